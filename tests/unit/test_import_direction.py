"""One direction of imports: errors/units <- specs <- graph <- parallel <- cost <- engine <- run <- sweep/search/report
<- cli.

Parses every module of the package and fails on a back-edge (a lower layer importing a higher one), and
checks that only the engine imports simpy and that the core never imports torch, dask or matplotlib at
module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "simulator"

LAYERS = {
    "errors": 0,
    "units": 0,
    "specs": 1,
    "graph": 2,
    "parallel": 3,
    "cost": 4,
    "engine": 5,
    "run": 6,
    "validate": 7,
    "sweep": 7,
    "search": 7,
    "calibration": 7,
    "report": 7,
    "cli": 8,
    "__main__": 9,
    "__init__": 9,
}


def _layer(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "simulator" or len(parts) == 1:
        return 9
    return LAYERS.get(parts[1], 9)


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        out.append((name.removesuffix(".__init__"), path))
    return out


def _imports(path: Path, *, top_level_only: bool = False) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_no_back_edges(module: str, path: Path) -> None:
    own = _layer(module)
    if module.rsplit(".", maxsplit=1)[-1] in ("__init__",) or module == "simulator":
        return
    for imported in _imports(path):
        if imported.startswith("simulator."):
            assert _layer(imported) <= own, f"{module} (layer {own}) imports {imported} (layer {_layer(imported)})"


def test_only_the_engine_imports_simpy() -> None:
    for module, path in _modules():
        if any(i == "simpy" or i.startswith("simpy.") for i in _imports(path)):
            assert module.startswith("simulator.engine"), module


def test_core_has_no_heavy_top_level_imports() -> None:
    for module, path in _modules():
        for imported in _imports(path, top_level_only=True):
            assert imported.split(".")[0] not in ("torch", "dask", "distributed", "matplotlib"), (module, imported)


def test_simulator_and_cli_do_not_load_torch() -> None:
    """torch is an optional extra: only the calibration commands that time real kernels import it, lazily."""
    import subprocess
    import sys

    code = (
        "import sys, simulator, simulator.run, simulator.cli, simulator.calibration.cli, "
        "simulator.calibration.profile, simulator.calibration.check, simulator.calibration.workflow; "
        "sys.exit('torch' in sys.modules)"
    )
    env_path = str(PACKAGE.parent)
    result = subprocess.run([sys.executable, "-c", code], cwd=env_path, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr or "torch was imported"


def test_engine_does_not_import_calibration() -> None:
    for module, path in _modules():
        if module.startswith("simulator.engine"):
            assert not any(i.startswith("simulator.calibration") for i in _imports(path)), module
