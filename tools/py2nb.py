"""Build a chapter notebook from a percent-format Python script.

    python tools/py2nb.py chapter.py notebooks/NN_name.ipynb

Cells are separated by ``# %%`` (code) and ``# %% [markdown]`` (markdown; each line's
leading ``# `` is stripped). The canonical setup cell (kvlab.colab.SETUP_CELL) is put
first; the notebook is written without outputs, with the ``python3`` kernel.
"""
from __future__ import annotations

import re
import sys

import nbformat

sys.path.insert(0, ".")
from kvlab.colab import SETUP_CELL  # noqa: E402


def convert(text: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    cells = [nbformat.v4.new_code_cell(SETUP_CELL)]
    chunks = re.split(r"^# %%(.*)$", text, flags=re.M)
    # chunks = [preamble, header1, body1, header2, body2, ...]
    for header, body in zip(chunks[1::2], chunks[2::2]):
        body = body.strip("\n")
        if "[markdown]" in header:
            lines = [re.sub(r"^# ?", "", line) for line in body.splitlines()]
            cells.append(nbformat.v4.new_markdown_cell("\n".join(lines).strip()))
        elif body.strip():
            cells.append(nbformat.v4.new_code_cell(body))
    for i, c in enumerate(cells):
        c["id"] = f"cell-{i:03d}"
    nb.cells = cells
    return nb


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        nb = convert(f.read())
    nbformat.write(nb, dst)
    print(f"wrote {dst} ({len(nb.cells)} cells)")
