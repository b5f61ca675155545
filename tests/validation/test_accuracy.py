"""Accuracy against the measured runs shipped in data/validation (issue 4).

Two kinds of assertion, on purpose:

* ``ISSUE_TARGET``: the figures issue 4 asks for. Where the simulator does not reach them yet the test is an
  ``xfail(strict=True)``: it fails loudly the day the target is met (XPASS), so the marker is removed then.
* ``GUARD``: the figures the current model reaches (analysis/ACCURACY.md), with a small margin. They keep a
  change that makes predictions worse from landing unnoticed; tighten them whenever accuracy improves.

Nothing here feeds back into the model: the measured step times are only compared with.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.validate import ValidationReport, validate_file

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "validation"

# issue 4, "Must show"
ISSUE_TARGET = {
    "published_runs.csv": {"median_abs_error": 0.07, "p90_abs_error": 0.15},
    "vtrain_single_node.csv": {"median_abs_error": 0.12},
}
# What the model reaches today (analysis/ACCURACY.md), plus about half a point of margin. vTrain's median went
# from 14.9% to 15.2% (and its Spearman from 0.833 to 0.867) when the tied-embedding all-reduce of single-node
# pipelines stopped being timed over the network (layout.place's offsets): a correction, not a regression.
# Published p90 went from 23.0% to 21.0% when llm-foundry's 2023 runs took FlashAttention-2's measured H100 curve,
# and to 20.8% with cuDNN attention for NeMo and measured causal-mask attention curves; the median from 8.9% to
# 8.7% when the 2021 and DeepSpeed stacks paid their unfused gradient accumulation; to 7.1% (p90 20.5%, vTrain
# 14.8%) with the streaming memory roof, Megatron's optimizer traffic, the Hopper FP8/BF16 GEMM ratio and the
# softmax timed as a row reduction; to 4.8% (p90 16.3%) when the free-recompute search learned Megatron's block
# method (recompute only the first N layers of each chunk), which MegaScale's baseline needs to fit without
# recomputing every layer.
# Then to 4.2% (p90 15.1%) with Transformer Engine's context-parallel copies and Meta's all-gather CP exchange.
# Then up to 4.8% (p90 17.2%), corrections that cost accuracy: pipeline hops inside a node went over NVLink (p90
# 15.4%), and the free-vp search stopped leaving out the depths the layout accepts (pp·vp up to layers + 2), so
# Llama 3 405B's rows take vp 8 and Megatron's interleaved schedule runs them faster than Meta's runs went.
# Then to 5.4% (p90 17.4%) when FP8's cast kernel stopped taking the dgrad GEMM's place beside the input
# all-gather (TE and Megatron overlap the two) and userbuffers pipelined the reduce-scatter with its GEMM.
# vTrain went from 14.7% (p90 35.7%, Spearman 0.870) to 22.3% (p90 58.8%, Spearman 0.628) when the kernel fit
# stopped overstating mid-size kernels: its monotone-time cap compounded over launch-bound stretches and made
# GEMMs of 1e8-1e9 FLOPs and small norms 1.6-3x slower than their own measurements (held-out kernel p90 on H100
# norm 178% -> 19%, GEMM 79% -> 31%). That slowness had stood in for the host cost these rows are bound by.
# Then p90 61.0%, Spearman 0.568, when the fit's monotone-time rule became an isotonic least-squares fit (a
# review found the cap it replaced held a slow bin's time over every later bin: GEMMs of 3e8-3e9 FLOPs came out
# 24-56% slower than the rows they were fitted to, now 3-8%); small kernels got faster again, as measured.
# Published p90 15.1% -> 13.6% (median 4.65% -> 4.68%) when NeMo 24.07's 512-GPU GPT-3 175B row took its own
# recipe (175b_mlperf.yaml: bf16 gradients, FP8 weights, TP overlap, no recomputation) instead of the generic
# NeMo entry, under which it did not fit without recomputing (+16.3% -> -9.3%). Then median 5.6%, p90 13.9%, when
# five more NeMo rows took their H100 FP8 launch scripts' bf16 gradients (and Llama 3 70B its recipe's TP overlap):
# Llama 3 8B fits without the recomputation its recipe does not run (+4.7% -> -13.5%), Llama 3 70B -2.3% -> -10.4%.
GUARD = {
    "published_runs.csv": {"median_abs_error": 0.061, "p90_abs_error": 0.144},
    "vtrain_single_node.csv": {"median_abs_error": 0.228, "p90_abs_error": 0.615},
}
GUARD_SPEARMAN = 0.55
SPEARMAN_TARGET = 0.8  # vtrain_single_node.csv, mean within-group rank correlation (issue 4)


@pytest.fixture(scope="module")
def published() -> ValidationReport:
    return validate_file(DATA / "published_runs.csv")


@pytest.fixture(scope="module")
def vtrain() -> ValidationReport:
    return validate_file(DATA / "vtrain_single_node.csv")


def test_every_published_run_is_predicted_feasible(published: ValidationReport) -> None:
    """A run that really ran and is predicted infeasible is a miss: there must be none."""
    assert published.summary["rows"] == 55
    assert published.summary["infeasible"] == 0, [r["reason"] for r in published.rows if not r["feasible"]]


@pytest.mark.parametrize("figure", ["median_abs_error", "p90_abs_error"])
def test_published_runs_do_not_regress(published: ValidationReport, figure: str) -> None:
    assert published.summary[figure] <= GUARD["published_runs.csv"][figure]


def test_published_runs_meet_the_median_target(published: ValidationReport) -> None:
    assert published.summary["median_abs_error"] <= ISSUE_TARGET["published_runs.csv"]["median_abs_error"]


def test_published_runs_meet_the_p90_target(published: ValidationReport) -> None:
    assert published.summary["p90_abs_error"] <= ISSUE_TARGET["published_runs.csv"]["p90_abs_error"]


def test_vtrain_rows_are_all_predicted(vtrain: ValidationReport) -> None:
    assert vtrain.summary["rows"] == 1440
    assert vtrain.summary["infeasible"] == 0


def test_vtrain_groups_are_ranked(vtrain: ValidationReport) -> None:
    """The ranking figure covers the file's layout groups, and ranks better than chance by a margin."""
    assert vtrain.summary["spearman_groups"] >= 100
    assert vtrain.summary["mean_spearman"] >= GUARD_SPEARMAN


@pytest.mark.xfail(
    strict=True,
    reason="issue 4 target (Spearman >= 0.8) not met since the kernel fit reproduces its measurements "
    "(0.870 -> 0.628 -> 0.568): the vTrain rows are host-bound and host cost is not modelled; see analysis/ACCURACY.md",
)
def test_vtrain_ranks_layouts(vtrain: ValidationReport) -> None:
    """What a planner needs: layouts of one job ranked like the measurements (issue 4: Spearman >= 0.8)."""
    assert vtrain.summary["mean_spearman"] >= SPEARMAN_TARGET


@pytest.mark.parametrize("figure", ["median_abs_error", "p90_abs_error"])
def test_vtrain_does_not_regress(vtrain: ValidationReport, figure: str) -> None:
    assert vtrain.summary[figure] <= GUARD["vtrain_single_node.csv"][figure]


@pytest.mark.xfail(strict=True, reason="issue 4 target not reached yet; see analysis/ACCURACY.md")
def test_vtrain_meets_the_issue_target(vtrain: ValidationReport) -> None:
    assert vtrain.summary["median_abs_error"] <= ISSUE_TARGET["vtrain_single_node.csv"]["median_abs_error"]


@pytest.fixture(scope="module")
def held_out() -> ValidationReport:
    return validate_file(DATA / "megatron_bridge_runs.csv")


def test_held_out_runs_are_all_predicted(held_out: ValidationReport) -> None:
    """Megatron-Bridge's tables (not an issue-4 target): MoE parallel folding (ep 32 over tp 2 · dp 16) and
    128 virtual stages for 126 layers really ran, so neither may be judged infeasible."""
    assert held_out.summary["rows"] == 26
    assert held_out.summary["infeasible"] == 0, [r["reason"] for r in held_out.rows if not r["feasible"]]


def test_held_out_dense_h100_rows_stay_close(held_out: ValidationReport) -> None:
    """The calibrated part of the held-out file: dense Llama 3 on H100 with current software, within 10% today
    (analysis/ACCURACY.md: −7.4% to +3.2%; −9.6% to +1.2% before the FP8 speed-up was read by GEMM size; it
    was −2.9% to +5.8% before the FP8 cast stopped delaying the dgrad
    GEMM behind the input all-gather and userbuffers overlapped the reduce-scatters, and −9.1% to +1.3% before
    pipeline stages launched their gradient reduction as Megatron-Core does)."""
    rows = [r for r in held_out.rows if r["cluster"] == "dgx-h100" and str(r["model"]).startswith("LLAMA")]
    assert len(rows) == 5
    assert max(abs(r["error"]) for r in rows) <= 0.10


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def test_report_and_readme_quote_the_current_figures(published: ValidationReport, vtrain: ValidationReport) -> None:
    """analysis/ACCURACY.md and the README's "How accurate is it?" quote what `validate` computes now: after a
    change that moves them, regenerate the report (analysis/accuracy/build_report.py) and edit the README."""
    report = (ROOT / "analysis" / "ACCURACY.md").read_text(encoding="utf-8")
    for name, rep in (("published_runs.csv", published), ("vtrain_single_node.csv", vtrain)):
        line = next(x for x in report.splitlines() if x.startswith(f"| `{name}` |"))
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # file | rows | predicted | infeasible | adjusted | median | mean | p90 | max | signed mean | Spearman
        s = rep.summary
        assert cells[5:8] == [_pct(s["median_abs_error"]), _pct(s["mean_abs_error"]), _pct(s["p90_abs_error"])], name
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    p, v = published.summary, vtrain.summary
    assert f"published runs median |error| {_pct(p['median_abs_error'])}, p90 {_pct(p['p90_abs_error'])}" in readme
    assert f"vTrain median {_pct(v['median_abs_error'])}" in readme
    assert f"rank correlation of {v['mean_spearman']:.3f}" in readme
