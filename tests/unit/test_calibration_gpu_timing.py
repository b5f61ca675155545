"""CUDA timing without a GPU: a simulated stream checks that time_fn times the GPU's work, not the host's gaps.

The fake models one CUDA stream: the host issues kernels at its own pace, the GPU runs them in order as soon as
it is free, and an event completes when the work queued before it has finished. A benchmark that issues three
2 µs kernels over 100 µs of host work (as ``torch.autograd.grad`` does for a norm's backward) then takes 6 µs of
GPU time, which is what a training step, whose host queues far ahead of the GPU, spends on it.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from simulator.calibration import torchlib

KERNEL_S = 2e-6
KERNELS = 3
HOST_PER_KERNEL_S = 100e-6 / KERNELS
SLEEP_RATE = 1.5e9  # spin cycles per second of the fake GPU


class _Stream:
    def __init__(self) -> None:
        self.host = 0.0  # the host's clock
        self.free_at = 0.0  # when the GPU finishes what is queued

    def launch(self, seconds: float) -> None:
        self.free_at = max(self.host, self.free_at) + seconds


class _Event:
    def __init__(self, stream: _Stream) -> None:
        self.stream = stream
        self.at = 0.0

    def record(self) -> None:
        self.at = max(self.stream.host, self.stream.free_at)

    def synchronize(self) -> None:
        self.stream.host = max(self.stream.host, self.at)

    def elapsed_time(self, other: _Event) -> float:
        return (other.at - self.at) * 1e3  # milliseconds, as CUDA's


def _fake_torch(stream: _Stream, *, sleep: bool) -> Any:
    cuda = types.SimpleNamespace(
        Event=lambda enable_timing=True: _Event(stream),
        synchronize=lambda dev=None: setattr(stream, "host", max(stream.host, stream.free_at)),
    )
    if sleep:
        cuda._sleep = lambda cycles: stream.launch(cycles / SLEEP_RATE)
    return types.SimpleNamespace(cuda=cuda)


@pytest.fixture
def stream(monkeypatch: pytest.MonkeyPatch) -> _Stream:
    s = _Stream()
    monkeypatch.setattr(torchlib, "time", types.SimpleNamespace(perf_counter=lambda: s.host))
    monkeypatch.setattr(torchlib, "_SLEEP_RATE", {})
    return s


def _backward_like(stream: _Stream) -> Any:
    def fn() -> None:
        for _ in range(KERNELS):
            stream.host += HOST_PER_KERNEL_S  # the host's work before each launch (autograd, dispatch)
            stream.launch(KERNEL_S)

    return fn


def test_cuda_events_time_the_gpu_work_of_a_host_bound_benchmark(
    stream: _Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torchlib, "require_torch", lambda: _fake_torch(stream, sleep=True))
    dev = types.SimpleNamespace(type="cuda")
    timing = torchlib.time_fn(_backward_like(stream), dev, warmup=2, repeats=5)
    assert timing.median_s == pytest.approx(KERNELS * KERNEL_S, rel=1e-6)
    assert timing.min_s == pytest.approx(KERNELS * KERNEL_S, rel=1e-6)
    # The spin's rate was measured once, and it matches the fake's.
    assert torchlib._SLEEP_RATE[str(dev)] == pytest.approx(SLEEP_RATE)


def test_without_a_spin_kernel_the_events_also_time_the_host(stream: _Stream, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PyTorch without ``torch.cuda._sleep``: timing still works and says what it is, the host-bound time (this is
    what every CUDA profile measured before the preload)."""
    monkeypatch.setattr(torchlib, "require_torch", lambda: _fake_torch(stream, sleep=False))
    dev = types.SimpleNamespace(type="cuda")
    timing = torchlib.time_fn(_backward_like(stream), dev, warmup=2, repeats=5)
    # The start event fires at once, and the GPU then waits for each launch: the host's 100 µs show, not the 6 µs.
    assert timing.median_s == pytest.approx(KERNELS * HOST_PER_KERNEL_S + KERNEL_S, rel=1e-6)


def test_a_gpu_bound_benchmark_loses_only_its_launch_gap_to_the_spin(
    stream: _Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One 1 ms kernel issued in 10 µs: the preload takes the 10 µs launch gap out, nothing else."""

    def gemm() -> None:
        stream.host += 10e-6
        stream.launch(1e-3)

    dev = types.SimpleNamespace(type="cuda")
    got = []
    for sleep in (True, False):
        monkeypatch.setattr(torchlib, "require_torch", lambda sleep=sleep: _fake_torch(stream, sleep=sleep))
        got.append(torchlib.time_fn(gemm, dev, warmup=2, repeats=3).median_s)
    assert got[0] == pytest.approx(1e-3, rel=1e-6)
    assert got[1] == pytest.approx(1e-3 + 10e-6, rel=1e-6)
