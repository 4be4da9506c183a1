"""Each chapter's scenes: the small scenarios it builds on, and the figures drawn from them.

One module per chapter, ``kvlab/scenes/chNN_*.py``. A module holds the chapter's seeded
scenarios (small managers, batches and step histories that its notebook, its checker and its
figures share) and the functions that draw them. A function decorated with
``@figure("NN_name.png")`` builds one of the pictures in ``figures/`` (what README shows);
``make figures`` (``python -m kvlab.scenes figures/``) renders them all, deterministically.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

FIGURES: dict[str, Callable] = {}


def figure(filename: str):
    """Register a zero-argument function returning a matplotlib Figure as ``figures/<filename>``."""

    def register(fn):
        FIGURES[filename] = fn
        return fn

    return register


def load_all() -> dict[str, Callable]:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("ch"):
            importlib.import_module(f"{__name__}.{mod.name}")
    return FIGURES


def render_all(out_dir: str, only: str | None = None) -> list[str]:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, fn in sorted(load_all().items()):
        if only and only not in name:
            continue
        fig = fn()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        written.append(path)
        print("wrote", path)
    return written
