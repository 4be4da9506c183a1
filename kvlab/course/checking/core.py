"""The machinery every exercise checker shares: run cases, call learner code, compare.

A checker runs the learner's function on *named edge cases* first, then on seeded random
cases, against :mod:`kvlab.course.reference`. On the first wrong answer it raises
:class:`CheckFailed` with a message in the learner's terms (which case, which request,
which part or region, the first wrong slot, expected vs got). When everything passes it
prints one line and returns.

Writing a checker (``kvlab/course/exercises/chNN_*.py``, registered with
:func:`kvlab.course.checking.registry.exercise`):

* run the learner's code only through :func:`call_learner` (``grid=`` for a kernel): it goes
  through the safety net (:mod:`kvlab.course.checking.sandbox`), and ``layout=`` (a :class:`Layout`)
  says how to name what the net finds ("by request 1, part 2", the inputs line);
* run the cases through :func:`run_cases`: it names the case, tells the safety net's findings
  together with the comparison, runs each kernel's programs in a changed order (and says so
  when only that order fails: a race), keeps one child process for all cases, and draws the
  failure;
* compare with :func:`compare_flat` and :class:`Segment` labels ("request 1, part 3"), or raise
  :class:`CheckFailed` yourself with ``expected=``/``got=`` (flat), ``wrong=``, ``label=``, and
  for the picture ``shape=`` (a table), ``segments=``, ``what=`` and ``page_size=``.

Imports go one way: ``core`` uses the sandbox, the sandbox never uses ``core``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ...base import runtime
from . import compiled, findings, inputs, picture, sandbox
from .audit import Order
from .failures import CAUSE_NAMED, Case, CheckFailed, Layout, Segment, fmt_values, label_at
from .guards import explain_value
from .messages import learner_traceback
from .slips import close
from .slips import recognised as slips_recognised
from .registry import EXERCISES, exercise  # noqa: F401  (kvlab.course.checking.core.EXERCISES, as before)

__all__ = ["Case", "CheckFailed", "Layout", "Segment", "call_learner", "compare_flat",
           "run_cases", "EXERCISES", "exercise"]


def compare_flat(expected, got, *, case: str, what: str = "output",
                 segments: Sequence[Segment] | None = None, owned=None) -> None:
    """Compare two 1-D results; raise :class:`CheckFailed` naming the first wrong position.

    ``owned`` (booleans, one per position): compare only those positions; the context lines
    show ``·`` at the others (e.g. the slots of another part of the same kernel)."""
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
            f"  expected: {fmt_values(exp)}\n  got:      {fmt_values(g)}",
            case=case, expected=exp, got=g, shape=shape, segments=segments, what=what,
        )
    mine = torch.ones_like(exp, dtype=torch.bool) if owned is None else torch.as_tensor(owned)
    wrong = ((g != exp) & mine).nonzero().flatten().tolist()
    if not wrong:
        return

    def shown(v, lo, hi):
        return "[" + ", ".join(str(int(v[j])) if mine[j] else "·" for j in range(lo, hi)) + "]"

    i = wrong[0]
    where = label_at(i, segments)
    lo, hi = max(0, i - 3), min(exp.numel(), i + 5)
    msg = (
        f"[{case}] {what}: {len(wrong)} of {exp.numel()} positions differ; "
        f"first at index {i}" + (f" ({where})" if where else "") + "\n"
        f"  expected[{i}] = {int(exp[i])}, got {int(g[i])}\n"
        f"  expected[{lo}:{hi}] = {shown(exp, lo, hi)}\n"
        f"  got[{lo}:{hi}]      = {shown(g, lo, hi)}"
    )
    bad_labels = [b for b in dict.fromkeys(label_at(j, segments) for j in wrong) if b]
    if len(bad_labels) > 1:
        msg += "\n  wrong values appear in: " + "; ".join(bad_labels[:8]) + (
            f"; ... ({len(bad_labels)} in all)" if len(bad_labels) > 8 else "")
    if len(shape) == 2 and shape[1] > 0:  # a table: say which row and column too
        msg += f"\n  (index {i} is row {i // shape[1]}, column {i % shape[1]} of the {what})"
    why = explain_value(int(g[i]), _LAST_SENTINELS)
    if why:
        msg += "\n  " + why
    raise CheckFailed(msg, case=case, expected=exp, got=g, wrong=wrong, label=where,
                      shape=shape, segments=segments, what=what)


# --- running cases -------------------------------------------------------------------------------


@dataclass
class _Attempt:
    """One run of one case: the program order it uses and what the safety net filed."""

    order: Order
    interpret: bool = False  # on a GPU: kernels run in Triton's interpreter (the audit pass)
    pending: list[CheckFailed] = field(default_factory=list)
    programs: int = 0  # the most programs of one kernel launch in this case


_ATTEMPT: _Attempt | None = None  # the case running now (None: outside run_cases)
_DEPTH = 0  # nested run_cases
_LAST_SENTINELS: list = []  # the guard values of the latest call, to explain odd values
_LAST_STORES: tuple = ()  # the tracked stores of the latest call (last_stores)


def case_order(index: int) -> Order:
    """The program order of a checker's ``index``-th case: reversed and shuffled by turns.

    The interpreter otherwise runs programs 0, 1, 2, ... one after another, which hides a race
    (two programs writing one place) that a GPU would show.
    """
    return Order("reversed") if index % 2 == 0 else Order("shuffled", seed=index)


def run_cases(exercise_name: str, cases: Iterable[Case], run_one: Callable[[Case], None],
              *, quiet: bool = False) -> int:
    """Run every case; stop at the first failure (raised with the case name). Returns the count."""
    global _DEPTH
    _DEPTH += 1
    try:
        n_edge = n_random = 0
        for index, case in enumerate(cases):
            err = _run_case(case, run_one, case_order(index))
            if err is not None:
                _show_picture(err)
                raise err
            if case.kind == "edge":
                n_edge += 1
            else:
                n_random += 1
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            sandbox.close_worker()
    if not quiet:
        print(f"✓ {exercise_name}: all {n_edge + n_random} cases pass "
              f"({n_edge} edge cases, {n_random} random)")
    return n_edge + n_random


def _run_case(case: Case, run_one, order: Order) -> CheckFailed | None:
    """The failure of ``case``, or None.

    In the interpreter the case runs once, its kernels' programs in ``order``, every load and
    store audited. On a GPU it runs compiled first (programs in the GPU's own order), then,
    for a kernel, once more in Triton's interpreter under the audit (the *audit pass*), so a
    stray read or a race is found there too.
    """
    if runtime.INTERPRET:
        return _audited_case(case, run_one, order, interpret=False)
    err, attempt = _attempt(case, run_one, Order())
    if attempt.programs == 0 or not sandbox.audit_pass_enabled():
        return err
    audited = _audited_case(case, run_one, order, interpret=True)
    if audited is None:
        return err  # right in the interpreter: a wrong answer here is the GPU's own
    if err is None or err.accesses or err.label == "crash" or audited.accesses or (
            audited.label in ("program order",) + CAUSE_NAMED):
        return audited.extend("\n  (found by running your kernel again in Triton's "
                              "interpreter, which checks every load and store and runs the "
                              "programs in a changed order)")
    return err


def _audited_case(case: Case, run_one, order: Order, interpret: bool) -> CheckFailed | None:
    """A failure in a changed program order that goes away when the programs run in order is
    reported as what it is: the answer depends on the order (a race on a GPU)."""
    err, attempt = _attempt(case, run_one, order, interpret)
    if err is None or attempt.programs < 2 or order.kind == "natural":
        return err
    in_order, _ = _attempt(case, run_one, Order(), interpret)
    if in_order is not None:
        return in_order  # wrong whatever the order: the usual message, programs in order
    return _order_dependent(err, case.name, order, attempt.programs)


def _attempt(case: Case, run_one, order: Order,
             interpret: bool = False) -> tuple[CheckFailed | None, _Attempt]:
    global _ATTEMPT
    outer, attempt = _ATTEMPT, _Attempt(order, interpret)
    _ATTEMPT = attempt
    try:
        try:
            run_one(case)
        finally:
            _ATTEMPT = outer
    except CheckFailed as e:
        if e.label == "compile":  # the kernel's source, whatever the case: no case named
            return e, attempt
        return _merge_pending(attempt.pending, e, case.name).add_case(case.name), attempt
    except Exception as e:  # the learner's code raised: say which case, what, and where
        where = learner_traceback(e)
        err = CheckFailed(f"[{case.name}] your code raised {type(e).__name__}: {e}"
                          + (f"\n{where}" if where else ""), case=case.name)
        err.__cause__ = e
        return _merge_pending(attempt.pending, err, case.name), attempt
    if attempt.pending:  # the answer was right, but the code touched memory outside a tensor
        return attempt.pending[0].add_case(case.name), attempt
    return None, attempt


def _merge_pending(pending: list[CheckFailed], err: CheckFailed, case: str) -> CheckFailed:
    """Put the safety net's findings first in ``err``'s message: they are the likely cause."""
    if not pending:
        return err
    body = err.message
    told = set(body.splitlines())  # e.g. the inputs line, when the comparison gives it too
    head = "\n".join(line for p in pending for line in p.message.splitlines() if line not in told
                     and not (err.label == "named cause" and line.strip() == findings.ADVICE))
    if body.startswith(f"[{case}] "):
        body = body[len(case) + 3:]
    if err.label in CAUSE_NAMED:  # the checker named the cause: it comes first (with its own advice)
        err.args = (f"{body}\n  and so: {head}",) + tuple(err.args[1:])
    else:
        then = "and then: " if err.label in ("crash", "timeout") else "and so the answer is wrong: "
        err.args = (f"{head}\n  {then}{body}",) + tuple(err.args[1:])
    if not err.band_writes:
        err.band_writes = [w for p in pending for w in p.band_writes]
    err.accesses = [a for p in pending for a in p.accesses] + err.accesses
    return err


def _order_dependent(err: CheckFailed, case: str, order: Order, programs: int) -> CheckFailed:
    body = err.message
    if body.startswith(f"[{case}] "):
        body = body[len(case) + 3:]
    text = (f"[{case}] your kernel's answer depends on the order in which its programs run: "
            f"it is right when they run {Order().describe(programs)}, and wrong when they run "
            f"{order.describe(programs)}:\n  {body}\n  On a GPU the programs of a grid run at "
            "the same time, in no fixed order. Two programs must never write the same place "
            "(let one program store a shared result, e.g. only the last one, pid == "
            "tl.num_programs(0) - 1, stores ret_values), and no program may rely on what "
            "another one writes.")
    out = CheckFailed(text, case=case, expected=err.expected, got=err.got, wrong=err.wrong,
                      label="program order", shape=err.shape, segments=err.segments, what=err.what,
                      page_size=err.page_size)
    out.__cause__ = err
    return out


def _show_picture(err: CheckFailed) -> None:
    """In a notebook, draw the failure (expected vs got, wrong cells marked). Never raises."""
    if getattr(err, "_picture_shown", False):
        return
    err._picture_shown = True
    try:
        picture.show_failure(err)
    except Exception:  # noqa: BLE001 - a picture is a bonus; the message says it all
        pass


def call_learner(fn: Callable[..., Any], *args, grid=None, layout: Layout | None = None,
                 read_only: Sequence[int | str] = (), track_stores: Sequence[int] = (), **kwargs):
    """Run the learner's function, or Triton kernel when ``grid`` is given: ``fn[grid](*args)``.

    Every checker runs learner code through here, inside the safety net
    (:mod:`kvlab.course.checking.sandbox`). Tensors written in place are visible to the caller
    afterwards; the return value is passed back. ``layout`` names the programs and the parts of
    the outputs in what the safety net reports. ``read_only`` lists the arguments (positions in
    ``args``, or keyword names) that the exercise's statement says the code must only read:
    each is compared after the call with a copy made before it (:mod:`kvlab.course.checking.inputs`), and
    a change is named with the argument. A kernel is first compiled for a GPU, once per kernel
    source (:mod:`kvlab.course.checking.compiled`): a refusal is raised (in the interpreter, after the
    run, unless the interpreter raises too: its error is told as usual). Inside
    :func:`run_cases` a memory finding or a changed input is told after the comparison (which
    names the wrong part); outside, it is raised at once. ``track_stores`` (positions of
    kernel arguments): in the interpreter, the audit keeps every store into them, with the
    program and the line that made it, for :func:`last_stores`.
    """
    global _LAST_SENTINELS, _LAST_STORES
    attempt = _ATTEMPT
    refused = compiled.problem(fn, args, kwargs) if grid is not None else None
    if refused and not runtime.INTERPRET:  # on a GPU the launch would only fail to compile too
        raise CheckFailed(refused, label="compile")
    frozen = inputs.freeze_args(sandbox.param_names(fn), args, kwargs, read_only)
    out = sandbox.guarded_call(fn, args, kwargs, grid, keep_worker=attempt is not None,
                               order=attempt.order if attempt is not None else Order(),
                               interpret=attempt is not None and attempt.interpret,
                               track=tuple(_names(fn, track_stores)))
    _LAST_SENTINELS, _LAST_STORES = out.sentinels, out.stores
    if refused and out.error is None:  # an error the interpreter raises too is told as before
        raise CheckFailed(refused, label="compile")
    if attempt is not None:
        attempt.programs = max(attempt.programs, out.programs)
    found = []
    if out.accesses:
        err = CheckFailed(findings.message(out.accesses, layout or Layout()),
                          label="memory outside a tensor")
        err.band_writes = out.band_writes
        err.accesses = out.accesses
        found.append(err)
    changes = [(f.name, how) for f in frozen if (how := inputs.first_change(f))]
    if changes and out.error is None:
        found.append(CheckFailed(inputs.message(changes, frozen), label="read-only argument changed"))
    for err in found:
        if attempt is None:
            if out.error is not None:
                err.extend(f"\n  and then: {out.error}")
            raise err from out.error
        attempt.pending.append(err)
    if out.error is not None:
        raise out.error
    return out.value


def pending_findings() -> list[CheckFailed]:
    """What the safety net filed in the case running now (empty outside :func:`run_cases`)."""
    return list(_ATTEMPT.pending) if _ATTEMPT is not None else []


@contextlib.contextmanager
def second_look() -> Iterator[None]:
    """Calls of learner code that only help tell a failure's cause: not filed with the case."""
    global _ATTEMPT
    outer, _ATTEMPT = _ATTEMPT, _Attempt(_ATTEMPT.order if _ATTEMPT else Order(), bool(_ATTEMPT and _ATTEMPT.interpret))
    try:
        yield
    finally:
        _ATTEMPT = outer


def last_stores() -> tuple:
    """The audit's :class:`~kvlab.course.checking.audit.Store` records of the latest call's tracked
    arguments (empty outside the interpreter's audit)."""
    return _LAST_STORES


def _names(fn, positions: Sequence[int]) -> list[str]:
    names = sandbox.param_names(fn)
    return [names[i] if i < len(names) else f"argument {i + 1}" for i in positions]


def looks_like(got: torch.Tensor, slips: dict[str, Callable[[], torch.Tensor]], atol: float) -> str:
    """``"\n  looks like <slip>"`` when exactly one known slip's output ``make()`` matches ``got``
    (within ``atol``), else ``""`` (:mod:`kvlab.course.checking.slips`: a checker names only the mistake it
    is sure of)."""
    return slips_recognised(got, slips, close(atol))
