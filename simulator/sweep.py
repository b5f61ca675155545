"""Sweeps: many (model, cluster, plan) cases simulated, one tidy DataFrame row each.

A sweep is embarrassingly parallel (Design: Scale-out). :func:`sweep` runs its cases in this process, on local
worker processes (``workers``), or on a Dask distributed cluster (``scheduler``), and returns the rows in the
order of the cases whatever order they finished in, so the same cases give the same bytes. Every case is a row,
including those that cannot be answered with a time: a plan that does not fit in memory (``status``
``out_of_memory``, with the stage and bytes over), one that cannot run at all (``cannot_run``: a degree that does
not divide the model, say) and a combination that is no plan (``invalid``: a GPU count that tp·pp·cp does not
divide, vp > 1 without a pipeline). Nothing is dropped silently.

With ``out``, finished rows are journalled next to the output file as they arrive (``<out>.journal``, one JSON line
per case, keyed by a hash of the case's inputs); a sweep that is killed and run again with the same ``out``
reuses the rows already there and simulates only the rest. The journal is deleted once ``out`` is written. It is
keyed by inputs, not by the simulator's code: after upgrading clustersim, delete a stale journal.

:func:`grid` builds the cases of a Cartesian product of knob values (the CLI's ``clustersim sweep`` and a grid
YAML file go through :func:`cases_from_mapping`). Specs are loaded and validated once, before any case runs:
nothing on the per-case path reads a file. Only this module, the edge of the package, imports pandas.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import itertools
import json
import math
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.errors import SpecError
from simulator.run import infeasible_result, row_columns, simulate
from simulator.specs._fields import check_whole
from simulator.specs.hardware import ClusterSpec
from simulator.specs.library import is_plain
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["STATUSES", "Case", "cases_from_mapping", "grid", "output_path", "process_context", "sweep", "write_frame"]

# What a row's ``status`` column says: a time that fits, a time that does not fit in memory (or no time, with
# time_oom=False), a plan that cannot run, and a combination that is no plan at all.
STATUSES = ("ok", "out_of_memory", "cannot_run", "invalid")
# Output formats by file suffix.
_WRITERS = (".csv", ".parquet", ".json")
# A guard, not physics: the most cases one sweep builds. A grid's size is the product of its axes' lengths, so a
# few long lists reach millions; at ~15 ms a case (fixed knobs, 2026-11-28) a million is four hours on one core.
MAX_CASES = 1_000_000
# Cases per task sent to a worker process: enough to amortise pickling the specs, few enough that progress and
# the journal advance often and the last worker does not run long alone.
_CHUNK_MAX = 32
_CHUNKS_PER_WORKER = 8


@dataclass(frozen=True, slots=True)
class Case:
    """One sweep case: a model, a cluster and a plan, with labels that become columns of its row.

    ``labels`` name what a sweep varied that the row's own columns cannot show, such as a what-if on the cluster
    (``set.cluster.nic_bandwidth_gbit_per_s``: the cluster's name is the same either way). A combination that
    is no plan (``grid`` found a GPU count that tp·pp·cp does not divide) has ``plan`` None, the reason in
    ``problem`` and the keys it was given in ``knobs``, which fill the row's ``plan.*`` columns.
    """

    model: ModelSpec
    cluster: ClusterSpec
    plan: PlanSpec | None
    labels: tuple[tuple[str, Any], ...] = ()
    problem: str = ""
    knobs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec) or not isinstance(self.cluster, ClusterSpec):
            raise SpecError("Case", "needs a ModelSpec and a ClusterSpec", "load them with load_model/load_cluster")
        if (self.plan is None) == (not self.problem):
            raise SpecError("Case", "takes a plan, or no plan and the problem why", "give a PlanSpec")
        if self.plan is not None and not isinstance(self.plan, PlanSpec):
            raise SpecError("Case: plan", f"must be a PlanSpec, got {type(self.plan).__name__}", "build a PlanSpec")
        labels = self.labels.items() if isinstance(self.labels, Mapping) else self.labels
        if isinstance(labels, str | bytes) or not all(isinstance(x, tuple) and len(x) == 2 for x in labels):
            raise SpecError(
                "Case: labels",
                f"must be a mapping of names to values or (name, value) pairs, got {self.labels!r}",
                "e.g. labels={'network': '2x'}",
            )
        object.__setattr__(self, "labels", tuple(labels))
        names = [name for name, _ in self.labels]
        for name in names:
            if not isinstance(name, str) or not name or name in row_columns() or name in ("case", "status"):
                raise SpecError(
                    f"Case: label {name!r}",
                    "must be a non-empty name that is not one of the result's columns",
                    "name it after what was varied, e.g. 'set.cluster.nic_bandwidth_gbit_per_s'",
                )
        if len(set(names)) != len(names):
            raise SpecError("Case: labels", f"name a column twice: {names}", "give each label once")

    def labelled(self, **labels: Any) -> Case:
        """A copy with more labels (``case.labelled(network="2x")``)."""
        return replace(self, labels=(*self.labels, *labels.items()))


def grid(
    model: ModelSpec | Sequence[ModelSpec],
    cluster: ClusterSpec | Sequence[ClusterSpec],
    *,
    gpus: int | Sequence[int] | None = None,
    **knobs: Any,
) -> list[Case]:
    """The cases of every combination of models, clusters, GPU counts and plan knob values.

    Each knob is a :class:`~simulator.specs.PlanSpec` field given one value or a list (tuple, range) of values;
    ``global_batch`` is required. With ``gpus``, dp is derived from it for each combination (a combination whose
    tp·pp·cp does not divide it is an ``invalid`` case, kept with the reason); a knob left out takes its
    default or, for the free knobs, is chosen by the simulator per case. Cases come in the order of
    ``itertools.product`` over models, clusters, GPU counts and the knobs in the order given.

    >>> from simulator.specs import load_cluster, load_model
    >>> cases = grid(load_model("llama3-8b"), load_cluster("dgx-h100"), gpus=16, tp=[1, 2, 3], global_batch=64)
    >>> [(c.plan.tp, c.plan.dp) if c.plan else c.problem for c in cases]
    [(1, 16), (2, 8), 'gpus 16 is not a multiple of tp·pp·cp = 3·1·1']
    """
    models = _as_list(model, ModelSpec, "model")
    clusters = _as_list(cluster, ClusterSpec, "cluster")
    known = PlanSpec.field_names()
    for key in knobs:
        if key not in known:
            from simulator.specs._fields import did_you_mean

            raise SpecError(f"grid: {key}", f"is not a plan knob{did_you_mean(key, known)}", "use a PlanSpec field")
    if "global_batch" not in knobs:
        raise SpecError("grid: global_batch", "is required", "give the sequences per optimizer step")
    counts, axes = _plan_axes("grid", knobs, gpus)
    _check_size("grid", len(models) * len(clusters) * len(counts) * math.prod(len(v) for v in axes.values()))
    cases = []
    for m, c, count in itertools.product(models, clusters, counts):
        for combo in itertools.product(*axes.values()):
            data = dict(zip(axes, combo, strict=True))
            cases.append(_case(m, c, count, data, ()))
    return cases


def cases_from_mapping(data: Any, where: str) -> list[Case]:
    """The cases a grid mapping describes (a grid YAML file, or the CLI's options): ``model`` and ``cluster`` (a
    name or path, or a list of them), ``gpus``, any plan key (``tp: [4, 8]``), and ``set``, a mapping of what-if
    overrides (``cluster.nic_bandwidth_gbit_per_s: [200, 400]``) whose values become labelled columns. Each value
    may be one value or a list. Models and clusters are loaded once per distinct override.
    """
    from simulator.specs.library import load_cluster, load_model

    if not isinstance(data, Mapping):
        raise SpecError(where, "must be a mapping of grid keys", "write 'model: gpt3-175b' and 'tp: [4, 8]' lines")
    allowed = ("model", "cluster", "gpus", "set", *PlanSpec.field_names())
    for key in data:
        if key not in allowed:
            from simulator.specs._fields import did_you_mean

            raise SpecError(
                f"{where}: {key}",
                f"is not a grid key{did_you_mean(str(key), allowed)}",
                "use model, cluster, gpus, set or a plan key",
            )
    for key in ("model", "cluster", "global_batch"):
        if data.get(key) in (None, [], ()):
            raise SpecError(f"{where}: {key}", "is required", f"give {key} one value or a list")
    models = _values(f"{where}: model", data["model"])
    clusters = _values(f"{where}: cluster", data["cluster"])
    for key, refs in (("model", models), ("cluster", clusters)):
        for ref in refs:
            if not isinstance(ref, str) or not ref.strip():
                raise SpecError(
                    f"{where}: {key}", f"must name a {key}, got {ref!r}", f"give a built-in {key} or a path"
                )
    sets = data.get("set") or {}
    if not isinstance(sets, Mapping):
        raise SpecError(f"{where}: set", "must map scope.key to values", "e.g. cluster.nic_bandwidth_gbit_per_s: [200]")
    set_axes: dict[str, tuple[str, str, tuple[Any, ...]]] = {}
    for dotted, values in sets.items():
        scope, dot, name = str(dotted).partition(".")
        if not dot or not name or scope not in ("model", "cluster", "device", "plan"):
            raise SpecError(
                f"{where}: set: {dotted}", "must look like scope.key", "scope is model, cluster, device or plan"
            )
        if scope == "plan":
            if name in data or name == "gpus":
                raise SpecError(
                    f"{where}: set: {dotted}",
                    f"is also given as the grid key {name}",
                    f"give {name} once, as a grid key",
                )
            set_axes[str(dotted)] = (scope, name, _axis(f"{where}: set", name, values))
        else:
            set_axes[str(dotted)] = (scope, name, _values(f"{where}: set: {dotted}", values))
    knobs = {key: value for key, value in data.items() if key in PlanSpec.field_names() and value is not None}
    counts, plan_axes = _plan_axes(where, knobs, data.get("gpus"))
    what_ifs = math.prod(len(v[2]) for v in set_axes.values())
    _check_size(where, len(models) * len(clusters) * len(counts) * what_ifs * math.prod(map(len, plan_axes.values())))
    loaded_models: dict[tuple[str, str], ModelSpec] = {}
    loaded_clusters: dict[tuple[str, str], ClusterSpec] = {}
    cases = []
    for what_if in itertools.product(*(v[2] for v in set_axes.values())):
        overrides: dict[str, dict[str, Any]] = {}
        for (scope, name, _), value in zip(set_axes.values(), what_if, strict=True):
            overrides.setdefault(scope, {})[name] = value
        labels = tuple((f"set.{dotted}", value) for dotted, value in zip(set_axes, what_if, strict=True))
        key_m = json.dumps(overrides.get("model", {}), sort_keys=True, default=str)
        key_c = json.dumps([overrides.get("cluster", {}), overrides.get("device", {})], sort_keys=True, default=str)
        for ref_m, ref_c, count in itertools.product(models, clusters, counts):
            m = loaded_models.get((ref_m, key_m))
            if m is None:
                m = loaded_models[ref_m, key_m] = load_model(ref_m, overrides.get("model"))
            c = loaded_clusters.get((ref_c, key_c))
            if c is None:
                c = loaded_clusters[ref_c, key_c] = load_cluster(
                    ref_c, overrides.get("cluster"), overrides.get("device")
                )
            for combo in itertools.product(*plan_axes.values()):
                knobs = dict(zip(plan_axes, combo, strict=True))
                knobs.update(overrides.get("plan", {}))
                cases.append(_case(m, c, count, knobs, labels, where))
    return cases


def sweep(
    cases: Iterable[Case | tuple[ModelSpec, ClusterSpec, PlanSpec]],
    *,
    workers: int = 1,
    scheduler: Any = None,
    out: str | Path | None = None,
    time_oom: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> pd.DataFrame:
    """Simulate every case; one row per case, in the cases' order.

    Columns: ``case`` (the case's position), its labels, ``status`` (one of :data:`STATUSES`), then
    :meth:`simulator.run.StepResult.to_row`'s columns (``plan.*``, times, the breakdown, memory, ``chosen.*``).

    Parameters
    ----------
    cases
        :class:`Case` objects, or ``(model, cluster, plan)`` tuples.
    workers
        Local worker processes; 1 (the default) runs in this process. More than the cores gains nothing.
    scheduler
        A Dask distributed scheduler address (``"tcp://host:8786"``) or ``distributed.Client``: run the cases on
        that cluster instead (``pip install 'clustersim[dask]'``; its workers need clustersim installed).
    out
        Write the rows there (``.csv``, ``.parquet`` with pyarrow, or ``.json`` records), journalling them as they
        finish so that a killed sweep resumes (module docstring).
    time_oom
        As :func:`simulator.run.simulate`: False answers a plan that does not fit from the memory model alone,
        much faster where most plans do not fit.
    progress
        Called with (cases done, cases in all) after each batch of rows.

    Examples
    --------
    >>> from simulator.specs import load_cluster, load_model
    >>> df = sweep(grid(load_model("llama3-8b"), load_cluster("dgx-h100"), gpus=8, tp=[2, 4], global_batch=32,
    ...                 micro_batch=1, recompute="full", grad_overlap=True, vp=1))
    >>> list(df["plan.tp"]), list(df["status"])
    ([2, 4], ['ok', 'ok'])
    """
    import pandas as pd

    for name, flag in (("time_oom", time_oom),):
        if not isinstance(flag, bool):
            raise SpecError(f"sweep: {name}", f"must be True or False, got {flag!r}", "pass a bool")
    check_whole("sweep: workers", workers, "use 1 to run in-process")
    todo = [_as_case(item, i) for i, item in enumerate(cases)]
    if len(todo) > MAX_CASES:
        raise SpecError("sweep", f"has {len(todo):,} cases, more than {MAX_CASES:,}", "split the sweep")
    out_path = output_path(out)
    spec_keys = _spec_keys(todo)
    keys = _case_keys(todo, time_oom, spec_keys)
    rows: dict[int, dict[str, Any]] = {}
    journal = None
    if out_path is not None:
        journal = out_path.with_name(out_path.name + ".journal")
        rows.update(_read_journal(journal, keys))
    total = len(todo)
    done = len(rows)
    if progress is not None:
        progress(done, total)
    pending = [i for i in range(total) if i not in rows]
    with _Journal(journal) as log:
        for batch in _run(todo, pending, spec_keys, workers, scheduler, time_oom):
            for index, row in batch:
                rows[index] = row
            log.write((keys[index], rows[index]) for index, _ in batch)
            done += len(batch)
            if progress is not None:
                progress(done, total)
    ordered = [{"case": i, **dict(todo[i].labels), **rows[i]} for i in range(total)]
    frame = (
        pd.DataFrame.from_records(ordered, columns=_columns(todo)) if ordered else pd.DataFrame(columns=_columns(todo))
    )
    if out_path is not None:
        write_frame(frame, out_path)
        if journal is not None and journal.exists():
            journal.unlink()
    return frame


# -- building cases --------------------------------------------------------------------------------------------


def _as_list(value: Any, kind: type, name: str) -> list[Any]:
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not items:
        raise SpecError(f"grid: {name}", "is an empty list", f"give at least one {name}")
    for item in items:
        if not isinstance(item, kind):
            raise SpecError(
                f"grid: {name}", f"must be a {kind.__name__} or a list of them, got {type(item).__name__}", "load it"
            )
    return items


def _values(where: str, value: Any) -> tuple[Any, ...]:
    """One value, or a list/tuple/range of them, as a tuple; an empty list is refused, a repeated value kept once."""
    if isinstance(value, list | tuple | range):
        values = tuple(value)
        if not values:
            raise SpecError(where, "is an empty list", "give at least one value")
    elif isinstance(value, Mapping | set | frozenset):
        raise SpecError(where, f"must be a value or a list of values, got {type(value).__name__}", "give a list")
    else:
        values = (value,)
    unique: list[Any] = []
    for v in values:
        if isinstance(v, list | tuple | Mapping):
            raise SpecError(where, f"must be a list of single values, got {v!r} in it", "flatten the list")
        if not is_plain(v):
            # A YAML date (2001-01-01) or !!binary value: no spec key takes one, and the grid's JSON could not hold it.
            raise SpecError(
                where, f"holds {v!r}, which YAML reads as a {type(v).__name__}", "quote it to give it as text"
            )
        if not any(_same(v, u) for u in unique):
            unique.append(v)
    return tuple(unique)


def _same(a: Any, b: Any) -> bool:
    """Whether two axis values are one (200 and 200.0 are; True and 1 are not)."""
    return bool(a == b) and isinstance(a, bool) == isinstance(b, bool) and isinstance(a, str) == isinstance(b, str)


def _axis(where: str, key: str, value: Any) -> tuple[Any, ...]:
    """An axis of a grid: its values, each read on its own as a plan file's reader reads it (a typo is bad input; only
    the rules between keys make a combination invalid), in canonical form ('Full' is 'full', 'auto' None, 8.0 8) and
    each once."""
    from simulator.specs._fields import Fields

    values = _values(f"{where}: {key}", value)
    if key == "gpus":
        read = [Fields({key: v}, where).integer(key, None, minimum=1) for v in values]
    else:
        read = [PlanSpec.read_value(key, v, where) for v in values]
    unique: list[Any] = []
    for v in read:
        if not any(_same(v, u) for u in unique):
            unique.append(v)
    return tuple(unique)


def _plan_axes(where: str, knobs: Mapping[str, Any], gpus: Any) -> tuple[tuple[Any, ...], dict[str, tuple[Any, ...]]]:
    """The GPU counts (None: dp given instead) and the plan axes of a grid, each value read."""
    if gpus is not None and knobs.get("dp") is not None:
        raise SpecError(f"{where}: dp", "is derived from gpus when gpus is given", "give gpus or dp, not both")
    counts = (None,) if gpus is None else _axis(where, "gpus", gpus)
    return counts, {key: _axis(where, key, value) for key, value in knobs.items()}


def _check_size(where: str, size: int) -> None:
    if size > MAX_CASES:
        raise SpecError(
            where, f"has {size:,} combinations, more than {MAX_CASES:,}", "sweep fewer values, or split the sweep"
        )


def _case(
    model: ModelSpec,
    cluster: ClusterSpec,
    gpus: int | None,
    knobs: dict[str, Any],
    labels: tuple[tuple[str, Any], ...],
    where: str = "grid",
) -> Case:
    """One combination as a case; a combination that is no plan keeps its knobs and the reason."""
    shown = {**({"gpus": gpus} if gpus is not None else {}), **knobs}
    try:
        plan = PlanSpec.from_mapping(dict(knobs), where, gpus=gpus)
    except SpecError as err:
        what = err.what
        if err.where.endswith(": gpus") and "multiple of tp·pp·cp" in what:
            tp, pp, cp = (int(knobs.get(k) or 1) for k in ("tp", "pp", "cp"))
            what = f"gpus {gpus} is not a multiple of tp·pp·cp = {tp}·{pp}·{cp}"
        else:
            what = f"{err.where.removeprefix(where + ': ')}: {what}"
        return Case(model, cluster, None, labels, what, tuple(shown.items()))
    return Case(model, cluster, plan, labels)


def _as_case(item: Any, index: int) -> Case:
    if isinstance(item, Case):
        return item
    if isinstance(item, tuple) and len(item) == 3:
        return Case(*item)
    raise SpecError(
        f"sweep: case {index}",
        f"must be a Case or a (model, cluster, plan) tuple, got {type(item).__name__}",
        "build cases with grid() or Case(model, cluster, plan)",
    )


# -- running ---------------------------------------------------------------------------------------------------


def _spec_keys(cases: list[Case]) -> dict[int, str]:
    """A hash of every distinct model and cluster object's repr (all its fields), by object id."""
    keys: dict[int, str] = {}
    for case in cases:
        for spec in (case.model, case.cluster):
            if id(spec) not in keys:
                keys[id(spec)] = hashlib.sha256(repr(spec).encode()).hexdigest()
    return keys


def _case_keys(cases: list[Case], time_oom: bool, spec_keys: dict[int, str] | None = None) -> list[str]:
    """A stable hash of each case's inputs (the journal's key)."""
    specs = _spec_keys(cases) if spec_keys is None else spec_keys
    keys = []
    for case in cases:
        text = "|".join(
            (
                specs[id(case.model)],
                specs[id(case.cluster)],
                repr(case.plan),
                repr(case.labels),
                case.problem,
                repr(case.knobs),
                str(time_oom),
            )
        )
        keys.append(hashlib.sha256(text.encode()).hexdigest())
    return keys


def _run(
    cases: list[Case], pending: list[int], spec_keys: dict[int, str], workers: int, scheduler: Any, time_oom: bool
) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    """Rows of the pending cases, in batches as they finish."""
    if not pending:
        return
    if scheduler is None and workers == 1:
        step = 8  # journal and progress every few cases
        for start in range(0, len(pending), step):
            yield [(i, _row(cases[i], time_oom)) for i in pending[start : start + step]]
        return
    # Cases that share specs go together, so that a worker's cost-model and program caches serve a whole chunk.
    order = sorted(pending, key=lambda i: (spec_keys[id(cases[i].model)], spec_keys[id(cases[i].cluster)], i))
    parallel = workers if scheduler is None else 64
    size = max(1, min(_CHUNK_MAX, math.ceil(len(order) / (parallel * _CHUNKS_PER_WORKER))))
    payloads = [_payload(cases, order[s : s + size], spec_keys, time_oom) for s in range(0, len(order), size)]
    if scheduler is not None:
        yield from _run_dask(scheduler, payloads)
        return
    context = process_context()
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(payloads)), mp_context=context) as pool:
        futures = [pool.submit(_run_chunk, payload) for payload in payloads]
        try:
            for future in concurrent.futures.as_completed(futures):
                yield future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def process_context() -> Any:
    """How worker processes start. Fork where it is safe, a single-threaded process on Linux: workers start at
    once with the parent's modules and caches, and a script needs no ``if __name__ == "__main__"`` guard.
    Elsewhere (macOS, Windows, a threaded host such as a Jupyter kernel) forkserver or spawn, which import the
    package afresh, and in a script need that guard (Python's multiprocessing rule)."""
    methods = multiprocessing.get_all_start_methods()
    if sys.platform.startswith("linux") and threading.active_count() == 1 and "fork" in methods:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["simulator.sweep", "simulator.search.planner"])
        return context
    return multiprocessing.get_context("spawn")


# A chunk for a worker: each distinct spec once by content hash, the cases pointing at them (index, model key,
# cluster key, plan, problem, knobs: labels stay here, they do not change a row's figures), and time_oom.
_Payload = tuple[dict[str, Any], list[tuple[int, str, str, PlanSpec | None, str, tuple[tuple[str, Any], ...]]], bool]


def _payload(cases: list[Case], indices: list[int], spec_keys: dict[int, str], time_oom: bool) -> _Payload:
    specs: dict[str, Any] = {}
    items = []
    for i in indices:
        case = cases[i]
        km, kc = spec_keys[id(case.model)], spec_keys[id(case.cluster)]
        specs.setdefault(km, case.model)
        specs.setdefault(kc, case.cluster)
        items.append((i, km, kc, case.plan, case.problem, case.knobs))
    return specs, items, time_oom


# The specs a worker process has received, by content hash: one object per distinct spec for the whole sweep, so
# that simulate's caches, keyed by object identity, serve every chunk and not only the one that brought it.
_WORKER_SPECS: dict[str, Any] = {}
_WORKER_SPECS_MAX = 256
_WORKER_SPECS_LOCK = threading.Lock()  # a threaded Dask worker runs several chunks at once


def _run_chunk(payload: _Payload) -> list[tuple[int, dict[str, Any]]]:
    specs, items, time_oom = payload
    with _WORKER_SPECS_LOCK:
        if len(_WORKER_SPECS) + len(specs) > _WORKER_SPECS_MAX:
            _WORKER_SPECS.clear()
        own: dict[str, Any] = {key: _WORKER_SPECS.setdefault(key, spec) for key, spec in specs.items()}
    return [
        (i, _row(Case(own[km], own[kc], plan, (), problem, knobs), time_oom))
        for i, km, kc, plan, problem, knobs in items
    ]


def _run_dask(scheduler: Any, payloads: list[_Payload]) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    try:
        distributed: Any = importlib.import_module("distributed")  # typed as Any: its stubs are partial
    except ImportError:
        raise SpecError(
            "sweep: scheduler",
            "needs Dask's distributed package, which is not installed",
            "pip install 'clustersim[dask]', or leave scheduler out to run on local processes",
        ) from None
    client = scheduler if isinstance(scheduler, distributed.Client) else None
    if client is None:
        if not isinstance(scheduler, str) or not scheduler.strip():
            raise SpecError(
                "sweep: scheduler",
                f"must be a scheduler address or a distributed.Client, got {scheduler!r}",
                "e.g. 'tcp://10.0.0.5:8786'",
            )
        try:
            client = distributed.Client(scheduler, timeout="30s")
        except (OSError, ValueError, TypeError) as err:  # unreachable, or no address ('missing port number')
            raise SpecError(
                f"sweep: scheduler {scheduler}", f"cannot be reached ({err})", "start it with dask-scheduler"
            ) from None
        owned = True
    else:
        owned = False
    try:
        futures = client.map(_run_chunk, payloads, pure=False)
        for future in distributed.as_completed(futures):
            yield future.result()
    finally:
        if owned:
            client.close()


def _row(case: Case, time_oom: bool) -> dict[str, Any]:
    """The case's row: status first, then the result's flat row."""
    if case.plan is None:
        return _invalid_row(case)
    try:
        result = simulate(case.model, case.cluster, case.plan, raise_infeasible=False, time_oom=time_oom)
    except SpecError as err:  # a knob the model refuses (recompute_layers beyond its layers): this case only
        knobs = {"gpus": case.plan.num_gpus, **case.plan.as_dict()}
        return _invalid_row(replace(case, plan=None, problem=f"{err.where}: {err.what}", knobs=tuple(knobs.items())))
    return {"status": result.status, **result.to_row()}


def _invalid_row(case: Case) -> dict[str, Any]:
    """A row of the usual columns for a combination that is no plan: its knobs, the reason, no figures."""
    template = infeasible_result(case.model, case.cluster, PlanSpec(global_batch=1), case.problem).to_row()
    row: dict[str, Any] = {"status": "invalid"}
    knobs = dict(case.knobs)
    for key, value in template.items():
        if key.startswith("plan."):
            row[key] = knobs.get(key.removeprefix("plan."))
        else:
            row[key] = knobs.get("gpus") if key == "num_gpus" else value
    # A what-if value may be any number (expert_imbalance .nan is refused only by the plan): JSON has no NaN.
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def _columns(cases: list[Case]) -> list[str]:
    labels: dict[str, None] = {}
    for case in cases:
        labels.update(dict.fromkeys(name for name, _ in case.labels))
    return ["case", *labels, "status", *row_columns()]


# -- output and journal ----------------------------------------------------------------------------------------


def output_path(out: str | Path | None) -> Path | None:
    """``out`` as a path whose format (by suffix) can be written, None for None; else a SpecError."""
    if out is None:
        return None
    path = Path(out)
    if path.suffix.lower() not in _WRITERS:
        raise SpecError(
            f"sweep: out {path}",
            f"has no known format (suffix {path.suffix or 'none'})",
            "name a .csv, .parquet or .json file",
        )
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise SpecError(
                f"sweep: out {path}",
                "needs pyarrow to write Parquet",
                "pip install 'clustersim[parquet]', or write .csv",
            ) from None
    if path.is_dir():
        raise SpecError(f"sweep: out {path}", "is a folder", "name a file")
    return path


def _read_journal(path: Path, keys: list[str]) -> dict[int, dict[str, Any]]:
    """Rows a killed run of the same sweep finished, by case index. A line cut off by the kill is skipped; so is
    a row of a case this sweep does not have (its inputs changed since)."""
    if not path.is_file():
        return {}
    where = {key: i for i, key in enumerate(keys)}
    columns = ["status", *row_columns()]
    rows: dict[int, dict[str, Any]] = {}
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("row"), dict):
                continue
            index = where.get(entry.get("key"))  # type: ignore[arg-type]
            if index is not None and list(entry["row"]) == columns:  # a row of another release's columns is redone
                rows[index] = entry["row"]
    return rows


class _Journal:
    """Appends finished rows to the journal, flushed to disk after each batch."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.handle: Any = None

    def __enter__(self) -> _Journal:
        if self.path is not None:
            self.handle = self.path.open("a", encoding="utf-8")
        return self

    def write(self, entries: Iterable[tuple[str, dict[str, Any]]]) -> None:
        if self.handle is None:
            return
        for key, row in entries:
            self.handle.write(json.dumps({"key": key, "row": row}, allow_nan=False) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.close()


def _one_type_per_column(frame: pd.DataFrame) -> bool:
    """Whether every column holds values of one type (Parquet stores one type per column)."""
    return all(len(_types(frame[c])) <= 1 for c in frame.columns)


def _types(column: Any) -> set[type]:
    return {type(v) for v in column if not _missing(v)}


def _as_text(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each column that mixes types (a label of numbers and words) written as text, None kept."""
    out = frame.copy()
    for c in out.columns:
        if len(_types(out[c])) > 1:
            out[c] = [None if _missing(v) else str(v) for v in out[c]]
    return out


def _missing(value: Any) -> bool:
    """Whether a cell is missing: None or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def write_frame(frame: pd.DataFrame, path: Path) -> None:
    """Write a sweep's or a planner's rows as CSV, Parquet or JSON by the path's suffix (:func:`output_path`), through a
    temporary file, so that a reader never sees half a file."""
    suffix = path.suffix.lower()
    tmp = path.with_name(path.name + ".tmp")
    if suffix == ".csv":
        frame.to_csv(tmp, index=False, lineterminator="\n")
    elif suffix == ".parquet":
        frame.to_parquet(tmp, index=False) if _one_type_per_column(frame) else _as_text(frame).to_parquet(
            tmp, index=False
        )
    else:
        # Python's own float repr, which reads back exactly (pandas' to_json keeps 15 significant digits at most).
        records = [
            {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            for row in frame.to_dict("records")
        ]
        tmp.write_text(json.dumps(records, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
