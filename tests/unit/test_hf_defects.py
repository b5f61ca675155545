"""Defects of the HF ``config.json`` importer found by adversarial testing: each was a traceback or a silent
misreading, and is now a ``SpecError`` naming the file and the config's own key (exit 2 from the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.cli import main
from simulator.errors import SpecError
from simulator.specs.hf import SUPPORTED_MODEL_TYPES, load_hf_config, model_from_hf_config
from simulator.specs.model import ModelSpec

# Configs of released checkpoints, shared with test_hf_import (tests/data/hf/README.md says which).
HF = Path(__file__).resolve().parents[1] / "data" / "hf"
LLAMA = json.loads((HF / "llama3-8b.json").read_text())
QWEN3_MOE = json.loads((HF / "qwen3-30b-a3b.json").read_text())
GPT2 = json.loads((HF / "gpt2.json").read_text())

NEOX = {
    "model_type": "gpt_neox",
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "vocab_size": 50304,
    "max_position_embeddings": 2048,
    "hidden_act": "gelu",
    "tie_word_embeddings": False,
}
WHERE = "cfg/config.json"


def _load(cfg: dict) -> ModelSpec:
    return model_from_hf_config(cfg, WHERE, name="m")


def _error(cfg: dict) -> SpecError:
    with pytest.raises(SpecError) as info:
        model_from_hf_config(cfg, WHERE, name="m")
    err = info.value
    assert err.where.count(WHERE) == 1
    assert err.fix
    return err


# -- 1: a file that is not UTF-8 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "{p}"],
        ["simulate", "--model", "{p}", "--cluster", "dgx-h100", "--global-batch", "8"],
        ["graph", "--model", "{p}"],
    ],
    ids=["check", "simulate", "graph"],
)
def test_non_utf8_config_is_a_clean_error(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect 1: bytes ff fe (a UTF-16 byte-order mark) raised UnicodeDecodeError out of load_hf_config; every
    command that reads the file now exits 2 with ``error: <file>: is not UTF-8 text ...; <fix>``."""
    path = tmp_path / "x.json"
    path.write_bytes(b'\xff\xfe{"a":1}')
    code = main([a.replace("{p}", str(path)) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: {path}: is not UTF-8 text" in err
    assert "line 1, byte 1 is 0xff" in err
    assert "UTF-16" in err
    assert "save the config.json as UTF-8" in err
    assert "Traceback" not in err


def test_non_utf8_byte_later_in_the_file_is_located(tmp_path: Path) -> None:
    """Defect 1: a Latin-1 byte inside the file is reported with its offset (no UTF-16 remark)."""
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "llama", "name": "caf\xe9"}')
    with pytest.raises(SpecError, match=r"is not UTF-8 text: line 1, byte 37 is 0xe9;") as info:
        load_hf_config(path)
    assert info.value.where == str(path)


def test_utf8_byte_order_mark_is_tolerated(tmp_path: Path) -> None:
    """Defect 1 (neighbour): a UTF-8 file with a byte-order mark (Windows editors write one) still loads."""
    path = tmp_path / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(LLAMA).encode())
    assert load_hf_config(path).layers == 32


def test_unreadable_and_unparsable_files_are_clean_errors(tmp_path: Path) -> None:
    """Defect 1 (neighbours): a directory named config.json, a 5000-digit number and arrays nested 100000 deep
    raised IsADirectoryError, ValueError and RecursionError."""
    folder = tmp_path / "d" / "config.json"
    folder.mkdir(parents=True)
    with pytest.raises(SpecError, match="cannot be read"):
        load_hf_config(folder)
    digits = tmp_path / "digits.json"
    digits.write_text('{"vocab_size": ' + "1" * 5000 + "}")
    with pytest.raises(SpecError, match="not a JSON file this importer can read"):
        load_hf_config(digits)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match="not a JSON file this importer can read"):
        load_hf_config(deep)


# -- 2: unsupported model_type ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["bert", "t5-like", "gemma", "falcon", "LLaMA-2"])
def test_unknown_model_type_with_llama_keys_is_refused(model_type: str) -> None:
    """Defect 2: a model_type outside the supported families that has hidden_size was read as Llama (gated,
    RMSNorm, RoPE); it is now refused, listing the supported types."""
    err = _error({**LLAMA, "model_type": model_type})
    assert err.where == f"{WHERE}: model_type"
    assert f"unsupported model_type {model_type.lower()!r}" in err.what
    assert all(t in err.fix for t in SUPPORTED_MODEL_TYPES)


def test_bert_file_from_the_cli_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect 2: ``check`` of a BERT config said ok; now it exits 2 naming model_type."""
    bert = {
        "model_type": "bert",
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "vocab_size": 30522,
        "hidden_act": "gelu",
    }
    (tmp_path / "config.json").write_text(json.dumps(bert))
    code = main(["check", str(tmp_path / "config.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "config.json: model_type: unsupported model_type 'bert'; supported: llama" in err


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED_MODEL_TYPES if t not in ("gpt2", "gpt_neox")])
def test_every_llama_family_is_still_read(model_type: str) -> None:
    """Defect 2: the README's families (Llama, Mistral/Mixtral, Qwen2/Qwen3 and their MoE) still load, and the
    model_type is case-insensitive as before."""
    cfg = QWEN3_MOE if model_type.endswith("moe") else LLAMA
    if model_type == "mixtral":  # Mixtral's configs always name their experts (a missing count is refused)
        cfg = {**LLAMA, "num_local_experts": 8, "num_experts_per_tok": 2}
    if model_type == "qwen3":  # Qwen3Config does not derive head_dim from the heads (a missing one is refused)
        cfg = {**LLAMA, "head_dim": 128}
    m = model_from_hf_config({**cfg, "model_type": model_type.upper()}, WHERE, name="m")
    assert m.gated_mlp
    assert m.norm == "rmsnorm"


def test_model_type_must_be_text() -> None:
    """Defect 2: a non-text model_type (a number) was turned into a string and read as Llama."""
    assert "must be text" in _error({**LLAMA, "model_type": 7}).what


def test_missing_model_type_is_placed_by_architectures() -> None:
    """Defect 2: without model_type, ``architectures`` decides: a BERT class is refused, a GPT-2 class is read
    as GPT-2, and a file with neither is still read the Llama way (documented behaviour)."""
    no_type = {k: v for k, v in LLAMA.items() if k != "model_type"}
    assert _load(no_type).gated_mlp
    assert _load({k: v for k, v in no_type.items() if k != "architectures"}).gated_mlp
    err = _error({**no_type, "architectures": ["BertForMaskedLM"]})
    assert err.where == f"{WHERE}: model_type"
    assert "'BertForMaskedLM'" in err.what
    gpt2 = {k: v for k, v in GPT2.items() if k != "model_type"}
    assert _load({**gpt2, "architectures": ["GPT2LMHeadModel"]}).norm == "layernorm"


@pytest.mark.parametrize(
    ("cfg", "family", "key"),
    [
        ({k: v for k, v in GPT2.items() if k not in ("model_type", "architectures")}, "gpt2", "n_embd"),
        ({**{k: v for k, v in NEOX.items() if k != "model_type"}, "rotary_pct": 0.25}, "gpt_neox", "rotary_pct"),
    ],
)
def test_a_family_without_model_type_or_architectures_is_named(cfg: dict, family: str, key: str) -> None:
    """A GPT-2 file with neither model_type nor architectures failed on 'hidden_size is required', which GPT-2
    files never have, and a NeoX one was read as a Llama without a word: the family's own keys name it."""
    err = _error(cfg)
    assert err.where == f"{WHERE}: model_type"
    assert key in err.what
    assert f'if it is {family}, add "model_type": "{family}"' in err.fix
    if family == "gpt2":  # GPT-J, CodeGen and BLOOM share the keys: the fix must not send them to GPT-2 unasked
        assert "GPT-J, CodeGen and BLOOM use these keys too and are not supported" in err.fix


def test_head_dim_is_bounded_like_the_other_sizes() -> None:
    """head_dim 10**17 was accepted (memory in the 10**16 GiB) where hidden 10**17 is refused at 2**53."""
    err = _error({**LLAMA, "head_dim": 10**17})
    assert err.where == f"{WHERE}: head_dim"
    assert "must be at most 2**53" in err.what
    assert "a number of 18 digits" in err.what


def test_deepseek_is_still_refused_at_its_own_key() -> None:
    """Defect 2: the DeepSeek check (naming n_routed_experts) still comes before the model_type check."""
    err = _error({**LLAMA, "model_type": "deepseek_v3", "n_routed_experts": 256})
    assert err.where == f"{WHERE}: n_routed_experts"


# -- 3: booleans written as text ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (LLAMA, "tie_word_embeddings"),
        (LLAMA, "attention_bias"),
        (LLAMA, "mlp_bias"),
        (NEOX, "tie_word_embeddings"),
        (GPT2, "tie_word_embeddings"),
    ],
)
@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_boolean_keys_must_be_json_booleans(cfg: dict, key: str, value: object) -> None:
    """Defect 3: ``"tie_word_embeddings": "false"`` was taken as true (bool of a non-empty text). transformers
    stores whatever JSON gives, so a text is a malformed config: the error names the key."""
    err = _error({**cfg, key: value})
    assert err.where == f"{WHERE}: {key}"
    assert f"must be true or false, got {value!r}" in err.what
    assert "without quotes" in err.fix


def test_json_booleans_are_read() -> None:
    """Defect 3: real booleans still work, and GPT-2 unties its output layer when the config says so
    (GPT2Config leaves tie_word_embeddings at PretrainedConfig's default, true)."""
    vocab_by_hidden = 128256 * 4096
    tied, untied = _load({**LLAMA, "tie_word_embeddings": True}), _load(LLAMA)
    assert untied.param_count() - tied.param_count() == vocab_by_hidden
    assert _load(GPT2).tied_embeddings
    assert not _load({**GPT2, "tie_word_embeddings": False}).tied_embeddings
    assert _load({**LLAMA, "attention_bias": True, "mlp_bias": True}).bias


# -- 4: activations -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "key", "act", "expected"),
    [
        (GPT2, "activation_function", "silu", "silu"),
        (GPT2, "activation_function", "swish", "silu"),
        (GPT2, "activation_function", "relu", "relu"),
        (GPT2, "activation_function", "relu2", "squared_relu"),
        (GPT2, "activation_function", "gelu_new", "gelu"),
        (GPT2, "activation_function", "quick_gelu", "gelu"),
        (NEOX, "hidden_act", "silu", "silu"),
        (NEOX, "hidden_act", "gelu_fast", "gelu"),
        (LLAMA, "hidden_act", "silu", "swiglu"),
        (LLAMA, "hidden_act", "gelu_pytorch_tanh", "geglu"),
        (LLAMA, "hidden_act", "gelu_new", "geglu"),
    ],
)
def test_activation_is_honoured(cfg: dict, key: str, act: str, expected: str) -> None:
    """Defect 4: GPT-2 with activation_function "silu" became gelu; each family's activation key is mapped to
    the ModelSpec activation it stands for."""
    assert _load({**cfg, key: act}).activation == expected


@pytest.mark.parametrize(
    ("cfg", "key", "act"),
    [
        (GPT2, "activation_function", "tanh"),
        (GPT2, "activation_function", "mish"),
        (NEOX, "hidden_act", "sigmoid"),
        (LLAMA, "hidden_act", "relu"),  # a gated ReLU (ReGLU) is not a ModelSpec activation
        (LLAMA, "hidden_act", "relu2"),
        (QWEN3_MOE, "hidden_act", "leaky_relu"),
    ],
)
def test_unrepresentable_activation_is_refused(cfg: dict, key: str, act: str) -> None:
    """Defect 4: an activation the spec cannot represent was silently gelu (GPT-2, NeoX); now an error naming
    the key, the value and the names that work."""
    err = _error({**cfg, key: act})
    assert err.where == f"{WHERE}: {key}"
    assert f"unsupported activation {act!r}" in err.what
    assert "use one of:" in err.fix


@pytest.mark.parametrize(("cfg", "key"), [(GPT2, "activation_function"), (NEOX, "hidden_act"), (LLAMA, "hidden_act")])
def test_activation_must_be_text(cfg: dict, key: str) -> None:
    """Defect 4: a number or list as the activation was str()-ed (GPT-2: silently gelu)."""
    for value in (1, ["gelu"], True):
        assert _error({**cfg, key: value}).where == f"{WHERE}: {key}"


# -- 5: ModelSpec errors name the config key ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "key", "field", "what"),
    [
        ({**LLAMA, "num_hidden_layers": 100_000}, "num_hidden_layers", "layers", "'layers' must be at most 10,000"),
        ({**GPT2, "n_layer": 100_000}, "n_layer", "layers", "'layers' must be at most 10,000"),
        ({**NEOX, "num_hidden_layers": 100_000}, "num_hidden_layers", "layers", "'layers' must be at most"),
        ({**LLAMA, "num_attention_heads": 33}, "num_attention_heads", "heads", "'heads' must divide 'hidden'"),
        ({**GPT2, "n_head": 7}, "n_head", "heads", "'heads' must divide 'hidden'"),
        ({**NEOX, "num_attention_heads": 7}, "num_attention_heads", "heads", "'heads' must divide 'hidden'"),
        ({**LLAMA, "num_key_value_heads": 5}, "num_key_value_heads", "kv_heads", "'kv_heads' must divide 'heads'"),
    ],
)
def test_model_spec_errors_name_the_config_key(cfg: dict, key: str, field: str, what: str) -> None:
    """Defect 5: 100000 layers said ``layers: ...``, a key config.json does not have; a ModelSpec error now
    names the key the value came from, and says which clustersim field it is."""
    err = _error(cfg)
    assert err.where == f"{WHERE}: {key}"
    assert what in err.what
    assert f"({key} is clustersim's '{field}')" in err.what


def test_huge_layer_count_from_the_cli_names_num_hidden_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect 5: the CLI message starts with the config key."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 100_000}))
    code = main(["check", str(tmp_path / "config.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "config.json: num_hidden_layers: 'layers' must be at most 10,000, got 100,000" in err


def test_a_repeated_key_and_an_upper_case_suffix(tmp_path: Path) -> None:
    """json.loads lets a repeated key's last value win silently (hidden 4096 then 2048 read as 2048); a .JSON file
    was parsed as YAML and failed on 'heads'."""
    from simulator.specs.library import load_model

    cfg = json.loads((Path(__file__).parents[1] / "data" / "hf" / "llama3-8b.json").read_text())
    text = json.dumps(cfg)
    dup = tmp_path / "dup.json"
    dup.write_text(text.replace('"hidden_size": 4096', '"hidden_size": 4096, "hidden_size": 2048'))
    with pytest.raises(SpecError, match="hidden_size: appears twice in one object"):
        load_model(dup)
    upper = tmp_path / "UPPER.JSON"
    upper.write_text(text)
    assert load_model(upper).hidden == 4096


def test_a_moe_model_type_without_its_expert_count_is_refused() -> None:
    """mixtral or qwen3_moe without num_local_experts / num_experts was imported as a dense model."""
    cfg = json.loads((Path(__file__).parents[1] / "data" / "hf" / "qwen3-30b-a3b.json").read_text())
    del cfg["num_experts"]
    with pytest.raises(SpecError, match="num_experts: is required for model_type 'qwen3_moe' but missing"):
        model_from_hf_config(cfg, "config.json", name="q")
    cfg["num_experts"] = 0  # stated as zero: a dense model, as transformers reads it
    assert model_from_hf_config(cfg, "config.json", name="q").moe is None


def test_a_moe_model_type_with_a_null_expert_count_is_refused() -> None:
    cfg = json.loads((Path(__file__).parents[1] / "data" / "hf" / "qwen3-30b-a3b.json").read_text())
    cfg["num_experts"] = None
    with pytest.raises(SpecError, match="num_experts: is required for model_type 'qwen3_moe'"):
        model_from_hf_config(cfg, "config.json", name="q")


@pytest.mark.parametrize(
    ("changes", "key", "what"),
    [
        ({"num_hidden_layers": 4, "decoder_sparse_step": 8}, "decoder_sparse_step", "leaves no MoE layer"),
        ({"num_hidden_layers": 2, "mlp_only_layers": [0, 1, 2]}, "mlp_only_layers", "leaves no MoE layer"),
        # Dense layers 3 and 7 between sparse ones: not a leading block (they had been moved to layers 0 and 1).
        ({"num_hidden_layers": 8, "mlp_only_layers": [3, 7]}, "mlp_only_layers", "not a leading block"),
    ],
)
def test_qwen_moe_layer_patterns_a_spec_cannot_hold_are_refused(changes: dict, key: str, what: str) -> None:
    """transformers makes Qwen-MoE layer i sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    == 0; a model spec holds a leading dense block, then every step-th layer sparse. Other patterns had been read
    as a leading block of as many dense layers (found by an import review)."""
    err = _error({**QWEN3_MOE, **changes})
    assert err.where == f"{WHERE}: {key}"
    assert what in err.what


def test_qwen_moe_dense_layers_before_the_sparse_pattern_start_it() -> None:
    """decoder_sparse_step 2 with mlp_only_layers [1]: sparse layers 3, 5, ..., 23 (11 of 24), not 1, 3, ..., 23."""
    cfg = {**QWEN3_MOE, "num_hidden_layers": 24, "decoder_sparse_step": 2, "mlp_only_layers": [1]}
    moe = model_from_hf_config(cfg, WHERE, name="q").moe
    assert moe is not None
    assert (moe.first_dense_layers, moe.layer_frequency) == (3, 2)
    assert sum(moe.is_moe_layer(i) for i in range(24)) == 11


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"model_type": "mistral", "sliding_window": 4096}, True),  # Mistral 7B v0.1
        ({"model_type": "mistral", "sliding_window": None}, False),  # v0.3
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, False),  # Qwen2's default
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, True),
        # A window as long as the positions never takes effect (Ministral 8B: 32,768 both).
        ({"model_type": "mistral", "sliding_window": 32768, "max_position_embeddings": 32768}, False),
    ],
)
def test_sliding_window_attention_is_refused_not_timed_as_full(changes: dict, refused: bool) -> None:
    """Windowed attention (each token sees the last W) is not modelled; it had been timed as full causal attention
    without a word. Refused with the fix (null times full attention, exact up to the window)."""
    if refused:
        err = _error({**LLAMA, **changes})
        assert err.where == f"{WHERE}: sliding_window"
        assert "not modelled" in err.what
    else:
        assert model_from_hf_config({**LLAMA, **changes}, WHERE, name="m").layers == LLAMA["num_hidden_layers"]


def test_a_qwen_moe_config_with_a_huge_layer_count_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """The Qwen-MoE importer built its per-layer sets before any bound applied: 1e20 layers exhausted memory (and 1e8
    took seconds and gigabytes). It is bounded like every other importer's layers."""
    data = json.loads((Path(__file__).parents[1] / "data" / "hf" / "qwen3-30b-a3b.json").read_text())
    data["num_hidden_layers"] = 1e20
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match="num_hidden_layers: must be <= 10000"):
        load_hf_config(path)


@pytest.mark.parametrize("model_type", [None, "mistral3", "llava"])
def test_a_multimodal_config_names_its_text_config(model_type: str | None) -> None:
    """A vision-language checkpoint keeps the language model under text_config: it had been refused for a missing
    hidden_size (or an unsupported model_type), without a word about where the fields are. Found by a review."""
    cfg: dict = {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {**LLAMA}}
    if model_type is not None:
        cfg["model_type"] = model_type
    err = _error(cfg)
    assert err.where == f"{WHERE}: text_config"
    assert "language model's fields are under text_config" in err.what
    assert "text_config object" in err.fix
    assert _load({**LLAMA, "text_config": {"hidden_size": 1}}).hidden == LLAMA["hidden_size"]  # top level wins


def test_a_huge_layer_count_is_not_printed_digit_by_digit() -> None:
    err = _error({**LLAMA, "num_hidden_layers": 10**300})
    assert "a number of 301 digits" in err.what
    assert len(str(err)) < 300
