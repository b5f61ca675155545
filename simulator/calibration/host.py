"""Profiles of the machine at hand: a device, a cluster and a calibration table from our own measurements.

The device's peak is the highest 16-bit GEMM throughput the profile measured (the ``probe.peak_gemm`` square
GEMM or any larger one), its FP8 peak the highest FP8 one where the profile timed FP8 GEMMs, and its memory
bandwidth the highest memory throughput of any memory-bound kernel or copy probe. All are *measured* figures,
with date and host as their source, so efficiencies are at most one by construction. On a CPU this bandwidth
is the best cache/DRAM rate the kernels reached, which is what the simulator's bandwidth floor for small
kernels needs; capacity is the host's RAM shared by its ranks.

On a CPU, one simulated "device" is one rank: a process with ``threads`` intra-op threads. The host is a
one-node cluster of ``ranks`` such devices whose "NVLink domain" is shared memory: its bandwidth is the
largest all-reduce bus bandwidth gloo reached between local processes (or, without collective rows, the
memory bandwidth). There is no network; NIC figures are placeholders that no single-node plan uses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from simulator.calibration.rows import Measurement
from simulator.cost.communication import bus_factor
from simulator.errors import CalibrationError
from simulator.specs.calibration import CalibrationTable
from simulator.specs.hardware import ClusterSpec, DeviceSpec
from simulator.units import GB, GBIT, GIB, TFLOP, sig

__all__ = ["host_cluster", "host_device", "write_yaml"]


def host_device(
    rows: Sequence[Measurement],
    *,
    name: str,
    ram_bytes: float | None = None,
    ranks: int = 1,
    device_bytes: float | None = None,
) -> DeviceSpec:
    """A device profile from measured rows (module docstring); ``device_bytes``, the GPU's own memory where the
    profile recorded it, is its capacity instead of the host's RAM shared by ``ranks``.

    Raises
    ------
    CalibrationError
        When the rows hold no GEMM or no memory-bound measurement.
    """
    gemm = _best([r for r in rows if r.kind == "gemm" and r.flops > 0 and r.precision != "fp8"], "GEMM")
    gemm8 = _best([r for r in rows if r.kind == "gemm" and r.flops > 0 and r.precision == "fp8"], "FP8 GEMM")
    memory = _best([r for r in rows if r.kind == "memory" and r.bytes > 0], "memory-bound")
    if not gemm or not memory:
        raise CalibrationError(
            f"device {name}: the rows need GEMM and memory-bound measurements to derive a peak and a bandwidth; "
            "profile with the device probes, or pass --device with a device profile"
        )
    ram = ram_bytes if ram_bytes is not None else _ram_bytes()
    capacity = device_bytes if device_bytes is not None else ram / max(ranks, 1)
    capacity_source = "the GPU's memory as CUDA reports it" if device_bytes is not None else f"RAM / {ranks} ranks"
    first = next((r for r in rows if r.device), rows[0])
    peak = max(gemm)
    return DeviceSpec(
        name=name,
        vendor=first.device,
        peak_flops=(("bf16", sig(peak / TFLOP) * TFLOP),)
        + ((("fp8", sig(max(gemm8) / TFLOP) * TFLOP),) if gemm8 else ()),
        hbm_bytes=sig(capacity / GIB, 3) * GIB,
        hbm_bandwidth_bytes_per_s=sig(max(memory) / GB) * GB,
        source=(
            f"measured by clustersim calibrate on host {first.host or 'unknown'} on {first.date or 'unknown date'} "
            f"(torch {first.torch_version}): peak = best bf16 (and FP8) GEMM throughput, bandwidth = best "
            f"memory-kernel throughput of the profile; capacity = {capacity_source}"
        ),
    )


# How far a GEMM of the profile may outrun the device's peak probe (a large square GEMM) before it is taken for a
# timing glitch. The probe is sized to reach the peak, yet a model shape may beat it by some percent (the peak is
# the best GEMM of the whole profile, profile.probe_shapes); twice the probe is no kernel, and it would set the
# derived peak and shrink every efficiency of the table by as much. Memory rows are not checked: a small op that
# stays in the first-level cache can outrun every copy probe by more than that.
_OUTLIER_RATIO = 2.0


def _rate(r: Measurement) -> float:
    """FLOP/s of a GEMM, bytes/s of any other row."""
    return (r.flops if r.kind == "gemm" else r.bytes) / r.time_s


def _best(rows: Sequence[Measurement], what: str) -> list[float]:
    """The throughputs of ``rows``. For GEMMs profiled with a peak probe, a CalibrationError names a row faster than
    :data:`_OUTLIER_RATIO` times the fastest probe; without probes nothing marks the peak, and the fastest row is
    taken as it."""
    probes = [_rate(r) for r in rows if r.kind == "gemm" and r.op.startswith("probe.")]
    if probes:
        ceiling = _OUTLIER_RATIO * max(probes)
        for r in rows:
            if _rate(r) > ceiling:
                raise CalibrationError(
                    f"{what} row {r.op!r} ({r.source or 'unnamed source'}, time {r.time_s:.3g} s) runs at "
                    f"{_rate(r) / TFLOP:.4g} TFLOP/s, more than {_OUTLIER_RATIO:g}x the device's peak probe "
                    f"({max(probes) / TFLOP:.4g} TFLOP/s): a timing glitch would set the derived device's peak and "
                    "shrink every efficiency of the table; remove the row or profile again"
                )
    return [_rate(r) for r in rows]


def _ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * GIB


def host_cluster(
    device: DeviceSpec, table: CalibrationTable | None, rows: Sequence[Measurement], *, name: str, ranks: int
) -> ClusterSpec:
    """A one-node cluster of ``ranks`` devices joined by shared memory (module docstring)."""
    busbw = [
        r.bytes / r.time_s * bus_factor("all_reduce", r.ranks)
        for r in rows
        if r.kind == "collective" and r.op == "all_reduce" and r.ranks >= 2
    ]
    link = max(busbw) if busbw else device.hbm_bandwidth_bytes_per_s
    return ClusterSpec(
        name=name,
        device=device,
        gpus_per_node=ranks,
        nvlink_bandwidth_bytes_per_s=sig(link / GB) * GB,
        nics_per_node=1,
        nic_bandwidth_bytes_per_s=1.0 * GBIT,
        intra_node_latency_s=0.0,
        calibration=table,
        max_gpus=ranks,
        description="this machine: one rank per simulated device, shared memory between ranks, no network",
        source=device.source,
    )


def device_mapping(d: DeviceSpec) -> dict[str, Any]:
    """The YAML form of a measured device."""
    return {
        "name": d.name,
        "vendor": d.vendor,
        "peak_tflops_bf16": sig(d.peak("bf16") / TFLOP),
        **({"peak_tflops_fp8": sig(d.peak("fp8") / TFLOP)} if "fp8" in dict(d.peak_flops) else {}),
        "hbm_gib": sig(d.hbm_bytes / GIB, 3),
        "hbm_bandwidth_gb_per_s": sig(d.hbm_bandwidth_bytes_per_s / GB),
        "source": d.source,
    }


def cluster_mapping(c: ClusterSpec, *, device_ref: str, calibration_ref: str | None) -> dict[str, Any]:
    """The YAML form of a host cluster; device and table are referenced by (relative) path."""
    out: dict[str, Any] = {
        "name": c.name,
        "description": c.description,
        "device": device_ref,
        "gpus_per_node": c.gpus_per_node,
        "nvlink_bandwidth_gb_per_s": sig(c.nvlink_bandwidth_bytes_per_s / GB),
        "nics_per_node": c.nics_per_node,
        "nic_bandwidth_gbit_per_s": 1,
        "intra_node_latency_us": 0,
        "max_gpus": c.max_gpus,
        "source": c.source + "; link = best gloo/NCCL all-reduce bus bandwidth between local processes",
    }
    if calibration_ref:
        out["calibration"] = calibration_ref
    return out


def write_yaml(data: dict[str, Any], path: Path, header: str = "") -> None:
    """Write a mapping as YAML (insertion order, no exponent notation thanks to rounded numbers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120)
    path.write_text((f"# {header}\n" if header else "") + text, encoding="utf-8")
