"""Chrome / Perfetto trace export of a simulated step.

One process per pipeline stage, one thread (track) per stream: compute, data-parallel, and the send links.
Idle time on the compute stream between tasks is drawn as explicit ``idle`` slices so pipeline bubbles are
visible at a glance. Timestamps are microseconds, as the Trace Event Format requires (Google, "Trace Event
Format", ``ph: X`` complete events and ``ph: M`` metadata events).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["chrome_trace", "chrome_trace_json"]

_TRACKS = ("compute", "dp", "send_fwd", "send_bwd")


def chrome_trace(timeline: Sequence[tuple[int, str, str, float, float]], *, title: str = "") -> dict[str, Any]:
    """Trace Event Format mapping for ``(stage, stream, name, start_s, end_s)`` rows.

    >>> t = chrome_trace([(0, "compute", "F0.0", 0.0, 1e-3), (0, "compute", "B0.0", 2e-3, 3e-3)])
    >>> [e["name"] for e in t["traceEvents"] if e["ph"] == "X"]
    ['F0.0', 'idle', 'B0.0']
    """
    events: list[dict[str, Any]] = []
    stages = sorted({row[0] for row in timeline})
    for s in stages:
        events.append({"ph": "M", "name": "process_name", "pid": s, "tid": 0, "args": {"name": f"stage {s}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": s, "tid": 0, "args": {"sort_index": s}})
        for tid, track in enumerate(_TRACKS):
            events.append({"ph": "M", "name": "thread_name", "pid": s, "tid": tid, "args": {"name": track}})
    last_end: dict[int, float] = {}
    for stage, stream, name, start, end in sorted(timeline, key=lambda r: (r[0], _TRACKS.index(r[1]), r[3], r[2])):
        tid = _TRACKS.index(stream)
        if stream == "compute":
            prev = last_end.get(stage, 0.0)
            if start > prev + 1e-12:
                events.append(_slice(stage, tid, "idle", "idle", prev, start))
            # A zero-length task (a W on a stage without decoder layers) sorts after the task starting with it
            # and ends earlier: the stream's last end never moves back, so idle slices never cover work.
            last_end[stage] = max(prev, end)
        cat = "optimizer" if name == "optimizer" else stream if stream != "compute" else name[:1]
        events.append(_slice(stage, tid, name, cat, start, end))
    meta: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if title:
        meta["otherData"] = {"title": title}
    return meta


def _slice(pid: int, tid: int, name: str, cat: str, start: float, end: float) -> dict[str, Any]:
    ts = round(start * 1e6, 3)
    return {
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


def chrome_trace_json(timeline: Sequence[tuple[int, str, str, float, float]], *, title: str = "") -> str:
    """The trace as a JSON string (deterministic: same input, same bytes)."""
    return json.dumps(chrome_trace(timeline, title=title), separators=(",", ":"), sort_keys=True)
