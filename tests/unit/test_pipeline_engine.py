"""The pipeline engine on synthetic stages: bubbles must emerge from the schedule, not from a formula."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from simulator.engine.fold import FoldResult
from simulator.engine.pipeline import PipelineInput, PipelineResult, StageInput, lower_bound, simulate_pipeline
from simulator.errors import InfeasiblePlanError, SimulatorError
from simulator.parallel.schedule import generate, in_flight


def _task(d: float) -> FoldResult:
    return FoldResult(duration_s=d, compute_s=d, exposed=(), comm_s=())


def _pipe(
    schedule: str,
    p: int,
    m: int,
    v: int = 1,
    f: float = 1.0,
    b: float = 2.0,
    send: float = 0.0,
    buckets: tuple[float, ...] = (),
    overlap: bool = False,
) -> PipelineInput:
    orders = generate(schedule, p, m, v)
    w = _task(b / 2) if schedule == "zb_h1" else _task(0.0)
    bb = _task(b / 2) if schedule == "zb_h1" else _task(b)
    stages = tuple(
        StageInput(
            order=orders[s],
            fwd=(_task(f / v),) * v,
            bwd=(_task(bb.duration_s / v),) * v,
            wgt=(_task(w.duration_s / v),) * v,
            dp_buckets=(buckets,) * v,
            dp_tail_s=0.0,
            optimizer_s=0.0,
            param_gather_s=0.0,
        )
        for s in range(p)
    )
    return PipelineInput(stages=stages, vp=v, send_fwd_s=(send,) * p, send_bwd_s=(send,) * p, grad_overlap=overlap)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 32), (4, 1)])
def test_one_f_one_b_bubble(p: int, m: int) -> None:
    """Issue 3 (1F1B): with p uniform stages, m micro-batches and free links the bubble is (p−1)/(m+p−1), within 1%."""
    r = simulate_pipeline(_pipe("1f1b", p, m))
    ideal = m * 3.0
    bubble = 1 - ideal / r.step_time_s
    assert bubble == pytest.approx((p - 1) / (m + p - 1), rel=0.01)


def test_gpipe_takes_as_long_as_one_f_one_b() -> None:
    """Issue 3: GPipe and 1F1B have the same bubble, so the same step time."""
    a = simulate_pipeline(_pipe("gpipe", 4, 8))
    b = simulate_pipeline(_pipe("1f1b", 4, 8))
    assert a.step_time_s == pytest.approx(b.step_time_s)


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_the_bubble_by_about_v(v: int) -> None:
    """Issue 3 (interleaving): v chunks per stage divide the 1F1B bubble by about v."""
    p, m = 4, 16
    base = simulate_pipeline(_pipe("1f1b", p, m)).step_time_s - m * 3.0
    inter = simulate_pipeline(_pipe("interleaved", p, m, v)).step_time_s - m * 3.0
    assert base / inter == pytest.approx(v, rel=0.2)


def test_zero_bubble_is_faster_than_one_f_one_b() -> None:
    """Issue 3 (schedules): ZB-H1 (B and W split) shortens the 1F1B step."""
    assert simulate_pipeline(_pipe("zb_h1", 4, 8)).step_time_s < simulate_pipeline(_pipe("1f1b", 4, 8)).step_time_s


@pytest.mark.parametrize(
    ("p", "m", "b", "w"), [(2, 4, 1.0, 1.0), (4, 8, 1.0, 1.0), (8, 32, 1.2, 0.8), (4, 4, 1.0, 0.5)]
)
def test_zero_bubble_h1_bubble_and_memory_are_the_papers(p: int, m: int, b: float, w: float) -> None:
    """ZB-H1 (Qi et al. 2023, Sec. 2.1): with equal stages and free sends the bubble is (p-1)(F+B-W), a third
    of 1F1B's when F = B = W, and every stage holds p micro-batches at its peak, as stage 0 does in 1F1B."""
    orders = generate("zb_h1", p, m)
    stages = tuple(
        StageInput(
            order=orders[s],
            fwd=(_task(1.0),),
            bwd=(_task(b),),
            wgt=(_task(w),),
            dp_buckets=((),),
            dp_tail_s=0.0,
            optimizer_s=0.0,
            param_gather_s=0.0,
        )
        for s in range(p)
    )
    pipe = PipelineInput(stages=stages, vp=1, send_fwd_s=(0.0,) * p, send_bwd_s=(0.0,) * p, grad_overlap=False)
    bubble = simulate_pipeline(pipe).step_time_s - m * (1.0 + b + w)
    assert bubble == pytest.approx((p - 1) * (1.0 + b - w))
    live = [in_flight(order) for order in orders]
    # Entries (between F and B, between B and W): p micro-batches on every stage at its peak; on the last stage
    # they all wait for their W, whose store weighs as the zero-bubble reference keeps it (memory.py).
    assert [max(sum(entry) for entry in entries) for entries in live] == [min(p, m)] * p
    assert (0, min(p, m)) in live[-1]


def test_breakdown_sums_to_step_time() -> None:
    """Issue 3 (breakdown): each stage's parts sum to the step time, with transfers and DP buckets."""
    r = simulate_pipeline(_pipe("1f1b", 4, 8, send=0.1, buckets=(0.5, 0.5)))
    for st in r.stages:
        parts = st.compute_s + st.pp_s + st.bubble_s + st.dp_s + st.optimizer_s + sum(v for _, v in st.exposed_s)
        assert parts == pytest.approx(r.step_time_s)


def test_gradient_overlap_hides_reduction() -> None:
    """Issue 3 (grad_overlap): overlapping gradient buckets with the last backward shortens the step."""
    slow = simulate_pipeline(_pipe("1f1b", 2, 4, buckets=(0.5, 0.5, 0.5), overlap=False)).step_time_s
    fast = simulate_pipeline(_pipe("1f1b", 2, 4, buckets=(0.5, 0.5, 0.5), overlap=True)).step_time_s
    assert fast < slow


def test_chained_parameter_buckets_show_where_longer_than_the_compute_they_overlap() -> None:
    """Without interleaving, Megatron-Core dispatches bucket j + 1 of the overlapped gather once the forward has waited
    for bucket j (``finish_param_sync``): one stage, a forward of 0.6 s in three pieces of 0.2 s, buckets of 0.1, 0.5
    and 0.1 s. The first waits 0.1 s; the second is dispatched at 0.1 s and ready at 0.6 s, 0.3 s after its piece
    could start; the third, dispatched at 0.6 s, is ready before its piece. The step grows by 0.4 s, all of it on
    the data-parallel stream, and the gathers' 0.7 s stay inside it."""
    base = _pipe("1f1b", 1, 2, f=0.6, buckets=(0.5,), overlap=True)
    gathered = replace(base, stages=(replace(base.stages[0], param_gather_buckets=((0.1, 0.5, 0.1),)),), record=True)
    without = simulate_pipeline(base)
    r = simulate_pipeline(gathered)
    assert r.step_time_s == pytest.approx(without.step_time_s + 0.4)
    assert r.stages[0].dp_s == pytest.approx(without.stages[0].dp_s + 0.4)
    spans = {row[2]: row[3:] for row in r.timeline if row[2].startswith("param_bucket")}
    assert spans == {
        "param_bucket0.0": (0.0, pytest.approx(0.1)),
        "param_bucket0.1": (pytest.approx(0.1), pytest.approx(0.6)),
        "param_bucket0.2": (pytest.approx(0.6), pytest.approx(0.7)),
    }
    assert lower_bound(gathered) <= r.step_time_s + 1e-12


def test_interleaved_parameter_buckets_are_dispatched_aligned_across_the_pipeline() -> None:
    """With interleaving, Megatron-Core dispatches every bucket of chunks 0 and 1 with the step and those of chunk c + 1
    when stage s starts its forward number f(c) − s (``param_sync_func``): p = 2, v = 3, so chunk 2's gather starts
    with forward number 2 − s (f(1) = p = 2), and no chunk waits when the gathers are short."""
    p, v = 2, 3
    base = _pipe("interleaved", p, 4, v, overlap=True)
    buckets = ((0.01, 0.01), (0.01,), (0.02,))
    gathered = replace(base, stages=tuple(replace(st, param_gather_buckets=buckets) for st in base.stages), record=True)
    r = simulate_pipeline(gathered)
    for s in range(p):
        forwards = sorted(row[3] for row in r.timeline if row[0] == s and row[1] == "compute" and row[2][0] == "F")
        (chunk2,) = [row for row in r.timeline if row[0] == s and row[2] == "param_bucket2.0"]
        assert chunk2[3] == pytest.approx(forwards[2 - s])
        early = ("param_bucket0.", "param_bucket1.")
        starts = sorted(row[3] for row in r.timeline if row[0] == s and row[2].startswith(early))
        assert starts == pytest.approx([0.0, 0.01, 0.02])  # chunks 0 and 1 back to back from the start
    assert r.stages[1].dp_s == pytest.approx(simulate_pipeline(base).stages[1].dp_s)  # hidden behind the fill


@pytest.mark.parametrize(("schedule", "at_step_start"), [("1f1b", True), ("interleaved", False)])
def test_first_parameter_bucket_waits_on_stage_zero_only(schedule: str, at_step_start: bool) -> None:
    """An overlapped ZeRO-1/2 parameter gather leaves its first bucket exposed before the first forward (Megatron-Core's
    forward pre-hook waits for it). Where every stage's first bucket is dispatched with the step (interleaved:
    align_param_gather; 1F1B: Megatron-Core 0.8 and earlier), only stage 0 waits for all of it; the later stages wait
    for their first input anyway (fill = 1 per stage here), so a bucket shorter than the fill costs them nothing, and
    the step grows by it."""
    v = 2 if schedule == "interleaved" else 1
    base = replace(_pipe(schedule, 4, 8, v, buckets=(0.5,), overlap=True), param_gather_at_step_start=at_step_start)
    first = ((0.3,),) + ((),) * (v - 1)
    gathered = replace(base, stages=tuple(replace(st, param_gather_buckets=first) for st in base.stages))
    without = simulate_pipeline(base)
    r = simulate_pipeline(gathered)
    assert r.step_time_s == pytest.approx(without.step_time_s + 0.3)
    assert r.stages[0].dp_s == pytest.approx(without.stages[0].dp_s + 0.3)
    assert [st.dp_s for st in r.stages[1:]] == pytest.approx([st.dp_s for st in without.stages[1:]])
    assert lower_bound(gathered) <= r.step_time_s + 1e-12
    assert lower_bound(gathered) == pytest.approx(lower_bound(base) + 0.3)
    # Without grad_overlap the gather blocks after the optimizer step instead (param_gather_s); no first-bucket wait.
    blocking = replace(gathered, grad_overlap=False)
    assert simulate_pipeline(blocking).step_time_s == pytest.approx(
        simulate_pipeline(replace(base, grad_overlap=False)).step_time_s
    )


def test_first_parameter_bucket_is_dispatched_by_the_first_forward_without_interleaving() -> None:
    """Megatron-Core 0.9 and later, without interleaving (align_param_gather forced off): nothing dispatches a stage's
    first parameter bucket before its first forward, whose pre-hook starts the gather once the input has arrived and
    waits for it (param_and_grad_buffer.finish_param_sync). Every stage then waits for its own gather one after
    another along the fill: p times the bucket, not once as when the step dispatches them all (stage 0 only)."""
    p, bucket = 4, 0.3
    base = _pipe("1f1b", p, 8, 1, buckets=(0.5,), overlap=True)
    gathered = replace(base, stages=tuple(replace(st, param_gather_buckets=((bucket,),)) for st in base.stages))
    without = simulate_pipeline(base)
    r = simulate_pipeline(replace(gathered, record=True))
    assert r.step_time_s == pytest.approx(without.step_time_s + p * bucket)
    assert [st.dp_s for st in r.stages] == pytest.approx([st.dp_s + bucket for st in without.stages])
    for s in range(p):
        start = next(row[3] for row in r.timeline if row[0] == s and row[2].startswith("param_bucket0."))
        first_input = s * (1.0 + bucket)  # forward 1 s per stage (_pipe), each stage also waiting for its bucket
        assert start == pytest.approx(first_input)
    assert r.critical_path_s == pytest.approx(without.critical_path_s + p * bucket)
    assert lower_bound(gathered) == pytest.approx(lower_bound(base) + p * bucket)
    assert lower_bound(gathered) <= r.step_time_s + 1e-12
    early = simulate_pipeline(replace(gathered, param_gather_at_step_start=True))
    assert early.step_time_s == pytest.approx(without.step_time_s + bucket)


def test_step_is_never_shorter_than_the_critical_path() -> None:
    """Issue 3 (post-run checks): step >= dependency critical path."""
    r = simulate_pipeline(_pipe("interleaved", 4, 8, 2, send=0.05))
    assert r.step_time_s >= r.critical_path_s


def test_transfers_are_timed() -> None:
    """Issue 3 (PP): non-zero send times lengthen the step."""
    without = simulate_pipeline(_pipe("1f1b", 4, 8)).step_time_s
    with_send = simulate_pipeline(_pipe("1f1b", 4, 8, send=0.2)).step_time_s
    assert with_send > without


def test_deadlock_is_reported() -> None:
    """Issue 3 (post-run checks): a schedule that cannot finish every task is reported as a deadlock."""
    inp = _pipe("1f1b", 2, 2)
    bad = inp.stages[1]
    # Stage 1 asks for its backward before its forward: a schedule no engine can run.
    broken = StageInput(
        order=tuple(reversed(bad.order)),
        fwd=bad.fwd,
        bwd=bad.bwd,
        wgt=bad.wgt,
        dp_buckets=bad.dp_buckets,
        dp_tail_s=0,
        optimizer_s=0,
        param_gather_s=0,
    )
    with pytest.raises(SimulatorError, match="deadlock"):
        simulate_pipeline(
            PipelineInput(
                stages=(inp.stages[0], broken), vp=1, send_fwd_s=(0, 0), send_bwd_s=(0, 0), grad_overlap=False
            )
        )


@pytest.mark.parametrize(("p", "m", "v"), [(2, 8, 2), (4, 8, 2), (4, 16, 4), (8, 32, 2), (8, 16, 4)])
def test_interleaved_bubble_is_the_one_f_one_b_bubble_over_v(p: int, m: int, v: int) -> None:
    """Issue 3 (interleaving): with free communication, interleaved 1F1B's idle time is (p−1)·(t_f+t_b)/v
    (Narayanan et al. SC21, Sec. 2.2.2), i.e. 1F1B's divided by v, within 1%."""
    ideal = m * 3.0
    inter = simulate_pipeline(_pipe("interleaved", p, m, v)).step_time_s - ideal
    base = simulate_pipeline(_pipe("1f1b", p, m)).step_time_s - ideal
    assert inter == pytest.approx((p - 1) * 3.0 / v, rel=0.01)
    assert base / inter == pytest.approx(v, rel=0.01)


@pytest.mark.parametrize(("f", "b"), [(1.0, 1.0), (1.0, 3.0), (2.0, 1.0)])
def test_one_f_one_b_bubble_for_any_forward_backward_ratio(f: float, b: float) -> None:
    """Issue 3 (1F1B): the bubble fraction is (p−1)/(m+p−1) whatever the forward/backward split, within 1%."""
    p, m = 4, 12
    step = simulate_pipeline(_pipe("1f1b", p, m, f=f, b=b)).step_time_s
    assert 1 - m * (f + b) / step == pytest.approx((p - 1) / (m + p - 1), rel=0.01)


def test_pipeline_timeline_pairs() -> None:
    """Issue 3 (engine): the whole (stage, task, start, end) record of a 2-stage, 3-micro-batch 1F1B step with
    t_f=1, t_b=2 and free links, compared as one list (SimPy-style)."""
    inp = _pipe("1f1b", 2, 3)
    r = simulate_pipeline(
        PipelineInput(
            stages=inp.stages, vp=1, send_fwd_s=(0.0, 0.0), send_bwd_s=(0.0, 0.0), grad_overlap=False, record=True
        )
    )
    got = sorted((s, name, start, end) for s, stream, name, start, end in r.timeline if stream == "compute")
    assert got == [
        (0, "B0.0", 4.0, 6.0),
        (0, "B1.0", 7.0, 9.0),
        (0, "B2.0", 10.0, 12.0),
        (0, "F0.0", 0.0, 1.0),
        (0, "F1.0", 1.0, 2.0),
        (0, "F2.0", 6.0, 7.0),
        (1, "B0.0", 2.0, 4.0),
        (1, "B1.0", 5.0, 7.0),
        (1, "B2.0", 8.0, 10.0),
        (1, "F0.0", 1.0, 2.0),
        (1, "F1.0", 4.0, 5.0),
        (1, "F2.0", 7.0, 8.0),
    ]
    assert r.step_time_s == 12.0


def test_pipeline_transfers_share_the_nics_with_gradient_reduction() -> None:
    """Issue 3 (NIC sharing): a pipeline transfer that leaves the node while the stage's gradient reduction
    also uses the NICs gets half the bandwidth while they overlap, and pushes the reduction back as much.

    p=2, one micro-batch, F=1, B=2, sends 0.5, one 1.0 s bucket reduced after each stage's backward. Stage 1
    ends its backward at 4.5 and starts reducing (until 5.5) while sending the gradient to stage 0: the
    0.5 s send overlaps the reduction all along, so it takes 1.0 and stage 0 starts its backward at 5.5
    instead of 5.0; the step ends at 8.5 instead of 8.0.
    """
    base = _pipe("1f1b", 2, 1, send=0.5, buckets=(1.0,))
    assert simulate_pipeline(base).step_time_s == pytest.approx(8.0)
    shared = PipelineInput(
        stages=tuple(replace(st, dp_network=True) for st in base.stages),
        vp=1,
        send_fwd_s=base.send_fwd_s,
        send_bwd_s=base.send_bwd_s,
        grad_overlap=False,
        hop_network=(True, True),
    )
    r = simulate_pipeline(shared)
    assert r.step_time_s == pytest.approx(8.5)
    # Stage 1's reduction was pushed back by the 0.5 s it shared, and still ends before the step does.
    assert r.stages[1].end_s == pytest.approx(6.0)


def test_gradient_reduction_shares_the_nics_with_a_context_parallel_ring() -> None:
    """Issue 3 (NIC sharing, CP): one stage, F=1, B=2 whose context-parallel ring keeps the NICs busy half of
    the time (1 s of 2), two buckets of 1.5 s and 0.5 s released at the middle and the end of the backward.
    The first bucket shares the NICs with the ring for the remaining 1 s of the backward, at half rate for
    half of that time: +0.5 s; the second starts after it. Step: 1 + 1 + 1.5 + 0.5 + 0.5 = 4.5 s (4.0 without
    sharing)."""
    order = generate("1f1b", 1, 1, 1)[0]
    stage = StageInput(
        order=order,
        fwd=(_task(1.0),),
        bwd=(FoldResult(duration_s=2.0, compute_s=2.0, exposed=(), comm_s=(("cp", 1.0),)),),
        wgt=(_task(0.0),),
        dp_buckets=((1.5, 0.5),),
        dp_tail_s=0.0,
        optimizer_s=0.0,
        param_gather_s=0.0,
    )

    def step(shared: bool) -> float:
        st = replace(stage, dp_network=shared, cp_network=shared)
        pipe = PipelineInput(stages=(st,), vp=1, send_fwd_s=(0.0,), send_bwd_s=(0.0,), grad_overlap=True)
        return simulate_pipeline(pipe).step_time_s

    assert step(False) == pytest.approx(4.0)
    assert step(True) == pytest.approx(4.5)


@pytest.mark.parametrize(("p", "m", "send"), [(1, 4, 0.0), (2, 4, 0.0), (4, 8, 0.0), (8, 32, 0.0), (4, 8, 0.25)])
def test_lower_bound_is_the_step_for_uniform_one_f_one_b(p: int, m: int, send: float) -> None:
    """The free-knob search's bound: for p uniform 1F1B stages it is the simulated step itself, so it prunes
    as much as a bound can; with transfers it stays below."""
    inp = _pipe("1f1b", p, m, send=send)
    step = simulate_pipeline(inp).step_time_s
    if send == 0.0:
        assert lower_bound(inp) == pytest.approx(step, rel=1e-12)
    else:
        assert step * 0.9 < lower_bound(inp) <= step


@hst.composite
def _uneven_pipes(draw: hst.DrawFn) -> PipelineInput:
    """Stages of different lengths, any schedule, transfers, buckets, tails, optimizer, parameter gathers and overlap
    slowdown."""
    schedule = draw(hst.sampled_from(["gpipe", "1f1b", "interleaved", "zb_h1"]))
    p = draw(hst.sampled_from([1, 2, 3, 4]))
    v = draw(hst.sampled_from([2, 3])) if schedule == "interleaved" else 1
    if schedule == "interleaved" and p == 1:
        p = 2
    m = p * draw(hst.integers(1, 3)) if schedule == "interleaved" else draw(hst.integers(1, 6))
    overlap = draw(hst.booleans())
    durations = hst.floats(0.0, 3.0, allow_nan=False)
    stages = []
    for order in generate(schedule, p, m, v):
        stages.append(
            StageInput(
                order=order,
                fwd=tuple(_task(draw(durations)) for _ in range(v)),
                bwd=tuple(_task(draw(durations)) for _ in range(v)),
                wgt=tuple(_task(draw(durations) if schedule == "zb_h1" else 0.0) for _ in range(v)),
                dp_buckets=tuple(tuple(draw(hst.lists(durations, max_size=3))) for _ in range(v)),
                dp_tail_s=draw(durations),
                optimizer_s=draw(durations),
                param_gather_s=draw(durations),
                dp_network=draw(hst.booleans()),
                param_gather_buckets=tuple(tuple(draw(hst.lists(durations, max_size=3))) for _ in range(v)),
            )
        )
    sends = tuple(draw(hst.floats(0.0, 1.0)) for _ in range(p))
    return PipelineInput(
        stages=tuple(stages),
        vp=v,
        send_fwd_s=sends,
        send_bwd_s=sends,
        grad_overlap=overlap,
        overlap_slowdown=draw(hst.sampled_from([0.0, 0.2])),
        hop_network=tuple(draw(hst.booleans()) for _ in range(p)) if p > 1 else (),
    )


@settings(max_examples=150, deadline=None)
@given(_uneven_pipes())
def test_lower_bound_never_exceeds_the_step(inp: PipelineInput) -> None:
    """The bound the free-knob search prunes with is a true lower bound on the simulated step, for every
    schedule, uneven stages, transfers, NIC sharing, gradient buckets with and without overlap."""
    step = simulate_pipeline(inp).step_time_s
    assert lower_bound(inp) <= step * (1 + 1e-12) + 1e-12


@pytest.mark.parametrize(("bucket", "step"), [(0.0, 17.0), (0.01, 17.01), (1.0, 17.5)])
def test_a_transfer_shares_the_nics_only_with_reductions_already_released(bucket: float, step: float) -> None:
    """1F1B, p 3, m 2, F 1, B 2/4/2, sends of 0.5 s, stage 1's hop to stage 0 and its gradient reduction on the
    network. Stage 1 releases its one bucket when its last backward ends (14.5 s); its send at 10.5 s must not be
    slowed by it (found by an engine review: the bucket was entered into the NIC's timeline when that backward
    started, so a 0 s bucket cost 0.5 s). The 1 s bucket does share the NICs with the send that starts with it."""
    orders = generate("1f1b", 3, 2)
    stages = tuple(
        StageInput(
            order=orders[s],
            fwd=(_task(1.0),),
            bwd=(_task((2.0, 4.0, 2.0)[s]),),
            wgt=(_task(0.0),),
            dp_buckets=((bucket,) if s == 1 else (),),
            dp_tail_s=0.0,
            optimizer_s=0.0,
            param_gather_s=0.0,
            dp_network=True,
        )
        for s in range(3)
    )
    inp = PipelineInput(
        stages=stages,
        vp=1,
        send_fwd_s=(0.5,) * 3,
        send_bwd_s=(0.5,) * 3,
        grad_overlap=True,
        hop_network=(True, False, False),
    )
    assert simulate_pipeline(inp).step_time_s == pytest.approx(step)


def test_aligned_reduction_waits_for_the_last_backward_on_later_stages() -> None:
    """Megatron-Core's align_grad_reduce without interleaving: stage 0 reduces each bucket as its last backward frees
    it; the other stages launch all theirs after their last backward (schedules.py: "other pipeline stages do grad
    reduction during pipeline bubble"), so their compute is never slowed by a reduction beside it."""
    base = replace(_pipe("1f1b", 3, 4, buckets=(0.4, 0.4), overlap=True), overlap_slowdown=0.2, record=True)
    aligned = simulate_pipeline(replace(base, align_grad_reduce=True))
    for s in range(3):
        last_b = max(row[4] for row in aligned.timeline if row[0] == s and row[2].startswith("B"))
        starts = [row[3] for row in aligned.timeline if row[0] == s and row[2].startswith("grad_bucket")]
        assert len(starts) == 2
        if s == 0:
            assert min(starts) < last_b  # the first bucket is reduced while the last backward still runs
        else:
            assert min(starts) == pytest.approx(last_b)
    assert aligned.step_time_s <= simulate_pipeline(base).step_time_s


def test_aligned_reduction_with_interleaving_launches_a_chunk_s_backward_passes_later() -> None:
    """With interleaving, stage s launches chunk c's buckets together after its backward number b(c) + s, b(c) that of
    chunk c's last backward (Megatron-Core's grad_sync_func), or after its last backward where that is beyond it."""
    p, m, v = 2, 4, 2
    base = replace(_pipe("interleaved", p, m, v, buckets=(0.1,), overlap=True), record=True, align_grad_reduce=True)
    r = simulate_pipeline(base)
    for s in range(p):
        backs = sorted((row[3], row[4], row[2]) for row in r.timeline if row[0] == s and row[2].startswith("B"))
        chunk_last = {int(name.split(".")[1]): k for k, (_, _, name) in enumerate(backs)}
        starts = sorted(row[3] for row in r.timeline if row[0] == s and row[2].startswith("grad_bucket"))
        expected = sorted(backs[min(k + s, len(backs) - 1)][1] for k in chunk_last.values())
        assert starts[0] == pytest.approx(expected[0])
        assert starts[-1] >= expected[-1] - 1e-9


def test_a_zero3_backward_hands_its_gradient_on_before_its_trailing_reduce_scatter() -> None:
    """ZeRO-3 reduce-scatters each layer's gradients on the data-parallel stream, detached from compute; the
    input gradient goes to the previous stage when the compute is done, not when the last scatter is (found by a
    schedule review: every backward with pp > 1 had waited for it). Without ZeRO-3 a send starts at the task's end."""
    from simulator.run import simulate
    from simulator.specs import PlanSpec, load_cluster, load_model

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    plan = PlanSpec(tp=1, pp=4, dp=4, global_batch=32, micro_batch=1, vp=1, recompute="full", grad_overlap=True)
    for zero, early in ((3, True), (1, False)):
        r = simulate(model, cluster, plan.with_(zero_stage=zero), record=True)
        rows = {(row[1], row[2]): row for row in r.timeline if row[0] == 1}
        task, send = rows[("compute", "B0.0")], rows[("send_bwd", "B0.0")]
        assert (send[3] < task[4] - 1e-9) is early, zero
        assert send[3] >= task[3]


def _gather_stage(order: tuple, fwd: FoldResult, gathers: tuple[float, ...], **kw: bool) -> StageInput:
    return StageInput(
        order=order,
        fwd=(fwd,),
        bwd=(_task(1.0),),
        wgt=(_task(0.0),),
        dp_buckets=((),),
        dp_tail_s=0.0,
        optimizer_s=0.0,
        param_gather_s=0.0,
        dp_network=True,
        param_gather_buckets=(gathers,) if gathers else (),
        **kw,
    )


def test_a_parameter_bucket_pushed_back_by_nic_sharing_holds_back_the_forward_waiting_for_it() -> None:
    """Stage 1 gathers a 3 s parameter bucket while the first forward's activations (0.5 s) arrive over the same
    NICs: sharing them fairly, the transfer takes 1 s and the gather ends at 3.5 s, so stage 1's forward starts at
    3.5, not at the 3.0 planned when the gather was dispatched (the engine used to read the stale end), and the trace
    shows the gather's end as it happened. (Gathers dispatched with the step, as Megatron-Core 0.8 did.)"""
    orders = generate("1f1b", 2, 1)

    def run(hop: bool) -> PipelineResult:
        stages = (
            _gather_stage(orders[0], _task(1.0), ()),
            _gather_stage(orders[1], _task(1.0), (3.0,)),
        )
        inp = PipelineInput(
            stages=stages,
            vp=1,
            send_fwd_s=(0.5, 0.5),
            send_bwd_s=(0.5, 0.5),
            grad_overlap=True,
            hop_network=(hop, hop),
            record=True,
            param_gather_at_step_start=True,
        )
        return simulate_pipeline(inp)

    assert run(False).step_time_s == pytest.approx(6.5)
    shared = run(True)
    assert shared.step_time_s == pytest.approx(7.0)
    rows = {row[2]: row[3:] for row in shared.timeline if row[0] == 1 and row[1] in ("compute", "dp")}
    assert rows["param_bucket0.0"] == (0.0, pytest.approx(3.5))
    assert rows["F0.0"] == (pytest.approx(3.5), pytest.approx(4.5))


def test_a_forward_stalled_for_a_parameter_bucket_runs_no_context_parallel_ring_meanwhile() -> None:
    """A forward of two pieces, the second waiting for a 1 s parameter bucket dispatched as the first starts, with
    the context-parallel ring on the wire for all of its compute and sharing the NICs with the gather: the ring
    overlaps the gather only while the first piece (0.5 s) runs, so the gather ends at 1.5 s, and the step at 2.0.
    The engine used to charge the gather the ring of the whole planned forward, including the stall, so that a
    longer forward made a shorter step; the trace splits the forward around its wait."""

    def run(fd: float) -> PipelineResult:
        fwd = FoldResult(duration_s=fd, compute_s=fd, exposed=(), comm_s=(("cp", fd),))
        stage = replace(_gather_stage(generate("1f1b", 1, 1)[0], fwd, (0.0, 1.0), cp_network=True), bwd=(_task(0.0),))
        inp = PipelineInput(stages=(stage,), vp=1, send_fwd_s=(0.0,), send_bwd_s=(0.0,), grad_overlap=True, record=True)
        return simulate_pipeline(inp)

    steps = [run(fd).step_time_s for fd in (1.0, 1.2, 1.5, 2.0)]
    assert steps[0] == pytest.approx(2.0)
    assert steps == sorted(steps)
    rows = [row[1:] for row in run(1.0).timeline if row[1] in ("compute", "wait")]
    assert rows[:3] == [
        ("compute", "F0.0", 0.0, pytest.approx(0.5)),
        ("wait", "dp gather wait", pytest.approx(0.5), pytest.approx(1.5)),
        ("compute", "F0.0", pytest.approx(1.5), pytest.approx(2.0)),
    ]


def test_the_critical_path_counts_weight_gradients_only_where_scheduled_apart() -> None:
    """A 1F1B input whose W programs are not empty (the schedule never runs them) is not held to a critical path
    that includes them: the engine used to report such a step as shorter than its critical path."""
    inp = _pipe("1f1b", 2, 2)
    stages = tuple(replace(st, wgt=(_task(5.0),)) for st in inp.stages)
    r = simulate_pipeline(replace(inp, stages=stages))
    assert r.step_time_s == pytest.approx(simulate_pipeline(inp).step_time_s)
    assert r.critical_path_s <= r.step_time_s


def test_interleaving_needs_a_pipeline() -> None:
    """One stage cannot interleave chunks (Megatron-LM asserts pp > 1); generate refuses it instead of handing the
    engine a schedule that deadlocks."""
    with pytest.raises(InfeasiblePlanError, match="pp >= 2"):
        generate("interleaved", 1, 2, 2)
