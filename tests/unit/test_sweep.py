"""Sweeps: cases from grids, one row per case in the cases' order, every status kept, the same bytes in-process and
on worker processes, and a killed sweep resumed from its journal."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from simulator import sweep as sweep_module
from simulator.errors import SpecError
from simulator.run import row_columns, simulate
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec
from simulator.sweep import STATUSES, Case, cases_from_mapping, grid, sweep

FIXED = {"micro_batch": 1, "recompute": "none", "grad_overlap": True, "vp": 1}


def _cases(model: ModelSpec, cluster: ClusterSpec) -> list[Case]:
    # tp 3 does not divide 8 GPUs (invalid), tp 8 does not divide... the 8 heads it does; pp 16 exceeds the layers.
    return grid(model, cluster, gpus=8, tp=[1, 2, 3, 4], pp=[1, 2, 16], global_batch=16, **FIXED)


def test_grid_order_and_derived_dp(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    cases = grid(tiny_model, toy_cluster, gpus=8, tp=[1, 2], pp=[1, 4], global_batch=16)
    assert [(c.plan.tp, c.plan.pp, c.plan.dp) for c in cases if c.plan] == [(1, 1, 8), (1, 4, 2), (2, 1, 4), (2, 4, 1)]


def test_grid_keeps_combinations_that_are_no_plan(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    cases = grid(tiny_model, toy_cluster, gpus=8, tp=[3], pp=[1, 2], vp=[2], global_batch=16)
    assert [c.plan for c in cases] == [None, None]
    assert cases[0].problem == "gpus 8 is not a multiple of tp·pp·cp = 3·1·1"
    assert dict(cases[0].knobs) == {"gpus": 8, "tp": 3, "pp": 1, "vp": 2, "global_batch": 16}


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"tp": [1, "x"], "global_batch": 8}, "tp: must be a whole number"),
        ({"tp": [], "global_batch": 8}, "tp: is an empty list"),
        ({"tpp": [1], "global_batch": 8}, "is not a plan knob (did you mean 'tp'?)"),
        ({"tp": [1]}, "global_batch: is required"),
        ({"tp": "auto", "global_batch": 8}, "does not choose tp"),
        ({"recompute": ["full", "most"], "global_batch": 8}, "recompute: must be one of"),
        ({"dp": [1, 2], "global_batch": 8}, "dp: is derived from gpus"),
    ],
)
def test_grid_refuses_bad_values(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, knobs: dict[str, object], message: str
) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        grid(tiny_model, toy_cluster, gpus=8, **knobs)


def test_grid_refuses_a_bad_gpu_count(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    with pytest.raises(SpecError, match="gpus: must be >= 1"):
        grid(tiny_model, toy_cluster, gpus=[8, 0], global_batch=8)


def test_grid_refuses_more_cases_than_the_guard(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweep_module, "MAX_CASES", 3)
    with pytest.raises(SpecError, match="has 4 combinations, more than 3"):
        grid(tiny_model, toy_cluster, gpus=8, tp=[1, 2], pp=[1, 2], global_batch=8)


def test_every_case_is_a_row_with_its_status(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    big = tiny_model.with_(hidden=8192, ffn_hidden=32768, heads=64, kv_heads=64)  # too big for 16 GiB at tp 1
    cases = [
        Case(tiny_model, toy_cluster, PlanSpec(tp=2, dp=4, global_batch=16, **FIXED)),
        Case(big, toy_cluster, PlanSpec(dp=8, global_batch=16, **FIXED)),
        Case(tiny_model, toy_cluster, PlanSpec(tp=3, global_batch=16, **FIXED)),  # 3 does not divide 8 heads
        *grid(tiny_model, toy_cluster, gpus=8, tp=5, global_batch=16),
    ]
    frame = sweep(cases)
    assert list(frame["case"]) == [0, 1, 2, 3]
    assert list(frame["status"]) == ["ok", "out_of_memory", "cannot_run", "invalid"]
    assert set(frame["status"]) <= set(STATUSES)
    assert list(frame.columns) == ["case", "status", *row_columns()]
    ok, oom, cannot, invalid = (frame.iloc[i] for i in range(4))
    assert ok["feasible"]
    assert ok["step_time_s"] > 0
    assert not oom["feasible"]
    assert oom["over_bytes"] > 0
    assert oom["step_time_s"] > 0
    assert "'tp' must divide 'heads'" in cannot["reason"]
    assert math.isnan(cannot["step_time_s"])
    assert invalid["reason"] == "gpus 8 is not a multiple of tp·pp·cp = 5·1·1"
    assert invalid["plan.tp"] == 5
    assert invalid["num_gpus"] == 8
    assert pd.isna(invalid["plan.dp"])


def test_rows_are_simulate_rows(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    cases = grid(tiny_model, toy_cluster, gpus=8, tp=[1, 2], global_batch=16)  # free knobs chosen per case
    frame = sweep(cases)
    for case, (_, row) in zip(cases, frame.iterrows(), strict=True):
        assert case.plan is not None
        expected = simulate(tiny_model, toy_cluster, case.plan).to_row()
        got = {k: row[k] for k in expected}
        assert json.dumps(got, default=str) == json.dumps(expected, default=str)


def test_time_oom_false_answers_from_memory_alone(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    big = tiny_model.with_(hidden=8192, ffn_hidden=32768, heads=64, kv_heads=64)
    frame = sweep([Case(big, toy_cluster, PlanSpec(dp=8, global_batch=16, **FIXED))], time_oom=False)
    assert frame.loc[0, "status"] == "out_of_memory"
    assert pd.isna(frame.loc[0, "step_time_s"])


def test_worker_processes_give_the_same_bytes(tiny_model: ModelSpec, toy_cluster: ClusterSpec, tmp_path: Path) -> None:
    cases = _cases(tiny_model, toy_cluster)
    sweep(cases, out=tmp_path / "one.csv")
    sweep(cases, workers=2, out=tmp_path / "two.csv")
    assert (tmp_path / "one.csv").read_bytes() == (tmp_path / "two.csv").read_bytes()
    assert not list(tmp_path.glob("*.journal"))


def test_a_killed_sweep_resumes_from_its_journal(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = _cases(tiny_model, toy_cluster)
    whole = tmp_path / "whole.csv"
    sweep(cases, out=whole)

    out = tmp_path / "rows.csv"
    real_row = sweep_module._row
    calls: list[int] = []

    def dying_row(case: Case, time_oom: bool) -> dict[str, object]:
        calls.append(1)
        if len(calls) > 9:  # killed during the second batch of eight
            raise KeyboardInterrupt
        return real_row(case, time_oom)

    monkeypatch.setattr(sweep_module, "_row", dying_row)
    with pytest.raises(KeyboardInterrupt):
        sweep(cases, out=out)
    journal = tmp_path / "rows.csv.journal"
    assert not out.exists()
    assert len(journal.read_text().splitlines()) == 8
    with journal.open("a") as handle:
        handle.write('{"key": "cut off by the kill')  # a line cut short is skipped

    calls.clear()
    monkeypatch.setattr(sweep_module, "_row", lambda case, t: (calls.append(1), real_row(case, t))[1])
    sweep(cases, out=out)
    assert len(calls) == len(cases) - 8
    assert out.read_bytes() == whole.read_bytes()
    assert not journal.exists()


def test_a_journal_row_of_other_inputs_is_not_reused(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, tmp_path: Path
) -> None:
    out = tmp_path / "rows.csv"
    case = Case(tiny_model, toy_cluster, PlanSpec(dp=8, global_batch=16, **FIXED))
    (tmp_path / "rows.csv.journal").write_text(json.dumps({"key": "0" * 64, "row": {"status": "ok"}}) + "\n")
    frame = sweep([case], out=out)
    assert frame.loc[0, "step_time_s"] == simulate(tiny_model, toy_cluster, case.plan).step_time_s  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json"])
def test_output_formats_round_trip(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, tmp_path: Path, suffix: str
) -> None:
    frame = sweep(
        grid(tiny_model, toy_cluster, gpus=8, tp=[1, 2], global_batch=16, **FIXED), out=tmp_path / f"r{suffix}"
    )
    path = tmp_path / f"r{suffix}"
    readers = {".csv": pd.read_csv, ".parquet": pd.read_parquet, ".json": lambda p: pd.read_json(p, precise_float=True)}
    back = readers[suffix](path)
    assert list(back.columns) == list(frame.columns)
    assert list(back["step_time_s"]) == list(frame["step_time_s"])


def test_an_unknown_output_format_is_bad_input(tiny_model: ModelSpec, toy_cluster: ClusterSpec, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"out .*r\.txt: has no known format"):
        sweep([], out=tmp_path / "r.txt")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"workers": 0}, "workers: must be a whole number >= 1"), ({"time_oom": "no"}, "time_oom: must be True or False")],
)
def test_bad_arguments_are_spec_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        sweep([], **kwargs)  # type: ignore[arg-type]


def test_a_case_that_is_not_a_case_is_bad_input() -> None:
    with pytest.raises(SpecError, match="case 0: must be a Case or a"):
        sweep(["gpt3-175b"])  # type: ignore[list-item]


def test_labels_become_columns(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    fast = replace(toy_cluster, nic_bandwidth_bytes_per_s=50e9)
    plan = PlanSpec(dp=8, global_batch=16, **FIXED)
    frame = sweep(
        [
            Case(tiny_model, toy_cluster, plan).labelled(network="1x"),
            Case(tiny_model, fast, plan).labelled(network="2x"),
        ]
    )
    assert list(frame.columns[:3]) == ["case", "network", "status"]
    assert list(frame["network"]) == ["1x", "2x"]


@pytest.mark.parametrize("name", ["step_time_s", "status", "case", ""])
def test_a_label_may_not_shadow_a_column(tiny_model: ModelSpec, toy_cluster: ClusterSpec, name: str) -> None:
    with pytest.raises(SpecError, match="not one of the result's columns"):
        Case(tiny_model, toy_cluster, PlanSpec(global_batch=8), labels=((name, 1),))


def test_the_dask_scheduler_gives_the_same_rows(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    distributed = pytest.importorskip("distributed")
    cases = _cases(tiny_model, toy_cluster)
    local = sweep(cases)
    with (
        distributed.LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        assert sweep(cases, scheduler=client).equals(local)
        assert sweep(cases, scheduler=cluster.scheduler_address).equals(local)


def test_a_bad_scheduler_is_bad_input(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    pytest.importorskip("distributed")
    case = Case(tiny_model, toy_cluster, PlanSpec(dp=8, global_batch=16, **FIXED))
    with pytest.raises(SpecError, match="scheduler: must be a scheduler address"):
        sweep([case], scheduler=42)


def test_cases_from_a_grid_mapping_label_what_ifs() -> None:
    data = {
        "model": "llama3-8b",
        "cluster": ["dgx-h100"],
        "gpus": 16,
        "tp": [2, 4],
        "global_batch": 64,
        "set": {"cluster.nic_bandwidth_gbit_per_s": [200, 400]},
    }
    cases = cases_from_mapping(data, "grid.yaml")
    assert [(dict(c.labels)["set.cluster.nic_bandwidth_gbit_per_s"], c.plan.tp) for c in cases if c.plan] == [
        (200, 2),
        (200, 4),
        (400, 2),
        (400, 4),
    ]
    slow, fast = cases[0].cluster, cases[2].cluster
    assert fast.nic_bandwidth_bytes_per_s == 2 * slow.nic_bandwidth_bytes_per_s
    assert cases[0].cluster is cases[1].cluster  # loaded once per distinct override


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"model": "llama3-8b", "cluster": "dgx-h100", "gpus": 8, "global_batch": 8, "tpp": 2},
            "tpp: is not a grid key",
        ),
        ({"model": "llama3-8b", "cluster": "dgx-h100", "gpus": 8}, "global_batch: is required"),
        ({"model": [], "cluster": "dgx-h100", "global_batch": 8}, "model: is required"),
        ({"model": "llama3-8b", "cluster": "dgx-h100", "global_batch": 8, "set": {"nics": [1]}}, "must look like"),
        ({"model": "llama3-8b", "cluster": "dgx-h100", "global_batch": 8, "set": [1]}, "set: must map"),
        ({"model": 3, "cluster": "dgx-h100", "global_batch": 8}, "model: must name a model"),
        (["model"], "must be a mapping"),
    ],
)
def test_bad_grid_mappings(data: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        cases_from_mapping(data, "grid.yaml")


def test_axis_values_are_read_canonically_and_kept_once(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    cases = grid(
        tiny_model, toy_cluster, gpus=[8, 8.0], recompute=["full", "Full"], micro_batch=["auto", 1], global_batch=16
    )
    assert [(c.plan.recompute, c.plan.micro_batch) for c in cases if c.plan] == [("full", None), ("full", 1)]


def test_a_non_finite_value_is_bad_input(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    with pytest.raises(SpecError, match="expert_imbalance: must be finite"):
        grid(tiny_model, toy_cluster, gpus=8, expert_imbalance=[math.nan, 1.0], global_batch=16)
    with pytest.raises(SpecError, match="expert_imbalance: must be finite"):
        cases_from_mapping(
            {
                "model": "llama3-8b",
                "cluster": "dgx-h100",
                "global_batch": 8,
                "set": {"plan.expert_imbalance": [math.inf]},
            },
            "grid.yaml",
        )


def test_parquet_takes_columns_that_mix_types(tiny_model: ModelSpec, toy_cluster: ClusterSpec, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    plan = PlanSpec(dp=8, global_batch=16, **FIXED)
    cases = [
        Case(tiny_model, toy_cluster, plan, labels={"what": 1}),
        Case(tiny_model, toy_cluster, plan, labels={"what": "x"}),
    ]
    sweep(cases, out=tmp_path / "rows.parquet")
    assert list(pd.read_parquet(tmp_path / "rows.parquet")["what"]) == ["1", "x"]


def test_journal_rows_of_other_columns_are_redone(
    tiny_model: ModelSpec, toy_cluster: ClusterSpec, tmp_path: Path
) -> None:
    case = Case(tiny_model, toy_cluster, PlanSpec(dp=8, global_batch=16, **FIXED))
    key = sweep_module._case_keys([case], True)[0]
    (tmp_path / "rows.csv.journal").write_text(json.dumps({"key": key, "row": {"status": "ok", "mfu": None}}) + "\n")
    frame = sweep([case], out=tmp_path / "rows.csv")
    assert frame.loc[0, "mfu"] > 0


@pytest.mark.parametrize("labels", ["ab", ["ab"], [("a",)]])
def test_labels_must_be_named_pairs(tiny_model: ModelSpec, toy_cluster: ClusterSpec, labels: object) -> None:
    with pytest.raises(SpecError, match="labels: must be a mapping of names to values"):
        Case(tiny_model, toy_cluster, PlanSpec(global_batch=8), labels=labels)  # type: ignore[arg-type]


def test_a_malformed_scheduler_address_is_bad_input(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    pytest.importorskip("distributed")
    case = Case(tiny_model, toy_cluster, PlanSpec(dp=8, global_batch=16, **FIXED))
    with pytest.raises(SpecError, match="scheduler notaurl: cannot be reached"):
        sweep([case], scheduler="notaurl")


def test_row_columns_are_to_rows_keys(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    # A sweep's DataFrame is built with these columns: a key to_row gained would otherwise be dropped silently.
    row = simulate(tiny_model, toy_cluster, PlanSpec(dp=8, global_batch=16, **FIXED)).to_row()
    assert tuple(row) == row_columns()
