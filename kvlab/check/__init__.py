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
import warnings

from . import picture, sandbox  # noqa: F401  (kvlab.check.picture, kvlab.check.sandbox)
from .core import (EXERCISES, STARTER_MARKER, Case, CheckFailed, Segment, call_learner, choose,
                   compare_flat, exercise, hint, not_attempted, run_cases, status)
from .sandbox import LearnerRaised

# Every checker runs learner code through call_learner: give it the safety net
# (child process in the interpreter, guard bands around tensor arguments).
sandbox.install()

__all__ = ["CheckFailed", "LearnerRaised", "Case", "Segment", "compare_flat", "exercise", "hint",
           "run_cases", "call_learner", "EXERCISES", "exercises", "broken_modules", "status",
           "choose", "not_attempted", "STARTER_MARKER"]

_loaded = False
#: chapter checker modules that failed to import: module name -> the error (see broken_modules)
_BROKEN: dict[str, BaseException] = {}


def _load_all() -> None:
    """Import every chapter's checker module so that all exercises are registered.

    A module that fails to import is recorded (and warned about) instead of taking every
    other chapter's checkers down with it.
    """
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("ch"):
            try:
                importlib.import_module(f"{__name__}.{mod.name}")
            except Exception as e:  # noqa: BLE001 - keep the other chapters usable
                _BROKEN[mod.name] = e
                warnings.warn(f"kvlab.check.{mod.name} could not be imported ({type(e).__name__}: "
                              f"{e}); its exercises are unavailable", RuntimeWarning, stacklevel=2)


def broken_modules() -> dict[str, BaseException]:
    """Chapter checker modules that failed to import, with their errors (empty when all is well)."""
    _load_all()
    return dict(_BROKEN)


def exercises() -> list[str]:
    """Names of every exercise in the course, in chapter order."""
    _load_all()
    return sorted(EXERCISES, key=lambda n: (EXERCISES[n].chapter, n))


def __getattr__(name: str):
    _load_all()
    if name in EXERCISES:
        return EXERCISES[name].checker
    broken = "".join(f"; kvlab.check.{m} failed to import: {type(e).__name__}: {e}"
                     for m, e in _BROKEN.items())
    raise AttributeError(f"kvlab.check has no checker {name!r}; known: {', '.join(exercises())}"
                         + broken)
