"""Operators: the unit of work the cost models time.

An :class:`Op` is one kernel-sized piece of work described by its *shape*, not by its cost: GEMMs by
``(batch, m, n, k)``, attention cores by batch, heads, query and key lengths and head size, memory-bound
kernels (norms, activations, residual adds, dropout, RoPE, embedding lookups, the optimizer update) by the
bytes they read and write. FLOPs and bytes are derived from the shape, so sharding an op (parallel/)
only changes its shape: ``tok_axis`` names the shape field that scales with the tokens of the micro-batch
(divided by context parallelism, and by sequence parallelism where ``sp_tokens``), ``tp_axis`` the field
that Megatron tensor parallelism divides (n for column-parallel, k or m for row-parallel, heads for the
attention core, bytes for memory ops over TP-split tensors, nothing for replicated ops). ``act_bytes``
is what the op keeps for the backward pass (Korthikanti et al. 2022, Sec. 4.1 accounting, 16-bit
activations and 1-byte dropout masks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["AXES", "FP8_EXCLUDED", "KINDS", "PHASES", "Op", "shape_text", "whole_tokens"]

KINDS = ("gemm", "attention", "memory")
PHASES = ("fwd", "bwd_input", "bwd_weight", "bwd", "opt")
AXES = ("", "m", "n", "k", "batch", "heads", "seq_q", "bytes", "vocab")
# GEMMs that stay in 16 bits under FP8 training: Transformer Engine runs FP8 only inside its linear layers, not
# in the output layer (Megatron keeps it in BF16), the MoE router or the unfused attention's batched GEMMs.
FP8_EXCLUDED = ("head.", "moe.router", "attn.scores", "attn.context")


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One operator of one micro-batch on one rank.

    Parameters
    ----------
    name : str
        Dotted name, unique inside its block, e.g. ``attn.qkv`` or ``mlp.down.dgrad``.
    kind : str
        ``gemm``, ``attention`` or ``memory``.
    phase : str
        ``fwd``, ``bwd_input`` (activation gradient), ``bwd_weight`` (weight gradient), ``bwd`` (both, for
        ops without weights) or ``opt``.
    m, n, k, batch : int
        GEMM shape: ``batch`` independent (m×k)·(k×n) products. ``m`` is the token dimension. In the model's
        graph the routed experts' token dimension (``m``, or ``k`` of a weight gradient) is the exact average
        tokens per expert, which may be a fraction; a shard a rank runs, or a shape a kernel is timed at, has
        whole tokens (:func:`whole_tokens`).
    heads, kv_heads, seq_q, seq_kv, head_dim, causal
        Attention core shape (``batch`` is the micro-batch size).
    read_bytes, write_bytes : float
        HBM traffic of a memory-bound op.
    params : int
        Parameters this op owns (forward op only; 0 for backward ops).
    replicated_params : int
        The part of ``params`` that tensor parallelism does not split although the op has a TP axis: the
        learned position table beside the vocab-parallel word table, which Megatron-LM keeps whole on every
        TP rank (a plain ``torch.nn.Embedding`` in ``LanguageModelEmbedding``), and a row-parallel layer's bias.
    act_bytes : float
        Bytes saved for the backward pass (forward op only).
    tok_axis, tp_axis : str
        Shape field divided by token sharding (CP, SP) and by tensor parallelism (see :data:`AXES`).
    sp_tokens : bool
        Whether sequence parallelism splits this op's tokens over the TP group (norms, dropout, residuals).
    causal_skip : bool
        Whether the kernel skips fully masked blocks (FlashAttention does, halving causal FLOPs).
    kernel : str
        Attention core only: the fused kernel that runs it (the plan's ``attention`` knob: ``flash``, ``flash2``
        or ``cudnn``), which selects its calibration curve; empty for other ops.
    fp8_layer : bool
        Whether the op's block runs in FP8 when the model trains in FP8: False in the decoder layers the plan
        keeps in BF16 (``layers_at_start_in_bf16``, ``layers_at_end_in_bf16``).
    grouped : bool
        GEMM only: the ``batch`` products are a grouped GEMM of routed experts, one GEMM per expert launched on a
        few streams (Transformer Engine's ``GroupedLinear``), not one batched kernel (unfused attention's
        ``baddbmm``); :class:`simulator.cost.compute.ComputeModel` times them in waves.
    """

    name: str
    kind: str
    phase: str = "fwd"
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    heads: int = 0
    kv_heads: int = 0
    seq_q: int = 0
    seq_kv: int = 0
    head_dim: int = 0
    causal: bool = False
    causal_skip: bool = True
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    params: int = 0
    replicated_params: int = 0
    act_bytes: float = 0.0
    tok_axis: str = ""
    tp_axis: str = ""
    sp_tokens: bool = False
    bwd_factor: float = 1.0  # attention: backward FLOPs relative to forward (hardware count)
    kernel: str = ""
    fp8_layer: bool = True
    grouped: bool = False

    # -- derived quantities ---------------------------------------------------------------------------
    @property
    def flops(self) -> float:
        """Hardware FLOPs executed (what the device actually computes)."""
        if self.kind == "gemm":
            return 2.0 * self.batch * self.m * self.n * self.k
        if self.kind == "attention":
            full = 4.0 * self.batch * self.heads * self.seq_q * self.seq_kv * self.head_dim
            if self.causal and self.causal_skip:
                full *= 0.5
            return full * (self.bwd_factor if self.phase != "fwd" else 1.0)
        return 0.0

    @property
    def model_flops(self) -> float:
        """FLOPs counted by MFU: attention scores and context at full s² (PaLM, Chowdhery et al. 2022,
        App. B; Megatron's F_MEG21), backward = 2 × forward (no recomputation, no causal discount)."""
        if self.kind == "gemm":
            return self.flops
        if self.kind == "attention":
            full = 4.0 * self.batch * self.heads * self.seq_q * self.seq_kv * self.head_dim
            return full * (2.0 if self.phase != "fwd" else 1.0)
        return 0.0

    @property
    def model_flops_causal(self) -> float:
        """:attr:`model_flops` with causal attention at half of s², the count Megatron-LM's
        ``num_floating_point_operations`` (``seq_length / 2  # causal mask``) and Megatron-Bridge's ``flop_utils``
        log their TFLOP/s/GPU with; NeMo 2's ``flops_formulas`` and PaLM count the full s², as :attr:`model_flops`."""
        if self.causal:  # a fused kernel, or the unfused path's score and context GEMMs
            return 0.5 * self.model_flops
        return self.model_flops

    @property
    def bytes(self) -> float:
        """HBM bytes moved: explicit for memory ops; operands and result (16-bit) for GEMMs and attention."""
        if self.kind == "memory":
            return self.read_bytes + self.write_bytes
        if self.kind == "gemm":
            return 2.0 * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)
        # FlashAttention reads Q, K, V and writes O once per pass (plus the fp32 log-sum-exp).
        q = self.batch * self.seq_q * self.heads * self.head_dim
        kv = self.batch * self.seq_kv * self.kv_heads * self.head_dim
        passes = 2.0 if self.phase != "fwd" else 1.0
        return passes * 2.0 * (2 * q + 2 * kv)

    def shape_key(self) -> tuple[Any, ...]:
        """Everything that determines the op's time (its name and accounting fields excluded)."""
        return (
            self.kind,
            self.phase if self.kind == "attention" else "",
            self.m,
            self.n,
            self.k,
            self.batch,
            self.heads,
            self.kv_heads,
            self.seq_q,
            self.seq_kv,
            self.head_dim,
            self.causal and self.causal_skip,
            self.bwd_factor if self.kind == "attention" else 1.0,
            self.kernel,
            self.grouped,
            self.read_bytes,
            self.write_bytes,
        )

    @property
    def fp8_capable(self) -> bool:
        """Whether this op runs as an FP8 GEMM when the model trains in FP8 (:data:`FP8_EXCLUDED`, ``fp8_layer``)."""
        return self.kind == "gemm" and self.fp8_layer and not self.name.startswith(FP8_EXCLUDED)

    def with_(self, **changes: Any) -> Op:
        """A copy with some fields changed."""
        return replace(self, **changes)


def whole_tokens(tokens: float) -> int:
    """The whole tokens a kernel runs for an exact (possibly fractional) token count: rounded up, at least one,
    with floating-point noise below a billionth of a token ignored (256.0000000001 is 256).

    >>> whole_tokens(42.67), whole_tokens(256.0), whole_tokens(0.25)
    (43, 256, 1)
    """
    return max(1, math.ceil(tokens - 1e-9))


def shape_text(x: float) -> str:
    """A shape dimension as text: whole numbers in full (1048576, not 1.04858e+06), fractions to two decimals."""
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"
