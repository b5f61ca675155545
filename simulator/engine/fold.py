"""Exact evaluation of one task's program: a compute stream and communication streams with waits.

A program (see :mod:`simulator.parallel.program`) is a list of steps, each on one stream, each waiting for
some earlier steps. Every stream runs its steps in list order, one at a time; a step starts when its stream
is free and everything it waits for has finished. Because waits only point backwards, one pass over the
list computes every start and end time exactly: this is the discrete-event evaluation of a single task, done
without an event queue, and it is what lets the pipeline-level simulation treat a whole chunk's forward or
backward as one event (repeated layers folded, Design: What is simulated).

With ``host_overhead_s`` the host issues every step in program order, spending that long per launch
(framework dispatch and kernel launch); a step cannot start before it has been issued, and compute time
lost waiting for the host is reported as exposed ``host`` time. Because launches are asynchronous, the
host only limits the GPU when kernels are shorter than their launch cost.

Compute steps marked ``overlapped`` may run while a collective is in flight on the same GPU; for as long as
one actually is (up to the end of the latest collective issued so far), they are slowed by the overlap
slowdown factor (communication kernels take SMs and memory bandwidth; Design: Physics). A compute step that
starts after the collectives it could overlap have finished runs at full speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["FoldResult", "TimedStep", "compute_end_floor", "fold", "overlap_extra"]


class TimedStep(NamedTuple):
    """A program step with its duration: ``kind`` is ``compute`` or the comm's breakdown bucket. (A named tuple:
    one is built per step of every program timed.)"""

    name: str
    stream: str
    duration_s: float
    waits: tuple[int, ...]
    kind: str
    overlapped: bool = False


@dataclass(frozen=True, slots=True)
class FoldResult:
    """Outcome of one program.

    ``duration_s`` runs until the last stream finishes; ``compute_s`` is busy compute time (slowdown
    included); ``exposed`` maps a comm kind to the time compute spent waiting for it (plus any tail after
    compute ended); ``comm_s`` maps a kind to its total (possibly hidden) busy time. ``timeline`` holds
    ``(name, stream, kind, start, end)`` per step when requested. ``output_s`` is when the task's output (the
    activation or gradient the next stage needs) is ready: before ``duration_s`` only where detached collectives
    on the data-parallel stream (ZeRO-3's gradient reduce-scatters) run on after everything else; None means at the
    end.
    """

    duration_s: float
    compute_s: float
    exposed: tuple[tuple[str, float], ...]
    comm_s: tuple[tuple[str, float], ...]
    timeline: tuple[tuple[str, str, str, float, float], ...] = ()
    output_s: float | None = None

    @property
    def ready_s(self) -> float:
        """Seconds from the task's start until its output can be sent (:attr:`output_s`, else the duration)."""
        return self.duration_s if self.output_s is None else self.output_s

    def exposed_of(self, kind: str) -> float:
        """Exposed seconds of one comm kind."""
        return dict(self.exposed).get(kind, 0.0)


def overlap_extra(window: float, duration: float, slowdown: float) -> float:
    """Extra seconds of a compute kernel that alone takes ``duration`` and starts while collectives run for
    ``window`` more seconds: it runs ``1 + slowdown`` times slower while they overlap (the slowdown is of the
    overlapped kernels' time, arXiv:2507.03114), so it does ``window / (1 + slowdown)`` of its work in the window
    and the rest at full speed; when it overlaps throughout, it takes ``duration · (1 + slowdown)``.

    >>> overlap_extra(10.0, 1.0, 0.25), overlap_extra(0.5, 1.0, 0.25), overlap_extra(0.0, 1.0, 0.25)
    (0.25, 0.1, 0.0)
    """
    if window <= 0.0 or slowdown <= 0.0:
        return 0.0
    return min(window, duration * (1.0 + slowdown)) * slowdown / (1.0 + slowdown)


NOTHING = -1  # a step that started at time zero, or on its free stream with nothing to wait for
HOST = -2  # a step whose start the host's issue set


def _charge(
    exposed: dict[str, float],
    steps: Sequence[TimedStep],
    starts: list[float],
    bound_by: list[int],
    j: int,
    lo: float,
    hi: float,
) -> None:
    """Charge the idle compute interval [lo, hi], which ends when step ``j`` ends, to what kept compute waiting:
    ``j``'s own kind from its start on, and before that whatever held ``j`` back (the collective ahead of it on
    its stream, or the one it waited for), back along the chain. Two collectives run back to back are each
    charged their own part, not both to the one that ends last."""
    while hi > lo:
        if j == HOST:
            exposed["host"] = exposed.get("host", 0.0) + (hi - lo)
            return
        if j == NOTHING or steps[j].kind == "compute":
            return
        begin = max(starts[j], lo)
        kind = steps[j].kind
        exposed[kind] = exposed.get(kind, 0.0) + (hi - begin)
        hi = begin
        j = bound_by[j]


def fold(
    steps: Sequence[TimedStep], overlap_slowdown: float = 0.0, *, host_overhead_s: float = 0.0, timeline: bool = False
) -> FoldResult:
    """Evaluate a program.

    Examples
    --------
    >>> s = [TimedStep("a", "compute", 1.0, (), "compute"), TimedStep("c", "comm", 0.5, (0,), "tp"),
    ...      TimedStep("b", "compute", 1.0, (1,), "compute")]
    >>> r = fold(s)
    >>> r.duration_s, r.exposed
    (2.5, (('tp', 0.5),))
    """
    free: dict[str, float] = {}
    ends: list[float] = [0.0] * len(steps)
    compute_free = 0.0
    compute_s = 0.0
    exposed: dict[str, float] = {}
    comm: dict[str, float] = {}
    rows: list[tuple[str, str, str, float, float]] = []
    host_free = 0.0
    comm_busy_until = 0.0  # end of the latest collective issued so far, on any communication stream
    starts: list[float] = [0.0] * len(steps)
    # What set each step's start: the index of the step it waited for or followed on its stream, HOST for the
    # host's issue, NOTHING for time zero. Idle compute time is charged along this chain (_charge).
    bound_by: list[int] = [NOTHING] * len(steps)
    last_on: dict[str, int] = {}
    for i, step in enumerate(steps):
        ready = free.get(step.stream, 0.0)
        binder = last_on.get(step.stream, NOTHING)
        if host_overhead_s > 0:
            # The host issues every kernel in program order and runs ahead of the GPU (asynchronous launch);
            # a kernel cannot start before its launch has been issued.
            host_free += host_overhead_s
            if host_free > ready:
                ready = host_free
                binder = HOST
        binding_end = ready
        for w in step.waits:
            if ends[w] > binding_end:
                binding_end = ends[w]
                binder = w
        start = binding_end
        duration = step.duration_s
        if step.kind == "compute":
            if step.overlapped and overlap_slowdown > 0:
                # Slowed only while a collective runs beside it; the collective's own end does not move.
                duration += overlap_extra(comm_busy_until - start, duration, overlap_slowdown)
            if start > compute_free and binder != NOTHING:
                _charge(exposed, steps, starts, bound_by, binder, compute_free, start)
            compute_s += duration
            compute_free = start + duration
        else:
            comm[step.kind] = comm.get(step.kind, 0.0) + duration
            comm_busy_until = max(comm_busy_until, start + duration)
        end = start + duration
        ends[i] = end
        starts[i] = start
        bound_by[i] = binder
        free[step.stream] = end
        last_on[step.stream] = i
        if timeline:
            rows.append((step.name, step.stream, step.kind, start, end))
    total = max(ends, default=0.0)
    # The output waits for every step but the data-parallel collectives nothing in the program waits for.
    waited = {w for step in steps for w in step.waits}
    ready = max((ends[i] for i, st in enumerate(steps) if st.stream != "dp" or i in waited), default=0.0)
    if total > compute_free:
        # Collectives still running after the last compute: charged along the chain of the one that ends last.
        last = max(range(len(steps)), key=lambda j: (ends[j], -j))
        _charge(exposed, steps, starts, bound_by, last, compute_free, total)
    return FoldResult(
        duration_s=total,
        compute_s=compute_s,
        exposed=tuple(sorted(exposed.items())),
        comm_s=tuple(sorted(comm.items())),
        timeline=tuple(rows),
        output_s=ready if ready < total else None,
    )


def compute_end_floor(steps: Sequence[TimedStep]) -> float:
    """A lower bound on when the last compute step of ``steps`` ends, however the program runs.

    The program folded with every collective on a stream of its own, without the overlap slowdown and without a
    host: what remains are the waits and the compute stream's order, the longest chain through them. A fold is a
    max-plus evaluation, monotone in its durations and constraints, so sharing streams, slowing overlapped compute
    or waiting for a host only moves steps later; so does running the steps after others on the same streams, or
    with more waits (each start is at least its relaxed start shifted by when the compute stream became free).

    >>> s = [TimedStep("a", "compute", 1.0, (), "compute"), TimedStep("c", "comm", 0.5, (0,), "tp"),
    ...      TimedStep("d", "comm", 0.25, (0,), "tp"), TimedStep("b", "compute", 1.0, (1, 2), "compute")]
    >>> fold(s).duration_s, compute_end_floor(s)
    (2.75, 2.5)
    """
    relaxed = [st if st.kind == "compute" else st._replace(stream=f"{st.stream}#{i}") for i, st in enumerate(steps)]
    rows = fold(relaxed, timeline=True).timeline
    return max((end for _, _, kind, _, end in rows if kind == "compute"), default=0.0)
