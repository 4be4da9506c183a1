"""Exercise checkers: ``kvlab.check.<exercise>(your_function)``.

Each chapter's checkers live in a module ``kvlab/course/exercises/chNN_*.py`` and register with
:func:`kvlab.course.checking.registry.exercise`. ``kvlab.check.hint(name, level)`` gives hints in steps;
``kvlab.solutions.show(name)`` shows a reference solution; ``kvlab.check.progress()`` lists
every exercise of the course with its state, kept between sessions; ``kvlab.check.recheck("NN")``
ends each chapter by checking its exercises again.

A wrong answer raises :class:`CheckFailed`. In a notebook it shows its message (and a picture),
none of kvlab's frames, and does not stop Run All: later cells use the package's version
(:func:`choose`) until the learner's passes (:mod:`kvlab.course.checking.cells`).

The floors of this package, each importing only from the floors below it::

    review            progress, recheck: where the learner stands
    catalog           every exercise (imports each chapter module): hint, status, choose
    chNN_*.py         the chapters' cases and checkers
    answers           the type, dtype and device an answer's statement fixes, one line each
    core              run_cases, call_learner, compare_flat          picture (failure pictures)
    slips             a diagnosis: the one known slip that gives exactly the learner's answer
    inputs, compiled  read-only arguments compared; kernels compiled for a GPU (compile_child)
    pool_state        a hash-chained cache as plain data, and how two differ in words
    sandbox           guarded_call: guard bands + audit + a child process
    workers, runner   the child processes; one call, here or in a child    shipping, pipes
    audit, guards     loads and stores checked in the interpreter; guard bands    messages
    findings, walk    what the net saw, in words; the one walker over arguments
    registry          the exercises, their status and what a check records
    cells, progress_file  a failure at the end of a notebook cell; the saved progress
    failures          CheckFailed, Case, Segment, Layout

Learner code always runs through :func:`call_learner`: a crash or a hang is reported instead
of killing the notebook, and memory accesses outside a tensor are named (read or write, which
argument, which request and part). A failure also draws a picture in a notebook.
"""
from __future__ import annotations

from ..checking import picture, sandbox  # noqa: F401  (kvlab.course.checking.picture, kvlab.course.checking.sandbox)
from .catalog import broken_modules, choose, exercises, hint, load_all, status
from ..checking.core import call_learner, compare_flat, run_cases
from ..checking.failures import Case, CheckFailed, Layout, LearnerRaised, Segment
from ..checking.registry import EXERCISES, STARTER_MARKER, exercise, not_attempted
from .review import progress, recheck

_load_all = load_all  # kvlab.solutions loads every exercise through this name

__all__ = ["CheckFailed", "LearnerRaised", "Case", "Segment", "Layout", "compare_flat", "exercise",
           "hint", "run_cases", "call_learner", "EXERCISES", "exercises", "broken_modules",
           "status", "choose", "not_attempted", "STARTER_MARKER", "progress", "recheck"]


def __getattr__(name: str):
    load_all()
    if name in EXERCISES:
        return EXERCISES[name].checker
    broken = "".join(f"; kvlab.check.{m} failed to import: {type(e).__name__}: {e}"
                     for m, e in broken_modules().items())
    raise AttributeError(f"kvlab.check has no checker {name!r}; known: {', '.join(exercises())}"
                         + broken)
