"""Import Microsoft Vidur's public profiles (``data/profiling/`` of microsoft/vidur, MIT licence).

What the files are, read from Vidur's profiling code (``vidur/profiling/mlp/mlp_wrapper.py``,
``vidur/profiling/collectives/collectives_impl.py``, ``vidur/profiling/utils/record_function_tracer.py``):

* ``compute/<gpu>/<model>/mlp.csv``: forward times of the operators of one transformer layer, the model cast
  to ``torch.float16``; ``time_stats.<op>.median`` is in **milliseconds** (the tracer multiplies the
  profiler's microseconds by 1e-3), per ``num_tokens`` and tensor-parallel width. GEMM shapes follow from
  the columns (below); memory-bound operators are converted to HBM bytes with the formulas in
  :func:`_memory_bytes`.
* ``network/<node>/all_reduce.csv`` and ``send_recv.csv``: NCCL times in milliseconds; ``size`` is the
  message in **bytes** (an 8-GPU A100 all-reduce of 64 MiB takes 0.675 ms, a bus bandwidth of 174 GB/s,
  which only the byte reading makes physical: as fp16 elements it would exceed NVLink's 300 GB/s).
  ``devices_per_node`` < ``num_workers`` means the group spans nodes (scope ``network``).

Vidur's ``a100`` SKU is the 80 GB part (``A100DeviceSKUConfig.total_memory_gb = 80``), its ``h100`` the
80 GB SXM part; they map to our devices ``A100-SXM4-80GB`` and ``H100-SXM5-80GB``. The GPU is read off the
folder (``compute/<gpu>/``, ``network/<node>/``) only where it is one of those names (:data:`DEVICES`); a file
anywhere else needs the caller to name the device.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from simulator.calibration.rows import Measurement, input_file, not_utf8_error
from simulator.errors import CalibrationError
from simulator.specs.calibration import COLLECTIVES

__all__ = ["DEVICES", "import_vidur_compute", "import_vidur_network", "import_vidur_tree"]

DEVICES = {
    "a100": "A100-SXM4-80GB",
    "h100": "H100-SXM5-80GB",
    "a100_dgx": "A100-SXM4-80GB",
    "h100_dgx": "H100-SXM5-80GB",
}
E = 2  # fp16 bytes per element
_MS = 1e-3
_SHAPE_COLUMNS = (
    "n_head",
    "n_kv_head",
    "n_embd",
    "n_expanded_embd",
    "use_gated_mlp",
    "num_tokens",
    "num_tensor_parallel_workers",
)


def _layer(row: pd.Series) -> tuple[int, int, int, int, int, int, int, bool]:
    """The profiled layer of one row: tokens m, hidden h, heads a, KV heads kv, MLP width f, TP width t,
    head size d and whether the MLP is gated."""
    m = int(row["num_tokens"])
    h = int(row["n_embd"])
    a = int(row["n_head"])
    kv = int(row["n_kv_head"])
    f = int(row["n_expanded_embd"])
    t = int(row["num_tensor_parallel_workers"])
    return m, h, a, kv, f, t, h // a, str(row["use_gated_mlp"]).strip().lower() == "true"  # checked on import


def _gemm_shape(op: str, row: pd.Series) -> tuple[int, int, int] | None:
    """(m, k, n) of a GEMM operator of the profiled layer, per tensor-parallel rank."""
    m, h, a, kv, f, t, d, gated = _layer(row)
    if op == "attn_pre_proj":
        return m, h, (a + 2 * kv) * d // t
    if op == "attn_post_proj":
        return m, a * d // t, h
    if op == "mlp_up_proj":
        return m, h, (2 if gated else 1) * f // t
    if op == "mlp_down_proj":
        return m, f // t, h
    return None


def _memory_bytes(op: str, row: pd.Series) -> float | None:
    """HBM bytes read plus written by a memory-bound operator (fp16), per rank.

    RMSNorm reads x and writes y; RoPE rewrites Q and K in place; SiLU-and-mul reads the gate and up halves
    and writes their product (GELU: reads and writes one tensor); the residual add reads two tensors and
    writes one; the vocab-parallel embedding gathers one row per token and writes it.
    """
    m, h, a, kv, f, t, d, gated = _layer(row)
    if op in ("input_layernorm", "post_attention_layernorm"):
        return float(2 * m * h * E)
    if op == "attn_rope":
        return float(2 * m * (a + kv) * d // t * E)
    if op == "mlp_act":
        return float((3 if gated else 2) * m * f // t * E)
    if op == "add":
        return float(3 * m * h * E)
    if op == "emb":
        return float(2 * m * h * E)
    return None


def _read(path: Path, what: str) -> pd.DataFrame:
    """The CSV at ``path``, or a CalibrationError that says why it cannot be read."""
    input_file(path, what)
    try:
        return pd.read_csv(path)
    except UnicodeDecodeError:
        raise not_utf8_error(path, path.read_bytes(), what) from None
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise CalibrationError(f"{path}: cannot read as CSV ({err}); give {what}") from None


def _device(path: Path, folder: str, device: str | None) -> str:
    """``device`` where given, else the device Vidur's ``folder`` name stands for; a CalibrationError for a folder
    that is not one of Vidur's (a copy under my_run/ had been imported as device 'my_run', which fit then took for
    any device's)."""
    if device:
        return device
    if folder in DEVICES:
        return DEVICES[folder]
    for prefix in ("a100_", "h100_"):  # upstream's other network folders: a100_pair_nvlink, h100_pair_nvlink...
        if folder.startswith(prefix):
            return DEVICES[prefix[:-1]]
    names = ", ".join(sorted(DEVICES))
    raise CalibrationError(
        f"{path}: cannot tell the GPU from the folder name {folder!r} (Vidur names its folders {names}); pass "
        "--device with the GPU the file was measured on, e.g. --device A100-SXM4-80GB"
    )


def _stat(row: pd.Series, op: str, stat: str) -> float:
    """``time_stats.<op>.<stat>`` in seconds, NaN where the column is absent or the cell empty."""
    value = row.get(f"time_stats.{op}.{stat}")
    return math.nan if value is None or pd.isna(value) else float(value) * _MS


def _drop_note(path: Path, empty: list[str], negative: list[str]) -> str:
    """One line saying which time cells were dropped and why (``empty``/``negative``: ``line N, column C``)."""
    parts = []
    if negative:
        parts.append(f"{len(negative)} zero or negative (first: {negative[0]})")
    if empty:
        parts.append(f"{len(empty)} empty (first: {empty[0]})")
    return f"{path}: dropped {len(empty) + len(negative)} median time cell(s) with no time to fit: " + "; ".join(parts)


MAX_SHAPE = 2**40


def _float_or_nan(value: object) -> float:
    """A cell as a float: inf for a number beyond any float (flagged as not finite), NaN for what is not a number."""
    try:
        return float(str(value))
    except ValueError:
        return math.nan


def _numbers(df: pd.DataFrame, path: Path, columns: list[str], *, required: bool, whole: bool = False) -> None:
    """Make ``columns`` numeric in place; a cell that is not a finite number (``whole``: a whole number from 1 to
    :data:`MAX_SHAPE`; when ``required``, also an empty one) is a CalibrationError naming the file's line, the column
    and the value."""
    for col in columns:
        try:
            values = pd.to_numeric(df[col], errors="coerce")
        except OverflowError:  # pandas raises on an integer beyond any float rather than coercing it
            values = pd.Series([_float_or_nan(v) for v in df[col]], index=df.index, dtype=float)
        bad = (values.isna() & (df[col].notna() | required)) | values.isin([np.inf, -np.inf])
        expected = "a number"
        if whole:
            # Bounded: a shape beyond 2^40 is a damaged cell, and its FLOPs (m·n·k) would overflow a float.
            bad |= values.notna() & ((values < 1) | (values % 1 != 0) | (values > MAX_SHAPE))
            expected = f"a whole number from 1 to {MAX_SHAPE}"
        if bad.any():
            pos = int(bad.to_numpy().argmax())
            cell = str(df[col].iloc[pos])
            shown = cell if len(cell) <= 40 else f"{cell[:40]}… ({len(cell)} characters)"
            raise CalibrationError(
                f"{path}: line {pos + 2}, column {col!r}: expected {expected}, got '{shown}'; "
                "fix the cell or remove the line"
            )
        df[col] = values


def import_vidur_compute(path: Path, device: str | None = None, notes: list[str] | None = None) -> list[Measurement]:
    """Rows from one ``mlp.csv`` (GEMMs and memory-bound operators).

    Empty, zero or negative median times are dropped; ``notes`` (when given) gets a line saying how many."""
    df = _read(path, "a Vidur mlp.csv")
    missing = [c for c in _SHAPE_COLUMNS if c not in df.columns]
    if missing:
        raise CalibrationError(f"{path}: missing column(s) {', '.join(missing)}; is this a Vidur mlp.csv?")
    _numbers(df, path, [c for c in _SHAPE_COLUMNS if c != "use_gated_mlp"], required=True, whole=True)
    gated = df["use_gated_mlp"].astype(str).str.strip().str.lower()
    odd = sorted(set(gated) - {"true", "false"})
    if odd:
        line = int(gated[~gated.isin(["true", "false"])].index[0]) + 2
        raise CalibrationError(
            f"{path}: line {line}: use_gated_mlp must be True or False (as Vidur writes it), got {odd[0]!r}; fix the "
            "cell: it decides the MLP's GEMM shapes"
        )
    _numbers(df, path, [c for c in df.columns if c.startswith("time_stats.")], required=False)
    gpu = path.parent.parent.name
    device = _device(path, gpu, device)
    ops = sorted({c.split(".")[1] for c in df.columns if c.startswith("time_stats.") and c.endswith(".median")})
    source = f"microsoft/vidur data/profiling/compute/{gpu}/{path.parent.name}/mlp.csv"
    rows: list[Measurement] = []
    empty: list[str] = []
    negative: list[str] = []
    for pos, (_, row) in enumerate(df.iterrows()):
        for op in ops:
            median = row[f"time_stats.{op}.median"]
            if pd.isna(median) or median <= 0:
                (empty if pd.isna(median) else negative).append(f"line {pos + 2}, column time_stats.{op}.median")
                continue
            common: dict[str, Any] = {
                "op": op,
                "precision": "fp16",
                "time_s": float(median) * _MS,
                "time_s_min": _stat(row, op, "min"),
                "time_s_std": _stat(row, op, "std"),
                "device": device,
                "source": source,
                # The line: two lines of one shape (Vidur profiled some token counts twice) may agree to the
                # microsecond, and read_rows counts rows alike in every column once.
                "note": f"tp={int(row['num_tensor_parallel_workers'])}; line {pos + 2}",
            }
            shape = _gemm_shape(op, row)
            if shape is not None:
                m, k, n = shape
                rows.append(
                    Measurement(
                        kind="gemm",
                        m=m,
                        n=n,
                        k=k,
                        flops=2.0 * m * n * k,
                        bytes=float(E * (m * k + k * n + m * n)),
                        **common,
                    )
                )
                continue
            size = _memory_bytes(op, row)
            if size is not None:
                rows.append(Measurement(kind="memory", m=int(row["num_tokens"]), bytes=size, **common))
    if (empty or negative) and notes is not None:
        notes.append(_drop_note(path, empty, negative))
    return rows


def import_vidur_network(path: Path, device: str | None = None, notes: list[str] | None = None) -> list[Measurement]:
    """Rows from one ``all_reduce.csv`` or ``send_recv.csv``.

    Empty, zero or negative median times are dropped; ``notes`` (when given) gets a line saying how many."""
    df = _read(path, "a Vidur network CSV")
    for col in ("size", "num_workers", "devices_per_node", "collective"):
        if col not in df.columns:
            raise CalibrationError(f"{path}: missing column {col!r}; is this a Vidur all_reduce/send_recv CSV?")
    _numbers(df, path, ["size", "num_workers", "devices_per_node"], required=True, whole=True)
    _numbers(df, path, [c for c in df.columns if c.startswith("time_stats.")], required=False)
    for pos, name in enumerate(df["collective"]):
        if f"time_stats.{name}.median" not in df.columns:
            raise CalibrationError(
                f"{path}: line {pos + 2}, column 'collective': {name!r} has no time_stats.{name}.median column; "
                "fix the cell or remove the line"
            )
        if name not in COLLECTIVES:
            raise CalibrationError(
                f"{path}: line {pos + 2}, column 'collective': {name!r} is not a collective calibration tables "
                f"accept ({', '.join(COLLECTIVES)}); fix the cell or remove the line"
            )
    node = path.parent.name
    device = _device(path, node, device)
    source = f"microsoft/vidur data/profiling/network/{node}/{path.name}"
    rows: list[Measurement] = []
    empty: list[str] = []
    negative: list[str] = []
    for pos, (_, row) in enumerate(df.iterrows()):
        collective = str(row["collective"])
        median = row[f"time_stats.{collective}.median"]
        if pd.isna(median) or median <= 0:
            (empty if pd.isna(median) else negative).append(f"line {pos + 2}, column time_stats.{collective}.median")
            continue
        workers = int(row["num_workers"])
        per_node = int(row["devices_per_node"])
        rows.append(
            Measurement(
                kind="collective",
                op=collective,
                precision="fp16",
                bytes=float(row["size"]),
                ranks=workers,
                scope="domain" if per_node >= workers else "network",
                time_s=float(median) * _MS,
                time_s_min=_stat(row, collective, "min"),
                time_s_std=_stat(row, collective, "std"),
                device=device,
                source=source,
                note=f"devices_per_node={per_node}; line {pos + 2}",
            )
        )
    if (empty or negative) and notes is not None:
        notes.append(_drop_note(path, empty, negative))
    return rows


def import_vidur_tree(root: Path, device: str | None = None, notes: list[str] | None = None) -> list[Measurement]:
    """Every ``compute/*/*/mlp.csv`` and ``network/*/*.csv`` under a Vidur ``profiling`` folder; ``device`` names
    the rows' device where the folder holds one GPU's profiles (a CalibrationError where it holds several)."""
    compute = sorted(root.glob("compute/*/*/mlp.csv"))
    network = sorted(root.glob("network/*/*.csv"))
    gpus = sorted({p.parent.parent.name for p in compute} | {p.parent.name for p in network})
    if device is not None and len(gpus) > 1:
        raise CalibrationError(
            f"{root}: holds the profiles of {', '.join(gpus)}, so --device {device} cannot name all of them; leave "
            "--device out (the folder names each GPU) and fit one device with calibrate fit --only-device"
        )
    rows: list[Measurement] = []
    for path in compute:
        rows += import_vidur_compute(path, device, notes=notes)
    for path in network:
        rows += import_vidur_network(path, device, notes=notes)
    if not rows:
        raise CalibrationError(
            f"{root}: no Vidur profiles found (expected compute/<gpu>/<model>/mlp.csv or network/<node>/*.csv under "
            "it); give Vidur's profiling folder, which holds compute/ and network/, or the CSV files themselves"
        )
    return rows
