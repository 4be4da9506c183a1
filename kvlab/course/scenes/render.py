"""Render every registered figure into ``figures/`` (``python -m kvlab.course.scenes figures/``)."""
from __future__ import annotations

import importlib
import os
import pkgutil
from pathlib import Path
from typing import Callable

from .figure_registry import FIGURES


def load_all() -> dict[str, Callable]:
    """Import every chapter's scene module, so that all figures are registered."""
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if mod.name.startswith("ch"):
            importlib.import_module(f"{__package__}.{mod.name}")
    return FIGURES


def render_all(out_dir: str, only: str | None = None) -> list[str]:
    """Draw every figure (or those whose file name contains ``only``) into ``out_dir``."""
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
