"""Hardware specs: one accelerator (:class:`DeviceSpec`) and one cluster of them (:class:`ClusterSpec`).

Numbers come from vendor datasheets and are *dense* peaks (no 2:4 sparsity). Rates use decimal prefixes as
datasheets do (TFLOP/s, GB/s, Gb/s); capacity is in GiB as allocators report it. The cluster describes
the two tiers a collective can cross: the NVLink/NVSwitch domain (inside a node, or a whole rack for
GB200 NVL72) and the scale-out network of NICs above it (rail-optimised or fat tree, possibly
oversubscribed). Per-size achieved bandwidths come from a calibration table when the cluster names one.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from simulator.errors import SpecError
from simulator.specs._fields import Fields, check_choices, check_positive, check_ranges, check_scalar_types
from simulator.specs.calibration import (
    MAX_BUSBW_GB_PER_S,
    MEMORY_CLASSES,
    MIN_BUSBW_GB_PER_S,
    CalibrationTable,
    EfficiencyCurve,
)
from simulator.units import GB, GBIT, GIB, TFLOP, US

__all__ = ["MAX_LATENCY_S", "PRECISIONS", "TOPOLOGIES", "ClusterSpec", "DeviceSpec"]

PRECISIONS = ("fp64", "tf32", "fp16", "bf16", "fp8")
TOPOLOGIES = ("rail_optimized", "fat_tree")
# How the GPUs of one scale-up domain are wired: through switches (NVSwitch: any group reaches the full per-GPU
# bandwidth) or as a direct mesh (AMD Infinity Fabric, DGX-1's NVLink cube-mesh: a GPU reaches each peer over
# its own links, so a group of k uses k - 1 of the n - 1 peer links; communication.CommModel).
NVLINK_TOPOLOGIES = ("switch", "mesh")
# How a job's nodes are laid on NVLink domains that span several nodes (GB200 NVL72): ``segments`` (equal blocks of
# nodes, each inside one domain: Slurm's --segment with the topology/block plugin, which NVIDIA's Megatron-Bridge
# launcher sets on 4-GPU nodes, scripts/performance/utils/executors.py) or ``packed`` (domains filled in rank order).
DOMAIN_ALLOCATIONS = ("segments", "packed")
# The longest per-hop latency a cluster may state: PyTorch's default NCCL process-group timeout, 10 minutes
# (pytorch/pytorch PR #110947, "Change ProcessGroupNCCL default timeout to 10 min"). A collective step slower than
# that is aborted by the watchdog, so no cluster that trains can have it; anything above is a typo.
MAX_LATENCY_S = 600.0
# Plausible ranges of the figures a device or a cluster states, in the units of their files (key: (low, high, unit
# in base units, unit name)). Outside them a figure is a unit slip or a typo, not hardware: a what-if of 1e-30
# TFLOP/s had run a 3e33-second step, one of 1e-20 Gb/s NICs a 2e22-second one. The bounds are deliberately wide,
# so that what-ifs stay free: 1 MFLOP/s is below even emulated arithmetic (PyTorch's FP8 GEMMs on this project's CI
# CPU, which the calibration loop profiles, ran 65 MFLOP/s), 1 EFLOP/s 50 times GB200's 20 PFLOP/s of sparse FP4
# (NVIDIA GB200 NVL72 datasheet); 1 MB/s to 1 PB/s brackets every memory, NVLink and NIC rate a hundredfold and more
# (B200's HBM3e 7.7 TB/s, NVLink 5 900 GB/s per direction, ConnectX-8 800 Gb/s); 1 MiB to 1 PiB of memory (0.001 to
# 1,000,000 GiB).
PLAUSIBLE: dict[str, tuple[float, float, float, str]] = {
    "peak_tflops": (1e-6, 1e6, TFLOP, "TFLOP/s"),
    "hbm_gib": (1e-3, 1e6, GIB, "GiB"),
    "hbm_bandwidth_gb_per_s": (1e-3, 1e6, GB, "GB/s"),
    "nvlink_bandwidth_gb_per_s": (MIN_BUSBW_GB_PER_S, MAX_BUSBW_GB_PER_S, GB, "GB/s"),
    "nic_bandwidth_gbit_per_s": (8e-3, 8e6, GBIT, "Gb/s"),
}


def _check_plausible(key: str, field: str, value: float, fix: str) -> None:
    """``value`` (of the spec's ``field``, in base units) must lie in the :data:`PLAUSIBLE` range of ``key``."""
    low, high, unit, label = PLAUSIBLE[key]
    if not low * unit <= value <= high * unit:
        raise SpecError(
            field, f"is not a realistic figure: {value / unit:g} {label} is outside {low:g} to {high:g} {label}", fix
        )


# The keys of a device file and of a cluster file (Fields: a valid key is never suggested as a misspelling).
_DEVICE_KEYS = (
    "name",
    "vendor",
    *(f"peak_tflops_{p}" for p in PRECISIONS),
    "hbm_gib",
    "hbm_bandwidth_gb_per_s",
    "sm_count",
    "tdp_watts",
    "price_per_gpu_hour_usd",
    "source",
    "sources",
    "description",
)
_CLUSTER_KEYS = (
    "name",
    "device",
    "calibration",
    "fabric_calibration",
    "gpus_per_node",
    "nvlink_bandwidth_gb_per_s",
    "nvls",
    "nvlink_domain_gpus",
    "nvlink_topology",
    "domain_allocation",
    "nics_per_node",
    "nic_bandwidth_gbit_per_s",
    "topology",
    "oversubscription",
    "intra_node_latency_us",
    "inter_node_latency_us",
    "max_gpus",
    "description",
    "source",
    "sources",
)
# A ClusterSpec field in base units and the key of a cluster file that gives it, so that a rule checked on the
# spec (ClusterSpec.__post_init__) names what the file says.
_CLUSTER_FILE_KEYS = {
    "nvlink_bandwidth_bytes_per_s": "nvlink_bandwidth_gb_per_s",
    "nic_bandwidth_bytes_per_s": "nic_bandwidth_gbit_per_s",
    "intra_node_latency_s": "intra_node_latency_us",
    "inter_node_latency_s": "inter_node_latency_us",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator.

    ``peak_flops`` pairs a precision with its dense peak FLOP/s; a precision the device lacks (FP8 on an
    A100) is absent, and :meth:`peak` falls back to the 16-bit peak for it.
    """

    name: str
    vendor: str = ""
    peak_flops: tuple[tuple[str, float], ...] = ()
    hbm_bytes: float
    hbm_bandwidth_bytes_per_s: float
    sm_count: int = 0
    tdp_watts: float = 0.0
    price_per_gpu_hour_usd: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        check_scalar_types(self)
        check_positive(self, ("hbm_bytes", "hbm_bandwidth_bytes_per_s"), "give the datasheet figure")
        pairs = self.peak_flops if isinstance(self.peak_flops, tuple) else (self.peak_flops,)
        for pair in pairs:
            ok = isinstance(pair, tuple) and len(pair) == 2 and pair[0] in PRECISIONS
            if not ok or isinstance(pair[1], bool) or not isinstance(pair[1], numbers.Real) or not pair[1] > 0:
                raise SpecError(
                    "peak_flops",
                    f"must pair a precision ({', '.join(PRECISIONS)}) with a peak FLOP/s > 0, got {pair!r}",
                    "e.g. peak_flops=(('bf16', 989e12),)",
                )
        check_ranges(self, {"sm_count": 0, "tdp_watts": 0.0, "price_per_gpu_hour_usd": 0.0})
        for precision, flops in pairs:
            _check_plausible("peak_tflops", f"peak_tflops_{precision}", flops, "give the dense peak in TFLOP/s")
        _check_plausible(
            "hbm_gib", "hbm_gib", self.hbm_bytes, "give the capacity in GiB (nvidia-smi's MiB / 1024: 79.6 on H100)"
        )
        _check_plausible(
            "hbm_bandwidth_gb_per_s",
            "hbm_bandwidth_gb_per_s",
            self.hbm_bandwidth_bytes_per_s,
            "give the datasheet memory bandwidth in GB/s (3,350 for an H100 SXM)",
        )

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision``; FP8 falls back to FP16/BF16 where the device has no FP8."""
        peaks = dict(self.peak_flops)
        if precision in peaks:
            return peaks[precision]
        if precision == "fp8":
            return self.peak("bf16")
        if precision in ("bf16", "fp16"):
            other = "fp16" if precision == "bf16" else "bf16"
            if other in peaks:
                return peaks[other]
        raise SpecError(
            f"device {self.name}", f"has no peak for precision {precision!r}", "add peak_tflops_" + precision
        )

    def curve_rate(self, curve: EfficiencyCurve) -> float:
        """The rate a measured curve's sizes are read against on this device: HBM bytes/s for the memory-bound
        classes and their backward curves (sizes in bytes), else the FLOP/s peak at the curve's precision (the
        16-bit one for ``any``). Size over this rate over the efficiency is the kernel's time."""
        if curve.op.removesuffix("_bwd") in MEMORY_CLASSES:
            return self.hbm_bandwidth_bytes_per_s
        return self.peak(curve.precision if curve.precision in ("fp16", "bf16", "fp8") else "bf16")

    @classmethod
    def from_mapping(cls, data: Any, where: str) -> DeviceSpec:
        """Build from a parsed device file (keys ``peak_tflops_<precision>``, ``hbm_gib``, ...)."""
        f = Fields(data, where, keys=_DEVICE_KEYS)
        peaks = {}
        for p in PRECISIONS:
            key = f"peak_tflops_{p}"
            value = f.scaled(key, f.number(key, None, positive=True), TFLOP, "give the dense datasheet peak in TFLOP/s")
            if value is not None:
                peaks[p] = value
        if "bf16" not in peaks and "fp16" not in peaks:
            raise f.error("peak_tflops_bf16", "is required (or peak_tflops_fp16)", "add the dense BF16 peak")
        kwargs: dict[str, Any] = {
            "name": f.text("name"),
            "vendor": f.text("vendor", ""),
            "peak_flops": tuple(peaks.items()),
            "hbm_bytes": f.scaled("hbm_gib", f.number("hbm_gib", positive=True), GIB, "give the HBM capacity in GiB"),
            "hbm_bandwidth_bytes_per_s": f.scaled(
                "hbm_bandwidth_gb_per_s",
                f.number("hbm_bandwidth_gb_per_s", positive=True),
                GB,
                "give the datasheet HBM bandwidth in GB/s",
            ),
            "sm_count": f.integer("sm_count", 0, minimum=0),
            "tdp_watts": f.number("tdp_watts", 0.0, minimum=0.0),
            "price_per_gpu_hour_usd": f.number("price_per_gpu_hour_usd", None, minimum=0.0),
            "source": f.text("source", ""),
        }
        try:
            spec = cls(**kwargs)
        except SpecError as err:
            raise SpecError(f"{where}: {err.where}", err.what, err.fix) from None
        f.done(ignore=("sources", "description"))
        return spec


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """A homogeneous cluster of nodes.

    ``nvlink_bandwidth_bytes_per_s`` is per GPU and per direction (the figure NVIDIA quotes as 900 GB/s for
    H100 is both directions: 450 GB/s each way). ``nic_bandwidth_bytes_per_s`` is per NIC, one direction.
    ``nvlink_domain_gpus`` is how many GPUs share one NVLink domain (8 for a DGX, 72 for GB200 NVL72).
    ``nvlink_topology`` is ``switch`` (NVSwitch) or ``mesh`` (direct peer links: ``nvlink_bandwidth`` is then
    the all-links figure, of which a group of k GPUs uses (k − 1) / (domain − 1), a point-to-point transfer 1).
    ``domain_allocation`` says how a job's nodes sit on a domain of several nodes (:data:`DOMAIN_ALLOCATIONS`,
    :meth:`job_domain_gpus`). ``topology`` describes the network (``rail_optimized`` or ``fat_tree``); both are
    modelled as non-blocking, and
    ``oversubscription`` is what slows it. ``intra_node_latency_s`` bounds NVLink collectives from below per step
    where they run on the default curves (measured curves carry their own latency), and is the latency of the steps
    inside a node of a collective across nodes, whose steps between nodes take ``inter_node_latency_s`` (NCCL's
    tuning model, src/graph/tuning.cc).
    """

    name: str
    device: DeviceSpec
    gpus_per_node: int
    nvlink_bandwidth_bytes_per_s: float
    nvls: bool = False
    nvlink_domain_gpus: int = 0  # 0 means gpus_per_node
    nvlink_topology: str = "switch"
    domain_allocation: str = "segments"
    nics_per_node: int
    nic_bandwidth_bytes_per_s: float
    topology: str = "rail_optimized"
    oversubscription: float = 1.0
    # Per-step latencies where a cluster file states none: the shipped clusters' figures and sources
    # (hardware_profiles/clusters/dgx-h100.yaml: NCCL's tuning model, src/graph/tuning.cc, hwLat).
    intra_node_latency_s: float = 3 * US
    inter_node_latency_s: float = 6 * US
    calibration: CalibrationTable | None = None
    # A table whose NVLink-domain collective curves apply because they were measured on an identical fabric
    # (same NVLink generation, per-GPU bandwidth and NVSwitch), when ``calibration`` has none of its own.
    fabric_calibration: CalibrationTable | None = None
    max_gpus: int | None = None
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        check_scalar_types(self)
        if not isinstance(self.device, DeviceSpec):
            raise SpecError("device", f"must be a DeviceSpec, got {type(self.device).__name__}", "load_device(name)")
        for key in ("calibration", "fabric_calibration"):
            table = getattr(self, key)
            if table is not None and not isinstance(table, CalibrationTable):
                raise SpecError(
                    key, f"must be a CalibrationTable or None, got {type(table).__name__}", "load_calibration(name)"
                )
        check_choices(
            self,
            {"topology": TOPOLOGIES, "nvlink_topology": NVLINK_TOPOLOGIES, "domain_allocation": DOMAIN_ALLOCATIONS},
        )
        check_positive(self, ("nvlink_bandwidth_bytes_per_s", "nic_bandwidth_bytes_per_s"), "give the datasheet figure")
        check_ranges(self, {"gpus_per_node": 1, "nics_per_node": 1, "nvlink_domain_gpus": 0, "max_gpus": 1})
        check_ranges(self, {"oversubscription": 1.0}, "1 is a non-blocking fabric")
        check_ranges(self, {"intra_node_latency_s": 0.0, "inter_node_latency_s": 0.0})
        _check_plausible(
            "nvlink_bandwidth_gb_per_s",
            "nvlink_bandwidth_bytes_per_s",
            self.nvlink_bandwidth_bytes_per_s,
            "give the NVLink bandwidth per GPU and direction in GB/s (450 for DGX H100)",
        )
        _check_plausible(
            "nic_bandwidth_gbit_per_s",
            "nic_bandwidth_bytes_per_s",
            self.nic_bandwidth_bytes_per_s,
            "give the line rate of one NIC in Gb/s (400 for ConnectX-7 NDR)",
        )
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            if getattr(self, name) > MAX_LATENCY_S:
                raise SpecError(
                    name,
                    f"must be at most {MAX_LATENCY_S:g} s (PyTorch's NCCL timeout), got {getattr(self, name):g}",
                    "give the per-hop latency (a few microseconds on NVLink and InfiniBand)",
                )
        if self.nvlink_domain_gpus == 0:
            object.__setattr__(self, "nvlink_domain_gpus", self.gpus_per_node)
        if self.nvlink_domain_gpus % self.gpus_per_node:
            raise SpecError(
                "nvlink_domain_gpus",
                f"must be a multiple of gpus_per_node: nvlink_domain_gpus={self.nvlink_domain_gpus}, "
                f"gpus_per_node={self.gpus_per_node}",
                "use a whole number of nodes per NVLink domain",
            )

    @property
    def calibration_label(self) -> str:
        """The calibration tables results on this cluster use, by name ("" when only default curves)."""
        names = [self.calibration.name] if self.calibration is not None else []
        if self.fabric_calibration is not None:
            names.append(f"{self.fabric_calibration.name} (NVLink collectives, same fabric)")
        return " + ".join(names)

    def job_domain_gpus(self, num_gpus: int) -> int:
        """How many consecutive ranks of a ``num_gpus`` job share one NVLink domain: the domain itself where it is one
        node, or with ``packed`` allocation; with ``segments`` the job's nodes come in equal segments, each inside one
        domain, of all its nodes when they fit one domain, else of the most nodes a domain holds that divide the job's
        node count (Megatron-Bridge's rule for Slurm's --segment: 64 trays of GB200 NVL72 in 4 segments of 16, i.e.
        64 GPUs a rack, not 72, 72, 72 and 40; a prime count of trays, segments of one).

        >>> from simulator.specs.library import load_cluster
        >>> nvl72 = load_cluster("gb200-nvl72")
        >>> nvl72.job_domain_gpus(256), nvl72.job_domain_gpus(576), nvl72.job_domain_gpus(32)
        (64, 72, 32)
        """
        domain = self.nvlink_domain_gpus
        if domain == self.gpus_per_node or self.domain_allocation == "packed":
            return domain
        nodes = max(1, -(-num_gpus // self.gpus_per_node))
        per_domain = domain // self.gpus_per_node
        segment = nodes if nodes <= per_domain else max(k for k in range(1, per_domain + 1) if nodes % k == 0)
        return segment * self.gpus_per_node

    @property
    def nic_bandwidth_per_gpu_bytes_per_s(self) -> float:
        """Scale-out bandwidth one GPU can use when every GPU of its node talks at once."""
        return self.nics_per_node * self.nic_bandwidth_bytes_per_s / self.gpus_per_node

    @classmethod
    def from_mapping(
        cls,
        data: Any,
        where: str,
        *,
        device: DeviceSpec | None = None,
        calibration: CalibrationTable | None = None,
        fabric_calibration: CalibrationTable | None = None,
    ) -> ClusterSpec:
        """Build from a parsed cluster file.

        ``device``, ``calibration`` and ``fabric_calibration`` are the objects the file's names of the same
        keys resolve to (the library does that); an inline ``device:`` mapping is read here.
        """
        f = Fields(data, where, keys=_CLUSTER_KEYS)
        raw_device = f.raw("device")
        f.raw("calibration", None)
        f.raw("fabric_calibration", None)
        if device is None:
            if isinstance(raw_device, str):
                raise f.error(
                    "device",
                    f"names {raw_device!r}, which only the library resolves",
                    "load the file with load_cluster, or pass device=load_device(name)",
                )
            if not isinstance(raw_device, dict):
                raise f.error(
                    "device",
                    f"must name a device profile or describe one inline, got {raw_device!r}",
                    "write a built-in device name (such as H100-SXM5-80GB), a path, or a mapping of device keys",
                )
            device = DeviceSpec.from_mapping(raw_device, f"{where}: device")
        spec_kwargs: dict[str, Any] = {
            "name": f.text("name"),
            "device": device,
            "gpus_per_node": f.integer("gpus_per_node", minimum=1),
            "nvlink_bandwidth_bytes_per_s": f.scaled(
                "nvlink_bandwidth_gb_per_s",
                f.number("nvlink_bandwidth_gb_per_s", positive=True),
                GB,
                "give the NVLink bandwidth per GPU and direction in GB/s (450 for DGX H100: 900 bidirectional)",
            ),
            "nvls": f.boolean("nvls", False),
            "nvlink_domain_gpus": f.integer("nvlink_domain_gpus", 0, minimum=1),
            "nvlink_topology": f.choice("nvlink_topology", NVLINK_TOPOLOGIES, "switch"),
            "domain_allocation": f.choice("domain_allocation", DOMAIN_ALLOCATIONS, "segments"),
            "nics_per_node": f.integer("nics_per_node", minimum=1),
            "nic_bandwidth_bytes_per_s": f.scaled(
                "nic_bandwidth_gbit_per_s",
                f.number("nic_bandwidth_gbit_per_s", positive=True),
                GBIT,
                "give the line rate of one NIC in Gb/s (400 for ConnectX-7 NDR)",
            ),
            "topology": f.choice("topology", TOPOLOGIES, "rail_optimized"),
            "oversubscription": f.number("oversubscription", 1.0, minimum=1.0),
            "intra_node_latency_s": _latency(f, "intra_node_latency_us", 3.0),
            "inter_node_latency_s": _latency(f, "inter_node_latency_us", 6.0),
            "calibration": calibration,
            "fabric_calibration": fabric_calibration,
            "max_gpus": f.integer("max_gpus", None, minimum=1),
            "description": f.text("description", ""),
            "source": f.text("source", ""),
        }
        f.done(ignore=("sources",))
        try:
            return cls(**spec_kwargs)
        except SpecError as err:
            raise SpecError(f"{where}: {_CLUSTER_FILE_KEYS.get(err.where, err.where)}", err.what, err.fix) from None


def _latency(f: Fields, key: str, default: float) -> float:
    """A per-hop latency in µs from a cluster file, in seconds; at most :data:`MAX_LATENCY_S`."""
    value: float = f.number(key, default, minimum=0.0)
    if value * US > MAX_LATENCY_S:
        raise f.error(
            key,
            f"must be at most {MAX_LATENCY_S / US:,.0f} µs (PyTorch's 10-minute NCCL timeout), got {value:g}",
            "give the per-hop latency in µs (about 3 on NVLink, 6 on InfiniBand)",
        )
    return value * US
