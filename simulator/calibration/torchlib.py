"""PyTorch helpers shared by the profiler and the check: lazy import, timing, provenance, the real GPT.

PyTorch is an optional extra (``clustersim[profile]``) and is imported only when a function here runs, so
``import simulator`` and the simulator proper never load it. Objects from torch are typed ``Any``: the
package type-checks without torch installed.

Timing follows the usual GPU/CPU benchmarking practice (PyTorch ``torch.utils.benchmark`` and Triton's
``do_bench``): warm-up runs first, then ``repeats`` timed runs, and the median is reported with the
minimum and the standard deviation as its spread. With ``cold_cache`` a buffer larger than the last-level
cache is overwritten before each timed run (outside the timing), as ``triton.testing.do_bench`` does with
its 256 MB L2 flush. The default keeps caches warm: in a training step a kernel's operands were written by
the kernels just before it, so neither extreme is exact. On a shared 2-core CPU host both gave a median
check error under 10%; the smallest configuration moved by up to ±25% between them (and between runs).
Both are offered, and neither is adjusted to step times.

On CUDA a pair of CUDA events brackets each run, and the run is *preloaded*: a spin kernel
(``torch.cuda._sleep``) longer than the host takes to issue the run goes first, so every kernel of the run is
already queued when the start event fires and the events time the GPU's work alone. Without it they also
timed the host's launch gaps: a benchmark of a few microseconds of GPU work issued through
``torch.autograd.grad`` (a norm's or activation's backward, about 100 µs of host work) measured the host, and
on an H200 a table fitted from such rows predicted the check's real steps 15-36% too slow, where the host
queues ahead of the GPU. The host's own cost per operator is measured apart (``launch_overhead_us``) and
charged by the simulator where the host, not the GPU, is the bottleneck. On the CPU ``time.perf_counter``
brackets each run, with the intra-op thread count fixed (``torch.set_num_threads``) so a profile and a
check use the same number of cores.

The GPT (:func:`build_gpt`) does the work of :func:`simulator.graph.transformer.build_graph` for a dense,
pre-norm model: learned token and position embeddings, per layer LayerNorm, fused QKV projection, causal
``scaled_dot_product_attention`` (the fused kernel), output projection and residual add, LayerNorm, a 4h
GELU MLP and residual add; a final LayerNorm, an untied (or tied) bias-free output layer and Megatron's fp32
cross-entropy (:func:`cross_entropy_forward`);
Adam. The kernel benchmarks of :mod:`.profile` call the same functions, so a profiled kernel is the one the
training step runs.
"""

from __future__ import annotations

import datetime as _dt
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from simulator.errors import CalibrationError
from simulator.specs.model import ModelSpec

__all__ = [
    "Timing",
    "build_gpt",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "device_name",
    "memory_guard",
    "provenance",
    "require_torch",
    "setup_device",
    "spawn",
    "time_fn",
]

DTYPE = "bfloat16"  # the simulator models 16-bit training (graph: 2-byte activations); bf16 runs on CPUs too


def require_torch() -> Any:
    """The ``torch`` module, or a CalibrationError saying how to install it."""
    try:
        import torch
    except ImportError:
        raise CalibrationError(
            "PyTorch is not installed: profile, check and host run real kernels through it; "
            "install it with: pip install 'clustersim[profile]'"
        ) from None
    return torch


def setup_device(device: str, threads: int | None) -> Any:
    """Select ``cuda`` or ``cpu`` (fixing the CPU thread count); returns the torch device."""
    torch = require_torch()
    if device not in ("cuda", "cpu"):
        raise CalibrationError(f"--device must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise CalibrationError("--device cuda: no CUDA device is visible to PyTorch; use --device cpu")
    if threads is not None:
        if threads < 1:
            raise CalibrationError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.device(device)


def device_name(dev: Any) -> str:
    """A readable name of the device: the GPU's, or the CPU model with the thread count."""
    torch = require_torch()
    if dev.type == "cuda":
        return str(torch.cuda.get_device_name(dev))
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {model} ({torch.get_num_threads()} threads)"


def provenance(dev: Any) -> dict[str, str]:
    """Device name, torch and CUDA versions, UTC date and host name, for every measured row."""
    torch = require_torch()
    return {
        "device": device_name(dev),
        "torch_version": str(torch.__version__),
        "cuda_version": str(torch.version.cuda or "") if dev.type == "cuda" else "",
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d"),
        "host": platform.node(),
    }


@dataclass(frozen=True, slots=True)
class Timing:
    """Median, minimum and standard deviation of the timed runs, in seconds."""

    median_s: float
    min_s: float
    std_s: float
    repeats: int


# Bytes overwritten between timed runs: more than the last-level cache (CPUs: tens of MB of L3; H100: 50 MB
# of L2). Triton's do_bench uses 256 MB on GPUs (triton/testing.py); 64 MB covers the CPUs we target.
FLUSH_BYTES = {"cuda": 256 * 2**20, "cpu": 64 * 2**20}
_FLUSH: dict[str, Any] = {}


def _flush_cache(dev: Any) -> None:
    torch = require_torch()
    key = str(dev)
    buf = _FLUSH.get(key)
    if buf is None:
        buf = torch.empty(FLUSH_BYTES[dev.type] // 4, dtype=torch.float32, device=dev)
        _FLUSH[key] = buf
    buf.zero_()


def time_fn(
    fn: Callable[[], Any],
    dev: Any,
    *,
    warmup: int = 2,
    repeats: int = 5,
    max_s: float = 2.0,
    cold_cache: bool = False,
) -> Timing:
    """Time ``fn`` (module docstring). Repeats stop early once ``max_s`` seconds have been spent (at least 3)."""
    torch = require_torch()
    cuda = dev.type == "cuda"
    # The host's time to issue one run (on CUDA the kernels are queued, not waited for): the least over the warm-up
    # runs, since the first also pays one-time costs (allocations, library handles, kernel selection).
    issue_s = math.inf
    for _ in range(max(warmup, 1) if cuda else warmup):
        t0 = time.perf_counter()
        fn()
        issue_s = min(issue_s, time.perf_counter() - t0)
    preload = _preload_cycles(dev, issue_s) if cuda else 0
    if cuda:
        torch.cuda.synchronize(dev)
    times: list[float] = []
    spent = 0.0
    for i in range(repeats):
        if cold_cache:
            _flush_cache(dev)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if preload:
                torch.cuda._sleep(preload)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) * 1e-3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        times.append(t)
        spent += t
        if spent > max_s and i >= 2:
            break
    return Timing(
        median_s=statistics.median(times),
        min_s=min(times),
        std_s=statistics.pstdev(times) if len(times) > 1 else 0.0,
        repeats=len(times),
    )


# The GPU spins for PRELOAD_FACTOR times the host's issue time of a run (the warm-up's fastest), plus
# PRELOAD_MARGIN_S, before the start event: the host then issues the whole run while the GPU is still busy, also
# when one issue takes longer than that (a garbage collection, a page fault). The spin is outside the timed interval.
PRELOAD_FACTOR = 2.0
PRELOAD_MARGIN_S = 50e-6
_SLEEP_RATE: dict[str, float] = {}  # spin cycles per second of torch.cuda._sleep, per device


def _preload_cycles(dev: Any, issue_s: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that outlast issuing one run (module docstring); 0 where this PyTorch has
    no ``_sleep`` (the events then time the launch gaps too, as before)."""
    torch = require_torch()
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return 0
    key = str(dev)
    rate = _SLEEP_RATE.get(key)
    if rate is None:
        # The spin counts SM clock cycles; its rate is measured rather than read from the clock, which boosts.
        cycles = 2_000_000
        sleep(cycles)  # warm-up: the clock ramps up under load
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sleep(cycles)
        end.record()
        end.synchronize()
        rate = _SLEEP_RATE[key] = cycles / max(start.elapsed_time(end) * 1e-3, 1e-9)
    return max(1, math.ceil(rate * (PRELOAD_FACTOR * issue_s + PRELOAD_MARGIN_S)))


def spawn(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, what: str) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` local processes (torch.multiprocessing); a failed rank is an error."""
    torch = require_torch()
    mp = torch.multiprocessing
    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CalibrationError(
            f"{what}: a worker process failed ({last}); rerun to resume, or check that {nprocs} local processes "
            "can start and reach each other on 127.0.0.1"
        ) from None


def init_rank(rank: int, world_size: int, device: str, threads: int, port: int) -> Any:
    """Join a local process group as ``rank`` (NCCL on CUDA, gloo on the CPU); returns the rank's device."""
    torch = require_torch()
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    torch.distributed.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    return dev


def memory_guard(needed_bytes: float, dev: Any) -> None:
    """Refuse a CPU benchmark that would not fit in free memory (raised as RuntimeError, like a CUDA OOM)."""
    if dev.type != "cpu":
        return
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            info = {line.split(":")[0]: line.split(":")[1] for line in fh}
        free = float(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return
    if needed_bytes > 0.7 * free:
        raise RuntimeError(
            f"out of memory: needs about {needed_bytes / 2**30:.1f} GiB, more than 70% of the "
            f"{free / 2**30:.1f} GiB available (the share a CPU benchmark may take, so that the machine keeps "
            "working); free memory or leave this shape out"
        )


def check_model(model: ModelSpec) -> None:
    """Refuse models the real GPT cannot run as the graph describes them."""
    problems = []
    if model.moe is not None:
        problems.append("mixture-of-experts layers")
    if model.gated_mlp or model.activation != "gelu":
        problems.append(f"activation {model.activation}")
    if model.norm != "layernorm":
        problems.append(f"norm {model.norm}")
    if model.position_embedding != "learned":
        problems.append(f"position embedding {model.position_embedding}")
    if model.kv_heads != model.heads or model.head_dim * model.heads != model.hidden:
        problems.append("grouped-query attention or a head size other than hidden/heads")
    if problems:
        raise CalibrationError(
            f"model {model.name}: the calibration GPT runs dense GPT layers (LayerNorm, learned positions, "
            f"4h GELU MLP, multi-head attention), not {', '.join(problems)}; give a GPT-style model"
        )


def cross_entropy_forward(logits: Any, targets: Any) -> tuple[Any, Any]:
    """Megatron-LM's vocab-parallel cross-entropy on one rank, forward: (per-token loss, fp32 softmax).

    The kernels Megatron runs, in its order (``_VocabParallelCrossEntropy.forward`` on ``output.float()``):
    cast to fp32, row max, in-place subtraction of the max, in-place ``exp``, row sum, in-place division.
    With one tensor-parallel rank the all-reduces between them vanish. The simulator charges these bytes
    (``simulator.graph.transformer.CE_FWD_READ``).
    """
    torch = require_torch()
    z = logits.float()
    z.sub_(z.max(dim=-1)[0].unsqueeze(-1))
    rows = torch.arange(z.shape[0], device=z.device)
    predicted = z[rows, targets]
    torch.exp(z, out=z)
    total = z.sum(dim=-1)
    loss = torch.log(total) - predicted
    z.div_(total.unsqueeze(-1))
    return loss, z


def cross_entropy_backward(softmax: Any, targets: Any, grad: Any, dtype: Any) -> Any:
    """Megatron's backward on the kept fp32 softmax, in place: subtract 1 at the targets, scale by the loss
    gradient, cast back to the logits' 16-bit type (``simulator.graph.transformer.CE_BWD_READ``)."""
    torch = require_torch()
    rows = torch.arange(softmax.shape[0], device=softmax.device)
    softmax[rows, targets] -= 1.0
    softmax.mul_(grad.unsqueeze(-1))
    return softmax.to(dtype)


def _cross_entropy_function() -> Any:
    """An autograd function over :func:`cross_entropy_forward` / :func:`cross_entropy_backward`."""
    torch = require_torch()

    class MegatronCrossEntropy(torch.autograd.Function):  # type: ignore[misc,name-defined]
        @staticmethod
        def forward(ctx: Any, logits: Any, targets: Any) -> Any:
            loss, softmax = cross_entropy_forward(logits, targets)
            ctx.save_for_backward(softmax, targets)
            ctx.logits_dtype = logits.dtype
            return loss

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
            softmax, targets = ctx.saved_tensors
            return cross_entropy_backward(softmax, targets, grad, ctx.logits_dtype), None

    return MegatronCrossEntropy


def build_gpt(model: ModelSpec, dev: Any, *, seed: int = 0) -> Any:
    """A real PyTorch GPT doing the graph's work for ``model`` (module docstring), in bf16 on ``dev``."""
    torch = require_torch()
    check_model(model)
    nn = torch.nn
    nnf = torch.nn.functional
    h, a, d = model.hidden, model.heads, model.head_dim
    cross_entropy = _cross_entropy_function().apply

    class Layer(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * h, bias=model.bias)
            self.out = nn.Linear(h, h, bias=model.bias)
            self.ln2 = nn.LayerNorm(h)
            self.up = nn.Linear(h, model.ffn_hidden, bias=model.bias)
            self.down = nn.Linear(model.ffn_hidden, h, bias=model.bias)

        def forward(self, x: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, a, d).permute(2, 0, 3, 1, 4)
            y = nnf.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
            return x + self.down(nnf.gelu(self.up(self.ln2(x))))

    class GPT(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(model.vocab, h)
            self.pos = nn.Embedding(model.seq_len, h)
            self.layers = nn.ModuleList(Layer() for _ in range(model.layers))
            self.norm = nn.LayerNorm(h)
            self.head = nn.Linear(h, model.vocab, bias=False)
            if model.tied_embeddings:
                self.head.weight = self.tok.weight

        def forward(self, ids: Any, targets: Any) -> Any:
            x = self.tok(ids) + self.pos.weight[: ids.shape[1]]
            for layer in self.layers:
                x = layer(x)
            logits = self.head(self.norm(x))
            return cross_entropy(logits.view(-1, model.vocab), targets.view(-1)).mean()

    torch.manual_seed(seed)  # PyTorch's default initialisers draw from its global generator
    return GPT().to(device=dev, dtype=getattr(torch, DTYPE))


def param_count(model: ModelSpec) -> int:
    """Parameters of :func:`build_gpt`'s network (tied output layer counted once)."""
    h, f = model.hidden, model.ffn_hidden
    bias = 1 if model.bias else 0
    layer = 4 * h + 3 * h * h + 3 * h * bias + h * h + h * bias + h * f + f * bias + f * h + h * bias
    head = 0 if model.tied_embeddings else model.vocab * h
    return model.layers * layer + model.vocab * h + model.seq_len * h + 2 * h + head


def finite(value: float) -> float:
    """``value`` when finite, else NaN (for CSV spreads)."""
    return value if math.isfinite(value) else math.nan
