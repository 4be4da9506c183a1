"""The machinery every exercise checker shares.

A checker runs the learner's function on *named edge cases* first, then on seeded random
cases, against :mod:`kvlab.reference`. On the first wrong answer it raises
:class:`CheckFailed` with a message in the learner's terms (which case, which request,
which part or region, the first wrong slot, expected vs got). When everything passes it
prints one line and returns.

Checkers register themselves with :func:`exercise`, which also stores their step-by-step
hints; :func:`hint` shows them and :mod:`kvlab.solutions` shows reference solutions.

Writing a checker (``kvlab/check/chNN_*.py``):

* run the learner's code only through :func:`call_learner` (``grid=`` for a kernel): that is
  where :mod:`kvlab.check.sandbox` adds the safety net (child process, guard bands);
* run the cases through :func:`run_cases`: it names the case, merges what the safety net saw
  with the comparison, keeps one child process for all cases, and draws the failure;
* compare with :func:`compare_flat` and :class:`Segment` labels ("request 1, part 3"), or raise
  :class:`CheckFailed` yourself with ``expected=``/``got=`` (flat), ``wrong=``, ``label=``, and
  for the picture ``shape=`` (a table), ``segments=``, ``what=`` and ``page_size=``
  (a page table is then drawn by :func:`kvlab.viz.page_table_heatmap`).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch


class CheckFailed(AssertionError):
    """The learner's answer differs from the reference. The message says where and how."""

    def __init__(self, message: str, *, case: str | None = None, expected: Any = None,
                 got: Any = None, wrong: Sequence[int] | None = None, label: str | None = None,
                 shape: Sequence[int] | None = None,
                 segments: Sequence["Segment"] | None = None, what: str | None = None,
                 page_size: int | None = None):
        self.case = case
        self.expected = expected
        self.got = got
        self.wrong = list(wrong) if wrong is not None else []
        self.label = label  # e.g. "request 1, part 3" or "region: duplicate"
        # for the failure picture (kvlab.check.picture): the output's shape before flattening,
        # the labelled ranges of the flat output, and what the output is called
        self.shape = tuple(shape) if shape is not None else None
        self.segments = list(segments) if segments is not None else []
        self.what = what
        self.page_size = page_size  # a page table is drawn with page boundaries when given
        super().__init__(message)

    def add_case(self, case: str) -> "CheckFailed":
        """Prefix the message with ``[case]`` (once) and remember the case; returns self."""
        if self.case is None:
            self.case = case
        msg = str(self.args[0]) if self.args else ""
        if not msg.startswith(f"[{case}]"):
            self.args = (f"[{case}] {msg}",) + tuple(self.args[1:])
        return self


@dataclass(frozen=True)
class Case:
    """One named input for a checker. ``kind`` is "edge" or "random"."""

    name: str
    args: dict
    kind: str = "edge"


@dataclass(frozen=True)
class Segment:
    """A labelled range ``[start, end)`` of a flat output, e.g. one request's part 2."""

    label: str
    start: int
    end: int


def _fmt(values, limit: int = 12) -> str:
    vals = [int(v) for v in values]
    if len(vals) > limit:
        return "[" + ", ".join(map(str, vals[:limit])) + f", ... ({len(vals)} in all)]"
    return "[" + ", ".join(map(str, vals)) + "]"


def label_at(index: int, segments: Iterable[Segment] | None) -> str | None:
    for seg in segments or ():
        if seg.start <= index < seg.end:
            return seg.label
    return None


def compare_flat(expected, got, *, case: str, what: str = "output",
                 segments: Sequence[Segment] | None = None) -> None:
    """Compare two 1-D results; raise :class:`CheckFailed` naming the first wrong position."""
    exp_full = torch.as_tensor(expected)
    shape = tuple(exp_full.shape)
    exp = exp_full.flatten().cpu().to(torch.int64)
    if not isinstance(got, torch.Tensor):
        try:
            got = torch.as_tensor(got)
        except Exception as e:  # noqa: BLE001 - learner code may return anything
            raise CheckFailed(f"[{case}] {what} should be a tensor, got {type(got).__name__}: {e}",
                              case=case) from None
    g = got.flatten().cpu().to(torch.int64)
    if g.numel() != exp.numel():
        raise CheckFailed(
            f"[{case}] {what} has {g.numel()} values, expected {exp.numel()}\n"
            f"  expected: {_fmt(exp)}\n  got:      {_fmt(g)}",
            case=case, expected=exp, got=g, shape=shape, segments=segments, what=what,
        )
    wrong = (g != exp).nonzero().flatten().tolist()
    if not wrong:
        return
    i = wrong[0]
    where = label_at(i, segments)
    lo, hi = max(0, i - 3), min(exp.numel(), i + 5)
    msg = (
        f"[{case}] {what} differs at {len(wrong)} of {exp.numel()} positions; "
        f"first at index {i}" + (f" ({where})" if where else "") + "\n"
        f"  expected[{i}] = {int(exp[i])}, got {int(g[i])}\n"
        f"  expected[{lo}:{hi}] = {_fmt(exp[lo:hi])}\n"
        f"  got[{lo}:{hi}]      = {_fmt(g[lo:hi])}"
    )
    bad_labels = sorted({label_at(j, segments) for j in wrong} - {None})
    if len(bad_labels) > 1:
        msg += "\n  wrong values appear in: " + "; ".join(bad_labels)
    if len(shape) == 2 and shape[1] > 0:  # a table: say which row and column too
        msg += f"\n  (index {i} is row {i // shape[1]}, column {i % shape[1]} of the {what})"
    why = _explain_value(int(g[i]))
    if why:
        msg += "\n  " + why
    raise CheckFailed(msg, case=case, expected=exp, got=g, wrong=wrong, label=where,
                      shape=shape, segments=segments, what=what)


def _explain_value(value: int) -> str | None:
    """Say so when a wrong value is a guard sentinel of the safety net (a read outside a tensor)."""
    from . import sandbox

    return sandbox.explain_value(value)


def run_cases(exercise_name: str, cases: Iterable[Case], run_one: Callable[[Case], None],
              *, quiet: bool = False) -> int:
    """Run every case; stop at the first failure (re-raised with the case name). Returns the count."""
    outermost = _PENDING is None
    try:
        return _run_cases(exercise_name, cases, run_one, quiet=quiet)
    finally:
        if outermost:
            _end_checker_run()


def _end_checker_run() -> None:
    """Let the safety net end the child process it kept for this checker's cases."""
    try:
        from . import sandbox

        sandbox.close_worker()
    except Exception:  # noqa: BLE001 - cleanup only
        pass


def _run_cases(exercise_name: str, cases: Iterable[Case], run_one: Callable[[Case], None],
               *, quiet: bool = False) -> int:
    global _PENDING
    n_edge = n_random = 0
    for case in cases:
        outer, _PENDING = _PENDING, []
        pending = _PENDING
        try:
            try:
                run_one(case)
            finally:
                _PENDING = outer
        except CheckFailed as e:
            _merge_pending(pending, e, case.name)
            e.add_case(case.name)
            _show_picture(e)
            raise
        except Exception as e:  # the learner's code raised: say which case and what
            err = CheckFailed(f"[{case.name}] your code raised {type(e).__name__}: {e}",
                              case=case.name)
            _merge_pending(pending, err, case.name)
            raise err from e
        if pending:  # the answer was right, but the code touched memory outside a tensor
            err = pending[0]
            err.add_case(case.name)
            _show_picture(err)
            raise err
        if case.kind == "edge":
            n_edge += 1
        else:
            n_random += 1
    if not quiet:
        print(f"✓ {exercise_name}: all {n_edge + n_random} cases pass "
              f"({n_edge} edge cases, {n_random} random)")
    return n_edge + n_random


# While run_cases runs a case, the safety net files memory-access problems (a write or read
# outside a tensor) here instead of raising at once, so that the comparison which follows can
# still say which part or region came out wrong. Outside run_cases it raises at once.
_PENDING: list[CheckFailed] | None = None


def report_or_defer(err: CheckFailed) -> None:
    """Raise ``err`` now, or, inside :func:`run_cases`, when the current case has been checked."""
    if _PENDING is None:
        raise err
    _PENDING.append(err)


def _merge_pending(pending: list[CheckFailed], err: CheckFailed, case: str) -> None:
    """Put the safety net's findings first in ``err``'s message: they are the likely cause."""
    if not pending:
        return
    head = "\n".join(str(p.args[0]) for p in pending)
    body = str(err.args[0]) if err.args else ""
    if body.startswith(f"[{case}] "):
        body = body[len(case) + 3:]
    err.args = (f"{head}\n  and so the answer is wrong: {body}",) + tuple(err.args[1:])


def _show_picture(err: CheckFailed) -> None:
    """In a notebook, draw the failure (expected vs got, wrong cells marked). Never raises."""
    if getattr(err, "_picture_shown", False):
        return
    err._picture_shown = True
    try:
        from .picture import show_failure

        show_failure(err)
    except Exception:  # noqa: BLE001 - a picture is a bonus; the message says it all
        pass


def call_learner(fn: Callable[..., Any], *args, grid=None, **kwargs):
    """Run the learner's function, or Triton kernel when ``grid`` is given: ``fn[grid](*args)``.

    Every checker runs learner code through here, so that :mod:`kvlab.check.sandbox` can
    add its safety net in one place (child process, guard bands around tensor arguments).
    Tensors written in place are visible to the caller afterwards; the return value is
    passed back.
    """
    impl = _CALL_LEARNER_IMPL
    if impl is not None:
        return impl(fn, *args, grid=grid, **kwargs)
    return fn[grid](*args, **kwargs) if grid is not None else fn(*args, **kwargs)


# kvlab.check.sandbox installs its guarded runner here when imported.
_CALL_LEARNER_IMPL: Callable[..., Any] | None = None


# --- registry of exercises: checker, hints, solution ------------------------------------


@dataclass
class Exercise:
    name: str
    chapter: str
    checker: Callable[..., Any]
    hints: list[str] = field(default_factory=list)
    solution: Callable[..., Any] | None = None


EXERCISES: dict[str, Exercise] = {}


def exercise(name: str, *, chapter: str, hints: Sequence[str] = (),
             solution: Callable[..., Any] | None = None):
    """Decorator: register a checker under ``name`` with its hints and reference solution.

    The registered checker first asks whether the learner has started (see
    :func:`not_attempted`): an untouched starter is reported in one ``not attempted yet:``
    line and the checker returns 0 without raising, so a learner can run a whole chapter
    before writing anything. Every outcome is remembered for :func:`status` and :func:`choose`.
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
                        _STATUS[name] = "failed"
                        raise
                    why = "it raises NotImplementedError"
                else:
                    _STATUS[name] = "passed"
                    return result
            _STATUS[name] = "not attempted"
            print(f"not attempted yet: {name} ({why}). Write your answer, then run this cell "
                  f"again; kvlab.check.hint({name!r}, 1) gives a first hint.")
            return 0

        EXERCISES[name] = Exercise(name, chapter, check, list(hints), solution)
        check.exercise_name = name
        check.hint = lambda level=1: hint(name, level)
        return check

    return register


# --- the learner's progress: not attempted, failed, passed -----------------------------

#: The line a starter carries in each region the learner writes: ``# YOUR CODE HERE: <exercise>``.
STARTER_MARKER = "YOUR CODE HERE"

#: exercise name -> "passed", "failed" or "not attempted" (the last check of it in this process)
_STATUS: dict[str, str] = {}


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


def _qualified_name(obj) -> str:
    target = getattr(obj, "fn", obj)  # a @triton.jit kernel keeps the Python function in .fn
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def status(name: str) -> str:
    """``"passed"``, ``"failed"``, ``"not attempted"`` or ``"not checked"``: the last check of
    exercise ``name`` in this process."""
    _lookup(name)
    return _STATUS.get(name, "not checked")


def choose(name: str, yours: Callable[..., Any], package: Callable[..., Any]):
    """``yours`` once it has passed ``kvlab.check.<name>``, else ``package``; says which.

    Cells after an exercise call this, so that a chapter runs top to bottom before the learner
    has written anything, and uses the learner's code from the moment it passes.
    """
    state = status(name)
    mine = getattr(getattr(yours, "fn", yours), "__name__", repr(yours))
    theirs = _qualified_name(package)
    if state == "passed":
        print(f"using your {mine} (it passed kvlab.check.{name})")
        return yours
    print(f"using {theirs} (your {mine} has not passed kvlab.check.{name} yet: {state})")
    return package


def _lookup(name: str) -> Exercise:
    from . import _load_all

    _load_all()
    if name not in EXERCISES:
        known = ", ".join(sorted(EXERCISES)) or "(none)"
        raise KeyError(f"no exercise named {name!r}; known exercises: {known}")
    return EXERCISES[name]


def hint(name: str, level: int = 1) -> str:
    """Show hint ``level`` (1, 2, ...) for exercise ``name``; later hints say more."""
    ex = _lookup(name)
    if not ex.hints:
        text = f"No hints are written for {name!r}."
    elif not 1 <= level <= len(ex.hints):
        text = f"{name!r} has hints 1 to {len(ex.hints)}."
    else:
        text = f"Hint {level}/{len(ex.hints)} for {name}: {ex.hints[level - 1]}"
    print(text)
    return text
