"""Model specs: dense and mixture-of-experts decoder-only transformers.

A :class:`ModelSpec` holds the architecture only (no batch, no parallelism). Parameter counts follow the
Megatron-LM layer layout: QKV and output projections, a two- or three-matrix MLP (gated MLPs such as SwiGLU
have three), two norms per layer, a final norm, token embeddings, an untied or tied output layer, and learned
position embeddings where the model uses them. Source for the per-layer count of a GPT layer
(12·h² + 13·h): Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters", SC21,
Sec. 5.1; grouped-query attention shrinks K and V to ``kv_heads`` heads (Ainslie et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simulator.errors import SpecError
from simulator.specs._fields import Fields, check_choices, check_count, check_ranges, check_scalar_types, fmt_number

__all__ = ["ACTIVATIONS", "MAX_LAYERS", "NORMS", "POSITION_EMBEDDINGS", "MoESpec", "ModelSpec"]

ACTIVATIONS = ("gelu", "relu", "squared_relu", "silu", "swiglu", "geglu")
NORMS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned", "rope", "alibi", "none")
# A guard, not physics: the deepest model the simulator builds. Every decoder layer is a node of the graph and
# of each pipeline chunk, so cost grows with depth; published transformers have at most a few hundred layers.
MAX_LAYERS = 10_000

# The keys of a model file and of its ``moe:`` mapping (Fields: a valid key is never suggested as a misspelling).
_MOE_KEYS = (
    "num_experts",
    "top_k",
    "expert_ffn_hidden",
    "shared_experts",
    "shared_expert_ffn_hidden",
    "layer_frequency",
    "first_dense_layers",
    "capacity_factor",
)
_MODEL_KEYS = (
    "name",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn_hidden",
    "vocab",
    "gated_mlp",
    "activation",
    "norm",
    "tied_embeddings",
    "position_embedding",
    "bias",
    "dropout",
    "seq_len",
    "description",
    "source",
    "sources",
    "moe",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class MoESpec:
    """Mixture-of-experts part of a model.

    ``capacity_factor`` of ``None`` means dropless routing (every token reaches its top-k experts); a number caps
    each expert's tokens at that many times its average and drops the rest (Megatron-Core's
    ``--moe-expert-capacity-factor``), which bounds the busiest rank's load however unbalanced the routing.
    MoE layers are those with index ``i >= first_dense_layers`` and ``(i - first_dense_layers) %
    layer_frequency == 0``.
    """

    num_experts: int
    top_k: int
    expert_ffn_hidden: int
    shared_experts: int = 0
    shared_expert_ffn_hidden: int = 0
    layer_frequency: int = 1
    first_dense_layers: int = 0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        check_scalar_types(self)
        check_ranges(self, {"num_experts": 1, "top_k": 1, "expert_ffn_hidden": 1, "layer_frequency": 1})
        check_ranges(self, {"shared_experts": 0, "shared_expert_ffn_hidden": 0, "first_dense_layers": 0})
        check_ranges(self, {"capacity_factor": 1.0}, "leave it out for dropless routing")
        if self.top_k > self.num_experts:
            raise SpecError(
                "top_k", f"must be <= num_experts: top_k={self.top_k}, num_experts={self.num_experts}", "lower top_k"
            )
        if self.shared_expert_ffn_hidden and not self.shared_experts:
            raise SpecError(
                "shared_expert_ffn_hidden",
                f"is {self.shared_expert_ffn_hidden} but shared_experts is 0, so it would be ignored",
                "give shared_experts (how many shared experts each MoE layer has), or remove the key",
            )
        if self.shared_experts and not self.shared_expert_ffn_hidden:
            # Checked here, not only when a file is read, so that a spec built in Python obeys the same rule.
            raise SpecError(
                "shared_expert_ffn_hidden",
                f"is required when shared_experts={self.shared_experts}",
                "give the FFN size of a shared expert",
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) is a MoE layer."""
        if index < self.first_dense_layers:
            return False
        return (index - self.first_dense_layers) % self.layer_frequency == 0

    @classmethod
    def from_fields(cls, f: Fields) -> MoESpec:
        """Build from the ``moe:`` mapping of a model file."""
        values = {
            "num_experts": f.integer("num_experts", minimum=1),
            "top_k": f.integer("top_k", minimum=1),
            "expert_ffn_hidden": f.integer("expert_ffn_hidden", minimum=1),
            "shared_experts": f.integer("shared_experts", 0, minimum=0),
            "shared_expert_ffn_hidden": f.integer("shared_expert_ffn_hidden", 0, minimum=0),
            "layer_frequency": f.integer("layer_frequency", 1, minimum=1),
            "first_dense_layers": f.integer("first_dense_layers", 0, minimum=0),
            "capacity_factor": f.number("capacity_factor", None, minimum=1.0),
        }
        try:
            spec = cls(**values)
        except SpecError as err:  # a cross-field rule (top_k <= num_experts, shared experts' size), located
            raise f.error(err.where, err.what, err.fix) from None
        f.done()
        return spec


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer.

    Examples
    --------
    >>> m = ModelSpec(name="tiny", layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=1000)
    >>> m.head_dim, m.kv_heads
    (16, 4)
    """

    name: str
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    kv_heads: int = 0  # 0 means "same as heads" (multi-head attention)
    head_dim: int = 0  # 0 means hidden // heads
    gated_mlp: bool = False
    activation: str = "gelu"
    norm: str = "layernorm"
    tied_embeddings: bool = False
    position_embedding: str = "learned"
    bias: bool = True
    dropout: bool = False
    seq_len: int = 2048
    moe: MoESpec | None = None
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        check_scalar_types(self)
        for name in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise SpecError(name, f"'{name}' must be >= 1, got {value}", f"give {name} as a positive whole number")
            if name != "layers":  # bounded far tighter below (MAX_LAYERS)
                check_count(name, value)
        if self.layers > MAX_LAYERS:
            got = fmt_number(self.layers) if self.layers >= 10**15 else f"{self.layers:,}"  # not 301 digits of 1e300
            raise SpecError(
                "layers",
                f"'layers' must be at most {MAX_LAYERS:,}, got {got}",
                "the simulator builds every decoder layer; give the model's real depth",
            )
        for name in ("kv_heads", "head_dim"):
            value = getattr(self, name)
            if value < 0:
                raise SpecError(
                    name, f"'{name}' must be >= 0, got {value}", f"give a positive {name}, or 0 for the default"
                )
            check_count(name, value)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0:
            if self.heads > 0 and self.hidden % self.heads:
                raise SpecError(
                    "heads",
                    f"'heads' must divide 'hidden': hidden={self.hidden}, heads={self.heads}",
                    "use a divisor of hidden, or give head_dim explicitly",
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _check_model(self)

    # -- derived sizes -------------------------------------------------------------------------------
    @property
    def attn_dim(self) -> int:
        """Width of the attention output (heads × head_dim); equals hidden for most models."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv_heads × head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return self.moe is not None

    @property
    def num_moe_layers(self) -> int:
        """How many decoder layers are MoE layers."""
        if self.moe is None:
            return 0
        return sum(1 for i in range(self.layers) if self.moe.is_moe_layer(i))

    def attention_params(self) -> int:
        """Parameters of one attention block (QKV, output projection, their biases)."""
        h = self.hidden
        weights = h * (self.attn_dim + 2 * self.kv_dim) + self.attn_dim * h
        biases = (self.attn_dim + 2 * self.kv_dim + h) if self.bias else 0
        return weights + biases

    def mlp_params(self, ffn: int | None = None) -> int:
        """Parameters of one dense MLP of width ``ffn`` (default: the model's)."""
        f = self.ffn_hidden if ffn is None else ffn
        mats = 3 if self.gated_mlp else 2
        biases = ((2 if self.gated_mlp else 1) * f + self.hidden) if self.bias else 0
        return mats * self.hidden * f + biases

    def norm_params(self) -> int:
        """Parameters of one norm (scale, plus shift for LayerNorm)."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def moe_params(self) -> tuple[int, int]:
        """(total, active per token) parameters of one MoE MLP block, router included."""
        assert self.moe is not None
        moe = self.moe
        router = self.hidden * moe.num_experts
        expert = self.mlp_params(moe.expert_ffn_hidden)
        # The shared experts are one MLP of their summed width (Megatron-Core's SharedExpertMLP; the graph builds it
        # so): with biases, one down-projection bias, not one per shared expert.
        shared = self.mlp_params(moe.shared_experts * moe.shared_expert_ffn_hidden) if moe.shared_experts else 0
        return router + moe.num_experts * expert + shared, router + moe.top_k * expert + shared

    def layer_params(self, index: int) -> tuple[int, int]:
        """(total, active) parameters of decoder layer ``index``."""
        base = self.attention_params() + 2 * self.norm_params()
        if self.moe is not None and self.moe.is_moe_layer(index):
            total, active = self.moe_params()
            return base + total, base + active
        dense = base + self.mlp_params()
        return dense, dense

    def embedding_params(self, seq_len: int = 0) -> int:
        """Input embedding (tokens, and positions when learned). A learned position table has a row per position
        up to the model's ``seq_len``, or up to ``seq_len`` when a run is longer: Megatron-LM refuses
        ``--seq-length`` above ``--max-position-embeddings`` (arguments.py), so such a run has a table that long."""
        positions = max(self.seq_len, seq_len)
        pos = positions * self.hidden if self.position_embedding == "learned" else 0
        return self.vocab * self.hidden + pos

    def output_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied to the input embedding)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def param_count(self) -> int:
        """Total parameters."""
        layers = sum(self.layer_params(i)[0] for i in range(self.layers))
        return layers + self.embedding_params() + self.output_params()

    def active_param_count(self) -> int:
        """Parameters used per token (differs from the total for MoE)."""
        layers = sum(self.layer_params(i)[1] for i in range(self.layers))
        return layers + self.embedding_params() + self.output_params()

    def to_mapping(self) -> dict[str, Any]:
        """The YAML form (inverse of :meth:`from_mapping`)."""
        out: dict[str, Any] = {
            "name": self.name,
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "ffn_hidden": self.ffn_hidden,
            "vocab": self.vocab,
            "gated_mlp": self.gated_mlp,
            "activation": self.activation,
            "norm": self.norm,
            "tied_embeddings": self.tied_embeddings,
            "position_embedding": self.position_embedding,
            "bias": self.bias,
            "dropout": self.dropout,
            "seq_len": self.seq_len,
        }
        # Derived defaults stay implicit, so that a --set of heads or hidden re-derives them.
        if self.kv_heads != self.heads:
            out["kv_heads"] = self.kv_heads
        if self.head_dim != self.hidden // self.heads or self.hidden % self.heads:
            out["head_dim"] = self.head_dim
        if self.description:
            out["description"] = self.description
        if self.source:
            out["source"] = self.source
        if self.moe is not None:
            moe = self.moe
            out["moe"] = {
                "num_experts": moe.num_experts,
                "top_k": moe.top_k,
                "expert_ffn_hidden": moe.expert_ffn_hidden,
                "shared_experts": moe.shared_experts,
                "shared_expert_ffn_hidden": moe.shared_expert_ffn_hidden,
                "layer_frequency": moe.layer_frequency,
                "first_dense_layers": moe.first_dense_layers,
                "capacity_factor": moe.capacity_factor,
            }
        return out

    def with_(self, **changes: Any) -> ModelSpec:
        """A copy with some model-file keys changed, derived sizes re-derived (``with_(hidden=6144)`` gives
        head_dim hidden / heads again, where ``dataclasses.replace`` would keep the old one and build another
        model); MoE keys go as ``**{"moe.top_k": 4}``. Checked like a model file.

        >>> from simulator.specs.library import load_model
        >>> load_model("gpt3-175b").with_(hidden=6144).head_dim
        64
        """
        data = self.to_mapping()
        for dotted, value in changes.items():
            target = data
            *parents, key = dotted.split(".")
            for part in parents:
                if not isinstance(target.get(part), dict):
                    raise SpecError(f"{self.name}: {dotted}", f"{part!r} is not a mapping here", "check the key")
                target = target[part]
            target[key] = value
        return ModelSpec.from_mapping(data, f"model {self.name} (with_)")

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Any, where: str) -> ModelSpec:
        """Build from a parsed model file.

        Raises
        ------
        SpecError
            On a missing or unknown key, a wrong type or an impossible value.
        """
        f = Fields(data, where, keys=_MODEL_KEYS)
        moe_fields = f.sub("moe", None, keys=_MOE_KEYS)
        heads = f.integer("heads", minimum=1)
        kwargs: dict[str, Any] = {
            "name": f.text("name"),
            "layers": f.integer("layers", minimum=1),
            "hidden": f.integer("hidden", minimum=1),
            "heads": heads,
            "kv_heads": f.integer("kv_heads", heads, minimum=1),
            "head_dim": f.integer("head_dim", 0, minimum=1),
            "ffn_hidden": f.integer("ffn_hidden", minimum=1),
            "vocab": f.integer("vocab", minimum=1),
            "gated_mlp": f.boolean("gated_mlp", False),
            "activation": f.choice("activation", ACTIVATIONS, "gelu"),
            "norm": f.choice("norm", NORMS, "layernorm"),
            "tied_embeddings": f.boolean("tied_embeddings", False),
            "position_embedding": f.choice("position_embedding", POSITION_EMBEDDINGS, "learned"),
            "bias": f.boolean("bias", True),
            "dropout": f.boolean("dropout", False),
            "seq_len": f.integer("seq_len", 2048, minimum=1),
            "description": f.text("description", ""),
            "source": f.text("source", ""),
            "moe": MoESpec.from_fields(moe_fields) if moe_fields is not None else None,
        }
        f.done(ignore=("sources",))
        try:
            return cls(**kwargs)
        except SpecError as err:
            raise SpecError(f"{where}: {err.where}", err.what, err.fix) from None


def _check_model(m: ModelSpec) -> None:
    """Cross-field rules; messages name the fields as the YAML spells them."""
    check_choices(m, {"activation": ACTIVATIONS, "norm": NORMS, "position_embedding": POSITION_EMBEDDINGS})
    if m.moe is not None and not isinstance(m.moe, MoESpec):
        raise SpecError("moe", f"must be a MoESpec or None, got {type(m.moe).__name__}", "build it with MoESpec(...)")
    if m.heads % m.kv_heads:
        raise SpecError(
            "kv_heads",
            f"'kv_heads' must divide 'heads': heads={m.heads}, kv_heads={m.kv_heads}",
            "use a divisor of heads (kv_heads = heads for multi-head attention)",
        )
    if m.gated_mlp != (m.activation in ("swiglu", "geglu")):
        raise SpecError(
            "gated_mlp",
            f"gated_mlp={str(m.gated_mlp).lower()} contradicts activation={m.activation}",
            "gated MLPs use swiglu or geglu; ungated ones gelu, relu, squared_relu or silu",
        )
    if m.moe is not None and m.moe.first_dense_layers >= m.layers:
        # With as many dense layers as layers, no layer has experts: the MoE block describes nothing (the HF
        # importer refuses the same for a config).
        raise SpecError(
            "moe.first_dense_layers",
            f"must be < layers (leave at least one MoE layer): first_dense_layers={m.moe.first_dense_layers}, "
            f"layers={m.layers}",
            "lower it, or remove the moe block for a dense model",
        )
