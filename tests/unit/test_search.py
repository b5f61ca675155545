"""Layout enumeration and the auto-planner: only layouts Megatron-LM would start, and a ranking whose answers are
exactly simulate's, with the engine run only where it can change the top."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator import run
from simulator.errors import SpecError
from simulator.run import rank, simulate
from simulator.search.layouts import CP_MIN_TOKENS_PER_RANK, DEFAULT_ZERO_STAGES, axes_of, layouts
from simulator.search.planner import autoplan
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec, MoESpec
from simulator.specs.plan import PlanSpec


def test_layouts_follow_megatrons_rules(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    model = tiny_model.with_(hidden=768, heads=12, kv_heads=4, layers=6, seq_len=16384)
    found = layouts(model, toy_cluster, 16, 32)
    assert found
    for p in found:
        assert p.num_gpus == 16
        assert model.heads % p.tp == 0
        assert model.kv_heads % p.tp == 0
        assert p.tp <= toy_cluster.nvlink_domain_gpus
        assert model.layers % p.pp == 0 or (model.layers + 2) % p.pp == 0
        assert 32 % p.dp == 0
        assert p.cp == 1 or model.seq_len // p.cp >= CP_MIN_TOKENS_PER_RANK
    axes = axes_of(found)
    assert axes["tp"] == [1, 2, 4]  # 8 divides neither 12 heads nor 4 KV heads
    assert axes["pp"] == [1, 2, 4, 8]  # 6 layers: 2 splits them; 4 and 8 split them with the embedding and the loss
    assert axes["cp"] == [1, 2, 4]
    assert axes["zero_stage"] == list(DEFAULT_ZERO_STAGES)


def test_pinned_degrees_narrow_the_search(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    found = layouts(tiny_model, toy_cluster, 8, 16, tp=[2, 3], pp=[2], zero_stage=[1], max_tp=2)
    assert [(p.tp, p.pp, p.dp, p.zero_stage) for p in found] == [(2, 2, 2, 1)]


def test_fixed_knobs_reach_every_layout(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    found = layouts(tiny_model, toy_cluster, 8, 16, zero_stage=[1], micro_batch=2, precision="fp16")
    assert {(p.micro_batch, p.precision) for p in found} == {(2, "fp16")}


def test_expert_degrees_divide_the_experts_and_dp_cp(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    moe = replace(tiny_model, moe=MoESpec(num_experts=6, top_k=2, expert_ffn_hidden=1024))
    found = layouts(moe, toy_cluster, 8, 16, tp=[1], pp=[1], zero_stage=[1])
    assert sorted(p.ep for p in found) == [1, 2]  # 3 and 6 do not divide dp 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_gpus": 0}, "num_gpus: must be a whole number >= 1"), ({"tp": [0]}, "tp: must hold whole numbers")],
)
def test_bad_layout_arguments(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, kwargs: dict[str, object], message: str
) -> None:
    args = {"num_gpus": 8, "global_batch": 8, **kwargs}
    with pytest.raises(SpecError, match=message):
        layouts(tiny_model, toy_cluster, **args)  # type: ignore[arg-type]


def _simulated(model: ModelSpec, cluster: ClusterSpec, plans: list[PlanSpec]) -> list[run.StepResult]:
    return [simulate(model, cluster, p, raise_infeasible=False, time_oom=False) for p in plans]


def _top(results: list[run.StepResult | None], k: int) -> list[int]:
    timed = [(r.step_time_s, i) for i, r in enumerate(results) if r is not None and r.feasible]
    return [i for _, i in sorted(timed)[:k]]


@pytest.mark.parametrize("top", [1, 3])
def test_rank_answers_as_simulate_and_finds_the_same_top(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, top: int
) -> None:
    model = tiny_model.with_(layers=8, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192, seq_len=2048)
    plans = layouts(model, toy_cluster, 8, 32, zero_stage=[0, 1])
    plans.append(PlanSpec(tp=3, global_batch=32))  # cannot run
    ranked = rank(model, toy_cluster, plans, top=top)
    each = _simulated(model, toy_cluster, plans)
    for entry, expected in zip(ranked, each, strict=True):
        if entry.result is not None:
            assert entry.result == expected
        else:
            assert expected.feasible  # only plans that fit are pruned, with a bound below their time
            assert entry.bound_s <= expected.step_time_s * (1 + 1e-9)
    assert _top([e.result for e in ranked], top) == _top(list(each), top)
    assert ranked[-1].result is not None
    assert ranked[-1].result.status == "cannot_run"


def test_rank_runs_the_engine_less_than_simulating_each(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model.with_(layers=8, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192, seq_len=2048)
    plans = layouts(model, toy_cluster, 8, 32, zero_stage=[1])
    runs: list[int] = []
    finish = run._finish

    def counting(*args: object) -> run.StepResult:
        runs.append(1)
        return finish(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(run, "_finish", counting)
    rank(model, toy_cluster, plans, top=1)
    pooled = len(runs)
    runs.clear()
    _simulated(model, toy_cluster, plans)
    assert pooled < len(runs)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.sampled_from([4, 6, 8]),
    batch=st.sampled_from([8, 16, 24]),
    nic=st.sampled_from([5e9, 25e9, 100e9]),
    top=st.integers(1, 4),
)
def test_rank_top_matches_simulating_each(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, layers: int, batch: int, nic: float, top: int
) -> None:
    model = tiny_model.with_(layers=layers)
    cluster = replace(toy_cluster, nic_bandwidth_bytes_per_s=nic)
    plans = layouts(model, cluster, 8, batch, zero_stage=[0, 1], cp=[1])
    ranked = rank(model, cluster, plans, top=top)
    each = _simulated(model, cluster, plans)
    assert _top([e.result for e in ranked], top) == _top(list(each), top)
    assert all(e.result is None or e.result == s for e, s in zip(ranked, each, strict=True))


def test_rank_refuses_bad_arguments(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    with pytest.raises(SpecError, match="top: must be a whole number >= 1"):
        rank(tiny_model, toy_cluster, [], top=0)
    with pytest.raises(SpecError, match=r"plans\[0\]: must be a PlanSpec"):
        rank(tiny_model, toy_cluster, [{"tp": 1}])  # type: ignore[list-item]


def test_autoplan_workers_give_the_same_answer(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    model = tiny_model.with_(layers=8, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192, seq_len=2048)
    one = autoplan(model, toy_cluster, 8, 32, top=3)
    two = autoplan(model, toy_cluster, 8, 32, top=3, workers=2)
    assert one.best == two.best
    assert one.best_layouts == two.best_layouts
    assert len(one.best) == 3
    assert [r.step_time_s for r in one.best] == sorted(r.step_time_s for r in one.best)


def test_autoplan_rows_say_what_became_of_every_layout(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    big = tiny_model.with_(layers=8, hidden=4096, heads=32, kv_heads=32, ffn_hidden=16384, seq_len=2048)
    found = autoplan(big, toy_cluster, 8, 32, top=1, zero_stage=[0])
    frame = found.to_frame(big, toy_cluster)
    assert list(frame["layout"]) == list(range(len(found.layouts)))
    assert set(frame["status"]) <= {"ok", "pruned", "out_of_memory", "cannot_run"}
    counts = found.counts()
    assert counts["out_of_memory"] > 0
    pruned = frame[frame["status"] == "pruned"]
    assert pruned["feasible"].all()
    assert pruned["step_time_s"].isna().all()
    assert pruned["bound_s"].notna().all()
    assert pruned["reason"].str.startswith("pruned: not among the 1 fastest layout, so not timed").all()
    assert counts["ok"] == 1  # only the top keep their results, whatever else the ranking timed


def test_autoplan_without_any_layout_is_bad_input(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    with pytest.raises(SpecError, match="no layout of tiny fits the rules"):
        autoplan(tiny_model, toy_cluster, 8, 3, tp=[1], pp=[1], cp=[1])  # dp 8 does not divide a batch of 3


def test_layouts_skip_combinations_the_fixed_knobs_do_not_suit(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    found = layouts(tiny_model, toy_cluster, 8, 16, vp=2, zero_stage=[1])
    assert found
    assert all(p.pp > 1 for p in found)  # vp 2 needs a pipeline
    with pytest.raises(SpecError, match="no layout takes the knobs given: vp: must be 1 without pipeline"):
        layouts(tiny_model, toy_cluster, 8, 16, vp=2, pp=[1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 1}, "dp: is searched or derived here"),
        ({"bogus": 1}, "bogus: is not a plan key"),
        ({"seq_len": "x"}, "seq_len: must be a whole number"),
        ({"max_tp": "x"}, "max_tp: must be a whole number >= 1"),
        ({"max_tp": 0}, "max_tp: must be a whole number >= 1"),
        ({"zero_stage": [-1]}, "zero_stage: must hold whole numbers from 0 to 3"),
        ({"tp": "4"}, "tp: must be a whole number or a list of them"),
        ({"tp": [3]}, "3 must divide the GPU count (8), the heads (8)"),
    ],
)
def test_layouts_refuse_bad_knobs(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        layouts(tiny_model, toy_cluster, 8, 16, **kwargs)  # type: ignore[arg-type]


def test_a_single_degree_pins_it(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    assert {p.tp for p in layouts(tiny_model, toy_cluster, 8, 16, tp=4)} == {4}


def test_autoplan_refuses_a_name_for_a_model(toy_cluster: ClusterSpec) -> None:
    with pytest.raises(SpecError, match="model: must be a ModelSpec, got str"):
        autoplan("llama3-8b", toy_cluster, 8, 16)  # type: ignore[arg-type]


def test_rank_reads_a_generator_once(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    plans = (PlanSpec(tp=tp, dp=8 // tp, global_batch=16) for tp in (1, 2))
    assert len(rank(tiny_model, toy_cluster, plans)) == 2
