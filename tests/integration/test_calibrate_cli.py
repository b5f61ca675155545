"""``clustersim calibrate`` end to end on a tiny CPU loop, the importers on shipped data, and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from simulator.cli import main

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "calibration"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.torch
def test_tiny_loop_profile_fit_check_and_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    host = tmp_path / "host"
    code, out, err = run(
        ["calibrate", "host", "--configs", "tiny", "--micro-batch", "1,2", "--ranks", "1", "--steps", "2",
         "--warmup", "1", "--repeats", "3", "--fp8-emulated", "--out", str(host), "--format", "json"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert len(result["rows"]) == 2
    for row in result["rows"]:
        assert row["measured_s"] > 0
        assert row["predicted_s"] > 0
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
    assert result["residuals"]["all kernels"]["n"] > 0
    cluster = host / "clusters" / "host-cpu.yaml"
    assert run(["check", str(cluster), str(host / "devices" / "host-cpu.yaml")], capsys)[0] == 0
    assert "peak_tflops_fp8" in (host / "devices" / "host-cpu.yaml").read_text()  # --fp8 profiled FP8 GEMMs
    assert "precision: fp8" in (host / "calibration" / "host-cpu.yaml").read_text()

    model = tmp_path / "tiny.yaml"
    model.write_text("name: tiny\nlayers: 2\nhidden: 64\nheads: 4\nffn_hidden: 256\nvocab: 256\nseq_len: 32\n")
    code, out, err = run(
        ["simulate", "--model", str(model), "--cluster", str(cluster), "--gpus", "1", "--global-batch", "1",
         "--micro-batch", "1", "--format", "json"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["calibration"] == "host-cpu"

    # The same loop by hand: profile, fit (with residuals), check against the cluster written above.
    prof = tmp_path / "prof"
    code, out, err = run(["calibrate", "profile", "--configs", "tiny", "--repeats", "3", "--out", str(prof)], capsys)
    assert code == 0, err
    assert "planned" in out
    table = tmp_path / "t.yaml"
    code, out, err = run(["calibrate", "fit", str(prof), "--out", str(table), "--format", "json"], capsys)
    assert code == 0, err
    fitted = json.loads(out)
    assert fitted["derived_device"]
    assert fitted["missing"] == []
    assert "gemm:bf16" in fitted["curves"]
    first = table.read_bytes()
    assert run(["calibrate", "fit", str(prof), "--out", str(table)], capsys)[0] == 0
    assert table.read_bytes() == first  # same rows, same bytes
    code, out, err = run(
        ["calibrate", "check", "--configs", "tiny", "--cluster", str(cluster), "--steps", "2", "--format", "json"],
        capsys,
    )
    assert code == 0, err
    assert {"configuration", "measured_s", "predicted_s", "error"} <= set(json.loads(out)["rows"][0])


@pytest.mark.torch
def test_fp8_profile_calibrates_fp8_gemms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    model = tmp_path / "tiny.yaml"
    model.write_text("name: tiny\nlayers: 2\nhidden: 64\nheads: 4\nffn_hidden: 256\nvocab: 320\nseq_len: 32\n")
    prof = tmp_path / "prof"
    argv = ["calibrate", "profile", "--model", str(model), "--fp8-emulated", "--repeats", "2", "--out", str(prof)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    table, device = tmp_path / "t.yaml", tmp_path / "d.yaml"
    argv = ["calibrate", "fit", str(prof), "--out", str(table), "--device-out", str(device), "--format", "json"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert {"gemm:bf16", "gemm:fp8"} <= set(json.loads(out)["curves"])
    assert "peak_tflops_fp8" in device.read_text()
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        f"name: c\ndevice: {device}\ngpus_per_node: 1\nnvlink_bandwidth_gb_per_s: 100\nnics_per_node: 1\n"
        f"nic_bandwidth_gbit_per_s: 1\ncalibration: {table}\nsource: test\n"
    )
    argv = ["simulate", "--model", str(model), "--cluster", str(cluster), "--gpus", "1", "--global-batch", "1",
            "--micro-batch", "1", "--precision", "fp8", "--format", "json"]  # fmt: skip
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert not [label for label in json.loads(out)["uncalibrated_ops"] if label.startswith("gemm")]


def test_importers_write_rows_from_shipped_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows"
    mlp = DATA / "vidur" / "compute" / "h100" / "Llama-2-7b-hf" / "mlp.csv"
    assert run(["calibrate", "import-vidur", str(mlp), "--out", str(out / "vidur.csv")], capsys)[0] == 0
    vtrain = DATA / "vtrain" / "a100_all_reduce_4gpu.txt"
    assert run(["calibrate", "import-nccl-tests", str(vtrain), "--out", str(out / "nccl.csv")], capsys)[0] == 0
    code, text, err = run(
        ["calibrate", "fit", str(out / "vidur.csv"), "--device", "H100-SXM5-80GB", "--out", str(tmp_path / "h.yaml")],
        capsys,
    )
    assert code == 0, err
    assert "held-out residuals" in text
    assert "gemm:fp16" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["calibrate", "fit", "/nonexistent/dir", "--out", "t.yaml"], "no such file or directory"),
        (["calibrate", "fit", "data/calibration/vtrain", "--out", "t.txt"], "must be a .yaml file"),
        (["calibrate", "import-vidur", "/nonexistent.csv", "--out", "x.csv"], "no such file"),
        (["calibrate", "import-torch-profiler", "README.md", "--out", "x.csv"], "Chrome trace"),
        (["calibrate", "profile", "--out", "x"], "give --model"),
        (["calibrate", "profile", "--tp", "0", "--out", "x"], "a whole number >= 1, got '0' in '0'"),
        (["calibrate", "profile", "--model", "gpt3-175b", "--tp", "5", "--out", "x"], "divide"),
        (["calibrate", "profile", "--sustain", "-5", "--out", "x"], "seconds from 0 to 3600, got '-5'"),
        (["calibrate", "host", "--sustain", "inf"], "seconds from 0 to 3600, got 'inf'"),
        (["calibrate", "check", "--cluster", "dgx-a100-80g-typo.yaml"], "file not found"),
    ],
)
def test_bad_input_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(ROOT)
    argv = [a if a not in ("x", "x.csv", "t.yaml", "t.txt") else str(tmp_path / a) for a in argv]
    code, _, err = run(argv, capsys)
    assert code == 2
    assert err.startswith("error:")
    assert message in err
    assert "Traceback" not in err


def test_missing_torch_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    code, _, err = run(["calibrate", "profile", "--configs", "tiny", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "pip install 'clustersim[profile]'" in err


def test_check_without_a_table_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["calibrate", "check", "--cluster", "dgx-v100", "--configs", "tiny"], capsys)
    assert code == 2
    assert "no calibration table" in err


@pytest.mark.slow
@pytest.mark.torch
def test_collectives_and_ddp_on_two_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    prof = tmp_path / "prof"
    code, _, err = run(
        ["calibrate", "profile", "--configs", "tiny", "--collectives", "--ranks", "2", "--out", str(prof)], capsys
    )
    assert code == 0, err
    rows = (prof / "collectives.csv").read_text().splitlines()
    assert len(rows) > 10
    code, out, err = run(["calibrate", "host", "--configs", "cpu", "--out", str(tmp_path / "h"), "--format", "json"],
                         capsys)  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert any(r["configuration"]["ranks"] == 2 for r in result["rows"])
    assert result["median_abs_error"] <= 0.2


def test_import_nccl_tests_scope_applies_to_vtrain_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`import-nccl-tests <vTrain table> --scope network` wrote every row as domain: the scope was never passed to the
    vTrain reader, which wrote domain whatever was asked. Found by a review of the calibration workflow."""
    out = tmp_path / "nccl.csv"
    vtrain = DATA / "vtrain" / "a100_all_reduce_4gpu.txt"
    code, _, err = run(["calibrate", "import-nccl-tests", str(vtrain), "--scope", "network", "--out", str(out)], capsys)
    assert code == 0, err
    scopes = {line.split(",")[10] for line in out.read_text().splitlines()[1:]}
    assert scopes == {"network"}
    code, _, err = run(["calibrate", "import-nccl-tests", str(vtrain), "--out", str(out)], capsys)
    assert code == 0, err
    assert {line.split(",")[10] for line in out.read_text().splitlines()[1:]} == {"domain"}


def test_fit_holdout_of_one_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fit --holdout 1` skipped the residual report without a word (every shape left out would leave nothing to
    fit), while the help promised to leave every Nth shape out: 1 is refused, and the help says what 0 does. Found by
    a review of the calibration workflow."""
    vtrain = DATA / "vtrain" / "a100_all_reduce_4gpu.txt"
    rows = tmp_path / "nccl.csv"
    assert run(["calibrate", "import-nccl-tests", str(vtrain), "--out", str(rows)], capsys)[0] == 0
    fit = ["calibrate", "fit", str(rows), "--device", "A100-SXM4-80GB", "--out", str(tmp_path / "t.yaml")]
    code, _, err = run([*fit, "--holdout", "1"], capsys)
    assert code == 2
    assert "argument --holdout: expected 0 (no held-out report) or a whole number >= 2, got '1'" in err
    assert not (tmp_path / "t.yaml").exists()
    code, out, err = run([*fit, "--holdout", "0"], capsys)
    assert code == 0, err
    assert "held-out residuals" not in out
    assert main(["calibrate", "fit", "--help"]) == 0
    assert "0 skips the report" in " ".join(capsys.readouterr().out.split())


@pytest.mark.torch
def test_profile_interrupted_by_ctrl_c_says_what_it_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during `calibrate profile` printed a KeyboardInterrupt traceback: it prints one line saying how many
    rows the folder keeps and exits 130 (128 + SIGINT, as a shell reports it). Found by a review of the calibration
    workflow."""
    pytest.importorskip("torch")
    from simulator.calibration import profile

    real = profile._time_shape
    calls = {"n": 0}

    def interrupted(shape: Any, dev: Any, warmup: int, repeats: int, cold: bool = False) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(shape, dev, 0, 1)

    monkeypatch.setattr(profile, "_time_shape", interrupted)
    out = tmp_path / "prof"
    code, _, err = run(["calibrate", "profile", "--configs", "tiny", "--no-probes", "--out", str(out)], capsys)
    assert code == 130
    assert err.splitlines()[-1] == f"interrupted; 2 rows kept in {out} (rerun the same command to measure the rest)"
    assert "Traceback" not in err


@pytest.mark.torch
def test_profile_says_shapes_and_rows_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The line "N shapes measured now" counted rows: with --passes 2 it said twice the shapes there were. Found by a
    review of the calibration workflow."""
    pytest.importorskip("torch")
    out = tmp_path / "prof"
    argv = ["calibrate", "profile", "--configs", "tiny", "--no-probes", "--repeats", "1", "--warmup", "0"]
    code, text, err = run([*argv, "--passes", "2", "--out", str(out)], capsys)
    assert code == 0, err
    planned = int(text.split(" planned in ")[0].rsplit(" ", 1)[1])
    assert f": {planned} shapes measured now ({2 * planned} rows, one per pass), 0 kept" in text
