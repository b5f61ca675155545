"""Collective costs: NVLink SHARP (NVLS) all-reduce and the network tier (issue 3: NVLS where present)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from simulator.cost.communication import NETWORK_EFFICIENCY, NVLS_GAIN, CommModel
from simulator.parallel.layout import place
from simulator.parallel.program import Comm
from simulator.specs.library import load_calibration, load_cluster

SIZE = 256 * 2**20


def _time(cluster_name: str, collective: str, ranks: int, *, nvls: bool, stride: int = 1) -> float:
    cluster = replace(load_cluster(cluster_name), nvls=nvls)
    comm = CommModel(cluster, cluster.calibration, load_calibration("default"))
    group = place("g", ranks, stride, cluster)
    return comm.time(Comm("c", collective, group, SIZE, "tp"))


def test_nvls_speeds_up_an_eight_gpu_all_reduce_by_the_measured_ratio() -> None:
    ring = _time("dgx-h100", "all_reduce", 8, nvls=False)
    nvls = _time("dgx-h100", "all_reduce", 8, nvls=True)
    assert ring / nvls == pytest.approx(NVLS_GAIN[8])
    assert NVLS_GAIN[8] == pytest.approx(480 / 370)


@pytest.mark.parametrize("ranks", [2, 4])
def test_nvls_gives_nothing_to_small_groups(ranks: int) -> None:
    assert _time("dgx-h100", "all_reduce", ranks, nvls=True) == _time("dgx-h100", "all_reduce", ranks, nvls=False)


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather", "all_to_all"])
def test_nvls_only_accelerates_all_reduce(collective: str) -> None:
    assert _time("dgx-h100", collective, 8, nvls=True) == _time("dgx-h100", collective, 8, nvls=False)


def test_the_default_table_gets_the_gain_too() -> None:
    """hgx-h200 has no measured table: its default (ring) curve is scaled by the same NVLS gain."""
    ring = _time("hgx-h200", "all_reduce", 8, nvls=False)
    assert ring / _time("hgx-h200", "all_reduce", 8, nvls=True) == pytest.approx(NVLS_GAIN[8])


def test_network_ring_is_paced_by_the_nics_at_the_achieved_fraction_of_line_rate() -> None:
    """A 2-node ring with one member per node (stride 8): each GPU's NIC share at 96% of line rate."""
    cluster = load_cluster("dgx-h100")
    t = _time("dgx-h100", "all_gather", 2, nvls=True, stride=8)
    expected = 0.5 * SIZE / (cluster.nic_bandwidth_per_gpu_bytes_per_s * NETWORK_EFFICIENCY) + 1 * (
        cluster.inter_node_latency_s
    )
    assert t == pytest.approx(expected)
