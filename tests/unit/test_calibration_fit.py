"""Fitting measurement rows into tables: curves, backward classes, determinism, residuals, launch overhead."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from simulator.calibration.fit import compute_class, fit_table, predict_time, residual_report
from simulator.calibration.host import host_cluster, host_device
from simulator.calibration.rows import Measurement, RowAppender, read_rows, write_rows
from simulator.calibration.workflow import fit_files, summarize_errors, write_table
from simulator.cost.compute import ComputeModel
from simulator.errors import CalibrationError
from simulator.graph.ops import Op
from simulator.specs.calibration import CalibrationTable
from simulator.specs.hardware import DeviceSpec

DEV = DeviceSpec(name="toy", peak_flops=(("bf16", 100e12),), hbm_bytes=16 * 2**30, hbm_bandwidth_bytes_per_s=1e12)
OWN = "clustersim calibrate profile"


def gemm_eff(flops: float) -> float:
    """A smooth synthetic efficiency: rises with size, saturates at 0.8."""
    return 0.8 * flops / (flops + 1e10)


def gemm_rows(source: str = "synthetic") -> list[Measurement]:
    rows = []
    for i in range(40):
        m = 64 * (1 + i)
        flops = 2.0 * m * 4096 * 4096
        rows.append(
            Measurement(
                kind="gemm", op="gemm.fwd", m=m, n=4096, k=4096, flops=flops, bytes=1.0, source=source,
                time_s=flops / (DEV.peak("bf16") * gemm_eff(flops)),
            )
        )  # fmt: skip
    return rows


def memory_rows(op: str, speed: float, source: str = OWN) -> list[Measurement]:
    out = []
    for i in range(12):
        size = 2.0 ** (16 + i)
        out.append(Measurement(kind="memory", op=op, bytes=size, time_s=size / (speed * 1e12), source=source))
    return out


def test_gemm_curve_reproduces_the_rows() -> None:
    rows = gemm_rows()
    table = fit_table(rows, DEV, name="t", min_bin_rows=1)
    errs = [abs(predict_time(r, table, DEV) / r.time_s - 1) for r in rows]  # type: ignore[operator]
    assert max(errs) < 0.1
    report = residual_report(rows, DEV)
    assert report["gemm:bf16"]["median_abs_error"] < 0.05


def test_fit_is_deterministic(tmp_path: Path) -> None:
    rows = gemm_rows() + memory_rows("layernorm", 0.5) + memory_rows("layernorm_bwd", 0.25)
    for name in ("a.yaml", "b.yaml"):
        write_table(fit_table(rows, DEV, name="t", min_bin_rows=1, generic_memory="unclassified"), tmp_path / name)
    assert (tmp_path / "a.yaml").read_bytes() == (tmp_path / "b.yaml").read_bytes()


def test_own_profiles_get_backward_curves_and_public_ones_do_not() -> None:
    rows = memory_rows("layernorm", 0.5) + memory_rows("layernorm_bwd", 0.25)
    own = fit_table(rows, DEV, name="own", min_bin_rows=1, generic_memory="unclassified")
    assert {c.op for c in own.compute} == {"norm", "norm_bwd"}
    public = fit_table(rows, DEV, name="public")
    assert {c.op for c in public.compute} == {"norm", "memory"}
    assert compute_class(rows[-1]) == "norm_bwd"
    assert compute_class(Measurement(kind="attention", op="aten::flash_backward", time_s=1.0)) == "attention_bwd"


def test_compute_model_uses_a_measured_backward_curve() -> None:
    rows = memory_rows("layernorm", 0.5) + memory_rows("layernorm_bwd", 0.25)
    table = fit_table(rows, DEV, name="own", min_bin_rows=1, generic_memory="unclassified")
    cm = ComputeModel(DEV, table, None, "bf16")
    size = 2.0**20
    fwd = cm.time(Op(name="ln1", kind="memory", read_bytes=size / 2, write_bytes=size / 2))
    bwd = cm.time(Op(name="ln1.bwd", kind="memory", phase="bwd", read_bytes=size / 2, write_bytes=size / 2))
    assert bwd == pytest.approx(2 * fwd, rel=1e-6)
    assert fwd == pytest.approx(size / 0.5e12, rel=1e-3)


def test_launch_overhead_and_probes() -> None:
    rows = [
        *gemm_rows(),
        Measurement(kind="overhead", op="launch", time_s=8e-6),
        Measurement(kind="overhead", op="launch", time_s=12e-6),
        Measurement(kind="gemm", op="probe.peak_gemm", flops=1e15, time_s=1.0),
    ]
    table = fit_table(rows, DEV, name="t")
    assert table.launch_overhead_s == pytest.approx(10e-6)
    assert CalibrationTable.from_mapping(table.to_mapping(), "t").launch_overhead_s == pytest.approx(10e-6)


def test_no_usable_rows_is_an_error() -> None:
    with pytest.raises(CalibrationError, match="no usable measurements"):
        fit_table([Measurement(kind="collective", op="all_reduce", scope="network", time_s=1.0)], DEV, name="t")


def test_rows_round_trip_and_append(tmp_path: Path) -> None:
    rows = gemm_rows()[:3]
    write_rows(rows, tmp_path / "a.csv")
    with RowAppender(tmp_path / "b.csv") as sink:
        for r in rows:
            sink.append(r)
    assert read_rows([tmp_path / "a.csv"]) == read_rows([tmp_path / "b.csv"]) == rows
    with RowAppender(tmp_path / "b.csv") as sink:  # appending to an existing file keeps one header
        sink.append(rows[0])
    assert len(read_rows([tmp_path / "b.csv"])) == 4
    (tmp_path / "c.csv").write_text("x,y\n1,2\n")
    with pytest.raises(CalibrationError, match="other columns"):
        RowAppender(tmp_path / "c.csv")


def test_host_device_and_cluster_from_rows() -> None:
    rows = (
        gemm_rows(OWN)
        + memory_rows("layernorm", 0.02)
        + [Measurement(kind="collective", op="all_reduce", bytes=2.0**24, ranks=2, scope="domain", time_s=0.01)]
    )
    dev = host_device(rows, name="host", ram_bytes=8 * 2**30, ranks=2)
    best = max(r.flops / r.time_s for r in rows if r.kind == "gemm")
    assert dev.peak("bf16") == pytest.approx(best, rel=1e-3)
    assert dev.hbm_bytes == pytest.approx(4 * 2**30)
    table = fit_table(rows, dev, name="host", min_bin_rows=1, generic_memory="unclassified")
    cluster = host_cluster(dev, table, rows, name="host", ranks=2)
    assert cluster.nvlink_bandwidth_bytes_per_s == pytest.approx(2.0**24 / 0.01, rel=1e-3)
    with pytest.raises(CalibrationError, match="GEMM and memory-bound"):
        host_device(memory_rows("layernorm", 0.1), name="x")


def test_fit_files_reports_residuals(tmp_path: Path) -> None:
    rows = gemm_rows(OWN) + memory_rows("gelu", 0.3) + memory_rows("gelu_bwd", 0.2)
    write_rows(rows, tmp_path / "p" / "kernels.csv")
    result = fit_files([tmp_path / "p"], name="host")
    assert result.derived_device
    summary = summarize_errors(result.residuals)
    assert summary["all kernels"]["median_abs_error"] < 0.1
    assert all(math.isfinite(v["p90_abs_error"]) for v in summary.values())
