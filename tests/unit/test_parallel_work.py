"""Issue 3, "every parallel dimension actually changes the work": each degree or knob adds the collectives the
Megatron-LM layout implies, shards the operators it should, and moves the simulated step the right way.

Programs are inspected through :func:`simulator.parallel.program.build_programs` (what one rank runs for a
chunk of layers); end-to-end effects through :func:`simulator.run.simulate`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from simulator.cost.communication import CommModel
from simulator.cost.compute import ComputeModel
from simulator.errors import InfeasiblePlanError, SpecError
from simulator.graph.ops import Op
from simulator.graph.transformer import build_graph
from simulator.parallel.layout import resolve_layout
from simulator.parallel.program import (
    Comm,
    attention_output_copy_bytes,
    build_programs,
    is_expert_gemm,
    local_act_bytes,
    local_params,
    param_all_gathers,
)
from simulator.run import simulate
from simulator.specs.hardware import ClusterSpec, DeviceSpec
from simulator.specs.library import load_calibration, load_cluster
from simulator.specs.model import ModelSpec, MoESpec
from simulator.specs.plan import PlanSpec

DENSE = ModelSpec(name="dense", layers=4, hidden=1024, heads=16, kv_heads=8, ffn_hidden=4096, vocab=8192, seq_len=1024)
MOE = ModelSpec(
    name="moe",
    layers=4,
    hidden=1024,
    heads=16,
    ffn_hidden=4096,
    vocab=8192,
    seq_len=1024,
    gated_mlp=True,
    activation="swiglu",
    moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=2048),
)
DEVICE = DeviceSpec(
    name="dev",
    peak_flops=(("bf16", 400e12), ("fp16", 400e12)),
    hbm_bytes=80 * 2**30,
    hbm_bandwidth_bytes_per_s=2e12,
)
CLUSTER = ClusterSpec(
    name="c",
    device=DEVICE,
    gpus_per_node=8,
    nvlink_bandwidth_bytes_per_s=100e9,
    nics_per_node=4,
    nic_bandwidth_bytes_per_s=12.5e9,
)


def _plan(**kw: object) -> PlanSpec:
    base: dict[str, object] = {
        "global_batch": 8,
        "micro_batch": 1,
        "recompute": "none",
        "grad_overlap": True,
        "vp": 1,
        "dp": 1,
    }
    base.update(kw)
    return PlanSpec(**base)  # type: ignore[arg-type]


def _comms(model: ModelSpec, plan: PlanSpec) -> list[Comm]:
    layout = resolve_layout(model, CLUSTER, plan.with_(seq_len=plan.seq_len or model.seq_len))
    graph = build_graph(model, layout.seq_len, layout.micro_batch, plan.attention)
    kind = "layer.moe" if model.moe is not None else "layer.dense"
    progs = build_programs(graph, layout, ((kind, 2),))
    return [s.work for prog in progs for s in prog if isinstance(s.work, Comm)]


def _collectives(model: ModelSpec, plan: PlanSpec, kind: str) -> Counter[str]:
    return Counter(c.collective for c in _comms(model, plan) if c.kind == kind)


def test_no_parallelism_no_collectives() -> None:
    """Issue 3: with every degree 1 a rank's programs contain no collective at all."""
    assert _comms(DENSE, _plan()) == []


def test_tensor_parallel_all_reduces_without_sequence_parallel() -> None:
    """Issue 3 (TP): Megatron TP without SP: 2 all-reduces per layer forward and 2 backward."""
    assert _collectives(DENSE, _plan(tp=4, sequence_parallel=False), "tp") == Counter({"all_reduce": 8})


def test_sequence_parallel_turns_all_reduce_into_reduce_scatter_and_all_gather() -> None:
    """Issue 3 (SP): each all-reduce becomes a reduce-scatter plus an all-gather; backward also re-gathers the
    sequence-split input of the QKV and MLP-up weight gradients (Korthikanti et al. 2022, Sec. 4.2.2)."""
    got = _collectives(DENSE, _plan(tp=4, sequence_parallel=True), "tp")
    assert got == Counter({"all_gather": 12, "reduce_scatter": 8})
    assert "all_reduce" not in got


def test_sequence_parallel_moves_the_same_bytes_per_region() -> None:
    """Issue 3 (SP): an all-gather plus a reduce-scatter of s·b·h carry what one all-reduce of s·b·h carries."""
    ar = [c for c in _comms(DENSE, _plan(tp=4, sequence_parallel=False)) if c.kind == "tp"]
    sp = [c for c in _comms(DENSE, _plan(tp=4, sequence_parallel=True)) if c.kind == "tp"]
    assert {c.size_bytes for c in ar} == {c.size_bytes for c in sp} == {2.0 * 1024 * 1024}


def test_context_parallel_adds_ring_exchanges() -> None:
    """Issue 3 (CP): cp=2 runs the attention core as 2 ring steps with 1 KV exchange each, forward and
    backward (backward carries KV and its gradient: twice the bytes)."""
    comms = [c for c in _comms(DENSE, _plan(cp=2)) if c.kind == "cp"]
    assert Counter(c.collective for c in comms) == Counter({"send_recv": 4})
    kv_fwd = 2 * 2 * (1024 // 2) * 8 * 64  # 16-bit K and V of the local tokens, kv_heads·head_dim wide
    assert sorted({c.size_bytes for c in comms}) == [kv_fwd, 2 * kv_fwd]


def test_context_parallel_halves_the_attention_work_per_rank() -> None:
    """Issue 3 (CP): cp=2 halves each rank's attention FLOPs and the tokens of every token-wise op."""
    layout1 = resolve_layout(DENSE, CLUSTER, _plan(seq_len=1024))
    layout2 = resolve_layout(DENSE, CLUSTER, _plan(cp=2, seq_len=1024))
    graph = build_graph(DENSE, 1024, 1)

    def work(layout: object) -> tuple[float, float]:
        fwd = build_programs(graph, layout, (("layer.dense", 1),))[0]  # type: ignore[arg-type]
        ops = [s.work for s in fwd if not isinstance(s.work, Comm)]
        attn = sum(op.flops for op in ops if op.kind == "attention")
        qkv = next(op for op in ops if op.name == "attn.qkv")
        return attn, qkv.m

    (a1, m1), (a2, m2) = work(layout1), work(layout2)
    assert a2 == pytest.approx(a1 / 2)
    assert m2 == m1 // 2


def test_causal_context_parallel_runs_one_masked_block_then_unmasked_half_blocks() -> None:
    """Load-balanced causal CP (Megatron-LM / Transformer Engine): the first ring step is the local block under
    the causal mask, each later one an unmasked half block; together cp masked strips' worth of FLOPs."""
    layout = resolve_layout(DENSE, CLUSTER, _plan(cp=4, seq_len=1024))
    fwd = build_programs(build_graph(DENSE, 1024, 1), layout, (("layer.dense", 1),))[0]
    steps = [s.work for s in fwd if not isinstance(s.work, Comm) and s.work.kind == "attention"]
    local = 1024 // 4
    masked, unmasked = (local, local, True), (local, local // 2, False)
    assert [(op.seq_q, op.seq_kv, op.causal) for op in steps] == [masked] + [unmasked] * 3
    whole = next(op for op in build_graph(DENSE, 1024, 1).block("layer.dense").forward if op.kind == "attention")
    assert sum(op.flops for op in steps) == pytest.approx(whole.flops / 4)


def _attention_region(plan: PlanSpec, phase: int) -> list[object]:
    """The steps of one layer's attention core (its kernels, copies and CP collectives) in program order."""
    layout = resolve_layout(DENSE, CLUSTER, plan)
    prog = build_programs(build_graph(DENSE, 1024, 1), layout, (("layer.dense", 1),))[phase]
    return [s.work for s in prog if s.work.name.startswith("attn.core")]


def test_ring_copy_traffic_follows_transformer_engine_for_two_ranks() -> None:
    """TE's ring attention (AttnFuncWithCP, cuDNN path) at cp=2, counted by hand from its source, per rank.

    Forward, rank 0: cat(k, v) 2kv, the second half of q made contiguous for step 1 (q), zero the output q, merge
    the diagonal step 3q and the half step 1.5q; rank 1
    also copies half the arriving KV (kv) and merges two whole steps (6q). Backward, rank 0: copy KV into the
    send buffer 2kv; step 0 (second half of q against the whole block): halves of q, out, dout 3q, dq copy q, cat
    dK/dV 2kv, copy 2kv; step 1 (diagonal): dq copy half + add half 2.5q, cat 2kv, add half + copy half 2.5kv.
    Rank 1: 2kv; step 0 (all q against half KV): kv copy, dq copy 2q, cat kv, copy kv; step 1: dq add 3q, cat
    2kv, add 3kv."""
    from simulator.parallel.program import ring_copy_traffic

    q, kv = 1.0, 0.25
    fwd0 = 2 * kv + q + q + 3 * q + 1.5 * q
    fwd1 = 2 * kv + q + kv + 6 * q
    bwd0 = 2 * kv + (3 * q + q + 2 * kv + 2 * kv) + (2.5 * q + 2 * kv + 2.5 * kv)
    bwd1 = 2 * kv + (kv + 2 * q + kv + kv) + (3 * q + 2 * kv + 3 * kv)
    fwd, bwd = ring_copy_traffic(2, q, kv)
    assert fwd == pytest.approx((fwd0 + fwd1) / 2)
    assert bwd == pytest.approx((bwd0 + bwd1) / 2)
    # Without a mask every step is whole: more merging, no half copies.
    assert ring_copy_traffic(2, q, kv, causal=False)[0] > fwd


def test_ring_attention_runs_transformer_engines_copies_after_its_steps() -> None:
    """p2p (the default): cp ring steps, then one streaming op with the copies and merges of TE's ring, forward
    and backward, timed as elementwise kernels."""
    region = _attention_region(_plan(cp=2), 0)
    assert [type(w).__name__ for w in region] == ["Comm", "Op", "Op", "Op"]
    merge = region[-1]
    assert merge.name == "attn.core.cp_merge"
    assert merge.kind == "memory"
    assert ComputeModel.memory_class(merge) == "elementwise"
    assert merge.bytes > 0
    assert _attention_region(_plan(cp=2), 1)[-1].name == "attn.core.bwd.cp_merge"


def test_all_gather_context_parallel_gathers_kv_and_reduce_scatters_its_gradient() -> None:
    """cp_comm all_gather (Llama 3, Sec. 3.3.2; TE AttnFuncWithCPAndKVAllGather): forward all-gathers the whole
    sequence's K and V (exposed, no ring); backward gathers again and reduce-scatters dK/dV. The rank's two
    query chunks run against their causal prefixes: the same FLOPs as the ring."""
    plan = _plan(cp=4, seq_len=1024, cp_comm="all_gather")
    fwd, bwd = _attention_region(plan, 0), _attention_region(plan, 1)
    kv_local = 2 * 2 * (1024 // 4) * 8 * 64
    fwd_comms = [w for w in fwd if isinstance(w, Comm)]
    bwd_comms = [w for w in bwd if isinstance(w, Comm)]
    assert [(c.collective, c.size_bytes) for c in fwd_comms] == [("all_gather", 4 * kv_local)]
    assert [c.collective for c in bwd_comms] == ["all_gather", "reduce_scatter"]
    ring = [w for w in _attention_region(_plan(cp=4, seq_len=1024), 0) if isinstance(w, Op) and w.kind == "attention"]
    kernels = [w for w in fwd if isinstance(w, Op) and w.kind == "attention"]
    assert len(kernels) == 2
    assert sum(k.flops for k in kernels) == pytest.approx(sum(k.flops for k in ring), rel=0.01)


def test_a2a_context_parallel_trades_sequence_for_heads() -> None:
    """cp_comm a2a (DeepSpeed-Ulysses; TE AttnFuncWithCPAndQKVOA2A): one all-to-all each for q, k and v in and
    for the output out (flash_attn_a2a_communicate issues one per tensor); one attention kernel over the whole
    sequence on heads/cp; the FLOPs per rank are the same."""
    plan = _plan(cp=2, cp_comm="a2a")
    fwd = _attention_region(plan, 0)
    comms = [w for w in fwd if isinstance(w, Comm)]
    assert [c.collective for c in comms] == ["all_to_all"] * 4
    q = 2 * (1024 // 2) * 16 * 64
    kv = 2 * 2 * (1024 // 2) * 8 * 64
    assert [c.size_bytes for c in comms] == [q, kv / 2, kv / 2, q]
    (core,) = [w for w in fwd if isinstance(w, Op) and w.kind == "attention"]
    assert (core.seq_q, core.seq_kv, core.heads, core.kv_heads) == (1024, 1024, 8, 4)
    whole = next(op for op in build_graph(DENSE, 1024, 1).block("layer.dense").forward if op.kind == "attention")
    assert core.flops == pytest.approx(whole.flops / 2)
    bwd_comms = [w for w in _attention_region(plan, 1) if isinstance(w, Comm)]
    assert [c.size_bytes for c in bwd_comms] == [q, q, kv / 2, kv / 2]


def test_a2a_context_parallel_needs_cp_to_divide_the_heads_of_a_tp_rank() -> None:
    """Ulysses scatters heads over the CP ranks: 8 KV heads over tp 4 leaves 2 per rank, which cp 4 cannot
    split; the plan is infeasible with a reason that names the fix."""
    with pytest.raises(InfeasiblePlanError, match="cp_comm a2a needs 'cp' to divide"):
        resolve_layout(DENSE, CLUSTER, _plan(tp=4, cp=4, cp_comm="a2a", seq_len=1024))
    with pytest.raises(SpecError, match="cp_comm"):
        _plan(cp_comm="ring")


def test_all_gather_and_a2a_context_parallelism_keep_a_second_output_copy() -> None:
    """TE's all-gather CP saves each query chunk's partial output and its all-to-all CP the head-sharded output,
    besides the output the projection GEMM keeps: one more local output per layer (16-bit, tokens/cp, heads/tp)
    than the ring; selective recomputation recomputes the core and drops it again."""
    local_out = 2 * 1 * (1024 // 2) * (16 // 2) * 64
    acts = {c: _sim(DENSE, _plan(tp=2, cp=2, cp_comm=c)).memory[0].activations for c in ("p2p", "all_gather", "a2a")}
    assert acts["all_gather"] - acts["p2p"] == pytest.approx(DENSE.layers * local_out)
    assert acts["a2a"] == pytest.approx(acts["all_gather"])
    sel = {c: _sim(DENSE, _plan(tp=2, cp=2, cp_comm=c, recompute="selective")) for c in ("p2p", "all_gather")}
    # ... and re-creates it for one layer at a time in backward: one local output more, not one per layer.
    assert sel["all_gather"].memory[0].activations == pytest.approx(sel["p2p"].memory[0].activations + local_out)


def test_cp_comm_choice_moves_the_step_the_way_its_collectives_do() -> None:
    """Exposed KV all-gathers cost time a ring hides: on a slow CP link all_gather is slower than p2p."""
    slow = replace(CLUSTER, nvlink_bandwidth_bytes_per_s=5e9)
    p2p = _sim(DENSE, _plan(cp=2), slow)
    ag = _sim(DENSE, _plan(cp=2, cp_comm="all_gather"), slow)
    assert p2p.feasible
    assert ag.feasible
    assert ag.breakdown["cp_exposed_s"] > p2p.breakdown["cp_exposed_s"]


def _accumulations(plan: PlanSpec) -> list[object]:
    layout = resolve_layout(DENSE, CLUSTER, plan)
    bwd = build_programs(build_graph(DENSE, 1024, 1), layout, (("layer.dense", 2),))[1]
    return [s.work for s in bwd if not isinstance(s.work, Comm) and s.work.name.endswith(".grad_accumulate")]


def test_unfused_gradient_accumulation_adds_one_add_per_layer_and_micro_batch() -> None:
    """Without gradient-accumulation fusion (2021 Megatron-LM, DeepSpeed) each layer's backward ends with an
    elementwise add of its fresh 16-bit gradients into the fp32 buffer: 2 + 4 bytes read, 4 written per
    parameter; fused (the default) and under ZeRO-3 (gradients reduce-scattered away) there is none."""
    assert _accumulations(_plan()) == []
    adds = _accumulations(_plan(grad_accum_fusion=False))
    layer = build_graph(DENSE, 1024, 1).block("layer.dense")
    params = sum(op.params for op in layer.forward)
    assert len(adds) == 2
    assert [(op.read_bytes, op.write_bytes) for op in adds] == [(6.0 * params, 4.0 * params)] * 2
    half = _accumulations(_plan(grad_accum_fusion=False, tp=2, precision="fp16"))[0]  # fp16 buffer, tp shards
    assert (half.read_bytes, half.write_bytes) == pytest.approx((4.0 * params / 2, 2.0 * params / 2), rel=1e-3)
    assert _accumulations(_plan(grad_accum_fusion=False, dp=2, zero_stage=3, global_batch=16)) == []
    slow = simulate(DENSE, CLUSTER, _plan(grad_accum_fusion=False)).step_time_s
    assert slow > simulate(DENSE, CLUSTER, _plan()).step_time_s


def test_upcast_copy_accumulation_is_a_cast_then_an_add() -> None:
    """grad_accum_upcast_copy (DeepSpeed's BF16_Optimizer: hp_grad.add_(lp.grad.to(fp32))): each layer's separate
    accumulation is a cast of the 16-bit gradient to an fp32 copy (2 bytes read, 4 written) and then the add of
    two fp32 tensors (8 read, 4 written), 8 bytes per parameter more than the one mixed-dtype add; the copy of the
    largest operator's parameters is a transient buffer. With an fp16 buffer the cast is a no-op; with fusion on the
    knob describes nothing and is refused."""
    plan = _plan(grad_accum_fusion=False, grad_accum_upcast_copy=True)
    layout = resolve_layout(DENSE, CLUSTER, plan)
    bwd = build_programs(build_graph(DENSE, 1024, 1), layout, (("layer.dense", 1),))[1]
    layer = build_graph(DENSE, 1024, 1).block("layer.dense")
    params = sum(op.params for op in layer.forward)
    ops = [s.work for s in bwd if not isinstance(s.work, Comm) and ".grad_" in s.work.name]
    assert [(op.name, op.read_bytes, op.write_bytes) for op in ops] == [
        ("layer.dense.grad_upcast", 2.0 * params, 4.0 * params),
        ("layer.dense.grad_accumulate", 8.0 * params, 4.0 * params),
    ]
    assert {ComputeModel.memory_class(op) for op in ops} == {"elementwise"}  # streaming kernels, timed alike
    half = _accumulations(_plan(grad_accum_fusion=False, grad_accum_upcast_copy=True, precision="fp16"))
    assert [(op.read_bytes, op.write_bytes) for op in half] == [(4.0 * params, 2.0 * params)] * 2
    one_add = simulate(DENSE, CLUSTER, _plan(grad_accum_fusion=False))
    copied = simulate(DENSE, CLUSTER, plan)
    assert copied.step_time_s > one_add.step_time_s
    # The embedding operator's parameters (word and learned position table) are the stage's largest.
    largest = max(op.params for op in build_graph(DENSE, 1024, 1).block("embedding").forward)
    assert largest == (DENSE.vocab + DENSE.seq_len) * DENSE.hidden
    assert copied.memory[0].buffers == pytest.approx(one_add.memory[0].buffers + 4.0 * largest)
    # BF16_Optimizer.backward keeps the 16-bit .grad of every parameter (update_hp_grads(clear_lp_grads=False))
    # until the next backward: 2 bytes per local parameter beside the fp32 buffer. Found by a review of the memory
    # model (BLOOM 176B's stack had been 7.4 GiB short on stage 0).
    local = (
        sum(
            op.params
            for name in ("embedding", "layer.dense", "head")
            for op in build_graph(DENSE, 1024, 1).block(name).forward
        )
        + (DENSE.layers - 1) * params
    )
    assert copied.memory[0].gradients == pytest.approx(one_add.memory[0].gradients + 2.0 * local)
    # Memory counts the copy exactly where the programs run it: ZeRO-3 over one rank still accumulates, over two
    # its gradients are reduce-scattered instead.
    for z3, runs in ((plan.with_(zero_stage=3), True), (plan.with_(zero_stage=3, dp=2, global_batch=16), False)):
        one = _sim(DENSE, z3.with_(grad_accum_upcast_copy=False)).memory[0].buffers
        assert (_sim(DENSE, z3).memory[0].buffers > one) is runs
        assert bool(_accumulations(z3)) is runs
    with pytest.raises(SpecError, match="grad_accum_upcast_copy"):
        _plan(grad_accum_upcast_copy=True)


def test_expert_parallel_adds_all_to_all() -> None:
    """Issue 3 (EP): ep=2 adds a dispatch and a combine all-to-all per MoE layer, forward and backward."""
    assert _collectives(MOE, _plan(dp=2), "ep") == Counter()
    assert _collectives(MOE, _plan(dp=2, ep=2), "ep") == Counter({"all_to_all": 8})


def test_expert_parallel_spreads_experts() -> None:
    """Issue 3 (EP): with ep=2 each rank runs half the experts, each on the tokens of both ranks: the same
    expert FLOPs per rank (the EP group shares the routed tokens) with half the expert weights."""

    def experts(plan: PlanSpec) -> list[object]:
        layout = resolve_layout(MOE, CLUSTER, plan.with_(seq_len=1024))
        fwd = build_programs(build_graph(MOE, 1024, 1), layout, (("layer.moe", 1),))[0]
        return [s.work for s in fwd if getattr(s.work, "name", "") == "moe.experts.up"]

    (one,), (two,) = experts(_plan(dp=2)), experts(_plan(dp=2, ep=2))
    assert (two.batch, two.m) == (one.batch // 2, one.m * 2)  # type: ignore[attr-defined]
    assert two.flops == pytest.approx(one.flops)  # type: ignore[attr-defined]
    assert two.params == one.params // 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(("experts", "seq", "top_k"), [(384, 2048, 8), (128, 4095, 8), (64, 8, 2), (8, 1024, 2)])
def test_routed_experts_count_every_routed_token_once(experts: int, seq: int, top_k: int) -> None:
    """The experts' GEMMs ran on tokens // experts tokens each: 2048 x 8 tokens over 384 experts lost 1.6% of
    their FLOPs, 8 x 2 tokens over 64 experts counted 4x as many (one each). Their model FLOPs are now exactly
    Megatron's 2·3·(b·s·top_k)·h·f_expert per GEMM pass, and a rank's share of them rounds up to whole tokens."""
    moe = replace(MOE, moe=MoESpec(num_experts=experts, top_k=top_k, expert_ffn_hidden=512), seq_len=seq)
    graph = build_graph(moe, seq, 1)
    ops = [op for b in graph.blocks for op in (*b.forward, *b.backward) if b.name == "layer.moe"]
    gemms = [op for op in ops if op.kind == "gemm" and op.name.startswith("moe.experts")]
    assert sum(op.model_flops for op in gemms) == pytest.approx(6 * seq * top_k * 3 * moe.hidden * 512)
    layout = resolve_layout(moe, CLUSTER, _plan(dp=8, ep=8, global_batch=8).with_(seq_len=seq))
    fwd = build_programs(graph, layout, (("layer.moe", 1),))[0]
    (up,) = [s.work for s in fwd if getattr(s.work, "name", "") == "moe.experts.up"]
    assert up.m == math.ceil(seq * top_k / experts * 8)  # type: ignore[attr-defined]
    assert isinstance(up.m, int)  # type: ignore[attr-defined]
    # Without expert parallelism a rank holds every expert: with fewer routed tokens than experts (16 over 64)
    # only as many experts run as there are tokens, one each; it had run all 64, one token each (4x the work).
    one = resolve_layout(moe, CLUSTER, _plan(dp=8, global_batch=8).with_(seq_len=seq))
    (up,) = [s.work for s in build_programs(graph, one, (("layer.moe", 1),))[0] if s.work.name == "moe.experts.up"]
    routed = seq * top_k
    assert up.batch * up.m == (routed if routed < experts else experts * math.ceil(routed / experts))  # type: ignore[attr-defined]


def test_moe_parallel_folding_spreads_whole_experts_over_tp_ranks() -> None:
    """MoE parallel folding (Megatron-Core --expert-tensor-parallel-size 1): with tp 2, dp 2 and ep 4 the expert
    group reaches across the TP ranks, which ep must not do with the experts TP-split (ep ∤ dp·cp), so expert_tp
    1 is the only placement and is reported. Each rank then runs whole experts (a quarter of the expert weights,
    not an eighth) on the tokens its TP rank holds and the routed part needs no TP collective. The all-to-all
    carries the rank's sequence shard in both placements (Megatron-Core's all-to-all dispatcher); the TP-split
    one then gathers the routed tokens over TP before its experts and reduce-scatters them before the combine."""
    moe = replace(MOE, moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=2048))
    split = _plan(tp=2, dp=4, ep=4, global_batch=8)
    folded = _plan(tp=2, dp=2, ep=4, global_batch=8)
    assert resolve_layout(moe, CLUSTER, split.with_(seq_len=1024)).etp == 2
    layout = resolve_layout(moe, CLUSTER, folded.with_(seq_len=1024))
    assert (layout.etp, layout.ep.stride, layout.edp.size) == (1, 1, 1)

    def experts(plan: PlanSpec) -> Op:
        lay = resolve_layout(moe, CLUSTER, plan.with_(seq_len=1024))
        fwd = build_programs(build_graph(moe, 1024, 1), lay, (("layer.moe", 1),))[0]
        (op,) = [s.work for s in fwd if getattr(s.work, "name", "") == "moe.experts.up"]
        assert isinstance(op, Op)
        return op

    whole, halves = experts(folded), experts(split)
    assert whole.params == 2 * halves.params  # 2 of 8 experts whole against 2 of 8 halved by tp
    assert whole.flops == pytest.approx(halves.flops)  # half the tokens, twice the width
    tp_comms = [c.name for c in _comms(moe, folded) if c.kind == "tp"]
    assert tp_comms
    assert not any(".mlp." in name for name in tp_comms)
    (a2a_folded,) = {c.size_bytes for c in _comms(moe, folded) if c.kind == "ep"}
    (a2a_split,) = {c.size_bytes for c in _comms(moe, split) if c.kind == "ep"}
    assert a2a_folded == pytest.approx(a2a_split)
    around_experts = [
        c for c in _comms(moe, split) if c.kind == "tp" and (".dispatch." in c.name or ".combine." in c.name)
    ]
    # Per layer (two here), forward and backward: an all-gather and a reduce-scatter each.
    assert Counter(c.collective for c in around_experts) == {"all_gather": 4, "reduce_scatter": 4}
    assert not any(".mlp." in c.name for c in _comms(moe, split) if c.kind == "tp")  # nothing before the router
    assert {c.size_bytes for c in around_experts} == {a2a_split * 2}  # gathered over tp 2
    result = _sim(moe, folded)
    assert result.feasible
    assert result.chosen["expert_tp"] == 1


def test_moe_parallel_folding_rules() -> None:
    moe = MOE
    with pytest.raises(SpecError, match="must be 1 or tp"):
        _plan(tp=4, dp=2, ep=2, expert_tp=2)
    with pytest.raises(InfeasiblePlanError, match="needs sequence parallelism"):
        resolve_layout(moe, CLUSTER, _plan(tp=2, dp=2, ep=4, sequence_parallel=False).with_(seq_len=1024))
    with pytest.raises(InfeasiblePlanError, match="must divide tp·dp·cp"):
        resolve_layout(moe, CLUSTER, _plan(tp=2, dp=3, ep=4).with_(seq_len=1024))
    # Asked for, folding applies even where the TP-split placement would fit.
    assert resolve_layout(moe, CLUSTER, _plan(tp=2, dp=2, ep=2, expert_tp=1).with_(seq_len=1024)).etp == 1


def test_zero3_gathers_parameters_and_scatters_gradients() -> None:
    """Issue 3 (ZeRO-3): each layer's parameters are all-gathered before its forward and its backward, and its
    gradients reduce-scattered; ZeRO-2 keeps only a shard of the gradients, so it reduce-scatters them layer by
    layer in every micro-batch's backward too (deepspeedai/DeepSpeed#2252); ZeRO 0-1 have no per-layer DP
    traffic (their gradients accumulate whole and are reduced once per step)."""
    for stage in (0, 1):
        assert _collectives(DENSE, _plan(dp=4, zero_stage=stage), "dp") == Counter()
    assert _collectives(DENSE, _plan(dp=4, zero_stage=2), "dp") == Counter({"reduce_scatter": 2})
    got = _collectives(DENSE, _plan(dp=4, zero_stage=3), "dp")
    assert got == Counter({"all_gather": 4, "reduce_scatter": 2})


def _sim(model: ModelSpec, plan: PlanSpec, cluster: ClusterSpec = CLUSTER):  # type: ignore[no-untyped-def]
    return simulate(model, cluster, plan)


def test_context_parallel_communication_is_timed() -> None:
    """Issue 3 (CP): on a slow fabric the ring exchanges show up as exposed CP time."""
    slow = ClusterSpec(
        name="slow",
        device=DEVICE,
        gpus_per_node=8,
        nvlink_bandwidth_bytes_per_s=1e9,
        nics_per_node=1,
        nic_bandwidth_bytes_per_s=1e9,
    )
    r = _sim(DENSE, _plan(cp=2), slow)
    assert r.breakdown["cp_exposed_s"] > 0
    assert _sim(DENSE, _plan(), slow).breakdown["cp_exposed_s"] == 0


def test_expert_parallel_communication_is_timed() -> None:
    """Issue 3 (EP): the dispatch and combine all-to-alls block the compute stream: ep_exposed > 0."""
    r = _sim(MOE, _plan(dp=2, ep=2))
    assert r.breakdown["ep_exposed_s"] > 0
    assert _sim(MOE, _plan(dp=2)).breakdown["ep_exposed_s"] == 0


def test_zero3_adds_exposed_data_parallel_time() -> None:
    """Issue 3 (ZeRO-3): parameter all-gathers over a slow network add data-parallel time."""
    z1 = _sim(DENSE, _plan(dp=16, global_batch=16, zero_stage=1))
    z3 = _sim(DENSE, _plan(dp=16, global_batch=16, zero_stage=3))
    assert z3.step_time_s > z1.step_time_s
    assert z3.memory[0].weights == pytest.approx(z1.memory[0].weights / 16)


def test_overlapped_zero1_gather_exposes_its_first_bucket() -> None:
    """ZeRO-1 with grad_overlap (Megatron-Core's overlap_param_gather): the updated parameters are gathered behind the
    next step's forward, but its first layer waits for the first bucket (Megatron's DDP buckets: 40M parameters at
    this dp, the model split evenly into as many): stage 0's DP stream gathers it at the start of the step."""
    plan = _plan(dp=16, global_batch=16, zero_stage=1)
    r = simulate(DENSE, CLUSTER, plan, record=True)
    row = next(row for row in r.timeline if row[2] == "param_bucket0.0")
    layout = resolve_layout(DENSE, CLUSTER, plan.with_(seq_len=DENSE.seq_len))
    params = build_graph(DENSE, DENSE.seq_len, 1).params()
    buckets = math.ceil(params / 40e6)
    assert buckets == 2
    gather = CommModel(CLUSTER, None, load_calibration("default"), plan.straggler_factor).time(
        Comm("g", "all_gather", layout.dp, 2.0 * params / buckets, "dp")
    )
    assert row[:2] == (0, "dp")
    assert row[3:] == (0.0, pytest.approx(gather))
    # Without ZeRO nothing is gathered; without grad_overlap the whole gather blocks after the optimizer step.
    assert not [row for row in _sim(DENSE, plan.with_(zero_stage=0)).timeline if "param_" in row[2]]
    blocking = simulate(DENSE, CLUSTER, plan.with_(grad_overlap=False), record=True)
    assert [row[2] for row in blocking.timeline if "param_all_gather" in row[2]] == ["param_all_gather"]


def test_overlapped_zero1_gather_cannot_hide_behind_a_shorter_forward() -> None:
    """One micro-batch per step (dp 16, global batch 16): each bucket's gather runs behind the compute of the bucket
    before it, and here it is longer, so the forward waits for it; gathers and gradient reduce-scatters share the
    stage's data-parallel stream, so the step is at least their sum (the engine used to hide every bucket but the
    first, whatever its length)."""
    r = simulate(DENSE, CLUSTER, _plan(dp=16, global_batch=16, zero_stage=1), record=True)
    rows = [row for row in r.timeline if row[0] == 0]
    gathers = [row for row in rows if row[2].startswith("param_bucket")]
    assert [row[2] for row in gathers] == ["param_bucket0.0", "param_bucket0.1"]
    first, second = [row for row in rows if row[2] == "F0.0"]
    assert first[3] == pytest.approx(gathers[0][4])  # the first bucket is waited for before the forward starts
    # The second bucket's gather is longer than the first half of the forward it runs beside, which therefore
    # waits for it: the trace splits the forward around that wait, named as one.
    assert gathers[1][4] - gathers[1][3] > first[4] - first[3]
    (wait,) = [row for row in rows if row[1] == "wait" and row[3] == pytest.approx(first[4])]
    assert wait[2] == "dp gather wait"
    assert wait[4] == pytest.approx(gathers[1][4]) == pytest.approx(second[3])
    assert second[4] - second[3] < first[4] - first[3]  # the first half ran beside a gather, slowed by the overlap
    assert r.step_time_s >= sum(row[4] - row[3] for row in rows if row[1] == "dp")


def test_full_recompute_adds_one_forward_of_hardware_flops() -> None:
    """Issue 3 (recompute): full recomputation executes each layer's forward once more, so hardware FLOPs
    grow by exactly one forward of the decoder layers while model FLOPs (MFU) do not change."""
    none = _sim(DENSE, _plan(recompute="none"))
    full = _sim(DENSE, _plan(recompute="full"))
    graph = build_graph(DENSE, 1024, 1)
    layer_fwd = sum(op.flops for op in graph.block("layer.dense").forward) * DENSE.layers * 8  # 8 micro-batches
    assert full.hardware_flops - none.hardware_flops == pytest.approx(layer_fwd, rel=1e-9)
    assert full.model_flops == none.model_flops
    assert full.hfu / full.mfu > none.hfu / none.mfu
    assert full.step_time_s > none.step_time_s


def test_selective_recompute_adds_only_the_attention_core() -> None:
    """Issue 3 (recompute): selective recomputation re-executes the attention core only."""
    none = _sim(DENSE, _plan(recompute="none"))
    sel = _sim(DENSE, _plan(recompute="selective"))
    graph = build_graph(DENSE, 1024, 1)
    core = sum(op.flops for op in graph.block("layer.dense").forward if op.kind == "attention") * DENSE.layers * 8
    assert sel.hardware_flops - none.hardware_flops == pytest.approx(core, rel=1e-9)


@pytest.mark.parametrize("attention", ["flash", "unfused"])
def test_selective_recompute_reruns_no_op_outside_the_attention_core(attention: str) -> None:
    """The recomputed ops are the core's (fused kernel, or the unfused scores, softmax, softmax dropout and
    context; Korthikanti et al. 2022, Sec. 5); the residual dropout-add after the projection is not one."""
    plan = _plan(recompute="selective", attention=attention, seq_len=1024)
    layout = resolve_layout(DENSE, CLUSTER, plan)
    bwd = build_programs(build_graph(DENSE, 1024, 1, attention), layout, (("layer.dense", 1),))[1]
    fwd_names = {op.name for op in build_graph(DENSE, 1024, 1, attention).block("layer.dense").forward}
    rerun = {s.work.name for s in bwd if isinstance(s.work, Op) and s.work.name in fwd_names}
    unfused_core = {"attn.scores", "attn.softmax", "attn.dropout", "attn.context"} & fwd_names  # dropout if any
    assert rerun == ({"attn.core"} if attention == "flash" else unfused_core)
    assert "attn.dropout_add" in fwd_names


def test_expert_imbalance_slows_the_step_but_adds_no_hardware_flops() -> None:
    """The busiest rank sets the pace, but imbalance (max over mean) moves work between ranks: the cluster's
    executed FLOPs, and so HFU's numerator, stay those of an even load."""
    even = _sim(MOE, _plan(dp=2, ep=2))
    skewed = _sim(MOE, _plan(dp=2, ep=2, expert_imbalance=1.5))
    assert skewed.step_time_s > even.step_time_s
    assert skewed.hardware_flops == pytest.approx(even.hardware_flops, rel=1e-3)


def test_context_parallelism_needs_a_fused_attention_kernel() -> None:
    """Megatron-Core's own DotProductAttention refuses context parallelism (only TE's fused attention does it)."""
    with pytest.raises(InfeasiblePlanError, match="context parallelism needs a fused attention kernel"):
        resolve_layout(DENSE, CLUSTER, _plan(cp=2, attention="unfused", seq_len=1024))


def test_block_recompute_recomputes_the_first_layers_of_each_chunk() -> None:
    """Megatron-LM's block method (``--recompute-num-layers N``): with pp 2 each stage's chunk holds two of the
    four layers; recomputing the first one of each adds half of full recomputation's FLOPs, and the first stage
    keeps that layer's input only, so its activations lie between full recomputation's and none's."""
    plan = _plan(pp=2, global_batch=8)
    none, full = _sim(DENSE, plan.with_(recompute="none")), _sim(DENSE, plan.with_(recompute="full"))
    one = _sim(DENSE, plan.with_(recompute="full", recompute_layers=1))
    assert one.hardware_flops - none.hardware_flops == pytest.approx((full.hardware_flops - none.hardware_flops) / 2)
    assert none.step_time_s < one.step_time_s < full.step_time_s
    # Stage 0 holds two micro-batches at its peak (1F1B), so what they keep outweighs one layer's working set.
    assert full.memory[0].activations < one.memory[0].activations < none.memory[0].activations
    # N at least the chunk's layer count is the same as every layer.
    two = _sim(DENSE, plan.with_(recompute="full", recompute_layers=2))
    assert two.hardware_flops == full.hardware_flops
    assert two.memory[0].activations == full.memory[0].activations


def test_free_recompute_tries_block_recompute_before_every_layer() -> None:
    """When no recompute fits without recomputation, the search takes the fewest recomputed layers per chunk
    that fit (and reports them), not all of them: what a Megatron user short of a few GiB does."""
    plan = _plan(pp=2, global_batch=8, recompute=None)
    layer = _sim(DENSE, plan.with_(recompute="full", recompute_layers=1)).memory[0]
    none = _sim(DENSE, plan.with_(recompute="none")).memory[0]
    # A device between the two: block recomputation of one layer fits, no recomputation does not.
    capacity = (layer.total + none.total) / 2
    tight = replace(CLUSTER, device=replace(DEVICE, hbm_bytes=capacity))
    chosen = simulate(DENSE, tight, plan)
    assert chosen.feasible
    assert chosen.chosen["recompute"] == "full"
    assert chosen.chosen["recompute_layers"] == 1
    assert chosen.plan.recompute_layers == 1


def test_embedding_and_loss_count_as_layers_when_virtual_stages_outnumber_layers() -> None:
    """Megatron-Core's --account-for-embedding/loss-in-pipeline-split: four layers on pp 2 × vp 3 = 6 virtual
    stages leave the first one the embedding alone and the last one the output head alone; the step runs, and
    does the same FLOPs as the plain pipeline. Seven virtual stages is one too many."""
    from simulator.parallel.stages import partition

    graph = build_graph(DENSE, 1024, 1)
    chunks = partition(graph, 2, 3)
    assert chunks[0][0].blocks == (("embedding", 1),)
    assert chunks[1][2].blocks == (("head", 1),)
    assert sum(c.layers for stage in chunks for c in stage) == DENSE.layers
    folded = _sim(DENSE, _plan(pp=2, vp=3, global_batch=8))
    plain = _sim(DENSE, _plan(pp=2, global_batch=8))
    assert folded.feasible
    assert folded.hardware_flops == pytest.approx(plain.hardware_flops)
    with pytest.raises(InfeasiblePlanError, match="'layers' \\+ 2"):
        resolve_layout(DENSE, CLUSTER, _plan(pp=7, dp=1, global_batch=8))


def test_recompute_layers_needs_full_recompute() -> None:
    with pytest.raises(SpecError, match="applies to recompute full only"):
        _plan(recompute="selective", recompute_layers=1)
    with pytest.raises(SpecError, match="must be >= 1"):
        _plan(recompute="full", recompute_layers=0)


def test_fp8_shortens_gemms_on_h100() -> None:
    """Issue 3 (FP8): on H100 (FP8 tensor cores) fp8 makes the step of a Llama-3-8B-wide model shorter and
    leaves MFU's FLOPs alone. (At width 1024 the cast kernels eat the gain, as with Transformer Engine.)"""
    h100 = load_cluster("dgx-h100")
    wide = ModelSpec(
        name="wide",
        layers=2,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        vocab=32000,
        seq_len=4096,
        gated_mlp=True,
        activation="swiglu",
    )
    plan = _plan(tp=2, global_batch=4)
    bf16 = simulate(wide, h100, plan)
    fp8 = simulate(wide, h100, plan.with_(precision="fp8"))
    assert fp8.step_time_s < bf16.step_time_s
    assert fp8.breakdown["compute_s"] < bf16.breakdown["compute_s"]
    assert fp8.model_flops == bf16.model_flops


def test_fp8_cast_kernels_match_transformer_engine_measurement() -> None:
    """Issue 4 (FP8 without an FP8 table): the cast kernels charged before FP8 GEMMs, checked against Transformer
    Engine's own kernel measurement of the same layer, never against a training step.

    TE's GEMM profiling tutorial (NVIDIA/TransformerEngine docs/examples/gemm_profiling/gemm_profiling.rst, "Worked
    Example: 5B Model on H200") times the twelve GEMMs of a hidden-4096, MLP-16384 layer at 31 x 512 tokens on an
    H200 NVL: 16.785 ms per layer as raw FP8 kernels (pre-quantized, current scaling) and 18.978 ms with delayed
    scaling, which always quantizes its inputs inside the timed region. The difference, 2.193 ms, is what quantizing
    every GEMM operand costs when each GEMM casts both of its inputs, weights included. Training does less (TE's
    cast_transpose serves the weight gradient, weights are cast once per step), so the layer's casts must cost less
    than that, and more than reading every FP8 GEMM input once in 16 bits and writing it once in 8 bits at the
    datasheet bandwidth.
    """
    model = ModelSpec(name="te-5b", layers=1, hidden=4096, heads=32, ffn_hidden=16384, vocab=50304, seq_len=512)
    h200 = load_cluster("hgx-h200")
    plan = _plan(micro_batch=31, global_batch=31, precision="fp8", seq_len=512)
    layout = resolve_layout(model, h200, plan)
    graph = build_graph(model, 512, 31, plan.attention)
    compute = ComputeModel(h200.device, h200.calibration, load_calibration("default"), "fp8")
    steps = [s.work for prog in build_programs(graph, layout, (("layer.dense", 1),)) for s in prog]
    casts = [op for op in steps if isinstance(op, Op) and op.name.endswith(".fp8_cast")]
    # Inputs of the FP8 GEMMs: activations of the four forward GEMMs and incoming gradients of the four dgrads.
    tokens, h, f = 31 * 512, 4096, 16384
    elements = tokens * (h + h + h + f) + tokens * (3 * h + h + f + h)
    assert sum(op.read_bytes for op in casts) == pytest.approx(2.0 * elements)
    cast_s = sum(compute.time(op) for op in casts)
    floor_s = 3.0 * elements / h200.device.hbm_bandwidth_bytes_per_s
    assert floor_s < cast_s < (18.978 - 16.785) * 1e-3


def test_fp8_is_infeasible_on_a100() -> None:
    """Issue 3 (FP8): an A100 has no FP8 tensor cores; asking for fp8 is an infeasible plan naming the device."""
    with pytest.raises(InfeasiblePlanError, match="fp8 needs FP8 tensor cores; A100"):
        simulate(DENSE, load_cluster("dgx-a100-80g"), _plan(precision="fp8"))
    # With free knobs the search must give the same reason, not "no candidate" after trying them all.
    free = _plan(precision="fp8", micro_batch=None, recompute=None, vp=None, grad_overlap=None)
    with pytest.raises(InfeasiblePlanError, match="fp8 needs FP8 tensor cores; A100"):
        simulate(DENSE, load_cluster("dgx-a100-80g"), free)


def _saved(model: ModelSpec, plan: PlanSpec, name: str, cluster: ClusterSpec = CLUSTER) -> float:
    """Bytes one rank keeps for the backward of the forward op ``name`` of a decoder layer."""
    layout = resolve_layout(model, cluster, plan.with_(seq_len=plan.seq_len or model.seq_len))
    graph = build_graph(model, layout.seq_len, layout.micro_batch, plan.attention)
    block = "layer.moe" if model.moe is not None else "layer.dense"
    return local_act_bytes(next(op for op in graph.block(block).forward if op.name == name), layout)


def test_expert_inputs_are_kept_whole_on_every_tp_rank() -> None:
    """With expert_tp = tp, Megatron-Core's token dispatcher gathers the routed tokens over TP before the
    experts, so the first expert GEMM keeps all of them on every TP rank (its second, row-parallel GEMM keeps a
    TP-split input); a dense first GEMM under sequence parallelism keeps its sequence-split input. With the
    experts folded (expert_tp 1) each rank routes only its own sequence shard."""
    one, two = _plan(dp=2, ep=2), _plan(tp=2, dp=2, ep=2)
    assert _saved(MOE, two, "moe.experts.up") == _saved(MOE, one, "moe.experts.up") > 0
    assert _saved(MOE, two, "moe.experts.down") == _saved(MOE, one, "moe.experts.down") / 2
    assert _saved(DENSE, _plan(tp=2), "mlp.up") == _saved(DENSE, _plan(), "mlp.up") / 2
    folded = _plan(tp=2, dp=1, ep=2, expert_tp=1)
    assert _saved(MOE, folded, "moe.experts.up") == _saved(MOE, one, "moe.experts.up") / 2


def test_expert_imbalance_scales_the_busiest_ranks_expert_activations() -> None:
    """The busiest rank's experts see ``expert_imbalance`` times the average routed tokens: it keeps that many
    more expert inputs and activations (and runs that much longer), while attention is unaffected."""
    even, skewed = _plan(dp=2, ep=2), _plan(dp=2, ep=2, expert_imbalance=1.5)
    for name in ("moe.experts.up", "moe.experts.act", "moe.experts.down"):
        assert _saved(MOE, skewed, name) == pytest.approx(1.5 * _saved(MOE, even, name))
    assert _saved(MOE, skewed, "attn.core") == _saved(MOE, even, "attn.core")


def test_fp8_attention_keeps_its_own_16_bit_output() -> None:
    """In a 16-bit run the fused attention core's saved output is the projection's saved input (counted once);
    in FP8 the projection keeps an FP8 copy (1 byte) while the core still holds its 16-bit output."""
    h100 = load_cluster("dgx-h100")
    bf16, fp8 = _plan(tp=2), _plan(tp=2, precision="fp8")
    out_bytes = 2.0 * DENSE.seq_len * DENSE.heads * DENSE.head_dim / 2  # one rank: 16-bit, heads over tp
    assert _saved(DENSE, fp8, "attn.out", h100) == _saved(DENSE, bf16, "attn.out", h100) / 2
    assert _saved(DENSE, fp8, "attn.core", h100) == _saved(DENSE, bf16, "attn.core", h100) + out_bytes
    layout = resolve_layout(DENSE, h100, fp8.with_(seq_len=DENSE.seq_len))
    layer = build_graph(DENSE, DENSE.seq_len, 1).block("layer.dense")
    core = next(op for op in layer.forward if op.name == "attn.core")
    assert attention_output_copy_bytes(core, layout) == out_bytes
    assert attention_output_copy_bytes(core, resolve_layout(DENSE, h100, bf16.with_(seq_len=DENSE.seq_len))) == 0


def _fp8_gemm_params(model: ModelSpec, plan: PlanSpec, cluster: ClusterSpec) -> float:
    """Parameters one rank holds of the GEMMs that run in FP8 (all decoder layers: the output layer stays 16-bit)."""
    layout = resolve_layout(model, cluster, plan.with_(seq_len=model.seq_len))
    block = build_graph(model, model.seq_len, 1).block("layer.dense")
    return model.layers * sum(local_params(op, layout) for op in block.forward if op.fp8_capable)


def test_fp8_training_holds_transformer_engines_cached_fp8_weights() -> None:
    """With 16-bit weights, Transformer Engine quantizes each FP8 GEMM's weight once per step into a cached
    workspace, rowwise and columnwise (1 byte each), beside the 16-bit weight. With fp8_param the FP8 weight and
    its transpose replace the 16-bit copy; in 16-bit training the knob changes nothing."""
    h100 = load_cluster("dgx-h100")
    bf16 = _plan(tp=2, dp=2, zero_stage=1, global_batch=16)
    fp8 = bf16.with_(precision="fp8")
    cached = _fp8_gemm_params(DENSE, fp8, h100)
    assert cached > 0
    base = _sim(DENSE, bf16, h100).memory[0].weights
    assert _sim(DENSE, fp8, h100).memory[0].weights == pytest.approx(base + 2.0 * cached)
    assert _sim(DENSE, fp8.with_(fp8_param=True), h100).memory[0].weights == pytest.approx(base)
    assert _sim(DENSE, bf16.with_(fp8_param=True), h100).memory[0].weights == pytest.approx(base)
    # Under ZeRO-3 the cache is sharded like the weights it copies.
    z3 = fp8.with_(zero_stage=3)
    assert _sim(DENSE, z3, h100).memory[0].weights == pytest.approx(
        _sim(DENSE, z3.with_(precision="bf16"), h100).memory[0].weights + 2.0 * cached / 2
    )


def test_fp8_params_are_gathered_in_one_byte() -> None:
    """fp8_param (Megatron-Core --fp8-param-gather): ZeRO-3's per-layer gathers move the FP8 GEMMs' weights in
    1 byte and the rest (norms) in 2."""
    h100 = load_cluster("dgx-h100")
    plan = _plan(dp=4, zero_stage=3, precision="fp8", global_batch=16)
    layout = resolve_layout(DENSE, h100, plan.with_(seq_len=DENSE.seq_len))
    graph = build_graph(DENSE, DENSE.seq_len, 1)

    def gathered(p: PlanSpec) -> float:
        lay = resolve_layout(DENSE, h100, p.with_(seq_len=DENSE.seq_len))
        progs = build_programs(graph, lay, (("layer.dense", 1),))
        comms = {s.work.name: s.work for prog in progs for s in prog if isinstance(s.work, Comm)}
        return sum(c.size_bytes for n, c in comms.items() if n.endswith("param_all_gather"))

    layer = graph.block("layer.dense").forward
    total = sum(op.params for op in layer)
    in_fp8 = sum(op.params for op in layer if op.fp8_capable)
    assert 0 < in_fp8 < total
    assert gathered(plan) == pytest.approx(2.0 * total)
    assert gathered(plan.with_(fp8_param=True)) == pytest.approx(2.0 * total - in_fp8)
    assert layout.dp.size == 4


def test_fp8_param_needs_a_sharded_optimizer() -> None:
    with pytest.raises(SpecError, match="zero_stage=0"):
        _plan(precision="fp8", fp8_param=True)
    assert _plan(precision="bf16", fp8_param=True).fp8_weights is False


def test_first_and_last_layers_in_bf16_run_16_bit_gemms() -> None:
    """layers_at_start_in_bf16 / layers_at_end_in_bf16 (Megatron-Core --first-last-layers-bf16): those decoder
    layers form their own block whose GEMMs run in 16 bits, with no FP8 casts, no cached FP8 weights and 16-bit
    saved inputs. Every layer in BF16 is the 16-bit run; outside FP8 the knobs change nothing."""
    h100 = load_cluster("dgx-h100")
    big = replace(DENSE, hidden=4096, heads=32, ffn_hidden=16384)  # large enough GEMMs for FP8 to pay off
    fp8 = _plan(dp=2, zero_stage=1, global_batch=16, precision="fp8", micro_batch=4)
    pinned = fp8.with_(layers_at_start_in_bf16=1, layers_at_end_in_bf16=1)
    graph = build_graph(big, big.seq_len, 1, bf16_layers=pinned.bf16_layers)
    assert graph.layer_kinds == ("layer.dense.bf16", "layer.dense", "layer.dense", "layer.dense.bf16")
    assert graph.params() == build_graph(big, big.seq_len, 1).params()
    assert not any(op.fp8_capable for op in graph.block("layer.dense.bf16").forward)
    assert any(op.fp8_capable for op in graph.block("layer.dense").forward)
    all_fp8, two, bf16 = (_sim(big, p, h100) for p in (fp8, pinned, fp8.with_(precision="bf16")))
    assert all_fp8.step_time_s < two.step_time_s < bf16.step_time_s
    # Two of four layers hold no FP8 weight cache (2 bytes per FP8 GEMM parameter) and keep 16-bit GEMM inputs.
    cache = 2.0 * _fp8_gemm_params(big, fp8, h100)
    assert two.memory[0].weights == pytest.approx(all_fp8.memory[0].weights - cache / 2)
    assert two.memory[0].activations > all_fp8.memory[0].activations
    every = fp8.with_(layers_at_start_in_bf16=2, layers_at_end_in_bf16=2)
    assert _sim(big, every, h100).step_time_s == pytest.approx(bf16.step_time_s, rel=1e-12)
    assert _sim(big, every, h100).memory == bf16.memory
    assert "gemm:fp8" not in _sim(big, every, h100).uncalibrated_ops
    assert bf16.plan.bf16_layers == (0, 0)
    assert _sim(big, pinned.with_(precision="bf16"), h100).step_time_s == bf16.step_time_s
    with pytest.raises(SpecError, match="layers_at_end_in_bf16"):
        _plan(layers_at_end_in_bf16=-1)


def test_vocabulary_is_padded_as_megatron_builds_it() -> None:
    """Megatron-LM pads the vocabulary to a multiple of make-vocab-size-divisible-by (128) times tp and builds the
    embedding and output layer for it; vocab_divisible_by 1 pads only to a multiple of tp."""
    assert _plan(tp=8).padded_vocab(128256) == 129024  # Llama 3's tokenizer at tp 8
    assert _plan(tp=1).padded_vocab(50257) == 50304  # GPT-2's, as Megatron logs it
    assert _plan(tp=2, vocab_divisible_by=1).padded_vocab(50257) == 50258  # vocab-parallel layers need tp | vocab
    assert _plan(tp=1, vocab_divisible_by=1).padded_vocab(50257) == 50257
    odd = replace(DENSE, vocab=8000)  # padded to 8192 at tp 2
    padded = _sim(odd, _plan(tp=2)).memory[0].weights
    stated = _sim(odd, _plan(tp=2, vocab_divisible_by=1)).memory[0].weights
    rows = 8192 - 8000
    assert padded - stated == pytest.approx(2.0 * rows * odd.hidden / 2 * (1 if odd.tied_embeddings else 2))
    with pytest.raises(SpecError, match="vocab_divisible_by"):
        _plan(vocab_divisible_by=0)


def test_tensor_parallel_divides_weights() -> None:
    """Issue 3 (TP): tp=4 holds a quarter of each layer's weights per rank (embedding vocab-split too); norms
    and a learned position table stay whole on every rank (Megatron-LM's position embedding is a plain
    ``torch.nn.Embedding``)."""
    one = _sim(DENSE, _plan())
    four = _sim(DENSE, _plan(tp=4))
    norms = DENSE.layers * 2 * DENSE.norm_params() + DENSE.norm_params()
    positions = DENSE.seq_len * DENSE.hidden
    assert DENSE.position_embedding == "learned"
    replicated = norms + positions
    expected = 2 * ((DENSE.param_count() - replicated) / 4 + replicated)
    assert four.memory[0].weights == pytest.approx(expected, rel=1e-3)
    assert one.memory[0].weights == 2 * DENSE.param_count()


def test_zero3_gathers_and_scatters_expert_parameters_over_the_expert_data_parallel_group() -> None:
    """Megatron-Core shards the routed experts' parameters over the expert-data-parallel group (tp·dp·cp over
    ep·expert_tp ranks), the dense ones over dp: a MoE layer's ZeRO-3 gathers and scatters use one each."""
    comms = _comms(MOE, _plan(dp=4, ep=2, zero_stage=3))
    groups = {c.name.rsplit(".", 1)[1]: c.group.size for c in comms if c.kind == "dp"}
    assert groups == {
        "param_all_gather": 4,
        "expert_param_all_gather": 2,
        "grad_reduce_scatter": 4,
        "expert_grad_reduce_scatter": 2,
    }
    assert not any("expert_" in c.name for c in _comms(DENSE, _plan(dp=4, zero_stage=3)))


def _program(plan: PlanSpec, blocks: tuple[tuple[str, int], ...], which: int, cluster: ClusterSpec = CLUSTER) -> list:  # type: ignore[type-arg]
    layout = resolve_layout(DENSE, cluster, plan.with_(seq_len=1024))
    return list(build_programs(build_graph(DENSE, 1024, 1), layout, blocks)[which])


def _index(program: list, suffix: str) -> int:  # type: ignore[type-arg]
    return next(i for i, s in enumerate(program) if s.work.name.endswith(suffix))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_input_regather_overlaps_the_activation_gradient_gemm(precision: str) -> None:
    """Megatron/TE issue the sequence-parallel input all-gather before the dgrad GEMM and wait for it before the
    wgrad GEMM; in FP8 the cast of the incoming gradient runs first and must not take the dgrad's place."""
    bwd = _program(_plan(tp=2, precision=precision), (("layer.dense", 1),), 1, load_cluster("dgx-h100"))
    gather = _index(bwd, "mlp.up.dgrad.input.all_gather")
    assert gather not in bwd[_index(bwd, "mlp.up.dgrad")].waits
    assert gather in bwd[_index(bwd, "mlp.up.wgrad")].waits


def test_tp_overlap_pipelines_the_reduce_scatter_with_its_gemm() -> None:
    """With userbuffers the projection's reduce-scatter runs beside the GEMM (issued before it, waited for by the
    next op); without them it blocks after the GEMM."""
    for overlap in (True, False):
        fwd = _program(_plan(tp=2, tp_overlap=overlap), (("layer.dense", 1),), 0)
        rs, gemm, after = _index(fwd, "attn.reduce_scatter"), _index(fwd, "attn.out"), _index(fwd, "attn.dropout_add")
        assert (rs < gemm) is overlap
        assert rs in fwd[after].waits


def test_zero_bubble_keeps_the_sequence_parallel_input_regather() -> None:
    """zb_h1 defers the weight gradients, but the gathered inputs they need are still gathered (in the B pass)."""
    plan = _plan(tp=2, pp=2, schedule="zb_h1")
    b, w = _program(plan, (("layer.dense", 1),), 1), _program(plan, (("layer.dense", 1),), 2)
    gathers = [s.work.name for s in b + w if s.work.name.endswith(".input.all_gather")]
    assert len(gathers) == 2  # the QKV and MLP-up inputs


def test_vocab_parallel_cross_entropy_all_reduces_its_three_row_statistics() -> None:
    """Megatron's _VocabParallelCrossEntropy all-reduces the max, the target logit and the sum of exponentials
    (fp32, one per token) over the TP group."""
    fwd = _program(_plan(tp=2), (("head", 1),), 0)
    reduces = [s.work for s in fwd if isinstance(s.work, Comm) and "cross_entropy" in s.work.name]
    assert [c.collective for c in reduces] == ["all_reduce"] * 3
    assert {c.size_bytes for c in reduces} == {4.0 * 1024}
    assert not [s for s in _program(_plan(), (("head", 1),), 0) if isinstance(s.work, Comm)]


def test_capacity_factor_caps_the_busiest_ranks_load() -> None:
    """A capacity factor drops an expert's tokens beyond that many times its average (Megatron-Core's
    --moe-expert-capacity-factor), so routing skew beyond it changes nothing: imbalance 1.5 under capacity 1.2 is
    imbalance 1.2 without one, and capacity 2 leaves imbalance 1.5 alone."""
    capped = replace(MOE, moe=replace(MOE.moe, capacity_factor=1.2))
    roomy = replace(MOE, moe=replace(MOE.moe, capacity_factor=2.0))
    skewed, at_cap = _plan(dp=2, ep=2, expert_imbalance=1.5), _plan(dp=2, ep=2, expert_imbalance=1.2)
    a, b = _sim(capped, skewed), _sim(MOE, at_cap)
    assert (a.step_time_s, a.peak_memory_bytes) == (b.step_time_s, b.peak_memory_bytes)
    c, d = _sim(roomy, skewed), _sim(MOE, skewed)
    assert (c.step_time_s, c.peak_memory_bytes) == (d.step_time_s, d.peak_memory_bytes)
    assert a.step_time_s < d.step_time_s


def test_a_row_parallel_bias_is_whole_on_every_tp_rank() -> None:
    """Megatron-Core's RowParallelLinear adds its bias after reducing the partial products, so every TP rank holds it
    whole ("bias is not parallelized"); a column-parallel bias is split with its columns. Found by a memory review:
    both were split, 2h(1 - 1/tp) parameters short per layer (4.4 MiB per rank for GPT-3 175B at tp 8)."""
    model = replace(DENSE, bias=True)
    layout = resolve_layout(model, CLUSTER, _plan(tp=4, seq_len=model.seq_len))
    ops = {op.name: op for op in build_graph(model, model.seq_len, 1).block("layer.dense").forward}
    h, f = model.hidden, model.ffn_hidden
    assert local_params(ops["attn.out"], layout) == model.attn_dim * h // 4 + h
    assert local_params(ops["mlp.down"], layout) == f * h // 4 + h
    assert local_params(ops["mlp.up"], layout) == (h * f + f) // 4
    assert build_graph(model, model.seq_len, 1).params() == model.param_count()


def test_zero3_gathers_only_sharded_parameters() -> None:
    """With ep = dp every rank keeps its experts whole (the expert-data-parallel group is one rank), so ZeRO-3
    gathers only a layer's dense parameters, and its two gather buffers (current and prefetched layer, 16-bit) hold
    the largest block's dense parameters; they had counted the whole MoE layer, experts included, 6x more here."""
    z2 = _sim(MOE, _plan(dp=2, ep=2, zero_stage=2))
    z3 = _sim(MOE, _plan(dp=2, ep=2, zero_stage=3))
    layout = resolve_layout(MOE, CLUSTER, _plan(dp=2, ep=2, zero_stage=3).with_(seq_len=MOE.seq_len))
    assert layout.edp.size == 1
    graph = build_graph(MOE, MOE.seq_len, 1)
    dense = max(
        sum(local_params(op, layout) for op in graph.block(name).forward if not is_expert_gemm(op))
        for name in ("embedding", "layer.moe", "head")
    )
    assert z3.memory[0].buffers - z2.memory[0].buffers == pytest.approx(2 * 2.0 * dense)


def test_all_gather_dispatcher_keeps_the_gathered_tokens_of_its_unpermutation() -> None:
    """Without expert parallelism Megatron-Core's all-gather dispatcher gathers the tokens over TP before permuting
    them, so the un-permutation keeps every routed token on each TP rank (its timing already said so); with the
    all-to-all dispatcher (ep > 1) it works on this rank's sequence shard. Found by a memory review: both kept 1/tp."""
    graph = build_graph(MOE, MOE.seq_len, 1)
    (unpermute,) = [op for op in graph.block("layer.moe").forward if op.name == "moe.unpermute"]
    gather = resolve_layout(MOE, CLUSTER, _plan(tp=2, ep=1, seq_len=MOE.seq_len))
    a2a = resolve_layout(MOE, CLUSTER, _plan(tp=2, dp=2, ep=2, expert_tp=2, seq_len=MOE.seq_len))
    assert gather.sequence_parallel
    assert a2a.sequence_parallel
    assert local_act_bytes(unpermute, gather) == unpermute.act_bytes
    assert local_act_bytes(unpermute, a2a) == pytest.approx(unpermute.act_bytes / 2)


def _compute_names(plan: PlanSpec) -> tuple[list[Op], list[Op]]:
    layout = resolve_layout(MOE, CLUSTER, plan.with_(seq_len=1024))
    fwd, bwd, _ = build_programs(build_graph(MOE, 1024, 1), layout, (("layer.moe", 1),))
    ops = [[s.work for s in prog if isinstance(s.work, Op)] for prog in (fwd, bwd)]
    return ops[0], ops[1]


def test_the_all_to_all_dispatcher_sorts_tokens_by_local_expert_and_back() -> None:
    """Megatron-Core's dispatcher runs sort_chunks_by_idxs after the dispatch and before the combine when a rank
    holds more than one expert (a copy of every routed token, and of its gradient in the backward); with one
    expert per rank, or without expert parallelism, there is nothing to sort."""
    fwd, bwd = _compute_names(_plan(dp=2, ep=2))  # 8 experts, 4 per rank
    names = [op.name for op in fwd]
    assert names.index("moe.permute") < names.index("moe.sort_chunks") < names.index("moe.experts.up")
    assert names.index("moe.experts.down") < names.index("moe.sort_chunks_back") < names.index("moe.unpermute")
    sort = fwd[names.index("moe.sort_chunks")]
    routed = 2 * 1024 * 2 * 1024  # 16-bit hidden states of 1,024 tokens x top-2
    assert (sort.read_bytes, sort.write_bytes) == (routed, routed)
    assert {op.name for op in bwd} >= {"moe.sort_chunks.bwd", "moe.sort_chunks_back.bwd"}
    for plan in (_plan(dp=8, ep=8), _plan(dp=2)):  # one expert per rank; no expert parallelism
        fwd, bwd = _compute_names(plan)
        assert not [op.name for op in fwd + bwd if "sort_chunks" in op.name]


def test_fp8_experts_pad_their_tokens_and_strip_the_padding() -> None:
    """Transformer Engine's grouped experts copy the routed tokens into 16-aligned groups before the first FP8
    GEMM and back after the last (Fp8Padding / Fp8Unpadding), and their gradients likewise; not in BF16."""
    fwd, bwd = _compute_names(_plan(dp=2, ep=2, precision="fp8"))
    names = [op.name for op in fwd]
    assert names.index("moe.sort_chunks") < names.index("moe.fp8_pad") < names.index("moe.experts.up")
    assert names.index("moe.experts.down") < names.index("moe.fp8_unpad") < names.index("moe.sort_chunks_back")
    up = fwd[names.index("moe.experts.up")]
    pad = fwd[names.index("moe.fp8_pad")]
    assert pad.read_bytes == 2 * up.batch * up.m * up.k
    assert {op.name for op in bwd} >= {"moe.fp8_pad.bwd", "moe.fp8_unpad.bwd"}
    fwd, bwd = _compute_names(_plan(dp=2, ep=2))
    assert not [op.name for op in fwd + bwd if "fp8_pad" in op.name or "fp8_unpad" in op.name]


def test_the_unpermutation_keeps_no_activation() -> None:
    """Megatron-Core multiplies the routing probabilities inside the experts, so unpermute saves only its row map
    (it had been charged a copy of every routed token: 28% of a Qwen3-30B-A3B layer's activations)."""
    layer = build_graph(MOE, 1024, 1).block("layer.moe")
    assert next(op for op in layer.forward if op.name == "moe.unpermute").act_bytes == 0


def test_zero3_with_one_expert_per_rank_still_treats_experts_as_experts() -> None:
    """Sharded over ep = num_experts a rank holds one expert and its GEMMs have batch 1; the experts were then
    counted as dense parameters and gathered over dp (5x the bytes). With edp 1 they are not gathered at all, and
    with dp 1 but edp 2 (expert_tp 1 under tp 4) they are."""
    full = _comms(MOE, _plan(dp=8, ep=8, zero_stage=3))
    half = _comms(MOE, _plan(dp=8, ep=4, zero_stage=3))

    def gathered(comms: list[Comm], tag: str) -> float:
        return sum(c.size_bytes for c in comms if c.name.endswith(f".{tag}param_all_gather"))

    assert gathered(full, "") == gathered(half, "")  # the dense part only, both ways
    assert gathered(full, "expert_") == 0
    assert gathered(half, "expert_") > 0
    folded = _comms(MOE, _plan(tp=4, ep=2, expert_tp=1, zero_stage=3))
    assert gathered(folded, "expert_") > 0
    assert gathered(folded, "") == 0  # dp 1: nothing dense to gather


def test_fp8_padding_also_with_one_expert_per_rank() -> None:
    """Transformer Engine's grouped experts pad in FP8 however many experts a rank holds."""
    fwd, _ = _compute_names(_plan(dp=8, ep=8, precision="fp8"))
    assert {"moe.fp8_pad", "moe.fp8_unpad"} <= {op.name for op in fwd}
    assert not [op.name for op in fwd if "sort_chunks" in op.name]  # one expert: nothing to sort


def test_optimizer_step_holds_an_fp32_copy_of_16_bit_gradients() -> None:
    """With 16-bit gradients the optimizer step gives the fp32 master weights an fp32 copy of their gradient shard
    (Megatron-Core ``_copy_model_grads_to_main_grads``: ``main_grad.float()``) while no activations are held, so a
    stage with few activations peaks there. Found by a memory review: that copy was not counted (a 7B at tp 8 in
    fp16 read 2.9 GiB low)."""
    big = replace(DENSE, layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=16384)
    params = build_graph(big, 256, 1).params()
    for zero, shard in ((0, 1), (1, 2), (2, 2), (3, 2)):
        plan = _plan(recompute="full", seq_len=256, precision="fp16", dp=2, zero_stage=zero)
        m = _sim(big, plan).memory[0]
        held = m.weights + m.gradients + m.optimizer
        assert m.total == pytest.approx(held + 2 * 2**30 + 4.0 * params / shard, rel=1e-6)
        assert m.total == pytest.approx(m.weights + m.gradients + m.optimizer + m.activations + m.buffers)
        # fp32 gradients are the master's gradients already: no copy, the backward's peak stands.
        fp32 = _sim(big, plan.with_(grad_dtype="fp32")).memory[0]
        if zero < 2:  # (ZeRO-2 and ZeRO-3 add a block's unsharded gradient, ZeRO-3 its gather buffers)
            assert fp32.buffers == pytest.approx(2 * 2**30 + 2.0 * 256 * big.vocab)  # the reserve and 16-bit logits


def test_selective_recompute_keeps_unexpanded_kv_with_unfused_attention() -> None:
    """Megatron-Core expands K and V to every query head inside the checkpointed attention core, so under selective
    recomputation unfused attention keeps Q, K and V as they came in, as fused attention does; it had kept the
    expanded copies (2.2 GiB too much for Llama 3 70B at tp 8, pp 4)."""
    fused = _sim(DENSE, _plan(recompute="selective", attention="flash2")).memory[0].activations
    unfused = _sim(DENSE, _plan(recompute="selective", attention="unfused")).memory[0].activations
    # The two keep the same per layer; they differ by what backward re-creates for one layer at a time: the unfused
    # core's 16-bit softmax (a·s²) and K and V expanded to every query head, the fused one's fp32 log-sum-exp.
    s, a, kv, d = DENSE.seq_len, DENSE.heads, DENSE.kv_heads, DENSE.head_dim
    assert unfused - fused == pytest.approx(2.0 * a * s * s + 2 * 2.0 * s * (a - kv) * d - 4.0 * a * s)
    # Without recomputation the unfused products do keep the expanded copies (and the s² tensors).
    assert _sim(DENSE, _plan(attention="unfused")).memory[0].activations > unfused


def test_only_the_first_stages_first_chunk_is_bucketed() -> None:
    """Megatron-Core's DDP buckets gradients (and the overlapped parameter gathers) only where they are on the
    critical path: with overlapped reduction, on pipeline stage 0, for model chunk 0; every other stage and chunk
    keeps one bucket per buffer (``bucket_size = None`` for ``pp_rank > 0`` or ``disable_bucketing``, set for
    ``model_chunk_idx > 0``). Found by a schedule review: every stage and chunk was bucketed."""
    wide = replace(DENSE, layers=16)
    plan = _plan(dp=16, global_batch=64, zero_stage=1, pp=2, vp=2)
    r = simulate(wide, CLUSTER, plan, record=True)
    gathers = sorted((row[0], row[2]) for row in r.timeline if row[2].startswith("param_bucket"))
    by_place: Counter[tuple[int, str]] = Counter((stage, name.split(".")[0]) for stage, name in gathers)
    assert by_place[(0, "param_bucket0")] >= 2  # stage 0, chunk 0: 40M-parameter buckets
    assert by_place[(0, "param_bucket1")] == by_place[(1, "param_bucket0")] == by_place[(1, "param_bucket1")] == 1
    # With align_grad_reduce off the buckets are the same (Megatron-Core's DDP decides them, not the schedule).
    unaligned = simulate(wide, CLUSTER, plan.with_(align_grad_reduce=False), record=True)
    assert sorted((row[0], row[2]) for row in unaligned.timeline if row[2].startswith("param_bucket")) == gathers
    # Without overlap nothing is bucketed: one reduction per model chunk's buffer after the last backward.
    serial = simulate(wide, CLUSTER, plan.with_(grad_overlap=False), record=True)
    assert sum(row[0] == 0 and row[1] == "dp" and row[2].startswith("grad") for row in serial.timeline) == 2


@pytest.mark.parametrize("zero", [2, 3])
def test_without_gradient_overlap_zero_2_and_3_wait_for_each_layers_reduce_scatter(zero: int) -> None:
    """Found by an engine review: ZeRO-2/3's per-layer gradient reduce-scatters were always detached on the
    data-parallel stream, so grad_overlap off changed nothing under ZeRO-3 (and only the parameter gather under
    ZeRO-2), and the free-knob search compared two identical candidates. Without overlap (DeepSpeed ZeRO-2's default
    overlap_comm false) the backward waits for each reduction."""
    from simulator.specs import load_cluster, load_model

    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100")
    plan = PlanSpec(tp=1, pp=1, dp=32, global_batch=64, micro_batch=1, seq_len=4096, recompute="full", zero_stage=zero)
    overlapped = simulate(model, cluster, plan.with_(grad_overlap=True))
    serial = simulate(model, cluster, plan.with_(grad_overlap=False))
    assert serial.breakdown["dp_exposed_s"] > 5 * overlapped.breakdown["dp_exposed_s"]
    assert serial.step_time_s > overlapped.step_time_s * 1.05
    free = simulate(model, cluster, plan)  # the search now tells the two apart, and reuses nothing across them
    assert free.chosen["grad_overlap"] is True
    assert free.step_time_s == overlapped.step_time_s


def test_gradient_buckets_grow_with_dp_not_with_context_parallelism() -> None:
    """Megatron-Core sizes a bucket max(40M, 1M · dp) parameters with get_data_parallel_world_size()'s default, i.e.
    without cp (distributed_data_parallel.py); dp·cp had been used, so (dp 32, cp 2) and (dp 16, cp 4) had the
    64M buckets of dp 64. Found by an engine review."""
    from simulator.run import _prepare
    from simulator.specs import load_model

    model = load_model("llama3-8b")
    counts = []
    for dp, cp in ((64, 1), (32, 2), (16, 4)):
        plan = PlanSpec(
            tp=1, pp=2, dp=dp, cp=cp, global_batch=2 * dp, micro_batch=1, seq_len=8192, recompute="full", vp=1
        ).with_(grad_overlap=True)
        prepared = _prepare(model, CLUSTER, plan, False, {})
        counts.append(len(prepared.pipe.stages[0].dp_buckets[0]))  # type: ignore[union-attr]
    assert counts[1] == counts[2] > counts[0] * 1.5  # 40M-parameter buckets against 64M ones


def test_without_interleaving_each_stage_gathers_its_first_bucket_when_its_first_forward_starts() -> None:
    """Megatron-Core 0.9 and later dispatch a stage's first overlapped parameter all-gather from its first forward's
    pre-hook (``finish_param_sync``; ``align_param_gather`` is forced off without interleaving), so on every stage the
    gather starts when the first input has arrived and the forward waits for it; Megatron-Core 0.8 dispatched every
    stage's first bucket with the step (``param_gather_at_step_start``), which the pipeline fill hides on later
    stages. Found by a schedule review: the engine dispatched them all with the step."""
    plan = _plan(dp=16, global_batch=64, zero_stage=1, pp=4, vp=1, grad_overlap=True)
    model = replace(DENSE, layers=16)
    lazy = simulate(model, CLUSTER, plan, record=True)
    early = simulate(model, CLUSTER, plan.with_(param_gather_at_step_start=True), record=True)
    assert lazy.feasible
    assert early.feasible
    assert lazy.step_time_s > early.step_time_s

    def first_gather(r, stage: int) -> float:  # type: ignore[no-untyped-def]
        return min(row[3] for row in r.timeline if row[0] == stage and row[2].startswith("param_bucket0."))

    def first_forward(r, stage: int) -> float:  # type: ignore[no-untyped-def]
        return min(row[3] for row in r.timeline if row[0] == stage and row[1] == "compute" and row[2].startswith("F0."))

    for s in range(1, 4):
        assert first_gather(early, s) == 0.0
        assert first_gather(lazy, s) > 0.0
        assert first_forward(lazy, s) >= first_gather(lazy, s)
    # With interleaving the schedule dispatches the gathers itself (align_param_gather): the knob changes nothing.
    inter = plan.with_(vp=2)
    assert (
        simulate(model, CLUSTER, inter).step_time_s
        == simulate(model, CLUSTER, inter.with_(param_gather_at_step_start=True)).step_time_s
    )


def test_grouped_expert_gemms_run_in_waves_of_transformer_engines_streams() -> None:
    """Transformer Engine's grouped expert GEMM is one cuBLAS GEMM per local expert on 4 streams
    (``multi_stream_cublas_gemm``), not one GEMM of all the experts' FLOPs: 16 small experts take four waves, each as
    long as one GEMM of 4 experts' FLOPs. Found by an MoE review: they were timed as one GEMM of 16 experts' FLOPs,
    up to 4x too fast for fine-grained experts (Qwen3-30B-A3B: 128 experts of 768)."""
    from simulator.cost.compute import GROUPED_GEMM_STREAMS

    h100 = load_cluster("dgx-h100")
    compute = ComputeModel(h100.device, h100.calibration, load_calibration("default"), "bf16")
    shape = {"name": "moe.experts.up", "kind": "gemm", "m": 2048, "n": 1536, "k": 2048}
    grouped = compute.time(Op(**shape, batch=16, grouped=True))  # type: ignore[arg-type]
    wave = compute.time(Op(**shape, batch=GROUPED_GEMM_STREAMS))  # type: ignore[arg-type]
    one_big = compute.time(Op(**shape, batch=16))  # type: ignore[arg-type]
    one_by_one = 16 * compute.time(Op(**shape))  # type: ignore[arg-type]
    assert GROUPED_GEMM_STREAMS == 4
    assert grouped == pytest.approx(4 * wave)
    assert one_big < grouped < one_by_one
    # An uneven last wave: 6 experts are one wave of 4 and one of 2.
    six = compute.time(Op(**shape, batch=6, grouped=True))  # type: ignore[arg-type]
    assert six == pytest.approx(wave + compute.time(Op(**shape, batch=2)))  # type: ignore[arg-type]
    # Up to 4 experts run at once: one wave, timed like the batched GEMM it stands for.
    assert compute.time(Op(**shape, batch=3, grouped=True)) == compute.time(Op(**shape, batch=3))  # type: ignore[arg-type]
    # The graph marks the routed experts' GEMMs as grouped, and nothing else.
    graph = build_graph(MOE, 1024, 1)
    gemms = [op for block in graph.blocks for op in (*block.forward, *block.backward) if op.kind == "gemm"]
    assert {op.name.split(".")[2] for op in gemms if op.grouped} == {"up", "down"}
    assert all(op.grouped == op.name.startswith("moe.experts") for op in gemms)


def test_the_moe_router_needs_no_gathered_input_for_its_weight_gradient() -> None:
    """Megatron-Core's router runs on the sequence-split hidden states before the token dispatcher gathers them; its
    weight gradient needs no TP all-gather of its input, as the column-parallel linears' does. Found by an MoE
    review: every MoE layer's backward gathered the whole hidden states once more (2.4% of a Mixtral step)."""
    comms = _comms(MOE, _plan(tp=2, dp=2, global_batch=8))
    gathers = [c.name for c in comms if c.kind == "tp" and c.collective == "all_gather"]
    assert not any("router" in name for name in gathers)
    assert any("attn.qkv.dgrad.input" in name for name in gathers)  # the linears' re-gather is still there


@pytest.mark.parametrize(("tp", "dp", "ep"), [(2, 2, 1), (2, 4, 2), (2, 2, 4)])
def test_shared_experts_are_a_tensor_parallel_mlp_of_their_own(tp: int, dp: int, ep: int) -> None:
    """Megatron-Core's ``SharedExpertMLP`` is a column- and row-parallel MLP on the sequence-split input: it gathers
    and reduce-scatters in both passes, besides the routed tokens' own collectives, and gathers its input again for
    its weight gradient. Found by an MoE review: without expert parallelism the routed part and the shared experts
    shared one all-gather and one reduce-scatter, and with it the shared up-projection's input was not re-gathered."""
    shared = replace(
        MOE,
        moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=2048, shared_experts=1, shared_expert_ffn_hidden=1024),
    )
    plan = _plan(tp=tp, dp=dp, ep=ep, global_batch=8)
    names = [c.name for c in _comms(shared, plan) if c.kind == "tp"]
    plain = [c.name for c in _comms(MOE, plan) if c.kind == "tp"]
    added = Counter(names) - Counter(plain)
    # Per MoE layer (two here): forward all-gather and reduce-scatter, backward all-gather of the output gradient,
    # re-gather of the input and reduce-scatter of the input gradient.
    assert sum(added.values()) == 2 * 5
    assert sum(n for name, n in added.items() if "moe.shared.up.dgrad.input" in name) == 2


def test_expert_parameter_gather_keeps_its_own_bucket_count_without_dense_data_parallelism() -> None:
    """With dp 1 and an expert-data-parallel group (tp 4, ep 2, expert_tp 1: edp 2) only the experts' buffer is
    gathered after the optimizer step, in as many buckets as that buffer has. Found by an MoE review: the experts'
    gather was paired with the dense buffer's bucket count (3 buckets of 40M for 2,000M parameters, not 50)."""
    from simulator.run import _bucket_count, _param_gather_buckets

    layout = resolve_layout(MOE, CLUSTER, _plan(tp=4, ep=2, expert_tp=1, zero_stage=1).with_(seq_len=1024))
    assert (layout.dp.size, layout.edp.size) == (1, 2)
    comm = CommModel(CLUSTER, None, load_calibration("default"))
    buckets = _param_gather_buckets(layout, comm, (100e6, 2000e6, 0.0, 0.0), 40e6)
    assert len(buckets) == _bucket_count(2000e6, 40e6) == 50
    (whole,) = param_all_gathers(0.0, 2000e6, layout, "x")
    assert sum(buckets) == pytest.approx(comm.time(whole), rel=0.05)  # per-bucket latency aside


def test_zero2_pays_for_its_sharded_gradients_in_every_micro_batch() -> None:
    """ZeRO-2 keeps a shard of the gradients, so they cannot accumulate over micro-batches: every backward
    reduce-scatters them, and a block's whole fresh gradient exists until its scatter ran. Found by a memory review:
    ZeRO-2 had ZeRO-1's one reduction per step with a sharded buffer, strictly better than ZeRO-1 (the same step
    time with 26 GiB less for a Llama 3 8B on 8 GPUs), which the validation's memory rescue then chose."""
    wide = replace(DENSE, layers=8)
    one, two = (_sim(wide, _plan(dp=4, global_batch=32, zero_stage=z)) for z in (1, 2))
    assert two.memory[0].gradients == pytest.approx(one.memory[0].gradients / 4)
    params = max(
        sum(op.params for op in block.forward)
        for block in build_graph(wide, 1024, 1).blocks
        if block.name == "layer.dense"
    )
    assert two.memory[0].buffers - one.memory[0].buffers >= 4.0 * params  # one layer's fp32 gradient at least
    assert two.step_time_s > one.step_time_s  # 8 micro-batches of reduce-scatters against one reduction
    assert two.breakdown["dp_exposed_s"] > one.breakdown["dp_exposed_s"]


@pytest.mark.parametrize("zero", [2, 3])
def test_the_last_stages_tied_output_copy_is_gathered_scattered_and_buffered(zero: int) -> None:
    """With tied embeddings and pp > 1 the last stage holds its own copy of the embedding matrix (vocab·h/tp), counted
    in its weights, but ZeRO-2/3's per-block reduce-scatter and ZeRO-3's gather left it out (``head.logits`` has no
    parameters of its own without pipelining), as did the buffer of the largest block's unsharded gradient: BLOOM
    176B at tp 4, pp 12 missed 1.05 GiB on stage 11 under ZeRO-2 and a 1.8 GB gather per pass under ZeRO-3. Found
    by a review of the memory model."""
    tied = replace(DENSE, tied_embeddings=True)
    plan = _plan(tp=2, pp=2, dp=2, zero_stage=zero, sequence_parallel=True)
    layout = resolve_layout(tied, CLUSTER, plan.with_(seq_len=tied.seq_len))
    graph = build_graph(tied, layout.seq_len, layout.micro_batch, plan.attention)
    head = tied.vocab * tied.hidden / 2 + tied.norm_params()  # the copy's shard and the final norm
    comms = {s.work.name: s.work for prog in build_programs(graph, layout, (("head", 1),)) for s in prog}
    assert comms["head.grad_reduce_scatter"].size_bytes == plan.grad_bytes * head
    if zero == 3:
        assert comms["head.param_all_gather"].size_bytes == 2 * head
    # Without pipelining the head reads the embedding's weights: nothing of its own to gather or scatter.
    flat = resolve_layout(tied, CLUSTER, plan.with_(seq_len=tied.seq_len, pp=1, dp=4))
    comms = {s.work.name: s.work for prog in build_programs(graph, flat, (("head", 1),)) for s in prog}
    assert comms["head.grad_reduce_scatter"].size_bytes == plan.grad_bytes * tied.norm_params()
    last = simulate(tied, CLUSTER, plan).memory[-1]
    untied = simulate(replace(DENSE, tied_embeddings=False), CLUSTER, plan).memory[-1]
    assert last.buffers == untied.buffers  # the copy buffers as the untied output layer's own weights do


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_zero_bubble_memory_counts_what_the_deferred_weight_pass_keeps(recompute: str) -> None:
    """A micro-batch past its B waits for its W holding each weight GEMM's input and output gradient (the zero-bubble
    reference's WeightGradStore; Qi et al. 2023: M_W = 32·s·b·h per layer without TP). It had been charged what the
    forward kept: under full recomputation only the layer input, though B re-creates the GEMM inputs and W still
    needs them (Llama 2 70B, tp 8, pp 4: 0.76 GiB on every stage where the last holds four W-pending micro-batches'
    ~7 GiB each). Found by a review of the memory model."""
    plan = _plan(tp=2, pp=2, dp=1, schedule="zb_h1", recompute=recompute, sequence_parallel=True)
    layout = resolve_layout(DENSE, CLUSTER, plan.with_(seq_len=DENSE.seq_len))
    graph = build_graph(DENSE, layout.seq_len, layout.micro_batch, plan.attention)
    layers = DENSE.layers // 2
    wgt = build_programs(graph, layout, (("layer.dense", layers),))[2]
    store = sum(2.0 * s.work.batch * (s.work.m * s.work.k + s.work.k * s.work.n) for s in wgt if s.work.kind == "gemm")
    # Per layer the inputs of qkv and up are gathered over tp and the output gradients of proj and down whole: four
    # 16-bit tokens × hidden tensors at least, besides the sharded ones.
    assert store >= layers * 4 * 2.0 * DENSE.seq_len * DENSE.hidden
    last = simulate(DENSE, CLUSTER, plan).memory[-1]
    head = build_programs(graph, layout, (("head", 1),))[2]
    store += sum(
        2.0 * s.work.batch * (s.work.m * s.work.k + s.work.k * s.work.n) for s in head if s.work.kind == "gemm"
    )
    held = min(2, plan.global_batch)  # the last stage holds p = 2 micro-batches waiting for their W at its peak
    assert last.activations >= held * store


def test_separate_accumulation_covers_exactly_the_gradients_not_reduce_scattered() -> None:
    """Under ZeRO-2/3 the dense gradients are reduce-scattered over dp and the routed experts' over edp
    (``_sharding_groups``); whichever of the two has a group of one is not scattered and, without accumulation
    fusion, is added into the buffer by its own kernel each micro-batch. Found by a review: the test had been
    ``dp > 1`` for both, so with dp 1 and edp 2 the experts were both accumulated and scattered, and with dp 2 and
    edp 1 (ep spanning every data-parallel rank) their gradients were never accumulated."""
    graph = build_graph(MOE, 1024, 1)

    def accumulated(**kw: object) -> float:
        layout = resolve_layout(MOE, CLUSTER, _plan(grad_accum_fusion=False, zero_stage=2, **kw))
        bwd = build_programs(graph, layout, (("layer.moe", 1),))[1]
        adds = [s.work for s in bwd if not isinstance(s.work, Comm) and s.work.name.endswith(".grad_accumulate")]
        return sum(op.write_bytes for op in adds) / layout.plan.grad_bytes

    layout = resolve_layout(MOE, CLUSTER, _plan(tp=4, ep=2, expert_tp=1))
    assert (layout.dp.size, layout.edp.size) == (1, 2)
    expert = sum(local_params(op, layout) for op in graph.block("layer.moe").forward if is_expert_gemm(op))
    dense = sum(local_params(op, layout) for op in graph.block("layer.moe").forward) - expert
    assert expert > 0
    assert dense > 0
    # dp 1, edp 2: the experts are scattered, the dense parameters accumulated
    assert accumulated(tp=4, ep=2, expert_tp=1) == pytest.approx(dense)
    both = resolve_layout(MOE, CLUSTER, _plan(dp=2, ep=2, global_batch=16))
    assert both.edp.size == 1
    expert2 = sum(local_params(op, both) for op in graph.block("layer.moe").forward if is_expert_gemm(op))
    assert accumulated(dp=2, ep=2, global_batch=16) == pytest.approx(expert2)  # dp 2, edp 1: the experts
    # BF16_Optimizer's kept 16-bit .grad is memory for exactly those parameters.
    kw: dict[str, object] = {"dp": 2, "ep": 2, "global_batch": 16, "zero_stage": 2, "grad_accum_fusion": False}
    copied = _sim(MOE, _plan(grad_accum_upcast_copy=True, **kw)).memory[0].gradients
    assert copied - _sim(MOE, _plan(**kw)).memory[0].gradients == pytest.approx(2.0 * MOE.layers * expert2)
