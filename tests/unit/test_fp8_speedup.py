"""The FP8 speed-up curve of cost.compute is what the committed H200 profile measured, point for point."""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from simulator.cost.compute import FP8_SPEEDUP, FP8_SPEEDUP_LOG10_FLOPS

DATA = Path(__file__).resolve().parents[2] / "data" / "calibration" / "h200"


def _paired_speedups() -> list[tuple[float, float]]:
    """(log10 FLOPs, BF16 time / FP8 time) of every GEMM shape timed in both precisions, per profile folder; a shape
    timed in several passes takes its median time."""
    pairs: list[tuple[float, float]] = []
    for kernels in sorted(DATA.glob("*/kernels.csv")):
        times: dict[tuple[str, ...], list[float]] = defaultdict(list)
        flops: dict[tuple[str, ...], float] = {}
        with kernels.open(encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                if row["kind"] != "gemm" or row["op"].startswith("probe."):
                    continue
                shape = (row["op"], row["m"], row["n"], row["k"], row["batch"])
                times[(*shape, row["precision"])].append(float(row["time_s"]))
                flops[shape] = float(row["flops"])
        for shape, f in flops.items():
            bf16, fp8 = times.get((*shape, "bf16")), times.get((*shape, "fp8"))
            if bf16 and fp8:
                pairs.append((math.log10(f), statistics.median(bf16) / statistics.median(fp8)))
    return pairs


def test_each_point_is_the_median_speedup_of_its_half_decade() -> None:
    pairs = _paired_speedups()
    assert len(pairs) == 327
    for centre, speedup in zip(FP8_SPEEDUP_LOG10_FLOPS, FP8_SPEEDUP, strict=True):
        inside = [s for x, s in pairs if centre - 0.25 <= x < centre + 0.25]
        assert len(inside) >= 3, centre
        assert statistics.median(inside) == pytest.approx(speedup, abs=5e-4), centre
    # Every measured pair falls in a bin the curve has a point for.
    assert all(FP8_SPEEDUP_LOG10_FLOPS[0] - 0.25 <= x < FP8_SPEEDUP_LOG10_FLOPS[-1] + 0.25 for x, _ in pairs)
