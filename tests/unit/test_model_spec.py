"""Issue 2, model specs: cross-field rules and the YAML round trip that ``--set model.*`` what-ifs rely on."""

from __future__ import annotations

import pytest

from simulator.errors import SpecError
from simulator.specs.library import load_model
from simulator.specs.model import ModelSpec


def test_heads_must_divide_hidden_without_head_dim() -> None:
    """Issue 2 (bad files): 12288 hidden over 7 heads is refused unless head_dim is given (found by the
    ``--set model.heads=7`` battery case: the rule never fired because head_dim was derived first)."""
    with pytest.raises(SpecError, match=r"'heads' must divide 'hidden': hidden=12288, heads=7"):
        ModelSpec(name="m", layers=2, hidden=12288, heads=7, ffn_hidden=4, vocab=10)
    explicit = ModelSpec(name="m", layers=2, hidden=12288, heads=7, head_dim=128, ffn_hidden=4, vocab=10)
    assert explicit.attn_dim == 896


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-405b", "mixtral-8x7b", "qwen3-235b-a22b"])
def test_mapping_round_trip(name: str) -> None:
    """Issue 2: ``from_mapping(to_mapping(m)) == m`` for built-in models (dense, GQA, MoE, explicit head_dim)."""
    m = load_model(name)
    assert ModelSpec.from_mapping(m.to_mapping(), "round trip") == m


def test_changing_heads_of_an_mha_model_keeps_it_mha() -> None:
    """Issue 3 (what-if): ``--set model.heads=64`` on GPT-3 (MHA) re-derives kv_heads and head_dim instead of
    keeping 96 KV heads of 128 (which made the what-if an error)."""
    m = load_model("gpt3-175b", {"heads": 64})
    assert (m.heads, m.kv_heads, m.head_dim) == (64, 64, 192)
    gqa = load_model("llama3-8b", {"hidden": 2048})
    assert (gqa.kv_heads, gqa.head_dim) == (8, 64)


def test_moe_keys_that_would_describe_nothing_are_refused() -> None:
    """A shared-expert size without shared experts, and as many leading dense layers as layers (no MoE layer at
    all), were accepted and ignored; the HF importer already refused the second for a config."""
    import yaml

    from simulator.specs.library import find_file
    from simulator.specs.model import MoESpec

    with pytest.raises(SpecError, match="shared_experts is 0, so it would be ignored"):
        MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=64, shared_expert_ffn_hidden=128)
    data = yaml.safe_load(find_file("model", "mixtral-8x7b").read_text())
    data["moe"]["first_dense_layers"] = data["layers"]
    with pytest.raises(SpecError, match="must be < layers"):
        ModelSpec.from_mapping(data, "m.yaml")


def test_a_learned_position_table_is_as_long_as_the_run() -> None:
    """GPT-3 run at 8,192 tokens kept its 2,048-row position table (Megatron-LM refuses a --seq-length above
    --max-position-embeddings, so such a run has 8,192 rows): stage 0's weights missed 6,144 x 12,288 parameters,
    which tensor parallelism does not split."""
    from simulator.graph.transformer import build_graph

    gpt3 = load_model("gpt3-175b")
    assert gpt3.embedding_params(8192) - gpt3.embedding_params() == 6144 * 12288
    assert gpt3.embedding_params(1024) == gpt3.embedding_params()  # a shorter run keeps the model's table
    (emb,) = [op for b in build_graph(gpt3, 8192, 1).blocks for op in b.forward if op.name == "embedding.lookup"]
    assert emb.replicated_params == 8192 * 12288
    llama = load_model("llama3-8b")  # rotary positions: no table
    assert llama.embedding_params(65536) == llama.embedding_params() == llama.vocab * llama.hidden


def test_a_longer_runs_position_table_does_not_leak_into_other_runs() -> None:
    """The per-block parameter cache was keyed without the sequence, so once a learned position table grew with
    a longer run, whichever length ran first set every later run's weights (found by a determinism review)."""
    from simulator.run import simulate
    from simulator.specs import PlanSpec, load_cluster

    gpt3, h100 = load_model("gpt3-175b"), load_cluster("dgx-h100")

    def weights(seq: int) -> float:
        plan = PlanSpec(tp=8, pp=8, dp=1, global_batch=8, micro_batch=1, vp=1, recompute="full", seq_len=seq)
        return simulate(gpt3, h100, plan.with_(grad_overlap=True), time_oom=False).memory[0].weights

    short, long_ = weights(2048), weights(4096)
    assert long_ - short == pytest.approx(2 * 2048 * 12288)  # 2,048 more 16-bit rows, not split over tp
    assert weights(2048) == short
