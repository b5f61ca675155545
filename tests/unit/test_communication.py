"""Collective costs: NVLink SHARP (NVLS) all-reduce and the network tier (issue 3: NVLS where present)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from simulator.cost.communication import NETWORK_EFFICIENCY, NVLS_GAIN, CommModel, bus_factor
from simulator.parallel.layout import place
from simulator.parallel.program import Comm
from simulator.specs.hardware import ClusterSpec
from simulator.specs.library import load_calibration, load_cluster

SIZE = 256 * 2**20


def _time(cluster_name: str, collective: str, ranks: int, *, nvls: bool, stride: int = 1) -> float:
    cluster = replace(load_cluster(cluster_name), nvls=nvls)
    comm = CommModel(cluster, cluster.calibration, load_calibration("default"))
    group = place("g", ranks, stride, cluster)
    return comm.time(Comm("c", collective, group, SIZE, "tp"))


def test_nvls_speeds_up_an_eight_gpu_all_reduce_by_the_measured_ratio() -> None:
    ring = _time("dgx-h100", "all_reduce", 8, nvls=False)
    nvls = _time("dgx-h100", "all_reduce", 8, nvls=True)
    # The gain divides what the time exceeds the smallest measured message's (latency, kept): at 256 MiB almost all.
    assert ring / nvls == pytest.approx(NVLS_GAIN[8], rel=0.01)
    assert ring / nvls < NVLS_GAIN[8]
    assert NVLS_GAIN[8] == pytest.approx(480 / 370)


@pytest.mark.parametrize("ranks", [2, 4])
def test_nvls_gives_nothing_to_small_groups(ranks: int) -> None:
    assert _time("dgx-h100", "all_reduce", ranks, nvls=True) == _time("dgx-h100", "all_reduce", ranks, nvls=False)


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather", "all_to_all"])
def test_nvls_only_accelerates_all_reduce(collective: str) -> None:
    assert _time("dgx-h100", collective, 8, nvls=True) == _time("dgx-h100", collective, 8, nvls=False)


def test_the_default_table_gets_the_gain_too() -> None:
    """dgx-b200 has no measured table: its default (ring) curve is scaled by the same NVLS gain."""
    ring = _time("dgx-b200", "all_reduce", 8, nvls=False)
    assert ring / _time("dgx-b200", "all_reduce", 8, nvls=True) == pytest.approx(NVLS_GAIN[8], rel=0.02)


@pytest.mark.parametrize(("collective", "ranks"), [("all_reduce", 8), ("all_reduce", 2), ("reduce_scatter", 4)])
def test_a_cluster_on_the_measured_fabric_uses_its_curves(collective: str, ranks: int) -> None:
    """hgx-h200's own table measured kernels on one GPU, no collective, and its fabric is DGX H100's NVLink 4 /
    NVSwitch: NVLink collectives take the DGX H100 measurements (same times), are not reported uncalibrated, and
    the default curve differs."""
    h200 = load_cluster("hgx-h200")
    assert h200.calibration is not None
    assert h200.calibration.compute
    assert not h200.calibration.collectives
    assert h200.fabric_calibration is not None
    comm = CommModel(h200, h200.calibration, load_calibration("default"))
    got = comm.time(Comm("c", collective, place("g", ranks, 1, h200), SIZE, "tp"))
    assert got == pytest.approx(_time("dgx-h100", collective, ranks, nvls=True))
    assert not any(label.endswith(":domain") for label in comm.uncalibrated)
    bare = CommModel(replace(h200, fabric_calibration=None), None, load_calibration("default"))
    assert bare.time(Comm("c", collective, place("g", ranks, 1, h200), SIZE, "tp")) != pytest.approx(got)


def test_dgx_a100_40g_shares_the_dgx_a100_fabric_measurements() -> None:
    """The 40 GB DGX A100 has the 80 GB system's NVLink 3 / NVSwitch: same measured all-reduce time."""
    a40 = load_cluster("dgx-a100-40g")
    comm = CommModel(a40, a40.calibration, load_calibration("default"))
    got = comm.time(Comm("c", "all_reduce", place("g", 8, 1, a40), SIZE, "tp"))
    assert got == pytest.approx(_time("dgx-a100-80g", "all_reduce", 8, nvls=False))


def test_an_nvlink_what_if_scales_the_fabric_curves() -> None:
    """The fabric table records the NVLink rate it was measured on, so doubling it halves a large all-gather."""
    base = load_cluster("hgx-h200")
    fast = load_cluster("hgx-h200", {"nvlink_bandwidth_gb_per_s": 900})
    times = []
    for cluster in (base, fast):
        comm = CommModel(cluster, None, load_calibration("default"))
        times.append(comm.time(Comm("c", "all_gather", place("g", 8, 1, cluster), SIZE, "tp")))
    assert times[0] / times[1] == pytest.approx(2.0, rel=0.02)  # the measured latency stays


def test_network_ring_is_paced_by_the_nics_at_the_achieved_fraction_of_line_rate() -> None:
    """A 2-node ring with one member per node (stride 8): each GPU's NIC share at 96% of line rate."""
    cluster = load_cluster("dgx-h100")
    t = _time("dgx-h100", "all_gather", 2, nvls=True, stride=8)
    expected = 0.5 * SIZE / (cluster.nic_bandwidth_per_gpu_bytes_per_s * NETWORK_EFFICIENCY) + 1 * (
        cluster.inter_node_latency_s
    )
    assert t == pytest.approx(expected)


def test_small_collectives_take_as_long_as_the_smallest_measured_message() -> None:
    """Below the smallest message a curve measured, time stops falling (small collectives are latency-bound):
    an 8-GPU DGX H100 all-reduce of 2 KiB lands among Vidur's measured 2-90 KiB times, not at 0.5 us."""
    import csv
    from pathlib import Path

    path = Path(__file__).parents[2] / "data/calibration/vidur/network/h100_dgx/all_reduce.csv"
    with path.open() as f:
        measured = [
            float(r["time_stats.all_reduce.median"]) * 1e-3
            for r in csv.DictReader(f)
            if r["num_workers"] == "8" and int(r["size"]) <= 92160
        ]
    cluster = replace(load_cluster("dgx-h100"), nvls=False)
    comm = CommModel(cluster, cluster.calibration, load_calibration("default"))
    group = place("tp", 8, 1, cluster)
    times = [comm.time(Comm("c", "all_reduce", group, float(size), "tp")) for size in (2048, 8192, 65536, 2**20)]
    assert min(measured) <= times[0] <= max(measured)
    assert times[0] == times[1] <= times[2] < times[3]


def test_pipeline_hops_inside_a_node_use_nvlink_when_others_cross_the_network() -> None:
    """tp 2 · pp 8 on 8-GPU nodes puts four stages on each node: hops 3 and 7 leave the node, the other six
    go over NVLink and take what a pipeline that never leaves the node takes."""
    from simulator.run import _prepare
    from simulator.specs.library import load_model
    from simulator.specs.plan import PlanSpec

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    knobs = {"dp": 1, "vp": 1, "global_batch": 64, "micro_batch": 1, "recompute": "selective", "grad_overlap": True}
    wide = _prepare(model, cluster, PlanSpec(tp=2, pp=8, **knobs), False, {}).pipe  # type: ignore[arg-type,union-attr]
    one_node = _prepare(model, cluster, PlanSpec(tp=2, pp=4, **knobs), False, {}).pipe  # type: ignore[arg-type,union-attr]
    assert wide.hop_network == (False, False, False, True) * 2
    inside = {t for t, crosses in zip(wide.send_fwd_s, wide.hop_network, strict=True) if not crosses}
    across = {t for t, crosses in zip(wide.send_fwd_s, wide.hop_network, strict=True) if crosses}
    assert inside == set(one_node.send_fwd_s)
    assert len(across) == 1
    assert across.pop() > 3 * inside.pop()
    assert wide.send_bwd_s == wide.send_fwd_s


def test_the_interleaved_wrap_hop_leaves_the_node_when_pp_is_not_a_multiple_of_the_stages_per_node() -> None:
    """tp 2 · pp 6 on 8-GPU nodes: stages 0-3 on the first node, 4 and 5 on the second. Hop 3 -> 4 and the wrap
    5 -> 0 (interleaving's last chunk to the next chunk on stage 0) leave the node; the wrap used to be
    classified by (s + 1) mod 4 and went over NVLink."""
    from simulator.run import _hops_on_network

    cluster = load_cluster("dgx-h100")
    assert _hops_on_network(place("pp", 6, 2, cluster), 8) == (False, False, False, True, False, True)
    assert _hops_on_network(place("pp", 8, 2, cluster), 8) == (False, False, False, True) * 2
    assert _hops_on_network(place("pp", 4, 2, cluster), 8) == (False,) * 4
    # 16-GPU stages in 72-GPU NVL72 racks: stage 4 (ranks 64-79) straddles racks 0 and 1, so hops 3 -> 4 and 4 -> 5
    # leave the rack; 8 x 16 = 128 ranks span two racks, so the wrap does too.
    assert _hops_on_network(place("pp", 8, 16, cluster), 72) == (False, False, False, True, True, False, False, True)


def test_groups_that_straddle_a_domain_boundary_are_placed_across_it() -> None:
    """Found by a review: a group was taken to start at a domain's first rank. On 72-GPU NVL72 racks expert groups of
    16 at ranks 64-79 sit 8 and 8 in two racks, and tp 6 on 8-GPU nodes puts ranks 6-11 on two nodes; both were
    placed in one domain (a 576-GPU Qwen3-235B plan ran its all-to-alls over NVLink: 2.2 s per step instead of about
    5 s). Only the first pipeline stage's groups were looked at, too: with 128-GPU stages the second starts 56 ranks
    into a rack, and a data-parallel group of 16 at stride 8 has one member in one of its racks there."""
    nvl72, a100 = load_cluster("gb200-nvl72"), load_cluster("dgx-a100-80g")
    packed = replace(nvl72, domain_allocation="packed")  # racks filled in rank order
    ep = place("ep", 16, 1, nvl72, world=576)  # 144 trays: segments of 18, whole racks
    assert (ep.per_domain, ep.domains, ep.fewest_per_domain) == (8, 2, 8)
    assert place("ep", 16, 1, nvl72).domains == 1  # the first block alone (ranks 0-15) fits one rack
    tp6 = place("tp", 6, 1, a100, world=768)
    assert (tp6.per_domain, tp6.domains, tp6.fewest_per_domain) == (4, 2, 2)
    assert place("dp", 16, 8, packed, world=128).fewest_per_domain == 7  # one stage: racks of 9 and 7
    assert place("dp", 16, 8, packed, world=512).fewest_per_domain == 1  # four stages: ranks 128... start mid-rack
    assert place("tp", 8, 1, nvl72, world=576).domains == 1  # 8 divides 72: no group straddles
    assert place("tp", 8, 1, a100, world=4096) == place("tp", 8, 1, a100)


def test_a_job_on_nvl72_racks_sits_in_equal_segments_as_megatron_bridge_launches_it() -> None:
    """Megatron-Bridge's launcher asks Slurm for segments of the most trays a rack holds that divide the job's tray
    count (scripts/performance/utils/executors.py): 256 GPUs are 4 racks of 64, so expert groups of 32 never leave a
    rack. Packed into 72, 72, 72 and 40, the group at ranks 64-95 would run 8 and 24 across two racks; its
    Qwen3-235B runs on 256 GB200s (Megatron-Bridge's tables) were then timed 2.7x slow."""
    nvl72 = load_cluster("gb200-nvl72")
    assert [nvl72.job_domain_gpus(n) for n in (8, 72, 76, 256, 512, 576, 1024)] == [8, 72, 4, 64, 64, 72, 64]
    assert not place("ep", 32, 1, nvl72, world=256).crosses_network
    assert place("ep", 32, 1, replace(nvl72, domain_allocation="packed"), world=256).fewest_per_domain == 8
    assert load_cluster("dgx-h100").job_domain_gpus(1024) == 8  # one-node domains: the node


def test_a_resolved_layout_places_its_groups_over_the_whole_job() -> None:
    """resolve_layout passes the job's size, so every stage's groups are placed (the expert groups of a 576-GPU
    NVL72 plan cross racks)."""
    from simulator.parallel.layout import resolve_layout
    from simulator.specs import load_model
    from simulator.specs.plan import PlanSpec

    plan = PlanSpec(
        tp=1, pp=4, dp=144, ep=16, global_batch=2304, micro_batch=1, sequence_parallel=False, vp=1, recompute="full"
    ).with_(grad_overlap=True)
    layout = resolve_layout(load_model("qwen3-235b-a22b"), load_cluster("gb200-nvl72"), plan)
    assert layout.ep.crosses_network
    assert layout.ep.fewest_per_domain == 8


@pytest.mark.parametrize(("ranks", "links"), [(2, 1), (4, 3), (8, 7)])
def test_a_direct_mesh_gives_a_group_only_its_peer_links(ranks: int, links: int) -> None:
    """MI300X's Infinity Fabric is a full mesh of 7 links of 64 GB/s per GPU: a pair shares one link, 8 GPUs use
    all 7, so a group of k gets (k - 1)/7 of the all-links bandwidth an NVSwitch would give any group: the time to
    move the bytes grows by 7/(k - 1), the latency of a small message does not (it had grown with it: a 2-rank
    all-reduce of 1 KiB took 170 us)."""
    mesh = load_cluster("mi300x-8")
    assert mesh.nvlink_topology == "mesh"
    switch = replace(mesh, nvlink_topology="switch")
    group = place("tp", ranks, 1, mesh)

    def seconds(cluster: ClusterSpec, size: float = SIZE) -> float:
        return CommModel(cluster, cluster.calibration, load_calibration("default")).time(
            Comm("c", "all_reduce", group, size, "tp")
        )

    big = 2.0**30
    assert seconds(mesh, big) / seconds(switch, big) == pytest.approx(7 / links, rel=0.05)
    assert seconds(mesh, 1024.0) == pytest.approx(seconds(switch, 1024.0), rel=0.01)
    assert seconds(mesh, 1024.0) < 50e-6


def _model(cluster: ClusterSpec) -> CommModel:
    return CommModel(cluster, cluster.calibration, load_calibration("default"))


def test_a_point_to_point_transfer_on_a_mesh_uses_one_link() -> None:
    """On direct peer links (MI300X's Infinity Fabric) a context-parallel ring step goes to one neighbour over one of
    the 7 links, whatever the ring's size; it had been given k − 1 links, 333 GB/s over a 64 GB/s link at cp 8."""
    mi300x = load_cluster("mi300x-8")
    size = 64 * 2**20
    one_link = mi300x.nvlink_bandwidth_bytes_per_s / (mi300x.nvlink_domain_gpus - 1)
    for ranks in (2, 4, 8):
        t = _model(mi300x).time(Comm("c", "send_recv", place("cp", ranks, 1, mi300x), size, "cp"))
        assert size / t <= one_link


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "send_recv"])
@pytest.mark.parametrize("size", [64 * 2**10, 2**20, SIZE])
def test_leaving_the_node_is_never_faster_than_staying_inside_it(collective: str, size: int) -> None:
    """The network part is modelled and the NVLink part measured, and small measured NCCL calls cost 20-40 us on
    DGX H100 (Vidur): two ranks on two nodes had been timed faster than two on one node up to about 1 MB."""
    h100 = load_cluster("dgx-h100")
    inside = _model(h100).time(Comm("c", collective, place("dp", 2, 1, h100), size, "dp"))
    across = _model(h100).time(Comm("c", collective, place("dp", 2, 8, h100), size, "dp"))
    assert place("dp", 2, 8, h100).crosses_network
    assert across >= inside


def test_nvlink_latency_bounds_collectives_on_default_curves_only() -> None:
    """The default curves scale with the NVLink bandwidth, their small-message floor with them; the cluster's per-step
    NVLink latency bounds them from below (an 8-rank all-reduce: 12 tree steps). Measured curves keep their own."""
    b200, h100 = load_cluster("dgx-b200"), load_cluster("dgx-h100")
    slow_b200 = replace(b200, intra_node_latency_s=100e-6)
    comm = Comm("c", "all_reduce", place("tp", 8, 1, b200), 64 * 2**10, "tp")
    assert _model(slow_b200).time(comm) == pytest.approx(12 * 100e-6)
    assert _model(b200).time(comm) < 12 * 100e-6
    h100_comm = Comm("c", "all_reduce", place("tp", 8, 1, h100), 64 * 2**10, "tp")
    assert _model(replace(h100, intra_node_latency_s=100e-6)).time(h100_comm) == _model(h100).time(h100_comm)


def _seconds(cluster: ClusterSpec, collective: str, ranks: int, size: float, stride: int = 1) -> float:
    model = CommModel(cluster, cluster.calibration, load_calibration("default"))
    return model.time(Comm("c", collective, place("g", ranks, stride, cluster), size, "tp"))


def test_a_faster_fabric_or_nvls_shortens_the_bytes_not_the_latency() -> None:
    """NCCL's tuning model keeps latency apart from bandwidth, and runs NVLS with its Simple protocol only: a small
    all-reduce takes what the measured curve says whatever the link bandwidth, a large one moves with it. Found by
    a communication review: the whole curve was scaled, so NVLS or a what-if at 2x NVLink halved a 2 KiB message."""
    h100 = load_cluster("dgx-h100")
    ring = replace(h100, nvls=False)
    fast = load_cluster("dgx-h100", {"nvlink_bandwidth_gb_per_s": 900, "nvls": False})
    slow = load_cluster("dgx-h100", {"nvlink_bandwidth_gb_per_s": 225, "nvls": False})
    small, large = 2048.0, 2.0**30
    for variant in (h100, fast, slow):
        assert _seconds(variant, "all_reduce", 8, small) == pytest.approx(_seconds(ring, "all_reduce", 8, small), 0.01)
    assert _seconds(ring, "all_reduce", 8, large) / _seconds(fast, "all_reduce", 8, large) == pytest.approx(2.0, 0.01)
    assert _seconds(slow, "all_reduce", 8, large) / _seconds(ring, "all_reduce", 8, large) == pytest.approx(2.0, 0.01)
    # Time still grows with the size on every fabric.
    for variant in (h100, fast, slow):
        times = [_seconds(variant, "all_reduce", 8, 2.0**e) for e in range(10, 33)]
        assert all(b >= a * (1 - 1e-9) for a, b in itertools.pairwise(times))


def test_network_ring_steps_inside_a_node_take_the_nvlink_latency() -> None:
    """NCCL's tuning model (src/graph/tuning.cc): of a ring all-gather's n - 1 steps only nodes - 1 cross the
    network; the others take the NVLink latency. A 512-rank all-gather over 64 nodes had been charged 511 network
    steps (3.07 ms of latency)."""
    h100 = load_cluster("dgx-h100")
    intra, inter = h100.intra_node_latency_s, h100.inter_node_latency_s
    tiny = 8.0 * 512
    latency = _seconds(h100, "all_gather", 512, tiny)
    assert latency == pytest.approx((512 - 64) * intra + 63 * inter, rel=0.05)
    # One member per node (a data-parallel group strided over tp = 8): every step crosses the network.
    strided = _seconds(h100, "all_gather", 64, tiny / 8, stride=8)
    assert strided == pytest.approx(63 * inter, rel=0.05)
    # All-reduce: the faster of the ring (2 (n - nodes) NVLink and 2 (nodes - 1) network steps) and the tree.
    tree = 2 * (7 * intra + 6 * inter)
    assert _seconds(h100, "all_reduce", 512, tiny) == pytest.approx(tree, rel=0.05)


@pytest.mark.parametrize("cluster", ["mi300x-8", "dgx-v100"])
def test_a_mesh_of_one_gpu_per_node_is_timed_not_crashed(cluster: str) -> None:
    """A mesh fabric with one GPU per node (a what-if) has no peer link inside a node; the in-domain bound of a
    collective leaving the node had divided by its zero links (found by a fuzzing review)."""
    from simulator.run import simulate
    from simulator.specs import PlanSpec, load_model

    spec = load_cluster(cluster, {"gpus_per_node": 1})
    r = simulate(load_model("llama3-8b"), spec, PlanSpec(dp=2, global_batch=16, precision="fp16"))
    assert r.step_time_s > 0


def test_a_slower_fabric_lengthens_the_bytes_not_a_latency_step() -> None:
    """A mesh's share of links (or a slower what-if fabric) slows the transfer of the message's bytes, not the latency
    and protocol overheads in the measured curve: the extra time over the NVSwitch reading grows in proportion to the
    size. Found by a review of the communication model: the whole time beyond the smallest measured message was
    scaled, so the curve's protocol step near 200 KiB was multiplied by 7 (a 2-rank all-reduce of 256 KiB on DGX V100's
    hybrid cube mesh took 186 us, of 512 KiB 262 us)."""
    mesh = load_cluster("dgx-v100")
    switch = replace(mesh, nvlink_topology="switch")
    kib = 1024.0

    def extra(size: float) -> float:
        return _seconds(mesh, "all_reduce", 2, size) - _seconds(switch, "all_reduce", 2, size)

    assert _seconds(mesh, "all_reduce", 2, 256 * kib) < 100e-6
    assert extra(512 * kib) / extra(256 * kib) == pytest.approx(2.0, rel=1e-6)
    assert extra(2**24) / extra(256 * kib) == pytest.approx(64.0, rel=1e-6)
    times = [_seconds(mesh, "all_reduce", 2, 2.0**e) for e in range(10, 33)]
    assert all(b >= a for a, b in itertools.pairwise(times))


def test_a_group_unevenly_spread_over_racks_is_paced_by_the_emptiest_rack() -> None:
    """NCCL sets every rank's ring channels and bandwidth to the minimum over the ranks (src/init.cc), so a
    data-parallel group strided 8 apart over 72-GPU NVL72 racks (nine members in each of seven racks, one in the
    eighth) moves what crosses the network at the pace of that one member's NIC. The fullest rack's nine NICs had set
    it: a 256 MiB all-reduce over 64 ranks ran at 404 GB/s of bus bandwidth instead of at most one NIC's ~48.
    Found by a review of the communication model."""
    nvl72 = load_cluster("gb200-nvl72")
    group = place("dp", 64, 8, nvl72)
    assert (group.per_domain, group.domains, group.fewest_per_domain) == (9, 8, 1)
    assert place("dp", 16, 8, nvl72).fewest_per_domain == 7  # racks of 9 and 7
    assert place("dp", 18, 8, nvl72).fewest_per_domain == 9  # two full racks
    size = 256.0 * 2**20
    seconds = _seconds(nvl72, "all_reduce", 64, size, stride=8)
    one_nic = nvl72.nic_bandwidth_per_gpu_bytes_per_s
    assert bus_factor("all_reduce", 64) * size / seconds <= one_nic
    # On DGX nodes a power-of-two group tiles the nodes: unchanged.
    h100 = load_cluster("dgx-h100")
    assert place("dp", 64, 8, h100).fewest_per_domain == 1 == place("dp", 64, 8, h100).per_domain
    assert place("dp", 32, 2, h100).fewest_per_domain == 4 == place("dp", 32, 2, h100).per_domain


def test_collectives_timed_on_a_stand_in_say_so() -> None:
    """Found by a review: the H100 table measures all-reduce only, and all-gathers, reduce-scatters and all-to-alls
    timed on its curve (the same ring traffic, an all-to-all not even that) were reported as calibrated, as was an
    8-GPU all-reduce sped up 30% by NVLS, a gain no curve of the table measured."""
    cluster = load_cluster("dgx-h100")
    tp8 = place("tp", 8, 1, cluster)
    for collective in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce"):
        model = _model(cluster)
        model.time(Comm("c", collective, tp8, SIZE, "tp"))
        expected = (
            {"all_reduce:domain:nvls_gain"} if collective == "all_reduce" else {f"{collective}:domain:all_reduce_curve"}
        )
        assert model.uncalibrated == expected
    model = _model(cluster)
    model.time(Comm("c", "all_reduce", place("tp", 4, 1, cluster), SIZE, "tp"))  # no NVLS gain up to 4 GPUs
    assert model.uncalibrated == set()
