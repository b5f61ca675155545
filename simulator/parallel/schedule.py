"""Pipeline schedules: the order in which each pipeline stage runs its micro-batch tasks.

A schedule is *generated* here and *executed* by the engine, which resolves the cross-stage dependencies
(a forward needs the previous stage's forward of the same micro-batch; a backward needs the next stage's
backward), so the pipeline bubble is an outcome of the simulation, never a formula.

* ``gpipe`` (Huang et al. 2019): all forwards, then all backwards; holds every micro-batch's activations.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): stage s runs p−s−1 warm-up forwards, then alternates
  one forward and one backward, then drains; holds at most p−s micro-batches.
* ``interleaved`` (Narayanan et al. SC21, Sec. 2.2; Megatron-LM ``forward_backward_pipelining_with_
  interleaving``): each stage holds ``vp`` model chunks; micro-batches advance in groups of p through the
  chunks; warm-up is 2·(p−s−1) + (v−1)·p tasks. As in Megatron-LM, the number of micro-batches must be a
  multiple of p.
* ``zb_h1`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 2.1, ZB-H1): the backward is split
  into B (activation gradient, sent upstream at once) and W (weight gradient). The backward dependency
  chain across stages carries only B, and each stage defers its W passes by as many micro-batches as it has
  fewer warm-up forwards than stage 0 (stage s runs W(j) after B(j+s)): the later stages, which would
  otherwise wait for the next forward, fill those gaps with weight gradients. Every stage then holds p
  micro-batches at its peak, stage 0's 1F1B peak, and the bubble is (p−1)·(F+B−W) against 1F1B's
  (p−1)·(F+B+W).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from threading import Lock

import numpy as np

from simulator.errors import InfeasiblePlanError

__all__ = [
    "SCHEDULES",
    "Task",
    "generate",
    "in_flight",
    "schedule_with_in_flight",
    "stage_in_flight",
    "steady_micro_batches",
]

# Schedules are pure functions of (schedule, p, m, v); the free-knob search sizes the same schedule once per
# recompute option it tries, and one search tries tens of (micro-batch, vp) pairs (GPT-3 175B on 1,024 GPUs: 38
# schedules, each needed again for its candidates' twins and recompute options), so the most recently used are
# kept (schedule_with_in_flight) up to 4,000,000 tasks and in-flight counts in all. Tasks are shared objects
# (_task), so a kept schedule costs a reference per task or count, 8 bytes: at most about 32 MB. One of more than
# 1,000,000 (p·m·v·2 tasks, plus about p·v² counts for a deep interleaved schedule) is rebuilt each time. A cache
# of 8 schedules had made such a search rebuild every one of them.
SCHEDULE_CACHE_BUDGET_TASKS = 4_000_000
SCHEDULE_CACHE_MAX_TASKS = 1_000_000

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")


@dataclass(frozen=True, slots=True)
class Task:
    """One task of one stage: ``kind`` F (forward), B (backward, or activation gradient for zb_h1) or W
    (weight gradient, zb_h1 only), for micro-batch ``mb`` and model chunk ``chunk``."""

    kind: str
    mb: int
    chunk: int = 0


# Per-stage task orders and, per stage, the micro-batches per chunk it holds at its peak (schedule_with_in_flight).
SizedSchedule = tuple[tuple[tuple[Task, ...], ...], tuple[tuple[tuple[int, ...], ...], ...]]


# Tasks are immutable, and every stage of a schedule (and every schedule of a search) names the same
# (kind, micro-batch, chunk) triples: building each once and sharing it makes generation about 3x faster.
_task = lru_cache(maxsize=1 << 16)(Task)


def generate(schedule: str, p: int, m: int, v: int = 1) -> tuple[tuple[Task, ...], ...]:
    """Per-stage task orders for ``p`` stages, ``m`` micro-batches and ``v`` chunks per stage.

    Examples
    --------
    >>> [t.kind + str(t.mb) for t in generate("1f1b", 2, 3)[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    if p < 1 or m < 1 or v < 1:
        raise InfeasiblePlanError(f"pipeline needs p, m, v >= 1: p={p}, m={m}, v={v}")
    if schedule == "gpipe":
        return tuple(_gpipe(m) for _ in range(p))
    if schedule == "1f1b":
        return tuple(_one_f_one_b(p, s, m) for s in range(p))
    if schedule == "interleaved":
        if v < 2:
            raise InfeasiblePlanError(f"the interleaved schedule needs vp >= 2, got vp={v}")
        if p < 2:
            # Megatron-LM asserts pipeline-model-parallel size > 1 with the interleaved schedule (arguments.py).
            raise InfeasiblePlanError(f"the interleaved schedule needs pp >= 2, got pp={p}")
        if m % p:
            raise InfeasiblePlanError(
                f"the interleaved schedule needs micro-batches to be a multiple of pp: "
                f"micro-batches={m}, pp={p} (Megatron-LM rule); change global batch, dp or micro_batch"
            )
        return tuple(_interleaved(p, s, m, v) for s in range(p))
    if schedule == "zb_h1":
        return tuple(_zb_h1(p, s, m) for s in range(p))
    raise InfeasiblePlanError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")


def _gpipe(m: int) -> tuple[Task, ...]:
    return tuple([_task("F", i) for i in range(m)] + [_task("B", i) for i in range(m)])


def _one_f_one_b(p: int, s: int, m: int) -> tuple[Task, ...]:
    warmup = min(p - s - 1, m)
    order = [_task("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order.append(_task("F", warmup + i))
        order.append(_task("B", i))
    order += [_task("B", i) for i in range(m - warmup, m)]
    return tuple(order)


def _interleaved(p: int, s: int, m: int, v: int) -> tuple[Task, ...]:
    total = m * v

    def forward_at(k: int) -> Task:
        group, pos = divmod(k, p * v)
        return _task("F", group * p + pos % p, pos // p)

    def backward_at(k: int) -> Task:
        group, pos = divmod(k, p * v)
        return _task("B", group * p + pos % p, v - 1 - pos // p)

    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [forward_at(k) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(forward_at(warmup + k))
        order.append(backward_at(k))
    order += [backward_at(k) for k in range(total - warmup, total)]
    return tuple(order)


def _zb_h1(p: int, s: int, m: int) -> tuple[Task, ...]:
    warmup = min(p - s - 1, m)
    order = [_task("F", i) for i in range(warmup)]

    def backward(i: int) -> None:
        order.append(_task("B", i))
        if i >= s:  # W deferred by s micro-batches (ZB-H1)
            order.append(_task("W", i - s))

    for i in range(m - warmup):
        order.append(_task("F", warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    order += [_task("W", i) for i in range(max(m - s, 0), m)]
    return tuple(order)


def in_flight(order: tuple[Task, ...], v: int = 1) -> tuple[tuple[int, ...], ...]:
    """The micro-batches per chunk whose activations a stage holds at each moment that can be its memory peak.

    A forward adds its micro-batch; the backward that consumes the activations releases it (with deferred
    weight-gradient passes, zb_h1, see :func:`_in_flight_split`: entries of length 2v). Each entry is a tuple
    of length ``v`` (entry c: chunk-c micro-batches live) taken just before a release; entries that another entry
    matches or exceeds in every chunk are left out. With one chunk that is the single peak count; with several,
    chunks of different sizes (uneven layer splits, the embedding and head on the end chunks) can peak at
    different moments, so the memory peak is the largest weighted sum over these entries
    (:func:`simulator.cost.memory.stage_memory`), not the mix at the moment the total count peaks.
    """
    if any(t.kind == "W" for t in order):
        return _in_flight_split(order, v)
    live = [0] * v
    peaks: set[tuple[int, ...]] = set()
    rising = False
    for t in order:
        if t.kind == "F":
            live[t.chunk] += 1
            rising = True
        elif t.kind == "B":
            if rising:
                peaks.add(tuple(live))
                rising = False
            live[t.chunk] -= 1
    if rising or not peaks:
        peaks.add(tuple(live))
    return tuple(_undominated(peaks))


def _in_flight_split(order: tuple[Task, ...], v: int) -> tuple[tuple[int, ...], ...]:
    """:func:`in_flight` of an order with deferred weight-gradient passes (zb_h1): entries of length 2v, the chunk's
    micro-batches between their F and B (holding the forward's activations) and then those between their B and W
    (holding only what W needs, :func:`simulator.cost.memory.stage_memory`). Since a B can add memory (a W that
    needs more than the forward kept, under recomputation), every state after an F or a B is a candidate peak."""
    held = [0] * (2 * v)
    states: set[tuple[int, ...]] = set()
    for t in order:
        if t.kind == "F":
            held[t.chunk] += 1
        elif t.kind == "B":
            held[t.chunk] -= 1
            held[v + t.chunk] += 1
        else:
            held[v + t.chunk] -= 1
            continue
        states.add(tuple(held))
    if not states:
        states.add(tuple(held))
    return tuple(_undominated(states))


def _undominated(entries: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The distinct ``entries`` that no other entry matches or exceeds in every chunk, largest first.

    For each chunk and count, a bitset (a Python int, one bit per entry) marks the entries holding at least
    that many micro-batches of the chunk; an entry's dominators are the AND of its chunks' sets, and the walk
    stops at the first chunk that leaves none. Pairwise checks cost entries² · chunks, and a deep interleaved
    schedule has about one entry per chunk, none dominated: cubic in vp (vp 1,250 took 9 s per stage; this,
    under 0.3 s; pp 8 with vp 1,250 and 16 micro-batches, about 0.1 s per stage).
    """
    items = sorted(entries, reverse=True)
    if len(items) < 2:
        return items
    everyone = (1 << len(items)) - 1
    # Each set is built from a boolean column packed into bytes (bit i of the int is entry i), not bit by bit:
    # the entries of a deep schedule number in the thousands, and or-ing them in one at a time is quadratic.
    counts = np.array(items, dtype=np.int64)
    at_least: list[list[int]] = []
    for column in counts.T:
        sets = [everyone]
        for t in range(1, int(column.max()) + 1):
            sets.append(int.from_bytes(np.packbits(column >= t, bitorder="little").tobytes(), "little"))
        at_least.append(sets)
    kept = []
    for i, e in enumerate(items):
        others = everyone ^ (1 << i)
        for sets, count in zip(at_least, e, strict=True):
            others &= sets[count]
            if not others:
                kept.append(e)
                break
    return kept


class _SizedCache:
    """Sized schedules, least recently used dropped first once the tasks held pass a budget."""

    def __init__(self, budget_tasks: int) -> None:
        self.budget = budget_tasks
        self.held = 0
        self.entries: OrderedDict[tuple[str, int, int, int], tuple[SizedSchedule, int]] = OrderedDict()
        self.lock = Lock()  # the search may run in threads; the dict and the count change together

    def get(self, key: tuple[str, int, int, int]) -> SizedSchedule | None:
        with self.lock:
            hit = self.entries.get(key)
            if hit is None:
                return None
            self.entries.move_to_end(key)
            return hit[0]

    def put(self, key: tuple[str, int, int, int], sized: SizedSchedule, tasks: int) -> None:
        with self.lock:
            if key in self.entries:
                return
            self.entries[key] = (sized, tasks)
            self.held += tasks
            while self.held > self.budget:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.held -= dropped


_SIZED = _SizedCache(SCHEDULE_CACHE_BUDGET_TASKS)


def schedule_with_in_flight(schedule: str, p: int, m: int, v: int = 1) -> SizedSchedule:
    """:func:`generate` and every stage's :func:`in_flight` (read off the shortest schedule that has the same entries,
    :func:`steady_micro_batches`). Cached while the tasks and in-flight counts held stay within
    SCHEDULE_CACHE_MAX_TASKS (a deep interleaved schedule's entries grow with vp²); the result is immutable."""
    key = (schedule, p, m, v)
    hit = _SIZED.get(key)
    if hit is not None:
        return hit
    orders = generate(schedule, p, m, v)
    short = steady_micro_batches(schedule, p, m, v)
    if short != m:
        live = schedule_with_in_flight(schedule, p, short, v)[1]
    else:
        live = tuple(in_flight(order, v) for order in orders)
    sized = (orders, live)
    held = sum(len(order) for order in orders) + sum(len(entries) * v for entries in live)
    if held <= SCHEDULE_CACHE_MAX_TASKS:
        _SIZED.put(key, sized, held)
    return sized


def steady_micro_batches(schedule: str, p: int, m: int, v: int = 1) -> int:
    """The fewest micro-batches whose schedule has the same :func:`in_flight` entries on every stage as ``m``.

    In the interleaved schedule's steady state each forward is followed by a backward, and the live count per
    chunk after step j repeats with period p·v (every p·v forwards and p·v backwards add p to each chunk), while
    the warm-up (2(p − s − 1) + (v − 1)p forwards) does not depend on m once the schedule is longer: any m whose
    steady state spans a whole period on every stage, i.e. m·v ≥ 2(p − 1) + (2v − 1)p, has the same entries (the
    cool-down only releases). Checked exhaustively in the tests. Other schedules are returned as they are."""
    if schedule != "interleaved" or v < 2 or m % p:
        return m
    shortest = p * -(-(2 * (p - 1) + (2 * v - 1) * p) // (p * v))
    return min(m, shortest)


def stage_in_flight(schedule: str, p: int, m: int, v: int = 1) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Every stage's :func:`in_flight` entries, which is all sizing a plan's memory needs, read off the shortest
    schedule that has them (:func:`steady_micro_batches`): a step of thousands of interleaved micro-batches is sized
    from a few dozen, and the long schedule's task orders are only generated if the engine runs it. (Other schedules
    are generated whole, and cached for the engine, by :func:`schedule_with_in_flight`.)"""
    return schedule_with_in_flight(schedule, p, steady_micro_batches(schedule, p, m, v), v)[1]
