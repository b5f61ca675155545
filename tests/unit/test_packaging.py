"""Issue 2, "a non-editable install finds the built-in models": the wheel carries models/ and
hardware_profiles/ as ``simulator/_data/``, and the library looks there first."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from simulator.specs import library

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_includes_the_library_under_the_package() -> None:
    """Issue 2: pyproject force-includes models/ and hardware_profiles/ as simulator/_data/... in the wheel."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert include == {
        "models": "simulator/_data/models",
        "hardware_profiles": "simulator/_data/hardware_profiles",
        "data/validation/software_stacks.yaml": "simulator/_data/data/validation/software_stacks.yaml",
    }


def test_installed_layout_is_found_without_the_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 2: with the package installed elsewhere (site-packages/simulator/_data/..., no repository next to
    it), built-in names resolve to the copies inside the package."""
    site = tmp_path / "site-packages"
    package = site / "simulator"
    shutil.copytree(ROOT / "models", package / "_data" / "models")
    shutil.copytree(ROOT / "hardware_profiles", package / "_data" / "hardware_profiles")
    monkeypatch.setattr(library, "_PACKAGE", package)
    monkeypatch.delenv("CLUSTERSIM_PATH", raising=False)
    assert library.data_roots() == (package / "_data",)
    assert library.find_file("model", "gpt3-175b") == package / "_data" / "models" / "gpt3-175b.yaml"
    assert library.find_file("cluster", "dgx-h100").is_relative_to(package / "_data")
    assert len(library.list_names("model")) == len(list((ROOT / "models").glob("*.yaml")))


def test_clustersim_path_is_searched_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 2: a folder in CLUSTERSIM_PATH overrides a built-in file of the same name."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "gpt3-175b.yaml").write_text(
        "name: gpt3-175b\nlayers: 2\nhidden: 64\nheads: 4\nffn_hidden: 256\nvocab: 100\n"
    )
    monkeypatch.setenv("CLUSTERSIM_PATH", str(tmp_path))
    assert library.data_roots()[0] == tmp_path
    assert library.load_model("gpt3-175b").layers == 2


def test_an_installed_validate_applies_the_shipped_software_stacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 4: a wheel install (site-packages/simulator/_data/data/validation/software_stacks.yaml, no repository)
    applies the shipped stacks to a CSV that has none beside it; before, it looked outside the package, found nothing
    and validated the published runs as stated, silently (median 12% instead of 6%). The report says which file it
    used. Another package's site-packages/data/validation/ is not ours."""
    from simulator import validate

    site = tmp_path / "site-packages"
    package = site / "simulator"
    shipped = package / "_data" / "data" / "validation" / "software_stacks.yaml"
    shipped.parent.mkdir(parents=True)
    shutil.copy(ROOT / "data" / "validation" / "software_stacks.yaml", shipped)
    shutil.copytree(ROOT / "models", package / "_data" / "models")
    (site / "data" / "validation").mkdir(parents=True)
    (site / "data" / "validation" / "software_stacks.yaml").write_text("stacks: []\n")  # someone else's
    monkeypatch.setattr(library, "_PACKAGE", package)
    monkeypatch.delenv("CLUSTERSIM_PATH", raising=False)
    csv = tmp_path / "elsewhere" / "runs.csv"
    csv.parent.mkdir()
    assert validate.default_stacks_file(csv) == shipped
    (csv.parent / "software_stacks.yaml").write_text("stacks: []\n")
    assert validate.default_stacks_file(csv) == csv.parent / "software_stacks.yaml"  # the CSV's own comes first


def test_the_shipped_stacks_file_is_named_without_the_install_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """validate printed the shipped stacks file's absolute path, so the same CSV gave other bytes from another
    checkout or install (found by a determinism review); a file next to the CSV or given is named as found."""
    from simulator.cli import main

    monkeypatch.delenv("CLUSTERSIM_PATH", raising=False)
    csv = tmp_path / "runs.csv"
    csv.write_text((ROOT / "data" / "validation" / "published_runs.csv").read_text())
    assert main(["validate", str(csv), "--format", "json"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["summary"]["stacks_file"]
        == "clustersim's data/validation/software_stacks.yaml"
    )
    shutil.copy(ROOT / "data" / "validation" / "software_stacks.yaml", tmp_path / "software_stacks.yaml")
    assert main(["validate", str(csv), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["stacks_file"] == str(tmp_path / "software_stacks.yaml")


def test_another_packages_top_level_folders_are_not_built_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In site-packages the package's parent is shared with every other package: a top-level models/ folder there
    (someone else's) is not clustersim's library. Only a source checkout (its pyproject.toml) is searched."""
    site = tmp_path / "site-packages"
    (site / "models").mkdir(parents=True)
    (site / "models" / "not-ours.yaml").write_text("name: not-ours\n")
    package = site / "simulator"
    shutil.copytree(ROOT / "models", package / "_data" / "models")
    monkeypatch.setattr(library, "_PACKAGE", package)
    monkeypatch.delenv("CLUSTERSIM_PATH", raising=False)
    assert library.data_roots() == (package / "_data",)
    assert "not-ours" not in {name for name, _ in library.list_names("model")}
    (site / "pyproject.toml").write_text("[project]\nname = 'clustersim'\n")  # a source checkout: searched
    assert library.data_roots() == (package / "_data", site)
