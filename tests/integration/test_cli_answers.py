"""Issue 3 (CLI): what-ifs, model and cluster references, the trace file, ``graph`` totals, determinism of
``simulate`` and ``validate`` output. Each test runs :func:`simulator.cli.main` on small configurations."""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from simulator.cli import main
from simulator.graph.transformer import build_graph
from simulator.specs.library import find_file, load_cluster, load_model
from simulator.units import fmt_seconds

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def simulate_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run([*argv, "--format", "json"], capsys)
    assert code == 0, err
    return json.loads(out)


LLAMA8 = [
    "simulate",
    "--model",
    "llama3-8b",
    "--cluster",
    "dgx-h100",
    "--gpus",
    "64",
    "--tp",
    "2",
    "--pp",
    "2",
    "--global-batch",
    "64",
    "--micro-batch",
    "1",
    "--recompute",
    "selective",
    "--vp",
    "1",
    "--no-grad-overlap",
    "--seq-len",
    "4096",
]


def test_fewer_nics_never_speed_up_and_here_slow_down(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (what-if): --set cluster.nics_per_node=4 halves the scale-out bandwidth of a DGX H100: the
    data-parallel reduction (dp=16 across nodes, not overlapped) takes longer and so does the step."""
    base = simulate_json(LLAMA8, capsys)
    fewer = simulate_json([*LLAMA8, "--set", "cluster.nics_per_node=4"], capsys)
    assert fewer["breakdown"]["dp_exposed_s"] > base["breakdown"]["dp_exposed_s"]
    assert fewer["step_time_s"] > base["step_time_s"]


def test_faster_hbm_speeds_up(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (what-if): --set device.hbm_bandwidth_gb_per_s=4800 (H200-class HBM on an H100) shortens the
    step: memory-bound kernels (norms, optimizer) get faster."""
    base = simulate_json(LLAMA8, capsys)
    fast = simulate_json([*LLAMA8, "--set", "device.hbm_bandwidth_gb_per_s=4800"], capsys)
    assert fast["step_time_s"] < base["step_time_s"]
    assert fast["breakdown"]["optimizer_s"] == pytest.approx(base["breakdown"]["optimizer_s"] * 3350 / 4800, rel=0.05)


def test_two_what_ifs_combine(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (what-if): both --set options of the issue apply together; each changes the answer."""
    both = simulate_json(
        [*LLAMA8, "--set", "cluster.nics_per_node=4", "--set", "device.hbm_bandwidth_gb_per_s=4800"], capsys
    )
    nics = simulate_json([*LLAMA8, "--set", "cluster.nics_per_node=4"], capsys)
    hbm = simulate_json([*LLAMA8, "--set", "device.hbm_bandwidth_gb_per_s=4800"], capsys)
    assert both["step_time_s"] < nics["step_time_s"]
    assert both["step_time_s"] > hbm["step_time_s"]


def test_model_by_yaml_path_and_hf_config_equal_the_built_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 3 (--model): a built-in name, a path to its YAML and an equivalent HF config.json give the same
    step time."""
    by_name = simulate_json(LLAMA8, capsys)
    yaml_path = find_file("model", "llama3-8b")
    by_yaml = simulate_json([*LLAMA8, "--model", str(yaml_path)], capsys)
    (tmp_path / "config.json").write_bytes((ROOT / "tests" / "data" / "hf" / "llama3-8b.json").read_bytes())
    by_hf = simulate_json([*LLAMA8, "--model", str(tmp_path / "config.json")], capsys)
    assert by_yaml["step_time_s"] == by_name["step_time_s"]
    assert by_hf["step_time_s"] == pytest.approx(by_name["step_time_s"], rel=1e-12)
    assert by_hf["memory"] == by_name["memory"]


def test_cluster_by_yaml_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (--cluster): a copy of a built-in cluster file, passed as a path, gives the same answer."""
    copy = tmp_path / "my-cluster.yaml"
    shutil.copy(find_file("cluster", "dgx-h100"), copy)
    by_name = simulate_json(LLAMA8, capsys)
    by_path = simulate_json([*LLAMA8, "--cluster", str(copy)], capsys)
    assert by_path["step_time_s"] == by_name["step_time_s"]
    assert by_path["cluster"] == "dgx-h100"


@pytest.mark.parametrize(("value", "says"), [("5", "must name a calibration table"), ("no-such-table", "no-such")])
def test_bad_fabric_calibration_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    """Issue 2 (bad input): a cluster file whose fabric_calibration is not a table name exits 2 naming the key."""
    text = find_file("cluster", "hgx-h200").read_text(encoding="utf-8")
    bad = tmp_path / "bad-cluster.yaml"
    bad.write_text(text.replace("fabric_calibration: h100-sxm5-80gb", f"fabric_calibration: {value}"))
    code, _, err = run([*LLAMA8, "--cluster", str(bad)], capsys)
    assert code == 2
    assert "fabric_calibration" in err
    assert says in err
    assert "Traceback" not in err


def test_memory_breakdown_adds_up(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (JSON output): each stage's memory lists its categories and their sum is its total."""
    data = simulate_json(LLAMA8, capsys)
    assert [m["stage"] for m in data["memory"]] == [0, 1]
    for m in data["memory"]:
        parts = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes")
        assert sum(m[k] for k in parts) == pytest.approx(m["total_bytes"])
        assert m["capacity_bytes"] == load_cluster("dgx-h100").device.hbm_bytes
    assert sum(data["breakdown"].values()) == pytest.approx(data["step_time_s"], rel=1e-9)
    assert data["tokens_per_s"] == pytest.approx(64 * 4096 / data["step_time_s"])


# -- trace --------------------------------------------------------------------------------------------------

TRACE_ARGS = [
    "simulate",
    "--model",
    "llama3-8b",
    "--cluster",
    "dgx-h100",
    "--gpus",
    "8",
    "--pp",
    "4",
    "--tp",
    "2",
    "--global-batch",
    "8",
    "--micro-batch",
    "1",
    "--recompute",
    "full",
    "--vp",
    "1",
    "--seq-len",
    "2048",
]


def _trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    path = tmp_path / "t.json"
    code, _, err = run([*TRACE_ARGS, "--trace", str(path)], capsys)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert set(data) >= {"traceEvents", "displayTimeUnit"}
    return data["traceEvents"]


def test_trace_names_one_process_per_stage_and_one_track_per_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 3 (trace): Chrome/Perfetto metadata names pid s "stage s" and its tids compute, dp, send_fwd,
    send_bwd; every slice sits on a named track."""
    events = _trace(tmp_path, capsys)
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {s: f"stage {s}" for s in range(4)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for s in range(4):
        assert [threads[(s, t)] for t in range(4)] == ["compute", "dp", "send_fwd", "send_bwd"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["ph"] for e in events} == {"M", "X"}
    for e in slices:
        assert (e["pid"], e["tid"]) in threads
        assert isinstance(e["ts"], int | float)
        assert e["ts"] >= 0
        assert isinstance(e["dur"], int | float)
        assert e["dur"] >= 0
    assert {e["tid"] for e in slices} >= {0, 2, 3}


def test_trace_compute_tracks_do_not_overlap_and_show_every_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 3 (trace): each stage's compute track runs its 8 forwards and 8 backwards one at a time."""
    events = _trace(tmp_path, capsys)
    for s in range(4):
        track = sorted((e for e in events if e["ph"] == "X" and e["pid"] == s and e["tid"] == 0), key=lambda e: e["ts"])
        for a, b in itertools.pairwise(track):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6  # Perfetto rejects misnested slices
        names = [e["name"] for e in track if e["cat"] not in ("idle", "optimizer")]
        assert sorted(names) == sorted([f"F{i}.0" for i in range(8)] + [f"B{i}.0" for i in range(8)])


def test_trace_shows_the_one_f_one_b_bubbles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (trace): 1F1B bubbles are visible and say what they wait for: the last stage waits from t=0 for its
    first forward's input (a bubble until it leaves stage 2, then its transfer), and stage 0 waits between its p=4
    warm-up forwards and the first backward."""
    events = _trace(tmp_path, capsys)

    def track(s: int) -> list[dict]:
        return sorted((e for e in events if e["ph"] == "X" and e["pid"] == s and e["tid"] == 0), key=lambda e: e["ts"])

    last = track(3)
    assert [e["name"] for e in last[:3]] == ["bubble", "pp transfer wait", "F0.0"]
    assert last[0]["ts"] == 0
    assert last[0]["dur"] > 0
    assert {e["cat"] for e in last[:2]} == {"idle"}
    first = [e["name"] for e in track(0)]
    assert first[:4] == ["F0.0", "F1.0", "F2.0", "F3.0"]
    waits = first[4 : first.index("B0.0")]
    assert waits
    assert set(waits) <= {"bubble", "pp transfer wait", "idle"}


def test_trace_is_byte_identical_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (determinism): the trace file has the same bytes on every run."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    run([*TRACE_ARGS, "--trace", str(a)], capsys)
    run([*TRACE_ARGS, "--trace", str(b)], capsys)
    assert a.read_bytes() == b.read_bytes()


# -- determinism of the JSON outputs ---------------------------------------------------------------------------


def test_simulate_json_is_byte_identical_twice(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (determinism): ``simulate --format json`` prints the same bytes twice (free knobs included)."""
    argv = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--pp", "2"]
    argv += ["--global-batch", "16", "--seq-len", "2048", "--format", "json"]
    first = run(argv, capsys)
    second = run(argv, capsys)
    assert first == second
    assert first[0] == 0


def test_validate_json_is_byte_identical_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (determinism): ``validate --format json`` prints the same bytes twice."""
    src = (ROOT / "data" / "validation" / "published_runs.csv").read_text().splitlines()
    (tmp_path / "few.csv").write_text("\n".join([src[0], *src[1:5]]) + "\n")
    argv = ["validate", str(tmp_path / "few.csv"), "--format", "json"]
    first = run(argv, capsys)
    second = run(argv, capsys)
    assert first == second
    assert json.loads(first[1])["summary"]["rows"] == 4


# -- graph --------------------------------------------------------------------------------------------------

GRAPH = ["graph", "--model", "gpt3-175b", "--seq-len", "2048", "--micro-batch", "1"]


def test_graph_json_rows_add_up_to_the_totals(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (graph): the rows' parameters times their block counts are the model's total; the totals are
    the published size, the F_MEG21 forward FLOPs per token and Korthikanti's 34·s·b·h (fused kernel) plus the
    fp32 log-sum-exp."""
    code, out, _ = run([*GRAPH, "--format", "json"], capsys)
    assert code == 0
    data = json.loads(out)
    rows, totals = data["ops"], data["totals"]
    assert sum(r["params"] * r["count"] for r in rows) == totals["parameters"] == load_model("gpt3-175b").param_count()
    fwd = sum(r["model_flops"] * r["count"] for r in rows if r["phase"] == "fwd")
    assert totals["forward_model_flops_per_token"] == pytest.approx(fwd / 2048)
    assert totals["forward_model_flops_per_token"] == pytest.approx(
        24 * 96 * 12288**2 * (1 + 2048 / (6 * 12288)) + 2 * 51200 * 12288
    )
    assert totals["step_model_flops_per_micro_batch"] == pytest.approx(3 * fwd)
    assert totals["activation_bytes_per_layer"] == 34 * 2048 * 12288 + 4 * 96 * 2048


def test_graph_table_lists_every_row_and_the_totals(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (graph): the table has one line per operator and prints the same totals as the JSON."""
    _, js, _ = run([*GRAPH, "--format", "json"], capsys)
    data = json.loads(js)
    code, table, _ = run([*GRAPH, "--format", "table"], capsys)
    assert code == 0
    lines = table.splitlines()
    for r in data["ops"]:
        assert any(line.split()[:3] == [r["block"], str(r["count"]), r["op"]] for line in lines), r["op"]
    for key, value in data["totals"].items():
        assert f"{key:<34}{value:,.4g}" in lines


def test_graph_dot_has_a_node_per_operator(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (graph): DOT output declares one node per operator of the graph and the edges between them."""
    code, dot, _ = run([*GRAPH, "--format", "dot"], capsys)
    assert code == 0
    g = build_graph(load_model("gpt3-175b"), 2048, 1).graph
    declared = [line for line in dot.splitlines() if "[label=" in line]
    edges = [line for line in dot.splitlines() if "->" in line]
    assert len(declared) == g.number_of_nodes()
    assert len(edges) == g.number_of_edges()
    assert dot.rstrip().endswith("}")


TP8 = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "8", "--global-batch", "8"]
TP8 += ["--micro-batch", "1", "--recompute", "none", "--vp", "1", "--grad-overlap", "--seq-len", "4096"]


def test_faster_nvlink_speeds_up_a_calibrated_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (what-if): doubling NVLink on dgx-h100 (whose collectives come from a measured table) shortens
    the exposed TP time and the step (found by this test: the measured curves ignored the override)."""
    base = simulate_json(TP8, capsys)
    same = simulate_json([*TP8, "--set", "cluster.nvlink_bandwidth_gb_per_s=450"], capsys)
    fast = simulate_json([*TP8, "--set", "cluster.nvlink_bandwidth_gb_per_s=900"], capsys)
    assert same["step_time_s"] == base["step_time_s"]
    assert fast["breakdown"]["tp_exposed_s"] < base["breakdown"]["tp_exposed_s"]
    assert fast["step_time_s"] < base["step_time_s"]


def test_table_shows_the_resolved_sequence_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 3 (CLI): the layout line shows sequence_parallel as resolved (on by default when tp > 1), not
    'None' (found by this test)."""
    code, out, _ = run([a for a in LLAMA8 if a != "--no-grad-overlap"], capsys)
    assert code == 0
    assert "sequence_parallel=true" in out


def test_train_tokens_turns_the_step_into_days_and_gpu_hours(capsys: pytest.CaptureFixture[str]) -> None:
    """How many days for N tokens: whole steps of global batch × sequence length at the simulated step time, on
    every GPU of the plan; the per-GPU rates NeMo's and Megatron-LM's logs use come with every answer."""
    data = simulate_json([*LLAMA8, "--train-tokens", "1.5T"], capsys)
    step, tokens_per_step = data["step_time_s"], 64 * 4096
    steps = -(-1.5e12 // tokens_per_step)
    assert data["train"]["steps"] == steps
    assert data["train"]["days"] == pytest.approx(steps * step / 86400)
    assert data["train"]["gpu_hours"] == pytest.approx(steps * step / 3600 * 64)
    assert data["train"]["cost_usd"] is None  # the device states no price
    assert data["tokens_per_s_per_gpu"] == pytest.approx(data["tokens_per_s"] / 64)
    assert data["model_tflops_per_gpu"] == pytest.approx(data["model_flops"] / step / 64 / 1e12)
    code, out, _ = run([*LLAMA8, "--train-tokens", "1500000000000"], capsys)
    assert code == 0
    assert f"training on 1.5T tokens: {steps:,.0f} steps" in out
    assert "per GPU: " in out
    assert " model TFLOP/s" in out
    # A plan that does not fit has no training time: its step is what it would take if it fitted.
    code, out, _ = run([*LLAMA8, "--micro-batch", "64", "--train-tokens", "1T", "--format", "json"], capsys)
    assert code == 3
    assert json.loads(out)["train"] is None
    for bad in ("0", "-3T", "lots", "1e400", "nanT"):
        code, _, err = run([*LLAMA8, "--train-tokens", bad], capsys)
        assert code == 2, bad
        assert "--train-tokens" in err
        assert "Traceback" not in err


def test_a_hand_written_cluster_of_a_measured_device_is_told_about_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cluster YAML naming the H100 but no calibration table runs on the default curves; check and simulate say
    which shipped table measured that device and how to use it (it had passed check with a bare "ok")."""
    cluster = tmp_path / "my-h100.yaml"
    cluster.write_text(
        "name: my-h100\ndevice: H100-SXM5-80GB\ngpus_per_node: 8\nnvlink_bandwidth_gb_per_s: 450\n"
        "nics_per_node: 8\nnic_bandwidth_gbit_per_s: 400\n",
        encoding="utf-8",
    )
    code, out, err = run(["check", str(cluster)], capsys)
    assert code == 0
    assert "uncalibrated" in out
    assert "add 'calibration: h100-sxm5-80gb'" in err
    code, out, err = run(
        [
            "simulate",
            "--model",
            "llama3-8b",
            "--cluster",
            str(cluster),
            "--gpus",
            "8",
            "--tp",
            "8",
            "--global-batch",
            "8",
            "--format",
            "json",
        ],
        capsys,
    )
    assert code == 0
    assert json.loads(out)["calibration"] == ""
    assert "add 'calibration: h100-sxm5-80gb'" in err
    # A built-in cluster that names its table gets no note.
    code, _, err = run(["check", str(find_file("cluster", "dgx-h100"))], capsys)
    assert code == 0
    assert not err


def test_trace_events_say_what_they_are_and_the_file_carries_the_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A task slice's args spell out its name (F3.1: forward of micro-batch 3, chunk 1), transfers read
    ``send F3.1`` (not the compute slice's name again), and otherData holds the step time, plan and breakdown."""
    path = tmp_path / "t.json"
    code, out, _ = run([*LLAMA8, "--trace", str(path), "--format", "json"], capsys)
    assert code == 0
    data = json.loads(path.read_text())
    answer = json.loads(out)
    assert data["otherData"]["step_time_s"] == answer["step_time_s"]
    assert data["otherData"]["breakdown"] == answer["breakdown"]
    assert data["otherData"]["plan"]["tp"] == 2
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    forward = next(e for e in slices if e["name"] == "F3.0" and e["tid"] == 0)
    assert forward["args"] == {"kind": "forward", "micro_batch": 3, "chunk": 0, "stage": forward["pid"]}
    sends = [e for e in slices if e["tid"] in (2, 3)]
    assert sends
    assert all(e["name"].startswith("send ") for e in sends)


def test_hardware_show_names_memory_and_features_as_the_device_has_them(capsys: pytest.CaptureFixture[str]) -> None:
    """The L40S's GDDR6 was shown as HBM, MI300X (no NVSwitch) as 'NVLS no', DGX-1's 6.25 GB/s NIC share as 6.2
    (found by a datasheet review)."""
    code, out, _ = run(["hardware", "show", "L40S"], capsys)
    assert code == 0
    assert "  memory 45.0 GiB at 864 GB/s" in out
    assert "HBM" not in out.split("source:")[0]
    code, out, _ = run(["hardware", "show", "mi300x-8"], capsys)
    assert "NVLS n/a" in out
    code, out, _ = run(["hardware", "show", "dgx-v100"], capsys)
    assert "(6.25 GB/s per GPU)" in out


def test_hardware_list_names_each_fabric_and_a_domain_wider_than_a_node(capsys: pytest.CaptureFixture[str]) -> None:
    """MI300X links by Infinity Fabric, not NVLink, and GB200 NVL72's NVLink domain spans 72 GPUs over 18 trays of 4:
    the list had called the first NVLink and hidden the second (found by a first-time-user review)."""
    code, out, _ = run(["hardware", "list"], capsys)
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "Infinity Fabric 448 GB/s" in lines["mi300x-8"]
    assert "NVLink 900 GB/s per direction, domain 72" in lines["gb200-nvl72"]
    assert "domain" not in lines["dgx-h100"]


def test_trace_waits_name_their_cause(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The compute track's waits say why: with ZeRO-1 and overlapped reduction stage 0's first forward waits for its
    first parameter bucket, and every stage waits for its gradient reduction before the optimizer; their lengths
    add up to the stage's exposed data-parallel time in the breakdown."""
    path = tmp_path / "z1.json"
    args = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "64", "--tp", "2", "--pp", "4"]
    code, out, _ = run([*args, "--global-batch", "64", "--zero", "1", "--trace", str(path), "--format", "json"], capsys)
    assert code == 0
    stages = json.loads(out)["stage_breakdown"]
    events = json.loads(path.read_text())["traceEvents"]
    for s, stage in enumerate(stages):
        waits = [e for e in events if e["ph"] == "X" and e["cat"] == "idle" and e["pid"] == s]
        assert "dp reduce wait" in {e["name"] for e in waits}
        dp_waits = sum(e["dur"] for e in waits if e["name"].startswith("dp ")) / 1e6
        assert dp_waits == pytest.approx(stage["dp_exposed_s"], abs=1e-6)
    assert "dp gather wait" in {e["name"] for e in events if e.get("pid") == 0}


def test_a_what_if_says_what_it_changed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A result made with --set names every override (JSON ``what_if``, the table's second line, the trace's
    otherData), so that a saved what-if cannot be mistaken for the baseline it differs from; without --set
    ``what_if`` is empty."""
    base = ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "512", "--tp", "8", "--pp", "8"]
    base += ["--global-batch", "512", "--micro-batch", "1"]
    what_if = ["--set", "cluster.nic_bandwidth_gbit_per_s=400", "--set", "device.hbm_gib=74"]
    assert simulate_json(base, capsys)["what_if"] == {}
    data = simulate_json(base + what_if + ["--trace", str(tmp_path / "t.json")], capsys)
    assert data["what_if"] == {"cluster.nic_bandwidth_gbit_per_s": 400, "device.hbm_gib": 74}
    trace = json.loads((tmp_path / "t.json").read_text())
    assert trace["otherData"]["what_if"] == data["what_if"]
    code, out, _ = run(base + what_if, capsys)
    assert code == 0
    assert out.splitlines()[1] == "what-if (--set): cluster.nic_bandwidth_gbit_per_s=400, device.hbm_gib=74"
    _, out, _ = run(base, capsys)
    assert "what-if" not in out


def test_time_to_train_is_only_given_for_a_plan_that_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """A plan that does not fit has a step time (what it would take if it fitted) but no training time: the JSON said
    null while Python's time_to_train gave 99 days and the table dropped the line without a word. Counts far beyond
    any training run (1e30 printed a 3e23-step training) and formatting slips ('1.5e+04T', '1 steps', '0.0 days') are
    gone. Found by a capacity-planning review."""
    code, out, _ = run([*LLAMA8, "--micro-batch", "64", "--train-tokens", "300B"], capsys)
    assert code == 3
    assert "training on 300B tokens: no training time, the plan is infeasible" in out
    code, _, err = run([*LLAMA8, "--train-tokens", "1e30"], capsys)
    assert code == 2
    assert "more than the 10,000T" in err
    code, _, err = run([*LLAMA8, "--train-tokens", "15000T"], capsys)
    assert code == 2
    code, out, _ = run([*LLAMA8, "--train-tokens", "262144"], capsys)  # one step of 64 × 4,096 tokens
    assert code == 0
    assert re.search(r"training on 262,144 tokens: 1 step of 262,144 tokens, [0-9.]+ m?s on 64 GPUs", out)
    from simulator.cli import _fmt_tokens

    assert [_fmt_tokens(t) for t in (15e12, 15_000e12, 999.99e9, 999.999e9, 999999999999999, 2.5e9, 1234.0)] == [
        "15T",
        "15,000T",
        "999.99B",
        "999.999B",
        "999.999999999999T",
        "2.5B",
        "1,234",
    ]


def test_time_to_train_reads_right_at_every_scale(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a review of the throughput metrics: 1.5 tokens was accepted and printed as 2, 999.999B as 1,000B,
    1.0000001e16 refused as "10,000T, more than the 10,000T", a run under an hour in seconds ("1479.100 s") and
    under half a GPU-hour as "0 GPU-hours"."""
    for bad, what in (("1.5", "1.5 tokens, not a whole number"), ("1.0005K", "1000.5 tokens")):
        code, _, err = run([*LLAMA8, "--train-tokens", bad], capsys)
        assert code == 2
        assert what in err, err
    code, _, err = run([*LLAMA8, "--train-tokens", "1.0000001e16"], capsys)
    assert code == 2
    assert "is 10,000.001T tokens, more than the 10,000T" in err
    data = simulate_json([*LLAMA8, "--train-tokens", "0.1K"], capsys)
    assert data["train"]["tokens"] == 100
    assert data["train"]["tokens_per_step"] == 64 * 4096
    step = data["step_time_s"]
    steps = math.ceil(3000 / step)  # some 50 minutes of steps
    code, out, _ = run([*LLAMA8, "--train-tokens", str(steps * 64 * 4096)], capsys)
    assert code == 0
    minutes = steps * step / 60
    assert f"steps of 262,144 tokens, {minutes:.1f} minutes on 64 GPUs, {minutes / 60 * 64:,.1f} GPU-hours" in out
    code, out, _ = run([*LLAMA8, "--train-tokens", "1"], capsys)
    assert f"1 step of 262,144 tokens, {fmt_seconds(step)} on 64 GPUs, {step / 3600 * 64:.3g} GPU-hours" in out


def test_time_to_train_from_python_checks_its_argument_and_feasibility() -> None:
    """Python's time_to_train: NaN for a plan that does not fit (its docstring's promise), a clear SpecError for a
    count that is not one (it returned zeros for -1, raised OverflowError for inf and TypeError for '15T')."""
    from simulator.errors import SpecError
    from simulator.run import simulate
    from simulator.specs import PlanSpec, load_cluster, load_model

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    small = replace(cluster, device=replace(cluster.device, hbm_bytes=5 * 2**30))
    plan = PlanSpec(tp=8, dp=1, global_batch=8, micro_batch=1, recompute="none", grad_overlap=False, vp=1)
    oom = simulate(model, small, plan)
    assert not oom.feasible
    assert math.isfinite(oom.step_time_s)
    assert all(math.isnan(oom.time_to_train(1e12)[k]) for k in ("steps", "days", "gpu_hours"))
    ok = simulate(model, cluster, plan)
    assert ok.time_to_train(1e12)["steps"] == math.ceil(1e12 / (8 * 8192))
    for bad in ("15T", -1, 0, math.inf, math.nan, True, 1e30):
        with pytest.raises(SpecError, match="time_to_train"):
            ok.time_to_train(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("what_if", "key"),
    [
        ("device.peak_tflops_bf16=1.0e-30", "peak_tflops_bf16"),
        ("device.hbm_bandwidth_gb_per_s=1.0e-9", "hbm_bandwidth_gb_per_s"),
        ("device.hbm_gib=1.0e+9", "hbm_gib"),
        ("cluster.nic_bandwidth_gbit_per_s=1.0e-20", "nic_bandwidth_gbit_per_s"),
        ("cluster.nvlink_bandwidth_gb_per_s=1.0e+12", "nvlink_bandwidth_gb_per_s"),
    ],
)
def test_an_unrealistic_hardware_figure_is_bad_input(
    what_if: str, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A what-if of 1e-30 TFLOP/s had run a 3e33-second step (exit 0), NICs of 1e-20 Gb/s a 2e22-second one: a
    figure far outside any hardware is a unit slip, answered as bad input naming the key (found by a
    capacity-planning review)."""
    code, _, err = run([*LLAMA8, "--set", what_if], capsys)
    assert code == 2
    assert key in err
    assert "not a realistic figure" in err
    assert "Traceback" not in err


def test_the_mfu_line_says_what_peak_it_is_against(capsys: pytest.CaptureFixture[str]) -> None:
    """MFU's denominator is the 16-bit peak, also for FP8 runs; the table says so, and the note on MFU above HFU no
    longer claims the full-s² convention is current Megatron-LM's (it halves causal attention)."""
    code, out, _ = run(LLAMA8, capsys)
    assert code == 0
    assert "of the bf16 peak 989 TFLOP/s" in out
    code, out, _ = run([*LLAMA8, "--precision", "fp8"], capsys)
    assert "FP8 runs are also rated against the 16-bit peak" in out


def test_mfu_by_megatrons_count_is_given_with_or_without_recomputation(capsys: pytest.CaptureFixture[str]) -> None:
    """The note on the full-s² convention was printed only where MFU exceeded HFU, so it vanished as soon as
    recomputation put HFU above MFU; it also named NeMo among the frameworks that halve causal attention, whose
    ``flops_formulas`` count the full s². It now always gives the Megatron-LM figure, and JSON carries it with the
    peak MFU is taken against. Found by a review of the throughput metrics."""
    code, out, _ = run([*LLAMA8, "--recompute", "full"], capsys)
    assert code == 0
    d = simulate_json([*LLAMA8, "--recompute", "full"], capsys)
    assert d["hfu"] > d["mfu"] > d["mfu_causal"] > 0
    assert d["mfu_causal"] == pytest.approx(d["mfu"] * d["model_flops_causal"] / d["model_flops"])
    assert d["peak_tflops_per_gpu"] == pytest.approx(989.4, abs=0.1)
    assert f"by their count MFU {d['mfu_causal'] * 100:.1f}%" in out
    assert "NeMo 2 do" in out
    assert "Megatron-LM and NeMo halve" not in out


@pytest.mark.parametrize(
    "extra",
    [
        [
            "--model",
            "llama2-7b",
            "--gpus",
            "16",
            "--tp",
            "2",
            "--pp",
            "2",
            "--schedule",
            "zb_h1",
            "--recompute",
            "none",
        ],
        ["--model", "llama3-8b", "--gpus", "64", "--tp", "2", "--pp", "4", "--zero", "1", "--no-grad-overlap"],
        ["--model", "llama3-8b", "--gpus", "32", "--tp", "2", "--pp", "4", "--vp", "2", "--zero", "1"],
    ],
    ids=["zb_h1", "blocking-gather", "interleaved"],
)
def test_every_stage_track_accounts_for_the_whole_step(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each stage's compute track covers the step from 0 to its end, and its labelled waits add up to the stage's
    own breakdown: a stage that finished early had been blank to the step's end (counted as bubble), a blocking
    parameter gather after the optimizer blank (counted as exposed data-parallel time); sub-nanosecond waits were
    zero-length slices, a wait pushed back by a NIC-sharing transfer two slices. otherData names the critical stage
    whose breakdown it carries, and every stage's. Found by a review of the trace output."""
    path = tmp_path / "t.json"
    argv = ["simulate", "--cluster", "dgx-h100", "--global-batch", "64", "--micro-batch", "1", *extra]
    code, out, err = run([*argv, "--trace", str(path), "--format", "json"], capsys)
    assert code == 0, err
    answer = json.loads(out)
    data = json.loads(path.read_text())
    assert data["otherData"]["critical_stage"] == answer["critical_stage"]
    assert data["otherData"]["stage_breakdown"] == answer["stage_breakdown"]
    step_us = answer["step_time_s"] * 1e6
    for s, stage in enumerate(answer["stage_breakdown"]):
        track = sorted(
            (e for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] == s and e["tid"] == 0),
            key=lambda e: e["ts"],
        )
        assert track[0]["ts"] == 0
        assert track[-1]["ts"] + track[-1]["dur"] == pytest.approx(step_us, abs=0.01)
        for before, after in itertools.pairwise(track):
            assert after["ts"] == pytest.approx(before["ts"] + before["dur"], abs=0.002)  # no gap on the track
            assert not (after["cat"] == "idle" and after["name"] == before["name"])  # one wait, one slice
        assert all(e["dur"] > 0 for e in track if e["cat"] == "idle")
        waits = {name: sum(e["dur"] for e in track if e["name"] == name) / 1e6 for name in ("bubble", "idle")}
        dp = sum(e["dur"] for e in track if e["name"].startswith("dp ")) / 1e6
        assert dp == pytest.approx(stage["dp_exposed_s"], abs=1e-6)
        assert waits["bubble"] + waits["idle"] == pytest.approx(stage["bubble_s"], abs=1e-6)


@pytest.mark.parametrize("pp", ["1", "2"])
def test_zero3_collectives_are_drawn_on_the_data_parallel_track(
    pp: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ZeRO-3's per-layer gathers and reduce-scatters run inside each task's length, and the data-parallel track
    had stayed empty (with pp 1 wholly): the stream promised to show them showed none. Each is now drawn there,
    inside the task that ran it, one at a time. Found by a review of the trace output."""
    path = tmp_path / "z3.json"
    argv = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "64", "--tp", "2", "--pp", pp]
    argv += ["--global-batch", "64", "--micro-batch", "1", "--zero", "3", "--recompute", "full"]
    code, _, err = run([*argv, "--trace", str(path), "--format", "json"], capsys)
    assert code == 0, err
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    for s in {e["pid"] for e in events}:
        dp = sorted((e for e in events if e["pid"] == s and e["tid"] == 1), key=lambda e: e["ts"])
        names = {e["name"].rsplit(".", 1)[-1] for e in dp}
        assert {"param_all_gather", "grad_reduce_scatter"} <= names, names
        for before, after in itertools.pairwise(dp):
            assert after["ts"] >= before["ts"] + before["dur"] - 0.002  # one collective at a time on the stream


def test_a_very_large_trace_gets_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An 8-GPU plan near the forward-pass guard wrote 321 MB of trace without a word. Found by a review."""
    import simulator.cli as cli

    monkeypatch.setattr(cli, "TRACE_NOTE_BYTES", 1000)
    code, _, err = run([*TRACE_ARGS, "--trace", str(tmp_path / "t.json")], capsys)
    assert code == 0
    assert f"note: --trace {tmp_path / 't.json'} holds" in err
    assert "a smaller --global-batch" in err
    monkeypatch.setattr(cli, "TRACE_NOTE_BYTES", 10**12)
    assert "holds" not in run([*TRACE_ARGS, "--trace", str(tmp_path / "t.json")], capsys)[2]


def test_throughput_figures_below_10_tflops_keep_significant_digits(capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU host profile (a peak of 0.22 TFLOP/s) the table said 'of the bf16 peak 0 TFLOP/s' and '0.0 model
    TFLOP/s': a peak under 10 TFLOP/s and a throughput under 1 are given to three significant digits; larger figures
    print as before. Found by a review of the calibration workflow."""
    argv = [*LLAMA8, "--set", "device.peak_tflops_bf16=0.22"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    d = simulate_json(argv, capsys)
    assert f"{d['model_tflops_per_gpu']:.3g} model TFLOP/s, of the bf16 peak 0.22 TFLOP/s" in out
    assert " 0.0 " not in out
    code, out, _ = run([*LLAMA8, "--set", "device.peak_tflops_bf16=2.5"], capsys)
    assert "of the bf16 peak 2.5 TFLOP/s" in out
