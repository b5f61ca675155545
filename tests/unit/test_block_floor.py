"""The pieces of the free-knob search's floor: a relaxed fold of one block instance's programs, and the graph hash
the search's caches key on.

``compute_end_floor`` must never exceed when the real fold ends its last compute step, whatever the streams, the
overlap slowdown and the host; a block's instance programs must be what a chunk emits for each instance, so that
the sum over a chunk's instances stays below the chunk's own fold.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import run
from simulator.engine.fold import TimedStep, compute_end_floor, fold
from simulator.engine.pipeline import lower_bound
from simulator.graph.transformer import build_graph
from simulator.parallel.layout import resolve_layout
from simulator.parallel.program import (
    block_programs,
    build_programs,
    instance_dp_comms,
    instance_key,
    recompute_program,
)
from simulator.run import _layout_memory, _models, _Sizes, _timed
from simulator.specs import PlanSpec, load_cluster, load_model
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec


@st.composite
def _programs(draw: st.DrawFn) -> list[TimedStep]:
    n = draw(st.integers(1, 14))
    steps: list[TimedStep] = []
    for i in range(n):
        compute = draw(st.booleans())
        waits = tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=3)))) if i else ()
        duration = draw(st.floats(0.0, 5.0, allow_nan=False))
        if compute:
            steps.append(TimedStep(f"c{i}", "compute", duration, waits, "compute", draw(st.booleans())))
        else:
            stream = draw(st.sampled_from(["comm", "dp", "tp"]))
            steps.append(TimedStep(f"x{i}", stream, duration, waits, draw(st.sampled_from(["tp", "dp", "cp"]))))
    return steps


@settings(max_examples=300, deadline=None)
@given(steps=_programs(), slowdown=st.sampled_from([0.0, 0.189, 1.0]), host=st.sampled_from([0.0, 0.3]))
def test_the_relaxed_fold_never_ends_compute_later_than_the_fold(
    steps: list[TimedStep], slowdown: float, host: float
) -> None:
    rows = fold(steps, slowdown, host_overhead_s=host, timeline=True).timeline
    last_compute = max((end for _, _, kind, _, end in rows if kind == "compute"), default=0.0)
    assert compute_end_floor(steps) <= last_compute + 1e-12


def test_a_blocking_collective_counts_and_an_overlapped_one_does_not() -> None:
    blocking = [
        TimedStep("a", "compute", 1.0, (), "compute"),
        TimedStep("ag", "tp", 0.5, (0,), "tp"),
        TimedStep("b", "compute", 1.0, (1,), "compute"),
    ]
    overlapped = [
        TimedStep("a", "compute", 1.0, (), "compute"),
        TimedStep("ag", "tp", 0.5, (0,), "tp"),
        TimedStep("b", "compute", 1.0, (), "compute"),
        TimedStep("c", "compute", 1.0, (1,), "compute"),
    ]
    assert compute_end_floor(blocking) == 2.5
    assert compute_end_floor(overlapped) == 3.0


def _chunk_compute_end(program: tuple[TimedStep, ...]) -> float:
    rows = fold(program, 0.0, timeline=True).timeline
    return max((end for _, _, kind, _, end in rows if kind == "compute"), default=0.0)


def test_a_chunks_instances_bound_its_own_fold() -> None:
    """Layer instances of a chunk with blocking TP (sequence parallel), FP8 casts and full recomputation: the sum of
    the instance floors stays below the chunk's folded compute, and is more than its compute alone."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    plan = PlanSpec(
        tp=4,
        pp=2,
        dp=1,
        global_batch=8,
        micro_batch=1,
        vp=1,
        recompute="full",
        precision="fp8",
        sequence_parallel=True,
        grad_overlap=True,
    )
    layout = resolve_layout(model, cluster, plan)
    graph = build_graph(model, layout.seq_len, layout.micro_batch)
    compute, comm = _models(cluster, plan.precision, plan.straggler_factor)
    blocks = (("layer.dense", 3),)
    fwd, bwd, _ = (_timed(p, compute, comm) for p in build_programs(graph, layout, blocks))
    f1, b1, w1 = (_timed(p, compute, comm) for p in block_programs(graph, layout, "layer.dense"))
    r1 = _timed(recompute_program(graph, layout, "layer.dense"), compute, comm)
    assert not w1  # 1F1B: the weight gradients stay in the backward
    instance_fwd = compute_end_floor(f1)
    instance_bwd = compute_end_floor(r1) + compute_end_floor(b1)
    assert 3 * instance_fwd <= _chunk_compute_end(tuple(fwd)) * (1 + 1e-12)
    assert 3 * instance_bwd <= _chunk_compute_end(tuple(bwd)) * (1 + 1e-12)
    compute_only = sum(s.duration_s for s in f1 if s.kind == "compute")
    assert instance_fwd > compute_only  # the blocking all-gathers and reduce-scatters count


def test_equal_graphs_hash_equal_and_the_hash_tells_layer_kinds_apart(tiny_model: ModelSpec) -> None:
    graph = build_graph(tiny_model, 128, 2)
    build_graph.cache_clear()
    again = build_graph(tiny_model, 128, 2)
    assert again is not graph
    assert again == graph
    assert hash(again) == hash(graph)
    bf16 = build_graph(tiny_model, 128, 2, bf16_layers=(1, 0))
    assert bf16 != graph
    assert hash(bf16) != hash(graph)
    assert {graph: 1}[again] == 1


def test_layouts_with_one_instance_key_share_their_instance_programs() -> None:
    """The search caches a block's floors under instance_key: layouts that differ only in recomputation, in how many
    layers recompute, or in whether ZeRO-2's reduce-scatters overlap, emit the same instance programs."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    base = PlanSpec(tp=2, pp=2, dp=2, global_batch=16, micro_batch=1, vp=1, zero_stage=2, sequence_parallel=True)
    variants = [
        base.with_(recompute="none", grad_overlap=True),
        base.with_(recompute="selective", grad_overlap=False),
        base.with_(recompute="full", recompute_layers=2, grad_overlap=True),
    ]
    layouts = [resolve_layout(model, cluster, v) for v in variants]
    assert len({instance_key(layout) for layout in layouts}) == 1
    graph = build_graph(model, layouts[0].seq_len, 1)
    for name in ("embedding", "layer.dense", "head"):
        assert len({block_programs(graph, layout, name) for layout in layouts}) == 1
    recomputed = [recompute_program(graph, layout, "layer.dense") for layout in layouts]
    assert not recomputed[0]
    assert recomputed[1]
    assert len(recomputed[2]) > len(recomputed[1])  # the whole forward again, not the attention core alone
    assert not recompute_program(graph, layouts[2], "head")  # only decoder layers recompute


def test_overlap_twins_are_sized_once_each_with_its_own_layout() -> None:
    """A free-knob search sizes a candidate and its grad_overlap twin once (memory does not depend on the overlap),
    and each keeps its own layout."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    on = PlanSpec(tp=2, pp=2, dp=2, global_batch=16, micro_batch=1, vp=1, recompute="full", zero_stage=2)
    on = on.with_(grad_overlap=True)
    off = on.with_(grad_overlap=False)
    sizes = _Sizes(model, cluster)
    first, twin = sizes.get(on), sizes.get(off)
    assert twin[3] is first[3]  # the memory sized for the first
    assert first[0].plan == on
    assert twin[0].plan == off
    assert twin[3] == _layout_memory(model, cluster, off)[3]
    assert sizes.get(on.with_(recompute="selective"))[3] != first[3]


def _deferred_and_bound(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec) -> tuple[run._Deferred, float]:
    """A fully specified plan that fits, sized with its floor, and the engine's lower bound on its step."""
    model, plan = run._normalised(model, cluster, plan)
    deferred = run._prepare(model, cluster, plan, False, {}, memory_only_if_infeasible=True, defer=True)
    assert isinstance(deferred, run._Deferred)
    return deferred, lower_bound(run._ready(model, cluster, deferred).pipe)


@pytest.mark.parametrize(
    "knobs",
    [
        {"zero_stage": 2, "grad_overlap": True},
        {"zero_stage": 2, "grad_overlap": False},
        {"zero_stage": 3, "grad_overlap": True},
        {"zero_stage": 3, "grad_overlap": False, "recompute": "full"},
        {"zero_stage": 3, "grad_overlap": True, "schedule": "zb_h1"},
        {"zero_stage": 2, "grad_overlap": True, "schedule": "zb_h1"},
    ],
)
def test_the_floor_with_sharded_data_parallelism_stays_below_the_bound(
    knobs: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeRO-2/3's gathers and scatters count in the floor (their dp stream) and the floor still never exceeds the
    engine's bound, with blocking or overlapped scatters, recomputation and the split weight-gradient pass. With
    ZeRO-3 over 16 ranks of two nodes and 512-token sequences the gathers outweigh the compute: the floor is more
    than the compute's alone."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    plan = PlanSpec(
        **{"tp": 1, "pp": 2, "dp": 16, "global_batch": 64, "micro_batch": 1, "vp": 1, "seq_len": 512, **knobs}
    )
    plan = plan.with_(recompute=plan.recompute or "none")
    deferred, bound = _deferred_and_bound(model, cluster, plan)
    assert deferred.floor_s <= bound * (1 + 1e-12)
    layout, graph, chunks, _ = deferred.sized
    gathers, scatters = instance_dp_comms(graph, layout, "layer.dense")
    assert scatters
    assert bool(gathers) == (plan.zero_stage == 3)
    monkeypatch.setattr(run, "instance_dp_comms", lambda *args: ((), ()))
    monkeypatch.setattr(run, "_BLOCK_FLOORS", run._Recent(run.BLOCK_FLOORS_MAX))
    compute_alone = run._compute_floor(graph, layout, chunks, *_models(cluster, plan.precision, 1.0))
    assert compute_alone <= deferred.floor_s
    if plan.zero_stage == 3:
        assert compute_alone < deferred.floor_s


def test_zero3_tasks_wait_for_their_first_gather_and_their_last_instance_for_every_gather(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one layer per chunk (interleaving) a ZeRO-3 task's first gather is not hidden by an earlier layer: the
    floor counts it before the task's compute, and stays below the engine's bound."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    plan = PlanSpec(
        tp=1, pp=2, dp=16, vp=16, global_batch=64, micro_batch=1, seq_len=512, zero_stage=3, recompute="full"
    )
    plan = plan.with_(grad_overlap=True)
    deferred, bound = _deferred_and_bound(model, cluster, plan)
    assert deferred.floor_s <= bound * (1 + 1e-12)
    layout, graph, chunks, _ = deferred.sized
    monkeypatch.setattr(run, "_compute_alone", lambda steps: 0.0)
    monkeypatch.setattr(run, "_BLOCK_FLOORS", run._Recent(run.BLOCK_FLOORS_MAX))
    without = run._compute_floor(graph, layout, chunks, *_models(cluster, plan.precision, 1.0))
    assert without < deferred.floor_s
