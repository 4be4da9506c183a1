"""Exercise checkers: ``kvlab.check.<exercise>(your_function)``.

Each chapter's checkers live in a module ``kvlab/check/chNN_*.py`` and register with
:func:`kvlab.check.core.exercise`. ``kvlab.check.hint(name, level)`` gives hints in steps;
``kvlab.solutions.show(name)`` shows a reference solution.

Learner code always runs through :func:`call_learner`, which :mod:`kvlab.check.sandbox`
wraps in a safety net: a crash or a hang is reported instead of killing the notebook, and
reads or writes just outside a tensor are caught by guard bands. A failure also draws a
picture in a notebook (:mod:`kvlab.check.picture`).
"""
from __future__ import annotations

import importlib
import pkgutil

from . import sandbox
from .core import (EXERCISES, Case, CheckFailed, Segment, call_learner, compare_flat, exercise,
                   hint, run_cases)
from .sandbox import LearnerRaised

# Every checker runs learner code through call_learner: give it the safety net
# (child process in the interpreter, guard bands around tensor arguments).
sandbox.install()

__all__ = ["CheckFailed", "LearnerRaised", "Case", "Segment", "compare_flat", "exercise", "hint",
           "run_cases", "call_learner", "EXERCISES", "exercises"]

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
