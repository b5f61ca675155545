"""Issue 2, operator-graph accounting: forward FLOPs per token and activation bytes per layer against the papers.

FLOPs reference (Megatron's F_MEG21, Narayanan et al. SC21, Sec. 5.1 and App.; the same count as PaLM,
Chowdhery et al. 2022, App. B): without recomputation one forward pass costs, per token,

    2·N_gemm + 4·L·s·h_attn

where N_gemm counts every weight matrix a token multiplies with (the decoder layers' QKV, output, MLP or
active-expert matrices, the router, and the output projection; not the embedding lookup, norms or biases),
and 4·L·s·h_attn is the attention scores and context at full s² (2·s·h_attn each per layer; MFU does not
discount the causal mask). For GPT-3 this is 24·L·h²·(1 + s/(6h)) + 2·V·h.

Activation reference (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Sec. 4.1, Eq. 1-5): bytes kept per layer per micro-batch with 16-bit activations, MHA, a 4h GELU
MLP, dropout on and the unfused attention kernel, no parallelism: s·b·h·(34 + 5·a·s/h).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from simulator.cost.memory import stage_memory
from simulator.graph.ops import Op
from simulator.graph.transformer import ModelGraph, build_graph
from simulator.parallel.layout import resolve_layout
from simulator.parallel.schedule import generate
from simulator.parallel.stages import Chunk
from simulator.specs.hardware import ClusterSpec, DeviceSpec
from simulator.specs.library import load_model
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec


def _megatron_forward_flops_per_token(m: ModelSpec, s: int) -> float:
    """F_MEG21 / 3 (no recomputation), generalised to GQA, gated MLPs and top-k experts."""
    h, d = m.hidden, m.head_dim
    attn = h * (m.attn_dim + 2 * m.kv_dim) + m.attn_dim * h
    mats = 3 if m.gated_mlp else 2
    total = 0.0
    for i in range(m.layers):
        if m.moe is not None and m.moe.is_moe_layer(i):
            mlp = m.moe.top_k * mats * h * m.moe.expert_ffn_hidden + h * m.moe.num_experts
            mlp += m.moe.shared_experts * mats * h * m.moe.shared_expert_ffn_hidden
        else:
            mlp = mats * h * m.ffn_hidden
        total += 2 * (attn + mlp) + 4 * s * m.heads * d
    return total + 2 * m.vocab * h


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-405b", "llama3-8b", "mixtral-8x7b"])
def test_forward_flops_per_token_equal_megatron_formula(name: str) -> None:
    """Issue 2 (FLOPs): the graph's forward model FLOPs per token equal F_MEG21's forward term exactly."""
    m = load_model(name)
    g = build_graph(m, m.seq_len, 1)
    assert g.forward_model_flops() / g.tokens == pytest.approx(
        _megatron_forward_flops_per_token(m, m.seq_len), rel=1e-9
    )


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-405b", "mixtral-8x7b"])
def test_forward_flops_per_token_within_half_a_percent_of_2n(name: str) -> None:
    """Issue 2 (FLOPs): forward FLOPs per token are within 0.5% of 2·N + 4·L·s·h_attn (Kaplan et al. 2020,
    Table 1, C_forward = 2N + 2·n_layer·n_ctx·d_attn per matrix pair; here scores and context both counted),
    with N the parameters used per token (active for MoE) less the input embedding and position tables."""
    m = load_model(name)
    g = build_graph(m, m.seq_len, 1)
    n = m.active_param_count() - (m.embedding_params() - (m.vocab * m.hidden if m.tied_embeddings else 0))
    reference = 2 * n + 4 * m.layers * m.seq_len * m.attn_dim
    assert g.forward_model_flops() / g.tokens == pytest.approx(reference, rel=0.005)


def test_gpt3_forward_flops_per_token_value() -> None:
    """Issue 2 (FLOPs): GPT-3 175B at s=2048 costs 358.8 GFLOP per token forward (24·L·h²(1+s/6h) + 2Vh)."""
    g = build_graph(load_model("gpt3-175b"), 2048, 1)
    layers, h, s, vocab = 96, 12288, 2048, 51200
    assert g.forward_model_flops() / g.tokens == pytest.approx(24 * layers * h * h * (1 + s / (6 * h)) + 2 * vocab * h)


def test_backward_model_flops_are_twice_forward() -> None:
    """Issue 2 (FLOPs): MFU's step count is 3x forward (backward = 2x forward, no recomputation)."""
    g = build_graph(load_model("llama3-8b"), 8192, 2)
    assert g.step_model_flops() == pytest.approx(3 * g.forward_model_flops(), rel=1e-12)


@pytest.mark.parametrize(("name", "seq"), [("gpt3-175b", 2048), ("llama3-70b", 8192), ("llama3-8b", 8192)])
def test_causal_model_flops_are_megatron_lms_count(name: str, seq: int) -> None:
    """Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py) halves causal attention:
    12·b·s·L·h²·((1 + g/a + s/(2h)) + (f/h)·(1.5 if gated else 1) + V/(2·L·h)) per step. ``mfu_causal`` is
    computed on this count; a review found the CLI naming NeMo among those that halve it, and the note missing
    wherever recomputation put HFU above MFU."""
    m = load_model(name)
    g = build_graph(m, seq, 1)
    h, layers = m.hidden, m.layers
    gated = 1.5 if m.gated_mlp else 1.0
    megatron = (
        12
        * seq
        * layers
        * h
        * h
        * ((1 + m.kv_heads / m.heads + seq / h / 2) + m.ffn_hidden / h * gated + m.vocab / (2 * layers * h))
    )
    assert g.step_model_flops(causal=True) == pytest.approx(megatron, rel=1e-12)
    assert g.step_model_flops() > g.step_model_flops(causal=True)
    # The count is analytic: the unfused path's score and context GEMMs are halved too (a review found mfu_causal
    # equal to mfu with --attention unfused).
    assert build_graph(m, seq, 1, "unfused").step_model_flops(causal=True) == pytest.approx(megatron, rel=1e-12)


def test_graph_parameters_equal_the_spec() -> None:
    """Issue 2 (graph): the operators own exactly the spec's parameters (nothing lost or double counted)."""
    for name in ("gpt3-175b", "llama3-405b", "mixtral-8x7b", "qwen3-235b-a22b"):
        m = load_model(name)
        assert build_graph(m, 1024, 1).params() == m.param_count(), name


# -- activation memory (Korthikanti et al. 2022) ---------------------------------------------------------

S, B, H, A = 2048, 2, 1024, 16
KORTHIKANTI = ModelSpec(
    name="k", layers=8, hidden=H, heads=A, ffn_hidden=4 * H, vocab=1000, seq_len=S, dropout=True, bias=True
)
DEVICE = DeviceSpec(name="d", peak_flops=(("bf16", 1e15),), hbm_bytes=1e15, hbm_bandwidth_bytes_per_s=1e12)
CLUSTER = ClusterSpec(
    name="c",
    device=DEVICE,
    gpus_per_node=8,
    nvlink_bandwidth_bytes_per_s=3e11,
    nics_per_node=8,
    nic_bandwidth_bytes_per_s=5e10,
)
SBH = S * B * H


def _layer_activations(layers: int, *, tp: int = 1, sp: bool = False, recompute: str = "none", kernel: str = "unfused"):
    """Activation bytes one rank keeps for a chunk of ``layers`` decoder layers and one micro-batch in flight."""
    plan = PlanSpec(
        tp=tp,
        global_batch=B,
        micro_batch=B,
        sequence_parallel=sp,
        recompute=recompute,
        grad_overlap=False,
        attention=kernel,
        vp=1,
    )
    layout = resolve_layout(KORTHIKANTI, CLUSTER, plan)
    graph = build_graph(KORTHIKANTI, S, B, kernel)
    chunk = Chunk(stage=0, chunk=0, blocks=(("layer.dense", layers),), layers=layers)
    return stage_memory(graph, layout, (chunk,), generate("1f1b", 1, 1)[0], DEVICE.hbm_bytes).activations


def test_activations_per_layer_match_korthikanti() -> None:
    """Issue 2 (activations): no parallelism, unfused kernel: s·b·h·(34 + 5·a·s/h) per layer, within 2%."""
    expected = SBH * (34 + 5 * A * S / H)
    assert _layer_activations(4) / 4 == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_and_sequence_parallel_divide_by_t(t: int) -> None:
    """Issue 2 (activations): TP with sequence parallelism keeps s·b·h·(34 + 5·a·s/h)/t (Korthikanti Eq. 5)."""
    expected = SBH * (34 + 5 * A * S / H) / t
    assert _layer_activations(4, tp=t, sp=True) / 4 == pytest.approx(expected, rel=0.02)


def test_tensor_parallel_without_sequence_parallel() -> None:
    """Issue 2 (activations): TP alone keeps s·b·h·(10 + 24/t + 5·a·s/(h·t)) (Korthikanti Eq. 3)."""
    t = 4
    expected = SBH * (10 + 24 / t + 5 * A * S / (H * t))
    assert _layer_activations(4, tp=t, sp=False) / 4 == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize(("t", "sp"), [(1, False), (4, True)])
def test_selective_recompute_drops_the_s_squared_term(t: int, sp: bool) -> None:
    """Issue 2 (activations): selective recomputation keeps 34·s·b·h/t per layer (Korthikanti Eq. 6), plus, while
    backward recomputes one layer's attention core, the 5·a·s²·b/t it re-creates (the difference between 6 and 2
    layers isolates the per-layer part)."""
    sel: dict[str, Any] = {"tp": t, "sp": sp, "recompute": "selective"}
    per_layer = (_layer_activations(6, **sel) - _layer_activations(2, **sel)) / 4
    assert per_layer == pytest.approx(34 * SBH / t, rel=0.02)
    working = _layer_activations(2, **sel) - 2 * per_layer
    assert working == pytest.approx(5 * A * S / H * SBH / t, rel=0.02)


@pytest.mark.parametrize("kernel", ["flash", "flash2"])
def test_fused_attention_kernel_drops_the_s_squared_term(kernel: str) -> None:
    """Issue 2 (activations): with a fused (FlashAttention) kernel the 5·a·s/h term vanishes: 34·s·b·h."""
    assert _layer_activations(4, kernel=kernel) / 4 == pytest.approx(34 * SBH, rel=0.02)


def test_flash2_builds_the_same_work_as_flash_and_names_its_kernel() -> None:
    """The kernel knob changes which measured curve times the attention core, not the work it does."""
    flash = build_graph(KORTHIKANTI, S, B, "flash").block("layer.dense")
    flash2 = build_graph(KORTHIKANTI, S, B, "flash2").block("layer.dense")
    for a, b in zip(flash.forward + flash.backward, flash2.forward + flash2.backward, strict=True):
        assert (a.name, a.flops, a.bytes, a.act_bytes) == (b.name, b.flops, b.bytes, b.act_bytes)
        if a.kind == "attention":
            assert (a.kernel, b.kernel) == ("flash", "flash2")
            assert a.shape_key() != b.shape_key()  # timed (and cached) apart


def test_full_recompute_keeps_only_the_layer_input() -> None:
    """Issue 2 (activations): full recomputation keeps 2·s·b·h per layer (Korthikanti Sec. 5), plus one
    layer's full working set while it is recomputed (the difference between 6 and 2 layers isolates the
    per-layer part)."""
    per_layer = (_layer_activations(6, recompute="full") - _layer_activations(2, recompute="full")) / 4
    assert per_layer == pytest.approx(2 * SBH, rel=0.02)
    working = _layer_activations(2, recompute="full") - 2 * (2 * SBH)
    assert working == pytest.approx(SBH * (34 + 5 * A * S / H), rel=0.02)


def test_full_recompute_input_is_split_by_sequence_parallel() -> None:
    """Issue 2 (activations): with TP+SP the kept layer input is 2·s·b·h/t."""
    t = 8
    per_layer = (
        _layer_activations(6, tp=t, sp=True, recompute="full") - _layer_activations(2, tp=t, sp=True, recompute="full")
    ) / 4
    assert per_layer == pytest.approx(2 * SBH / t, rel=0.02)


def _op(graph: ModelGraph, name: str) -> Op:
    return next(op for b in graph.blocks for op in b.forward + b.backward if op.name == name)


@pytest.mark.parametrize(("s", "loaded"), [(1024, 1025 / 2048), (2048, 2049 / 4096), (4096, 1.0)])
def test_unfused_causal_softmax_loads_only_the_unmasked_scores(s: int, loaded: float) -> None:
    """Megatron's scaled_upper_triang_masked_softmax (s ≤ 2048) reads row i's i+1 scores and writes the whole
    row; its backward reads gradient and probabilities of the same part. Longer rows use torch's softmax."""
    m = ModelSpec(name="t", layers=1, hidden=256, heads=4, ffn_hidden=1024, vocab=1000, seq_len=s)
    g = build_graph(m, s, 2, "unfused")
    s2 = 2.0 * 2 * 4 * s * s  # bytes of the b·a·s² 16-bit scores
    fwd, bwd = _op(g, "attn.softmax"), _op(g, "attn.softmax.bwd")
    assert (fwd.read_bytes, fwd.write_bytes) == pytest.approx((s2 * loaded, s2))
    assert (bwd.read_bytes, bwd.write_bytes) == pytest.approx((2 * s2 * loaded, s2))
    assert fwd.act_bytes == pytest.approx(s2)  # the whole probability matrix is kept for backward


def test_cross_entropy_moves_the_bytes_of_megatrons_kernel_chain() -> None:
    """fp32 cast, max, sub_, exp, sum, div_ forward (22 B read, 16 B written per logit); mul_ and the cast back
    (8 B read, 6 B written) backward; the fp32 softmax (4 B) is kept."""
    m = ModelSpec(name="t", layers=1, hidden=256, heads=4, ffn_hidden=1024, vocab=1000, seq_len=128)
    g = build_graph(m, 128, 2)
    logits = 2 * 128 * 1000
    fwd, bwd = _op(g, "head.cross_entropy"), _op(g, "head.cross_entropy.bwd")
    assert (fwd.read_bytes, fwd.write_bytes, fwd.act_bytes) == (22 * logits, 16 * logits, 4 * logits)
    assert (bwd.read_bytes, bwd.write_bytes) == (8 * logits, 6 * logits)


def test_unfused_attention_keeps_the_expanded_keys_and_values_of_gqa() -> None:
    """Megatron-Core's unfused DotProductAttention repeat_interleaves K and V to every query head before the batched
    products, and autograd keeps those copies: with 4 query heads per KV head the score product keeps Q and the
    expanded K (2·a·d per token), the context product the expanded V (a·d), as with full multi-head attention."""
    gqa = ModelSpec(name="g", layers=1, hidden=1024, heads=16, kv_heads=4, ffn_hidden=4096, vocab=1000, seq_len=512)
    mha = ModelSpec(name="m", layers=1, hidden=1024, heads=16, ffn_hidden=4096, vocab=1000, seq_len=512)
    kept = {}
    for model in (gqa, mha):
        ops = build_graph(model, 512, 2, "unfused").block("layer.dense").forward
        kept[model.name] = {op.name: op.act_bytes for op in ops if op.name in ("attn.scores", "attn.context")}
    assert kept["g"] == kept["m"]
    assert kept["g"]["attn.scores"] == 2.0 * 512 * 2 * 2 * 16 * 64


def test_several_shared_experts_with_biases_count_as_the_one_mlp_the_graph_builds() -> None:
    """Megatron-Core's SharedExpertMLP is one MLP of the shared experts' summed width (one down-projection bias),
    which the graph builds; the spec had counted one MLP per shared expert, (S - 1)·hidden more per MoE layer with
    biases. Found by a review of the importer (262,272 against the graph's 262,144)."""
    base = load_model("mixtral-8x7b")
    assert base.moe is not None
    moe = replace(base.moe, shared_experts=2, shared_expert_ffn_hidden=1024)
    m = replace(base, moe=moe, bias=True, layers=2, hidden=256, heads=4, kv_heads=4, ffn_hidden=512, vocab=1000)
    assert build_graph(m, 128, 1).params() == m.param_count()
