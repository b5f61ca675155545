"""Import a PyTorch profiler (Kineto) Chrome trace: kernel durations attributed to the operators that ran them.

A trace exported with ``torch.profiler.profile(..., record_shapes=True).export_chrome_trace(path)`` holds
``traceEvents``; CPU operators have ``cat == "cpu_op"`` with ``args["Input Dims"]``, ``args["Input type"]``
and ``args["External id"]``; GPU kernels have ``cat == "kernel"`` and carry the launching operator's
``External id`` (and a ``correlation`` id shared with the ``cuda_runtime`` launch event). A kernel is
attributed to the innermost recognised CPU operator with its External id, falling back to the operator whose
time span contains the launch (the rule Vidur's tracer uses); a kernel launched by an operator this importer does
not read (``aten::_flash_attention_forward``) inside an attention operator it does
(``aten::_scaled_dot_product_flash_attention``) is that attention's, since everything such an operator launches is
attention work. Kernels under an unread operator inside a GEMM or memory-bound one (a cast inside
``aten::linear``) are not charged to it. Durations (``dur``) are microseconds (Trace Event
Format). On a CPU-only trace there are no kernels, and a recognised operator's own duration is used,
except for one that holds another of its kind (``aten::linear`` around ``aten::addmm``, ``aten::layer_norm`` around
``aten::native_layer_norm``): the inner one is the measurement, the outer one the same work plus dispatch. An
operator inside one of another kind that is counted (the bias ``aten::copy_`` inside ``aten::addmm``, a backward
``aten::mm``'s ``aten::clone``/``aten::copy_``) is part of that one's duration and no row of its own. An operator
on empty tensors (an MoE expert that received no tokens multiplies a 0×h matrix) has no FLOPs or bytes to fit and
is left out.

Recognised operators: ``aten::mm``/``addmm``/``bmm``/``linear``/``matmul`` (GEMM), scaled-dot-product
attention forward and backward of the flash (FlashAttention-2), cuDNN and CPU backends (attention, named for
their curve: ``flash2_sdpa_causal_fwd``, ``cudnn_sdpa_bwd``...; causal from the recorded ``is_causal``),
norms, activations, element-wise arithmetic, softmax and dropout (memory-bound), and NCCL kernels (collectives,
sized by ``record_param_comms``: the whole buffer, as nccl-tests counts it).

A collective's scope (``domain``: inside one NVLink domain; ``network``: across nodes, which a fit leaves out of
the tables) is what the caller says (``--scope``), else read off the group's global ranks (``record_param_comms``'
``Process Group Ranks``, or its ``Global rank start``/``stride``) and the GPUs the traced host lists in
``deviceProperties``: torchrun numbers ranks node by node (global rank = node rank × GPUs per node + local rank),
so ranks in more than one block of that size span nodes. Where neither is known the group is taken to be inside
one domain, and a note says so (a multi-node group fitted as NVLink bandwidth would make every NVLink collective
as slow as the network).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from simulator.calibration.rows import Measurement, read_text
from simulator.errors import CalibrationError
from simulator.specs._fields import MAX_COUNT, is_finite_number

__all__ = ["import_torch_trace"]

_DTYPE_BYTES = {
    "float": 4,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "double": 8,
    "long int": 8,
    "int": 4,
    "bool": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}
_PRECISION = {"float": "fp32", "c10::Half": "fp16", "c10::BFloat16": "bf16", "c10::Float8_e4m3fn": "fp8"}
_GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}
# SDPA's backend operators: the row name prefix that routes them to their kernel's curve (ATTENTION_ROW_PREFIXES:
# PyTorch's CUDA flash backend is FlashAttention-2, its cuDNN backend cuDNN's fused attention; on a CPU the flash
# kernel is the host's own attention) and where ``is_causal`` sits among the operator's inputs, whose values Kineto
# records under "Concrete Inputs" (schemas of aten/src/ATen/native/native_functions.yaml). The memory-efficient
# backend is not here: no curve of the simulator times it, so its rows would misstate another kernel's speed.
_ATTN = {
    "aten::_scaled_dot_product_flash_attention": ("flash2_sdpa", 4),
    "aten::_scaled_dot_product_flash_attention_backward": ("flash2_sdpa", 11),
    "aten::_scaled_dot_product_cudnn_attention": ("cudnn_sdpa", 6),
    "aten::_scaled_dot_product_cudnn_attention_backward": ("cudnn_sdpa", 14),
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("sdpa", 4),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": ("sdpa", 7),
}
# The dtype of a collective as record_param_comms writes it (c10::toString of the ScalarType).
_COMM_DTYPE_BYTES = {
    "Float": 4,
    "Half": 2,
    "BFloat16": 2,
    "Double": 8,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}
_MEMORY = {
    "aten::layer_norm",
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::rms_norm",
    "aten::gelu",
    "aten::gelu_backward",
    "aten::silu",
    "aten::silu_backward",
    "aten::add",
    "aten::add_",
    "aten::mul",
    "aten::mul_",
    "aten::softmax",
    "aten::_softmax",
    "aten::_softmax_backward_data",
    "aten::dropout",
    "aten::native_dropout",
    "aten::copy_",
    "aten::_log_softmax",
    "aten::nll_loss_forward",
}
_NCCL = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "sendrecv": "send_recv",
    "alltoall": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
}


def _numel(dims: Any) -> int:
    if not isinstance(dims, list) or not dims:
        return 0
    return math.prod(int(d) for d in dims) if all(isinstance(d, int) for d in dims) else 0


def _well_formed(e: Any) -> bool:
    """An event the importer can read: a name, finite ``ts`` and ``dur`` ≥ 0, ``args`` (if any) a mapping whose
    ``External id`` (if any) is an id. Anything else (a hand-edited or truncated trace) is skipped rather than
    guessed at."""
    if not (
        isinstance(e, dict)
        and isinstance(e.get("name"), str)
        and is_finite_number(e.get("ts"))
        and is_finite_number(e.get("dur"))
        and e["dur"] >= 0
        and isinstance(e.get("args", {}), dict)
    ):
        return False
    ext = e.get("args", {}).get("External id")
    return ext is None or (isinstance(ext, int | str) and not isinstance(ext, bool))


def _ext_id(e: dict[str, Any]) -> int | str | None:
    """The ``External id`` that links a kernel to its operator (None if absent)."""
    ext: int | str | None = e.get("args", {}).get("External id")
    return ext


def _shape(d: Any) -> list[int] | None:
    """One tensor's dimensions: a list of whole numbers from 0 to 2**53, else None (scalars, lists of tensors,
    garbage: a larger dimension is a damaged field, whose FLOPs would overflow a float)."""
    if isinstance(d, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNT for x in d):
        return d
    return None


def _classify(op: dict[str, Any]) -> dict[str, Any] | None:
    """Shape, FLOPs and bytes of a recognised CPU operator."""
    name = op["name"]
    args = op.get("args", {})
    raw_dims = args.get("Input Dims")
    dims = [_shape(d) for d in raw_dims] if isinstance(raw_dims, list) else []
    raw_types = args.get("Input type")
    types = [t for t in raw_types if isinstance(t, str)] if isinstance(raw_types, list) else []
    dtype = next((t for t in types if t in _PRECISION), "float")
    elem = _DTYPE_BYTES.get(dtype, 2)
    precision = _PRECISION.get(dtype, "fp32")
    if name in _GEMM:
        mats = [d for d in dims if d is not None and len(d) >= 2]
        if name == "aten::linear" and len(mats) >= 2:
            x, w = mats[0], mats[1]
            m = _numel(x[:-1])
            k, n = x[-1], w[0]
            batch = 1
        elif len(mats) >= 2:
            a, b = mats[-2], mats[-1]
            batch = _numel(a[:-2]) or 1
            m, k, n = a[-2], a[-1], b[-1]
        else:
            return None
        return {
            "kind": "gemm",
            "m": m,
            "n": n,
            "k": k,
            "batch": batch,
            "flops": 2.0 * batch * m * n * k,
            "bytes": float(elem * batch * (m * k + k * n + m * n)),
            "precision": precision,
        }
    if name in _ATTN:
        backward = name.endswith("_backward")
        q, kv = [*dims, None, None, None][1:3] if backward else [*dims, None, None][:2]  # backward: grad_out first
        if q is None or kv is None or len(q) != 4 or len(kv) < 3:
            return None
        nb, nh, sq, hd = q
        skv = kv[2]
        prefix, at = _ATTN[name]
        concrete = args.get("Concrete Inputs")
        if name == "aten::_scaled_dot_product_cudnn_attention" and isinstance(concrete, list) and len(concrete) < 9:
            at = 4  # PyTorch before 2.5: (query, key, value, dropout_p, is_causal, ...), no attn_bias or lse flag
        causal = isinstance(concrete, list) and len(concrete) > at and str(concrete[at]).lower() == "true"
        # The papers' and the graph's convention: a causal mask halves the FLOPs the kernel executes.
        flops = 4.0 * nb * nh * sq * skv * hd * (2.5 if backward else 1.0) * (0.5 if causal else 1.0)
        return {
            "kind": "attention",
            "op": f"{prefix}{'_causal' if causal else ''}_{'bwd' if backward else 'fwd'}",
            "m": sq,
            "n": skv,
            "k": hd,
            "batch": nb * nh,
            "flops": flops,
            "bytes": float(elem * 4 * nb * nh * sq * hd),
            "precision": precision,
        }
    if name in _MEMORY:
        tensors = [_numel(t) for t in dims if t is not None]
        if not tensors:
            return None
        moved = float(elem * (sum(tensors) + max(tensors)))  # inputs read, one output written
        return {"kind": "memory", "m": max(tensors), "bytes": moved, "precision": precision}
    return None


_WHAT = "a Chrome trace JSON from torch.profiler (prof.export_chrome_trace(path))"


def import_torch_trace(
    path: Path, *, device: str = "", scope: str = "", notes: list[str] | None = None
) -> list[Measurement]:
    """Rows from one Chrome trace; identical operator shapes are merged (median time). ``scope`` (``domain`` or
    ``network``) overrides the scope read off each collective's ranks (module docstring).

    Events the importer cannot read (no name, ``ts`` or ``dur``...) and NCCL kernels it cannot size or name
    are skipped; ``notes`` (when given) gets a line saying how many.
    """
    text = read_text(path, _WHAT)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{path}: not a readable Chrome trace JSON ({err}); give {_WHAT}") from None
    except ValueError:  # an integer of more than 4,300 digits (Python's int_max_str_digits)
        raise CalibrationError(
            f"{path}: not a readable Chrome trace JSON (it holds an integer of more than 4,300 digits); give {_WHAT}"
        ) from None
    except RecursionError:
        raise CalibrationError(f"{path}: not a readable Chrome trace JSON (nested too deeply); give {_WHAT}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise CalibrationError(f"{path}: no traceEvents list; export with prof.export_chrome_trace(path)")
    timed = [e for e in events if isinstance(e, dict) and e.get("cat") in ("cpu_op", "kernel")]
    readable = [e for e in timed if _well_formed(e)]
    skipped = len(timed) - len(readable)
    ops = [e for e in readable if e["cat"] == "cpu_op"]
    kernels = [e for e in readable if e["cat"] == "kernel"]
    props = data.get("deviceProperties") if isinstance(data, dict) else None
    props = props if isinstance(props, list) else []
    if not device:
        first = props[0] if props else {}
        device = str(first.get("name", "")) if isinstance(first, dict) else ""
    host_gpus = sum(isinstance(p, dict) for p in props)
    by_ext: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    comms: dict[Any, dict[str, Any]] = {}
    for op in ops:
        ext = _ext_id(op)
        if ext is not None:
            by_ext[ext].append(op)
        if op["name"] == "record_param_comms":
            comms.setdefault(ext, op)
    # Each operator's shape, FLOPs and bytes, worked out once (kernels look their owners up here).
    shapes = {id(op): c for op in ops if (c := _classify(op)) is not None}
    parent = _parents(ops)
    op_time: dict[int, float] = defaultdict(float)
    comm_rows: list[tuple[str, float, float, int, tuple[int, ...]]] = []
    unnamed_comms = unsized_comms = 0
    for kern in kernels:
        kname = kern["name"]
        if "nccl" in kname.lower():
            low = kname.lower().replace("_", "")
            coll = next((v for k, v in _NCCL.items() if k in low), None)
            if coll is None:
                unnamed_comms += 1
                continue
            size, group, members = _comm_size(comms, kern)
            if size > 0 and float(kern["dur"]) > 0:
                comm_rows.append((coll, size, float(kern["dur"]) * 1e-6, group, members))
            else:
                unsized_comms += 1
            continue
        ext = _ext_id(kern)
        owners = by_ext.get(ext) or [o for o in ops if o["ts"] <= kern["ts"] <= o["ts"] + o["dur"]]
        recognised = [o for o in owners if id(o) in shapes]
        if not recognised:
            # Launched by an operator the importer does not read: an attention operator around it owns it.
            around = [a for o in owners if (a := _recognised_ancestor(o, parent, shapes)) is not None]
            recognised = [a for a in around if shapes[id(a)]["kind"] == "attention"]
        if recognised:
            owner = min(recognised, key=lambda o: o["dur"])  # innermost recognised operator
            op_time[id(owner)] += float(kern["dur"])
    if not kernels:
        # CPU-only trace: a recognised operator's own duration is its time, unless it holds one of its own kind
        # (the inner one is the measurement) or sits inside a counted one (whose duration holds its time).
        outer = set()
        for op in ops:
            a = _recognised_ancestor(op, parent, shapes) if id(op) in shapes else None
            if a is not None and shapes[id(a)]["kind"] == shapes[id(op)]["kind"]:
                outer.add(id(a))
        counted = {id(op) for op in ops if id(op) in shapes and id(op) not in outer}
        for op in ops:
            if id(op) in counted and not _inside_counted(op, parent, counted):
                op_time[id(op)] += float(op["dur"])
    groups: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    info: dict[tuple[Any, ...], dict[str, Any]] = {}
    zero_time = empty = 0
    for op in ops:
        t = op_time.get(id(op))
        if t is None:
            continue  # no kernel of its own (an outer operator whose kernels its inner one owns)
        if t <= 0:
            zero_time += 1
            continue
        c = shapes[id(op)]
        if not (c.get("flops", 1.0) > 0 and c["bytes"] > 0):
            empty += 1  # a GEMM or attention without FLOPs, a memory operator without bytes (rows.check_fittable)
            continue
        row_op = str(c.get("op", op["name"]))  # attention rows are named for their kernel's curve
        key = (row_op, c["kind"], c.get("m", 0), c.get("n", 0), c.get("k", 0), c.get("batch", 1), c["bytes"])
        groups[key].append(t * 1e-6)
        info[key] = c
    rows: list[Measurement] = []
    for key in sorted(groups, key=str):
        c = info[key]
        times = groups[key]
        rows.append(
            Measurement(
                kind=c["kind"],
                op=key[0],
                precision=c["precision"],
                m=int(c.get("m", 0)),
                n=int(c.get("n", 0)),
                k=int(c.get("k", 0)),
                batch=int(c.get("batch", 1)),
                flops=float(c.get("flops", 0.0)),
                bytes=float(c["bytes"]),
                time_s=statistics.median(times),
                time_s_min=min(times),
                repeats=len(times),
                device=device,
                source=f"PyTorch profiler trace {path.name}",
            )
        )
    merged: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    assumed = 0
    for coll, size, seconds, group, members in comm_rows:
        row_scope, why = _comm_scope(scope, members, host_gpus)
        assumed += not why and group > 1
        merged[(coll, size, group, row_scope, why)].append(seconds)
    for (coll, size, group, row_scope, why), times in sorted(merged.items()):
        rows.append(
            Measurement(
                kind="collective",
                op=coll,
                bytes=size,
                ranks=group,
                scope=row_scope,
                time_s=statistics.median(times),
                repeats=len(times),
                device=device,
                source=f"PyTorch profiler trace {path.name}",
                note=why,
            )
        )
    if notes is not None:
        if skipped:
            notes.append(
                f"{path}: skipped {skipped} operator/kernel event(s) it cannot read (no name, a ts or dur that is "
                "not a finite number >= 0, or args that are not a mapping)"
            )
        if zero_time:
            notes.append(f"{path}: skipped {zero_time} recognised operator(s) timed at zero duration")
        if empty:
            notes.append(
                f"{path}: skipped {empty} recognised operator(s) on empty tensors (no FLOPs or bytes to fit: an MoE "
                "expert that received no tokens, say)"
            )
        if unnamed_comms:
            notes.append(f"{path}: skipped {unnamed_comms} NCCL kernel(s) whose name says no known collective")
        if assumed:
            notes.append(
                f"{path}: {assumed} NCCL kernel(s) taken to run inside one NVLink domain (scope domain): the trace "
                "records neither their group's ranks nor the host's GPUs; pass --scope network if the groups spanned "
                "nodes"
            )
        if unsized_comms:
            notes.append(
                f"{path}: skipped {unsized_comms} NCCL kernel(s) without a message size (no record_param_comms "
                "operator with In/Out msg nelems and a known dtype) or with a zero duration"
            )
    if not rows:
        unreadable = f" ({skipped} operator/kernel events unreadable: no name, ts or dur)" if skipped else ""
        raise CalibrationError(
            f"{path}: no recognised operators with timings{unreadable}; record with record_shapes=True and CUDA "
            "activity"
        )
    return rows


def _count(value: Any) -> int:
    """A whole, finite, non-negative count from a trace field, else 0 (also above 2^53, where a float stops counting
    whole numbers: a damaged field, whose byte size would overflow a float)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    return int(number) if math.isfinite(number) and 0 <= number <= MAX_COUNT else 0


def _parents(ops: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each operator's enclosing operator on its thread (``id(op)`` to the parent), from the spans: operators of one
    thread nest (Kineto records the dispatcher's call stack as nested spans)."""
    threads: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for op in ops:
        threads[(str(op.get("pid")), str(op.get("tid")))].append(op)
    parent: dict[int, dict[str, Any]] = {}
    for thread in threads.values():
        stack: list[dict[str, Any]] = []
        for op in sorted(thread, key=lambda o: (o["ts"], -o["dur"])):
            end = op["ts"] + op["dur"]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < end:
                stack.pop()
            if stack:
                parent[id(op)] = stack[-1]
            stack.append(op)
    return parent


def _recognised_ancestor(
    op: dict[str, Any], parent: dict[int, dict[str, Any]], shapes: dict[int, Any]
) -> dict[str, Any] | None:
    """The nearest operator around ``op`` that the importer reads, or None."""
    up = parent.get(id(op))
    while up is not None and id(up) not in shapes:
        up = parent.get(id(up))
    return up


def _inside_counted(op: dict[str, Any], parent: dict[int, dict[str, Any]], counted: set[int]) -> bool:
    """Whether an operator around ``op`` is counted (its duration already holds ``op``'s time)."""
    up = parent.get(id(op))
    while up is not None:
        if id(up) in counted:
            return True
        up = parent.get(id(up))
    return False


def _comm_scope(given: str, members: tuple[int, ...], host_gpus: int) -> tuple[str, str]:
    """The scope of a collective over global ranks ``members`` and why (empty when assumed; module docstring)."""
    if given:
        return given, "scope given by the caller"
    if members and host_gpus > 1:
        nodes = len({r // host_gpus for r in members})
        where = "network" if nodes > 1 else "domain"
        return where, f"ranks on {nodes} node(s) of {host_gpus} GPUs (torchrun numbering)"
    return "domain", ""


def _group_members(args: dict[str, Any], group: int) -> tuple[int, ...]:
    """The global ranks of a collective's group, from ``Process Group Ranks`` (a list, or its text ``[0, 8]``) or from
    ``Global rank start`` and ``Global rank stride``; empty when the trace has neither."""
    listed = args.get("Process Group Ranks")
    if isinstance(listed, str):
        try:
            listed = json.loads(listed)
        except ValueError:  # not JSON, or an integer of more than 4,300 digits
            listed = None
    if isinstance(listed, list) and listed and all(isinstance(r, int) and not isinstance(r, bool) for r in listed):
        return tuple(r for r in listed if 0 <= r <= 2**31)
    start, stride = args.get("Global rank start"), args.get("Global rank stride")
    if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**31 for v in (start, stride)) and stride:
        return tuple(start + i * stride for i in range(min(group, 2**16)))
    return ()


def _comm_size(comms: dict[Any, dict[str, Any]], kern: dict[str, Any]) -> tuple[float, int, tuple[int, ...]]:
    """Message bytes, group size and the group's global ranks (empty when unrecorded) from the
    ``record_param_comms`` operator that launched an NCCL kernel (``comms``: the first such operator per External
    id; without an id on the kernel, the trace's first)."""
    ext = _ext_id(kern)
    op = comms.get(ext) if ext is not None else next(iter(comms.values()), None)
    if op is None:
        return 0.0, 0, ()
    args = op.get("args", {})
    # The message size as nccl-tests and the tables count it, the whole buffer: the gathered output of an
    # all-gather, the full input of a reduce-scatter, i.e. the larger of the two (each rank's shard is the smaller).
    nelems = max(_count(args.get("In msg nelems") or 0), _count(args.get("Out msg nelems") or 0))
    elem = _COMM_DTYPE_BYTES.get(str(args.get("dtype", "")).removeprefix("c10::"), 0)  # unknown dtype: unsized
    group = _count(args.get("Group size") or 0)
    return float(nelems * elem), group, _group_members(args, group)
