"""A plan, model or cluster built in Python is checked as strictly as one read from a file (found by fuzzing
the Python API: ``tp="2"`` raised TypeError, ``attention="x"`` a ValueError deep in the search,
``straggler_factor=nan`` gave a NaN step time)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from simulator.errors import SpecError
from simulator.run import simulate
from simulator.specs import PlanSpec, load_cluster, load_model


@pytest.mark.parametrize(
    ("changes", "where", "what"),
    [
        ({"tp": "2"}, "tp", "must be a whole number, got '2'"),
        ({"tp": 2.5}, "tp", "must be a whole number, got 2.5"),
        ({"pp": True}, "pp", "must be a whole number, got True"),
        ({"dp": 0}, "dp", "must be >= 1, got 0"),
        ({"micro_batch": -3}, "micro_batch", "must be >= 1, got -3"),
        ({"seq_len": 0}, "seq_len", "must be >= 1, got 0"),
        ({"zero_stage": 4}, "zero_stage", "must be 0, 1, 2 or 3, got 4"),
        ({"attention": "x"}, "attention", "must be one of flash, flash2, cudnn, unfused, got 'x'"),
        ({"recompute": "partial"}, "recompute", "must be one of none, selective, full"),
        ({"schedule": "1F1B"}, "schedule", "must be one of gpipe, 1f1b, interleaved, zb_h1"),
        ({"precision": None}, "precision", "must be one of fp16, bf16, fp8, got None"),
        ({"grad_dtype": "int8"}, "grad_dtype", "must be one of fp32, bf16, fp16"),
        ({"sequence_parallel": 1}, "sequence_parallel", "must be true or false, got 1"),
        ({"grad_accum_fusion": None}, "grad_accum_fusion", "must be true or false, got None"),
        ({"straggler_factor": float("nan")}, "straggler_factor", "must be a finite number, got nan"),
        ({"expert_imbalance": 0.5}, "expert_imbalance", "must be >= 1, got 0.5"),
    ],
)
def test_a_bad_field_is_a_spec_error_naming_it(changes: dict, where: str, what: str) -> None:
    with pytest.raises(SpecError) as info:
        PlanSpec(global_batch=64, **changes)
    assert info.value.where == where
    assert what in info.value.what
    assert info.value.fix


def test_numpy_scalars_become_python_ones_and_give_the_same_answer() -> None:
    """A sweep that builds plans from a DataFrame passes numpy scalars; the plan holds Python ones, so results
    compare equal and serialise to JSON."""
    plan = PlanSpec(
        tp=np.int64(2), dp=np.int32(4), global_batch=np.float64(64.0), micro_batch=2, sequence_parallel=np.bool_(1)
    )
    assert (type(plan.tp), type(plan.dp), type(plan.global_batch), type(plan.sequence_parallel)) == (
        int,
        int,
        int,
        bool,
    )
    assert plan == PlanSpec(tp=2, dp=4, global_batch=64, micro_batch=2, sequence_parallel=True)
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    result = simulate(model, cluster, plan)
    json.dumps(result.to_dict())
    assert result.to_dict() == simulate(model, cluster, plan.with_(tp=2)).to_dict()


def _bad_spec_cases() -> list[tuple[str, dict, str, str]]:
    return [
        ("model", {"layers": "4"}, "layers", "must be a whole number, got '4'"),
        ("model", {"hidden": float("nan")}, "hidden", "must be a whole number, got nan"),
        ("model", {"activation": "tanh"}, "activation", "must be one of gelu, relu"),
        ("model", {"gated_mlp": "yes"}, "gated_mlp", "must be true or false, got 'yes'"),
        ("moe", {"top_k": 9}, "top_k", "must be <= num_experts: top_k=9, num_experts=8"),
        ("moe", {"num_experts": -1}, "num_experts", "must be >= 1, got -1"),
        ("moe", {"capacity_factor": 0.5}, "capacity_factor", "must be >= 1, got 0.5"),
        ("cluster", {"gpus_per_node": 0}, "gpus_per_node", "must be >= 1, got 0"),
        ("cluster", {"nic_bandwidth_bytes_per_s": 0.0}, "nic_bandwidth_bytes_per_s", "must be > 0, got 0.0"),
        ("cluster", {"topology": "torus"}, "topology", "must be one of rail_optimized, fat_tree"),
        ("cluster", {"device": "H100"}, "device", "must be a DeviceSpec, got str"),
        ("device", {"hbm_bytes": -1.0}, "hbm_bytes", "must be > 0, got -1.0"),
        ("device", {"peak_flops": (("bf16", -1.0),)}, "peak_flops", "with a peak FLOP/s > 0"),
        ("device", {"peak_flops": 989e12}, "peak_flops", "must pair a precision"),
    ]


@pytest.mark.parametrize(("spec", "changes", "where", "what"), _bad_spec_cases())
def test_a_model_or_cluster_built_in_python_is_checked_like_a_file(
    spec: str, changes: dict, where: str, what: str
) -> None:
    """Found by fuzzing: a text layer count, NaN sizes, a non-tuple peak_flops or a negative expert count were
    accepted and failed later (TypeError, NaN step times)."""
    from dataclasses import replace

    from simulator.specs.model import MoESpec

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    base = {
        "model": model,
        "moe": MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=1024),
        "cluster": cluster,
        "device": cluster.device,
    }[spec]
    with pytest.raises(SpecError) as info:
        replace(base, **changes)
    assert info.value.where == where
    assert what in info.value.what


def test_a_plan_file_reads_every_field_with_the_dataclass_default() -> None:
    """A plan file and PlanSpec agree: every field is read (there is one reader per field), and a key left out
    gets the dataclass's own default (dp aside: it is derived from the GPU count)."""
    from simulator.specs.plan import _KNOB_READERS, _LAYOUT_READERS

    assert sorted({*_KNOB_READERS, *_LAYOUT_READERS}) == sorted(PlanSpec.field_names())
    assert not set(_KNOB_READERS) & set(_LAYOUT_READERS)
    read = PlanSpec.from_mapping({"global_batch": 8}, "plan.yaml", gpus=8)
    assert read == PlanSpec(global_batch=8, dp=8)
    full = PlanSpec(global_batch=8, dp=8, tp=2, fp8_param=True, zero_stage=1, precision="fp8", straggler_factor=1.2)
    assert PlanSpec.from_mapping(full.as_dict(), "plan.yaml") == full
