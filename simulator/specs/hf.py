"""Import a Hugging Face ``config.json`` as a :class:`ModelSpec`.

Users already have these files on disk, so ``--model path/to/config.json`` works wherever a model name
does. Supported families (by ``model_type``): ``llama``, ``mistral``, ``mixtral``, ``qwen2``,
``qwen2_moe``, ``qwen3``, ``qwen3_moe``, ``gpt2``, ``gpt_neox``; other types whose keys follow the Llama
naming are read the Llama way. Field meanings follow the ``transformers`` configuration classes of those
families (``LlamaConfig``, ``MixtralConfig``, ``Qwen3MoeConfig``, ``GPT2Config``, ``GPTNeoXConfig``).
The default training sequence length is ``max_position_embeddings`` capped at 8192, because long-context
maxima (131072 for Llama 3.1) are rarely the pre-training length; pass ``--seq-len`` to override.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from simulator.errors import SpecError
from simulator.specs._fields import Fields
from simulator.specs.model import ModelSpec, MoESpec

__all__ = ["SUPPORTED_MODEL_TYPES", "UNREAD_ARCHITECTURE_KEYS", "load_hf_config", "model_from_hf_config"]

# config.json keys of architectures the importer does not model (DeepSeek V2/V3: routed and shared experts under
# other names, MoE layer frequency, multi-head latent attention): their presence is an error, not a silent
# llama-style reading.
UNREAD_ARCHITECTURE_KEYS = (
    "n_routed_experts",
    "n_shared_experts",
    "moe_layer_freq",
    "first_k_dense_replace",
    "kv_lora_rank",
    "q_lora_rank",
)

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gpt2",
    "gpt_neox",
)

_SEQ_CAP = 8192
_GATED_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu"}
_PLAIN_ACTS = {"gelu": "gelu", "gelu_new": "gelu", "gelu_fast": "gelu", "relu": "relu", "gelu_pytorch_tanh": "gelu"}


def load_hf_config(path: Path) -> ModelSpec:
    """Read ``config.json`` at ``path``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(str(path), "file not found", "check the path") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"{path}: line {err.lineno}", f"not valid JSON ({err.msg})", "fix the syntax") from None
    name = path.parent.name if path.name == "config.json" else path.stem
    return model_from_hf_config(data, str(path), name=name or "hf-model")


def model_from_hf_config(data: Any, where: str, *, name: str) -> ModelSpec:
    """Translate a parsed Hugging Face config into a :class:`ModelSpec`.

    Examples
    --------
    >>> cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...        "intermediate_size": 128, "vocab_size": 100, "hidden_act": "silu"}
    >>> model_from_hf_config(cfg, "config.json", name="tiny").gated_mlp
    True
    """
    f = Fields(data, where)
    model_type = str(f.data.get("model_type", "")).lower()
    if model_type == "gpt2":
        return _gpt2(f, name)
    if model_type == "gpt_neox":
        return _neox(f, name)
    for key in UNREAD_ARCHITECTURE_KEYS:
        if f.data.get(key) is not None:
            # A llama-style reading of such a file would be a different, much smaller model, with no error.
            raise f.error(
                key,
                f"model_type {model_type or '(none)'!r} has an architecture this importer does not read "
                "(DeepSeek-style routed and shared experts or multi-head latent attention)",
                "write a clustersim model YAML for it (models/*.yaml show the fields)",
            )
    if model_type and model_type not in SUPPORTED_MODEL_TYPES and "hidden_size" not in f.data:
        raise f.error(
            "model_type",
            f"unsupported model_type {model_type!r}",
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}; or write a clustersim model YAML",
        )
    return _llama_like(f, name, model_type)


# ModelSpec field -> the config.json key it was read from, so cross-field errors name the file's own key.
_LLAMA_KEYS = {
    "kv_heads": "num_key_value_heads",
    "heads": "num_attention_heads",
    "gated_mlp": "hidden_act",
    "moe.first_dense_layers": "mlp_only_layers",
}
_GPT2_KEYS = {"kv_heads": "n_head", "heads": "n_head"}
_NEOX_KEYS = {"kv_heads": "num_attention_heads", "heads": "num_attention_heads"}


def _respec(err: SpecError, f: Fields, keys: dict[str, str]) -> SpecError:
    """A ModelSpec error re-located at the config.json key that caused it (a reader's own error already is)."""
    if err.where.startswith(f"{f.where}: "):
        return err
    return SpecError(f"{f.where}: {keys.get(err.where, err.where)}", err.what, err.fix)


def _seq(f: Fields, key: str) -> int:
    value = f.integer(key, 2048, minimum=1)
    return int(min(value, _SEQ_CAP))


def _llama_like(f: Fields, name: str, model_type: str) -> ModelSpec:
    hidden = f.integer("hidden_size", minimum=1)
    heads = f.integer("num_attention_heads", minimum=1)
    act = str(f.raw("hidden_act", "silu")).lower()
    if act not in _GATED_ACTS:
        raise f.error("hidden_act", f"unsupported activation {act!r} for a gated MLP", "use silu or gelu")
    moe = _moe(f, model_type)
    ffn = f.integer("intermediate_size", 0, minimum=1) if moe is not None else f.integer("intermediate_size", minimum=1)
    if moe is not None and not ffn:
        ffn = moe.expert_ffn_hidden
    bias = bool(f.raw("attention_bias", False)) and bool(f.raw("mlp_bias", False))
    try:
        return ModelSpec(
            name=name,
            layers=f.integer("num_hidden_layers", minimum=1),
            hidden=hidden,
            heads=heads,
            kv_heads=f.integer("num_key_value_heads", heads, minimum=1),
            head_dim=f.integer("head_dim", 0, minimum=1),
            ffn_hidden=ffn,
            vocab=f.integer("vocab_size", minimum=1),
            gated_mlp=True,
            activation=_GATED_ACTS[act],
            norm="rmsnorm",
            tied_embeddings=bool(f.raw("tie_word_embeddings", False)),
            position_embedding="rope",
            bias=bias,
            dropout=False,
            seq_len=_seq(f, "max_position_embeddings"),
            moe=moe,
            source=f"Hugging Face config.json ({model_type or 'llama-style'}): {f.where}",
        )
    except SpecError as err:
        raise _respec(err, f, _LLAMA_KEYS) from None


def _moe(f: Fields, model_type: str) -> MoESpec | None:
    data = f.data
    # Mixtral names the expert count num_local_experts, Qwen-MoE and DeepSeek num_experts; 0 or null: dense.
    count_key = "num_local_experts" if data.get("num_local_experts") else "num_experts"
    f.used.update(("num_local_experts", "num_experts"))
    if not data.get(count_key):
        return None
    experts = f.integer(count_key, minimum=1)
    top_k = f.integer("num_experts_per_tok", minimum=1)
    if top_k > experts:
        raise f.error(
            "num_experts_per_tok",
            f"must be <= the number of experts: num_experts_per_tok={top_k}, experts={experts}",
            "check the config (top-k routing picks k of the experts)",
        )
    ffn_key = "moe_intermediate_size" if data.get("moe_intermediate_size") else "intermediate_size"
    if data.get(ffn_key) is None:
        raise f.error("moe_intermediate_size", "is required but missing", "add the expert FFN size")
    expert_ffn = f.integer(ffn_key, minimum=1)
    f.used.update(("moe_intermediate_size",))
    shared_ffn = f.integer("shared_expert_intermediate_size", 0, minimum=0)
    step = f.integer("decoder_sparse_step", 1, minimum=1)
    dense_layers = f.int_list("mlp_only_layers", (), minimum=0)
    # Qwen2-MoE/Qwen3-MoE make layer i sparse when (i + 1) % decoder_sparse_step == 0 (transformers
    # modeling_qwen2_moe.py): layers step-1, 2·step-1, ..., i.e. step-1 leading dense layers, then every step-th.
    first_dense = max(f.integer("first_k_dense_replace", 0, minimum=0), step - 1)
    if dense_layers:
        # Only a leading block of dense layers is representable; Qwen's released models leave it empty.
        first_dense = max(first_dense, len(dense_layers))
    return MoESpec(
        num_experts=experts,
        top_k=top_k,
        expert_ffn_hidden=expert_ffn,
        shared_experts=1 if shared_ffn else 0,
        shared_expert_ffn_hidden=shared_ffn,
        layer_frequency=step,
        first_dense_layers=first_dense,
        capacity_factor=None,
    )


def _gpt2(f: Fields, name: str) -> ModelSpec:
    hidden = f.integer("n_embd", minimum=1)
    act = str(f.raw("activation_function", "gelu_new")).lower()
    try:
        return ModelSpec(
            name=name,
            layers=f.integer("n_layer", minimum=1),
            hidden=hidden,
            heads=f.integer("n_head", minimum=1),
            ffn_hidden=f.integer("n_inner", 4 * hidden, minimum=1),
            vocab=f.integer("vocab_size", minimum=1),
            gated_mlp=False,
            activation=_PLAIN_ACTS.get(act, "gelu"),
            norm="layernorm",
            tied_embeddings=True,
            position_embedding="learned",
            bias=True,
            dropout=True,
            seq_len=_seq(f, "n_positions"),
            source=f"Hugging Face config.json (gpt2): {f.where}",
        )
    except SpecError as err:
        raise _respec(err, f, _GPT2_KEYS) from None


def _neox(f: Fields, name: str) -> ModelSpec:
    hidden = f.integer("hidden_size", minimum=1)
    act = str(f.raw("hidden_act", "gelu")).lower()
    try:
        return ModelSpec(
            name=name,
            layers=f.integer("num_hidden_layers", minimum=1),
            hidden=hidden,
            heads=f.integer("num_attention_heads", minimum=1),
            ffn_hidden=f.integer("intermediate_size", 4 * hidden, minimum=1),
            vocab=f.integer("vocab_size", minimum=1),
            gated_mlp=False,
            activation=_PLAIN_ACTS.get(act, "gelu"),
            norm="layernorm",
            tied_embeddings=bool(f.raw("tie_word_embeddings", False)),
            position_embedding="rope",
            bias=True,
            dropout=False,
            seq_len=_seq(f, "max_position_embeddings"),
            source=f"Hugging Face config.json (gpt_neox): {f.where}",
        )
    except SpecError as err:
        raise _respec(err, f, _NEOX_KEYS) from None
