"""The built-in library of models and hardware profiles, and loading specs by name or path.

Built-in files live in ``models/`` and ``hardware_profiles/{devices,clusters,calibration}/`` at the top of
the repository; a wheel carries them inside the package as ``simulator/_data/`` so a non-editable install
finds them too. A file's stem is its name (``models/gpt3-175b.yaml`` is ``gpt3-175b``), matched without
regard to case; directories listed in the ``CLUSTERSIM_PATH`` environment variable (``:``-separated, each
holding ``models/`` or ``hardware_profiles/``) are searched first. Anything that looks like a path is
read as a file: YAML, or a Hugging Face ``config.json`` for models. Loaded specs are cached per file, so
repeated lookups (sweeps) do no I/O.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from simulator.errors import SpecError
from simulator.specs._fields import did_you_mean
from simulator.specs._yaml import load_yaml_file
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


def data_roots() -> tuple[Path, ...]:
    """Directories searched for built-in data, first match wins."""
    roots: list[Path] = []
    for entry in os.environ.get("CLUSTERSIM_PATH", "").split(os.pathsep):
        if entry.strip():
            roots.append(Path(entry).expanduser())
    for candidate in (_PACKAGE / "_data", _PACKAGE.parent):
        if (candidate / "models").is_dir() or (candidate / "hardware_profiles").is_dir():
            roots.append(candidate)
    return tuple(roots)


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


def _looks_like_path(ref: str) -> bool:
    return ref.endswith((".yaml", ".yml", ".json")) or os.sep in ref or "/" in ref


def find_file(kind: str, ref: str | Path) -> Path:
    """The file that ``ref`` names: an existing path, or a built-in name of ``kind``."""
    text = str(ref)
    if isinstance(ref, Path) or _looks_like_path(text):
        path = Path(text).expanduser()
        if not path.is_file():
            raise SpecError(text, "file not found", f"check the path, or use a built-in {kind} name")
        return path
    names = list_names(kind)
    for name, path in names:
        if name.lower() == text.lower():
            return path
    known = [n for n, _ in names]
    hint = did_you_mean(text, known)
    listing = ", ".join(known) if len(known) <= 40 else ", ".join(known[:40]) + ", ..."
    raise SpecError(f"{kind} {text!r}", f"is not a built-in {kind}{hint}", f"use one of: {listing}; or a file path")


def _stamp(path: Path) -> tuple[str, float]:
    resolved = path.resolve()
    return str(resolved), resolved.stat().st_mtime


def load_spec_file(path: Path) -> Any:
    """Parse a YAML spec file strictly (a thin wrapper kept for the CLI's ``check``)."""
    return load_yaml_file(path)


@lru_cache(maxsize=256)
def _model_cached(path_str: str, _mtime: float) -> ModelSpec:
    path = Path(path_str)
    if path.suffix == ".json":
        return load_hf_config(path)
    return ModelSpec.from_mapping(load_yaml_file(path), str(path))


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
    return DeviceSpec.from_mapping(load_yaml_file(path), str(path))


def load_device(ref: str | Path) -> DeviceSpec:
    """A device by built-in name or path."""
    return _device_cached(*_stamp(find_file("device", ref)))


@lru_cache(maxsize=256)
def _calibration_cached(path_str: str, _mtime: float) -> CalibrationTable:
    path = Path(path_str)
    return CalibrationTable.from_mapping(load_yaml_file(path), str(path))


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


@lru_cache(maxsize=256)
def _cluster_cached(path_str: str, _mtime: float) -> ClusterSpec:
    path = Path(path_str)
    data = load_yaml_file(path)
    device: DeviceSpec | None = None
    tables: dict[str, CalibrationTable | None] = {"calibration": None, "fabric_calibration": None}
    if isinstance(data, dict):
        raw_device = data.get("device")
        if isinstance(raw_device, str):
            dev_path = _resolve_ref("device", raw_device, path, f"{path}: device")
            device = _device_cached(*_stamp(dev_path))
        for key in tables:
            raw_cal = data.get(key)
            if isinstance(raw_cal, str):
                cal_path = _resolve_ref("calibration", raw_cal, path, f"{path}: {key}")
                tables[key] = _calibration_cached(*_stamp(cal_path))
            elif raw_cal is not None:
                raise SpecError(f"{path}: {key}", "must name a calibration table", "write its name or path")
    # A table measured on a sibling part (A100 40 GB vs 80 GB: the same SMs and clocks) may be shared;
    # results name the table and its device, so the transfer is visible.
    spec = ClusterSpec.from_mapping(data, str(path), device=device, calibration=tables["calibration"])
    fabric = tables["fabric_calibration"]
    if fabric is not None:
        # Named because the fabric is the one the table was measured on: record its NVLink rate, so that a
        # what-if on this cluster's NVLink scales the curves.
        spec = replace(spec, fabric_calibration=fabric.measured_on(spec.nvlink_bandwidth_bytes_per_s))
    return spec


def load_cluster(
    ref: str | Path,
    overrides: Mapping[str, Any] | None = None,
    device_overrides: Mapping[str, Any] | None = None,
) -> ClusterSpec:
    """A cluster by built-in name or path, with its device and calibration table resolved.

    ``overrides`` and ``device_overrides`` change keys of the cluster file and of its device file before
    the specs are built: the what-if questions (``--set cluster.nics_per_node=4``).
    """
    path = find_file("cluster", ref)
    cluster = _cluster_cached(*_stamp(path))
    if not overrides and not device_overrides:
        return cluster
    device = cluster.device
    if device_overrides:
        raw_device = load_yaml_file(_device_path(path, cluster))
        data = apply_overrides(raw_device, device_overrides, "device")
        device = DeviceSpec.from_mapping(data, f"{device.name} (with --set device.* overrides)")
    raw = load_yaml_file(path)
    data = apply_overrides(raw, overrides or {}, "cluster")
    if isinstance(data.get("device"), dict) and not device_overrides:
        device = DeviceSpec.from_mapping(data["device"], f"{path}: device")
    # The cluster's measured collective curves were taken on the fabric the file describes; record it so that
    # an NVLink what-if scales them instead of leaving the answer unchanged.
    calibration = cluster.calibration
    if calibration is not None:
        calibration = calibration.measured_on(cluster.nvlink_bandwidth_bytes_per_s)
    return ClusterSpec.from_mapping(
        data,
        f"{path} (with --set cluster.* overrides)",
        device=device,
        calibration=calibration,
        fabric_calibration=cluster.fabric_calibration,
    )


def _device_path(cluster_path: Path, cluster: ClusterSpec) -> Path:
    raw = load_yaml_file(cluster_path)
    ref = raw.get("device") if isinstance(raw, dict) else None
    if isinstance(ref, str):
        return _resolve_ref("device", ref, cluster_path, f"{cluster_path}: device")
    return find_file("device", cluster.device.name)


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
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            parsed = value
        out.setdefault(scope, {})[name] = parsed
    return out


def apply_overrides(data: Any, overrides: Mapping[str, Any], scope: str) -> dict[str, Any]:
    """A copy of ``data`` with dotted keys replaced; unknown top-level keys are refused by the spec later."""
    if not isinstance(data, dict):
        raise SpecError(scope, "cannot apply --set overrides to a file that is not a mapping", "fix the file")
    out: dict[str, Any] = copy.deepcopy(data)
    for dotted, value in overrides.items():
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
    if not p.is_file():
        raise SpecError(str(p), "file not found", "check the path of the plan file")
    return PlanSpec.from_mapping(load_yaml_file(p), str(p), gpus=gpus)
