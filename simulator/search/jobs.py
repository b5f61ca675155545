"""Several training jobs on one cluster: how many GPUs each gets, in which layout, and when all are done.

A capacity planner with a fixed cluster and a list of jobs (a model, a token budget, a global batch) asks how to
share the GPUs so that the last job finishes first. Each job is planned on every whole-node GPU count it could get
(:func:`simulator.search.planner.autoplan`: the fastest layout at that count, with the job's own fixed knobs), which
gives its training time as a function of its GPUs. Three schedules are then compared, as Hydra-style multi-model
training compares sharing the cluster in space with sharing it in time (Nagrecha and Kumar, "Hydra: A System for
Large Multi-Model Deep Learning", arXiv:2110.08633):

* **side by side**: every job on its own partition of whole nodes, all starting at once. The smallest makespan is
  found exactly over the planned counts: for a target time each job takes the fewest GPUs that finish it by then,
  and the least target whose partitions fit in the cluster wins (the sum of those fewest GPUs only grows as the
  target shrinks, so a bisection over the candidate times finds it). GPUs left over then go, whole counts at a
  time, to whichever job is last to finish, while that shortens it, and then to the other jobs, slowest first,
  wherever a larger planned count shortens them (the makespan stays; they finish sooner and free their GPUs).
* **re-planned as jobs finish**: side by side, and whenever a job finishes the jobs still running are laid out
  again on the whole cluster for the work they have left (the same exact least-makespan choice), so that GPUs a
  finished job frees are not left idle. A job that changes its GPU count restarts from a checkpoint in its new
  layout; the restart is not charged (minutes against days). Never later than side by side: the allocation it had
  is among those each re-planning may keep.
* **one after another**: each job alone on the cluster, on the planned count that trains it fastest, in the
  order given.

The answer is the shortest of the three, with all reported. A job that fits on no planned count is reported with the
reason, and the rest are scheduled without it. Training time is whole steps of global batch × sequence at the
simulated step time (:meth:`simulator.run.StepResult.time_to_train`): no restarts, evaluation or checkpoints.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from simulator.errors import SpecError
from simulator.run import StepResult
from simulator.search.planner import autoplan
from simulator.specs._fields import check_whole
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec

__all__ = ["SCHEDULES", "Job", "JobPlan", "Phase", "Schedule", "gpu_counts", "schedule_jobs"]


@dataclass(frozen=True)
class Job:
    """One training job: ``tokens`` tokens of ``model`` at ``global_batch`` sequences per step; ``plan`` holds the
    knobs the job fixes (``tp: 8``, ``precision: fp8``...; lists narrow the search), the rest is planned per GPU
    count. ``min_gpus`` and ``max_gpus`` bound the counts it may get."""

    name: str
    model: ModelSpec
    tokens: float
    global_batch: int
    plan: dict[str, Any] = field(default_factory=dict)
    min_gpus: int = 1
    max_gpus: int | None = None


@dataclass(frozen=True)
class JobPlan:
    """A job on ``gpus`` GPUs: its fastest layout there (``result``) and its training time, or why it cannot run."""

    job: str
    gpus: int
    result: StepResult | None
    days: float
    reason: str = ""

    @property
    def gpu_days(self) -> float:
        return self.days * self.gpus


@dataclass(frozen=True)
class Phase:
    """Part of a job's training in a re-planned schedule: ``plan``'s GPUs and layout from ``start`` to ``end``
    (days since the schedule began)."""

    plan: JobPlan
    start: float
    end: float


SCHEDULES = ("side_by_side", "replanned", "one_after_another")  # the order a tie is broken in
TIE = 1e-9  # relative difference in days below which two schedules tie


@dataclass(frozen=True)
class Schedule:
    """The three schedules and every plan they were built from (see the module docstring)."""

    cluster: str
    gpus: int
    jobs: tuple[str, ...]
    plans: tuple[JobPlan, ...]  # every job on every planned count
    side_by_side: tuple[JobPlan, ...]  # one per job that can run, in the jobs' order
    side_by_side_days: float
    one_after_another: tuple[JobPlan, ...]
    one_after_another_days: float
    unplanned: tuple[tuple[str, str], ...]  # (job, why it runs on no count)
    replanned: tuple[Phase, ...] = ()  # every job's phases, in the order they start
    replanned_days: float = math.inf

    def days(self, which: str) -> float:
        """When the last job of schedule ``which`` (one of :data:`SCHEDULES`) ends; inf where it is not possible."""
        return float(getattr(self, f"{which}_days"))

    @property
    def best(self) -> str | None:
        """The schedule that finishes every job soonest (ties in the order of :data:`SCHEDULES`); None where no job
        can run."""
        least = min(self.days(w) for w in SCHEDULES)
        if not math.isfinite(least):
            return None
        # Within rounding of the soonest is a tie (re-planned rebuilds side by side's end from its phases).
        return next(w for w in SCHEDULES if self.days(w) <= least * (1.0 + TIE))

    def idle_gpu_days(self, which: str) -> float:
        """GPU-days the cluster holds but no job uses before the last job ends, in schedule ``which`` (inf where that
        schedule is not possible)."""
        total = self.days(which)
        if not math.isfinite(total):
            return math.inf
        if which == "replanned":
            used = sum(ph.plan.gpus * (ph.end - ph.start) for ph in self.replanned)
        else:
            used = sum(p.gpu_days for p in (self.side_by_side if which == "side_by_side" else self.one_after_another))
        return max(0.0, self.gpus * total - used)  # not -3e-15 where every GPU is busy to the end

    def to_dict(self) -> dict[str, Any]:
        def plan(p: JobPlan) -> dict[str, Any]:
            r = p.result
            return {
                "job": p.job,
                "gpus": p.gpus,
                "days": p.days if math.isfinite(p.days) else None,
                "gpu_days": p.gpu_days if math.isfinite(p.days) else None,
                "step_time_s": r.step_time_s if r is not None and r.feasible else None,
                "mfu": r.mfu if r is not None and r.feasible else None,
                "plan": r.plan.as_dict() if r is not None else None,
                "reason": p.reason,
            }

        return {
            "cluster": self.cluster,
            "gpus": self.gpus,
            "best": self.best,
            "side_by_side": {
                "days": _finite(self.side_by_side_days),
                "idle_gpu_days": _finite(self.idle_gpu_days("side_by_side")),
                "jobs": [plan(p) for p in self.side_by_side],
            },
            "replanned": {
                "days": _finite(self.replanned_days),
                "idle_gpu_days": _finite(self.idle_gpu_days("replanned")),
                "phases": [
                    {
                        **plan(ph.plan),
                        "start_days": ph.start,
                        "end_days": ph.end,
                        "days": ph.end - ph.start,  # this phase's, not the whole job's at this count
                        "gpu_days": ph.plan.gpus * (ph.end - ph.start),
                        "whole_job_days_at_these_gpus": ph.plan.days,
                    }
                    for ph in self.replanned
                ],
            },
            "one_after_another": {
                "days": _finite(self.one_after_another_days),
                "idle_gpu_days": _finite(self.idle_gpu_days("one_after_another")),
                "jobs": [plan(p) for p in self.one_after_another],
            },
            "unplanned": [{"job": j, "reason": why} for j, why in self.unplanned],
            "plans": [plan(p) for p in self.plans],
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def gpu_counts(cluster: ClusterSpec, gpus: int, job: Job) -> list[int]:
    """Whole-node counts a job is planned on: one node and every power of two of nodes up to the cluster, what is
    left of the cluster beside each of those (so that two jobs can share it 48 + 16), and the whole cluster, within
    the job's bounds (a single count below one node where the cluster is smaller).

    >>> from simulator.specs import load_cluster, load_model
    >>> gpu_counts(load_cluster("dgx-h100"), 64, Job("j", load_model("llama3-8b"), 1e9, 64))
    [8, 16, 32, 48, 56, 64]
    """
    node = cluster.gpus_per_node
    counts = {gpus}
    n = 1
    while n * node <= gpus:
        counts.add(n * node)
        if gpus - n * node >= node and (gpus - n * node) % node == 0:
            counts.add(gpus - n * node)
        n *= 2
    top = min(gpus, job.max_gpus or gpus)
    return sorted(c for c in counts if job.min_gpus <= c <= top)


def _plan_job(job: Job, cluster: ClusterSpec, count: int, workers: int) -> JobPlan:
    try:
        # The job's knobs as autoplan takes them: tp, pp, cp, ep and zero_stage narrow the search, the rest hold.
        found = autoplan(job.model, cluster, count, job.global_batch, top=1, workers=workers, **job.plan)
    except SpecError as err:
        if err.where == "autoplan" or err.where.startswith("layouts"):
            # No layout of the job's knobs on this count (a fixed tp that does not divide it, say): a reason for
            # this count, while other counts and other jobs go on.
            return JobPlan(job.name, count, None, math.inf, f"on {count} GPUs: {err.where}: {err.what}")
        raise SpecError(f"job {job.name}: {err.where}", err.what, err.fix) from None
    if not found.best:
        counts = found.counts()
        over, cannot = counts["out_of_memory"], counts["cannot_run"]
        why = f"on {count} GPUs no layout fits ({over} out of memory, {cannot} cannot run)"
        reasons = sorted(
            {
                r.result.reason
                for r in found.ranked
                if r.result is not None and not r.result.feasible and r.result.reason
            }
        )
        if reasons:
            why += f": {reasons[0]}" + (f" (and {len(reasons) - 1} other reasons)" if len(reasons) > 1 else "")
        return JobPlan(job.name, count, None, math.inf, why)
    best = found.best[0]
    days = best.time_to_train(job.tokens)["days"]
    return JobPlan(job.name, count, best, days)


def schedule_jobs(
    jobs: Sequence[Job], cluster: ClusterSpec, gpus: int, *, workers: int = 1, counts: Sequence[int] | None = None
) -> Schedule:
    """Plan ``jobs`` on ``gpus`` GPUs of ``cluster`` and compare the three schedules (module docstring). ``counts``
    replaces the planned GPU counts (:func:`gpu_counts`) for every job; ``workers`` is the planner's.

    Raises
    ------
    SpecError
        No job, two jobs of one name, or a count that is not a whole number of GPUs up to ``gpus``.
    """
    check_whole("schedule: gpus", gpus, "give the GPUs of the cluster to share")
    if not jobs:
        raise SpecError("schedule: jobs", "is empty", "give one job or more")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise SpecError("schedule: jobs", f"name {twice[0]!r} is used twice", "give every job its own name")
    for c in counts or ():
        check_whole("schedule: counts", c, "give GPU counts")
        if c > gpus:
            raise SpecError("schedule: counts", f"{c} is more than the cluster's {gpus} GPUs", "give smaller counts")
    plans: list[JobPlan] = []
    by_job: dict[str, list[JobPlan]] = {}
    for job in jobs:
        options = sorted(set(counts)) if counts else gpu_counts(cluster, gpus, job)
        mine = [_plan_job(job, cluster, c, workers) for c in options]
        plans += mine
        by_job[job.name] = [p for p in mine if math.isfinite(p.days)]
    unplanned = tuple((j.name, _why_nowhere(j, plans, cluster, gpus)) for j in jobs if not by_job[j.name])
    runnable = [j.name for j in jobs if by_job[j.name]]
    side, side_days = _side_by_side(runnable, by_job, gpus)
    phases, replanned_days = _replanned(runnable, by_job, gpus) if side else ((), math.inf)
    if side_days < replanned_days <= side_days * (1.0 + TIE):
        replanned_days = side_days  # rebuilt from its phases, side by side's end can come out one rounding later
    serial = tuple(min(by_job[n], key=lambda p: (p.days, p.gpus)) for n in runnable)
    serial_days = sum(p.days for p in serial) if serial else math.inf
    return Schedule(
        cluster.name,
        gpus,
        tuple(names),
        tuple(plans),
        side,
        side_days,
        serial,
        serial_days,
        unplanned,
        phases,
        replanned_days,
    )


def _why_nowhere(job: Job, plans: list[JobPlan], cluster: ClusterSpec, gpus: int) -> str:
    """Why a job runs on none of its counts: each count's reason, or that it has no count at all."""
    mine = [p.reason for p in plans if p.job == job.name]
    if mine:
        return "; ".join(mine)
    bounds = f"min_gpus {job.min_gpus}" + (f" and max_gpus {job.max_gpus}" if job.max_gpus is not None else "")
    return f"no whole-node GPU count ({cluster.gpus_per_node} per node) within {bounds} of the {gpus} GPUs"


def _fewest(options: list[JobPlan], target: float) -> JobPlan | None:
    """The plan with the fewest GPUs that finishes by ``target`` (None where none does)."""
    fitting = [p for p in options if p.days <= target]
    return min(fitting, key=lambda p: (p.gpus, p.days)) if fitting else None


def _replanned(names: list[str], by_job: dict[str, list[JobPlan]], gpus: int) -> tuple[tuple[Phase, ...], float]:
    """Side by side, laid out again on the whole cluster each time a job finishes (module docstring). A job's left
    work is the fraction of its tokens not yet trained; on ``g`` GPUs it trains 1 / days(g) of them per day."""
    left = dict.fromkeys(names, 1.0)
    now = 0.0
    phases: list[Phase] = []
    running: dict[str, Phase] = {}
    while left:
        active = [n for n in names if n in left]
        # What each job has left, as the plans it could run it on: the same counts, days scaled by the work left.
        scaled = {n: [replace(p, days=p.days * left[n]) for p in by_job[n]] for n in active}
        chosen, _ = _side_by_side(active, scaled, gpus)
        if not chosen:  # cannot happen: the allocation before the last job finished still fits
            raise AssertionError("re-planning found no side-by-side allocation for the jobs left")
        step = min(p.days for p in chosen)
        now_next = now + step
        for p in chosen:
            full = next(q for q in by_job[p.job] if q.gpus == p.gpus)  # the count's whole-job plan
            current = running.get(p.job)
            if current is not None and current.plan.gpus == full.gpus:
                running[p.job] = replace(current, end=now_next)  # the same layout goes on
            else:
                if current is not None:
                    phases.append(current)
                running[p.job] = Phase(full, now, now_next)
            left[p.job] -= step / full.days
            if p.days <= step * (1.0 + 1e-12):  # done (the first to finish, or tied with it)
                del left[p.job]
                phases.append(running.pop(p.job))
        now = now_next
    phases.sort(key=lambda ph: (ph.start, names.index(ph.plan.job)))
    return tuple(phases), now


def _side_by_side(names: list[str], by_job: dict[str, list[JobPlan]], gpus: int) -> tuple[tuple[JobPlan, ...], float]:
    if not names:
        return (), math.inf
    times = sorted({p.days for n in names for p in by_job[n]})
    floor = max(min(p.days for p in by_job[n]) for n in names)  # no target below the slowest job's best time
    times = times[bisect.bisect_left(times, floor) :]

    def fits(target: float) -> list[JobPlan] | None:
        chosen = [_fewest(by_job[n], target) for n in names]
        if any(p is None for p in chosen):
            return None
        picked = [p for p in chosen if p is not None]
        return picked if sum(p.gpus for p in picked) <= gpus else None

    lo, hi = 0, len(times) - 1
    if fits(times[hi]) is None:
        return (), math.inf  # even the loosest target needs more GPUs than the cluster has: jobs must share in time
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(times[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    picked = fits(times[lo])
    assert picked is not None
    # GPUs left over: to the job that finishes last, a larger planned count at a time, while that shortens it.
    current = {p.job: p for p in picked}
    free = gpus - sum(p.gpus for p in picked)
    while True:
        last = max(current.values(), key=lambda p: (p.days, p.job))
        better = [p for p in by_job[last.job] if p.days < last.days and p.gpus - last.gpus <= free]
        if not better:
            break
        step = min(better, key=lambda p: (p.days, p.gpus))
        free -= step.gpus - last.gpus
        current[last.job] = step
    # Then to the other jobs, slowest first: the makespan stays, they finish sooner (a re-planned schedule hands
    # their GPUs on sooner; a finished job's GPUs had sat idle beside a job that could have used them).
    changed = True
    while changed and free > 0:
        changed = False
        for job in sorted(current, key=lambda n: (-current[n].days, names.index(n))):
            have = current[job]
            better = [p for p in by_job[job] if p.days < have.days and p.gpus - have.gpus <= free]
            if better:
                step = min(better, key=lambda p: (p.days, p.gpus))
                free -= step.gpus - have.gpus
                current[job] = step
                changed = True
                break
    chosen = tuple(current[n] for n in names)
    return chosen, max(p.days for p in chosen)
