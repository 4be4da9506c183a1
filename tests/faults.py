"""Injected failures, for "a call that fails half-way leaves no trace" tests and the state machines.

* :class:`Boom` (an error) and :class:`Interrupted` (a ``KeyboardInterrupt``: a learner pressing
  stop) are what the injections raise;
* :func:`failing` wraps a callable so that its k-th call fails, before or after doing its work;
* :func:`interrupt_at_line` raises :class:`Interrupted` at the k-th line a function runs (by
  ``sys.settrace``), so a test can interrupt a method between *any* two of its lines; given
  modules instead, at the k-th line run by any of their functions, so a test can interrupt a
  call anywhere in everything it calls there (:func:`lines_run` counts them).
"""
from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Callable


class Boom(RuntimeError):
    """An injected error."""


class Interrupted(KeyboardInterrupt):
    """An injected interrupt."""


def failing(fn: Callable, k: int = 0, *, after: bool = False, error: type = Boom) -> Callable:
    """``fn``, except that its ``k``-th call (from 0) raises ``error``: before doing anything,
    or ``after`` doing its work (the effect happened, the caller never hears of it)."""
    calls = [0]

    def wrapper(*args, **kwargs):
        n = calls[0]
        calls[0] += 1
        if n != k:
            return fn(*args, **kwargs)
        if after:
            fn(*args, **kwargs)
        raise error(f"injected into call {k} of {getattr(fn, '__name__', fn)}")
    return wrapper


def _traced(where) -> Callable:
    """A test of frames: those of ``where`` (a function, a method, or a module, or a list of them:
    every function of a module counts)."""
    codes, files = set(), set()
    for item in where if isinstance(where, (list, tuple)) else [where]:
        if isinstance(item, ModuleType):
            files.add(item.__file__)
        else:
            codes.add(inspect.unwrap(getattr(item, "__func__", item)).__code__)
    return lambda frame: frame.f_code in codes or frame.f_code.co_filename in files


@contextmanager
def interrupt_at_line(where, k: int, *, error: type = None):
    """Within the block, raise :class:`Interrupted` (once; or ``error``) when the frames of
    ``where`` reach their ``k``-th line (from 1; other callees run untraced). ``where``: a function
    (a decorated one is unwrapped), or modules (every function defined there). Yields a list whose
    only item is the number of lines seen: fewer than ``k`` means the block ran to the end
    uninterrupted."""
    error = error or Interrupted
    traced = _traced(where)
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                raise error(f"line {frame.f_lineno} of {frame.f_code.co_name}")
        return local

    def calls(frame, event, arg):
        return local if traced(frame) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield seen
    finally:
        sys.settrace(previous)


def lines_run(where, call: Callable) -> int:
    """How many lines the frames of ``where`` run during ``call()`` (uninterrupted)."""
    with interrupt_at_line(where, -1) as seen:
        call()
    return seen[0]


@contextmanager
def patched(obj, name: str, replacement):
    """Within the block, ``obj.name`` is ``replacement`` (set on the instance; put back after)."""
    had, old = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


class FailingKernel:
    """A Triton kernel whose launch fails: ``kernel[grid](...)`` raises ``error``, before the
    kernel runs or after (it ran; the host never hears of it)."""

    def __init__(self, kernel, *, after: bool, error: type = Boom):
        self.kernel, self.after, self.error = kernel, after, error

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.after:
                self.kernel[grid](*args, **kwargs)
            raise self.error("injected into a kernel launch")
        return launch
