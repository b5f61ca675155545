"""Import NCCL collective timings from nccl-tests output (NVIDIA/nccl-tests) and from vTrain's tables.

* Standard nccl-tests stdout: a ``#``-commented header (``# nThread 1 nGpus 8 ...``, one ``#  Rank`` line per
  rank naming its host and device, ``# Collective test starting: all_reduce_perf`` in recent versions, and the
  column header ``#  size  count  type  redop  root  time  algbw  busbw #wrong ...``) and one data line per size
  with ``size count type redop root`` followed by the out-of-place and in-place ``time algbw busbw #wrong``
  columns; times in **microseconds** (nccl-tests ``README.md``, ``doc/PERFORMANCE.md``). The out-of-place time
  is used. Logs older than the root column (2.x before 2.10) have four fields before the times, not five; as
  nccl-tests prints a time of 10 ms or more as a whole number (``%7.0f``), the fields themselves do not tell the
  two apart, so the column header does (the fields before ``time``), else the length of a whole data line (12
  fields without the root column, 13 with it).
* vTrain's ``trace/a100/a100_all_reduce_<n>gpu.txt`` (VIA-Research/vTrain, MIT): CSV with columns
  ``size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)``; times in **nanoseconds**, n GPUs of one
  node from the file name. Check: 1 GiB on 8 A100s takes 8.2 ms, a bus bandwidth of 229 GB/s.

The group spans nodes (scope ``network``) when the rank lines name more than one host, unless the caller says
otherwise (``scope``): the hosts of one multi-node NVLink domain (GB200 NVL72: 18 trays of 4 GPUs) share NVLink.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from simulator.calibration.rows import MAX_ALGBW_BYTES_PER_S, Measurement, input_file, not_utf8_error
from simulator.errors import CalibrationError
from simulator.specs.calibration import COLLECTIVES

__all__ = ["collective_name", "import_nccl_tests", "import_vtrain_table"]

_WHAT = "nccl-tests output or a vTrain table"

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


def collective_name(text: str) -> str:
    """The calibration-table name of a collective given as ``text`` (``all_reduce``, ``allreduce``,
    ``all_reduce_perf``...), or a CalibrationError listing the names calibration tables accept.

    >>> collective_name("all_gather_perf"), collective_name("AllReduce")
    ('all_gather', 'all_reduce')
    """
    name = _collective_from(text)
    if name is None or name not in COLLECTIVES:
        raise CalibrationError(
            f"--collective {text!r}: not a collective calibration tables accept; give one of "
            f"{', '.join(COLLECTIVES)} (nccl-tests' all_reduce_perf is all_reduce, sendrecv_perf is send_recv)"
        )
    return name


def _dropped_note(path: Path, lines: list[int], why: str) -> str:
    shown = ", ".join(map(str, lines[:5])) + (", ..." if len(lines) > 5 else "")
    return f"{path}: dropped {len(lines)} data line(s) with {why}: line {shown}"


def import_nccl_tests(
    path: Path,
    *,
    collective: str | None = None,
    device: str = "",
    ranks: int | None = None,
    scope: str | None = None,
    notes: list[str] | None = None,
) -> list[Measurement]:
    """Rows from one nccl-tests output file.

    ``collective`` and ``ranks`` override what the header says (older versions do not name the test), ``scope`` what
    the rank lines' hosts say.
    Data lines with a zero or negative size or time, or with wrong results (``#wrong`` > 0), are dropped; ``notes``
    (when given) gets one line saying how many and which. A time too short for any fabric (a unit slip) is an
    error.
    """
    input_file(path, "nccl-tests output")
    name_given = collective_name(collective) if collective else None
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CalibrationError(f"{path}: cannot be read ({err.strerror or err}); give nccl-tests output") from None
    utf8 = True
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # a stray byte in a log is tolerated; a binary file has no data lines
        utf8 = False
        text = raw.decode("utf-8", errors="replace")
    # One file may hold several runs (a job script running all_reduce_perf then all_gather_perf, or one binary
    # on two node counts): each starts with its "# nThread ... nGpus" header and has its own rank lines, test
    # name and data lines, so each run's rows get their own collective, group size and scope.
    runs: list[_Run] = [_Run()]
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        run = runs[-1]
        if stripped.startswith("#"):
            m = re.search(r"nThread\s+(\d+)\s+nGpus\s+(\d+)", stripped)
            if m:
                # nccl-tests prints "Collective test starting" before this header: a run that has no rank or
                # data line yet is the one that line opened.
                if run.data or run.rank_lines:
                    run = _Run()
                    runs.append(run)
                run.n_threads, run.n_gpus = int(m.group(1)), int(m.group(2))
            m = re.search(
                r"Rank\s+\d+\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s+(.*)$", stripped
            )
            if m:
                run.rank_lines += 1
                run.hosts.add(m.group(1))
                run.gpu_name = m.group(2).strip()
            columns = stripped.lstrip("#").split()
            if columns and columns[0] in ("size", "bytes") and "time" in columns:
                run.leading = columns.index("time")  # the column header: the fields before the out-of-place time
            m = re.search(r"Collective test starting:\s*(\S+)", stripped)
            if m:
                if run.data or run.rank_lines:  # the next test of the log: its own run
                    run = _Run()
                    runs.append(run)
                run.detected = _collective_from(m.group(1))
            continue
        tokens = stripped.split()
        # A line that starts with a size and an element count is a data line, also one cut short (a run killed while
        # printing it): _run_rows refuses it rather than dropping it without a word. Other lines ('8 GPUs done', a
        # timestamp a job script echoed) are not nccl-tests output and are skipped, as before.
        if re.fullmatch(r"[-+]?\d+", tokens[0]) and len(tokens) > 1 and re.fullmatch(r"[-+]?\d+", tokens[1]):
            run.data.append((lineno, tokens))
    if not any(r.data for r in runs) and not utf8:
        raise not_utf8_error(path, raw, "nccl-tests output")
    if not any(r.data for r in runs):
        raise CalibrationError(
            f"{path}: no nccl-tests data lines (size count type ... time algbw busbw) found; give the standard "
            "output of an nccl-tests binary such as all_reduce_perf"
        )
    rows = []
    dropped: list[int] = []
    wrong: list[int] = []
    for run in runs:
        if not run.data:
            continue
        name = name_given or run.detected or _collective_from(path.stem.split(".")[0])
        if name is None:
            raise CalibrationError(
                f"{path}: line {run.data[0][0]}: cannot tell which collective this is; pass --collective "
                f"({', '.join(COLLECTIVES)})"
            )
        rows += _run_rows(path, run, name, ranks, scope, device, dropped, wrong)
    if notes is not None:
        if dropped:
            notes.append(_dropped_note(path, dropped, "a zero or negative size or time (nothing to fit)"))
        if wrong:
            notes.append(_dropped_note(path, wrong, "#wrong > 0 (nccl-tests found wrong results: a broken run)"))
    return rows


def _check_plausible(path: Path, lineno: int, size: float, time_s: float, unit: str) -> None:
    """A line whose message would move faster than :data:`MAX_ALGBW_BYTES_PER_S` is refused, naming the unit."""
    if size / time_s > MAX_ALGBW_BYTES_PER_S:
        raise CalibrationError(
            f"{path}: line {lineno}: {size:.0f} bytes in {time_s:.3g} s is {size / time_s / 1e12:.3g} TB/s, more "
            f"than ten times the fastest GPU fabric (NVLink 5, 0.9 TB/s per direction); the times must be in {unit}: "
            "fix the file's unit or remove the line"
        )


@dataclass
class _Run:
    """One nccl-tests run inside an output file: its header figures, rank lines and data lines."""

    n_threads: int = 1
    n_gpus: int = 1
    rank_lines: int = 0
    hosts: set[str] = field(default_factory=set)
    gpu_name: str = ""
    detected: str | None = None
    leading: int | None = None  # fields before the out-of-place time, from the column header
    data: list[tuple[int, list[str]]] = field(default_factory=list)

    def fields_before_time(self) -> int | None:
        """The fields before the out-of-place time: ``size count type redop root`` (5) or, older than the root
        column, ``size count type redop`` (4). The column header says; without one, a whole data line: 13 or 12
        fields with the in-place columns, 9 or 8 without (nccl-tests before 2.0 printed the out-of-place ones only).
        None when neither tells (no header, every line cut short)."""
        if self.leading is not None:
            return self.leading
        longest = max((len(tokens) for _, tokens in self.data), default=0)
        return {13: 5, 12: 4, 9: 5, 8: 4}.get(longest)


def _run_rows(
    path: Path,
    run: _Run,
    name: str,
    ranks: int | None,
    scope: str | None,
    device: str,
    dropped: list[int],
    wrong: list[int],
) -> list[Measurement]:
    """The measurement rows of one run (lines with a zero or negative size or time go to ``dropped``, lines whose
    out-of-place result nccl-tests found wrong to ``wrong``)."""
    n = ranks or run.rank_lines or run.n_gpus * run.n_threads
    scope = scope or ("network" if len(run.hosts) > 1 else "domain")
    # Read from the front: size count type redop [root] time algbw busbw #wrong, out of place, then the same four in
    # place (reading from the end found the in-place time). Whether the root column is there is the run's layout
    # (module docstring): a whole-number fifth field is no sign of it, as times of 10 ms and more print as whole
    # numbers.
    at = run.fields_before_time()
    rows = []
    for lineno, tokens in run.data:
        size = float(tokens[0])
        if at is None:
            raise CalibrationError(
                f"{path}: line {lineno}: cannot read a time in microseconds: this run has no column header (# size "
                "count type redop root time ...) and no whole data line to tell whether the root column is there "
                f"(line {' '.join(tokens)!r}, cut off?); keep the header lines of the nccl-tests output, or fix or "
                "remove the line"
            )
        trailing = tokens[at : at + 4]
        try:
            time_us = float(trailing[0]) if len(trailing) == 4 else math.nan
        except ValueError:
            time_us = math.nan
        if not math.isfinite(time_us):
            raise CalibrationError(
                f"{path}: line {lineno}: cannot read a time in microseconds from {(trailing or [''])[0]!r} (line "
                f"{' '.join(tokens)!r}: its out-of-place time algbw busbw #wrong, cut off?); a data line is size "
                "count type redop root, then time algbw busbw #wrong out of place (and again in place); fix or "
                "remove the line"
            )
        if size <= 0 or time_us <= 0:
            dropped.append(lineno)
            continue
        if trailing[3].isdigit() and int(trailing[3]) > 0:
            wrong.append(lineno)
            continue
        _check_plausible(path, lineno, size, time_us * 1e-6, "microseconds (nccl-tests' time column)")
        rows.append(
            Measurement(
                kind="collective",
                op=name,
                precision=tokens[2] if len(tokens) > 2 else "",
                bytes=size,
                ranks=n,
                scope=scope,
                time_s=time_us * 1e-6,
                device=device or run.gpu_name,
                source=f"nccl-tests output {path.name}",
                host=",".join(sorted(run.hosts)),
                note=f"hosts={len(run.hosts) or 1}; line {lineno}",  # the line: rows.read_rows counts copies once
            )
        )
    return rows


def import_vtrain_table(
    path: Path,
    *,
    device: str = "A100-SXM4-80GB",
    ranks: int | None = None,
    scope: str | None = None,
    notes: list[str] | None = None,
) -> list[Measurement]:
    """Rows from a vTrain ``a100_all_reduce_<n>gpu.txt`` table (one node, NVSwitch: scope ``domain`` unless
    ``scope`` says otherwise).

    Lines with fewer than four cells or a zero or negative size or time are dropped; ``notes`` (when given)
    gets a line saying how many and which.
    """
    input_file(path, "a vTrain table (size(B),count,type,time(ns),...)")
    m = re.search(r"(\d+)gpu", path.name)
    n = ranks or (int(m.group(1)) if m else None)
    if n is None:
        raise CalibrationError(
            f"{path}: cannot tell the GPU count from the name (vTrain names it a100_all_reduce_<n>gpu.txt); "
            "pass --ranks"
        )
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = list(csv.reader(fh))
    except UnicodeDecodeError:
        raise not_utf8_error(path, path.read_bytes(), "a vTrain table") from None
    except csv.Error as err:
        raise CalibrationError(f"{path}: not a readable CSV ({err}); give a vTrain table") from None
    except OSError as err:
        raise CalibrationError(f"{path}: cannot be read ({err.strerror or err}); give a vTrain table") from None
    if not reader or not reader[0] or not reader[0][0].startswith("size"):
        raise CalibrationError(
            f"{path}: expected a header starting with size(B),count,type,time(ns); give a vTrain table"
        )
    rows = []
    short: list[int] = []
    dropped: list[int] = []
    for i, rec in enumerate(reader[1:], start=2):
        if not rec or not any(cell.strip() for cell in rec):
            continue
        if len(rec) < 4:
            short.append(i)
            continue
        try:
            size, time_ns = float(rec[0]), float(rec[3])
        except ValueError:
            size = time_ns = math.nan
        if not (math.isfinite(size) and math.isfinite(time_ns)):
            raise CalibrationError(
                f"{path}: line {i}: size or time(ns) is not a finite number: {rec[:4]!r}; fix or remove the line"
            )
        if size <= 0 or time_ns <= 0:
            dropped.append(i)
            continue
        _check_plausible(path, i, size, time_ns * 1e-9, "nanoseconds (vTrain's time(ns) column)")
        rows.append(
            Measurement(
                kind="collective",
                op="all_reduce",
                precision=rec[2],
                bytes=size,
                ranks=n,
                scope=scope or "domain",
                time_s=time_ns * 1e-9,
                device=device,
                source=f"VIA-Research/vTrain trace/a100/{path.name}",
                note=f"line {i}",  # the line: rows.read_rows counts rows alike in every column once
            )
        )
    if notes is not None:
        if short:
            notes.append(_dropped_note(path, short, "fewer than 4 cells (size, count, type, time)"))
        if dropped:
            notes.append(_dropped_note(path, dropped, "a zero or negative size or time (nothing to fit)"))
    return rows
