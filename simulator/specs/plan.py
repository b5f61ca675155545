"""The execution plan: how one training step is laid out on the GPUs.

Degrees follow Megatron-LM: ``num_gpus = tp · pp · dp · cp``; expert parallelism ``ep`` is carved out of
``dp · cp`` (it must divide it), or of ``tp · dp · cp`` with ``expert_tp`` 1 (MoE parallel folding, chosen where
ep does not divide dp · cp). ``vp`` is the number of model chunks per pipeline rank (interleaved 1F1B
when > 1). A knob set to ``None`` is *free*: :func:`simulator.run.simulate` chooses it (the fastest value
that fits in memory) and reports the choice. Free-able knobs are listed in :data:`FREE_KNOBS`. Other
knobs have defaults an experienced Megatron-LM user expects: the structural degrees (tp, pp, cp, ep) are 1
and ``dp`` is derived from the GPU count; ``sequence_parallel`` is on whenever tp > 1 (NeMo and Megatron
recommend it); ``tp_overlap`` (TE userbuffers overlap of TP collectives with GEMMs) is off; ``grad_dtype`` (the
dtype gradients are accumulated and reduced in) follows Megatron-LM: fp32 when training in bf16 or fp8
(``accumulate_allreduce_grads_in_fp32``), fp16 when training in fp16; ``schedule`` is
1F1B, interleaved when vp > 1; ``precision`` is bf16; ``attention`` is ``flash`` (the device's own fused
FlashAttention-style kernel, the fastest measured on it: FlashAttention-3 on Hopper, FlashAttention-2 on Ampere);
``flash2`` pins FlashAttention-2 (what a stack without FlashAttention-3 or cuDNN attention runs on Hopper);
``cudnn`` pins cuDNN's fused attention (what Transformer Engine prefers on Hopper);
``unfused`` is the explicit-softmax path Megatron-LM used before FlashAttention (Dao et al. 2022).
``cp_comm`` is how context parallelism exchanges keys and values (Megatron-Core's ``--cp-comm-type``, Transformer
Engine's ``cp_comm_type``): ``p2p`` (the default) passes KV blocks around a ring, overlapped with attention
steps; ``all_gather`` gathers the whole sequence's KV before attention and reduce-scatters its gradient after
(exposed; Llama 3, Dubey et al. 2024, Sec. 3.3.2); ``a2a`` trades sequence for heads with all-to-alls around
attention (DeepSpeed-Ulysses, Jacobs et al. 2023), which needs cp to divide the heads of each TP rank.
``grad_accum_fusion`` is on: the weight-gradient GEMMs accumulate straight into the gradient buffer across
micro-batches (Megatron-LM ``--gradient-accumulation-fusion``, the default since 2022, and Megatron-Core's
``grad_added_to_main_grad``); off, every micro-batch's backward adds each parameter's fresh 16-bit gradient
into the buffer in a separate kernel (Megatron-LM's 2021 ``param_hook``: ``main_grad.add_(grad)``; PyTorch
autograd's own accumulation behaves alike), reading the gradient and the buffer and writing the buffer.
``align_grad_reduce`` (on by default, as Megatron-Core's ``--no-align-grad-reduce`` leaves it) shapes overlapped
gradient reduction with pipeline parallelism: without interleaving only the first stage reduces during its last
backward and the others after theirs; with interleaving stage s launches a chunk's buckets together s backward
passes after that chunk's last one (:class:`simulator.engine.pipeline.PipelineInput`). Off, every stage reduces
during the last backward of each chunk. Either way only the first stage's first chunk is split into buckets, as
Megatron-Core's DDP does (``bucket_size`` none for pipeline ranks > 0 and later chunks; ``run._chunk_bucket_params``).
``param_gather_at_step_start`` (off by default) is when, without interleaving, a stage dispatches the all-gather of
its first parameter bucket under a sharded optimizer with ``grad_overlap``. Off, as Megatron-Core does since its
bucket groups (0.9, NeMo 24.09 on): nothing dispatches it before the stage's first forward, whose pre-hook starts it
and waits for it (``finish_param_sync``: "If current bucket's param AG has not been dispatched, dispatch it now
(e.g., first AG bucket in first model chunk if ddp_config.align_param_gather is False)"; Megatron-LM forces
``align_param_gather`` off without interleaving), so each stage's first forward waits for a gather that starts when
its input arrives, and later stages hold one bucket of their whole chunk. On, as Megatron-Core 0.8 and earlier did
(``DistributedOptimizer.zero_grad``: "launch all-gather for first accessed bucket here before forward compute is
initiated") and apex's ``DistributedFusedAdam`` (its first parameter sync overlaps the optimizer step, NVIDIA/apex
PR #1621): every stage's first bucket is dispatched with the step, so the pipeline fill hides it on later stages.
With interleaving the schedule dispatches the gathers itself (``align_param_gather``) and this knob does nothing.
``grad_accum_upcast_copy`` (off by default; only with ``grad_accum_fusion`` off) makes that separate accumulation
two kernels, as DeepSpeed's ``BF16_Optimizer`` runs it after every micro-batch's backward
(``deepspeed/runtime/bf16_optimizer.py``, ``update_hp_grads``: ``hp_grad.add_(lp.grad.to(hp_grad.dtype))``): a
copy of the 16-bit gradient cast up to the buffer's dtype, then the add, 8 more bytes per parameter with an fp32
buffer; the copy of the largest parameter tensor is a transient buffer. With a 16-bit buffer the cast is a no-op.
The 16-bit gradients themselves stay allocated after it (``backward`` calls ``update_hp_grads(clear_lp_grads=False)``
and frees them only when the next backward starts, ``clear_lp_grads``), so every local parameter also holds 2 bytes
of 16-bit gradient beside the buffer (:func:`simulator.cost.memory.stage_memory`).
``fp8_param`` (off by default, as Megatron-Core's ``--fp8-param-gather``; NeMo's ``fp8_params``; Megatron-Bridge's
FP8 recipes turn it on) keeps the weights of the FP8 GEMMs in FP8 only when training in FP8: no 16-bit copy
beside Transformer Engine's quantized one, and the distributed optimizer gathers them in 1 byte instead of 2.
Off, Transformer Engine caches FP8 copies next to the 16-bit weights
(:data:`simulator.cost.memory.FP8_WEIGHT_CACHE_BYTES`).
It needs the distributed optimizer or FSDP (``zero_stage`` 1 or more; Megatron-LM asserts "--fp8-param-gather only
supported with distributed optimizer") and does nothing in 16-bit training.
``vocab_divisible_by`` is Megatron-LM's ``--make-vocab-size-divisible-by`` (default 128, also NeMo's): the
embedding and output layer are built for the vocabulary padded up to a multiple of it times tp
(``_vocab_size_with_padding``: Llama 3's 128,256 tokens become 129,024 at tp 8), which is what they hold and
compute; 1 pads only to a multiple of tp, which the vocab-parallel layers need (frameworks that do not pad, such
as Composer/llm-foundry without TP).
``layers_at_start_in_bf16`` and ``layers_at_end_in_bf16`` (0 by default) keep that many decoder layers at the start
and at the end of the model in BF16 when training in FP8, as Megatron-Core's ``--first-last-layers-bf16`` with
``--num-layers-at-start-in-bf16`` / ``--num-layers-at-end-in-bf16`` (``is_first_last_bf16_layer`` in
``megatron/core/fp8_utils.py``): their GEMMs run in 16 bits, with no FP8 casts, no cached FP8 weights and 16-bit saved
inputs. Megatron-Bridge's FP8 current-scaling recipe sets 1 and 1 for training, while its performance scripts turn
it off. They do nothing outside FP8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, replace
from typing import Any

from simulator.errors import SpecError
from simulator.specs._fields import MISSING, Fields, check_choices, check_ranges, check_scalar_types, did_you_mean
from simulator.specs.calibration import ATTENTION_CLASSES
from simulator.units import fmt_knob

__all__ = [
    "ATTENTION",
    "CP_COMM",
    "FREE_KNOBS",
    "GRAD_DTYPES",
    "PRECISIONS",
    "RECOMPUTE",
    "SCHEDULES",
    "TRAINING_KNOBS",
    "PlanSpec",
    "read_knob",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp16", "bf16", "fp8")
ATTENTION = (*ATTENTION_CLASSES, "unfused")  # the fused kernels with a calibration class, then unfused
GRAD_DTYPES = ("fp32", "bf16", "fp16")
CP_COMM = ("p2p", "all_gather", "a2a")
FREE_KNOBS = ("micro_batch", "vp", "recompute", "grad_overlap")

AUTO = ("auto", "free", "")  # what a plan value may say to leave a knob to the simulator
# Knobs a plan file may leave to 'auto' besides the free ones: each follows from the rest of the plan (dp from the
# GPU count, expert_tp from ep and dp, the schedule from vp, sequence parallelism from tp, the gradient dtype
# from the precision, the sequence length from the model).
AUTO_DERIVED = ("dp", "expert_tp", "schedule", "sequence_parallel", "grad_dtype", "seq_len")

# How a plan file's training knobs are read and checked; software_stacks.yaml entries use the same rules.
_KNOB_READERS: dict[str, Any] = {
    "vp": lambda f, key, default: f.integer(key, default, minimum=1),
    "micro_batch": lambda f, key, default: f.integer(key, default, minimum=1),
    "sequence_parallel": lambda f, key, default: f.boolean(key, default),
    "zero_stage": lambda f, key, default: f.integer(key, default, minimum=0, maximum=3),
    "grad_overlap": lambda f, key, default: f.boolean(key, default),
    "tp_overlap": lambda f, key, default: f.boolean(key, default),
    "grad_accum_fusion": lambda f, key, default: f.boolean(key, default),
    "align_grad_reduce": lambda f, key, default: f.boolean(key, default),
    "grad_accum_upcast_copy": lambda f, key, default: f.boolean(key, default),
    "param_gather_at_step_start": lambda f, key, default: f.boolean(key, default),
    "fp8_param": lambda f, key, default: f.boolean(key, default),
    "vocab_divisible_by": lambda f, key, default: f.integer(key, default, minimum=1),
    "layers_at_start_in_bf16": lambda f, key, default: f.integer(key, default, minimum=0),
    "layers_at_end_in_bf16": lambda f, key, default: f.integer(key, default, minimum=0),
    "grad_dtype": lambda f, key, default: f.choice(key, GRAD_DTYPES, default),
    "attention": lambda f, key, default: f.choice(key, ATTENTION, default),
    "cp_comm": lambda f, key, default: f.choice(key, CP_COMM, default),
}


TRAINING_KNOBS = tuple(_KNOB_READERS)  # the knobs read_knob reads

# The other fields of a plan file: its layout, batch, sequence and what-if factors.
_LAYOUT_READERS: dict[str, Any] = {
    "tp": lambda f, key, default: f.integer(key, default, minimum=1),
    "pp": lambda f, key, default: f.integer(key, default, minimum=1),
    "dp": lambda f, key, default: f.integer(key, default, minimum=1),
    "cp": lambda f, key, default: f.integer(key, default, minimum=1),
    "ep": lambda f, key, default: f.integer(key, default, minimum=1),
    "expert_tp": lambda f, key, default: f.integer(key, default, minimum=1),
    "schedule": lambda f, key, default: f.choice(key, SCHEDULES, default),
    "global_batch": lambda f, key, default: f.integer(key, default, minimum=1),
    "seq_len": lambda f, key, default: f.integer(key, default, minimum=1),
    "recompute": lambda f, key, default: f.choice(key, RECOMPUTE, default),
    "recompute_layers": lambda f, key, default: f.integer(key, default, minimum=1),
    "precision": lambda f, key, default: f.choice(key, PRECISIONS, default),
    "expert_imbalance": lambda f, key, default: f.number(key, default, minimum=1.0),
    "straggler_factor": lambda f, key, default: f.number(key, default, minimum=1.0),
}


def read_knob(fields: Fields, key: str, default: Any = MISSING) -> Any:
    """One training knob (``vp``, ``micro_batch``, ``zero_stage``, ``attention``...), checked as in a plan file."""
    return _KNOB_READERS[key](fields, key, default)


_CHOICES = {
    "schedule": SCHEDULES,
    "recompute": RECOMPUTE,
    "precision": PRECISIONS,
    "grad_dtype": GRAD_DTYPES,
    "attention": ATTENTION,
    "cp_comm": CP_COMM,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSpec:
    """One parallel layout and its training knobs; ``None`` marks a free knob.

    Examples
    --------
    >>> PlanSpec(tp=8, pp=8, dp=16, global_batch=1536).num_gpus
    1024
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    # Tensor parallelism inside the experts (Megatron-Core's --expert-tensor-parallel-size): None is Megatron's
    # default, tp, unless ep does not divide dp·cp; then 1, MoE parallel folding (experts spread over the
    # tp·dp·cp ranks of a stage, Liu et al. 2025, arXiv:2504.14960). 1 or tp.
    expert_tp: int | None = None
    vp: int | None = None
    schedule: str | None = None
    micro_batch: int | None = None
    global_batch: int
    seq_len: int | None = None  # None: the model's default
    sequence_parallel: bool | None = None
    recompute: str | None = None
    # With full recomputation, how many decoder layers of each model chunk recompute (Megatron-LM's
    # --recompute-method block --recompute-num-layers N: the first N layers of the chunk; the others keep their
    # activations). None: every layer (Megatron's uniform method with one layer per checkpoint).
    recompute_layers: int | None = None
    zero_stage: int = 0
    grad_overlap: bool | None = None
    tp_overlap: bool | None = None
    grad_accum_fusion: bool = True
    align_grad_reduce: bool = True  # pipeline stages launch overlapped reductions as Megatron-Core does (docstring)
    grad_accum_upcast_copy: bool = False  # the separate accumulation casts to a copy first (module docstring)
    param_gather_at_step_start: bool = False  # vp 1: first parameter bucket gathered with the step (docstring)
    fp8_param: bool = False  # FP8 GEMM weights kept in FP8 only (module docstring)
    vocab_divisible_by: int = 128  # the vocabulary is padded to a multiple of this times tp (module docstring)
    layers_at_start_in_bf16: int = 0  # FP8 runs: first decoder layers kept in BF16 (module docstring)
    layers_at_end_in_bf16: int = 0  # FP8 runs: last decoder layers kept in BF16
    precision: str = "bf16"
    grad_dtype: str | None = None  # None: Megatron-LM's default for the precision (see grad_bytes)
    attention: str = "flash"
    cp_comm: str = "p2p"  # how context parallelism moves KV: p2p ring, all_gather or a2a (module docstring)
    expert_imbalance: float = 1.0
    straggler_factor: float = 1.0

    def __post_init__(self) -> None:
        # Every field is checked here, so a plan built in Python (a sweep over a DataFrame, say) gets the same
        # SpecError as one read from a file; numpy integers, floats and booleans become Python ones.
        check_choices(self, _CHOICES, optional=("schedule", "recompute", "grad_dtype"))
        check_scalar_types(self)
        check_ranges(self, {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "global_batch": 1}, "use a positive degree")
        check_ranges(self, {"vp": 1, "micro_batch": 1, "seq_len": 1, "recompute_layers": 1, "expert_tp": 1})
        check_ranges(self, {"vocab_divisible_by": 1}, "use 1 for no padding")
        check_ranges(self, {"layers_at_start_in_bf16": 0, "layers_at_end_in_bf16": 0}, "use 0 for all layers in FP8")
        check_ranges(self, {"expert_imbalance": 1.0, "straggler_factor": 1.0}, "1 means no slowdown")
        if not 0 <= self.zero_stage <= 3:
            raise SpecError("zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}", "pick a ZeRO stage")
        if self.expert_tp is not None and self.expert_tp not in (1, self.tp):
            raise SpecError(
                "expert_tp",
                f"must be 1 or tp ({self.tp}), got {self.expert_tp}",
                "use 1 (MoE parallel folding) or tp, or leave it out",
            )
        if self.recompute_layers is not None and self.recompute != "full":
            got = "is not set" if self.recompute is None else f"is {self.recompute}"
            raise SpecError(
                "recompute_layers",
                f"applies to recompute full only, but recompute {got} (recompute_layers={self.recompute_layers})",
                "add recompute: full (--recompute full), or leave recompute_layers out",
            )
        if self.grad_accum_upcast_copy and self.grad_accum_fusion:
            raise SpecError(
                "grad_accum_upcast_copy",
                "describes the separate gradient accumulation, got grad_accum_fusion=true",
                "set grad_accum_fusion: false, or leave grad_accum_upcast_copy out",
            )
        if self.schedule == "interleaved" and self.vp == 1:
            raise SpecError("vp", "must be > 1 with the interleaved schedule, got vp=1", "raise vp or use 1f1b")
        if self.pp == 1 and self.schedule == "interleaved":
            raise SpecError(
                "schedule",
                "interleaved needs pipeline parallelism, got pp=1 (model chunks interleave over pipeline stages)",
                "raise pp to 2 or more, or leave the schedule out",
            )
        if self.pp == 1 and self.vp is not None and self.vp > 1:
            raise SpecError(
                "vp",
                f"must be 1 without pipeline parallelism, got vp={self.vp} with pp=1 (model chunks interleave "
                "over pipeline stages)",
                "raise pp to 2 or more, or leave vp out",
            )
        if self.schedule not in (None, "interleaved") and self.vp is not None and self.vp > 1:
            raise SpecError(
                "vp",
                f"must be 1 with the {self.schedule} schedule, got vp={self.vp} (model chunks need the interleaved "
                "one)",
                "use schedule interleaved, or leave vp out",
            )
        if self.fp8_param and self.precision == "fp8" and self.zero_stage == 0:
            raise SpecError(
                "fp8_param",
                "FP8 weights need the distributed optimizer or FSDP to hold their higher-precision master copy, "
                "got zero_stage=0",
                "set zero_stage to 1 or more, or fp8_param to false",
            )

    @property
    def expert_load(self) -> float:
        """The routed experts' load on the busiest expert-parallel rank over the average: ``expert_imbalance``, at
        most ep (the busiest of ep ranks can receive every routed token of its group, ep times the average; with
        ep 1 one rank holds every expert and routing skew does not change its work). A sweep over ep with one
        imbalance factor therefore stays valid at every ep."""
        return min(self.expert_imbalance, float(self.ep))

    @property
    def fp8_weights(self) -> bool:
        """Whether the FP8 GEMMs' weights are held in FP8 only (``fp8_param`` in an FP8 run)."""
        return self.fp8_param and self.precision == "fp8"

    @property
    def bf16_layers(self) -> tuple[int, int]:
        """(first, last) decoder layers kept in BF16: the ``layers_at_*_in_bf16`` knobs in an FP8 run, else (0, 0)."""
        if self.precision != "fp8":
            return 0, 0
        return self.layers_at_start_in_bf16, self.layers_at_end_in_bf16

    @staticmethod
    def derive_dp(gpus: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
        """The data-parallel degree that fills ``gpus`` with tp·pp·cp-sized replicas."""
        per_replica = tp * pp * cp
        if gpus % per_replica:
            raise SpecError(
                "gpus",
                f"must be a multiple of tp·pp·cp: gpus={gpus}, tp={tp}, pp={pp}, cp={cp}",
                "change the GPU count or the degrees",
            )
        return gpus // per_replica

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element accumulated and reduced.

        Megatron-LM accumulates and all-reduces gradients in fp32 when training in bf16 (it sets
        ``accumulate_allreduce_grads_in_fp32`` with ``--bf16``) and in the model dtype in fp16 (Megatron-LM
        ``arguments.py``); NeMo recipes may reduce in bf16 instead (``optim.grad_sync_dtype: bf16``).
        """
        return 4 if self.grad_dtype_or_default == "fp32" else 2

    @property
    def grad_dtype_or_default(self) -> str:
        """``grad_dtype``, or Megatron-LM's default for the precision when it is not set (see :attr:`grad_bytes`)."""
        return self.grad_dtype or ("fp16" if self.precision == "fp16" else "fp32")

    def check_model_layers(self, layers: int) -> None:
        """Refuse knobs that count decoder layers beyond the model's ``layers``.

        ``recompute_layers`` counts layers of a model chunk and ``layers_at_start_in_bf16`` /
        ``layers_at_end_in_bf16`` count layers of the model, so none can exceed its layers: a larger value is a
        typo, not a request the step could honour. The plan alone does not know the model:
        :func:`simulator.run.simulate` calls this before anything else.
        """
        for name in ("recompute_layers", "layers_at_start_in_bf16", "layers_at_end_in_bf16"):
            value = getattr(self, name)
            if value is not None and value > layers:
                raise SpecError(
                    name,
                    f"must be <= the model's {layers} decoder layers, got {name}={value}",
                    f"use at most {layers}"
                    + (
                        ", or leave recompute_layers out to recompute every layer" if name == "recompute_layers" else ""
                    ),
                )

    def padded_vocab(self, vocab: int) -> int:
        """``vocab`` padded up to a multiple of ``vocab_divisible_by`` · tp, as Megatron-LM builds the model."""
        multiple = self.vocab_divisible_by * self.tp
        return -(-vocab // multiple) * multiple

    @property
    def num_gpus(self) -> int:
        """tp · pp · dp · cp."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def free_knobs(self) -> tuple[str, ...]:
        """Knobs left for the engine to choose."""
        return tuple(k for k in FREE_KNOBS if getattr(self, k) is None)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The plan's keys, in declaration order."""
        return tuple(field.name for field in fields(cls))

    @classmethod
    def file_keys(cls) -> tuple[str, ...]:
        """The keys a plan file may have: the plan's, the GPU count, and a name and description."""
        return (*cls.field_names(), "gpus", "name", "description")

    def as_dict(self) -> dict[str, Any]:
        """Every field by name, in declaration order (what results and sweeps report)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def read_value(cls, key: str, value: Any, where: str) -> Any:
        """One value of one plan key as a plan file's reader reads it: checked (its type, range or choices; ``auto``
        only where the simulator chooses or derives the key) and in its canonical form (``Full`` is ``full``, ``8.0``
        is 8, ``auto`` is None), without the rules between keys: what a sweep reads of every value of an axis before
        it combines them, so that ``tp: [4, x]`` is bad input while ``vp: 2`` beside ``pp: 1`` is only one
        combination that is no plan.

        >>> PlanSpec.read_value("recompute", "Full", "grid"), PlanSpec.read_value("micro_batch", "auto", "grid")
        ('full', None)
        >>> PlanSpec.read_value("tp", "x", "--tp")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        simulator.errors.SpecError: --tp: tp: must be a whole number, got the text 'x'; ...
        """
        known = cls.field_names()
        if key not in known:
            raise SpecError(f"{where}: {key}", f"is not a plan key{did_you_mean(key, known)}", "use a PlanSpec field")
        if isinstance(value, str) and value.strip().lower() in AUTO:
            if key in FREE_KNOBS or key in AUTO_DERIVED:
                return None
            raise SpecError(
                f"{where}: {key}",
                f"is {value!r}, but the simulator does not choose {key} (it chooses {', '.join(FREE_KNOBS)})",
                f"give {key} a value",
            )
        reader = _KNOB_READERS.get(key) or _LAYOUT_READERS[key]
        return reader(Fields({key: value}, where), key, None)

    def with_(self, **changes: Any) -> PlanSpec:
        """A copy with some fields changed (``dataclasses.replace``); an unknown field is a SpecError naming it."""
        known = {f.name for f in fields(self)}
        for key in changes:
            if key not in known:
                raise SpecError(f"plan: {key}", f"unknown key{did_you_mean(key, known)}", "use a PlanSpec field")
        return replace(self, **changes)

    @classmethod
    def from_mapping(cls, data: Any, where: str, *, gpus: int | None = None) -> PlanSpec:
        """Build from a parsed plan file (``auto`` or ``null`` leaves a knob free)."""
        f = Fields(data, where)
        defaults = {fl.name: fl.default for fl in fields(cls)}
        # An unknown key keeps its value, 'auto' or not, so that the key check below names it.
        auto = {k for k, v in f.data.items() if isinstance(v, str) and v.strip().lower() in AUTO and k in defaults}
        for key in sorted(auto):
            # 'auto' leaves free what the simulator chooses (the free knobs) or derives from the rest of the plan
            # (AUTO_DERIVED); a knob with a fixed default is not searched ('tp: auto' had been read as tp 1,
            # 'recompute_layers: auto' as every layer, 'tp_overlap: auto' as off, none of them reported).
            if key not in FREE_KNOBS and key not in AUTO_DERIVED:
                default = defaults[key]
                if (
                    default is dataclasses.MISSING
                ):  # global_batch: a fuzzing run printed '<dataclasses._MISSING_TYPE object>'
                    fix = f"give {key} a value (it has no default)"
                else:
                    shown = "every layer" if key == "recompute_layers" else fmt_knob(default, "false")
                    fix = f"give {key} a value, or leave it out for the default ({shown})"
                raise SpecError(
                    f"{where}: {key}",
                    f"is {f.data[key]!r}, but the simulator does not choose {key} (it chooses "
                    f"{', '.join(FREE_KNOBS)}; it derives {', '.join(AUTO_DERIVED)})",
                    fix,
                )
        raw = {k: v for k, v in f.data.items() if k not in auto}
        g = Fields(raw, where, keys=cls.file_keys())
        kwargs: dict[str, Any] = {}
        for field in fields(cls):
            reader = _KNOB_READERS.get(field.name) or _LAYOUT_READERS[field.name]
            # The dataclass's defaults, but dp: left out, it is derived from the GPU count below.
            default = None if field.name == "dp" else field.default
            if default is dataclasses.MISSING:
                default = MISSING  # required: global_batch
            kwargs[field.name] = reader(g, field.name, default)
        if gpus is not None and "gpus" not in raw and gpus < 1:
            # A count from the caller (--gpus) gets the same range check as one written in the file.
            raise SpecError(f"{where}: gpus", f"must be >= 1, got {gpus}", "use a positive GPU count")
        gpus = g.integer("gpus", gpus, minimum=1)
        g.done(ignore=("name", "description"))
        if kwargs["schedule"] == "interleaved" and kwargs["vp"] is not None and kwargs["vp"] < 2:
            raise g.error("vp", f"must be > 1 with the interleaved schedule, got {kwargs['vp']}", "raise vp")
        if kwargs["schedule"] not in (None, "interleaved") and kwargs["vp"] is not None and kwargs["vp"] > 1:
            raise g.error(
                "vp",
                f"must be 1 with the {kwargs['schedule']} schedule, got {kwargs['vp']} (model chunks need the "
                "interleaved one)",
                "use schedule interleaved, or leave vp out",
            )
        try:
            if kwargs["dp"] is None:
                if gpus is None:
                    raise SpecError("dp", "is missing and so is the GPU count", "give dp, or gpus")
                kwargs["dp"] = cls.derive_dp(gpus, kwargs["tp"], kwargs["pp"], kwargs["cp"])
            plan = cls(**kwargs)
            if gpus is not None and plan.num_gpus != gpus:
                raise SpecError(
                    "gpus",
                    f"must equal tp·pp·dp·cp: gpus={gpus}, tp·pp·dp·cp={plan.num_gpus}",
                    "fix the degrees or leave dp out",
                )
            return plan
        except SpecError as err:
            raise SpecError(f"{where}: {err.where}", err.what, err.fix) from None
