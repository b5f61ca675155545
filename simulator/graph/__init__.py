"""Operator graphs of transformers: shapes, FLOPs, bytes, parameters and saved activations per op."""

from __future__ import annotations

from simulator.graph.ops import Op
from simulator.graph.transformer import ATTENTION_KERNELS, Block, ModelGraph, build_graph

__all__ = ["ATTENTION_KERNELS", "Block", "ModelGraph", "Op", "build_graph"]
