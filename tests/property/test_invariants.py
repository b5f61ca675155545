"""Invariants of the simulator over random small configurations (Hypothesis)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.errors import InfeasiblePlanError
from simulator.run import simulate
from simulator.specs.hardware import ClusterSpec, DeviceSpec
from simulator.specs.model import ModelSpec, MoESpec
from simulator.specs.plan import PlanSpec

DEVICE = DeviceSpec(
    name="prop-gpu",
    peak_flops=(("bf16", 300e12), ("fp16", 300e12), ("fp8", 600e12)),
    hbm_bytes=80 * 2**30,
    hbm_bandwidth_bytes_per_s=2e12,
)
CLUSTER = ClusterSpec(
    name="prop-cluster",
    device=DEVICE,
    gpus_per_node=8,
    nvlink_bandwidth_bytes_per_s=300e9,
    nics_per_node=8,
    nic_bandwidth_bytes_per_s=25e9,
)
MODEL = ModelSpec(name="prop", layers=8, hidden=1024, heads=16, kv_heads=8, ffn_hidden=4096, vocab=8192, seq_len=512)

layouts = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2, 4, 8]),
        "pp": st.sampled_from([1, 2, 4]),
        "dp": st.sampled_from([1, 2, 4, 16]),
        "cp": st.sampled_from([1, 2, 4]),
        "cp_comm": st.sampled_from(["p2p", "all_gather", "a2a"]),
        "micro_batch": st.sampled_from([1, 2]),
        "m": st.sampled_from([1, 2, 4, 8]),
        "recompute": st.sampled_from(["none", "selective", "full"]),
        "zero_stage": st.sampled_from([0, 1, 2, 3]),
        "grad_overlap": st.booleans(),
        "schedule": st.sampled_from(["1f1b", "gpipe", "zb_h1"]),
    }
).filter(
    # Ulysses (a2a) CP needs cp to divide each TP rank's query and KV heads; other plans always fit this model.
    lambda d: d["cp_comm"] != "a2a" or (MODEL.heads // d["tp"] % d["cp"] == 0 and max(1, 8 // d["tp"]) % d["cp"] == 0)
)


def _plan(d: dict) -> PlanSpec:
    return PlanSpec(
        tp=d["tp"],
        pp=d["pp"],
        dp=d["dp"],
        cp=d["cp"],
        cp_comm=d["cp_comm"],
        micro_batch=d["micro_batch"],
        global_batch=d["micro_batch"] * d["dp"] * d["m"],
        recompute=d["recompute"],
        zero_stage=d["zero_stage"],
        grad_overlap=d["grad_overlap"],
        schedule=d["schedule"],
        vp=1,
    )


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(layouts)
def test_gpu_count_and_busy_time(d: dict) -> None:
    """Issue 3: tp·pp·dp·cp is the GPU count; no stage is busy longer than the step; parts sum to it."""
    plan = _plan(d)
    assert plan.num_gpus == plan.tp * plan.pp * plan.dp * plan.cp
    r = simulate(MODEL, CLUSTER, plan)
    assert r.num_gpus == plan.num_gpus
    for stage in r.stage_breakdown:
        assert stage["compute_s"] <= r.step_time_s * (1 + 1e-9)
        assert sum(stage.values()) == pytest.approx(r.step_time_s, rel=1e-6)


@SETTINGS
@given(layouts, st.sampled_from(["nvlink", "nic", "hbm", "flops"]), st.sampled_from([1.5, 2.0, 4.0]))
def test_more_hardware_never_slows_a_step(d: dict, what: str, factor: float) -> None:
    """Issue 3: more NVLink, NIC, HBM bandwidth or FLOP/s never makes a step slower (random plans with pp, cp,
    ZeRO 0-3, every schedule but interleaved, which the MoE test below covers)."""
    plan = _plan(d)
    faster = {
        "nvlink": replace(CLUSTER, nvlink_bandwidth_bytes_per_s=CLUSTER.nvlink_bandwidth_bytes_per_s * factor),
        "nic": replace(CLUSTER, nic_bandwidth_bytes_per_s=CLUSTER.nic_bandwidth_bytes_per_s * factor),
        "hbm": replace(
            CLUSTER, device=replace(DEVICE, hbm_bandwidth_bytes_per_s=DEVICE.hbm_bandwidth_bytes_per_s * factor)
        ),
        "flops": replace(
            CLUSTER, device=replace(DEVICE, peak_flops=tuple((p, f * factor) for p, f in DEVICE.peak_flops))
        ),
    }[what]
    base = simulate(MODEL, CLUSTER, plan).step_time_s
    better = simulate(MODEL, faster, plan).step_time_s
    assert better <= base * (1 + 1e-9)


def test_serial_sum_at_tp_pp_dp_1() -> None:
    """With no parallelism the step is the sum of every op's time over all micro-batches plus the optimizer."""
    from simulator.cost.compute import ComputeModel
    from simulator.graph.transformer import build_graph
    from simulator.run import _default_table

    plan = PlanSpec(micro_batch=2, global_batch=8, recompute="none", grad_overlap=False)
    r = simulate(MODEL, CLUSTER, plan)
    cm = ComputeModel(DEVICE, None, _default_table(), "bf16")
    g = build_graph(MODEL, MODEL.seq_len, 2)
    per_mb = sum(cm.time(op) * b.count for b in g.blocks for op in b.forward + b.backward)
    total = per_mb * 4 + cm.time(g.optimizer_step(plan.precision, plan.grad_bytes, g.params(), g.params()))
    assert r.step_time_s == pytest.approx(total, rel=1e-9)


@SETTINGS
@given(layouts)
def test_same_inputs_same_answer(d: dict) -> None:
    """Issue 3 (determinism): the same inputs give an equal result."""
    plan = _plan(d)
    assert simulate(MODEL, CLUSTER, plan) == simulate(MODEL, CLUSTER, plan)


@SETTINGS
@given(st.sampled_from([3, 5, 6, 7]))
def test_indivisible_tp_is_infeasible(tp: int) -> None:
    """Issue 3: tp that does not divide the heads is an infeasible plan with the rule in the message."""
    with pytest.raises(InfeasiblePlanError, match="'tp' must divide 'heads'"):
        simulate(MODEL, CLUSTER, PlanSpec(tp=tp, global_batch=1, micro_batch=1, recompute="none", grad_overlap=True))


# -- MoE, expert parallelism and interleaving (issue 3: monotonicity across random small plans) ---------------

MOE_MODEL = ModelSpec(
    name="prop-moe",
    layers=8,
    hidden=1024,
    heads=16,
    kv_heads=4,
    ffn_hidden=2048,
    vocab=8192,
    seq_len=512,
    gated_mlp=True,
    activation="swiglu",
    position_embedding="rope",
    bias=False,
    moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=1024, layer_frequency=2),
)

moe_layouts = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2, 4]),
        "pp": st.sampled_from([1, 2, 4]),
        "dp": st.sampled_from([1, 2, 4, 8]),
        "cp": st.sampled_from([1, 2]),
        "ep": st.sampled_from([1, 2, 4, 8]),
        "vp": st.sampled_from([1, 2]),
        "micro_batch": st.sampled_from([1, 2]),
        "m": st.sampled_from([4, 8]),
        "recompute": st.sampled_from(["none", "selective", "full"]),
        "zero_stage": st.sampled_from([0, 1, 2, 3]),
        "grad_overlap": st.booleans(),
        "sequence_parallel": st.booleans(),
    }
)


def _moe_plan(d: dict) -> PlanSpec:
    ep = d["ep"] if (d["dp"] * d["cp"]) % d["ep"] == 0 else 1
    vp = d["vp"] if d["pp"] > 1 and d["m"] % d["pp"] == 0 else 1
    return PlanSpec(
        tp=d["tp"],
        pp=d["pp"],
        dp=d["dp"],
        cp=d["cp"],
        ep=ep,
        vp=vp,
        micro_batch=d["micro_batch"],
        global_batch=d["micro_batch"] * d["dp"] * d["m"],
        recompute=d["recompute"],
        zero_stage=d["zero_stage"],
        grad_overlap=d["grad_overlap"],
        # Megatron-Core needs sequence parallelism for expert parallelism with tensor parallelism.
        sequence_parallel=d["sequence_parallel"] or (d["tp"] > 1 and ep > 1),
    )


@SETTINGS
@given(moe_layouts, st.sampled_from(["nvlink", "nic", "hbm", "flops"]), st.sampled_from([1.25, 2.0, 8.0]))
def test_more_hardware_never_slows_a_moe_step(d: dict, what: str, factor: float) -> None:
    """Issue 3: more NVLink, NIC, HBM bandwidth or FLOP/s never makes a step slower, for MoE models with
    expert parallelism, interleaved schedules, context parallelism and ZeRO 0-3."""
    plan = _moe_plan(d)
    faster = _faster(what, factor)
    base = simulate(MOE_MODEL, CLUSTER, plan)
    better = simulate(MOE_MODEL, faster, plan)
    assert better.step_time_s <= base.step_time_s * (1 + 1e-9)


@SETTINGS
@given(moe_layouts)
def test_moe_breakdown_sums_to_step_time(d: dict) -> None:
    """Issue 3: for every stage, compute + exposed communication + bubble + optimizer equals the step time,
    and no stage computes for longer than the step."""
    r = simulate(MOE_MODEL, CLUSTER, _moe_plan(d))
    for stage in r.stage_breakdown:
        assert stage["compute_s"] <= r.step_time_s * (1 + 1e-9)
        assert sum(stage.values()) == pytest.approx(r.step_time_s, rel=1e-6)
        assert min(stage.values()) >= -1e-12


def _faster(what: str, factor: float) -> ClusterSpec:
    return {
        "nvlink": replace(CLUSTER, nvlink_bandwidth_bytes_per_s=CLUSTER.nvlink_bandwidth_bytes_per_s * factor),
        "nic": replace(CLUSTER, nic_bandwidth_bytes_per_s=CLUSTER.nic_bandwidth_bytes_per_s * factor),
        "hbm": replace(
            CLUSTER, device=replace(DEVICE, hbm_bandwidth_bytes_per_s=DEVICE.hbm_bandwidth_bytes_per_s * factor)
        ),
        "flops": replace(
            CLUSTER, device=replace(DEVICE, peak_flops=tuple((p, f * factor) for p, f in DEVICE.peak_flops))
        ),
    }[what]


@pytest.mark.parametrize("what", ["nvlink", "nic", "hbm", "flops"])
def test_each_hardware_knob_matters(what: str) -> None:
    """Issue 3: the monotonicity properties above are not vacuous: on a plan that uses NVLink (tp=4, SP off),
    the network (dp=16 over 8 nodes, no overlap), HBM and tensor cores, doubling any one of the four strictly
    shortens the step."""
    plan = PlanSpec(
        tp=4, pp=2, dp=16, global_batch=64, micro_batch=1, recompute="none", grad_overlap=False, vp=1,
        sequence_parallel=False,
    )  # fmt: skip
    base = simulate(MODEL, CLUSTER, plan).step_time_s
    assert simulate(MODEL, _faster(what, 2.0), plan).step_time_s < base * (1 - 1e-3)


@SETTINGS
@given(
    st.sampled_from([MODEL, MOE_MODEL]),
    st.sampled_from(["flash", "unfused"]),
    st.sampled_from(["1f1b", "gpipe"]),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from(["fp16", "bf16"]),
)
def test_serial_sum_for_random_models(
    model: ModelSpec, attention: str, schedule: str, mb: int, m: int, precision: str
) -> None:
    """Issue 3: with tp=pp=dp=cp=1 (no communication, no overlap) the step is exactly the serial sum of every
    operator's time over all micro-batches plus the optimizer, for dense and MoE models, both attention
    kernels, both schedules and both 16-bit precisions."""
    from simulator.cost.compute import ComputeModel
    from simulator.graph.transformer import build_graph
    from simulator.run import _default_table

    plan = PlanSpec(
        micro_batch=mb,
        global_batch=mb * m,
        recompute="none",
        grad_overlap=False,
        attention=attention,
        schedule=schedule,
        precision=precision,
        vp=1,
    )
    r = simulate(model, CLUSTER, plan)
    cm = ComputeModel(DEVICE, None, _default_table(), precision)
    g = build_graph(model, model.seq_len, mb, attention)
    per_mb = sum(cm.time(op) * b.count for b in g.blocks for op in b.forward + b.backward)
    optimizer = g.optimizer_step(plan.precision, plan.grad_bytes, g.params(), g.params())
    assert r.step_time_s == pytest.approx(per_mb * m + cm.time(optimizer), rel=1e-9)


def _walk_every_domain(size: int, stride: int, domain: int, offsets: int, world: int) -> tuple[int, int, int]:
    """layout._worst_placed as it was: every domain of every group walked (hours for a 2**40-GPU data-parallel
    group, which fuzzing found)."""
    if stride >= domain:
        return 1, size, 1
    span = size * stride
    blocks = max(1, min(world, span * domain // math.gcd(span, domain)) // span)
    starts = {(b * span + j) % domain for b in range(min(blocks, domain)) for j in range(min(offsets, domain))}
    worst = (size + 1, 0, 0)
    for first in sorted(starts):
        last = first + (size - 1) * stride
        counts = [
            sum(1 for k in range(size) if d * domain <= first + k * stride < (d + 1) * domain)
            for d in range(first // domain, last // domain + 1)
        ]
        worst = min(worst, (min(counts), -len(counts), -max(counts)))
    return -worst[2], -worst[1], worst[0]


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(2, 200),
    stride=st.integers(1, 80),
    domain=st.sampled_from([2, 4, 6, 8, 16, 36, 64, 72]),
    offsets=st.integers(1, 80),
    blocks=st.integers(0, 8),
)
def test_group_placement_reads_one_period_of_domains(
    size: int, stride: int, domain: int, offsets: int, blocks: int
) -> None:
    """The worst-placed group of a family, found from the first domains, one period of the stride and the last
    domain, is the one walking every domain finds."""
    from simulator.parallel.layout import _worst_placed

    world = blocks * size * stride
    assert _worst_placed(size, stride, domain, offsets, world) == _walk_every_domain(
        size, stride, domain, offsets, world
    )
