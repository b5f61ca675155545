"""Enumerating the parallel layouts of one job: every (tp, pp, cp, ep, zero stage) that could lay a model out on a
GPU count, pruned by the rules Megatron-LM checks before it starts (a layout it would refuse is no candidate).

What is enumerated, where the caller does not pin a degree:

- ``tp``: divisors of the GPU count up to the NVLink domain (tensor parallelism all-reduces every layer's
  activations and is only run inside NVLink: Narayanan et al., SC21, Sec. 3.3 "tensor model parallelism within a
  node"), dividing the attention heads and the KV heads (Megatron-Core splits both over tp).
- ``pp``: divisors of the GPUs left, up to the decoder layers, that split the layers evenly, or the layers plus the
  embedding and the loss (Megatron-Core's ``--account-for-embedding/loss-in-pipeline-split``).
- ``cp``: 1, and powers of two that leave every context-parallel rank at least :data:`CP_MIN_TOKENS_PER_RANK` tokens
  of a sequence split into 2·cp chunks.
- ``ep`` (mixture-of-experts models only): divisors of the expert count that divide dp·cp, the group Megatron-Core
  carves the expert-parallel ranks from.
- ``zero_stage``: :data:`DEFAULT_ZERO_STAGES`.

dp then fills the GPU count and must divide the global batch. Nothing here times anything: :mod:`.planner` does,
through the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from simulator.errors import SpecError
from simulator.run import check_spec
from simulator.specs._fields import check_count, check_whole
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec

__all__ = ["CP_MIN_TOKENS_PER_RANK", "DEFAULT_ZERO_STAGES", "SEARCHED", "axes_of", "layouts"]

# A search bound, not physics: context parallelism is tried only where each rank keeps at least this many tokens of a
# sequence. Below it attention is a small share of a layer and the KV exchange cannot hide behind it; the published
# runs split 131,072 tokens over cp 16 (8,192 per rank, Llama 3 405B, Dubey et al. 2024, Sec. 3.3.2) and NeMo's
# long-context recipes 16k-128k tokens into 4,096 or more per rank. A user who wants smaller shards pins cp.
CP_MIN_TOKENS_PER_RANK = 4096
# ZeRO stages tried by default: plain data parallelism (0), Megatron's distributed optimizer (1, which shards the
# optimizer state at the same communication volume) and FSDP (3, what fits large models without model parallelism).
# Stage 2 is rarely faster than 1 with Megatron-style overlap and is tried when asked for.
DEFAULT_ZERO_STAGES = (0, 1, 3)
# The layout knobs this module enumerates; any other plan key the caller gives is passed through to every layout.
SEARCHED = ("tp", "pp", "cp", "ep", "zero_stage")


def layouts(
    model: ModelSpec,
    cluster: ClusterSpec,
    num_gpus: int,
    global_batch: int,
    *,
    tp: Sequence[int] | int | None = None,
    pp: Sequence[int] | int | None = None,
    cp: Sequence[int] | int | None = None,
    ep: Sequence[int] | int | None = None,
    zero_stage: Sequence[int] | int | None = None,
    max_tp: int | None = None,
    **fixed: Any,
) -> list[PlanSpec]:
    """Every layout of ``model`` on ``num_gpus`` GPUs of ``cluster`` for a step of ``global_batch`` sequences.

    A degree given as a value or a list is searched over those values only (still subject to the rules above);
    ``max_tp`` raises or lowers the NVLink-domain bound on tp. Other plan keys in ``fixed`` (``seq_len``,
    ``precision``, ``micro_batch``...) are set in every layout, read as a plan file reads them; the free knobs left
    out stay free for the simulator to choose. A combination the fixed knobs do not suit (``vp=2`` where pp is 1) is
    no layout.
    Layouts come in the order of tp, pp, cp, ep and zero stage, each ascending.

    Examples
    --------
    >>> from simulator.specs import load_cluster, load_model
    >>> found = layouts(load_model("llama3-8b"), load_cluster("dgx-h100"), 16, 64, zero_stage=[1])
    >>> [(p.tp, p.pp, p.cp, p.dp) for p in found][:4]
    [(1, 1, 1, 16), (1, 1, 2, 8), (1, 2, 1, 8), (1, 2, 2, 4)]
    >>> sorted({p.tp for p in found}), sorted({p.cp for p in found})
    ([1, 2, 4, 8], [1, 2])
    """
    check_spec("layouts: model", model)
    check_spec("layouts: cluster", cluster)
    check_whole("layouts: num_gpus", num_gpus, "give num_gpus")
    check_whole("layouts: global_batch", global_batch, "give global_batch")
    check_count("layouts: num_gpus", num_gpus)
    check_count("layouts: global_batch", global_batch)
    if max_tp is not None:
        check_whole("layouts: max_tp", max_tp, "give the largest tp to try")
    knobs = _fixed(fixed)
    seq_len = int(knobs.get("seq_len") or model.seq_len)
    tp_bound = cluster.nvlink_domain_gpus if max_tp is None else max_tp
    # Only a tp dividing the GPUs, the heads and the KV heads can run: the divisors of their gcd (not of the GPU
    # count itself, which may be as large as 2**53).
    candidates = _given("tp", tp, _divisors(math.gcd(num_gpus, model.heads, model.kv_heads)))
    tps = [t for t in candidates if model.heads % t == 0 and model.kv_heads % t == 0 and num_gpus % t == 0]
    if tp is not None and candidates and not tps:
        raise SpecError(
            "layouts: tp",
            f"{', '.join(map(str, candidates))} must divide the GPU count ({num_gpus}), the heads ({model.heads}) and "
            f"the KV heads ({model.kv_heads}), as Megatron-Core splits them",
            "give a tp that divides them",
        )
    tps = [t for t in tps if t <= tp_bound]
    zeros = _given("zero_stage", zero_stage, DEFAULT_ZERO_STAGES)
    out = []
    refused: list[str] = []  # why combinations with the fixed knobs are no plan (vp 2 beside pp 1, say)
    for t in tps:
        for p in _given("pp", pp, _pp_degrees(num_gpus // t, model.layers)):
            if (num_gpus // t) % p or not _splits_layers(model.layers, p):
                continue
            for c in _given("cp", cp, _cp_degrees(seq_len)):
                if (num_gpus // (t * p)) % c or (c > 1 and seq_len % (2 * c)):
                    continue
                dp = num_gpus // (t * p * c)
                if global_batch % dp:
                    continue  # Megatron-LM asserts that dp divides the global batch
                for e in _expert_degrees(model, t, dp, c, ep):
                    for z in zeros:
                        try:
                            layout = PlanSpec(
                                tp=t, pp=p, dp=dp, cp=c, ep=e, zero_stage=z, global_batch=global_batch, **knobs
                            )
                        except SpecError as err:
                            refused.append(f"{err.where}: {err.what}")
                            continue
                        out.append(layout)
    if not out and refused:
        raise SpecError(
            "layouts", f"no layout takes the knobs given: {refused[0]}", "change or leave out the knob it names"
        )
    return out


def _fixed(fixed: dict[str, Any]) -> dict[str, Any]:
    """The plan keys every layout shares, read as a plan file reads them ('auto' leaves a free knob free)."""
    out = {}
    for key, value in fixed.items():
        if key in (*SEARCHED, "dp", "global_batch"):
            raise SpecError(
                f"layouts: {key}",
                "is searched or derived here, not a knob every layout shares",
                "give the degrees to search as lists (tp=[4, 8]); dp follows from the GPU count",
            )
        read = PlanSpec.read_value(key, value, "layouts")
        if read is not None:
            out[key] = read
    return out


def _given(name: str, values: Sequence[int] | int | None, default: Iterable[int]) -> list[int]:
    """The values of a searched degree: the default range, or those given (one value or a list), checked."""
    if values is None:
        return sorted(set(default))
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise SpecError(f"layouts: {name}", f"must be a whole number or a list of them, got {values!r}", "e.g. [4, 8]")
    low = 0 if name == "zero_stage" else 1
    high = 3 if name == "zero_stage" else None
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
            bounds = f"from {low} to {high}" if high is not None else f">= {low}"
            raise SpecError(
                f"layouts: {name}", f"must hold whole numbers {bounds}, got {v!r}", f"fix the {name} values"
            )
        out.append(v)
    if not out:
        raise SpecError(f"layouts: {name}", "is an empty list", "give at least one value, or leave it out")
    return sorted(set(out))


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, from its prime factors (trial division stops once the factor left
    is prime, so a GPU count such as 2**40 takes a few steps, not a million)."""
    factors: dict[int, int] = {}
    rest, d = n, 2
    while d * d <= rest:
        while rest % d == 0:
            factors[d] = factors.get(d, 0) + 1
            rest //= d
        d += 1 if d == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    out = [1]
    for prime, power in factors.items():
        out = [x * prime**k for x in out for k in range(power + 1)]
    return sorted(out)


def _pp_degrees(n: int, layers: int) -> list[int]:
    """The pipeline degrees dividing ``n`` that split the layers evenly, with or without the embedding and the loss
    counted as a layer each (:func:`_splits_layers`): the divisors of gcd(n, layers) and of gcd(n, layers + 2)."""
    return sorted({*_divisors(math.gcd(n, layers)), *_divisors(math.gcd(n, layers + 2))})


def _splits_layers(layers: int, pp: int) -> bool:
    """Whether pp stages split the decoder layers evenly, or with the embedding and the loss counted as a layer each."""
    return pp == 1 or (pp <= layers and layers % pp == 0) or (pp <= layers + 2 and (layers + 2) % pp == 0)


def _cp_degrees(seq_len: int) -> list[int]:
    degrees = [1]
    c = 2
    while seq_len // c >= CP_MIN_TOKENS_PER_RANK:
        degrees.append(c)
        c *= 2
    return degrees


def _expert_degrees(model: ModelSpec, tp: int, dp: int, cp: int, ep: Sequence[int] | int | None) -> list[int]:
    if model.moe is None:
        return [1]
    experts = model.moe.num_experts
    return [
        e for e in _given("ep", ep, _divisors(math.gcd(experts, dp * cp))) if experts % e == 0 and (dp * cp) % e == 0
    ]


def axes_of(found: Sequence[PlanSpec]) -> dict[str, list[int]]:
    """The values each searched degree took over ``found`` (what a planner reports it searched)."""
    return {name: sorted({getattr(p, name) for p in found}) for name in SEARCHED}
