"""pyproject.toml's package list matches the source tree (it is listed, not discovered, so that
the recipe configs in recipes/configs install as hf_flash.recipes.configs), no top-level
`recipes` package goes into the wheel, and every console command points at a callable."""

import importlib
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_packages_list_matches_the_tree():
    setuptools = PYPROJECT["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "hf_flash").rglob("__init__.py")}
    data_only = {"hf_flash.recipes.configs", "hf_flash.eval.corpus"}
    assert listed == on_disk | data_only
    assert not any(p == "recipes" or p.startswith("recipes.") for p in listed)
    assert setuptools["package-dir"]["hf_flash.recipes.configs"] == "recipes/configs"
    assert list((REPO / "recipes" / "configs").glob("*.yaml"))
    assert (REPO / "hf_flash" / "eval" / "corpus" / "README.md").is_file()
    assert (REPO / "hf_flash" / "py.typed").is_file()


def test_console_scripts_resolve():
    scripts = PYPROJECT["project"]["scripts"]
    assert set(scripts) == {"hf-flash-demo", "hf-flash-finetune", "hf-flash-eval", "hf-flash-study"}
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_license_and_metadata():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert {"peft>=0.17", "accelerate>=1.10", "pyyaml"} <= set(project["optional-dependencies"]["test"])
