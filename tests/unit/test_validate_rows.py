"""How validation rows become simulations: software-stack annotations and the gradient dtype knob."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
import pytest

from simulator.errors import SpecError
from simulator.parallel.layout import MAX_MICRO_BATCHES
from simulator.run import simulate
from simulator.specs import PlanSpec, load_cluster, load_model
from simulator.specs.model import MAX_LAYERS
from simulator.validate import format_report, load_stacks, validate_file, validate_frame

STACKS = Path(__file__).resolve().parents[2] / "data" / "validation" / "software_stacks.yaml"


def _row(**changes: object) -> dict[str, object]:
    row: dict[str, object] = {
        "run_id": "r1",
        "source": "NVIDIA/NeMo performance summary",
        "model": "Tiny",
        "layers": 4,
        "hidden": 512,
        "heads": 8,
        "ffn_hidden": 2048,
        "vocab": 1024,
        "seq_len": 256,
        "cluster": "dgx-h100",
        "num_gpus": 8,
        "tp": 1,
        "pp": 1,
        "dp": 8,
        "micro_batch": 1,
        "global_batch": 8,
        "recompute": "none",
        "precision": "bf16",
        "measured_step_time_s": 1.0,
    }
    row.update(changes)
    return row


def test_stack_entries_can_be_restricted_to_one_model() -> None:
    """A recipe fact read from one model's configuration applies to that model's rows only."""
    stacks = load_stacks(STACKS)
    frame = pd.DataFrame([_row(), _row(run_id="r2", model="Nemotron-340B (tiny stand-in)")])
    report = validate_frame(frame, "t.csv", stacks=stacks)
    assert [r["stack"] for r in report.rows] == [
        "NeMo 24.07 (Megatron-Core, Transformer Engine)",
        "NeMo 24.07, Nemotron-4 340B recipe",
    ]


def test_vtrain_rows_run_the_unfused_attention_of_their_framework() -> None:
    stacks = load_stacks(STACKS)
    frame = pd.DataFrame([_row(source="vTrain ground truth (ground_truth_single.csv)", cluster="dgx-a100-80g")])
    unfused = validate_frame(frame, "t.csv", stacks=stacks).rows[0]
    plain = validate_frame(frame, "t.csv", stacks=()).rows[0]
    assert unfused["stack"].startswith("Megatron-DeepSpeed")
    # The explicit s x s softmax costs time the fused kernel does not spend.
    assert unfused["predicted_step_time_s"] > plain["predicted_step_time_s"]


def test_bf16_gradients_halve_gradient_memory_and_reduction() -> None:
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100")
    base = PlanSpec(dp=16, global_batch=16, micro_batch=1, recompute="full", zero_stage=1, grad_overlap=False)
    fp32 = simulate(model, cluster, base)
    assert fp32.feasible, fp32.reason
    bf16 = simulate(model, cluster, base.with_(grad_dtype="bf16"))
    assert base.grad_bytes == 4
    assert bf16.memory[0].gradients == pytest.approx(fp32.memory[0].gradients / 2)
    assert bf16.breakdown["dp_exposed_s"] < fp32.breakdown["dp_exposed_s"]


def test_grad_dtype_defaults_follow_megatron() -> None:
    assert PlanSpec(global_batch=1, precision="bf16").grad_bytes == 4
    assert PlanSpec(global_batch=1, precision="fp8").grad_bytes == 4
    assert PlanSpec(global_batch=1, precision="fp16").grad_bytes == 2


def test_unknown_grad_dtype_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="grad_dtype: must be one of fp32, bf16, fp16"):
        PlanSpec.from_mapping({"global_batch": 8, "grad_dtype": "int8"}, "plan.yaml", gpus=8)


def _sc21_row() -> dict[str, object]:
    """A small SC21-sourced row of the 39.1B model, micro-batch left empty as in the paper's table."""
    row = _row(
        source="Narayanan et al., Efficient Large-Scale Language Model Training on GPU",
        model="GPT 39.1B",
        cluster="dgx-a100-80g",
        precision="fp16",
        recompute="full",
        tp=2,
        dp=4,
        global_batch=32,
    )
    del row["micro_batch"]
    return row


def test_sc21_launch_script_fills_only_the_knobs_the_row_leaves_empty() -> None:
    """SC21's Table 1 left micro-batch, interleaving and DDP unsaid; the authors' script states them."""
    stacks = load_stacks(STACKS)
    base = _sc21_row()
    frame = pd.DataFrame([base, {**base, "run_id": "r2", "micro_batch": 2}])
    rows = validate_frame(frame, "t.csv", stacks=stacks).rows
    assert all(r["feasible"] for r in rows), [r["reason"] for r in rows]
    assert rows[0]["stack"].startswith("Megatron-LM, 2021 (SC21), launch script")
    # Nothing left to choose: micro_batch 4, vp 1 and no gradient overlap (--DDP-impl local) come from the script.
    assert rows[0]["chosen"] == {}
    # A stated column wins over the script.
    assert rows[1]["predicted_step_time_s"] != rows[0]["predicted_step_time_s"]


def test_stack_knob_values_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "software_stacks.yaml"
    bad.write_text(
        "stacks:\n  - match: x\n    name: y\n    knobs:\n      micro_batch: 0\n    evidence: z\n", encoding="utf-8"
    )
    with pytest.raises(SpecError, match=r"stacks\[0\]\.knobs\.micro_batch"):
        load_stacks(bad)
    bad.write_text(
        "stacks:\n  - match: x\n    name: y\n    knobs:\n      grad_overlap: maybe\n    evidence: z\n", encoding="utf-8"
    )
    with pytest.raises(SpecError, match="true or false"):
        load_stacks(bad)
    # Found by fuzzing: a list in `override` was a TypeError (unhashable type) traceback.
    bad.write_text(
        "stacks:\n  - match: x\n    name: y\n    knobs:\n      zero_stage: 1\n    override: [[zero_stage]]\n"
        "    evidence: z\n",
        encoding="utf-8",
    )
    with pytest.raises(SpecError, match="must list knobs that the entry sets"):
        load_stacks(bad)


def test_a_stack_entry_with_columns_applies_only_to_rows_of_that_layout(tmp_path: Path) -> None:
    """A recipe that states its nodes and micro-batch (NeMo's 175b_mlperf.yaml: 64 nodes, micro-batch 2) is the
    recipe of one of a model's rows, not of every row of that model: its `columns` must all equal the row's."""
    stacks_file = tmp_path / "software_stacks.yaml"
    stacks_file.write_text(
        "stacks:\n"
        "  - match: NeMo\n    model: Tiny\n    columns: {num_gpus: 8, micro_batch: 2}\n    name: recipe\n"
        "    knobs:\n      grad_dtype: bf16\n    evidence: e\n"
        "  - match: NeMo\n    name: generic\n    knobs:\n      grad_dtype: fp32\n    evidence: e\n",
        encoding="utf-8",
    )
    stacks = load_stacks(stacks_file)
    assert stacks[0].columns == (("num_gpus", 8), ("micro_batch", 2))
    frame = pd.DataFrame(
        [
            _row(micro_batch=2, global_batch=16),
            _row(run_id="r2", micro_batch=1, global_batch=16),
            _row(run_id="r3", micro_batch="", global_batch=16),
        ]
    )
    rows = validate_frame(frame, "t.csv", stacks=stacks).rows
    assert all(r["feasible"] for r in rows), [r["reason"] for r in rows]
    assert [r["stack"] for r in rows] == ["recipe", "generic", "generic"]
    assert [r["stack_knobs"]["grad_dtype"] for r in rows] == ["bf16", "fp32", "fp32"]
    # Each shipped recipe entry picks the one published row whose layout its recipe runs: the MLPerf recipe the
    # 512-GPU GPT-3 175B row and not the 128-GPU one, each launch script its own row.
    runs = pd.read_csv(STACKS.parent / "published_runs.csv")
    picked = {
        st.model: [
            r.run_id
            for r in runs.itertuples()
            if st.applies(r.source, r.model, {c: getattr(r, c) for c, _ in st.columns})
        ]
        for st in load_stacks(STACKS)
        if st.columns
    }
    assert picked == {
        "GPT3-175B": ["dev-0023"],
        "GPT3-5B": ["dev-0020"],
        "LLAMA2-7B": ["dev-0024"],
        "LLAMA2-70B": ["dev-0026"],
        "LLAMA3-8B": ["dev-0030"],
        "LLAMA3-70B": ["dev-0031"],
    }


def test_stack_columns_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "software_stacks.yaml"
    head = "stacks:\n  - match: x\n    name: y\n    knobs: {}\n    evidence: z\n"
    bad.write_text(head + "    columns: {nodes: 64}\n", encoding="utf-8")
    with pytest.raises(SpecError, match=r"stacks\[0\]\.columns\.nodes.*num_gpus"):
        load_stacks(bad)
    bad.write_text(head + "    columns: {micro_batch: two}\n", encoding="utf-8")
    with pytest.raises(SpecError, match=r"stacks\[0\]\.columns\.micro_batch"):
        load_stacks(bad)
    bad.write_text(head + "    columns: [num_gpus]\n", encoding="utf-8")
    with pytest.raises(SpecError, match=r"stacks\[0\]\.columns"):
        load_stacks(bad)


def test_a_cluster_cell_no_file_system_takes_is_an_invalid_row_not_the_end_of_the_run() -> None:
    """A 300-character cluster cell made Path.is_file() raise 'File name too long', which ended the whole run
    with one error instead of reporting that row as invalid and the others as usual. Found by fuzzing."""
    rows = validate_frame(pd.DataFrame([_row(cluster="x" * 300), _row(run_id="r2")]), "t.csv").rows
    assert rows[0]["invalid"]
    assert "is no cluster name or path" in rows[0]["reason"]
    assert not rows[1]["invalid"]
    assert rows[1]["feasible"]


def test_a_model_entry_and_its_source_entry_both_apply() -> None:
    """SC21's per-model launch settings come from one entry, its unfused attention from the source's entry."""
    stacks = load_stacks(STACKS)
    base = _sc21_row()
    stated = {
        **base,
        "micro_batch": 4,
        "vp": 1,
        "grad_overlap": False,
        "attention": "unfused",
        "grad_accum_fusion": False,
    }
    with_stacks = validate_frame(pd.DataFrame([base]), "t.csv", stacks=stacks).rows[0]
    by_hand = validate_frame(pd.DataFrame([stated]), "t.csv", stacks=()).rows[0]
    assert with_stacks["feasible"], with_stacks["reason"]
    assert with_stacks["predicted_step_time_s"] == by_hand["predicted_step_time_s"]


def test_rows_and_summary_say_which_ops_ran_uncalibrated() -> None:
    frame = pd.DataFrame(
        [
            _row(run_id="bf16"),
            _row(run_id="fp8", precision="fp8"),  # the shipped H100 table has no FP8 GEMM measurement
            _row(run_id="two-nodes", num_gpus=16, dp=16, global_batch=16),  # no multi-node collective data either
        ]
    )
    report = validate_frame(frame, "t.csv")
    labels = {r["run_id"]: r["uncalibrated"] for r in report.rows}
    # An 8-GPU gradient all-reduce on DGX H100 runs NVLS, whose gain over the measured ring curve is NCCL's figure.
    assert labels["bf16"] == ["all_reduce:domain:nvls_gain"]
    assert labels["fp8"] == ["all_reduce:domain:nvls_gain", "gemm:fp8"]
    assert "all_reduce:network" in labels["two-nodes"]
    assert "gemm:fp8" not in labels["two-nodes"]
    assert report.summary["uncalibrated_rows"] == 3
    assert report.summary["uncalibrated"]["gemm:fp8"] == 1
    assert report.rows_frame()["uncalibrated"].tolist()[1] == "all_reduce:domain:nvls_gain;gemm:fp8"


def test_llm_foundry_rows_run_flashattention2_which_changes_h100_rows_only() -> None:
    """llm-foundry's 2023 benchmarks predate FlashAttention-3 and cuDNN attention in PyTorch: FlashAttention-2,
    which on A100 is the device's own fused kernel and on H100 is slower than FlashAttention-3."""
    stacks = load_stacks(STACKS)
    source = "S17: mosaicml/llm-foundry scripts/train/benchmarking/README.md"
    # 4k tokens: attention kernels long enough to be timed on the measured curves (not at the shortest-kernel floor).
    rows = [
        _row(run_id="h100", source=source, seq_len=4096),
        _row(run_id="a100", source=source, cluster="dgx-a100-80g", seq_len=4096),
    ]
    pinned = validate_frame(pd.DataFrame(rows), "t.csv", stacks=stacks).rows
    plain = validate_frame(pd.DataFrame(rows), "t.csv", stacks=()).rows
    assert [r["stack"] for r in pinned] == ["llm-foundry / Composer FSDP, 2023"] * 2
    assert pinned[0]["predicted_step_time_s"] > plain[0]["predicted_step_time_s"]
    assert pinned[1]["predicted_step_time_s"] == plain[1]["predicted_step_time_s"]


def test_tied_embedding_all_reduce_of_a_single_node_pipeline_stays_on_nvlink() -> None:
    # pp 4 over dp 2 on one DGX: the first and last stages are ranks 0 and 6 (and 1 and 7), all in one node.
    row = _row(run_id="pp4", cluster="dgx-a100-80g", tp=1, pp=4, dp=2, global_batch=8, precision="fp16")
    report = validate_frame(pd.DataFrame([row]), "t.csv")
    assert report.rows[0]["feasible"]
    assert not [label for label in report.rows[0]["uncalibrated"] if label.endswith(":network")]


@pytest.mark.parametrize("value", ["abc", "-1", "0", "inf"])
def test_a_bad_measured_time_makes_the_row_invalid_not_infeasible(value: str) -> None:
    """A measured time that is not seconds > 0 is a bad cell: the row says which and how to fix it."""
    report = validate_frame(pd.DataFrame([_row(), _row(run_id="r2", measured_step_time_s=value)]), "f.csv")
    good, bad = report.rows
    assert good["feasible"]
    assert not good["invalid"]
    assert not bad["feasible"]
    assert bad["invalid"]
    assert "line 3 (r2): measured_step_time_s" in bad["reason"]
    assert repr(value) in bad["reason"]
    s = report.summary
    assert (s["predicted"], s["infeasible"], s["invalid"], s["unmeasured"]) == (1, 0, 1, 0)
    assert s["by_cluster"]["dgx-h100"]["invalid"] == 1
    # rows counts the group's rows as the top-level rows does, scored those with an error (it had been the latter)
    assert (s["by_cluster"]["dgx-h100"]["rows"], s["by_cluster"]["dgx-h100"]["scored"]) == (2, 1)
    table = format_report(report, "table")
    assert "rows    2 (1 scored)  median" in table
    assert "  max " in table.split("by cluster:")[1]


def test_an_unmeasured_row_is_predicted_and_left_out_of_the_error_figures() -> None:
    report = validate_frame(
        pd.DataFrame([_row(), _row(run_id="r2", measured_step_time_s=float("nan"), global_batch=64)]), "f.csv"
    )
    measured, unmeasured = report.rows
    assert unmeasured["feasible"]
    assert unmeasured["predicted_step_time_s"] > measured["predicted_step_time_s"]
    s = report.summary
    assert (s["predicted"], s["unmeasured"], s["invalid"]) == (2, 1, 0)
    assert s["median_abs_error"] == pytest.approx(abs(measured["error"]))


@pytest.mark.parametrize("column", ["layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"])
def test_an_empty_architecture_cell_makes_the_row_invalid_and_names_the_cell(column: str) -> None:
    """A model the row does not describe is bad input (no silent default such as a 2,048-token sequence)."""
    report = validate_frame(pd.DataFrame([_row(), _row(run_id="r2", **{column: float("nan")})]), "f.csv")
    good, bad = report.rows
    assert good["feasible"]
    assert bad["invalid"]
    assert not bad["feasible"]
    assert f"line 3 (r2): {column}" in bad["reason"]
    assert "is empty" in bad["reason"]
    assert report.summary["invalid"] == 1


@pytest.mark.parametrize("column", ["layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"])
@pytest.mark.parametrize("value", [0, -2])
def test_a_size_below_one_makes_the_row_invalid_and_names_the_cell(column: str, value: int) -> None:
    """Found by fuzzing the validator: heads 0 divided by zero instead of naming the cell."""
    report = validate_frame(pd.DataFrame([_row(), _row(run_id="r2", **{column: value})]), "f.csv")
    good, bad = report.rows
    assert good["feasible"]
    assert bad["invalid"]
    assert f"line 3 (r2): {column}: '{column}' must be >= 1, got {value}" in bad["reason"]


def test_an_absurd_size_in_a_fully_stated_row_is_an_out_of_memory_answer() -> None:
    """Found by fuzzing: a mistyped vocabulary (1e30) in a row with every knob stated ran the engine on 10^25
    gradient buckets and overflowed; now the buckets are capped and the row is an infeasible answer."""
    report = validate_frame(pd.DataFrame([_row(run_id="r2", vocab="1e15", grad_overlap=True, vp=1)]), "f.csv")
    (row,) = report.rows
    assert not row["invalid"]
    assert not row["feasible"]
    assert row["reason"].startswith("out of memory: stage 0 needs")
    # Past 2**53 a count is not exact in the cost models' floats (10**400 overflowed them): bad input.
    (beyond,) = validate_frame(pd.DataFrame([_row(run_id="r2", vocab="1e30")]), "f.csv").rows
    assert beyond["invalid"]
    assert "vocab: must be at most 2**53" in beyond["reason"]


def test_a_mistyped_depth_or_batch_is_an_answer_not_a_hang() -> None:
    """Found by fuzzing: 1e30 layers or a 1e30 global batch made the simulator build that many layers or
    micro-batches until memory ran out. Depth over MAX_LAYERS is bad input; more micro-batches per step than
    MAX_MICRO_BATCHES is a plan the engine declines, with the reason."""
    frame = pd.DataFrame(
        [_row(run_id="r2", layers="1e30"), _row(run_id="r3", global_batch=8 * (MAX_MICRO_BATCHES + 1))]
    )
    deep, long = validate_frame(frame, "f.csv").rows
    assert deep["invalid"]
    assert f"layers: 'layers' must be at most {MAX_LAYERS:,}" in deep["reason"]
    assert not long["invalid"]
    assert not long["feasible"]
    assert f"{MAX_MICRO_BATCHES + 1:,} micro-batches per step" in long["reason"]


def test_rows_without_a_source_are_grouped_under_a_visible_label() -> None:
    """A file without a ``source`` column (or with empty cells) still gets a readable by-source breakdown."""
    frame = pd.DataFrame([_row(), _row(run_id="r2", source="")]).drop(columns=["source"])
    report = validate_frame(frame, "f.csv")
    assert list(report.summary["by_source"]) == ["(not given)"]
    assert report.summary["by_source"]["(not given)"]["rows"] == 2
    mixed = validate_frame(pd.DataFrame([_row(), _row(run_id="r2", source="")]), "f.csv")
    assert sorted(mixed.summary["by_source"]) == ["(not given)", "NVIDIA/NeMo performance summary"]


@pytest.mark.parametrize(("column", "value"), [("num_gpus", "abc"), ("global_batch", "3.5"), ("num_gpus", "inf")])
def test_a_bad_gpu_count_or_batch_is_reported_on_its_row_not_for_the_whole_file(column: str, value: str) -> None:
    """Found by fuzzing (tests/property/test_validate_fuzz.py): these two cells, read to label the row, raised
    out of the whole file; now the row is invalid with the cell in its reason and the other rows are predicted."""
    report = validate_frame(pd.DataFrame([_row(), _row(run_id="r2", **{column: value})]), "f.csv")
    good, bad = report.rows
    assert good["feasible"]
    assert bad["invalid"]
    assert bad[column] is None
    assert f"line 3 (r2): {column}: must be a whole number, got {value!r}" in bad["reason"]


def test_a_stack_that_overrides_a_stated_knob_says_so() -> None:
    """NeMo 24.07's tables state zero_stage 0 but its recipes run the distributed optimizer: the entry's override
    is reported per row (stated and used value) and counted, and knobs it only fills are listed too."""
    stacks = load_stacks(STACKS)
    report = validate_frame(pd.DataFrame([_row(zero_stage=0)]), "t.csv", stacks=stacks)
    (row,) = report.rows
    assert row["stack_knobs"]["zero_stage"] == [0, 1]
    assert report.summary["stack_overridden"] == 1
    filled = validate_frame(pd.DataFrame([_sc21_row()]), "t.csv", stacks=stacks).rows[0]["stack_knobs"]
    assert filled["micro_batch"] == 4
    assert not any(isinstance(v, list) for v in filled.values())


def test_spearman_does_not_rank_one_layout_measured_on_two_software_releases() -> None:
    """Groups also share source and precision: the same layouts from two releases form two groups, not one
    group in which identical predictions meet different measurements."""
    rows = [
        _row(run_id=f"{src}{i}", source=f"release {src}", tp=tp, dp=8 // tp, measured_step_time_s=t)
        for src, times in (("a", (1.0, 1.1, 1.2)), ("b", (1.3, 1.2, 1.1)))
        for i, (tp, t) in enumerate(zip((1, 2, 4), times, strict=True))
    ]
    summary = validate_frame(pd.DataFrame(rows), "t.csv").summary
    assert summary["spearman_groups"] == 2
    # Each group's own figure is listed (only the mean was), so a poor mean can be traced to its layouts.
    by_group = {g["source"]: g for g in summary["spearman_by_group"]}
    assert sorted(by_group) == ["release a", "release b"]
    assert by_group["release a"]["rows"] == 3
    assert by_group["release a"]["spearman"] == -by_group["release b"]["spearman"]
    assert summary["mean_spearman"] == pytest.approx(sum(g["spearman"] for g in by_group.values()) / 2)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        # Found by trying the validator with hand-made rows: each of these used to be predicted silently.
        ({"precision": float("nan")}, "precision: is empty; fill precision"),
        ({"tp": float("nan")}, "tp: is empty; fill tp"),
        ({"arch": "rnn"}, "arch: must be dense or moe, got 'rnn'"),
        ({"arch": "moe", "num_experts": 8, "experts_topk": 0}, "experts_topk: must be >= 1, got 0; use experts_topk"),
        ({"nics_per_node": 0}, "nics_per_node: must be >= 1, got 0"),
        ({"kv_heads": 0}, "kv_heads: must be >= 1, got 0; fix the cell, or leave it empty for as many as heads"),
        ({"vocab": "1_024"}, "vocab: must be a whole number, got '1_024'"),
        ({"layers": "\u0664"}, "layers: must be a whole number"),  # an Arabic-Indic four
        ({"measured_step_time_s": "1_0"}, "measured_step_time_s: must be a number of seconds of at least 1e-06"),
        # A dense row naming experts was simulated as MoE (+46% on one row); an empty top-k became 2 unreported.
        ({"arch": "dense", "num_experts": 8, "experts_topk": 2}, "arch: is dense, but num_experts is 8"),
        ({"arch": "moe", "num_experts": 8}, "experts_topk: is required for a MoE row; fill experts_topk"),
        ({"cluster": float("nan")}, "cluster: is empty; fill cluster"),  # was ": is a directory, not a cluster file"
        # In the CSV's terms: it had said "gpus: ...; fix the degrees or leave dp out" (dp is a required column).
        ({"num_gpus": 3}, "num_gpus: must equal tp·pp·dp·cp: num_gpus=3, tp·pp·dp·cp=8; fix num_gpus or the degrees"),
    ],
)
def test_a_cell_that_is_not_what_the_contract_says_makes_the_row_invalid(
    changes: dict[str, object], fragment: str
) -> None:
    report = validate_frame(pd.DataFrame([_row(), _row(run_id="r2", **changes)]), "f.csv")
    good, bad = report.rows
    assert good["feasible"]
    assert bad["invalid"], bad
    assert bad["reason"].startswith(f"f.csv: line 3 (r2): {fragment}"), bad["reason"]
    assert bad["reason"].count("f.csv") == 1


def test_plain_decimal_numbers_are_still_read() -> None:
    """The cell rule keeps what spreadsheets write: signs, decimals with a zero fraction, exponents."""
    report = validate_frame(
        pd.DataFrame([_row(layers="4.0", vocab="1.024e3", measured_step_time_s="+2.5E-1")]), "f.csv"
    )
    (row,) = report.rows
    assert row["feasible"]
    assert row["measured_step_time_s"] == 0.25


def test_a_row_that_contradicts_its_software_stack_names_the_stack() -> None:
    """Found by trying: an FP8 Megatron-Bridge row stated with zero_stage 0 met its stack's FP8 weights, and the
    reason named neither the row nor the stack, only a knob that is not a column."""
    stacks = load_stacks(STACKS)
    row = _row(source="NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md", precision="fp8", zero_stage=0)
    (bad,) = validate_frame(pd.DataFrame([row]), "f.csv", stacks=stacks).rows
    assert bad["invalid"]
    assert bad["reason"].startswith("f.csv: line 2 (r1): fp8_param (set by software stack 'Megatron-Bridge")
    assert bad["reason"].endswith("or validate with --no-stacks")


@pytest.mark.parametrize(("knobs", "fragment"), [({"micro_batch": 1000}, "global_batch"), ({"vp": 7}, "vp")])
def test_a_stack_knob_that_the_framework_would_refuse_makes_the_row_invalid(
    knobs: dict[str, object], fragment: str
) -> None:
    """Found by a CLI review: a stack setting micro_batch 1000 (global batch not a multiple of dp·1000) or vp 7 at
    pp 1 left the row a feasible-looking miss, 'infeasible' with exit 0, where the same value in a cell is invalid."""
    from simulator.validate import Stack

    stack = Stack(match="NVIDIA", name="s", model="Tiny", knobs=knobs, override=(), evidence="e")
    (bad,) = validate_frame(pd.DataFrame([_row(micro_batch=None)]), "f.csv", stacks=(stack,)).rows
    assert bad["invalid"], bad
    assert bad["reason"].startswith(f"f.csv: line 2 (r1): {fragment} (set by software stack 's')"), bad["reason"]


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"tp": 3, "dp": 1, "num_gpus": 3}, "tp: must divide heads (8) and kv_heads (8)"),
        ({"global_batch": 66}, "global_batch: must be a multiple of dp·micro_batch (8·1 = 8), got 66"),
        ({"global_batch": 66, "micro_batch": float("nan")}, "global_batch: must be a multiple of dp (8), got 66"),
        ({"vp": 2}, "vp: must be 1 without pipeline parallelism, got vp=2 with pp=1"),
        ({"ep": 2}, "ep: needs a MoE model"),
        # Found by a review of the MoE model: rows Megatron refuses to start were counted as infeasible misses.
        (
            {"arch": "moe", "num_experts": 6, "experts_topk": 2, "ep": 4},
            "ep: must divide num_experts (6) (Megatron-LM asserts it), got 4",
        ),
        (
            {"arch": "moe", "num_experts": 16, "experts_topk": 2, "ep": 16},
            "ep: must divide a pipeline stage's tp·dp·cp (8)",
        ),
        ({"arch": "dense", "experts_topk": 2}, "arch: is dense, but experts_topk is 2"),
        ({"measured_step_time_s": 1e-320}, "measured_step_time_s: must be a number of seconds of at least 1e-06"),
    ],
)
def test_a_row_its_framework_would_refuse_to_start_is_invalid_not_a_miss(
    changes: dict[str, object], fragment: str
) -> None:
    """tp 3 with 8 heads, a global batch that dp·micro_batch does not divide, interleaving without a pipeline or
    expert parallelism in a dense model cannot have run: Megatron-LM refuses to start (``arguments.py``,
    ``TransformerConfig``), so such a row has a wrong cell and is invalid (exit 2), as a wrong num_gpus is, instead
    of counting as the simulator's miss. A measured time too small to be a step made the row's error infinite and
    the summary's p90 null. Found by a review of ``validate``."""
    (row,) = validate_frame(pd.DataFrame([_row(**changes)]), "f.csv").rows
    assert not row["feasible"]
    assert row["invalid"], row
    assert row["reason"].startswith(f"f.csv: line 2 (r1): {fragment}"), row["reason"]


def test_every_row_and_summary_has_one_shape_and_the_csv_keeps_every_digit() -> None:
    """Found by an output audit: rows without a software stack lacked the ``stack`` keys (and wrote NaN into the CSV's
    JSON cell), a file without measurements dropped the error keys from its summary, and the CSV rounded to 6
    significant digits (3.14159265358979 s became 3.14159)."""
    from io import StringIO

    from simulator.validate import format_report

    stacks = load_stacks(STACKS)
    frame = pd.DataFrame([_row(), _row(run_id="r2", source="elsewhere", measured_step_time_s=3.14159265358979)])
    report = validate_frame(frame, "t.csv", stacks=stacks)
    assert set(report.rows[0]) == set(report.rows[1])
    assert report.rows[1]["stack"] is None
    assert report.rows[1]["stack_knobs"] == {}
    back = pd.read_csv(StringIO(format_report(report, "csv")))
    assert back["measured_step_time_s"].tolist() == [1.0, 3.14159265358979]
    assert back["stack_knobs"][1] == "{}"
    unmeasured = validate_frame(pd.DataFrame([_row(measured_step_time_s=None)]), "t.csv").summary
    assert unmeasured["median_abs_error"] != unmeasured["median_abs_error"]  # NaN: null in JSON, not missing
    assert set(unmeasured["by_cluster"]["dgx-h100"]) >= {"median_abs_error", "p90_abs_error", "max_abs_error"}


def test_table_prints_knobs_as_simulate_does_and_no_negative_zero() -> None:
    from simulator.validate import _signed_pct, format_report

    assert _signed_pct(-0.0004) == "+0.0%"
    assert _signed_pct(-0.0006) == "-0.1%"
    report = validate_frame(pd.DataFrame([_row(source="elsewhere", recompute=None)]), "t.csv")
    line = format_report(report, "table").splitlines()[1]
    assert "recompute=none" in line
    assert "True" not in line
    assert " | stack" not in line


def test_the_table_caps_absurd_percentages() -> None:
    """A measured time of 1e-300 s printed a 300-digit percentage in the table (JSON and CSV keep the value)."""
    from simulator.validate import _pct, _signed_pct

    assert _signed_pct(1e300) == ">+1e6%"
    assert _pct(1e300) == ">1e6%"
    assert _signed_pct(-0.0001) == "+0.0%"
    assert _signed_pct(0.1234) == "+12.3%"


def test_whole_number_columns_stay_whole_when_a_row_leaves_them_empty() -> None:
    """An invalid row with an empty num_gpus made pandas write the column as floats (8.0) in --out, so it no longer
    joined onto the input by num_gpus (found by an output review)."""
    rows = [_row(), _row(run_id="r2", num_gpus=None)]
    frame = validate_frame(pd.DataFrame(rows), "t.csv").rows_frame()
    assert str(frame["num_gpus"].dtype) == "Int64"
    written = pd.read_csv(io.StringIO(frame.to_csv(index=False)), dtype=str, keep_default_na=False)
    assert list(written["num_gpus"]) == ["8", ""]


def test_each_row_carries_the_layout_as_simulated() -> None:
    """Plotting the error against the layout needed a join back onto the input (found by an output review): every
    row now carries the knobs as simulated, free ones as chosen, whole numbers staying whole in the CSV."""
    rows = [_row(), _row(run_id="r2", num_gpus=None)]
    report = validate_frame(pd.DataFrame(rows), "t.csv")
    first = report.rows[0]
    assert (first["tp"], first["pp"], first["dp"], first["seq_len"]) == (1, 1, 8, 256)
    assert first["micro_batch"] == 1
    assert first["recompute"] == "none"
    assert report.rows[1]["tp"] is None  # an invalid row has no layout
    written = pd.read_csv(io.StringIO(report.rows_frame().to_csv(index=False)), dtype=str, keep_default_na=False)
    assert list(written["dp"]) == ["8", ""]


def test_a_repeated_run_id_is_bad_input(tmp_path: Path) -> None:
    """A row given twice was counted twice in the median and p90; the message names the lines of the copies (it
    named none: found by a review of ``validate``), counted in the file, past a blank line."""
    src = (Path(__file__).resolve().parents[2] / "data" / "validation" / "published_runs.csv").read_text().splitlines()
    path = tmp_path / "dup.csv"
    path.write_text("\n".join([src[0], src[1], src[2], "", src[1]]) + "\n")
    with pytest.raises(SpecError, match=r"repeats run_id dev-0001 \(lines 2, 5\);"):
        validate_file(path)


def test_an_empty_cell_raised_to_fit_is_not_reported_as_stated() -> None:
    """A row with no zero_stage (the default 0 is tried first) that fits only at 1 read 'zero_stage 0->1', as if
    0 had been stated (found by an acceptance audit): the stated value of an empty cell is null, 'empty' in text."""
    big = {"model": "7B", "layers": 32, "hidden": 4096, "heads": 32, "ffn_hidden": 11008, "vocab": 32000}
    rows = [_row(seq_len=2048, recompute="full", **big), _row(run_id="r2", zero_stage=0, recompute="full", **big)]
    report = validate_frame(pd.DataFrame(rows), "t.csv")
    empty, stated = report.rows
    assert empty["adjusted"] == {"zero_stage": [None, 1]}
    assert stated["adjusted"]["zero_stage"][0] == 0
    table = format_report(report, "table")
    assert "adjusted to fit: zero_stage empty->1" in table
    assert "adjusted to fit: zero_stage 0->1" in table


def _tiny_csv(rows: list[dict[str, object]]) -> str:
    frame = pd.DataFrame(rows)
    return frame.to_csv(index=False)


def test_a_short_row_is_bad_input_not_a_padded_one(tmp_path: Path) -> None:
    """pandas pads a row with too few fields, so a row that lost its last cell (the measured time) was quietly left
    unscored. Found by a review of ``validate``."""
    text = _tiny_csv([_row(), _row(run_id="r2")]).splitlines()
    text[2] = text[2].rsplit(",", 1)[0]  # r2 without its measured time
    path = tmp_path / "short.csv"
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(SpecError, match="line 3 has 18 fields, the header 19"):
        validate_file(path)


def test_line_numbers_count_a_line_of_spaces(tmp_path: Path) -> None:
    """A line of spaces (which pandas skips) shifted every later row's line number back by one."""
    text = _tiny_csv([_row(), _row(run_id="r2", hidden="512x")]).splitlines()
    path = tmp_path / "spaces.csv"
    path.write_text("\n".join([text[0], text[1], "   ", text[2]]) + "\n")
    (_, bad) = validate_file(path).rows
    assert bad["reason"].startswith(f"{path}: line 4 (r2): hidden"), bad["reason"]


def test_a_file_that_is_not_utf8_names_the_line_and_byte(tmp_path: Path) -> None:
    """pandas' decode error gives an offset inside its own read buffer ("position 1"), not the file's line."""
    text = _tiny_csv([_row(), _row(run_id="r2", model="Tiny é")])
    path = tmp_path / "latin1.csv"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(SpecError, match=r"is not UTF-8 text: line 3, byte \d+ is 0xe9"):
        validate_file(path)


def test_rows_are_grouped_by_the_cluster_and_precision_they_ran_on() -> None:
    """ "DGX-H100" and "dgx-h100" are one cluster to the simulator, and were two in the per-cluster figures and in the
    ranking groups, which then lost their rows. Found by a review of ``validate``."""
    rows = [
        _row(cluster="DGX-H100", precision="BF16"),
        _row(run_id="r2", tp=2, dp=4, measured_step_time_s=1.2),
        _row(run_id="r3", tp=4, dp=2, measured_step_time_s=1.5),
    ]
    report = validate_frame(pd.DataFrame(rows), "t.csv")
    assert list(report.summary["by_cluster"]) == ["dgx-h100"]
    assert report.summary["spearman_groups"] == 1


@pytest.mark.parametrize("cell", ["99999999999999999999999", "1e308", "-1e19", "18446744073709551617"])
def test_counts_beyond_two_to_the_53_are_invalid_and_every_format_writes_them(cell: str) -> None:
    """Found by a CLI review: a num_gpus or global_batch of 1e23 read as 99999999999999991611392 (a float's rounding),
    and --format csv / --out then crashed casting it to 64 bits (OverflowError, a traceback and exit 1)."""
    frame = pd.DataFrame([_row(num_gpus=cell), _row(run_id="r2", global_batch=cell)], dtype=object)
    report = validate_frame(frame, "t.csv")
    assert [r["invalid"] for r in report.rows] == [True, True]
    assert "num_gpus" in report.rows[0]["reason"]
    assert "global_batch" in report.rows[1]["reason"]
    assert report.rows_frame()["num_gpus"].isna().tolist() == [True, False]


def test_a_group_the_simulator_cannot_tell_apart_scores_zero_not_nothing() -> None:
    """Three rows whose measured times differ but whose predictions are equal had been dropped from the mean (a
    simulator that cannot tell layouts apart improved its score); they rank nothing, so they count as 0. Groups that
    cannot be ranked at all (equal measured times, or fewer than three rows predicted) are counted apart. Found by a
    review of ``validate``."""
    ranked = [
        _row(run_id=f"a{tp}", tp=tp, dp=8 // tp, measured_step_time_s=t) for tp, t in ((1, 1.0), (2, 1.1), (4, 1.2))
    ]
    blind = [_row(run_id=f"b{i}", model="Tiny B", measured_step_time_s=t) for i, t in enumerate((1.3, 1.2, 1.1))]
    flat = [_row(run_id=f"c{tp}", model="Tiny C", tp=tp, dp=8 // tp, measured_step_time_s=1.0) for tp in (1, 2, 4)]
    summary = validate_frame(pd.DataFrame(ranked + blind + flat), "t.csv").summary
    by_model = {g["model"]: g for g in summary["spearman_by_group"]}
    assert sorted(by_model) == ["Tiny", "Tiny B"]
    assert by_model["Tiny B"]["spearman"] == 0.0
    assert summary["spearman_groups"] == 2
    assert summary["mean_spearman"] == pytest.approx(by_model["Tiny"]["spearman"] / 2)
    assert summary["spearman_groups_unranked"] == 1
    table = format_report(validate_frame(pd.DataFrame(ranked + blind + flat), "t.csv"), "table")
    assert "over 2 groups (1 more could not be ranked)" in table


def test_a_row_of_nothing_but_separators_is_a_blank_line(tmp_path: Path) -> None:
    """A spreadsheet exports an emptied row as ",,,,": it had been reported as an unreadable run ("heads: is
    empty", exit 2). Found by a review of ``validate``."""
    text = _tiny_csv([_row(), _row(run_id="r2", tp=2, dp=4)])
    header, first, second = text.strip().splitlines()
    path = tmp_path / "runs.csv"
    path.write_text("\n".join([header, first, "," * header.count(","), second, ""]))
    report = validate_file(path)
    assert [r["run_id"] for r in report.rows] == ["r1", "r2"]
    assert report.summary["invalid"] == 0
    (tmp_path / "empty.csv").write_text("\n".join([header, "," * header.count(","), ""]))
    with pytest.raises(SpecError, match="has a header but no rows"):
        validate_file(tmp_path / "empty.csv")


@pytest.mark.parametrize(("column", "arch"), [("num_experts", None), ("experts_topk", "dense"), ("num_experts", "moe")])
def test_a_negative_expert_count_is_invalid(column: str, arch: str | None) -> None:
    """num_experts -2 with arch empty had been read as a dense row. Found by a review of ``validate``."""
    changes: dict[str, object] = {column: -2, "arch": arch}
    if arch == "moe":
        changes.update(num_experts=-2, experts_topk=2)
    (row,) = validate_frame(pd.DataFrame([_row(**changes)]), "t.csv").rows
    assert row["invalid"]
    assert f"{column}: must be >= 0, got -2" in row["reason"]


def test_a_cluster_yaml_named_by_a_row_is_found_next_to_the_csv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative cluster path had been read from the working directory, while software_stacks.yaml is looked for
    next to the CSV: the same file predicted from one folder and failed from another. Found by a review."""
    folder = tmp_path / "runs"
    folder.mkdir()
    shipped = Path(__file__).resolve().parents[2] / "hardware_profiles" / "clusters" / "dgx-h100.yaml"
    (folder / "mycl.yaml").write_text(shipped.read_text().replace("name: dgx-h100", "name: mycl"))
    (folder / "runs.csv").write_text(_tiny_csv([_row(cluster="mycl.yaml")]))
    monkeypatch.chdir(tmp_path)
    (row,) = validate_file(folder / "runs.csv", use_stacks=False).rows
    assert row["feasible"], row["reason"]
    assert row["cluster"] == "mycl"


@pytest.mark.parametrize(
    ("changes", "column", "what"),
    [
        ({"cp": 3, "dp": 2, "num_gpus": 6, "global_batch": 6}, "cp", "must split seq_len (256) into 2·cp equal chunks"),
        (
            {"precision": "fp8", "cluster": "dgx-a100-80g"},
            "precision",
            "fp8 needs FP8 tensor cores; A100-SXM4-80GB has none (use bf16 or fp16)",
        ),
        (
            {"precision": "bf16", "cluster": "dgx-v100"},
            "precision",
            "bf16 needs BF16 tensor cores; V100-SXM2-32GB has none (use fp16)",
        ),
    ],
)
def test_a_layout_its_framework_refuses_is_invalid_not_a_miss(changes: dict, column: str, what: str) -> None:
    """A cp that does not split the sequence into 2·cp chunks, or FP8 on an A100, cannot start under Megatron-Core
    and Transformer Engine: such a row has a wrong cell, and had been counted as a run judged infeasible (exit 0)
    while a tp not dividing the heads was invalid (exit 2). Found by a review of ``validate``."""
    (row,) = validate_frame(pd.DataFrame([_row(**changes)]), "t.csv").rows
    assert row["invalid"], row["reason"]
    assert f"{column}: {what}" in row["reason"]


def test_an_invalid_row_is_grouped_under_its_clusters_own_name() -> None:
    """A valid row counted under dgx-h100 and an invalid one under its cell's "DGX-H100": one cluster, two groups in
    the by-cluster figures. Found by a review of ``validate``."""
    rows = [_row(cluster="DGX-H100"), _row(run_id="r2", cluster="DGX-H100", measured_step_time_s=-1)]
    report = validate_frame(pd.DataFrame(rows), "t.csv")
    assert report.rows[1]["invalid"]
    assert list(report.summary["by_cluster"]) == ["dgx-h100"]
    assert report.summary["by_cluster"]["dgx-h100"]["invalid"] == 1


def test_long_source_names_are_printed_whole() -> None:
    """Two sources that differ only after their 70th character printed as one name twice. Found by a review."""
    long = "NVIDIA/NeMo performance summary, a very long description of the table it came from, release "
    rows = [_row(source=long + "24.07"), _row(run_id="r2", source=long + "24.09")]
    table = format_report(validate_frame(pd.DataFrame(rows), "t.csv"), "table")
    assert f"  {long}24.07  rows" in table
    assert f"  {long}24.09  rows" in table


def test_a_group_whose_every_row_is_judged_infeasible_is_unranked_without_a_warning() -> None:
    """The ranking of a group is not attempted with fewer than three predictions: with none, numpy's statistics of
    an empty list had raised a RuntimeWarning (an error under this project's warning filter)."""
    from simulator.validate import summarise

    rows = [
        _row(run_id=f"a{tp}", tp=tp, dp=8 // tp, measured_step_time_s=t) for tp, t in ((1, 1.0), (2, 1.1), (4, 1.2))
    ]
    report = validate_frame(pd.DataFrame(rows), "t.csv")
    judged = [{**r, "feasible": False, "predicted_step_time_s": math.nan} for r in report.rows]
    summary = summarise(judged)
    assert summary["spearman_groups"] == 0
    assert summary["spearman_groups_unranked"] == 1


def test_a_row_naming_a_built_in_model_of_its_shape_takes_that_files_architecture() -> None:
    """An ungated row was completed as Megatron-LM's GPT (GELU, biases, learned positions, tied, dropout), which
    contradicted the sourced models/nemotron-8b.yaml (squared ReLU, no biases, RoPE, untied, no dropout). A row
    naming a built-in model of its shape now takes that file's facts; another shape, or an unknown name, keeps the
    defaults. Found by a review of the project's constants."""
    nemotron = load_model("nemotron-8b")
    shape = {
        "model": "Nemotron-8B",
        "layers": nemotron.layers,
        "hidden": nemotron.hidden,
        "heads": nemotron.heads,
        "kv_heads": nemotron.kv_heads,
        "ffn_hidden": nemotron.ffn_hidden,
        "vocab": nemotron.vocab,
        "gated_mlp": False,
        "seq_len": 4096,
        "tp": 2,
        "dp": 2,
        "num_gpus": 4,
        "global_batch": 8,
    }
    same, other = validate_frame(
        pd.DataFrame([_row(**shape), _row(**{**shape, "run_id": "r2", "layers": 30})]), "t.csv"
    ).rows
    assert same["architecture"] == "models/nemotron-8b.yaml"
    assert other["architecture"] is None
    from simulator.validate import builtin_architecture, row_model

    model, where = builtin_architecture(row_model(pd.Series(_row(**shape)), "t.csv"))
    assert where == "models/nemotron-8b.yaml"
    facts = ("activation", "norm", "bias", "dropout", "position_embedding", "tied_embeddings")
    assert [getattr(model, f) for f in facts] == [getattr(nemotron, f) for f in facts]
    assert model.vocab == nemotron.vocab
