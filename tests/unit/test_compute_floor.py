"""The free-knob search's compute floor: a lower bound on a candidate's step that costs no program building.

The search prepares (builds, times and folds the programs of) only the candidates whose floor can still beat the
fastest step found, so the floor must never exceed what the engine's own bound says, and skipping on it must not
change any answer.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator import run
from simulator.engine.pipeline import lower_bound
from simulator.run import rank, simulate
from simulator.search.layouts import layouts
from simulator.specs import load_cluster, load_model
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec


def _floor_and_bound(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec) -> tuple[float, float] | None:
    """The floor of a fully specified plan and the engine's lower bound of the same plan; None when it does not fit
    or cannot run."""
    model, plan = run._normalised(model, cluster, plan)
    try:
        deferred = run._prepare(model, cluster, plan, False, {}, memory_only_if_infeasible=True, defer=True)
    except run.InfeasiblePlanError:
        return None
    if not isinstance(deferred, run._Deferred):
        return None
    prepared = run._ready(model, cluster, deferred)
    return deferred.floor_s, lower_bound(prepared.pipe)


# Plans that exercise what the programs add to or take from the blocks' ops: context-parallel attention pieces,
# FP8 casts, the split weight-gradient pass, interleaving, partial and selective recomputation, ZeRO-3 gathers,
# expert parallelism with folded experts.
CASES = [
    (
        "llama3-8b",
        "dgx-h100",
        {"tp": 2, "pp": 2, "dp": 2, "global_batch": 16, "micro_batch": 1, "recompute": "none", "vp": 1},
    ),
    (
        "llama3-8b",
        "dgx-h100",
        {
            "tp": 1,
            "pp": 2,
            "dp": 2,
            "cp": 2,
            "global_batch": 16,
            "micro_batch": 1,
            "recompute": "full",
            "zero_stage": 1,
        },
    ),
    (
        "llama3-8b",
        "dgx-h100",
        {"tp": 2, "pp": 4, "dp": 1, "global_batch": 16, "micro_batch": 1, "vp": 2, "recompute": "full"},
    ),
    (
        "llama3-8b",
        "dgx-h100",
        {
            "tp": 2,
            "pp": 2,
            "dp": 2,
            "global_batch": 16,
            "micro_batch": 2,
            "recompute": "full",
            "recompute_layers": 3,
            "vp": 1,
        },
    ),
    (
        "llama3-8b",
        "dgx-h100",
        {"tp": 4, "pp": 2, "dp": 1, "global_batch": 8, "micro_batch": 1, "recompute": "selective", "vp": 1},
    ),
    ("llama3-8b", "dgx-h100", {"tp": 2, "pp": 2, "dp": 2, "global_batch": 16, "micro_batch": 1, "schedule": "zb_h1"}),
    (
        "llama3-8b",
        "dgx-h100",
        {"tp": 1, "pp": 1, "dp": 8, "global_batch": 16, "micro_batch": 2, "zero_stage": 3, "recompute": "full"},
    ),
    (
        "llama3-8b",
        "dgx-h100",
        {"tp": 2, "pp": 2, "dp": 2, "global_batch": 16, "micro_batch": 1, "precision": "fp8", "vp": 1},
    ),
    (
        "gpt3-175b",
        "dgx-a100-80g",
        {"tp": 8, "pp": 8, "dp": 2, "global_batch": 64, "micro_batch": 1, "vp": 3, "recompute": "full"},
    ),
    (
        "mixtral-8x7b",
        "dgx-h100",
        {"tp": 2, "pp": 2, "dp": 4, "ep": 4, "global_batch": 32, "micro_batch": 1, "recompute": "full"},
    ),
    (
        "mixtral-8x7b",
        "dgx-h100",
        {
            "tp": 2,
            "pp": 2,
            "dp": 8,
            "ep": 8,
            "expert_tp": 1,
            "global_batch": 64,
            "micro_batch": 1,
            "recompute": "full",
            "zero_stage": 1,
        },
    ),
]


@pytest.mark.parametrize(("model", "cluster", "knobs"), CASES)
def test_the_floor_never_exceeds_the_engines_bound(model: str, cluster: str, knobs: dict[str, object]) -> None:
    plan = PlanSpec(grad_overlap=True, **{"vp": 1, "recompute": "none", **knobs})  # type: ignore[arg-type]
    got = _floor_and_bound(load_model(model), load_cluster(cluster), plan)
    assert got is not None, "the case must fit and run"
    floor, bound = got
    assert 0 < floor <= bound * (1 + 1e-12), (floor, bound)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.sampled_from([4, 6, 8]),
    batch=st.sampled_from([8, 16, 32]),
    micro_batch=st.sampled_from([1, 2]),
    recompute=st.sampled_from(["none", "selective", "full"]),
    recompute_layers=st.sampled_from([None, 1, 2]),
    zero=st.sampled_from([0, 1, 3]),
    cp=st.sampled_from([1, 2]),
    index=st.integers(0, 200),
)
def test_the_floor_bounds_every_layout(
    tiny_model: ModelSpec,
    toy_cluster: ClusterSpec,
    layers: int,
    batch: int,
    micro_batch: int,
    recompute: str,
    recompute_layers: int | None,
    zero: int,
    cp: int,
    index: int,
) -> None:
    model = tiny_model.with_(layers=layers)
    plans = layouts(model, toy_cluster, 8, batch, zero_stage=[zero], cp=[cp])
    if not plans:
        return
    plan = plans[index % len(plans)]
    plan = replace(
        plan,
        micro_batch=micro_batch,
        recompute=recompute,
        recompute_layers=recompute_layers if recompute == "full" else None,
        vp=plan.vp or 1,
        grad_overlap=True,
    )
    got = _floor_and_bound(model, toy_cluster, plan)
    if got is not None:
        floor, bound = got
        assert floor <= bound * (1 + 1e-12), (plan, floor, bound)


def _every_candidate_prepared(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search as it was before the floor: every candidate prepared before the engine runs any."""

    def zero(*args: object) -> float:
        return 0.0

    monkeypatch.setattr(run, "_compute_floor", zero)


def test_skipping_on_the_floor_changes_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    plans = [PlanSpec(tp=tp, pp=pp, dp=16 // (tp * pp), global_batch=64) for tp in (1, 2, 4) for pp in (1, 2, 4)]
    with_floor = [simulate(model, cluster, p, raise_infeasible=False) for p in plans]
    ranked = rank(model, cluster, plans, top=2)
    _every_candidate_prepared(monkeypatch)
    without = [simulate(model, cluster, p, raise_infeasible=False) for p in plans]
    assert with_floor == without
    ranked_without = rank(model, cluster, plans, top=2)
    top = sorted((r.result.step_time_s, i) for i, r in enumerate(ranked) if r.result and r.result.feasible)[:2]
    top_without = sorted(
        (r.result.step_time_s, i) for i, r in enumerate(ranked_without) if r.result and r.result.feasible
    )[:2]
    assert top == top_without
    for i in (i for _, i in top):
        assert ranked[i].result == ranked_without[i].result


def test_the_search_prepares_fewer_candidates_than_it_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the floor is for: candidates that cannot win are never built."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    counts = {"ready": 0, "sized": 0}
    ready, search = run._ready, run._search

    def counting_ready(*args: object) -> run._Prepared:
        counts["ready"] += 1
        return ready(*args)  # type: ignore[arg-type]

    def counting_search(*args: object) -> tuple[list[tuple[float, int, run._Deferred]], run.StepResult | None]:
        found = search(*args)  # type: ignore[arg-type]
        counts["sized"] += len(found[0])
        return found

    monkeypatch.setattr(run, "_ready", counting_ready)
    monkeypatch.setattr(run, "_search", counting_search)
    simulate(model, cluster, PlanSpec(tp=2, pp=4, dp=2, global_batch=64))
    assert 0 < counts["ready"] < counts["sized"], counts
