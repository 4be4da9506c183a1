"""Repository hygiene: dependencies in step, notebooks clean and in sync with their sources."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower()


def _pyproject_requirements() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"]) + list(meta["optional-dependencies"]["dev"])
    return {r.replace(" ", "") for r in reqs}


def _environment_requirements() -> set[str]:
    reqs, in_pip = set(), False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        s = line.strip()
        if s.startswith("- pip:"):
            in_pip = True
        elif in_pip and s.startswith("- "):
            reqs.add(s[2:].replace(" ", ""))
    return reqs


def test_environment_yml_matches_pyproject():
    assert _environment_requirements() == _pyproject_requirements()


def test_pyproject_names_the_course_dependencies():
    names = {_name(r) for r in _pyproject_requirements()}
    for needed in ["torch", "triton", "jupyterlab", "matplotlib", "ipywidgets", "nbval",
                   "pytest", "hypothesis", "jupytext"]:
        assert needed in names


def test_the_package_requires_only_what_import_kvlab_needs():
    """Colab has torch, triton, numpy, matplotlib and ipywidgets: installing the course there
    must not pull a second Jupyter stack or test tools (they are extras)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {_name(r) for r in meta["dependencies"]} == {
        "torch", "triton", "numpy", "matplotlib", "ipywidgets"}


def test_the_dev_extra_holds_every_other_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = set(extras["dev"])
    for name, reqs in extras.items():
        assert set(reqs) <= dev, f"extra {name!r} has requirements missing from dev"


def test_the_oldest_tested_triton_is_the_declared_floor():
    from kvlab.triton_compat import OLDEST_TRITON

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (triton_req,) = [r for r in meta["dependencies"] if _name(r) == "triton"]
    floor = ".".join(map(str, OLDEST_TRITON[:2]))
    assert triton_req == f"triton>={floor}"
    assert f"TRITON_OLDEST ?= triton=={'.'.join(map(str, OLDEST_TRITON))}" in (
        ROOT / "Makefile").read_text()


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has stored outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_matches_its_source(path):
    sys.path.insert(0, str(ROOT / "tools"))
    from py2nb import convert

    src = ROOT / "notebooks" / "src" / (path.stem + ".py")
    assert src.exists(), f"{path.name} has no source {src.relative_to(ROOT)}"
    built = convert(src.read_text())
    stored = nbformat.read(path, as_version=4)
    assert [c.source for c in stored.cells] == [c.source for c in built.cells], (
        f"{path.name} is out of date: run `make notebooks`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_opens_with_the_setup_cell(path):
    from kvlab.colab import SETUP_CELL

    nb = nbformat.read(path, as_version=4)
    assert nb.cells[0].cell_type == "code" and nb.cells[0].source == SETUP_CELL


def test_setup_cell_is_harmless_locally(capsys):
    from kvlab.colab import SETUP_CELL

    exec(compile(SETUP_CELL, "<setup cell>", "exec"), {})  # not in Colab: no clone, no install
    out = capsys.readouterr().out
    assert "kvlab runtime:" in out


def test_repository_url_is_set_in_one_place():
    from kvlab.colab import REPO_URL, SETUP_CELL

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["urls"]["Repository"] == REPO_URL
    assert REPO_URL in SETUP_CELL
