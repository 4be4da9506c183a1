"""The safety net around learner code: a child process and guard bands.

Used by every "your turn" cell of the course (chapters 01-06) through
:func:`kvlab.check.core.call_learner`; importing :mod:`kvlab.check` installs
:func:`guarded_call` there.

Two things can go wrong with a learner's Triton kernel that a plain comparison never sees:

* **It crashes.** In Triton's interpreter an unmasked load or store far outside a tensor
  touches raw host memory: a segfault kills the Jupyter kernel and every variable with it.
  So, in the interpreter on Linux, the call runs in a *forked child process*: the child
  inherits the kernel object defined in the notebook, runs it, and sends the final contents
  of every tensor argument (and the return value) back over a pipe. A crash, a Python
  exception or a hang (``TIMEOUT_S``) in the child becomes a :class:`CheckFailed` in the
  parent, and the notebook keeps running.
* **It touches memory just outside a tensor.** That rarely crashes; it silently corrupts a
  neighbour. So every tensor argument is copied into a larger *guard buffer* whose ends
  hold sentinel values, and the learner gets a view of the middle::

      guard buffer of `free_pages` (int64, BAND elements each side)
      ┌──────── before band ────────┬───── the real data ─────┬──────── after band ────────┐
      │ -7777 -7777 ... -7777 -7777 │ 4  9  2  7  ...         │ -8277 -8277 ... -8277 -8277│
      └─────────────────────────────┴─────────────────────────┴────────────────────────────┘
                                    ^ the learner's tensor is a view starting here

  After the call a changed sentinel means a *write outside* the tensor (reported with the
  argument's name and how far out it went); a sentinel value turning up inside another
  tensor means a *read outside* (reported with the name of the tensor it came from, and the
  side: every argument gets its own before/after sentinels).

Inside one checker run (:func:`kvlab.check.core.run_cases`) the same child serves every
case of the same learner function, so Triton's interpreter stays warm; it ends with the run,
or at the first crash or memory finding.

Where a child process is not used: on CUDA (forking after CUDA is initialised is unsafe;
the call runs in-process, with guard bands), on macOS/Windows (no safe ``fork``: in-process
with guard bands), and for Python functions that are methods of an object or receive
objects other than plain data (tensors, numbers, strings and lists/tuples/dicts of them) -
a child could not hand the changes it makes to such objects back, so those run in-process
(with guard bands on their tensors). Changes a child makes to list, dict and set
arguments are copied back into the caller's objects; changes to *global* state of the
notebook stay in the child: checkers pass everything as arguments. ``KVLAB_SANDBOX=inprocess`` forces in-process runs (e.g. to use a
debugger); ``KVLAB_SANDBOX=off`` turns the safety net off altogether.
"""
from __future__ import annotations

import faulthandler
import inspect
import io
import linecache
import os
import pickle
import re
import select
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from .. import runtime
from .core import CheckFailed

#: Elements of guard band on each side of every tensor argument.
BAND = 128
#: Seconds a learner call may take in the child process before it is stopped.
TIMEOUT_S = float(os.environ.get("KVLAB_SANDBOX_TIMEOUT", "60"))

_MAX_SENTINEL_SLOTS = 24  # distinct sentinel pairs; arguments beyond that share them


class LearnerRaised(CheckFailed):
    """The learner's code raised. ``original`` is the exception (when it could be sent back)."""

    def __init__(self, message: str, *, original: BaseException | None = None,
                 traceback_text: str = ""):
        self.original = original
        self.traceback_text = traceback_text
        super().__init__(message)


class Sentinel(NamedTuple):
    """One guard value: which argument's band it fills, on which side, as raw integer bits."""

    argument: str
    side: str  # "before" or "after"
    bits: int  # the value seen through the integer view of the buffer
    is_float: bool
    width: int  # bytes per element

    def describe(self) -> str:
        if self.is_float:
            return f"NaN with guard bit pattern {self.bits & 0xFFFFFFFFFFFFFFFF:#x}"
        return str(self.bits)


# --- sentinel values -----------------------------------------------------------------------

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_view_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The signed integer dtype of the same width, through which sentinels are written and read."""
    if dtype.is_complex:
        return None
    return _INT_VIEW.get(torch.empty((), dtype=dtype).element_size())


def sentinel_bits(slot: int, dtype: torch.dtype) -> tuple[int, int]:
    """The (before, after) sentinel bits for the ``slot``-th guarded argument of ``dtype``.

    Integers get negative values no slot or page index can have (-7777, -8277, -8777, ...);
    floats get quiet NaNs with a recognisable payload, so that arithmetic on them is loud too.
    """
    slot %= _MAX_SENTINEL_SLOTS
    width = torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point:
        payload = 0x60 + 2 * slot if width >= 4 else 1 + 2 * slot
        base = {2: 0x7FC0, 4: 0x7FC01E00, 8: 0x7FF8000000001E00}[width]
        return base | payload, base | (payload + 1)
    if width == 1:
        return -70 - 2 * slot, -71 - 2 * slot
    return -7777 - 1000 * slot, -8277 - 1000 * slot


# --- guard buffers -------------------------------------------------------------------------


@dataclass
class GuardedStorage:
    """One guard buffer: a copy of the part of a storage that the arguments in it use."""

    names: list[str]
    original_flat: torch.Tensor  # the caller's memory [lo, hi) as a 1-D tensor
    buffer: torch.Tensor  # BAND + (hi - lo) + BAND elements
    span: int
    before: Sentinel
    after: Sentinel
    int_dtype: torch.dtype | None

    @property
    def label(self) -> str:
        first = f"`{self.names[0]}`"
        if len(self.names) > 1:
            first += " (memory shared with " + ", ".join(f"`{n}`" for n in self.names[1:]) + ")"
        return first

    def bands(self) -> tuple[torch.Tensor, torch.Tensor]:
        ints = self.buffer.view(self.int_dtype)
        return ints[:BAND], ints[BAND + self.span:]


@dataclass
class GuardedArg:
    name: str
    original: torch.Tensor
    view: torch.Tensor  # what the learner gets
    initial: torch.Tensor  # a copy of the original contents, to tell new values from old
    storage: GuardedStorage


@dataclass
class Guards:
    storages: list[GuardedStorage] = field(default_factory=list)
    args: list[GuardedArg] = field(default_factory=list)

    def sentinels(self) -> list[Sentinel]:
        out = []
        for g in self.storages:
            out += [g.before, g.after]
        return out


def _extent(t: torch.Tensor) -> int:
    """How many elements of storage a view reaches: 1 + sum((size-1) * stride)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr(), t.dtype)


def guard_tensors(named: list[tuple[str, torch.Tensor]]) -> tuple[Guards, list[torch.Tensor]]:
    """Copy every tensor into a guard buffer; return the guards and the views to hand out.

    Tensors that share memory (same storage and dtype) share one guard buffer, so a write
    through one is still seen through the other. Strides are kept: a learner kernel that is
    given ``page_table.stride(0)`` still indexes the same way.
    """
    guards = Guards()
    groups: dict[Any, list[int]] = {}
    for i, (_, t) in enumerate(named):
        groups.setdefault(_storage_key(t), []).append(i)
    views: list[torch.Tensor | None] = [None] * len(named)
    for slot, idxs in enumerate(groups.values()):
        tensors = [named[i][1] for i in idxs]
        dtype, device = tensors[0].dtype, tensors[0].device
        lo = min(t.storage_offset() for t in tensors)
        hi = max(t.storage_offset() + _extent(t) for t in tensors)
        hi = max(hi, lo)
        span = hi - lo
        original_flat = torch.empty(0, dtype=dtype, device=device).set_(
            tensors[0].untyped_storage(), lo, (span,), (1,))
        buffer = torch.empty(BAND + span + BAND, dtype=dtype, device=device)
        int_dtype = _int_view_dtype(dtype)
        names = [named[i][0] for i in idxs]
        is_float = dtype.is_floating_point
        width = buffer.element_size()
        if int_dtype is not None:
            b_bits, a_bits = (_signed(b, int_dtype) for b in sentinel_bits(slot, dtype))
            ints = buffer.view(int_dtype)
            ints[:BAND] = b_bits
            ints[BAND + span:] = a_bits
        else:  # complex: no sentinel, but the band still absorbs small overruns
            b_bits = a_bits = 0
            buffer.zero_()
        before = Sentinel(names[0], "before", b_bits, is_float, width)
        after = Sentinel(names[0], "after", a_bits, is_float, width)
        buffer[BAND:BAND + span] = original_flat
        g = GuardedStorage(names, original_flat, buffer, span, before, after, int_dtype)
        guards.storages.append(g)
        for i in idxs:
            name, t = named[i]
            view = buffer.as_strided(t.shape, t.stride(), buffer.storage_offset() + BAND
                                     + t.storage_offset() - lo)
            views[i] = view
            guards.args.append(GuardedArg(name, t, view, t.detach().clone(), g))
    return guards, views  # type: ignore[return-value]


def _signed(bits: int, int_dtype: torch.dtype | None) -> int:
    if int_dtype is None:
        return 0
    width = torch.empty((), dtype=int_dtype).element_size() * 8
    bits &= (1 << width) - 1
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def copy_back(guards: Guards) -> None:
    """Copy the middle of every guard buffer back into the caller's memory."""
    for g in guards.storages:
        if g.span:
            g.original_flat.copy_(g.buffer[BAND:BAND + g.span])


class BandWrite(NamedTuple):
    """Writes into one side of one argument's guard band (for the failure picture)."""

    argument: str
    side: str  # "before" or "after"
    distances: list[int]  # how far outside, 1 = the element right next to the data
    length: int  # elements of real data


def band_writes(guards: Guards) -> list[BandWrite]:
    """Every side of every guard band that changed, with the distances of the changed elements."""
    found = []
    for g in guards.storages:
        if g.int_dtype is None:
            continue
        before, after = g.bands()
        changed_before = (before != g.before.bits).nonzero().flatten().tolist()
        changed_after = (after != g.after.bits).nonzero().flatten().tolist()
        if changed_before:
            found.append(BandWrite(g.names[0], "before", [BAND - i for i in changed_before], g.span))
        if changed_after:
            found.append(BandWrite(g.names[0], "after", [i + 1 for i in changed_after], g.span))
    return found


def band_violations(guards: Guards) -> list[str]:
    """One line per argument whose guard band changed: which side, how many, how far out."""
    lines = []
    for g in guards.storages:
        if g.int_dtype is None:
            continue
        before, after = g.bands()
        changed_before = (before != g.before.bits).nonzero().flatten()
        changed_after = (after != g.after.bits).nonzero().flatten()
        if changed_before.numel():
            far = BAND - int(changed_before.min())
            lines.append(
                f"{g.label}: {changed_before.numel()} value(s) written before its start, "
                f"up to {far} element(s) before it" + (" (the whole guard band: it may have gone "
                                                       "further)" if far >= BAND else ""))
        if changed_after.numel():
            far = int(changed_after.max()) + 1
            lines.append(
                f"{g.label}: {changed_after.numel()} value(s) written past the end, "
                f"up to {far} element(s) out" + (" (the whole guard band: it may have gone "
                                                  "further)" if far >= BAND else ""))
    return lines


def _sentinel_hits(values: torch.Tensor, sentinels: list[Sentinel],
                   new_only: torch.Tensor | None = None):
    """(index tuple, sentinel) for every element of ``values`` equal to some sentinel's bits."""
    int_dtype = _int_view_dtype(values.dtype)
    if int_dtype is None or values.numel() == 0:
        return []
    ints = values.detach().view(int_dtype) if values.dim() else values.detach().reshape(1).view(int_dtype)
    hits = []
    for s in sentinels:
        if s.is_float != values.dtype.is_floating_point:
            continue
        if s.is_float and s.width != values.element_size():
            continue  # a float pattern only survives a copy at the same width
        if _signed(s.bits, int_dtype) != s.bits:  # does not fit this integer width
            continue
        mask = ints == s.bits
        if new_only is not None:
            mask &= new_only
        for idx in mask.nonzero().tolist()[:3]:
            hits.append((tuple(idx), s))
    return hits


def _fmt_index(name: str, idx: tuple) -> str:
    return f"{name}[{', '.join(map(str, idx))}]" if idx else name


def wild_reads(guards: Guards, returned: list[tuple[str, torch.Tensor]] = ()) -> list[str]:
    """Lines naming output values that are guard sentinels: the code read outside a tensor."""
    sentinels = guards.sentinels()
    lines = []
    for a in guards.args:
        int_dtype = _int_view_dtype(a.view.dtype)
        if int_dtype is None or a.view.numel() == 0:
            continue
        new = a.view.view(int_dtype) != a.initial.view(int_dtype)
        for idx, s in _sentinel_hits(a.view, sentinels, new):
            lines.append(_read_line(_fmt_index(a.name, idx), s))
    for name, t in returned:
        for idx, s in _sentinel_hits(t, sentinels):
            lines.append(_read_line(_fmt_index(name, idx), s))
    return lines


def _read_line(where: str, s: Sentinel) -> str:
    side = "past the end of" if s.side == "after" else "before the start of"
    return (f"`{where}` holds the guard sentinel {s.describe()}: your code read {side} "
            f"`{s.argument}`")


# --- explaining wrong values after the fact -----------------------------------------------

#: The sentinels of the latest guarded call (so checkers can explain odd values).
LAST_SENTINELS: list[Sentinel] = []


def explain_value(value: int) -> str | None:
    """If an integer looks like (or computed from) a guard sentinel of the last call, say whose.

    A kernel that reads ``free_pages`` one past its end gets -8277 and then may compute
    ``-8277 * page_size + k``; both are recognised here.
    """
    value = int(value)
    for s in LAST_SENTINELS:
        if s.is_float:
            continue
        side = "past the end of" if s.side == "after" else "before the start of"
        if value == s.bits:
            return (f"{value} is the guard sentinel of `{s.argument}`: your code read {side} "
                    f"`{s.argument}`")
        derived = abs(value - s.bits) <= 64 or any(
            value // (1 << k) == s.bits for k in range(1, 17))
        if derived:
            return (f"{value} looks computed from the guard sentinel {s.bits} of "
                    f"`{s.argument}`: your code probably read {side} `{s.argument}`")
    return None


# --- naming arguments ---------------------------------------------------------------------


def _param_names(fn: Callable) -> list[str]:
    target = getattr(fn, "fn", fn)  # a @triton.jit kernel keeps the Python function in .fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _collect(obj, name: str, out: list, plain: list[bool]):
    """Find tensors inside ``obj`` (lists/tuples/dicts walked); note whether all is plain data."""
    if isinstance(obj, torch.Tensor):
        out.append((name, obj))
    elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for i, x in enumerate(obj):
            _collect(x, f"{name}[{i}]", out, plain)
    elif isinstance(obj, dict) and type(obj) is dict:
        for k, x in obj.items():
            _collect(x, f"{name}[{k!r}]", out, plain)
    elif type(obj) in (set, frozenset):
        for x in obj:
            _collect(x, f"{name} element", out, plain)
    elif isinstance(obj, tuple):  # NamedTuples: immutable, walk their fields
        for k, x in zip(getattr(obj, "_fields", range(len(obj))), obj):
            _collect(x, f"{name}.{k}" if isinstance(k, str) else f"{name}[{k}]", out, plain)
    elif not isinstance(obj, _PLAIN) and not callable(obj):
        plain[0] = False


def _has_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(x) for x in obj)
    if type(obj) is dict:
        return any(_has_tensor(x) for x in obj.values())
    return False


def _substitute(obj, mapping: dict[int, torch.Tensor]):
    """``obj`` with every tensor replaced by ``mapping[id(tensor)]``.

    Containers holding tensors are rebuilt; all others are passed as they are (the same
    object), so that a learner's changes to a list or dict argument reach the caller.
    """
    if isinstance(obj, torch.Tensor):
        return mapping.get(id(obj), obj)
    if not _has_tensor(obj):
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_substitute(x, mapping) for x in obj)
    if type(obj) is dict:
        return {k: _substitute(x, mapping) for k, x in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_substitute(x, mapping) for x in obj))
    return obj


# --- running --------------------------------------------------------------------------------


def _mode() -> str:
    setting = os.environ.get("KVLAB_SANDBOX", "auto").strip().lower()
    if setting in ("off", "0", "false", "no"):
        return "off"
    if setting in ("inprocess", "in-process"):
        return "inprocess"
    return "auto"


def can_fork() -> bool:
    """A child process is used only on Linux, in the interpreter, with CUDA untouched."""
    return (sys.platform.startswith("linux") and hasattr(os, "fork") and runtime.INTERPRET
            and not torch.cuda.is_initialized())


def _invoke(fn, args, kwargs, grid):
    return fn[grid](*args, **kwargs) if grid is not None else fn(*args, **kwargs)


def guarded_call(fn: Callable[..., Any], *args, grid=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` (or ``fn[grid](...)``) inside the safety net.

    Returns what the learner's code returns; tensors written in place are copied back into
    the caller's tensors. Raises :class:`CheckFailed` for a crash, a hang, an exception in a
    child process, a write outside a tensor or a read outside one.
    """
    mode = _mode()
    if mode == "off":
        return _invoke(fn, args, kwargs, grid)

    names = _param_names(fn)
    found: list[tuple[str, torch.Tensor]] = []
    plain = [True]
    for i, a in enumerate(args):
        _collect(a, names[i] if i < len(names) else f"argument {i + 1}", found, plain)
    for k, a in kwargs.items():
        _collect(a, k, found, plain)
    # one entry per distinct tensor object (the same tensor passed twice is guarded once)
    seen: dict[int, int] = {}
    named: list[tuple[str, torch.Tensor]] = []
    for name, t in found:
        if id(t) not in seen:
            seen[id(t)] = len(named)
            named.append((name, t))
    guards, views = guard_tensors(named)
    LAST_SENTINELS[:] = guards.sentinels()
    mapping = {id(t): v for (_, t), v in zip(named, views)}
    g_args = _substitute(tuple(args), mapping)
    g_kwargs = _substitute(dict(kwargs), mapping)

    # a method's object (e.g. a prefix cache) is state the child could not hand back
    bound_to = getattr(fn, "__self__", None)
    plain_fn = bound_to is None or inspect.ismodule(bound_to)
    use_child = (mode == "auto" and can_fork() and (grid is not None or (plain[0] and plain_fn))
                 and all(t.device.type == "cpu" for _, t in named))
    if use_child:
        ret = _run_in_child(fn, g_args, g_kwargs, grid, guards)
    else:
        ret = _invoke(fn, g_args, g_kwargs, grid)
        if any(t.device.type == "cuda" for _, t in named):
            torch.cuda.synchronize()

    # returned tensors that are the views we handed out become the caller's own tensors
    back = {id(v): t for (_, t), v in zip(named, views)}
    ret = _substitute(ret, back)
    copy_back(guards)

    problems = band_violations(guards)
    returned: list[tuple[str, torch.Tensor]] = []
    _collect(ret, "return value", returned, [True])
    returned = [(n, t) for n, t in returned if id(t) not in {id(o) for _, o in named}]
    problems += wild_reads(guards, returned)
    if problems:
        close_worker()  # a stray store may have hit the child's own memory: start afresh
        advice = ("Mask every tl.load / tl.store whose offsets can reach past the data "
                  "(mask=offs < n), and check the index you compute for each program.")
        from . import core

        # inside a checker this is raised after the comparison, which names the part
        err = CheckFailed("the safety net caught memory accesses outside the tensors:\n  "
                          + "\n  ".join(problems) + "\n  " + advice,
                          label="memory outside a tensor")
        err.band_writes = band_writes(guards)  # drawn by kvlab.check.picture
        core.report_or_defer(err)
    return ret


class _ArgRef(NamedTuple):
    index: int


# --- the child process ------------------------------------------------------------------------
#
#   parent (notebook)                              child (a fork of the notebook)
#   guard buffers + views  --- 1st call: inherited by fork --->  runs fn, sends the answer back
#   checker compares       <-- answer: buffers, return, lists --
#   next case (same fn)    --- request over a pipe ---------->  runs fn again (warm interpreter)
#   end of the checker     --- pipe closed ------------------>  exits
#
# Inside one checker run (run_cases) the child is kept for the next call of the same function:
# forking and warming up Triton's interpreter cost more than most calls. Outside a checker, or
# after a crash or a memory finding, every call gets a fresh child.


class _Worker:
    """A child process running one learner function, call after call."""

    def __init__(self, fn, first_request: dict):
        self.fn = fn
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.crash_log = tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # ---- child: never returns ----
            code = 1
            try:
                os.close(to_child_w)
                os.close(from_child_r)
                code = _worker_main(fn, first_request, to_child_r, from_child_w, self.crash_log)
            finally:
                os._exit(code)
        os.close(to_child_r)
        os.close(from_child_w)
        self.pid, self.to_child, self.from_child = pid, to_child_w, from_child_r
        self.alive = True

    def call(self, request_blob: bytes | None) -> dict:
        """Send a request (None: the first one, inherited at fork) and wait for the answer."""
        try:
            if request_blob is not None:
                _send_msg(self.to_child, request_blob)
            data, timed_out = _recv_msg(self.from_child, TIMEOUT_S)
        except BrokenPipeError:
            data, timed_out = None, False
        except BaseException:  # e.g. KeyboardInterrupt in the notebook: do not leave the child
            self.kill()
            raise
        answer = None
        if data is not None:
            try:
                answer = pickle.loads(data)
            except Exception:  # noqa: BLE001 - a truncated message from a dying child
                answer = None
        if answer is None:
            self.fail(timed_out)
        return answer

    def fail(self, timed_out: bool):
        if timed_out:
            os.kill(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        self.crash_log.seek(0)
        crash_text = self.crash_log.read().decode(errors="replace")
        self._close_fds()
        if timed_out:
            raise CheckFailed(
                f"your code did not finish within {TIMEOUT_S:.0f} s and was stopped. Look for a "
                "loop that never ends, or a grid far larger than intended.", label="timeout")
        raise CheckFailed(_crash_message(status, crash_text), label="crash")

    def kill(self):
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._close_fds()

    def close(self):
        """Close the pipe: the child exits; it is reaped later (exiting takes tens of ms)."""
        if self.alive:
            self._close_fds()
            _ZOMBIES.append(self.pid)
            _reap()

    def _close_fds(self):
        self.alive = False
        for fd in (self.to_child, self.from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        self.crash_log.close()


_WORKER: _Worker | None = None  # the child kept for the current checker run


def close_worker() -> None:
    """End the child kept for the current checker run (``run_cases`` calls this at its end)."""
    global _WORKER
    if _WORKER is not None:
        _WORKER.close()
        _WORKER = None


def _in_checker() -> bool:
    from . import core

    return core._PENDING is not None


def _run_in_child(fn, g_args, g_kwargs, grid, guards: Guards):
    global _WORKER
    request = {"args": g_args, "kwargs": g_kwargs, "grid": grid,
               "buffers": [g.buffer for g in guards.storages],
               "views": [a.view for a in guards.args]}
    keep = _in_checker()
    worker, blob = None, None
    if keep and _WORKER is not None and _WORKER.fn is fn and _WORKER.alive:
        try:
            buf = io.BytesIO()
            torch.save(request, buf)  # one save: views keep sharing their buffers' memory
            worker, blob = _WORKER, buf.getvalue()
        except Exception:  # noqa: BLE001 - e.g. a lambda grid: start a child that inherits it
            worker = None
    if worker is None:
        close_worker()
        worker = _Worker(fn, request)
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

    if answer["stdout"]:
        sys.stdout.write(answer["stdout"])
    if answer["stderr"]:
        sys.stderr.write(answer["stderr"])
    if answer["status"] == "raised":
        raise LearnerRaised(
            f"your code raised {answer['summary']}\n{answer['traceback']}",
            original=answer.get("exception"), traceback_text=answer["traceback"])
    for g, contents in zip(guards.storages, answer["buffers"]):
        g.buffer.copy_(contents)
    _update_containers(g_args, g_kwargs, answer["containers"])
    return _resolve_refs(answer["ret"], {i: a.view for i, a in enumerate(guards.args)})


_ZOMBIES: list[int] = []  # finished children not yet reaped


def _reap() -> None:
    for pid in list(_ZOMBIES):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _ZOMBIES.remove(pid)


def _resolve_refs(obj, views: dict[int, torch.Tensor]):
    if isinstance(obj, _ArgRef):
        return views[obj.index]
    if type(obj) in (list, tuple):
        return type(obj)(_resolve_refs(x, views) for x in obj)
    if type(obj) is dict:
        return {k: _resolve_refs(x, views) for k, x in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_resolve_refs(x, views) for x in obj))
    return obj


def _make_refs(obj, views: list[torch.Tensor]):
    """Returned tensors that are argument views travel as references, not copies."""
    if isinstance(obj, torch.Tensor):
        for i, v in enumerate(views):
            if obj is v or (obj.data_ptr() == v.data_ptr() and obj.shape == v.shape
                            and obj.stride() == v.stride() and obj.dtype == v.dtype):
                return _ArgRef(i)
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_make_refs(x, views) for x in obj)
    if type(obj) is dict:
        return {k: _make_refs(x, views) for k, x in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_make_refs(x, views) for x in obj))
    return obj


_MUTABLE = (list, dict, set, bytearray)


def _mutable_containers(g_args, g_kwargs) -> dict:
    """Top-level list/dict/set arguments (without tensors) as the learner's code left them."""
    found = {}
    for key, value in [*enumerate(g_args), *g_kwargs.items()]:
        if type(value) in _MUTABLE and not _has_tensor(value):
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001 - e.g. a lambda inside: cannot travel, skip it
                continue
            found[key] = value
    return found


def _update_containers(g_args, g_kwargs, after: dict) -> None:
    """Apply the child's changes to list/dict/set arguments to the caller's own objects."""
    for key, value in after.items():
        target = g_args[key] if isinstance(key, int) else g_kwargs[key]
        if isinstance(target, (list, bytearray)):
            target[:] = value
        elif isinstance(target, (dict, set)):
            target.clear()
            target.update(value)


def _worker_main(fn, request, in_fd: int, out_fd: int, crash_log) -> int:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files for planted crashes
    except Exception:  # noqa: BLE001
        pass
    faulthandler.enable(file=crash_log, all_threads=False)
    torch.set_num_threads(1)  # the parent's OpenMP pool did not survive the fork
    while True:
        if request is None:
            data, _ = _recv_msg(in_fd, None)
            if data is None:  # the parent closed the pipe: done
                return 0
            request = torch.load(io.BytesIO(data), weights_only=False)
        _send_msg(out_fd, _serve(fn, request))
        request = None


def _serve(fn, request: dict) -> bytes:
    """Run one call in the child; the pickled answer for the parent."""
    g_args, g_kwargs = request["args"], request["kwargs"]
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    try:
        ret = _invoke(fn, g_args, g_kwargs, request["grid"])
        answer = {"status": "ok", "ret": _make_refs(ret, request["views"]),
                  "buffers": request["buffers"],
                  "containers": _mutable_containers(g_args, g_kwargs)}
        try:
            return pickle.dumps({**answer, "stdout": out.getvalue(), "stderr": err.getvalue()})
        except Exception as e:  # noqa: BLE001 - e.g. a lambda in the return value
            raise TypeError(f"the return value could not be sent back from the child process "
                            f"({e}); return tensors, numbers or lists of them") from e
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        summary = f"{type(e).__name__}: {e}"
        tb = _learner_traceback(e)
        try:
            pickle.dumps(e)
            exc = e
        except Exception:  # noqa: BLE001
            exc = None
        return pickle.dumps({"status": "raised", "summary": summary, "traceback": tb,
                             "exception": exc, "stdout": out.getvalue(),
                             "stderr": err.getvalue()})
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


def _send_msg(fd: int, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _recv_exact(fd: int, n: int, deadline: float | None) -> tuple[bytes | None, bool]:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, True
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None, False  # the other side is gone
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks), False


def _recv_msg(fd: int, timeout: float | None) -> tuple[bytes | None, bool]:
    """One length-prefixed message: (data, timed_out); data None when the other side is gone."""
    deadline = None if timeout is None else time.monotonic() + timeout
    head, timed_out = _recv_exact(fd, 8, deadline)
    if head is None:
        return None, timed_out
    return _recv_exact(fd, int.from_bytes(head, "little"), deadline)


# --- messages ---------------------------------------------------------------------------------

_LIBRARY_PATH = re.compile(r"(site-packages|dist-packages|/lib/python\d|kvlab/check/)")


def _is_learner_frame(filename: str) -> bool:
    return not _LIBRARY_PATH.search(filename.replace(os.sep, "/"))


def _learner_traceback(e: BaseException) -> str:
    """The frames of the learner's own code (notebook cells, their modules), then the error."""
    lines = []
    cause = e
    seen = set()
    while cause is not None and id(cause) not in seen:  # InterpreterError wraps the real one
        seen.add(id(cause))
        for fs in traceback.extract_tb(cause.__traceback__):
            if _is_learner_frame(fs.filename):
                lines.append(f"  in {fs.name}, line {fs.lineno}: {(fs.line or '').strip()}")
        cause = cause.__cause__ or cause.__context__
    innermost = e
    while innermost.__cause__ is not None:
        innermost = innermost.__cause__
    out = "\n".join(dict.fromkeys(lines))
    if innermost is not e:
        out += f"\n  (inner error: {type(innermost).__name__}: {innermost})"
    return out


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


def _crash_message(status: int, crash_text: str) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signame = signal.Signals(sig).name
        except ValueError:
            signame = f"signal {sig}"
        what = f"the kernel crashed the interpreter (signal {signame})"
    else:
        what = f"the child process running your code exited with status {os.WEXITSTATUS(status)}"
    msg = (f"{what}: most likely an unmasked load or store far outside a tensor, or an "
           "index computed from garbage. Your notebook is fine: the crash happened in a "
           "separate process.")
    where = []
    for m in _FRAME.finditer(crash_text):  # most recent call first
        if m["file"].replace(os.sep, "/").endswith("kvlab/check/sandbox.py"):
            break  # frames from here on are the checker calling the learner's code
        if _is_learner_frame(m["file"]):
            src = linecache.getline(m["file"], int(m["line"])).strip()
            where.append(f"  in {m['name']}, line {m['line']}" + (f": {src}" if src else ""))
    if where:
        msg += "\n  It was running:\n" + "\n".join(dict.fromkeys(where))
    return msg


def install() -> None:
    """Route :func:`kvlab.check.core.call_learner` through :func:`guarded_call`."""
    from . import core

    core._CALL_LEARNER_IMPL = guarded_call
