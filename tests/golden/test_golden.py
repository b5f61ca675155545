"""Golden scenarios (issue 3): small plans whose whole ``simulate`` result is compared with a committed file.

Each scenario's :meth:`StepResult.to_dict` is rounded to 6 significant digits and written as JSON with
sorted keys; the test compares that text with ``expected/<scenario>.json`` byte for byte, so *any* change
in the answer (a time, a memory category, a chosen knob, an uncalibrated op class) shows up as a diff.
When a change is intended (a cost-model update), regenerate on purpose and review the diff:

    python -m pytest tests/golden --regen-golden && git diff tests/golden/expected

The scenarios use small models written here, so a library edit cannot change them silently, and the
built-in clusters, so their calibration tables are covered.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from simulator.run import simulate
from simulator.specs.library import load_cluster
from simulator.specs.model import ModelSpec, MoESpec
from simulator.specs.plan import PlanSpec

EXPECTED = Path(__file__).resolve().parent / "expected"

DENSE = ModelSpec(
    name="golden-dense",
    layers=8,
    hidden=2048,
    heads=16,
    kv_heads=4,
    ffn_hidden=5632,
    vocab=32000,
    seq_len=2048,
    gated_mlp=True,
    activation="swiglu",
    norm="rmsnorm",
    position_embedding="rope",
    bias=False,
)
GPT = ModelSpec(
    name="golden-gpt", layers=8, hidden=1536, heads=16, ffn_hidden=6144, vocab=51200, seq_len=2048, dropout=True
)
MOE = ModelSpec(
    name="golden-moe",
    layers=4,
    hidden=2048,
    heads=16,
    kv_heads=8,
    ffn_hidden=5632,
    vocab=32000,
    seq_len=2048,
    gated_mlp=True,
    activation="swiglu",
    norm="rmsnorm",
    position_embedding="rope",
    bias=False,
    moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=2816),
)

_FIXED: dict[str, Any] = {"micro_batch": 1, "recompute": "selective", "grad_overlap": True}

# name -> (model, cluster, plan)
SCENARIOS: dict[str, tuple[ModelSpec, str, PlanSpec]] = {
    "dense_1f1b_pp2_a100": (DENSE, "dgx-a100-80g", PlanSpec(tp=2, pp=2, dp=2, global_batch=16, vp=1, **_FIXED)),
    "dense_interleaved_vp2_h100": (DENSE, "dgx-h100", PlanSpec(tp=2, pp=2, dp=1, global_batch=8, vp=2, **_FIXED)),
    "dense_cp2_h100": (DENSE, "dgx-h100", PlanSpec(tp=2, cp=2, dp=2, global_batch=8, seq_len=8192, vp=1, **_FIXED)),
    "dense_cp4_all_gather_h100": (
        DENSE,
        "dgx-h100",
        PlanSpec(tp=2, cp=4, dp=2, cp_comm="all_gather", global_batch=8, seq_len=8192, vp=1, **_FIXED),
    ),
    "moe_ep2_h100": (MOE, "dgx-h100", PlanSpec(pp=2, dp=4, ep=2, global_batch=16, vp=1, **_FIXED)),
    "gpt_zero3_full_recompute_a100": (
        GPT,
        "dgx-a100-80g",
        PlanSpec(dp=16, zero_stage=3, global_batch=32, micro_batch=2, recompute="full", grad_overlap=True, vp=1),
    ),
    "dense_free_knobs_h100": (DENSE, "dgx-h100", PlanSpec(tp=2, pp=2, dp=2, global_batch=32)),
}


def _round(value: Any) -> Any:
    """Floats to 6 significant digits (NaN and inf to null), recursively."""
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round(v) for v in value]
    raise TypeError(f"unexpected {type(value).__name__} in a result")


def render(name: str) -> str:
    """The golden text of a scenario."""
    model, cluster, plan = SCENARIOS[name]
    result = simulate(model, load_cluster(cluster), plan)
    return json.dumps(_round(result.to_dict()), indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden(name: str, request: pytest.FixtureRequest) -> None:
    """Issue 3 (golden): the full rounded JSON result equals the committed expected file."""
    path = EXPECTED / f"{name}.json"
    text = render(name)
    if request.config.getoption("--regen-golden"):
        path.write_text(text, encoding="utf-8")
        return
    assert path.is_file(), f"missing {path}; create it with: python -m pytest tests/golden --regen-golden"
    assert text == path.read_text(encoding="utf-8"), (
        f"{name}: result changed; if intended, run python -m pytest tests/golden --regen-golden and review git diff"
    )


def test_every_expected_file_has_a_scenario() -> None:
    """Issue 3 (golden): no stale expected file is left behind when a scenario is renamed or removed."""
    assert sorted(p.stem for p in EXPECTED.glob("*.json")) == sorted(SCENARIOS)


def test_rounding_keeps_six_significant_digits() -> None:
    """Issue 3 (golden): the rounding is 6 significant digits, NaN becomes null, structure is kept."""
    assert _round({"a": [1.23456789e-5, 123456789.0, math.nan], "b": True, "c": 3}) == {
        "a": [1.23457e-5, 123457000.0, None],
        "b": True,
        "c": 3,
    }
