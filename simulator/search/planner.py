"""The auto-planner: the fastest layouts of one training job, found through the engine.

:func:`autoplan` enumerates the layouts of a job (:func:`simulator.search.layouts.layouts`), leaves the free knobs
(micro-batch, interleaving, recomputation, gradient overlap) to the simulator's own search, and ranks the layouts with
:func:`simulator.run.rank`: every candidate of every layout is sized and costed, and the engine runs them in the order
of a lower bound on their step, stopping once no bound can beat the ``top``-th fastest layout found. The ranking is
therefore the engine's, never a formula's (Design: ``search/`` must not bypass the engine for final rankings), and
each layout it returns has exactly the result ``simulate`` gives that layout. A layout whose bound rules it out is
reported as ``pruned`` with that bound, not dropped; so are those that do not fit or cannot run, with their reasons.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from simulator.errors import SpecError
from simulator.run import Ranked, StepResult, infeasible_result, rank, row_columns
from simulator.search.layouts import layouts
from simulator.specs._fields import check_whole
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec
from simulator.units import fmt_seconds

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["AutoPlan", "autoplan"]


@dataclass(frozen=True, slots=True)
class AutoPlan:
    """What :func:`autoplan` found: every layout searched, in enumeration order, with its ranking entry."""

    model: str
    cluster: str
    num_gpus: int
    global_batch: int
    top: int
    layouts: tuple[PlanSpec, ...]
    ranked: tuple[Ranked, ...]

    @property
    def best_layouts(self) -> tuple[int, ...]:
        """The indices of the ``top`` fastest layouts that fit, fastest first (a tie goes to the earlier layout)."""
        timed = [(r.step_time_s, i) for i, r in enumerate(e.result for e in self.ranked) if r and r.feasible]
        return tuple(i for _, i in sorted(timed)[: self.top])

    @property
    def best(self) -> tuple[StepResult, ...]:
        """The results of :attr:`best_layouts`."""
        return tuple(self.ranked[i].result for i in self.best_layouts)  # type: ignore[misc]

    def status(self, index: int) -> str:
        """``ok`` (among the ``top`` fastest, with its result), ``out_of_memory``, ``cannot_run`` or ``pruned`` (it
        fits, but is not among the ``top`` fastest: the engine ran its candidates only as far as it took to show
        that, and its result is not kept)."""
        result = self.ranked[index].result
        return "pruned" if result is None else result.status

    def counts(self) -> dict[str, int]:
        """How many layouts have each status."""
        out = dict.fromkeys(("ok", "pruned", "out_of_memory", "cannot_run"), 0)
        for i in range(len(self.layouts)):
            out[self.status(i)] += 1
        return out

    def rows(self, model: ModelSpec, cluster: ClusterSpec) -> list[dict[str, Any]]:
        """One flat row per layout: ``layout`` (its index), ``status``, ``bound_s`` and
        :meth:`~simulator.run.StepResult.to_row`'s columns (a pruned layout has its plan and no figures)."""
        out = []
        for i, (plan, entry) in enumerate(zip(self.layouts, self.ranked, strict=True)):
            if entry.result is None:
                reason = (
                    f"pruned: not among the {self.top} fastest layout{'s' if self.top != 1 else ''}, so not timed to "
                    f"the end (the lower bound of its candidates: {fmt_seconds(entry.bound_s)})"
                )
                row = infeasible_result(model, cluster, plan, reason).to_row()
                row["feasible"] = True  # it fits; only its time was not worth the engine's
            else:
                row = entry.result.to_row()
            out.append({"layout": i, "status": self.status(i), "bound_s": _finite(entry.bound_s), **row})
        return out

    def to_frame(self, model: ModelSpec, cluster: ClusterSpec) -> pd.DataFrame:
        """:meth:`rows` as a DataFrame with the same columns whatever the layouts."""
        import pandas as pd

        return pd.DataFrame.from_records(
            self.rows(model, cluster), columns=["layout", "status", "bound_s", *row_columns()]
        )


def autoplan(
    model: ModelSpec,
    cluster: ClusterSpec,
    num_gpus: int,
    global_batch: int,
    *,
    top: int = 5,
    tp: Sequence[int] | int | None = None,
    pp: Sequence[int] | int | None = None,
    cp: Sequence[int] | int | None = None,
    ep: Sequence[int] | int | None = None,
    zero_stage: Sequence[int] | int | None = None,
    max_tp: int | None = None,
    workers: int = 1,
    **fixed: Any,
) -> AutoPlan:
    """The ``top`` fastest layouts of ``model`` on ``num_gpus`` GPUs of ``cluster`` at ``global_batch`` sequences
    per step, and the fate of every other layout.

    ``tp``, ``pp``, ``cp``, ``ep``, ``zero_stage`` and ``max_tp`` narrow the search
    (:func:`simulator.search.layouts.layouts`); other plan keys in ``fixed`` (``seq_len``, ``precision``,
    ``attention``, ``micro_batch``...) hold for every layout, and the free knobs left out are chosen per layout.
    ``workers`` local processes share the layouts and the fastest steps each has found, to prune against; the answer
    is the same with any number of them (only the ``top`` keep their results).

    Raises
    ------
    SpecError
        For a bad argument, or when no layout of the job exists (no tp divides the heads, no dp divides the batch).

    Examples
    --------
    >>> from simulator.specs import load_cluster, load_model
    >>> found = autoplan(load_model("llama3-8b"), load_cluster("dgx-h100"), 16, 64, top=1, zero_stage=[1])
    >>> best = found.best[0]
    >>> (best.plan.tp, best.plan.pp, best.plan.cp), found.counts()["ok"]
    ((1, 1, 2), 1)
    """
    check_whole("autoplan: top", top, "ask for 1 or more layouts")
    found = layouts(
        model,
        cluster,
        num_gpus,
        global_batch,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        zero_stage=zero_stage,
        max_tp=max_tp,
        **fixed,
    )
    if not found:
        raise SpecError(
            "autoplan",
            f"no layout of {model.name} fits the rules on {num_gpus} GPUs with a global batch of {global_batch}: "
            "tp must divide the heads and stay within an NVLink domain, pp split the layers, dp divide the batch",
            "change the GPU count or the global batch, or name the degrees to try",
        )
    check_whole("autoplan: workers", workers, "use 1 to run in-process")
    ranked = _ranked(model, cluster, found, top, min(workers, len(found)))
    # Only the top keep their results: which other layouts a ranking happens to time to the end depends on how the
    # layouts were shared among the workers, and the answer must not.
    timed = sorted((r.result.step_time_s, i) for i, r in enumerate(ranked) if r.result and r.result.feasible)
    best = {i for _, i in timed[:top]}
    ranked = [
        Ranked(None, r.bound_s) if r.result is not None and r.result.feasible and i not in best else r
        for i, r in enumerate(ranked)
    ]
    return AutoPlan(model.name, cluster.name, num_gpus, global_batch, top, tuple(found), tuple(ranked))


def _ranked(model: ModelSpec, cluster: ClusterSpec, found: list[PlanSpec], top: int, workers: int) -> list[Ranked]:
    """:func:`rank` over the layouts, on ``workers`` processes. Each ranks every workers-th layout, pruning against the
    ``top`` fastest steps of all shares so far (:class:`_Board`, each a step some layout reaches, so the ``top``
    fastest of all are never pruned); every result a share returns is exact, so merging the shares gives the
    ranking of one process, with perhaps a few more layouts timed."""
    if workers == 1:
        return rank(model, cluster, found, top=top)
    from simulator.sweep import process_context

    context = process_context()
    board = context.Array("d", [math.inf] * (workers * top))  # each share's fastest steps so far (_Board)
    shares = [found[w::workers] for w in range(workers)]
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_share_board, initargs=(board,)
    ) as pool:
        parts = list(pool.map(_rank_share, [(model, cluster, share, top, w) for w, share in enumerate(shares)]))
    merged: list[Ranked] = [Ranked(None, math.nan)] * len(found)
    for w, part in enumerate(parts):
        merged[w::workers] = part
    return merged


class _Board:
    """The shares' fastest steps so far, one row of ``top`` per share in shared memory (:class:`simulator.run.Peers`):
    a share prunes against the ``top``-th fastest of all rows, its own included, so the workers rank as one process
    would prune instead of each timing a ``top`` of its own."""

    def __init__(self, board: Any, top: int, row: int) -> None:
        self._board, self._top, self._row = board, top, row

    def cutoff(self) -> float:
        with self._board.get_lock():
            steps = sorted(self._board[:])
        return float(steps[self._top - 1])

    def publish(self, fastest: Sequence[float]) -> None:
        row = [*fastest[: self._top], *[math.inf] * (self._top - len(fastest))]
        with self._board.get_lock():
            self._board[self._row * self._top : (self._row + 1) * self._top] = row


_WORKER: dict[str, Any] = {}  # in a worker process: the pool's shared board (_share_board)


def _share_board(board: Any) -> None:
    _WORKER["board"] = board


def _rank_share(job: tuple[ModelSpec, ClusterSpec, list[PlanSpec], int, int]) -> list[Ranked]:
    model, cluster, share, top, row = job
    return rank(model, cluster, share, top=top, peers=_Board(_WORKER["board"], top, row))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
