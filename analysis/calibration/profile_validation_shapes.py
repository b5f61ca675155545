"""Profile, on the GPU at hand, the kernel shapes that the validation rows of one cluster run.

    python analysis/calibration/profile_validation_shapes.py data/validation/published_runs.csv \
        --cluster dgx-h100 --device cuda --out profiles/h200-validation [--fp8] [--dry-run]

For every row of the CSV on ``--cluster`` it builds the row's model as ``clustersim validate`` does
(:func:`simulator.validate.row_model`, with the built-in model's architecture facts where the row names one)
and collects the distinct operator shapes of one micro-batch at the row's tensor-parallel width and
per-rank sequence (the row's sequence over its context-parallel degree), at the row's micro-batch or, where
the row leaves it free, at 1 and 2. ``--fp8`` (the default) also times the FP8 GEMMs of FP8 training. The
shapes are timed by :func:`simulator.calibration.profile.run_profile`, which resumes a killed run and keeps
what it measured, so ``clustersim calibrate fit`` reads the folder like any other profile.

The rows give shapes only: the measured step times of the CSV are never read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from simulator.calibration.profile import Shape, model_shapes, probe_shapes, run_profile
from simulator.validate import builtin_architecture, row_model, row_plan


def shapes_for(csv: Path, cluster: str, fp8: bool) -> tuple[dict[str, Shape], list[str]]:
    """The distinct kernel shapes of the rows on ``cluster`` and one line per row used."""
    frame = pd.read_csv(csv, dtype=str, keep_default_na=False)
    frame = frame.drop(columns=[c for c in frame.columns if c.startswith("measured")])  # never read step times
    shapes: dict[str, Shape] = {}
    used: list[str] = []
    for i, cells in frame.iterrows():
        if cells.get("cluster", "") != cluster:
            continue
        where = f"{csv.name} row {int(str(i)) + 2}"
        row = cells.replace("", None)
        model, _ = builtin_architecture(row_model(row, where))
        plan = row_plan(row, where)
        tp, cp = plan.tp or 1, plan.cp or 1
        seq = (plan.seq_len or model.seq_len) // cp
        mbs = (plan.micro_batch,) if plan.micro_batch else (1, 2)
        before = len(shapes)
        for s in model_shapes(model, seq_len=seq, micro_batches=mbs, tps=(tp,), fp8=fp8):
            shapes.setdefault(s.key, s)
        added = len(shapes) - before
        used.append(f"{row.get('run_id')}: {model.name} tp={tp} seq/rank={seq} micro_batch={mbs}: +{added}")
    return shapes, used


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--cluster", required=True, help="the rows' cluster column, e.g. dgx-h100")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="16-bit GEMMs only")
    ap.add_argument("--fp8-emulated", action="store_true", help="FP8 on a CPU (tests the pipeline only)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--dry-run", action="store_true", help="list the rows and shape counts, time nothing")
    args = ap.parse_args(argv)
    shapes, used = shapes_for(args.csv, args.cluster, args.fp8)
    for line in used:
        print(line)
    flops = sum(s.flops for s in shapes.values())
    print(f"{len(used)} rows, {len(shapes)} distinct shapes, {flops / 1e12:.1f} TFLOP per pass")
    if args.dry_run or not used:
        return 0 if used else 2
    report = run_profile(
        [*shapes.values(), *probe_shapes(args.device, fp8=args.fp8)],
        args.out,
        device=args.device,
        warmup=args.warmup,
        repeats=args.repeats,
        passes=args.passes,
        fp8_emulated=args.fp8_emulated,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    missing = len(report.missing)
    print(f"profiled on {report.device}: {report.measured} measured, {report.resumed} resumed, {missing} missing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
