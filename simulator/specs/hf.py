"""Import a Hugging Face ``config.json`` as a :class:`ModelSpec`.

Users already have these files on disk, so ``--model path/to/config.json`` works wherever a model name
does. Supported families (by ``model_type``): ``llama``, ``mistral``, ``mixtral``, ``qwen2``,
``qwen2_moe``, ``qwen3``, ``qwen3_moe``, ``gpt2``, ``gpt_neox``; any other ``model_type`` is refused
rather than read the Llama way (a BERT or T5 file would silently become a different model). A file
without ``model_type`` is placed by its ``architectures`` class name, and read the Llama way when it
has neither. Booleans must be JSON ``true``/``false``, activations ones the family's MLP can be modelled
with, and an error that :class:`ModelSpec` raises names the config.json key the value came from. Field
meanings follow the ``transformers`` configuration classes of those families (``LlamaConfig``,
``MixtralConfig``, ``Qwen3MoeConfig``, ``GPT2Config``, ``GPTNeoXConfig``).
The default training sequence length is ``max_position_embeddings`` capped at 8192, because long-context
maxima (131072 for Llama 3.1) are rarely the pre-training length; pass ``--seq-len`` to override. GPT-2's is
``n_positions``, uncapped: its learned position table has that many rows.
Biases: a model spec has one flag for every linear layer's bias, set where a config sets both ``attention_bias`` and
``mlp_bias``; Qwen2's q/k/v-only biases, either flag alone and Qwen3's q/k norms are left out (each under 0.002% of
the parameters, and no GEMM FLOPs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from simulator.errors import SpecError, not_utf8
from simulator.specs._fields import Fields
from simulator.specs._yaml import read_spec_bytes
from simulator.specs.model import MAX_LAYERS, ModelSpec, MoESpec

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

# ``architectures`` class-name prefixes of the supported families (longest first), for files without model_type.
_ARCHITECTURE_PREFIXES = (
    ("Qwen2Moe", "qwen2_moe"),
    ("Qwen3Moe", "qwen3_moe"),
    ("Qwen2", "qwen2"),
    ("Qwen3", "qwen3"),
    ("Mixtral", "mixtral"),
    ("Mistral", "mistral"),
    ("Llama", "llama"),
    ("GPTNeoX", "gpt_neox"),
    ("GPT2", "gpt2"),
)

# The default sequence length of an imported config: its max_position_embeddings up to this many tokens. Long-context
# maxima (128k for Llama 3.1) are what a model was extended to, rarely what it was pre-trained at (Llama 3: 8,192,
# Dubey et al. 2024, Sec. 3.4.1); --seq-len sets any other.
_SEQ_CAP = 8192
# Activation names of transformers' ACT2FN that the ModelSpec activations can stand for. The GELU
# approximations (tanh, sigmoid) cost the same elementwise pass as the exact one.
_GELUS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python", "gelu_accurate", "quick_gelu")
_GATED_ACTS = {"silu": "swiglu", "swish": "swiglu", **dict.fromkeys(_GELUS, "geglu")}
_PLAIN_ACTS = {
    **dict.fromkeys(_GELUS, "gelu"),
    "relu": "relu",
    "relu2": "squared_relu",
    "silu": "silu",
    "swish": "silu",
}


def load_hf_config(path: Path) -> ModelSpec:
    """Read ``config.json`` at ``path``."""
    where = str(path)
    try:
        raw = read_spec_bytes(path)
    except FileNotFoundError:
        raise SpecError(where, "file not found", "check the path") from None
    except OSError as err:
        raise SpecError(where, f"cannot be read ({err.strerror or err})", "check the path and permissions") from None
    try:
        text = raw.decode("utf-8-sig")  # JSON is UTF-8 (RFC 8259); a leading byte-order mark is tolerated
    except UnicodeDecodeError:
        raise SpecError(where, not_utf8(raw), "save the config.json as UTF-8 JSON, as Hugging Face writes it") from None
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except SpecError as err:
        raise SpecError(f"{where}: {err.where}", err.what, err.fix) from None
    except json.JSONDecodeError as err:
        raise SpecError(f"{path}: line {err.lineno}", f"not valid JSON ({err.msg})", "fix the syntax") from None
    except (ValueError, RecursionError) as err:  # a number of over 4300 digits, arrays nested thousands deep
        raise SpecError(where, f"not a JSON file this importer can read ({err})", "fix the file") from None
    name = path.parent.name if path.name == "config.json" else path.stem
    return model_from_hf_config(data, where, name=name or "hf-model")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: a repeated key (which json.loads lets the last one win,
    silently) is an error, as the YAML reader makes it."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SpecError(key, "appears twice in one object", "keep one of them")
        out[key] = value
    return out


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
    text = f.data.get("text_config") if isinstance(f.data, Mapping) else None
    if isinstance(text, Mapping) and f.data.get("hidden_size") is None:
        # A vision-language checkpoint (Mistral 3, LLaVA, Qwen2-VL...): its language model is a config of its own.
        raise f.error(
            "text_config",
            "the language model's fields are under text_config (a multimodal checkpoint's config), not at the top",
            "save the text_config object as a config.json of its own (it names its own model_type) and give that",
        )
    model_type = _model_type(f)
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
    if model_type and model_type not in SUPPORTED_MODEL_TYPES:
        # Read the Llama way, a BERT or T5 file would become a gated, RMSNorm, rotary model without a word.
        raise f.error(
            "model_type",
            f"unsupported model_type {model_type!r}",
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}; or write a clustersim model YAML",
        )
    return _llama_like(f, name, model_type)


# Keys of a supported family's config.json (transformers' GPT2Config and GPTNeoXConfig attribute names) that a
# Llama-style file lacks: a file without model_type or architectures that carries them is not a Llama, and is
# refused with the family named. GPT-2's are shared by families this importer does not read (GPT-J and CodeGen,
# which also have rotary_dim; BLOOM's n_layer and n_head), so the fix names them too.
_FAMILY_MARK_KEYS = (
    ("gpt2", ("n_embd", "n_layer", "n_head"), "GPT-J, CodeGen and BLOOM use these keys too and are not supported"),
    ("gpt_neox", ("rotary_pct", "use_parallel_residual"), ""),
)


def _model_type(f: Fields) -> str:
    """The lower-case ``model_type``; without one, the family its ``architectures`` class names, or ``""``."""
    value = f.raw("model_type", None)
    if value is not None:
        if not isinstance(value, str):
            raise f.error("model_type", f"must be text, got {value!r}", 'write it in quotes, like "llama"')
        return value.strip().lower()
    classes = f.raw("architectures", None)
    if classes is None:
        for family, marks, shared in _FAMILY_MARK_KEYS:
            found = [k for k in marks if k in f.data]
            if found:
                # Read the Llama way, such a file fails on a missing hidden_size, or is silently another model.
                raise f.error(
                    "model_type",
                    f"is missing, and the keys {', '.join(found)} are not a Llama's",
                    f'if it is {family}, add "model_type": "{family}" (or the architectures list the checkpoint '
                    f"has){f'; {shared}' if shared else ''}; otherwise write a clustersim model YAML",
                )
        return ""  # read the Llama way, as documented
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise f.error("architectures", f"must be a list of class names, got {classes!r}", 'write ["LlamaForCausalLM"]')
    for prefix, family in _ARCHITECTURE_PREFIXES:
        if classes[0].startswith(prefix):
            return family
    raise f.error(
        "model_type",
        f"is missing, and architectures {classes[0]!r} is not one of the supported families",
        f"add the model_type; supported: {', '.join(SUPPORTED_MODEL_TYPES)}; or write a clustersim model YAML",
    )


def _flag(f: Fields, key: str, default: bool) -> bool:
    """A JSON boolean (``"false"`` in quotes is text, which transformers would store as a true value)."""
    value = f.raw(key, default)
    if not isinstance(value, bool):
        raise f.error(key, f"must be true or false, got {value!r}", "write true or false without quotes")
    return value


def _activation(f: Fields, key: str, default: str, table: dict[str, str], mlp: str) -> str:
    """The ModelSpec activation of the config's activation name ``key``, refusing names it cannot stand for."""
    value = f.raw(key, default)
    if not isinstance(value, str):
        raise f.error(key, f"must be an activation name in quotes, got {value!r}", f"write one of: {', '.join(table)}")
    act = value.strip().lower()
    if act not in table:
        raise f.error(
            key,
            f"unsupported activation {act!r} for {mlp}",
            f"use one of: {', '.join(table)}; or write a clustersim model YAML",
        )
    return table[act]


def _respec(err: SpecError, f: Fields, keys: dict[str, str]) -> SpecError:
    """A ModelSpec error re-located at the config.json key that caused it (a reader's own error already is).

    ``keys`` maps a ModelSpec field (``layers``) to the key this file gave it in (``num_hidden_layers``).
    """
    if err.where.startswith(f"{f.where}: "):
        return err
    key = keys.get(err.where, err.where)
    if key == err.where:
        return SpecError(f"{f.where}: {key}", err.what, err.fix)
    return SpecError(f"{f.where}: {key}", f"{err.what} ({key} is clustersim's '{err.where}')", err.fix)


def _seq(f: Fields, key: str, default: int = 2048, *, cap: bool = True) -> int:
    """The default training length: the maximum positions (``default``, the family class's, where missing) capped
    at 8,192; not capped (``cap`` false) for a learned position table, whose rows the model's ``seq_len`` sizes."""
    value = f.integer(key, default, minimum=1)
    return int(min(value, _SEQ_CAP)) if cap else value


# ModelSpec field -> the config.json key it came from, so that a spec error names the file's own key. GPT-NeoX
# and the Llama family share the names; Llama adds grouped-query heads, an explicit head size and biases.
_NEOX_KEYS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_attention_heads",
    "ffn_hidden": "intermediate_size",
    "vocab": "vocab_size",
    "seq_len": "max_position_embeddings",
    "gated_mlp": "hidden_act",
    "activation": "hidden_act",
    "tied_embeddings": "tie_word_embeddings",
}
_LLAMA_KEYS = {**_NEOX_KEYS, "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "bias": "attention_bias"}
_GPT2_KEYS = {
    "layers": "n_layer",
    "hidden": "n_embd",
    "heads": "n_head",
    "kv_heads": "n_head",
    "ffn_hidden": "n_inner",
    "vocab": "vocab_size",
    "seq_len": "n_positions",
    "gated_mlp": "activation_function",
    "activation": "activation_function",
    "tied_embeddings": "tie_word_embeddings",
}


# Keys whose absence LlamaConfig fills by derivation (num_key_value_heads None: heads; head_dim None: hidden //
# heads) but these families' configuration classes fill with a constant of their own (MistralConfig's and
# MixtralConfig's num_key_value_heads is 8, Qwen3Config's head_dim 128; transformers ``configuration_*.py``).
# Released configs always carry them, so a file without one is refused rather than read the Llama way, which made
# Mistral 7B 8.05B instead of 7.25B.
_UNDERIVED_KEYS = {
    "mistral": ("num_key_value_heads",),
    "mixtral": ("num_key_value_heads",),
    "qwen2": ("num_key_value_heads",),
    "qwen2_moe": ("num_key_value_heads",),
    "qwen3": ("num_key_value_heads", "head_dim"),
    "qwen3_moe": ("num_key_value_heads", "head_dim"),
}


def _llama_like(f: Fields, name: str, model_type: str) -> ModelSpec:
    hidden = f.integer("hidden_size", minimum=1)
    heads = f.integer("num_attention_heads", minimum=1)
    for key in _UNDERIVED_KEYS.get(model_type, ()):
        if f.raw(key, None) is None:
            raise f.error(
                key,
                f"is required for model_type {model_type!r} but missing (its transformers configuration class "
                "gives it a constant, not the Llama derivation from the heads)",
                f"add {key} from the checkpoint's config.json",
            )
    activation = _activation(f, "hidden_act", "silu", _GATED_ACTS, "a gated MLP")
    keys = dict(_LLAMA_KEYS)  # _moe adds the MoE fields' keys
    moe = _moe(f, model_type, keys)
    ffn = f.integer("intermediate_size", 0, minimum=1) if moe is not None else f.integer("intermediate_size", minimum=1)
    if moe is not None and not ffn:
        ffn = moe.expert_ffn_hidden
        keys["ffn_hidden"] = keys["moe.expert_ffn_hidden"]
    _refuse_sliding_window(f, model_type)
    attention_bias, mlp_bias = _flag(f, "attention_bias", False), _flag(f, "mlp_bias", False)  # both checked
    bias = attention_bias and mlp_bias
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
            activation=activation,
            norm="rmsnorm",
            tied_embeddings=_flag(f, "tie_word_embeddings", False),
            position_embedding="rope",
            bias=bias,
            dropout=False,
            seq_len=_seq(f, "max_position_embeddings"),
            moe=moe,
            source=f"Hugging Face config.json ({model_type or 'llama-style'}): {f.where}",
        )
    except SpecError as err:
        raise _respec(err, f, keys) from None


# The model types whose every released config is a mixture of experts, and those whose model has no experts.
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _refuse_sliding_window(f: Fields, model_type: str) -> None:
    """Refuse a config whose attention is windowed (Mistral 7B v0.1: ``sliding_window`` 4096; Qwen2/Qwen3 only with
    ``use_sliding_window``): each token attends to the last W tokens only, which the graph does not model, so
    sequences longer than the window would be timed as full causal attention, silently."""
    window = f.raw("sliding_window", None)
    active = _flag(f, "use_sliding_window", False) if model_type.startswith("qwen") else window is not None
    if not active or window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise f.error("sliding_window", f"must be a token count or null, got {window!r}", "write a whole number")
    positions = f.raw("max_position_embeddings", None)
    if isinstance(positions, int) and not isinstance(positions, bool) and window >= positions:
        return  # no sequence the model takes is longer than the window: full causal attention
    raise f.error(
        "sliding_window",
        f"sliding-window attention ({window} tokens) is not modelled: sequences longer than the window would be "
        "timed as full causal attention",
        "set sliding_window to null to time full causal attention (the same up to the window, more beyond it)",
    )


# Which key holds an expert's FFN width. MixtralConfig has none of its own: its experts are intermediate_size wide.
# Qwen2MoeConfig and Qwen3MoeConfig keep intermediate_size for the dense layers (mlp_only_layers) and give the
# experts moe_intermediate_size, whose class defaults (1408, 768) a released config always overrides: a file
# without it is refused rather than timed with experts of the dense layers' width (4-24x too large).
_EXPERT_FFN_FIX = {
    "qwen2_moe": "add moe_intermediate_size, the experts' FFN width (transformers' Qwen2MoeConfig default: 1408)",
    "qwen3_moe": "add moe_intermediate_size, the experts' FFN width (transformers' Qwen3MoeConfig default: 768)",
    "mixtral": "add intermediate_size, the experts' FFN width (Mixtral's experts use it)",
}


def _expert_ffn_key(data: Mapping[str, Any], model_type: str) -> str:
    if model_type == "mixtral":
        return "intermediate_size"
    if model_type in _MOE_TYPES:
        return "moe_intermediate_size"
    # A llama-style file with experts and no family: the MoE key when it has one, else the one FFN width it has.
    return "moe_intermediate_size" if data.get("moe_intermediate_size") is not None else "intermediate_size"


def _moe(f: Fields, model_type: str, keys: dict[str, str]) -> MoESpec | None:
    """The MoE part, or None for a dense model; adds to ``keys`` the config keys of the MoE fields."""
    data = f.data
    # Mixtral names the expert count num_local_experts, Qwen-MoE and DeepSeek num_experts; 0 or null: dense.
    count_key = "num_local_experts" if data.get("num_local_experts") else "num_experts"
    f.used.update(("num_local_experts", "num_experts"))
    if model_type in _DENSE_TYPES and data.get(count_key):
        # LlamaForCausalLM (and Mistral's, Qwen2's, Qwen3's) has no experts and ignores the key: read as one, a
        # stray count would make the file a mixture of experts several times the checkpoint's size.
        raise f.error(
            count_key,
            f"model_type {model_type!r} has no experts, got {count_key}={data[count_key]!r}",
            "remove the key, or set the model_type of the mixture-of-experts family (mixtral, qwen2_moe, qwen3_moe)",
        )
    for key in ("num_local_experts", "num_experts") if model_type in _MOE_TYPES else ():
        value = data.get(key)
        if isinstance(value, bool) or (model_type == "mixtral" and value is not None):
            # false is no count; Mixtral's sparse block has no dense fallback (Qwen-MoE's reads 0 as dense layers).
            f.integer(key, minimum=1)
    if not data.get(count_key):
        absent = data.get("num_local_experts") is None and data.get("num_experts") is None  # missing or null
        if model_type in _MOE_TYPES and absent:
            # Mixtral's and Qwen-MoE's configs always carry the count; without it this would import the model
            # as a dense one of another size.
            key = "num_local_experts" if model_type == "mixtral" else "num_experts"
            raise f.error(key, f"is required for model_type {model_type!r} but missing", f"add {key} to the config")
        return None
    experts = f.integer(count_key, minimum=1)
    top_k = f.integer("num_experts_per_tok", minimum=1)
    if top_k > experts:
        raise f.error(
            "num_experts_per_tok",
            f"must be <= the number of experts: num_experts_per_tok={top_k}, experts={experts}",
            "check the config (top-k routing picks k of the experts)",
        )
    ffn_key = _expert_ffn_key(data, model_type)
    if data.get(ffn_key) is None:
        raise f.error(ffn_key, "is required but missing", _EXPERT_FFN_FIX.get(model_type, "add the expert FFN size"))
    expert_ffn = f.integer(ffn_key, minimum=1)
    if model_type != "mixtral":
        f.used.update(("moe_intermediate_size",))
    shared_ffn = f.integer("shared_expert_intermediate_size", 0, minimum=0)
    step = f.integer("decoder_sparse_step", 1, minimum=1)
    dense_layers = f.int_list("mlp_only_layers", (), minimum=0)
    leading = f.integer("first_k_dense_replace", 0, minimum=0)
    # Qwen2-MoE/Qwen3-MoE make layer i sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    # == 0 (transformers modeling_qwen2_moe.py). A model spec holds a leading block of dense layers, then every
    # step-th layer sparse: the sparse set must be that, starting at its first layer.
    # Bounded before the per-layer sets below are built (a layer count of 1e20 used to exhaust memory here; the
    # model spec bounds every other importer's layers the same way).
    layers = f.integer("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    dense = set(dense_layers) | set(range(min(leading, layers)))
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if not sparse:
        key = (
            "mlp_only_layers"
            if dense_layers
            else "first_k_dense_replace"
            if leading >= layers
            else "decoder_sparse_step"
        )
        raise f.error(
            key,
            f"leaves no MoE layer of the {layers} (decoder_sparse_step {step}, mlp_only_layers {sorted(dense_layers)})",
            "check the config; a model without MoE layers has no experts",
        )
    first_dense = sparse[0]
    if sparse != list(range(first_dense, layers, step)):
        key = "mlp_only_layers" if dense_layers else "decoder_sparse_step"
        raise f.error(
            key,
            f"leaves MoE layers {sparse} (decoder_sparse_step {step}, mlp_only_layers {sorted(dense_layers)}), which "
            "are not a leading block of dense layers followed by every step-th layer",
            "write a clustersim model YAML with the nearest moe.first_dense_layers and moe.layer_frequency",
        )
    first_dense_key = "mlp_only_layers" if dense_layers else "decoder_sparse_step"
    moe_keys = {
        "num_experts": count_key,
        "top_k": "num_experts_per_tok",
        "expert_ffn_hidden": ffn_key,
        "shared_experts": "shared_expert_intermediate_size",
        "shared_expert_ffn_hidden": "shared_expert_intermediate_size",
        "layer_frequency": "decoder_sparse_step",
        "first_dense_layers": first_dense_key,
    }
    keys.update({f"moe.{field}": key for field, key in moe_keys.items()})
    try:
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
    except SpecError as err:
        raise _respec(err, f, moe_keys) from None


def _gpt2(f: Fields, name: str) -> ModelSpec:
    hidden = f.integer("n_embd", minimum=1)
    activation = _activation(f, "activation_function", "gelu_new", _PLAIN_ACTS, "GPT-2's ungated MLP")
    try:
        return ModelSpec(
            name=name,
            layers=f.integer("n_layer", minimum=1),
            hidden=hidden,
            heads=f.integer("n_head", minimum=1),
            ffn_hidden=f.integer("n_inner", 4 * hidden, minimum=1),
            vocab=f.integer("vocab_size", minimum=1),
            gated_mlp=False,
            activation=activation,
            norm="layernorm",
            # GPT2Config leaves tie_word_embeddings at PretrainedConfig's default, true.
            tied_embeddings=_flag(f, "tie_word_embeddings", True),
            position_embedding="learned",
            bias=True,
            dropout=True,
            seq_len=_seq(f, "n_positions", 1024, cap=False),  # GPT2Config's default; the table has n_positions rows
            source=f"Hugging Face config.json (gpt2): {f.where}",
        )
    except SpecError as err:
        raise _respec(err, f, _GPT2_KEYS) from None


def _neox(f: Fields, name: str) -> ModelSpec:
    hidden = f.integer("hidden_size", minimum=1)
    activation = _activation(f, "hidden_act", "gelu", _PLAIN_ACTS, "GPT-NeoX's ungated MLP")
    try:
        return ModelSpec(
            name=name,
            layers=f.integer("num_hidden_layers", minimum=1),
            hidden=hidden,
            heads=f.integer("num_attention_heads", minimum=1),
            ffn_hidden=f.integer("intermediate_size", 4 * hidden, minimum=1),
            vocab=f.integer("vocab_size", minimum=1),
            gated_mlp=False,
            activation=activation,
            norm="layernorm",
            tied_embeddings=_flag(f, "tie_word_embeddings", False),
            position_embedding="rope",
            bias=True,
            dropout=False,
            seq_len=_seq(f, "max_position_embeddings"),
            source=f"Hugging Face config.json (gpt_neox): {f.where}",
        )
    except SpecError as err:
        raise _respec(err, f, _NEOX_KEYS) from None
