"""Plans that cannot run are answers, options override files: found by adversarial runs of the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.cli import main
from simulator.errors import InfeasiblePlanError
from simulator.parallel.layout import MAX_PIPELINE_TASKS
from simulator.run import simulate
from simulator.specs import PlanSpec, load_cluster, load_model


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


LLAMA = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100"]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--gpus", "24", "--tp", "3", "--global-batch", "24"], "'tp' must divide 'heads': tp=3, heads=32"),
        (["--gpus", "8", "--global-batch", "10", "--micro-batch", "1"], "'global_batch' must be a multiple"),
    ],
)
def test_a_plan_that_cannot_run_is_a_json_answer_with_exit_3(
    extra: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed nothing on stdout with --format json (only a line on stderr), so a script reading the JSON
    broke; now it is the same document as an out-of-memory answer: feasible false and the reason."""
    code, out, err = _run([*LLAMA, *extra, "--format", "json"], capsys)
    assert code == 3
    answer = json.loads(out)
    assert answer["feasible"] is False
    assert reason in answer["reason"]
    assert answer["step_time_s"] is None
    assert answer["num_gpus"] == int(extra[1])
    assert err == ""
    code, table, _ = _run([*LLAMA, *extra], capsys)
    assert code == 3
    assert f"infeasible: the plan cannot run, whatever its free knobs: {reason}" in table
    assert "memory per stage" not in table  # nothing was sized


def test_bf16_on_a_gpu_without_bf16_tensor_cores_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """V100 has FP16 tensor cores only; bf16 used to run at the FP16 peak."""
    argv = ["simulate", "--model", "llama2-7b", "--cluster", "dgx-v100", "--gpus", "8", "--tp", "8"]
    code, out, _ = _run([*argv, "--global-batch", "16", "--format", "json"], capsys)
    assert code == 3
    assert json.loads(out)["reason"] == "precision bf16 needs BF16 tensor cores; V100-SXM2-32GB has none (use fp16)"
    code, _, _ = _run([*argv, "--global-batch", "16", "--precision", "fp16", "--format", "json"], capsys)
    assert code in (0, 3)  # an answer either way: fp16 runs on V100


def test_gpus_on_the_command_line_overrides_the_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("tp: 8\ngpus: 16\nglobal_batch: 64\nmicro_batch: 1\n")
    code, out, _ = _run([*LLAMA, "--plan", str(plan), "--gpus", "32", "--format", "json"], capsys)
    assert code == 0
    assert json.loads(out)["num_gpus"] == 32
    code, out, _ = _run([*LLAMA, "--plan", str(plan), "--format", "json"], capsys)
    assert json.loads(out)["num_gpus"] == 16


def test_hardware_show_reports_a_broken_cluster_file_as_a_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cluster file with a bad value was retried as a device file, whose error (no peak FLOP/s) hid the real
    one."""
    broken = tmp_path / "my-cluster.yaml"
    text = (Path(__file__).resolve().parents[2] / "hardware_profiles" / "clusters" / "dgx-h100.yaml").read_text()
    broken.write_text(text.replace("gpus_per_node: 8", "gpus_per_node: 0"))
    assert "gpus_per_node: 0" in broken.read_text()
    code, _, err = _run(["hardware", "show", str(broken)], capsys)
    assert code == 2
    assert err.startswith(f"error: {broken}: gpus_per_node: must be >= 1, got 0")


@pytest.mark.parametrize("kind", ["models", "hardware"])
def test_list_takes_no_name(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run([kind, "list", "x"], capsys)
    assert code == 2
    assert err.startswith(f"error: {kind} list: takes no name, got 'x'; use clustersim {kind} show x")


def test_the_engine_guard_counts_interleaved_stages_too() -> None:
    """Found by trying: 100,000 micro-batches on pp 2 passed the micro-batch guard, and with vp free the search
    simulated up to 3.2 million forward passes per candidate (over 6 minutes, 10.9 GB). Forward passes summed
    over stages and chunks are now bounded too; interleaving depths beyond the bound are left out of the search."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    micro_batches = 100_000  # the micro-batch guard's bound: pp 4 · vp 2 makes 800,000 forward passes
    plan = PlanSpec(
        tp=8, pp=4, dp=1, global_batch=micro_batches, micro_batch=1, vp=2, recompute="full", grad_overlap=True
    )
    assert micro_batches * 4 * 2 > MAX_PIPELINE_TASKS
    with pytest.raises(InfeasiblePlanError, match="= 800,000 forward passes per step is more than the 500,000"):
        simulate(model, cluster, plan)


def test_a_plan_that_cannot_run_prints_no_python_none(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by an output audit: the layout line of a plan that could not run printed ``micro_batch=None``."""
    args = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-a100-80g", "--gpus", "8", "--precision", "fp8"]
    assert main([*args, "--global-batch", "8"]) == 3
    out = capsys.readouterr().out
    assert "None" not in out
    assert "micro_batch=free" in out


def test_hardware_list_shows_the_16_bit_format_each_gpu_has(capsys: pytest.CaptureFixture[str]) -> None:
    """V100 has FP16 tensor cores and no BF16 (simulate refuses bf16 there), so the list says fp16 for it."""
    assert main(["hardware", "list"]) == 0
    v100 = next(line for line in capsys.readouterr().out.splitlines() if "V100-SXM2-32GB " in line)
    assert " fp16 " in v100
    assert "bf16" not in v100


def test_one_gpu_is_singular(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "megatron-gpt-1.7b", "--cluster", "dgx-a100-80g", "--gpus", "1"]
    assert main([*args, "--global-batch", "8", "--micro-batch", "1", "--recompute", "full"]) == 0
    assert ": 1 GPU (tp 1" in capsys.readouterr().out


def test_out_of_memory_json_says_which_stage_is_over_by_how_much(capsys: pytest.CaptureFixture[str]) -> None:
    """The README promises the stage and bytes over: in JSON each stage's ``over_bytes`` (0 where it fits)."""
    args = ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--tp", "8", "--gpus", "8"]
    assert main([*args, "--global-batch", "8", "--format", "json"]) == 3
    data = json.loads(capsys.readouterr().out)
    over = [m for m in data["memory"] if m["over_bytes"] > 0]
    assert over
    assert all(m["over_bytes"] == m["total_bytes"] - m["capacity_bytes"] for m in over)


def test_an_out_of_memory_table_says_its_times_are_hypothetical(capsys: pytest.CaptureFixture[str]) -> None:
    """The breakdown of a plan that does not fit is what the step would take if it did; the table said so nowhere."""
    argv = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16"]
    assert main([*argv, "--micro-batch", "1", "--recompute", "none", "--vp", "1", "--grad-overlap"]) == 3
    assert "time breakdown (critical stage 0, if the plan fitted in memory)" in capsys.readouterr().out
    assert main([*argv, "--tp", "8", "--dp", "1"]) == 0
    assert "time breakdown (critical stage 0)\n" in capsys.readouterr().out
