"""Rankings that share what they found (the planner's workers): each prunes against the fastest steps of all, and
the fastest layouts keep exactly their results."""

from __future__ import annotations

import math
from collections.abc import Sequence

from simulator.run import Ranked, rank, simulate
from simulator.search.planner import autoplan
from simulator.specs import PlanSpec, load_cluster, load_model
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec


class _Fixed:
    """Peers that claim a fixed cutoff and record what this ranking publishes."""

    def __init__(self, cutoff: float) -> None:
        self._cutoff = cutoff
        self.published: list[list[float]] = []

    def cutoff(self) -> float:
        return self._cutoff

    def publish(self, fastest: Sequence[float]) -> None:
        self.published.append(list(fastest))


def _bounds(ranked: Sequence[Ranked]) -> list[float | None]:
    return [None if math.isnan(r.bound_s) else r.bound_s for r in ranked]


PLANS = [PlanSpec(tp=tp, pp=pp, dp=16 // (tp * pp), global_batch=64) for tp in (1, 2, 4) for pp in (1, 2, 4)]


def test_a_peers_cutoff_prunes_what_it_rules_out_and_keeps_what_beats_it() -> None:
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    alone = rank(model, cluster, PLANS, top=2)
    timed = sorted((r.result.step_time_s, i) for i, r in enumerate(alone) if r.result and r.result.feasible)
    (best_s, best), (second_s, _) = timed[0], timed[1]
    # A peer has found a layout between the fastest and the second: only the fastest can still be in the top 2.
    peers = _Fixed((best_s + second_s) / 2)
    shared = rank(model, cluster, PLANS, top=2, peers=peers)
    assert shared[best].result == alone[best].result == simulate(model, cluster, PLANS[best], raise_infeasible=False)
    timed_shared = [i for i, r in enumerate(shared) if r.result is not None and r.result.feasible]
    assert timed_shared == [best]
    assert _bounds(shared) == _bounds(alone)  # a bound is the plan's own, whoever prunes it
    assert peers.published
    assert peers.published[-1] == [best_s]
    assert all(len(p) <= 2 and p == sorted(p) for p in peers.published)


def test_peers_that_found_nothing_change_nothing() -> None:
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    assert rank(model, cluster, PLANS, top=2, peers=_Fixed(math.inf)) == rank(model, cluster, PLANS, top=2)


def test_autoplan_workers_share_and_answer_as_one(tiny_model: ModelSpec, toy_cluster: ClusterSpec) -> None:
    model = tiny_model.with_(layers=8, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192, seq_len=2048)
    one = autoplan(model, toy_cluster, 8, 32, top=2)
    three = autoplan(model, toy_cluster, 8, 32, top=2, workers=3)
    assert one.best == three.best
    assert _bounds(one.ranked) == _bounds(three.ranked)
    # Which layouts have a result (the top, and those that do not fit) is the same; NaN figures of the ones that do
    # not fit compare unequal to themselves once they have crossed a process boundary, so compare what they say.
    assert [(r.result is None, r.result and r.result.reason) for r in one.ranked] == [
        (r.result is None, r.result and r.result.reason) for r in three.ranked
    ]
