"""The benchmarks' one timing rule: a first (cold) call, then the median of ``repeats`` more."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """Seconds of the first call, the median seconds of ``repeats`` more calls, and the first call's value."""
    t0 = time.perf_counter()
    value = fn()
    cold = time.perf_counter() - t0
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return cold, statistics.median(samples), value
