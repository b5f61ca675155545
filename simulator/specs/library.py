"""The built-in library of models and hardware profiles, and loading specs by name or path.

Built-in files live in ``models/`` and ``hardware_profiles/{devices,clusters,calibration}/`` at the top of
the repository; a wheel carries them inside the package as ``simulator/_data/`` so a non-editable install
finds them too. A file's stem is its name (``models/gpt3-175b.yaml`` is ``gpt3-175b``), matched without
regard to case; directories listed in the ``CLUSTERSIM_PATH`` environment variable (``:``-separated, each
holding ``models/`` or ``hardware_profiles/``) are searched first. Anything that looks like a path is
read as a file: YAML, or a Hugging Face ``config.json`` for models. Loaded specs are cached per file (its path and
modification time), so a repeated lookup parses nothing, but it still finds and stats the file (a name lists the
library's folders, about 10 file-system calls), and overrides (``load_cluster(name, {...})``) re-read the YAML
they change: a sweep loads its specs once, outside the loop, and varies them with ``ModelSpec.with_``,
``PlanSpec.with_`` or ``dataclasses.replace`` (a cluster).
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from simulator.errors import SpecError
from simulator.specs._fields import did_you_mean
from simulator.specs._yaml import load_yaml_file, load_yaml_text
from simulator.specs.calibration import CalibrationTable
from simulator.specs.hardware import ClusterSpec, DeviceSpec
from simulator.specs.hf import load_hf_config
from simulator.specs.model import ModelSpec
from simulator.specs.plan import PlanSpec

__all__ = [
    "KINDS",
    "apply_overrides",
    "data_roots",
    "find_file",
    "is_plain",
    "list_names",
    "load_calibration",
    "load_cluster",
    "load_device",
    "load_model",
    "load_plan",
    "load_spec_file",
    "parse_overrides",
]

KINDS: dict[str, str] = {
    "model": "models",
    "device": "hardware_profiles/devices",
    "cluster": "hardware_profiles/clusters",
    "calibration": "hardware_profiles/calibration",
}

_PACKAGE = Path(__file__).resolve().parents[1]


def builtin_roots() -> tuple[Path, ...]:
    """The folders clustersim's own data ships in: the wheel's copy (pyproject.toml: force-include), else the source
    checkout the package sits in, only where that is ours (its pyproject.toml), never another package's top-level
    models/ folder in site-packages."""
    source_tree = (_PACKAGE.parent,) if (_PACKAGE.parent / "pyproject.toml").is_file() else ()
    return tuple(
        root
        for root in (_PACKAGE / "_data", *source_tree)
        if (root / "models").is_dir() or (root / "hardware_profiles").is_dir()
    )


def data_roots() -> tuple[Path, ...]:
    """Directories searched for built-in data, first match wins: CLUSTERSIM_PATH's, then :func:`builtin_roots`."""
    user = tuple(Path(e).expanduser() for e in os.environ.get("CLUSTERSIM_PATH", "").split(os.pathsep) if e.strip())
    return user + builtin_roots()


def list_names(kind: str) -> list[tuple[str, Path]]:
    """``(name, path)`` of every built-in file of ``kind``, sorted by name, first root wins."""
    seen: dict[str, Path] = {}
    for root in data_roots():
        folder = root / KINDS[kind]
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.yaml")):
            seen.setdefault(path.stem.lower(), path)
    return sorted(((p.stem, p) for p in seen.values()), key=lambda item: item[0].lower())


def tables_for_device(device: str) -> list[str]:
    """Names of the built-in calibration tables measured on ``device`` (their ``device:`` key), for a hint where
    a cluster of that device names none. Reads the table files: for the CLI, not for a sweep's hot path."""
    from simulator.specs._yaml import load_yaml_file

    names = []
    for name, path in list_names("calibration"):
        try:
            data = load_yaml_file(path)
        except SpecError:
            continue
        if isinstance(data, dict) and str(data.get("device", "")).lower() == device.lower():
            names.append(name)
    return names


def _looks_like_path(ref: str) -> bool:
    return ref.lower().endswith((".yaml", ".yml", ".json")) or os.sep in ref or "/" in ref


def find_file(kind: str, ref: str | Path) -> Path:
    """The file that ``ref`` names: an existing path, or a built-in name of ``kind``."""
    text = str(ref)
    if not text.strip():
        # Path("") is the current folder, which read as "is a directory" for an empty `device:` in a cluster file.
        raise SpecError(f"{kind} {text!r}", "is empty", f"name a built-in {kind} or a {kind} file")
    if isinstance(ref, Path) or _looks_like_path(text):
        path = Path(text).expanduser()
        if path.is_dir():
            raise SpecError(text, "is a directory, not a file", f"name the {kind} file inside it, or a built-in {kind}")
        if not path.exists():  # a pipe (<(...), /dev/stdin) is no regular file, and reads like one
            raise SpecError(text, "file not found", f"check the path, or use a built-in {kind} name")
        return path
    names = list_names(kind)
    for name, path in names:
        if name.lower() == text.lower():
            return path
    known = [n for n, _ in names]
    hint = did_you_mean(text, known)
    listing = ", ".join(known) if len(known) <= 40 else ", ".join(known[:40]) + ", ..."
    if Path(text).expanduser().is_dir():  # a bare folder name: not a built-in, and not a file either
        raise SpecError(
            text,
            f"is a directory, not a {kind} file, nor a built-in {kind}{hint}",
            f"name a file inside it, or one of: {listing}",
        )
    raise SpecError(f"{kind} {text!r}", f"is not a built-in {kind}{hint}", f"use one of: {listing}; or a file path")


def _stamp(path: Path) -> tuple[str, float]:
    """The cache key of a spec file: its resolved path and modification time. A pipe (``--model <(...)``,
    /dev/stdin) keeps its own name (resolved it is /proc/.../pipe:[n], which cannot be opened) and a key no other
    read shares, since it can be read once and another pipe may take the same name."""
    if not path.is_file():
        return str(path), -float(next(_PIPE_READS))
    resolved = path.resolve()
    return str(resolved), resolved.stat().st_mtime


_PIPE_READS = itertools.count(1)


def load_spec_file(path: Path) -> Any:
    """Parse a YAML spec file strictly (a thin wrapper kept for the CLI's ``check``)."""
    return load_yaml_file(path)


# The top-level keys that mark each kind of spec file (a Hugging Face config.json is a model too).
_KIND_MARKS: tuple[tuple[str, frozenset[str]], ...] = (
    ("calibration", frozenset({"compute", "collectives"})),
    ("device", frozenset()),  # any peak_tflops* key
    ("cluster", frozenset({"gpus_per_node"})),
    ("model", frozenset({"layers", "hidden", "heads", "num_hidden_layers", "hidden_size"})),
    ("plan", frozenset({"global_batch", "tp", "pp", "dp"})),
)
# Where a file of each kind is given, for the fix of a file passed in the wrong place.
_KIND_PLACE = {
    "model": "--model",
    "cluster": "--cluster",
    "plan": "--plan",
    "device": "a cluster file's device: key",
    "calibration": "a cluster file's calibration: key",
}


def kinds_by_keys(data: Any) -> list[str]:
    """The kinds of spec file (calibration, device, cluster, model, plan) whose marking keys ``data`` has."""
    if not isinstance(data, dict):
        return []
    keys = {k for k in data if isinstance(k, str)}
    return [
        kind
        for kind, marks in _KIND_MARKS
        if (keys & marks if marks else any(k.startswith("peak_tflops") for k in keys))
    ]


def _read_as(kind: str, path: Path) -> Any:
    """The parsed file at ``path``, refused where its keys mark it as another kind of spec file (a model file
    given as ``--cluster`` would otherwise fail on "device: is required", which does not say what is wrong)."""
    data = load_yaml_file(path)
    fits = kinds_by_keys(data)
    if fits and kind not in fits:
        marks = sorted(k for k in data if isinstance(k, str) and kinds_by_keys({k: None}) == fits[:1])[:3]
        raise SpecError(
            str(path),
            f"is a {fits[0]} file (it has {', '.join(marks)}), not a {kind} file",
            f"give a {kind} here; a {fits[0]} file goes to {_KIND_PLACE[fits[0]]}",
        )
    return data


@lru_cache(maxsize=256)
def _model_cached(path_str: str, _mtime: float) -> ModelSpec:
    path = Path(path_str)
    if path.suffix.lower() == ".json":
        return load_hf_config(path)
    return ModelSpec.from_mapping(_read_as("model", path), str(path))


def load_model(ref: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """A model by built-in name, YAML path or Hugging Face ``config.json`` path.

    ``overrides`` maps top-level keys of the model file (``layers``, ``moe.top_k``...) to new values.
    """
    model = _model_cached(*_stamp(find_file("model", ref)))
    if not overrides:
        return model
    data = apply_overrides(model.to_mapping(), overrides, "model")
    return ModelSpec.from_mapping(data, f"model {model.name} (with --set model.* overrides)")


@lru_cache(maxsize=256)
def _device_cached(path_str: str, _mtime: float) -> DeviceSpec:
    path = Path(path_str)
    return DeviceSpec.from_mapping(_read_as("device", path), str(path))


def load_device(ref: str | Path) -> DeviceSpec:
    """A device by built-in name or path."""
    return _device_cached(*_stamp(find_file("device", ref)))


@lru_cache(maxsize=256)
def _calibration_cached(path_str: str, _mtime: float) -> CalibrationTable:
    path = Path(path_str)
    return CalibrationTable.from_mapping(_read_as("calibration", path), str(path))


def load_calibration(ref: str | Path) -> CalibrationTable:
    """A calibration table by built-in name or path."""
    return _calibration_cached(*_stamp(find_file("calibration", ref)))


def _resolve_ref(kind: str, ref: str, base: Path, where: str) -> Path:
    """A reference inside a file: relative paths are relative to that file."""
    if _looks_like_path(ref):
        candidate = (base.parent / ref) if not Path(ref).is_absolute() else Path(ref)
        if not candidate.is_file():
            raise SpecError(where, f"names {ref!r}, which is not a file", "fix the path")
        return candidate
    try:
        return find_file(kind, ref)
    except SpecError as err:
        raise SpecError(where, f"{err.where} {err.what}", err.fix) from None


_TABLE_KEYS = ("calibration", "fabric_calibration")


@lru_cache(maxsize=256)
def _cluster_cached(path_str: str, _mtime: float) -> ClusterSpec:
    path = Path(path_str)
    return _build_cluster(_read_as("cluster", path), path, str(path))


def _build_cluster(
    data: Any,
    path: Path,
    where: str,
    *,
    overridden: Mapping[str, Any] | None = None,
    device_overrides: Mapping[str, Any] | None = None,
    measured_nvlink: float | None = None,
) -> ClusterSpec:
    """A cluster from the parsed mapping of the file at ``path``, its device and tables resolved.

    ``overridden`` holds the keys ``--set cluster.*`` changed (their references are resolved like the file's, and
    errors name the option); ``device_overrides`` changes keys of the device, named or inline. A calibration
    table that does not record the NVLink rate its collectives were measured on takes ``measured_nvlink``: the
    rate the file states (the fabric it describes), not one a what-if set.
    """
    changed = overridden or {}

    def origin(key: str) -> str:
        return f"--set cluster.{key}={changed[key]}" if key in changed else f"{path}: {key}"

    def resolve(kind: str, key: str, ref: str) -> Path:
        if key not in changed:
            return _resolve_ref(kind, ref, path, origin(key))
        try:  # given on the command line: a path is relative to the working directory, as --cluster's is
            return find_file(kind, ref)
        except SpecError as err:
            raise SpecError(origin(key), f"{err.where} {err.what}", err.fix) from None

    device: DeviceSpec | None = None
    tables: dict[str, CalibrationTable | None] = dict.fromkeys(_TABLE_KEYS)
    if isinstance(data, dict):
        raw_device = data.get("device")
        if isinstance(raw_device, str):
            dev_path = resolve("device", "device", raw_device)
            device = _device_cached(*_stamp(dev_path))
            if device_overrides:
                changed_device = apply_overrides(load_yaml_file(dev_path), device_overrides, "device")
                device = DeviceSpec.from_mapping(changed_device, f"{device.name} (with --set device.* overrides)")
        elif isinstance(raw_device, dict):
            if device_overrides:  # an inline device: the overrides change the mapping the cluster file holds
                data = {**data, "device": apply_overrides(raw_device, device_overrides, "device")}
        elif device_overrides:
            raise SpecError(
                f"--set device.{next(iter(device_overrides))}",
                f"cannot change the device: {origin('device')} names none",
                "give the cluster a device (a built-in name, a path or an inline mapping)",
            )
        for key in tables:
            raw_cal = data.get(key)
            if isinstance(raw_cal, str):
                cal_path = resolve("calibration", key, raw_cal)
                tables[key] = _calibration_cached(*_stamp(cal_path))
            elif raw_cal is not None:
                raise SpecError(origin(key), "must name a calibration table", "write its name or path")
    # A table measured on a sibling part (A100 40 GB vs 80 GB: the same SMs and clocks) may be shared;
    # results name the table and its device, so the transfer is visible.
    spec = ClusterSpec.from_mapping(data, where, device=device)
    # Each table's NVLink-domain curves are scaled by this cluster's NVLink rate over the rate of the fabric they
    # were measured on: the table's own record, else the file's (a fabric_calibration is named because that
    # fabric is identical; a calibration was measured on the node the file describes).
    reference = spec.nvlink_bandwidth_bytes_per_s if measured_nvlink is None else measured_nvlink
    own, fabric = tables["calibration"], tables["fabric_calibration"]
    return replace(
        spec,
        calibration=own.measured_on(reference) if own is not None else None,
        fabric_calibration=fabric.measured_on(reference) if fabric is not None else None,
    )


def load_cluster(
    ref: str | Path,
    overrides: Mapping[str, Any] | None = None,
    device_overrides: Mapping[str, Any] | None = None,
) -> ClusterSpec:
    """A cluster by built-in name or path, with its device and calibration table resolved.

    ``overrides`` and ``device_overrides`` change keys of the cluster file and of its device (a named device
    file or an inline mapping) before the specs are built: the what-if questions (``--set
    cluster.nics_per_node=4``, ``--set cluster.device=B200``, ``--set device.hbm_gib=96``). A changed
    ``device``, ``calibration`` or ``fabric_calibration`` is resolved as the file's own would be.
    """
    path = find_file("cluster", ref)
    cluster = _cluster_cached(*_stamp(path))
    if not overrides and not device_overrides:
        return cluster
    data = apply_overrides(load_yaml_file(path), overrides or {}, "cluster")
    scopes = [f"{scope}.*" for scope, given in (("cluster", overrides), ("device", device_overrides)) if given]
    return _build_cluster(
        data,
        path,
        f"{path} (with --set {' and '.join(scopes)} overrides)",
        overridden={k: v for k, v in (overrides or {}).items() if "." not in k},
        device_overrides=device_overrides,
        # The curves of a table that does not record its fabric were measured on the one the file describes.
        measured_nvlink=cluster.nvlink_bandwidth_bytes_per_s,
    )


def is_plain(value: Any) -> bool:
    """Whether a parsed --set value is made of JSON's types only (text, numbers, booleans, null, lists, mappings)."""
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


def parse_overrides(settings: list[str] | tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Split ``scope.key=value`` strings (``--set``) by scope: model, cluster, device or plan.

    Values are read as YAML scalars, so ``4`` is a number and ``true`` a boolean.

    >>> parse_overrides(["cluster.nics_per_node=4", "device.hbm_bandwidth_gb_per_s=4800"])
    {'cluster': {'nics_per_node': 4}, 'device': {'hbm_bandwidth_gb_per_s': 4800}}
    """
    out: dict[str, dict[str, Any]] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        scope, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise SpecError(f"--set {item}", "must look like scope.key=value", "e.g. --set cluster.nics_per_node=4")
        if scope not in ("model", "cluster", "device", "plan"):
            hint = did_you_mean(scope, ("model", "cluster", "device", "plan"))
            raise SpecError(f"--set {item}", f"unknown scope {scope!r}{hint}", "use model., cluster., device. or plan.")
        try:
            parsed = load_yaml_text(value, f"--set {key.strip()}") if value.strip() else None
        except SpecError as err:
            if "not valid YAML" not in err.what:
                raise  # a value no tag can build, or nested too deeply: said as such, not passed on as text
            parsed = value  # not YAML syntax: the text itself, which the spec then judges
        if not is_plain(parsed):
            # A YAML date (2001-01-01) or !!binary value: no spec key takes one, and echoed into a what-if's JSON
            # or trace it could not be written; the text itself, which the spec then judges.
            parsed = value.strip()
        given = out.setdefault(scope, {})
        if name in given and given[name] != parsed:
            # The last one used to win silently, unlike a flag and a --set that disagree.
            raise SpecError(
                f"--set {key.strip()}",
                f"is given twice, as {given[name]!r} and {parsed!r}",
                "give each key once",
            )
        given[name] = parsed
    return out


def apply_overrides(data: Any, overrides: Mapping[str, Any], scope: str) -> dict[str, Any]:
    """A copy of ``data`` with dotted keys replaced; unknown top-level keys are refused by the spec later."""
    if not isinstance(data, dict):
        raise SpecError(scope, "cannot apply --set overrides to a file that is not a mapping", "fix the file")
    if not isinstance(overrides, Mapping):
        raise SpecError(
            f"{scope} overrides",
            f"must be a mapping of keys to values, got {type(overrides).__name__}",
            "pass a dict such as {'nics_per_node': 4}",
        )
    out: dict[str, Any] = copy.deepcopy(data)
    for dotted, value in overrides.items():
        if not isinstance(dotted, str):
            raise SpecError(f"{scope} overrides", f"keys must be text, got {dotted!r}", "name a key of the file")
        parts = dotted.split(".")
        target = out
        for part in parts[:-1]:
            nxt = target.get(part)
            if not isinstance(nxt, dict):
                raise SpecError(f"--set {scope}.{dotted}", f"{part!r} is not a mapping in the {scope}", "check the key")
            target = nxt
        target[parts[-1]] = value
    return out


def load_plan(path: str | Path, *, gpus: int | None = None) -> PlanSpec:
    """A plan from a YAML file."""
    p = Path(path)
    if p.is_dir():
        raise SpecError(str(p), "is a directory, not a file", "name the plan YAML file")
    if not p.is_file():
        raise SpecError(str(p), "file not found", "check the path of the plan file")
    return PlanSpec.from_mapping(_read_as("plan", p), str(p), gpus=gpus)
