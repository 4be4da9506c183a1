"""Every line of code in the chapters fits the width a reader has on a laptop.

Measured in the browser (``tests/ui/test_site.py`` and ``tests/ui/test_lab_ui.py`` check that
these many characters still fit): the website at 1280 px shows 89 characters of code in a
box, JupyterLab at 1280 px with its file browser open (an 848 px editor) 107. So no line of
a code cell, nor of a code block in the prose, may be wider than :data:`MAX_CODE_COLUMNS`
(black's default too): then no code scrolls sideways on either. Every chapter source
``notebooks/src/NN_*.py`` is checked, and both built notebooks (whose first and last cells
come from the package: the setup cell, the closing checks).
"""
from __future__ import annotations

import re
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))
BUILT = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted(
    (ROOT / "notebooks" / "solutions").glob("[0-9][0-9]_*.ipynb"))
#: characters of code per line (the narrower of the two measured limits, rounded down)
MAX_CODE_COLUMNS = 88
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def too_wide(cells, limit: int = MAX_CODE_COLUMNS) -> list[str]:
    """``cell N, line M (W chars): text`` for each line of code wider than ``limit``: the
    lines of code cells, and of fenced code blocks in markdown cells."""
    found = []
    for n, cell in enumerate(cells):
        if cell.cell_type == "code":
            blocks = [cell.source]
        elif cell.cell_type == "markdown":
            blocks = _FENCE.findall(cell.source) + _indented_blocks(_FENCE.sub("", cell.source))
        else:
            continue
        for block in blocks:
            for m, line in enumerate(block.splitlines(), 1):
                if len(line) > limit:
                    found.append(f"cell {n}, line {m} ({len(line)} chars): {line.strip()[:60]}")
    return found


def _indented_blocks(markdown: str) -> list[str]:
    """Markdown's indented code blocks (four spaces after a blank line, not inside a list: a
    list item's continuation lines are indented too), each without its four spaces."""
    blocks, block, previous, in_list = [], None, "", False
    for line in markdown.splitlines():
        if block is not None and (line.startswith("    ") or not line.strip()):
            block.append(line[4:])
            continue
        if block is not None:
            blocks.append("\n".join(block))
            block = None
        if line.startswith("    ") and not previous.strip() and not in_list:
            block = [line[4:]]
            continue
        if line.strip():
            in_list = bool(re.match(r"\s*([-*+]|\d+\.) ", line)) or (in_list and line[:1] == " ")
        previous = line
    if block is not None:
        blocks.append("\n".join(block))
    return blocks


def test_every_chapter_is_checked():
    assert SOURCES and len(BUILT) == 2 * len(SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_line_of_a_chapters_code_is_wider_than_the_page(path):
    wide = too_wide(jupytext.read(path).cells)
    assert not wide, (f"{path.name}: {len(wide)} lines of code wider than {MAX_CODE_COLUMNS} "
                      "characters (they scroll sideways on the website):\n" + "\n".join(wide))


@pytest.mark.parametrize("path", BUILT, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_cells_a_build_adds_fit_too(path):
    wide = too_wide(nbformat.read(path, as_version=4).cells)
    assert not wide, f"{path.relative_to(ROOT)}:\n" + "\n".join(wide)


def test_the_check_finds_a_wide_line_in_code_and_in_a_fence():
    cells = [nbformat.v4.new_code_cell("x = 1\n" + "y" * 89),
             nbformat.v4.new_markdown_cell("text " * 40 + "\n```python\n" + "z" * 90 + "\n```\n"),
             nbformat.v4.new_code_cell("w" * 88)]
    assert [w.split(" (")[0] for w in too_wide(cells)] == ["cell 0, line 2", "cell 1, line 1"]


def test_the_check_finds_a_wide_line_in_an_indented_block_but_not_in_a_list():
    wide = "v" * 90
    cells = [nbformat.v4.new_markdown_cell(f"A diagram:\n\n    short\n    {wide}\n\nText {wide}\n"),
             nbformat.v4.new_markdown_cell(f"1. an item\n\n    its second paragraph {wide}\n")]
    assert [w.split(" (")[0] for w in too_wide(cells)] == ["cell 0, line 2"]
