"""Build the two notebooks of every chapter from its percent-format source.

    python tools/build_notebooks.py            # every notebooks/src/NN_*.py
    python tools/build_notebooks.py --check    # exit 1 if a stored notebook is stale

One source, ``notebooks/src/NN_name.py`` (jupytext's percent format: ``# %%`` starts a code
cell, ``# %% [markdown]`` a markdown cell), gives two notebooks, both opening with an
"Open in Colab" text link for that notebook (:func:`kvlab.course.colab.colab_link`) and the setup cell
(:data:`kvlab.course.colab.SETUP_CELL`), ending (when chapter NN has a registered exercise) with a
cell that checks the chapter's exercises again (:func:`kvlab.course.check.review.closing_cells`), and
stored without outputs:

* ``notebooks/NN_name.ipynb``, the **learner's**: every answer region is replaced by its
  starter, so the exercise cells hold a signature, a docstring and what to fill in;
* ``notebooks/solutions/NN_name.ipynb``: the same chapter with the answers in.

Marking answers in a source (the convention of nbgrader, with the starter given beside it)::

    def my_page_to_token(page_starts, page_size):
        \"\"\"Every slot of the pages ...\"\"\"
        ### BEGIN SOLUTION
        ...                                  # only in the solutions build
        ### END SOLUTION
        ### BEGIN STARTER
        # YOUR CODE HERE: page_to_token      # only in the learner build
        raise NotImplementedError("...")
        ### END STARTER

Marker lines may be indented; they are dropped from both builds. Whole cells can belong to
one build: a cell tagged ``solution`` (``# %% [markdown] tags=["solution"]``, e.g. a
discussion of the chapter's open questions) appears only in the solutions build, a cell
tagged ``learner`` only in the learner build.

Relative links in the sources are written from ``notebooks/`` (``[page](glossary.md#page)``).
The solutions build lives one folder down, so there a link to anything but a chapter notebook
(``NN_name.ipynb``, which both folders have) gets ``../`` in front.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvlab.course.check.review import chapters, closing_cells  # noqa: E402
from kvlab.course.colab import SETUP_CELL, colab_link  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
from notebook_kernel import KERNELSPEC  # noqa: E402

SRC = ROOT / "notebooks" / "src"
LEARNER_DIR = ROOT / "notebooks"
SOLUTIONS_DIR = ROOT / "notebooks" / "solutions"

MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN STARTER", "END STARTER")
#: a Markdown link's target: not a URL, not absolute, not a bare #anchor
_CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)
_RELATIVE_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|/|#)([^)\s]+)\)")
_MARKER = re.compile(r"^\s*### (BEGIN SOLUTION|END SOLUTION|BEGIN STARTER|END STARTER)\s*$")
BUILDS = ("learner", "solutions")


class MarkerError(ValueError):
    """An answer region that does not open and close properly (names the file, cell and line)."""


def split_regions(source: str, build: str, where: str = "") -> str:
    """The cell's source for ``build``: answers kept (solutions) or replaced by starters (learner)."""
    keep_in = {"learner": {None, "STARTER"}, "solutions": {None, "SOLUTION"}}[build]
    out, region, opened_at = [], None, 0
    for lineno, line in enumerate(source.splitlines(), 1):
        m = _MARKER.match(line)
        if not m:
            if region in keep_in:
                out.append(line)
            continue
        verb, kind = m.group(1).split()
        if verb == "BEGIN":
            if region is not None:
                raise MarkerError(f"{where} line {lineno}: '### BEGIN {kind}' inside an open "
                                  f"{region} region (opened at line {opened_at})")
            region, opened_at = kind, lineno
        else:
            if region != kind:
                raise MarkerError(f"{where} line {lineno}: '### END {kind}' without a matching "
                                  f"'### BEGIN {kind}'")
            region = None
    if region is not None:
        raise MarkerError(f"{where} line {opened_at}: '### BEGIN {region}' is never closed")
    return "\n".join(out)


def rebase_links(source: str) -> str:
    """The Markdown of a solutions notebook: relative links (other than to a chapter
    notebook, which ``notebooks/solutions/`` has too) point one folder up."""
    def rebase(m: re.Match) -> str:
        target = m.group(1)
        if target.split("#")[0].endswith(".ipynb"):
            return m.group(0)
        return f"](../{target})"

    parts = _CODE.split(source)  # code (``kernel[grid](args)``) is left alone: odd parts
    return "".join(p if i % 2 else _RELATIVE_LINK.sub(rebase, p) for i, p in enumerate(parts))


def has_markers(source: str) -> bool:
    return any(_MARKER.match(line) for line in source.splitlines())


def build(src_path: Path, which: str) -> nbformat.NotebookNode:
    """The ``which`` build (``"learner"`` or ``"solutions"``) of one chapter source."""
    if which not in BUILDS:
        raise ValueError(f"which must be one of {BUILDS}, got {which!r}")
    text = src_path.read_text()
    parsed = jupytext.reads(text, fmt="py:percent")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)  # the kernel `make lab` installs (notebook_kernel)
    nb.metadata["language_info"] = {"name": "python"}
    cells = [nbformat.v4.new_code_cell(SETUP_CELL)]
    skip_tag = "solution" if which == "learner" else "learner"
    for i, cell in enumerate(parsed.cells):
        tags = set(cell.metadata.get("tags", []))
        if skip_tag in tags:
            continue
        source = split_regions(cell.source, which, f"{src_path.name} cell {i + 1}")
        if cell.cell_type == "markdown":
            new = nbformat.v4.new_markdown_cell(rebase_links(source) if which == "solutions" else source)
        else:
            new = nbformat.v4.new_code_cell(source)
        if tags - {"solution", "learner"}:
            new.metadata["tags"] = sorted(tags - {"solution", "learner"})
        cells.append(new)
    if src_path.name[:2] in chapters():
        text, code = closing_cells(src_path.name[:2])
        cells += [nbformat.v4.new_markdown_cell(text), nbformat.v4.new_code_cell(code)]
    for i, c in enumerate(cells):
        c["id"] = f"cell-{i:03d}"
    nb.cells = [badge_cell(src_path, which)] + cells
    return nb


def badge_cell(src_path: Path, which: str) -> nbformat.NotebookNode:
    """The first cell: an "Open in Colab" link for this build of the chapter (text: it reads the
    same without internet, where Colab's badge picture would show broken)."""
    path = target(src_path, which).relative_to(ROOT).as_posix()
    cell = nbformat.v4.new_markdown_cell(colab_link(path))
    cell["id"] = "colab-badge"
    return cell


def target(src_path: Path, which: str) -> Path:
    folder = LEARNER_DIR if which == "learner" else SOLUTIONS_DIR
    return folder / (src_path.stem + ".ipynb")


def sources() -> list[Path]:
    return sorted(SRC.glob("[0-9][0-9]_*.py"))


def _same(a: nbformat.NotebookNode, b: nbformat.NotebookNode) -> bool:
    strip = lambda nb: ([(c.cell_type, c.source, dict(c.get("metadata", {}))) for c in nb.cells],  # noqa: E731
                        nb.metadata.get("kernelspec"))
    return strip(a) == strip(b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale notebooks")
    args = parser.parse_args(argv)
    stale = []
    SOLUTIONS_DIR.mkdir(exist_ok=True)
    for src in sources():
        for which in BUILDS:
            nb, path = build(src, which), target(src, which)
            if args.check:
                if not path.exists() or not _same(nb, nbformat.read(path, as_version=4)):
                    stale.append(path.relative_to(ROOT))
                continue
            nbformat.write(copy.deepcopy(nb), path)
            print(f"wrote {path.relative_to(ROOT)} ({len(nb.cells)} cells)")
    if stale:
        print("stale (run `make notebooks`):", ", ".join(map(str, stale)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
