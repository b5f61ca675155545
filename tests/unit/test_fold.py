from __future__ import annotations

import pytest

from simulator.engine.fold import TimedStep, fold


def C(name: str, d: float, waits: tuple[int, ...] = (), overlapped: bool = False) -> TimedStep:
    return TimedStep(name, "compute", d, waits, "compute", overlapped)


def X(name: str, d: float, waits: tuple[int, ...], kind: str = "tp", stream: str = "comm") -> TimedStep:
    return TimedStep(name, stream, d, waits, kind)


def test_serial_compute_is_the_sum() -> None:
    r = fold([C("a", 1.0), C("b", 2.0), C("c", 0.5)])
    assert r.duration_s == pytest.approx(3.5)
    assert r.compute_s == pytest.approx(3.5)
    assert r.exposed == ()


def test_blocking_collective_is_exposed() -> None:
    r = fold([C("a", 1.0), X("ar", 0.3, (0,)), C("b", 1.0, (1,))])
    assert r.duration_s == pytest.approx(2.3)
    assert r.exposed_of("tp") == pytest.approx(0.3)


def test_overlapped_collective_hides_behind_compute() -> None:
    steps = [C("a", 1.0), X("rs", 0.4, (0,)), C("wgrad", 1.0, overlapped=True), C("next", 1.0, (1,))]
    r = fold(steps)
    assert r.duration_s == pytest.approx(3.0)
    assert r.exposed_of("tp") == 0.0
    slowed = fold(steps, overlap_slowdown=0.1)
    # Only the 0.4 s during which the reduce-scatter runs beside the weight gradient is slowed: 1.1 times slower
    # there, the weight gradient does 0.4 / 1.1 s of its work in those 0.4 s and the rest at full speed.
    assert slowed.duration_s == pytest.approx(3.0 + 0.4 * 0.1 / 1.1)


def test_slowdown_covers_the_whole_step_when_the_collective_outlasts_it() -> None:
    steps = [C("a", 1.0), X("rs", 2.0, (0,)), C("wgrad", 1.0, overlapped=True)]
    slowed = fold(steps, overlap_slowdown=0.1)
    assert slowed.compute_s == pytest.approx(2.0 + 0.1)
    assert slowed.duration_s == pytest.approx(3.0)  # the collective still ends at 3.0


def test_compute_after_the_collective_ended_is_not_slowed() -> None:
    steps = [C("a", 1.0), X("rs", 0.1, (0,)), C("b", 1.0), C("c", 1.0, overlapped=True)]
    assert fold(steps, overlap_slowdown=0.5).duration_s == pytest.approx(3.0)


def test_partially_hidden_collective_exposes_the_rest() -> None:
    steps = [C("a", 1.0), X("rs", 1.5, (0,)), C("wgrad", 1.0), C("next", 1.0, (1,))]
    r = fold(steps)
    assert r.duration_s == pytest.approx(3.5)
    assert r.exposed_of("tp") == pytest.approx(0.5)


def test_tail_collective_counts_in_duration() -> None:
    r = fold([C("a", 1.0), X("rs", 0.5, (0,), kind="dp", stream="dp")])
    assert r.duration_s == pytest.approx(1.5)
    assert r.exposed_of("dp") == pytest.approx(0.5)


def test_streams_run_in_order() -> None:
    steps = [C("a", 1.0), X("c1", 1.0, (0,)), X("c2", 1.0, (0,)), C("b", 0.1, (2,))]
    r = fold(steps, timeline=True)
    starts = {name: start for name, _, _, start, _ in r.timeline}
    assert starts["c2"] == pytest.approx(2.0)
    assert r.duration_s == pytest.approx(3.1)


def test_back_to_back_collectives_are_each_charged_their_own_wait() -> None:
    """A TP reduce-scatter then an EP all-to-all on one stream, the next compute waiting for the second: the idle
    time is split along the chain (each kind its own duration), not all charged to the one that ends last."""
    steps = [
        TimedStep("gemm", "compute", 1.0, (), "compute"),
        TimedStep("rs", "comm", 0.3, (0,), "tp"),
        TimedStep("a2a", "comm", 0.2, (0,), "ep"),
        TimedStep("next", "compute", 1.0, (2,), "compute"),
    ]
    r = fold(steps)
    assert r.duration_s == pytest.approx(2.5)
    assert dict(r.exposed) == pytest.approx({"tp": 0.3, "ep": 0.2})
    # The same holds for collectives still running after the last compute.
    tail = fold(steps[:3])
    assert dict(tail.exposed) == pytest.approx({"tp": 0.3, "ep": 0.2})
