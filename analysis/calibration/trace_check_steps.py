"""Where a real check step's time goes on a GPU: GPU busy time against wall time, from a PyTorch profiler trace.

    python analysis/calibration/trace_check_steps.py --out trace_steps.json [--steps 3]

Trains each configuration of ``clustersim calibrate check --device cuda`` (the GPU set) as the check does and
records a few steps under ``torch.profiler`` (Kineto). Per configuration it writes the median wall time of a
step, the GPU time its kernels, copies and memsets took (the union of their intervals), the number of kernels,
and the kernel time by name family (GEMM, attention, norm, optimizer, ...). Wall time above busy time is time
the GPU waited for the host (``data/calibration/h200/README.md`` compares the H200's with the check's step
times). Nothing here feeds a calibration table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from simulator.calibration.check import GPU_CONFIGS, CheckConfig
from simulator.calibration.torchlib import build_gpt, require_torch

FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),  # first: attention kernels are built on CUTLASS too
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "ampere_", "cublas", "nvjet")),
    ("norm", ("layer_norm", "layernorm", "rms")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("softmax_loss", ("softmax", "nll", "cross_entropy", "log_softmax")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "gelu", "reduce")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def busy_seconds(events: list[dict[str, Any]]) -> float:
    """Length of the union of the intervals (µs in the trace) of GPU events."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events)
    total, end = 0.0, -1.0
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total * 1e-6


def trace_config(cfg: CheckConfig, steps: int, warmup: int) -> dict[str, Any]:
    torch = require_torch()
    dev = torch.device("cuda")
    net = build_gpt(cfg.model(), dev, seed=0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq_len), generator=gen).to(dev)
    targets = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq_len), generator=gen).to(dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        net(ids, targets).backward()
        opt.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    walls = []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text(encoding="utf-8"))
    gpu = [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    by_family: dict[str, float] = {}
    for e in kernels:
        fam = family(str(e.get("name", "")))
        by_family[fam] = by_family.get(fam, 0.0) + float(e.get("dur", 0.0)) * 1e-6 / steps
    # Untraced steps for the wall time (the profiler's own host overhead slows the traced ones).
    plain = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - t0)
    return {
        "name": cfg.name,
        "wall_s": statistics.median(plain),
        "traced_wall_s": statistics.median(walls),
        "gpu_busy_s": busy_seconds(gpu) / steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_s_by_family": {k: round(v, 9) for k, v in sorted(by_family.items())},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    torch = require_torch()
    if not torch.cuda.is_available():
        print("no CUDA device: this script traces GPU steps", file=sys.stderr)
        return 2
    rows = [trace_config(cfg, args.steps, args.warmup) for cfg in GPU_CONFIGS]
    args.out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    for r in rows:
        print(
            f"{r['name']:<22} wall {r['wall_s'] * 1e3:7.2f} ms  GPU busy {r['gpu_busy_s'] * 1e3:7.2f} ms  "
            f"kernels {r['kernels_per_step']:.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
