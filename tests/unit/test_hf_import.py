"""Issue 2, HF ``config.json`` importer: small inline configs of released checkpoints give the right ModelSpec
fields and parameter counts.

Each config below copies the architecture keys of the published ``config.json`` (irrelevant keys such as
``rope_theta`` are kept where a real file has them, to show they are tolerated). Expected totals are the
safetensors parameter counts Hugging Face shows on each model card; where clustersim leaves out a tensor
the spec cannot express (Qwen2's QKV biases, Qwen3's q_norm/k_norm scales), the test adds it back so the
comparison stays exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.errors import SpecError
from simulator.specs.hf import load_hf_config, model_from_hf_config
from simulator.specs.library import load_model

# Configs of released checkpoints shared with other test modules (tests/data/hf/README.md says which).
HF = Path(__file__).resolve().parents[1] / "data" / "hf"
LLAMA3_8B = json.loads((HF / "llama3-8b.json").read_text())
QWEN3_30B_A3B = json.loads((HF / "qwen3-30b-a3b.json").read_text())
GPT2 = json.loads((HF / "gpt2.json").read_text())

MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": None,  # v0.1 says 4096, windowed attention, which the importer refuses (not modelled)
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
QWEN2_57B_A14B = {
    "model_type": "qwen2_moe",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "moe_intermediate_size": 2560,
    "shared_expert_intermediate_size": 20480,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
NEOX_20B = {
    "model_type": "gpt_neox",
    "hidden_size": 6144,
    "intermediate_size": 24576,
    "num_hidden_layers": 44,
    "num_attention_heads": 64,
    "vocab_size": 50432,
    "max_position_embeddings": 2048,
    "rotary_pct": 0.25,
    "use_parallel_residual": True,
    "hidden_act": "gelu_fast",
    "tie_word_embeddings": False,
}


def _load(cfg: dict) -> object:
    return model_from_hf_config(cfg, "config.json", name="m")


# (config, exact total from the model card, parameters the spec leaves out, why)
TOTALS = [
    ("llama3-8b", LLAMA3_8B, 8_030_261_248, 0, "meta-llama/Meta-Llama-3-8B"),
    ("mistral-7b", MISTRAL_7B, 7_241_732_096, 0, "mistralai/Mistral-7B-v0.1"),
    ("mixtral-8x7b", MIXTRAL_8X7B, 46_702_792_704, 0, "mistralai/Mixtral-8x7B-v0.1"),
    ("qwen2-7b", QWEN2_7B, 7_615_616_512, 28 * (3584 + 2 * 512), "Qwen/Qwen2-7B; spec has no QKV-only bias"),
    ("qwen3-8b", QWEN3_8B, 8_190_735_360, 36 * 2 * 128, "Qwen/Qwen3-8B; q_norm and k_norm scales"),
    ("qwen3-30b-a3b", QWEN3_30B_A3B, 30_532_122_624, 48 * 2 * 128, "Qwen/Qwen3-30B-A3B; q_norm and k_norm"),
    ("gpt2", GPT2, 124_439_808, 0, "openai-community/gpt2"),
    ("gpt-neox-20b", NEOX_20B, 20_554_567_680, 0, "EleutherAI/gpt-neox-20b"),
]


@pytest.mark.parametrize(("cfg", "total", "missing"), [t[1:4] for t in TOTALS], ids=[t[0] for t in TOTALS])
def test_total_parameters_are_exact(cfg: dict, total: int, missing: int) -> None:
    """Issue 2 (HF importer): the imported spec counts exactly the checkpoint's parameters."""
    assert _load(cfg).param_count() + missing == total


def test_qwen2_moe_totals_within_half_a_percent() -> None:
    """Issue 2 (HF importer): Qwen2-57B-A14B, published as 57.41B total and 14.2B active (model card)."""
    m = _load(QWEN2_57B_A14B)
    assert m.param_count() == pytest.approx(57.41e9, rel=0.005)
    assert m.active_param_count() == pytest.approx(14.2e9, rel=0.005)
    assert m.moe is not None
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_hidden) == (64, 8, 2560)
    assert (m.moe.shared_experts, m.moe.shared_expert_ffn_hidden) == (1, 20480)


def test_mixtral_active_parameters() -> None:
    """Issue 2 (HF importer): Mixtral 8x7B uses 12.9B parameters per token (Mistral AI announcement)."""
    assert _load(MIXTRAL_8X7B).active_param_count() == pytest.approx(12.9e9, rel=0.005)


def test_qwen3_moe_active_parameters() -> None:
    """Issue 2 (HF importer): Qwen3-30B-A3B activates "3.3B" (model card). The layout gives 3.353e9, which the
    card truncates; 2% admits that rounding and nothing else (a wrong top_k or expert width is off by >10%)."""
    assert _load(QWEN3_30B_A3B).active_param_count() == pytest.approx(3.3e9, rel=0.02)


def test_llama_fields() -> None:
    """Issue 2 (HF importer): the Llama reading of every architecture field."""
    m = _load(LLAMA3_8B)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn_hidden, m.vocab) == (
        32,
        4096,
        32,
        8,
        128,
        14336,
        128256,
    )
    assert (m.gated_mlp, m.activation, m.norm, m.position_embedding, m.bias, m.tied_embeddings) == (
        True,
        "swiglu",
        "rmsnorm",
        "rope",
        False,
        False,
    )
    assert m.seq_len == 8192
    assert m.moe is None


def test_long_context_maximum_is_capped_at_8192() -> None:
    """Issue 2 (HF importer): max_position_embeddings 131072 (Qwen2) is not taken as the training length."""
    assert _load(QWEN2_7B).seq_len == 8192


def test_explicit_head_dim_is_kept() -> None:
    """Issue 2 (HF importer): Qwen3's head_dim (128) is read, not derived from hidden/heads."""
    m = _load(QWEN3_30B_A3B)
    assert (m.head_dim, m.attn_dim, m.hidden) == (128, 4096, 2048)


def test_tied_embeddings_are_read() -> None:
    """Issue 2 (HF importer): tie_word_embeddings=true drops the separate output matrix."""
    tied = _load({**QWEN2_7B, "tie_word_embeddings": True})
    assert _load(QWEN2_7B).param_count() - tied.param_count() == 152064 * 3584


def test_gpt2_fields() -> None:
    """Issue 2 (HF importer): GPT-2 is LayerNorm, GELU 4h MLP, learned positions, tied, with biases."""
    m = _load(GPT2)
    assert (m.ffn_hidden, m.activation, m.norm, m.position_embedding, m.tied_embeddings, m.bias, m.seq_len) == (
        3072,
        "gelu",
        "layernorm",
        "learned",
        True,
        True,
        1024,
    )


def test_neox_fields() -> None:
    """Issue 2 (HF importer): GPT-NeoX is LayerNorm, ungated GELU, rotary, untied, with biases."""
    m = _load(NEOX_20B)
    assert (m.gated_mlp, m.activation, m.position_embedding, m.tied_embeddings, m.bias) == (
        False,
        "gelu",
        "rope",
        False,
        True,
    )


def test_file_is_named_after_its_folder(tmp_path: Path) -> None:
    """Issue 2 (HF importer): ``path/Meta-Llama-3-8B/config.json`` loads as model ``Meta-Llama-3-8B``, also by
    ``load_model`` (the path that ``--model`` takes)."""
    folder = tmp_path / "Meta-Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert load_hf_config(folder / "config.json").name == "Meta-Llama-3-8B"
    assert load_model(str(folder / "config.json")).param_count() == 8_030_261_248


def test_imported_llama_matches_the_built_in_one() -> None:
    """Issue 2 (HF importer): the built-in llama3-8b YAML and the imported config describe the same model."""
    assert _load(LLAMA3_8B).param_count() == load_model("llama3-8b").param_count()


BAD = [
    ({**LLAMA3_8B, "num_key_value_heads": 5}, "num_key_value_heads", "'kv_heads' must divide 'heads'"),
    ({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"}, "hidden_size", "is required but missing"),
    ({**LLAMA3_8B, "num_hidden_layers": "32"}, "num_hidden_layers", "must be a whole number, got the text '32'"),
    ({**LLAMA3_8B, "hidden_act": "tanh"}, "hidden_act", "unsupported activation 'tanh'"),
    ({**MIXTRAL_8X7B, "num_experts_per_tok": None}, "num_experts_per_tok", "is required but missing"),
    ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, "num_experts_per_tok", "must be <= the number of experts"),
    ({**GPT2, "n_head": 0}, "n_head", "must be >= 1, got 0"),
    ({"model_type": "t5", "d_model": 512}, "model_type", "unsupported model_type 't5'"),
    # Found by fuzzing: a null intermediate_size of a dense model reached ModelSpec as None (a TypeError).
    ({**LLAMA3_8B, "intermediate_size": None}, "intermediate_size", "is required but missing"),
    ({**LLAMA3_8B, "vocab_size": "abc"}, "vocab_size", "must be a whole number, got the text 'abc'"),
    # Found by fuzzing: the MoE keys were read with int(), so text, lists or NaN raised ValueError/TypeError.
    ({**MIXTRAL_8X7B, "num_local_experts": "8x"}, "num_local_experts", "must be a whole number"),
    ({**QWEN3_30B_A3B, "num_experts": float("nan")}, "num_experts", "must be a whole number"),
    ({**QWEN2_57B_A14B, "shared_expert_intermediate_size": "8"}, "shared_expert_intermediate_size", "whole number"),
    ({**QWEN2_57B_A14B, "decoder_sparse_step": [1, 2]}, "decoder_sparse_step", "must be a whole number"),
    ({**QWEN2_57B_A14B, "decoder_sparse_step": 0}, "decoder_sparse_step", "must be >= 1, got 0"),
    ({**QWEN3_30B_A3B, "mlp_only_layers": 1.5}, "mlp_only_layers", "must be a list of whole numbers"),
    ({**QWEN3_30B_A3B, "moe_intermediate_size": None, "intermediate_size": None}, "moe_intermediate_size", "missing"),
    # Found by a review: without moe_intermediate_size a Qwen-MoE file was timed with experts as wide as its dense
    # layers (intermediate_size 6144 for Qwen3-30B-A3B, 8x its experts' 768), and a Mixtral file without
    # intermediate_size was told to add moe_intermediate_size, a key Mixtral does not have.
    ({k: v for k, v in QWEN3_30B_A3B.items() if k != "moe_intermediate_size"}, "moe_intermediate_size", "missing"),
    ({k: v for k, v in QWEN2_57B_A14B.items() if k != "moe_intermediate_size"}, "moe_intermediate_size", "missing"),
    ({**MIXTRAL_8X7B, "intermediate_size": None}, "config.json: intermediate_size", "is required but missing"),
]


@pytest.mark.parametrize(("cfg", "where", "what"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_configs_name_the_key(cfg: dict, where: str, what: str) -> None:
    """Issue 2 (bad files): a broken config.json raises SpecError naming the file and key, with a fix."""
    with pytest.raises(SpecError) as info:
        model_from_hf_config(cfg, "cfg/config.json", name="m")
    err = info.value
    assert err.where.startswith("cfg/config.json")
    assert err.where.count("cfg/config.json") == 1  # a reader's error is not re-prefixed with the file
    assert where in err.where or where in err.what
    assert what in err.what
    assert err.fix


def test_decoder_sparse_step_places_moe_layers_as_qwen_does() -> None:
    """Issue 2 (HF importer): with decoder_sparse_step=2 Qwen-MoE layers 1, 3, 5 are sparse ((i+1) % step == 0,
    transformers' Qwen2MoeDecoderLayer), not 0, 2, 4 (found by this test: the importer started at layer 0)."""
    m = _load({**QWEN2_57B_A14B, "num_hidden_layers": 5, "decoder_sparse_step": 2})
    assert m.moe is not None
    assert [m.moe.is_moe_layer(i) for i in range(5)] == [False, True, False, True, False]
    assert m.num_moe_layers == 2


@pytest.mark.parametrize("key", ["n_routed_experts", "kv_lora_rank", "first_k_dense_replace"])
def test_deepseek_style_configs_are_refused_not_read_as_a_small_dense_model(key: str) -> None:
    """DeepSeek V2/V3 name their experts and attention differently (n_routed_experts, MLA's kv_lora_rank): read
    llama-style, V3 came out as a 38.6B dense model instead of 671B. The key is named in the error."""
    cfg = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "intermediate_size": 18432,
        "vocab_size": 129280,
        "hidden_act": "silu",
        key: 3,
    }
    with pytest.raises(SpecError, match=f"{key}: model_type 'deepseek_v3' has an architecture this importer"):
        model_from_hf_config(cfg, "config.json", name="ds")


_FAMILY_CONFIGS = {
    "mistral": MISTRAL_7B,
    "mixtral": MIXTRAL_8X7B,
    "qwen2": QWEN2_7B,
    "qwen2_moe": QWEN2_57B_A14B,
    "qwen3": QWEN3_8B,
    "qwen3_moe": QWEN3_30B_A3B,
}


@pytest.mark.parametrize(
    ("family", "key"),
    [
        *((family, "num_key_value_heads") for family in _FAMILY_CONFIGS),
        ("qwen3", "head_dim"),
        ("qwen3_moe", "head_dim"),
    ],
)
def test_a_family_key_transformers_does_not_derive_is_required(family: str, key: str) -> None:
    """Found by a review of the importer: a missing key took Llama's derivation in every family (kv heads = heads,
    head_dim = hidden/heads), but these families' config classes give it a constant of their own (MistralConfig's
    num_key_value_heads is 8, Qwen3Config's head_dim 128): Mistral 7B without its kv heads came out 8.05B instead of
    7.25B. Released configs always carry the key, so a file without it is refused rather than guessed."""
    cfg = {k: v for k, v in _FAMILY_CONFIGS[family].items() if k != key}
    assert cfg.get("model_type") == family
    with pytest.raises(SpecError, match=rf"{key}: is required for model_type '{family}' but missing"):
        _load(cfg)


def test_llama_derives_kv_heads_and_head_dim() -> None:
    """LlamaConfig derives both (num_key_value_heads None -> heads; head_dim None -> hidden // heads)."""
    cfg = {k: v for k, v in LLAMA3_8B.items() if k not in ("num_key_value_heads", "head_dim")}
    m = _load(cfg)
    assert (m.kv_heads, m.head_dim) == (32, 128)


def test_gpt2_without_n_positions_has_gpt2configs_1024_positions() -> None:
    """GPT2Config's n_positions defaults to 1024: the learned position table (and the default sequence) had
    2048 rows, the importer's default for every family."""
    cfg = {k: v for k, v in GPT2.items() if k != "n_positions"}
    assert _load(cfg).seq_len == 1024
    assert _load(cfg).param_count() == 124_439_808


@pytest.mark.parametrize(("count", "what"), [(0, "must be >= 1, got 0"), (False, "must be a whole number, got False")])
def test_a_mixture_of_experts_family_with_no_experts_is_refused(count: object, what: str) -> None:
    """num_local_experts 0 or false imported Mixtral as a dense 7.24B model without a word (transformers'
    MixtralSparseMoeBlock has no dense fallback; Qwen-MoE's decoder layer reads num_experts 0 as dense MLPs, and
    that stays allowed)."""
    with pytest.raises(SpecError, match=f"num_local_experts: {what}"):
        _load({**MIXTRAL_8X7B, "num_local_experts": count})
    with pytest.raises(SpecError, match="num_experts: must be a whole number, got False"):
        _load({**QWEN3_30B_A3B, "num_experts": False})
    assert _load({**QWEN3_30B_A3B, "num_experts": 0}).moe is None


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_expert_keys_in_a_dense_family_are_refused(family: str) -> None:
    """LlamaForCausalLM (and Mistral's, Qwen2's, Qwen3's) has no experts and ignores num_local_experts: a stray
    count had made a Llama file a 47.5B mixture of experts."""
    base = {"llama": LLAMA3_8B, "mistral": MISTRAL_7B, "qwen2": QWEN2_7B, "qwen3": QWEN3_8B}[family]
    cfg = {**base, "model_type": family, "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(SpecError, match=rf"num_local_experts: model_type '{family}' has no experts"):
        _load(cfg)
    assert _load({**base, "model_type": family, "num_experts": 0}).moe is None  # 0 or null: no experts, as said


def test_gpt2s_learned_position_table_is_n_positions_long() -> None:
    """A learned position table has n_positions rows whatever length a run uses: the 8,192 cap on the default
    sequence (meant for rotary models' long-context maxima) had cut a 32,768-position GPT-2's table, 129.9M
    parameters where the checkpoint has 148.8M. Found by a review of the importer."""
    m = _load({**GPT2, "n_positions": 32768})
    assert m.param_count() == 148_819_200
    assert m.seq_len == 32768
