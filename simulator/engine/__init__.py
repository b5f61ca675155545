"""The discrete-event engine: folds each task's program, then simulates the pipeline step with simpy.

Durations arrive as data from the cost models; the engine computes no costs itself.
"""

from __future__ import annotations

from simulator.engine.fold import FoldResult, TimedStep, fold
from simulator.engine.pipeline import PipelineInput, PipelineResult, StageInput, StageTimes, simulate_pipeline

__all__ = [
    "FoldResult",
    "PipelineInput",
    "PipelineResult",
    "StageInput",
    "StageTimes",
    "TimedStep",
    "fold",
    "simulate_pipeline",
]
