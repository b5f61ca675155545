"""Profile the kernels and collectives of a model's layers on the device at hand, through PyTorch.

What is timed (each distinct shape once; :mod:`.torchlib` for how):

* the GEMMs of every linear layer of :func:`simulator.graph.transformer.build_graph`'s graph, for each
  micro-batch size and tensor-parallel width asked for (the shard a TP rank computes): the forward
  ``x·Wᵀ``, the activation gradient ``dy·W`` and the weight gradient ``dyᵀ·x``;
* with ``fp8``, those GEMMs that FP8 training runs in FP8 once more as FP8 GEMMs (``torch._scaled_mm``, E4M3
  operands with per-tensor scales, the layout Transformer Engine issues), and an FP8 peak probe;
* the attention core, forward and backward (``scaled_dot_product_attention``, causal: rows
  ``attention_causal_fwd`` and ``_bwd``, which fit the ``attention_causal`` curves);
* LayerNorm, GELU, the residual add, the embedding lookup, cross-entropy (forward and backward each) and
  the Adam step over the model's parameters;
* two device probes: a large GEMM (peak throughput) and copies of several sizes (memory bandwidth);
* with ``sustain_s``, that large GEMM once more, after the kernels: timed as every kernel is (a short burst),
  then run back to back for ``sustain_s`` seconds and timed again over the last quarter of that run
  (:func:`sustained_gemm`), with the SM clock, power and temperature NVML reports before and at the end;
* on CUDA, the host's launch cost per small operator with autograd (``launch_overhead_us``): the CPU time
  per operator of a long chain of tiny ones, while the GPU idles between them;
* with ``collectives``, all-reduce, all-gather, reduce-scatter, all-to-all and send/recv over a range of
  sizes, between local processes (``torch.distributed``: NCCL on GPUs, gloo on the CPU).

Each row carries the FLOPs and bytes the *simulator's graph* assigns to the operator it stands for, so the
fitted curves predict exactly those operators. Rows are appended and flushed one shape at a time to
``kernels.csv`` and ``collectives.csv``; ``manifest.json`` lists every planned shape and ``failures.csv``
why a shape failed (out of memory...). A killed or failed run keeps what it measured; running it again
measures only what is missing, and :func:`missing_shapes` says what still is. Only the same device resumes: a
folder whose rows were measured on another (for a CPU, the same model with another thread count) is refused, since
one table would mix the two.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from simulator.calibration.rows import SUSTAINED_PROBES, Measurement, RowAppender, read_rows
from simulator.calibration.torchlib import (
    DTYPE,
    Timing,
    cross_entropy_backward,
    cross_entropy_forward,
    device_name,
    finite,
    init_rank,
    memory_guard,
    provenance,
    require_torch,
    setup_device,
    spawn,
    time_fn,
)
from simulator.errors import CalibrationError
from simulator.graph.ops import Op, whole_tokens
from simulator.graph.transformer import OPTIMIZER_BYTES_PER_PARAM, build_graph
from simulator.specs.model import ModelSpec

__all__ = [
    "COLLECTIVES_CSV",
    "KERNELS_CSV",
    "NOT_MEASURED",
    "ProfileReport",
    "Shape",
    "collective_shapes",
    "fp8_refusal",
    "fp8_support",
    "missing_shapes",
    "model_shapes",
    "probe_shapes",
    "run_profile",
    "sustained_gemm",
    "sustained_shapes",
]

KERNELS_CSV = "kernels.csv"
COLLECTIVES_CSV = "collectives.csv"
MANIFEST = "manifest.json"
FAILURES = "failures.csv"
SOURCE = "clustersim calibrate profile"
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """One thing to time: a benchmark (``op``) with its dimensions, and the FLOPs and bytes it stands for.

    Memory benchmarks use ``m`` rows by ``n`` columns (``k`` is the vocabulary of an embedding, ``batch``
    its sequences); the Adam step uses ``m`` parameters; collectives ``bytes`` per rank over ``ranks``.
    """

    kind: str
    op: str
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    heads: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    ranks: int = 0
    precision: str = "bf16"

    @property
    def key(self) -> str:
        """A stable identifier (the manifest's and the rows' ``note``); 16-bit shapes keep their old keys."""
        dims = f"m={self.m},n={self.n},k={self.k},b={self.batch},h={self.heads}"
        if self.kind == "collective":
            dims = f"bytes={int(self.bytes)},ranks={self.ranks}"
        if self.precision != "bf16":
            dims += f",p={self.precision}"
        return f"{self.kind}:{self.op}:{dims}"


# -- what to time -------------------------------------------------------------------------------------------


def _div(value: int, tp: int) -> int:
    return max(1, math.ceil(value / tp))


def _shard(op: Op, tp: int) -> Op:
    """The shard of ``op`` one of ``tp`` tensor-parallel ranks computes (sequence parallelism aside)."""
    if tp == 1 or not op.tp_axis:
        return op
    if op.tp_axis == "heads":
        return op.with_(heads=_div(op.heads, tp), kv_heads=_div(op.kv_heads, tp))
    if op.tp_axis == "bytes":
        return op.with_(read_bytes=op.read_bytes / tp, write_bytes=op.write_bytes / tp)
    if op.tp_axis == "vocab":
        return op
    return op.with_(**{op.tp_axis: _div(getattr(op, op.tp_axis), tp)})


def _memory_shape(op: Op, model: ModelSpec, b: int, s: int, tp: int) -> Shape | None:
    tokens = b * s
    bwd = "_bwd" if op.phase != "fwd" else ""
    name = op.name.removesuffix(".bwd")
    if name in ("ln1", "ln2", "final_norm"):
        bench, rows, cols = "layernorm", tokens, model.hidden
    elif name.endswith("dropout_add"):
        bench, rows, cols = "residual_add", tokens, model.hidden
    elif name == "mlp.act":
        bench, rows, cols = "gelu", tokens, _div(model.ffn_hidden, tp)
    elif name == "embedding.lookup":
        return Shape(kind="memory", op="embedding" + bwd, m=s, n=model.hidden, k=model.vocab, batch=b, bytes=op.bytes)
    elif name == "head.cross_entropy":
        bench, rows, cols = "cross_entropy", tokens, _div(model.vocab, tp)
    else:
        return None
    return Shape(kind="memory", op=bench + bwd, m=rows, n=cols, bytes=op.bytes)


def model_shapes(
    model: ModelSpec,
    *,
    seq_len: int | None = None,
    micro_batches: Sequence[int] = (1,),
    tps: Sequence[int] = (1,),
    fp8: bool = False,
) -> list[Shape]:
    """The distinct shapes of ``model``'s operators for each micro-batch size and TP width, in a stable order.

    With ``fp8`` every GEMM that FP8 training runs in FP8 (:attr:`Op.fp8_capable`) is also timed as an FP8
    GEMM (a second shape with ``precision="fp8"``), so one profile calibrates both precisions.

    >>> m = ModelSpec(name="t", layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=256, seq_len=32)
    >>> sorted({s.op for s in model_shapes(m)})[:4]
    ['adam', 'attention_causal_bwd', 'attention_causal_fwd', 'cross_entropy']
    """
    s = seq_len or model.seq_len
    seen: dict[str, Shape] = {}
    for tp in tps:
        if tp < 1 or model.heads % tp:
            raise CalibrationError(f"--tp {tp}: must be >= 1 and divide the model's heads ({model.heads})")
        for b in micro_batches:
            if b < 1:
                raise CalibrationError(f"--micro-batch {b}: must be >= 1")
            graph = build_graph(model, s, b)
            for block in graph.blocks:
                for raw in block.forward + block.backward:
                    op = _shard(raw, tp)
                    shape: Shape | None
                    if op.kind == "gemm":
                        # The routed experts' tokens per expert are an exact average in the graph; a kernel runs
                        # whole tokens (a float size also fails in torch.randn).
                        op = op.with_(**{axis: whole_tokens(getattr(op, axis)) for axis in ("m", "k")})
                        phase = op.name.rsplit(".", 1)[-1] if op.name.endswith((".dgrad", ".wgrad")) else "fwd"
                        shape = Shape(
                            kind="gemm", op=f"gemm.{phase}", m=op.m, n=op.n, k=op.k, batch=op.batch, flops=op.flops,
                            bytes=op.bytes,
                        )  # fmt: skip
                        if fp8 and op.fp8_capable and op.batch == 1:
                            eight = replace(shape, precision="fp8")
                            seen.setdefault(eight.key, eight)
                    elif op.kind == "attention":
                        shape = Shape(
                            kind="attention",
                            op="attention_causal_fwd" if op.phase == "fwd" else "attention_causal_bwd",
                            m=op.seq_q,
                            n=op.seq_kv,
                            k=op.head_dim,
                            batch=op.batch,
                            heads=op.heads,
                            flops=op.flops,
                            bytes=op.bytes,
                        )
                    else:
                        shape = _memory_shape(op, model, b, s, tp)
                    if shape is not None:
                        seen.setdefault(shape.key, shape)
            params = math.ceil(graph.params() / tp)
            adam = Shape(kind="memory", op="adam", m=params, bytes=OPTIMIZER_BYTES_PER_PARAM * params, heads=tp)
            seen.setdefault(adam.key, replace(adam, k=model.hidden))
    return list(seen.values())


def probe_shapes(dev_type: str, *, fp8: bool = False) -> list[Shape]:
    """The device probes: a large square GEMM (also in FP8 with ``fp8``) and copies of several sizes.

    The device's peak is the best GEMM throughput of the whole profile (:mod:`.host`), so the probe only has to
    be large enough to reach it. On a CPU that is 1024: a 2-core host's MKL GEMMs run at 71 GFLOP/s at 512 and 103
    at 1024 (fp32, measured here), while on a host without bf16 instructions (AVX2 only) a bf16 GEMM takes the
    emulated path at about 1 GFLOP/s, where 2048³ took about a minute per run and the test profile 20 minutes.
    A CPU has no FP8 arithmetic at all: ``torch._scaled_mm`` runs a reference path at about 0.06 GFLOP/s whatever
    the size (a 64×256×64 GEMM and 1024³ alike, measured on a 2-core Xeon), where 1024³ took 33 s per run, so the
    CPU's FP8 probe is 256³.
    """
    n = 8192 if dev_type == "cuda" else 1024
    n8 = 8192 if dev_type == "cuda" else 256
    copies = (2**20, 2**24, 2**28, 2**30) if dev_type == "cuda" else (2**18, 2**22, 2**26)
    peak = Shape(kind="gemm", op="probe.peak_gemm", m=n, n=n, k=n, flops=2.0 * n**3, bytes=6.0 * n * n)
    peak8 = Shape(
        kind="gemm", op="probe.peak_gemm", precision="fp8", m=n8, n=n8, k=n8, flops=2.0 * n8**3, bytes=3.0 * n8 * n8
    )
    return [peak, *([peak8] if fp8 else [])] + [
        Shape(kind="memory", op="probe.copy", m=size // 2, n=1, bytes=2.0 * size) for size in copies
    ]


def sustained_shapes(dev_type: str) -> tuple[Shape, Shape]:
    """The burst and sustained timings of the peak probe's GEMM (:data:`SUSTAINED_PROBES`)."""
    peak = probe_shapes(dev_type)[0]
    burst, sustained = SUSTAINED_PROBES
    return replace(peak, op=burst), replace(peak, op=sustained)


def collective_shapes(ranks: int, dev_type: str) -> list[Shape]:
    """Collectives to time: every op at sizes from 4 KiB to 16 MiB (CPU) or 64 KiB to 1 GiB (GPU), by factors of 2.

    Two sizes per octave is also the resolution of the fitted bandwidth curves (:mod:`.fit`).
    """
    lo, hi = (12, 24) if dev_type == "cpu" else (16, 30)
    return [
        Shape(kind="collective", op=op, bytes=float(2**e), ranks=ranks)
        for op in COLLECTIVE_OPS
        for e in range(lo, hi + 1)
    ]


# -- bookkeeping: manifest, failures, what is missing --------------------------------------------------------


def _manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data["shapes"], dict):
            raise TypeError
        return data
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, AttributeError, TypeError):
        raise CalibrationError(f"{path}: not a profile manifest; remove it or use an empty --out folder") from None


def _read_manifest(out: Path) -> dict[str, str]:
    return {str(k): str(v) for k, v in _manifest(out).get("shapes", {}).items()}


def device_memory(out: Path) -> float | None:
    """The memory of the GPU a profile folder was measured on (bytes, as CUDA reports it), None where its manifest
    does not say (a CPU profile, or one written before the manifest recorded it)."""
    value = _manifest(out).get("device_memory_bytes")
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _write_manifest(out: Path, shapes: dict[str, str], memory_bytes: float | None = None) -> None:
    path = out / MANIFEST
    data: dict[str, Any] = {"shapes": dict(sorted(shapes.items()))}
    memory = memory_bytes if memory_bytes is not None else device_memory(out)
    if memory is not None:
        data["device_memory_bytes"] = int(memory)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _done_keys(out: Path) -> set[str]:
    return set(_done_counts(out))


def _done_counts(out: Path) -> Counter[str]:
    done: Counter[str] = Counter()
    for name in (KERNELS_CSV, COLLECTIVES_CSV):
        path = out / name
        if path.is_file() and path.stat().st_size > 0:
            for row in read_rows([path]) if _has_rows(path) else []:
                if row.note.startswith("shape="):
                    done[row.note.removeprefix("shape=").split(";")[0]] += 1
    return done


def _has_rows(path: Path) -> bool:
    with path.open("rb") as fh:  # bytes: a file that is not UTF-8 is reported by read_rows, with its name
        return sum(1 for _ in fh) > 1


def _record_failure(out: Path, key: str, reason: str) -> None:
    path = out / FAILURES
    new = not path.exists()
    with path.open("a", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        if new:
            writer.writerow(["shape", "reason"])
        writer.writerow([key, reason.replace("\n", " ")[:300]])
        fh.flush()
        os.fsync(fh.fileno())


# The reason missing_shapes gives a shape that never failed: the run stopped before it (a rerun measures it).
NOT_MEASURED = "not measured"


def missing_shapes(out: Path) -> list[tuple[str, str]]:
    """``(shape, reason)`` for every planned shape of the profile in ``out`` that has no row yet.

    The reason is the last recorded failure, or ``not measured`` (the run stopped before it).
    """
    planned = _read_manifest(out)
    if not planned:
        return []
    done = _done_keys(out)
    reasons: dict[str, str] = {}
    path = out / FAILURES
    if path.is_file():
        with path.open(newline="", encoding="utf-8", errors="replace") as fh:  # reasons only: never fatal
            for rec in csv.DictReader(fh):
                reasons[rec.get("shape") or ""] = rec.get("reason") or ""
    return [(key, reasons.get(key, NOT_MEASURED)) for key in sorted(planned) if key not in done]


@dataclass(frozen=True, slots=True)
class ProfileReport:
    """What a profile run did: shapes planned, measured now (in ``rows`` rows: one per pass), already there, and
    missing."""

    out: Path
    planned: int
    measured: int
    resumed: int
    missing: tuple[tuple[str, str], ...]
    device: str
    rows: int = 0


def _same_device(out: Path, device: str) -> None:
    """Refuse to resume into ``out`` when its rows were measured on another device than ``device`` (a CPU's name
    carries its thread count: a rerun with --threads 2 had kept 53 rows of one thread and measured none)."""
    for name in (KERNELS_CSV, COLLECTIVES_CSV):
        path = out / name
        if not (path.is_file() and _has_rows(path)):
            continue
        others = sorted({r.device for r in read_rows([path]) if r.device and r.device != device})
        if others:
            raise CalibrationError(
                f"--out {out}: holds rows measured on {', '.join(others)}, and this run is on {device}: resuming would "
                "mix the two in one table; give a new --out folder to start afresh (or empty this one), or rerun "
                "with the device and --threads of those rows to resume"
            )


# -- the benchmarks -----------------------------------------------------------------------------------------


def _benchmark(shape: Shape, dev: Any) -> Callable[[], Any]:
    """A closure running the operator ``shape`` stands for (inputs allocated once, outside the timing)."""
    torch = require_torch()
    nnf = torch.nn.functional
    dt = getattr(torch, DTYPE)

    def rand(*dims: int, grad: bool = False) -> Any:
        return torch.randn(*dims, device=dev, dtype=dt, requires_grad=grad)

    op, m, n, k, b = shape.op, shape.m, shape.n, shape.k, shape.batch
    # Inputs, outputs and (for Adam) gradients and two moments: a few times the bytes the op moves.
    memory_guard(3.0 * shape.bytes, dev)
    if shape.kind == "gemm" and shape.precision == "fp8":
        return _fp8_gemm(shape, dev)
    if shape.kind == "gemm":
        if shape.op == "probe.peak_gemm" or op == "gemm.dgrad":
            x, w = (rand(m, k), rand(k, n)) if b == 1 else (rand(b, m, k), rand(b, k, n))
            return (lambda: torch.mm(x, w)) if b == 1 else (lambda: torch.bmm(x, w))
        if op == "gemm.wgrad":
            g, x = (rand(k, m), rand(k, n)) if b == 1 else (rand(b, k, m), rand(b, k, n))
            return (lambda: torch.mm(g.t(), x)) if b == 1 else (lambda: torch.bmm(g.transpose(1, 2), x))
        x, w = (rand(m, k), rand(n, k)) if b == 1 else (rand(b, m, k), rand(b, n, k))
        return (lambda: torch.mm(x, w.t())) if b == 1 else (lambda: torch.bmm(x, w.transpose(1, 2)))
    if shape.kind == "attention":
        # Q, K and V as the model makes them: strided views of the fused QKV projection's output.
        qkv = rand(b, m, 3, shape.heads, k, grad=True)
        q, kk, v = qkv.permute(2, 0, 3, 1, 4)
        if op == "attention_causal_fwd":
            return lambda: nnf.scaled_dot_product_attention(q, kk, v, is_causal=True)
        out = nnf.scaled_dot_product_attention(q, kk, v, is_causal=True)
        gout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (qkv,), gout, retain_graph=True)
    base = op.removesuffix("_bwd")
    backward = op.endswith("_bwd")
    if base == "probe.copy":
        src, dst = rand(m), rand(m)
        return lambda: dst.copy_(src)
    if base == "residual_add":
        x, y = rand(m, n), rand(m, n)
        return lambda: x + y
    if base == "adam":
        return _adam(shape, dev)
    if base == "embedding":
        table = rand(k, n, grad=True)
        pos = rand(m, n, grad=True)
        ids = torch.randint(0, k, (b, m), device=dev, generator=torch.Generator(device=dev).manual_seed(0))

        def embed() -> Any:
            return nnf.embedding(ids, table) + pos

        if not backward:
            return embed
        y = embed()
        gy = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, (table, pos), gy, retain_graph=True)
    x = rand(m, n, grad=True)
    if base == "layernorm":
        w, bias = rand(n, grad=True), rand(n, grad=True)

        def fwd() -> Any:
            return nnf.layer_norm(x, (n,), w, bias)

        inputs: tuple[Any, ...] = (x, w, bias)
    elif base == "gelu":

        def fwd() -> Any:
            return nnf.gelu(x)

        inputs = (x,)
    elif base == "cross_entropy":
        # Megatron's kernel chain, as the calibration GPT runs it; the backward is timed on its own, in place on
        # a kept softmax (a loss gradient of ones keeps the values bounded over the repeats).
        targets = torch.randint(0, n, (m,), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
        if backward:
            _, softmax = cross_entropy_forward(x.detach(), targets)
            ones = torch.ones(m, device=dev, dtype=softmax.dtype)
            return lambda: cross_entropy_backward(softmax, targets, ones, dt)
        return lambda: cross_entropy_forward(x.detach(), targets)
    else:
        raise CalibrationError(f"shape {shape.key}: no benchmark for op {op!r}")
    if not backward:
        return fwd
    y = fwd()
    gy = torch.randn_like(y)
    return lambda: torch.autograd.grad(y, inputs, gy, retain_graph=True)


FP8_ALIGN = 16  # FP8 GEMMs need every dimension a multiple of 16 (cuBLASLt; Transformer Engine pads to it)


def _fp8_gemm(shape: Shape, dev: Any) -> Callable[[], Any]:
    """An FP8 GEMM as Transformer Engine runs it: E4M3 operands with per-tensor scales, BF16 output.

    Every FP8 GEMM of a TE linear layer (forward, activation gradient, weight gradient) is issued in the "TN"
    layout, the only one Hopper's FP8 tensor cores take, from operands TE has already cast and transposed
    (``cast_transpose``; that kernel is modelled as its own memory-bound op), so all three roles are timed as
    ``x (m×k) · W (n×k)ᵀ`` with ``torch._scaled_mm``. Dimensions are padded up to :data:`FP8_ALIGN`; the row
    keeps the graph's FLOPs. Sources: Transformer Engine documentation ("Using FP8 with Transformer
    Engine"), PyTorch ``torch._scaled_mm`` (row-major ``x``, column-major second operand).
    """
    torch = require_torch()
    e4m3 = torch.float8_e4m3fn
    m, n, k = (FP8_ALIGN * math.ceil(max(d, 1) / FP8_ALIGN) for d in (shape.m, shape.n, shape.k))
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16).to(e4m3)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16).to(e4m3)
    scale = torch.ones((), device=dev, dtype=torch.float32)
    out = torch.bfloat16
    return lambda: torch._scaled_mm(x, w.t(), scale_a=scale, scale_b=scale, out_dtype=out)


# FP8 tensor cores start at compute capability 8.9 (Ada: L40S; Hopper: H100, H200; Blackwell: B200).
FP8_CAPABILITY = (8, 9)


def fp8_refusal(
    dev_type: str,
    *,
    capability: tuple[int, int] | None = None,
    name: str = "",
    torch_version: str = "",
    has_fp8_matmul: bool = True,
    emulated: bool = False,
) -> str:
    """Why FP8 GEMMs must not be timed on a device ("" when they may): the decision of :func:`fp8_support`,
    without PyTorch or a GPU.

    A CPU has no FP8 arithmetic: ``torch._scaled_mm`` runs an emulated reference path there (about 0.06 GFLOP/s
    whatever the size) whose times say nothing about FP8 hardware, so it is refused unless ``emulated`` (the
    ``--fp8-emulated`` option, for exercising the FP8 pipeline on a machine without FP8 tensor cores). A CUDA
    device needs compute capability 8.9 or higher.

    >>> fp8_refusal("cuda", capability=(9, 0), name="NVIDIA H100 80GB HBM3")
    ''
    >>> fp8_refusal("cpu", emulated=True)
    ''
    """
    if not has_fp8_matmul:
        return f"PyTorch {torch_version} has no FP8 matmul (torch._scaled_mm needs PyTorch >= 2.1)"
    if dev_type == "cuda":
        if capability is not None and tuple(capability) < FP8_CAPABILITY:
            major, minor = capability
            return (
                f"{name or 'this GPU'} (compute capability {major}.{minor}) has no FP8 tensor cores; they start at "
                "8.9 (Ada, Hopper, Blackwell: L40S, H100, H200, B200)"
            )
        return ""
    if emulated:
        return ""
    return (
        f"--device {dev_type} has no FP8 tensor cores (they start at CUDA compute capability 8.9: L40S, H100, H200, "
        "B200) and PyTorch would time an emulated torch._scaled_mm that says nothing about FP8 hardware; run on "
        "such a GPU with --device cuda, or pass --fp8-emulated to time the emulation anyway (a test of the FP8 "
        "pipeline, not a calibration)"
    )


def fp8_support(dev: Any, *, emulated: bool = False) -> str:
    """Why FP8 GEMMs cannot be timed on ``dev`` ("" when they can; :func:`fp8_refusal` decides)."""
    torch = require_torch()
    has = hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")
    capability = name = None
    if has and dev.type == "cuda":
        capability = tuple(torch.cuda.get_device_capability(dev))
        name = str(torch.cuda.get_device_name(dev))
    return fp8_refusal(
        dev.type,
        capability=capability,
        name=name or "",
        torch_version=str(torch.__version__),
        has_fp8_matmul=has,
        emulated=emulated,
    )


def _adam(shape: Shape, dev: Any) -> Callable[[], Any]:
    """Adam over tensors shaped like the model's (one big matrix per 4·hidden² parameters, plus vectors)."""
    torch = require_torch()
    dt = getattr(torch, DTYPE)
    h = max(shape.k, 1)
    total = shape.m
    sizes: list[int] = []
    while total > 0:
        chunk = min(total, 4 * h * h)
        sizes.append(chunk)
        total -= chunk
        if total > 0:
            vec = min(total, h)
            sizes.append(vec)
            total -= vec
    params = [torch.zeros(sz, device=dev, dtype=dt, requires_grad=True) for sz in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(params, lr=1e-4)
    step: Callable[[], Any] = opt.step
    return step


def _time_shape(shape: Shape, dev: Any, warmup: int, repeats: int, cold_cache: bool = False) -> Any:
    """Time one shape; its inputs are freed when this returns."""
    return time_fn(_benchmark(shape, dev), dev, warmup=warmup, repeats=repeats, cold_cache=cold_cache)


def _launch_overhead(dev: Any, ops: int = 2000) -> float:
    """Host seconds per small operator with autograd: a chain of tiny ops, issued without synchronising."""
    torch = require_torch()
    x = torch.ones(8, device=dev, requires_grad=True)
    for _ in range(3):
        y = x
        for _ in range(ops):
            y = y * 1.0001
        torch.cuda.synchronize(dev)
    samples = []
    for _ in range(5):
        y = x
        t0 = time.perf_counter()
        for _ in range(ops):
            y = y * 1.0001
        samples.append((time.perf_counter() - t0) / ops)
        torch.cuda.synchronize(dev)
    samples.sort()
    return samples[len(samples) // 2]


@dataclass(frozen=True, slots=True)
class SustainedRun:
    """One GEMM timed in a short burst and under sustained load (:func:`sustained_gemm`).

    ``before`` and ``after`` are the device's SM clock, power and temperature (NVML, through PyTorch) before the
    burst and while the last timed GEMMs ran, "" where they cannot be read (a CPU, no ``pynvml``).
    """

    burst: Timing
    sustained: Timing
    seconds: float
    before: str
    after: str


def _nvml(read: Callable[[Any], Any], dev: Any) -> float | None:
    """One NVML reading through PyTorch, None where it cannot be had: no ``pynvml`` (an ImportError), an
    ``NVMLError`` (a class of ``pynvml``, which we do not import) or a driver without the counter."""
    try:
        return float(read(dev))
    except Exception:
        return None


def _device_state(dev: Any) -> str:
    """SM clock, power draw and temperature as NVML reports them ("" on a CPU or where NVML cannot be read)."""
    if dev.type != "cuda":
        return ""
    torch = require_torch()
    # torch.cuda.clock_rate (MHz), power_draw (mW) and temperature (degrees C) read NVML through pynvml.
    readers = (("sm_clock_mhz", "clock_rate", 1.0), ("power_w", "power_draw", 1e-3), ("temp_c", "temperature", 1.0))
    parts = []
    for label, name, scale in readers:
        read = getattr(torch.cuda, name, None)
        value = _nvml(read, dev) if read is not None else None
        if value is not None:
            parts.append(f"{label}={value * scale:g}")
    return " ".join(parts)


def sustained_gemm(
    dev: Any, seconds: float, *, window_s: float = 0.25, warmup: int = 2, repeats: int = 5
) -> SustainedRun:
    """The peak probe's GEMM timed as every kernel is profiled, then after ``seconds`` of back-to-back load.

    Kernel profiles (ours, Vidur's) time each shape for a few runs with pauses between shapes, so a GPU runs
    them near its boost clock. A training step keeps the tensor cores busy for minutes, and a GPU at its power
    limit lowers its clock until it stays under the limit. The burst is timed exactly as :func:`time_fn` times
    every shape; then the GEMM runs back to back in windows of about ``window_s`` seconds, each timed as a whole
    (CUDA events, or the wall clock on a CPU), until ``seconds`` have passed, and the sustained time per GEMM is
    the median over the windows that ended in the last quarter of the run.
    """
    torch = require_torch()
    burst_shape, _ = sustained_shapes(dev.type)
    fn = _benchmark(replace(burst_shape, op="probe.peak_gemm"), dev)
    before = _device_state(dev)
    burst = time_fn(fn, dev, warmup=warmup, repeats=repeats)
    per_window = max(1, round(window_s / burst.median_s))
    cuda = dev.type == "cuda"
    windows: list[tuple[float, float]] = []  # (seconds since the load started, seconds per GEMM)
    after = before
    t_start = time.perf_counter()
    elapsed = 0.0
    while elapsed < seconds or not windows:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_window):
                fn()
            end.record()
            after = _device_state(dev) or after  # read while this window's GEMMs are still running
            end.synchronize()
            took = start.elapsed_time(end) * 1e-3
        else:
            t0 = time.perf_counter()
            for _ in range(per_window):
                fn()
            took = time.perf_counter() - t0
        elapsed = time.perf_counter() - t_start
        windows.append((elapsed, took / per_window))
    tail = [per for ended, per in windows if ended >= 0.75 * elapsed] or [windows[-1][1]]
    sustained = Timing(
        median_s=statistics.median(tail),
        min_s=min(tail),
        std_s=statistics.pstdev(tail) if len(tail) > 1 else 0.0,
        repeats=len(tail) * per_window,
    )
    return SustainedRun(burst=burst, sustained=sustained, seconds=elapsed, before=before, after=after)


# -- running ------------------------------------------------------------------------------------------------


def _prov(prov: dict[str, str]) -> dict[str, Any]:
    return {k: prov.get(k, "") for k in ("device", "host", "torch_version", "cuda_version", "date")}


def _row(
    shape: Shape, seconds: float, min_s: float, std_s: float, repeats: int, prov: dict[str, str], note: str = ""
) -> Measurement:
    return Measurement(
        kind=shape.kind,
        op=shape.op,
        precision=shape.precision if shape.kind in ("gemm", "attention") else "",
        m=shape.m,
        n=shape.n,
        k=shape.k,
        batch=shape.batch * (shape.heads if shape.kind == "attention" else 1),
        flops=shape.flops,
        bytes=shape.bytes,
        ranks=shape.ranks,
        scope="domain" if shape.kind == "collective" else "",
        time_s=seconds,
        time_s_min=finite(min_s),
        time_s_std=finite(std_s),
        repeats=repeats,
        source=SOURCE,
        note=f"shape={shape.key}" + (f"; {note}" if note else ""),
        **_prov(prov),
    )


def _timed_row(shape: Shape, t: Timing, prov: dict[str, str], note: str = "") -> Measurement:
    return _row(shape, t.median_s, t.min_s, t.std_s, t.repeats, prov, note)


def run_profile(
    shapes: Sequence[Shape],
    out: Path,
    *,
    device: str = "cpu",
    threads: int | None = 1,
    warmup: int = 2,
    repeats: int = 5,
    passes: int = 1,
    cold_cache: bool = False,
    collectives: Sequence[Shape] = (),
    launch_overhead: bool | None = None,
    sustain_s: float = 0.0,
    fp8_emulated: bool = False,
    log: Callable[[str], None] | None = None,
) -> ProfileReport:
    """Time ``shapes`` (and ``collectives``) into ``out``, resuming whatever an earlier run measured.

    FP8 shapes need FP8 tensor cores (:func:`fp8_refusal`); ``fp8_emulated`` allows timing PyTorch's emulated
    FP8 GEMM on a CPU, to test the FP8 pipeline rather than to calibrate it.

    With ``passes`` > 1 every shape is timed once per pass, the passes one after the other, and each pass
    writes its own row: a burst of interference from other processes (a shared CPU, a GPU clock dip) then
    spoils one row of a shape rather than all of it, and the fit's medians set it aside.

    ``launch_overhead`` defaults to on for CUDA and off for the CPU, where operators run synchronously and
    their measured times already include PyTorch's dispatch cost.

    With ``sustain_s`` > 0 the peak probe's GEMM is timed once more after the kernels, in a burst and after
    ``sustain_s`` seconds of back-to-back load (:func:`sustained_gemm`); give it a minute or more on a GPU: its
    power limit acts within milliseconds, but its temperature, and with it the clock the limit allows, settles
    over tens of seconds.

    Raises
    ------
    CalibrationError
        PyTorch missing, no such device, or an ``out`` folder holding something else.
    """
    dev = setup_device(device, threads if device == "cpu" else None)
    torch = require_torch()
    say = log or (lambda _msg: None)
    if any(s.precision == "fp8" for s in shapes):
        why = fp8_support(dev, emulated=True) if fp8_emulated else fp8_support(dev)
        if why:
            raise CalibrationError(f"FP8 profiling: {why}; profile without --fp8")
        if dev.type != "cuda":
            say("--fp8-emulated: timing PyTorch's emulated FP8 GEMM on the CPU (tests the pipeline, not FP8 hardware)")
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(dev)
    _same_device(out, prov["device"])
    planned = _read_manifest(out)
    todo = list(shapes) + list(collectives)
    if launch_overhead is None:
        launch_overhead = dev.type == "cuda"
    launch_key = "overhead:launch"
    sustain = sustained_shapes(dev.type) if sustain_s > 0 else ()
    for shape in (*todo, *sustain):
        planned[shape.key] = shape.op
    if launch_overhead:
        planned[launch_key] = "launch"
    # A GPU's capacity is no kernel time, but a device derived from this profile needs it (host.host_device).
    memory = float(torch.cuda.get_device_properties(dev).total_memory) if dev.type == "cuda" else None
    _write_manifest(out, planned, memory)
    counts = _done_counts(out)
    before = Counter(counts)
    done = set(counts)
    keys = [s.key for s in (*todo, *sustain)] + ([launch_key] if launch_overhead else [])
    resumed = sum(1 for key in keys if key in done)
    if resumed:
        say(f"resuming: {resumed} of {len(keys)} shapes already measured in {out}")
    with RowAppender(out / KERNELS_CSV) as sink:
        failed: set[str] = set()
        for p in range(max(passes, 1)):
            for i, shape in enumerate(shapes):
                if counts[shape.key] > p or shape.key in failed:
                    continue
                try:
                    t = _time_shape(shape, dev, warmup, repeats, cold_cache)
                except RuntimeError as err:  # out of memory, unsupported kernel: keep going, report it missing
                    failed.add(shape.key)
                    _record_failure(out, shape.key, f"{type(err).__name__}: {err}")
                    say(f"failed {shape.key}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                sink.append(_timed_row(shape, t, prov))
                counts[shape.key] += 1
                if (i + 1) % 100 == 0:
                    say(f"  pass {p + 1}/{passes}: {i + 1}/{len(shapes)} kernel shapes")
        if launch_overhead and launch_key not in done:
            per_op = _launch_overhead(dev)
            sink.append(
                Measurement(
                    kind="overhead",
                    op="launch",
                    time_s=per_op,
                    repeats=5,
                    source=SOURCE,
                    note=f"shape={launch_key}",
                    **_prov(prov),
                )
            )
        if sustain and sustain[1].key not in done:
            _run_sustained(sustain, sustain_s, dev, out, done, prov, sink, say)
    pending = [c for c in collectives if c.key not in done]
    if pending:
        _run_collectives(pending, out, dev.type, threads, warmup, repeats, prov)
    missing = tuple(missing_shapes(out))
    after = _done_counts(out)  # the shapes with rows they did not have, and the rows, a pass each (or a collective)
    return ProfileReport(
        out=out,
        planned=len(planned),
        measured=sum(1 for key in after if after[key] > before[key]),
        resumed=resumed,
        missing=missing,
        device=device_name(dev),
        rows=sum(after.values()) - sum(before.values()),
    )


def _run_sustained(
    shapes: tuple[Shape, Shape],
    seconds: float,
    dev: Any,
    out: Path,
    done: set[str],
    prov: dict[str, str],
    sink: RowAppender,
    say: Callable[[str], None],
) -> int:
    """Time the burst and sustained GEMM (:func:`sustained_gemm`) into ``sink``; the rows written."""
    burst_shape, sustained_shape = shapes
    say(f"timing the peak GEMM under {seconds:g} s of sustained load")
    try:
        run = sustained_gemm(dev, seconds)
    except RuntimeError as err:
        _record_failure(out, sustained_shape.key, f"{type(err).__name__}: {err}")
        say(f"failed {sustained_shape.key}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
        return 0
    written = 0
    if burst_shape.key not in done:
        sink.append(_timed_row(burst_shape, run.burst, prov, f"before: {run.before}" if run.before else ""))
        written += 1
    state = f"; end: {run.after}" if run.after else ""
    sink.append(
        _timed_row(sustained_shape, run.sustained, prov, f"after {run.seconds:.0f} s of back-to-back GEMMs{state}")
    )
    ratio = run.burst.median_s / run.sustained.median_s
    say(f"  sustained GEMM throughput {ratio:.3f} of the burst's ({run.after or 'no clock reading'})")
    return written + 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run_collectives(
    shapes: Sequence[Shape],
    out: Path,
    dev_type: str,
    threads: int | None,
    warmup: int,
    repeats: int,
    prov: dict[str, str],
) -> int:
    torch = require_torch()
    ranks = shapes[0].ranks
    if dev_type == "cuda" and torch.cuda.device_count() < ranks:
        raise CalibrationError(
            f"--ranks {ranks}: only {torch.cuda.device_count()} GPUs are visible; give --ranks "
            f"{torch.cuda.device_count()} or fewer (one process per GPU), or make more GPUs visible"
        )
    before = len(_done_keys(out))
    payload = [(s.op, s.bytes, s.key) for s in shapes]
    # Collectives between processes are at the mercy of the scheduler (a preempted rank stalls the others
    # for a time slice), so they get more timed runs than kernels for a stable median.
    repeats = max(2 * repeats, 10)
    spawn(
        _collective_worker,
        (ranks, _free_port(), dev_type, threads or 1, payload, str(out), warmup, repeats, prov),
        ranks,
        "collective benchmark",
    )
    return len(_done_keys(out)) - before


def _collective_worker(
    rank: int,
    ranks: int,
    port: int,
    dev_type: str,
    threads: int,
    payload: list[tuple[str, float, str]],
    out_dir: str,
    warmup: int,
    repeats: int,
    prov: dict[str, str],
) -> None:
    """One rank of the collective benchmark (spawned); rank 0 writes the rows."""
    torch = require_torch()
    dist = torch.distributed
    dev = init_rank(rank, ranks, dev_type, threads, port)
    out = Path(out_dir)
    sink = RowAppender(out / COLLECTIVES_CSV) if rank == 0 else None
    dt = getattr(torch, DTYPE)
    try:
        for op, size, key in payload:
            n = max(int(size) // 2, ranks)
            n -= n % ranks
            try:
                fn = _collective_fn(dist, torch, op, n, rank, ranks, dev, dt)
                times = []
                for i in range(warmup + repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    if dev_type == "cuda":
                        torch.cuda.synchronize(dev)
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
            except (RuntimeError, ValueError, NotImplementedError) as err:
                if rank == 0:
                    _record_failure(out, key, f"{type(err).__name__}: {err}")
                dist.barrier()
                continue
            if sink is not None:
                times.sort()
                shape = Shape(kind="collective", op=op, bytes=float(2 * n), ranks=ranks)
                mean = sum(times) / len(times)
                std = math.sqrt(sum((t - mean) ** 2 for t in times) / len(times))
                row = _row(shape, times[len(times) // 2], times[0], std, len(times), prov)
                sink.append(replace(row, note=f"shape={key}"))
    finally:
        if sink is not None:
            sink.close()
        dist.destroy_process_group()


def _collective_fn(dist: Any, torch: Any, op: str, n: int, rank: int, ranks: int, dev: Any, dt: Any) -> Any:
    """The timed call; sizes follow nccl-tests (buffer, gathered output, scattered input, send buffer)."""
    if op == "all_reduce":
        buf = torch.ones(n, device=dev, dtype=dt)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        part = torch.ones(n // ranks, device=dev, dtype=dt)
        outs = [torch.empty_like(part) for _ in range(ranks)]
        return lambda: dist.all_gather(outs, part)
    if op == "reduce_scatter":
        inp = torch.ones(n, device=dev, dtype=dt)
        res = torch.empty(n // ranks, device=dev, dtype=dt)
        single = getattr(dist, "reduce_scatter_single", None)  # the newer name (torch >= 2.13)
        if single is not None:
            return lambda: single(res, inp)
        return lambda: dist.reduce_scatter_tensor(res, inp)
    if op == "all_to_all":
        inp = torch.ones(n, device=dev, dtype=dt)
        res = torch.empty_like(inp)
        return lambda: dist.all_to_all_single(res, inp)
    send = torch.ones(n, device=dev, dtype=dt)
    recv = torch.empty_like(send)

    def exchange() -> None:
        reqs = [dist.isend(send, (rank + 1) % ranks), dist.irecv(recv, (rank - 1) % ranks)]
        for r in reqs:
            r.wait()

    return exchange
