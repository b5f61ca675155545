"""Fitting measurement rows into tables: curves, backward classes, determinism, residuals, launch overhead."""

from __future__ import annotations

import math
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from simulator.calibration.fit import compute_class, fit_table, predict_time, residual_report
from simulator.calibration.host import host_cluster, host_device
from simulator.calibration.rows import Measurement, RowAppender, read_rows, write_rows
from simulator.calibration.workflow import fit_files, summarize_errors, write_table
from simulator.cost.compute import ComputeModel
from simulator.errors import CalibrationError, SpecError
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


def attention_rows(op: str, eff: float, precision: str = "bf16", source: str = "paper") -> list[Measurement]:
    """Attention kernels at a constant efficiency over 512..4k tokens (B·S = 16k, 16 heads of 128)."""
    out = []
    for s in (512, 1024, 2048, 4096):
        flops = 4.0 * (16384 // s) * 16 * s * s * 128 * (2.5 if "bwd" in op else 1.0) * (0.5 if "causal" in op else 1.0)
        time_s = flops / (DEV.peak("bf16") * eff)
        out.append(Measurement(kind="attention", op=op, precision=precision, flops=flops, time_s=time_s, source=source))
    return out


def _curve_at(table: CalibrationTable, op: str, precision: str = "bf16") -> tuple[float, str]:
    curve = table.compute_curve(op, precision)
    assert curve is not None, op
    return curve.efficiency[0], curve.source


def test_flash2_rows_fit_their_own_curves_beside_the_devices_fastest_kernel() -> None:
    """H100: FlashAttention-3 rows give ``attention``, FlashAttention-2 rows (``flash2_...``) ``attention_fa2``."""
    rows = (
        attention_rows("flash_attention_fwd", 0.6, source="fa3")
        + attention_rows("flash2_attention_fwd", 0.35, source="fa2")
        + attention_rows("flash2_attention_bwd", 0.3, source="fa2")
    )
    assert [compute_class(rows[i]) for i in (0, 4, 8)] == ["attention", "attention_fa2", "attention_fa2_bwd"]
    table = fit_table(rows, DEV, name="t", min_bin_rows=1)
    assert {c.op for c in table.compute} == {"attention", "attention_fa2", "attention_fa2_bwd"}
    assert _curve_at(table, "attention") == (pytest.approx(0.6), "fa3")
    assert _curve_at(table, "attention_fa2") == (pytest.approx(0.35), "fa2")
    assert _curve_at(table, "attention_fa2_bwd") == (pytest.approx(0.3), "fa2")


def test_a_device_measured_only_with_flash2_takes_it_as_its_own_kernel() -> None:
    """A100: FlashAttention-2 is the Ampere kernel, so its rows give both ``attention`` and ``attention_fa2``,
    credited to them; a device with its own kernel measured at either 16-bit precision keeps that one."""
    fa2 = attention_rows("flash2_attention_fwd", 0.5, precision="fp16", source="fa2")
    table = fit_table(fa2, DEV, name="a100", min_bin_rows=1)
    assert {c.op for c in table.compute} == {"attention", "attention_fa2"}
    assert _curve_at(table, "attention", "fp16") == _curve_at(table, "attention_fa2", "fp16") == (0.5, "fa2")
    both = fit_table(fa2 + attention_rows("flash_attention_fwd", 0.6, source="own"), DEV, name="b", min_bin_rows=1)
    assert _curve_at(both, "attention", "fp16") == (pytest.approx(0.6), "own")  # bf16 stands in for fp16


def test_compute_model_times_each_attention_kernel_on_its_own_curve() -> None:
    rows = attention_rows("flash_attention_fwd", 0.6) + attention_rows("flash2_attention_fwd", 0.35)
    rows += attention_rows("flash2_attention_bwd", 0.3)
    cm = ComputeModel(DEV, fit_table(rows, DEV, name="t", min_bin_rows=1), None, "bf16")
    shape = {"kind": "attention", "batch": 8, "heads": 16, "kv_heads": 16, "seq_q": 2048, "seq_kv": 2048,
             "head_dim": 128, "bwd_factor": 2.5}  # fmt: skip
    for kernel, fwd_eff, bwd_eff, labels in (
        ("flash", 0.6, 0.6 * 63 / 73, {"attention.bwd:bf16"}),  # no backward rows: the FA2 paper's ratio
        ("flash2", 0.35, 0.3, set()),  # measured backward
    ):
        cm.uncalibrated.clear()
        fwd = Op(name="attn.core", kernel=kernel, **shape)
        bwd = Op(name="attn.core.bwd", phase="bwd", kernel=kernel, **shape)
        assert cm.time(fwd) == pytest.approx(fwd.flops / (DEV.peak("bf16") * fwd_eff), rel=1e-3)
        assert cm.time(bwd) == pytest.approx(bwd.flops / (DEV.peak("bf16") * bwd_eff), rel=1e-3)
        assert cm.uncalibrated == labels


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


def test_sustained_gemm_probes_give_the_ratio_that_slows_flop_bound_kernels() -> None:
    """The burst and sustained timings of one GEMM give sustained_gemm_ratio (median over median); a table with it
    divides the FLOP-bound time of GEMMs and attention by it, leaves memory-bound kernels alone, and round-trips."""
    probe = {"kind": "gemm", "m": 8192, "n": 8192, "k": 8192, "flops": 2.0 * 8192**3}
    rows = [
        *gemm_rows(),
        Measurement(op="probe.gemm_burst", time_s=1.00, **probe),
        Measurement(op="probe.gemm_burst", time_s=1.02, **probe),
        Measurement(op="probe.gemm_sustained", time_s=1.20, **probe),
        *(Measurement(kind="memory", op="layernorm", bytes=2.0**k, time_s=2.0**k / 0.5e12) for k in range(16, 30)),
    ]
    table = fit_table(rows, DEV, name="t", min_bin_rows=1)
    assert table.sustained_gemm_ratio == pytest.approx(1.01 / 1.20, abs=1e-4)
    assert CalibrationTable.from_mapping(table.to_mapping(), "t") == table
    burst_rows = [r for r in rows if r.op != "probe.gemm_sustained"]
    assert fit_table(burst_rows, DEV, name="t").sustained_gemm_ratio is None  # a burst alone measures nothing
    burst_only = replace(table, sustained_gemm_ratio=None)
    gemm = Op(name="qkv", kind="gemm", m=4096, n=4096, k=4096)
    norm = Op(name="ln1", kind="memory", read_bytes=2.0**24, write_bytes=2.0**24)
    hot, cool = ComputeModel(DEV, table, None, "bf16"), ComputeModel(DEV, burst_only, None, "bf16")
    assert hot.time(gemm) == pytest.approx(cool.time(gemm) / table.sustained_gemm_ratio, rel=1e-9)
    assert hot.time(norm) == cool.time(norm)


@pytest.mark.parametrize("value", [0, -0.5, 1.3, 2.5, "fast"])
def test_a_bad_sustained_ratio_names_the_key(value: object) -> None:
    mapping = {**fit_table(gemm_rows(), DEV, name="t").to_mapping(), "sustained_gemm_ratio": value}
    with pytest.raises(SpecError, match="sustained_gemm_ratio"):
        CalibrationTable.from_mapping(mapping, "t.yaml")


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
        sink.append(replace(rows[0], time_s=2 * rows[0].time_s))  # another timing (an exact copy is read once)
    assert len(read_rows([tmp_path / "b.csv"])) == 4
    (tmp_path / "c.csv").write_text("x,y\n1,2\n")
    with pytest.raises(CalibrationError, match="other columns"):
        RowAppender(tmp_path / "c.csv")


def test_fit_names_the_rows_it_leaves_out(tmp_path: Path) -> None:
    """Cross-node collectives and unknown overhead rows were dropped by fit without a word."""
    rows = [
        *gemm_rows("vidur"),
        Measurement(kind="collective", op="all_reduce", bytes=2.0**24, ranks=16, scope="network", time_s=0.01),
        Measurement(kind="collective", op="all_reduce", bytes=2.0**24, ranks=8, scope="domain", time_s=0.001),
        Measurement(kind="overhead", op="python", time_s=1e-5),
    ]
    write_rows(rows, tmp_path / "rows.csv")
    result = fit_files([tmp_path / "rows.csv"], name="t", device=DEV)
    assert [n for _, n in result.unfitted] == [1, 1]
    assert "collectives across nodes" in result.unfitted[0][0]
    assert "overhead rows other than 'launch'" in result.unfitted[1][0]


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


def test_one_glitched_row_does_not_become_the_derived_peak() -> None:
    """The derived device's peak is the fastest GEMM: one row timed at a thousandth of its time (a timer glitch,
    a hand edit) made the peak 1,000x and every efficiency of the table a thousandth. Against the profile's peak
    probe it is refused, named; a shape somewhat faster than the probe still sets the peak."""
    rows = [*gemm_rows(OWN), *memory_rows("layernorm", 0.02)]
    best = max(r.flops / r.time_s for r in rows if r.kind == "gemm")
    flops = 2.0 * 1024**3  # the probe 10% under the best model shape:
    probe = Measurement(kind="gemm", op="probe.peak_gemm", flops=flops, time_s=flops / (0.9 * best), source=OWN)
    glitch = Measurement(kind="gemm", op="gemm.glitch", m=64, n=64, k=64, flops=2.0 * 64**3, time_s=1e-12, source=OWN)
    with pytest.raises(CalibrationError, match=r"GEMM row 'gemm.glitch' .* more than 2x the device's peak probe"):
        host_device([*rows, probe, glitch], name="host", ram_bytes=2**30)
    dev = host_device([*rows, probe], name="host", ram_bytes=2**30)
    assert dev.peak("bf16") == pytest.approx(best, rel=1e-3)
    assert host_device([*rows, glitch], name="host", ram_bytes=2**30).peak("bf16") > 1e3 * best  # no probe: no mark


def test_fit_files_reports_residuals(tmp_path: Path) -> None:
    rows = gemm_rows(OWN) + memory_rows("gelu", 0.3) + memory_rows("gelu_bwd", 0.2)
    write_rows(rows, tmp_path / "p" / "kernels.csv")
    result = fit_files([tmp_path / "p"], name="host")
    assert result.derived_device
    summary = summarize_errors(result.residuals)
    assert summary["all kernels"]["median_abs_error"] < 0.1
    assert all(math.isfinite(v["p90_abs_error"]) for v in summary.values())


def test_cudnn_and_causal_rows_fit_curves_of_their_own() -> None:
    """cuDNN rows (``cudnn_...``) give ``attention_cudnn``; rows whose op names a causal mask give the kernel's
    ``_causal`` curve, forward and backward, beside its unmasked one."""
    rows = (
        attention_rows("flash_attention_fwd", 0.6, source="fa3")
        + attention_rows("flash_attention_causal_fwd", 0.55, source="fa3")
        + attention_rows("cudnn_attention_fwd", 0.58, source="cudnn")
        + attention_rows("cudnn_attention_causal_fwd", 0.5, source="cudnn")
        + attention_rows("cudnn_attention_bwd", 0.48, source="cudnn")
        + attention_rows("attention_causal_bwd", 0.45, source="own")
    )
    assert [compute_class(rows[i]) for i in range(0, 24, 4)] == [
        "attention",
        "attention_causal",
        "attention_cudnn",
        "attention_cudnn_causal",
        "attention_cudnn_bwd",
        "attention_causal_bwd",
    ]
    table = fit_table(rows, DEV, name="t", min_bin_rows=1)
    assert _curve_at(table, "attention_causal") == (pytest.approx(0.55), "fa3")
    assert _curve_at(table, "attention_cudnn_causal") == (pytest.approx(0.5), "cudnn")
    assert _curve_at(table, "attention_causal_bwd") == (pytest.approx(0.45), "own")


def test_a_device_measured_only_with_flash2_takes_its_causal_curve_too() -> None:
    rows = attention_rows("flash2_attention_fwd", 0.5) + attention_rows("flash2_attention_causal_fwd", 0.4)
    table = fit_table(rows, DEV, name="a100", min_bin_rows=1)
    assert {c.op for c in table.compute} == {"attention", "attention_causal", "attention_fa2", "attention_fa2_causal"}
    assert _curve_at(table, "attention_causal") == _curve_at(table, "attention_fa2_causal") == (0.4, "paper")


def test_a_causal_op_takes_the_causal_curve_where_measured_and_the_unmasked_one_otherwise() -> None:
    """The causal curve times causal ops of its kernel, calibrated; a kernel measured only without a mask times
    them on that curve, still calibrated (same kernel), and its measured backward serves both."""
    rows = attention_rows("flash_attention_fwd", 0.6) + attention_rows("flash_attention_causal_fwd", 0.5)
    rows += attention_rows("cudnn_attention_fwd", 0.55) + attention_rows("cudnn_attention_bwd", 0.45)
    cm = ComputeModel(DEV, fit_table(rows, DEV, name="t", min_bin_rows=1), None, "bf16")
    shape = {"kind": "attention", "batch": 8, "heads": 16, "kv_heads": 16, "seq_q": 2048, "seq_kv": 2048,
             "head_dim": 128, "bwd_factor": 2.5}  # fmt: skip
    peak = DEV.peak("bf16")
    for kernel, causal, eff in (("flash", False, 0.6), ("flash", True, 0.5), ("cudnn", True, 0.55)):
        op = Op(name="attn.core", kernel=kernel, causal=causal, **shape)
        assert ComputeModel.op_class(op).endswith("_causal") == causal
        assert cm.time(op) == pytest.approx(op.flops / (peak * eff), rel=1e-3)
    bwd = Op(name="attn.core.bwd", phase="bwd", kernel="cudnn", causal=True, **shape)
    assert cm.time(bwd) == pytest.approx(bwd.flops / (peak * 0.45), rel=1e-3)
    assert cm.uncalibrated == set()
    unskipped = Op(name="attn.core", kernel="flash", causal=True, causal_skip=False, **shape)
    assert ComputeModel.op_class(unskipped) == "attention"  # a kernel computing the masked blocks runs unmasked


def test_backward_gemm_layouts_get_their_own_curves_where_measured() -> None:
    """Our profiler times each GEMM in the layout it runs (forward x·Wᵀ, dgrad g·W, wgrad gᵀ·x). The weight
    gradient's rows fit ``gemm_wgrad`` and time the weight-gradient GEMMs; without such rows (public profiles,
    or a layout not measured) the backward GEMMs keep the forward ``gemm`` curve."""
    fwd = gemm_rows(OWN)
    wgrad = [replace(r, op="gemm.wgrad", time_s=2 * r.time_s) for r in fwd]  # type: ignore[operator]
    assert compute_class(wgrad[0]) == "gemm_wgrad"
    assert compute_class(fwd[0]) == "gemm"
    table = fit_table(fwd + wgrad, DEV, name="own", min_bin_rows=1)
    only_fwd = fit_table(fwd, DEV, name="own", min_bin_rows=1)
    assert {c.op for c in table.compute} == {"gemm", "gemm_wgrad"}
    m, n, k = 1024, 4096, 4096
    ops = {
        "fwd": Op(name="mlp.up", kind="gemm", m=m, n=n, k=k),
        "dgrad": Op(name="mlp.up.dgrad", kind="gemm", phase="bwd_input", m=m, n=k, k=n),
        "wgrad": Op(name="mlp.up.wgrad", kind="gemm", phase="bwd_weight", m=k, n=n, k=m),
    }
    with_layouts = ComputeModel(DEV, table, None, "bf16")
    forward_only = ComputeModel(DEV, only_fwd, None, "bf16")
    t = {name: with_layouts.time(op) for name, op in ops.items()}
    assert t["wgrad"] == pytest.approx(2 * t["fwd"], rel=0.05)
    assert t["dgrad"] == pytest.approx(t["fwd"], rel=1e-6)  # no dgrad rows: the forward curve
    assert forward_only.time(ops["wgrad"]) == pytest.approx(t["fwd"], rel=1e-6)
    # The held-out check predicts each row on its own layout's curve.
    assert predict_time(wgrad[5], table, DEV) == pytest.approx(wgrad[5].time_s, rel=0.1)


@pytest.mark.parametrize("cls", ["norm", "elementwise", "rope", "activation", "memory"])
def test_default_memory_curves_are_read_at_bytes_over_hbm_bandwidth(cls: str) -> None:
    """The default table's memory-bound curves are shifted by HBM bandwidth, the axis compute reads them on
    (bytes / HBM bandwidth), so on H100 they give about what H100's own measured curve gives. They had been
    shifted by the 16-bit FLOP/s peak: a 1 MB norm read 0.34 instead of about 0.02."""
    from simulator.specs.library import load_calibration, load_device

    default, h100 = load_calibration("default"), load_calibration("h100-sxm5-80gb")
    hbm = load_device("H100-SXM5-80GB").hbm_bandwidth_bytes_per_s
    (generic,) = [c for c in default.compute if c.op == cls]
    (own,) = [c for c in h100.compute if c.op == cls]
    for size in (1e5, 1e6, 1e7, 1e8):
        assert generic.at(size, hbm) == pytest.approx(own.at(size), rel=0.3)


def test_the_all_kernels_summary_counts_the_backward_gemm_curves() -> None:
    """`gemm_dgrad` and `gemm_wgrad` residuals are kernels too; the summary had matched `gemm` exactly and left
    them out of the held-out figure the README quotes."""
    residuals = {"gemm:bf16": [0.1], "gemm_dgrad:bf16": [0.2], "gemm_wgrad:bf16": [0.3], "all_reduce:8": [0.9]}
    summary = summarize_errors(residuals)
    assert summary["all kernels"]["n"] == 3
    assert summary["all kernels"]["median_abs_error"] == pytest.approx(0.2)


def test_fit_refuses_rows_measured_on_another_device(tmp_path: Path) -> None:
    """A profile fitted against a device it was not measured on gives efficiencies that mean nothing: a CPU
    profile named as an H100 (its fastest GEMM at 0.1% of the H100's peak) and H100 rows named as an A100 (faster
    than the A100's peak) are refused with the rows' own device named; the rows' device itself is accepted."""
    from simulator.specs.library import load_device

    def rows_at(tflops: float, device: str) -> list[Measurement]:
        return [replace(r, time_s=r.flops / (tflops * 1e12), device=device) for r in gemm_rows()]

    cases = {
        "cpu": (rows_at(1.0, "cpu: Xeon"), "H100-SXM5-80GB", "under 2% of"),
        "h100": (rows_at(700.0, "NVIDIA H100 80GB HBM3"), "A100-SXM4-80GB", "faster than"),
    }
    for name, (rows, device, relation) in cases.items():
        write_rows(rows, tmp_path / f"{name}.csv")
        with pytest.raises(CalibrationError, match=relation) as err:
            fit_files([tmp_path / f"{name}.csv"], name="t", device=load_device(device), holdout_every=0)
        assert rows[0].device in str(err.value)
        assert "--device must name the device" in str(err.value)
    result = fit_files([tmp_path / "h100.csv"], name="t", device=load_device("H100-SXM5-80GB"), holdout_every=0)
    assert result.table.compute_curve("gemm", "bf16") is not None


def test_the_shipped_default_table_names_only_the_tables_each_curve_came_from() -> None:
    """Found by a review: every default compute curve said "median of a100-sxm4-80gb, h100-sxm5-80gb", though cuDNN
    and causal attention were measured on H100 alone, and each collective curve stopped at the last half-octave below
    the largest message measured (send/recv at 41 MB of 57 MB)."""
    from simulator.specs.library import load_calibration

    default = load_calibration("default")
    a100, h100 = load_calibration("a100-sxm4-80gb"), load_calibration("h100-sxm5-80gb")
    for curve in default.compute:
        measured_on = [t.name for t in (a100, h100) if any(c.op == curve.op for c in t.compute)]
        assert curve.source == "median of " + ", ".join(measured_on)
    for band in default.collectives:
        tops = [
            c.log2_bytes[-1]
            for t in (a100, h100)
            for c in t.collectives
            if (c.collective, c.scope, c.ranks) == (band.collective, band.scope, band.ranks)
        ]
        assert band.log2_bytes[-1] == pytest.approx(max(tops), abs=1e-3)


def _held_out(row: Measurement, every: int = 5) -> bool:
    """Whether holdout_errors leaves ``row`` out (its hash of the shape)."""
    key = f"{row.kind}|{row.op}|{row.m}|{row.n}|{row.k}|{row.batch}|{row.bytes}|{row.ranks}|{row.source}"
    return zlib.crc32(key.encode()) % every == 0


def test_holdout_that_would_leave_a_curve_nothing_to_fit_keeps_its_rows_with_a_note(tmp_path: Path) -> None:
    """Fit of a tiny input whose every row hashed into the held-out share failed with 'no usable measurements',
    though the table itself fits; and a class whose rows were all held out was reported against another curve (a
    backward GEMM on the forward one). Such a class's rows stay in the fit, and a note says so. Found by a review of
    the calibration workflow."""
    row = next(r for r in gemm_rows() if _held_out(r))
    write_rows([row], tmp_path / "one.csv")
    result = fit_files([tmp_path / "one.csv"], name="t", device=DEV)
    assert result.residuals == {}
    assert [n for n in result.notes if n.startswith("held-out")] == [
        "held-out residuals: every row of gemm:bf16 fell among the shapes left out (every 5th), which would leave "
        "its curve nothing to fit; those rows stay in the fit and get no residual"
    ]
    # A class with rows on both sides is held out as before; one with nothing left to fit is not.
    dgrad = next(d for r in gemm_rows() if _held_out(d := replace(r, op="gemm.dgrad")))
    write_rows([*gemm_rows(), dgrad], tmp_path / "two.csv")
    result = fit_files([tmp_path / "two.csv"], name="t", device=DEV)
    assert "gemm:bf16" in result.residuals
    assert "gemm_dgrad:bf16" not in result.residuals  # had been predicted on the forward curve
    assert [n for n in result.notes if "gemm_dgrad:bf16 fell among" in n]


def gemm_at(flops: float, efficiency: float) -> Measurement:
    """A GEMM row of ``flops`` running at ``efficiency`` of DEV's peak."""
    return Measurement(kind="gemm", op="gemm.fwd", flops=flops, time_s=flops / (DEV.peak("bf16") * efficiency))


# 20 rows in two well-populated bins of a quarter decade (1e10 and 2e10 FLOPs).
TWO_BINS = [gemm_at(base * (1 + 0.03 * i), 0.6) for base in (1e10, 2e10) for i in range(10)]


def test_fit_notes_the_rows_of_sparse_bins_it_leaves_out() -> None:
    """fit drops bins of fewer than 3 rows where better-populated bins exist, without a word: 3 small GEMM rows at
    0.5% efficiency beside 20 large ones at 60% gave a curve 100x too fast for the rows it was given. A note per
    curve says how many rows and bins were left out, and why. Found by a review of the calibration workflow."""
    small = [gemm_at(1e7, 0.005), gemm_at(1e8, 0.005), gemm_at(1.1e8, 0.005)]
    notes: list[str] = []
    table = fit_table([*TWO_BINS, *small], DEV, name="t", notes=notes)
    curve = table.compute_curve("gemm", "bf16")
    assert curve is not None
    assert curve.at(1e7, DEV.peak("bf16")) > 0.5  # the small rows (0.5%) are not in the curve
    assert notes == [
        "gemm:bf16: left out 3 of 23 rows, in 2 size bins of fewer than 3 rows (1e+07 to 1.1e+08 FLOPs) beside "
        "better-populated ones: the curve there follows its neighbours, not these rows (a median of one or two rows "
        "measures no size); measure more shapes of those sizes to fit them"
    ]
    quiet: list[str] = []
    fit_table(TWO_BINS, DEV, name="t", notes=quiet)
    assert quiet == []


def test_fit_notes_a_curve_of_one_problem_size() -> None:
    """Rows of a single problem size made a one-point curve that the simulator applies flat to every size, without
    a word. A note names the curve and the size. Found by a review of the calibration workflow."""
    notes: list[str] = []
    table = fit_table([gemm_at(4e9, 0.5), gemm_at(4e9, 0.55), gemm_at(4e9, 0.45)], DEV, name="t", notes=notes)
    assert len(table.compute[0].log10_size) == 1
    assert notes == [
        "gemm:bf16: one point, from 3 rows of one size (4e+09 FLOPs): the table applies its efficiency to every "
        "size; give rows of more sizes for a curve that follows size"
    ]
    notes = []
    fit_table(TWO_BINS[:10], DEV, name="t", notes=notes)  # several sizes, one bin
    assert notes == [
        "gemm:bf16: one point, from 10 rows of sizes 1e+10 to 1.27e+10 FLOPs: the table applies its efficiency to "
        "every size; give rows of more sizes for a curve that follows size"
    ]


def test_fit_refuses_a_collective_row_faster_than_any_fabric(tmp_path: Path) -> None:
    """The importers refuse a collective whose message would move at more than ten times NVLink 5 (a unit slip), but a
    hand-written CSV row at 1.8e9 GB/s bus bandwidth was fitted into a table. Reading rows applies the same bound.
    Found by a review of the calibration workflow."""
    row = Measurement(kind="collective", op="all_reduce", bytes=2.0**20, ranks=8, scope="domain", time_s=1e-12)
    write_rows([row], tmp_path / "r.csv")
    with pytest.raises(CalibrationError, match=r"r\.csv: line 2: .*1048576 bytes in 1e-12 s is 1\.05e\+06 TB/s"):
        read_rows([tmp_path / "r.csv"])
    write_rows([replace(row, time_s=1e-5)], tmp_path / "ok.csv")  # 105 GB/s: a real fabric's
    assert len(read_rows([tmp_path / "ok.csv"])) == 1


def test_exact_duplicate_rows_are_read_once_with_a_note(tmp_path: Path) -> None:
    """`fit prof prof/kernels.csv` read the profile's rows twice, in the curves' samples and in the provenance's
    rows: a file named twice is read once, and a row that repeats one of another file in every column is dropped,
    each with a note. Found by a review of the calibration workflow; a review of that change found it merging
    Vidur's twin measurements in a rows file imported before the importers named their lines, so rows within one
    file all count."""
    rows = gemm_rows(OWN)
    write_rows(rows, tmp_path / "prof" / "kernels.csv")
    notes: list[str] = []
    assert read_rows([tmp_path / "prof", tmp_path / "prof" / "kernels.csv"], notes=notes) == rows
    assert notes == [f"{tmp_path / 'prof' / 'kernels.csv'}: read once (it was named twice, or inside a folder named)"]
    # Rows merged into a second file are copies; within one file every row counts (two equal timings of one shape
    # may be two measurements: a rows file imported before the importers named their lines had Vidur's twins so).
    write_rows(rows[:5], tmp_path / "merged.csv")
    notes = []
    assert read_rows([tmp_path / "prof" / "kernels.csv", tmp_path / "merged.csv"], notes=notes) == rows
    assert notes == [
        f"dropped 5 row(s) that repeat a row of another file in every column (counted once): "
        f"{tmp_path / 'merged.csv'} line 2, a copy of line 2 of {tmp_path / 'prof' / 'kernels.csv'}, ..."
    ]
    write_rows([*rows, *rows[:5]], tmp_path / "pasted.csv")
    assert len(read_rows([tmp_path / "pasted.csv"])) == len(rows) + 5
    result = fit_files([tmp_path / "prof", tmp_path / "prof" / "kernels.csv"], name="t", device=DEV)
    assert dict(result.table.provenance)["rows"] == "40"
    assert len(result.notes) == 1
