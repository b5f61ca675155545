"""Regenerate ``analysis/ACCURACY.md``: the simulator's error against real, measured training steps.

Runs ``clustersim validate`` (the public :func:`simulator.validate.validate_file`) on every validation file
given (default: the three shipped in ``data/validation/``), and writes

* ``analysis/ACCURACY.md``: the summary per file (median, mean, p90, max |error|, infeasible rows, mean
  within-group Spearman), the breakdown by cluster and by source, the per-row table, and the notes of
  ``analysis/accuracy/NOTES.md`` (why families of rows are off, as far as we can tell);
* ``analysis/accuracy/scatter.png``: predicted vs measured step time, log-log, one colour per file, with the
  ±15% band (needs matplotlib: ``pip install 'clustersim[plot]'``; skipped with a message otherwise).

Usage::

    python analysis/accuracy/build_report.py [CSV ...] [--out analysis/ACCURACY.md]

Nothing here fits anything: the measured step times are only compared with.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from simulator.units import fmt_knob
from simulator.validate import ValidationReport, stack_overrides, stated_text, validate_file

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_FILES = (
    ROOT / "data" / "validation" / "published_runs.csv",
    ROOT / "data" / "validation" / "vtrain_single_node.csv",
    ROOT / "data" / "validation" / "megatron_bridge_runs.csv",
)
NOTES = Path(__file__).with_name("NOTES.md")
BAND = 0.15  # the ±15% band drawn on the scatter plot (issue 4's p90 target on published runs)


def _pct(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:.1f}%"


def _num(x: Any, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summary_table(reports: list[tuple[str, ValidationReport]]) -> list[str]:
    """One Markdown row per validation file."""
    lines = [
        "| file | rows | predicted | infeasible | adjusted | median | mean | p90 | max | signed mean "
        "| Spearman (groups) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rep in reports:
        s = rep.summary
        lines.append(
            f"| `{name}` | {s['rows']} | {s['predicted']} | {s['infeasible']} | {s['adjusted']} | "
            f"{_pct(s.get('median_abs_error'))} | {_pct(s.get('mean_abs_error'))} | {_pct(s.get('p90_abs_error'))} | "
            f"{_pct(s.get('max_abs_error'))} | {_pct(s.get('mean_signed_error'))} | "
            f"{_num(s.get('mean_spearman'))} ({s['spearman_groups']}) |"
        )
    return lines


def breakdown(rep: ValidationReport, key: str) -> list[str]:
    """Markdown table of the summary broken down by ``cluster`` or ``source``."""
    lines = [f"| {key} | rows | median | p90 | signed mean | infeasible |", "|---|---:|---:|---:|---:|---:|"]
    for name, st in rep.summary[f"by_{key}"].items():
        lines.append(
            f"| {name} | {st['rows']} | {_pct(st.get('median_abs_error'))} | {_pct(st.get('p90_abs_error'))} | "
            f"{_pct(st.get('mean_signed_error'))} | {st['infeasible']} |"
        )
    return lines


def row_table(rep: ValidationReport) -> list[str]:
    """Markdown table with one line per validation row."""
    lines = [
        "| run_id | model | cluster | GPUs | measured s | predicted s | error | chosen / adjusted / stack |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rep.rows:
        pred = r["predicted_step_time_s"]
        parts = [", ".join(f"{k}={fmt_knob(v)}" for k, v in r["chosen"].items())]
        if r.get("adjusted"):
            parts.append("adjusted " + ", ".join(f"{k} {stated_text(a)}→{b}" for k, (a, b) in r["adjusted"].items()))
        if r.get("stack"):
            parts.append(f"stack: {r['stack']}")
            overridden = stack_overrides(r)
            if overridden:
                parts[-1] += " (overrides " + ", ".join(f"{k} {a}→{b}" for k, (a, b) in overridden.items()) + ")"
        notes = "; ".join(p for p in parts if p)
        if not r["feasible"]:
            notes = f"infeasible: {r['reason']}"
        lines.append(
            f"| {r['run_id']} | {r['model']} | {r['cluster']} | {r['num_gpus']} | {r['measured_step_time_s']:.4g} | "
            f"{'' if math.isnan(pred) else f'{pred:.4g}'} | {_pct(r['error']) if r['feasible'] else 'miss'} | "
            f"{notes.replace('|', '/')} |"
        )
    return lines


def scatter(reports: list[tuple[str, ValidationReport]], path: Path) -> bool:
    """Write the predicted-vs-measured plot; False when matplotlib is missing."""
    try:
        import matplotlib  # optional extra ('plot'), imported only here

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 6.0), dpi=120)
    lo, hi = math.inf, 0.0
    for (name, rep), marker in zip(reports, ("o", "s", "^", "D", "v"), strict=False):
        pts = [(r["measured_step_time_s"], r["predicted_step_time_s"]) for r in rep.rows if r["feasible"]]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        ax.scatter(xs, ys, s=10 if len(pts) > 200 else 22, marker=marker, alpha=0.6, label=f"{name} ({len(pts)})")
    lo, hi = lo / 1.5, hi * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between([lo, hi], [lo * (1 - BAND), hi * (1 - BAND)], [lo * (1 + BAND), hi * (1 + BAND)], alpha=0.12)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"clustersim vs measured training steps (band ±{BAND:.0%})")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    # A fixed creation date in the metadata keeps the file byte-identical for identical inputs.
    fig.savefig(path, metadata={"Software": "clustersim analysis/accuracy/build_report.py"})
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Build the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, default=list(DEFAULT_FILES))
    parser.add_argument("--out", type=Path, default=ROOT / "analysis" / "ACCURACY.md")
    args = parser.parse_args(argv)
    reports = [(f.name, validate_file(f)) for f in args.files]
    png = args.out.parent / "accuracy" / "scatter.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plotted = scatter(reports, png)
    out = [
        "# Accuracy against measured training runs",
        "",
        "Generated by `python analysis/accuracy/build_report.py`; do not edit by hand. Every prediction is made",
        "from kernel- and collective-level calibration and datasheets; the measured step times below are only",
        "compared with, never fitted. |error| is |predicted − measured| / measured; a row that really ran but is",
        "predicted infeasible is a miss, counted under *infeasible* (it has no predicted time, so the |error|",
        "figures leave it out). Spearman is the mean rank correlation of predicted vs measured step time inside",
        "groups of rows sharing model, cluster, GPU count and global batch, and source and precision (layout",
        "ranking: one layout measured on two software releases is not a choice of layout). A row whose",
        "`software_stacks.yaml` entry overrides a stated knob says so in its notes.",
        "",
        "## Summary",
        "",
        *summary_table(reports),
        "",
    ]
    if plotted:
        out += [f"![predicted vs measured]({png.relative_to(args.out.parent).as_posix()})", ""]
    else:
        out += ["(scatter plot skipped: matplotlib is not installed; `pip install 'clustersim[plot]'`)", ""]
    if NOTES.is_file():
        out += [NOTES.read_text(encoding="utf-8").rstrip(), ""]
    for name, rep in reports:
        out += [f"## `{name}`", "", "### By cluster", "", *breakdown(rep, "cluster"), ""]
        out += ["### By source", "", *breakdown(rep, "source"), ""]
        if rep.summary.get("uncalibrated"):
            out += [
                "### Uncalibrated ops",
                "",
                f"{rep.summary['uncalibrated_rows']} of {rep.summary['predicted']} predicted rows timed some ops on "
                "the default curves (no kernel or collective measurement for that class on that hardware) or on a "
                "stand-in (`...:all_reduce_curve`: the hardware's measured all-reduce curve for another NVLink "
                "collective; `all_reduce:domain:nvls_gain`: a measured ring all-reduce sped up by NVLink SHARP's "
                "published gain):",
                "",
                "| op class | rows |",
                "|---|---:|",
                *(f"| `{label}` | {n} |" for label, n in rep.summary["uncalibrated"].items()),
                "",
            ]
        out += ["### Rows", "", *row_table(rep), ""]
    args.out.write_text("\n".join(out), encoding="utf-8")
    print(f"wrote {args.out}" + (f" and {png}" if plotted else ""))
    for name, rep in reports:
        s = rep.summary
        print(
            f"{name}: median {_pct(s.get('median_abs_error'))}, p90 {_pct(s.get('p90_abs_error'))}, "
            f"infeasible {s['infeasible']}, Spearman {_num(s.get('mean_spearman'))}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
