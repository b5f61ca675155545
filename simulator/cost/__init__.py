"""Cost models: seconds for operators and collectives, bytes per pipeline stage. No simulation here."""

from __future__ import annotations

from simulator.cost.communication import CommModel
from simulator.cost.compute import ComputeModel
from simulator.cost.memory import StageMemory, stage_memory

__all__ = ["CommModel", "ComputeModel", "StageMemory", "stage_memory"]
