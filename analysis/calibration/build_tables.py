"""Rebuild the calibration tables shipped in hardware_profiles/calibration/ from data/calibration/.

    python analysis/calibration/build_tables.py

Imports the public measurements (Vidur's A100 and H100 kernel and NCCL profiles, vTrain's A100 nccl-tests
tables), fits one table per device, derives the device-independent default table, writes them as YAML and
writes analysis/calibration/RESIDUALS.md (held-out prediction error of each curve). Tables of our own profiles
(``clustersim calibrate profile`` folders under data/calibration/<gpu>/, OWN_TABLES) are fitted the way
``clustersim calibrate fit --device`` fits them. The default table stays derived from the public A100 and H100
tables alone: a device measured later would otherwise move every uncalibrated device's curves, and the curves
the A100 table lacks, in the same change. Deterministic: a second run writes the same bytes.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from simulator.calibration.fit import default_table, fit_table, residual_report  # noqa: E402
from simulator.calibration.importers.nccl_tests import import_vtrain_table  # noqa: E402
from simulator.calibration.importers.vidur import DEVICES, import_vidur_compute, import_vidur_network  # noqa: E402
from simulator.calibration.rows import Measurement, read_rows  # noqa: E402
from simulator.calibration.workflow import fit_files, summarize_errors  # noqa: E402
from simulator.specs.calibration import CalibrationTable  # noqa: E402
from simulator.specs.library import load_cluster, load_device  # noqa: E402

DATA = ROOT / "data" / "calibration"
OUT = ROOT / "hardware_profiles" / "calibration"

TABLES = {
    # table name: (device, cluster whose NVLink the collectives ran on, vidur gpu folder, vidur node folder, vtrain?)
    "a100-sxm4-80gb": ("A100-SXM4-80GB", "dgx-a100-80g", "a100", "a100_dgx", True),
    "h100-sxm5-80gb": ("H100-SXM5-80GB", "dgx-h100", "h100", "h100_dgx", False),
}

OWN_TABLES = {
    # table name: (datasheet device the efficiencies are relative to, folder under data/calibration/, what it is)
    "h200-sxm-141gb": (
        "H200-SXM-141GB",
        "h200",
        "one NVIDIA H200 SXM (700 W) lent to the project, profiled by clustersim calibrate on 2026-11-28",
    ),
}


def own_table(name: str) -> tuple[CalibrationTable, dict[str, dict[str, float]]]:
    """A table fitted from our own profile folders (every subfolder of data/calibration/<folder>/), relative to
    the datasheet device, with its held-out residuals."""
    device_name, folder, what = OWN_TABLES[name]
    folders = sorted(p for p in (DATA / folder).iterdir() if p.is_dir())
    result = fit_files(folders, name=name, device=load_device(device_name))
    provenance = (
        *result.table.provenance,
        ("data", f"data/calibration/{folder}/ ({', '.join(p.name for p in folders)}): {what}"),
        ("method", f"data/calibration/{folder}/README.md"),
        ("builder", "analysis/calibration/build_tables.py"),
    )
    source = f"fitted from clustersim calibrate profile measurements on {device_name} (see provenance)"
    table = replace(result.table, source=source, provenance=provenance)
    return table, summarize_errors(result.residuals)


def published_rows(device: str) -> list[Measurement]:
    """Kernel throughputs published as numbers (data/calibration/published/) for one device."""
    return [r for r in read_rows([DATA / "published"]) if r.device == device]


def rows_for(gpu: str, node: str, vtrain: bool) -> list[Measurement]:
    """The profiled rows (Vidur, vTrain) of one device; published numbers come from published_rows."""
    rows: list[Measurement] = []
    for path in sorted((DATA / "vidur" / "compute" / gpu).glob("*/mlp.csv")):
        rows += import_vidur_compute(path)
    for path in sorted((DATA / "vidur" / "network" / node).glob("*.csv")):
        rows += import_vidur_network(path)
    if vtrain:
        for path in sorted((DATA / "vtrain").glob("a100_all_reduce_*gpu.txt")):
            rows += import_vtrain_table(path)
    return rows


def merged(profiled: CalibrationTable, published: CalibrationTable) -> CalibrationTable:
    """``profiled`` with the curves fitted from published numbers added (their classes must be new to it)."""
    clash = {(c.op, c.precision) for c in profiled.compute} & {(c.op, c.precision) for c in published.compute}
    if clash:
        raise SystemExit(f"curves fitted from both profiled and published rows: {sorted(clash)}")
    return replace(profiled, compute=tuple(sorted((*profiled.compute, *published.compute), key=lambda c: c.op)))


def build() -> tuple[dict[str, CalibrationTable], dict[str, dict[str, dict[str, float]]]]:
    tables: dict[str, CalibrationTable] = {}
    residuals: dict[str, dict[str, dict[str, float]]] = {}
    measured = []
    for name, (device_name, cluster_name, gpu, node, vtrain) in TABLES.items():
        device = load_device(device_name)
        profiled = rows_for(gpu, node, vtrain)
        published = published_rows(DEVICES[gpu])
        rows = profiled + published
        files = sorted({r.source for r in rows})
        provenance = (
            (
                "data",
                "data/calibration/: vidur/ and vtrain/ copied from the public repositories below (MIT licence, LICENSE"
                " files kept); published/ holds kernel throughputs transcribed from papers and pull requests",
            ),
            ("vidur", "microsoft/vidur data/profiling/ (fp16 kernels and NCCL, times in ms)"),
            (
                "vtrain",
                "VIA-Research/vTrain trace/a100/ (nccl-tests all-reduce, times in ns)" if vtrain else "not used",
            ),
            ("published", "data/calibration/published/ (attention kernel throughputs published as numbers)"),
            ("files", f"{len(files)} files, {len(rows)} rows"),
            (
                "nvlink",
                f"measured_nvlink_bandwidth_gb_per_s: the fabric the collectives ran on, as "
                f"hardware_profiles/clusters/{cluster_name}.yaml states it (datasheet)",
            ),
            ("builder", "analysis/calibration/build_tables.py"),
        )
        source = f"fitted from public kernel and NCCL measurements on {device_name} (see provenance)"
        table = fit_table(profiled, device, name=name, source=source, provenance=provenance)
        # A published number is already an aggregate over many runs (a paper's bar, a benchmark's table cell), so
        # every one is kept (min_bin_rows=1) instead of being dropped as a sparse bin beside better-populated ones.
        table = merged(table, fit_table(published, device, name=name, min_bin_rows=1))
        # The NVLink rate of the system the collectives were measured on (the cluster file cites its datasheet),
        # so that any cluster using the table scales its in-domain curves by its own rate over this one.
        nvlink = load_cluster(cluster_name).nvlink_bandwidth_bytes_per_s
        table = replace(table, measured_nvlink_bandwidth_bytes_per_s=nvlink)
        tables[name] = table
        # Held out the way each part is fitted: profiled rows with the sparse-bin rule, published ones without.
        parts = {**residual_report(profiled, device), **residual_report(published, device, min_bin_rows=1)}
        residuals[name] = dict(sorted(parts.items()))
        measured.append((table, device, nvlink))
    tables["default"] = default_table(measured)
    for name in OWN_TABLES:
        tables[name], residuals[name] = own_table(name)
    return tables, residuals


def render() -> dict[Path, str]:
    """The text of every file the build writes, by path: the tables and RESIDUALS.md."""
    tables, residuals = build()
    header = (
        "# Generated by analysis/calibration/build_tables.py from data/calibration/; do not edit by hand.\n"
        "# Kernel and collective measurements only: no training step times were used.\n"
    )
    files = {
        OUT / f"{name}.yaml": header + yaml.safe_dump(table.to_mapping(), sort_keys=False, width=120)
        for name, table in tables.items()
    }
    lines = [
        "# Calibration residuals",
        "",
        "Held-out check of the shipped tables: every fifth measurement is left out, the table is fitted on the",
        "rest, and the held-out kernels and collectives are predicted. Regenerate with",
        "`python analysis/calibration/build_tables.py`.",
        "",
        "| table | curve | held-out rows | median abs error | p90 abs error |",
        "|---|---|---:|---:|---:|",
    ]
    for name, report in residuals.items():
        for curve, stats in report.items():
            lines.append(
                f"| {name} | {curve} | {int(stats['n'])} | {stats['median_abs_error'] * 100:.1f}% "
                f"| {stats['p90_abs_error'] * 100:.1f}% |"
            )
    files[ROOT / "analysis" / "calibration" / "RESIDUALS.md"] = "\n".join(lines) + "\n"
    return files


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    files = render()
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(files) - 1} tables to {OUT}")


if __name__ == "__main__":
    main()
