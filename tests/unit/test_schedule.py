from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.errors import InfeasiblePlanError
from simulator.parallel.schedule import Task, generate, in_flight


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (4, 8), (4, 2)])
def test_every_stage_runs_each_micro_batch_once(schedule: str, p: int, m: int) -> None:
    for order in generate(schedule, p, m):
        fwd = [t.mb for t in order if t.kind == "F"]
        bwd = [t.mb for t in order if t.kind == "B"]
        assert sorted(fwd) == list(range(m))
        assert sorted(bwd) == list(range(m))
        for t in order:
            if t.kind == "B":
                assert order.index(Task("F", t.mb)) < order.index(t)


def test_one_f_one_b_warmup_and_memory() -> None:
    orders = generate("1f1b", 4, 8)
    assert [t.kind for t in orders[0][:4]] == ["F", "F", "F", "F"]
    assert [in_flight(o) for o in orders] == [((4,),), ((3,),), ((2,),), ((1,),)]
    assert all(in_flight(o) == ((8,),) for o in generate("gpipe", 4, 8))


def test_interleaved_visits_every_chunk_and_holds_more_on_stage_zero() -> None:
    p, m, v = 4, 8, 2
    orders = generate("interleaved", p, m, v)
    for order in orders:
        assert sorted((t.mb, t.chunk) for t in order if t.kind == "F") == [(i, c) for i in range(m) for c in range(v)]
    # Korthikanti et al. 2022: about (1 + (p-1)/(p·v)) times the 1F1B activations on the first stage.
    assert max(sum(live) for live in in_flight(orders[0], v)) / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


def _live_mixes(order: tuple[Task, ...], v: int) -> list[tuple[int, ...]]:
    """Every per-chunk live count the order passes through (release at B), the brute-force reference."""
    live = [0] * v
    out = [tuple(live)]
    for t in order:
        live[t.chunk] += 1 if t.kind == "F" else -1
        out.append(tuple(live))
    return out


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 4, 3), (2, 6, 4), (8, 16, 2)])
def test_interleaved_memory_peak_is_the_largest_weighted_mix(p: int, m: int, v: int) -> None:
    """Chunks of different sizes can peak at different moments: for any per-chunk weights, the largest weighted
    sum over the returned mixes equals the largest over every moment of the order."""
    weights = [(1.0,) * v, tuple(float(c + 1) for c in range(v)), tuple(float(v - c) ** 3 for c in range(v))]
    for order in generate("interleaved", p, m, v):
        peaks = in_flight(order, v)
        every = _live_mixes(order, v)
        assert set(peaks) <= set(every)
        # Only the mixes no other one matches or exceeds in every chunk are kept.
        for a in peaks:
            assert not any(b != a and all(x <= y for x, y in zip(a, b, strict=True)) for b in peaks)
        for w in weights:
            assert max(sum(a * b for a, b in zip(w, mix, strict=True)) for mix in peaks) == pytest.approx(
                max(sum(a * b for a, b in zip(w, mix, strict=True)) for mix in every)
            )


def test_interleaved_needs_micro_batches_multiple_of_pp() -> None:
    with pytest.raises(InfeasiblePlanError, match="multiple of pp"):
        generate("interleaved", 4, 6, 2)


def test_zero_bubble_splits_weight_gradients() -> None:
    order = generate("zb_h1", 4, 8)[0]
    assert sum(1 for t in order if t.kind == "W") == 8
    first_w = next(i for i, t in enumerate(order) if t.kind == "W")
    first_b = next(i for i, t in enumerate(order) if t.kind == "B")
    assert first_w > first_b


def test_small_schedules_are_cached_and_large_ones_are_not_held() -> None:
    """The free-knob search sizes one schedule per recompute option: small ones come from a cache (the same
    immutable object), large ones are rebuilt rather than held in memory after the call; both agree."""
    from simulator.parallel.schedule import SCHEDULE_CACHE_MAX_TASKS, schedule_with_in_flight

    assert schedule_with_in_flight("interleaved", 4, 8, 2) is schedule_with_in_flight("interleaved", 4, 8, 2)
    m = SCHEDULE_CACHE_MAX_TASKS // 2 + 1  # 2·p·m·v tasks: just over the limit at p = v = 1
    big = schedule_with_in_flight("1f1b", 1, m)
    assert big is not schedule_with_in_flight("1f1b", 1, m)
    assert big == schedule_with_in_flight("1f1b", 1, m)
    assert big[0] == generate("1f1b", 1, m)
    assert big[1] == (((1,),),)
    orders, live = schedule_with_in_flight("1f1b", 4, 8)
    assert orders == generate("1f1b", 4, 8)
    assert live == tuple(in_flight(o) for o in generate("1f1b", 4, 8))


def test_the_schedule_cache_holds_a_whole_search_and_drops_the_least_recent_past_its_budget() -> None:
    """A free-knob search sizes tens of schedules, each again for its twins and recompute options: all of them
    stay cached (a cache of 8 had rebuilt every one); past the task budget the least recently used goes first."""
    from simulator.parallel.schedule import _SizedCache, schedule_with_in_flight

    keys = [(4, m, v) for m in (4, 8, 12, 16, 20, 24, 28, 32) for v in (2, 3, 4, 6)]
    first = [schedule_with_in_flight("interleaved", p, m, v) for p, m, v in keys]
    again = [schedule_with_in_flight("interleaved", p, m, v) for p, m, v in keys]
    assert all(x is y for x, y in zip(first, again, strict=True))
    cache = _SizedCache(budget_tasks=10)
    a, b, c = (schedule_with_in_flight("1f1b", 1, n, 1) for n in (2, 2, 3))
    cache.put(("1f1b", 1, 2, 1), a, 4)
    cache.put(("gpipe", 1, 2, 1), b, 4)
    assert cache.get(("1f1b", 1, 2, 1)) is a  # now the most recent
    cache.put(("1f1b", 1, 3, 1), c, 6)
    assert cache.get(("gpipe", 1, 2, 1)) is None
    assert cache.get(("1f1b", 1, 2, 1)) is a
    assert cache.held == 10


@given(st.sets(st.tuples(*[st.integers(0, 4)] * 3), max_size=40))
def test_undominated_matches_the_pairwise_definition(entries: set[tuple[int, ...]]) -> None:
    """The bitset walk keeps exactly the entries no other one matches or exceeds in every chunk, largest first."""
    from simulator.parallel.schedule import _undominated

    def dominated(a: tuple[int, ...]) -> bool:
        return any(b != a and all(x <= y for x, y in zip(a, b, strict=True)) for b in entries)

    assert _undominated(entries) == sorted((a for a in entries if not dominated(a)), reverse=True)


def test_a_long_interleaved_schedule_is_sized_from_the_shortest_one_with_its_entries() -> None:
    """Sizing needs only the in-flight entries; in the interleaved steady state they repeat with period p·v, so a
    schedule of thousands of micro-batches has the entries of one whose steady state spans a period
    (steady_micro_batches). Exhaustive over 2 <= p <= 8, v <= 6 and several longer m; other schedules are kept."""
    from simulator.parallel.schedule import stage_in_flight, steady_micro_batches

    for p in range(2, 9):
        for v in range(2, 7):
            m0 = steady_micro_batches("interleaved", p, 10_000 * p, v)
            assert m0 % p == 0
            assert m0 * v >= 2 * (p - 1) + (2 * v - 1) * p
            for m in (m0, m0 + p, m0 + 5 * p):
                full = tuple(in_flight(order, v) for order in generate("interleaved", p, m, v))
                assert stage_in_flight("interleaved", p, m, v) == full, (p, v, m)
    assert steady_micro_batches("1f1b", 4, 1000) == 1000
    assert steady_micro_batches("interleaved", 4, 6, 2) == 6  # not a multiple of pp: refused by generate, as before
