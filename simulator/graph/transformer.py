"""The operator graph of one decoder-only transformer for one micro-batch.

What is built: the forward and backward operators of each *distinct* decoder layer (dense, and MoE when the
model has experts) with a multiplicity, plus the embedding, the output head with its cross-entropy loss, and
the optimizer update. Identical layers are stored once (folded, as TAP does), so the graph's size does not
grow with depth. Nothing here knows about GPUs or parallelism: shapes are those of the whole model on one
device, and ``parallel/`` shards them.

Modelling choices, with sources:

* GEMM FLOPs are 2·m·n·k; the backward of a linear layer is two GEMMs of the same size (activation and
  weight gradients), i.e. 2× its forward (Narayanan et al. SC21, Sec. 5.1).
* Attention: scores and context are 2·b·s²·d_attn FLOPs each (4·b·s²·d_attn together). With the fused
  (FlashAttention) kernel, masked blocks of a causal mask are skipped (half the work) and the backward
  executes 2.5× the forward FLOPs because it recomputes the scores (Dao 2023, FlashAttention-2, Sec. 3).
  The unfused path (Megatron before FlashAttention) is two batched GEMMs plus softmax and dropout kernels.
* Activations kept for backward follow Korthikanti et al. 2022 (Sec. 4.1): 16-bit tensors, 1-byte dropout
  masks; the sum over one layer with the unfused kernel, MHA and a 4h GELU MLP is 34·s·b·h + 5·a·s²·b.
  The fused kernel stores Q, K, V and an fp32 log-sum-exp instead of the s² terms.
* Memory-bound kernels move their inputs and outputs once through HBM (16-bit), which is how fused
  Megatron/Apex kernels (LayerNorm, bias-GeLU, bias-dropout-add, RoPE) behave.
  Megatron's causal softmax kernel of the unfused path reads only the unmasked scores (CAUSAL_SOFTMAX_MAX_SEQ);
  its cross-entropy is a chain of unfused fp32 kernels (CE_FWD_READ and the following constants).
* The optimizer is mixed-precision Adam as Megatron-LM runs it (``MixedPrecisionOptimizer.step`` in
  megatron/core/optimizer/optimizer.py, apex ``multi_tensor_adam``), per parameter: the fused Adam reads the
  fp32 main gradient, master weight, momentum and variance (16 B) and writes the last three (12 B); the global
  norm reads the main gradient (4 B); ``_copy_main_params_to_model_params`` reads the fp32 master weight and
  writes the 16-bit weight (4 + 2 B); ``zero_grad_buffer`` writes the gradient buffer (4 B in fp32): 42 B
  (:func:`optimizer_bytes`). Gradients kept in 16 bits are first copied to fp32 main gradients
  (``_copy_model_grads_to_main_grads``, ``.float()``), and fp16 loss scaling unscales them in place and checks
  for inf/nan (``_unscale_main_grads_and_check_for_nan``, 4 + 4 B): 54 B for fp16 with fp16 gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import networkx as nx

from simulator.graph.ops import Op, shape_text
from simulator.specs.model import ModelSpec
from simulator.specs.plan import ATTENTION

__all__ = ["ATTENTION_KERNELS", "OPTIMIZER_BYTES_PER_PARAM", "Block", "ModelGraph", "build_graph", "optimizer_bytes"]

# Fused kernels (flash, flash2, cudnn) build the same ops; unfused builds GEMMs and softmax.
ATTENTION_KERNELS = ATTENTION
E = 2  # bytes per 16-bit activation element
# Name suffix of the decoder-layer blocks an FP8 run keeps in BF16 (build_graph's bf16_layers).
BF16_SUFFIX = ".bf16"
# Mixed-precision Adam, bytes per parameter (module docstring; Megatron-LM MixedPrecisionOptimizer.step):
ADAM_READ, ADAM_WRITE = 16.0, 12.0  # fused Adam: reads main grad, master, exp_avg, exp_avg_sq; writes the last 3
GRAD_NORM_READ = 4.0  # clip_grad_norm: multi_tensor_l2norm over the fp32 main gradients
COPY_BACK_READ, COPY_BACK_WRITE = 4.0, 2.0  # _copy_main_params_to_model_params: fp32 master -> 16-bit weight
FP16_UNSCALE_READ, FP16_UNSCALE_WRITE = 4.0, 4.0  # fp16 only: unscale the main gradients in place, inf/nan check


def optimizer_bytes(precision: str, grad_bytes: int) -> tuple[float, float, float]:
    """Bytes one optimizer step moves per parameter: (read, written) on the optimizer's shard of the parameters,
    and written per *local* parameter to zero the gradient buffer (which is not sharded below ZeRO-2).

    >>> optimizer_bytes("bf16", 4), optimizer_bytes("fp16", 2)
    ((24.0, 14.0, 4.0), (30.0, 22.0, 2.0))
    """
    read = ADAM_READ + GRAD_NORM_READ + COPY_BACK_READ
    write = ADAM_WRITE + COPY_BACK_WRITE
    if grad_bytes < 4:  # 16-bit gradient buffer: copied to fp32 main gradients first (.float())
        read += grad_bytes
        write += 4.0
    if precision == "fp16":  # dynamic loss scaling
        read += FP16_UNSCALE_READ
        write += FP16_UNSCALE_WRITE
    return read, write, float(grad_bytes)


# The reference: bf16 (or fp8) training with fp32 gradients, Megatron-LM's default.
OPTIMIZER_BYTES_PER_PARAM = sum(optimizer_bytes("bf16", 4))
FA_BWD_FACTOR = 2.5  # FlashAttention-2 backward/forward FLOPs (Dao 2023, Sec. 3.2: 5 vs 2 matmuls)
# Megatron-LM's vocab-parallel cross-entropy, bytes moved per logit (source: _VocabParallelCrossEntropy in
# megatron/mpu/cross_entropy.py, later megatron/core/tensor_parallel/cross_entropy.py, called on
# ``output.float()``). Forward: cast 16→32 bit (read 2, write 4), row max (read 4), ``sub_`` of the max
# (read 4, write 4), ``exp`` in place (4 + 4), row sum (4), ``div_`` by the sum (4 + 4): 22 read, 16 written.
# Backward: ``mul_`` of the kept softmax by the loss gradient (4 + 4) and the cast back to 16 bit (4 + 2).
CE_FWD_READ, CE_FWD_WRITE = 22, 16
CE_BWD_READ, CE_BWD_WRITE = 8, 6
# Longest key length of Megatron's fused causal softmax kernel: FusedScaleMaskSoftmax takes it for
# 16 < s_k ≤ 2048 (megatron/model/fused_softmax.py, custom_kernel_constraint; the CUDA dispatcher asserts ≤ 2048).
CAUSAL_SOFTMAX_MAX_SEQ = 2048


@dataclass(frozen=True, slots=True)
class Block:
    """The forward and backward operators of one block type and how many times it repeats."""

    name: str
    count: int
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]

    @property
    def params(self) -> int:
        """Parameters of one instance."""
        return sum(op.params for op in self.forward)

    @property
    def act_bytes(self) -> float:
        """Bytes one instance keeps for backward, per micro-batch."""
        return sum(op.act_bytes for op in self.forward)

    def model_flops(self, phase: str = "all", causal: bool = False) -> float:
        """Model FLOPs of one instance (``fwd``, ``bwd`` or ``all``); ``causal``: with causal attention at half of s²
        (:attr:`~simulator.graph.ops.Op.model_flops_causal`)."""
        ops = self.forward if phase == "fwd" else self.backward if phase == "bwd" else self.forward + self.backward
        return sum(op.model_flops_causal if causal else op.model_flops for op in ops)


@dataclass(frozen=True, slots=True)
class ModelGraph:
    """All work of one micro-batch of one model, before any parallelism.

    ``layer_kinds[i]`` names the block of decoder layer ``i``; ``blocks`` holds each distinct block once.
    ``graph`` is the networkx DAG over all operators (nodes ``block/op``; the node attribute ``op`` is the
    :class:`~simulator.graph.ops.Op`, ``count`` the block's multiplicity).
    """

    model: ModelSpec
    seq_len: int
    micro_batch: int
    attention: str
    blocks: tuple[Block, ...]
    layer_kinds: tuple[str, ...]
    optimizer: Op
    graph: nx.DiGraph[str] = field(compare=False, hash=False, repr=False)

    def __hash__(self) -> int:
        # What build_graph builds the rest from (its arguments; layer_kinds carries bf16_layers): equal graphs agree
        # on these, so equal graphs hash equal. Hashing every op of every block instead took 18 µs per graph (Llama 3
        # 70B), and the search's caches key on the graph: 3.4 s of a 21 s autoplan.
        return hash((self.model, self.seq_len, self.micro_batch, self.attention, self.layer_kinds))

    def block(self, name: str) -> Block:
        """The block called ``name``."""
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(name)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.seq_len * self.micro_batch

    def optimizer_step(self, precision: str, grad_bytes: int, shard_params: float, local_params: float) -> Op:
        """The optimizer op of one rank: :func:`optimizer_bytes` over the ``shard_params`` it updates, and the
        zeroing of the gradient buffer over ``local_params`` (equal to the shard from ZeRO-2 on)."""
        read, write, zeroing = optimizer_bytes(precision, grad_bytes)
        return self.optimizer.with_(
            read_bytes=read * shard_params, write_bytes=write * shard_params + zeroing * local_params
        )

    def params(self) -> int:
        """Total parameters (each layer counted with its multiplicity)."""
        return sum(b.params * b.count for b in self.blocks)

    def forward_model_flops(self) -> float:
        """Model FLOPs of one forward pass of the micro-batch."""
        return sum(b.model_flops("fwd") * b.count for b in self.blocks)

    def step_model_flops(self, causal: bool = False) -> float:
        """Model FLOPs of forward plus backward of the micro-batch (no recomputation); ``causal``: with causal
        attention at half of s², Megatron-LM's count."""
        return sum(b.model_flops("all", causal) * b.count for b in self.blocks)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per operator (forward then backward, per block), for tables and JSON."""
        out: list[dict[str, Any]] = []
        for b in self.blocks:
            for op in b.forward + b.backward:
                out.append(
                    {
                        "block": b.name,
                        "count": b.count,
                        "op": op.name,
                        "kind": op.kind,
                        "phase": op.phase,
                        "shape": _shape_text(op),
                        "flops": op.flops,
                        "model_flops": op.model_flops,
                        "bytes": op.bytes,
                        "params": op.params,
                        "act_bytes": op.act_bytes,
                    }
                )
        opt = self.optimizer
        out.append(
            {
                "block": "optimizer",
                "count": 1,
                "op": opt.name,
                "kind": opt.kind,
                "phase": opt.phase,
                "shape": _shape_text(opt),
                "flops": 0.0,
                "model_flops": 0.0,
                "bytes": opt.bytes,
                "params": 0,
                "act_bytes": 0.0,
            }
        )
        return out


def _shape_text(op: Op) -> str:
    if op.kind == "gemm":
        prefix = f"{op.batch}x" if op.batch > 1 else ""
        m, k, n = (shape_text(x) for x in (op.m, op.k, op.n))
        return f"{prefix}[{m}x{k}]·[{k}x{n}]"
    if op.kind == "attention":
        return f"b={op.batch} heads={op.heads}/{op.kv_heads} s={op.seq_q}x{op.seq_kv} d={op.head_dim}"
    return f"read {op.read_bytes:.0f} B, write {op.write_bytes:.0f} B"


# -- builders ---------------------------------------------------------------------------------------------


def _linear(
    name: str, tokens: int, k: int, n: int, *, tp: str, bias: bool, act: bool = True, sp: bool = False
) -> tuple[Op, tuple[Op, Op]]:
    """A linear layer ``[tokens×k]·[k×n]``: forward op and its (activation-grad, weight-grad) backward ops.

    ``tp`` is ``column`` (n split), ``row`` (k split) or ``""`` (replicated).
    """
    fwd_tp = {"column": "n", "row": "k", "": ""}[tp]
    dgrad_tp = {"column": "k", "row": "n", "": ""}[tp]
    wgrad_tp = {"column": "n", "row": "m", "": ""}[tp]
    params = k * n + (n if bias else 0)
    fwd = Op(
        name=name,
        kind="gemm",
        m=tokens,
        k=k,
        n=n,
        params=params,
        # A row-parallel layer's bias is whole on every TP rank: it is added once, after the reduction of the
        # partial products (Megatron-Core RowParallelLinear: "bias is not parallelized").
        replicated_params=n if bias and tp == "row" else 0,
        act_bytes=float(E * tokens * k) if act else 0.0,
        tok_axis="m",
        tp_axis=fwd_tp,
        sp_tokens=sp,
    )
    dgrad = Op(
        name=f"{name}.dgrad",
        kind="gemm",
        phase="bwd_input",
        m=tokens,
        k=n,
        n=k,
        tok_axis="m",
        tp_axis=dgrad_tp,
        sp_tokens=sp,
    )
    wgrad = Op(
        name=f"{name}.wgrad",
        kind="gemm",
        phase="bwd_weight",
        m=k,
        k=tokens,
        n=n,
        tok_axis="k",
        tp_axis=wgrad_tp,
        sp_tokens=sp,
    )
    return fwd, (dgrad, wgrad)


def _mem(
    name: str,
    read: float,
    write: float,
    *,
    bwd_read: float,
    bwd_write: float,
    act: float = 0.0,
    params: int = 0,
    tp: bool = False,
    sp: bool = True,
) -> tuple[Op, Op]:
    """A memory-bound op over the tokens, and its backward."""
    common: dict[str, Any] = {"kind": "memory", "tok_axis": "bytes", "tp_axis": "bytes" if tp else "", "sp_tokens": sp}
    fwd = Op(name=name, read_bytes=read, write_bytes=write, act_bytes=act, params=params, **common)
    bwd = Op(name=f"{name}.bwd", phase="bwd", read_bytes=bwd_read, write_bytes=bwd_write, **common)
    return fwd, bwd


def _norm(name: str, model: ModelSpec, tokens: int) -> tuple[Op, Op]:
    th = tokens * model.hidden
    # Forward reads x and writes y; backward reads dy and x, writes dx (Apex fused LayerNorm / RMSNorm).
    return _mem(
        name,
        E * th,
        E * th,
        bwd_read=2 * E * th,
        bwd_write=E * th,
        act=float(E * th),
        params=model.norm_params(),
    )


def _dropout(name: str, model: ModelSpec, tokens: int) -> tuple[Op, Op]:
    """Plain dropout (the embedding's: Megatron's ``embedding_dropout``): read the input, write the output and the
    1-byte mask; its backward reads the gradient and the mask."""
    th = tokens * model.hidden
    mask = float(th)
    return _mem(name, E * th, E * th + mask, bwd_read=E * th + mask, bwd_write=E * th, act=mask)


def _dropout_add(name: str, model: ModelSpec, tokens: int) -> tuple[Op, Op]:
    th = tokens * model.hidden
    mask = float(th) if model.dropout else 0.0  # 1-byte mask (Korthikanti et al. 2022, Sec. 4.1)
    # Fused bias-dropout-add: read branch and residual, write the sum (and the mask).
    return _mem(name, 2 * E * th, E * th + mask, bwd_read=E * th + mask, bwd_write=E * th, act=mask)


def _attention(model: ModelSpec, b: int, s: int, kernel: str) -> tuple[list[Op], list[Op]]:
    """Forward ops and backward ops (in backward order) of the attention core."""
    tokens = b * s
    a, kv, d = model.heads, model.kv_heads, model.head_dim
    fwd: list[Op] = []
    bwd: list[Op] = []
    if kernel != "unfused":
        qkv_bytes = float(E * tokens * (a + 2 * kv) * d)
        lse = float(4 * b * a * s)  # fp32 log-sum-exp per query row and head
        common: dict[str, Any] = {
            "kind": "attention",
            "batch": b,
            "heads": a,
            "kv_heads": kv,
            "seq_q": s,
            "seq_kv": s,
            "head_dim": d,
            "causal": True,
            "causal_skip": True,
            "tok_axis": "seq_q",
            "tp_axis": "heads",
            "bwd_factor": FA_BWD_FACTOR,
            "kernel": kernel,
        }
        fwd.append(Op(name="attn.core", act_bytes=qkv_bytes + lse, **common))
        bwd.append(Op(name="attn.core.bwd", phase="bwd", **common))
        return fwd, bwd
    # Unfused Megatron path: baddbmm scores, fused scale-mask-softmax, dropout, bmm context.
    bh = b * a
    s2 = float(b * a * s * s)
    # Megatron's unfused DotProductAttention expands K and V to every query head (repeat_interleave over the
    # query groups) before the batched products, and those expanded copies are what autograd keeps: a · d per
    # token each, whatever the number of KV heads.
    qk_keep = float(E * tokens * 2 * a * d)
    v_keep = float(E * tokens * a * d)
    scores = Op(
        name="attn.scores",
        kind="gemm",
        batch=bh,
        m=s,
        n=s,
        k=d,
        act_bytes=qk_keep,
        tok_axis="m",
        tp_axis="batch",
    )
    softmax_keep = E * s2
    # Megatron's fused causal softmax (scaled_upper_triang_masked_softmax, taken for s ≤ 2048) loads only the
    # i + 1 unmasked scores of row i and writes the whole row (zeros above the diagonal); its backward loads
    # the gradient and the probabilities of the same causal part and writes the whole row. Longer sequences
    # fall back to torch's softmax over the full rows.
    loaded = (s + 1) / (2 * s) if 16 < s <= CAUSAL_SOFTMAX_MAX_SEQ else 1.0
    softmax, softmax_b = _mem(
        "attn.softmax",
        E * s2 * loaded,
        E * s2,
        bwd_read=2 * E * s2 * loaded,
        bwd_write=E * s2,
        act=softmax_keep,
        tp=True,
        sp=False,
    )
    mask = s2 if model.dropout else 0.0
    drop_keep = (mask + E * s2) if model.dropout else 0.0
    dropout, dropout_b = _mem(
        "attn.dropout",
        E * s2,
        E * s2 + mask,
        bwd_read=E * s2 + mask,
        bwd_write=E * s2,
        act=drop_keep,
        tp=True,
        sp=False,
    )
    context = Op(
        name="attn.context",
        kind="gemm",
        batch=bh,
        m=s,
        n=d,
        k=s,
        act_bytes=v_keep,
        tok_axis="m",
        tp_axis="batch",
    )
    fwd = [scores, softmax] + ([dropout] if model.dropout else []) + [context]
    # Backward of context: d(probs) = dO·Vᵀ and dV = probsᵀ·dO; of scores: dQ = dS·K and dK = dSᵀ·Q.
    ctx_b1 = Op(
        name="attn.context.dgrad", kind="gemm", phase="bwd", batch=bh, m=s, n=s, k=d, tok_axis="m", tp_axis="batch"
    )
    ctx_b2 = Op(
        name="attn.context.vgrad", kind="gemm", phase="bwd", batch=bh, m=s, n=d, k=s, tok_axis="m", tp_axis="batch"
    )
    sc_b1 = Op(
        name="attn.scores.qgrad", kind="gemm", phase="bwd", batch=bh, m=s, n=d, k=s, tok_axis="m", tp_axis="batch"
    )
    sc_b2 = Op(
        name="attn.scores.kgrad", kind="gemm", phase="bwd", batch=bh, m=s, n=d, k=s, tok_axis="m", tp_axis="batch"
    )
    bwd = [ctx_b1, ctx_b2] + ([dropout_b] if model.dropout else []) + [softmax_b, sc_b1, sc_b2]
    # The score and context GEMMs compute the whole s² (the mask is applied in the softmax), but they are causal
    # attention: Megatron-LM's model-FLOPs count halves them as it does a fused kernel's (Op.model_flops_causal).
    fwd = [op.with_(causal=True) if op.kind == "gemm" else op for op in fwd]
    bwd = [op.with_(causal=True) if op.kind == "gemm" else op for op in bwd]
    return fwd, bwd


def _mlp(prefix: str, model: ModelSpec, tokens: int, ffn: int, *, experts: int = 1) -> tuple[list[Op], list[Op]]:
    """A dense MLP (or ``experts`` stacked experts): forward ops and backward ops in backward order."""
    g = 2 if model.gated_mlp else 1
    up, (up_d, up_w) = _linear(f"{prefix}.up", tokens, model.hidden, g * ffn, tp="column", bias=model.bias)
    down, (down_d, down_w) = _linear(f"{prefix}.down", tokens, ffn, model.hidden, tp="row", bias=model.bias)
    tf = tokens * ffn
    act, act_b = _mem(
        f"{prefix}.act",
        E * g * tf,
        E * tf,
        bwd_read=E * tf + E * g * tf,
        bwd_write=E * g * tf,
        act=float(E * g * tf),
        tp=True,
        sp=False,
    )
    fwd = [up, act, down]
    bwd = [down_d, down_w, act_b, up_d, up_w]
    if experts > 1:
        # Stack the experts as a grouped GEMM: batch = experts, m (or k for wgrad) = tokens per expert.
        # Memory ops and saved activations already cover all routed tokens, so only GEMMs change. The average
        # is kept exact (a fraction where the routed tokens do not divide evenly, 2048 x 8 over 384 experts say):
        # rounded down, the experts' model FLOPs lost up to 1.6% there, and counted 4x too many where fewer tokens
        # than experts were rounded up to one each. A rank's share is rounded up where the layout shards it (with
        # fewer tokens than experts, only that many experts run, one token each: parallel.program.shard_op).
        per = tokens / experts
        fwd = [_as_grouped(op, experts, per) for op in fwd]
        bwd = [_as_grouped(op, experts, per) for op in bwd]
    return fwd, bwd


def _as_grouped(op: Op, experts: int, per_expert_tokens: float) -> Op:
    """Re-express a GEMM over all routed tokens as ``experts`` GEMMs of ``per_expert_tokens`` each."""
    if op.kind != "gemm":
        return op
    token_field = "m" if op.tok_axis == "m" else "k"
    return op.with_(
        batch=experts,
        params=op.params * experts,
        replicated_params=op.replicated_params * experts,
        grouped=True,
        **{token_field: per_expert_tokens},
    )


def _layer(model: ModelSpec, b: int, s: int, kernel: str, moe: bool) -> tuple[list[Op], list[Op]]:
    tokens = b * s
    h = model.hidden
    ln1, ln1_b = _norm("ln1", model, tokens)
    qkv, (qkv_d, qkv_w) = _linear(
        "attn.qkv", tokens, h, model.attn_dim + 2 * model.kv_dim, tp="column", bias=model.bias
    )
    fwd: list[Op] = [ln1, qkv]
    bwd_attn: list[Op] = []
    if model.position_embedding == "rope":
        qk = float(E * tokens * (model.attn_dim + model.kv_dim))
        rope, rope_b = _mem("attn.rope", qk, qk, bwd_read=qk, bwd_write=qk, tp=True, sp=False)
        fwd.append(rope)
        bwd_attn.append(rope_b)
    core_f, core_b = _attention(model, b, s, kernel)
    fwd += core_f
    out, (out_d, out_w) = _linear("attn.out", tokens, model.attn_dim, h, tp="row", bias=model.bias)
    add1, add1_b = _dropout_add("attn.dropout_add", model, tokens)
    ln2, ln2_b = _norm("ln2", model, tokens)
    fwd += [out, add1, ln2]
    if moe:
        mlp_f, mlp_b = _moe_block(model, tokens)
    else:
        mlp_f, mlp_b = _mlp("mlp", model, tokens, model.ffn_hidden)
    add2, add2_b = _dropout_add("mlp.dropout_add", model, tokens)
    fwd += [*mlp_f, add2]
    bwd = [add2_b, *mlp_b, ln2_b, add1_b, out_d, out_w, *core_b, *bwd_attn, qkv_d, qkv_w, ln1_b]
    return fwd, bwd


def _moe_block(model: ModelSpec, tokens: int) -> tuple[list[Op], list[Op]]:
    """Router, permutation, experts (grouped GEMMs), un-permutation, and shared experts."""
    moe = model.moe
    assert moe is not None
    h = model.hidden
    router, (router_d, router_w) = _linear("moe.router", tokens, h, moe.num_experts, tp="", bias=False, sp=True)
    routed_tokens = tokens * moe.top_k
    topk, topk_b = _mem(
        "moe.topk",
        4.0 * tokens * moe.num_experts,
        4.0 * tokens * moe.num_experts,
        bwd_read=4.0 * tokens * moe.num_experts,
        bwd_write=4.0 * tokens * moe.num_experts,
    )
    permute, permute_b = _mem(
        "moe.permute",
        float(E * tokens * h),
        float(E * routed_tokens * h),
        bwd_read=float(E * routed_tokens * h),
        bwd_write=float(E * tokens * h),
        sp=False,
    )
    experts_f, experts_b = _mlp("moe.experts", model, routed_tokens, moe.expert_ffn_hidden, experts=moe.num_experts)
    # The un-permutation keeps nothing but its row map for the backward: Megatron-Core applies the routing
    # probabilities inside the experts (the probs travel with the tokens and the activation multiplies them,
    # ``weighted_bias_swiglu_impl``), so ``unpermute`` runs without probs and Transformer Engine's
    # ``_moe_unpermute_mask_map`` saves only ``row_id_map`` (int32, tokens x top_k: negligible beside h).
    unpermute, unpermute_b = _mem(
        "moe.unpermute",
        float(E * routed_tokens * h),
        float(E * tokens * h),
        bwd_read=float(E * tokens * h),
        bwd_write=float(E * routed_tokens * h),
        sp=False,
    )
    fwd = [router, topk, permute, *experts_f, unpermute]
    bwd = [unpermute_b, *experts_b, permute_b, topk_b, router_d, router_w]
    if moe.shared_experts:
        shared_f, shared_b = _mlp("moe.shared", model, tokens, moe.shared_expert_ffn_hidden * moe.shared_experts)
        fwd += shared_f
        bwd = shared_b + bwd
    return fwd, bwd


def _embedding(model: ModelSpec, b: int, s: int) -> tuple[list[Op], list[Op]]:
    tokens = b * s
    th = tokens * model.hidden
    emb = Op(
        name="embedding.lookup",
        kind="memory",
        read_bytes=float(E * th * (2 if model.position_embedding == "learned" else 1)),
        write_bytes=float(E * th),
        params=model.embedding_params(s),
        replicated_params=model.embedding_params(s) - model.vocab * model.hidden,  # learned positions
        tok_axis="bytes",
        tp_axis="vocab",  # vocab-parallel word table: its parameters split, lookup traffic not
        sp_tokens=False,
    )
    # Backward: scatter-add of the output gradient into the fp32 embedding gradient.
    emb_b = Op(
        name="embedding.lookup.bwd",
        kind="memory",
        phase="bwd",
        read_bytes=float(E * th),
        write_bytes=float(4 * th),
        tok_axis="bytes",
        sp_tokens=False,
    )
    drop, drop_b = _dropout("embedding.dropout", model, tokens)
    fwd = [emb] + ([drop] if model.dropout else [])
    bwd = ([drop_b] if model.dropout else []) + [emb_b]
    return fwd, bwd


def _head(model: ModelSpec, b: int, s: int) -> tuple[list[Op], list[Op]]:
    tokens = b * s
    norm, norm_b = _norm("final_norm", model, tokens)
    logits, (logits_d, logits_w) = _linear("head.logits", tokens, model.hidden, model.vocab, tp="column", bias=False)
    if model.tied_embeddings:
        logits = logits.with_(params=0)  # shares the input embedding's weights
    tv = float(tokens * model.vocab)
    # Megatron-LM's vocab-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py) is a chain
    # of PyTorch kernels over the [tokens, vocab/tp] logits, cast to fp32 first (``output.float()``); it keeps
    # the fp32 softmax (4 B) for backward. Bytes per logit, see CE_FWD_* / CE_BWD_* above.
    ce, ce_b = _mem(
        "head.cross_entropy",
        CE_FWD_READ * tv,
        CE_FWD_WRITE * tv,
        bwd_read=CE_BWD_READ * tv,
        bwd_write=CE_BWD_WRITE * tv,
        act=4 * tv,
        tp=True,
        sp=False,
    )
    return [norm, logits, ce], [ce_b, logits_d, logits_w, norm_b]


@lru_cache(maxsize=512)
def build_graph(
    model: ModelSpec, seq_len: int, micro_batch: int, attention: str = "flash", bf16_layers: tuple[int, int] = (0, 0)
) -> ModelGraph:
    """Build the operator graph of ``model`` for micro-batches of ``micro_batch`` sequences of ``seq_len``.

    ``bf16_layers`` = (first, last): that many decoder layers at the start and at the end form their own block
    (``layer.dense.bf16``, ``layer.moe.bf16``) whose ops are marked to stay in 16 bits in FP8 training
    (:attr:`Op.fp8_layer`; the plan's ``layers_at_start_in_bf16`` and ``layers_at_end_in_bf16``).

    Cached: the same arguments return the same object.

    Examples
    --------
    >>> from simulator.specs.model import ModelSpec
    >>> m = ModelSpec(name="tiny", layers=4, hidden=64, heads=4, ffn_hidden=256, vocab=1000)
    >>> g = build_graph(m, 128, 2)
    >>> [b.name for b in g.blocks], g.block("layer.dense").count
    (['embedding', 'layer.dense', 'head'], 4)
    >>> build_graph(m, 128, 2, bf16_layers=(1, 1)).layer_kinds
    ('layer.dense.bf16', 'layer.dense', 'layer.dense', 'layer.dense.bf16')
    """
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
    b, s = micro_batch, seq_len
    first, last = bf16_layers
    kinds = tuple(
        ("layer.moe" if model.moe is not None and model.moe.is_moe_layer(i) else "layer.dense")
        + (BF16_SUFFIX if i < first or i >= model.layers - last else "")
        for i in range(model.layers)
    )
    emb_f, emb_b = _embedding(model, b, s)
    blocks = [Block("embedding", 1, tuple(emb_f), tuple(emb_b))]
    for kind in ("layer.dense", "layer.moe"):
        in_fp8, in_bf16 = kinds.count(kind), kinds.count(kind + BF16_SUFFIX)
        if not in_fp8 and not in_bf16:
            continue
        f, bw = _layer(model, b, s, attention, moe=kind == "layer.moe")
        if in_fp8:
            blocks.append(Block(kind, in_fp8, tuple(f), tuple(bw)))
        if in_bf16:
            pinned = (tuple(op.with_(fp8_layer=False) for op in ops) for ops in (f, bw))
            blocks.append(Block(kind + BF16_SUFFIX, in_bf16, *pinned))
    head_f, head_b = _head(model, b, s)
    blocks.append(Block("head", 1, tuple(head_f), tuple(head_b)))
    params = sum(blk.params * blk.count for blk in blocks)
    read, write, zero = optimizer_bytes("bf16", 4)  # the reference; run.py sizes it for the plan and the rank
    optimizer = Op(
        name="optimizer.adam",
        kind="memory",
        phase="opt",
        read_bytes=read * params,
        write_bytes=(write + zero) * params,
    )
    return ModelGraph(
        model=model,
        seq_len=s,
        micro_batch=b,
        attention=attention,
        blocks=tuple(blocks),
        layer_kinds=kinds,
        optimizer=optimizer,
        graph=_to_networkx(blocks, optimizer),
    )


def _to_networkx(blocks: list[Block], optimizer: Op) -> nx.DiGraph[str]:
    """Chain forward ops block by block, then backward ops in reverse, then the optimizer.

    Each forward op also points at its own backward op(s) (the saved activations they consume).
    """
    g: nx.DiGraph[str] = nx.DiGraph()
    prev: str | None = None
    for blk in blocks:
        for op in blk.forward:
            node = f"{blk.name}/{op.name}"
            g.add_node(node, op=op, count=blk.count, block=blk.name)
            if prev is not None:
                g.add_edge(prev, node)
            prev = node
    for blk in reversed(blocks):
        for op in blk.backward:
            node = f"{blk.name}/{op.name}"
            g.add_node(node, op=op, count=blk.count, block=blk.name)
            if prev is not None:
                g.add_edge(prev, node)
            prev = node
            base = op.name.removesuffix(".bwd").removesuffix(".dgrad").removesuffix(".wgrad")
            fwd_node = f"{blk.name}/{base}"
            if fwd_node in g and fwd_node != node:
                g.add_edge(fwd_node, node)
    g.add_node("optimizer/adam", op=optimizer, count=1, block="optimizer")
    if prev is not None:
        g.add_edge(prev, "optimizer/adam")
    return g
