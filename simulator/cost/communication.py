"""Communication cost: how long one collective of one rank takes on the cluster.

Ring-algorithm costs (Design: Physics, Collectives; Thakur et al. 2005; nccl-tests PERFORMANCE.md):
for a group of n ranks and a buffer of S bytes, ``time = factor(n) · S / busbw + latency`` with factor
2(n−1)/n for all-reduce, (n−1)/n for all-gather, reduce-scatter and all-to-all, 1 for send/recv.
``busbw`` is the *bus bandwidth actually achieved* at that message size:

* inside one NVLink domain, the measured curve of the cluster's calibration table for the collective and
  the nearest group size (it already contains latency, so none is added), or of its ``fabric_calibration``
  table (measured on an identical NVLink fabric) where its own has none; without either, the NVLink
  bandwidth times the default efficiency curve of the default table. On a direct mesh (``nvlink_topology:
  mesh``) a group of k GPUs uses k − 1 of the n − 1 peer links, so it gets that fraction of the bandwidth;
* across domains, the network: each member brings its share of the node's NICs
  (``nics · nic_bandwidth / gpus_per_node``), so a ring with k members per node reaches k times that
  share, divided by the topology's oversubscription, times the achieved fraction of line rate
  :data:`NETWORK_EFFICIENCY`; the slower of the two tiers dominates, and the latency is NCCL's tuning model's:
  steps inside a domain at the NVLink latency, steps between domains at the network's.

All-to-all sends (k−1)/n of its data over NVLink and (n−k)/n over the network, each at its own rate.

Where the cluster has in-switch reduction (NVLink SHARP, ``nvls``), NCCL runs all-reduce inside the domain
with the NVLS algorithm, whose bus bandwidth beats the ring's by :data:`NVLS_GAIN` (by the number of members in
the domain). The measured curves of the shipped tables are ring all-reduce (Vidur's DGX H100 peak is 328 GB/s,
below the ~370 GB/s NCCL's ring reaches on H100 NVLink, so NVLS was off when they were taken), and so is the
default curve derived from them; the gain is applied on top of them, to what their time exceeds the smallest
message's (NCCL runs NVLS with its Simple protocol, never for the small, latency-bound messages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from simulator.cost.compute import COST_CACHE_MAX
from simulator.parallel.layout import Group
from simulator.parallel.program import Comm
from simulator.specs.calibration import BandwidthCurve, CalibrationTable
from simulator.specs.hardware import ClusterSpec

__all__ = ["NETWORK_EFFICIENCY", "NVLINK_FALLBACK_EFFICIENCY", "NVLS_GAIN", "CommModel", "bus_factor"]

# Achieved fraction of InfiniBand/RoCE line rate for large NCCL collectives across nodes: 24 of 25 GB/s per
# HDR 200 Gb/s NIC (NCCL maintainer, NVIDIA/nccl issue #412) and 48-49 of 50 GB/s per NDR 400 Gb/s NIC
# (NVIDIA, NVIDIA/nccl-tests issue #267): 0.96.
NETWORK_EFFICIENCY = 0.96
# NVLink bus bandwidth fraction for large messages when no curve exists at all (default table absent): an
# 8-GPU all-reduce of 1 GiB on DGX A100 reaches 229 GB/s of 300 GB/s (data/calibration/vtrain/
# a100_all_reduce_8gpu.txt).
NVLINK_FALLBACK_EFFICIENCY = 0.76
# NVLS over ring all-reduce bus bandwidth inside one NVSwitch domain, by group members in the domain: 480 GB/s
# (NVLS) vs 370 GB/s (ring) on 8 H100s, i.e. +30% (NCCL maintainer, NVIDIA/nccl-tests issue #212 and
# NVIDIA/nccl issue #1442); with 5, 6 and 7 GPUs 420, 440 and 460 GB/s, and no gain up to 4 GPUs (8x H100 SXM
# measurements, NVIDIA/nccl issue #1455). Larger domains (NVL72) and Blackwell keep the 8-GPU H100 gain: an
# extrapolation, since no NVLS measurement of those is in this project (a review pointed at NVIDIA/nccl issue #2140,
# 8x B300 at 695 GB/s ring against 845 GB/s NVLS, 1.22, which we have not been able to check). Such devices' all-
# reduces run on the default curves, which their results list as uncalibrated.
NVLS_GAIN = {5: 420 / 370, 6: 440 / 370, 7: 460 / 370, 8: 480 / 370}


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: time = factor · size / busbw.

    >>> bus_factor("all_reduce", 8)
    1.75
    """
    if collective == "send_recv":
        return 1.0
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


@dataclass
class CommModel:
    """Collective durations on one cluster, cached per (collective, group, size)."""

    cluster: ClusterSpec
    table: CalibrationTable | None
    default: CalibrationTable | None
    straggler_factor: float = 1.0
    # Per collective: the seconds and the uncalibrated labels timing it raised (see ComputeModel._cache).
    _cache: dict[tuple[object, ...], tuple[float, frozenset[str]]] = field(default_factory=dict, repr=False)
    uncalibrated: set[str] = field(default_factory=set, repr=False)

    def time(self, comm: Comm) -> float:
        """Seconds for ``comm`` on its group."""
        key = (comm.collective, comm.group, comm.size_bytes, comm.kind)
        cached = self._cache.get(key)
        if cached is None:
            outer, self.uncalibrated = self.uncalibrated, set()
            try:
                seconds = self._time(comm.collective, comm.group, comm.size_bytes)
            finally:
                labels, self.uncalibrated = frozenset(self.uncalibrated), outer
            if comm.kind == "dp":
                # Data-parallel collectives wait for the slowest replica (Design: stragglers).
                seconds *= self.straggler_factor
            cached = (seconds, labels)
            if len(self._cache) >= COST_CACHE_MAX:
                self._cache.clear()  # bounded like ComputeModel's per-shape cache
            self._cache[key] = cached
        if cached[1]:
            self.uncalibrated.update(cached[1])
        return cached[0]

    def _domain_curve(self, collective: str, ranks: int) -> tuple[BandwidthCurve | None, float, bool]:
        """A measured (or default) NVLink-domain curve, the factor that scales it to this cluster, and whether it
        was measured (on this cluster's fabric)."""
        # The cluster's own table first, then one measured on an identical NVLink fabric (ClusterSpec).
        for table in (self.table, self.cluster.fabric_calibration):
            if table is None:
                continue
            curve = table.bandwidth_curve(collective, "domain", ranks)
            if curve is None and collective in ("all_gather", "reduce_scatter", "all_to_all"):
                # Same ring traffic pattern as half an all-reduce (nccl-tests PERFORMANCE.md): measured on this fabric,
                # but for another collective, which the result says (an all-to-all is not a ring).
                curve = table.bandwidth_curve("all_reduce", "domain", ranks)
                if curve is not None:
                    self.uncalibrated.add(f"{collective}:domain:all_reduce_curve")
            if curve is not None:
                ref = curve.reference_bandwidth_bytes_per_s  # set when a what-if changed the measured fabric
                return curve, (self.cluster.nvlink_bandwidth_bytes_per_s / ref if ref else 1.0), True
        self.uncalibrated.add(f"{collective}:domain")
        if self.default is not None:
            curve = self.default.bandwidth_curve(collective, "domain", ranks) or self.default.bandwidth_curve(
                "all_reduce", "domain", ranks
            )
            if curve is not None and curve.reference_bandwidth_bytes_per_s:
                scale = self.cluster.nvlink_bandwidth_bytes_per_s / curve.reference_bandwidth_bytes_per_s
                return curve, scale, False
        return None, 1.0, False

    def _domain_busbw(self, collective: str, ranks: int, size: float) -> float:
        bw, scale, _, _, _ = self._domain_rate(collective, ranks, size)
        return bw * scale

    def _domain_rate(self, collective: str, ranks: int, size: float) -> tuple[float, float, float, bool, float]:
        """(bus bandwidth at ``size`` on the fabric the curve was measured on, the factor that scales only its
        *bandwidth* part to this cluster (another fabric's NVLink bandwidth, NVLS, a mesh's share of links), the
        smallest message it measured (0 without a curve), whether it was measured on this cluster's fabric, and the
        curve's highest bus bandwidth: the fabric's rate once latency and protocol no longer show). The
        default curves are stated on a fabric of their sources' median NVLink bandwidth (fit.default_table)."""
        curve, scale, measured = self._domain_curve(collective, ranks)
        if collective == "all_reduce" and self.cluster.nvls and ranks > 4:
            scale *= NVLS_GAIN.get(ranks, NVLS_GAIN[8])
            if measured:  # the NVLS gain is NCCL's maintainers' figure, not part of the measured (ring) curve
                self.uncalibrated.add("all_reduce:domain:nvls_gain")
        if self.cluster.nvlink_topology == "mesh":
            # Direct peer links: a group of k reaches its peers over k - 1 of the domain's n - 1 links, and a
            # point-to-point transfer (a pipeline hop, a context-parallel ring step) over the one link to its peer.
            # (At least one link: a one-GPU domain still bounds a collective leaving it by a two-rank one.)
            links = 1 if collective == "send_recv" else max(1, min(ranks - 1, self.cluster.nvlink_domain_gpus - 1))
            scale *= links / max(self.cluster.nvlink_domain_gpus - 1, 1)
        if curve is None:
            bw = self.cluster.nvlink_bandwidth_bytes_per_s * NVLINK_FALLBACK_EFFICIENCY
            return bw, scale, 0.0, measured, bw
        return curve.at(size), scale, 2.0 ** curve.log2_bytes[0], measured, curve.peak_bytes_per_s

    def _network_busbw(self, per_domain: int) -> float:
        c = self.cluster
        share = c.nic_bandwidth_per_gpu_bytes_per_s
        return per_domain * share * NETWORK_EFFICIENCY / c.oversubscription

    def _time(self, collective: str, group: Group, size: float) -> float:
        n = group.size
        if n <= 1 or size <= 0:
            return 0.0
        c = self.cluster
        if not group.crosses_network:
            return self._domain_time(collective, n, size)
        self.uncalibrated.add(f"{collective}:network")
        # A collective that leaves the node does everything one inside it does (launch, handshakes, NVLink hops
        # where it has several ranks per node) and crosses the network besides: it is never faster than the same
        # collective inside one NVLink domain (measured there, while the network part below is modelled).
        inside = self._domain_time(collective, min(n, max(c.nvlink_domain_gpus, 2)), size)
        return max(inside, self._network_time(collective, group, size))

    def _domain_time(self, collective: str, n: int, size: float) -> float:
        """Seconds for ``collective`` of ``size`` bytes over ``n`` ranks inside one NVLink domain."""
        busbw, scale, smallest, measured, peak = self._domain_rate(collective, n, size)
        factor = bus_factor(collective, n)
        # Below the smallest message the curve measured, a collective takes as long as that message: small
        # ones are latency-bound (Vidur's 8-GPU DGX H100 all-reduce takes 20-38 us from 2 KiB to 90 KiB,
        # data/calibration/vidur/network/h100_dgx/all_reduce.csv), where a flat bandwidth would make a
        # 2 KiB one take 0.5 us.
        t = factor * max(size, smallest) / busbw
        if scale > 1.0:
            # NVLS or a faster what-if fabric: what the curve takes beyond its smallest message's time (all latency,
            # which NCCL's tuning model keeps apart from the bandwidth, src/graph/tuning.cc; NVLS runs the Simple
            # protocol only, never for small messages) shrinks with the bandwidth, the latency stays. (Scaling only
            # the transfer at the curve's top rate, as below, would make the time fall with the size where the
            # measured bandwidth climbs steeply, 256 KiB to 1 MiB on DGX H100.)
            latency = factor * smallest / self._domain_rate(collective, n, smallest)[0] if smallest > 0 else 0.0
            t = latency + (t - latency) / scale
        elif scale < 1.0:
            # A mesh's share of links or a slower what-if fabric: the message's transfer at the fabric's full rate
            # (the curve's highest bus bandwidth) takes 1/scale as long; the rest of the measured time, latency and
            # protocol overheads, stays. Scaling all of the time beyond the smallest message had multiplied a latency
            # step of the curve (a protocol switch near 200 KiB) by 1/scale too: a 2-rank all-reduce of 256 KiB
            # on DGX V100's mesh took 186 us (found by a review of the communication model).
            t += factor * size / peak * (1.0 / scale - 1.0)
        if not measured:
            # A default curve's small messages were measured on other fabrics: the cluster's own per-step NVLink
            # latency bounds the time from below (curves measured on this fabric carry their own).
            t = max(t, _steps(collective, n) * self.cluster.intra_node_latency_s)
        return t

    def _network_time(self, collective: str, group: Group, size: float) -> float:
        n = group.size
        c = self.cluster
        k = group.per_domain
        fewest = group.fewest_per_domain  # the domain with the fewest members paces what crosses the network
        lat = c.inter_node_latency_s
        if collective == "send_recv":
            return size / (c.nic_bandwidth_per_gpu_bytes_per_s * NETWORK_EFFICIENCY / c.oversubscription) + lat
        if collective == "all_to_all":
            # The rank whose domain holds the fewest members sends the most over its NIC share.
            nv = (k - 1) / n * size / self._domain_busbw("all_to_all", max(k, 2), size) if k > 1 else 0.0
            net_bw = c.nic_bandwidth_per_gpu_bytes_per_s * NETWORK_EFFICIENCY / c.oversubscription
            return max(nv, (n - fewest) / n * size / net_bw) + (n - 1) * lat
        busbw = self._network_busbw(fewest)
        if k > 1:
            busbw = min(busbw, self._domain_busbw(collective, k, size))
        return bus_factor(collective, n) * size / busbw + _network_latency(
            collective, n, k, c.intra_node_latency_s, lat
        )


def _network_latency(collective: str, n: int, k: int, intra: float, inter: float) -> float:
    """Latency of ``collective`` over ``n`` ranks, ``k`` in each NVLink domain, spanning ``ceil(n / k)`` of them, as
    NCCL's tuning model counts it (src/graph/tuning.cc): a ring's steps between members of one domain take the
    NVLink latency and only those between domains the network's (ring all-gather and reduce-scatter: n − 1 steps,
    of which nodes − 1 cross; ring all-reduce twice both); a double-binary-tree all-reduce (NCCL 2.4; Sanders et
    al. 2009) takes 2 · ((k − 1) NVLink + log2(nodes) network steps); NCCL picks the faster, here the one with the
    smaller latency. All-to-all keeps n − 1 network steps."""
    if collective == "all_to_all":
        return (n - 1) * inter
    nodes = max(1, -(-n // max(k, 1)))
    if collective == "all_reduce":
        ring = 2 * (n - nodes) * intra + 2 * (nodes - 1) * inter
        tree = 2 * ((k - 1) * intra + math.ceil(math.log2(nodes)) * inter)
        return min(ring, tree)
    return (n - nodes) * intra + (nodes - 1) * inter


def _steps(collective: str, n: int) -> int:
    """Latency-bound steps of ``collective`` over ``n`` ranks inside one NVLink domain, for the lower bound of
    default curves (:meth:`CommModel._domain_time`): one for a point-to-point transfer, n − 1 for a ring (all-gather,
    reduce-scatter, all-to-all), and for all-reduce the fewer of a ring's 2(n − 1) and 4·log2(n); the 4 puts the
    bound at 12 steps for 8 GPUs, 36 us at 3 us a step, where Vidur measured 20-38 us for a small 8-GPU all-reduce on
    DGX H100 (data/calibration/vidur/network/h100_dgx/all_reduce.csv). Across nodes see :func:`_network_latency`."""
    if collective == "send_recv":
        return 1
    if collective == "all_reduce":
        return min(2 * (n - 1), 4 * math.ceil(math.log2(n)))
    return n - 1
