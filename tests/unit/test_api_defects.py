"""The Python API as a planner calls it: found by adversarial runs (a helper's fuzzing of simulate)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest

from simulator import run
from simulator.cost.compute import COST_CACHE_MAX
from simulator.engine.trace import chrome_trace
from simulator.errors import SpecError
from simulator.graph.ops import Op
from simulator.parallel.program import _build_cached
from simulator.run import simulate
from simulator.specs import PlanSpec, load_cluster, load_model
from simulator.specs.model import ModelSpec, MoESpec

A100 = load_cluster("dgx-a100-80g")


def _tiny(**changes: object) -> ModelSpec:
    base: dict[str, object] = {
        "name": "tiny",
        "layers": 4,
        "hidden": 256,
        "heads": 4,
        "ffn_hidden": 1024,
        "vocab": 1000,
        "seq_len": 512,
    }
    return ModelSpec(**{**base, **changes})  # type: ignore[arg-type]


def test_a_zero_length_task_does_not_send_the_idle_slice_over_work() -> None:
    """Under zb_h1 a stage without decoder layers has W tasks of 0 s that start with the next F and sort after
    it: the stream's last end stepped back and an idle slice covered F."""
    events = chrome_trace(
        [(0, "compute", "W0.0", 1e-3, 1e-3), (0, "compute", "F1.0", 1e-3, 2e-3), (0, "compute", "B1.0", 3e-3, 4e-3)]
    )["traceEvents"]
    idle = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "idle"]
    assert idle == [(0.0, 1000.0), (2000.0, 3000.0)]
    r = simulate(_tiny(layers=1), A100, PlanSpec(pp=3, global_batch=8, micro_batch=1, schedule="zb_h1"), record=True)
    slices = sorted(
        (e["pid"], e["ts"], e["ts"] + e["dur"])
        for e in chrome_trace(r.timeline)["traceEvents"]
        if e.get("ph") == "X" and e.get("tid") == 0
    )
    for (pid, _, end), (next_pid, start, _) in itertools.pairwise(slices):
        if pid == next_pid:
            assert start >= end - 1e-6, (pid, end, start)


def test_a_count_beyond_two_to_the_53_is_bad_input() -> None:
    """seq_len 10**400 raised OverflowError deep in the graph; 10**300 answered inf seconds and NaN MFU."""
    for build in (
        lambda: PlanSpec(global_batch=8, seq_len=10**400),
        lambda: PlanSpec(global_batch=8, vocab_divisible_by=2**53 + 1),
        lambda: _tiny(vocab=10**400),
    ):
        with pytest.raises(SpecError, match=r"must be at most 2\*\*53"):
            build()


def test_to_dict_is_strict_json_for_an_infeasible_plan() -> None:
    """A plan that cannot run has no times (NaN attributes, null in JSON); one that runs out of memory is timed as a
    fixed plan is, with or without free knobs, and says how far over it is."""
    gpt3 = load_model("gpt3-175b")
    r = run.infeasible_result(gpt3, A100, PlanSpec(tp=8, global_batch=8), "'tp' must divide 'heads'")
    assert not r.feasible
    data = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert data["step_time_s"] is None
    assert data["mfu"] is None
    assert math.isnan(r.step_time_s)  # the attribute keeps its float type
    over = simulate(gpt3, A100, PlanSpec(tp=8, global_batch=8))
    assert not over.feasible
    assert "GiB over" in over.reason
    fixed = simulate(gpt3, A100, over.plan)
    assert (over.step_time_s, over.reason) == (fixed.step_time_s, fixed.reason)
    assert json.loads(json.dumps(over.to_dict(), allow_nan=False))["step_time_s"] == over.step_time_s


@pytest.mark.parametrize("position", ["model", "cluster", "plan"])
def test_simulate_names_an_argument_of_the_wrong_type(position: str) -> None:
    args = {"model": _tiny(), "cluster": A100, "plan": PlanSpec(global_batch=8)}
    args[position] = "gpt3-175b"
    with pytest.raises(SpecError, match=f"simulate: {position}: must be a .*Spec, got str"):
        simulate(args["model"], args["cluster"], args["plan"])  # type: ignore[arg-type]


def test_shared_experts_need_their_size_in_python_as_in_a_file() -> None:
    with pytest.raises(SpecError, match="shared_expert_ffn_hidden: is required when shared_experts=2"):
        MoESpec(num_experts=4, top_k=2, expert_ffn_hidden=512, shared_experts=2)


def test_caches_stay_bounded_over_many_distinct_plans() -> None:
    """A sweep of 1,024 distinct plans grew to 460 MB: every plan's programs were kept (4,096 entries, no hits)."""
    assert _build_cached.cache_info().maxsize == 256
    from simulator import run

    assert run.FOLDED_MAX == 256  # folded chunks across calls: one per cached program at most
    from simulator.run import _models

    model, _ = _models(A100, "bf16", 1.0)
    saved = dict(model._cache)
    try:
        model._cache.clear()
        model._cache.update({("filler", i): (0.0, frozenset()) for i in range(COST_CACHE_MAX)})
        model.time(_a_gemm())
        assert len(model._cache) == 1
    finally:
        model._cache.clear()
        model._cache.update(saved)


def _a_gemm() -> Op:
    from simulator.graph.transformer import build_graph

    graph = build_graph(_tiny(), 512, 1)
    return next(op for block in graph.blocks for op in block.forward if op.kind == "gemm")


def test_recording_a_trace_does_not_change_an_out_of_memory_answer() -> None:
    """Nothing fits, knobs free: the answer with a timeline is the answer without one (recording used to re-run the
    least-memory candidate through the engine, which only the recorded answer then reported)."""
    plan = PlanSpec(tp=8, global_batch=8)
    gpt3 = load_model("gpt3-175b")
    plain, recorded = simulate(gpt3, A100, plan), simulate(gpt3, A100, plan, record=True)
    assert not plain.feasible
    assert recorded.timeline
    assert json.dumps(plain.to_dict()) == json.dumps(recorded.to_dict())


def test_errors_survive_pickling_as_a_process_pool_sends_them() -> None:
    """SpecError could not be unpickled (its __init__ takes where, what, fix): one bad plan in a spawn pool hung
    multiprocessing's map and broke a ProcessPoolExecutor instead of reporting the error."""
    import pickle

    from simulator.errors import CalibrationError, InfeasiblePlanError, SpecError

    for err in (SpecError("tp", "must be >= 1, got 0", "use a positive degree"), InfeasiblePlanError("x"),
                CalibrationError("y")):  # fmt: skip
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err)
        assert str(back) == str(err)
    spec = pickle.loads(pickle.dumps(SpecError("a", "b", "c")))
    assert (spec.where, spec.what, spec.fix) == ("a", "b", "c")


def test_threads_get_the_results_a_serial_loop_gets() -> None:
    """The cost models are shared across calls and collect each call's uncalibrated labels: threads (Dask's
    default scheduler) used to mix them up between results (6-20 of 162 differed). Calls now run one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from simulator.run import simulate
    from simulator.specs import PlanSpec, load_cluster, load_model

    model = load_model("llama3-8b")
    jobs = [
        (load_cluster(name), PlanSpec(tp=tp, dp=16 // tp, global_batch=32, micro_batch=1, recompute="full"))
        for name in ("dgx-h100", "dgx-b200", "dgx-a100-80g")
        for tp in (1, 2, 4, 8)
    ] * 3
    serial = [simulate(model, c, p).to_dict() for c, p in jobs]
    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(lambda job: simulate(model, *job).to_dict(), jobs))
    assert threaded == serial


def test_model_with_rederives_what_replace_would_keep() -> None:
    """dataclasses.replace(gpt3, hidden=6144) kept head_dim 128 (87.3 B parameters instead of 72.8 B, a step 17%
    slower, no warning); with_ goes through the model file's rules."""
    from dataclasses import replace

    from simulator.errors import SpecError
    from simulator.specs import load_model

    gpt3 = load_model("gpt3-175b")
    assert replace(gpt3, hidden=6144).head_dim == 128  # the trap
    wide = gpt3.with_(hidden=6144)
    assert (wide.head_dim, wide.attn_dim) == (64, 6144)
    assert wide == load_model("gpt3-175b", {"hidden": 6144})
    with pytest.raises(SpecError, match="'heads' must divide 'hidden'"):
        gpt3.with_(hidden=6000)
    mixtral = gpt3.with_(moe={"num_experts": 8, "top_k": 2, "expert_ffn_hidden": 4096})
    assert mixtral.moe is not None
    assert mixtral.with_(**{"moe.top_k": 1}).moe.top_k == 1


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_plans_that_differ_only_in_what_programs_never_read_share_them(zero: int) -> None:
    """The program cache is keyed on program_key(layout), not the whole layout (a sweep over the global batch
    rebuilt every program). Building afresh for plans with one key gives equal programs, and the cache hits."""
    from simulator.graph.transformer import build_graph
    from simulator.parallel.layout import resolve_layout
    from simulator.parallel.program import _build, build_programs, program_key
    from simulator.specs import PlanSpec, load_cluster, load_model

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    base = {"tp": 2, "pp": 2, "micro_batch": 1, "vp": 1, "recompute": "selective", "zero_stage": zero}
    plans = [
        PlanSpec(**base, dp=4, global_batch=64, grad_overlap=True),  # type: ignore[arg-type]
        # (ZeRO-2/3's per-layer reduce-scatters block the backward without overlap: there it is read)
        PlanSpec(**base, dp=4, global_batch=256, grad_overlap=zero >= 2, straggler_factor=1.2),  # type: ignore[arg-type]
        PlanSpec(**base, dp=4, global_batch=64, grad_overlap=True, align_grad_reduce=False),  # type: ignore[arg-type]
    ]
    if zero < 3:
        plans.append(PlanSpec(**base, dp=16, global_batch=64, grad_overlap=True))  # type: ignore[arg-type]
    layouts = [resolve_layout(model, cluster, p.with_(seq_len=4096)) for p in plans]
    assert len({program_key(layout) for layout in layouts}) == 1
    graph = build_graph(model, 4096, 1)
    blocks = (("embedding", 1), ("layer.dense", 8))
    fresh = [_build(graph, layout, blocks) for layout in layouts]
    assert all(programs == fresh[0] for programs in fresh)
    assert all(build_programs(graph, layout, blocks) is build_programs(graph, layouts[0], blocks) for layout in layouts)
    # and a field the programs do read makes a new key
    other = resolve_layout(model, cluster, plans[0].with_(seq_len=4096, precision="fp16"))
    assert program_key(other) != program_key(layouts[0])


def test_a_sweep_can_take_plans_that_cannot_run_as_answers() -> None:
    """Only the CLI turned InfeasiblePlanError into an answer; a sweep needed its own try/except per plan."""
    from simulator.errors import InfeasiblePlanError
    from simulator.run import simulate
    from simulator.specs import PlanSpec, load_cluster, load_model

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    bad = PlanSpec(tp=3, dp=1, global_batch=8, micro_batch=1)  # 3 does not divide 32 heads
    with pytest.raises(InfeasiblePlanError, match="'tp' must divide 'heads'"):
        simulate(model, cluster, bad)
    answer = simulate(model, cluster, bad, raise_infeasible=False)
    assert not answer.feasible
    assert "'tp' must divide 'heads'" in answer.reason
    assert answer.to_dict()["step_time_s"] is None
    # No times, so no critical stage either: None, not -1, which indexes the last stage and plots as a stage.
    assert answer.critical_stage is None
    assert answer.to_row()["critical_stage"] is None


def test_every_row_has_the_same_columns() -> None:
    """A free-knob result had 60 columns, a fixed one 55 and an infeasible one 46: a DataFrame's column order
    depended on which result came first."""
    from simulator.run import simulate
    from simulator.specs import PlanSpec, load_cluster, load_model

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    plans = [
        PlanSpec(tp=2, dp=4, global_batch=16),  # free knobs
        PlanSpec(tp=2, dp=4, global_batch=16, micro_batch=1, vp=1, recompute="full", grad_overlap=True),  # fixed
        PlanSpec(tp=1, dp=8, global_batch=16, micro_batch=1, vp=1, recompute="none", grad_overlap=True),  # OOM
        PlanSpec(tp=3, dp=1, global_batch=8),  # cannot run
    ]
    rows = [simulate(model, cluster, p, raise_infeasible=False).to_row() for p in plans]
    assert len({tuple(row) for row in rows}) == 1
    assert rows[1]["chosen.micro_batch"] is None
    assert rows[3]["compute_s"] is None


def test_a_sweep_can_skip_timing_plans_that_do_not_fit() -> None:
    """An out-of-memory plan ran the whole engine (12 ms against 0.1 ms for its memory); time_oom=False answers
    it from the memory model alone: the same reason and memory, no times. Plans that fit are unaffected."""
    import math

    from simulator.run import simulate
    from simulator.specs import PlanSpec, load_cluster, load_model

    model, cluster = load_model("llama3-70b"), load_cluster("dgx-h100")
    for plan in (PlanSpec(dp=256, global_batch=512, micro_batch=1, vp=1, recompute="none", grad_overlap=True),
                 PlanSpec(dp=256, global_batch=512)):  # fixed knobs, and free ones none of which fits  # fmt: skip
        timed, untimed = simulate(model, cluster, plan), simulate(model, cluster, plan, time_oom=False)
        assert not timed.feasible
        assert not untimed.feasible
        assert untimed.reason == timed.reason
        assert untimed.to_dict()["memory"] == timed.to_dict()["memory"]
        assert untimed.plan == timed.plan  # the defaults it was sized under written out, as when timed
        assert math.isnan(untimed.step_time_s)
    fits = PlanSpec(tp=8, pp=4, dp=8, global_batch=512)
    assert simulate(model, cluster, fits, time_oom=False).to_dict() == simulate(model, cluster, fits).to_dict()


# -- found by a review of the Python API for sweeps --------------------------------------------------------------


def test_an_interleaved_schedule_without_a_pipeline_is_refused_where_the_plan_is_built() -> None:
    """PlanSpec(pp=1, schedule='interleaved') was accepted and the free-vp search then built vp=2 with pp=1 itself,
    a SpecError out of simulate(..., raise_infeasible=False) that a sweep does not expect. The contradiction is the
    plan's own, as vp > 1 with pp 1 is: refused by the constructor, with the fix."""
    with pytest.raises(SpecError, match="schedule: interleaved needs pipeline parallelism, got pp=1"):
        PlanSpec(tp=2, dp=4, global_batch=32, schedule="interleaved")
    model = load_model("llama3-8b")
    result = simulate(model, A100, PlanSpec(tp=2, dp=4, global_batch=32), raise_infeasible=False)
    assert result.plan.vp == 1


def test_numpy_scalars_are_taken_by_what_if_overrides() -> None:
    """A grid built with numpy or pandas hands over numpy scalars: PlanSpec and ModelSpec took them, the override
    readers (ModelSpec.with_, load_cluster's overrides) refused np.int64(4096) as 'not a whole number'."""
    np = pytest.importorskip("numpy")
    assert load_model("llama3-8b").with_(hidden=np.int64(4096)).hidden == 4096
    assert load_cluster("dgx-h100", {"nics_per_node": np.int64(4)}).nics_per_node == 4
    assert load_cluster("dgx-h100", None, {"hbm_gib": np.float32(96)}).device.hbm_bytes == 96 * 2**30
    grid = PlanSpec(global_batch=8).with_(global_batch=np.int64(16))
    assert grid.global_batch == 16
    assert type(grid.global_batch) is int


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: load_cluster("dgx-h100", [("nics_per_node", 4)]), "must be a mapping of keys to values, got list"),
        (lambda: load_cluster("dgx-h100", {1: 0}), "keys must be text, got 1"),
        (lambda: PlanSpec(global_batch=8).with_(micro_bach=1), "micro_bach: unknown key (did you mean 'micro_batch'?)"),
        (lambda: replace(A100, calibration={}), "calibration: must be a CalibrationTable or None, got dict"),
        (lambda: simulate(load_model("llama3-8b"), A100, PlanSpec(global_batch=8), time_oom="no"), "time_oom"),
        (lambda: simulate(load_model("llama3-8b"), A100, PlanSpec(global_batch=8), record=1), "record"),
    ],
)
def test_wrong_arguments_to_the_api_are_spec_errors(call: object, fragment: str) -> None:
    """Each was a raw AttributeError or TypeError, or (time_oom='no', a truthy string) silently taken as True."""
    with pytest.raises(SpecError) as info:
        call()  # type: ignore[operator]
    assert fragment in str(info.value)
