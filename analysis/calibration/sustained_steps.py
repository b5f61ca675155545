"""Real training steps under sustained load: does a GPU's step slow down as its power limit bites?

    python analysis/calibration/sustained_steps.py --out sustained_steps.json [--seconds 40] [--device cuda]

Trains GEMM-heavy GPTs of the check's family (``simulator.calibration.check.CheckConfig``) back to back for
``--seconds`` each and records every step's wall time, with the SM clock, power and temperature NVML reports at the
start and the end. A table's ``sustained_gemm_ratio`` (``clustersim calibrate profile --sustain``) is measured on
one GEMM run back to back, the worst case; a training step also runs attention, memory-bound kernels and the
optimizer, and draws less power on average. These steps show how much of that ratio a real step pays: the early
steps run at the boost clock, the late ones at whatever clock the power limit leaves. The predictions with and
without the ratio are made afterwards, on any machine (the JSON keeps each configuration).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from simulator.calibration.check import CheckConfig
from simulator.calibration.profile import _device_state
from simulator.calibration.torchlib import build_gpt, require_torch, setup_device

CONFIGS = (
    CheckConfig(name="h4096-L8-s4096-b2", hidden=4096, layers=8, heads=32, seq_len=4096, micro_batch=2, vocab=32768),
    CheckConfig(name="h2048-L8-s2048-b4", hidden=2048, layers=8, heads=16, seq_len=2048, micro_batch=4, vocab=32768),
)
TINY = (CheckConfig(name="tiny-h64-L2-s32-b2", hidden=64, layers=2, heads=4, seq_len=32, micro_batch=2, vocab=256),)


def run(cfg: CheckConfig, device: str, seconds: float, warmup: int = 3) -> dict[str, Any]:
    torch = require_torch()
    dev = setup_device(device, None if device == "cuda" else 1)
    net = build_gpt(cfg.model(), dev, seed=0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq_len), generator=gen).to(dev)
    targets = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq_len), generator=gen).to(dev)
    cuda = dev.type == "cuda"

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        net(ids, targets).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        step()
    before = _device_state(dev)
    steps: list[tuple[float, float]] = []  # (seconds since the first timed step began, step seconds)
    t_start = time.perf_counter()
    while not steps or steps[-1][0] < seconds:
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        steps.append((t1 - t_start, t1 - t0))
    after = _device_state(dev)
    times = [s for _, s in steps]
    tail = [s for at, s in steps if at >= 0.75 * steps[-1][0]] or times[-1:]
    return {
        "configuration": asdict(cfg),
        "steps": len(times),
        "first5_median_s": statistics.median(times[:5]),
        "last_quarter_median_s": statistics.median(tail),
        "seconds": steps[-1][0],
        "before": before,
        "after": after,
        "step_times_s": [round(s, 6) for s in times],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a seconds-scale configuration (tests)")
    args = ap.parse_args(argv)
    rows = []
    for cfg in TINY if args.tiny else CONFIGS:
        row = run(cfg, args.device, args.seconds)
        if args.device == "cuda":
            require_torch().cuda.empty_cache()  # the model and optimizer of run() are gone: free their memory
        rows.append(row)
        print(
            f"{cfg.name:<22} {row['steps']:4d} steps: first {row['first5_median_s'] * 1e3:8.2f} ms, "
            f"last quarter {row['last_quarter_median_s'] * 1e3:8.2f} ms; {row['before']} -> {row['after']}",
            flush=True,
        )
        args.out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
