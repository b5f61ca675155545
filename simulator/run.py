"""Simulate one training step: compose specs, graph, parallel plan, cost models and the engine.

:func:`simulate` is the public entry point. It resolves free knobs by trying candidate values (the
fastest plan that fits in memory wins; for each micro-batch size and interleaving depth the least
recomputation that fits is taken, since more of the same recomputation only adds time, and where that is
selective recomputation, the fewest fully recomputed layers that fit compete with it), builds the per-stage work, asks
the cost models for durations, and runs the discrete-event engine. Everything it returns is plain data.
Nothing here models physics; it only wires the layers together.
"""

from __future__ import annotations

import gc
import heapq
import math
import numbers
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from simulator.cost.communication import CommModel
from simulator.cost.compute import ComputeModel
from simulator.cost.memory import StageMemory, stage_memory
from simulator.engine.fold import FoldResult, TimedStep, compute_end_floor, fold
from simulator.engine.pipeline import PipelineInput, PipelineResult, StageInput, lower_bound, simulate_pipeline
from simulator.errors import InfeasiblePlanError, SpecError
from simulator.graph.transformer import ModelGraph, build_graph
from simulator.parallel.layout import Group, Layout, place, resolve_layout
from simulator.parallel.program import (
    Comm,
    Program,
    block_programs,
    build_programs,
    expert_load,
    instance_dp_comms,
    instance_key,
    param_all_gathers,
    program_key,
    recompute_program,
    reduces_in_backward,
    stage_params,
)
from simulator.parallel.schedule import generate, schedule_with_in_flight, stage_in_flight
from simulator.parallel.stages import Chunk, most_layers_per_chunk, partition
from simulator.specs._fields import check_whole
from simulator.specs.calibration import CalibrationTable
from simulator.specs.hardware import ClusterSpec
from simulator.specs.library import list_names, load_calibration
from simulator.specs.model import ModelSpec
from simulator.specs.plan import FREE_KNOBS, PlanSpec
from simulator.units import fmt_bytes

__all__ = [
    "DEFAULT_OVERLAP_SLOWDOWN",
    "Ranked",
    "StepResult",
    "check_spec",
    "infeasible_result",
    "rank",
    "row_columns",
    "simulate",
]

# Slowdown of compute kernels that run while NCCL kernels share the GPU (SMs and HBM taken by the collective);
# used when the cluster's calibration table has no measured value. source: average computational slowdown
# of overlapped execution, 18.9%, measured with GPT and LLaMA training on A100, H100, MI250 and MI210
# (Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning, arXiv:2507.03114).
DEFAULT_OVERLAP_SLOWDOWN = 0.189
# Megatron-LM DistributedDataParallel: bucket_size = max(40,000,000, 1,000,000 · dp) parameters
# (megatron/core/distributed/distributed_data_parallel.py), dp being get_data_parallel_world_size() without context
# parallelism (its default), though the buckets are reduced over dp·cp.
BUCKET_PARAMS_MIN = 40_000_000
BUCKET_PARAMS_PER_DP = 1_000_000
# A guard, not physics: at most this many gradient buckets per chunk. Only a chunk of over 4·10^12 parameters
# (at the 40M-parameter minimum bucket) reaches it; the largest of the validation files has 254. Beyond it the
# buckets grow instead, so a mistyped size (vocab 1e30) still gives an answer instead of a list of 10^25 buckets.
GRAD_BUCKETS_MAX = 100_000
# The most tokens a time-to-train question may ask about: 10,000 T, several hundred times the largest pretraining
# runs published (Llama 3: 15.6 T tokens, Dubey et al. 2024; Qwen3: 36 T, Qwen3 technical report 2025). Beyond it a
# count is a typo or a unit slip (1e30 had printed a 3e23-step training).
MAX_TRAIN_TOKENS = 1e16
# A search bound, not physics: a free micro-batch is chosen among the divisors of the per-replica batch up to this
# many sequences. Megatron-LM's and NeMo's published recipes use 1-16 (SC21's run_table_1.sh: 16 down to 1); beyond
# it activations grow while GEMM efficiency has long since plateaued. A user who wants more states it.
MICRO_BATCH_CANDIDATES_MAX = 16
# From this many partial-recomputation settings on, the search bisects over them instead of trying each in
# turn (_first_fitting_recompute); below it, a linear scan costs no more. Same answer either way.
PARTIAL_RECOMPUTE_BISECT_MIN = 4
_V = TypeVar("_V")

# Relative margin by which a candidate's lower bound must exceed the fastest step found before the free-knob
# search skips it: the bound sums the same durations in another order, so it may round a few ulps high.
BOUND_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class StepResult:
    """The answer for one (model, cluster, plan).

    Times are seconds, memory bytes. ``breakdown`` splits the step of the critical stage into compute,
    exposed communication per kind, pipeline bubble and optimizer; ``chosen`` lists the value picked for
    each free knob; ``uncalibrated_ops`` names the op classes timed with default curves; ``timeline`` (with
    ``record``) holds ``(stage, stream, name, start_s, end_s)`` rows: tasks on ``compute``, gradient reductions and
    gathers on ``dp``, transfers on ``send_fwd``/``send_bwd``, and on ``wait`` why the compute stream waited
    (``bubble``, ``pp transfer wait`` or ``dp gather wait`` before a task, ``dp reduce wait`` before the optimizer);
    ``launch_overhead_us`` is the host cost per operator the engine charged, from the cluster's calibration
    table, or None where no table measured it (then none is charged: ``host_exposed_s`` is 0 because host time
    is not modelled, not because it was found to be hidden).
    """

    model: str
    cluster: str
    num_gpus: int
    plan: PlanSpec
    feasible: bool
    reason: str
    step_time_s: float
    tokens_per_s: float
    model_flops: float
    hardware_flops: float
    mfu: float
    hfu: float
    memory: tuple[StageMemory, ...]
    breakdown: dict[str, float]
    stage_breakdown: tuple[dict[str, float], ...]
    critical_stage: int | None  # None where the plan has no times (cannot run, or out of memory untimed)
    chosen: dict[str, Any]
    uncalibrated_ops: tuple[str, ...]
    calibration: str
    launch_overhead_us: float | None = None
    model_flops_causal: float = math.nan
    peak_tflops_per_gpu: float = math.nan  # the peak MFU and HFU are taken against: the GPU's 16-bit dense peak
    timeline: tuple[tuple[int, str, str, float, float], ...] = field(default=(), repr=False, compare=False)

    @property
    def status(self) -> str:
        """``ok`` (it fits, with a time), ``out_of_memory`` (a stage is over its memory: the reason says which and
        by how much) or ``cannot_run`` (no times: a degree that does not divide the model, say)."""
        if self.feasible:
            return "ok"
        return "out_of_memory" if any(m.over > 0 for m in self.memory) else "cannot_run"

    @property
    def peak_memory_bytes(self) -> float:
        """Largest per-stage total."""
        return max((m.total for m in self.memory), default=0.0)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Throughput per GPU, the unit NeMo's and Megatron-Bridge's performance tables report."""
        return self.tokens_per_s / self.num_gpus

    @property
    def model_tflops_per_gpu(self) -> float:
        """Model TFLOP/s achieved per GPU (model FLOPs of the step over its time); MFU is this over the GPU's 16-bit
        peak. Attention counts at full s² (PaLM's convention, the "TFLOP/s/GPU" older Megatron-LM releases logged):
        current Megatron-LM halves causal attention in ``num_floating_point_operations``, so this figure is above the
        one it logs for the same step: 1.4% for GPT-3 at 2k tokens, 12.5% for Llama 3 8B at 8k."""
        return self.model_flops / self.step_time_s / self.num_gpus / 1e12

    @property
    def mfu_causal(self) -> float:
        """MFU by Megatron-LM's and Megatron-Bridge's count, causal attention at half of s² (``model_flops_causal``):
        the figure to compare with the TFLOP/s/GPU they log, over the same 16-bit peak. Below :attr:`mfu` by the
        attention's share: 1.4% for GPT-3 at 2k tokens, 11% for Llama 3 8B at 8k."""
        return self.mfu * self.model_flops_causal / self.model_flops if self.model_flops else math.nan

    def time_to_train(self, tokens: float) -> dict[str, float]:
        """Steps, days and GPU-hours to train on ``tokens`` tokens at this step time (whole steps of global batch ×
        sequence length; no restarts, evaluation or checkpointing). NaN where the plan is infeasible: a plan that
        does not fit in memory has a step time (what it would take if it fitted), but no training time.

        Raises
        ------
        SpecError
            If ``tokens`` is not a number of tokens from 1 to :data:`MAX_TRAIN_TOKENS`.
        """
        if (
            isinstance(tokens, bool)
            or not isinstance(tokens, numbers.Real)
            or not 1 <= float(tokens) <= MAX_TRAIN_TOKENS
        ):
            raise SpecError(
                "time_to_train(tokens)",
                f"must be a number of tokens from 1 to {MAX_TRAIN_TOKENS:.0e}, got {tokens!r}",
                "give the token count as a number, e.g. 15e12",
            )
        tokens = float(tokens)
        per_step = self.plan.global_batch * (self.plan.seq_len or 0)
        timed = self.feasible and math.isfinite(self.step_time_s)
        steps = math.ceil(tokens / per_step) if per_step > 0 and timed else math.nan
        seconds = steps * self.step_time_s
        return {
            "tokens": float(tokens),
            "tokens_per_step": float(per_step),
            "steps": float(steps),
            "days": seconds / 86400.0,
            "gpu_hours": seconds / 3600.0 * self.num_gpus,
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (stable key order); a time or rate an infeasible plan does not have is None
        (JSON null), not NaN, which strict JSON has no token for."""
        clean: dict[str, Any] = _finite_or_none(self._mapping())
        return clean

    def to_row(self) -> dict[str, Any]:
        """One flat row for a sweep's DataFrame (``pd.DataFrame([r.to_row() for r in results])``): the scalars of
        :meth:`to_dict`, the plan's knobs as ``plan.<knob>``, the breakdown as ``<part>_s``, the free knobs'
        choices as ``chosen.<knob>``, the peak memory and the bytes over capacity of the worst stage, and the
        uncalibrated ops joined by spaces. Same stable key order for every result.

        >>> from simulator.specs import load_cluster, load_model, PlanSpec
        >>> row = simulate(load_model("llama3-8b"), load_cluster("dgx-h100"),
        ...                PlanSpec(tp=2, dp=4, global_batch=16)).to_row()
        >>> row["plan.tp"], row["feasible"], "compute_s" in row, row["over_bytes"]
        (2, True, True, 0.0)
        """
        d = self.to_dict()
        row: dict[str, Any] = {k: d[k] for k in ("model", "cluster", "num_gpus", "feasible", "reason")}
        row.update({f"plan.{k}": v for k, v in d["plan"].items()})
        for key in ROW_FIGURES:
            row[key] = d[key]
        row.update({key: d["breakdown"].get(key) for key in BREAKDOWN_KEYS})  # None where a plan has no times
        row["peak_memory_bytes"] = d["peak_memory_bytes"]
        row["over_bytes"] = max((m["over_bytes"] for m in d["memory"]), default=None)
        # Every knob the search may choose, None where this plan fixed it or was never searched, so that every
        # row has the same columns in the same order whatever the first result of a sweep was.
        row.update({f"chosen.{k}": d["chosen"].get(k) for k in CHOSEN_KEYS})
        row["uncalibrated_ops"] = " ".join(d["uncalibrated_ops"])
        row["calibration"] = d["calibration"]
        return row

    def _mapping(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "model": self.model,
            "cluster": self.cluster,
            "num_gpus": self.num_gpus,
            "plan": plan.as_dict(),
            "feasible": self.feasible,
            "reason": self.reason,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "model_flops": self.model_flops,
            "hardware_flops": self.hardware_flops,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "model_flops_causal": self.model_flops_causal,
            "mfu_causal": self.mfu_causal,
            "peak_tflops_per_gpu": self.peak_tflops_per_gpu,
            "memory": [m.as_dict() for m in self.memory],
            "peak_memory_bytes": self.peak_memory_bytes if self.memory else None,
            "breakdown": dict(self.breakdown),
            "stage_breakdown": [dict(stage) for stage in self.stage_breakdown],
            "critical_stage": self.critical_stage,
            "chosen": dict(self.chosen),
            "uncalibrated_ops": list(self.uncalibrated_ops),
            "calibration": self.calibration,
            "launch_overhead_us": self.launch_overhead_us,
        }


# The columns of StepResult.to_row: the breakdown's parts (engine.pipeline.StageTimes.as_dict) and the knobs a
# result's `chosen` may name (the free knobs, the partial recomputation the search may pick, and expert_tp where
# MoE parallel folding was the only way to place ep).
BREAKDOWN_KEYS = (
    "compute_s",
    "tp_exposed_s",
    "cp_exposed_s",
    "ep_exposed_s",
    "host_exposed_s",
    "pp_exposed_s",
    "dp_exposed_s",
    "bubble_s",
    "optimizer_s",
)
CHOSEN_KEYS = (*FREE_KNOBS, "recompute_layers", "expert_tp")
# The figures of a result a row carries, between its plan and its breakdown.
ROW_FIGURES = (
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "model_flops",
    "hardware_flops",
    "model_tflops_per_gpu",
    "mfu",
    "hfu",
    "model_flops_causal",
    "mfu_causal",
    "peak_tflops_per_gpu",
    "launch_overhead_us",
    "critical_stage",
)


def row_columns() -> tuple[str, ...]:
    """The columns of :meth:`StepResult.to_row`, the same for every result, in its order.

    >>> row_columns()[:6]
    ('model', 'cluster', 'num_gpus', 'feasible', 'reason', 'plan.tp')
    """
    return (
        "model",
        "cluster",
        "num_gpus",
        "feasible",
        "reason",
        *(f"plan.{k}" for k in PlanSpec.field_names()),
        *ROW_FIGURES,
        *BREAKDOWN_KEYS,
        "peak_memory_bytes",
        "over_bytes",
        *(f"chosen.{k}" for k in CHOSEN_KEYS),
        "uncalibrated_ops",
        "calibration",
    )


def _finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float (nested in dicts and lists) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


# -- cost-model cache: one compute and one comm model per (cluster, precision), kept across calls ---------

_MODELS: dict[tuple[int, str, float], tuple[ClusterSpec, ComputeModel, CommModel]] = {}
_DEFAULT_TABLE: list[CalibrationTable | None] = []


def _default_table() -> CalibrationTable | None:
    if not _DEFAULT_TABLE:
        names = {n.lower() for n, _ in list_names("calibration")}
        _DEFAULT_TABLE.append(load_calibration("default") if "default" in names else None)
    return _DEFAULT_TABLE[0]


def _models(cluster: ClusterSpec, precision: str, straggler: float) -> tuple[ComputeModel, CommModel]:
    key = (id(cluster), precision, straggler)
    hit = _MODELS.get(key)
    if hit is not None and hit[0] is cluster:
        return hit[1], hit[2]
    default = _default_table()
    compute = ComputeModel(cluster.device, cluster.calibration, default, precision)
    comm = CommModel(cluster, cluster.calibration, default, straggler)
    if len(_MODELS) > 64:
        _MODELS.clear()
    _MODELS[key] = (cluster, compute, comm)
    return compute, comm


# Host cost per operator where the calibration table measured none: none is charged (results then say
# "host exposed: not modelled" and report launch_overhead_us as None) rather than a number no measurement gave.
LAUNCH_OVERHEAD_S = 0.0


def _measured_launch_overhead_s(cluster: ClusterSpec) -> float | None:
    """The host cost per operator the cluster's calibration table measured, None where it has none."""
    table = cluster.calibration
    return table.launch_overhead_s if table is not None else None


def _launch_overhead(cluster: ClusterSpec) -> float:
    measured = _measured_launch_overhead_s(cluster)
    return LAUNCH_OVERHEAD_S if measured is None else measured


def _measured_launch_overhead_us(cluster: ClusterSpec) -> float | None:
    """:func:`_measured_launch_overhead_s` in µs, as results report it."""
    measured = _measured_launch_overhead_s(cluster)
    return None if measured is None else measured * 1e6


def _overlap_slowdown(cluster: ClusterSpec) -> float:
    table = cluster.calibration
    if table is not None and table.overlap_slowdown is not None:
        return table.overlap_slowdown
    return DEFAULT_OVERLAP_SLOWDOWN


# -- public entry point -------------------------------------------------------------------------------------


def simulate(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: PlanSpec,
    *,
    record: bool = False,
    raise_infeasible: bool = True,
    time_oom: bool = True,
) -> StepResult:
    """Simulate one training step of ``model`` on ``cluster`` laid out as ``plan``.

    Free knobs of the plan (``None``) are chosen: the fastest combination that fits in memory.

    Thread-safe (calls from several threads run one at a time); for a parallel sweep use processes.

    With ``time_oom=False`` a plan that does not fit in memory is answered from the memory model alone (the
    stage and bytes over, no times), 10-35x faster with fixed knobs than timing the step it cannot run (GPT-3 175B
    and Llama 3 405B layouts, measured 2026-11-25; with free knobs every candidate is sized first and little is
    saved): what a sweep over many layouts that mostly do not fit wants. With ``raise_infeasible=False`` a plan
    that cannot run at all is an answer too, as the CLI gives it (``feasible=False``, the reason, no times): what a
    sweep over layouts wants, with no try/except per plan.
    Filter on ``feasible`` before ranking by ``step_time_s``: a plan that does not fit in memory still carries
    the time its step would take if it fitted.

    Raises
    ------
    InfeasiblePlanError
        When the plan cannot run at all (a degree that does not divide, too many GPUs) and ``raise_infeasible``
        is true (the default). A plan that runs out of memory is *not* an error: the result has
        ``feasible=False`` and a reason.

    Examples
    --------
    >>> from simulator.specs import load_cluster, load_model, PlanSpec
    >>> r = simulate(load_model("gpt3-175b"), load_cluster("dgx-h100"),
    ...              PlanSpec(tp=8, pp=8, dp=1, global_batch=16, micro_batch=1, recompute="selective",
    ...                       grad_overlap=True))
    >>> r.feasible, r.step_time_s > 0
    (True, True)
    """
    for name, value in (("model", model), ("cluster", cluster), ("plan", plan)):
        check_spec(f"simulate: {name}", value)
    for name, flag in (("record", record), ("raise_infeasible", raise_infeasible), ("time_oom", time_oom)):
        if not isinstance(flag, bool | np.bool_):  # time_oom="no" is a truthy string: it had timed the step
            raise SpecError(f"simulate: {name}", f"must be True or False, got {flag!r}", "pass a bool")
    record, raise_infeasible, time_oom = bool(record), bool(raise_infeasible), bool(time_oom)
    with _CALL_LOCK, _gc_paused():
        try:
            return _simulate(model, cluster, plan, record, time_oom)
        except InfeasiblePlanError as err:
            if raise_infeasible:
                raise
            return infeasible_result(model, cluster, plan, str(err))


@dataclass(frozen=True, slots=True)
class Ranked:
    """One plan's place in a ranking (:func:`rank`).

    ``result`` is the plan's answer exactly as ``simulate(model, cluster, plan, raise_infeasible=False,
    time_oom=False)`` gives it, or None where the ranking proved, without running the engine on it, that the plan
    cannot be among the fastest asked for. ``bound_s`` is a lower bound on the plan's step where a candidate fits
    (the smallest of its candidates' compute floors, :func:`_compute_floor`: the busiest stage's compute and the
    collectives its compute must wait for, after the first micro-batch's forward has reached it, without the
    overlap slowdown, the data-parallel collectives, the drain or the optimizer; it depends on the plan alone, not
    on how far the ranking timed it), NaN where none fits.
    """

    result: StepResult | None
    bound_s: float


class Peers(Protocol):
    """Other rankings of the same job running at the same time (the planner's worker processes, each ranking a share
    of the layouts): what they found lets a ranking prune against the fastest layouts of all shares."""

    def cutoff(self) -> float:
        """The ``top``-th fastest step among the layouts the other rankings have timed so far (inf until they have
        ``top``): each is a step some layout of theirs reaches, so no layout bounded above it can enter the top."""
        ...

    def publish(self, fastest: Sequence[float]) -> None:
        """This ranking's fastest steps so far, at most ``top``, one per layout."""
        ...


def rank(
    model: ModelSpec, cluster: ClusterSpec, plans: Sequence[PlanSpec], *, top: int = 1, peers: Peers | None = None
) -> list[Ranked]:
    """Rank ``plans`` of one model on one cluster, running the engine only where it can change the ``top`` fastest.

    Each plan's free knobs are searched as :func:`simulate` searches them, but the candidates of all the plans
    are pooled: the engine runs them in the order of their lower bounds and stops once a bound exceeds the
    ``top``-th fastest plan found, so most plans of a large layout search never reach the engine, and a candidate
    whose compute floor already exceeds it is not even prepared (:class:`_Queue`). Every plan among
    the ``top`` fastest, and every other plan whose search finished, has the result :func:`simulate` gives it
    (with ``raise_infeasible=False, time_oom=False``: a plan that does not fit is answered from memory alone); the
    rest have None and their bound. One entry per plan, in the plans' order. With ``peers`` (rankings of other
    layouts of the same job) a plan is also ruled out by the ``top`` fastest they found: the plans among the ``top``
    fastest of all have their results as without peers, which others are timed to the end depends on the peers.

    Examples
    --------
    >>> from simulator.specs import load_cluster, load_model, PlanSpec
    >>> plans = [PlanSpec(tp=tp, dp=8 // tp, global_batch=32) for tp in (1, 2, 4, 8)]
    >>> ranked = rank(load_model("llama3-8b"), load_cluster("dgx-h100"), plans)
    >>> [(p.tp, r.result is not None and r.result.feasible) for p, r in zip(plans, ranked)]  # tp 1 does not fit
    [(1, False), (2, False), (4, True), (8, False)]
    >>> round(ranked[1].bound_s, 2), round(ranked[2].result.step_time_s, 2)  # tp 2 cannot beat tp 4: not timed
    (3.82, 3.52)
    """
    check_whole("rank: top", top, "ask for the fastest 1 or more")
    plans = list(plans)  # a generator is read once
    check_spec("rank: model", model)
    check_spec("rank: cluster", cluster)
    for i, plan in enumerate(plans):
        check_spec(f"rank: plans[{i}]", plan)
    with _CALL_LOCK, _gc_paused():
        return _rank(model, cluster, list(plans), top, peers)


def _rank(
    model: ModelSpec, cluster: ClusterSpec, plans: list[PlanSpec], top: int, peers: Peers | None = None
) -> list[Ranked]:
    answers: list[StepResult | None] = [None] * len(plans)
    bounds = [math.nan] * len(plans)
    models: list[ModelSpec] = [model] * len(plans)
    pool: list[tuple[float, int, int, _Deferred]] = []  # (floor, plan, candidate, deferred)
    for pi, plan in enumerate(plans):
        try:
            models[pi], normal = _normalised(model, cluster, plan)
            if normal.free_knobs:
                prepared, fallback = _search(models[pi], cluster, normal)
                if not prepared:
                    if fallback is None:
                        raise InfeasiblePlanError(_structural_error(models[pi], cluster, normal))
                    # As simulate answers a plan none of whose candidates fits (its _run, memory only).
                    answers[pi] = _run(models[pi], cluster, fallback.plan, False, fallback.chosen, False)
            else:
                got = _prepare(models[pi], cluster, normal, False, {}, memory_only_if_infeasible=True, defer=True)
                prepared = [(got.floor_s, 0, got)] if isinstance(got, _Deferred) else []
                if not isinstance(got, _Deferred):
                    assert isinstance(got, StepResult)  # memory only: the plan does not fit
                    answers[pi] = got
        except InfeasiblePlanError as err:
            answers[pi] = infeasible_result(model, cluster, plan, str(err))
            continue
        pool += [(floor, pi, ci, deferred) for floor, ci, deferred in prepared]
        if prepared:
            bounds[pi] = min(floor for floor, _, _ in prepared)
    finished: dict[int, list[tuple[int, StepResult]]] = {}
    fastest: dict[int, float] = {}  # per plan, its fastest candidate timed so far
    cutoff = math.inf  # the top-th fastest plan so far: no candidate bounded above it can enter the top
    unrun: dict[int, float] = {}  # per plan, the smallest bound (or floor) among its candidates the engine skipped

    outside = math.inf  # the peers' cutoff, read once per candidate the queue hands out

    def limit(pi: int) -> float:
        return min(fastest.get(pi, math.inf), cutoff, outside) * (1.0 + BOUND_SLACK)

    def skipped(pi: int, bound: float) -> None:
        unrun[pi] = min(unrun.get(pi, math.inf), bound)

    queue = _Queue(pool, cluster, models)
    while True:
        if peers is not None:
            outside = peers.cutoff()
        if (item := queue.pop(limit, skipped)) is None:
            break
        _, pi, ci, ready = item
        result = _finish(models[pi], cluster, ready)
        finished.setdefault(pi, []).append((ci, result))
        fastest[pi] = min(fastest.get(pi, math.inf), result.step_time_s)
        steps = sorted(fastest.values())
        if len(steps) >= top:
            cutoff = steps[top - 1]
        if peers is not None:
            peers.publish(steps[:top])
    for pi, timed in finished.items():
        # Exact where no skipped candidate could have beaten its fastest (simulate's own rule for stopping).
        if unrun.get(pi, math.inf) > fastest[pi] * (1.0 + BOUND_SLACK):
            answers[pi] = _pick(timed)
    return [Ranked(answers[pi], bounds[pi]) for pi in range(len(plans))]


# What each spec is and how a caller gets one, for the message when something else stands in its place.
_SPEC_KINDS: dict[str, tuple[type, str]] = {
    "model": (ModelSpec, "load one with simulator.specs.load_model(name or path)"),
    "cluster": (ClusterSpec, "load one with simulator.specs.load_cluster(name or path)"),
    "plan": (PlanSpec, "build one with simulator.specs.PlanSpec(tp=..., global_batch=...)"),
}


def check_spec(where: str, value: Any) -> None:
    """Refuse a name or a dict where a spec belongs (``where`` ends with model, cluster or plan, or plans[i]): a
    SpecError that says which spec and how to get one, not an AttributeError later."""
    kind, fix = _SPEC_KINDS["plan" if where.endswith("]") else where.rsplit(" ", 1)[-1]]
    if not isinstance(value, kind):
        raise SpecError(where, f"must be a {kind.__name__}, got {type(value).__name__}", fix)


# One call at a time per process: the cost models and program caches are shared across calls (that is what makes
# a sweep fast), and each call collects its uncalibrated labels in the shared models. Threads gain nothing from
# running calls side by side under the GIL; this makes them safe (Dask's threaded scheduler, a thread pool), and a
# parallel sweep uses processes (every spec, result and error pickles).
_CALL_LOCK = threading.RLock()


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one call.

    A call allocates hundreds of thousands of short-lived objects (schedule tasks, simpy events), almost all
    freed by reference counting; the collector's passes over them cost about a sixth of a free-knob search
    (``analysis/benchmarks/bench_simulate.py``). The cycles a call leaves (simpy's environment and processes)
    are collected after it, once the collector runs again. Restores the collector's previous state.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _simulate(
    model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, record: bool, time_oom: bool = True
) -> StepResult:
    model, plan = _normalised(model, cluster, plan)
    if not plan.free_knobs:
        return _run(model, cluster, plan, record, {}, time_oom)
    # Every candidate is sized first (memory, and a floor from its compute alone), which is cheap; the engine then
    # runs them in the order of a lower bound on their step time, building a candidate's programs only when its
    # floor can still beat the fastest found so far, and skips those whose bound cannot. The choice is the same
    # as running every candidate (ties go to the earlier candidate).
    pending, fallback = _search(model, cluster, plan)
    finished: list[tuple[int, StepResult]] = []
    fastest = math.inf
    queue = _Queue([(floor, 0, index, deferred) for floor, index, deferred in pending], cluster, [model])

    def limit(_: int) -> float:
        return fastest * (1.0 + BOUND_SLACK)

    while (item := queue.pop(limit)) is not None:
        _, _, index, ready = item
        result = _finish(model, cluster, ready)
        finished.append((index, result))
        fastest = min(fastest, result.step_time_s)
    best = _pick(finished)
    chosen = best or fallback
    if chosen is None:
        raise InfeasiblePlanError(_structural_error(model, cluster, plan))
    if chosen is fallback:
        # Nothing fits: answer as for a fixed plan that does not fit (the engine still times the step, and
        # ``reason`` says which stage is over by how much), so that recording a trace cannot change the answer.
        return _run(model, cluster, chosen.plan, record, chosen.chosen, time_oom)
    if record:
        chosen = _run(model, cluster, chosen.plan, True, chosen.chosen)
    return chosen


def _normalised(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec) -> tuple[ModelSpec, PlanSpec]:
    """The model and plan as the step runs them: the model's sequence length where the plan has none, the vocabulary
    padded as Megatron-LM builds it; with the checks every candidate shares.

    Raises
    ------
    SpecError
        When a knob counts layers beyond the model.
    InfeasiblePlanError
        When the GPU has no tensor cores for the precision.
    """
    seq_len = plan.seq_len or model.seq_len
    plan = replace(plan, seq_len=seq_len)
    vocab = plan.padded_vocab(model.vocab)
    if vocab != model.vocab:
        # Megatron-LM builds the embedding and output layer for the padded vocabulary (PlanSpec.vocab_divisible_by).
        model = replace(model, vocab=vocab)
    plan.check_model_layers(model.layers)  # knobs that count layers: a typo beyond the model is bad input
    _check_precision(cluster, plan)  # once, before any candidate: they all share the precision
    return model, plan


def _search(
    model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec
) -> tuple[list[tuple[float, int, _Deferred]], StepResult | None]:
    """The free-knob search before the engine: every candidate that fits, sized and deferred, with its compute floor,
    in the order of the candidates; and, for when none fits, the candidate that is least over memory (a
    memory-only answer), None where no candidate is a runnable plan. ``model`` and ``plan`` are
    :func:`_normalised`. :class:`_Queue` orders them and prepares and times them as the engine needs them."""
    prepared: list[tuple[float, int, _Deferred]] = []
    fallback: StepResult | None = None
    # Memory does not depend on grad_overlap, so the candidates that differ only in it need the same
    # recomputation: the second starts its search where the first one's ended (None: nothing ran or fitted).
    fitted: dict[tuple[int | None, int | None], int | None] = {}
    folds: _FoldMemo = {}  # They also run the same programs, timed once for both (_pipeline_input).
    sizes = _Sizes(model, cluster)  # and are sized once for both
    for index, candidate in enumerate(_candidates(model, plan)):
        twin = (candidate.micro_batch, candidate.vp)
        start = fitted.get(twin, 0)
        if start is None:
            continue  # its twin found no runnable or fitting recomputation; this one, with equal memory, neither
        got, fitted[twin] = _first_fitting_recompute(model, cluster, candidate, plan, start, folds, sizes)
        if isinstance(got, _Deferred):
            prepared.append((got.floor_s, index, got))
            fitting = fitted[twin]
            if plan.recompute is None and got.plan.recompute == "selective" and fitting is not None:
                # Selective and full recomputation trade memory for time differently (with a fused attention
                # kernel selective saves little memory, yet costs the attention core again): the fewest fully
                # recomputed layers that fit (the options after selective) compete too.
                more, _ = _first_fitting_recompute(model, cluster, candidate, plan, fitting + 1, folds, sizes)
                if isinstance(more, _Deferred):
                    prepared.append((more.floor_s, index, more))
        elif got is not None and (fallback is None or got.peak_memory_bytes < fallback.peak_memory_bytes):
            fallback = got
    return prepared, fallback


def _pick(finished: list[tuple[int, StepResult]]) -> StepResult | None:
    """The fastest of a search's timed candidates; a tie (within a picosecond) goes to the earlier candidate."""
    best: StepResult | None = None
    for _, result in sorted(finished, key=lambda item: item[0]):
        if best is None or result.step_time_s < best.step_time_s - 1e-12:
            best = result
    return best


def _check_precision(cluster: ClusterSpec, plan: PlanSpec) -> None:
    if problem := precision_problem(cluster, plan.precision):
        raise InfeasiblePlanError(problem)


def precision_problem(cluster: ClusterSpec, precision: str) -> str | None:
    """Why a plan cannot train in ``precision`` on the cluster's GPU, or None: it needs tensor cores of that format,
    and a device file lists a peak for each it has (V100 has FP16 but no BF16, A100 no FP8; Transformer Engine
    refuses FP8 below compute capability 8.9). The one wording for ``simulate`` and ``validate``."""
    peaks = dict(cluster.device.peak_flops)
    if precision in peaks:
        return None
    has = [p for p in ("fp8", "bf16", "fp16") if p in peaks]
    fix = f"use {' or '.join(has)}" if has else f"the device lists no peak at all: give it peak_tflops_{precision}"
    return f"precision {precision} needs {precision.upper()} tensor cores; {cluster.device.name} has none ({fix})"


def _structural_error(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec) -> str:
    """Why no candidate of ``plan`` can run: the rule every candidate breaks, said as the plan's own when the
    free knobs do not matter to it (``'tp' must divide 'heads'``), else the first candidate's."""
    candidates = _candidates(model, plan)
    if not candidates:
        # Every value of the free knobs was left out before sizing (interleaving with micro-batches that are not
        # a multiple of pp): say why for the smallest of them.
        vp = plan.vp or (2 if _schedule(plan) == "interleaved" else 1)
        candidates = [replace(plan, micro_batch=plan.micro_batch or 1, vp=vp, grad_overlap=plan.grad_overlap or False)]
    reasons: list[str] = []
    runnable = False
    for candidate in candidates:
        trial = replace(candidate, recompute=candidate.recompute or "full")
        try:
            resolve_layout(model, cluster, trial)
            generate(
                _schedule(trial), trial.pp, trial.global_batch // (trial.dp * (trial.micro_batch or 1)), trial.vp or 1
            )
            runnable = True
        except InfeasiblePlanError as err:
            reasons.append(str(err))
        if runnable and reasons:
            break  # the free knobs matter, and the first reason is known: the rest cannot change the message
    if reasons and len(reasons) == len(candidates) and len(set(reasons)) == 1:
        return f"the plan cannot run, whatever its free knobs: {reasons[0]}"
    return f"no value of the free knobs gives a runnable plan: {reasons[0] if reasons else 'no candidate'}"


def _schedule(plan: PlanSpec) -> str:
    return plan.schedule or ("interleaved" if (plan.vp or 1) > 1 else "1f1b")


def _candidates(model: ModelSpec, plan: PlanSpec) -> list[PlanSpec]:
    """Plans with micro_batch, vp and grad_overlap fixed (recompute stays free when it was)."""
    per_replica = plan.global_batch // plan.dp if plan.global_batch % plan.dp == 0 else 0
    if plan.micro_batch is not None:
        mbs = [plan.micro_batch]
    else:
        mbs = [d for d in range(1, min(per_replica, MICRO_BATCH_CANDIDATES_MAX) + 1) if per_replica % d == 0] or [1]
    if plan.vp is not None:
        vps = [plan.vp]
    elif plan.schedule in ("gpipe", "1f1b", "zb_h1") or (plan.pp == 1 and plan.schedule is None):
        vps = [1]
    else:
        per_stage = -(-model.layers // plan.pp)
        # pp·vp may exceed the layers by the embedding and the loss (resolve_layout's rule). Tried: the chunk counts
        # that split each stage's layers evenly, and those that split the virtual stages evenly where Megatron-Core
        # counts the embedding and the loss as a layer each (pp·vp dividing layers + 2: 17 for 32 layers on pp 2).
        limit = model.layers + 2
        vps = sorted(
            v
            for v in range(2, limit // plan.pp + 1)
            if (per_stage % v == 0 or limit % (plan.pp * v) == 0) and limit >= plan.pp * v
        )
        if plan.schedule is None:
            vps = [1, *vps]  # an explicit interleaved schedule needs vp >= 2
    # Overlap is usually faster, but overlapped compute is slowed down (overlap_slowdown): try both.
    overlap = [plan.grad_overlap] if plan.grad_overlap is not None else [True, False]
    out = []
    for mb in mbs:
        for vp in vps:
            if vp > 1 and (per_replica // mb) % plan.pp:
                continue  # interleaving needs micro-batches in multiples of pp
            for go in overlap:
                out.append(replace(plan, micro_batch=mb, vp=vp, grad_overlap=go))
    return out


def _recompute_options(model: ModelSpec, candidate: PlanSpec) -> list[tuple[str, int | None]]:
    """Recomputation settings to try, least recomputation first: the plan's own when it states one; else none,
    selective, full recomputation of the first 1, 2, ... layers of every model chunk (Megatron-LM's
    ``--recompute-method block --recompute-num-layers``), then of every layer."""
    if candidate.recompute is not None:
        return [(candidate.recompute, candidate.recompute_layers)]
    # Bounded by the fullest chunk, not the average: with the embedding and the loss on chunks of their own one
    # chunk can hold two layers where the average is one.
    per_chunk = most_layers_per_chunk(model.layers, candidate.pp * (candidate.vp or 1))
    partial: list[tuple[str, int | None]] = [("full", n) for n in range(1, per_chunk)]
    return [("none", None), ("selective", None), *partial, ("full", None)]


def _first_fitting_recompute(
    model: ModelSpec,
    cluster: ClusterSpec,
    candidate: PlanSpec,
    original: PlanSpec,
    start: int = 0,
    fold_memo: _FoldMemo | None = None,
    sizes: _Sizes | None = None,
) -> tuple[StepResult | _Deferred | None, int | None]:
    """The candidate with the least recomputation that fits, sized and deferred (:func:`_ready`); else the last
    (infeasible) memory-only result, or None when no recompute setting gives a runnable plan. Also returns the
    index of the fitting option in :func:`_recompute_options` (None when none fits); the search starts at
    option ``start``, which a caller passes when it knows that the options before it do not fit.

    Recomputing the first n layers of every chunk keeps n layer inputs where n layers' activations were, and a
    layer input is one of the tensors a layer keeps: no stage needs more memory at n + 1 than at n. So once
    none and selective recomputation have not fitted, the fewest layers that fit are found by bisection over
    n (memory only, :func:`_fits`) instead of by trying every n in turn, which is quadratic in depth.
    """
    options = _recompute_options(model, candidate)
    partial = [i for i, (rc, n) in enumerate(options) if rc == "full" and n is not None]
    last: StepResult | None = None
    # What the bisection sized, so that the plan it picks is not sized twice (nor, in a search, its overlap twin).
    sizes = sizes if sizes is not None else _Sizes(model, cluster)
    i = start
    while i < len(options):
        if len(partial) >= PARTIAL_RECOMPUTE_BISECT_MIN and i == partial[0]:
            i = _first_fitting_partial(model, cluster, candidate, options, i, partial[-1] + 1, sizes)
        rc, layers = options[i]
        trial = replace(candidate, recompute=rc, recompute_layers=layers)
        chosen = {k: getattr(trial, k) for k in original.free_knobs}
        if layers is not None and original.recompute is None:
            chosen["recompute_layers"] = layers
        try:
            got = _prepare(
                model,
                cluster,
                trial,
                False,
                chosen,
                memory_only_if_infeasible=True,
                sized=sizes.get(trial),
                fold_memo=fold_memo,
                defer=True,
            )
        except InfeasiblePlanError:
            return last, None
        if isinstance(got, _Deferred):
            return got, i
        assert isinstance(got, StepResult)  # memory only: the plan does not fit
        last = got
        i += 1
    return last, None


def _first_fitting_partial(
    model: ModelSpec,
    cluster: ClusterSpec,
    candidate: PlanSpec,
    options: list[tuple[str, int | None]],
    start: int,
    stop: int,
    sizes: _Sizes,
) -> int:
    """The index of the first of ``options[start:stop]`` (partial recomputation, ascending n) that fits, or
    ``stop`` when none does; ``start`` when some probe is not a runnable plan (the caller then tries every n
    and reports it as it would have)."""
    lo, hi = start, stop
    while lo < hi:
        mid = (lo + hi) // 2
        rc, n = options[mid]
        fits = _fits(replace(candidate, recompute=rc, recompute_layers=n), sizes)
        if fits is None:
            return start
        if fits:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _fits(plan: PlanSpec, sizes: _Sizes) -> bool | None:
    """Whether ``plan`` fits in every stage's memory; None when it is not a runnable plan (sized through
    ``sizes``, which keeps it)."""
    try:
        got = sizes.get(plan)
    except InfeasiblePlanError:
        return None
    return all(m.over <= 0 for m in got[-1])


class _Sizes:
    """What one free-knob search has sized (:func:`_layout_memory`), by the knobs its candidates differ in but
    ``grad_overlap``: memory does not depend on it (a ZeRO-2/3 reduce-scatter that overlaps or blocks holds the
    same buffers), so the overlap twins share the graph, chunks and memory, each with its own layout."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        self._model, self._cluster = model, cluster
        self._items: dict[tuple[Any, ...], _Sized] = {}

    def get(self, plan: PlanSpec) -> _Sized:
        """``plan`` sized, now or by an earlier call for it or its overlap twin.

        Raises
        ------
        InfeasiblePlanError
            When the plan cannot be laid out or scheduled.
        """
        # Within one search (_candidates, _recompute_options) every other knob is the searched plan's own.
        key = (plan.micro_batch, plan.vp, plan.recompute, plan.recompute_layers, plan.schedule, plan.expert_tp)
        got = self._items.get(key)
        if got is None:
            got = self._items[key] = _layout_memory(self._model, self._cluster, plan)
        elif got[0].plan != plan:
            got = (resolve_layout(self._model, self._cluster, plan), *got[1:])
        return got


class _Recent(Generic[_V]):
    """A cache kept across calls, bounded to its ``size`` most recently used entries (the oldest out first)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[Any, ...], _V] = OrderedDict()

    def get(self, key: tuple[Any, ...]) -> _V | None:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
        return hit

    def put(self, key: tuple[Any, ...], value: _V) -> None:
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)


class _FoldedChunk(NamedTuple):
    """A chunk's forward, backward and weight-gradient programs folded for the engine, the FLOPs they execute,
    and the uncalibrated labels timing them raised (so that a plan reusing them reports the same)."""

    fwd: FoldResult
    bwd: FoldResult
    wgt: FoldResult
    flops: float
    compute_labels: frozenset[str]
    comm_labels: frozenset[str]


# Per chunk (its blocks), and per plan of a search keyed by the plan without grad_overlap (_pipeline_input).
_Folds = dict[tuple[tuple[str, int], ...], _FoldedChunk]
_FoldMemo = dict[PlanSpec, _Folds]


def _fold_chunk(
    graph: ModelGraph,
    layout: Layout,
    blocks: tuple[tuple[str, int], ...],
    compute: ComputeModel,
    comm: CommModel,
    slowdown: float,
    host: float,
    record: bool,
) -> _FoldedChunk:
    """Time and fold one chunk's programs (the models' uncalibrated sets gain its labels, as for any timing).

    Kept across calls (not when recording a timeline): a sweep's plans that share a chunk's programs and cost
    models share its folding too, which was half of a repeated call."""
    key = None
    if not record:
        key = (graph, program_key(layout), blocks, id(compute), id(comm), slowdown, host)
        hit = _FOLDED.get(key)
        if hit is not None:
            return _reused(hit[2], compute, comm)
    outer_compute, compute.uncalibrated = compute.uncalibrated, set()
    outer_comm, comm.uncalibrated = comm.uncalibrated, set()
    try:
        programs = build_programs(graph, layout, blocks)
        fwd, bwd, wgt = (
            fold(_timed(p, compute, comm), slowdown, host_overhead_s=host, timeline=record) for p in programs
        )
        flops = sum(_program_flops(p, layout) for p in programs)
        labels = frozenset(compute.uncalibrated), frozenset(comm.uncalibrated)
    finally:
        compute.uncalibrated = outer_compute | compute.uncalibrated
        comm.uncalibrated = outer_comm | comm.uncalibrated
    folded = _FoldedChunk(fwd, bwd, wgt, flops, *labels)
    if key is not None:
        _FOLDED.put(key, (compute, comm, folded))  # the models held, so that their ids in the key stay theirs
    return folded


def _reused(folded: _FoldedChunk, compute: ComputeModel, comm: CommModel) -> _FoldedChunk:
    """``folded``, timed for an earlier plan or call: its uncalibrated labels count for this one too."""
    compute.uncalibrated.update(folded.compute_labels)
    comm.uncalibrated.update(folded.comm_labels)
    return folded


# Folded chunks across calls, least recently used out first: bounded like the program cache it mirrors.
FOLDED_MAX = 256
_FOLDED: _Recent[tuple[ComputeModel, CommModel, _FoldedChunk]] = _Recent(FOLDED_MAX)


# A plan's layout, graph, pipeline chunks and per-stage memory (_layout_memory).
_Sized = tuple[Layout, ModelGraph, tuple[tuple[Chunk, ...], ...], tuple[StageMemory, ...]]


def _layout_memory(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec) -> _Sized:
    """A plan's layout, graph, pipeline chunks and per-stage memory (sized from the schedule's in-flight counts):
    what the search needs to know whether it fits, and the engine's input is built from.

    Raises
    ------
    InfeasiblePlanError
        When the plan cannot be laid out or scheduled.
    """
    layout = resolve_layout(model, cluster, plan)
    graph = build_graph(model, layout.seq_len, layout.micro_batch, plan.attention, plan.bf16_layers)
    chunks = partition(graph, plan.pp, layout.vp)
    live = stage_in_flight(layout.schedule, plan.pp, layout.num_micro_batches, layout.vp)
    capacity = cluster.device.hbm_bytes
    kept: dict[str, float] = {}  # per block and per distinct chunk, shared by the stages (stage_memory)
    by_chunk: dict[tuple[object, ...], tuple[float, float]] = {}
    memory = tuple(
        stage_memory(graph, layout, chunks[s], (), capacity, live[s], kept, by_chunk) for s in range(plan.pp)
    )
    return layout, graph, chunks, memory


# -- one fully specified plan ------------------------------------------------------------------------------


def _run(
    model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, record: bool, chosen: dict[str, Any], time_oom: bool = True
) -> StepResult:
    """Simulate a fully specified plan (out of memory still runs the engine and says so in ``reason``, unless
    ``time_oom`` is false: then the memory model's answer comes back without times)."""
    prepared = _prepare(model, cluster, plan, record, chosen, memory_only_if_infeasible=not time_oom)
    if isinstance(prepared, StepResult):
        return prepared  # out of memory, not timed
    assert isinstance(prepared, _Prepared)  # not deferred: no defer asked
    return _finish(model, cluster, prepared)


@dataclass(frozen=True, slots=True)
class _Deferred:
    """A free-knob candidate that fits, sized but not yet timed: the search builds, times and folds its programs
    (:func:`_ready`) only once its floor (:func:`_compute_floor`) says it could still beat the fastest step found."""

    plan: PlanSpec
    chosen: dict[str, Any]
    sized: _Sized
    folds: _FoldMemo | None
    floor_s: float


def _compute_floor(
    graph: ModelGraph,
    layout: Layout,
    chunks: tuple[tuple[Chunk, ...], ...],
    compute: ComputeModel,
    comm: CommModel,
) -> float:
    """A lower bound on the step, from each block's own programs, without building the chunks' programs.

    A chunk's programs emit each block instance's steps as :func:`~simulator.parallel.program.block_programs` emits
    the instance alone, plus what joins instances (ZeRO-3's gathers and scatters), and an instance's steps may also
    wait for the instance before it; so a task's compute stream ends no earlier than the sum of its instances'
    :func:`~simulator.engine.fold.compute_end_floor` (each instance starts once the one before has left the compute
    stream). That counts the compute and the collectives compute must wait for (blocking TP, context-parallel and
    expert all-to-all exchanges), not the overlap slowdown. Nor does a task end before its ``dp`` stream has run, one
    after another, every ZeRO-2/3 gather and scatter it issues (:func:`~simulator.parallel.program.instance_dp_comms`;
    the gathers are waited for, so its output is not ready before either): each task counts the larger of the two.
    A stage runs each task of every micro-batch one after another, not before the first micro-batch's forward has
    crossed every earlier stage's first chunk (:func:`~simulator.engine.pipeline.lower_bound`, whose fill and busy
    terms these bound from below). It leaves out the drain and the optimizer, so it is weaker than the engine's
    bound, but it costs a few small programs per distinct block instead of every chunk's."""
    key = (graph, instance_key(layout), id(compute), id(comm))  # what a block's programs and their times depend on
    recomputes = layout.recompute in ("full", "selective")
    split_w = layout.schedule == "zb_h1"
    limit = layout.plan.recompute_layers  # None: every layer of a chunk
    m = layout.num_micro_batches
    seen: dict[str, _BlockFloor] = {}  # this plan's blocks: each looked up once
    seen_again: dict[str, _RecomputeFloor] = {}

    def floors(name: str) -> _BlockFloor:
        got = seen.get(name)
        if got is None:
            got = seen[name] = _block_floor(graph, layout, key, name, compute, comm)
        return got

    def recomputed(name: str) -> _RecomputeFloor:
        got = seen_again.get(name)
        if got is None:
            got = seen_again[name] = _recompute_floor(graph, layout, key, name, compute, comm)
        return got

    floor = 0.0
    fill = 0.0  # the first micro-batch's forward through the first chunk of every earlier stage
    for stage in chunks:
        total = 0.0
        first_forward = 0.0
        for c, chunk in enumerate(stage):
            # Per task of this chunk: its compute floor, its compute alone, and its dp stream's work (forward,
            # backward, weight gradient).
            fwd = bwd = wgt = 0.0
            fwd_alone = bwd_alone = 0.0
            gathers = scatters = 0.0
            layers_before = 0
            for name, count in chunk.blocks:
                block = floors(name)
                fwd += count * block.fwd
                bwd += count * block.bwd
                wgt += count * block.wgt
                fwd_alone += count * block.fwd_alone
                bwd_alone += count * block.bwd_alone
                gathers += count * block.gathers
                scatters += count * block.scatters
                if name.startswith("layer."):
                    if recomputes:
                        again = count if limit is None else max(0, min(count, limit - layers_before))
                        if again:
                            rec = recomputed(name)
                            bwd += again * rec.floor
                            bwd_alone += again * rec.alone
                    layers_before += count
            forward, backward = max(fwd, gathers), max(bwd, gathers)
            if gathers:
                # ZeRO-3: a task's compute cannot start before the first instance's parameters have arrived, nor its
                # last instance's compute before every gather has run on the dp stream, one after another (the
                # forward gathers in chunk order, the backward in reverse; each instance computes after its own).
                head, tail = floors(chunk.blocks[0][0]), floors(chunk.blocks[-1][0])
                forward = max(forward, head.gathers + fwd_alone, gathers + tail.fwd_alone)
                backward = max(backward, tail.gathers + bwd_alone, gathers + head.bwd_alone)
            if split_w:
                total += forward + backward + max(wgt, scatters)
            else:
                total += forward + max(backward + wgt, gathers + scatters)
            if c == 0:
                first_forward = forward
        floor = max(floor, fill + m * total)
        fill += first_forward
    return floor


class _BlockFloor(NamedTuple):
    """A block instance's floors (:func:`_compute_floor`): its forward, backward and weight-gradient compute floors
    (:func:`~simulator.engine.fold.compute_end_floor`), the seconds of its ZeRO-3 parameter gathers and ZeRO-2/3
    gradient scatters, and its forward's and backward's compute alone (:func:`_compute_alone`)."""

    fwd: float
    bwd: float
    wgt: float
    gathers: float
    scatters: float
    fwd_alone: float
    bwd_alone: float


class _RecomputeFloor(NamedTuple):
    """A block instance's recomputation: its compute floor and its compute alone."""

    floor: float
    alone: float


def _block_floor(
    graph: ModelGraph, layout: Layout, key: tuple[Any, ...], name: str, compute: ComputeModel, comm: CommModel
) -> _BlockFloor:
    """A block instance's floors, kept across candidates and calls (a search sizes every candidate, and a repeated
    call sizes them all again) under the layout's :func:`~simulator.parallel.program.instance_key`: candidates that
    differ only in their recomputation share them."""
    hit = _BLOCK_FLOORS.get((*key, name, None))
    if hit is not None:
        assert isinstance(hit[2], _BlockFloor)
        return hit[2]
    fwd, bwd, wgt = block_programs(graph, layout, name)
    gathers, scatters = instance_dp_comms(graph, layout, name)
    timed_fwd, timed_bwd = _timed(fwd, compute, comm), _timed(bwd, compute, comm)
    got = _BlockFloor(
        fwd=compute_end_floor(timed_fwd),
        bwd=compute_end_floor(timed_bwd),
        wgt=compute_end_floor(_timed(wgt, compute, comm)),
        gathers=sum(comm.time(c) for c in gathers),
        scatters=sum(comm.time(c) for c in scatters),
        fwd_alone=_compute_alone(timed_fwd),
        bwd_alone=_compute_alone(timed_bwd),
    )
    _BLOCK_FLOORS.put((*key, name, None), (compute, comm, got))  # the models held, so that their ids stay theirs
    return got


def _recompute_floor(
    graph: ModelGraph, layout: Layout, key: tuple[Any, ...], name: str, compute: ComputeModel, comm: CommModel
) -> _RecomputeFloor:
    """A block instance's recomputation floors under the layout's recompute mode, kept as :func:`_block_floor`
    keeps its floors (the mode added to the key)."""
    hit = _BLOCK_FLOORS.get((*key, name, layout.recompute))
    if hit is not None:
        assert isinstance(hit[2], _RecomputeFloor)
        return hit[2]
    timed = _timed(recompute_program(graph, layout, name), compute, comm)
    got = _RecomputeFloor(compute_end_floor(timed), _compute_alone(timed))
    _BLOCK_FLOORS.put((*key, name, layout.recompute), (compute, comm, got))
    return got


def _compute_alone(steps: list[TimedStep]) -> float:
    """The nominal seconds of a program's compute steps, which its compute stream runs one after another."""
    return sum(st.duration_s for st in steps if st.kind == "compute")


# Block floors across calls; an entry is a few floats (and the key).
BLOCK_FLOORS_MAX = 4096
_BLOCK_FLOORS: _Recent[tuple[ComputeModel, CommModel, _BlockFloor | _RecomputeFloor]] = _Recent(BLOCK_FLOORS_MAX)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A plan with every duration computed, ready for the engine (see :func:`_prepare`)."""

    plan: PlanSpec
    layout: Layout
    graph: ModelGraph
    memory: tuple[StageMemory, ...]
    reason: str
    chosen: dict[str, Any]
    pipe: PipelineInput
    hw_flops_rank: float
    uncalibrated: frozenset[str]


def _prepare(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: PlanSpec,
    record: bool,
    chosen: dict[str, Any],
    *,
    memory_only_if_infeasible: bool = False,
    sized: _Sized | None = None,
    fold_memo: _FoldMemo | None = None,
    defer: bool = False,
) -> StepResult | _Prepared | _Deferred:
    """Everything up to the engine: layout, graph, memory, schedule and the engine's input.

    Returns the (infeasible) result already when the plan does not fit and ``memory_only_if_infeasible``;
    ``sized`` is the plan's :func:`_layout_memory` where the caller has it already, ``fold_memo`` the search's
    folded programs (:func:`_pipeline_input`). With ``defer``, a plan that fits comes back sized, with its compute
    floor, for :func:`_ready` to finish when the search needs it.
    """
    sized = sized if sized is not None else _layout_memory(model, cluster, plan)
    layout, graph, chunks, memory = sized
    if plan.expert_tp is None and layout.experts_folded:
        chosen = {**chosen, "expert_tp": layout.etp}  # MoE parallel folding was the only way to place ep
    over = [m for m in memory if m.over > 0]
    reason = ""
    if over:
        worst = max(over, key=lambda m: m.over)
        reason = f"out of memory: stage {worst.stage} needs {worst.describe()}; {fmt_bytes(worst.over)} over"
        if memory_only_if_infeasible:
            # With the defaults it was sized under written out, as a timed result's plan has them (_as_run).
            return _infeasible_result(model, cluster, _as_run(plan, layout, model), memory, reason, chosen)
    compute, comm = _models(cluster, plan.precision, plan.straggler_factor)
    if defer and not over:
        return _Deferred(plan, chosen, sized, fold_memo, _compute_floor(graph, layout, chunks, compute, comm))
    # The models are shared across calls; their uncalibrated sets must describe this run only.
    compute.uncalibrated.clear()
    comm.uncalibrated.clear()
    slowdown = _overlap_slowdown(cluster)
    # The task orders, only now that the engine needs them (sizing needed only their in-flight counts).
    orders = schedule_with_in_flight(layout.schedule, plan.pp, layout.num_micro_batches, layout.vp)[0]
    pipe, hw_flops_rank = _pipeline_input(
        graph, layout, chunks, orders, compute, comm, slowdown, cluster, record, fold_memo
    )
    labels = frozenset(compute.uncalibrated | comm.uncalibrated)
    return _Prepared(plan, layout, graph, memory, reason, chosen, pipe, hw_flops_rank, labels)


class _Queue:
    """Deferred candidates (``(floor, plan index, candidate index, deferred)``) in the order of their engine lower
    bounds, each prepared (programs built, timed and folded) only when the search reaches its floor.

    :meth:`pop` returns the candidate with the smallest :func:`~simulator.engine.pipeline.lower_bound` among those
    not yet returned or skipped: a candidate's floor is at most its bound, so once the smallest prepared bound is no
    larger than the next floor, no candidate still deferred can come before it. The engine therefore meets the
    candidates in the order the search met them when it prepared every one first (ties of equal bounds aside),
    and candidates whose floor is already beyond their plan's limit are never prepared.
    """

    def __init__(
        self, items: list[tuple[float, int, int, _Deferred]], cluster: ClusterSpec, models: Sequence[ModelSpec]
    ) -> None:
        self._pending = sorted(items, key=lambda item: (item[0], item[1], item[2]))
        self._next = 0
        self._heap: list[tuple[float, int, int, int, _Prepared]] = []  # (bound, plan, candidate, arrival, ...)
        self._arrivals = 0
        self._cluster = cluster
        self._models = models

    def pop(
        self, limit: Callable[[int], float], skipped: Callable[[int, float], None] | None = None
    ) -> tuple[float, int, int, _Prepared] | None:
        """The next candidate whose bound is within ``limit(plan index)``, or None when none is left; candidates
        passed over because their floor or bound exceeds their plan's limit are reported to ``skipped``."""
        while True:
            floor = self._pending[self._next][0] if self._next < len(self._pending) else math.inf
            if self._heap and self._heap[0][0] <= floor:
                bound, pi, ci, _, ready = heapq.heappop(self._heap)
                if bound <= limit(pi):
                    return bound, pi, ci, ready
                if skipped is not None:
                    skipped(pi, bound)
            elif self._next < len(self._pending):
                _, pi, ci, deferred = self._pending[self._next]
                self._next += 1
                if floor > limit(pi):
                    if skipped is not None:
                        skipped(pi, floor)
                    continue
                ready = _ready(self._models[pi], self._cluster, deferred)
                heapq.heappush(self._heap, (lower_bound(ready.pipe), pi, ci, self._arrivals, ready))
                self._arrivals += 1
            else:
                return None


def _ready(model: ModelSpec, cluster: ClusterSpec, deferred: _Deferred) -> _Prepared:
    """A deferred candidate prepared for the engine, as :func:`_prepare` would have prepared it at once."""
    got = _prepare(
        model, cluster, deferred.plan, False, deferred.chosen, sized=deferred.sized, fold_memo=deferred.folds
    )
    assert isinstance(got, _Prepared)  # it fits: _prepare returns early only for a plan that does not
    return got


def _finish(model: ModelSpec, cluster: ClusterSpec, prepared: _Prepared) -> StepResult:
    """Run the engine on a prepared plan and assemble the answer."""
    return _assemble(model, cluster, prepared, simulate_pipeline(prepared.pipe))


def _timed(program: Program, compute: ComputeModel, comm: CommModel) -> list[TimedStep]:
    """Each step with its duration. A chunk repeats its layers' op objects once per layer instance
    (``program._build``), so each distinct object is timed once here: the cost models' own per-shape caches
    would give the same seconds, but building their keys for every step of every layer was a fifth of a search."""
    out: list[TimedStep] = []
    seconds: dict[int, float] = {}  # id of an op or comm of this program (alive as long as the program) -> s
    for step in program:
        work = step.work
        duration = seconds.get(id(work))
        if isinstance(work, Comm):
            if duration is None:
                duration = seconds[id(work)] = comm.time(work)
            out.append(TimedStep(work.name, step.stream, duration, step.waits, work.kind))
        else:
            if duration is None:
                duration = seconds[id(work)] = compute.time(work)
            out.append(TimedStep(work.name, step.stream, duration, step.waits, "compute", step.overlapped))
    return out


def _program_flops(program: Program, layout: Layout) -> float:
    """FLOPs one rank of average load executes: the programs time the busiest rank's experts (expert
    imbalance), but the cluster as a whole does the mean amount of expert work."""
    seen: dict[int, float] = {}  # per distinct op object of the program (a chunk repeats its layers' ops)
    out: list[float] = []
    for s in program:
        work = s.work
        if isinstance(work, Comm):
            continue
        flops = seen.get(id(work))
        if flops is None:
            flops = seen[id(work)] = work.flops / expert_load(work, layout)
        out.append(flops)
    return sum(out)  # summed as before, in program order


def _pipeline_input(
    graph: ModelGraph,
    layout: Layout,
    chunks: tuple[tuple[Chunk, ...], ...],
    orders: tuple[tuple[Any, ...], ...],
    compute: ComputeModel,
    comm: CommModel,
    slowdown: float,
    cluster: ClusterSpec,
    record: bool,
    fold_memo: _FoldMemo | None = None,
) -> tuple[PipelineInput, float]:
    """The engine's input for a sized plan, and the FLOPs one rank executes. ``fold_memo`` (one free-knob search)
    shares the folded chunk programs between plans that differ only in ``grad_overlap``, which the programs do
    not depend on: it shapes only how the engine overlaps the gradient reduction."""
    plan = layout.plan
    m = layout.num_micro_batches
    grad_b = plan.grad_bytes
    zero = plan.zero_stage
    stages: list[StageInput] = []
    hw_flops = 0.0
    bucket_params = max(BUCKET_PARAMS_MIN, BUCKET_PARAMS_PER_DP * plan.dp)  # plan.dp: without cp, as Megatron
    host = _launch_overhead(cluster)
    folds: _Folds = {}
    if fold_memo is not None and not record:  # a timeline is recorded for the one plan that asks for it, alone
        # Gradient overlap changes no program but ZeRO-2/3's, whose per-layer reduce-scatters it makes blocking.
        shared = plan if reduces_in_backward(plan) else replace(plan, grad_overlap=None)
        folds = fold_memo.setdefault(shared, {})
    for s, stage_chunks in enumerate(chunks):
        fwd: list[FoldResult] = []
        bwd: list[FoldResult] = []
        wgt: list[FoldResult] = []
        buckets: list[tuple[float, ...]] = []
        bucket_sizes: list[float] = []  # parameters per bucket of each chunk (_chunk_bucket_params)
        # Per chunk: (dense, expert, FP8 dense, FP8 expert) local parameters (stage_params).
        params: list[tuple[float, float, float, float]] = []
        for chunk in stage_chunks:
            folded = folds.get(chunk.blocks)
            if folded is None:
                folded = folds[chunk.blocks] = _fold_chunk(
                    graph, layout, chunk.blocks, compute, comm, slowdown, host, record
                )
            else:
                _reused(folded, compute, comm)
            fwd.append(folded.fwd)
            bwd.append(folded.bwd)
            wgt.append(folded.wgt)
            hw_flops += folded.flops * m
            params.append(stage_params(graph, layout, (chunk,)))
            dense, expert, _, _ = params[-1]
            bucket_sizes.append(_chunk_bucket_params(layout, s, chunk.chunk, bucket_params))
            buckets.append(_grad_buckets(dense, expert, layout, comm, grad_b, bucket_sizes[-1]) if zero < 2 else ())
        local_dense, local_expert, fp8_dense, fp8_expert = (sum(p[i] for p in params) for i in range(4))
        local_params = local_dense + local_expert
        # Optimizer step on this rank's shard (ZeRO-1 and up shard the optimizer of dense parameters over dp and
        # of the routed experts' over the expert-data-parallel group, as cost.memory counts it); the gradient
        # buffer it zeroes is sharded only from ZeRO-2 on (graph.transformer.optimizer_bytes).
        opt_params = local_dense / layout.dp.size + local_expert / layout.edp.size if zero >= 1 else local_params
        opt_op = graph.optimizer_step(plan.precision, grad_b, opt_params, opt_params if zero >= 2 else local_params)
        optimizer_s = compute.time(opt_op)
        param_gather_s = 0.0
        gather_buckets: tuple[tuple[float, ...], ...] = ()
        if zero in (1, 2):
            # The updated 16-bit parameters are gathered back over the groups their optimizer is sharded over.
            # (FP8 layers' weights in 1 byte with fp8_param.)
            gathers = param_all_gathers(local_dense, local_expert, layout, "step", (fp8_dense, fp8_expert))
            param_gather_s = sum(comm.time(c) for c in gathers)
            if layout.grad_overlap:
                gather_buckets = tuple(
                    _param_gather_buckets(layout, comm, chunk_params, size)
                    for chunk_params, size in zip(params, bucket_sizes, strict=True)
                )
        tail = 0.0
        if graph.model.tied_embeddings and plan.pp > 1 and s in (0, plan.pp - 1):
            size = grad_b * graph.model.vocab * graph.model.hidden / layout.tp.size
            group = place(
                "embedding", 2, layout.pp.stride * (plan.pp - 1), cluster, offsets=layout.pp.stride, world=plan.num_gpus
            )
            tail = comm.time(Comm("embedding_grad_all_reduce", "all_reduce", group, size, "dp"))
        stages.append(
            StageInput(
                order=orders[s],
                fwd=tuple(fwd),
                bwd=tuple(bwd),
                wgt=tuple(wgt),
                dp_buckets=tuple(buckets),
                dp_tail_s=tail,
                optimizer_s=optimizer_s,
                param_gather_s=param_gather_s,
                param_gather_buckets=gather_buckets,
                dp_network=layout.dp.crosses_network or layout.edp.crosses_network,
                cp_network=layout.cp.crosses_network,
            )
        )
    act = 2.0 * layout.micro_batch * layout.seq_len / layout.cp.size * graph.model.hidden
    if layout.sequence_parallel:
        act /= layout.tp.size
    hops = _hops_on_network(layout.pp, cluster.job_domain_gpus(plan.num_gpus))
    sends = _hop_send_times(comm, layout.pp, act, hops)
    pipe = PipelineInput(
        stages=tuple(stages),
        hop_network=hops,
        vp=layout.vp,
        send_fwd_s=sends,
        send_bwd_s=sends,
        grad_overlap=layout.grad_overlap,
        overlap_slowdown=slowdown,
        record=record,
        # Megatron-Core's schedules align the launch; its ZB-H1 and GPipe orders are not its own.
        align_grad_reduce=plan.align_grad_reduce and layout.schedule in ("1f1b", "interleaved"),
        param_gather_at_step_start=plan.param_gather_at_step_start,
    )
    return pipe, hw_flops


def _hops_on_network(pp: Group, domain: int) -> tuple[bool, ...]:
    """Whether the hop from stage s to stage (s+1) mod p leaves the NVLink domain (``domain`` consecutive ranks) for
    any of the pipelines: consecutive stages are ``stride`` ranks apart (Megatron's order), and the pipelines start
    at ranks 0 … stride − 1. Ranks x and x + d (0 < d < domain) sit in different domains for some x in
    [a, a + stride) exactly when a multiple of ``domain`` lies in (a, a + stride − 1 + d]. The wrap from the last
    stage back to stage 0 (interleaved schedules) counts too: with p 6 and 4 stages a node, stages 4 and 5 sit on
    the second node, and with 16-GPU stages in 72-GPU racks, stage 4 straddles racks 0 and 1."""
    if pp.size <= 1:
        return ()
    stride = pp.stride

    def crosses(a: int, b: int) -> bool:
        a, b = min(a, b), max(a, b)
        return b - a >= domain or (b + stride - 1) // domain > a // domain

    return tuple(crosses(s * stride, ((s + 1) % pp.size) * stride) for s in range(pp.size))


def _hop_send_times(comm: CommModel, pp: Group, size: float, hops: tuple[bool, ...]) -> tuple[float, ...]:
    """Seconds to send one micro-batch's activations (or their gradients) over each pipeline hop: a hop inside
    an NVLink domain goes over NVLink, one that leaves it over the NICs, even when other hops of the same
    pipeline cross the network (tp·cp·dp smaller than a node puts several stages on one node)."""
    if pp.size <= 1:
        return (0.0,) * pp.size
    by_link = {
        crosses: comm.time(
            Comm(
                "pp_send",
                "send_recv",
                Group(pp.name, 2, pp.stride, 1 if crosses else 2, 2 if crosses else 1),
                size,
                "pp",
            )
        )
        for crosses in set(hops)
    }
    return tuple(by_link[crosses] for crosses in hops)


def _chunk_bucket_params(layout: Layout, stage: int, chunk: int, bucket_params: int) -> float:
    """Parameters per gradient (and parameter-gather) bucket of model chunk ``chunk`` on pipeline stage ``stage``.
    Megatron-Core's DDP buckets only where the communication is on the critical path: with overlapped reduction, on
    the first pipeline stage, for its first model chunk; elsewhere each buffer is one bucket
    (``distributed_data_parallel.py``: ``bucket_size = None`` when not ``overlap_grad_reduce``, when
    ``pp_rank > 0``, or with ``disable_bucketing``, which ``training.py`` sets for ``model_chunk_idx > 0``)."""
    return bucket_params if layout.grad_overlap and stage == 0 and chunk == 0 else math.inf


def _grad_buckets(
    dense: float, expert: float, layout: Layout, comm: CommModel, grad_b: int, bucket_params: float
) -> tuple[float, ...]:
    """Reduction time of each gradient bucket of a chunk (all-reduce, or reduce-scatter under ZeRO-1/2)."""
    collective = "all_reduce" if layout.plan.zero_stage == 0 else "reduce_scatter"
    out: list[float] = []
    for params, group in ((dense, layout.dp), (expert, layout.edp)):
        if params <= 0 or group.size <= 1:
            continue
        n = _bucket_count(params, bucket_params)
        size = grad_b * params / n
        t = comm.time(Comm("grad_bucket", collective, group, size, "dp"))
        out += [t] * n
    return tuple(out)


def _bucket_count(params: float, bucket_params: float) -> int:
    """How many buckets Megatron-LM's DDP splits ``params`` parameters of one buffer into."""
    return min(max(1, math.ceil(params / bucket_params)), GRAD_BUCKETS_MAX)


def _param_gather_buckets(
    layout: Layout, comm: CommModel, chunk: tuple[float, float, float, float], bucket_params: float
) -> tuple[float, ...]:
    """Seconds to all-gather each parameter bucket of one chunk under ZeRO-1/2, in the order its first forward needs
    them; ``chunk`` is its (dense, expert, FP8 dense, FP8 expert) local parameters (:func:`stage_params`).
    Megatron-Core gathers the updated parameters in the buckets the gradients were reduced in, each waited for in
    the forward pre-hook of the first layer that uses it (``overlap_param_gather``; ``distributed_data_parallel.py``,
    ``param_and_grad_buffer.py``; the engine says when each is dispatched). The dense and expert buffers are
    bucketed, and gathered, separately (as :func:`_grad_buckets` reduces them): the dense buckets, then the
    experts'."""
    dense, expert, fp8_dense, fp8_expert = chunk
    out: list[float] = []
    # Each buffer on its own, so that its gather (none over a group of one rank) goes with its own bucket count: with
    # dp 1 and an expert-data-parallel group the experts' gather had been paired with the dense buffer's count.
    for params, fp8, is_expert in ((dense, fp8_dense, False), (expert, fp8_expert, True)):
        n = _bucket_count(params, bucket_params)
        share = (0.0, params / n) if is_expert else (params / n, 0.0)
        in_fp8 = (0.0, fp8 / n) if is_expert else (fp8 / n, 0.0)
        for gather in param_all_gathers(*share, layout, "step.bucket", in_fp8):
            t = comm.time(gather)  # 0 for an empty buffer or a group of one rank
            if t > 0:
                out += [t] * n
    return tuple(out)


def _infeasible_result(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: PlanSpec,
    memory: tuple[StageMemory, ...],
    reason: str,
    chosen: dict[str, Any],
) -> StepResult:
    return StepResult(
        model=model.name,
        cluster=cluster.name,
        num_gpus=plan.num_gpus,
        plan=plan,
        feasible=False,
        reason=reason,
        step_time_s=math.nan,
        tokens_per_s=math.nan,
        model_flops=math.nan,
        hardware_flops=math.nan,
        mfu=math.nan,
        hfu=math.nan,
        memory=memory,
        breakdown={},
        stage_breakdown=(),
        critical_stage=None,
        chosen=chosen,
        uncalibrated_ops=(),
        calibration=cluster.calibration_label,
        launch_overhead_us=_measured_launch_overhead_us(cluster),
    )


def infeasible_result(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, reason: str) -> StepResult:
    """The answer for a plan that cannot run at all (what :func:`simulate` raises as InfeasiblePlanError), as a
    result: feasible False, the reason, no times and no memory."""
    return _infeasible_result(model, cluster, replace(plan, seq_len=plan.seq_len or model.seq_len), (), reason, {})


def _as_run(plan: PlanSpec, layout: Layout, model: ModelSpec) -> PlanSpec:
    """The plan with the defaults it ran under written out (schedule, sequence parallelism, expert TP, TP overlap,
    gradient dtype), so that a result says what ran and running its plan again gives the same answer."""
    return replace(
        plan,
        schedule=layout.schedule,
        sequence_parallel=layout.sequence_parallel,
        expert_tp=layout.etp if model.moe is not None else plan.expert_tp,
        tp_overlap=layout.tp_overlap,
        grad_dtype=plan.grad_dtype_or_default,
    )


def _assemble(model: ModelSpec, cluster: ClusterSpec, prepared: _Prepared, result: PipelineResult) -> StepResult:
    plan, layout, graph, memory = prepared.plan, prepared.layout, prepared.graph, prepared.memory
    reason, chosen, hw_flops_rank = prepared.reason, prepared.chosen, prepared.hw_flops_rank
    step = result.step_time_s
    sequences = plan.global_batch
    tokens = sequences * layout.seq_len
    model_flops = graph.step_model_flops() * (sequences / layout.micro_batch)
    model_flops_causal = graph.step_model_flops(causal=True) * (sequences / layout.micro_batch)
    ranks_per_stage = layout.tp.size * layout.cp.size * plan.dp
    hardware_flops = hw_flops_rank * ranks_per_stage
    peak = cluster.device.peak("fp16" if plan.precision == "fp16" else "bf16")
    denom = step * plan.num_gpus * peak
    stages = tuple(st.as_dict() for st in result.stages)
    crit = stages[result.critical_stage]
    return StepResult(
        model=model.name,
        cluster=cluster.name,
        num_gpus=plan.num_gpus,
        plan=_as_run(plan, layout, model),
        feasible=not reason,
        reason=reason,
        step_time_s=step,
        tokens_per_s=tokens / step if step > 0 else math.inf,
        model_flops=model_flops,
        hardware_flops=hardware_flops,
        mfu=model_flops / denom if denom > 0 else 0.0,
        hfu=hardware_flops / denom if denom > 0 else 0.0,
        memory=memory,
        breakdown=dict(crit),
        stage_breakdown=stages,
        critical_stage=result.critical_stage,
        chosen=chosen,
        uncalibrated_ops=tuple(sorted(prepared.uncalibrated)),
        calibration=cluster.calibration_label,
        launch_overhead_us=_measured_launch_overhead_us(cluster),
        timeline=result.timeline,
        model_flops_causal=model_flops_causal,
        peak_tflops_per_gpu=peak / 1e12,
    )
