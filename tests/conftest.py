"""Shared fixtures: small models and clusters built in code, so unit tests do not depend on library files."""

from __future__ import annotations

import pytest

from simulator.specs.hardware import ClusterSpec, DeviceSpec
from simulator.specs.model import ModelSpec


@pytest.fixture
def tiny_model() -> ModelSpec:
    return ModelSpec(name="tiny", layers=8, hidden=512, heads=8, ffn_hidden=2048, vocab=1024, seq_len=256)


@pytest.fixture
def toy_device() -> DeviceSpec:
    return DeviceSpec(
        name="toy",
        peak_flops=(("bf16", 100e12), ("fp16", 100e12)),
        hbm_bytes=16 * 2**30,
        hbm_bandwidth_bytes_per_s=1e12,
    )


@pytest.fixture
def toy_cluster(toy_device: DeviceSpec) -> ClusterSpec:
    return ClusterSpec(
        name="toy-8",
        device=toy_device,
        gpus_per_node=8,
        nvlink_bandwidth_bytes_per_s=200e9,
        nics_per_node=8,
        nic_bandwidth_bytes_per_s=25e9,
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--regen-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/expected/*.json from the current simulator instead of comparing (on purpose only)",
    )
