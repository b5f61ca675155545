"""Partition of the model into pipeline stages and model chunks.

Megatron-LM splits the decoder layers evenly over the ``pp·vp`` virtual stages, in the order
virtual stage = chunk·pp + stage, with the embedding on the first virtual stage and the output head and
loss on the last. When ``pp·vp`` does not divide the layer count, layers are taken away from the first and
last virtual stages, which also carry the embedding and the head; this is what Llama 3 405B did (126 layers on
16 stages: "we reduce one Transformer layer each from the first and the last stages", Llama 3 paper, Sec.
3.3.2). With vp > 1 classic Megatron-LM refuses an uneven split; Megatron-Core expresses it with
``--pipeline-model-parallel-layout`` (or the first/last-stage layer counts), so the simulator accepts it.
With up to two more virtual stages than layers, the embedding and the loss count
as one layer each, so the first virtual stage may hold the embedding alone and the last the output head alone:
Megatron-Core's ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``,
with which Megatron-Bridge runs Llama 3.1 405B (126 layers) on pp 16 × vp 8 = 128 virtual stages
(docs/performance-summary-archive.md, 26.02 container, DGX-GB200).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from simulator.errors import InfeasiblePlanError
from simulator.graph.transformer import ModelGraph

__all__ = ["Chunk", "most_layers_per_chunk", "partition"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """The blocks one pipeline stage runs for one model chunk: ``(block name, count)`` in forward order."""

    stage: int
    chunk: int
    blocks: tuple[tuple[str, int], ...]
    layers: int


def most_layers_per_chunk(layers: int, virtual: int) -> int:
    """The most decoder layers any of ``virtual`` model chunks holds (more than the average's ceiling where the
    embedding and the loss take chunks of their own: 32 layers over 33 chunks put 2 in one).

    >>> most_layers_per_chunk(32, 33), most_layers_per_chunk(96, 8)
    (2, 12)
    """
    if virtual > layers + 2:
        return -(-layers // virtual)  # no such partition; the plan is refused where it is placed
    return max(_layers_per_virtual_stage(layers, virtual))


def _layers_per_virtual_stage(layers: int, virtual: int) -> list[int]:
    """Decoder layers on each virtual stage, in virtual-stage order.

    >>> _layers_per_virtual_stage(10, 4), _layers_per_virtual_stage(6, 8), _layers_per_virtual_stage(6, 7)
    ([2, 3, 3, 2], [0, 1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 2, 1, 1, 0])
    """
    if virtual > layers + 2:
        raise InfeasiblePlanError(
            f"more pipeline chunks than layers plus the embedding and the loss: pp·vp={virtual}, layers={layers}"
        )
    if virtual > layers:
        # The embedding and the loss are counted as layers (Megatron-Core's account-for-* options).
        counts = _layers_per_virtual_stage(layers + 2, virtual)
        counts[0] -= 1
        counts[-1] -= 1
        return counts
    base = -(-layers // virtual)
    counts = [base] * virtual
    deficit = base * virtual - layers
    # Take layers away from the ends first (they also hold the embedding and the head), then inwards.
    order = []
    lo, hi = 0, virtual - 1
    while lo <= hi:
        order.append(lo)
        if hi != lo:
            order.append(hi)
        lo, hi = lo + 1, hi - 1
    i = 0
    while deficit > 0:
        idx = order[i % len(order)]
        if counts[idx] > 1:
            counts[idx] -= 1
            deficit -= 1
        i += 1
    return counts


def partition(graph: ModelGraph, pp: int, vp: int) -> tuple[tuple[Chunk, ...], ...]:
    """``result[stage][chunk]``: what each stage runs for each of its ``vp`` chunks.

    Examples
    --------
    >>> from simulator.specs.model import ModelSpec
    >>> from simulator.graph.transformer import build_graph
    >>> g = build_graph(ModelSpec(name="t", layers=6, hidden=64, heads=4, ffn_hidden=256, vocab=100), 64, 1)
    >>> [c.blocks for c in (s[0] for s in partition(g, 2, 1))]
    [(('embedding', 1), ('layer.dense', 3)), (('layer.dense', 3), ('head', 1))]
    """
    return _partition(graph.layer_kinds, pp, vp)


@lru_cache(maxsize=1024)
def _partition(layer_kinds: tuple[str, ...], pp: int, vp: int) -> tuple[tuple[Chunk, ...], ...]:
    """:func:`partition` by the graph's layer kinds, all it reads: a free-knob search partitions each candidate's
    graph again, the same few ways."""
    virtual = pp * vp
    counts = _layers_per_virtual_stage(len(layer_kinds), virtual)
    stages: list[list[Chunk]] = [[] for _ in range(pp)]
    start = 0
    for v_index, n_layers in enumerate(counts):
        chunk, stage = divmod(v_index, pp)
        kinds = layer_kinds[start : start + n_layers]
        start += n_layers
        blocks: list[tuple[str, int]] = []
        if v_index == 0:
            blocks.append(("embedding", 1))
        for kind in kinds:
            if blocks and blocks[-1][0] == kind:
                blocks[-1] = (kind, blocks[-1][1] + 1)
            else:
                blocks.append((kind, 1))
        if v_index == virtual - 1:
            blocks.append(("head", 1))
        stages[stage].append(Chunk(stage, chunk, tuple(blocks), n_layers))
    return tuple(tuple(s) for s in stages)
