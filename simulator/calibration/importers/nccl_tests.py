"""Import NCCL collective timings from nccl-tests output (NVIDIA/nccl-tests) and from vTrain's tables.

* Standard nccl-tests stdout: a ``#``-commented header (``# nThread 1 nGpus 8 ...``, one ``#  Rank`` line per
  rank naming its host and device, ``# Collective test starting: all_reduce_perf`` in recent versions) and
  one data line per size with ``size count type redop root`` followed by the out-of-place and in-place
  ``time algbw busbw #wrong`` columns; times in **microseconds** (nccl-tests ``README.md``,
  ``doc/PERFORMANCE.md``). The out-of-place time is used.
* vTrain's ``trace/a100/a100_all_reduce_<n>gpu.txt`` (VIA-Research/vTrain, MIT): CSV with columns
  ``size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)``; times in **nanoseconds**, n GPUs of one
  node from the file name. Check: 1 GiB on 8 A100s takes 8.2 ms, a bus bandwidth of 229 GB/s.

The group spans nodes (scope ``network``) when the rank lines name more than one host.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

from simulator.calibration.rows import Measurement
from simulator.errors import CalibrationError

__all__ = ["import_nccl_tests", "import_vtrain_table"]

_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "sendrecv": "send_recv",
    "send_recv": "send_recv",
}


def _collective_from(text: str) -> str | None:
    key = text.lower().removesuffix("_perf").replace("-", "_")
    return _COLLECTIVES.get(key) or _COLLECTIVES.get(key.replace("_", ""))


def import_nccl_tests(
    path: Path, *, collective: str | None = None, device: str = "", ranks: int | None = None
) -> list[Measurement]:
    """Rows from one nccl-tests output file.

    ``collective`` and ``ranks`` override what the header says (older versions do not name the test).
    """
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise CalibrationError(f"{path}: cannot be read ({err}); give nccl-tests output") from None
    hosts: set[str] = set()
    rank_lines = 0
    n_gpus = n_threads = 1
    detected = None
    gpu_name = ""
    data: list[list[str]] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            m = re.search(r"nThread\s+(\d+)\s+nGpus\s+(\d+)", stripped)
            if m:
                n_threads, n_gpus = int(m.group(1)), int(m.group(2))
            m = re.search(
                r"Rank\s+\d+\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s+(.*)$", stripped
            )
            if m:
                rank_lines += 1
                hosts.add(m.group(1))
                gpu_name = m.group(2).strip()
            m = re.search(r"Collective test starting:\s*(\S+)", stripped)
            if m:
                detected = _collective_from(m.group(1))
            continue
        tokens = stripped.split()
        if len(tokens) >= 8 and tokens[0].isdigit():
            data.append(tokens)
    name = collective or detected or _collective_from(path.stem.split(".")[0])
    if name is None:
        raise CalibrationError(
            f"{path}: cannot tell which collective this is; pass --collective (all_reduce, all_gather, ...)"
        )
    if not data:
        raise CalibrationError(f"{path}: no nccl-tests data lines (size count type ... time algbw busbw) found")
    n = ranks or rank_lines or n_gpus * n_threads
    scope = "network" if len(hosts) > 1 else "domain"
    rows = []
    for i, tokens in enumerate(data):
        size = float(tokens[0])
        trailing = tokens[-8:] if len(tokens) >= 13 else tokens[-4:]
        try:
            time_us = float(trailing[0])
        except ValueError:
            raise CalibrationError(f"{path}: data line {i + 1}: cannot read a time from {tokens!r}") from None
        if size <= 0 or time_us <= 0:
            continue
        rows.append(
            Measurement(
                kind="collective",
                op=name,
                precision=tokens[2] if len(tokens) > 2 else "",
                bytes=size,
                ranks=n,
                scope=scope,
                time_s=time_us * 1e-6,
                device=device or gpu_name,
                source=f"nccl-tests output {path.name}",
                note=f"hosts={len(hosts) or 1}",
            )
        )
    return rows


def import_vtrain_table(path: Path, *, device: str = "A100-SXM4-80GB", ranks: int | None = None) -> list[Measurement]:
    """Rows from a vTrain ``a100_all_reduce_<n>gpu.txt`` table (one node, NVSwitch)."""
    m = re.search(r"(\d+)gpu", path.name)
    n = ranks or (int(m.group(1)) if m else None)
    if n is None:
        raise CalibrationError(f"{path}: cannot tell the GPU count from the name; pass --ranks")
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = list(csv.reader(fh))
    except OSError as err:
        raise CalibrationError(f"{path}: cannot be read ({err})") from None
    if not reader or not reader[0] or not reader[0][0].startswith("size"):
        raise CalibrationError(f"{path}: expected a header starting with size(B),count,type,time(ns)")
    rows = []
    for i, rec in enumerate(reader[1:], start=2):
        if len(rec) < 4:
            continue
        try:
            size, time_ns = float(rec[0]), float(rec[3])
        except ValueError:
            raise CalibrationError(f"{path}: line {i}: size or time(ns) is not a number: {rec[:4]!r}") from None
        rows.append(
            Measurement(
                kind="collective",
                op="all_reduce",
                precision=rec[2],
                bytes=size,
                ranks=n,
                scope="domain",
                time_s=time_ns * 1e-9,
                device=device,
                source=f"VIA-Research/vTrain trace/a100/{path.name}",
            )
        )
    return rows
