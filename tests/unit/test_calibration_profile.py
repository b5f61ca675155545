"""The profiler: shapes from the graph, incremental rows, resume after a killed or failed run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from simulator.calibration import profile
from simulator.calibration.profile import missing_shapes, model_shapes, probe_shapes, run_profile, sustained_shapes
from simulator.calibration.rows import read_rows
from simulator.errors import CalibrationError
from simulator.graph.transformer import build_graph
from simulator.specs.model import ModelSpec, MoESpec

TINY = ModelSpec(name="t", layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=256, seq_len=32)


def test_shapes_cover_the_graph_with_its_flops() -> None:
    shapes = model_shapes(TINY, micro_batches=(1, 2))
    ops = {s.op for s in shapes}
    assert {"gemm.fwd", "gemm.dgrad", "gemm.wgrad", "attention_causal_fwd", "attention_causal_bwd", "adam"} <= ops
    assert {"layernorm", "layernorm_bwd", "gelu_bwd", "cross_entropy_bwd", "embedding_bwd"} <= ops
    graph = build_graph(TINY, 32, 1)
    gemm_flops = {op.flops for b in graph.blocks for op in b.forward + b.backward if op.kind == "gemm"}
    assert gemm_flops <= {s.flops for s in shapes if s.kind == "gemm"}
    assert len({s.key for s in shapes}) == len(shapes)
    tp2 = model_shapes(TINY, tps=(2,))
    assert max(s.n for s in tp2 if s.op == "gemm.fwd" and s.k == 64) == 128  # column-parallel up: 256 / 2
    with pytest.raises(CalibrationError, match="divide"):
        model_shapes(TINY, tps=(3,))


@pytest.mark.parametrize("seq", [32, 30])
def test_moe_expert_shapes_are_whole_tokens(seq: int) -> None:
    """The graph holds the experts' exact average tokens (30 tokens over 4 experts: 7.5 each); the profiler's
    shapes had taken it as is, so every MoE profile failed in torch.randn on a float size (found by a review)."""
    moe = replace(TINY, gated_mlp=True, activation="swiglu", moe=MoESpec(num_experts=4, top_k=1, expert_ffn_hidden=64))
    experts = [s for s in model_shapes(moe, seq_len=seq) if s.kind == "gemm" and s.batch == 4]
    assert experts
    assert all(isinstance(v, int) for s in experts for v in (s.m, s.n, s.k))
    assert {s.m for s in experts if s.op == "gemm.fwd"} == {-(-seq // 4)}  # 8 tokens each at 30, rounded up


@pytest.mark.torch
def test_kill_and_out_of_memory_keep_rows_and_report_missing(tmp_path: Path, monkeypatch: Any) -> None:
    pytest.importorskip("torch")
    shapes = model_shapes(TINY)[:6]
    real = profile._time_shape
    calls = {"n": 0}

    def flaky(shape: Any, dev: Any, warmup: int, repeats: int, cold: bool = False) -> Any:
        calls["n"] += 1
        if shape.key == shapes[1].key:
            raise RuntimeError("out of memory: pretend")
        if calls["n"] == 4:
            raise KeyboardInterrupt  # the run is killed while timing the fourth shape
        return real(shape, dev, 0, 1)

    monkeypatch.setattr(profile, "_time_shape", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_profile(shapes, tmp_path, warmup=0, repeats=1)
    kept = read_rows([tmp_path / "kernels.csv"])
    assert len(kept) == 2  # shapes 0 and 2 were flushed before the kill
    missing = dict(missing_shapes(tmp_path))
    assert len(missing) == 4
    assert "out of memory" in missing[shapes[1].key]
    assert missing[shapes[5].key] == "not measured"

    monkeypatch.setattr(profile, "_time_shape", lambda s, d, w, r, c=False: real(s, d, 0, 1))
    report = run_profile(shapes, tmp_path, warmup=0, repeats=1)
    assert report.resumed == 2
    assert report.measured == 4
    assert report.missing == ()
    assert len(read_rows([tmp_path / "kernels.csv"])) == 6


@pytest.mark.torch
def test_tiny_profile_rows_have_provenance(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    shapes = [s for s in model_shapes(TINY) if s.op in ("gemm.fwd", "layernorm", "attention_causal_bwd", "adam")]
    report = run_profile([*shapes, *probe_shapes("cpu")[:2]], tmp_path, warmup=1, repeats=2)
    assert report.missing == ()
    rows = read_rows([tmp_path])
    assert all(r.time_s > 0 and r.device.startswith("CPU") and r.torch_version and r.date for r in rows)
    assert {r.op for r in rows} >= {"gemm.fwd", "probe.peak_gemm"}


@pytest.mark.torch
def test_sustained_load_probe_is_timed_once_and_resumed(tmp_path: Path) -> None:
    """--sustain adds the burst and sustained timings of the peak GEMM (both planned, so a killed run lists them
    as missing), the sustained row after at least the asked-for load; a second run measures nothing again."""
    pytest.importorskip("torch")
    shapes = [s for s in model_shapes(TINY) if s.op == "gemm.fwd"][:1]
    report = run_profile(shapes, tmp_path, warmup=1, repeats=2, sustain_s=0.3)
    assert report.planned == 3
    assert report.missing == ()
    rows = {r.op: r for r in read_rows([tmp_path])}
    burst, sustained = rows["probe.gemm_burst"], rows["probe.gemm_sustained"]
    assert (burst.m, burst.flops) == (sustained.m, sustained.flops) == (1024, 2.0 * 1024**3)
    assert sustained.time_s * sustained.repeats >= 0.3 * 0.25  # the last quarter of at least 0.3 s of load
    assert sustained.note.startswith(f"shape={sustained_shapes('cpu')[1].key}; after ")
    again = run_profile(shapes, tmp_path, warmup=1, repeats=2, sustain_s=0.3)
    assert (again.measured, again.resumed) == (0, 3)
    assert len(read_rows([tmp_path])) == 3


@pytest.mark.torch
def test_megatron_cross_entropy_chain_equals_torch_cross_entropy() -> None:
    """The kernel chain the profiler times and the calibration GPT runs computes the ordinary cross-entropy."""
    torch = pytest.importorskip("torch")
    from simulator.calibration.torchlib import _cross_entropy_function

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=gen).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 500, (64,), generator=gen)
    loss = _cross_entropy_function().apply(logits, targets).mean()
    loss.backward()
    reference = logits.detach().float().requires_grad_(True)
    expected = torch.nn.functional.cross_entropy(reference, targets)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert logits.grad is not None
    assert logits.grad.dtype == torch.bfloat16
    assert torch.allclose(logits.grad.float(), reference.grad, atol=1e-3)


def test_fp8_shapes_are_the_fp8_gemms_of_fp8_training() -> None:
    plain = model_shapes(TINY)
    both = model_shapes(TINY, fp8=True)
    eight = [s for s in both if s.precision == "fp8"]
    # The 16-bit shapes and their keys (a resumed profile's manifest) do not change.
    assert [s.key for s in both if s.precision == "bf16"] == [s.key for s in plain]
    assert eight
    assert all(s.kind == "gemm" and s.batch == 1 and s.key.endswith(",p=fp8") for s in eight)
    # The output layer stays in BF16 under FP8 training: its GEMMs (n or k = vocab) get no FP8 shape.
    model = ModelSpec(name="t", layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=320, seq_len=32)
    ops = [op for b in build_graph(model, 32, 1).blocks for op in b.forward + b.backward if op.kind == "gemm"]
    capable = {(op.m, op.n, op.k) for op in ops if op.fp8_capable}
    head = {(op.m, op.n, op.k) for op in ops if op.name.startswith("head.")}
    assert {(s.m, s.n, s.k) for s in model_shapes(model, fp8=True) if s.precision == "fp8"} == capable
    assert head
    assert not head & capable
    probes = probe_shapes("cpu", fp8=True)
    assert [p.precision for p in probes if p.op == "probe.peak_gemm"] == ["bf16", "fp8"]
    # A CPU emulates FP8 at a rate that does not grow with size: its probe stays small (33 s per run at 1024³).
    sizes = {p.precision: p.m for p in probes if p.op == "probe.peak_gemm"}
    assert sizes["fp8"] < sizes["bf16"]
    assert {p.precision: p.m for p in probe_shapes("cuda", fp8=True) if p.op == "probe.peak_gemm"} == {
        "bf16": 8192,
        "fp8": 8192,
    }


@pytest.mark.torch
def test_fp8_needs_fp8_tensor_cores(monkeypatch: Any) -> None:
    torch = pytest.importorskip("torch")

    class Dev:
        type = "cuda"

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "NVIDIA A100-SXM4-80GB")
    assert "8.0" in profile.fp8_support(Dev())
    assert "8.9" in profile.fp8_support(Dev())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    assert profile.fp8_support(Dev()) == ""
    monkeypatch.setattr(profile, "fp8_support", lambda dev: "no FP8 here")
    with pytest.raises(CalibrationError, match="no FP8 here; profile without --fp8"):
        run_profile([s for s in model_shapes(TINY, fp8=True) if s.precision == "fp8"][:1], Path("unused"))


def test_missing_shapes_are_told_apart_failed_from_unreached(capsys: pytest.CaptureFixture[str]) -> None:
    """A profile's summary said "rerun the same command to retry them" of every missing shape, also of those that
    ran out of memory, which a rerun fails again; failed shapes now name the fix, unreached ones the rerun."""
    from simulator.calibration.cli import _print_missing

    _print_missing(
        [
            ("gemm.fwd:a", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
            ("gemm.fwd:b", "not measured"),
        ]
    )
    out = capsys.readouterr().out
    failed, unreached = out.split("not measured 1 shapes")
    assert "failed 1 shapes" in failed
    assert "lower --micro-batch or --seq-len" in failed
    assert "gemm.fwd:a" in failed
    assert "rerun the same command to measure them" in unreached
    assert "gemm.fwd:b" in unreached
    _print_missing([("attention:c", "RuntimeError: no kernel image is available")])
    out = capsys.readouterr().out
    assert "fix the cause" in out
    assert "not measured" not in out
    _print_missing([])
    assert capsys.readouterr().out == ""


@pytest.mark.torch
def test_resuming_a_profile_of_another_device_or_thread_count_is_refused(tmp_path: Path) -> None:
    """A profile resumed into a folder whatever it held: a rerun with --threads 2 kept the 53 rows measured with one
    thread and added none, so the table mixed (or just was) the other setting. Resuming is refused when the folder's
    rows were measured on another device (the CPU's name carries its thread count), saying how to start afresh.
    Found by a review of the calibration workflow."""
    pytest.importorskip("torch")
    from simulator.calibration.rows import write_rows

    shapes = [s for s in model_shapes(TINY) if s.op == "gemm.fwd"][:2]
    run_profile(shapes, tmp_path, warmup=0, repeats=1)
    rows = read_rows([tmp_path / "kernels.csv"])
    write_rows([replace(r, device="CPU Some Other Model (2 threads)") for r in rows], tmp_path / "kernels.csv")
    with pytest.raises(CalibrationError) as err:
        run_profile(shapes, tmp_path, warmup=0, repeats=1)
    text = str(err.value)
    assert f"--out {tmp_path}: holds rows measured on CPU Some Other Model (2 threads)" in text
    assert "give a new --out folder to start afresh" in text
    assert len(read_rows([tmp_path / "kernels.csv"])) == 2  # nothing added


@pytest.mark.torch
def test_a_profile_reports_shapes_measured_not_rows(tmp_path: Path) -> None:
    """With --passes 3 every shape writes three rows, and "N shapes measured now" counted rows (3N). The report
    counts shapes and, apart, rows. Found by a review of the calibration workflow."""
    pytest.importorskip("torch")
    shapes = [s for s in model_shapes(TINY) if s.op == "gemm.fwd"][:2]
    report = run_profile(shapes, tmp_path, warmup=0, repeats=1, passes=3)
    assert (report.measured, report.rows, report.planned) == (2, 6, 2)
    again = run_profile(shapes, tmp_path, warmup=0, repeats=1, passes=3)
    assert (again.measured, again.rows, again.resumed) == (0, 0, 2)


@pytest.mark.torch
def test_a_gpu_profile_records_the_gpus_memory_and_the_derived_device_takes_it(tmp_path: Path) -> None:
    """A device derived from a CUDA profile had the host's RAM as its memory (an H200 profiled in a 128 GiB VM
    came out at 126 GiB; a GPU in a 2 TiB host would have come out at 2 TiB). The manifest now records the GPU's
    memory, a resumed run keeps it, and the fit reads it; CPU profiles still share the host's RAM among ranks."""
    pytest.importorskip("torch")
    from simulator.calibration.workflow import fit_files
    from simulator.units import GIB

    shapes = [s for s in model_shapes(TINY) if s.kind == "gemm"][:2]
    run_profile([*shapes, *probe_shapes("cpu")], tmp_path, repeats=1, launch_overhead=False)
    assert profile.device_memory(tmp_path) is None
    cpu = fit_files([tmp_path], name="cpu", ranks=2, holdout_every=0).device
    assert "RAM / 2 ranks" in cpu.source
    # What run_profile writes on CUDA (torch.cuda.get_device_properties(dev).total_memory): an H200's 143,771 MiB.
    profile._write_manifest(tmp_path, profile._read_manifest(tmp_path), 143771 * 2**20)
    run_profile([*shapes, *probe_shapes("cpu")], tmp_path, repeats=1, launch_overhead=False)  # resumes, keeps it
    assert profile.device_memory(tmp_path) == 143771 * 2**20
    gpu = fit_files([tmp_path], name="gpu", ranks=2, holdout_every=0).device
    assert gpu.hbm_bytes == pytest.approx(140.0 * GIB, rel=1e-3)
    assert "the GPU's memory as CUDA reports it" in gpu.source
    # The folder's kernels.csv named on its own reads the same manifest (a review found it took the RAM).
    alone = fit_files([tmp_path / "kernels.csv"], name="gpu", ranks=2, holdout_every=0).device
    assert alone.hbm_bytes == gpu.hbm_bytes


def test_the_validation_rows_kernel_shapes_are_read_without_their_step_times(tmp_path: Path) -> None:
    """analysis/calibration/profile_validation_shapes.py (run on the H200): the H100 rows of published_runs.csv give
    693 distinct shapes, and the measured step times are dropped before a row is read (a file whose times are
    garbage gives the same shapes)."""
    import importlib.util

    import pandas as pd

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "profile_validation_shapes", root / "analysis" / "calibration" / "profile_validation_shapes.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    csv = root / "data" / "validation" / "published_runs.csv"
    shapes, used = module.shapes_for(csv, "dgx-h100", True)
    assert (len(used), len(shapes)) == (24, 693)
    # Every FP8 GEMM has its 16-bit twin, so the two precisions are compared shape by shape (FP8_SPEEDUP).
    fp8 = [s for s in shapes.values() if s.precision == "fp8"]
    assert fp8
    assert all(replace(s, precision="bf16").key in shapes for s in fp8)
    frame = pd.read_csv(csv, dtype=str, keep_default_na=False)
    frame["measured_step_time_s"] = "not a number"
    frame.to_csv(tmp_path / "garbled.csv", index=False)
    again, _ = module.shapes_for(tmp_path / "garbled.csv", "dgx-h100", True)
    assert list(again) == list(shapes)
