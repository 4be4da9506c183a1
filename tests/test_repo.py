"""Repository hygiene: dependencies in step, notebooks clean and in sync with their sources."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))
LEARNER = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "notebooks" / "solutions").glob("*.ipynb"))
NOTEBOOKS = LEARNER + SOLUTIONS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower()


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _expand(extra: str) -> set[str]:
    """The requirements of ``extra``, with the ``kvlab[...]`` extras it names spelled out."""
    reqs = set()
    for req in _extras()[extra]:
        m = re.fullmatch(r"kvlab\[([\w,\s-]+)\]", req.strip())
        if m:
            for name in m.group(1).split(","):
                reqs |= _expand(name.strip())
        else:
            reqs.add(req.replace(" ", ""))
    return reqs


def _pyproject_requirements() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {r.replace(" ", "") for r in meta["dependencies"]} | _expand("dev")


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


def test_the_dev_extra_names_every_other_extra_and_copies_none():
    """``dev = ["kvlab[lab,hf,test,site]"]``: one line that cannot drift from the extras."""
    extras = _extras()
    (dev,) = extras["dev"]
    m = re.fullmatch(r"kvlab\[([\w,\s-]+)\]", dev)
    assert m, f"dev should be one 'kvlab[...]' requirement naming the other extras, got {dev!r}"
    assert sorted(n.strip() for n in m.group(1).split(",")) == sorted(set(extras) - {"dev"})
    for name in set(extras) - {"dev"}:
        assert _expand(name) <= _expand("dev"), f"extra {name!r} has requirements missing from dev"


def test_the_oldest_tested_triton_is_the_declared_floor():
    from kvlab.base.triton_compat import OLDEST_TRITON

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (triton_req,) = [r for r in meta["dependencies"] if _name(r) == "triton"]
    floor = ".".join(map(str, OLDEST_TRITON[:2]))
    assert triton_req == f"triton>={floor}"
    assert f"TRITON_OLDEST ?= triton=={'.'.join(map(str, OLDEST_TRITON))}" in (
        ROOT / "Makefile").read_text()


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT / "notebooks"))


def _builder():
    sys.path.insert(0, str(ROOT / "tools"))
    import build_notebooks

    return build_notebooks


def test_every_source_has_both_builds_and_nothing_else():
    stems = [p.stem for p in SOURCES]
    assert stems, "no chapter sources in notebooks/src/"
    assert [p.stem for p in LEARNER] == stems
    assert [p.stem for p in SOLUTIONS] == stems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{_id(path)} cell {i} has stored outputs"
            assert cell.execution_count is None, f"{_id(path)} cell {i} has an execution count"


@pytest.mark.parametrize("which", ["learner", "solutions"])
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_notebook_matches_its_source(src, which):
    b = _builder()
    built, path = b.build(src, which), b.target(src, which)
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: run `make notebooks`"
    stored = nbformat.read(path, as_version=4)
    assert [(c.cell_type, c.source) for c in stored.cells] == [
        (c.cell_type, c.source) for c in built.cells], (
        f"{path.relative_to(ROOT)} is out of date with {src.relative_to(ROOT)}: run `make notebooks`")


@pytest.mark.parametrize("path", LEARNER, ids=_id)
def test_a_learner_notebook_holds_no_answer_region(path):
    b = _builder()
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        assert not b.has_markers(cell.source), f"{_id(path)} cell {i} holds an answer-region marker"
        assert "solution" not in cell.get("metadata", {}).get("tags", []), (
            f"{_id(path)} cell {i} is a solutions-only cell")


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_every_answer_region_has_a_starter_beside_it(src):
    """A learner must find something to fill in where an answer was taken out."""
    import jupytext

    b = _builder()
    for i, cell in enumerate(jupytext.reads(src.read_text(), fmt="py:percent").cells):
        if "### BEGIN SOLUTION" in cell.source:
            starter = b.split_regions(cell.source, "learner")
            assert "YOUR CODE HERE" in starter, (
                f"{src.name} cell {i + 1}: an answer region without a starter "
                "('# YOUR CODE HERE: <exercise>' in a '### BEGIN STARTER' block)")


def test_marker_mistakes_are_named():
    b = _builder()
    with pytest.raises(b.MarkerError, match="line 1: '### BEGIN SOLUTION' is never closed"):
        b.split_regions("### BEGIN SOLUTION\nx = 1", "learner", "s.py cell 3")
    with pytest.raises(b.MarkerError, match="without a matching"):
        b.split_regions("x = 1\n### END STARTER", "solutions")
    with pytest.raises(b.MarkerError, match="inside an open SOLUTION region"):
        b.split_regions("### BEGIN SOLUTION\n### BEGIN STARTER", "learner")


def test_the_two_builds_of_one_cell():
    b = _builder()
    src = ("def f(x):\n    \"\"\"Double x.\"\"\"\n    ### BEGIN SOLUTION\n    return 2 * x\n"
           "    ### END SOLUTION\n    ### BEGIN STARTER\n    # YOUR CODE HERE: f\n"
           "    raise NotImplementedError\n    ### END STARTER\n\nprint(f(2))")
    assert b.split_regions(src, "solutions") == (
        'def f(x):\n    """Double x."""\n    return 2 * x\n\nprint(f(2))')
    assert b.split_regions(src, "learner") == (
        'def f(x):\n    """Double x."""\n    # YOUR CODE HERE: f\n    raise NotImplementedError\n'
        "\nprint(f(2))")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_notebook_opens_with_its_colab_badge_and_the_setup_cell(path):
    from kvlab.course.colab import SETUP_CELL, colab_url

    nb = nbformat.read(path, as_version=4)
    badge = nb.cells[0]
    assert badge.cell_type == "markdown" and "[Open in Colab](" in badge.source
    assert f"({colab_url(path.relative_to(ROOT).as_posix())})" in badge.source, (
        "the link must open this very notebook in Colab")
    # no picture from another site: without internet JupyterLab would show a broken image
    assert "![" not in badge.source and "<img" not in badge.source
    assert nb.cells[1].cell_type == "code" and nb.cells[1].source == SETUP_CELL


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_notebook_ends_by_checking_its_chapters_exercises_again(path):
    from kvlab.course.check.review import chapters, closing_cells

    nb = nbformat.read(path, as_version=4)
    chapter = path.name[:2]
    if chapter not in chapters():  # no exercise to check again
        assert "kvlab.check.recheck" not in nb.cells[-1].source
        return
    text, code = closing_cells(chapter)
    assert [nb.cells[-2].source, nb.cells[-1].source] == [text, code]
    assert nb.cells[-1].cell_type == "code"


def test_setup_cell_is_harmless_locally(capsys):
    from kvlab.course.colab import SETUP_CELL

    exec(compile(SETUP_CELL, "<setup cell>", "exec"), {})  # not in Colab: no clone, no install
    out = capsys.readouterr().out
    assert "kvlab runtime:" in out


def test_repository_url_is_set_in_one_place():
    from kvlab.course.colab import REPO_URL, SETUP_CELL

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["urls"]["Repository"] == REPO_URL
    assert REPO_URL in SETUP_CELL
    assert meta["urls"]["Issues"] == f"{REPO_URL}/issues"


def _contributing_map() -> dict[str, str]:
    """CONTRIBUTING's one-screen map: ``kvlab/...`` path -> what it says the folder is."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## The package, one screen", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(kvlab/[^`]*)` \| ([^|]+) \|", section, re.M)}


def test_contributing_maps_every_folder_and_top_level_module_of_the_package():
    listed = set(_contributing_map())
    package = ROOT / "kvlab"
    folders = {f"{p.parent.relative_to(ROOT).as_posix()}/" for p in package.rglob("__init__.py")
               if p.parent != package and "__pycache__" not in p.parts}
    top = {f"kvlab/{p.name}" for p in package.glob("*.py")}
    assert listed == folders | top, (f"missing from CONTRIBUTING's map: {sorted(folders | top - listed)}; "
                                     f"not in the tree: {sorted(listed - folders - top)}")


def test_each_subsystem_says_what_it_is_which_chapter_builds_it_and_what_it_exports():
    for init in sorted((ROOT / "kvlab").glob("**/__init__.py")):
        doc = init.read_text().split('"""')[1] if '"""' in init.read_text() else ""
        assert len(doc.strip().splitlines()) >= 3, f"{init.relative_to(ROOT)} says too little about itself"
        assert re.search(r"chapter|\(\d\d", doc, re.I), f"{init.relative_to(ROOT)} names no chapter"
