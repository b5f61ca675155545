"""The tidy measurement row shared by every calibration source.

One :class:`Measurement` is one timed kernel or collective with its shape, size, precision and provenance.
Our profiler writes them, importers translate third-party profiles into them, and :mod:`.fit` turns them
into efficiency tables. Conventions:

* GEMM FLOPs are ``2·m·n·k·batch``.
* Attention FLOPs follow FlashAttention's accounting (Dao 2023): forward ``4·batch·heads·s_q·s_kv·d``,
  halved for a causal mask; the backward executes 2.5 times the forward.
* ``bytes`` is HBM traffic (read plus written) for memory-bound kernels and the nccl-tests ``size`` (bytes
  per rank) for collectives.
* ``time_s`` is the median over repeats, in seconds.
* Kind ``overhead`` is a host-side cost per operator (op ``launch``: the CPU time PyTorch spends issuing one
  small operator with autograd, measured on CUDA where the host runs ahead of the GPU).
* Ops named ``probe.*`` measure a device property (peak GEMM throughput, memory bandwidth), not a kernel of
  a model; fits use them for the device profile, not for curves. The pair ``probe.gemm_burst`` and
  ``probe.gemm_sustained`` (:data:`SUSTAINED_PROBES`) times one large GEMM as the profiler times every kernel,
  then after minutes of back-to-back load; their ratio is the table's ``sustained_gemm_ratio``.

CSV files use a fixed column order and round-trip floats exactly (``repr``), so the same rows give the
same bytes. Reading them reads each file once (one named twice, or inside a folder also named, is read once) and
counts a row of one file that repeats one of another file in every column once: a measurement is one row, with its
provenance (the profiler's rows carry exact times, date and host; the importers' the line they come from), so the
same row in a second file is a copy (rows merged into another file, a profile named beside its own CSV). Within one
file every row is kept: two equal timings of one shape there may be two measurements (Vidur's twins agree to the
microsecond, and a rows file imported before the importers named their lines does not tell them apart).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from simulator.errors import CalibrationError, not_utf8
from simulator.specs.calibration import COLLECTIVES, SCOPES

__all__ = [
    "COLUMNS",
    "KINDS",
    "MAX_ALGBW_BYTES_PER_S",
    "SUSTAINED_PROBES",
    "Measurement",
    "RowAppender",
    "input_file",
    "measurement_files",
    "memory_class",
    "not_utf8_error",
    "read_rows",
    "read_text",
    "write_rows",
]

KINDS = ("gemm", "attention", "memory", "collective", "overhead")
# The largest group a collective row may name: far beyond any cluster (a 25-digit cell is a typo).
MAX_RANKS = 1_000_000
# Precisions a GEMM or attention row may name (fit reads fp32 against the TF32 peak, an empty cell as bf16).
ROW_PRECISIONS = ("", "fp32", "tf32", "fp16", "bf16", "fp8")
# The same GEMM timed in a short burst (as every kernel is profiled) and under sustained load (module docstring).
SUSTAINED_PROBES = ("probe.gemm_burst", "probe.gemm_sustained")
# The fastest rate any collective can show, in bytes of its message per second: NVLink 5 moves 900 GB/s per GPU and
# direction (NVIDIA B200/GB200 datasheets, 1.8 TB/s bidirectional); an all-gather's algorithm bandwidth approaches
# that, an all-reduce's half of it. Ten times the fabric is no measurement but a unit slip: times in a larger unit
# read as a smaller one (microseconds in a column read as nanoseconds are a factor of 1,000 too short). The
# opposite slip makes times too long, which no bound can tell from a slow fabric.
MAX_ALGBW_BYTES_PER_S = 1e13


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One timed kernel or collective."""

    kind: str
    op: str
    precision: str = "bf16"
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    flops: float = 0.0
    bytes: float = 0.0
    ranks: int = 0
    scope: str = ""
    time_s: float
    time_s_min: float = math.nan
    time_s_std: float = math.nan
    repeats: int = 0
    device: str = ""
    source: str = ""
    host: str = ""
    torch_version: str = ""
    cuda_version: str = ""
    date: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CalibrationError(f"measurement kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not (self.time_s > 0 and math.isfinite(self.time_s)):
            raise CalibrationError(f"measurement {self.op!r}: time_s must be a positive number, got {self.time_s}")
        if self.kind == "collective" and self.op not in COLLECTIVES:
            # A calibration table accepts only these (specs.calibration); a row with any other op would be
            # fitted into a table that clustersim cannot load.
            raise CalibrationError(
                f"collective measurement: op must be one of {', '.join(COLLECTIVES)}, got {self.op!r}; "
                "rename the op or remove the row"
            )


def check_fittable(row: Measurement) -> None:
    """Raise a CalibrationError unless ``row`` has what fitting it needs: a GEMM or attention row a known precision and
    positive FLOPs (its efficiency is FLOPs over time against that precision's peak), a memory or collective row
    positive bytes. Applied to rows read from files (an empty ``flops`` cell used to end in a traceback)."""
    if row.kind in ("gemm", "attention"):
        if row.precision not in ROW_PRECISIONS:
            raise CalibrationError(
                f"column 'precision': {row.precision!r} is not one of {', '.join(p for p in ROW_PRECISIONS if p)}; "
                "fix the cell (empty means bf16)"
            )
        if not (row.flops > 0 and math.isfinite(row.flops)):
            raise CalibrationError(
                f"column 'flops': {_fmt(row.flops) or 'empty'} is not a positive number for a {row.kind} row; give "
                "the kernel's FLOPs (2·m·n·k for a GEMM) or remove the row"
            )
    if row.kind == "collective" and row.scope not in SCOPES:
        # Any other word was fitted as 'across nodes' and dropped without a word.
        raise CalibrationError(
            f"column 'scope': {row.scope!r} is not one of {', '.join(SCOPES)} for a collective row; write domain (one "
            "NVLink domain) or network (across nodes)"
        )
    if row.kind == "collective" and not 1 <= row.ranks <= MAX_RANKS:
        raise CalibrationError(
            f"column 'ranks': {row.ranks} is not a group size from 1 to {MAX_RANKS:,} for a collective row; "
            "fix the cell"
        )
    if row.kind in ("memory", "collective") and not (row.bytes > 0 and math.isfinite(row.bytes)):
        raise CalibrationError(
            f"column 'bytes': {_fmt(row.bytes) or 'empty'} is not a positive number for a {row.kind} row; give the "
            "bytes it moves or remove the row"
        )
    if row.kind == "collective" and row.bytes / row.time_s > MAX_ALGBW_BYTES_PER_S:
        # The importers' bound (MAX_ALGBW_BYTES_PER_S), for rows written by hand or by another tool.
        raise CalibrationError(
            f"{row.bytes:.0f} bytes in {row.time_s:.3g} s is {row.bytes / row.time_s / 1e12:.3g} TB/s, more than ten "
            "times the fastest GPU fabric (NVLink 5, 0.9 TB/s per direction); column 'time_s' must be in seconds "
            "and 'bytes' in bytes: fix the row's units or remove it"
        )


COLUMNS = tuple(f.name for f in fields(Measurement))

_MEMORY_CLASS_WORDS = (
    ("norm", ("layernorm", "layer_norm", "rms_norm", "rmsnorm", "norm")),
    ("rope", ("rope", "rotary")),
    ("embedding", ("emb", "embedding")),
    ("activation", ("act", "gelu", "silu", "relu", "swiglu")),
    ("elementwise", ("add", "mul", "dropout", "copy", "adam", "cross_entropy")),
)


def memory_class(op: str) -> str:
    """The memory-kernel class (``norm``, ``rope``, ``embedding``, ``activation``, ``elementwise`` or ``memory``).

    >>> memory_class("post_attention_layernorm"), memory_class("aten::gelu"), memory_class("aten::_softmax")
    ('norm', 'activation', 'memory')
    """
    low = op.lower()
    for cls, words in _MEMORY_CLASS_WORDS:
        if any(w in low for w in words):
            return cls
    return "memory"


_INTS = {"m", "n", "k", "batch", "ranks", "repeats"}
_FLOATS = {"flops", "bytes", "time_s", "time_s_min", "time_s_std"}


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return str(value)


def write_rows(rows: Iterable[Measurement], path: Path) -> int:
    """Write rows as CSV (fixed columns, exact floats); returns how many were written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(COLUMNS)
        for row in rows:
            data = asdict(row)
            writer.writerow([_fmt(data[c]) for c in COLUMNS])
            count += 1
    return count


class RowAppender:
    """Append rows to a CSV one at a time, flushed and synced to disk after each, so a killed run keeps them.

    The header is written when the file is new or empty; an existing file must have the same columns.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not path.exists() or path.stat().st_size == 0
        if not fresh:
            with path.open(encoding="utf-8", errors="replace") as fh:
                header = fh.readline().strip().split(",")
            if tuple(header) != COLUMNS:
                raise CalibrationError(
                    f"{path}: exists with other columns than a measurement CSV; give an empty or a profile folder"
                )
        self.path = path
        self._fh = path.open("a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._fh, lineterminator="\n")
        if fresh:
            self._writer.writerow(COLUMNS)
            self._flush()

    def _flush(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def append(self, row: Measurement) -> None:
        """Write one row and flush it to disk."""
        data = asdict(row)
        self._writer.writerow([_fmt(data[c]) for c in COLUMNS])
        self._flush()

    def close(self) -> None:
        """Close the file."""
        self._fh.close()

    def __enter__(self) -> RowAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def input_file(path: Path, what: str) -> None:
    """Raise a CalibrationError unless ``path`` is a file one can open (it names the path and says why not).

    ``what`` is what the command expects there, e.g. ``a Chrome trace JSON from torch.profiler``.
    """
    if path.is_dir():
        raise CalibrationError(f"{path}: is a directory, not a file; give {what}")
    if not path.exists():
        raise CalibrationError(f"{path}: no such file; give {what}")
    if not path.is_file():
        raise CalibrationError(f"{path}: not a regular file; give {what}")


def not_utf8_error(path: Path, data: bytes, what: str) -> CalibrationError:
    """The error for a file that is not UTF-8 text (a binary file, or text saved in another encoding)."""
    return CalibrationError(f"{path}: {not_utf8(data)}; give {what}, saved as UTF-8 text")


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of ``path``, or a CalibrationError naming the file and why it cannot be read."""
    input_file(path, what)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CalibrationError(f"{path}: cannot be read ({err.strerror or err}); give {what}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise not_utf8_error(path, data, what) from None


def _parse(path: Path, line: int, column: str, text: str) -> object:
    try:
        if column in _INTS:
            if not text:
                return 0
            try:
                return int(text)
            except ValueError:
                # A spreadsheet or pandas round trip writes whole numbers as 64.0: the same count.
                value = float(text)
                if not value.is_integer():
                    raise CalibrationError(
                        f"{path}: line {line}: column {column!r}: {text!r} is not a whole number; fix or remove the row"
                    ) from None
                return int(value)
        if column in _FLOATS:
            return float(text) if text else math.nan
    except (ValueError, OverflowError):
        raise CalibrationError(
            f"{path}: line {line}: column {column!r}: {text!r} is not a number; fix or remove the row"
        ) from None
    return text


# What `calibrate profile` writes beside its measurements: the shapes that failed and why (profile.FAILURES). It is
# not a measurement file, so reading a profile folder skips it; named here to keep this module free of profile's
# torch-side imports.
NOT_MEASUREMENTS = frozenset({"failures.csv"})


def measurement_files(paths: Sequence[Path]) -> list[Path]:
    """The files :func:`read_rows` reads for ``paths``: each file given, and every ``*.csv`` inside a directory but
    a profile's ``failures.csv``, in a stable order (a file more than once where it is named more than once)."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files += sorted(f for f in p.rglob("*.csv") if f.name not in NOT_MEASUREMENTS)
        elif p.is_file():
            files.append(p)
        else:
            raise CalibrationError(f"{p}: no such file or directory; give measurement CSVs or folders of them")
    return files


def read_rows(paths: Sequence[Path], notes: list[str] | None = None) -> list[Measurement]:
    """Read measurement CSVs (or every ``*.csv`` inside a directory but a profile's ``failures.csv``), in a stable
    order: each file once, and a row that repeats one of another file in every column once (module docstring);
    ``notes`` (when given) gets a line for each file read once and one for the rows dropped."""
    files = measurement_files(paths)
    if not files:
        raise CalibrationError(f"no measurement CSVs found in {', '.join(map(str, paths))}; run profile or an importer")
    out: list[Measurement] = []
    seen_files: set[Path] = set()
    first: dict[tuple[str, ...], tuple[Path, int]] = {}  # each row's cells: where it was read first
    copies: list[tuple[Path, int, Path, int]] = []
    for path in files:
        if path.resolve() in seen_files:
            if notes is not None:
                notes.append(f"{path}: read once (it was named twice, or inside a folder named)")
            continue
        seen_files.add(path.resolve())
        for line, row in _read_csv(path):
            cells = _cells(row)
            if cells in first and first[cells][0] != path:
                copies.append((path, line, *first[cells]))
                continue
            first.setdefault(cells, (path, line))
            out.append(row)
    if copies and notes is not None:
        path, line, of, of_line = copies[0]
        notes.append(
            f"dropped {len(copies)} row(s) that repeat a row of another file in every column (counted once): {path} "
            f"line {line}, a copy of line {of_line} of {of}" + (", ..." if len(copies) > 1 else "")
        )
    return out


def _cells(row: Measurement) -> tuple[str, ...]:
    """A row as the cells it is written as (NaN equal to NaN, which the dataclass's own == is not)."""
    data = asdict(row)
    return tuple(_fmt(data[c]) for c in COLUMNS)


_WHAT = "a measurement CSV (written by calibrate profile or an importer)"


def _read_csv(path: Path) -> list[tuple[int, Measurement]]:
    """The rows of one measurement CSV with their line numbers; a file that is not UTF-8 text or not CSV is a
    CalibrationError."""
    out: list[tuple[int, Measurement]] = []
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in ("kind", "op", "time_s") if c not in (reader.fieldnames or [])]
            if missing:
                raise CalibrationError(
                    f"{path}: missing column(s) {', '.join(missing)}; expected the columns {', '.join(COLUMNS)}"
                )
            for i, raw in enumerate(reader, start=2):
                values = {c: _parse(path, i, c, raw.get(c) or "") for c in COLUMNS if c in raw}
                try:
                    row = Measurement(**values)  # type: ignore[arg-type]
                    check_fittable(row)
                    out.append((i, row))
                except CalibrationError as err:
                    raise CalibrationError(f"{path}: line {i}: {err}") from None
    except UnicodeDecodeError:  # read again for the line and byte: the reader's offset is into its own buffer
        raise not_utf8_error(path, path.read_bytes(), _WHAT) from None
    except csv.Error as err:
        raise CalibrationError(f"{path}: not a readable CSV ({err}); give {_WHAT}") from None
    except OSError as err:
        raise CalibrationError(f"{path}: cannot be read ({err.strerror or err}); give {_WHAT}") from None
    return out
