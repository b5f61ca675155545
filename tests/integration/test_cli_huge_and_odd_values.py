"""Values a fuzzing pass of the CLI found crashing it (2026-11-29): integers beyond any float, YAML dates and
binaries in --set, a GPU count whose divisors took minutes, an endless input file. Each is bad input (exit 2, one
``error:`` line) or, where the value is harmless, an answer (exit 0); none may end in a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator import validate
from simulator.cli import main
from simulator.search.layouts import _divisors, _pp_degrees, _splits_layers, layouts
from simulator.specs import load_cluster, load_model

ROOT = Path(__file__).resolve().parents[2]
HUGE = 10**400  # no float holds it: float(HUGE) raises OverflowError
SIM = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "8", "--global-batch", "16"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    assert "Traceback" not in err, err
    return err


def test_a_huge_integer_in_a_device_file_is_too_large_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (ROOT / "hardware_profiles/devices/H100-SXM5-80GB.yaml").read_text()
    device = tmp_path / "d.yaml"
    device.write_text(text.replace("hbm_gib: 79.6", f"hbm_gib: {HUGE}"))
    assert f"hbm_gib: {HUGE}" in device.read_text()
    err = _error(capsys, ["check", str(device)])
    assert "hbm_gib: is too large: a number of 401 digits" in err


@pytest.mark.parametrize("key", ["device.hbm_gib", "plan.straggler_factor", "cluster.nic_bandwidth_gbit_per_s"])
def test_a_huge_integer_given_with_set_is_too_large(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, [*SIM, "--set", f"{key}={HUGE}"])
    assert key.split(".")[1] in err
    assert "too large" in err


def test_a_huge_integer_in_a_calibration_curve_is_not_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "cal.yaml"
    table.write_text(
        "name: fz\ndevice: H100-SXM5-80GB\ncompute:\n"
        f"- {{op: gemm, precision: bf16, log10_size: [1, {HUGE}], efficiency: [0.5, 0.6]}}\n"
    )
    err = _error(capsys, ["check", str(table)])
    assert "compute[0].log10_size[1]: must be a finite number, got a number of 401 digits" in err


def test_a_collectives_group_size_is_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ranks of 10**400 passed `check` and crashed the nearest-group-size lookup of `simulate`."""
    table = tmp_path / "cal.yaml"
    curve = "log2_bytes: [10, 20, 30], busbw_gb_per_s: [1, 100, 400]"
    table.write_text(
        "name: fz\ndevice: H100-SXM5-80GB\ncollectives:\n"
        f"- {{collective: all_reduce, scope: domain, ranks: 8, {curve}}}\n"
        f"- {{collective: all_reduce, scope: domain, ranks: {HUGE}, {curve}}}\n"
    )
    err = _error(capsys, ["check", str(table)])
    assert "collectives[1].ranks: must be <= 9,007,199,254,740,992, got a number of 401 digits" in err


def test_a_yaml_date_given_with_set_is_text_and_json_still_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`sources` is a key the specs read without judging it; a YAML date there reached json.dumps and the trace."""
    trace = tmp_path / "t.json"
    argv = [*SIM, "--set", "model.sources=2001-01-01", "--format", "json", "--trace", str(trace)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert "2001-01-01" in json.dumps(out)
    json.loads(trace.read_text())
    assert main([*SIM, "--set", "model.sources=!!binary aGVsbG8=", "--format", "json"]) == 0
    assert "!!binary aGVsbG8=" in capsys.readouterr().out


def test_a_sweep_takes_a_date_on_the_command_line_as_text_and_refuses_one_in_a_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = ["sweep", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "8"]
    out = tmp_path / "s.json"
    argv = [*sweep, "--global-batch", "16", "--workers", "1", "--set", "cluster.sources=2001-01-01", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    assert "2001-01-01" in out.read_text()
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        "model: llama3-8b\ncluster: dgx-h100\ngpus: 8\ntp: 8\nglobal_batch: 16\nset:\n  cluster.sources: [2001-01-01]\n"
    )
    err = _error(capsys, ["sweep", str(grid), "--workers", "1"])
    assert "set: cluster.sources: holds datetime.date(2001, 1, 1), which YAML reads as a date" in err
    assert "quote it" in err


def test_plan_refuses_a_gpu_count_beyond_2_53(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", str(HUGE), "--global-batch", "16"]
    err = _error(capsys, [*argv, "--workers", "1"])
    assert "num_gpus: must be at most 2**53" in err
    assert "a number of 401 digits" in err


def test_divisors_come_from_prime_factors() -> None:
    """Trial division up to sqrt(n) took minutes for 2**53 GPUs (a schedule's count); the factors take a few steps."""
    for n in range(1, 2000):
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    assert _divisors(2**53) == [2**k for k in range(54)]
    assert _divisors(2**40 * 3**5 * 7) == sorted(
        2**a * 3**b * 7**c for a in range(41) for b in range(6) for c in range(2)
    )


def test_pipeline_degrees_are_the_divisors_that_split_the_layers() -> None:
    for n in (1, 8, 12, 64, 96, 128, 1000):
        for layers in (1, 2, 4, 30, 32, 80, 94, 126):
            expected = [p for p in range(1, n + 1) if n % p == 0 and _splits_layers(layers, p)]
            assert _pp_degrees(n, layers) == expected, (n, layers)


def test_layouts_unchanged_by_the_narrower_candidate_lists() -> None:
    """tp from the gcd of GPUs and heads, pp from the gcd of GPUs and layers, ep from the gcd of experts and dp·cp:
    the same layouts as filtering every divisor of the GPU count."""
    h100 = load_cluster("dgx-h100")
    llama = layouts(load_model("llama3-70b"), h100, 256, 512, zero_stage=[1])
    assert {(p.tp, p.pp, p.cp) for p in llama} >= {(8, 4, 1), (4, 8, 1), (8, 8, 1), (1, 1, 1)}
    assert {p.pp for p in llama} == {d for d in range(1, 257) if 256 % d == 0 and _splits_layers(80, d)}
    moe = layouts(load_model("mixtral-8x7b"), h100, 64, 64, zero_stage=[1])
    assert {p.ep for p in moe} == {1, 2, 4, 8}
    assert all(8 % p.ep == 0 and (p.dp * p.cp) % p.ep == 0 for p in moe)


def test_validate_refuses_an_endless_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`validate /dev/zero` read until memory ran out; a file over the cap is refused by its size."""
    monkeypatch.setattr(validate, "MAX_CSV_BYTES", 1000)
    big = tmp_path / "big.csv"
    big.write_text("run_id\n" + "x\n" * 1000)
    err = _error(capsys, ["validate", str(big)])
    assert f"{big}: holds more than" in err
    assert "the wrong file?" in err


TRACES = {
    "dur": {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": HUGE, "args": {"Input Dims": [[4, 2], [2, 3]]}},
    "dims": {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10, "args": {"Input Dims": [[HUGE, 2], [2, 3]]}},
}


@pytest.mark.parametrize("case", sorted(TRACES))
def test_torch_profiler_import_skips_events_with_huge_integers(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [TRACES[case]]}))
    err = _error(capsys, ["calibrate", "import-torch-profiler", str(trace), "--out", str(tmp_path / "o.csv")])
    assert "no recognised operators" in err


def test_torch_profiler_import_refuses_a_5000_digit_integer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": [{"dur": ' + "9" * 5000 + "}]}")
    err = _error(capsys, ["calibrate", "import-torch-profiler", str(trace), "--out", str(tmp_path / "o.csv")])
    assert "an integer of more than 4,300 digits" in err


def test_a_collectives_huge_message_size_is_unreadable_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = [
        {
            "cat": "cpu_op",
            "name": "record_param_comms",
            "ts": 0,
            "dur": 5,
            "args": {"In msg nelems": HUGE, "dtype": "BFloat16", "Group size": 8, "External id": 3},
        },
        {"cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 1, "dur": 5, "args": {"External id": 3}},
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    err = _error(capsys, ["calibrate", "import-torch-profiler", str(trace), "--out", str(tmp_path / "o.csv")])
    assert "no recognised operators" in err


def test_vidur_import_names_a_huge_cell_briefly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = ROOT / "data/calibration/vidur/compute/h100/Llama-2-7b-hf/mlp.csv"
    lines = source.read_text().splitlines()
    first = lines[1].split(",")
    first[0] = str(HUGE)
    mlp = tmp_path / "h100" / "mlp.csv"
    mlp.parent.mkdir()
    mlp.write_text("\n".join([lines[0], ",".join(first), *lines[2:5]]) + "\n")
    err = _error(capsys, ["calibrate", "import-vidur", str(mlp), "--out", str(tmp_path / "o.csv")])
    assert "line 2, column 'time_stats.emb.min': expected a number" in err
    assert "(401 characters)" in err
    assert len(err) < 400
