"""A self-contained HTML report of one simulated step (``clustersim simulate --html FILE``).

One file with no scripts and no external resources (inline CSS and SVG), so it can be mailed, attached to a
ticket or archived next to a capacity plan and still open years later. It holds what a planner asks of a step:
the headline figures (step time, throughput, MFU, memory, time to train), where the step's time goes on the
critical stage and on every stage, each stage's memory against the GPU's capacity, the pipeline timeline of the
step (compute, gradient reductions, transfers and why the compute stream waited), the plan with the knobs the
simulator chose, the calibration used and the op classes it timed on default curves, and the command that
reproduces the result. Same result, same bytes: nothing in it depends on the clock or the machine.

A timeline of more than :data:`MAX_TIMELINE_BARS` bars (thousands of micro-batches on dozens of stages) is left
out with a note; ``--trace`` writes it for Perfetto, which is made for that size.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from simulator.units import GIB, fmt_bytes

if TYPE_CHECKING:
    from simulator.run import StepResult

__all__ = ["MAX_TIMELINE_BARS", "html_report", "plan_report"]

MAX_TIMELINE_BARS = 20_000  # about 2 MB of SVG; browsers draw that at once

# Breakdown parts, their labels and colours (a palette that stays apart for the common colour-vision deficiencies:
# Okabe and Ito, "Color Universal Design", 2008), in the order they stack.
_PARTS = (
    ("compute_s", "compute", "#0072B2"),
    ("tp_exposed_s", "TP exposed", "#E69F00"),
    ("cp_exposed_s", "CP exposed", "#F0E442"),
    ("ep_exposed_s", "EP exposed", "#CC79A7"),
    ("pp_exposed_s", "PP exposed", "#D55E00"),
    ("dp_exposed_s", "DP exposed", "#009E73"),
    ("host_exposed_s", "host exposed", "#56B4E9"),
    ("bubble_s", "bubble", "#BBBBBB"),
    ("optimizer_s", "optimizer", "#000000"),
)
_MEMORY = (
    ("weights", "#0072B2"),
    ("gradients", "#009E73"),
    ("optimizer", "#E69F00"),
    ("activations", "#D55E00"),
    ("buffers", "#BBBBBB"),
)
# Timeline bars by what they are: forward, backward and weight-gradient tasks, data-parallel and send work, waits.
_TASK_COLOURS = {"F": "#0072B2", "B": "#56B4E9", "W": "#009E73"}
_STREAM_COLOURS = {"dp": "#E69F00", "send_fwd": "#CC79A7", "send_bwd": "#CC79A7"}
_WAIT_COLOUR = "#DDDDDD"
_TRACKS = ("compute", "dp", "send_fwd", "send_bwd")

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#222;
padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #ddd}
.sub{color:#666;margin-top:0}.bad{color:#B00020;font-weight:600}.ok{color:#006B3C;font-weight:600}
table{border-collapse:collapse;margin:.6em 0}td,th{padding:.2em .8em;text-align:left;border-bottom:1px solid #eee}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.figs{display:flex;flex-wrap:wrap;gap:.8em}.fig{border:1px solid #ddd;border-radius:6px;padding:.5em .9em;
min-width:9em}.fig b{display:block;font-size:1.3em}.fig span{color:#666;font-size:.85em}
.legend span{display:inline-block;margin-right:1em;font-size:.85em}.legend i{display:inline-block;width:.9em;
height:.9em;margin-right:.3em;vertical-align:-.1em}
code,pre{background:#f6f6f6;border-radius:4px}pre{padding:.6em;white-space:pre-wrap;word-break:break-all}
svg text{font-size:11px;font-family:inherit}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float, digits: int = 4) -> str:
    """A figure with ``digits`` significant digits, '—' where there is none (NaN, None)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    text = f"{value:.{digits}g}"
    if "e" in text and abs(value) >= 1:
        return f"{value:,.0f}"  # 31,500 GPU-hours and 1,000 (999.7 to 3 digits), not 3.15e+04 and 1e+03
    return text


def _seconds(value: float) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    if value >= 1.0:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} µs"


def _pct(value: float) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value * 100:.1f}%"


def _legend(items: Sequence[tuple[str, str]]) -> str:
    return (
        '<div class="legend">'
        + "".join(f'<span><i style="background:{c}"></i>{_e(label)}</span>' for label, c in items)
        + "</div>"
    )


def _stacked_rows(
    rows: Sequence[tuple[str, Sequence[tuple[float, str, str]]]], total: float, unit: str, *, marker: float = 0.0
) -> str:
    """Horizontal stacked bars, one per row: ``(label, [(value, colour, tooltip), ...])`` scaled to ``total``; an
    optional vertical ``marker`` (a capacity) is drawn across all rows."""
    width, label_w, row_h = 900, 110, 22
    top = 16 if marker > 0 else 4  # room for the marker's label above the bars
    plot = width - label_w - 10
    height = top + row_h * len(rows) + 20
    scale = plot / total if total > 0 else 0.0
    out = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    for i, (label, parts) in enumerate(rows):
        y = top + i * row_h
        out.append(f'<text x="0" y="{y + 14}">{_e(label)}</text>')
        x = float(label_w)
        for value, colour, tip in parts:
            w = max(value, 0.0) * scale
            if w <= 0:
                continue
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 6}" fill="{colour}">'
                f"<title>{_e(tip)}</title></rect>"
            )
            x += w
    if marker > 0:
        mx = label_w + marker * scale
        out.append(
            f'<line x1="{mx:.2f}" y1="{top - 2}" x2="{mx:.2f}" y2="{height - 18}" stroke="#B00020" '
            'stroke-dasharray="4 3"/>'
            f'<text x="{mx:.2f}" y="11" text-anchor="middle" fill="#B00020">capacity</text>'
        )
    out.append(
        f'<text x="{label_w}" y="{height - 4}">0</text>'
        f'<text x="{width - 10}" y="{height - 4}" text-anchor="end">{_e(unit)}</text>'
    )
    out.append("</svg>")
    return "".join(out)


def _breakdown_rows(result: StepResult) -> str:
    rows = []
    for i, stage in enumerate(result.stage_breakdown):
        parts = [
            (stage.get(key, 0.0), colour, f"stage {i}: {label} {_seconds(stage.get(key, 0.0))}")
            for key, label, colour in _PARTS
        ]
        star = " ★" if i == result.critical_stage else ""
        rows.append((f"stage {i}{star}", parts))
    total = max((sum(max(v, 0.0) for v, _, _ in parts) for _, parts in rows), default=0.0)
    return _stacked_rows(rows, total, _seconds(total))


def _memory_rows(result: StepResult) -> str:
    rows = []
    for m in result.memory:
        parts = [
            (getattr(m, name) / GIB, colour, f"stage {m.stage}: {name} {fmt_bytes(getattr(m, name))}")
            for name, colour in _MEMORY
        ]
        rows.append((f"stage {m.stage}", parts))
    capacity = max((m.capacity for m in result.memory), default=0.0) / GIB
    total = max([capacity * 1.05, *(m.total / GIB for m in result.memory)], default=0.0)
    return _stacked_rows(rows, total, f"{total:.0f} GiB", marker=capacity)


def _timeline(result: StepResult) -> str:
    """The step as bars per stage and stream (compute, dp, sends), waits in grey."""
    timeline = result.timeline
    if not timeline:
        return "<p>No timeline: the plan has no times.</p>"
    if len(timeline) > MAX_TIMELINE_BARS:
        return (
            f"<p>The timeline has {len(timeline):,} bars, more than a page draws well ({MAX_TIMELINE_BARS:,}); "
            '<code>--trace step.json</code> writes it for <a href="https://ui.perfetto.dev">Perfetto</a>, or a '
            "smaller <code>--global-batch</code> shows the same schedule.</p>"
        )
    stages = 1 + max(row[0] for row in timeline)
    used = [t for t in _TRACKS if any(row[1] == t for row in timeline)]
    end = max(row[4] for row in timeline) or 1.0
    width, label_w, lane_h = 1000, 150, 14
    plot = width - label_w - 10
    lanes = [(s, t) for s in range(stages) for t in used]
    height = lane_h * len(lanes) + 30
    index = {lane: i for i, lane in enumerate(lanes)}
    out = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    for (s, t), i in index.items():
        y = 4 + i * lane_h
        if t == used[0]:
            out.append(f'<line x1="0" y1="{y - 2}" x2="{width}" y2="{y - 2}" stroke="#eee"/>')
        out.append(f'<text x="0" y="{y + 10}">{_e(f"stage {s} {t}")}</text>')
    for stage, stream, name, start, stop in timeline:
        lane = index.get((stage, stream))
        if lane is None or stop <= start:
            continue
        x = label_w + start / end * plot
        w = max((stop - start) / end * plot, 0.3)
        if stream == "wait":
            continue
        if stream == "compute":
            colour = _TASK_COLOURS.get(name[:1], "#0072B2")
        else:
            colour = _STREAM_COLOURS.get(stream, "#999999")
        out.append(
            f'<rect x="{x:.2f}" y="{4 + lane * lane_h}" width="{w:.2f}" height="{lane_h - 3}" fill="{colour}">'
            f"<title>{_e(f'{name}: {_seconds(start)} to {_seconds(stop)}')}</title></rect>"
        )
    for stage, stream, name, start, stop in timeline:
        if stream != "wait" or stop <= start or (stage, "compute") not in index:
            continue
        i = index[(stage, "compute")]
        x = label_w + start / end * plot
        w = max((stop - start) / end * plot, 0.3)
        out.append(
            f'<rect x="{x:.2f}" y="{4 + i * lane_h + 4}" width="{w:.2f}" height="{lane_h - 11}" '
            f'fill="{_WAIT_COLOUR}"><title>{_e(f"{name}: {_seconds(stop - start)}")}</title></rect>'
        )
    y = height - 6
    out.append(
        f'<text x="{label_w}" y="{y}">0</text>'
        f'<text x="{width - 10}" y="{y}" text-anchor="end">{_e(_seconds(end))}</text>'
    )
    out.append("</svg>")
    legend = _legend(
        [
            ("forward", _TASK_COLOURS["F"]),
            ("backward", _TASK_COLOURS["B"]),
            ("weight gradients (zb_h1)", _TASK_COLOURS["W"]),
            ("data-parallel", _STREAM_COLOURS["dp"]),
            ("send", _STREAM_COLOURS["send_fwd"]),
            ("compute waits (bubble, transfers, gathers)", _WAIT_COLOUR),
        ]
    )
    return legend + "".join(out)


def _table(rows: Sequence[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _layout(plan: dict[str, Any]) -> str:
    return " · ".join(f"{k} {plan[k]}" for k in ("tp", "pp", "dp", "cp", "ep") if plan.get(k) not in (None, 1))


def _page(title: str, body: Sequence[str], version: str) -> str:
    head = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
    ]
    tail = [f'<p class="sub">clustersim {_e(version)}</p>' if version else "", "</body></html>\n"]
    return "\n".join([*head, *body, *tail])


def _step_sections(
    result: StepResult,
    *,
    command: str = "",
    what_if: dict[str, Any] | None = None,
    train: dict[str, float] | None = None,
) -> list[str]:
    """Everything about one step below its title: the subtitle, figures, breakdown, memory, timeline, plan,
    calibration and the reproducing command."""
    d = result.to_dict()
    status = (
        '<span class="ok">fits and runs</span>'
        if result.feasible
        else f'<span class="bad">{_e(result.status.replace("_", " "))}</span>: {_e(result.reason)}'
    )
    plan = d["plan"]
    figs = [
        ("step time", _seconds(result.step_time_s)),
        ("tokens/s per GPU", _num(result.tokens_per_s_per_gpu)),
        ("MFU", _pct(result.mfu)),
        ("MFU (causal count)", _pct(result.mfu_causal)),
        ("model TFLOP/s per GPU", _num(result.model_tflops_per_gpu)),
        ("peak memory", fmt_bytes(result.peak_memory_bytes)),
    ]
    if train:
        figs.append(("days to train", _num(train.get("days", math.nan), 3)))
        figs.append(("GPU-hours", _num(train.get("gpu_hours", math.nan), 3)))
    parts = [
        f'<p class="sub">{_e(_layout(plan) or "no model parallelism")}, global batch {_e(plan.get("global_batch"))}, '
        f"sequence {_e(plan.get('seq_len'))}, {_e(plan.get('precision'))}; {status}</p>",
        '<div class="figs">'
        + "".join(f'<div class="fig"><b>{_e(v)}</b><span>{_e(k)}</span></div>' for k, v in figs)
        + "</div>",
    ]
    if what_if:
        parts.append("<p>What-if: " + ", ".join(f"<code>{_e(k)}={_e(v)}</code>" for k, v in what_if.items()) + "</p>")
    if result.stage_breakdown:
        crit = result.critical_stage
        b = result.breakdown
        step = result.step_time_s
        parts.append("<h2>Where the step's time goes</h2>")
        parts.append(
            f"<p>The critical stage ({_e(crit)}, ★) sets the step. Its parts add up to the step time; exposed "
            "communication is what compute could not hide.</p>"
        )
        parts.append(_legend([(label, colour) for _, label, colour in _PARTS]))
        parts.append(_breakdown_rows(result))
        parts.append(
            "<table><tr><th>part</th><th>critical stage</th><th>share</th></tr>"
            + "".join(
                f'<tr><td>{_e(label)}</td><td class="n">{_seconds(b.get(key, 0.0))}</td>'
                f'<td class="n">{_pct(b.get(key, 0.0) / step if step else math.nan)}</td></tr>'
                for key, label, _ in _PARTS
                if b.get(key, 0.0) > 0
            )
            + "</table>"
        )
    if result.memory:
        parts.append("<h2>Memory per GPU, by pipeline stage</h2>")
        parts.append(_legend([(name, colour) for name, colour in _MEMORY] + [("capacity", "#B00020")]))
        parts.append(_memory_rows(result))
        over = [m for m in result.memory if m.over > 0]
        if over:
            parts.append(
                '<p class="bad">'
                + "; ".join(f"stage {m.stage} is {fmt_bytes(m.over)} over {fmt_bytes(m.capacity)}" for m in over)
                + "</p>"
            )
    parts.append("<h2>Timeline of the step</h2>")
    parts.append(_timeline(result))
    parts.append("<h2>Plan</h2>")
    chosen = d.get("chosen") or {}
    parts.append(
        _table([(k, _e(v) + (" <i>(chosen)</i>" if k in chosen else "")) for k, v in plan.items() if v is not None])
    )
    parts.append("<h2>Calibration</h2>")
    unc = result.uncalibrated_ops
    parts.append(
        _table(
            [
                ("table", _e(result.calibration or "none (default curves)")),
                (
                    "host cost per operator",
                    "not modelled" if result.launch_overhead_us is None else f"{result.launch_overhead_us:.3g} µs",
                ),
                ("timed on default or derived curves", _e(", ".join(unc)) if unc else "none"),
            ]
        )
    )
    if command:
        parts.append("<h2>Reproduce</h2>")
        parts.append(f"<pre>{_e(command)}</pre>")
    return parts


def html_report(
    result: StepResult,
    *,
    command: str = "",
    what_if: dict[str, Any] | None = None,
    train: dict[str, float] | None = None,
    version: str = "",
) -> str:
    """The report as one HTML document (module docstring). ``command`` reproduces the result; ``what_if`` lists the
    ``--set`` overrides it was made with; ``train`` is :meth:`StepResult.time_to_train`'s answer."""
    title = f"{result.model} on {result.num_gpus:,} GPUs of {result.cluster}"
    body = [f"<h1>{_e(title)}</h1>", *_step_sections(result, command=command, what_if=what_if, train=train)]
    return _page(title, body, version)


def plan_report(
    best: Sequence[StepResult],
    *,
    title: str,
    facts: Sequence[str],
    detail: StepResult | None,
    command: str = "",
    version: str = "",
) -> str:
    """``clustersim plan --html``: the planner's facts (what it searched, what became of the layouts), the best
    layouts ranked, and the fastest one in full (``detail``, simulated again with its timeline) with the
    ``simulate`` command that reproduces it."""
    body = [f"<h1>{_e(title)}</h1>", *(f"<p>{_e(fact)}</p>" for fact in facts)]
    if best:
        head = ["#", "layout", "ZeRO", "micro-batch", "vp", "recompute", "step time", "tokens/s per GPU", "MFU"]
        head.append("peak memory")
        rows = []
        for i, r in enumerate(best, 1):
            p = r.plan
            cells = [
                str(i),
                _e(_layout(p.as_dict()) or ("one GPU" if r.num_gpus == 1 else "data parallel only")),
                _e(p.zero_stage),
                _e(p.micro_batch),
                _e(p.vp),
            ]
            cells += [_e(p.recompute), _seconds(r.step_time_s), _num(r.tokens_per_s_per_gpu), _pct(r.mfu)]
            cells.append(fmt_bytes(r.peak_memory_bytes))
            tds = (f'<td class="n">{c}</td>' if j >= 6 else f"<td>{c}</td>" for j, c in enumerate(cells))
            rows.append("<tr>" + "".join(tds) + "</tr>")
        body.append("<h2>The fastest layouts</h2>")
        body.append("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>")
    if detail is not None:
        body.append("<h2>The fastest in detail</h2>")
        body += _step_sections(detail, command=command)
    return _page(title, body, version)
