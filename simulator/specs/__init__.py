"""Frozen, validated inputs: model, device, cluster, plan and calibration specs, and their loaders.

This layer imports nothing above it (graph, parallel, cost, engine...). Every spec is a frozen dataclass
built by a named constructor from a parsed file; errors are :class:`~simulator.errors.SpecError` naming
the file and key path.
"""

from __future__ import annotations

from simulator.specs.calibration import BandwidthCurve, CalibrationTable, EfficiencyCurve
from simulator.specs.hardware import ClusterSpec, DeviceSpec
from simulator.specs.hf import model_from_hf_config
from simulator.specs.library import (
    list_names,
    load_calibration,
    load_cluster,
    load_device,
    load_model,
    load_plan,
)
from simulator.specs.model import ModelSpec, MoESpec
from simulator.specs.plan import PlanSpec

__all__ = [
    "BandwidthCurve",
    "CalibrationTable",
    "ClusterSpec",
    "DeviceSpec",
    "EfficiencyCurve",
    "MoESpec",
    "ModelSpec",
    "PlanSpec",
    "list_names",
    "load_calibration",
    "load_cluster",
    "load_device",
    "load_model",
    "load_plan",
    "model_from_hf_config",
]
