"""Any cell of a validation file may be wrong; each row still gets an answer (Hypothesis).

``validate`` must read every file with the columns of data/validation/README.md. Whatever a cell holds
(empty, text, a negative or absurd number, a value meant for another column), the row is predicted, judged
infeasible with a reason, or reported invalid with the file, row and column in its reason; the other rows
are still predicted, and nothing raises.
"""

from __future__ import annotations

import math

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.validate import validate_frame

BASE: dict[str, object] = {
    "run_id": "fz",
    "set": "fuzz",
    "source": "fuzz",
    "model": "Tiny-MoE",
    "arch": "moe",
    "layers": 4,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 4,
    "ffn_hidden": 1024,
    "vocab": 1024,
    "head_dim": "",
    "gated_mlp": "true",
    "num_experts": 8,
    "experts_topk": 2,
    "seq_len": 256,
    "cluster": "dgx-h100",
    "nics_per_node": "",
    "num_gpus": 16,
    "tp": 2,
    "pp": 2,
    "dp": 4,
    "cp": 1,
    "ep": 2,
    "vp": "",
    "sequence_parallel": "true",
    "micro_batch": "",
    "global_batch": 16,
    "recompute": "",
    "zero_stage": 1,
    "grad_overlap": "",
    "precision": "bf16",
    "measured_step_time_s": 0.05,
    "measured_from": "iteration time",
    "notes": "",
}
COLUMNS = [c for c in BASE if c != "run_id"]
# Edge values for any column: empty, text, signs, fractions, huge, booleans, other columns' vocabularies.
VALUES = [
    "",
    " ",
    "abc",
    "0",
    "-1",
    "1",
    "2",
    "3",
    "3.5",
    "16",
    "1e9",
    "1e30",
    "inf",
    "-inf",
    "NaN",
    "true",
    "False",
    "yes",
    "none",
    "full",
    "selective",
    "dense",
    "moe",
    "fp8",
    "fp16",
    "dgx-a100-40g",
    "gb200-nvl72",
    "hgx-h200",
]

mutations = st.lists(st.tuples(st.sampled_from(COLUMNS), st.sampled_from(VALUES)), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations)
def test_every_row_gets_an_answer_whatever_its_cells_hold(changes: list[tuple[str, str]]) -> None:
    bad = dict(BASE, run_id="bad")
    for column, value in changes:
        bad[column] = value
    frame = pd.DataFrame([dict(BASE), bad], dtype=str)
    report = validate_frame(frame, "fuzz.csv")
    good, row = report.rows
    assert good["feasible"]
    assert not good["invalid"]
    if row["invalid"]:
        assert not row["feasible"]
        assert row["reason"].startswith("fuzz.csv: line 3 (bad): ")
    elif row["feasible"]:
        assert math.isfinite(row["predicted_step_time_s"])
        assert row["predicted_step_time_s"] > 0
    else:
        assert row["reason"]
    assert report.summary["rows"] == 2
    assert report.summary["invalid"] == int(row["invalid"])
