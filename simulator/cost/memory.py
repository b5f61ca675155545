"""Memory cost: the peak bytes one rank of each pipeline stage holds.

Per stage (Design: Physics, Weights/gradients/optimizer and Activation memory):

* weights: 2 bytes per local parameter (16-bit), divided by the data-parallel degree under ZeRO-3/FSDP; in FP8
  training 2 more bytes per parameter of the FP8 GEMMs, the quantized copies Transformer Engine caches
  (:data:`FP8_WEIGHT_CACHE_BYTES`), unless ``fp8_param`` keeps those weights in FP8 only (1 byte plus its cached
  transpose, in place of the 16-bit weight);
* gradients: 4 bytes (fp32 main gradients, bf16 training) or 2 (fp16), divided by dp under ZeRO-2/3;
* optimizer: 12 bytes (fp32 master weight, Adam momentum and variance), divided by dp under ZeRO-1 and up
  (Megatron's distributed optimizer; Rajbhandari et al. 2020, Sec. 5);
* activations: what each model chunk keeps per micro-batch (from the operator graph, sharded), times the
  number of micro-batches the schedule holds at its peak (read off the generated task order; under zb_h1 a
  micro-batch past its B holds what its deferred W needs instead, :func:`_weight_grad_store`). Full
  recomputation keeps only each layer's input (Korthikanti et al. 2022, Sec. 5) plus one layer's working
  set while it is recomputed (with ``recompute_layers`` only the chunk's first layers recompute and the others
  keep everything, Megatron-LM's block method); selective recomputation drops what the attention core alone keeps,
  and re-creates it for one layer at a time in backward (that layer's working set);
* buffers: transient tensors that live outside the saved activations (the 16-bit logits before the fp32
  cross-entropy on the last stage; under ZeRO-2 and ZeRO-3 one block's whole gradient before its reduce-scatter;
  under ZeRO-3 the gathered parameters of the current and the prefetched layer; with ``grad_accum_upcast_copy``
  the cast copy of the largest operator's gradient) and a
  fixed per-process reserve for the CUDA context, library workspaces and NCCL buffers (:data:`RESERVED_BYTES`);
  with 16-bit gradients, what the optimizer step's fp32 copy of the gradient shard needs beyond the backward's
  peak (that phase holds no activations).

Parameters of experts are counted once per expert-parallel rank; ZeRO divides them over the
expert-data-parallel group instead of the whole data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from simulator.graph.ops import Op
from simulator.graph.transformer import ModelGraph
from simulator.parallel.layout import Layout
from simulator.parallel.program import (
    attention_output_copy_bytes,
    block_params,
    build_programs,
    fp8_gemm,
    local_act_bytes,
    local_params,
    separately_accumulated,
    stage_params,
    tied_copy_params,
    upcasts_gradients,
)
from simulator.parallel.schedule import Task, in_flight
from simulator.parallel.stages import Chunk
from simulator.units import GIB, fmt_bytes

__all__ = ["FP8_WEIGHT_CACHE_BYTES", "RESERVED_BYTES", "StageMemory", "stage_memory"]

# Device memory a training process holds outside PyTorch's tensors, as the sum of its measured parts:
# * the CUDA context: 287 MB with lazy module loading (PyTorch's default since 1.13; 667 MB eager), measured
#   in pytorch/pytorch pull request #86509;
# * NCCL communicator buffers: a 4 MiB FIFO per channel and peer (NCCL_BUFFSIZE default, NCCL user guide;
#   nccl issue #285), a ring holding two peers on up to 32 channels, i.e. up to 256 MiB per communicator and
#   protocol; a Megatron rank holds several communicators (TP, PP, DP, embedding), and the NCCL maintainers
#   confirm memory grows with channels and communicators (nccl issues #864 and #986, where one all-reduce
#   communicator took 1.6 GB on the reporter's H100 node);
# * cuBLAS workspaces (32 MiB per handle and stream on Hopper, PyTorch CUDA semantics notes).
# 0.3 GiB + about 1.5 GiB of NCCL buffers + workspaces rounds to 2 GiB; it is a floor, not a fit: the
# caching allocator's fragmentation comes on top and is not modelled.
RESERVED_BYTES = 2.0 * GIB
RESERVED_SOURCE = (
    "CUDA context 287 MB (pytorch/pytorch#86509) + NCCL channel buffers (NCCL_BUFFSIZE 4 MiB per channel "
    "and peer; nccl#285, #864, #986) + cuBLAS workspaces"
)

# Bytes per parameter of an FP8 GEMM's weight that Transformer Engine keeps besides the 16-bit weight: with
# Megatron-Core's default (disable_parameter_transpose_cache off) its linear layers are called with
# is_first_microbatch, and TE then quantizes each weight once per step into a cached workspace
# (TransformerEngineBaseModule.get_weight_workspace, cache_name "weight"; GroupedLinear "weight{i}" per expert)
# that it reuses for every micro-batch. In training the weight quantizer is set to rowwise and columnwise usage
# (linear.py: set_usage(rowwise=True, columnwise=is_grad_enabled ...)): one FP8 copy for the forward GEMM and one
# transposed for the backward data-gradient GEMM, 1 byte each. MXFP8's scales (1 byte per 32 values per copy)
# are left out. Under TE's FSDP path the cached workspace is sharded like the weight (_fsdp_gather_tensors).
FP8_WEIGHT_CACHE_BYTES = 2.0


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Peak memory of one rank of one pipeline stage, by category (bytes)."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    capacity: float

    @property
    def total(self) -> float:
        """Sum of all categories."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    @property
    def over(self) -> float:
        """Bytes above capacity (0 when it fits)."""
        return max(0.0, self.total - self.capacity)

    def describe(self) -> str:
        """One line: total, capacity and the largest categories."""
        parts = {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
        }
        detail = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        return f"{fmt_bytes(self.total)} of {fmt_bytes(self.capacity)} ({detail})"

    def as_dict(self) -> dict[str, float]:
        """Plain data for JSON output."""
        return {
            "stage": self.stage,
            "weights_bytes": self.weights,
            "gradients_bytes": self.gradients,
            "optimizer_bytes": self.optimizer,
            "activations_bytes": self.activations,
            "buffers_bytes": self.buffers,
            "total_bytes": self.total,
            "capacity_bytes": self.capacity,
            "over_bytes": self.over,  # above capacity: how much a plan that does not fit must shed on this stage
        }


def _chunk_activations(
    graph: ModelGraph, layout: Layout, chunk: Chunk, kept_by_block: dict[str, float]
) -> tuple[float, float]:
    """(bytes kept per micro-batch, transient working set of one layer) for a chunk. ``kept_by_block`` holds what
    one instance of each block keeps without recomputation, filled as blocks are met: every stage of a plan has
    the same graph and layout, so they share it."""
    kept = 0.0
    working = 0.0
    tokens = layout.micro_batch * layout.seq_len / layout.cp.size
    sp_div = layout.tp.size if layout.sequence_parallel else 1
    layer_input = 2.0 * tokens * graph.model.hidden / sp_div  # 16-bit layer input
    tp, cp = layout.tp.size, layout.cp.size
    # Under full recomputation the first `recompute_layers` decoder layers of the chunk recompute (all by default).
    to_recompute = layout.plan.recompute_layers if layout.plan.recompute_layers is not None else chunk.layers
    for name, count in chunk.blocks:
        ops = graph.block(name).forward
        full = kept_by_block.get(name)
        if full is None:
            full = kept_by_block[name] = sum(local_act_bytes(op, layout) for op in ops)
        if name.startswith("layer.") and layout.recompute == "full":
            recomputed = min(count, to_recompute)
            to_recompute -= recomputed
            kept += layer_input * recomputed + full * (count - recomputed)
            if recomputed:
                working = max(working, full)
        elif name.startswith("layer.") and layout.recompute == "selective":
            # The recomputed attention core still needs Q, K and V; what it alone keeps is dropped:
            # the s² softmax and dropout tensors (unfused) or the fp32 log-sum-exp (fused), and its own copy of
            # its output (all-gather or all-to-all context parallelism, FP8 runs).
            dropped = sum(local_act_bytes(op, layout) for op in ops if op.name in ("attn.softmax", "attn.dropout"))
            model = graph.model
            if model.kv_heads != model.heads:
                # The unfused products keep K and V expanded to every query head, but Megatron-Core expands them
                # (repeat_interleave) inside the checkpointed core, so only Q, K and V as they came in are saved:
                # (heads + 2 kv_heads) head widths per token instead of 3 heads (tp divides both head counts).
                expanded = sum(local_act_bytes(op, layout) for op in ops if op.name in ("attn.scores", "attn.context"))
                dropped += expanded * (1.0 - (model.heads + 2 * model.kv_heads) / (3 * model.heads))
            # Per rank the attention core has ceil(heads/tp) heads and ceil(seq_q/cp) queries (shard_op).
            dropped += sum(
                4.0 * op.batch * -(-op.heads // tp) * -(-op.seq_q // cp) + attention_output_copy_bytes(op, layout)
                for op in ops
                if op.kind == "attention"
            )
            kept += (full - dropped) * count
            if count:
                # Backward recomputes one layer's core at a time, and what it re-creates lives until that core's
                # backward is done: a working set like full recomputation's layer, the s² tensors when unfused.
                working = max(working, dropped)
        else:
            kept += full * count
    return kept, working


def _weight_grad_store(graph: ModelGraph, layout: Layout, chunk: Chunk) -> float:
    """Bytes one micro-batch keeps for ``chunk`` between its B and its deferred W (zb_h1): the two operands of every
    weight-gradient GEMM, the layer input and the output gradient of each weight GEMM, which the zero-bubble
    reference queues in its ``WeightGradStore`` (Qi et al. 2023, arXiv:2401.10241, Sec. 2: M_W). Under
    recomputation they are the tensors B re-created; without it, what B leaves of the forward's activations. 16-bit,
    1 byte for an FP8 GEMM's (Transformer Engine's quantized copies)."""
    stored = 0.0
    for step in build_programs(graph, layout, chunk.blocks)[2]:
        op = step.work
        if isinstance(op, Op) and op.kind == "gemm" and op.phase == "bwd_weight":
            stored += (1.0 if fp8_gemm(op, layout) else 2.0) * op.batch * (op.m * op.k + op.k * op.n)
    return stored


@lru_cache(maxsize=256)
def _live_counts(live: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """The in-flight entries as a matrix (one row per entry), built once per schedule: weighing them in Python was
    entries × chunks multiplications per stage and candidate, quadratic in vp (a 1,000-layer model's free-knob search
    spent 2.5 of 4.5 s there, 10,000 layers minutes). Each row sums left to right below eight chunks, as Python's
    sum did; numpy's pairwise summation beyond, deterministically."""
    return np.array(live, dtype=np.float64)


def stage_memory(
    graph: ModelGraph,
    layout: Layout,
    chunks: tuple[Chunk, ...],
    order: tuple[Task, ...],
    capacity: float,
    live: tuple[tuple[int, ...], ...] | None = None,
    kept_by_block: dict[str, float] | None = None,
    by_chunk: dict[tuple[object, ...], tuple[float, float]] | None = None,
) -> StageMemory:
    """Peak memory of one rank of the stage that runs ``chunks`` in task ``order``; ``live`` is
    ``in_flight(order, vp)`` when the caller has it already. Callers sizing every stage of one plan pass one
    ``kept_by_block`` dict to all of them (:func:`_chunk_activations`), and one ``by_chunk`` dict, which keeps each
    distinct chunk's activations (a chunk's depend on its blocks and layer count alone, and an interleaved plan has
    dozens of chunks of one layer)."""
    plan = layout.plan
    dense, expert, fp8_dense, fp8_expert = stage_params(graph, layout, chunks)
    dp, edp = layout.dp.size, layout.edp.size
    zero = plan.zero_stage

    def per_rank(d: float, e: float, from_stage: int) -> float:
        """Parameters held per rank: dense ones sharded over dp and experts' over edp from ZeRO ``from_stage``."""
        return d / dp + e / edp if zero >= from_stage else d + e

    weights = 2.0 * per_rank(dense, expert, 3)
    if not plan.fp8_weights:
        # With fp8_param the FP8 weight (1 byte) and its cached transpose (1 byte) take the 16-bit copy's place.
        weights += FP8_WEIGHT_CACHE_BYTES * per_rank(fp8_dense, fp8_expert, 3)
    gradients = plan.grad_bytes * per_rank(dense, expert, 2)
    if upcasts_gradients(layout):
        # DeepSpeed's BF16_Optimizer keeps every parameter's 16-bit .grad from the backward until the next one
        # starts (PlanSpec docstring, grad_accum_upcast_copy): 2 bytes per separately accumulated local parameter
        # beside the buffer.
        gradients += 2.0 * separately_accumulated(dense, expert, layout)
    optimizer = 12.0 * per_rank(dense, expert, 1)

    if live is None:
        live = in_flight(order, layout.vp)
    kept_by_chunk = [0.0] * layout.vp
    working = 0.0
    kept_by_block = {} if kept_by_block is None else kept_by_block
    by_chunk = {} if by_chunk is None else by_chunk
    for chunk in chunks:
        got = by_chunk.get((chunk.blocks, chunk.layers))
        if got is None:
            got = by_chunk[chunk.blocks, chunk.layers] = _chunk_activations(graph, layout, chunk, kept_by_block)
        kept, work = got
        kept_by_chunk[chunk.chunk] += kept
        working = max(working, work)
    # The largest mix of live micro-batches the order reaches, weighted by what each chunk keeps (with deferred
    # weight-gradient passes, and what a micro-batch past its B keeps for its W: schedule._in_flight_split).
    held = kept_by_chunk
    if live and len(live[0]) == 2 * layout.vp:
        stored = [0.0] * layout.vp
        for chunk in chunks:
            stored[chunk.chunk] += _weight_grad_store(graph, layout, chunk)
        held = kept_by_chunk + stored
    activations = float(np.max((_live_counts(live) * np.asarray(held)).sum(axis=1)))
    activations += working

    buffers = RESERVED_BYTES
    if any(name == "head" for c in chunks for name, _ in c.blocks):
        tokens = layout.micro_batch * layout.seq_len / layout.cp.size
        buffers += 2.0 * tokens * graph.model.vocab / layout.tp.size  # 16-bit logits before the fp32 loss
    if zero >= 2 and (dp > 1 or edp > 1):
        # Only what is sharded is gathered or scattered: dense parameters over dp, the routed experts' over edp (with
        # ep = dp·cp every rank keeps its experts whole).
        largest = 0.0
        for name in {name for chunk in chunks for name, _ in chunk.blocks}:
            block_dense, block_expert, _, _ = block_params(graph, layout, name)
            gathered = tied_copy_params(graph, layout, name) + block_dense if dp > 1 else 0.0
            largest = max(largest, gathered + (block_expert if edp > 1 else 0.0))
        # A block's whole fresh gradient exists until its reduce-scatter has run (PyTorch FSDP and Megatron-FSDP
        # reduce-scatter a whole unsharded gradient; DeepSpeed ZeRO-2 its reduce buckets): one block's, a floor,
        # as the scatter runs while the next block's backward produces more.
        buffers += plan.grad_bytes * largest
        if zero >= 3:
            buffers += 2 * 2.0 * largest  # current and prefetched layer, gathered in 16-bit
    if upcasts_gradients(layout):
        # The separate accumulation's cast copy of one parameter's gradient at a time (PlanSpec docstring): the
        # largest operator's parameters, a bound on its largest tensor (an embedding operator holds two).
        tensor = max(
            max(local_params(op, layout), tied_copy_params(graph, layout, name) if op.name == "head.logits" else 0)
            for c in chunks
            for name, _ in c.blocks
            for op in graph.block(name).forward
        )
        buffers += plan.grad_bytes * tensor
    if plan.grad_bytes < 4:
        # The optimizer step: with 16-bit gradients the fp32 master weights receive an fp32 copy of their
        # gradient shard (Megatron-Core optimizer.py, _copy_model_grads_to_main_grads: main_param.grad =
        # main_grad.float(), on the distributed optimizer's shard; DeepSpeed's FP16_Optimizer flattens
        # p.grad.to(fp32) likewise), held until the step ends, while no activations are. That phase peaks at
        # weights + gradients + optimizer + the reserve + the copy; what it needs beyond the backward's peak is
        # booked under buffers, so the categories still add up to the stage's peak.
        step = RESERVED_BYTES + 4.0 * per_rank(dense, expert, 1)
        buffers += max(0.0, step - (activations + buffers))
    return StageMemory(
        stage=chunks[0].stage,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        buffers=buffers,
        capacity=capacity,
    )
