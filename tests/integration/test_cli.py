"""The CLI on small configurations: the commands a new user runs first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.cli import main
from simulator.specs.library import KINDS, data_roots

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


SIM = [
    "simulate",
    "--model",
    "gpt3-175b",
    "--cluster",
    "dgx-a100-80g",
    "--gpus",
    "64",
    "--tp",
    "8",
    "--pp",
    "8",
    "--global-batch",
    "32",
    "--micro-batch",
    "1",
    "--recompute",
    "selective",
    "--vp",
    "1",
]


def test_simulate_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(SIM, capsys)
    assert code == 0, err
    assert "step time" in out
    assert "MFU" in out
    assert "time breakdown (critical stage" in out
    assert "memory per stage (GiB)" in out
    assert out.count("  stage ") == 8


def test_simulate_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (CLI JSON): the documented keys, per-stage memory with its breakdown, and the time breakdown."""
    code, out, _ = run([*SIM, "--format", "json"], capsys)
    assert code == 0
    data = json.loads(out)
    for key in (
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "hfu",
        "feasible",
        "reason",
        "memory",
        "breakdown",
        "chosen",
        "uncalibrated_ops",
    ):
        assert key in data
    assert data["feasible"] is True
    assert len(data["memory"]) == 8
    assert set(data["memory"][0]) >= {
        "weights_bytes",
        "gradients_bytes",
        "optimizer_bytes",
        "activations_bytes",
        "buffers_bytes",
        "total_bytes",
        "capacity_bytes",
    }
    for key in ("compute_s", "tp_exposed_s", "pp_exposed_s", "dp_exposed_s", "bubble_s", "optimizer_s"):
        assert key in data["breakdown"]


def test_every_plan_key_has_a_flag_and_comes_back_in_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    """A plan key is declared once, on PlanSpec: simulate has a flag for each (but the what-if factors, set with
    --set plan.KEY=VALUE), and the JSON's plan section gives every key back, so the plan can be run again."""
    from simulator.cli import _build_parser
    from simulator.specs.plan import PlanSpec

    args = _build_parser().parse_args(["simulate", "--model", "m", "--cluster", "c", "--global-batch", "1"])
    factors = {"expert_imbalance", "straggler_factor"}
    assert [k for k in PlanSpec.field_names() if not hasattr(args, k)] == sorted(factors)
    code, out, _ = run([*SIM, "--format", "json", "--set", "plan.straggler_factor=1.1"], capsys)
    assert code == 0
    plan = json.loads(out)["plan"]
    assert list(plan) == list(PlanSpec.field_names())
    assert plan["straggler_factor"] == 1.1
    assert PlanSpec(**plan).as_dict() == plan


def test_free_knobs_are_chosen_and_reported(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (free knobs): the four free knobs appear under chosen in the CLI output."""
    argv = [
        "simulate",
        "--model",
        "gpt3-175b",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "64",
        "--tp",
        "8",
        "--pp",
        "8",
        "--global-batch",
        "32",
        "--format",
        "json",
    ]
    code, out, _ = run(argv, capsys)
    data = json.loads(out)
    assert code == 0
    assert set(data["chosen"]) == {"micro_batch", "vp", "recompute", "grad_overlap"}


def test_what_if_faster_network(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (what-if): a faster NIC shortens a network-bound step."""
    argv = [
        "simulate",
        "--model",
        "gpt3-175b",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "512",
        "--tp",
        "8",
        "--pp",
        "8",
        "--global-batch",
        "256",
        "--micro-batch",
        "1",
        "--recompute",
        "selective",
        "--vp",
        "1",
        "--no-grad-overlap",
        "--format",
        "json",
    ]
    _, base, _ = run(argv, capsys)
    _, fast, _ = run([*argv, "--set", "cluster.nic_bandwidth_gbit_per_s=400"], capsys)
    assert json.loads(fast)["step_time_s"] < json.loads(base)["step_time_s"]


def test_infeasible_memory_is_an_answer_with_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3: GPT-3 175B on 8 A100s is infeasible: exit 3, the stage and bytes over in the answer."""
    argv = [
        "simulate",
        "--model",
        "gpt3-175b",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "8",
        "--global-batch",
        "8",
        "--micro-batch",
        "1",
        "--recompute",
        "full",
    ]
    code, out, _ = run(argv, capsys)
    assert code == 3
    assert "infeasible: out of memory: stage 0 needs" in out
    assert "over" in out


def test_trace_is_chrome_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (trace): one process per stage, idle slices, byte-identical twice."""
    trace = tmp_path / "trace.json"
    code, _, _ = run([*SIM, "--trace", str(trace)], capsys)
    assert code == 0
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"stage {s}" for s in range(8)}
    slices = [e for e in events if e["ph"] == "X"]
    assert any(e["name"] == "bubble" and e["cat"] == "idle" for e in slices), "bubbles must be visible"
    assert any(e["name"].startswith("F0.") for e in slices)
    again = tmp_path / "again.json"
    run([*SIM, "--trace", str(again)], capsys)
    assert again.read_bytes() == trace.read_bytes()


def test_models_and_hardware_listings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["models", "list"], capsys)
    assert code == 0
    assert "gpt3-175b" in out
    assert "mixtral-8x7b" in out
    code, out, _ = run(["models", "show", "mixtral-8x7b"], capsys)
    assert code == 0
    assert "active" in out
    code, out, _ = run(["hardware", "list"], capsys)
    assert code == 0
    assert "dgx-h100" in out
    assert "H100-SXM5-80GB" in out
    code, out, _ = run(["hardware", "show", "dgx-h100"], capsys)
    assert code == 0
    assert "NVLS yes" in out
    code, out, _ = run(["hardware", "show", "H100-SXM5-80GB"], capsys)
    assert code == 0
    assert "989.4 TFLOP/s" in out


@pytest.mark.parametrize("fmt", ["table", "json", "dot"])
def test_graph_formats(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (graph): table, json and dot formats, with the Llama 3 405B total."""
    code, out, _ = run(
        ["graph", "--model", "llama3-405b", "--seq-len", "4096", "--micro-batch", "2", "--format", fmt], capsys
    )
    assert code == 0
    if fmt == "json":
        data = json.loads(out)
        assert data["totals"]["parameters"] == pytest.approx(405.85e9, rel=1e-3)
        assert {op["phase"] for op in data["ops"]} >= {"fwd", "bwd_input", "bwd_weight", "bwd", "opt"}
    elif fmt == "dot":
        assert out.startswith("digraph")
        assert "->" in out
    else:
        assert "layer.dense" in out
        assert "attn.qkv" in out


def test_graph_shapes_print_whole_numbers_in_full(capsys: pytest.CaptureFixture[str]) -> None:
    """A 1,048,576-token GEMM's shape was printed 1.04858e+06 (six significant digits) once shapes allowed the
    experts' fractional token average; whole numbers print in full, fractions to two decimals."""
    argv = ["graph", "--model", "llama3-8b", "--seq-len", "131072", "--micro-batch", "8", "--format", "json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    shapes = {op["op"]: op["shape"] for op in json.loads(out)["ops"]}
    assert shapes["attn.qkv"] == "[1048576x4096]·[4096x6144]"
    code, out, _ = run(["graph", "--model", "mixtral-8x7b", "--seq-len", "4095", "--format", "json"], capsys)
    assert {op["op"]: op["shape"] for op in json.loads(out)["ops"]}["moe.experts.up"] == "8x[1023.75x4096]·[4096x28672]"


def test_graph_table_columns_hold_long_sequences(capsys: pytest.CaptureFixture[str]) -> None:
    """At 131k tokens attn.core.bwd's GFLOP (22517998.14) was wider than its column and pushed the row out of
    line with the header: every number now ends under its header."""
    code, out, _ = run(["graph", "--model", "llama3-405b", "--seq-len", "131072", "--micro-batch", "16"], capsys)
    assert code == 0
    lines = out.splitlines()
    header = lines[1]
    ends = [header.index(h) + len(h) for h in ("GFLOP", "MB moved", "params M", "act MB")]
    table = lines[2 : lines.index("")]
    assert any("22517998.14" in line for line in table)
    for line in table:
        numbers = line.split()[-4:]
        assert [line.index(n, e - len(n)) + len(n) for n, e in zip(numbers, ends, strict=True)] == ends, line


@pytest.mark.parametrize(
    ("calibration", "note"),
    [
        ("calibration: a100-sxm4-80gb\n", "table a100-sxm4-80gb was measured on A100-SXM4-80GB, not on its device"),
        # (no table at all: test_cli_answers' hint that names the device's shipped one)
        ("calibration: h100-sxm5-80gb\n", None),
    ],
)
def test_a_cluster_file_with_another_devices_table_is_noted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], calibration: str, note: str | None
) -> None:
    """A hand-written H100 cluster naming the A100 table ran its kernels at A100 efficiencies without a word."""
    text = (ROOT / "hardware_profiles" / "clusters" / "dgx-h100.yaml").read_text()
    lines = [line for line in text.splitlines(keepends=True) if not line.startswith("calibration:")]
    cluster = tmp_path / "mine.yaml"
    cluster.write_text("".join(lines).replace("name: dgx-h100", "name: mine") + calibration)
    argv = ["simulate", "--model", "llama3-8b", "--cluster", str(cluster), "--gpus", "8", "--tp", "8"]
    argv += ["--global-batch", "8"]
    code, _, err = run(argv, capsys)
    assert code == 0
    if note is None:
        assert "note:" not in err
    else:
        assert note in err
    code, out, _ = run(["check", str(cluster)], capsys)  # check had called the other device's table "uncalibrated"
    assert code == 0
    assert ("calibrated on another device: see the note" in out) is (note is not None)
    assert "uncalibrated" not in out


@pytest.mark.parametrize(
    ("ep", "extra", "note"),
    [
        ("2", [], "capped by ep 2 with 4 experts per rank and top_k 2 (the busiest rank gets at most every routed"),
        # One expert per rank takes one copy of a token of two: the cap is 8 · 1 / 2 = 4, not ep's 8.
        ("8", [], None),
        ("8", ["--set", "model.moe.top_k=4"], "capped by ep 8 with 1 expert per rank and top_k 4"),
        ("8", ["--set", "model.moe.capacity_factor=1.25"], "capped by capacity_factor 1.25 (routing drops"),
        ("2", ["--set", "model.moe.capacity_factor=1.25"], "and by capacity_factor 1.25 (routing drops the tokens"),
    ],
)
def test_expert_imbalance_capped_is_noted(
    capsys: pytest.CaptureFixture[str], ep: str, extra: list[str], note: str | None
) -> None:
    """expert_imbalance 4 with ep 2 ran as 2 (the cap a sweep over ep relies on) without saying so; under a
    capacity factor the load used is that factor, which the note must say (it first named ep's cap only)."""
    argv = ["simulate", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "64", "--tp", "2", "--pp", "4"]
    code, _, err = run([*argv, "--ep", ep, "--global-batch", "256", "--set", "plan.expert_imbalance=4", *extra], capsys)
    assert code == 0
    if note is None:
        assert "expert_imbalance" not in err
    else:
        assert note in err
        assert err.count("was used") == 1
        if "capacity_factor" in note:
            assert "1.25 was used" in err
        elif "1 expert per rank" in note:
            assert "2 times the average): 2 was used" in err  # top-4 over 8 ranks of one expert: 8 · 1 / 4


@pytest.mark.parametrize(("precision", "noted"), [("bf16", True), ("fp8", False)])
def test_fp8_only_knobs_in_a_16_bit_run_are_noted(
    capsys: pytest.CaptureFixture[str], precision: str, noted: bool
) -> None:
    """fp8_param in a BF16 run was accepted and did nothing, without a word."""
    argv = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--tp", "8"]
    argv += ["--global-batch", "16", "--zero", "1", "--precision", precision, "--set", "plan.fp8_param=true"]
    code, _, err = run(argv, capsys)
    assert code == 0
    assert ("note: fp8_param only acts in FP8 runs; this one is bf16, so it changes nothing" in err) is noted


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ([], None),
        (["--zero", "0"], "zero_stage 0"),
        (["--zero", "3"], "zero_stage 3"),
        (["--no-grad-overlap"], "grad_overlap off"),
        (["--pp", "2", "--vp", "2"], "vp 2"),
        (["--gpus", "8"], "dp 1"),
    ],
)
def test_param_gather_at_step_start_where_it_cannot_act_is_noted(
    capsys: pytest.CaptureFixture[str], extra: list[str], why: str | None
) -> None:
    """The knob moves the first parameter bucket's gather under ZeRO-1/2 with overlapped gathers, without
    interleaving, over a data-parallel group of more than one rank (run._param_gather_buckets, the engine's
    _gathers_on_arrival); anywhere else it had been accepted and done nothing, without a word."""
    argv = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "32", "--tp", "8"]
    argv += ["--global-batch", "32", "--micro-batch", "1", "--zero", "1", "--param-gather-at-step-start", *extra]
    code, _, err = run(argv, capsys)
    assert code == 0, err
    if why is None:
        assert "param_gather_at_step_start" not in err
    else:
        assert f"note: param_gather_at_step_start changes nothing here ({why}" in err


def test_every_shipped_yaml_checks(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2: every shipped YAML passes clustersim check."""
    files = []
    for folder in KINDS.values():
        files += sorted((ROOT / folder).glob("*.yaml"))
    assert files
    code, out, err = run(["check", *map(str, files)], capsys)
    assert code == 0, err
    assert out.count("ok: ") == len(files)


def test_library_root_is_the_repository() -> None:
    """Issue 2: in a checkout the repository is a library root (the wheel layout: tests/unit/test_packaging.py)."""
    assert ROOT in data_roots()


def test_validate_on_a_tiny_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = (ROOT / "data" / "validation" / "published_runs.csv").read_text().splitlines()
    (tmp_path / "few.csv").write_text("\n".join([src[0], *src[11:14]]) + "\n")
    code, out, _ = run(
        ["validate", str(tmp_path / "few.csv"), "--format", "json", "--out", str(tmp_path / "o.csv")], capsys
    )
    assert code == 0
    data = json.loads(out)
    assert data["summary"]["rows"] == 3
    for row in data["rows"]:
        assert set(row) >= {
            "run_id",
            "predicted_step_time_s",
            "measured_step_time_s",
            "error",
            "feasible",
            "reason",
            "chosen",
        }
    assert (tmp_path / "o.csv").read_text().startswith("run_id,")


def test_a_plan_that_cannot_run_with_param_gather_at_step_start_is_an_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The knob's note resolved the plan's layout to find its data-parallel groups, and a plan that cannot run
    keeps its free knobs: an AssertionError, exit 1 and no trace. Found by a review of the trace output."""
    trace = tmp_path / "x.json"
    argv = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "3", "--tp", "3"]
    argv += ["--global-batch", "8", "--zero", "1", "--param-gather-at-step-start", "--trace", str(trace)]
    code, _, err = run(argv, capsys)
    assert code == 3, err
    assert "Traceback" not in err
    assert json.loads(trace.read_text())["otherData"]["feasible"] is False
