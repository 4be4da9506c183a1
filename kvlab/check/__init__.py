"""Exercise checkers: ``kvlab.check.<exercise>(your_function)``.

Each chapter's checkers live in a module ``kvlab/check/chNN_*.py`` and register with
:func:`kvlab.check.core.exercise`. ``kvlab.check.hint(name, level)`` gives hints in steps;
``kvlab.solutions.show(name)`` shows a reference solution.
"""
from __future__ import annotations

import importlib
import pkgutil

from .core import (EXERCISES, Case, CheckFailed, Segment, call_learner, compare_flat, exercise,
                   hint, run_cases)

__all__ = ["CheckFailed", "Case", "Segment", "compare_flat", "exercise", "hint", "run_cases",
           "EXERCISES", "exercises"]

_loaded = False


def _load_all() -> None:
    """Import every chapter's checker module so that all exercises are registered."""
    global _loaded
    if _loaded:
        return
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("ch"):
            importlib.import_module(f"{__name__}.{mod.name}")
    _loaded = True


def exercises() -> list[str]:
    """Names of every exercise in the course, in chapter order."""
    _load_all()
    return sorted(EXERCISES, key=lambda n: (EXERCISES[n].chapter, n))


def __getattr__(name: str):
    _load_all()
    if name in EXERCISES:
        return EXERCISES[name].checker
    raise AttributeError(f"kvlab.check has no checker {name!r}; known: {', '.join(exercises())}")
