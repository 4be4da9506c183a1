"""The exercises of the course: each checker with its hints and reference solution.

A chapter's checker module registers its checkers with :func:`exercise`; the registered
checker first asks whether the learner has started at all (:func:`not_attempted`), then
records every outcome that counts (``passed``, ``failed``, ``not attempted``): in
:data:`STATUS` for this process (:mod:`kvlab.course.check.catalog` reads it for ``status`` and
``choose``), in :data:`LAST_CALL` (what ``recheck`` runs again) and in the progress file
(:mod:`kvlab.course.checking.progress_file`, read by ``progress``). In IPython a failure counts once it
ends a cell (:mod:`kvlab.course.checking.cells`): one caught inside the cell is a demonstration.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from . import cells, progress_file
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
    #: the regions of a shared solution this exercise covers (titles of ``# ---- ... ----`` lines);
    #: empty: the whole solution. ``kvlab.solutions.show`` prints only these.
    solution_regions: tuple[str, ...] = ()
    #: the chapter module's checker itself (raises CheckFailed), without the bookkeeping
    grade: Callable[..., Any] | None = None
    #: its place among its chapter's exercises: the order in which the notebook asks for them
    order: int = 0
    #: the exercise checked right before this one in the same cell, on the same answer (chapter
    #: 03's parts): when that one fails, the cell stops before this check runs
    after: str | None = None


EXERCISES: dict[str, Exercise] = {}

#: exercise name -> "passed", "failed" or "not attempted" (the last check of it in this process)
STATUS: dict[str, str] = {}

#: exercise name -> (fn, args, kwargs) of the last check of it that counted, in this process
LAST_CALL: dict[str, tuple] = {}


class Verdict(NamedTuple):
    """What one check found: ``state`` is "passed", "failed" or "not attempted"."""

    state: str
    why: str | None = None  # not attempted: why it counts as untouched
    error: CheckFailed | None = None  # failed: the failure


def verdict(name: str, fn, args: tuple = (), kwargs: dict | None = None,
            grade: Callable[..., Any] | None = None) -> Verdict:
    """Run the checker of ``name`` (or ``grade``) on ``fn``; never raises :class:`CheckFailed`,
    records nothing."""
    why = not_attempted(fn, name)
    if why is not None:
        return Verdict("not attempted", why)
    try:
        (grade or EXERCISES[name].grade)(fn, *args, **(kwargs or {}))
    except CheckFailed as err:
        if _raised_not_implemented(err):
            return Verdict("not attempted", "it raises NotImplementedError")
        return Verdict("failed", error=err)
    return Verdict("passed")


def record(name: str, state: str, call: tuple) -> None:
    """``state`` is now the outcome of exercise ``name`` (for choose, recheck and progress)."""
    STATUS[name] = state
    LAST_CALL[name] = call
    progress_file.save(name, EXERCISES[name].chapter, state)


def not_attempted_line(name: str, why: str) -> str:
    return (f"not attempted yet: {name} ({why}). Write your answer, then run this cell again; "
            f"kvlab.check.hint({name!r}, 1) gives a first hint.")


def exercise(name: str, *, chapter: str, hints: Sequence[str] = (),
             solution: Callable[..., Any] | None = None, solution_regions: Sequence[str] = (),
             order: int = 0, after: str | None = None):
    """Decorator: register a checker under ``name`` with its hints and reference solution.

    The registered checker prints one line and returns None (nothing for a notebook to echo):
    ``✓ ...`` when every case passes, ``not attempted yet: ...`` for an untouched starter (see
    :func:`not_attempted`), so a learner can run a whole chapter before writing anything. A
    wrong answer raises :class:`CheckFailed`; in a notebook it is shown and Run All goes on
    (:mod:`kvlab.course.checking.cells`). A chapter's exercises appear in ``kvlab.check.progress()`` and
    ``recheck`` by being registered here: nothing else lists them, in the order of ``order``
    (the chapter's: ``tests/test_course_text.py`` compares it with the notebook). ``after``
    names the exercise whose check comes right before this one in the same cell.
    """

    def register(checker):
        @functools.wraps(checker)
        def check(fn, *args, **kwargs) -> None:
            found, call = verdict(name, fn, args, kwargs, checker), (fn, args, kwargs)
            if found.state == "failed":
                raise _failure(name, found.error, call)
            if found.state == "not attempted":
                print(not_attempted_line(name, found.why))
            record(name, found.state, call)

        EXERCISES[name] = Exercise(name, chapter, check, list(hints), solution,
                                   tuple(solution_regions), checker, order, after)
        check.exercise_name = name
        check.hint = lambda level=1: show_hint(name, level)
        return check

    return register


def _failure(name: str, err: CheckFailed, call: tuple) -> CheckFailed:
    """``err``, marked as exercise ``name``'s verdict; recorded now, or in IPython when it ends
    the cell (see :mod:`kvlab.course.checking.cells`)."""
    err.checked_by = f"kvlab.check.{name}"
    if cells.watch(lambda pending: record(*pending)):
        err.pending = (name, "failed", call)
        if cells.in_kernel():
            err.footer = (f"(Run All goes on: later cells use the package's version until yours "
                          f"passes. A hint: kvlab.check.hint({name!r}, 1).)" + _not_run_after(name))
    else:
        record(name, "failed", call)
    return err


def checked_after(name: str) -> list[str]:
    """The exercises whose checks follow ``name``'s in its cell (``after=``), in order."""
    chain, at = [], name
    while (at := next((n for n, ex in EXERCISES.items() if ex.after == at), None)) is not None:
        chain.append(at)
    return chain


def _not_run_after(name: str) -> str:
    later = checked_after(name)
    if not later:
        return ""
    return (f"\n(The check{'s' * (len(later) > 1)} after it in this cell did not run: "
            f"{', '.join(f'kvlab.check.{n}' for n in later)}.)")


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


def hint_text(name: str, level: int = 1) -> str:
    """Hint ``level`` (1, 2, ...) of a registered exercise ``name``, as :func:`show_hint` prints it."""
    ex = EXERCISES.get(name)
    if ex is None:
        known = ", ".join(sorted(EXERCISES)) or "(none)"
        raise KeyError(f"no exercise named {name!r}; known exercises: {known}")
    if not ex.hints:
        return f"No hints are written for {name!r}."
    if not 1 <= level <= len(ex.hints):
        return f"{name!r} has hints 1 to {len(ex.hints)}."
    return f"Hint {level}/{len(ex.hints)} for {name}: {ex.hints[level - 1]}"


def show_hint(name: str, level: int = 1) -> None:
    """Print hint ``level`` (1, 2, ...) of a registered exercise ``name`` (returns None: a
    notebook cell ending with it shows the hint once)."""
    print(hint_text(name, level))
