"""Calibration tables: measured efficiency of kernels and bandwidth of collectives on one device type.

A table is *data fitted from kernel-level measurements* (our own profiler, or imported public profiles);
it never contains end-to-end step times. Compute curves give achieved/peak efficiency against log10 of the
problem size (FLOPs for GEMMs and attention, bytes moved for memory-bound kernels). Collective curves give
the NCCL *bus bandwidth* (nccl-tests' ``busbw``) against log2 of the message size, for a group size and a
scope (``domain``: inside one fast-interconnect domain, NVLink/NVSwitch or one host's shared memory;
``network``, across that domain over NICs, is refused in a table: the cost model times the network part from the
cluster's NIC fields and reads no such curve). Lookups interpolate linearly in
those log coordinates and hold the end values flat outside the measured range, so a table never
extrapolates a trend it has not seen.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Any

from simulator.errors import SpecError
from simulator.specs._fields import MAX_COUNT, Fields
from simulator.units import GB, sig

__all__ = [
    "ATTENTION_CLASSES",
    "ATTENTION_CURVES",
    "ATTENTION_ROW_PREFIXES",
    "AXES",
    "BACKWARD_CLASSES",
    "CAUSAL",
    "COLLECTIVES",
    "COMPUTE_OPS",
    "MEMORY_CLASSES",
    "SCOPES",
    "STANDS_IN",
    "BandwidthCurve",
    "CalibrationTable",
    "EfficiencyCurve",
    "interp",
]

# Memory-bound kernels differ a lot in how well they use HBM (a fused residual add streams at ~85% of peak,
# a normalisation or an embedding gather far lower), so they get their own classes; ``memory`` is the
# generic curve used for anything else and as the fallback.
MEMORY_CLASSES = ("memory", "norm", "elementwise", "activation", "rope", "embedding")
# Attention curves per fused kernel (the plan's ``attention`` knob): ``attention`` is the device's own fused
# kernel, the fastest one measured on it (FlashAttention-3 on H100, FlashAttention-2 on A100);
# ``attention_fa2`` is FlashAttention-2 wherever it runs, which on Hopper cannot use the wgmma and TMA
# instructions and reaches 31-37% of peak against FlashAttention-3's 47-65% (Shah et al. 2024,
# arXiv:2407.08608, Sec. 4.1, head dim 128); ``attention_cudnn`` is cuDNN's fused attention (what Transformer
# Engine prefers on Hopper), measured in the same figures at 58-62% of peak forward (no mask, 1k-16k tokens).
# Measurement rows of FlashAttention-2 name their op ``flash2_...``, those of cuDNN ``cudnn_...``.
ATTENTION_CLASSES = {"flash": "attention", "flash2": "attention_fa2", "cudnn": "attention_cudnn"}
ATTENTION_ROW_PREFIXES = {"flash2_": "attention_fa2", "cudnn_": "attention_cudnn"}
# A causal mask is a curve of its own where it was measured (``<class>_causal``, from rows whose op names
# ``causal``): the kernel skips the masked blocks, so it executes half the FLOPs, but it still computes the
# diagonal blocks whole and its thread blocks get unequal work, so it reaches a lower fraction of peak than the
# same kernel without a mask at equal FLOPs (FlashAttention-3 on H100: 5-18% lower from 16k down to 1k tokens,
# Shah et al. 2024 Sec. 4.1, the same figures).
# Where no causal curve was measured, a causal op is timed on the kernel's curve without a mask.
CAUSAL = "_causal"
ATTENTION_CURVES = tuple(c + mask for c in ATTENTION_CLASSES.values() for mask in ("", CAUSAL))
# ``<class>_bwd`` curves describe backward passes where they were measured on their own (our profiler times
# scaled_dot_product_attention's and each memory-bound kernel's backward); without them the cost model
# uses the forward curve (for attention with the published backward/forward ratio).
BACKWARD_CLASSES = (
    *(f"{c}_bwd" for c in ATTENTION_CURVES),
    *(f"{c}_bwd" for c in MEMORY_CLASSES),
)
# The GEMMs of the backward pass run other operand layouts than the forward (x·Wᵀ): the activation gradient
# g·W (``gemm_dgrad``) and the weight gradient gᵀ·x (``gemm_wgrad``). Our profiler times each layout
# (``gemm.dgrad``/``gemm.wgrad`` rows); where a table has their curves they time those ops, else ``gemm`` does.
# They differ where the library handles a transposed operand less well: PyTorch's bf16 GEMM on this project's
# CI CPU (one thread, 1,024 tokens, hidden 1,024, MLP 4,096) took 5.5 ms forward, 5.9 ms dgrad and 10.7 ms
# wgrad (measured 2026-11-24, torch 2.13 CPU build); cuBLAS on GPUs picks its kernel per layout.
GEMM_BACKWARD_CLASSES = {"bwd_input": "gemm_dgrad", "bwd_weight": "gemm_wgrad"}
COMPUTE_OPS = ("gemm", *GEMM_BACKWARD_CLASSES.values(), *ATTENTION_CURVES, *MEMORY_CLASSES, *BACKWARD_CLASSES)
# A curve measured at one 16-bit precision times ops of the other: FP16 and BF16 tensor-core GEMMs and attention
# run at the same peak on every device we profile (datasheets: A100 312, H100 989 dense TFLOP/s for both).
STANDS_IN = {"bf16": "fp16", "fp16": "bf16"}
AXES = ("size", "ideal_seconds")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SCOPES = ("domain", "network")


def _logs(values: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(math.log(max(v, 1e-300)) for v in values)


def interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear interpolation, flat outside ``[xs[0], xs[-1]]``.

    >>> interp((0.0, 1.0), (10.0, 20.0), 0.25)
    12.5
    """
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_right(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _check_axis(f: Fields, key: str, xs: tuple[float, ...], ys: tuple[float, ...], ykey: str) -> None:
    # One point is enough: a lookup holds it flat (interp); none leaves nothing to look up.
    if not xs:
        raise f.error(
            key, "needs at least one measured point, got an empty list", f"give {key} and {ykey} one value per point"
        )
    if len(xs) != len(ys):
        raise f.error(ykey, f"must have as many values as {key}: {len(ys)} vs {len(xs)}", "give one value per point")
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise f.error(key, "must be strictly increasing", "sort the points and merge duplicates")


@dataclass(frozen=True, slots=True, kw_only=True)
class EfficiencyCurve:
    """Achieved fraction of peak against log10 of the problem size, for one op class and precision.

    With ``axis: size`` the x coordinate is log10 of FLOPs (gemm, attention) or bytes moved (memory), as
    measured on one device. With ``axis: ideal_seconds`` it is log10 of the time the op would take at the
    device's peak (size / peak): the form used for default curves that transfer between devices, since
    small kernels are limited by fixed launch and ramp-up latencies rather than by their size.
    """

    op: str
    precision: str
    log10_size: tuple[float, ...]
    efficiency: tuple[float, ...]
    axis: str = "size"
    samples: int = 0
    source: str = ""
    _log_efficiency: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_log_efficiency", _logs(self.efficiency))

    def at(self, size: float, peak: float = 1.0) -> float:
        """Efficiency at problem size ``size`` (FLOPs or bytes); ``peak`` converts for the ideal-seconds axis.

        Interpolated linearly in log efficiency against log size, so that time (size / efficiency) is
        piecewise linear in log-log and a stretch of constant measured time (a launch-bound kernel) stays
        constant between the points (calibration.fit.monotone_time).
        """
        x = size / peak if self.axis == "ideal_seconds" else size
        return math.exp(interp(self.log10_size, self._log_efficiency, math.log10(max(x, 1e-30))))

    @classmethod
    def from_fields(cls, f: Fields) -> EfficiencyCurve:
        """Build from one entry of ``compute:``."""
        xs = f.number_list("log10_size")
        ys = f.number_list("efficiency")
        _check_axis(f, "log10_size", xs, ys, "efficiency")
        for i, y in enumerate(ys):
            if not MIN_CURVE_EFFICIENCY <= y <= 1.0:
                raise f.error(
                    f"efficiency[{i}]",
                    f"must be in [{MIN_CURVE_EFFICIENCY:g}, 1], got {y}",
                    "efficiency is achieved / peak (a table's smallest measured one is 7e-4)",
                )
        spec = cls(
            op=f.choice("op", COMPUTE_OPS),
            precision=f.choice("precision", CURVE_PRECISIONS),
            log10_size=xs,
            efficiency=ys,
            axis=f.choice("axis", AXES, "size"),
            samples=f.integer("samples", 0, minimum=0),
            source=f.text("source", ""),
        )
        f.done()
        return spec


# Precisions a compute curve may be stated for ("any": memory-bound classes, which run at any precision).
CURVE_PRECISIONS = ("any", "fp32", "tf32", "fp16", "bf16", "fp8")


def _refuse_repeats(f: Fields, key: str, keys: list[tuple[object, ...]], what: str) -> None:
    for j, k in enumerate(keys):
        if k in keys[:j]:
            first = keys.index(k)
            raise f.error(
                f"{key}[{j}]",
                f"repeats the {what} of {key}[{first}] ({', '.join(map(str, k))})",
                "keep one curve per key (merge their points)",
            )


# The range of a realistic bus bandwidth or NVLink rate, in GB/s, also the cluster files' bounds for NVLink
# (hardware.PLAUSIBLE, which says why: 1 MB/s to 1 PB/s). Outside it a figure is a unit slip: a curve at 1e-310 GB/s
# (a denormal) made a step of NaN seconds, exit 0.
MIN_BUSBW_GB_PER_S, MAX_BUSBW_GB_PER_S = 1e-3, 1e6
# A curve's smallest messages are latency-bound and far slower: nccl-tests' 8-byte all-reduce over 8 GPUs takes about
# 18 us, a bus bandwidth of 8e-4 GB/s (it prints 0.00), which calibrate fit writes as measured. 1 KB/s is below any.
MIN_CURVE_BUSBW_GB_PER_S = 1e-6
# The lowest efficiency a curve may state: far below any measured kernel's (the shipped tables' smallest is 7e-4,
# a launch-bound norm on H100), and above the denormals that made times overflow.
MIN_CURVE_EFFICIENCY = 1e-6


def _bandwidth_or_zero(f: Fields, key: str, default: float | None = 0.0) -> float | None:
    """A bandwidth in GB/s within the realistic range; the default (0 or None: not stated) where left out."""
    value = f.number(key, default, minimum=0.0)
    if (
        value is not None
        and (value != 0.0 or default is None)
        and not MIN_BUSBW_GB_PER_S <= value <= MAX_BUSBW_GB_PER_S
    ):
        raise f.error(
            key,
            f"is not a realistic figure: {value:g} GB/s is outside {MIN_BUSBW_GB_PER_S:g} to {MAX_BUSBW_GB_PER_S:g}",
            "give the per-GPU NVLink bandwidth in GB/s",
        )
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class BandwidthCurve:
    """Achieved bus bandwidth of one collective against log2 of the message size.

    A curve with ``reference_bandwidth_bytes_per_s`` was measured on a fabric of that per-GPU bandwidth and is
    scaled by ``cluster bandwidth / reference`` when used on another cluster. Default tables give it per curve in
    the file; a measured table gives it for all its ``domain`` curves at once
    (``measured_nvlink_bandwidth_gb_per_s``), or else takes the NVLink rate of the cluster file that names it
    (:meth:`CalibrationTable.measured_on`).
    """

    collective: str
    scope: str
    ranks: int
    log2_bytes: tuple[float, ...]
    busbw_bytes_per_s: tuple[float, ...]
    samples: int = 0
    source: str = ""
    reference_bandwidth_bytes_per_s: float = 0.0
    _log_busbw: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_log_busbw", _logs(self.busbw_bytes_per_s))

    @property
    def peak_bytes_per_s(self) -> float:
        """The highest bus bandwidth measured: the fabric's rate once latency and protocol no longer show."""
        return max(self.busbw_bytes_per_s)

    def at(self, size_bytes: float) -> float:
        """Bus bandwidth (bytes/s) for a message of ``size_bytes``, interpolated in log bandwidth against log size
        (time stays monotone where the measured time is; see :meth:`EfficiencyCurve.at`)."""
        return math.exp(interp(self.log2_bytes, self._log_busbw, math.log2(max(size_bytes, 1.0))))

    @classmethod
    def from_fields(cls, f: Fields) -> BandwidthCurve:
        """Build from one entry of ``collectives:``."""
        xs = f.number_list("log2_bytes")
        ys = f.number_list("busbw_gb_per_s")
        _check_axis(f, "log2_bytes", xs, ys, "busbw_gb_per_s")
        for i, y in enumerate(ys):
            if not MIN_CURVE_BUSBW_GB_PER_S <= y <= MAX_BUSBW_GB_PER_S:
                raise f.error(
                    f"busbw_gb_per_s[{i}]",
                    f"is not a realistic bus bandwidth: {y:g} GB/s is outside {MIN_CURVE_BUSBW_GB_PER_S:g} to "
                    f"{MAX_BUSBW_GB_PER_S:g} GB/s",
                    "give the nccl-tests busbw in GB/s",
                )
        if f.choice("scope", SCOPES) == "network":
            # Measurement rows may be network-scoped (the importers label them), a table's curves may not: the cost
            # model never looks one up, and a curve accepted but unread would leave the answer silently unchanged.
            raise f.error(
                "scope",
                "network curves are not read: the part of a collective that crosses the network is timed from the "
                "cluster's NIC fields (communication.CommModel), and calibrate fit leaves network rows out",
                "remove the curve; to time a measured network, set the cluster's nic_bandwidth_gbit_per_s, "
                "nics_per_node and inter_node_latency_us from what it measured",
            )
        spec = cls(
            collective=f.choice("collective", COLLECTIVES),
            scope="domain",
            ranks=f.integer("ranks", minimum=2, maximum=MAX_COUNT),
            log2_bytes=xs,
            busbw_bytes_per_s=tuple(
                f.scaled(f"busbw_gb_per_s[{i}]", y, GB, "give the nccl-tests busbw in GB/s") for i, y in enumerate(ys)
            ),
            samples=f.integer("samples", 0, minimum=0),
            source=f.text("source", ""),
            reference_bandwidth_bytes_per_s=f.scaled(
                "reference_bandwidth_gb_per_s",
                _bandwidth_or_zero(f, "reference_bandwidth_gb_per_s"),
                GB,
                "give the per-GPU NVLink bandwidth the curve was measured on in GB/s",
            ),
        )
        f.done()
        return spec


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationTable:
    """Everything measured about one device type (and the node it sat in, for collectives)."""

    name: str
    device: str
    compute: tuple[EfficiencyCurve, ...] = ()
    collectives: tuple[BandwidthCurve, ...] = ()
    overlap_slowdown: float | None = None
    launch_overhead_s: float | None = None
    # Throughput of a large GEMM under minutes of back-to-back load over its throughput when profiled as every
    # kernel is (a short burst): the clock a GPU at its power limit settles at. None: not measured.
    sustained_gemm_ratio: float | None = None
    # NVLink bandwidth per GPU and direction of the fabric the ``domain`` collective curves were measured on (the
    # file's ``measured_nvlink_bandwidth_gb_per_s``): every cluster using the table scales those curves by its own
    # NVLink rate over this one. None: not recorded; the cluster file naming the table stands for that fabric.
    measured_nvlink_bandwidth_bytes_per_s: float | None = None
    provenance: tuple[tuple[str, str], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        measured = self.measured_nvlink_bandwidth_bytes_per_s
        if measured is not None:
            if isinstance(measured, bool) or not isinstance(measured, int | float) or not 0 < measured < math.inf:
                raise SpecError(
                    "measured_nvlink_bandwidth_bytes_per_s",
                    f"must be a finite number > 0, got {measured!r}",
                    "give the per-GPU, per-direction NVLink bandwidth of the measured system",
                )
            # Recorded on the curves, where CommModel reads it.
            object.__setattr__(self, "collectives", _referenced(self.collectives, float(measured)))

    def compute_curve(self, op: str, precision: str) -> EfficiencyCurve | None:
        """The curve for ``op`` at ``precision`` (FP16 and BF16 stand in for each other), or None."""
        fallback = STANDS_IN.get(precision)
        found = None
        for curve in self.compute:
            if curve.op != op:
                continue
            if curve.precision == precision:
                return curve
            if curve.precision in (fallback, "any"):
                found = curve
        return found

    def measured_on(self, nvlink_bandwidth_bytes_per_s: float) -> CalibrationTable:
        """A copy whose NVLink-domain curves without a reference record that they were measured on a fabric
        of ``nvlink_bandwidth_bytes_per_s`` per GPU, so that a cluster with another NVLink rate scales them.

        The library passes the rate of the cluster file that names the table: the fallback for a table that does
        not record its own (``measured_nvlink_bandwidth_bytes_per_s``, already on its curves, which this keeps).
        """
        curves = _referenced(self.collectives, nvlink_bandwidth_bytes_per_s)
        # Unchanged (every domain curve records its fabric): the table itself, so a shipped cluster holds the
        # very table load_calibration returns.
        return self if curves == self.collectives else replace(self, collectives=curves)

    def bandwidth_curve(self, collective: str, scope: str, ranks: int) -> BandwidthCurve | None:
        """The measured curve for this collective and scope whose group size is nearest ``ranks``."""
        best: BandwidthCurve | None = None
        for curve in self.collectives:
            if curve.collective != collective or curve.scope != scope:
                continue
            if best is None or abs(math.log2(curve.ranks / ranks)) < abs(math.log2(best.ranks / ranks)):
                best = curve
        return best

    @classmethod
    def from_mapping(cls, data: Any, where: str) -> CalibrationTable:
        """Build from a parsed calibration file."""
        f = Fields(data, where)
        compute_raw = f.raw("compute", [])
        coll_raw = f.raw("collectives", [])
        if not isinstance(compute_raw, list):
            raise f.error("compute", "must be a list of curves", "write '- op: gemm ...' entries")
        if not isinstance(coll_raw, list):
            raise f.error("collectives", "must be a list of curves", "write '- collective: all_reduce ...' entries")
        compute = tuple(
            EfficiencyCurve.from_fields(Fields(c, where, f"compute[{i}]")) for i, c in enumerate(compute_raw)
        )
        colls = tuple(BandwidthCurve.from_fields(Fields(c, where, f"collectives[{i}]")) for i, c in enumerate(coll_raw))
        # Lookups take the first curve of a key, so a second one would be ignored or, reordered, win: refuse it.
        _refuse_repeats(f, "compute", [(c.op, c.precision) for c in compute], "op and precision")
        _refuse_repeats(
            f, "collectives", [(c.collective, c.scope, c.ranks) for c in colls], "collective, scope and ranks"
        )
        prov_f = f.sub("provenance", None)
        provenance: tuple[tuple[str, str], ...] = ()
        if prov_f is not None:
            provenance = tuple((str(k), str(v)) for k, v in prov_f.data.items())
            prov_f.used.update(prov_f.data)
        spec = cls(
            name=f.text("name"),
            device=f.text("device"),
            compute=compute,
            collectives=colls,
            overlap_slowdown=f.number("overlap_slowdown", None, minimum=0.0, maximum=1.0),
            # At most a second per operator: kernel launches take microseconds; 1e20 µs made a step of 1e18 s.
            launch_overhead_s=_us(f.number("launch_overhead_us", None, minimum=0.0, maximum=1e6)),
            # Sustained over burst speed: a GPU kept busy cannot beat its burst speed (above 1, a GEMM could pass peak).
            # Below a tenth, a GPU is broken rather than throttled (H100's sustained GEMMs run at 0.8-0.95 of burst).
            sustained_gemm_ratio=f.number("sustained_gemm_ratio", None, minimum=0.1, maximum=1.0),
            measured_nvlink_bandwidth_bytes_per_s=f.scaled(
                "measured_nvlink_bandwidth_gb_per_s",
                _bandwidth_or_zero(f, "measured_nvlink_bandwidth_gb_per_s", None),
                GB,
                "give the NVLink bandwidth per GPU and direction of the measured system in GB/s (450 for DGX H100)",
            ),
            provenance=provenance,
            source=f.text("source", ""),
        )
        f.done(ignore=("description",))
        if not compute and not colls:
            raise SpecError(where, "has neither compute nor collectives curves", "add at least one curve")
        return spec

    def to_mapping(self) -> dict[str, Any]:
        """The YAML form (inverse of :meth:`from_mapping`); numbers rounded to stable decimals."""
        out: dict[str, Any] = {"name": self.name, "device": self.device}
        if self.source:
            out["source"] = self.source
        if self.provenance:
            out["provenance"] = dict(self.provenance)
        if self.overlap_slowdown is not None:
            out["overlap_slowdown"] = round(self.overlap_slowdown, 4)
        if self.launch_overhead_s is not None:
            out["launch_overhead_us"] = round(self.launch_overhead_s * 1e6, 3)
        if self.sustained_gemm_ratio is not None:
            out["sustained_gemm_ratio"] = round(self.sustained_gemm_ratio, 4)
        measured = self.measured_nvlink_bandwidth_bytes_per_s
        if measured is not None:
            out["measured_nvlink_bandwidth_gb_per_s"] = round(measured / GB, 3)
        out["compute"] = [
            {
                "op": c.op,
                "precision": c.precision,
                "axis": c.axis,
                "samples": c.samples,
                "source": c.source,
                "log10_size": [round(x, 4) for x in c.log10_size],
                "efficiency": [sig(y) for y in c.efficiency],
            }
            for c in self.compute
        ]
        out["collectives"] = [_curve_mapping(b, measured) for b in self.collectives]
        return out


def _referenced(curves: tuple[BandwidthCurve, ...], reference: float) -> tuple[BandwidthCurve, ...]:
    """``curves`` with ``reference`` as the fabric bandwidth of each ``domain`` curve that records none."""
    return tuple(
        replace(c, reference_bandwidth_bytes_per_s=reference)
        if c.scope == "domain" and not c.reference_bandwidth_bytes_per_s
        else c
        for c in curves
    )


def _us(value: float | None) -> float | None:
    return None if value is None else value * 1e-6


def _curve_mapping(b: BandwidthCurve, measured: float | None = None) -> dict[str, Any]:
    """One curve's YAML form; a reference equal to the table's ``measured`` fabric is left to the table's key."""
    out: dict[str, Any] = {
        "collective": b.collective,
        "scope": b.scope,
        "ranks": b.ranks,
        "samples": b.samples,
        "source": b.source,
    }
    if b.reference_bandwidth_bytes_per_s and b.reference_bandwidth_bytes_per_s != measured:
        out["reference_bandwidth_gb_per_s"] = round(b.reference_bandwidth_bytes_per_s / GB, 3)
    out["log2_bytes"] = [round(x, 4) for x in b.log2_bytes]
    out["busbw_gb_per_s"] = [sig(y / GB) for y in b.busbw_bytes_per_s]
    return out
