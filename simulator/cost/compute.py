"""Compute cost: how long one operator takes on one device.

``time = max(FLOPs / (peak · efficiency), bytes / (HBM bandwidth · streaming efficiency))`` for GEMMs and
attention, and ``bytes / (HBM bandwidth · efficiency)`` for memory-bound kernels (Design: Physics, Compute
time). The memory roof of a GEMM is the bandwidth a streaming kernel actually sustains at that many bytes (the
device's measured ``elementwise`` curve), not the datasheet peak: that is how the roofline model defines it
(Williams, Waterman and Patterson, "Roofline", CACM 2009: the memory ceiling is measured STREAM bandwidth). It
binds for GEMMs of low arithmetic intensity, such as the batched score and context products of unfused
attention, whose output is s² per head against a head dimension of 64-128.
Efficiency comes from the cluster's calibration table (measured kernels, interpolated in log-space of the
problem size); where the table has no curve for an op class and precision, the built-in *default* table is
used (curves derived from the measured devices, expressed against the op's ideal time at peak so that they
transfer between devices) and the op is reported as uncalibrated. Costs are computed once per distinct
op shape and cached in the model object, so the engine's hot path only looks them up.

Kernel profiles time each shape for a few runs, so the curves hold what a GPU does near its boost clock. Where
the table also measured one GEMM under minutes of back-to-back load (``sustained_gemm_ratio``,
``clustersim calibrate profile --sustain``), the FLOP-bound time of GEMMs and attention is divided by that ratio:
a training step keeps the tensor cores busy for as long, and a GPU at its power limit settles at a lower clock.
Memory-bound kernels and the memory roof keep their profiled speed (HBM does not slow with the SM clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from simulator.graph.ops import Op
from simulator.specs.calibration import (
    ATTENTION_CLASSES,
    CAUSAL,
    GEMM_BACKWARD_CLASSES,
    CalibrationTable,
    EfficiencyCurve,
)
from simulator.specs.hardware import DeviceSpec

__all__ = ["COST_CACHE_MAX", "FALLBACK_EFFICIENCY", "GROUPED_GEMM_STREAMS", "ComputeModel"]

# A bound on the per-shape cost cache (entries of about 300 bytes: some 60 MB). One plan times tens of distinct
# shapes; a planner's sweep over thousands of distinct sequence lengths or batch sizes would otherwise keep every
# one of them for the life of the process.
COST_CACHE_MAX = 200_000

# Used only when neither the cluster's table nor the default table has a curve for an op class: a flat
# efficiency per class, at or below the large-size plateaus of the measured tables that ship with clustersim
# (hardware_profiles/calibration/: GEMM 0.75 A100, 0.7-0.8 H100; attention 0.73 A100 and 0.65 H100, taken lower
# for the unmeasured kernels this stands in for; memory-bound 0.5, about A100's 0.49). The default table covers every
# class, so this is reached only with a table that lacks one and no default table at all.
FALLBACK_EFFICIENCY = {"gemm": 0.7, "attention": 0.5, "memory": 0.5}
# Where a table has a forward attention curve but no backward one (the A100 table: FlashAttention-2's published
# forward range), backward efficiency is forward efficiency times the same paper's ratio: the backward reaches
# up to 63% of A100 peak where the forward reaches 73% (Dao 2023, arXiv:2307.08691, Sec. 4.1). The H100 table
# has measured backward kernels (FlashAttention-3, tritonbench PR #1256), and devices without attention data
# take the default table's backward curve derived from them (ComputeModel._time).
ATTENTION_BWD_RATIO = 63.0 / 73.0
# Where a device has no FP8 GEMM measurement, an FP8 GEMM runs at the 16-bit efficiency of the same shape (the
# device's own measured curve, else the default one) times a ratio that grows with the GEMM's size, relative to the
# FP8 peak (twice the 16-bit one on Hopper and Blackwell): fp8_over_16bit_efficiency. Source: our profile of one
# H200 SXM (data/calibration/h200/README.md): 327 GEMM shapes of the validation rows' models and of the check
# configurations, each timed in BF16 (torch.mm) and in FP8 as Transformer Engine runs it (torch._scaled_mm, E4M3,
# per-tensor scales, BF16 output), paired by shape. Each point is the median FP8 speed-up of one half-decade of FLOPs,
# at the bin's centre, over the H200's peak ratio of 2 (tests/unit/test_fp8_speedup.py recomputes them from the
# data). Small GEMMs gain little (1.11x at 2 GFLOP), large ones about 1.85x (1.905x in Transformer Engine's GEMM
# profiling tutorial for a 2 TFLOP GEMM of a 5B model on an H200 NVL, docs/examples/gemm_profiling). Hopper FP8 and
# BF16 GEMMs share cuBLASLt and the SM90 tensor cores, so the ratio transfers to the H100 (same die); absolute times
# do not. Blackwell takes it too (the same tutorial's B300 run: 1.923x), for want of a measurement of its own.
FP8_SPEEDUP_LOG10_FLOPS = (9.25, 9.75, 10.25, 10.75, 11.25, 11.75, 12.25, 12.75)
FP8_SPEEDUP = (1.114, 1.317, 1.5, 1.664, 1.728, 1.798, 1.847, 2.023)
FP8_MEASURED_PEAK_RATIO = 2.0  # H200 datasheet: 1,979 FP8 against 989 BF16 dense TFLOP/s


def fp8_over_16bit_efficiency(flops: float) -> float:
    """The measured FP8/16-bit efficiency ratio of a GEMM of ``flops`` FLOPs (log-linear between the points above,
    flat beyond them).

    >>> round(fp8_over_16bit_efficiency(10**11.5), 4), fp8_over_16bit_efficiency(1e6) == FP8_SPEEDUP[0] / 2
    (0.8815, True)
    """
    x = math.log10(max(flops, 1.0))
    xs, ys = FP8_SPEEDUP_LOG10_FLOPS, FP8_SPEEDUP
    if x <= xs[0]:
        return ys[0] / FP8_MEASURED_PEAK_RATIO
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return (ys[i - 1] + t * (ys[i] - ys[i - 1])) / FP8_MEASURED_PEAK_RATIO
    return ys[-1] / FP8_MEASURED_PEAK_RATIO


# A numerical guard, not physics: no efficiency read off a curve is taken below this, so that a curve that reaches
# zero (a user's table, an extrapolation) cannot turn into a division by zero or an infinite time.
MIN_EFFICIENCY = 1e-4
# The routed experts' grouped GEMM is one cuBLAS GEMM per local expert, issued round-robin on this many CUDA
# streams: Transformer Engine's ``GroupedLinear`` calls ``general_grouped_gemm``, which runs
# ``multi_stream_cublas_gemm`` (transformer_engine/common/gemm/cublaslt_gemm.cu) over
# ``nvte_get_num_compute_streams()`` streams, 4 (transformer_engine/common/util/multi_stream.cpp). TE's CUTLASS
# grouped kernel replaces it only for Hopper BF16 when NVTE_USE_CUTLASS_GROUPED_GEMM is set, which is not the
# default. So at most this many expert GEMMs run at once: the experts are timed in waves, each wave as one GEMM of
# its members' combined FLOPs (the streams fill the SMs one small GEMM leaves idle, and no better than a GEMM that
# large would), not all of them as one GEMM of the total, which made small experts up to 4x too fast.
GROUPED_GEMM_STREAMS = 4


@dataclass
class ComputeModel:
    """Operator durations for one device, calibration table and training precision.

    Parameters
    ----------
    device : DeviceSpec
        The accelerator.
    table : CalibrationTable or None
        Measured curves for this device (the cluster's ``calibration``).
    default : CalibrationTable or None
        Device-independent default curves (axis ``ideal_seconds``).
    precision : str
        ``fp16``, ``bf16`` or ``fp8``; FP8 applies to the GEMMs of transformer layers (Transformer Engine),
        while attention, the output layer and memory-bound kernels stay in 16-bit.
    """

    device: DeviceSpec
    table: CalibrationTable | None
    default: CalibrationTable | None
    precision: str
    # Per shape: the seconds and the uncalibrated labels that timing it raised, so that a cache hit reports
    # the same labels as a miss (the set below then describes only the ops timed since it was last cleared).
    _cache: dict[tuple[object, ...], tuple[float, frozenset[str]]] = field(default_factory=dict, repr=False)
    uncalibrated: set[str] = field(default_factory=set, repr=False)
    _floor: float | None = field(default=None, repr=False)

    @property
    def floor_s(self) -> float:
        """The shortest kernel time the calibration saw on this device: the least time any curve of its table
        (else of the default table) starts at. A curve holds its smallest point's efficiency below it, so time
        falls with size there; this floor stops it at what a kernel was measured to take at least (launch and
        ramp-up latency), without holding, say, an attention curve that starts at 100 µs kernels at 100 µs."""
        if self._floor is None:
            # The curves this device's ops are timed on: its table's, and the default ones for the classes the table
            # lacks (a partial table must not hold every kernel at its own shortest, say a 100 µs attention curve).
            own = self.table.compute if self.table is not None else ()
            covered = {c.op for c in own}
            fallback = tuple(c for c in self.default.compute if c.op not in covered) if self.default else ()
            self._floor = min((self._first_point_s(c) for c in (*own, *fallback)), default=0.0)
        return self._floor

    def _first_point_s(self, curve: EfficiencyCurve) -> float:
        """Seconds of a kernel at ``curve``'s smallest measured size."""
        x = float(10.0 ** curve.log10_size[0]) / curve.efficiency[0]
        return x if curve.axis == "ideal_seconds" else x / self.device.curve_rate(curve)

    @property
    def _sustained(self) -> float:
        """The table's measured sustained/burst GEMM throughput ratio, 1 where it has none (module docstring)."""
        ratio = self.table.sustained_gemm_ratio if self.table is not None else None
        return 1.0 if ratio is None else ratio

    def _curve(self, op_class: str, precision: str) -> tuple[EfficiencyCurve | None, bool]:
        """(curve, calibrated?) for an op class at a precision."""
        curve, calibrated, _ = self._lookup(self._candidates(op_class), precision)
        return curve, calibrated

    @staticmethod
    def _candidates(op_class: str) -> tuple[str, ...]:
        """The classes that may time ops of ``op_class``, best first: a causal attention class, then the same
        kernel without a mask (specs.calibration.CAUSAL)."""
        if op_class.endswith(CAUSAL):
            return op_class, op_class.removesuffix(CAUSAL)
        return (op_class,)

    def _lookup(
        self, classes: tuple[str, ...], precision: str, suffix: str = ""
    ) -> tuple[EfficiencyCurve | None, bool, str]:
        """(curve, calibrated?, class it was found under) for the first of ``classes`` (each + ``suffix``) that the
        device's table has, else the first the default table has."""
        if self.table is not None:
            for cls in classes:
                curve = self.table.compute_curve(cls + suffix, precision)
                if curve is not None:
                    return curve, True, cls + suffix
        if self.default is not None:
            for cls in classes:
                curve = self.default.compute_curve(cls + suffix, precision) or self.default.compute_curve(
                    cls + suffix, "any"
                )
                if curve is not None:
                    return curve, False, cls + suffix
        return None, False, classes[0] + suffix

    @staticmethod
    def memory_class(op: Op) -> str:
        """The calibration class of a memory-bound operator of the graph (see specs.calibration.MEMORY_CLASSES).

        The softmax of unfused attention is timed as a ``norm``: like LayerNorm it reduces each row (max and sum
        of exponentials) and rescales it, one read and one write per element, and its backward is a row
        reduction too (dx = y·(dy − Σ dy·y)); Megatron's fused softmax and Apex's fused LayerNorm are both
        warp-per-row kernels (megatron/fused_kernels/scaled_upper_triang_masked_softmax.h,
        apex/csrc/layer_norm_cuda_kernel.cu).
        """
        name = op.name
        if name.startswith(("ln", "final_norm")) or ".softmax" in name:
            return "norm"
        if "rope" in name:
            return "rope"
        if name.startswith("embedding.lookup"):
            return "embedding"
        if name.endswith((".act", ".act.bwd")):
            return "activation"
        # The cross-entropy is a chain of streaming PyTorch kernels (casts, in-place sub/exp/div/mul, row max
        # and sum; see graph.transformer.CE_FWD_READ), timed as one elementwise op over the bytes they move.
        # The copies, adds and output merges of context-parallel attention (program.py, ``.cp_*``) stream too.
        if (
            name.endswith(
                (
                    "dropout_add",
                    "dropout_add.bwd",
                    "dropout",
                    "dropout.bwd",
                    ".fp8_cast",
                    ".grad_accumulate",
                    ".grad_upcast",
                )
            )
            or name.startswith(("optimizer", "head.cross_entropy"))
            or ".cp_" in name
        ):
            return "elementwise"
        return "memory"

    @staticmethod
    def op_class(op: Op) -> str:
        """The calibration class that times ``op``: its memory class, ``gemm``, or its attention kernel's curve
        (``attention`` for the device's own fused kernel, ``attention_fa2`` for FlashAttention-2,
        ``attention_cudnn`` for cuDNN; with ``_causal`` when the kernel skips the masked blocks of a causal
        mask, timed on the unmasked curve where no causal one was measured)."""
        if op.kind == "memory":
            return ComputeModel.memory_class(op)
        if op.kind == "attention":
            kernel = ATTENTION_CLASSES.get(op.kernel, "attention")
            return kernel + CAUSAL if op.causal and op.causal_skip else kernel
        return op.kind

    def op_precision(self, op: Op) -> str:
        """The precision an op computes in under this model's training precision."""
        if self.precision == "fp8" and op.fp8_capable:
            return "fp8"
        return "fp16" if self.precision == "fp16" else "bf16"

    def time(self, op: Op) -> float:
        """Seconds for ``op`` (cached per shape)."""
        precision = self.op_precision(op)
        cls = self.op_class(op)
        # Backward ops may have their own measured curve (``<class>_bwd``), so the phase is part of the key.
        key = (precision, cls, op.phase, *op.shape_key())
        cached = self._cache.get(key)
        if cached is None:
            outer, self.uncalibrated = self.uncalibrated, set()
            try:
                seconds = self._time(op, precision, cls)
                if seconds > 0:
                    seconds = max(seconds, self.floor_s)
            finally:
                labels, self.uncalibrated = frozenset(self.uncalibrated), outer
            cached = (seconds, labels)
            if len(self._cache) >= COST_CACHE_MAX:
                self._cache.clear()  # a long sweep of distinct shapes: start over rather than grow without bound
            self._cache[key] = cached
        if cached[1]:
            self.uncalibrated.update(cached[1])
        return cached[0]

    def _time(self, op: Op, precision: str, cls: str) -> float:
        """Seconds for ``op`` at ``precision`` on the curves of its calibration class ``cls`` (:meth:`op_class`)."""
        hbm = self.device.hbm_bandwidth_bytes_per_s
        if op.kind == "memory":
            size = op.bytes
            if size <= 0:
                return 0.0
            # Reported under the class whose curve timed it (norm, rope, ...), "memory" only for the generic one.
            label = cls
            curve, calibrated = self._measured_backward(op, cls, precision)
            if curve is None:
                curve, calibrated = self._curve(cls, precision)
            if curve is None:
                curve, calibrated = self._curve("memory", precision)
                label = "memory"
            eff = self._efficiency(curve, calibrated, "memory", label, size, hbm)
            return size / (hbm * eff)
        flops = op.flops
        if flops <= 0:
            return 0.0
        if op.grouped and op.batch > GROUPED_GEMM_STREAMS:
            waves, rest = divmod(op.batch, GROUPED_GEMM_STREAMS)
            wave = self._time(op.with_(batch=GROUPED_GEMM_STREAMS, grouped=False), precision, cls)
            last = self._time(op.with_(batch=rest, grouped=False), precision, cls) if rest else 0.0
            return waves * wave + last
        peak = self.device.peak(precision)
        classes = self._candidates(cls)
        curve, calibrated, found = self._lookup(classes, precision)
        bwd_curve, _ = self._measured_backward(op, cls, precision)
        fp8 = self._fp8_efficiency(flops) if op.kind == "gemm" and precision == "fp8" and not calibrated else None
        if fp8 is not None:
            eff = fp8
        elif bwd_curve is not None:
            eff = self._efficiency(bwd_curve, True, op.kind, f"{found}_bwd:{precision}", flops, peak)
        elif op.kind == "attention" and op.phase != "fwd":
            # No backward curve of the device's own. A table with a forward curve keeps it, times the same
            # paper's backward/forward ratio; a device with no attention data at all takes the default table's
            # backward curve (derived from measured backward kernels), like any other uncalibrated class.
            default_bwd, _, found_bwd = (None, False, "") if calibrated else self._lookup(classes, precision, "_bwd")
            if default_bwd is not None:
                eff = self._efficiency(default_bwd, False, op.kind, f"{found_bwd}:{precision}", flops, peak)
            else:
                ratio_label = f"{found}.bwd:{precision}"
                eff = self._efficiency(curve, False, op.kind, ratio_label, flops, peak) * ATTENTION_BWD_RATIO
        else:
            eff = self._efficiency(curve, calibrated, op.kind, f"{found}:{precision}", flops, peak)
        compute_s = flops / (peak * eff * self._sustained)
        return max(compute_s, self._memory_roof(op.bytes, precision, compute_s))

    def _fp8_efficiency(self, flops: float) -> float | None:
        """Efficiency of an FP8 GEMM that no FP8 curve covers, from the 16-bit one (fp8_over_16bit_efficiency);
        None where there is no 16-bit GEMM curve either."""
        own, _ = self._curve("gemm", "bf16")  # the device's own 16-bit GEMMs, else the default curve
        if own is None:
            return None
        self.uncalibrated.add("gemm:fp8")
        p16, p8 = self.device.peak("bf16"), self.device.peak("fp8")
        # The measured ratio at this size, and never faster than a 16-bit GEMM of the same ideal time: flops · p16 / p8
        # FLOPs at the 16-bit peak (half the FLOPs where FP8's peak is twice, as on every shipped device; a what-if
        # raising the 16-bit peak alone had made FP8 steps slower).
        same_time = own.at(flops * p16 / p8, p16)
        return max(min(own.at(flops, p16) * fp8_over_16bit_efficiency(flops), same_time, 1.0), MIN_EFFICIENCY)

    def _memory_roof(self, size: float, precision: str, compute_s: float) -> float:
        """Seconds to move ``size`` bytes at the bandwidth a streaming kernel sustains (module docstring).

        The streaming curve's label is reported as uncalibrated only when the memory roof binds. Only the curve's
        decline past its best size counts (L2 cache, then DRAM, as transfers grow); a small op's launch latency
        is in its own measured curve already, so below that size the roof is the datasheet bandwidth."""
        if size <= 0:
            return 0.0
        hbm = self.device.hbm_bandwidth_bytes_per_s
        curve, calibrated = self._curve("elementwise", precision)
        eff = _sustained(curve, size, hbm) if curve is not None else FALLBACK_EFFICIENCY["memory"]
        seconds = size / (hbm * eff)
        if seconds > compute_s and not calibrated:
            self.uncalibrated.add("elementwise")
        return seconds

    def _measured_backward(self, op: Op, cls: str, precision: str) -> tuple[EfficiencyCurve | None, bool]:
        """The table's own backward curve for a backward op (``<class>_bwd``, measured by our profiler), if any.

        A backward kernel measured on the device beats deriving it from the forward curve: on CPUs and GPUs
        alike the backward of a norm, an activation or attention reaches a different efficiency at the
        same size than its forward. A causal attention op takes its kernel's unmasked backward curve where
        no causal one was measured.
        """
        if op.phase not in ("bwd", "bwd_input", "bwd_weight") or self.table is None:
            return None, False
        classes, suffix = self._candidates(cls), "_bwd"
        if op.kind == "gemm":
            # A backward GEMM's layout (activation or weight gradient) has its own curve where it was measured.
            layout = GEMM_BACKWARD_CLASSES.get(op.phase)
            if layout is None:
                return None, False
            classes, suffix = (layout,), ""
        curve, calibrated, _ = self._lookup(classes, precision, suffix)
        return (curve, True) if calibrated else (None, False)

    def _efficiency(
        self, curve: EfficiencyCurve | None, calibrated: bool, kind: str, label: str, size: float, peak: float
    ) -> float:
        """Efficiency of ``curve`` at ``size``; ``label`` is reported when uncalibrated, ``kind`` (gemm, attention,
        memory) picks the flat fallback when there is no curve at all."""
        if curve is None:
            self.uncalibrated.add(label)
            return FALLBACK_EFFICIENCY[kind]
        if not calibrated:
            self.uncalibrated.add(label)
        return max(curve.at(size, peak), MIN_EFFICIENCY)


def _sustained(curve: EfficiencyCurve, size: float, bandwidth: float) -> float:
    """A streaming curve's efficiency at ``size`` bytes, or at its best size where ``size`` is smaller.

    >>> c = EfficiencyCurve(op="elementwise", precision="any", log10_size=(4.0, 7.0, 9.0), efficiency=(0.1, 1.0, 0.8))
    >>> _sustained(c, 1e3, 1.0), _sustained(c, 1e9, 1.0)
    (1.0, 0.8)
    """
    best = max(range(len(curve.efficiency)), key=curve.efficiency.__getitem__)
    at_best = 10.0 ** curve.log10_size[best] * (bandwidth if curve.axis == "ideal_seconds" else 1.0)
    return min(max(curve.at(max(size, at_best), bandwidth), MIN_EFFICIENCY), 1.0)
