"""Close the loop: train a small real GPT for a few steps, predict the step with the simulator, compare.

Each :class:`CheckConfig` is a GPT (hidden size, layers, heads, sequence, micro-batch, vocabulary) and a
number of data-parallel ranks. :func:`measure_step` trains it with PyTorch (:func:`.torchlib.build_gpt`,
bf16, Adam) for ``warmup + steps`` steps and reports the median step time; with two or more ranks it runs
``torch.nn.parallel.DistributedDataParallel`` over gloo (CPU) or NCCL (GPU) between local processes.
:func:`predict_step` builds the matching :class:`~simulator.specs.model.ModelSpec` and
:class:`~simulator.specs.plan.PlanSpec` and asks :func:`simulator.run.simulate` on the host cluster, whose
calibration table was fitted from kernel measurements only. Measured step times are never fed back into
any table: they only judge the prediction.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.calibration.torchlib import build_gpt, init_rank, require_torch, setup_device, spawn
from simulator.errors import CalibrationError
from simulator.run import simulate
from simulator.specs.hardware import ClusterSpec
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec

__all__ = [
    "CPU_CONFIGS",
    "GPU_CONFIGS",
    "TINY_CONFIGS",
    "CheckConfig",
    "CheckRow",
    "device_mismatch",
    "measure_step",
    "predict_step",
    "run_check",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckConfig:
    """One small GPT training configuration."""

    name: str
    hidden: int
    layers: int
    heads: int
    seq_len: int
    micro_batch: int
    vocab: int = 4096
    ranks: int = 1

    def model(self) -> ModelSpec:
        """The model as the simulator sees it (GPT-2 style: LayerNorm, learned positions, 4h GELU MLP)."""
        return ModelSpec(
            name=self.name,
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            ffn_hidden=4 * self.hidden,
            vocab=self.vocab,
            seq_len=self.seq_len,
            position_embedding="learned",
            bias=True,
            tied_embeddings=False,
            dropout=False,
        )

    def plan(self) -> PlanSpec:
        """Pure data parallelism over ``ranks``, one micro-batch per rank and step, bf16, fused attention."""
        return PlanSpec(
            dp=self.ranks,
            global_batch=self.micro_batch * self.ranks,
            micro_batch=self.micro_batch,
            seq_len=self.seq_len,
            vp=1,
            schedule="1f1b",
            recompute="none",
            sequence_parallel=False,
            grad_overlap=True,
            tp_overlap=False,
            precision="bf16",
            attention="flash",
        )

    def label(self) -> str:
        """Short description for tables."""
        ddp = f" ddp×{self.ranks}" if self.ranks > 1 else ""
        return f"h{self.hidden} L{self.layers} s{self.seq_len} b{self.micro_batch}{ddp}"


# Within the CPU range (hidden 256–1024, 2–8 layers, sequence 128–512, batch 1–8) plus one DDP run.
CPU_CONFIGS = (
    CheckConfig(name="h256-L2-s128-b1", hidden=256, layers=2, heads=4, seq_len=128, micro_batch=1),
    CheckConfig(name="h512-L4-s256-b2", hidden=512, layers=4, heads=8, seq_len=256, micro_batch=2),
    CheckConfig(name="h768-L4-s512-b1", hidden=768, layers=4, heads=12, seq_len=512, micro_batch=1),
    CheckConfig(name="h1024-L2-s256-b4", hidden=1024, layers=2, heads=16, seq_len=256, micro_batch=4),
    CheckConfig(name="h384-L8-s128-b8", hidden=384, layers=8, heads=6, seq_len=128, micro_batch=8),
    CheckConfig(name="h512-L2-s256-b2-ddp2", hidden=512, layers=2, heads=8, seq_len=256, micro_batch=2, ranks=2),
)
# Larger shapes for a GPU, where the CPU sizes would be launch-bound.
GPU_CONFIGS = (
    CheckConfig(name="h1024-L4-s1024-b4", hidden=1024, layers=4, heads=16, seq_len=1024, micro_batch=4, vocab=32768),
    CheckConfig(name="h2048-L4-s1024-b2", hidden=2048, layers=4, heads=16, seq_len=1024, micro_batch=2, vocab=32768),
    CheckConfig(name="h2048-L8-s2048-b1", hidden=2048, layers=8, heads=16, seq_len=2048, micro_batch=1, vocab=32768),
    CheckConfig(name="h4096-L2-s2048-b1", hidden=4096, layers=2, heads=32, seq_len=2048, micro_batch=1, vocab=32768),
)
# Seconds-scale loop for tests and CI.
TINY_CONFIGS = (
    CheckConfig(name="tiny-h64-L2-s32-b1", hidden=64, layers=2, heads=4, seq_len=32, micro_batch=1, vocab=256),
    CheckConfig(name="tiny-h64-L2-s32-b2", hidden=64, layers=2, heads=4, seq_len=32, micro_batch=2, vocab=256),
)


@dataclass(frozen=True, slots=True)
class CheckRow:
    """Measured and predicted step time of one configuration; ``error`` is predicted / measured − 1."""

    config: CheckConfig
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return self.predicted_s / self.measured_s - 1.0

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        c = self.config
        return {
            "configuration": {
                "name": c.name,
                "hidden": c.hidden,
                "layers": c.layers,
                "heads": c.heads,
                "seq_len": c.seq_len,
                "micro_batch": c.micro_batch,
                "vocab": c.vocab,
                "ranks": c.ranks,
            },
            "measured_s": self.measured_s,
            "predicted_s": self.predicted_s,
            "error": self.error,
        }


def _train_steps(cfg: CheckConfig, dev: Any, steps: int, warmup: int, ddp: Any = None, seed: int = 0) -> list[float]:
    torch = require_torch()
    net = build_gpt(cfg.model(), dev, seed=seed)
    model = ddp(net) if ddp is not None else net
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq_len), generator=gen).to(dev)
    targets = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq_len), generator=gen).to(dev)
    cuda = dev.type == "cuda"
    times: list[float] = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def measure_step(
    cfg: CheckConfig, *, device: str = "cpu", threads: int | None = 1, steps: int = 5, warmup: int = 2
) -> list[float]:
    """Wall times of ``steps`` training steps of ``cfg`` (seconds); DDP over local processes when ranks > 1."""
    dev = setup_device(device, threads if device == "cpu" else None)
    if cfg.ranks == 1:
        return _train_steps(cfg, dev, steps, warmup)
    from simulator.calibration.profile import _free_port

    with tempfile.TemporaryDirectory(prefix="clustersim-ddp-") as tmp:
        result = Path(tmp) / "times.json"
        spawn(
            _ddp_worker,
            (cfg, device, threads or 1, steps, warmup, _free_port(), str(result)),
            cfg.ranks,
            f"DDP check {cfg.name}",
        )
        times: list[float] = json.loads(result.read_text(encoding="utf-8"))
    return times


def _ddp_worker(
    rank: int, cfg: CheckConfig, device: str, threads: int, steps: int, warmup: int, port: int, result: str
) -> None:
    """One DDP rank (spawned); rank 0 writes the slowest rank's step times."""
    torch = require_torch()
    dist = torch.distributed
    dev = init_rank(rank, cfg.ranks, device, threads, port)
    try:
        ids = [rank] if device == "cuda" else None

        def wrap(net: Any) -> Any:
            return torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)

        times = _train_steps(cfg, dev, steps, warmup, ddp=wrap, seed=0)
        mine = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(result).write_text(json.dumps(mine.tolist()), encoding="utf-8")
        del times
        dist.barrier()  # no rank tears down gloo while a peer still has work in flight
    finally:
        dist.destroy_process_group()


def predict_step(cfg: CheckConfig, cluster: ClusterSpec) -> float:
    """The simulator's step time for ``cfg`` on ``cluster``."""
    if cfg.ranks > cluster.gpus_per_node:
        raise CalibrationError(
            f"check {cfg.name}: needs {cfg.ranks} ranks, the cluster {cluster.name} has {cluster.gpus_per_node} "
            "per node; profile the host with more ranks or drop the configuration"
        )
    result = simulate(cfg.model(), cluster, cfg.plan())
    if not result.feasible:
        raise CalibrationError(
            f"check {cfg.name}: the simulator finds it infeasible on {cluster.name}: {result.reason}; "
            "use a smaller configuration"
        )
    return result.step_time_s


# A GPU model in a device name: H100 in "NVIDIA H100 80GB HBM3" and "H100-SXM5-80GB", MI300X, L40S, GB200...
_GPU_MODEL = re.compile(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b")


def _gpu_models(text: str) -> set[str]:
    return set(_GPU_MODEL.findall(text.upper()))


def device_mismatch(dev_type: str, measured: str, cluster: ClusterSpec) -> str:
    """Why the real steps of ``check`` (on ``dev_type``, named ``measured``) cannot judge ``cluster``'s
    predictions ("" when they can).

    The predictions are for the cluster's device; real steps on another one measure the gap between two
    machines, not the calibration. The cluster's device is a CPU when its name, vendor or the devices its table
    was measured on (provenance ``devices``) say ``CPU``, as the profiles ``calibrate host --device cpu``
    writes do. On CUDA, the GPU model in the measured name (H100, A100, MI300X...) must be one the cluster's
    device names, where both name one.

    >>> from simulator.specs.library import load_cluster
    >>> device_mismatch("cuda", "NVIDIA H100 80GB HBM3", load_cluster("dgx-h100"))
    ''
    """
    dev = cluster.device
    described = [dev.name, dev.vendor]
    if cluster.calibration is not None:
        described += [value for key, value in cluster.calibration.provenance if key == "devices"]
    text = " ".join(d for d in described if d)
    cluster_cpu = re.search(r"\bcpu\b", text, re.IGNORECASE) is not None
    theirs = f"the predictions are for cluster {cluster.name}'s device {dev.name}" + (
        f" ({dev.vendor})" if dev.vendor and dev.vendor != dev.name else ""
    )
    fix = (
        "the errors would compare two different machines, not test the calibration; give --cluster a cluster "
        f"whose device is the one measured (calibrate host --device {dev_type} writes one for this machine), "
        "or leave out --cluster to profile this machine first"
    )
    if dev_type != "cuda":
        if cluster_cpu:
            return ""
        return f"--device {dev_type} times real steps on this CPU ({measured}), but {theirs}, not a CPU: {fix}"
    if cluster_cpu:
        return f"--device cuda times real steps on {measured}, but {theirs}, a CPU: {fix}"
    mine, named = _gpu_models(measured), _gpu_models(text)
    if mine and named and not mine & named:
        return f"--device cuda times real steps on {measured}, but {theirs}: {fix}"
    return ""


def run_check(
    configs: Sequence[CheckConfig],
    cluster: ClusterSpec,
    *,
    device: str = "cpu",
    threads: int | None = 1,
    steps: int = 5,
    warmup: int = 2,
    rounds: int = 2,
) -> list[CheckRow]:
    """Measure and predict every configuration.

    The configurations are measured in ``rounds`` interleaved rounds of ``steps`` steps each and the median
    over all steps is reported, so interference from other processes during one round does not decide
    a configuration's time.
    """
    predicted = [predict_step(cfg, cluster) for cfg in configs]
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(max(rounds, 1)):
        for i, cfg in enumerate(configs):
            times[i] += measure_step(cfg, device=device, threads=threads, steps=steps, warmup=warmup)
    return [CheckRow(cfg, statistics.median(t), p) for cfg, t, p in zip(configs, times, predicted, strict=True)]
