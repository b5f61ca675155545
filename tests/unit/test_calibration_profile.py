"""The profiler: shapes from the graph, incremental rows, resume after a killed or failed run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from simulator.calibration import profile
from simulator.calibration.profile import missing_shapes, model_shapes, probe_shapes, run_profile
from simulator.calibration.rows import read_rows
from simulator.errors import CalibrationError
from simulator.graph.transformer import build_graph
from simulator.specs.model import ModelSpec

TINY = ModelSpec(name="t", layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=256, seq_len=32)


def test_shapes_cover_the_graph_with_its_flops() -> None:
    shapes = model_shapes(TINY, micro_batches=(1, 2))
    ops = {s.op for s in shapes}
    assert {"gemm.fwd", "gemm.dgrad", "gemm.wgrad", "attention_fwd", "attention_bwd", "adam"} <= ops
    assert {"layernorm", "layernorm_bwd", "gelu_bwd", "cross_entropy_bwd", "embedding_bwd"} <= ops
    graph = build_graph(TINY, 32, 1)
    gemm_flops = {op.flops for b in graph.blocks for op in b.forward + b.backward if op.kind == "gemm"}
    assert gemm_flops <= {s.flops for s in shapes if s.kind == "gemm"}
    assert len({s.key for s in shapes}) == len(shapes)
    tp2 = model_shapes(TINY, tps=(2,))
    assert max(s.n for s in tp2 if s.op == "gemm.fwd" and s.k == 64) == 128  # column-parallel up: 256 / 2
    with pytest.raises(CalibrationError, match="divide"):
        model_shapes(TINY, tps=(3,))


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
    shapes = [s for s in model_shapes(TINY) if s.op in ("gemm.fwd", "layernorm", "attention_bwd", "adam")]
    report = run_profile([*shapes, *probe_shapes("cpu")[:2]], tmp_path, warmup=1, repeats=2)
    assert report.missing == ()
    rows = read_rows([tmp_path])
    assert all(r.time_s > 0 and r.device.startswith("CPU") and r.torch_version and r.date for r in rows)
    assert {r.op for r in rows} >= {"gemm.fwd", "probe.peak_gemm"}


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
