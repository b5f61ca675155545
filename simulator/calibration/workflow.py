"""The calibration loop as functions the CLI composes: fit files, write host profiles, run the whole loop.

:func:`fit_files` reads measurement CSVs (profile folders or importer output), chooses the device the
efficiencies are relative to (a named device profile, or one derived from the rows' own probes), fits the
table and the held-out residual report, and lists shapes a profile folder planned but never measured.
:func:`run_host` is ``clustersim calibrate host``: profile the check configurations' kernels (and the
collectives between local ranks), fit, write ``devices/``, ``calibration/`` and ``clusters/`` YAML files
that ``clustersim simulate --cluster`` accepts, and check the predictions against real training steps.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from simulator.calibration.fit import _peak_precision, fit_table, holdout_errors, unfitted_reason
from simulator.calibration.host import cluster_mapping, device_mapping, host_cluster, host_device, write_yaml
from simulator.calibration.rows import Measurement, read_rows
from simulator.errors import CalibrationError, SpecError
from simulator.specs.calibration import CalibrationTable
from simulator.specs.hardware import DeviceSpec

__all__ = ["FitResult", "HostResult", "fit_files", "own_profile", "run_host", "summarize_errors", "write_table"]


@dataclass(frozen=True, slots=True)
class FitResult:
    """A fitted table with what it was fitted from and how well it predicts held-out rows."""

    table: CalibrationTable
    device: DeviceSpec
    derived_device: bool
    rows: tuple[Measurement, ...]
    residuals: dict[str, list[float]]
    missing: tuple[tuple[str, str, str], ...]  # (folder, shape, reason)
    unfitted: tuple[tuple[str, int], ...] = ()  # (why fit_table left rows out, how many)
    notes: tuple[str, ...] = ()  # what reading, fitting and holding out left out or could not do, and why


def own_profile(rows: Sequence[Measurement]) -> bool:
    """Whether every kernel row comes from our profiler (then each kernel class was timed on its own)."""
    from simulator.calibration.profile import SOURCE

    kernels = [r for r in rows if r.kind != "collective"]
    return bool(kernels) and all(r.source == SOURCE for r in kernels)


def fit_files(
    paths: Sequence[Path],
    *,
    name: str,
    device: DeviceSpec | None = None,
    holdout_every: int = 5,
    ranks: int = 1,
    only_device: Sequence[str] = (),
) -> FitResult:
    """Fit a table from measurement files or folders (module docstring); with ``only_device``, from the rows
    measured on those devices only (one GPU may go by two names: Vidur's rows say H100-SXM5-80GB, a profile
    the name CUDA reports).

    Raises
    ------
    CalibrationError
        No rows, rows of several devices, or no device to divide by.
    """
    from simulator.calibration.profile import missing_shapes

    notes: list[str] = []
    rows = _one_device(read_rows(paths, notes=notes), only_device)
    missing = tuple((str(p), key, why) for p in paths if p.is_dir() for key, why in missing_shapes(p))
    derived = device is None
    if device is None:
        if not own_profile(rows) and not any(r.op.startswith("probe.") for r in rows):
            on = sorted({r.device for r in rows if r.device})
            said = f" (the rows say {', '.join(on)})" if on else ""
            raise CalibrationError(
                "without --device the device is derived from a profile of our own (its fastest GEMM and copy), and "
                f"these rows are not one: they were imported{said}; --device must name the device the rows "
                f"were measured on, e.g. --device {_device_suggestion(on)}"
            )
        from simulator.calibration.profile import device_memory

        # The GPU's memory where a profile folder recorded it (CUDA), else the host's RAM shared by the ranks.
        folders = [p if p.is_dir() else p.parent for p in paths]  # a profile's kernels.csv: its folder's manifest
        memories = [m for p in folders if (m := device_memory(p)) is not None]
        device = host_device(rows, name=name, ranks=ranks, device_bytes=min(memories) if memories else None)
    _check_peaks(rows, device, derived)
    if not derived:
        _check_measured_on(rows, device)
    options: dict[str, Any] = {"min_bin_rows": 1, "generic_memory": "unclassified"} if own_profile(rows) else {}
    table = fit_table(
        rows, device, name=name, source=_source(rows), provenance=_provenance(rows), notes=notes, **options
    )
    residuals = (
        holdout_errors(rows, device, holdout_every=holdout_every, notes=notes, **options) if holdout_every > 1 else {}
    )
    unfitted = Counter(why for r in rows if (why := unfitted_reason(r)))
    return FitResult(
        table, device, derived, tuple(rows), residuals, missing, tuple(sorted(unfitted.items())), tuple(notes)
    )


def _device_suggestion(names: Sequence[str]) -> str:
    """The built-in device the rows name, for an error's fix (A100-SXM4-80GB where they name none we ship)."""
    from simulator.specs.library import load_device

    for name in names:
        try:
            return load_device(name).name
        except SpecError:
            continue
    return "A100-SXM4-80GB (a built-in name, or a device YAML)"


def _one_device(rows: list[Measurement], only_device: Sequence[str]) -> list[Measurement]:
    """The rows of one device. A table's efficiencies are one device's: rows measured on several (a Vidur folder
    holds A100 and H100 profiles) would average their speeds into a curve neither device has, so that is an
    error unless ``only_device`` picks the names it goes by. Rows that name no device count as the device's own."""
    if only_device:
        kept = [r for r in rows if r.device in only_device or not r.device]
        have = sorted({r.device or "(none)" for r in rows})
        unknown = [d for d in only_device if d not in have]
        if unknown or not kept:
            raise CalibrationError(
                f"--only-device {', '.join(unknown or only_device)}: no row was measured on it (the rows name "
                f"{', '.join(have)}); give one of those"
            )
        return kept
    counts: dict[str, int] = {}
    for r in rows:
        if r.device:
            counts[r.device] = counts.get(r.device, 0) + 1
    if len(counts) > 1:
        listed = ", ".join(f"{d} ({n} rows)" for d, n in sorted(counts.items()))
        raise CalibrationError(
            f"the rows were measured on several devices: {listed}; a table describes one device, so fit each "
            "separately: add --only-device with one of those names (repeat it where one GPU goes by two names), "
            "or give only that device's files"
        )
    return rows


def _check_peaks(rows: Sequence[Measurement], device: DeviceSpec, derived: bool) -> None:
    """Raise a CalibrationError when ``device`` has no peak for the precision of some GEMM or attention rows:
    their efficiencies need the peak of the device they were measured on."""
    by_peak: dict[str, list[Measurement]] = {}
    for r in rows:
        if r.kind in ("gemm", "attention") and not r.op.startswith("probe."):
            by_peak.setdefault(_peak_precision(r.precision), []).append(r)
    for peak, group in sorted(by_peak.items()):
        try:
            device.peak(peak)
        except SpecError:
            pass
        else:
            continue
        first = group[0]
        precisions = ", ".join(sorted({r.precision or "(empty)" for r in group}))
        measured = sorted({r.device for r in group if r.device})
        on = f"; the rows say they were measured on {', '.join(measured)}" if measured else ""
        what = (
            f"{len(group)} GEMM/attention rows at precision {precisions} (e.g. {first.op!r} from "
            f"{first.source or 'an unnamed source'}) need the device's {peak} peak{on}"
        )
        if derived:
            have = ", ".join(p for p, _ in device.peak_flops)
            raise CalibrationError(
                f"{what}, but without --device the efficiencies are relative to a device derived from the rows' "
                f"own GEMMs, which has only a {have} peak; --device must name the device the rows were measured "
                f"on (a built-in device such as H100-SXM5-80GB, or a device YAML with peak_tflops_{peak})"
            )
        raise CalibrationError(
            f"{what}, but device {device.name} has no peak_tflops_{peak}; --device must name the device the rows "
            f"were measured on, and its profile must give peak_tflops_{peak}"
        )


# How far the fastest GEMM of a profile may lie from the named device's datasheet peak before the rows are taken to
# come from another device. Above: datasheet peaks are stated at the boost clock, which no kernel beats beyond
# timing noise (1.15 leaves room for that). Below: a GPU's fastest profiled GEMM reaches tens of percent of its peak
# even for decode-size shapes (Vidur's smallest H100 and A100 GEMMs, data/calibration/vidur), while a CPU reaches a
# thousandth of a GPU's; 2% separates the two with margin on both sides.
_PEAK_CEILING, _PEAK_FLOOR = 1.15, 0.02


def _check_measured_on(rows: Sequence[Measurement], device: DeviceSpec) -> None:
    """Raise a CalibrationError when the rows name another device we ship a profile of, or when their fastest GEMM
    is implausible on ``device`` (faster than its peak, or under 2% of it): they were measured on another device,
    and their efficiencies against this one's peaks would be meaningless (a CPU profile fitted as an H100 table,
    say)."""
    from simulator.specs.library import list_names

    # Rows that name a device we ship a profile of, and not this one, were measured there: an A100's GEMMs fitted as
    # an H100's sit inside the plausible band above (24% of the H100's peak) and made every H100 kernel 3x slow.
    # Names we do not ship (a torch device string, "NVIDIA H100 80GB HBM3") say nothing either way.
    shipped = {name.lower() for name, _ in list_names("device")}
    foreign = sorted(
        {r.device for r in rows if r.device.lower() in shipped and r.device.lower() != device.name.lower()}
    )
    if foreign:
        raise CalibrationError(
            f"the rows say they were measured on {', '.join(foreign)}, not on device {device.name}: --device must "
            f"name the device the rows were measured on (--device {foreign[0]}), or --only-device pick its rows"
        )
    best: dict[str, float] = {}
    for r in rows:
        if r.kind == "gemm" and not r.op.startswith("probe."):  # FLOPs and time positive (rows.check_fittable)
            peak = _peak_precision(r.precision)
            best[peak] = max(best.get(peak, 0.0), r.flops / r.time_s)
    for peak, rate in sorted(best.items()):
        fraction = rate / device.peak(peak)
        if _PEAK_FLOOR <= fraction <= _PEAK_CEILING:
            continue
        measured = sorted({r.device for r in rows if r.device})
        on = f" (the rows say they were measured on {', '.join(measured)})" if measured else ""
        relation = "faster than" if fraction > _PEAK_CEILING else "under 2% of"
        raise CalibrationError(
            f"the rows' fastest {peak} GEMM runs at {rate / 1e12:.3g} TFLOP/s, {relation} device {device.name}'s "
            f"{device.peak(peak) / 1e12:.4g} TFLOP/s peak ({fraction:.1%}){on}: they were measured on another "
            "device; --device must name the device the rows were measured on (or leave it out for a profile of "
            "our own, to derive the device from its probes)"
        )


def _source(rows: Sequence[Measurement]) -> str:
    sources = sorted({r.source for r in rows if r.source})
    text = "fitted by clustersim calibrate fit from " + ("; ".join(sources) or "measurements")
    return text if len(text) < 300 else text[:297] + "..."


def _provenance(rows: Sequence[Measurement]) -> tuple[tuple[str, str], ...]:
    def joined(values: set[str]) -> str:
        return ", ".join(sorted(v for v in values if v)) or "n/a"

    return (
        ("devices", joined({r.device for r in rows})),
        ("hosts", joined({r.host for r in rows})),
        ("dates", joined({r.date for r in rows})),
        ("torch", joined({r.torch_version for r in rows})),
        ("cuda", joined({r.cuda_version for r in rows})),
        ("rows", str(len(rows))),
    )


def summarize_errors(residuals: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per curve and overall (``all kernels``: every compute curve): count, median and p90 of |error|."""
    out: dict[str, dict[str, float]] = {}
    kernels: list[float] = []
    for key, signed in residuals.items():
        errs = sorted(abs(e) for e in signed)
        if ":" not in key or key.split(":")[0].startswith("gemm") or key.startswith("attention"):
            kernels += errs
        out[key] = _stats(errs)
    if kernels:
        out["all kernels"] = _stats(sorted(kernels))
    return out


def _stats(errs: list[float]) -> dict[str, float]:
    return {
        "n": float(len(errs)),
        "median_abs_error": statistics.median(errs),
        "p90_abs_error": errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)],
    }


def write_table(table: CalibrationTable, path: Path, header: str = "") -> None:
    """Write a calibration table as YAML; the same table gives the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(table.to_mapping(), sort_keys=False, width=120)
    path.write_text((f"# {header}\n" if header else "") + text, encoding="utf-8")


def check_ranks(ranks: int, device: str) -> None:
    """Refuse more local ranks than the machine has cores (CPU) or GPUs (CUDA): each is a process of its own (about
    200 MB on a CPU), and 100,000 of them were killed for memory without a word."""
    if device == "cpu":
        most, what = os.cpu_count() or 1, "CPU cores"
    else:
        from simulator.calibration.torchlib import require_torch

        most, what = max(1, int(require_torch().cuda.device_count())), "GPUs"
    if ranks > most:
        raise CalibrationError(
            f"--ranks {ranks}: more than the {most} {what} of this machine (one process per rank); give --ranks "
            f"{most} or fewer"
        )


def _default_ranks(device: str) -> int:
    """Two ranks on a CPU with two or more cores (one DDP check), every GPU (up to 8) on CUDA."""
    if device == "cpu":
        return min(2, os.cpu_count() or 1)
    from simulator.calibration.torchlib import require_torch

    return max(1, min(8, int(require_torch().cuda.device_count())))


@dataclass(frozen=True, slots=True)
class HostResult:
    """What ``calibrate host`` produced."""

    device_yaml: Path
    calibration_yaml: Path
    cluster_yaml: Path
    fit: FitResult
    check: tuple[Any, ...]
    wall_s: float


def run_host(
    out: Path,
    *,
    device: str = "cpu",
    name: str | None = None,
    configs: Sequence[Any] = (),
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    ranks: int | None = None,
    threads: int = 1,
    steps: int = 5,
    warmup: int = 2,
    repeats: int = 3,
    passes: int = 3,
    rounds: int = 2,
    cold_cache: bool = False,
    check: bool = True,
    fp8: bool = False,
    fp8_emulated: bool = False,
    sustain_s: float = 0.0,
    log: Callable[[str], None] | None = None,
) -> HostResult:
    """Profile, fit, write the host's device, calibration and cluster profiles, and check them.

    With ``fp8`` the profile also times the FP8 GEMMs (``profile --fp8``), so the table gets a ``gemm:fp8``
    curve and the device an FP8 peak; the check's real steps stay 16-bit. With ``sustain_s`` it also times the
    peak GEMM under that many seconds of load (``profile --sustain``), which gives ``sustained_gemm_ratio``.
    FP8 needs FP8 tensor cores; ``fp8_emulated`` times PyTorch's emulated FP8 GEMM on a CPU instead
    (:func:`~simulator.calibration.profile.fp8_refusal`).
    """
    from simulator.calibration.check import CPU_CONFIGS, GPU_CONFIGS, run_check
    from simulator.calibration.profile import collective_shapes, model_shapes, probe_shapes, run_profile
    from simulator.specs.library import load_cluster

    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    configs = tuple(configs) or (CPU_CONFIGS if device == "cpu" else GPU_CONFIGS)
    name = name or f"host-{device}"
    if ranks is None:
        ranks = _default_ranks(device)
    if ranks < 1:
        raise CalibrationError(
            f"--ranks must be >= 1 (processes, one per simulated device), got {ranks}; give --ranks 1 or more, or "
            "leave it out for the default (2 CPU processes, or every GPU up to 8)"
        )
    check_ranks(ranks, device)
    configs = tuple(c for c in configs if c.ranks <= ranks)
    shapes: dict[str, Any] = {}
    for cfg in configs:
        mbs = sorted({*micro_batches, cfg.micro_batch})
        for shape in model_shapes(cfg.model(), micro_batches=mbs, fp8=fp8):
            shapes.setdefault(shape.key, shape)
    profile_dir = out / "profile"
    probes = probe_shapes(device, fp8=fp8)
    say(
        f"profiling {len(shapes)} kernel shapes of {len(configs)} configurations and {len(probes)} peak probes "
        f"({len(shapes) + len(probes)} in all) into {profile_dir}"
    )
    report = run_profile(
        [*shapes.values(), *probes],
        profile_dir,
        device=device,
        threads=threads,
        repeats=repeats,
        passes=passes,
        cold_cache=cold_cache,
        collectives=collective_shapes(ranks, device) if ranks > 1 else (),
        sustain_s=sustain_s,
        fp8_emulated=fp8_emulated,
        log=say,
    )
    if report.missing:
        say(f"{len(report.missing)} shapes missing (see {profile_dir / 'failures.csv'}); fitting what was measured")
    fit = fit_files([profile_dir], name=name, ranks=ranks)
    for note in fit.notes:
        say(f"note: {note}")
    device_yaml = out / "devices" / f"{name}.yaml"
    calibration_yaml = out / "calibration" / f"{name}.yaml"
    cluster_yaml = out / "clusters" / f"{name}.yaml"
    write_yaml(device_mapping(fit.device), device_yaml, "measured by clustersim calibrate host")
    write_table(fit.table, calibration_yaml, "fitted by clustersim calibrate host from profile/")
    cluster = host_cluster(fit.device, fit.table, fit.rows, name=name, ranks=ranks)
    write_yaml(
        cluster_mapping(cluster, device_ref=f"../devices/{name}.yaml", calibration_ref=f"../calibration/{name}.yaml"),
        cluster_yaml,
        "this machine, measured by clustersim calibrate host",
    )
    loaded = load_cluster(cluster_yaml)
    rows: tuple[Any, ...] = ()
    if check:
        say(f"checking {len(configs)} configurations against real training steps")
        rows = tuple(
            run_check(configs, loaded, device=device, threads=threads, steps=steps, warmup=warmup, rounds=rounds)
        )
        (out / "check.json").write_text(json.dumps([r.as_dict() for r in rows], indent=1) + "\n", encoding="utf-8")
    return HostResult(device_yaml, calibration_yaml, cluster_yaml, replace(fit), rows, time.perf_counter() - t0)
