"""The exercises of the course: each checker with its hints and reference solution.

A chapter's checker module registers its checkers with :func:`exercise`; the registered
checker first asks whether the learner has started at all (:func:`not_attempted`) and
remembers every outcome (``passed``, ``failed``, ``not attempted``), which
:mod:`kvlab.check.catalog` reads for ``status`` and ``choose``.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .failures import CheckFailed

#: The line a starter carries in each region the learner writes: ``# YOUR CODE HERE: <exercise>``.
STARTER_MARKER = "YOUR CODE HERE"


@dataclass
class Exercise:
    name: str
    chapter: str
    checker: Callable[..., Any]
    hints: list[str] = field(default_factory=list)
    solution: Callable[..., Any] | None = None


EXERCISES: dict[str, Exercise] = {}

#: exercise name -> "passed", "failed" or "not attempted" (the last check of it in this process)
STATUS: dict[str, str] = {}


def exercise(name: str, *, chapter: str, hints: Sequence[str] = (),
             solution: Callable[..., Any] | None = None):
    """Decorator: register a checker under ``name`` with its hints and reference solution.

    The registered checker first asks whether the learner has started (see
    :func:`not_attempted`): an untouched starter is reported in one ``not attempted yet:``
    line and the checker returns 0 without raising, so a learner can run a whole chapter
    before writing anything. Every outcome is remembered in :data:`STATUS`.
    """

    def register(checker):
        @functools.wraps(checker)
        def check(fn, *args, **kwargs):
            why = not_attempted(fn, name)
            if why is None:
                try:
                    result = checker(fn, *args, **kwargs)
                except CheckFailed as err:
                    if not _raised_not_implemented(err):
                        STATUS[name] = "failed"
                        raise
                    why = "it raises NotImplementedError"
                else:
                    STATUS[name] = "passed"
                    return result
            STATUS[name] = "not attempted"
            print(f"not attempted yet: {name} ({why}). Write your answer, then run this cell "
                  f"again; kvlab.check.hint({name!r}, 1) gives a first hint.")
            return 0

        EXERCISES[name] = Exercise(name, chapter, check, list(hints), solution)
        check.exercise_name = name
        check.hint = lambda level=1: show_hint(name, level)
        return check

    return register


def _source_of(fn) -> str:
    target = getattr(fn, "fn", fn)  # a @triton.jit kernel keeps the Python function in .fn
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):
        return ""


def not_attempted(fn, name: str) -> str | None:
    """Why ``fn`` is still the untouched starter of exercise ``name``, or None when it is not.

    A starter carries the line ``# YOUR CODE HERE: <name>`` where the answer goes (a Triton
    kernel cannot raise, so for kernels the marker is the only sign); a plain function's
    starter also raises ``NotImplementedError``, which the checker notices when it runs.
    """
    for line in _source_of(fn).splitlines():
        text = line.strip()
        if text.startswith("#") and text.lstrip("# ").startswith(f"{STARTER_MARKER}: {name}"):
            rest = text.lstrip("# ")[len(f"{STARTER_MARKER}: {name}"):]
            if rest == "" or not (rest[0].isalnum() or rest[0] == "_"):
                return (f"the line '# {STARTER_MARKER}: {name}' is still there: replace it "
                        "with your code")
    return None


def _raised_not_implemented(err: BaseException | None) -> bool:
    """Whether a checker failure is the learner's code raising NotImplementedError (directly,
    or in the safety net's child process, which sends the original exception back)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, NotImplementedError) or isinstance(getattr(err, "original", None),
                                                                NotImplementedError):
            return True
        err = err.__cause__ or err.__context__
    return False


def show_hint(name: str, level: int = 1) -> str:
    """Print hint ``level`` (1, 2, ...) of a registered exercise ``name`` and return it."""
    ex = EXERCISES.get(name)
    if ex is None:
        known = ", ".join(sorted(EXERCISES)) or "(none)"
        raise KeyError(f"no exercise named {name!r}; known exercises: {known}")
    if not ex.hints:
        text = f"No hints are written for {name!r}."
    elif not 1 <= level <= len(ex.hints):
        text = f"{name!r} has hints 1 to {len(ex.hints)}."
    else:
        text = f"Hint {level}/{len(ex.hints)} for {name}: {ex.hints[level - 1]}"
    print(text)
    return text
