"""`clustersim sweep` (a grid from options or a YAML file, ranked in a table, every row in CSV or JSON) and
`clustersim plan` (the auto-planner): tables, rows, the reproducing command, exit codes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd
import pytest

from simulator.cli import main

BASE = ["sweep", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "32"]
FIXED = ["--micro-batch", "1", "--recompute", "full", "--vp", "1", "--grad-overlap", "true"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_table_ranks_what_fits_and_lists_what_does_not(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*BASE, "--tp", "1,2,3,4", "--pp", "1,2", *FIXED, "--workers", "1"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("sweep: 8 cases in ")
    assert "2 invalid" in lines[0]
    assert lines[1].startswith("best ")
    assert "by step time" in lines[1]
    header = lines[2].split()
    assert header[:5] == ["rank", "case", "tp", "pp", "dp"]
    ranked = lines[3 : lines.index("invalid:")]
    assert len(ranked) == 5
    times = [float(line.split()[header.index("step")]) for line in ranked]
    assert times == sorted(times)
    assert "invalid:" in out
    assert "1 × gpus 16 is not a multiple of tp·pp·cp = 3·2·1" in out


def test_csv_has_every_case_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*BASE, "--tp", "2,4", *FIXED, "--format", "csv", "--workers", "1"], capsys)
    assert code == 0
    frame = pd.read_csv(io.StringIO(out))
    assert list(frame["case"]) == [0, 1]
    assert list(frame["plan.tp"]) == [2, 4]
    assert list(frame["plan.dp"]) == [8, 4]


def test_json_summary_names_the_best_case(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*BASE, "--tp", "2,4", *FIXED, "--format", "json", "--rank-by", "mfu"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["summary"]["cases"] == 2
    assert data["summary"]["ranked_by"] == "mfu"
    best = max(data["rows"], key=lambda r: r["mfu"])
    assert data["summary"]["best_case"] == best["case"]


def test_grid_file_with_what_if_axis_and_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        "model: llama3-8b\ncluster: dgx-h100\ngpus: 32\nglobal_batch: 64\ntp: [4]\npp: [2]\nmicro_batch: 1\n"
        "recompute: full\nvp: 1\ngrad_overlap: true\nset:\n  cluster.nic_bandwidth_gbit_per_s: [100, 400]\n"
    )
    out = tmp_path / "rows.csv"
    code, text, _ = run(["sweep", str(grid), "--out", str(out), "--workers", "1"], capsys)
    assert code == 0
    assert "cluster.nic_bandwidth_gbit_per_s" in text
    assert f"wrote 2 rows to {out}" in text
    frame = pd.read_csv(out)
    assert list(frame["set.cluster.nic_bandwidth_gbit_per_s"]) == [100, 400]
    slow, fast = frame["step_time_s"]
    assert fast <= slow  # a faster network never slows the step


def test_options_override_the_grid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text("model: llama3-8b\ncluster: dgx-h100\ngpus: 16\nglobal_batch: 32\ntp: [1, 2, 4, 8]\n")
    code, out, _ = run(["sweep", str(grid), "--tp", "2", *FIXED, "--format", "csv"], capsys)
    assert code == 0
    assert list(pd.read_csv(io.StringIO(out))["plan.tp"]) == [2]


def test_nothing_fits_exits_3_and_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sweep", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"]
    code, out, _ = run([*argv, "--tp", "1,2", *FIXED, "--workers", "1"], capsys)
    assert code == 3
    assert "0 fit, 2 out of memory" in out
    assert "nothing fits; the closest is case 1: out of memory" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "2,x"], "tp: must be a whole number"),
        (["--tp", "2,,4"], "--tp: has an empty value"),
        (["--set", "cluster.nics_per_node"], "must look like scope.key=value"),
        (["--zero", "5"], "zero_stage: must be <= 3"),
        (["--workers", "0"], "--workers: must be >= 1"),
        (["--out", "rows.txt"], "has no known format"),
        (["--model", "llama3-8"], "llama3-8"),
    ],
)
def test_bad_input_exits_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*BASE, *extra], capsys)
    assert code == 2
    assert err.startswith("error: ")
    assert message in err
    assert "Traceback" not in err


def test_missing_required_axes_are_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["sweep", "--model", "llama3-8b", "--cluster", "dgx-h100"], capsys)
    assert code == 2
    assert "--global-batch: is required" in err


def test_the_grid_file_is_never_the_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = tmp_path / "grid.csv"
    grid.write_text("model: llama3-8b\n")
    code, _, err = run(["sweep", str(grid), "--out", str(grid)], capsys)
    assert code == 2
    assert "is an input of this command" in err


PLAN = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "32"]


def test_plan_ranks_layouts_and_gives_the_command_of_the_fastest(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*PLAN, "--tp", "2,4", "--pp", "1,2", "--zero", "1", "--workers", "1", "--top", "2"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "autoplan: llama3-8b on dgx-h100, 16 GPUs, global batch 32 × 8,192 tokens, bf16"
    assert lines[1].startswith("searched 8 layouts (tp 2,4 · pp 1,2 · cp 1,2 · ep 1 · zero 1)")
    assert lines[2] == "best 2, fastest first:"
    command = lines[-1].split()
    assert command[:2] == ["clustersim", "simulate"]
    # The command reproduces the fastest layout's step time.
    code, again, _ = run(command[1:], capsys)
    assert code == 0
    best_time = lines[4].split()[lines[3].split().index("step")]
    assert f"step time {best_time} s" in again


def test_plan_csv_has_a_row_per_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*PLAN, "--tp", "2,4", "--zero", "1", "--cp", "1", "--format", "csv", "--top", "1"], capsys)
    assert code == 0
    frame = pd.read_csv(io.StringIO(out))
    assert list(frame["layout"]) == list(range(len(frame)))
    assert set(frame["status"]) <= {"ok", "pruned", "out_of_memory", "cannot_run"}
    assert (frame["status"] == "ok").sum() >= 1


def test_plan_json_best_is_fastest_first(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*PLAN, "--tp", "2,4", "--zero", "1", "--format", "json", "--top", "2"], capsys)
    assert code == 0
    data = json.loads(out)
    times = [r["step_time_s"] for r in data["best"]]
    assert times == sorted(times)
    assert len(times) == 2
    assert data["summary"]["searched"]["tp"] == [2, 4]


def test_plan_where_nothing_fits_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"]
    code, out, _ = run([*argv, "--zero", "0", "--pp", "1", "--tp", "1,2", "--workers", "1"], capsys)
    assert code == 3
    assert "nothing fits; the closest is layout" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--precision", "bf16,fp8"], "--precision: takes one value in plan"),
        (["--dp", "4"], "--dp: is what the planner derives"),
        (["--set", "cluster.nics_per_node=4,8"], "takes one value in plan"),
        (["--tp", "3"], "tp: 3 must divide the GPU count (16), the heads (32)"),
        (["--zero", "7"], "zero_stage: must be <= 3"),
    ],
)
def test_plan_bad_input_exits_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*PLAN, *extra], capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_plan_needs_gpus_and_a_batch(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8"], capsys)
    assert code == 2
    assert "--global-batch: is required" in err


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "analysis" / "sweeps").glob("*.yaml")))
def test_shipped_sweep_grids_build_their_cases(path: Path) -> None:
    from simulator.specs._yaml import load_yaml_file
    from simulator.sweep import cases_from_mapping

    cases = cases_from_mapping(load_yaml_file(path), str(path))
    assert cases
    assert all(case.plan is not None for case in cases)


def test_sweep_set_axis_without_a_grid_file(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*BASE, "--tp", "4", *FIXED, "--set", "cluster.nic_bandwidth_gbit_per_s=200,400", "--format", "csv"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert list(pd.read_csv(io.StringIO(out))["set.cluster.nic_bandwidth_gbit_per_s"]) == [200, 400]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top", "-1"], "--top: must be >= 1"),
        (["--set", "cluster.nics_per_node=4", "--set", "cluster.nics_per_node=8"], "is given twice"),
        (["--dask-scheduler", "notaurl"], "scheduler notaurl: cannot be reached"),
    ],
)
def test_more_sweep_bad_input(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*BASE, "--tp", "4", *FIXED, *extra], capsys)
    assert code == 2
    assert message in err


def test_sweep_never_writes_over_a_model_in_its_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.yaml"
    model.write_text((Path(__file__).resolve().parents[2] / "models" / "llama3-8b.yaml").read_text())
    argv = ["sweep", "--model", f"{model},llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16"]
    code, _, err = run([*argv, "--out", str(model)], capsys)
    assert code == 2
    assert "is an input of this command" in err


def test_plan_takes_set_plan_keys_and_the_printed_command_reproduces_booleans(
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra = ["--set", "plan.tp=2", "--sequence-parallel", "true", "--tp-overlap", "false", "--zero", "1", "--top", "1"]
    code, out, _ = run([*PLAN, *extra, "--workers", "1"], capsys)
    assert code == 0
    command = out.splitlines()[-1].split()
    assert "--sequence-parallel" in command
    assert "--no-tp-overlap" in command
    assert command.count("--tp") == 1
    code, again, err = run(command[1:], capsys)
    assert code == 0, err
    header, first = out.splitlines()[3].split(), out.splitlines()[4].split()
    assert f"step time {first[header.index('step')]} s" in again


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "plan.dp=2"], "is what the planner derives"),
        (["--set", "plan.bogus=1"], "bogus: is not a plan key"),
        (["--set", "plan.tp=2", "--tp", "4"], "--set plan.tp: is also given as --tp"),
        (["--top", "0"], "--top: must be >= 1"),
        (["--max-tp", "0"], "max_tp: must be a whole number >= 1"),
    ],
)
def test_more_plan_bad_input(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*PLAN, *extra, "--workers", "1"], capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_plan_with_a_knob_some_layouts_do_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*PLAN, "--vp", "2", "--zero", "1", "--top", "1", "--workers", "1"], capsys)
    assert code == 0
    assert "--vp 2" in out.splitlines()[-1]


def test_plan_gives_the_same_bytes_on_any_number_of_workers(capsys: pytest.CaptureFixture[str]) -> None:
    outputs = []
    for workers in ("1", "2"):
        code, out, _ = run([*PLAN, "--zero", "1", "--top", "3", "--format", "csv", "--workers", workers], capsys)
        assert code == 0
        outputs.append(out)
    assert outputs[0] == outputs[1]
