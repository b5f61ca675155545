"""The shipped calibration tables are what the build makes of the shipped measurements, byte for byte."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_tables_and_residuals_are_what_build_tables_writes() -> None:
    """A hand edit to a table, or a fit change committed without rebuilding, shows up here (the tables carry a
    'do not edit by hand' header; this test is what enforces it)."""
    spec = importlib.util.spec_from_file_location("build_tables", ROOT / "analysis" / "calibration" / "build_tables.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    files = module.render()
    assert len(files) == 5  # a100, h100, default, h200 and RESIDUALS.md
    stale = [str(path.relative_to(ROOT)) for path, text in files.items() if path.read_text(encoding="utf-8") != text]
    assert not stale, f"rebuild with python analysis/calibration/build_tables.py: {stale}"
