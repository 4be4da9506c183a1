"""Every exercise of the course, found by importing each chapter's checker module.

``kvlab.check.hint``, ``status`` and ``choose`` live here: they name exercises of any chapter,
so they load every ``kvlab/course/exercises/chNN_*.py`` first (once). A module that fails to import is
recorded (:func:`broken_modules`) instead of taking the other chapters down with it.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings
from typing import Any, Callable

from .. import exercises as _exercises
from ..checking.registry import EXERCISES, STATUS, Exercise, show_hint

_loaded = False
#: chapter checker modules that failed to import: module name -> the error
_BROKEN: dict[str, BaseException] = {}


def load_all() -> None:
    """Import every chapter's checker module so that all exercises are registered."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in pkgutil.iter_modules(_exercises.__path__):
        if mod.name.startswith("ch"):
            try:
                importlib.import_module(f"{_exercises.__name__}.{mod.name}")
            except Exception as e:  # noqa: BLE001 - keep the other chapters usable
                _BROKEN[mod.name] = e
                warnings.warn(f"kvlab.check.{mod.name} could not be imported ({type(e).__name__}: "
                              f"{e}); its exercises are unavailable", RuntimeWarning, stacklevel=2)


def broken_modules() -> dict[str, BaseException]:
    """Chapter checker modules that failed to import, with their errors (empty when all is well)."""
    load_all()
    return dict(_BROKEN)


def exercises() -> list[str]:
    """Names of every exercise in the course: chapter by chapter, each chapter's in the order
    its notebook asks for them (``exercise(..., order=)``, then the order of registration)."""
    load_all()
    registered = {name: i for i, name in enumerate(EXERCISES)}
    return sorted(EXERCISES, key=lambda n: (EXERCISES[n].chapter, EXERCISES[n].order, registered[n]))


def lookup(name: str) -> Exercise:
    load_all()
    if name not in EXERCISES:
        known = ", ".join(sorted(EXERCISES)) or "(none)"
        raise KeyError(f"no exercise named {name!r}; known exercises: {known}")
    return EXERCISES[name]


def hint(name: str, level: int = 1) -> None:
    """Show hint ``level`` (1, 2, ...) for exercise ``name``; later hints say more."""
    lookup(name)
    show_hint(name, level)


def status(name: str) -> str:
    """``"passed"``, ``"failed"``, ``"not attempted"`` or ``"not checked"``: the last check of
    exercise ``name`` in this process (in IPython, a failure caught inside its cell does not
    count: see :mod:`kvlab.course.checking.cells`)."""
    lookup(name)
    return STATUS.get(name, "not checked")


def _qualified_name(obj) -> str:
    target = getattr(obj, "fn", obj)  # a @triton.jit kernel keeps the Python function in .fn
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def public_name(obj) -> str:
    """How a learner reaches ``obj``: ``kvlab.page_hashes`` rather than the module that defines
    it, when the package exports it (``kvlab.HashPrefixCache.free`` for a method); the
    reference solution of an exercise is named as such, never by the checker module keeping it."""
    for package in ("kvlab", "kvlab.serving.hf", "kvlab.kernels"):  # only those imported already
        module = sys.modules.get(package)
        exported = getattr(module, "__all__", ())
        name = next((n for n in exported if getattr(module, n, None) is obj), None)
        if name is not None:
            return f"{package}.{name}"
        owner, _, method = getattr(obj, "__qualname__", "").partition(".")
        if method and owner in exported and getattr(getattr(module, owner), method, None) is obj:
            return f"{package}.{owner}.{method}"
    for ex in EXERCISES.values():
        if ex.solution is obj:
            return f"the reference solution of {ex.name} (kvlab.solutions.show({ex.name!r}) prints it)"
    return _qualified_name(obj)


def choose(name: str, yours: Callable[..., Any], package: Callable[..., Any]):
    """``yours`` once it has passed ``kvlab.check.<name>``, else ``package``; says which.

    Cells after an exercise call this, so that a chapter runs top to bottom before the learner
    has written anything, and uses the learner's code from the moment it passes.
    """
    state = status(name)
    mine = getattr(getattr(yours, "fn", yours), "__name__", repr(yours))
    if state == "passed":
        print(f"using your {mine} (it passed kvlab.check.{name})")
        return yours
    print(f"using {public_name(package)} (your {mine} has not passed kvlab.check.{name} "
          f"yet: {state})")
    return package
