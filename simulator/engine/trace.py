"""Chrome / Perfetto trace export of a simulated step.

One process per pipeline stage, one thread (track) per stream: compute, data-parallel (gradient buckets, parameter
gathers, and ZeRO-2/3's per-layer collectives inside the task that runs them), and the send links. A stage that
finishes before the step ends waits as ``bubble`` to its end.
Idle time on the compute stream between tasks is drawn as explicit ``idle`` slices so pipeline bubbles are
visible at a glance; where the engine knows why the stream waits, the slice says so (``bubble``, ``pp transfer
wait``, ``dp gather wait``, ``dp reduce wait``). Timestamps are microseconds, as the Trace Event Format requires
(Google, "Trace Event Format", ``ph: X`` complete events and ``ph: M`` metadata events).

A task is named ``<kind><micro-batch>.<chunk>``: ``F3.1`` is the forward of micro-batch 3 through the stage's model
chunk 1 (``B`` backward, ``W`` weight gradients under zb_h1); its ``args`` spell that out. A transfer on a send
track is named ``send F3.1``, the output of that task on its way to the next stage. ``otherData`` carries the
title and whatever the caller adds (the CLI: the plan, the step time and its breakdown).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from simulator.engine.pipeline import WAITS

__all__ = ["chrome_trace", "chrome_trace_json"]

_TRACKS = ("compute", "dp", "send_fwd", "send_bwd")


def chrome_trace(
    timeline: Sequence[tuple[int, str, str, float, float]], *, title: str = "", meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Trace Event Format mapping for ``(stage, stream, name, start_s, end_s)`` rows; ``meta`` goes to ``otherData``.

    >>> t = chrome_trace([(0, "compute", "F0.0", 0.0, 1e-3), (0, "compute", "B0.0", 2e-3, 3e-3)])
    >>> [e["name"] for e in t["traceEvents"] if e["ph"] == "X"]
    ['F0.0', 'idle', 'B0.0']
    >>> t["traceEvents"][-1]["args"]
    {'kind': 'backward', 'micro_batch': 0, 'chunk': 0, 'stage': 0}
    """
    events: list[dict[str, Any]] = []
    stages = sorted({row[0] for row in timeline})
    for s in stages:
        events.append({"ph": "M", "name": "process_name", "pid": s, "tid": 0, "args": {"name": f"stage {s}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": s, "tid": 0, "args": {"sort_index": s}})
        for tid, track in enumerate(_TRACKS):
            events.append({"ph": "M", "name": "thread_name", "pid": s, "tid": tid, "args": {"name": track}})
    last_end: dict[int, float] = {}
    # The engine's recorded waits ("wait" rows) are drawn on the compute track, in place of the idle they explain.
    rows = [row for row in timeline if row[1] != "wait"] + [
        (stage, "compute", name, start, end) for stage, name, start, end in _waits(timeline)
    ]
    for stage, stream, name, start, end in sorted(rows, key=lambda r: (r[0], _TRACKS.index(r[1]), r[3], r[2])):
        tid = _TRACKS.index(stream)
        if stream == "compute":
            prev = last_end.get(stage, 0.0)
            if round(start * 1e6, 3) > round(prev * 1e6, 3):  # a gap the trace's nanoseconds can show
                events.append(_slice(stage, tid, "idle", "idle", prev, start))
            # A zero-length task (a W on a stage without decoder layers) sorts after the task starting with it
            # and ends earlier: the stream's last end never moves back, so idle slices never cover work.
            last_end[stage] = max(prev, end)
        if name == "optimizer" or stream != "compute":
            cat = name if name == "optimizer" else stream
        else:
            cat = "idle" if name in WAITS else name[:1]
        task = _task_args(name, stage)
        label = f"send {name}" if stream.startswith("send") else name
        events.append(_slice(stage, tid, label, cat, start, end, task))
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    other = ({"title": title} if title else {}) | dict(meta or {})
    if other:
        trace["otherData"] = other
    return trace


_KINDS = {"F": "forward", "B": "backward", "W": "weight gradients"}


def _waits(timeline: Sequence[tuple[int, str, str, float, float]]) -> list[tuple[int, str, float, float]]:
    """The recorded waits as ``(stage, name, start, end)``: one slice per wait, where a NIC-sharing transfer that
    pushed a gather back had recorded two adjacent ones, and none shorter than the trace's nanosecond (a float's
    rounding between two events at one instant)."""
    out: list[tuple[int, str, float, float]] = []
    for stage, _, name, start, end in sorted((r for r in timeline if r[1] == "wait"), key=lambda r: (r[0], r[3])):
        if out and out[-1][0] == stage and out[-1][1] == name and abs(out[-1][3] - start) < 1e-12:
            out[-1] = (stage, name, out[-1][2], max(out[-1][3], end))
        else:
            out.append((stage, name, start, end))
    return [w for w in out if round(w[3] * 1e6, 3) > round(w[2] * 1e6, 3)]


def _task_args(name: str, stage: int) -> dict[str, Any] | None:
    """What a task name (``F3.1``) stands for, or None for other slices."""
    kind, rest = name[:1], name[1:]
    mb, dot, chunk = rest.partition(".")
    if kind not in _KINDS or not dot or not mb.isdigit() or not chunk.isdigit():
        return None
    return {"kind": _KINDS[kind], "micro_batch": int(mb), "chunk": int(chunk), "stage": stage}


def _slice(
    pid: int, tid: int, name: str, cat: str, start: float, end: float, args: dict[str, Any] | None = None
) -> dict[str, Any]:
    ts = round(start * 1e6, 3)
    event: dict[str, Any] = {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        # From the rounded end, not the rounded length: independently rounded ts and dur can make a slice end
        # 1 ns after the next one on its track starts, which Perfetto reports as misnested slices.
        "dur": round(round(end * 1e6, 3) - ts, 3),
    }
    if args:
        event["args"] = args
    return event


def chrome_trace_json(
    timeline: Sequence[tuple[int, str, str, float, float]], *, title: str = "", meta: dict[str, Any] | None = None
) -> str:
    """The trace as a JSON string (deterministic: same input, same bytes)."""
    return json.dumps(chrome_trace(timeline, title=title, meta=meta), separators=(",", ":"), sort_keys=True)
