"""Defects of ``clustersim calibrate`` found by adversarial testing: each is now a clean ``error:`` (exit 2)
that names the file and says what to do, a note on stderr, or a warning, never a traceback or a silent result."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from simulator.calibration import check as check_mod
from simulator.calibration.check import device_mismatch
from simulator.calibration.host import host_cluster
from simulator.calibration.importers.nccl_tests import collective_name, import_nccl_tests, import_vtrain_table
from simulator.calibration.importers.torch_profiler import import_torch_trace
from simulator.calibration.importers.vidur import import_vidur_network
from simulator.calibration.profile import _read_manifest, fp8_refusal
from simulator.calibration.rows import COLUMNS, Measurement, RowAppender, read_rows, write_rows
from simulator.cli import main
from simulator.errors import CalibrationError
from simulator.specs.calibration import COLLECTIVES
from simulator.specs.hardware import DeviceSpec
from simulator.specs.library import load_cluster

BINARY = b'\xff\xfe{"a":1}'
NCCL_HEADER = """\
# nThread 1 nGpus 2 minBytes 0 maxBytes 128 step: 2(factor) warmup iters: 5 iters: 20
# Collective test starting: all_reduce_perf
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
"""
NCCL_LINE = "{size:>12} 2 float sum -1 {time} 0.00 0.00 0 11.23 0.00 0.00 0\n"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def nccl_output(*lines: tuple[int, str]) -> str:
    return NCCL_HEADER + "".join(NCCL_LINE.format(size=size, time=time) for size, time in lines)


def measurement_csv(path: Path, rows: list[dict[str, str]]) -> Path:
    lines = [",".join(COLUMNS)] + [",".join(row.get(c, "") for c in COLUMNS) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# -- 1. non-UTF-8 input is a clean error naming the file -----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "command", "prefix"),
    [
        ("rows.csv", ["calibrate", "fit"], b""),
        ("trace.json", ["calibrate", "import-torch-profiler"], b""),
        ("all_reduce.txt", ["calibrate", "import-nccl-tests"], b""),
        ("a100_all_reduce_8gpu.txt", ["calibrate", "import-nccl-tests"], b"size(B),count,type,time(ns)\n"),
        ("mlp.csv", ["calibrate", "import-vidur"], b""),
        ("all_reduce.csv", ["calibrate", "import-vidur"], b""),
    ],
)
def test_non_utf8_input_is_a_clean_error_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, command: list[str], prefix: bytes
) -> None:
    path = tmp_path / name
    path.write_bytes(prefix + BINARY)
    out = tmp_path / ("t.yaml" if command[-1] == "fit" else "rows.csv")
    code, _, err = run([*command, str(path), "--out", str(out)], capsys)
    assert code == 2
    line = prefix.count(b"\n") + 1
    column = len(prefix) - (prefix.rfind(b"\n") + 1) + 1
    assert err.startswith(f"error: {path}: is not UTF-8 text: line {line}, byte {column} is 0xff"), err
    assert "saved as UTF-8" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_every_reader_of_a_profile_folder_reports_non_utf8_files(tmp_path: Path) -> None:
    (tmp_path / "kernels.csv").write_bytes(BINARY)
    with pytest.raises(CalibrationError, match=r"kernels\.csv: is not UTF-8 text: line 1, byte 1 is 0xff"):
        read_rows([tmp_path])
    with pytest.raises(CalibrationError, match="exists with other columns"):
        RowAppender(tmp_path / "kernels.csv")
    (tmp_path / "manifest.json").write_bytes(BINARY)
    with pytest.raises(CalibrationError, match=r"manifest\.json: not a profile manifest"):
        _read_manifest(tmp_path)


# -- 2. collectives outside the calibration tables' list are refused ------------------------------------------


def test_import_nccl_tests_refuses_an_unknown_collective(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out.txt"
    path.write_text(nccl_output((8, "11.4")))
    out = tmp_path / "rows.csv"
    code, _, err = run(
        ["calibrate", "import-nccl-tests", str(path), "--collective", "bogus", "--out", str(out)], capsys
    )
    assert code == 2
    assert "--collective 'bogus'" in err
    assert ", ".join(COLLECTIVES) in err
    assert not out.exists()
    # Aliases nccl-tests uses are translated to the table's name.
    assert collective_name("allgather") == "all_gather"
    assert collective_name("reduce_scatter_perf") == "reduce_scatter"
    code, _, err = run(
        ["calibrate", "import-nccl-tests", str(path), "--collective", "allreduce", "--out", str(out)], capsys
    )
    assert code == 0, err
    assert {r.op for r in read_rows([out])} == {"all_reduce"}


def test_fit_refuses_rows_with_an_unknown_collective(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = measurement_csv(
        tmp_path / "rows.csv",
        [{"kind": "collective", "op": "bogus", "bytes": "1048576", "ranks": "8", "scope": "domain", "time_s": "1e-4"}],
    )
    table = tmp_path / "t.yaml"
    code, _, err = run(["calibrate", "fit", str(rows), "--device", "H100-SXM5-80GB", "--out", str(table)], capsys)
    assert code == 2
    assert f"{rows}: line 2:" in err
    assert "'bogus'" in err
    assert "all_reduce" in err
    assert not table.exists()
    with pytest.raises(CalibrationError, match="op must be one of"):
        Measurement(kind="collective", op="allreduce", time_s=1.0)


def test_vidur_network_refuses_an_unknown_collective(tmp_path: Path) -> None:
    path = tmp_path / "network" / "x" / "bogus.csv"
    path.parent.mkdir(parents=True)
    path.write_text(
        "time_stats.bogus.min,time_stats.bogus.median,time_stats.bogus.std,num_workers,size,collective,"
        "devices_per_node\n0.01,0.02,0.001,8,2048,bogus,8\n"
    )
    with pytest.raises(CalibrationError, match="line 2, column 'collective': 'bogus' is not a collective"):
        import_vidur_network(path)


# -- 3. --fp8 needs FP8 tensor cores -----------------------------------------------------------------------


def test_fp8_is_refused_without_fp8_tensor_cores() -> None:
    cpu = fp8_refusal("cpu")
    assert "no FP8 tensor cores" in cpu
    assert "emulated" in cpu
    assert "--fp8-emulated" in cpu
    assert fp8_refusal("cpu", emulated=True) == ""
    a100 = fp8_refusal("cuda", capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    assert "NVIDIA A100-SXM4-80GB (compute capability 8.0) has no FP8 tensor cores" in a100
    assert "8.9" in a100
    assert fp8_refusal("cuda", capability=(8, 6), name="RTX 3090", emulated=True) != ""  # CUDA: never emulated
    assert fp8_refusal("cuda", capability=(8, 9), name="NVIDIA L40S") == ""
    assert fp8_refusal("cuda", capability=(9, 0), name="NVIDIA H100 80GB HBM3") == ""
    assert fp8_refusal("cuda", capability=(10, 0), name="NVIDIA B200") == ""
    assert "no FP8 matmul" in fp8_refusal("cuda", capability=(9, 0), torch_version="2.0.1", has_fp8_matmul=False)


@pytest.mark.torch
@pytest.mark.parametrize("command", ["profile", "host"])
def test_fp8_on_the_cpu_is_refused_before_anything_is_timed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out"
    code, _, err = run(
        ["calibrate", command, "--device", "cpu", "--fp8", "--configs", "tiny", "--out", str(out)], capsys
    )
    assert code == 2
    assert "error: FP8 profiling: --device cpu has no FP8 tensor cores" in err
    assert "profile without --fp8" in err
    assert not (out / "kernels.csv").exists()
    assert not (out / "profile" / "kernels.csv").exists()


# -- 4. messages that name the right thing and say what to do -------------------------------------------------


def test_fit_of_fp32_rows_without_device_says_device_must_name_the_measured_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = measurement_csv(
        tmp_path / "trace.csv",
        [
            {
                "kind": "gemm",
                "op": "aten::addmm",
                "precision": "fp32",
                "m": "64",
                "n": "512",
                "k": "512",
                "flops": "33554432.0",
                "time_s": "0.03",
                "source": "PyTorch profiler trace t.json",
            },
            {"kind": "memory", "op": "aten::add_", "precision": "fp32", "bytes": "3145728.0", "time_s": "0.01"},
        ],
    )
    table = tmp_path / "fittp.yaml"
    code, _, err = run(["calibrate", "fit", str(rows), "--out", str(table)], capsys)
    assert code == 2
    # Imported rows carry no probes to derive a device from (it used to be made up from their fastest GEMM).
    assert "these rows are not one: they were imported" in err
    assert "--device must name the device the rows were measured on" in err
    assert "device fittp" not in err
    assert "e.g. --device A100-SXM4-80GB (a built-in name" in err  # the rows name no device we ship
    named = tmp_path / "named.csv"
    frame = pd.read_csv(rows, dtype=str, keep_default_na=False)
    frame["device"] = "H100-SXM5-80GB"
    frame.to_csv(named, index=False)
    code, _, err = run(["calibrate", "fit", str(named), "--out", str(table)], capsys)
    assert code == 2
    assert "e.g. --device H100-SXM5-80GB" in err  # it had always suggested the A100
    code, _, err = run(["calibrate", "fit", str(rows), "--device", "V100-SXM2-32GB", "--out", str(table)], capsys)
    assert code == 2
    assert "device V100-SXM2-32GB has no peak_tflops_tf32" in err
    assert "--device must name the device the rows were measured on" in err
    # An H100 has a TF32 peak, but a 33.5 MFLOP GEMM in 30 ms (1.1 GFLOP/s) was not timed on one.
    code, _, err = run(["calibrate", "fit", str(rows), "--device", "H100-SXM5-80GB", "--out", str(table)], capsys)
    assert code == 2
    assert "under 2% of device H100-SXM5-80GB's" in err
    fast = rows.read_text().replace(",0.03,", ",1e-06,")
    assert fast != rows.read_text()
    rows.write_text(fast)
    assert run(["calibrate", "fit", str(rows), "--device", "H100-SXM5-80GB", "--out", str(table)], capsys)[0] == 0


def test_ranks_errors_say_what_to_give(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["calibrate", "host", "--ranks", "0", "--out", str(tmp_path / "h")], capsys)
    assert code == 2
    assert "--ranks must be >= 1" in err
    assert "give --ranks 1 or more" in err
    code, _, err = run(
        ["calibrate", "profile", "--configs", "tiny", "--collectives", "--ranks", "1", "--out", str(tmp_path / "p")],
        capsys,
    )
    assert code == 2
    assert "give --ranks 2 or more, or leave out --collectives" in err


def test_nccl_time_that_is_not_a_number_names_the_line_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "all_reduce.txt"
    path.write_text(nccl_output((8, "11.4"), (16, "abc")))
    with pytest.raises(CalibrationError, match=r"line 5: cannot read a time .*'abc'.*; fix or remove the line"):
        import_nccl_tests(path)
    path.write_text(nccl_output((8, "nan")))
    with pytest.raises(CalibrationError, match=r"line 4: cannot read a time .*'nan'"):
        import_nccl_tests(path)


@pytest.mark.parametrize("command", ["import-nccl-tests", "import-torch-profiler", "fit"])
def test_a_directory_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    out = tmp_path / ("t.yaml" if command == "fit" else "rows.csv")
    code, _, err = run(["calibrate", command, str(folder), "--out", str(out)], capsys)
    assert code == 2
    if command == "fit":  # fit reads folders of CSVs: an empty one says so
        assert "no measurement CSVs found" in err
    else:
        assert f"error: {folder}: is a directory, not a file" in err
        assert "no such file" not in err


# -- 5. dropped input rows are reported ------------------------------------------------------------------------


def test_import_nccl_tests_says_how_many_rows_it_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "all_reduce.txt"
    path.write_text(nccl_output((0, "1.0"), (8, "11.4"), (16, "0"), (32, "-3.5"), (64, "12.0")))
    out = tmp_path / "rows.csv"
    code, text, err = run(["calibrate", "import-nccl-tests", str(path), "--out", str(out)], capsys)
    assert code == 0, err
    assert f"note: {path}: dropped 3 data line(s) with a zero or negative size or time" in err
    assert "line 4, 6, 7" in err
    assert text.startswith(f"wrote 2 rows to {out}")
    assert "note(s) above" in text
    notes: list[str] = []
    assert len(import_nccl_tests(path, notes=notes)) == 2
    assert len(notes) == 1


def test_other_importers_report_dropped_rows(tmp_path: Path) -> None:
    vtrain = tmp_path / "a100_all_reduce_8gpu.txt"
    vtrain.write_text(
        "size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)\n"
        "1024,256,float,5000,0.1,5000,0.1\n2048,512,float,0,0,0,0\n4096,1024\n"
    )
    notes: list[str] = []
    assert len(import_vtrain_table(vtrain, notes=notes)) == 1
    assert any(
        "dropped 1 data line(s) with a zero or negative size or time (nothing to fit): line 3" in n for n in notes
    )
    assert any("fewer than 4 cells" in n and "line 4" in n for n in notes)

    net = tmp_path / "network" / "a100_dgx" / "all_reduce.csv"
    net.parent.mkdir(parents=True)
    net.write_text(
        "time_stats.all_reduce.min,time_stats.all_reduce.median,time_stats.all_reduce.std,num_workers,size,"
        "collective,devices_per_node\n0.01,0.02,0.001,8,2048,all_reduce,8\n0.01,-0.5,0.001,8,4096,all_reduce,8\n"
        "0.01,,0.001,8,8192,all_reduce,8\n"
    )
    notes = []
    assert len(import_vidur_network(net, notes=notes)) == 1
    assert notes == [
        f"{net}: dropped 2 median time cell(s) with no time to fit: 1 zero or negative (first: line 3, column "
        "time_stats.all_reduce.median); 1 empty (first: line 4, column time_stats.all_reduce.median)"
    ]

    trace = tmp_path / "trace.json"
    events = [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100,
         "args": {"Input Dims": [[64, 128], [128, 256]], "Input type": ["float", "float"]}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": "x"},
        {"cat": "cpu_op", "name": "aten::gelu", "ts": 200, "dur": 0, "args": {"Input Dims": [[64, 256]]}},
    ]  # fmt: skip
    trace.write_text(json.dumps({"traceEvents": events}))
    notes = []
    assert [r.op for r in import_torch_trace(trace, notes=notes)] == ["aten::mm"]
    assert any("skipped 1 operator/kernel event(s) it cannot read" in n for n in notes)
    assert any("skipped 1 recognised operator(s) timed at zero duration" in n for n in notes)


# -- 6. check warns when the measured device is not the cluster's ----------------------------------------------


def _cpu_cluster() -> Any:
    device = DeviceSpec(
        name="host-cpu",
        vendor="CPU Intel(R) Xeon(R) Processor (1 threads)",
        peak_flops=(("bf16", 1e11),),
        hbm_bytes=2**33,
        hbm_bandwidth_bytes_per_s=1e10,
    )
    return host_cluster(device, None, [], name="host-cpu", ranks=2)


def test_device_mismatch_between_the_measured_device_and_the_cluster() -> None:
    h100 = load_cluster("dgx-h100")
    why = device_mismatch("cpu", "CPU Intel(R) Xeon(R) Processor (1 threads)", h100)
    assert "--device cpu" in why
    assert "H100-SXM5-80GB" in why
    assert "not a CPU" in why
    assert device_mismatch("cuda", "NVIDIA H100 80GB HBM3", h100) == ""
    assert "NVIDIA A100-SXM4-80GB" in device_mismatch("cuda", "NVIDIA A100-SXM4-80GB", h100)
    assert device_mismatch("cuda", "NVIDIA GeForce RTX 4090", h100) == ""  # no model to compare: no warning
    host = _cpu_cluster()
    assert device_mismatch("cpu", "CPU AMD EPYC 7R13 (2 threads)", host) == ""
    assert "a CPU" in device_mismatch("cuda", "NVIDIA H100 80GB HBM3", host)


@pytest.mark.torch
def test_check_warns_when_the_cluster_is_another_device(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    monkeypatch.setattr(check_mod, "run_check", lambda *args, **kwargs: [])
    code, out, err = run(["calibrate", "check", "--device", "cpu", "--cluster", "dgx-h100", "--format", "json"], capsys)
    assert code == 0, err
    assert err.startswith("warning: --device cpu times real steps on this CPU")
    assert "cluster dgx-h100's device H100-SXM5-80GB" in err
    assert "H100-SXM5-80GB" in json.loads(out)["warning"]


def test_write_rows_round_trip_still_holds(tmp_path: Path) -> None:
    rows = [
        Measurement(kind="collective", op=op, bytes=8.0, ranks=2, scope="domain", time_s=1e-5) for op in COLLECTIVES
    ]
    assert write_rows(rows, tmp_path / "r.csv") == len(COLLECTIVES)
    assert read_rows([tmp_path / "r.csv"]) == rows


# -- one device per table; a profile's failures.csv is not a measurement file --------------------------------


def _gemm_rows(device: str) -> list[dict[str, str]]:
    return [
        {
            "kind": "gemm",
            "op": "gemm",
            "m": str(n),
            "n": str(n),
            "k": str(n),
            "flops": str(2 * n**3),
            "precision": "bf16",
            "time_s": str(2 * n**3 / 5e14),
            "device": device,
        }
        for n in (1024, 2048, 4096, 8192)
    ]


def test_fit_refuses_rows_of_several_devices_and_only_device_picks_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Vidur folder holds A100 and H100 profiles; fitting both into one table averaged their speeds (the README's
    workflow made an 'H100' table three times too slow). Mixing is refused; --only-device keeps one device."""
    rows = measurement_csv(tmp_path / "rows.csv", _gemm_rows("A100-SXM4-80GB") + _gemm_rows("H100-SXM5-80GB"))
    table = tmp_path / "t.yaml"
    base = ["calibrate", "fit", str(rows), "--device", "H100-SXM5-80GB", "--holdout", "0", "--out", str(table)]
    code, _, err = run(base, capsys)
    assert code == 2
    assert "A100-SXM4-80GB (4 rows), H100-SXM5-80GB (4 rows)" in err
    assert "--only-device" in err
    assert not table.exists()
    code, _, err = run([*base, "--only-device", "H100-SXM5-80GB"], capsys)
    assert code == 0, err
    assert "H100-SXM5-80GB" in table.read_text()
    assert "A100-SXM4-80GB" not in table.read_text()
    code, _, err = run([*base, "--only-device", "B200"], capsys)
    assert code == 2
    assert "--only-device B200: no row was measured on it" in err


def test_import_vidur_device_applies_to_a_folder_of_one_gpu_and_is_refused_for_several(tmp_path: Path) -> None:
    from simulator.calibration.importers.vidur import import_vidur_tree

    root = Path(__file__).parents[2] / "data" / "calibration" / "vidur"
    with pytest.raises(CalibrationError, match="holds the profiles of a100, a100_dgx, h100, h100_dgx"):
        import_vidur_tree(root, "MY-GPU")
    one = tmp_path / "profiling"
    (one / "network" / "h100_dgx").mkdir(parents=True)
    src = root / "network" / "h100_dgx" / "send_recv.csv"
    (one / "network" / "h100_dgx" / "send_recv.csv").write_text(src.read_text())
    assert {r.device for r in import_vidur_tree(one, "MY-GPU")} == {"MY-GPU"}


def test_a_profile_folders_failures_csv_is_not_read_as_measurements(tmp_path: Path) -> None:
    """`calibrate profile` writes failures.csv (shape, reason) beside its rows; fitting the folder after a shape
    ran out of memory used to fail on its missing columns."""
    from simulator.calibration.profile import FAILURES
    from simulator.calibration.rows import NOT_MEASUREMENTS

    assert FAILURES in NOT_MEASUREMENTS
    measurement_csv(tmp_path / "kernels.csv", _gemm_rows("H100-SXM5-80GB"))
    (tmp_path / FAILURES).write_text("shape,reason\ngemm:8192x8192x8192:bf16,CUDA out of memory\n")
    assert len(read_rows([tmp_path])) == 4
    with pytest.raises(CalibrationError, match="missing column"):
        read_rows([tmp_path / FAILURES])  # named explicitly, it is still not a measurement file


def test_import_vidur_refuses_a_use_gated_mlp_it_cannot_read(tmp_path: Path) -> None:
    """Anything but "true" used to read as an ungated MLP, halving the up-projection's width without a word."""
    from simulator.calibration.importers.vidur import import_vidur_compute

    src = (Path(__file__).parents[2] / "data/calibration/vidur/compute/a100/Llama-2-7b-hf/mlp.csv").read_text()
    lines = src.splitlines()
    header = lines[0].split(",")
    cells = lines[3].split(",")
    cells[header.index("use_gated_mlp")] = "maybe"
    path = tmp_path / "a100" / "Llama-2-7b-hf" / "mlp.csv"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join([*lines[:3], ",".join(cells), *lines[4:]]) + "\n")
    with pytest.raises(CalibrationError, match=r"line 4: use_gated_mlp must be True or False .* got 'maybe'"):
        import_vidur_compute(path)


def test_only_device_keeps_rows_that_name_no_device(tmp_path: Path) -> None:
    """Rows without a device count as the device's own, with --only-device as without it."""
    from simulator.calibration.workflow import fit_files
    from simulator.specs.library import load_device

    rows = _gemm_rows("H100-SXM5-80GB") + _gemm_rows("")
    path = measurement_csv(tmp_path / "rows.csv", rows)
    result = fit_files([path], name="t", device=load_device("H100-SXM5-80GB"), holdout_every=0,
                       only_device=("H100-SXM5-80GB",))  # fmt: skip
    assert len(result.rows) == 8


@pytest.mark.parametrize(
    ("cells", "says"),
    [
        ({"flops": ""}, "column 'flops': empty is not a positive number for a gemm row"),
        ({"flops": "nan"}, "column 'flops': empty is not a positive number for a gemm row"),
        ({"flops": "-5"}, "column 'flops': -5.0 is not a positive number"),
        ({"precision": "abc"}, "column 'precision': 'abc' is not one of fp32, tf32, fp16, bf16, fp8"),
    ],
)
def test_fit_names_the_line_and_column_of_an_unfittable_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cells: dict[str, str], says: str
) -> None:
    """A GEMM row without FLOPs used to end fit in an IndexError traceback (exit 1), one with an unknown precision in
    a message naming neither file nor line; both are bad input now, located."""
    good = {"kind": "gemm", "op": "gemm.fwd", "precision": "bf16", "m": "64", "n": "64", "k": "64"}
    good |= {"flops": "524288.0", "time_s": "1e-5"}
    rows = measurement_csv(tmp_path / "k.csv", [good, good | cells])
    code, _, err = run(
        ["calibrate", "fit", str(rows), "--device", "H100-SXM5-80GB", "--out", str(tmp_path / "t.yaml")], capsys
    )
    assert code == 2
    assert f"{rows}: line 3: {says}" in err
    assert "Traceback" not in err


def test_profile_and_host_refuse_more_threads_ranks_or_load_than_the_machine_can_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--threads 100000 crashed PyTorch (exit 139), --ranks 100000 was killed for memory (exit 137) and --sustain
    1e30 ran forever; each is bad input now, with the bound it broke."""
    import os

    cores = os.cpu_count() or 1
    out = str(tmp_path / "p")
    profile = ["calibrate", "profile", "--configs", "tiny", "--out", out]
    fewer = f"give --ranks {cores} or fewer"
    cases = [
        ([*profile, "--threads", str(cores + 1)], f"at most the {cores} CPU cores"),
        ([*profile, "--sustain", "1e30"], "from 0 to 3600"),
        ([*profile, "--collectives", "--ranks", str(cores + 1)], fewer),
        (["calibrate", "host", "--ranks", str(cores + 1), "--no-check", "--out", out], fewer),
    ]
    for argv, says in cases:
        code, _, err = run(argv, capsys)
        assert code == 2, argv
        assert says in err
    assert not (tmp_path / "p").exists()


def test_whole_numbers_written_as_floats_are_read_as_counts(tmp_path: Path) -> None:
    """A measurement CSV passed through pandas or a spreadsheet has m = 64.0: it was refused as 'not a number'.
    It is the count 64; 64.5 is refused as not a whole number."""
    path = tmp_path / "rows.csv"
    row = {"kind": "gemm", "op": "mm", "precision": "bf16", "m": "64.0", "n": "64", "k": "64", "flops": "524288"}
    pd.DataFrame([{**row, "time_s": "1e-6"}]).to_csv(path, index=False)
    (read,) = read_rows([path])
    assert (read.m, type(read.m)) == (64, int)
    pd.DataFrame([{**row, "m": "64.5", "time_s": "1e-6"}]).to_csv(path, index=False)
    with pytest.raises(CalibrationError, match=r"column 'm': '64\.5' is not a whole number"):
        read_rows([path])


VIDUR_H100 = (
    Path(__file__).resolve().parents[2] / "data" / "calibration" / "vidur" / "compute" / "h100" / "Llama-2-7b-hf"
)


def test_fit_refuses_rows_that_name_another_shipped_device(tmp_path: Path) -> None:
    """Vidur's A100 rows fitted as H100 passed the peak check (their best GEMM is 24% of the H100 peak) and made every
    H100 kernel about 3x slow. Rows naming a device we ship, and not the one named, are now refused. Found by a
    calibration review."""
    from simulator.calibration.importers.vidur import import_vidur_compute
    from simulator.calibration.workflow import fit_files
    from simulator.specs.library import load_device

    rows = import_vidur_compute(VIDUR_H100 / "mlp.csv", device="A100-SXM4-80GB")
    path = tmp_path / "a100.csv"
    write_rows(rows, path)
    with pytest.raises(CalibrationError, match="measured on A100-SXM4-80GB, not on device H100-SXM5-80GB"):
        fit_files([path], name="t", device=load_device("H100-SXM5-80GB"))
    # A device name we do not ship (what CUDA reports) says nothing either way: the peak check decides.
    renamed = [replace(r, device="NVIDIA H100 80GB HBM3") for r in rows]
    write_rows(renamed, path)
    assert fit_files([path], name="t", device=load_device("H100-SXM5-80GB"), holdout_every=1).table


def test_huge_numbers_are_bad_input_not_a_traceback(tmp_path: Path) -> None:
    """A shape of 1e308 in a Vidur CSV or a message of 1e308 elements in a trace overflowed a float (OverflowError,
    exit 1). Found by a calibration review."""
    from simulator.calibration.importers.vidur import import_vidur_compute

    frame = pd.read_csv(VIDUR_H100 / "mlp.csv")
    frame["n_kv_head"] = frame["n_kv_head"].astype(float)
    frame.loc[0, "n_kv_head"] = 1e308
    bad = tmp_path / "mlp.csv"
    frame.to_csv(bad, index=False)
    with pytest.raises(CalibrationError, match=r"line 2, column 'n_kv_head': expected a whole number from 1 to"):
        import_vidur_compute(bad, device="H100-SXM5-80GB")
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 1, "dur": 5,
             "args": {"External id": 9, "In msg nelems": 1e308, "Out msg nelems": 0, "dtype": "BFloat16",
                      "Group size": 8}},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 3, "dur": 4,
             "args": {"External id": 9}},
        ]
    }  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    with pytest.raises(CalibrationError):
        import_torch_trace(path)


def test_nccl_tests_data_lines_are_read_from_the_front(tmp_path: Path) -> None:
    """Logs older than nccl-tests' root column (12 fields) were read from the end, which gave the in-place time,
    and a data line cut off in its in-place part gave algbw as the time; rank lines without "Group" (older logs)
    were not counted, so a 2-node run was filed as one node's. Found by a calibration review."""
    old = tmp_path / "old.log"
    old.write_text(
        "# nThread 1 nGpus 8 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20\n"
        "#   Rank  0 Pid  12345 on   node01 device  0 [0x07] Tesla V100-SXM2-32GB\n"
        "#       size   count  type  redop  time  algbw  busbw  error  time  algbw  busbw  error\n"
        "    33554432  8388608  float  sum  500.0  67.11  117.44  0e+00  250.0  134.22  234.88  0e+00\n"
    )
    (row,) = import_nccl_tests(old, collective="all_reduce")
    assert row.time_s == pytest.approx(500e-6)
    cut = tmp_path / "cut.log"
    cut.write_text(NCCL_HEADER + "     2097152  524288  float  sum  -1  40.00  52.43  52.43  0  39.50\n")
    (row,) = import_nccl_tests(cut, collective="all_reduce")
    assert row.time_s == pytest.approx(40e-6)
    two = tmp_path / "two.log"
    ranks = "".join(
        f"#  Rank {i:2d} Pid {100 + i} on node0{i // 8} device {i % 8} [0x07] NVIDIA H100 80GB HBM3\n"
        for i in range(16)
    )
    two.write_text(NCCL_HEADER.replace("nGpus 2", "nGpus 1") + ranks + NCCL_LINE.format(size=1048576, time="30.00"))
    (row,) = import_nccl_tests(two, collective="all_reduce")
    assert (row.ranks, row.scope) == (16, "network")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scope": "galaxy"}, "column 'scope': 'galaxy' is not one of domain, network"),
        ({"ranks": 10**24}, "column 'ranks': 1000000000000000000000000 is not a group size"),
        ({"ranks": 0}, "column 'ranks': 0 is not a group size"),
    ],
)
def test_a_collective_row_with_an_unknown_scope_or_group_size_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, Any], message: str
) -> None:
    """Found by a CLI review: a scope of 'galaxy' was fitted as 'across nodes' and dropped without a word, and a
    25-digit group size reached a table that `calibrate check` then passed."""
    row = Measurement(kind="collective", op="all_reduce", bytes=2.0**20, ranks=8, scope="domain", time_s=1e-4)
    path = tmp_path / "rows.csv"
    write_rows([replace(row, **changes)], path)
    assert main(["calibrate", "fit", str(path), "--device", "H100-SXM5-80GB", "--out", str(tmp_path / "t.yaml")]) == 2
    assert message in capsys.readouterr().err
