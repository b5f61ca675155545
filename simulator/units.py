"""Unit constants and conversions.

Everything inside the simulator is SI: seconds, bytes, FLOPs, bytes per second. YAML files name their
unit in the key (``hbm_bandwidth_gb_per_s``, ``nic_bandwidth_gbit_per_s``) and are converted once, when the
spec is built, with the constants below. Decimal prefixes for rates (GB/s, Gb/s, TFLOP/s, as datasheets
use them) and binary prefixes for capacities (GiB, as ``nvidia-smi`` and allocators report memory).
"""

from __future__ import annotations

KIB = 1024
MIB = 1024**2
GIB = 1024**3

KB = 1_000
MB = 1_000_000
GB = 1_000_000_000

TFLOP = 1e12
GBIT = 1e9 / 8  # bytes per gigabit

US = 1e-6
MS = 1e-3


def sig(value: float, digits: int = 4) -> float:
    """``value`` rounded to ``digits`` significant digits (0 for values <= 0): how calibration tables store
    measured figures, so that a small efficiency (0.000753) keeps its precision where fixed decimals (0.0008)
    would shift it by 6%.

    >>> sig(0.00075349), sig(0.61234), sig(0.0)
    (0.0007535, 0.6123, 0.0)
    """
    if value <= 0:
        return 0.0
    return float(f"{value:.{digits}g}")


def gib(n_bytes: float) -> float:
    """Bytes expressed in GiB."""
    return n_bytes / GIB


def fmt_bytes(n_bytes: float) -> str:
    """Human-readable size in binary units, e.g. ``'13.2 GiB'``."""
    size = float(n_bytes)
    for unit, scale in (("TiB", 1024**4), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def fmt_seconds(seconds: float, like: float | None = None) -> str:
    """Human-readable duration, e.g. ``'12.4 ms'``; with ``like``, in the unit ``like`` would take (a column of
    parts of one total reads in one unit).

    >>> fmt_seconds(0.0124), fmt_seconds(0.0124, like=2.5), fmt_seconds(0.0, like=2.5)
    ('12.40 ms', '0.012 s', '0.000 s')
    """
    scale = seconds if like is None else like
    if scale >= 1:
        return f"{seconds:.3f} s"
    if scale >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_knob(value: object, unset: str = "none") -> str:
    """A plan knob as the YAML files spell it: ``true``/``false`` (not Python's ``True``), and ``unset`` for a knob
    with no value (a plan that could not run never had its free knobs chosen)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return unset if value is None else str(value)
