"""The work of one rank for one model chunk: sharded operators and the collectives sharding implies.

For each pipeline stage and model chunk this module builds three *programs* (forward, backward, and for
zero-bubble schedules a separate weight-gradient pass): ordered lists of :class:`Step` s, each an
operator on the compute stream or a collective on a communication stream, with explicit waits. The engine
evaluates a program by running every stream in order and honouring the waits; the cost models supply the
durations. Collective placement follows Megatron-LM:

* Tensor parallelism (Shoeybi et al. 2019): without sequence parallelism, an all-reduce of the
  [s·b, h] activations after the attention output projection and after the MLP in forward, and after the
  QKV and MLP-input activation gradients in backward. With sequence parallelism (Korthikanti et al. 2022,
  Sec. 4.2.2) each all-reduce becomes a reduce-scatter and an all-gather around the TP region, and the
  backward re-gathers the sequence-split input for the weight gradient.
* Backward activation-gradient collectives overlap the weight-gradient GEMM that follows them (Megatron-LM
  ``LinearWithGradAccumulationAndAsyncCommunication``, on by default since 2022). With ``tp_overlap``
  (Transformer Engine userbuffers) the forward all-gathers and reduce-scatters are also pipelined with
  their GEMMs.
* Context parallelism (Megatron-Core's ``--cp-comm-type``, Transformer Engine's implementations): by default
  ring attention (Liu et al. 2023): the attention core runs in cp steps; each step's KV block exchange with the
  ring neighbours overlaps the previous step's compute; backward circulates KV and its gradient (twice the
  bytes). Alternatively an exposed all-gather of KV (Llama 3) or all-to-alls of q, k, v and the output
  (DeepSpeed-Ulysses). Each also runs the copies and output merges of TE's implementation.
* Expert parallelism (Lepikhin et al. 2020, GShard; Megatron-Core token dispatcher): an all-to-all
  dispatches routed tokens to their experts and another combines them, in forward and backward. With
  TP-split experts it moves each rank's sequence shard, and a TP all-gather after it (reduce-scatter before
  the combine) hands every TP rank all the tokens of its experts (the all-to-all dispatcher); without
  expert parallelism the hidden states are gathered over TP before the router (the all-gather dispatcher).
* ZeRO-3 / FSDP (Rajbhandari et al. 2020; Zhao et al. 2023): each layer's parameters are all-gathered
  before its forward (prefetched during the previous layer) and again before its backward; its gradients
  are reduce-scattered after its backward, asynchronously. Routed experts' parameters use the
  expert-data-parallel group. ZeRO-2 reduce-scatters the gradients the same way (every micro-batch, layer by
  layer), with the parameters whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

from simulator.graph.ops import Op, whole_tokens
from simulator.graph.transformer import ModelGraph
from simulator.parallel.layout import Group, Layout
from simulator.parallel.stages import Chunk
from simulator.specs.plan import PlanSpec

__all__ = [
    "SELECTIVE_RECOMPUTE_OPS",
    "Comm",
    "Program",
    "Step",
    "attention_output_copy_bytes",
    "block_params",
    "block_programs",
    "build_programs",
    "chunk_params",
    "expert_load",
    "fp8_gemm",
    "instance_dp_comms",
    "instance_key",
    "is_expert_gemm",
    "local_act_bytes",
    "local_params",
    "param_all_gathers",
    "recompute_program",
    "separately_accumulated",
    "shard_op",
    "stage_params",
    "upcasts_gradients",
]

ACT_BYTES = 2  # 16-bit activations and activation gradients on the wire


@dataclass(frozen=True, slots=True)
class Comm:
    """One collective of one rank.

    ``size_bytes`` follows nccl-tests: the buffer size for all-reduce, the *gathered* size for all-gather,
    the *input* size for reduce-scatter, the send buffer for all-to-all, and the message for send/recv.
    ``kind`` is the breakdown bucket it is charged to (tp, cp, ep, dp, pp).
    """

    name: str
    collective: str
    group: Group
    size_bytes: float
    kind: str


class Step(NamedTuple):
    """One entry of a program: an operator or a collective, the stream it runs on, what it waits for.

    ``waits`` are indices of earlier steps (in addition to the order of the step's own stream).
    ``overlapped`` marks compute that runs while a collective is in flight (for the overlap slowdown).
    A named tuple, not a frozen dataclass: a chunk's program has thousands of steps, and a tuple is built about three
    times faster.
    """

    work: Op | Comm
    stream: str
    waits: tuple[int, ...] = ()
    overlapped: bool = False


Program = tuple[Step, ...]


def shard_op(op: Op, layout: Layout, model_experts: int = 0, top_k: int = 1) -> Op:
    """The part of ``op`` one rank executes under ``layout``.

    Tokens are divided by cp (and by tp where sequence parallelism splits them); the TP axis by tp;
    expert GEMMs are spread over ep ranks, each receiving ep times the tokens per expert, scaled by the
    plan's expert imbalance factor (the busiest rank sets the pace).
    """
    tp = layout.tp.size
    cp = layout.cp.size
    folded = _folded(op, layout)
    tok_div = cp * (tp if (layout.sequence_parallel and op.sp_tokens) or _routes_own_shard(op, layout) else 1)
    tp_div = tp if op.tp_axis and not folded else 1
    changes: dict[str, object] = {"act_bytes": local_act_bytes(op, layout), "params": local_params(op, layout)}
    if op.kind == "memory":
        scale = expert_load(op, layout) / (tok_div * (tp_div if op.tp_axis == "bytes" else 1))
        changes["read_bytes"] = op.read_bytes * scale
        changes["write_bytes"] = op.write_bytes * scale
        return op.with_(**changes)
    if op.kind == "attention":
        changes["seq_q"] = _ceil(op.seq_q, cp)
        changes["heads"] = _ceil(op.heads, tp)
        changes["kv_heads"] = max(1, op.kv_heads // tp)
        return op.with_(**changes)
    expert = is_expert_gemm(op)
    for axis, div in ((op.tok_axis, tok_div), (op.tp_axis, tp_div)):
        if axis and div > 1:
            exact = expert and axis == op.tok_axis  # rounded up below, once
            changes[axis] = getattr(op, axis) / div if exact else _ceil(int(getattr(op, axis)), div)
    if expert:
        # The experts' token count is an exact average (graph.transformer._mlp); the busiest rank's share is
        # rounded up once, here, to the whole tokens its GEMMs run. With fewer tokens than experts on the rank, only
        # as many experts as there are tokens run, one token each (not every expert a token of its own).
        ep = layout.ep.size
        field = op.tok_axis
        base = float(changes.get(field, getattr(op, field)))  # type: ignore[arg-type]
        per_expert = base * ep * expert_load(op, layout)
        experts = op.batch // ep
        changes[field] = whole_tokens(per_expert)
        changes["batch"] = experts if per_expert >= 1 else min(experts, whole_tokens(per_expert * experts))
    return op.with_(**changes)


def is_expert_gemm(op: Op) -> bool:
    """Whether ``op`` is one of the routed experts' GEMMs (one problem per expert), whose parameters are sharded and
    reduced over the expert-data-parallel group. By name: sharded over ep = num_experts a rank holds one expert and
    the op's batch is 1 (testing batch > 1 had counted those experts as dense parameters under ZeRO-3 and left
    their FP8 padding out)."""
    return op.kind == "gemm" and op.name.startswith("moe.experts")


def expert_load(op: Op, layout: Layout) -> float:
    """How many times the average routed tokens the busiest rank's experts process: the layout's expert load (the
    plan's imbalance, capped by a capacity factor) for the routed experts' ops (their GEMMs, activation and saved
    inputs), 1 for every other op."""
    return layout.expert_load if op.name.startswith("moe.experts") else 1.0


def _routed(op_name: str) -> bool:
    """Router, permutation, routed experts and un-permutation (not the shared experts)."""
    return op_name.startswith("moe.") and not op_name.startswith("moe.shared")


def _folded(op: Op, layout: Layout) -> bool:
    """Whether ``op`` runs folded: expert_tp 1 under tp > 1, so the routed part of the MoE block works on the
    tokens this TP rank holds (sequence parallelism) with whole experts, and needs no TP collective."""
    return layout.experts_folded and _routed(op.name)


def _gathers_after_dispatch(layout: Layout) -> bool:
    """Whether the MoE block runs Megatron-Core's all-to-all token dispatcher with TP-split experts (expert_tp =
    tp > 1, ep > 1, sequence parallelism): the router and the permutation work on this rank's sequence shard,
    the expert-parallel all-to-all moves only those tokens, and a TP all-gather after it (a reduce-scatter
    before the combining all-to-all) gives every TP rank all the routed tokens of its experts
    (``MoEAlltoAllTokenDispatcher``: ``token_dispatch``, then ``gather_from_sequence_parallel_region`` in
    ``dispatch_postprocess``). Without expert parallelism the block keeps the all-gather dispatcher's order,
    Megatron's default: the hidden states are gathered over TP before the router."""
    return not layout.experts_folded and layout.ep.size > 1 and layout.tp.size > 1 and layout.sequence_parallel


def _dispatches_own_shard(layout: Layout) -> bool:
    """Whether the expert-parallel all-to-all moves this TP rank's sequence shard (folded experts, or the
    all-to-all dispatcher) rather than tokens already gathered over TP before the router."""
    return layout.experts_folded or _gathers_after_dispatch(layout)


def _routes_own_shard(op: Op, layout: Layout) -> bool:
    """Whether ``op`` (router to un-permutation) works on the tokens of this TP rank's sequence shard only: the
    whole routed part with folded experts, the permutations with the all-to-all dispatcher."""
    return _folded(op, layout) or (op.name in ("moe.permute", "moe.unpermute") and _gathers_after_dispatch(layout))


def local_act_bytes(op: Op, layout: Layout) -> float:
    """The activation bytes one rank keeps for ``op``'s backward (the ``act_bytes`` of :func:`shard_op`)."""
    tp = layout.tp.size
    # A column-parallel GEMM keeps its *input*, which TP replicates unless sequence parallelism splits it
    # (Megatron saves the sequence-split input and gathers it again for the backward); a row-parallel GEMM,
    # the attention core and TP-split memory ops keep TP-split tensors. The routed experts' GEMMs are the
    # exception to the first rule: with expert_tp = tp the token dispatcher has already gathered their input
    # over TP (Megatron-Core ``MoEAlltoAllTokenDispatcher``, ``gather_from_sequence_parallel_region``), so
    # every TP rank keeps all the routed tokens its experts see; so do the permutations of the all-gather dispatcher
    # (no expert parallelism), which work on the tokens gathered over TP.
    gathered = op.name in ("moe.permute", "moe.unpermute") and not _routes_own_shard(op, layout)
    sp_split = layout.sequence_parallel and tp > 1 and not is_expert_gemm(op) and not gathered
    act_split = op.tp_axis not in ("", "n", "vocab") or sp_split or _folded(op, layout)
    act = op.act_bytes * expert_load(op, layout) / (layout.cp.size * (tp if act_split else 1))
    if op.kind == "gemm" and fp8_gemm(op, layout):
        act /= 2  # Transformer Engine keeps the FP8 copy of a GEMM input for the backward pass (1 byte)
    return act + attention_output_copy_bytes(op, layout)


def attention_output_copy_bytes(op: Op, layout: Layout) -> float:
    """The copy of the attention output the fused attention core keeps besides the projection GEMM's input.

    In a 16-bit run the output the core returns and saves for its backward is the very tensor the output
    projection keeps, so it counts once (in the projection's ``act_bytes``). A second copy exists when:

    * context parallelism gathers keys and values or moves heads with all-to-all: Transformer Engine's
      ``AttnFuncWithCPAndKVAllGather`` saves each query chunk's partial output besides the output it returns,
      and ``AttnFuncWithCPAndQKVOA2A`` the head-sharded output from before the closing all-to-all;
    * the run is FP8 and the core saves the output it returns (no context parallelism, or the ``p2p`` ring,
      whose ``AttnFuncWithCPAndKVP2P`` saves it): the projection then keeps its own FP8 copy (halved in
      :func:`local_act_bytes`) while the core still holds the 16-bit output its backward needs (FlashAttention
      and cuDNN fused attention compute the softmax-gradient term from it).

    One rank's local output: 16-bit, its tokens over cp, its heads over tp. Zero for other ops. Selective
    recomputation re-runs the core, which then keeps neither copy (:mod:`simulator.cost.memory`).
    """
    if op.kind != "attention":
        return 0.0
    cp_copy = layout.cp.size > 1 and layout.plan.cp_comm != "p2p"
    if not cp_copy and not (layout.plan.precision == "fp8" and op.fp8_layer):
        return 0.0
    # The split shard_op makes (which cannot be called here: shard_op calls local_act_bytes).
    heads = _ceil(op.heads, layout.tp.size)
    return float(ACT_BYTES * op.batch * _ceil(op.seq_q, layout.cp.size) * heads * op.head_dim)


def local_params(op: Op, layout: Layout) -> int:
    """The parameters of ``op`` one rank holds: split over tp along the TP axis (but for its
    ``replicated_params``), expert weights over ep (the ``params`` of :func:`shard_op`, without building the
    sharded op)."""
    params = op.params
    if op.tp_axis and not _folded(op, layout):
        params = (op.params - op.replicated_params) // layout.tp.size + op.replicated_params
    return params // layout.ep.size if is_expert_gemm(op) else params


def chunk_params(graph: ModelGraph, layout: Layout, chunk: Chunk) -> tuple[float, float]:
    """(dense, expert) parameters one rank holds for ``chunk``.

    With pipelining and tied embeddings, the last stage keeps its own copy of the embedding matrix for the
    output layer, kept in sync by an all-reduce of its gradient with the first stage (Megatron-LM).
    """
    dense = expert = 0.0
    for name, count in chunk.blocks:
        block_dense, block_expert, _, _ = block_params(graph, layout, name)
        dense += (block_dense + tied_copy_params(graph, layout, name)) * count
        expert += block_expert * count
    return dense, expert


def tied_copy_params(graph: ModelGraph, layout: Layout, block: str) -> float:
    """The parameters of the output layer's own copy of a tied embedding matrix that one rank of block ``block``
    holds: vocab·hidden/tp in the head when pipelining puts it on another stage than the embedding (Megatron-LM
    keeps the copy there and all-reduces its gradient with the first stage's), else 0 (without pipelining the head
    reads the embedding's weights: its ``head.logits`` op has no parameters of its own). The copy is gathered,
    reduce-scattered and held like any other weight of the stage."""
    if block == "head" and graph.model.tied_embeddings and layout.pp.size > 1:
        return graph.model.vocab * graph.model.hidden / layout.tp.size
    return 0.0


def stage_params(graph: ModelGraph, layout: Layout, chunks: tuple[Chunk, ...]) -> tuple[float, float, float, float]:
    """(dense, expert, FP8 dense, FP8 expert) parameters one rank holds for a stage's ``chunks``: all of them
    (:func:`chunk_params`), and those of the FP8 GEMMs among them (:attr:`Op.fp8_capable`), the weights
    Transformer Engine keeps a quantized copy of when the model trains in FP8 (0 when it does not)."""
    dense = expert = fp8_dense = fp8_expert = 0.0
    in_fp8 = layout.plan.precision == "fp8"
    for chunk in chunks:
        d, e = chunk_params(graph, layout, chunk)
        dense += d
        expert += e
        if in_fp8:
            for name, count in chunk.blocks:
                _, _, block_dense, block_expert = block_params(graph, layout, name)
                fp8_dense += block_dense * count
                fp8_expert += block_expert * count
    return dense, expert, fp8_dense, fp8_expert


# (dense, expert, FP8 dense, FP8 expert) parameters one rank holds of one block, by (model, block, tp, ep,
# folded, embedding rows): they do not depend on the micro-batch, nor on the sequence but through a learned
# position table as long as a longer run (ModelSpec.embedding_params), and a layout search asks for the same
# blocks thousands of times.
_BLOCK_PARAMS: dict[tuple[object, ...], tuple[int, int, int, int]] = {}
_BLOCK_PARAMS_MAX = 4096


def block_params(graph: ModelGraph, layout: Layout, name: str) -> tuple[int, int, int, int]:
    """(dense, expert, FP8 dense, FP8 expert) parameters one rank holds of one instance of block ``name`` (the sums
    of :func:`local_params` over its forward ops; the output layer's tied copy is :func:`tied_copy_params`)."""
    key = (
        graph.model,
        name,
        layout.tp.size,
        layout.ep.size,
        layout.experts_folded,
        graph.model.embedding_params(graph.seq_len),
    )
    hit = _BLOCK_PARAMS.get(key)
    if hit is None:
        counts = [0, 0, 0, 0]
        for op in graph.block(name).forward:
            params = local_params(op, layout)
            expert = 1 if is_expert_gemm(op) else 0
            counts[expert] += params
            if op.fp8_capable:
                counts[2 + expert] += params
        if len(_BLOCK_PARAMS) >= _BLOCK_PARAMS_MAX:
            _BLOCK_PARAMS.clear()
        hit = _BLOCK_PARAMS[key] = (counts[0], counts[1], counts[2], counts[3])
    return hit


def _gather_ahead(
    builder: _Builder, instances: list[tuple[str, list[Op], list[Op]]], j: int, layout: Layout, prefix: str
) -> None:
    """ZeRO-3 before block instance ``j`` (in the order it runs): gather its parameters if it is the first,
    prefetch the next one's, then wait for its own (labels ``prefix`` + index)."""
    for k in (0, j + 1) if j == 0 else (j + 1,):
        if k < len(instances):
            name, f_ops, _ = instances[k]
            for comm in _param_gathers(f_ops, layout, name):
                builder.comm(comm, stream="dp", label=f"{prefix}{k}")
    builder.wait_for(f"{prefix}{j}")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    """Appends steps and wires waits: blocking, overlapped (joined by a later compute), or labelled."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.last_compute: int | None = None
        self.computes = 0
        self.joins: dict[int, list[int]] = {}  # compute ordinal -> comm steps it must wait for
        self.labels: dict[str, list[int]] = {}  # label -> comm steps joined by wait_for(label)
        self.in_flight: set[int] = set()  # comm steps not yet waited for

    def compute(self, op: Op, *, prelude: bool = False) -> None:
        """Append a compute step. A ``prelude`` (the FP8 cast before its GEMM) runs as its own kernel but is not
        counted for joins: a collective meant to overlap the GEMM, or to be waited for by the GEMM, still is."""
        waits = [] if prelude else self.joins.pop(self.computes, [])
        self.in_flight.difference_update(waits)
        self.steps.append(Step(op, "compute", tuple(sorted(waits)), bool(self.in_flight)))
        self.last_compute = len(self.steps) - 1
        if not prelude:
            self.computes += 1

    def comm(self, comm: Comm, *, stream: str = "comm", join: int = 1, label: str = "") -> None:
        """Issue ``comm`` after the last compute.

        The ``join``-th next compute waits for it (1: the next one, i.e. blocking; 2: the one after,
        i.e. overlapped with the next compute); with ``label`` the compute after :meth:`wait_for`
        waits; with ``join=0`` and no label nothing inside the program waits (detached).
        """
        waits = () if self.last_compute is None else (self.last_compute,)
        self.steps.append(Step(comm, stream, waits))
        index = len(self.steps) - 1
        self.in_flight.add(index)
        if label:
            self.labels.setdefault(label, []).append(index)
        elif join > 0:
            self.joins.setdefault(self.computes + join - 1, []).append(index)

    def wait_for(self, label: str) -> None:
        """Make the next compute wait for the comms issued under ``label``."""
        for index in self.labels.pop(label, []):
            self.joins.setdefault(self.computes, []).append(index)

    def finish(self) -> Program:
        # Comms nobody joined (tail collectives, detached gradient scatters) stay in the program; the
        # engine decides whether the program's length includes them.
        return tuple(self.steps)

    def _pending(self) -> set[int]:
        """The comms a later compute will still wait for (named in a join or a label)."""
        return {i for v in self.joins.values() for i in v} | {i for v in self.labels.values() for i in v}

    def relative_state(self) -> tuple[object, ...]:
        """Everything the wiring of the next steps depends on, relative to the current end: the last compute, the
        joins and labels still pending, which comms in flight can still be waited for (only those named in a join
        or label ever are), and whether any other comm is in flight (it keeps later computes ``overlapped``)."""
        n, c = len(self.steps), self.computes
        pending = self._pending()
        return (
            None if self.last_compute is None else self.last_compute - n,
            tuple(sorted((k - c, tuple(i - n for i in v)) for k, v in self.joins.items())),
            tuple(sorted((label, tuple(i - n for i in v)) for label, v in self.labels.items())),
            tuple(sorted(i - n for i in self.in_flight if i in pending)),
            any(i not in pending for i in self.in_flight),
        )

    def repeat(self, start: int, computes: int, times: int) -> None:
        """Append ``times`` more copies of the steps from ``start`` to the end, which ran ``computes`` counted
        computes, each copy shifted by their span, and move the state on as emitting them would have.

        Exact when those steps were emitted from a :meth:`relative_state` equal to the one they left: the same
        emission from the same relative state appends the same steps, shifted, and leaves the same state."""
        span = len(self.steps) - start
        template = self.steps[start:]
        pending = self._pending()
        detached = [i for i in range(start, start + span) if i in self.in_flight and i not in pending]
        for t in range(1, times + 1):
            d = span * t
            self.steps += [
                s if not s.waits else Step(s.work, s.stream, tuple(w + d for w in s.waits), s.overlapped)
                for s in template
            ]
            self.in_flight.update(i + d for i in detached)
        d, dc = span * times, computes * times
        self.last_compute = None if self.last_compute is None else self.last_compute + d
        self.computes += dc
        self.joins = {k + dc: [i + d for i in v] for k, v in self.joins.items()}
        self.labels = {label: [i + d for i in v] for label, v in self.labels.items()}
        self.in_flight = {i + d if i in pending else i for i in self.in_flight}


def _emit_instances(builders: tuple[_Builder, ...], items: list[tuple[object, Callable[[], None]]]) -> None:
    """Emit block instances in order (``(signature, emit)``: what the emission depends on besides the builders,
    and the emission). Where an instance has the signature of the one before and the builders are in the relative
    state that one started from, its steps and every following instance of that signature are the same steps
    shifted (:meth:`_Builder.repeat`): a chunk of 80 equal layers is emitted about twice, then copied."""
    previous: tuple[object, tuple[object, ...], list[tuple[int, int]]] | None = None
    i = 0
    while i < len(items):
        signature, emit = items[i]
        state = tuple(b.relative_state() for b in builders)
        if previous is not None and previous[0] == signature and previous[1] == state:
            n = 1
            while i + n < len(items) and items[i + n][0] == signature:
                n += 1
            for b, (start, computes) in zip(builders, previous[2], strict=True):
                b.repeat(start, computes, n)
            i += n
            previous = None
            continue
        marks = [(len(b.steps), b.computes) for b in builders]
        emit()
        previous = (signature, state, [(start, b.computes - c) for b, (start, c) in zip(builders, marks, strict=True)])
        i += 1


def build_programs(
    graph: ModelGraph, layout: Layout, blocks: tuple[tuple[str, int], ...]
) -> tuple[Program, Program, Program]:
    """Forward, backward and weight-gradient programs of one chunk made of ``blocks``.

    ``blocks`` lists ``(block name, repeat count)`` in forward order, e.g.
    ``(("embedding", 1), ("layer.dense", 4))``. For schedules other than ``zb_h1`` the weight-gradient
    program is empty and the backward program contains the weight gradients.
    """
    return _build_cached(graph, program_key(layout), blocks, _Unhashed(layout))


@dataclass(frozen=True, slots=True, eq=False)
class _Unhashed:
    """Carries the layout into the cached builder without being part of its cache key: every two compare equal
    and hash alike, so the key is (graph, program_key, blocks)."""

    value: Layout

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Unhashed)

    def __hash__(self) -> int:
        return 0


def reduces_in_backward(plan: PlanSpec) -> bool:
    """Whether the backward programs reduce-scatter each layer's gradients (ZeRO-2 and ZeRO-3, whose gradient buffer is
    sharded; :func:`_build`): then the data-parallel groups and gradient overlap shape the programs, which otherwise
    never read them (:func:`program_key`, and the free-knob search's fold memo in ``simulator.run``)."""
    return plan.zero_stage >= 2


def program_key(layout: Layout) -> tuple[object, ...]:
    """Everything of ``layout`` that a chunk's programs depend on (every ``layout.`` read in this module), so that
    plans differing only in what the programs never read (the global batch and so the micro-batch count, the
    data-parallel degree and gradient overlap outside ZeRO-2/3, the overlap's alignment, the straggler factor) share
    them: a sweep over those rebuilt every program (1.4x slower per call). ``tests/unit/test_api_defects.py`` builds
    programs for layouts with equal keys and checks they are equal."""
    scatters = reduces_in_backward(layout.plan)
    return (
        *instance_key(layout),
        layout.recompute,
        layout.plan.recompute_layers,
        layout.grad_overlap if scatters else None,  # whether ZeRO-2/3's per-layer reduce-scatters block the backward
    )


def instance_key(layout: Layout) -> tuple[object, ...]:
    """What one block instance's forward and backward programs (:func:`block_programs`) depend on: the chunk's
    :func:`program_key` without the recomputation, which adds a program of its own, and without the overlap of
    ZeRO-2/3's reduce-scatters, which join instances. Candidates that differ only in those share these programs."""
    plan = layout.plan
    scatters = reduces_in_backward(plan)  # the gradient reduce-scatters in the backward run over dp and edp
    return (
        layout.tp,
        layout.cp,
        layout.ep,
        layout.dp if scatters else layout.dp.size > 1,
        layout.edp if scatters else None,
        layout.pp.size,
        layout.etp,
        layout.sequence_parallel,
        layout.tp_overlap,
        layout.expert_load,
        layout.seq_len,
        layout.micro_batch,
        layout.schedule,
        plan.precision,
        plan.grad_bytes,
        plan.zero_stage,
        plan.cp_comm,
        plan.grad_accum_upcast_copy,
        plan.grad_accum_fusion,
        plan.fp8_weights,
    )


# One entry holds a chunk's whole program, about 135 kB for Llama 3 70B (4,096 entries grew a 1,024-plan sweep to
# 460 MB); 256 keep the last few dozen layouts' programs and bound the memory. The layout itself is not part of the
# key (_Unhashed): the first layout with a key builds the programs every later one with that key shares.
@lru_cache(maxsize=256)
def _build_cached(
    graph: ModelGraph, key: tuple[object, ...], blocks: tuple[tuple[str, int], ...], layout: _Unhashed
) -> tuple[Program, Program, Program]:
    return _build(graph, layout.value, blocks)


def _instance_dp_work(layout: Layout) -> tuple[bool, bool]:
    """(gathers, scatters): whether each block instance gathers its parameters (ZeRO-3) and reduce-scatters its
    fresh gradients (ZeRO-2 and ZeRO-3) on the ``dp`` stream.

    ZeRO-3 shards whatever has a group to shard over: the dense parameters over dp, the routed experts over edp
    (tp 4 · ep 2 with expert_tp 1 has dp 1 but edp 2: its experts are still gathered and scattered). ZeRO-2 and
    ZeRO-3 keep only their shard of the gradients, so each micro-batch's fresh gradients are reduce-scattered in its
    backward, layer by layer, as they are produced: gradients cannot accumulate over micro-batches in a shard ("For
    zero stage 2 (and 3), gradient reduction is required after every backward because of gradient partitioning",
    DeepSpeed maintainers, deepspeedai/DeepSpeed#2252; PyTorch FSDP's SHARD_GRAD_OP likewise reduce-scatters in
    every backward outside no_sync)."""
    shards = layout.dp.size > 1 or layout.edp.size > 1
    return layout.plan.zero_stage == 3 and shards, reduces_in_backward(layout.plan) and shards


def _build(graph: ModelGraph, layout: Layout, blocks: tuple[tuple[str, int], ...]) -> tuple[Program, Program, Program]:
    split_w = layout.schedule == "zb_h1"
    fwd = _Builder()
    bwd = _Builder()
    wgt = _Builder()
    zero3, scatters = _instance_dp_work(layout)
    # Every block instance of the chunk in forward order, each with its sharded forward and backward ops.
    instances: list[tuple[str, list[Op], list[Op]]] = []
    for name, count in blocks:
        instances += [(name, *_instance_ops(graph, layout, name))] * count

    # Forward; under ZeRO-3 each instance's parameters are gathered one instance ahead (prefetch).
    def forward(j: int, name: str, f_ops: list[Op]) -> None:
        if zero3:
            _gather_ahead(fwd, instances, j, layout, "f")
        _emit_forward(fwd, name, f_ops, layout, graph)

    # Backward in reverse; recomputation first where the plan asks for it (with recompute_layers, only for the
    # chunk's first that many decoder layers: Megatron-LM's block method).
    layers = [i for i, (name, _, _) in enumerate(instances) if name.startswith("layer.")]
    recomputed = set(layers[: layout.plan.recompute_layers])  # a None bound slices every layer
    rev = list(reversed(instances))

    def backward(j: int, name: str, f_ops: list[Op], b_ops: list[Op]) -> None:
        if zero3:
            _gather_ahead(bwd, rev, j, layout, "b")
        if len(instances) - 1 - j in recomputed:
            _emit_recompute(bwd, name, f_ops, layout, graph)
        _emit_backward(bwd, wgt if split_w else None, name, b_ops, layout, graph)
        _emit_accumulate(wgt if split_w else bwd, f_ops, layout, name)
        if scatters:
            # Overlapped (FSDP, DeepSpeed's overlap_comm): on the data-parallel stream, nothing waits. Without
            # overlap (DeepSpeed ZeRO-2's default overlap_comm false) the reduction runs in the backward hook and the
            # next backward op waits for it.
            for comm in _grad_scatters(f_ops, layout, name):
                (wgt if split_w else bwd).comm(comm, stream="dp", join=0 if layout.grad_overlap else 1)

    # An instance's emission depends on the builders and on its block (its op lists), on whether it recomputes, and
    # under ZeRO-3 on its index (the gathers' labels and prefetch): equal signatures repeat (_emit_instances).
    _emit_instances(
        (fwd,),
        [
            ((j if zero3 else None, name, id(f_ops)), partial(forward, j, name, f_ops))
            for j, (name, f_ops, _) in enumerate(instances)
        ],
    )
    _emit_instances(
        (bwd, wgt),
        [
            (
                (j if zero3 else None, name, id(f_ops), len(instances) - 1 - j in recomputed),
                partial(backward, j, name, f_ops, b_ops),
            )
            for j, (name, f_ops, b_ops) in enumerate(rev)
        ],
    )
    return fwd.finish(), bwd.finish(), wgt.finish()


def _instance_ops(graph: ModelGraph, layout: Layout, name: str) -> tuple[list[Op], list[Op]]:
    """The sharded forward and backward ops of one instance of block ``name``."""
    moe = graph.model.moe
    experts = moe.num_experts if moe is not None else 0
    top_k = moe.top_k if moe is not None else 1
    block = graph.block(name)
    f_ops = [shard_op(op, layout, experts, top_k) for op in block.forward]
    b_ops = [shard_op(op, layout, experts, top_k) for op in block.backward]
    copy = tied_copy_params(graph, layout, name)
    if copy:  # the output layer's own weights: gathered, scattered and accumulated like any other
        f_ops = [op.with_(params=round(copy)) if op.name == "head.logits" else op for op in f_ops]
    return f_ops, b_ops


def _emit_accumulate(b: _Builder, f_ops: list[Op], layout: Layout, name: str) -> None:
    """A block instance's separate gradient-accumulation kernels, after its backward."""
    for accumulate in _grad_accumulate(f_ops, layout, name):
        b.compute(accumulate)


def block_programs(graph: ModelGraph, layout: Layout, name: str) -> tuple[Program, Program, Program]:
    """One instance of block ``name`` on its own: its forward, backward and weight-gradient (empty unless ``zb_h1``
    splits it off) programs, emitted as :func:`build_programs` emits each instance of a chunk, without what joins
    instances (ZeRO-3's parameter gathers and gradient scatters); :func:`recompute_program` is its recomputation.
    Within a chunk an instance's steps are the same, and some may also wait for steps of the instance before it;
    the free-knob search bounds a chunk's compute from these (``run._block_floor``). They depend on
    :func:`instance_key` of the layout."""
    f_ops, b_ops = _instance_ops(graph, layout, name)
    fwd, bwd, wgt = _Builder(), _Builder(), _Builder()
    split_w = layout.schedule == "zb_h1"
    _emit_forward(fwd, name, f_ops, layout, graph)
    _emit_backward(bwd, wgt if split_w else None, name, b_ops, layout, graph)
    _emit_accumulate(wgt if split_w else bwd, f_ops, layout, name)
    return fwd.finish(), bwd.finish(), wgt.finish()


def instance_dp_comms(graph: ModelGraph, layout: Layout, name: str) -> tuple[tuple[Comm, ...], tuple[Comm, ...]]:
    """The collectives :func:`build_programs` issues on the ``dp`` stream for each instance of block ``name``:
    ZeRO-3's parameter all-gathers (in the forward, and again in the backward) and ZeRO-2/3's gradient
    reduce-scatters (in the backward, or with ``zb_h1`` in the weight-gradient pass); empty where the plan has none.
    They depend on :func:`instance_key`."""
    zero3, scatters = _instance_dp_work(layout)
    if not scatters:  # ZeRO-3 scatters too
        return (), ()
    f_ops, _ = _instance_ops(graph, layout, name)
    gathers = tuple(_param_gathers(f_ops, layout, name)) if zero3 else ()
    return gathers, tuple(_grad_scatters(f_ops, layout, name))


def recompute_program(graph: ModelGraph, layout: Layout, name: str) -> Program:
    """What a block instance runs again before its backward under the layout's recomputation (empty without, and
    for blocks other than decoder layers, which :func:`build_programs` never recomputes), on its own as
    :func:`block_programs`. It depends on :func:`instance_key` and the recomputation."""
    rec = _Builder()
    if name.startswith("layer."):
        _emit_recompute(rec, name, _instance_ops(graph, layout, name)[0], layout, graph)
    return rec.finish()


def _sharding_groups(dense: float, expert: float, layout: Layout) -> list[tuple[str, Group, float]]:
    """(label, group, local parameters) of sharded parameters (ZeRO-3's per-layer gathers and scatters, ZeRO-1/2's
    gather after the optimizer step): dense parameters are sharded over the data-parallel group, the routed
    experts' over the expert-data-parallel group (Megatron-Core keeps expert parameters in their own buffers,
    reduced and gathered over that group)."""
    parts = [("", layout.dp, dense)] if layout.dp.size > 1 else []
    if expert and layout.edp.size > 1:
        parts.append(("expert_", layout.edp, expert))
    return parts


def _split_params(f_ops: list[Op]) -> tuple[int, int]:
    """(dense, routed-expert) parameters of a block's sharded forward ops."""
    expert = sum(op.params for op in f_ops if is_expert_gemm(op))
    return sum(op.params for op in f_ops) - expert, expert


def param_all_gathers(
    dense: float, expert: float, layout: Layout, name: str, fp8: tuple[float, float] = (0.0, 0.0)
) -> list[Comm]:
    """The all-gathers of ``dense`` and ``expert`` local parameters, each over its sharding group: in 16 bits,
    but for the ``fp8`` (dense, expert) parameters among them, gathered in 1 byte when the plan keeps the FP8
    GEMMs' weights in FP8 (``fp8_param``; Megatron-Core's ``--fp8-param-gather``)."""
    in_fp8 = dict(zip(("", "expert_"), fp8 if layout.plan.fp8_weights else (0.0, 0.0), strict=True))
    return [
        Comm(f"{name}.{tag}param_all_gather", "all_gather", group, float(2 * params - in_fp8[tag]), "dp")
        for tag, group, params in _sharding_groups(dense, expert, layout)
    ]


def _param_gathers(f_ops: list[Op], layout: Layout, name: str) -> list[Comm]:
    fp8 = _split_params([op for op in f_ops if op.fp8_capable])
    return param_all_gathers(*_split_params(f_ops), layout, name, (float(fp8[0]), float(fp8[1])))


def _grad_scatters(f_ops: list[Op], layout: Layout, name: str) -> list[Comm]:
    return [
        Comm(f"{name}.{tag}grad_reduce_scatter", "reduce_scatter", group, float(layout.plan.grad_bytes * params), "dp")
        for tag, group, params in _sharding_groups(*_split_params(f_ops), layout)
    ]


def separately_accumulated(dense: float, expert: float, layout: Layout) -> float:
    """Of ``dense`` and routed-``expert`` local parameters, those whose fresh gradients each micro-batch's backward
    adds into the buffer in kernels of its own: none with gradient-accumulation fusion; under ZeRO-2 or ZeRO-3, only
    those with no group to be reduce-scattered over (:func:`_sharding_groups`: dense over dp, experts over edp), the
    others being scattered away instead (the reduced shard's add into the sharded buffer, 1/dp of the work, is left
    out)."""
    if layout.plan.grad_accum_fusion:
        return 0.0
    if not reduces_in_backward(layout.plan):
        return dense + expert
    return (dense if layout.dp.size == 1 else 0.0) + (expert if layout.edp.size == 1 else 0.0)


def _accumulates_separately(layout: Layout) -> bool:
    """Whether some local parameters' gradients may be accumulated separately (:func:`separately_accumulated`; a
    dense model's edp is dp·cp, so its edp of 1 means dp 1)."""
    return not layout.plan.grad_accum_fusion and (
        not reduces_in_backward(layout.plan) or layout.dp.size == 1 or layout.edp.size == 1
    )


def upcasts_gradients(layout: Layout) -> bool:
    """Whether that separate accumulation goes through a copy cast up to the buffer's dtype
    (``grad_accum_upcast_copy``; a no-op with a 16-bit buffer; PlanSpec docstring)."""
    return _accumulates_separately(layout) and layout.plan.grad_accum_upcast_copy and layout.plan.grad_bytes > 2


def _grad_accumulate(f_ops: list[Op], layout: Layout, name: str) -> list[Op]:
    """The separate gradient-accumulation kernels of a block (:func:`separately_accumulated`): the fresh 16-bit
    gradient of each local parameter is added into the buffer in ``grad_dtype``, in one kernel, or cast to a copy
    in the buffer's dtype first and then added (:func:`upcasts_gradients`)."""
    params = separately_accumulated(*_split_params(f_ops), layout)
    if params <= 0:
        return []
    acc = layout.plan.grad_bytes

    def streaming(kernel: str, read: float, write: float) -> Op:
        return Op(
            name=f"{name}.{kernel}",
            kind="memory",
            phase="bwd",
            read_bytes=float(params * read),
            write_bytes=float(params * write),
        )

    if upcasts_gradients(layout):
        return [streaming("grad_upcast", 2, acc), streaming("grad_accumulate", 2 * acc, acc)]
    return [streaming("grad_accumulate", 2 + acc, acc)]


def _tokens(layout: Layout) -> int:
    return layout.micro_batch * layout.seq_len // layout.cp.size


def _tp_comms(layout: Layout, hidden: int, tag: str) -> tuple[Comm | None, Comm | None, Comm | None]:
    """(all-gather before, reduce-scatter after, all-reduce after) of a TP region of width ``hidden``."""
    if layout.tp.size == 1:
        return None, None, None
    size = float(ACT_BYTES * _tokens(layout) * hidden)
    if layout.sequence_parallel:
        return (
            Comm(f"{tag}.all_gather", "all_gather", layout.tp, size, "tp"),
            Comm(f"{tag}.reduce_scatter", "reduce_scatter", layout.tp, size, "tp"),
            None,
        )
    return None, None, Comm(f"{tag}.all_reduce", "all_reduce", layout.tp, size, "tp")


# Where each TP region starts and ends, by forward op name.
# Shared experts are a TP-split MLP of their own (Megatron-Core ``SharedExpertMLP``: Transformer Engine column- and
# row-parallel linears on the sequence-split input): their all-gather and reduce-scatter come on top of the routed
# part's, which the token dispatcher issues (the all-gather dispatcher: ``gather_from_sequence_parallel_region`` of
# the hidden states after the router, ``reduce_scatter_to_sequence_parallel_region`` after the un-permutation).
_REGION_START = {
    "attn.qkv": "attn",
    "mlp.up": "mlp",
    "moe.router": "mlp",
    "moe.shared.up": "shared",
    "head.logits": "head",
}
_REGION_END = {
    "attn.out": "attn",
    "mlp.down": "mlp",
    "moe.unpermute": "mlp",
    "moe.shared.down": "shared",
    "embedding.lookup": "embedding",
}


def _without(table: dict[str, str], name: str, add: dict[str, str] | None = None) -> dict[str, str]:
    """``table`` without the entry ``name``, plus the entries of ``add``."""
    return {**{k: v for k, v in table.items() if k != name}, **(add or {})}


# With folded experts (or the all-to-all dispatcher) the routed part of the MoE block (router to un-permutation) has
# no TP collective of its own; shared experts keep theirs.
_FOLDED_REGION_START = _without(_REGION_START, "moe.router")
_FOLDED_REGION_END = _without(_REGION_END, "moe.unpermute")


def _emit_forward(b: _Builder, block: str, ops: list[Op], layout: Layout, graph: ModelGraph) -> None:
    h = graph.model.hidden
    fwd_overlap = 2 if layout.tp_overlap else 1
    gathered = _gathers_after_dispatch(layout)
    local = _dispatches_own_shard(layout)
    starts, ends = (_FOLDED_REGION_START, _FOLDED_REGION_END) if local else (_REGION_START, _REGION_END)
    for op in ops:
        region = starts.get(op.name)
        if region is not None:
            ag, _, _ = _tp_comms(layout, h, f"{block}.{region}")
            if ag is not None:
                b.comm(ag, join=fwd_overlap if op.kind == "gemm" and layout.tp_overlap else 1)
        if op.name in ("moe.permute",) and layout.ep.size > 1:
            _emit_compute(b, op, layout)
            b.comm(_a2a(layout, graph, f"{block}.dispatch"))
            if gathered:
                b.comm(_expert_tp_comm(layout, graph, f"{block}.dispatch", "all_gather"))
            _emit_sort_chunks(b, layout, graph, "moe.sort_chunks")
            continue
        if op.name == "moe.experts.up":
            _emit_fp8_padding(b, op, layout, "moe.fp8_pad", "input")
        if op.name == "moe.unpermute" and layout.ep.size > 1:
            _emit_sort_chunks(b, layout, graph, "moe.sort_chunks_back")
            if gathered:
                b.comm(_expert_tp_comm(layout, graph, f"{block}.combine", "reduce_scatter"))
            b.comm(_a2a(layout, graph, f"{block}.combine"))
        end = ends.get(op.name)
        closing: list[Comm] = []
        if end is not None:
            _, rs, ar = _tp_comms(layout, h, f"{block}.{end}")
            closing = [c for c in (rs, ar) if c is not None]
        # Transformer Engine's userbuffers pipeline a region's last GEMM with its reduce-scatter (tp_overlap, which
        # needs sequence parallelism): issued with the GEMM, waited for by the next op; otherwise blocking after it.
        pipelined = layout.tp_overlap and layout.sequence_parallel and op.kind == "gemm"
        if pipelined:
            for c in closing:
                b.comm(c, join=2)
        _emit_compute(b, op, layout)
        if op.name == "moe.experts.down":
            _emit_fp8_padding(b, op, layout, "moe.fp8_unpad", "output")
        if not pipelined:
            for c in closing:
                b.comm(c)
        if op.name == "head.cross_entropy" and layout.tp.size > 1:
            # Vocab-parallel cross-entropy (Megatron's _VocabParallelCrossEntropy): all-reduces of the fp32 row
            # maximum, the target logit and the sum of exponentials, one value per token.
            size = float(4 * _tokens(layout))
            for what in ("max", "target_logit", "sum_exp"):
                b.comm(Comm(f"{block}.cross_entropy.{what}_all_reduce", "all_reduce", layout.tp, size, "tp"))


def fp8_gemm(op: Op, layout: Layout) -> bool:
    """Whether ``op`` is a GEMM that runs in FP8 (Transformer Engine linear layers; not the output layer,
    the router or the unfused attention's batched GEMMs)."""
    return layout.plan.precision == "fp8" and op.fp8_capable


def _fp8_cast(op: Op) -> Op | None:
    """The quantisation kernel Transformer Engine runs before an FP8 GEMM.

    TE casts the 16-bit GEMM input (forward: the activation, m×k; activation gradient: the incoming
    gradient, m×k of the dgrad GEMM) to FP8 and also writes its transpose for the other backward GEMM
    (``cast_transpose``): read 2 bytes, write 1 + 1 bytes per element. Weight-gradient GEMMs reuse those
    casts and weights are cast once per step (TE's FP8 weight cache), so neither adds a cast here.
    Source: NVIDIA Transformer Engine documentation, "Using FP8 with Transformer Engine" and the
    ``cast_transpose`` kernels of ``transformer_engine.pytorch.cpp_extensions``.
    """
    if op.phase == "bwd_weight":
        return None
    elements = float(op.batch * op.m * op.k)
    return Op(
        name=f"{op.name}.fp8_cast",
        kind="memory",
        phase=op.phase,
        read_bytes=2.0 * elements,
        write_bytes=2.0 * elements,
    )


def _emit_compute(b: _Builder, op: Op, layout: Layout) -> None:
    """One compute op; with cp > 1 the attention core runs as the plan's context-parallel exchange."""
    if op.kind == "attention" and layout.cp.size > 1:
        _EMIT_CP[layout.plan.cp_comm](b, op, layout)
        return
    if fp8_gemm(op, layout):
        cast = _fp8_cast(op)
        if cast is not None:
            b.compute(cast, prelude=True)
    b.compute(op)


def _qkv_bytes(op: Op) -> tuple[float, float]:
    """Bytes of one rank's local queries (= its attention output) and of its local keys and values."""
    q = float(ACT_BYTES * op.batch * op.seq_q * op.heads * op.head_dim)
    kv = float(ACT_BYTES * 2 * op.batch * op.seq_q * op.kv_heads * op.head_dim)
    return q, kv


def _cp_copies(op: Op, traffic: float, tag: str = "cp_merge") -> Op:
    """The streaming copy and add kernels a context-parallel attention runs around its attention kernels."""
    return Op(name=f"{op.name}.{tag}", kind="memory", phase=op.phase, read_bytes=traffic / 2, write_bytes=traffic / 2)


@lru_cache(maxsize=64)
def ring_copy_traffic(cp: int, q: float, kv: float, causal: bool = True) -> tuple[float, float]:
    """HBM bytes (read + write) of the copies and merges of Transformer Engine's ring attention, per rank.

    Mirrors ``AttnFuncWithCP`` (TE 1.x ``transformer_engine/pytorch/attention.py``; later
    ``AttnFuncWithCPAndKVP2P``), cuDNN path, ``sbhd`` layout, for a causal mask with the load-balanced chunks
    (rank r holds chunks r and 2·cp−1−r). ``q`` is the local query (and output) size, ``kv`` the local keys and
    values. A half-tensor copy reads and writes half the tensor; an in-place add reads two and writes one.

    Forward: ``torch.cat`` of K and V into the first send buffer (2·kv); at steps 1 … r the first half of the
    arriving KV is made contiguous (kv), at later steps the second half of q (q); the output is zeroed (q) and
    every step's partial output merged into it by the fused log-sum-exp correction (3·q for a whole step, 1.5·q
    for a half one). Backward: the KV copy into the first buffer (2·kv); half-KV steps copy half the KV (kv),
    half-q steps the second halves of q, out and dout (3·q); each step accumulates its dq (copy or add, whole or
    half) and concatenates and accumulates its dK/dV into the buffer that travels on. The fp32 log-sum-exp
    bookkeeping (4-8 bytes per token and head against 2·head_dim bytes per token and head of q) is left out.
    Without a mask every step is whole: no half copies, whole merges and accumulations.
    Returns the mean over the cp ranks of (forward, backward) traffic.
    """
    if not causal:
        fwd = 2 * kv + q + 3 * q * cp
        bwd = 2 * kv + (2 * q + 4 * kv) + (cp - 1) * (3 * q + 5 * kv)
        return fwd, bwd
    fwd = bwd = 0.0
    for r in range(cp):
        fwd += 2 * kv + q
        fwd += sum(kv if i <= r else q for i in range(1, cp))
        fwd += sum(3 * q if i <= r else 1.5 * q for i in range(cp))
        t = cp - r - 1  # from this step on the local queries see whole KV blocks
        bwd += 2 * kv
        for i in range(cp):
            if i < t:  # second half of the queries against a whole KV block
                bwd += 3 * q + (q if i == 0 else 1.5 * q) + 2 * kv + (2 * kv if i == 0 else 3 * kv)
                continue
            if i == t:
                bwd += 2 * q if r == cp - 1 else 2.5 * q
            else:
                bwd += 3 * q
            if i == cp - 1:  # the diagonal block
                bwd += 2 * kv + (2.5 * kv if r == 0 else 3 * kv)
            else:  # all queries against the first half of a KV block
                bwd += kv + kv + (kv if (i == 0 and r == cp - 1) else 1.5 * kv)
    return fwd / cp, bwd / cp


def _emit_cp_p2p(b: _Builder, op: Op, layout: Layout) -> None:
    """Ring attention (``cp_comm: p2p``): cp attention steps, each step's KV exchange with the ring neighbours
    overlapping the previous step's compute; backward circulates KV and its gradient (twice the bytes).

    With a causal mask and load balancing (each rank holds chunks i and 2·cp−1−i of the sequence; Megatron-LM /
    Transformer Engine), the first step is the local block under the mask and every later one an unmasked half
    block (all local queries against the earlier chunk of the arriving KV, or the later query chunk against all
    of it): the same executed FLOPs as cp masked strips, timed on the kernel's curve with and without a mask.
    The copies and output merges around the steps follow :func:`ring_copy_traffic`.
    """
    cp = layout.cp.size
    local = op.seq_q
    if op.causal and op.causal_skip:
        pieces = [op.with_(seq_kv=local)] + [op.with_(seq_kv=max(1, local // 2), causal=False)] * (cp - 1)
    else:
        pieces = [op.with_(seq_kv=local)] * cp
    q, kv = _qkv_bytes(op)
    kv_bytes = kv if op.phase == "fwd" else 2 * kv  # KV and its gradient travel together in backward
    for i, piece in enumerate(pieces):
        if i < cp - 1:
            b.comm(Comm(f"{op.name}.ring_{i}", "send_recv", layout.cp, kv_bytes, "cp"), join=2)
        b.compute(piece)
    fwd, bwd = ring_copy_traffic(cp, q, kv, op.causal)
    b.compute(_cp_copies(op, fwd if op.phase == "fwd" else bwd))


def _emit_cp_all_gather(b: _Builder, op: Op, layout: Layout) -> None:
    """All-gather attention (``cp_comm: all_gather``; Llama 3, Dubey et al. 2024, Sec. 3.3.2; Transformer
    Engine's ``AttnFuncWithCPAndKVAllGather``): the whole sequence's K and V are gathered before attention
    (exposed), each of the rank's two query chunks attends to its causal prefix, and backward re-gathers K and V
    and reduce-scatters their gradient (exposed).

    Rank 0 stands for every rank (each computes the same FLOPs): its chunks see 1 and 2·cp chunks of KV. A chunk
    against a longer prefix is one bottom-right causal kernel, timed as an unmasked one of equal FLOPs. Copies
    (from TE's source): reorder of the gathered KV (2·cp·kv), the two half-q copies and output copies (4·q);
    backward adds zeroing the gathered dK/dV (cp·kv), the reorder before the reduce-scatter (2·cp·kv), the half
    copies of q and dout and the dq copies (6·q) and the accumulation of each chunk's dK/dV (3 × its prefix).
    """
    cp = layout.cp.size
    c = max(1, op.seq_q // 2)  # one of the rank's two chunks
    q, kv = _qkv_bytes(op)
    gathered = cp * kv
    if op.causal:
        pieces = [op.with_(seq_q=c, seq_kv=c), op.with_(seq_q=c, seq_kv=2 * cp * c - c // 2, causal=False)]
        prefix_chunks = 1 + 2 * cp
    else:
        pieces = [op.with_(seq_q=c, seq_kv=2 * cp * c)] * 2
        prefix_chunks = 4 * cp
    b.comm(Comm(f"{op.name}.kv_all_gather", "all_gather", layout.cp, gathered, "cp"))
    if op.phase == "fwd":
        b.compute(_cp_copies(op, 2 * gathered + 4 * q))
        for piece in pieces:
            b.compute(piece)
        return
    b.compute(_cp_copies(op, 3 * gathered + 6 * q + 1.5 * prefix_chunks * kv))
    for piece in pieces:
        b.compute(piece)
    b.compute(_cp_copies(op, 2 * gathered, "cp_reorder"))
    b.comm(Comm(f"{op.name}.dkv_reduce_scatter", "reduce_scatter", layout.cp, gathered, "cp"))


def _emit_cp_a2a(b: _Builder, op: Op, layout: Layout) -> None:
    """Ulysses attention (``cp_comm: a2a``; Jacobs et al. 2023, DeepSpeed-Ulysses; Transformer Engine's
    ``AttnFuncWithCPAndQKVOA2A``): all-to-alls turn sequence-sharded q, k, v into head-sharded ones over the
    whole sequence, attention runs on heads/cp, and another all-to-all returns the output (backward: dout in,
    dq, dk, dv out), one all-to-all per tensor; all exposed. Around every all-to-all TE's
    ``flash_attn_a2a_communicate`` makes three copies of each tensor (one layout change before it, a layout
    change and a chunk reorder after it, or the mirror image): 6 bytes of traffic per byte moved.
    """
    cp = layout.cp.size
    q, kv = _qkv_bytes(op)
    core = op.with_(seq_q=op.seq_q * cp, heads=max(1, op.heads // cp), kv_heads=max(1, op.kv_heads // cp))
    # One all-to-all per tensor (flash_attn_a2a_communicate issues an all_to_all_single for each): q, k and v
    # (or dq, dk and dv) and the output (or its gradient).
    qkv = {"q": q, "k": kv / 2, "v": kv / 2}
    inputs, outputs = (qkv, {"out": q}) if op.phase == "fwd" else ({"out": q}, qkv)
    b.compute(_cp_copies(op, 2 * sum(inputs.values()), "cp_layout"))
    for name, size in inputs.items():
        b.comm(Comm(f"{op.name}.a2a_in.{name}", "all_to_all", layout.cp, size, "cp"))
    b.compute(_cp_copies(op, 4 * sum(inputs.values()), "cp_reorder"))
    b.compute(core)
    b.compute(_cp_copies(op, 4 * sum(outputs.values()), "cp_layout_out"))
    for name, size in outputs.items():
        b.comm(Comm(f"{op.name}.a2a_out.{name}", "all_to_all", layout.cp, size, "cp"))
    b.compute(_cp_copies(op, 2 * sum(outputs.values())))


_EMIT_CP = {"p2p": _emit_cp_p2p, "all_gather": _emit_cp_all_gather, "a2a": _emit_cp_a2a}


def _routed_bytes(layout: Layout, graph: ModelGraph, tokens: int) -> float:
    """16-bit hidden states of ``tokens`` tokens, each routed to top_k experts, at the busiest rank's share."""
    moe = graph.model.moe
    assert moe is not None
    return float(ACT_BYTES * tokens * moe.top_k * graph.model.hidden) * layout.expert_load


def _a2a(layout: Layout, graph: ModelGraph, tag: str) -> Comm:
    # The tokens of this rank's sequence shard with folded experts or the all-to-all dispatcher; otherwise they
    # were gathered over TP before the router.
    tokens = _tokens(layout) // (layout.tp.size if _dispatches_own_shard(layout) else 1)
    return Comm(f"{tag}.all_to_all", "all_to_all", layout.ep, _routed_bytes(layout, graph, tokens), "ep")


def _expert_tp_comm(layout: Layout, graph: ModelGraph, tag: str, collective: str) -> Comm:
    """The all-to-all dispatcher's TP all-gather of the routed tokens after the dispatch (``all_gather``) or
    reduce-scatter before the combine: every TP rank ends with all routed tokens of its experts (gathered size,
    the busiest rank's share)."""
    return Comm(f"{tag}.{collective}", collective, layout.tp, _routed_bytes(layout, graph, _tokens(layout)), "tp")


def _copy(name: str, size: float) -> Op:
    """A kernel that reads ``size`` bytes and writes as many (a gather or pad copy), backward when ``name`` says."""
    phase = "bwd" if name.endswith(".bwd") else "fwd"
    return Op(name=name, kind="memory", phase=phase, read_bytes=size, write_bytes=size)


def _emit_sort_chunks(b: _Builder, layout: Layout, graph: ModelGraph, name: str) -> None:
    """The copy that sorts the dispatched tokens by local expert (after the dispatching all-to-all and the expert-TP
    gather), or back by source rank before the combine, and the same for their gradients: Megatron-Core's
    all-to-all dispatcher calls ``sort_chunks_by_idxs`` in ``dispatch_postprocess`` and ``combine_preprocess``
    whenever a rank holds more than one expert (``num_local_experts > 1``); Transformer Engine's
    ``moe_sort_chunks_by_index`` gathers every routed token's row into a new tensor."""
    moe = graph.model.moe
    if moe is None or layout.ep.size == 1 or moe.num_experts // layout.ep.size <= 1:
        return
    gathered = _gathers_after_dispatch(layout)
    tokens = _tokens(layout) // (layout.tp.size if _dispatches_own_shard(layout) and not gathered else 1)
    size = _routed_bytes(layout, graph, tokens)
    b.compute(_copy(name, size))


def _emit_fp8_padding(b: _Builder, op: Op, layout: Layout, name: str, side: str) -> None:
    """In FP8, Transformer Engine's grouped experts pad each expert's tokens to a multiple of 16 before the first
    GEMM and strip the padding after the last (Megatron-Core ``TEGroupedMLP``: ``Fp8Padding``/``Fp8Unpadding``,
    which copy the whole tensor unless every count is aligned; ``moe_router_padding_for_fp8``, off by default,
    would align them in the router instead), and the backward does the same to the gradients: one 16-bit copy of
    the routed tokens at ``op``'s ``input`` (m×k) or ``output`` (m×n)."""
    if not (fp8_gemm(op, layout) and is_expert_gemm(op)):  # also with one expert per rank (TEGroupedMLP pads)
        return
    size = float(ACT_BYTES * op.batch * op.m * (op.k if side == "input" else op.n))
    b.compute(_copy(name, size))


# What selective recomputation re-runs besides a fused attention core: the unfused core's score product, softmax,
# softmax dropout and context product (Korthikanti et al. 2022, Sec. 5), not the residual dropout-add after the
# output projection. cost.memory drops the same tensors.
SELECTIVE_RECOMPUTE_OPS = frozenset({"attn.scores", "attn.softmax", "attn.dropout", "attn.context"})


def _emit_recompute(b: _Builder, block: str, f_ops: list[Op], layout: Layout, graph: ModelGraph) -> None:
    if layout.recompute == "full":
        _emit_forward(b, f"{block}.recompute", f_ops, layout, graph)
    elif layout.recompute == "selective":
        for op in f_ops:
            if op.kind == "attention" or op.name in SELECTIVE_RECOMPUTE_OPS:
                _emit_compute(b, op.with_(act_bytes=0.0), layout)


# Backward TP collectives: before the first op of a region's backward (SP all-gather of the incoming
# gradient) and after its activation-gradient GEMM (reduce-scatter or all-reduce of the input gradient).
_BWD_REGION_START = {
    "attn.out.dgrad": "attn",
    "mlp.down.dgrad": "mlp",
    "moe.unpermute.bwd": "mlp",
    "moe.shared.down.dgrad": "shared",
    "head.cross_entropy.bwd": "head",
    "embedding.lookup.bwd": "embedding",
}
_BWD_REGION_END = {
    "attn.qkv.dgrad": "attn",
    "mlp.up.dgrad": "mlp",
    "moe.router.dgrad": "mlp",
    "moe.shared.up.dgrad": "shared",
    "head.logits.dgrad": "head",
}
# Activation-gradient GEMMs whose weight-gradient partner needs the sequence-split input gathered again
# (Megatron-LM issues that all-gather before the dgrad GEMM so that the two overlap). Not the MoE router: it runs
# on the sequence-split hidden states before the token dispatcher gathers them (Megatron-Core ``MoELayer.forward``),
# so its weight gradient needs no gathered input (its replicated weight's gradient is all-reduced over TP with the
# other sequence-parallel parameters at the end of the step).
_DGRAD_WITH_INPUT_GATHER = {"attn.qkv.dgrad", "mlp.up.dgrad", "head.logits.dgrad", "moe.shared.up.dgrad"}
# Folded experts (or the all-to-all dispatcher): the routed part's backward has no TP collective either.
_FOLDED_BWD_REGION_START = _without(_BWD_REGION_START, "moe.unpermute.bwd")
_FOLDED_BWD_REGION_END = _without(_BWD_REGION_END, "moe.router.dgrad")


def _emit_backward(
    b: _Builder, w: _Builder | None, block: str, ops: list[Op], layout: Layout, graph: ModelGraph
) -> None:
    h = graph.model.hidden
    started: set[str] = set()
    gathered = _gathers_after_dispatch(layout)
    starts, ends = (
        (_FOLDED_BWD_REGION_START, _FOLDED_BWD_REGION_END)
        if _dispatches_own_shard(layout)
        else (_BWD_REGION_START, _BWD_REGION_END)
    )
    for op in ops:
        region = starts.get(op.name)
        if region is not None and region not in started:
            started.add(region)
            ag, _, _ = _tp_comms(layout, h, f"{block}.{region}.bwd")
            if ag is not None and region != "head":
                b.comm(ag, join=2 if layout.tp_overlap else 1)
        if op.name == "moe.unpermute.bwd" and layout.ep.size > 1:
            _emit_compute(b, op, layout)
            b.comm(_a2a(layout, graph, f"{block}.combine.bwd"))
            if gathered:  # the gradient of the combine's reduce-scatter
                b.comm(_expert_tp_comm(layout, graph, f"{block}.combine.bwd", "all_gather"))
            _emit_sort_chunks(b, layout, graph, "moe.sort_chunks_back.bwd")
            continue
        if op.name == "moe.experts.down.dgrad":
            _emit_fp8_padding(b, op, layout, "moe.fp8_unpad.bwd", "input")
        if op.name == "moe.permute.bwd" and layout.ep.size > 1:
            _emit_sort_chunks(b, layout, graph, "moe.sort_chunks.bwd")
            if gathered:  # the gradient of the dispatch's all-gather
                b.comm(_expert_tp_comm(layout, graph, f"{block}.dispatch.bwd", "reduce_scatter"))
            b.comm(_a2a(layout, graph, f"{block}.dispatch.bwd"))
        if op.phase == "bwd_weight" and w is not None:
            w.compute(op)
            continue
        if op.name in _DGRAD_WITH_INPUT_GATHER and layout.sequence_parallel:
            # Under zb_h1 the gather still runs in the activation-gradient pass, which keeps the gathered input for
            # the deferred weight-gradient pass (the zero-bubble reference's WeightGradStore).
            ag, _, _ = _tp_comms(layout, h, f"{block}.{op.name}.input")
            if ag is not None:
                b.comm(ag, join=2)  # joined by the weight-gradient GEMM right after the dgrad
        _emit_compute(b, op, layout)
        if op.name == "moe.experts.up.dgrad":
            _emit_fp8_padding(b, op, layout, "moe.fp8_pad.bwd", "output")
        end = ends.get(op.name)
        if end is not None:
            _, rs, ar = _tp_comms(layout, h, f"{block}.{end}.bwd")
            for c in (rs, ar):
                if c is not None:
                    # Async: overlaps the weight-gradient GEMM that follows; joined by the op after it.
                    b.comm(c, join=2 if w is None else 1)
