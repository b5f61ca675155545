"""Accuracy against measured runs: predict every row of a validation CSV and summarise the error.

A validation file has one measured training configuration per row (columns described in
``data/validation/README.md``). Each row becomes a model spec, a cluster (with the row's NIC override) and
a plan; empty plan cells are free knobs that :func:`simulator.run.simulate` chooses. Rows whose
architecture columns leave something unsaid take what the built-in model file of that name says, where the row
names one of the same shape (:func:`builtin_architecture`: activation, norm, biases, dropout, positions and tied
embeddings, each sourced in ``models/``; the row's ``architecture`` names the file); the others are completed the
way the model families in the files are built: gated-MLP models are Llama-style (RMSNorm, RoPE, no biases, untied
embeddings, no dropout), ungated ones GPT-style as Megatron-LM builds them (LayerNorm, learned positions, biases,
tied embeddings, dropout 0.1). None of these choices uses the measured times.

A run that really ran cannot have been out of memory. When a row *as stated* does not fit, the stated
configuration must be incomplete (papers often omit memory savers that their framework turns on by
default, such as NeMo's and Megatron-LM's distributed optimizer), so the validator relaxes it in a fixed,
documented order, :data:`RESCUE_STEPS` (distributed optimizer, then sequence parallelism, then
recomputation), takes the first that fits, and reports the row as *adjusted* with what changed (``[stated, used]``;
stated is null where the cell was empty and the default was tried first). The
summary counts adjusted rows; ``strict=True`` turns this off and reports such rows as infeasible.

A validation folder may also hold ``software_stacks.yaml``: per source, facts about how the runs were
executed that the CSV cannot carry (the attention kernel of pre-FlashAttention frameworks), carries
differently from what the framework did (NeMo's distributed optimizer) or leaves empty although the authors'
own launch scripts state it (the micro-batch, interleaving and DDP flavour of the SC21 runs), each with its
evidence. Knobs an entry may set: :data:`STACK_KNOBS`, checked like the same keys of a plan file. Every
entry whose ``match`` is a substring of a row's ``source`` (and whose optional ``model`` is a substring of
the row's ``model``, for facts read from one model's configuration, and whose optional ``columns`` all equal the
row's cells, for a recipe that states the nodes and micro-batch it ran) applies; for each knob the first such
entry that sets it decides, so a model's entry goes before its source's, and the row's ``stack`` names the
first. Stated columns are replaced only for knobs the deciding entry lists under ``override``.

The summary gives the median, mean, 90th percentile and maximum absolute relative error, the number of
rows judged infeasible (a run that really ran and is predicted infeasible is a miss; it has no predicted time,
so it is counted there and not in the |error| figures), the rows that could
not be read (``invalid``: a bad cell, named in the row's ``reason``, or a layout its framework refuses to start,
:func:`_row_rules`; not counted as infeasible) and those
without a measured time (``unmeasured``: predicted, left out of the error figures), breakdowns by
cluster and by source, the mean Spearman rank correlation of predicted vs measured step time inside
groups of rows that share model, cluster, GPU count and global batch (how well layouts are ranked; also
source and precision, since one layout measured on two software releases is not a choice of layout; each group's
own figure under ``spearman_by_group``; a group whose predictions are all equal ranks nothing and counts as 0; groups
of three or more measured rows that cannot be ranked, because rows judged infeasible leave fewer than three
predictions or every measured time is the same, are counted under ``spearman_groups_unranked``), and
which op classes ran on default (uncalibrated) curves in how many rows; each row lists its own under
``uncalibrated``.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import math
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from simulator.errors import InfeasiblePlanError, SpecError, not_utf8
from simulator.parallel.layout import batch_split_problem
from simulator.run import precision_problem, simulate
from simulator.specs._fields import MAX_COUNT, Fields
from simulator.specs._yaml import load_yaml_file, read_spec_bytes
from simulator.specs.hardware import ClusterSpec
from simulator.specs.library import builtin_roots, data_roots, load_cluster, load_model
from simulator.specs.model import ModelSpec, MoESpec
from simulator.specs.plan import TRAINING_KNOBS, PlanSpec, read_knob
from simulator.units import fmt_knob

__all__ = [
    "REQUIRED_COLUMNS",
    "RESCUE_STEPS",
    "STACK_KNOBS",
    "ValidationReport",
    "format_report",
    "stack_overrides",
    "stated_text",
    "validate_file",
    "validate_frame",
]

# Memory savers tried, cumulatively and in this order, when a stated row does not fit (module docstring).
RESCUE_STEPS: tuple[dict[str, Any], ...] = (
    {"zero_stage": 1},
    {"zero_stage": 1, "sequence_parallel": True},
    {"zero_stage": 1, "sequence_parallel": True, "recompute": "selective"},
    {"zero_stage": 1, "sequence_parallel": True, "recompute": "full"},
    {"zero_stage": 2, "sequence_parallel": True, "recompute": "full"},
    {"zero_stage": 3, "sequence_parallel": True, "recompute": "full"},
)
_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}
STACK_KNOBS = TRAINING_KNOBS  # an entry may set any training knob a plan file's reader checks


@dataclass(frozen=True)
class Stack:
    """One entry of ``software_stacks.yaml``."""

    match: str
    name: str
    model: str
    knobs: dict[str, Any]
    override: tuple[str, ...]
    evidence: str
    columns: tuple[tuple[str, int], ...] = ()  # (column, value): the row's cell must hold that whole number

    def applies(self, source: str, model: str, cells: dict[str, int | None]) -> bool:
        """Whether the entry applies to a row with this ``source``, ``model`` and these :data:`STACK_COLUMNS`."""
        return self.match in source and self.model in model and all(cells.get(c) == v for c, v in self.columns)


# The CSV columns an entry's ``columns`` may name: a recipe file states the layout it runs (nodes, micro-batch,
# interleaving), which tells one of a model's rows from another measured with a different recipe.
STACK_COLUMNS = ("num_gpus", "tp", "pp", "dp", "cp", "ep", "vp", "micro_batch", "global_batch", "seq_len")


# Per row, the layout as simulated (after stack knobs, relaxation and the free knobs' choices).
LAYOUT_COLUMNS = ("tp", "pp", "dp", "cp", "ep", "vp", "micro_batch", "seq_len", "recompute", "zero_stage")
LAYOUT_TEXT = ("recompute",)


def load_stacks(path: Path) -> tuple[Stack, ...]:
    """Read a ``software_stacks.yaml`` (see module docstring)."""
    data = load_yaml_file(path)
    f = Fields(data, str(path))
    raw = f.raw("stacks")
    if not isinstance(raw, list):
        raise f.error("stacks", "must be a list of entries", "write '- match: ...' entries")
    out = []
    for i, entry in enumerate(raw):
        e = Fields(entry, str(path), f"stacks[{i}]")
        knobs = e.sub("knobs")
        values: dict[str, Any] = {}
        for key in knobs.data:
            if key not in STACK_KNOBS:
                raise knobs.error(str(key), f"is not a stack knob; use one of {', '.join(STACK_KNOBS)}", "remove it")
            values[key] = read_knob(knobs, str(key))
        override = e.raw("override", [])
        if not isinstance(override, list) or any(not isinstance(k, str) or k not in values for k in override):
            raise e.error("override", "must list knobs that the entry sets", "e.g. override: [zero_stage]")
        cells = e.sub("columns", None)
        columns = []
        for key in cells.data if cells is not None else ():
            if key not in STACK_COLUMNS:
                raise cells.error(
                    str(key), f"is not a column an entry can match; use one of {', '.join(STACK_COLUMNS)}", "remove it"
                )
            columns.append((str(key), cells.integer(str(key), minimum=1)))
        out.append(
            Stack(
                match=e.text("match"),
                name=e.text("name"),
                model=e.text("model", ""),
                knobs=values,
                override=tuple(override),
                evidence=e.text("evidence"),
                columns=tuple(columns),
            )
        )
        e.done()
    f.done()
    return tuple(out)


def default_stacks_file(csv_path: Path) -> Path | None:
    """``software_stacks.yaml`` next to the CSV, else the one shipped with clustersim, found where the built-in
    library is (``data_roots``: the source checkout's ``data/validation``, which the wheel carries under
    ``simulator/_data``), else None."""
    for candidate in (csv_path.parent / "software_stacks.yaml", *(root / SHIPPED_STACKS for root in data_roots())):
        if candidate.is_file():
            return candidate
    return None


SHIPPED_STACKS = Path("data") / "validation" / "software_stacks.yaml"  # relative to a data root


def _stacks_label(chosen: Path | None, given: Path | None, csv_path: Path) -> str | None:
    """The stacks file as a report names it: as given, or next to the CSV, or, for the one found in the built-in
    library, ``clustersim's data/validation/software_stacks.yaml``: its absolute path would make the report depend
    on where clustersim is installed (same inputs, same output bytes)."""
    if chosen is None:
        return None
    builtin = [root / SHIPPED_STACKS for root in builtin_roots()]
    if given is None and chosen != csv_path.parent / "software_stacks.yaml" and chosen in builtin:
        return f"clustersim's {SHIPPED_STACKS.as_posix()}"
    return str(chosen)  # as given, next to the CSV, or in a CLUSTERSIM_PATH folder


def stack_overrides(row: dict[str, Any]) -> dict[str, list[Any]]:
    """The knobs a row's stack entry overrode, ``{knob: [stated, used]}`` (``stack_knobs`` also lists the knobs
    it only filled in, as plain values)."""
    return {k: v for k, v in row.get("stack_knobs", {}).items() if isinstance(v, list)}


def _apply_stacks(plan: PlanSpec, matching: list[Stack], stated: set[str]) -> tuple[PlanSpec, dict[str, Any]]:
    """``plan`` with the knobs of every matching entry (for each knob the first entry that sets it decides), and
    what they set: ``{knob: value}`` for a knob the row left empty, ``{knob: [stated, used]}`` for one the entry
    overrides (reported per row, so that no stated value changes silently)."""
    changes: dict[str, Any] = {}
    decided: set[str] = set()
    for stack in matching:
        for k, v in stack.knobs.items():
            if k not in decided and (k not in stated or k in stack.override):
                changes[k] = v
            decided.add(k)
    shown = {k: [getattr(plan, k), v] if k in stated else v for k, v in changes.items()}
    return (replace(plan, **changes) if changes else plan), shown


REQUIRED_COLUMNS = (
    "run_id",
    "model",
    "layers",
    "hidden",
    "heads",
    "ffn_hidden",
    "vocab",
    "seq_len",
    "cluster",
    "num_gpus",
    "tp",
    "pp",
    "dp",
    "global_batch",
    "precision",
    "measured_step_time_s",
)


@dataclass
class ValidationReport:
    """Per-row predictions and the summary figures."""

    source: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def rows_frame(self) -> pd.DataFrame:
        """The per-row results as a DataFrame (``chosen`` as compact JSON)."""
        frame = pd.DataFrame(self.rows)
        for col in ("chosen", "adjusted", "stack_knobs"):
            if col in frame:
                frame[col] = frame[col].map(lambda c: json.dumps(c, sort_keys=True))
        if "uncalibrated" in frame:
            frame["uncalibrated"] = frame["uncalibrated"].map(";".join)
        for col in ("num_gpus", "global_batch", *(c for c in LAYOUT_COLUMNS if c not in LAYOUT_TEXT)):
            if col in frame:
                # Whole numbers stay whole when an invalid row leaves one empty (pandas would make the column float).
                frame[col] = frame[col].astype("Int64")
        return frame

    def to_dict(self) -> dict[str, Any]:
        """``{"summary": ..., "rows": [...]}`` for JSON output."""
        return {"summary": self.summary, "rows": self.rows}


def _cell(row: pd.Series, col: str) -> Any:
    value = row.get(col)
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, str) and not value.strip():
        return None
    return value


# A number as a CSV cell writes one: ASCII digits, an optional sign, point and exponent. Python's float() also
# takes "1_000", "inf" and other scripts' digits, which in a measured-runs file are typing errors.
_NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def _number(value: Any) -> float | None:
    """``value`` as a float when it is written as a plain decimal number, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    return float(text) if _NUMBER.fullmatch(text) else None


def _int(row: pd.Series, col: str, where: str, default: int | None = None) -> int | None:
    value = _cell(row, col)
    if value is None:
        return default
    number = _number(value)
    if number is None or not math.isfinite(number) or not number.is_integer():
        raise SpecError(f"{where}: {col}", f"must be a whole number, got {value!r}", "fix the cell")
    return int(number)


def _positive_or_none(row: pd.Series, col: str, where: str, empty_means: str) -> int | None:
    """An optional count: None when empty, else a whole number >= 1 (0 is not "unset" in a CSV cell)."""
    value = _int(row, col, where)
    if value is not None and value < 1:
        raise SpecError(
            f"{where}: {col}", f"must be >= 1, got {value}", f"fix the cell, or leave it empty for {empty_means}"
        )
    return value


def _int_or_none(row: pd.Series, col: str, where: str) -> int | None:
    """``_int`` for a cell that only labels the row: None where the cell is not a whole number, or one past 2^53,
    where a float no longer counts whole numbers (1e23 reads as 99999999999999991611392) and a column of them
    overflows the 64-bit integers of the CSV and Parquet output (the row's own reading reports the cell)."""
    try:
        value = _int(row, col, where)
    except SpecError:
        return None
    return value if value is None or abs(value) <= MAX_COUNT else None


def _required_int(row: pd.Series, col: str, where: str) -> int:
    value = _int(row, col, where)
    if value is None:
        raise SpecError(f"{where}: {col}", "is empty", f"fill {col}: it is required (data/validation/README.md)")
    return value


def _bool(row: pd.Series, col: str, where: str) -> bool | None:
    value = _cell(row, col)
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise SpecError(f"{where}: {col}", f"must be true or false, got {value!r}", "fix the cell")


def _measured(row: pd.Series, where: str) -> tuple[float, SpecError | None]:
    """The row's measured seconds (NaN when the cell is empty: predicted, left out of the error figures),
    or the error that makes the row invalid."""
    value = _cell(row, "measured_step_time_s")
    if value is None:
        return math.nan, None
    number = _number(value)
    seconds = math.nan if number is None else number
    if math.isfinite(seconds) and seconds >= MIN_MEASURED_S:
        return seconds, None
    return math.nan, SpecError(
        f"{where}: measured_step_time_s",
        f"must be a number of seconds of at least {MIN_MEASURED_S:g}, got {value!r}",
        "write the measured seconds per optimizer step, or leave the cell empty to predict the row unmeasured",
    )


# A training step takes at least one kernel launch (microseconds); below that a cell is a unit mix-up (or so small that
# the relative error of any prediction overflows).
MIN_MEASURED_S = 1e-6


def _row_rules(
    model: ModelSpec,
    plan: PlanSpec,
    row: pd.Series,
    where: str,
    stack_knobs: Iterable[str] = (),
    cluster: ClusterSpec | None = None,
) -> None:
    """Rules a run that really ran cannot break, because its framework refuses to start without them (Megatron-LM
    ``arguments.py`` and ``TransformerConfig``): a row that breaks one has a wrong cell, and is invalid, not a
    miss. Only what the row states (its cells, and the knobs its software stack sets, ``stack_knobs``) is checked;
    a free micro-batch is the validator's to choose."""
    stated_mb = _cell(row, "micro_batch") is not None or "micro_batch" in stack_knobs
    if split := batch_split_problem(plan.global_batch, plan.dp, plan.micro_batch if stated_mb else None):
        raise SpecError(f"{where}: global_batch", split, "fix global_batch, dp or micro_batch")
    if plan.cp > 1 and model.seq_len % (2 * plan.cp):
        # Megatron-Core's context parallelism splits each sequence into 2·cp chunks for causal load balance (TE's
        # attention asserts the per-rank length is even), so such a run cannot start.
        raise SpecError(
            f"{where}: cp",
            f"must split seq_len ({model.seq_len}) into 2·cp equal chunks (Megatron-Core's load-balanced context "
            f"parallelism), got {plan.cp}",
            "fix cp or seq_len",
        )
    if cluster is not None and (problem := precision_problem(cluster, plan.precision)):
        raise SpecError(f"{where}: precision", problem.removeprefix("precision "), "fix precision or cluster")
    if model.heads % plan.tp or model.kv_heads % plan.tp:
        raise SpecError(
            f"{where}: tp",
            f"must divide heads ({model.heads}) and kv_heads ({model.kv_heads}) (Megatron-Core splits both over tp), "
            f"got {plan.tp}",
            "fix tp, heads or kv_heads",
        )
    if plan.ep > 1 and model.moe is None:
        raise SpecError(
            f"{where}: ep", f"needs a MoE model, got ep={plan.ep} for a dense row", "set ep to 1, or arch to moe"
        )
    if model.moe is not None and model.moe.num_experts % plan.ep:
        # arguments.py: "num_experts must be divisible by expert_model_parallel_size".
        raise SpecError(
            f"{where}: ep",
            f"must divide num_experts ({model.moe.num_experts}) (Megatron-LM asserts it), got {plan.ep}",
            "fix ep or num_experts",
        )
    if plan.ep > 1 and (plan.tp * plan.dp * plan.cp) % plan.ep:
        # parallel_state.initialize_model_parallel: a stage's tp·dp·cp ranks are regrouped as expert_tp·ep·edp,
        # so ep must divide them even with expert_tp 1 (MoE parallel folding; the README's column contract).
        raise SpecError(
            f"{where}: ep",
            f"must divide a pipeline stage's tp·dp·cp ({plan.tp * plan.dp * plan.cp}) (Megatron-Core's expert "
            f"groups split those ranks), got {plan.ep}",
            "fix ep, tp, dp or cp",
        )


# The model fields whose CSV column has another name (the others are named alike).
_MODEL_COLUMNS = {"name": "model", "top_k": "experts_topk", "expert_ffn_hidden": "ffn_hidden"}


def row_model(row: pd.Series, where: str) -> ModelSpec:
    """The model a validation row describes (see the module docstring for unstated choices)."""
    arch = _cell(row, "arch")
    if arch is not None and str(arch).lower() not in ("dense", "moe"):
        raise SpecError(
            f"{where}: arch", f"must be dense or moe, got {arch!r}", "fix the cell (data/validation/README.md)"
        )
    gated = bool(_bool(row, "gated_mlp", where))
    experts = _int(row, "num_experts", where)
    # Every cell is read first, so that a bad one is named once, by its column.
    heads = _required_int(row, "heads", where)
    layers = _required_int(row, "layers", where)
    hidden = _required_int(row, "hidden", where)
    ffn_hidden = _required_int(row, "ffn_hidden", where)
    vocab = _required_int(row, "vocab", where)
    seq_len = _required_int(row, "seq_len", where)
    kv_heads = _positive_or_none(row, "kv_heads", where, "as many as heads")
    head_dim = _positive_or_none(row, "head_dim", where, "hidden / heads")
    top_k = _int(row, "experts_topk", where)
    try:
        moe = None
        for column, value in (("num_experts", experts), ("experts_topk", top_k)):
            if value is not None and value < 0:
                # 0 and 1 stand for "no experts" in a dense row (a convention some files follow); below 0 is no count.
                raise SpecError(column, f"must be >= 0, got {value}", "fill the count, or leave it empty for dense")
        dense = arch is not None and str(arch).lower() == "dense"
        if dense and (experts or 0) > 1:
            raise SpecError("arch", f"is dense, but num_experts is {experts}", "set arch to moe, or empty num_experts")
        if dense and (top_k or 0) > 1:
            raise SpecError("arch", f"is dense, but experts_topk is {top_k}", "set arch to moe, or empty experts_topk")
        if str(arch or "dense").lower() == "moe" or (experts or 0) > 1:
            if not experts:
                raise SpecError("num_experts", "is required for a MoE row", "fill num_experts")
            if top_k is None:
                # Not guessed: top-1 and top-8 routing of one model differ nearly threefold in step time.
                raise SpecError("experts_topk", "is required for a MoE row", "fill experts_topk (experts per token)")
            moe = MoESpec(num_experts=experts, top_k=top_k, expert_ffn_hidden=ffn_hidden)
        return ModelSpec(
            name=str(_cell(row, "model") or "model"),
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads or heads,
            head_dim=head_dim or 0,
            ffn_hidden=ffn_hidden,
            vocab=vocab,
            gated_mlp=gated,
            activation="swiglu" if gated else "gelu",
            norm="rmsnorm" if gated else "layernorm",
            tied_embeddings=not gated,
            position_embedding="rope" if gated else "learned",
            bias=not gated,
            dropout=not gated,
            seq_len=seq_len,
            moe=moe,
        )
    except SpecError as err:  # a rule of the model spec, named by the row's own columns
        fix = err.fix
        for name, column in _MODEL_COLUMNS.items():
            fix = re.sub(rf"\b{name}\b", column, fix)
        raise SpecError(f"{where}: {_MODEL_COLUMNS.get(err.where, err.where)}", err.what, fix) from None


# The architecture facts a validation CSV has no column for, taken from a built-in model file where the row names
# that model (builtin_architecture).
_ARCHITECTURE_FACTS = ("activation", "norm", "tied_embeddings", "position_embedding", "bias", "dropout")
_SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "gated_mlp")


def _name_key(name: str) -> str:
    """A model name for matching: lower case, letters, digits and dots only ('LLAMA3-8B', 'Llama 3 8B': llama38b)."""
    return re.sub(r"[^a-z0-9.]", "", name.lower())


@functools.lru_cache(maxsize=1)
def _builtin_models_by_key() -> dict[str, str]:
    from simulator.specs.library import list_names

    return {_name_key(name): name for name, _ in list_names("model")}


def builtin_architecture(model: ModelSpec) -> tuple[ModelSpec, str | None]:
    """``model`` with the architecture facts of the built-in model it names (``models/<name>.yaml``, each fact with
    its source there) in place of the GPT or Llama defaults (module docstring), and that file's name; ``model`` and
    None where the row names no built-in model, or one of another shape (a name alone is not trusted: the row's
    layers, hidden, heads, kv_heads, head_dim, ffn_hidden and gated_mlp must all agree, and both be dense or both
    MoE). The row's vocabulary, sequence length and experts stay its own. Nemotron's squared ReLU, bias-free layers,
    RoPE and untied embeddings, MPT's and BLOOM's ALiBi had been completed as GPT's GELU, biases and learned
    positions (a review of the project's constants)."""
    name = _builtin_models_by_key().get(_name_key(model.name))
    if name is None:
        return model, None
    ref = load_model(name)
    same_shape = all(getattr(ref, f) == getattr(model, f) for f in _SHAPE_FIELDS)
    if not same_shape or (ref.moe is None) != (model.moe is None):
        return model, None
    return replace(model, **{f: getattr(ref, f) for f in _ARCHITECTURE_FACTS}), f"models/{name}.yaml"


# Plan columns the contract requires: an empty cell is a gap in the row, not a knob left free.
_REQUIRED_PLAN_CELLS = ("num_gpus", "tp", "pp", "dp", "global_batch", "precision")


def row_plan(row: pd.Series, where: str) -> PlanSpec:
    """The plan a validation row describes; empty plan cells stay free."""
    for col in _REQUIRED_PLAN_CELLS:
        if _cell(row, col) is None:
            raise SpecError(f"{where}: {col}", "is empty", f"fill {col}: it is required (data/validation/README.md)")
    data: dict[str, Any] = {}
    for col in ("tp", "pp", "dp", "cp", "ep", "vp", "micro_batch", "global_batch", "zero_stage", "seq_len"):
        value = _int(row, col, where)
        if value is not None:
            data[col] = value
    for col in ("sequence_parallel", "grad_overlap", "grad_accum_fusion"):
        value_b = _bool(row, col, where)
        if value_b is not None:
            data[col] = value_b
    for col in ("recompute", "precision", "attention"):
        value = _cell(row, col)
        if value is not None:
            data[col] = str(value).strip()
    gpus = _int(row, "num_gpus", where)
    plan = PlanSpec.from_mapping(data, where, gpus=None)
    if gpus is not None and plan.num_gpus != gpus:  # in the CSV's own terms (simulate's says --gpus and dp)
        raise SpecError(
            f"{where}: num_gpus",
            f"must equal tp·pp·dp·cp: num_gpus={gpus}, tp·pp·dp·cp={plan.num_gpus}",
            "fix num_gpus or the degrees",
        )
    return plan


def row_cluster(
    row: pd.Series, where: str, cache: dict[tuple[str, int | None], ClusterSpec], folder: Path | None = None
) -> ClusterSpec:
    """The row's cluster, with ``nics_per_node`` overridden when the row sets it. A relative YAML path is looked for
    next to the CSV (``folder``) first, as ``software_stacks.yaml`` is, so that a file gives the same answer from
    any working directory."""
    name = str(_cell(row, "cluster") or "")
    if not name:
        raise SpecError(
            f"{where}: cluster", "is empty", "fill cluster (a name `clustersim hardware list` shows, or a YAML)"
        )
    nics = _positive_or_none(row, "nics_per_node", where, "the cluster profile's own count")
    try:
        if folder is not None and not Path(name).is_absolute() and (folder / name).is_file():
            name = str(folder / name)
        key = (name, nics)
        if key not in cache:
            cache[key] = load_cluster(name, {"nics_per_node": nics} if nics is not None else None)
    except SpecError as err:
        raise SpecError(f"{where}: cluster", f"{err.where}: {err.what}", err.fix) from None
    except (OSError, ValueError) as err:
        # A cell no file system takes as a name (300 characters, a NUL byte): this row is invalid, the run goes on
        # (it had ended the whole run at its first such row).
        raise SpecError(
            f"{where}: cluster", f"{name[:80]!r} is no cluster name or path ({err})", "fix the cell"
        ) from None
    return cache[key]


def _relaxed(plan: PlanSpec, step: dict[str, Any]) -> PlanSpec | None:
    """``plan`` with the memory savers of ``step`` applied where they save memory, or None if none does."""
    changes: dict[str, Any] = {}
    if step.get("zero_stage", 0) > plan.zero_stage:
        changes["zero_stage"] = step["zero_stage"]
    if step.get("sequence_parallel") and plan.tp > 1 and plan.sequence_parallel is False:
        changes["sequence_parallel"] = True
    wanted = step.get("recompute")
    if wanted and plan.recompute is not None and _RECOMPUTE_RANK[wanted] > _RECOMPUTE_RANK[plan.recompute]:
        changes["recompute"] = wanted
        changes["recompute_layers"] = None  # every layer: the most the step can save
    return replace(plan, **changes) if changes else None


def simulate_row(
    model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, *, strict: bool = False
) -> tuple[Any, dict[str, Any]]:
    """Simulate a row; when it does not fit as stated, relax it (see module docstring).

    Returns the result and ``{knob: [stated, used]}`` for every knob that was changed.
    """
    result = simulate(model, cluster, plan)
    if result.feasible or strict:
        return result, {}
    seen: set[PlanSpec] = set()
    for step in RESCUE_STEPS:
        trial = _relaxed(plan, step)
        if trial is None or trial in seen:
            continue
        seen.add(trial)
        attempt = simulate(model, cluster, trial)
        if attempt.feasible:
            adjusted = {
                k: [getattr(plan, k), getattr(trial, k)]
                for k in ("zero_stage", "sequence_parallel", "recompute")
                if getattr(plan, k) != getattr(trial, k)
            }
            return attempt, adjusted
    return result, {}


def validate_frame(
    frame: pd.DataFrame,
    source: str,
    *,
    strict: bool = False,
    stacks: tuple[Stack, ...] = (),
    lines: list[int] | None = None,
    folder: Path | None = None,
) -> ValidationReport:
    """Predict every row of ``frame``; rows that cannot be simulated are reported with their reason.

    ``lines`` gives each row's line in the file (where blank lines or quoted line breaks come before it);
    without it, row i is named as line i + 2, under the header. ``folder`` (the CSV's) is where a cluster cell's
    relative YAML path is looked for first.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        found = [str(c) for c in frame.columns]
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        raise SpecError(
            source,
            f"missing column(s): {', '.join(missing)} (the header has: {shown or 'nothing'})",
            "name the columns as data/validation/README.md does",
        )
    row_lines = lines if lines is not None and len(lines) == len(frame) else [i + 2 for i in range(len(frame))]
    at: dict[str, list[int]] = {}
    for value, line in zip(frame["run_id"], row_lines, strict=True):  # a required column, checked above
        if isinstance(value, str) and value.strip():
            at.setdefault(value.strip(), []).append(line)
    repeated = sorted(i for i, found in at.items() if len(found) > 1)
    if repeated:
        # One run counted twice weighs twice in the median and p90; a repeated measurement needs an id of its own.
        named = [f"{i} (lines {', '.join(map(str, at[i]))})" for i in repeated[:5]]
        shown = ", ".join(named) + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else "")
        raise SpecError(source, f"repeats run_id {shown}", "give every row its own run_id, or remove the copies")
    report = ValidationReport(source=source)
    clusters: dict[tuple[str, int | None], ClusterSpec] = {}
    matches_columns = any(st.columns for st in stacks)  # whether any entry reads a row's layout cells
    for position, (_, row) in enumerate(frame.iterrows()):
        line = row_lines[position]
        where = f"{source}: line {line} ({_cell(row, 'run_id') or 'no run_id'})"
        measured, bad_measure = _measured(row, where)
        entry: dict[str, Any] = {
            "run_id": str(_cell(row, "run_id") or ""),
            "model": str(_cell(row, "model") or ""),
            "cluster": str(_cell(row, "cluster") or ""),
            "source": str(_cell(row, "source") or ""),
            # Identification only: a bad cell here is reported by row_plan below, as this row's reason.
            "num_gpus": _int_or_none(row, "num_gpus", where),
            "global_batch": _int_or_none(row, "global_batch", where),
            "precision": str(_cell(row, "precision") or ""),
            "measured_step_time_s": measured,
            "architecture": None,  # the built-in model file the architecture facts came from (builtin_architecture)
            "stack": None,  # the software_stacks.yaml entry that matched the row, and what it set
            "stack_knobs": {},
        }
        try:
            if bad_measure is not None:
                raise bad_measure
            model, entry["architecture"] = builtin_architecture(row_model(row, where))
            cluster = row_cluster(row, where, clusters, folder)
            plan = row_plan(row, where)
            _row_rules(model, plan, row, where, cluster=cluster)
            # Grouped by what was simulated: "DGX-H100" and "dgx-h100" (or "BF16" and "bf16") are one cluster.
            entry.update(cluster=cluster.name, precision=plan.precision)
            row_source = str(_cell(row, "source") or "")
            row_name = str(_cell(row, "model") or "")
            cells = {c: _int_or_none(row, c, where) for c in STACK_COLUMNS} if matches_columns else {}
            matching = [st for st in stacks if st.applies(row_source, row_name, cells)]
            if matching:
                stated = {k for k in STACK_KNOBS if _cell(row, k) is not None}
                try:
                    plan, entry["stack_knobs"] = _apply_stacks(plan, matching, stated)
                    # A stack's knob that breaks a rule the framework enforces makes the row as unrunnable as a cell.
                    _row_rules(model, plan, row, where, entry["stack_knobs"], cluster)
                except SpecError as err:  # the row's cells and its stack's knobs contradict each other
                    raise SpecError(
                        f"{where}: {err.where.removeprefix(f'{where}: ')} (set by software stack {matching[0].name!r})",
                        err.what,
                        f"{err.fix}, in the row or in the stack entry; or validate with --no-stacks",
                    ) from None
                entry["stack"] = matching[0].name
            result, adjusted = simulate_row(model, cluster, plan, strict=strict)
            for knob in adjusted:
                if _cell(row, knob) is None and knob not in entry["stack_knobs"]:
                    adjusted[knob][0] = None  # an empty cell, simulated at the default first: not a stated value
            predicted = result.step_time_s if result.feasible else math.nan
            entry.update(
                adjusted=adjusted,
                predicted_step_time_s=predicted,
                error=(predicted - measured) / measured if result.feasible else math.nan,
                feasible=result.feasible,
                invalid=False,
                reason=result.reason,
                chosen=result.chosen,
                mfu=result.mfu if result.feasible else math.nan,
                uncalibrated=sorted(result.uncalibrated_ops),
            )
            # The layout as simulated (stack knobs, relaxation and the free knobs' choices applied), for plotting
            # the error against it without joining back onto the input.
            entry.update({key: getattr(result.plan, key) for key in LAYOUT_COLUMNS})
        except (InfeasiblePlanError, SpecError) as err:
            # Every reason names its file and line; a rule checked deeper down (the plan's own) may not.
            reason = str(err) if str(err).startswith(f"{source}: ") else f"{where}: {err}"
            entry.update(
                adjusted={},
                predicted_step_time_s=math.nan,
                error=math.nan,
                feasible=False,
                invalid=isinstance(err, SpecError),
                reason=reason,
                chosen={},
                mfu=math.nan,
                uncalibrated=[],
            )
            entry.update(dict.fromkeys(LAYOUT_COLUMNS))
            if entry["cluster"]:
                # Grouped by the cluster's own name, as the rows that ran are ("DGX-H100" is dgx-h100), where the
                # cell names one (loaded once per file); a cell that names none stays as written.
                with contextlib.suppress(SpecError):
                    entry["cluster"] = row_cluster(row, where, clusters, folder).name
        report.rows.append(entry)
    report.summary = summarise(report.rows)
    return report


SEPARATORS = (",", ";", "\t")


def _separator(text: str) -> str:
    """The field separator: ``,`` as the README specifies, or ``;`` / tab where the header has no comma but
    one of those (spreadsheets export that way in many locales)."""
    lines = text.splitlines()  # CR-only line endings (older Excel for Mac) end a line too
    header = lines[0] if lines else ""
    if "," in header:
        return ","
    return next((sep for sep in (";", "\t") if sep in header), ",")


def _width(line: str, sep: str) -> int:
    """How many fields ``line`` has when it is split at ``sep``."""
    return len(next(csv.reader([line], delimiter=sep), []))


def _records(path: Path, text: str, sep: str) -> tuple[list[str], list[int], str]:
    """The header's names, the line each non-blank record starts on (as pandas reads them: blank lines skipped, a
    quoted line break kept inside its cell), and what is wrong where the first record is longer than the header
    (for the error pandas raises then). Raises SpecError for a file whose header and rows use different separators
    (a short row that another separator would split into the header's width)."""
    long = ""
    try:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep)
        header = next(reader, [])
        starts: list[int] = []
        begin = reader.line_num + 1
        for record in reader:
            # pandas skips a line of nothing but spaces as it skips an empty one (a row of empty cells it keeps).
            if record and not (len(record) == 1 and not record[0].strip()):
                if len(record) > len(header) and not long:
                    long = f"line {begin} has {len(record)} fields, the header {len(header)}"
                if len(record) < len(header):
                    line = sep.join(record)
                    other = next((o for o in SEPARATORS if o != sep and _width(line, o) >= len(header)), None)
                    if other is not None:
                        raise SpecError(
                            str(path),
                            f"the header is separated by {sep!r} but line {begin} by {other!r}",
                            "use one separator throughout the file",
                        )
                    # pandas pads a short row with empty cells, so a lost trailing cell (the measured time, say)
                    # would go unnoticed; a CSV writer writes every field, empty ones as nothing between separators.
                    raise SpecError(
                        str(path),
                        f"line {begin} has {len(record)} fields, the header {len(header)}",
                        f"write every field, empty ones as nothing between two {sep!r}; close every quote you open",
                    )
                starts.append(begin)
            begin = reader.line_num + 1
    except csv.Error:
        return [], [], "a row has more fields than the header"  # read_csv reports what else is wrong
    return header, starts, long or f"a row has more fields than the header's {len(header)}"


# The most a validation CSV may hold: the shipped files are under 1 MiB (1,440 runs in 0.4 MiB); a device such as
# /dev/zero, or a multi-GiB file named by mistake, would otherwise be read until memory runs out.
MAX_CSV_BYTES = 64 * 2**20


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, read once (so that a pipe, /dev/stdin or <(...), can be validated too)."""
    try:
        return read_spec_bytes(
            path,
            MAX_CSV_BYTES,
            ("hundreds of thousands of runs (the wrong file?)", "name a validation CSV, or split a larger one"),
        )
    except FileNotFoundError:
        raise SpecError(str(path), "file not found", "check the path") from None
    except IsADirectoryError:
        raise SpecError(str(path), "is a directory, not a file", "name the CSV file") from None
    except OSError as err:
        reason = err.strerror or err.__class__.__name__
        raise SpecError(str(path), f"cannot be read ({reason})", "check the path and its permissions") from None


def validate_file(
    path: Path, *, strict: bool = False, stacks_file: Path | None = None, use_stacks: bool = True
) -> ValidationReport:
    """Read a validation CSV and predict every row."""
    data = _read_bytes(path)
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or (len(data) > 1 and b"\x00" in data[:2]):
        # UTF-16 (Excel's "Unicode text"): decoded as UTF-8 it was one field per line, reported as a field count.
        raise SpecError(str(path), "is UTF-16 text, not UTF-8", "save the file as UTF-8 (CSV UTF-8 in Excel)")
    text = data.decode("utf-8-sig", errors="replace")
    sep = _separator(text)
    header, lines, long_row = _records(path, text, sep)
    try:
        with warnings.catch_warnings():
            # Rows longer than the header would otherwise turn the first column(s) into the index, silently.
            warnings.simplefilter("error", pd.errors.ParserWarning)
            frame = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False, sep=sep, index_col=False)
    except pd.errors.ParserWarning:
        raise SpecError(str(path), long_row, "quote cells that contain the separator") from None
    except UnicodeDecodeError:
        raise SpecError(str(path), not_utf8(data), "save the file as UTF-8") from None
    except pd.errors.ParserError as err:
        detail = " ".join(str(err).replace("Error tokenizing data. C error: ", "").split())
        raise SpecError(
            str(path),
            f"is not a readable CSV ({detail}; pandas counts rows from 0 after the header)",
            "quote cells that contain the separator, and close every quote you open",
        ) from None
    except pd.errors.EmptyDataError:
        raise SpecError(str(path), "is empty", "give a CSV with a header row") from None
    if frame.empty:
        raise SpecError(str(path), "has a header but no rows", "add one measured run per line below the header")
    # Hand-edited headers ("run_id , model", "Run_ID") name the same columns. The names are the file's own where
    # the csv reader got them: pandas renames a repeated name ("tp.1"), which would hide it from this check.
    names = [str(c).strip().lower() for c in (header if len(header) == len(frame.columns) else frame.columns)]
    twice = sorted({n for n in names if n and names.count(n) > 1})
    if twice:
        raise SpecError(str(path), f"names column(s) {', '.join(twice)} more than once", "keep one of each")
    frame.columns = [str(c).strip().lower() for c in frame.columns]
    # ... and hand-edited cells ("dgx-h100 ") the same values.
    frame = frame.apply(lambda column: column.str.strip()).replace("", np.nan)
    # A row of nothing but separators (a spreadsheet's export of an emptied row) is a blank line, not a run.
    kept = frame.notna().any(axis=1).to_numpy()
    if not kept.all():
        if len(lines) == len(frame):
            lines = [line for line, keep in zip(lines, kept, strict=True) if keep]
        frame = frame[kept].reset_index(drop=True)
        if frame.empty:
            raise SpecError(str(path), "has a header but no rows", "add one measured run per line below the header")
    stacks: tuple[Stack, ...] = ()
    chosen = (stacks_file or default_stacks_file(path)) if use_stacks else None
    if chosen is not None:
        stacks = load_stacks(chosen)
    report = validate_frame(frame, str(path), strict=strict, stacks=stacks, lines=lines, folder=path.parent)
    # Which facts about the runs' software were applied, so that two reports can be told apart.
    report.summary["stacks_file"] = _stacks_label(chosen, stacks_file, path)
    report.summary["stacks_used"] = "file" if chosen is not None else ("off" if not use_stacks else "none found")
    return report


def _stats(errors: list[float]) -> dict[str, Any]:
    if not errors:  # every key still there (null in JSON), so that a file's summary has one shape
        figures = ("median_abs_error", "mean_abs_error", "p90_abs_error", "max_abs_error", "mean_signed_error")
        return {"rows": 0, **dict.fromkeys(figures, math.nan)}
    a = np.abs(np.array(errors))
    return {
        "rows": len(errors),
        "median_abs_error": float(np.median(a)),
        "mean_abs_error": float(np.mean(a)),
        "p90_abs_error": float(np.percentile(a, 90)),
        "max_abs_error": float(np.max(a)),
        "mean_signed_error": float(np.mean(errors)),
    }


def _group_figures(grp: list[dict[str, Any]]) -> dict[str, Any]:
    """A cluster's or source's figures: rows counts every row of the group, as at the top; scored those with an
    error (predicted and measured), which the error figures are over."""
    errors = [r["error"] for r in grp if r.get("feasible") and math.isfinite(r["error"])]
    return {
        **_stats(errors),
        "rows": len(grp),
        "scored": len(errors),
        "infeasible": sum(1 for r in grp if not r.get("feasible") and not r.get("invalid")),
        "invalid": sum(1 for r in grp if r.get("invalid")),
    }


def _spearman(pred: list[float], meas: list[float]) -> float:
    """Spearman's rho (average ranks for ties); NaN where the measured times are all equal (nothing to rank), 0
    where only the predictions are (the simulator cannot tell the layouts apart: it ranks nothing)."""
    p = pd.Series(pred).rank().to_numpy()
    m = pd.Series(meas).rank().to_numpy()
    if np.std(m) == 0:
        return math.nan
    if np.std(p) == 0:
        return 0.0
    return float(np.corrcoef(p, m)[0, 1])


NOT_GIVEN = "(not given)"  # the group of rows whose cluster or source cell is empty or whose file lacks the column


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Summary figures over per-row results (see module docstring)."""
    predicted = [r for r in rows if r.get("feasible")]
    # Error figures need a measurement; a row without one is still predicted (and counted as such).
    ok = [r for r in predicted if math.isfinite(r["measured_step_time_s"])]
    invalid = sum(1 for r in rows if r.get("invalid"))
    summary: dict[str, Any] = {
        "rows": len(rows),
        "predicted": len(predicted),
        "infeasible": len(rows) - len(predicted) - invalid,
        "invalid": invalid,
        "unmeasured": len(predicted) - len(ok),
        "adjusted": sum(1 for r in rows if r.get("adjusted")),
        "stack_overridden": sum(1 for r in rows if stack_overrides(r)),
    }
    summary.update({k: v for k, v in _stats([r["error"] for r in ok]).items() if k != "rows"})
    for key in ("cluster", "source"):
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault(str(r.get(key) or NOT_GIVEN), []).append(r)
        summary[f"by_{key}"] = {name: _group_figures(grp) for name, grp in sorted(groups.items())}
    layout_groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("invalid") or not math.isfinite(r["measured_step_time_s"]):
            continue
        # The same layout measured with two software releases (or precisions) is not a choice between layouts.
        group = (r["model"], r["cluster"], r["num_gpus"], r["global_batch"], r["source"], r["precision"])
        layout_groups.setdefault(group, []).append(r)
    rhos = []
    per_group = []
    unranked = 0
    for group, measured in layout_groups.items():
        if len(measured) < 3:
            continue
        grp = [r for r in measured if r.get("feasible")]
        rho = math.nan
        if len(grp) >= 3:
            rho = _spearman([r["predicted_step_time_s"] for r in grp], [r["measured_step_time_s"] for r in grp])
        if math.isnan(rho):
            # Three measured layouts that cannot be ranked: rows judged infeasible (each counted as a miss already)
            # leave fewer than three predictions, or every measured time is the same.
            unranked += 1
            continue
        rhos.append(rho)
        # Each group's own figure, so that a poor mean can be traced to the layouts it ranks badly.
        keys = ("model", "cluster", "num_gpus", "global_batch", "source", "precision")
        per_group.append({**dict(zip(keys, group, strict=True)), "rows": len(grp), "spearman": rho})
    summary["spearman_groups"] = len(rhos)
    summary["spearman_groups_unranked"] = unranked
    summary["mean_spearman"] = float(np.mean(rhos)) if rhos else math.nan
    summary["spearman_by_group"] = per_group
    counts: dict[str, int] = {}
    for r in predicted:
        for label in r.get("uncalibrated", ()):
            counts[label] = counts.get(label, 0) + 1
    summary["uncalibrated_rows"] = sum(1 for r in predicted if r.get("uncalibrated"))
    summary["uncalibrated"] = dict(sorted(counts.items()))
    return summary


def _signed_pct(fraction: float) -> str:
    """``+1.2%``; an error that rounds to zero is ``+0.0%``, never ``-0.0%``; beyond ±1,000,000% (a measured
    time of 1e-300 s, say) the table says ``>+1e6%`` instead of a 300-digit number (JSON and CSV keep the value)."""
    if abs(fraction) >= 1e4:
        return ">+1e6%" if fraction > 0 else "<-1e6%"
    text = f"{fraction * 100:+.1f}%"
    return "+0.0%" if text == "-0.0%" else text


def format_report(report: ValidationReport, fmt: str) -> str:
    """Render as ``table``, ``json`` or ``csv``."""
    if fmt == "json":
        return json.dumps(_clean(report.to_dict()), indent=2)
    if fmt == "csv":
        return str(report.rows_frame().to_csv(index=False)).rstrip("\n")
    lines = [
        f"{'run_id':<18}{'model':<28}{'cluster':<14}{'GPUs':>6}"
        f"{'measured':>11}{'predicted':>11}{'error':>9}  chosen / reason"
    ]
    for r in report.rows:
        pred = r["predicted_step_time_s"]
        err = r["error"]
        notes = [r["reason"] if not r["feasible"] else ", ".join(f"{k}={fmt_knob(v)}" for k, v in r["chosen"].items())]
        if r.get("stack"):
            notes.append(f"stack: {r['stack']}")
            overridden = stack_overrides(r)
            if overridden:
                notes[-1] += " (overrides " + ", ".join(f"{k} {a}->{b}" for k, (a, b) in overridden.items()) + ")"
        if r.get("adjusted"):
            notes.append(
                "adjusted to fit: " + ", ".join(f"{k} {stated_text(a)}->{b}" for k, (a, b) in r["adjusted"].items())
            )
        note = " | ".join(n for n in notes if n)
        meas = r["measured_step_time_s"]
        gpus = "?" if r["num_gpus"] is None else r["num_gpus"]
        run_id, model, cluster = (_one_line(r[k]) for k in ("run_id", "model", "cluster"))
        lines.append(
            f"{run_id:<18}{model[:27]:<28}{cluster:<14}{gpus:>6}"
            f"{'' if math.isnan(meas) else f'{meas:.4g}':>11}{'' if math.isnan(pred) else f'{pred:.4g}':>11}"
            f"{'' if math.isnan(err) else _signed_pct(err):>9}  {_one_line(note)}"
        )
    s = report.summary
    lines.append("")
    extra = "".join(f", {key} {s[key]}" for key in ("invalid", "unmeasured") if s.get(key))
    lines.append(
        f"rows {s['rows']}, predicted {s['predicted']}, infeasible {s['infeasible']}{extra}, adjusted to fit "
        f"{s['adjusted']}; |error| median "
        f"{_pct(s.get('median_abs_error'))}, mean {_pct(s.get('mean_abs_error'))}, p90 {_pct(s.get('p90_abs_error'))}, "
        f"max {_pct(s.get('max_abs_error'))}; within-group Spearman {_num(s.get('mean_spearman'))} "
        f"over {s['spearman_groups']} groups"
        + (f" ({s['spearman_groups_unranked']} more could not be ranked)" if s.get("spearman_groups_unranked") else "")
    )
    if "stacks_used" in s:
        matched = sum(1 for r in report.rows if r.get("stack"))
        lines.append(
            f"software stacks: {s['stacks_file']} ({matched} of {s['rows']} rows matched an entry)"
            if s["stacks_used"] == "file"
            else "software stacks: ignored (--no-stacks); rows simulated as stated"
            if s["stacks_used"] == "off"
            else "software stacks: none found next to the CSV or shipped; rows simulated as stated (--stacks FILE)"
        )
    if s.get("uncalibrated"):
        lines.append(
            f"{s['uncalibrated_rows']} rows used default (uncalibrated) curves for: "
            + ", ".join(f"{label} ({n} rows)" for label, n in s["uncalibrated"].items())
        )
    for key in ("by_cluster", "by_source"):
        lines.append(f"{key.replace('_', ' ')}:")
        width = min(max((len(name) for name in s[key]), default=0), 72)
        for name, st in s[key].items():
            scored = f" ({st['scored']} scored)" if st["scored"] != st["rows"] else ""
            # A name longer than the column pushes its own figures right rather than being cut: two sources that
            # differ only past the cut had printed as one name twice.
            lines.append(
                f"  {name:<{width}}  rows {st['rows']:>4}{scored}  median {_pct(st.get('median_abs_error'))}  "
                f"mean {_pct(st.get('mean_abs_error'))}  p90 {_pct(st.get('p90_abs_error'))}  "
                f"max {_pct(st.get('max_abs_error'))}  infeasible {st['infeasible']}"
                + (f"  invalid {st['invalid']}" if st.get("invalid") else "")
            )
    return "\n".join(lines)


def stated_text(value: Any) -> str:
    """A knob's stated value in an adjustment: ``empty`` where the cell was (the default was tried first)."""
    return "empty" if value is None else str(value)


def _one_line(text: str) -> str:
    """A cell for the table: line breaks inside a quoted CSV cell would break the table's rows."""
    return " ".join(text.splitlines()) if "\n" in text or "\r" in text else text


def _pct(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return ">1e6%" if x >= 1e4 else f"{x * 100:.1f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value
