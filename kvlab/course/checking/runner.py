"""How one call of learner code runs: here, or inside a child process.

A *call* is a dict: the guarded ``args``/``kwargs`` and ``grid``, the guard ``buffers`` with the
``views`` handed out, the storages' ``names`` and ``spans`` (for the audit) and the program
``order`` (``None``: no audit). :func:`invoke` runs it in this process; in a child,
:func:`serve` runs it and answers with what the code left behind::

    parent (notebook)                          child (kvlab.course.checking.workers starts it)
    guard buffers + views  --- call --------->  invoke(fn, call): a kernel under the audit
    copy the buffers back  <-- answer --------  buffers, return value, lists, findings, prints
    next call              --- call --------->  (the same child, warm)
    end                    --- pipe closed --->  exits

A forked child inherits the function (:func:`fork_main`); a spawned one is sent it by source
and rebuilds it (:func:`spawned_main`, :mod:`kvlab.course.checking.shipping`).
"""
from __future__ import annotations

import contextlib
import faulthandler
import io
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ...base import runtime
from .audit import Audit, audited, extents_of
from .guards import BAND
from .messages import is_cuda_error, learner_traceback
from .pipes import recv_msg, send_msg
from .shipping import file_names, rebuild
from .walk import has_tensor, to_refs

def invoke(fn, call: dict, accesses: list):
    """Run ``call`` in this process; a kernel in the interpreter runs under the audit.

    Stray accesses the audit saw go into ``accesses`` (also when the code then raises).
    """
    args, kwargs, grid = call["args"], call["kwargs"], call["grid"]
    audit = None
    if grid is not None and runtime.INTERPRET and call.get("order") is not None:
        audit = Audit(extents_of(call["buffers"], call["names"], call["spans"], BAND),
                      call["order"], call.get("track", ()))
    cuda = [b.device for b in call["buffers"] if b.device.type == "cuda"]
    try:
        with audited(audit) if audit is not None else contextlib.nullcontext(), (
                torch.cuda.device(cuda[0]) if cuda else contextlib.nullcontext()), (
                warnings.catch_warnings() if grid is not None else contextlib.nullcontext()):
            if grid is not None:
                # NaN or inf in a kernel makes the interpreter's numpy warn, line after line,
                # before the checker's message; that message says what went wrong instead
                warnings.simplefilter("ignore", RuntimeWarning)
                fn[grid](*args, **kwargs)
                ret = None  # a launch returns no result (compiled Triton hands back its kernel handle)
            else:
                ret = fn(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        return ret
    finally:
        if audit is not None:
            accesses += audit.accesses + audit.stores  # the stores of tracked arguments too


# --- lists and dicts the learner's code changes ------------------------------------------------

_MUTABLE = (list, dict, set, bytearray)


def mutable_containers(args, kwargs) -> dict:
    """Top-level list/dict/set arguments (without tensors) as the learner's code left them."""
    found = {}
    for key, value in [*enumerate(args), *kwargs.items()]:
        if type(value) in _MUTABLE and not has_tensor(value):
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001 - e.g. a lambda inside: cannot travel, skip it
                continue
            found[key] = value
    return found


def apply_containers(args, kwargs, after: dict) -> None:
    """Apply a child's changes to list/dict/set arguments to the caller's own objects."""
    for key, value in after.items():
        target = args[key] if isinstance(key, int) else kwargs[key]
        if isinstance(target, (list, bytearray)):
            target[:] = value
        elif isinstance(target, (dict, set)):
            target.clear()
            target.update(value)


# --- the child's side ---------------------------------------------------------------------------


def serve(fn, call: dict, renames: dict[str, str] | None = None) -> bytes:
    """Run one call in a child; the pickled answer for the parent."""
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    accesses: list = []
    renames = renames or {}
    try:
        try:
            ret = invoke(fn, call, accesses)
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            answer = _raised(e, renames)
        else:
            answer = {"status": "ok", "ret": to_refs(ret, call["views"]),
                      "buffers": [b.cpu() for b in call["buffers"]],
                      "containers": mutable_containers(call["args"], call["kwargs"])}
            try:
                pickle.dumps(answer["ret"])
            except Exception as e:  # noqa: BLE001 - e.g. a lambda in the return value
                answer = _raised(TypeError(f"the return value could not be sent back from the "
                                           f"child process ({e}); return tensors, numbers or "
                                           "lists of them"), renames)
        answer["accesses"] = [a._replace(filename=renames.get(a.filename, a.filename))
                              for a in accesses]
        answer["stdout"], answer["stderr"] = out.getvalue(), err.getvalue()
        return pickle.dumps(answer)
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


def _raised(e: BaseException, renames: dict[str, str]) -> dict:
    try:
        pickle.dumps(e)
        exc = e
    except Exception:  # noqa: BLE001
        exc = None
    trace = learner_traceback(e)
    for temp, original in renames.items():
        trace = trace.replace(temp, original)
    return {"status": "raised", "summary": f"{type(e).__name__}: {e}", "traceback": trace,
            "exception": exc, "fatal": is_cuda_error(e)}


def _child_setup(crash_log) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files for planted crashes
    except Exception:  # noqa: BLE001
        pass
    faulthandler.enable(file=crash_log, all_threads=False)
    torch.set_num_threads(1)


def fork_main(fn, first: dict, in_fd: int, out_fd: int, crash_log) -> int:
    _child_setup(crash_log)
    call = first
    while True:
        if call is None:
            data, _ = recv_msg(in_fd, None)
            if data is None:  # the parent closed the pipe: done
                return 0
            call = torch.load(io.BytesIO(data), weights_only=False)
        send_msg(out_fd, serve(fn, call))
        call = None


def spawned_main() -> None:
    """Entry point of a spawned child: ``python -c ... <in_fd> <out_fd> <workdir>``."""
    in_fd, out_fd, workdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    _child_setup(sys.stderr)
    started = time.perf_counter()
    if not runtime.INTERPRET:
        torch.zeros(1, device=runtime.DEVICE)  # start CUDA now: part of the start-up cost
    send_msg(out_fd, pickle.dumps({"ready": True, "cuda_init_s": time.perf_counter() - started}))
    built: dict = {}
    functions: dict[str, Any] = {}
    renames: dict[str, str] = {}
    while True:
        data, _ = recv_msg(in_fd, None)
        if data is None:
            return
        call = torch.load(io.BytesIO(data), weights_only=False,
                          map_location="cpu" if runtime.INTERPRET else None)
        key, shipped = call.pop("fn")
        if shipped is not None:
            functions[key] = rebuild(shipped, workdir, built)
            renames.update(file_names(shipped, workdir))
        send_msg(out_fd, serve(functions[key], call, renames))
