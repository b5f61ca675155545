"""A chunk's programs are emitted for a few instances and the rest copied (program._emit_instances): the copies must
be exactly the steps that emitting every instance gives, for every kind of layout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.graph.transformer import build_graph
from simulator.parallel import program
from simulator.parallel.layout import resolve_layout
from simulator.parallel.stages import partition
from simulator.search.layouts import layouts
from simulator.specs import PlanSpec, load_cluster, load_model
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec


def _emit_every_instance(builders: tuple[object, ...], items: list[tuple[object, Callable[[], None]]]) -> None:
    for _, emit in items:
        emit()


def _both(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For every chunk of the plan: whether the copied programs equal the programs emitted instance by instance."""
    layout = resolve_layout(model, cluster, plan)
    graph = build_graph(model, layout.seq_len, layout.micro_batch, plan.attention)
    same = []
    for stage in partition(graph, plan.pp, layout.vp):
        for chunk in stage:
            copied = program._build(graph, layout, chunk.blocks)
            with monkeypatch.context() as m:
                m.setattr(program, "_emit_instances", _emit_every_instance)
                emitted = program._build(graph, layout, chunk.blocks)
            same.append(copied == emitted)
    return same


CASES = [
    ("llama3-8b", "dgx-h100", {"tp": 2, "pp": 2, "dp": 2, "recompute": "full", "recompute_layers": 3}),
    ("llama3-8b", "dgx-h100", {"tp": 4, "pp": 1, "dp": 2, "recompute": "selective", "tp_overlap": True}),
    ("llama3-8b", "dgx-h100", {"tp": 2, "pp": 2, "dp": 2, "recompute": "none", "schedule": "zb_h1"}),
    ("llama3-8b", "dgx-h100", {"tp": 1, "pp": 2, "dp": 4, "recompute": "none", "zero_stage": 2, "grad_overlap": True}),
    ("llama3-8b", "dgx-h100", {"tp": 1, "pp": 2, "dp": 4, "recompute": "full", "zero_stage": 2, "grad_overlap": False}),
    ("llama3-8b", "dgx-h100", {"tp": 1, "pp": 1, "dp": 8, "recompute": "full", "zero_stage": 3}),
    ("llama3-8b", "dgx-h100", {"tp": 2, "pp": 2, "cp": 2, "dp": 1, "recompute": "none", "precision": "fp8"}),
    ("llama3-8b", "dgx-h100", {"tp": 2, "pp": 2, "dp": 2, "vp": 4, "recompute": "full", "recompute_layers": 1}),
    ("mixtral-8x7b", "dgx-h100", {"tp": 2, "pp": 2, "dp": 4, "ep": 4, "recompute": "full"}),
    ("mixtral-8x7b", "dgx-h100", {"tp": 2, "pp": 1, "dp": 8, "ep": 8, "expert_tp": 1, "zero_stage": 2}),
    ("gpt3-175b", "dgx-a100-80g", {"tp": 8, "pp": 8, "dp": 2, "vp": 3, "recompute": "selective"}),
]


@pytest.mark.parametrize(("model", "cluster", "knobs"), CASES)
def test_copied_instances_are_the_emitted_ones(
    model: str, cluster: str, knobs: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = {"global_batch": 32, "micro_batch": 1, "vp": 1, "recompute": "none", "grad_overlap": True}
    plan = PlanSpec(**{**base, **knobs})  # type: ignore[arg-type]
    assert all(_both(load_model(model), load_cluster(cluster), plan, monkeypatch))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.sampled_from([3, 4, 6, 8]),
    recompute=st.sampled_from(["none", "selective", "full"]),
    recompute_layers=st.sampled_from([None, 1, 2]),
    zero=st.sampled_from([0, 1, 2, 3]),
    cp=st.sampled_from([1, 2]),
    overlap=st.booleans(),
    schedule=st.sampled_from([None, "zb_h1"]),
    index=st.integers(0, 200),
)
def test_copies_match_for_every_layout(
    tiny_model: ModelSpec,
    toy_cluster: ClusterSpec,
    monkeypatch: pytest.MonkeyPatch,
    layers: int,
    recompute: str,
    recompute_layers: int | None,
    zero: int,
    cp: int,
    overlap: bool,
    schedule: str | None,
    index: int,
) -> None:
    model = tiny_model.with_(layers=layers)
    plans = layouts(model, toy_cluster, 8, 16, zero_stage=[zero], cp=[cp])
    if not plans:
        return
    plan = plans[index % len(plans)]
    vp = plan.vp or 1
    plan = replace(
        plan,
        micro_batch=1,
        recompute=recompute,
        recompute_layers=recompute_layers if recompute == "full" else None,
        vp=vp,
        schedule=schedule if vp == 1 else None,
        grad_overlap=overlap,
    )
    assert all(_both(model, toy_cluster, plan, monkeypatch))


def test_a_deep_chunk_is_emitted_about_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of copying: 80 equal layers run the emitter for a handful of instances, not 80."""
    model, cluster = load_model("llama3-70b"), load_cluster("dgx-h100")
    plan = PlanSpec(tp=8, pp=1, dp=1, global_batch=8, micro_batch=1, vp=1, recompute="full", grad_overlap=True)
    layout = resolve_layout(model, cluster, plan)
    graph = build_graph(model, layout.seq_len, 1)
    calls = []
    emit = program._emit_forward

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        emit(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(program, "_emit_forward", counted)
    program._build(graph, layout, (("embedding", 1), ("layer.dense", 80), ("head", 1)))
    assert len(calls) < 10  # forward and recomputation forwards together
