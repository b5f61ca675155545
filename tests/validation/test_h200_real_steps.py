"""Real training steps measured on an H200 SXM (data/calibration/h200/), predicted with the shipped hgx-h200.

The calibration loop's own yardstick on a GPU: small GPTs trained for real in PyTorch, their step times measured
on the same kind of GPU whose kernels the table was fitted from (the steps are not in the fit). Issue 5 asked for
a real-step error within 10%; a change to the cost model or the H200 table that moves these steps out of it
shows here.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from simulator.calibration.check import GPU_CONFIGS, CheckConfig, predict_step
from simulator.specs.library import load_cluster

DATA = Path(__file__).resolve().parents[2] / "data" / "calibration" / "h200"


def _check_rows(name: str) -> list[tuple[CheckConfig, float]]:
    data = json.loads((DATA / name).read_text(encoding="utf-8"))
    rows = data["rows"] if isinstance(data, dict) else data
    by_name = {c.name: c for c in GPU_CONFIGS}
    return [(by_name[r["configuration"]["name"]], float(r["measured_s"])) for r in rows]


@pytest.mark.parametrize("name", ["check_steps.json", "verify_check.json", "verify_check_long.json"])
def test_check_steps_on_h200_are_predicted_within_ten_percent(name: str) -> None:
    cluster = load_cluster("hgx-h200")
    errors = [predict_step(cfg, cluster) / measured - 1.0 for cfg, measured in _check_rows(name)]
    assert len(errors) == 4
    assert max(abs(e) for e in errors) <= 0.10, errors
    assert statistics.median(abs(e) for e in errors) <= 0.08, errors


def test_steps_at_the_power_limit_need_the_sustained_ratio() -> None:
    """GEMM-heavy GPTs trained back to back for 40 s each (0.19 and 0.06 s per step) ran at the power limit
    (688-694 W, SM clock 1,515-1,680 MHz at the end): the late steps are predicted within 3% with the table's
    sustained_gemm_ratio (0.835, one GEMM run back to back) and 11-12% too fast without it."""
    cluster = load_cluster("hgx-h200")
    assert cluster.calibration is not None
    assert cluster.calibration.sustained_gemm_ratio == pytest.approx(0.8347)
    table = dataclasses.replace(cluster.calibration, sustained_gemm_ratio=None)
    burst = dataclasses.replace(cluster, calibration=table)
    rows = json.loads((DATA / "sustained_steps.json").read_text(encoding="utf-8"))
    assert len(rows) == 2
    for row in rows:
        cfg = CheckConfig(**row["configuration"])
        late = row["last_quarter_median_s"]
        assert abs(predict_step(cfg, cluster) / late - 1.0) <= 0.03, cfg.name
        assert predict_step(cfg, burst) / late - 1.0 < -0.10, cfg.name
