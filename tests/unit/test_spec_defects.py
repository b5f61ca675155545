"""Defects of spec loading found by adversarial testing: what-ifs that were ignored, misleading messages, and
values that were accepted but cannot describe a real run. Each test names the defect it pins down."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from simulator.cli import main
from simulator.cost.communication import CommModel
from simulator.errors import SpecError
from simulator.parallel.layout import expert_load
from simulator.specs.calibration import CalibrationTable
from simulator.specs.hardware import MAX_LATENCY_S, ClusterSpec
from simulator.specs.library import find_file, load_calibration, load_cluster, load_model
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec
from simulator.units import GB, GIB

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "hardware_profiles" / "clusters"
TP8 = ["simulate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--global-batch", "16", "--micro-batch", "1"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def step_time(argv: list[str], capsys: pytest.CaptureFixture[str]) -> float:
    code, out, err = run([*argv, "--format", "json"], capsys)
    assert code == 0, err
    return float(json.loads(out)["step_time_s"])


def cluster_copy(tmp_path: Path, name: str, **changes: Any) -> Path:
    """A copy of a built-in cluster file with some keys changed (table names stay built-in names)."""
    data = yaml.safe_load((CLUSTERS / f"{name}.yaml").read_text())
    data.update(changes)
    path = tmp_path / f"{name}-copy.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def assert_clean_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# -- 1. --set cluster.device / cluster.calibration were ignored ---------------------------------------------


def test_set_cluster_device_resolves_the_new_device() -> None:
    cluster = load_cluster("dgx-h100", {"device": "B200"})
    assert cluster.device.name == "B200"
    assert load_cluster("dgx-h100").device.name == "H100-SXM5-80GB"  # the cached built-in is untouched


def test_set_cluster_device_changes_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    base = step_time([*TP8, "--cluster", "dgx-h100"], capsys)
    b200 = step_time([*TP8, "--cluster", "dgx-h100", "--set", "cluster.device=B200"], capsys)
    assert b200 < base


@pytest.mark.parametrize(
    ("setting", "fragments"),
    [
        ("cluster.device=nope", ["--set cluster.device=nope", "device 'nope' is not a built-in device", "use one of"]),
        ("cluster.device=H100-SXM5-80G", ["is not a built-in device (did you mean 'H100-SXM5-80GB'?)"]),
        ("cluster.calibration=nope", ["--set cluster.calibration=nope", "is not a built-in calibration"]),
        ("cluster.calibration=h100-sxm5-80g", ["(did you mean 'h100-sxm5-80gb'?)"]),
        ("cluster.fabric_calibration=nope", ["--set cluster.fabric_calibration=nope", "not a built-in calibration"]),
        ("cluster.calibration=7", ["--set cluster.calibration=7", "must name a calibration table"]),
    ],
)
def test_unknown_device_or_table_in_set_is_an_error(
    setting: str, fragments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run([*TP8, "--cluster", "dgx-h100", "--set", setting], capsys)
    assert_clean_error(code, err, *fragments)


def test_set_cluster_calibration_swaps_or_drops_the_table() -> None:
    swapped = load_cluster("dgx-h100", {"calibration": "a100-sxm4-80gb"})
    assert swapped.calibration is not None
    assert swapped.calibration.name == "a100-sxm4-80gb"
    assert load_cluster("dgx-h100", {"calibration": None}).calibration is None


def test_set_device_keys_apply_to_the_device_set_on_the_cluster() -> None:
    cluster = load_cluster("dgx-h100", {"device": "B200"}, {"hbm_gib": 100})
    assert cluster.device.name == "B200"
    assert cluster.device.hbm_bytes == 100 * GIB


# -- 2. --set device.* on a cluster whose device is an inline mapping ---------------------------------------

INLINE_DEVICE = {"name": "X", "peak_tflops_bf16": 100, "hbm_gib": 10, "hbm_bandwidth_gb_per_s": 1000}


def test_device_overrides_apply_to_an_inline_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = cluster_copy(tmp_path, "dgx-h100", device=INLINE_DEVICE)
    assert load_cluster(path).device.hbm_bytes == 10 * GIB
    changed = load_cluster(path, None, {"hbm_gib": 20})
    assert changed.device.name == "X"
    assert changed.device.hbm_bytes == 20 * GIB
    code, _, err = run([*TP8, "--cluster", str(path), "--set", "device.hbm_gib=20"], capsys)
    assert code in (0, 3), err  # runs (fits or not), instead of "device 'X' is not a built-in device"
    assert "not a built-in device" not in err


def test_bad_device_override_on_an_inline_device_names_the_key(tmp_path: Path) -> None:
    path = cluster_copy(tmp_path, "dgx-h100", device=INLINE_DEVICE)
    with pytest.raises(SpecError) as info:
        load_cluster(path, None, {"hbm_gib": -1})
    assert "device.* overrides" in info.value.where
    assert "hbm_gib" in info.value.where


# -- 3. a calibration table records the NVLink fabric its collectives were measured on ----------------------


@pytest.mark.parametrize(("table", "gb_per_s"), [("a100-sxm4-80gb", 300), ("h100-sxm5-80gb", 450)])
def test_shipped_tables_record_their_measured_fabric(table: str, gb_per_s: float) -> None:
    t = load_calibration(table)
    assert t.measured_nvlink_bandwidth_bytes_per_s == gb_per_s * GB
    domain = [c for c in t.collectives if c.scope == "domain"]
    assert domain
    assert all(c.reference_bandwidth_bytes_per_s == gb_per_s * GB for c in domain)


@pytest.mark.parametrize("name", ["dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "hgx-h200"])
def test_shipped_clusters_scale_their_measured_curves_by_exactly_one(name: str) -> None:
    cluster = load_cluster(name)
    tables = [t for t in (cluster.calibration, cluster.fabric_calibration) if t is not None]
    assert tables
    for table in tables:
        for curve in table.collectives:
            if curve.scope == "domain":
                assert cluster.nvlink_bandwidth_bytes_per_s / curve.reference_bandwidth_bytes_per_s == 1.0


def test_a_cluster_file_with_another_nvlink_rate_scales_like_the_what_if(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A copy of dgx-h100 stating 45 GB/s gives the --set answer, not the 450 GB/s one."""
    copy = cluster_copy(tmp_path, "dgx-h100", nvlink_bandwidth_gb_per_s=45)
    base = step_time([*TP8, "--cluster", "dgx-h100"], capsys)
    what_if = step_time([*TP8, "--cluster", "dgx-h100", "--set", "cluster.nvlink_bandwidth_gb_per_s=45"], capsys)
    from_file = step_time([*TP8, "--cluster", str(copy)], capsys)
    assert what_if > 2 * base
    assert from_file == what_if


def test_a_fabric_table_scales_on_a_cluster_with_another_nvlink_rate(tmp_path: Path) -> None:
    slow = load_cluster(cluster_copy(tmp_path, "hgx-h200", nvlink_bandwidth_gb_per_s=45))
    fast = load_cluster("hgx-h200")
    assert slow.fabric_calibration is not None
    slow_bw = CommModel(slow, slow.calibration, None)._domain_busbw("all_reduce", 8, 2**28)
    fast_bw = CommModel(fast, fast.calibration, None)._domain_busbw("all_reduce", 8, 2**28)
    assert slow_bw == pytest.approx(fast_bw / 10)


def test_a_table_without_the_key_takes_the_rate_of_the_file_that_names_it(tmp_path: Path) -> None:
    text = (ROOT / "hardware_profiles" / "calibration" / "h100-sxm5-80gb.yaml").read_text()
    data = yaml.safe_load(text)
    del data["measured_nvlink_bandwidth_gb_per_s"]
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    cluster = load_cluster(cluster_copy(tmp_path, "dgx-h100", nvlink_bandwidth_gb_per_s=45, calibration="bare.yaml"))
    assert cluster.calibration is not None
    domain = [c for c in cluster.calibration.collectives if c.scope == "domain"]
    assert all(c.reference_bandwidth_bytes_per_s == 45 * GB for c in domain)  # today's fallback: no scaling
    # ... while a what-if on that file still scales against the rate the file states.
    what_if = load_cluster(tmp_path / "dgx-h100-copy.yaml", {"nvlink_bandwidth_gb_per_s": 90})
    assert what_if.calibration is not None
    assert {c.reference_bandwidth_bytes_per_s for c in what_if.calibration.collectives if c.scope == "domain"} == {
        45 * GB
    }


@pytest.mark.parametrize("value", [0, -300, "fast", 1.0e308])
def test_the_measured_fabric_key_is_checked(value: Any) -> None:
    data = yaml.safe_load((ROOT / "hardware_profiles" / "calibration" / "h100-sxm5-80gb.yaml").read_text())
    data["measured_nvlink_bandwidth_gb_per_s"] = value
    with pytest.raises(SpecError) as info:
        CalibrationTable.from_mapping(data, "t.yaml")
    assert info.value.where == "t.yaml: measured_nvlink_bandwidth_gb_per_s"


def test_the_measured_fabric_survives_a_round_trip() -> None:
    table = load_calibration("h100-sxm5-80gb")
    mapping = table.to_mapping()
    assert mapping["measured_nvlink_bandwidth_gb_per_s"] == 450
    assert all("reference_bandwidth_gb_per_s" not in c for c in mapping["collectives"])
    assert CalibrationTable.from_mapping(mapping, "t") == table
    default = load_calibration("default")  # per-curve references of the default table stay per curve
    # The A100's 300 and the H100's 450 GB/s: the default curves are stated on a fabric of the median.
    assert all(c["reference_bandwidth_gb_per_s"] == 375.0 for c in default.to_mapping()["collectives"])


def test_a_table_built_in_python_refuses_a_bad_fabric_rate() -> None:
    with pytest.raises(SpecError, match="measured_nvlink_bandwidth_bytes_per_s"):
        CalibrationTable(name="t", device="d", measured_nvlink_bandwidth_bytes_per_s=-1.0)


# -- 4. misleading messages ---------------------------------------------------------------------------------

MODEL = {"name": "m", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn_hidden": 1024, "vocab": 1000}


@pytest.mark.parametrize("hidden", ["null", "absent"])
def test_missing_or_null_hidden_does_not_suggest_renaming_ffn_hidden(hidden: str) -> None:
    data = {k: v for k, v in MODEL.items() if k != "hidden"}
    if hidden == "null":
        data["hidden"] = None
    with pytest.raises(SpecError) as info:
        ModelSpec.from_mapping(data, "m.yaml")
    assert info.value.where == "m.yaml: hidden"
    assert "ffn_hidden" not in str(info.value)
    assert "is required but missing" in info.value.what


def test_a_misspelt_key_is_still_suggested() -> None:
    data = {**{k: v for k, v in MODEL.items() if k != "hidden"}, "hiden": 256}
    with pytest.raises(SpecError) as info:
        ModelSpec.from_mapping(data, "m.yaml")
    assert "rename 'hiden' to 'hidden'" in str(info.value)


def test_set_model_heads_to_nothing_names_heads(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*TP8, "--cluster", "dgx-h100", "--set", "model.heads="], capsys)
    assert_clean_error(code, err, "heads: is required but missing", "give 'heads' a value")
    assert "kv_heads" not in err


def test_huge_nvlink_rate_names_the_yaml_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = cluster_copy(tmp_path, "dgx-h100", nvlink_bandwidth_gb_per_s=1.0e308)
    code, _, err = run([*TP8, "--cluster", str(path)], capsys)
    assert_clean_error(code, err, "nvlink_bandwidth_gb_per_s: is not a realistic figure", "in GB/s")
    assert "bytes_per_s" not in err
    assert "such as 8" not in err


def test_huge_device_figures_name_the_yaml_key(tmp_path: Path) -> None:
    path = cluster_copy(tmp_path, "dgx-h100", device={**INLINE_DEVICE, "hbm_gib": 1.0e308})
    with pytest.raises(SpecError) as info:
        load_cluster(path)
    assert info.value.where.endswith("device: hbm_gib")


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_recompute_layers_without_full_recompute_says_what_to_set(recompute: str | None) -> None:
    with pytest.raises(SpecError) as info:
        PlanSpec(global_batch=8, recompute=recompute, recompute_layers=5)
    message = str(info.value)
    assert "None" not in message
    assert ("recompute is not set" if recompute is None else "recompute is selective") in message
    assert "recompute: full" in message


def test_recompute_layers_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*TP8, "--cluster", "dgx-h100", "--recompute-layers", "5"], capsys)
    assert_clean_error(code, err, "recompute_layers", "recompute is not set", "--recompute full")


@pytest.mark.parametrize("field", ["compute", "collectives"])
def test_a_curve_with_empty_lists_needs_a_point(field: str) -> None:
    data = yaml.safe_load((ROOT / "hardware_profiles" / "calibration" / "h100-sxm5-80gb.yaml").read_text())
    curve = data[field][0]
    xkey, ykey = ("log10_size", "efficiency") if field == "compute" else ("log2_bytes", "busbw_gb_per_s")
    curve[xkey], curve[ykey] = [], []
    with pytest.raises(SpecError) as info:
        CalibrationTable.from_mapping(data, "t.yaml")
    assert info.value.where == f"t.yaml: {field}[0].{xkey}"
    assert "at least one measured point" in info.value.what
    assert "0 vs 0" not in str(info.value)


def test_exponent_text_in_a_plan_gets_a_plan_hint(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*TP8, "--cluster", "dgx-h100", "--set", "plan.expert_imbalance=1e6"], capsys)
    assert_clean_error(code, err, "expert_imbalance", "text '1e6'", "write 1000000")
    assert "peak_tflops" not in err


def test_exponent_text_in_a_device_keeps_its_unit_hint() -> None:
    data = {**INLINE_DEVICE, "peak_tflops_bf16": "989e12"}
    with pytest.raises(SpecError) as info:
        load_cluster_from(data)
    assert "TFLOP/s" in info.value.fix


def load_cluster_from(device: dict[str, Any]) -> ClusterSpec:
    data = yaml.safe_load((CLUSTERS / "dgx-b200.yaml").read_text())
    data["device"] = device
    return ClusterSpec.from_mapping(data, "c.yaml")


def test_expert_imbalance_is_bounded_by_what_ep_ranks_can_receive() -> None:
    """The busiest of ep ranks can at most receive all routed tokens (ep times the average), so the factor acts up
    to ep; one factor stays valid across a sweep over ep (at ep 1 routing skew changes no rank's work)."""
    assert PlanSpec(global_batch=8, dp=4, ep=4, expert_imbalance=4.5).expert_load == 4.0
    assert PlanSpec(global_batch=8, dp=4, ep=4, expert_imbalance=1.3).expert_load == 1.3
    assert PlanSpec(global_batch=8, dp=4, expert_imbalance=1.3).expert_load == 1.0


@pytest.mark.parametrize(
    ("model", "ep", "cap"),
    [("mixtral-8x7b", 8, 4.0), ("mixtral-8x7b", 4, 4.0), ("mixtral-8x7b", 2, 2.0), ("qwen3-235b-a22b", 32, 16.0)],
)
def test_expert_load_is_capped_by_one_copy_of_a_token_per_expert(model: str, ep: int, cap: float) -> None:
    """Top-k routes a token to k distinct experts, so a rank holding e experts receives at most min(k, e) copies of
    each token of its group: ep · min(k, e) / k times the average. Mixtral (8 experts, top-2) at ep 8 had been
    capped at ep's 8 (65,536 rows on the busiest rank where 32,768 is the most routing can send), Qwen3-235B
    (128, top-8) at ep 32 at 32 instead of 16; the expert GEMMs, all-to-alls and activations all scaled with it.
    Found by a review of the MoE model."""
    spec = load_model(model)
    plan = PlanSpec(global_batch=256, dp=ep, ep=ep, expert_imbalance=1000.0)
    assert expert_load(plan, spec) == cap
    assert expert_load(replace(plan, expert_imbalance=1.5), spec) == 1.5


def test_a_directory_given_as_a_model_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*TP8, "--cluster", "dgx-h100", "--model", str(tmp_path)], capsys)
    assert_clean_error(code, err, str(tmp_path), "is a directory, not a file")
    with pytest.raises(SpecError, match="is a directory"):
        find_file("cluster", str(tmp_path) + "/")


@pytest.mark.parametrize("flag", ["--model", "--cluster"])
def test_a_yaml_file_that_is_not_utf8_names_the_line_and_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """A Latin-1 YAML had been reported as "cannot be read (UnicodeDecodeError: 'utf-8' codec can't decode byte
    0xe9 in position 27: invalid continuation byte)": Python's words, an offset, no line. Every reader of a file
    (YAML, config.json, validation and calibration CSVs) now says it alike."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: tiny\nlayers: 2\ndescription: caf\u00e9\n".encode("latin-1"))
    argv = [*TP8, "--cluster", "dgx-h100"]
    argv[argv.index(flag) + 1] = str(path)
    code, _, err = run(argv, capsys)
    assert_clean_error(code, err, str(path), "is not UTF-8 text: line 3, byte 17 is 0xe9")
    assert "save the file as UTF-8" in err
    assert "UnicodeDecodeError" not in err


def test_a_bare_directory_name_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mymodels").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = run([*TP8, "--cluster", "dgx-h100", "--model", "mymodels"], capsys)
    assert_clean_error(code, err, "mymodels: is a directory, not a model file")


# -- 5. values that cannot describe a real run --------------------------------------------------------------


@pytest.mark.parametrize("key", ["intra_node_latency_us", "inter_node_latency_us"])
def test_latency_beyond_the_nccl_timeout_is_refused(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster_copy(tmp_path, "dgx-h100", **{key: 1.0e300})
    code, _, err = run([*TP8, "--cluster", str(path)], capsys)
    assert_clean_error(code, err, f"{key}: must be at most", "NCCL timeout")
    assert load_cluster(cluster_copy(tmp_path, "dgx-h100", **{key: 5.0e8})).name == "dgx-h100"  # below the bound


def test_latency_bound_holds_for_specs_built_in_python(toy_cluster: ClusterSpec) -> None:
    from dataclasses import replace

    with pytest.raises(SpecError, match="inter_node_latency_s"):
        replace(toy_cluster, inter_node_latency_s=2 * MAX_LATENCY_S)


@pytest.mark.parametrize("knob", ["recompute_layers", "layers_at_start_in_bf16", "layers_at_end_in_bf16"])
def test_layer_counts_beyond_the_model_are_refused(knob: str) -> None:
    extra = {"recompute": "full"} if knob == "recompute_layers" else {"precision": "fp8"}
    plan = PlanSpec(global_batch=8, **extra, **{knob: 33})
    with pytest.raises(SpecError) as info:
        plan.check_model_layers(32)
    assert info.value.where == knob
    assert "32 decoder layers" in info.value.what
    PlanSpec(global_batch=8, **extra, **{knob: 32}).check_model_layers(32)


@pytest.mark.parametrize("knob", ["recompute_layers", "layers_at_start_in_bf16"])
def test_a_layer_count_beyond_the_model_is_refused_by_simulate(knob: str) -> None:
    """Found by trying: recompute_layers 50 or 40 BF16 layers on a 32-layer model ran as if valid."""
    from simulator.run import simulate
    from simulator.specs import load_cluster, load_model

    extra: dict[str, Any] = {"recompute": "full"} if knob == "recompute_layers" else {"precision": "fp8"}
    plan = PlanSpec(tp=8, dp=1, global_batch=8, **extra, **{knob: 50})
    with pytest.raises(SpecError, match=f"must be <= the model's 32 decoder layers, got {knob}=50"):
        simulate(load_model("llama3-8b"), load_cluster("dgx-h100"), plan)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: d["compute"][0].update(precision="bf61"), "compute[0].precision: must be one of any, fp32"),
        (lambda d: d["compute"].append(dict(d["compute"][0])), "repeats the op and precision of compute[0]"),
        (lambda d: d["collectives"].append(dict(d["collectives"][0])), "repeats the collective, scope and ranks"),
        (lambda d: d.update(launch_overhead_us=1e20), "launch_overhead_us: must be <= 1000000"),
    ],
)
def test_a_calibration_table_refuses_what_it_would_silently_ignore_or_blow_up(change: Any, says: str) -> None:
    """A curve at a precision no op runs at (a typo) was never used; a second curve of the same key was ignored, or won
    where it came first; a launch cost of 1e20 us made a step of 1e18 s. Each is bad input, located."""
    data = yaml.safe_load(find_file("calibration", "h100-sxm5-80gb").read_text())
    change(data)
    with pytest.raises(SpecError, match=says.replace("[", r"\[").replace("]", r"\]")):
        CalibrationTable.from_mapping(data, "t.yaml")


def test_an_empty_device_name_says_it_is_empty() -> None:
    """`device: ""` in a cluster file read as the current folder ("is a directory")."""
    with pytest.raises(SpecError, match="device '': is empty"):
        find_file("device", "")


def test_a_key_set_twice_to_different_values_is_refused() -> None:
    """--set plan.tp=8 --set plan.tp=4 ran with tp 4, silently; the same value twice is harmless."""
    from simulator.specs.library import parse_overrides

    with pytest.raises(SpecError, match="given twice, as 8 and 4"):
        parse_overrides(["plan.tp=8", "plan.tp=4"])
    assert parse_overrides(["plan.tp=8", "plan.tp=8"]) == {"plan": {"tp": 8}}


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs named pipes")
def test_a_model_or_cluster_from_a_pipe_is_read(tmp_path: Path) -> None:
    """Found by a CLI review: '--model <(cat m.yaml)' was 'file not found' (a pipe is no regular file), and once
    past that its cache key resolved to /proc/.../pipe:[n], which cannot be opened. Two pipes by one name are two
    reads, not one cached answer."""
    import os
    import threading

    from simulator.specs.library import load_model

    fifo = tmp_path / "model.yaml"
    os.mkfifo(fifo)
    text = (ROOT / "models" / "llama3-8b.yaml").read_text()
    names = []
    for layers in (32, 16):

        def write(content: str = text.replace("layers: 32", f"layers: {layers}", 1)) -> None:
            fifo.write_text(content)

        writer = threading.Thread(target=write, daemon=True)  # never left blocked on the pipe
        writer.start()
        names.append(load_model(fifo).layers)
        writer.join()
    assert names == [32, 16]


def test_a_network_scope_curve_in_a_table_is_refused_not_ignored() -> None:
    """The cost model times what crosses the network from the cluster's NIC fields and never looks up a network
    curve, so a table carrying one (all-reduce over 16 GPUs on two nodes at 0.001 GB/s, say) was accepted and left
    the answer unchanged. Found by a review of the communication model."""
    data = yaml.safe_load((ROOT / "hardware_profiles" / "calibration" / "h100-sxm5-80gb.yaml").read_text())
    curve = {"collective": "all_reduce", "scope": "network", "ranks": 16, "log2_bytes": [20, 30]}
    data["collectives"].append({**curve, "busbw_gb_per_s": [0.001, 0.001]})
    with pytest.raises(SpecError) as info:
        CalibrationTable.from_mapping(data, "t.yaml")
    err = info.value
    assert err.where == f"t.yaml: collectives[{len(data['collectives']) - 1}].scope"
    assert "network curves are not read" in err.what
    assert "nic_bandwidth_gbit_per_s" in err.what + err.fix


@pytest.mark.parametrize("flag", ["--model", "--cluster"])
def test_a_device_file_given_as_a_spec_is_refused_not_read_whole(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """/dev/zero as a model or cluster (or a validation row's cluster) was read whole: memory until a MemoryError
    traceback. Found by a review of ``validate``."""
    argv = [*TP8, "--cluster", "dgx-h100"]
    argv[argv.index(flag) + 1] = "/dev/zero"
    code, _, err = run(argv, capsys)
    assert_clean_error(code, err, "/dev/zero", "holds more than 64 MiB, far more than a spec file")
