"""Small notebooks that test the UI harness itself (no kvlab, so they run in seconds).

``slider_demo``: an IntSlider (class ``kvlab-timeline-slider``) redraws a matplotlib figure
into an Image widget (class ``kvlab-view``), the same shape as chapter 07's timeline explorer.
``error_demo``: a warning on stderr (must *not* count as an error), a slider whose callback
raises (the traceback goes to JupyterLab's Log Console), then a cell that raises.
"""
from __future__ import annotations

from pathlib import Path

import nbformat

SLIDER_DEMO = "ui_slider_demo.ipynb"
ERROR_DEMO = "ui_error_demo.ipynb"

_SLIDER_CELLS = [
    "import io\n"
    "import ipywidgets as widgets\n"
    "import matplotlib\n"
    "import matplotlib.pyplot as plt\n"
    "import numpy as np",
    "def render(step: int) -> bytes:\n"
    "    grid = np.zeros((6, 16))\n"
    "    grid.flat[: (step + 1) * 6] = 1 + np.arange((step + 1) * 6) % 3\n"
    "    fig, ax = plt.subplots(figsize=(5, 2))\n"
    "    ax.imshow(grid, cmap='viridis', vmin=0, vmax=3)\n"
    "    ax.set_title(f'step {step}')\n"
    "    buf = io.BytesIO()\n"
    "    fig.savefig(buf, format='png')\n"
    "    plt.close(fig)\n"
    "    return buf.getvalue()",
    "slider = widgets.IntSlider(value=0, min=0, max=9, description='step',\n"
    "                           continuous_update=False)  # as chapter 07's explorer\n"
    "slider.add_class('kvlab-timeline-slider')\n"
    "view = widgets.Image(value=render(0), format='png')\n"
    "view.add_class('kvlab-view')\n"
    "slider.observe(lambda change: setattr(view, 'value', render(change['new'])), names='value')\n"
    "widgets.VBox([slider, view])",
    "fig, ax = plt.subplots(figsize=(4, 2))\n"
    "ax.imshow(np.arange(32).reshape(4, 8))\n"
    "plt.show()",
]

_ERROR_CELLS = [
    "import warnings\n"
    "warnings.warn('only a warning: the harness must not call this an error')\n"
    "print('fine')",
    "import ipywidgets as widgets\n"
    "bad = widgets.IntSlider(value=0, min=0, max=9, continuous_update=False)\n"
    "bad.add_class('kvlab-timeline-slider')\n"
    "def explode(change):\n"
    "    raise ValueError(f'callback failed at {change[\"new\"]}')\n"
    "bad.observe(explode, names='value')\n"
    "bad",
    "1 / 0",
    "print('never reached')",
]


def _write(path: Path, sources: list[str]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:03d}"
    nbformat.write(nb, path)
    return path


def write_fixture_notebooks(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [_write(folder / SLIDER_DEMO, _SLIDER_CELLS), _write(folder / ERROR_DEMO, _ERROR_CELLS)]
