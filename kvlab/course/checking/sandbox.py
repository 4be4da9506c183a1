"""The safety net around learner code: guard bands, the audit, and a child process.

:func:`kvlab.course.checking.core.call_learner` runs every piece of learner code through
:func:`guarded_call`, which returns what the code returned and what the net saw (an
:class:`Outcome`); the checker decides what to say. The net has three layers:

* **guard bands** (:mod:`kvlab.course.checking.guards`): every tensor argument is handed over as a
  view into a larger buffer with sentinels at both ends, so a stray access just outside it
  is noticed, and nothing outside the buffer is touched;
* **the audit** (:mod:`kvlab.course.checking.audit`, Triton's interpreter only): every load and store of
  a kernel is checked as it happens, named (read or write, which argument, which program and
  line), and a wild one is switched off before it touches memory;
* **a child process** (:mod:`kvlab.course.checking.workers`), so that a crash or a hang is a readable
  failure instead of a dead notebook::

      where                          which child                    why
      interpreter, Linux             a fork, one per checker run    cheap; inherits the code
      CUDA tensors (a GPU)           a spawned Python, kept         forking after CUDA is unsafe;
                                     for the session                an illegal address kills
                                                                    only the child's context
      objects with state, methods    none (in this process)         their changes must stay
      macOS/Windows, interpreter     none (in this process)         no fork; bands still guard

``KVLAB_SANDBOX`` chooses: ``auto`` (the table), ``spawn`` (a spawned child wherever a child
is possible, also in the interpreter), ``fork``, ``inprocess`` (guard bands and audit, no
child: e.g. to use a debugger) or ``off`` (nothing at all).

On a GPU, checker runs (:func:`kvlab.course.checking.core.run_cases`) also run each kernel case again in
Triton's interpreter, in a second spawned child, under the audit (the *audit pass*): compiled
code cannot see a read whose value is never stored, nor a race that this GPU happened to win.
``KVLAB_AUDIT=0`` leaves it out.

What it costs per check: a spawned child starts once per session (a Python importing torch
and kvlab, then its CUDA init: seconds), each new kernel compiles once in it, and every call
sends its tensors both ways through a pipe (milliseconds). A forked child costs a fork per
checker run. ``python tools/gpu_check_sandbox.py`` measures each of these, side by side with
the same kernel run in this process.
"""
from __future__ import annotations

import atexit
import inspect
import io
import os
import sys
from typing import Any, Callable, NamedTuple

import torch

from ...base import runtime
from .audit import Order, Store
from .failures import CheckFailed, LearnerRaised
from .findings import Access, merge
from .guards import (BandWrite, Sentinel, band_accesses, band_writes, copy_back, guard_tensors,
                     sentinel_reads)
from .messages import cuda_error_message
from .runner import apply_containers, invoke
from .shipping import CannotShip, ship
from .walk import from_refs, is_plain_data, replace_tensors, tensors_in
from .workers import ForkWorker, SpawnWorker

MODES = ("auto", "spawn", "fork", "inprocess", "off")


class Outcome(NamedTuple):
    """What a guarded call returned and what the safety net saw."""

    value: Any
    accesses: list[Access]  # memory accesses outside the arguments, the first one first
    band_writes: list[BandWrite]  # for the failure picture
    sentinels: list[Sentinel]  # to explain odd values afterwards
    error: BaseException | None = None  # what the learner's code raised (or the crash)
    programs: int = 0  # programs in the kernel's grid (0: not a kernel)
    where: str = "inprocess"  # "inprocess", "fork" or "spawn"
    stores: tuple = ()  # the audit's Store records of the tracked arguments


def mode() -> str:
    setting = os.environ.get("KVLAB_SANDBOX", "auto").strip().lower().replace("-", "")
    if setting in ("off", "0", "false", "no"):
        return "off"
    return setting if setting in MODES else "auto"


def can_fork() -> bool:
    """A forked child is used only on Linux, in the interpreter, with CUDA never started."""
    return (sys.platform.startswith("linux") and hasattr(os, "fork") and runtime.INTERPRET
            and not torch.cuda.is_initialized())


def param_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s positional parameters (a kernel's too), as its author wrote them."""
    target = getattr(fn, "fn", fn)  # a @triton.jit kernel keeps the Python function in .fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _child_kind(fn, grid, args, kwargs, tensors) -> str:
    """Where this call runs: "fork", "spawn" or "inprocess" (see the module's table)."""
    setting = mode()
    if setting == "inprocess":
        return "inprocess"
    bound_to = getattr(fn, "__self__", None)  # a method's object is state a child cannot hand back
    plain = is_plain_data((args, kwargs)) and (bound_to is None or inspect.ismodule(bound_to))
    if grid is None and not plain:
        return "inprocess"
    on_cuda = any(t.device.type == "cuda" for _, t in tensors)
    if setting == "spawn" or on_cuda:
        return "spawn"
    if can_fork():
        return "fork"
    return "spawn" if setting == "fork" and not runtime.INTERPRET else "inprocess"


def audit_pass_enabled() -> bool:
    """On a GPU, whether checkers run each kernel case again in Triton's interpreter (a spawned
    child) under the audit. ``KVLAB_AUDIT=0`` turns it off; so do ``inprocess`` and ``off``."""
    return (not runtime.INTERPRET and mode() in ("auto", "spawn", "fork")
            and os.environ.get("KVLAB_AUDIT", "1").strip() not in ("0", "off", "no", "false"))


def guarded_call(fn: Callable[..., Any], args: tuple, kwargs: dict, grid=None, *,
                 keep_worker: bool = False, order: Order | None = Order(),
                 interpret: bool = False, track: tuple[str, ...] = ()) -> Outcome:
    """Run ``fn(*args, **kwargs)`` (or ``fn[grid](...)``) inside the safety net.

    Tensors written in place are copied back into the caller's tensors, and a returned view
    of an argument is the caller's own tensor. ``keep_worker``: keep a forked child for the
    next call of the same function (a checker run). ``order``: the order of the grid's
    programs in the interpreter (``None``: no audit). ``interpret``: on a GPU, run a kernel in
    Triton's interpreter instead (a spawned child), under the audit (``where="interpreter"``).
    ``track``: arguments whose in-bounds stores the audit keeps (``Outcome.stores``).
    """
    programs = _grid_size(grid, fn, args, kwargs)
    if mode() == "off":
        try:
            value = fn[grid](*args, **kwargs) if grid is not None else fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the checker reports it
            return Outcome(None, [], [], [], e, programs, "inprocess")
        return Outcome(value, [], [], [], None, programs, "inprocess")

    names = param_names(fn)
    found = [pair for i, a in enumerate(args)
             for pair in tensors_in(a, names[i] if i < len(names) else f"argument {i + 1}")]
    found += [pair for k, a in kwargs.items() for pair in tensors_in(a, k)]
    named = list({id(t): (n, t) for n, t in reversed(found)}.values())[::-1]  # each tensor once
    guards = guard_tensors(named)
    views = guards.views()
    mapping = {id(t): v for (_, t), v in zip(named, views)}
    call = {"args": replace_tensors(tuple(args), mapping),
            "kwargs": replace_tensors(dict(kwargs), mapping), "grid": grid,
            "buffers": [g.buffer for g in guards.storages], "views": views,
            "names": [g.names[0] for g in guards.storages],
            "spans": [g.span for g in guards.storages], "order": order, "track": track}
    where = _child_kind(fn, grid, args, kwargs, named)
    accesses: list[Access] = []
    value, error = None, None
    try:
        if interpret and grid is not None and not runtime.INTERPRET and where == "spawn":
            value, done = _run_spawned(fn, call, guards, accesses, interpret=True)
            where = "interpreter" if done == "spawn" else where
        if where == "fork":
            value = _run_forked(fn, call, guards, keep_worker, accesses)
        elif where == "spawn":
            value, where = _run_spawned(fn, call, guards, accesses, diagnose=not keep_worker)
        if where == "inprocess":
            value = invoke(fn, call, accesses)
    except Exception as e:  # noqa: BLE001 - the learner's error, or the child's crash
        error = e
    stores = tuple(a for a in accesses if isinstance(a, Store))
    accesses = [a for a in accesses if not isinstance(a, Store)]
    value = replace_tensors(value, {id(v): t for (_, t), v in zip(named, views)})
    copy_back(guards)
    writes = band_writes(guards)
    originals = {id(t) for _, t in named}
    returned = [(n, t) for n, t in tensors_in(value, "return value") if id(t) not in originals]
    seen = merge(accesses + band_accesses(writes) + sentinel_reads(guards, returned))
    if seen:
        close_worker()  # a stray store may have hit the child's own memory: start afresh
    return Outcome(value, seen, writes, guards.sentinels(), error, programs, where, stores)


def _grid_size(grid, fn, args, kwargs) -> int:
    if grid is None:
        return 0
    if callable(grid):
        try:
            grid = grid(dict(zip(param_names(fn), args), **kwargs))
        except Exception:  # noqa: BLE001 - the launch itself will say what is wrong
            return 1
    size = 1
    for n in tuple(grid):
        size *= int(n)
    return size


# --- children -----------------------------------------------------------------------------------

_WORKER: ForkWorker | None = None  # the fork kept for the current checker run
_STARTED = {
    False: "kvlab.check: your code runs in a separate process, so that a crash cannot take this "
           "notebook's GPU with it (started in {:.1f} s, once per session; "
           "KVLAB_SANDBOX=inprocess runs it here instead)",
    True: "kvlab.check: kernels are also checked in Triton's interpreter, which sees every load "
          "and store (started in {:.1f} s, once per session; KVLAB_AUDIT=0 skips it)",
}
_SPAWNED: dict[bool, SpawnWorker] = {}  # spawned children, by interpreter mode, kept


def close_worker() -> None:
    """End the forked child kept for the current checker run (a checker run ends with this)."""
    global _WORKER
    if _WORKER is not None:
        _WORKER.close()
        _WORKER = None


def close_spawned() -> None:
    """End the spawned children (they are otherwise kept for the session)."""
    for worker in _SPAWNED.values():
        worker.close()
    _SPAWNED.clear()


atexit.register(close_spawned)


def _answer(answer: dict, call: dict, guards, accesses: list) -> Any:
    """Apply a child's answer to this process's buffers and arguments; its return value."""
    accesses += answer.get("accesses", [])
    if answer["stdout"]:
        sys.stdout.write(answer["stdout"])
    if answer["stderr"]:
        sys.stderr.write(answer["stderr"])
    if answer["status"] == "raised":
        if answer.get("fatal"):
            raise CheckFailed(cuda_error_message(answer["summary"], answer["traceback"]),
                              label="crash")
        raise LearnerRaised(f"your code raised {answer['summary']}\n{answer['traceback']}",
                            original=answer.get("exception"), traceback_text=answer["traceback"])
    for g, contents in zip(guards.storages, answer["buffers"]):
        g.buffer.copy_(contents)
    apply_containers(call["args"], call["kwargs"], answer["containers"])
    return from_refs(answer["ret"], call["views"])


def _run_forked(fn, call: dict, guards, keep: bool, accesses: list) -> Any:
    global _WORKER
    worker, blob = None, None
    if keep and _WORKER is not None and _WORKER.fn is fn and _WORKER.alive:
        try:
            buf = io.BytesIO()
            torch.save(call, buf)  # one save: views keep sharing their buffers' memory
            worker, blob = _WORKER, buf.getvalue()
        except Exception:  # noqa: BLE001 - e.g. a lambda grid: start a child that inherits it
            worker = None
    if worker is None:
        close_worker()
        worker = ForkWorker(fn, call)
        if keep:
            _WORKER = worker
    try:
        answer = worker.call(blob)
    except BaseException:
        if _WORKER is worker:
            _WORKER = None
        raise
    finally:
        if not keep:
            worker.close()
    return _answer(answer, call, guards, accesses)


def _run_spawned(fn, call: dict, guards, accesses: list,
                 interpret: bool | None = None, diagnose: bool = False) -> tuple[Any, str]:
    """Run in the session's spawned child (``interpret``: the one running Triton's interpreter;
    default: the runtime's own kind); ``(value, "spawn")``, or ``(None, "inprocess")`` when the
    function cannot be sent there (then it runs here, as before). ``diagnose``: after a CUDA
    error in a kernel, find the stray access in the interpreter (checkers do that themselves)."""
    interpret = runtime.INTERPRET if interpret is None else interpret
    try:
        shipped = ship(fn)
    except CannotShip:
        return None, "inprocess"
    if callable(call["grid"]):
        call = {**call, "grid": tuple(call["grid"](
            dict(zip(param_names(fn), call["args"]), **call["kwargs"])))}
    worker = _SPAWNED.get(interpret)
    if worker is None or not worker.alive:
        try:
            worker = _SPAWNED[interpret] = SpawnWorker(interpret)
        except CheckFailed:
            if interpret == runtime.INTERPRET:
                raise
            return None, "inprocess"  # no interpreter child for the audit pass: skip it
        if not runtime.INTERPRET:  # on a GPU: say once why the first check takes seconds
            print(_STARTED[interpret].format(worker.startup_s))
    try:
        answer = worker.call_fn(shipped.key(), shipped, call)
    except BaseException:
        _SPAWNED.pop(interpret, None)
        raise
    if answer.get("fatal"):  # the child's CUDA context is gone: the next call gets a new one
        worker.close()
        _SPAWNED.pop(interpret, None)
        if call["grid"] is not None and not interpret and diagnose:
            found = diagnose_in_interpreter(shipped, call)
            accesses += found
            if found:
                answer["traceback"] += ("\n  (the accesses above were found by running the same "
                                        "call again in Triton's interpreter, which checks each one)")
    return _answer(answer, call, guards, accesses), "spawn"


def diagnose_in_interpreter(shipped, call: dict) -> list[Access]:
    """After a CUDA error in a kernel: run the same call in Triton's interpreter (a spawned
    child), where the audit names each access outside an argument. Empty if that fails too."""
    try:
        worker = _SPAWNED.get(True)
        if worker is None or not worker.alive:
            worker = _SPAWNED[True] = SpawnWorker(interpret=True)
        answer = worker.call_fn(shipped.key(), shipped, {**call, "order": Order()})
    except Exception:  # noqa: BLE001 - a diagnosis is a bonus
        _SPAWNED.pop(True, None)
        return []
    return list(answer.get("accesses", []))
