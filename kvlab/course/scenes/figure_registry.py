"""The registry of the figures in ``figures/``: ``@figure("NN_name.png")`` marks a function that
builds one. Chapter modules import this; :mod:`kvlab.course.scenes.render` loads them and draws."""
from __future__ import annotations

from typing import Callable

#: file name in figures/ -> a zero-argument function returning a matplotlib Figure
FIGURES: dict[str, Callable] = {}


def figure(filename: str):
    """Register a zero-argument function returning a matplotlib Figure as ``figures/<filename>``."""

    def register(fn):
        FIGURES[filename] = fn
        return fn

    return register
