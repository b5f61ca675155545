"""Fit measurement rows into a calibration table, and report how well the table predicts held-out rows.

Compute curves, one per (op class, precision): each row's efficiency is ``FLOPs / (time · peak)`` for GEMMs
and attention, ``bytes / (time · HBM bandwidth)`` for memory-bound kernels; rows are binned by log10 of
their size (``bins_per_decade`` bins per decade) and each bin contributes the *median* efficiency at the
median size of its rows. Medians make the table robust to the outliers every profile has (a kernel that
caught a clock dip, a shape with an unlucky tiling) without smoothing away real steps. Bins with fewer
than three rows are dropped when better-populated bins exist; the curve there follows the better-measured
sizes, not those rows, so a note says how many each curve left out. Efficiencies are clipped to (0, 1]. A
curve of one point (rows of one size) is applied flat to every size, and a note says so too.

With ``generic_memory="all"`` (public profiles, forward passes mostly) memory rows feed the curve of their
class (norm, activation...) and the generic ``memory`` curve. With ``"unclassified"`` (our own profiles,
which time every class and the backward of each kernel separately) every row feeds only its own curve,
backward passes (ops named ``..._bwd`` or ``..._backward``) apart from forward ones (``norm_bwd``,
``attention_bwd``...), and the generic ``memory`` curve holds the kernels of no other class, such as
cross-entropy, which are exactly the ones that fall back to it. Attention backward rows always get
their own ``attention_bwd`` curve. Rows named
``probe.*`` (device properties) and ``overhead`` rows (host launch cost, stored as ``launch_overhead_us``)
feed no curve. The burst and sustained timings of one GEMM (``probe.gemm_burst``, ``probe.gemm_sustained``)
give ``sustained_gemm_ratio``, the median burst time over the median sustained time.

Collective curves, one per (collective, scope, group size), give the nccl-tests bus bandwidth
``size / time · factor`` (factor 2(n−1)/n for all-reduce, (n−1)/n for all-gather, reduce-scatter and
all-to-all, 1 for send/recv; nccl-tests ``doc/PERFORMANCE.md``) binned two per octave of message size.
Only ``domain`` scope (inside one NVLink domain or host) is fitted into tables: a network curve describes
one particular fabric and NIC count, which the cluster profile already states; its rows are kept for
reports.

The default table (:func:`default_table`) re-expresses each measured device's compute curves against the
op's *ideal time at peak* (size / peak) and takes the median over devices: small kernels are limited by
launch and ramp-up latencies measured in seconds, not by their FLOPs, so that axis transfers between
devices of different speed. Its collective curves are bus bandwidth as a fraction of the measured
cluster's NVLink bandwidth, scaled to the target cluster's when used.
"""

from __future__ import annotations

import math
import statistics
import zlib
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from simulator.calibration.rows import SUSTAINED_PROBES, Measurement, memory_class
from simulator.cost.communication import bus_factor
from simulator.errors import CalibrationError
from simulator.specs.calibration import (
    ATTENTION_CLASSES,
    ATTENTION_ROW_PREFIXES,
    CAUSAL,
    COMPUTE_OPS,
    STANDS_IN,
    BandwidthCurve,
    CalibrationTable,
    EfficiencyCurve,
)
from simulator.specs.hardware import DeviceSpec
from simulator.units import GB, sig

__all__ = [
    "compute_class",
    "default_table",
    "fit_table",
    "holdout_errors",
    "monotone_time",
    "predict_time",
    "residual_report",
    "unfitted_reason",
]

MIN_BIN_ROWS = 3
GENERIC_MEMORY = ("all", "unclassified")


# Our profiler's backward GEMM rows (profile.model_shapes) fit their layout's curve (specs.calibration).
GEMM_ROW_CLASSES = {"gemm.dgrad": "gemm_dgrad", "gemm.wgrad": "gemm_wgrad"}


def compute_class(row: Measurement) -> str:
    """The curve a compute row belongs to: ``gemm`` (``gemm_dgrad``/``gemm_wgrad`` for our profiler's backward
    GEMM layouts), an attention class (``attention``; ``attention_fa2`` for
    FlashAttention-2 rows, named ``flash2_...``; ``attention_cudnn`` for cuDNN rows, ``cudnn_...``; each with
    ``_causal`` when the op names a causal mask), its ``_bwd`` variant, or a memory class.

    >>> compute_class(Measurement(kind="attention", op="attention_bwd", time_s=1.0))
    'attention_bwd'
    >>> compute_class(Measurement(kind="attention", op="flash2_attention_causal_fwd", time_s=1.0))
    'attention_fa2_causal'
    """
    backward = "_bwd" in row.op or "backward" in row.op
    if row.kind == "memory":
        return memory_class(row.op) + ("_bwd" if backward else "")
    if row.kind == "attention":
        cls = next((c for p, c in ATTENTION_ROW_PREFIXES.items() if row.op.startswith(p)), ATTENTION_CLASSES["flash"])
        return cls + (CAUSAL if "causal" in row.op else "") + ("_bwd" if backward else "")
    if row.kind == "gemm":
        return GEMM_ROW_CLASSES.get(row.op, "gemm")
    return row.kind


def _default_kernel_from_fa2(
    compute: dict[tuple[str, str], list[tuple[float, float]]],
) -> dict[tuple[str, str], str]:
    """Give a device whose only measured fused attention kernel is FlashAttention-2 its ``attention`` curves from it.

    ``attention`` is the device's own fused kernel, the fastest measured on it; where no other kernel was
    measured at a precision (A100: FlashAttention-2 is the Ampere kernel, Dao 2023), that is FlashAttention-2.
    Every FlashAttention-2 curve (with and without a causal mask, forward and backward) gives its counterpart.
    Returns the curves it added, each with the class of the rows it was fitted from.
    """
    fa2, own = ATTENTION_CLASSES["flash2"], ATTENTION_CLASSES["flash"]
    own_family = {own + mask + phase for mask in ("", CAUSAL) for phase in ("", "_bwd")}

    def family(precision: str) -> str:  # one name for precisions whose curves stand in for each other
        return min(precision, STANDS_IN.get(precision, precision))

    measured_own = {family(p) for c, p in compute if c in own_family}
    derived: dict[tuple[str, str], str] = {}
    for (cls, precision), points in list(compute.items()):
        if family(precision) in measured_own:
            continue
        if cls.startswith(fa2) and own + cls.removeprefix(fa2) in own_family:
            key = (own + cls.removeprefix(fa2), precision)
            compute[key] = list(points)
            derived[key] = cls
    return derived


def _is_probe(row: Measurement) -> bool:
    return row.op.startswith("probe.")


def _efficiency(row: Measurement, device: DeviceSpec) -> tuple[float, float]:
    """(size, efficiency) of a compute row."""
    if row.kind == "memory":
        return row.bytes, row.bytes / (row.time_s * device.hbm_bandwidth_bytes_per_s)
    return row.flops, row.flops / (row.time_s * device.peak(_peak_precision(row.precision)))


def _peak_precision(precision: str) -> str:
    return {"fp32": "tf32"}.get(precision, precision or "bf16")


def _bins(points: list[tuple[float, float]], per_unit: float, log: Any) -> dict[int, list[tuple[float, float]]]:
    """The usable points (size and value > 0) by bin of ``per_unit`` bins per unit of ``log`` size."""
    bins: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for size, value in points:
        if size > 0 and value > 0 and math.isfinite(value):
            x = log(size)
            bins[math.floor(x * per_unit)].append((x, value))
    return bins


def _sparse(bins: dict[int, list[tuple[float, float]]], min_rows: int) -> dict[int, list[tuple[float, float]]]:
    """The bins :func:`_binned` drops: those of fewer than ``min_rows`` rows, where any bin has that many."""
    if not any(len(v) >= min_rows for v in bins.values()):
        return {}
    return {k: v for k, v in bins.items() if len(v) < min_rows}


def _binned(
    points: list[tuple[float, float]], per_unit: float, log: Any, min_rows: int = MIN_BIN_ROWS
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[int, ...]]:
    """(log size, median value, rows) of each bin of ``per_unit`` bins per unit of ``log`` size."""
    bins = _bins(points, per_unit, log)
    if not bins:
        return (), (), ()
    sparse = _sparse(bins, min_rows)
    use = {k: v for k, v in bins.items() if k not in sparse}
    xs: list[float] = []
    ys: list[float] = []
    counts: list[int] = []
    for key in sorted(use):
        pts = use[key]
        x = statistics.median(p[0] for p in pts)
        if xs and x <= xs[-1]:
            continue
        xs.append(round(x, 4))
        ys.append(statistics.median(p[1] for p in pts))
        counts.append(len(pts))
    return tuple(xs), tuple(ys), tuple(counts)


def monotone_time(
    xs: Sequence[float], ys: Sequence[float], base: float, weights: Sequence[int] | None = None
) -> tuple[float, ...]:
    """The efficiencies nearest ``ys`` under which a bigger problem never takes less time.

    Time is ``base**x / y``; the curves interpolate ``log y`` linearly in ``x`` (``EfficiencyCurve.at``), so
    log time is piecewise linear and non-decreasing exactly when it is non-decreasing at the points. Where the
    measured log time falls with size (noise, or a kernel that switches algorithm), the points are replaced by
    the isotonic least-squares fit of log time (pool adjacent violators, each point weighted by ``weights``,
    the rows of its bin, else alike: Barlow et al. 1972, *Statistical Inference under Order Restrictions*), which
    puts a dip's neighbours at their weighted mean. The cap this replaces held the slower point's time over every
    later point until the measurements caught up, so one slow bin slowed the curve after it: the GEMMs of 3e8-3e9
    FLOPs came out 24% (A100) and 56% (H100) slower than the rows the curve was fitted to (median), now 8% and 3%;
    the fewer rows of 1e8-3e8 FLOPs, which run slower per FLOP than the larger ones, went from 13% and 2% too fast
    to 30% and 28%. A stretch of rising time passes unchanged.

    Measured times of 10, 10 and 6.3 (a dip at the largest size) become one time for all three, their geometric
    mean 8.6; a constant time passes unchanged:

    >>> xs = (0.0, 0.25, 0.5)
    >>> [round(10**x / y, 2) for x, y in zip(xs, monotone_time(xs, (0.1, 0.1 * 10**0.25, 0.5), 10.0), strict=True)]
    [8.58, 8.58, 8.58]
    >>> [round(y, 4) for y in monotone_time((0.0, 1.0), (0.1, 1.0), 10.0)]
    [0.1, 1.0]
    """
    if any(not (math.isfinite(y) and y > 0) for y in ys) or any(w <= 0 for w in weights or ()):
        raise ValueError("monotone_time needs finite efficiencies > 0 and weights > 0")  # _binned gives such
    logb = math.log(base)
    times = [x * logb - math.log(y) for x, y in zip(xs, ys, strict=True)]
    blocks: list[list[float]] = []  # [weighted sum of log times, weight, points] of each pooled run, left to right
    for t, w in zip(times, weights or [1] * len(times), strict=True):
        blocks.append([t * w, float(w), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
            blocks[-1][2] += n
    fitted = [total / count for total, count, n in blocks for _ in range(int(n))]
    return tuple(math.exp(x * logb - t) for x, t in zip(xs, fitted, strict=True))


def unfitted_reason(row: Measurement) -> str:
    """Why :func:`fit_table` leaves ``row`` out ("" where it reads it), for the fit's report: no row is dropped
    without a word."""
    if row.kind == "overhead" and row.op != "launch":
        return "overhead rows other than 'launch' (the only host cost a table holds)"
    if row.kind == "collective":
        if row.scope != "domain":
            return (
                "collectives across nodes (no network curve is fitted: the fabric and NICs they ran on are not "
                "recorded, and clusters state their own)"
            )
        if row.ranks < 2:
            return "collectives of one rank (no data moves)"
        if not row.bytes > 0:
            return "collectives without a size"
    return ""


def fit_table(
    rows: Sequence[Measurement],
    device: DeviceSpec,
    *,
    name: str,
    source: str = "",
    provenance: Sequence[tuple[str, str]] = (),
    bins_per_decade: int = 4,
    min_bin_rows: int = MIN_BIN_ROWS,
    generic_memory: str = "all",
    notes: list[str] | None = None,
) -> CalibrationTable:
    """A calibration table for ``device`` from measurement ``rows``.

    ``min_bin_rows`` drops sparser bins where better-populated ones exist (1 keeps every bin: right for
    our own profiles, which time each shape once with many repeats); ``generic_memory`` says which memory
    rows feed the generic ``memory`` curve (module docstring). ``notes`` (when given) gets a line for each
    curve that left rows out in sparse bins and for each curve of one point.

    Raises
    ------
    CalibrationError
        When no row yields a curve.
    """
    if generic_memory not in GENERIC_MEMORY:
        raise CalibrationError(f"generic_memory must be one of {', '.join(GENERIC_MEMORY)}, got {generic_memory!r}")
    compute: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    colls: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
    launch: list[float] = []
    sustained: dict[str, list[float]] = {op: [] for op in SUSTAINED_PROBES}
    for row in rows:
        if unfitted_reason(row):
            continue
        if row.kind == "overhead":
            launch.append(row.time_s)
            continue
        if _is_probe(row):
            if row.op in sustained:
                sustained[row.op].append(row.time_s)
            continue
        if row.kind == "collective":
            busbw = row.bytes / row.time_s * (bus_factor(row.op, row.ranks) or 1.0)
            colls[(row.op, row.scope, row.ranks)].append((row.bytes, busbw))
        elif row.kind == "memory":
            point = _efficiency(row, device)
            cls = compute_class(row)
            if generic_memory == "all":
                # Public profiles: forward and backward share a class curve, and every row the generic one.
                compute[(memory_class(row.op), "any")].append(point)
                if memory_class(row.op) != "memory":
                    compute[("memory", "any")].append(point)
            else:
                compute[(cls, "any")].append(point)
        else:
            compute[(compute_class(row), row.precision)].append(_efficiency(row, device))
    derived = _default_kernel_from_fa2(compute)
    curves: list[EfficiencyCurve] = []
    for (kind, precision), points in sorted(compute.items()):
        if notes is not None and (kind, precision) not in derived:  # a derived curve repeats its source's notes
            unit = "bytes" if precision == "any" else "FLOPs"
            label = kind if precision == "any" else f"{kind}:{precision}"
            notes += _bin_notes(label, points, bins_per_decade, math.log10, min_bin_rows, unit)
        xs, ys, rows_per_bin = _binned(points, bins_per_decade, math.log10, min_bin_rows)
        ys = monotone_time(xs, tuple(min(max(y, 1e-4), 1.0) for y in ys), 10.0, rows_per_bin)
        if xs:
            curves.append(
                EfficiencyCurve(
                    op=kind,
                    precision=precision,
                    log10_size=xs,
                    efficiency=tuple(sig(min(max(y, 1e-4), 1.0)) for y in ys),
                    samples=len(points),
                    source=_sources(rows, derived.get((kind, precision), kind), precision),
                )
            )
    bands: list[BandwidthCurve] = []
    for (op, scope, ranks), points in sorted(colls.items()):
        if notes is not None:
            notes += _bin_notes(f"{op}:{ranks}", points, 2, math.log2, min_bin_rows, "bytes")
        xs, ys, rows_per_bin = _binned(points, 2, math.log2, min_bin_rows)
        ys = monotone_time(xs, ys, 2.0, rows_per_bin)
        if xs:
            bands.append(
                BandwidthCurve(
                    collective=op,
                    scope=scope,
                    ranks=ranks,
                    log2_bytes=xs,
                    busbw_bytes_per_s=tuple(sig(y / GB) * GB for y in ys),
                    samples=len(points),
                    source=_sources(rows, "collective", op),
                )
            )
    if not curves and not bands:
        raise CalibrationError(
            f"no usable measurements for {device.name}: every row was empty or out of scope; "
            "give kernel or collective rows (profile, or an importer)"
        )
    return CalibrationTable(
        name=name,
        device=device.name,
        compute=tuple(curves),
        collectives=tuple(bands),
        launch_overhead_s=round(statistics.median(launch), 9) if launch else None,
        sustained_gemm_ratio=_sustained_ratio(*(sustained[op] for op in SUSTAINED_PROBES)),
        provenance=tuple(provenance),
        source=source,
    )


def _bin_notes(
    label: str, points: list[tuple[float, float]], per_unit: float, log: Any, min_rows: int, unit: str
) -> list[str]:
    """What a curve's fit does not say by itself: rows it left out in sparse bins (:func:`_binned`), or that it
    is one point, applied flat to every size."""
    bins = _bins(points, per_unit, log)
    sparse = _sparse(bins, min_rows)
    out: list[str] = []
    if sparse:
        left = [size for size, value in points if size > 0 and value > 0 and math.isfinite(value)]
        dropped = [x for v in sparse.values() for x, _ in v]
        bins_said = "1 size bin" if len(sparse) == 1 else f"{len(sparse)} size bins"
        out.append(
            f"{label}: left out {len(dropped)} of {len(left)} rows, in {bins_said} of fewer than {min_rows} rows "
            f"({_sizes(dropped, log, unit)}) beside better-populated ones: the curve there follows its neighbours, "
            "not these rows (a median of one or two rows measures no size); measure more shapes of those sizes to "
            "fit them"
        )
    kept = [v for k, v in bins.items() if k not in sparse]
    if len(kept) == 1:
        (pts,) = kept
        xs = [x for x, _ in pts]
        sizes = f"one size ({_sizes(xs, log, unit)})" if min(xs) == max(xs) else f"sizes {_sizes(xs, log, unit)}"
        out.append(
            f"{label}: one point, from {len(pts)} row{'' if len(pts) == 1 else 's'} of {sizes}: the table applies "
            "its efficiency to every size; give rows of more sizes for a curve that follows size"
        )
    return out


def _sizes(xs: Sequence[float], log: Any, unit: str) -> str:
    """The range of sizes whose logs are ``xs`` (``4.19e+06 FLOPs``, ``1e+07 to 1.1e+08 FLOPs``)."""
    base = 10.0 if log is math.log10 else 2.0
    lo, hi = base ** min(xs), base ** max(xs)
    return f"{lo:.3g} {unit}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g} to {hi:.3g} {unit}"


def _sustained_ratio(burst: Sequence[float], sustained: Sequence[float]) -> float | None:
    """Median burst time over median sustained time of the same GEMM, None unless both were measured. At most 1:
    a GPU kept busy cannot run faster than in a burst, so a sustained run timed faster is noise between them.

    >>> _sustained_ratio([1.0, 1.2], [1.25]), _sustained_ratio([1.0], []), _sustained_ratio([1.3], [1.0])
    (0.88, None, 1.0)
    """
    if not burst or not sustained:
        return None
    return round(min(statistics.median(burst) / statistics.median(sustained), 1.0), 4)


def _sources(rows: Sequence[Measurement], kind: str, key: str) -> str:
    found = sorted(
        {
            r.source.rsplit("/", 2)[0] if "/" in r.source else r.source
            for r in rows
            if (r.kind == kind == "collective" and key in (r.precision, r.op))
            or (r.kind != "collective" and compute_class(r) == kind)
            or (r.kind == "memory" and kind == "memory")
        }
    )
    text = "; ".join(found)
    return text if len(text) < 300 else text[:297] + "..."


def predict_time(row: Measurement, table: CalibrationTable, device: DeviceSpec) -> float | None:
    """What ``table`` predicts for a measured row (None when it has no curve for it)."""
    if row.kind == "collective":
        curve = table.bandwidth_curve(row.op, row.scope, row.ranks)
        if curve is None or curve.ranks != row.ranks:
            return None
        return row.bytes * (bus_factor(row.op, row.ranks) or 1.0) / curve.at(row.bytes)
    if row.kind == "overhead" or _is_probe(row):
        return None
    if row.kind == "memory":
        mcurve = (
            table.compute_curve(compute_class(row), "any")
            or table.compute_curve(memory_class(row.op), "any")
            or table.compute_curve("memory", "any")
        )
        if mcurve is None:
            return None
        return row.bytes / (device.hbm_bandwidth_bytes_per_s * mcurve.at(row.bytes, device.hbm_bandwidth_bytes_per_s))
    ccurve = table.compute_curve(compute_class(row), row.precision)
    if ccurve is None and row.kind == "gemm":
        ccurve = table.compute_curve("gemm", row.precision)  # what times a backward GEMM without its own curve
    if ccurve is None:
        return None
    peak = device.peak(_peak_precision(row.precision))
    return row.flops / (peak * ccurve.at(row.flops, peak))


def _residual_key(row: Measurement) -> str:
    """The curve a held-out row is reported under (``gemm:fp16``, ``norm``, ``all_reduce:8``...)."""
    if row.kind == "collective":
        return f"{row.op}:{row.ranks}"
    if row.kind == "memory":
        return compute_class(row)
    return f"{compute_class(row)}:{row.precision}"


def holdout_errors(
    rows: Sequence[Measurement],
    device: DeviceSpec,
    *,
    holdout_every: int = 5,
    name: str = "holdout",
    notes: list[str] | None = None,
    **fit: Any,
) -> dict[str, list[float]]:
    """Fit on about (1 − 1/holdout_every) of the rows (chosen by a hash of each shape) and predict the rest.

    Returns the signed relative errors (predicted / measured − 1) of the held-out rows, per curve
    (``gemm:fp16``, ``attention_bwd:bf16``, ``norm``, ``all_reduce:8``...). ``fit`` goes to :func:`fit_table`.
    A curve whose every row falls among the held-out shapes would have nothing to fit (a tiny input failed with
    'no usable measurements'; a backward GEMM class was reported against the forward curve): its rows stay in the
    fit, unreported, and ``notes`` (when given) gets a line naming such curves.
    """

    def held_out(r: Measurement) -> bool:
        # A stable hash of the shape, so the split is deterministic and not aligned with file order.
        key = f"{r.kind}|{r.op}|{r.m}|{r.n}|{r.k}|{r.batch}|{r.bytes}|{r.ranks}|{r.source}"
        return zlib.crc32(key.encode()) % holdout_every == 0

    fitted: dict[str, list[bool]] = defaultdict(list)  # per curve, whether each of its rows is held out
    for r in rows:
        if r.kind != "overhead" and not _is_probe(r) and not unfitted_reason(r):
            fitted[_residual_key(r)].append(held_out(r))
    alone = sorted(key for key, held in fitted.items() if all(held))
    if alone and notes is not None:
        notes.append(
            f"held-out residuals: every row of {', '.join(alone)} fell among the shapes left out (every "
            f"{holdout_every}th), which would leave {'its curve' if len(alone) == 1 else 'their curves'} nothing to "
            f"fit; those rows stay in the fit and get no residual"
        )

    def left_out(r: Measurement) -> bool:
        return held_out(r) and _residual_key(r) not in alone

    usable = [r for r in rows if r.kind != "overhead" and not _is_probe(r)]
    train = [r for r in rows if not left_out(r)]
    test = [r for r in usable if left_out(r)]
    if not test:
        return {}
    table = fit_table(train, device, name=name, **fit)
    errors: dict[str, list[float]] = defaultdict(list)
    for row in test:
        predicted = predict_time(row, table, device)
        if predicted is None:
            continue
        errors[_residual_key(row)].append(predicted / row.time_s - 1.0)
    return dict(sorted(errors.items()))


def residual_report(
    rows: Sequence[Measurement], device: DeviceSpec, *, holdout_every: int = 5, name: str = "holdout", **fit: Any
) -> dict[str, dict[str, float]]:
    """Held-out prediction error per curve (see :func:`holdout_errors`).

    Returns, per curve, the held-out count and the median and 90th-percentile absolute relative error of
    predicted vs measured time.
    """
    report: dict[str, dict[str, float]] = {}
    for key, signed in holdout_errors(rows, device, holdout_every=holdout_every, name=name, **fit).items():
        errs = sorted(abs(e) for e in signed)
        report[key] = {
            "n": float(len(errs)),
            "median_abs_error": statistics.median(errs),
            "p90_abs_error": errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)],
        }
    return report


def default_table(
    measured: Sequence[tuple[CalibrationTable, DeviceSpec, float]],
    *,
    name: str = "default",
    step: float = 0.25,
) -> CalibrationTable:
    """Device-independent curves from measured ``(table, device, nvlink_bytes_per_s)`` triples (module docstring)."""
    if not measured:
        raise CalibrationError("default_table needs at least one measured table")
    compute: list[EfficiencyCurve] = []
    for kind in COMPUTE_OPS:
        shifted: list[tuple[EfficiencyCurve, float]] = []
        sources: list[str] = []  # the tables that measured this class (the H100 table alone has cuDNN attention)
        for table, device, _ in measured:
            for curve in table.compute:
                if curve.op != kind or curve.precision not in ("fp16", "bf16", "any"):
                    continue
                # Memory-bound classes (and their backward curves) are read at bytes / HBM bandwidth
                # (cost.compute), so they are shifted by the bandwidth, not by a FLOP/s peak.
                shifted.append((curve, math.log10(device.curve_rate(curve))))
                if table.name not in sources:
                    sources.append(table.name)
        if not shifted:
            continue
        lo = min(c.log10_size[0] - off for c, off in shifted)
        hi = max(c.log10_size[-1] - off for c, off in shifted)
        grid = [lo + i * step for i in range(int((hi - lo) / step) + 1)] + [hi]
        # Each measured curve read as it is used (EfficiencyCurve.at: log-linear, flat outside its range).
        ys = list(
            monotone_time(grid, [statistics.median(c.at(10.0 ** (g + off)) for c, off in shifted) for g in grid], 10.0)
        )
        xs_out: list[float] = []
        ys_out: list[float] = []
        for g, y in zip(grid, ys, strict=True):
            if not xs_out or g > xs_out[-1] + 1e-9:
                xs_out.append(round(g, 4))
                ys_out.append(sig(y))
        compute.append(
            EfficiencyCurve(
                op=kind,
                precision="any",
                log10_size=tuple(xs_out),
                efficiency=tuple(ys_out),
                axis="ideal_seconds",
                samples=sum(c.samples for c, _ in shifted),
                source="median of " + ", ".join(sources),
            )
        )
    bands: list[BandwidthCurve] = []
    groups: dict[tuple[str, int], list[tuple[BandwidthCurve, float, str]]] = defaultdict(list)
    for table, _, nvlink in measured:
        for band in table.collectives:
            if band.scope == "domain":
                groups[(band.collective, band.ranks)].append((band, nvlink, table.name))
    for (collective, ranks), items in sorted(groups.items()):
        lo = min(c.log2_bytes[0] for c, _, _ in items)
        hi = max(c.log2_bytes[-1] for c, _, _ in items)
        # Half-octave steps, and the largest message measured (the steps alone stopped short of it: a send/recv
        # curve measured to 57 MB ended at 41 MB).
        grid = [lo + i * 0.5 for i in range(int((hi - lo) / 0.5) + 1)]
        if hi > grid[-1] + 1e-9:
            grid.append(hi)
        fractions = monotone_time(
            grid,
            [statistics.median(c.at(2.0**g) / bw for c, bw, _ in items) for g in grid],
            2.0,
        )
        # Stated on a fabric of the sources' median NVLink bandwidth, so that a curve is seconds on a real fabric:
        # another cluster scales its bandwidth part, while its small messages keep the latency they were measured
        # with (CommModel._domain_time; NVLink latency does not follow link bandwidth).
        reference = statistics.median(bw for _, bw, _ in items)
        bands.append(
            BandwidthCurve(
                collective=collective,
                scope="domain",
                ranks=ranks,
                log2_bytes=tuple(round(g, 4) for g in grid),
                busbw_bytes_per_s=tuple(sig(f * reference / GB) * GB for f in fractions),
                samples=sum(c.samples for c, _, _ in items),
                source=f"median fraction of NVLink bandwidth of {', '.join(sorted({name for _, _, name in items}))}, "
                f"at their median NVLink bandwidth",
                reference_bandwidth_bytes_per_s=reference,
            )
        )
    return CalibrationTable(
        name=name,
        device="any",
        compute=tuple(compute),
        collectives=tuple(bands),
        source="derived from the measured tables by clustersim.calibration.fit.default_table",
    )
