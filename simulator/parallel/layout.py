"""A resolved layout: every knob fixed, every rule checked, every communication group placed.

Ranks are ordered as Megatron-LM orders them (``tp-cp-ep-dp-pp``: tensor-parallel ranks are adjacent,
pipeline stages are farthest apart), so a group is described by its size and the rank *stride* between
members. Placing a group on the cluster tells how many members share one NVLink domain (a node, or a
whole NVL72 rack) and how many domains it spans; a group that spans domains runs hierarchically and its
slowest tier dominates (Design: Physics, Collectives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from simulator.errors import InfeasiblePlanError
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec, MoESpec
from simulator.specs.plan import PlanSpec

__all__ = ["MAX_MICRO_BATCHES", "MAX_PIPELINE_TASKS", "Group", "Layout", "place", "resolve_layout"]

# A guard, not physics: the most micro-batches per step the engine simulates (its cost is linear in
# micro-batches × pp × vp, about 0.2 ms each; 100,000 of them on 8 interleaved stages take over a minute).
# Published runs have at most a few hundred; a larger count is a mistyped global batch.
MAX_MICRO_BATCHES = 100_000
# The same guard on what the engine's cost grows with: forward passes per step summed over the stages and their
# model chunks (micro-batches × pp × vp). Measured on the 2-core CI machine (2026-11-24): 100,000 micro-batches
# × pp 2 × vp 16 = 3.2 million took 81 s and 9 GB, i.e. about 25 µs and 3 kB each; 500,000 keep one candidate
# under about 15 s and 1.5 GB. The published runs need at most about 10,000 (GPT-3 175B: 96 micro-batches ×
# pp 8 × vp 12 = 9,216).
MAX_PIPELINE_TASKS = 500_000


@dataclass(frozen=True, slots=True)
class Group:
    """A communication group: ``size`` ranks, ``stride`` apart in the global rank order.

    ``per_domain`` members share one NVLink domain; the group spans ``domains`` domains. Where the domains do not
    hold equally many members (a 72-GPU NVL72 rack holds 9 of a stride-8 group of 64: eight racks of 9, 9, …, 9
    and 1), ``fewest`` is the fewest members any domain of the group family holds (1 there), which bounds what
    the group moves over the network: NCCL sets every rank's ring channels and bandwidth to the minimum over the
    ranks (``src/init.cc``), so the rack with one member and its one NIC paces the whole ring. 0: as
    ``per_domain``.
    """

    name: str
    size: int
    stride: int
    per_domain: int
    domains: int
    fewest: int = 0

    @property
    def fewest_per_domain(self) -> int:
        """The fewest members of the group (family) in one of its NVLink domains."""
        return self.fewest or self.per_domain

    @property
    def crosses_network(self) -> bool:
        """Whether traffic of this group leaves the NVLink domain."""
        return self.domains > 1


def place(
    name: str, size: int, stride: int, cluster: ClusterSpec, offsets: int | None = None, world: int | None = None
) -> Group:
    """Place a group of ``size`` ranks with rank ``stride`` on the cluster.

    The groups of one kind (its *family*) start at ranks ``b · size · stride + j`` for ``j`` in ``0 … offsets − 1``
    (default ``stride``) and every ``b`` inside ``world`` ranks (default: one block, ``b`` = 0): Megatron's
    tp-cp-ep-dp-pp order tiles the job with them. Domains hold consecutive ranks, as many as the cluster lays on one
    (:meth:`ClusterSpec.job_domain_gpus`: on GB200 NVL72 a 256-GPU job sits 64 GPUs a rack). The group is described
    by the worst-placed one of its family (the fewest members in one of its domains, then the most domains): the
    step waits for that one. A group need not start at a domain's first rank: 16 expert-parallel ranks at 64 … 79 of
    72-GPU NVL72 racks sit 8 and 8 in two racks, and the stage at ranks 128 … 255 of a 2-stage pipeline starts 56
    ranks into a rack. The tied embedding's group (first and last pipeline stage: ``stride`` = (pp − 1) × the
    pipeline stride, offsets = the pipeline stride) is a family of one block.

    >>> from simulator.specs.hardware import ClusterSpec, DeviceSpec
    >>> dev = DeviceSpec(name="d", peak_flops=(("bf16", 1e15),), hbm_bytes=8e10, hbm_bandwidth_bytes_per_s=3e12)
    >>> c = ClusterSpec(name="c", device=dev, gpus_per_node=8, nvlink_bandwidth_bytes_per_s=4.5e11,
    ...                 nics_per_node=8, nic_bandwidth_bytes_per_s=5e10)
    >>> g = place("dp", 16, 8, c)
    >>> (g.per_domain, g.domains)
    (1, 16)
    >>> g = place("embedding", 2, 6, c, offsets=2)  # pp 4 over dp 2: ranks 0 and 6, or 1 and 7, one node
    >>> (g.per_domain, g.domains)
    (2, 1)
    >>> g = place("tp", 6, 1, c, world=48)  # ranks 6 ... 11: two on the first node, four on the second
    >>> (g.per_domain, g.domains, g.fewest_per_domain)
    (4, 2, 2)
    """
    if size <= 1:
        return Group(name, 1, stride, 1, 1)
    domain = cluster.job_domain_gpus(world) if world else cluster.nvlink_domain_gpus
    most, domains, fewest = _worst_placed(size, stride, domain, offsets or stride, world or 0)
    return Group(name, size, stride, most, domains, fewest)


@lru_cache(maxsize=4096)
def _worst_placed(size: int, stride: int, domain: int, offsets: int, world: int) -> tuple[int, int, int]:
    """(most members in one domain, domains, fewest members in one domain) of the worst-placed group of the family
    (:func:`place`): the fewest members in a domain first, then the most domains. A group's placement depends only
    on its first rank modulo ``domain``, so at most ``domain`` first ranks are looked at, each in
    O(domains it touches)."""
    if stride >= domain:
        return 1, size, 1  # every member in a domain of its own
    span = size * stride
    blocks = max(1, min(world, span * domain // math.gcd(span, domain)) // span)
    starts = sorted({(b * span + j) % domain for b in range(min(blocks, domain)) for j in range(min(offsets, domain))})
    # A domain's count depends on where its first rank falls modulo the stride, which repeats every `period` domains:
    # the first domain, one period after it and the last domain hold every count there is (walking all of them took
    # hours for a dp group of 2**40 GPUs, found by fuzzing).
    period = stride // math.gcd(domain, stride)
    worst: tuple[int, int, int] = (size + 1, 0, 0)
    for first in starts:
        last = first + (size - 1) * stride
        low, high = first // domain, last // domain
        touched = range(low, high + 1) if high - low <= 2 * period + 2 else [*range(low, low + period + 1), high]
        counts = []
        for d in touched:
            lo, hi = max(d * domain, first), min((d + 1) * domain - 1, last)
            counts.append((hi - first) // stride - (lo - first + stride - 1) // stride + 1)
        worst = min(worst, (min(counts), -(high - low + 1), -max(counts)))
    fewest, domains, most = worst[0], -worst[1], -worst[2]
    return most, domains, fewest


@dataclass(frozen=True, slots=True)
class Layout:
    """A plan with every knob fixed, plus derived counts and placed groups."""

    plan: PlanSpec
    micro_batch: int
    num_micro_batches: int
    vp: int
    schedule: str
    sequence_parallel: bool
    recompute: str
    grad_overlap: bool
    tp_overlap: bool
    seq_len: int
    tp: Group
    cp: Group
    ep: Group
    dp: Group  # gradient reduction group of dense parameters: dp × cp ranks (Megatron)
    edp: Group  # expert-data-parallel group: tp·dp·cp / (ep·etp) ranks
    pp: Group
    etp: int = 1  # tensor parallelism inside the experts (tp, or 1 with MoE parallel folding)
    # The routed experts' tokens on the busiest expert-parallel rank over the average (see resolve_layout).
    expert_load: float = 1.0

    @property
    def num_gpus(self) -> int:
        """GPUs in the job."""
        return self.plan.num_gpus

    @property
    def experts_folded(self) -> bool:
        """MoE parallel folding: the experts are not TP-split although the rest of the model is (etp 1, tp > 1)."""
        return self.etp != self.tp.size


def resolve_layout(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec) -> Layout:
    """Check ``plan`` against ``model`` and ``cluster`` and place its groups; every free knob must be set.

    Raises
    ------
    InfeasiblePlanError
        When a degree does not divide what it must, or the job does not fit the cluster.
    """
    free = plan.free_knobs
    assert not free, f"knobs still free at layout time: {free} (run.simulate resolves them first)"
    tp, pp, dp, cp, ep = plan.tp, plan.pp, plan.dp, plan.cp, plan.ep
    world = tp * cp * dp * pp
    seq_len = plan.seq_len or model.seq_len
    mb = plan.micro_batch
    assert mb is not None
    vp = plan.vp or 1
    _require(model.heads % tp == 0, f"'tp' must divide 'heads': tp={tp}, heads={model.heads}")
    # Megatron-Core splits the KV heads (query groups) over tp: divide(num_query_groups, tp) asserts.
    _require(
        model.kv_heads % tp == 0,
        f"'tp' must divide 'kv_heads' (Megatron-Core splits the KV heads over tp): tp={tp}, kv_heads={model.kv_heads}",
    )
    if vp > 1:
        _require(pp > 1, f"interleaving ('vp' > 1) needs a pipeline: vp={vp}, pp={pp}; use pp >= 2 or vp=1")
    if pp * vp > 1:
        # Megatron-LM wants pp·vp to divide the layers; uneven first/last stages (as Llama 3 ran) are allowed
        # (parallel.stages takes the remainder from the ends), and the embedding and the loss may count as a
        # layer each, leaving the first and last virtual stages without a decoder layer (Megatron-Core's
        # --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split).
        _require(
            model.layers + 2 >= pp * vp,
            f"'pp·vp' must not exceed 'layers' + 2 (the embedding and the loss): pp={pp}, vp={vp}, "
            f"layers={model.layers}",
        )
    _require(seq_len % cp == 0, f"'cp' must divide 'seq_len': cp={cp}, seq_len={seq_len}")
    if cp > 1:
        # Load-balanced causal ring attention splits each sequence into 2·cp chunks (Megatron-LM / TE).
        _require(seq_len % (2 * cp) == 0, f"'2·cp' must divide 'seq_len': cp={cp}, seq_len={seq_len}")
        # Megatron-Core's own DotProductAttention asserts "Context parallelism is only supported by
        # TEDotProductAttention": the KV exchange lives in Transformer Engine's fused attention.
        _require(
            plan.attention != "unfused",
            f"context parallelism needs a fused attention kernel: cp={cp}, attention=unfused; "
            "use attention flash, flash2 or cudnn, or cp=1",
        )
        if plan.cp_comm == "a2a":
            # Ulysses-style CP scatters heads over the CP ranks: each TP rank's query and KV heads must split
            # evenly (Transformer Engine's AttnFuncWithCPAndQKVOA2A asserts both).
            heads, kv_heads = model.heads // tp, max(1, model.kv_heads // tp)
            _require(
                heads % cp == 0 and kv_heads % cp == 0,
                f"cp_comm a2a needs 'cp' to divide the query and KV heads of each TP rank: cp={cp}, "
                f"heads/tp={heads}, kv_heads/tp={kv_heads}; use cp_comm p2p or all_gather",
            )
    etp = _expert_tp(plan, model)
    if ep > 1:
        _require(model.moe is not None, f"'ep' > 1 needs a mixture-of-experts model: ep={ep}, model={model.name}")
        assert model.moe is not None
        _require(
            model.moe.num_experts % ep == 0,
            f"'ep' must divide 'num_experts': ep={ep}, num_experts={model.moe.num_experts}",
        )
        if etp == tp:
            _require((dp * cp) % ep == 0, f"'ep' must divide dp·cp: ep={ep}, dp={dp}, cp={cp}")
        else:
            _require(
                (tp * dp * cp) % ep == 0,
                f"'ep' must divide tp·dp·cp with expert_tp 1: ep={ep}, tp={tp}, dp={dp}, cp={cp}",
            )
    _require(
        dp <= plan.global_batch,
        f"dp={dp:,} data-parallel replicas for a global batch of {plan.global_batch:,} sequences: every replica "
        "needs at least one; use fewer GPUs (or more tp, pp, cp) or a larger global batch",
    )
    if split := batch_split_problem(plan.global_batch, dp, mb):
        raise InfeasiblePlanError(f"'global_batch' {split}; fix global_batch, dp or micro_batch")
    micro_batches = plan.global_batch // (dp * mb)
    _require(
        micro_batches <= MAX_MICRO_BATCHES,
        f"{micro_batches:,} micro-batches per step (global_batch / (dp·micro_batch)) is more than the "
        f"{MAX_MICRO_BATCHES:,} the engine simulates: raise micro_batch or dp, or lower global_batch",
    )
    tasks = micro_batches * pp * vp
    _require(
        tasks <= MAX_PIPELINE_TASKS,
        f"{micro_batches:,} micro-batches × pp {pp} × vp {vp} = {tasks:,} forward passes per step is more than the "
        f"{MAX_PIPELINE_TASKS:,} the engine simulates: lower vp, raise micro_batch or dp, or lower global_batch",
    )
    if cluster.max_gpus is not None:
        _require(
            plan.num_gpus <= cluster.max_gpus,
            f"the job needs {plan.num_gpus} GPUs but cluster {cluster.name} has {cluster.max_gpus}",
        )
    m = plan.global_batch // (dp * mb)
    schedule = plan.schedule or ("interleaved" if vp > 1 else "1f1b")
    if schedule == "interleaved" and vp == 1:
        raise InfeasiblePlanError("the interleaved schedule needs vp >= 2")
    if schedule != "interleaved" and vp > 1:
        raise InfeasiblePlanError(f"vp={vp} needs the interleaved schedule, not {schedule}")
    sp = bool(plan.sequence_parallel) if plan.sequence_parallel is not None else tp > 1
    if tp == 1:
        sp = False
    if plan.tp_overlap and tp > 1:
        # Megatron-Core asserts it: userbuffers overlap the all-gathers and reduce-scatters of sequence parallelism.
        _require(sp, f"tp_overlap needs sequence parallelism: tp={tp}; turn sequence_parallel on or tp_overlap off")
    if sp:
        # Sequence parallelism splits each micro-batch's local sequence over tp (_split_along_first_dim asserts).
        _require(
            (seq_len // cp) % tp == 0,
            f"sequence parallelism needs 'tp' to divide the tokens of each sequence on a CP rank: tp={tp}, "
            f"seq_len/cp={seq_len // cp}; change seq_len or turn sequence_parallel off",
        )
    if etp != tp:
        # Folded experts take the tokens each TP rank holds, which needs them split (Megatron-Core asserts it).
        _require(sp, f"expert_tp 1 with tp={tp} needs sequence parallelism; turn it on or use expert_tp {tp}")
    elif ep > 1 and tp > 1:
        # TransformerConfig: "When using expert parallelism and tensor parallelism, sequence parallelism must be
        # used".
        _require(sp, f"ep={ep} with tp={tp} needs sequence parallelism (Megatron-Core); turn it on")
    recompute = plan.recompute
    assert recompute is not None
    return Layout(
        plan=plan,
        micro_batch=mb,
        num_micro_batches=m,
        vp=vp,
        schedule=schedule,
        sequence_parallel=sp,
        recompute=recompute,
        grad_overlap=bool(plan.grad_overlap),
        tp_overlap=bool(plan.tp_overlap),
        seq_len=seq_len,
        tp=place("tp", tp, 1, cluster, world=world),
        cp=place("cp", cp, tp, cluster, world=world),
        # Expert ranks are ordered etp-ep-edp inside a stage (Megatron-Core's expert rank generator).
        ep=place("ep", ep, etp, cluster, world=world),
        dp=place("dp", dp * cp, tp, cluster, world=world),
        edp=place("edp", tp * dp * cp // (ep * etp), etp * ep, cluster, world=world),
        pp=place("pp", pp, tp * cp * dp, cluster, world=world),
        etp=etp,
        expert_load=expert_load(plan, model),
    )


def expert_load(plan: PlanSpec, model: ModelSpec) -> float:
    """The busiest expert-parallel rank's routed tokens over the average: the plan's ``expert_load`` (its imbalance,
    at most ep), capped by the model's capacity factor where routing drops tokens. Megatron-Core's
    ``--moe-expert-capacity-factor`` gives each expert at most that many times its average tokens and drops the rest,
    so no rank holds more (padding every expert to its capacity, ``--moe-pad-expert-input-to-capacity``, is not
    modelled: its rank runs at the cap whatever the routing)."""
    load = plan.expert_load
    if model.moe is not None:
        load = min(load, routing_cap(plan, model.moe))
        if model.moe.capacity_factor is not None:
            load = min(load, model.moe.capacity_factor)
    return load


def routing_cap(plan: PlanSpec, moe: MoESpec) -> float:
    """The most the busiest expert-parallel rank can receive over the average, whatever the routing: top-k picks k
    distinct experts, so a token sends one copy at most to each expert and at most min(k, e) copies to a rank
    holding e = num_experts / ep of them. Of its group's tokens · k routed copies (ep ranks' average: tokens · k /
    ep) one rank receives at most tokens · min(k, e): ep · min(k, e) / k times the average (Mixtral's 8 experts,
    top-2, over ep 8: 4, not ep's 8; Qwen3-235B's 128, top-8, over ep 32: 16). With e >= k it is ep, the bound
    :attr:`PlanSpec.expert_load` applies without the model. Found by a review of the MoE model."""
    per_rank = moe.num_experts / plan.ep
    return plan.ep * min(float(moe.top_k), per_rank) / moe.top_k


def _expert_tp(plan: PlanSpec, model: ModelSpec) -> int:
    """The experts' tensor-parallel degree: the plan's, else tp (Megatron-Core's default) unless ep does not
    divide dp·cp, where only MoE parallel folding (expert_tp 1) can place the experts."""
    if model.moe is None or plan.tp == 1:
        return plan.tp
    if plan.expert_tp is not None:
        return plan.expert_tp
    return plan.tp if (plan.dp * plan.cp) % plan.ep == 0 else 1


def batch_split_problem(global_batch: int, dp: int, micro_batch: int | None) -> str | None:
    """Why a global batch cannot be split over dp replicas of micro_batch sequences each, or None: Megatron-LM's
    ``arguments.py`` asserts ``global_batch_size % (micro_batch_size * data_parallel_size) == 0``. A micro-batch
    left free (None) needs dp to divide the batch only. The one wording of this rule for ``simulate``, ``check``
    and ``validate``."""
    per_step = dp * (micro_batch or 1)
    if global_batch % per_step == 0:
        return None
    what = f"dp·micro_batch ({dp}·{micro_batch} = {per_step})" if micro_batch else f"dp ({dp})"
    return f"must be a multiple of {what}, got {global_batch}"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InfeasiblePlanError(message)
