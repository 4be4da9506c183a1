"""What only compiled Triton refuses: every learner kernel is also compiled for a GPU.

Triton's interpreter runs a kernel's Python as it is, so it accepts code that the compiler
refuses. The classic one: a loop-carried variable whose type changes (``carry = 0``, an int32,
then ``carry += tl.sum(x)`` with an int64 ``x``) runs in the interpreter and is a
``CompilationError`` on a GPU. So the first time a checker launches a kernel,
:func:`problem` compiles it with Triton's own compiler for a GPU,
``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))``
(an H100/H200; no GPU is needed to compile), and tells a refusal in the learner's terms, with
their line (in the interpreter, unless the interpreter raises too: then its error is told, as
before). It compiles in a child Python (:mod:`kvlab.course.checking.compile_child`, kept for the session),
for two reasons: in the interpreter, Triton's own library (``tl.sum``, ...) became interpreted
Python when this process imported it, which the compiler cannot use; and on a GPU, a compiler
that crashes on odd code (an LLVM assertion aborts the process) takes only the child with it,
as the safety net's children do for a crashing kernel::

    runtime        compiled for
    interpreter    sm_90 (TARGET)
    GPU            this GPU

Once per kernel source: the verdict is kept, so a checker run compiles a kernel at most once,
with the arguments of its first launch (constexpr values included), and a second checker of the
same kernel (chapter 03's three parts) not at all. kvlab's own kernels are skipped (a GPU run of
the tests compiles them). When the compiler cannot run (no CUDA backend in this Triton, a kernel
that cannot travel to the child), nothing is reported: a broken tool is never the learner's
fault. ``KVLAB_GPU_COMPILE=0`` turns the check off.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import linecache
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ...base import runtime
from .pipes import recv_msg, send_msg
from .shipping import ship, to_plain

#: the GPU the interpreter's kernels are compiled for: (backend, compute capability, warp size)
TARGET = ("cuda", 90, 32)
TIMEOUT_S = float(os.environ.get("KVLAB_GPU_COMPILE_TIMEOUT", "120"))
_DTYPES = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
           torch.uint8: "u8", torch.bool: "i1", torch.float64: "fp64", torch.float32: "fp32",
           torch.float16: "fp16", torch.bfloat16: "bf16"}
_VERDICTS: dict[str, str | None] = {}  # kernel (source and what it refers to) -> the problem, or None


def enabled() -> bool:
    return os.environ.get("KVLAB_GPU_COMPILE", "1").strip().lower() not in ("0", "off", "no", "false")


def problem(kernel, args: tuple, kwargs: dict) -> str | None:
    """Why ``kernel`` does not compile for a GPU, in the learner's terms; None when it does
    (or when that cannot be found out here)."""
    if not enabled() or not hasattr(kernel, "fn"):
        return None
    try:
        shipped = ship(kernel)
    except Exception:  # noqa: BLE001 - CannotShip, or anything odd: no verdict, never a crash
        return None
    if shipped.reference is not None:  # kvlab's own kernel
        return None
    key = shipped.key()
    if key not in _VERDICTS:
        types = signature(kernel.fn, args, kwargs)
        try:
            answer = _compile_in_child(shipped, *types) if types is not None else None
        except Exception:  # noqa: BLE001 - the child could not start: no verdict
            answer = None
        _VERDICTS[key] = _words(answer, kernel.fn) if answer and answer.get("ok") is False else None
    return _VERDICTS[key]


def _is_constexpr(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return "constexpr" in str(text)


def signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict] | None:
    """Triton's ``(signature, constexprs)`` for a launch with these arguments, or None."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    given = dict(zip(params, args), **kwargs)
    types, constants = {}, {}
    for name, p in params.items():
        value = given.get(name, p.default)
        if value is inspect.Parameter.empty:
            return None
        if _is_constexpr(p.annotation) or value is None:
            types[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _DTYPES:
                return None
            types[name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            types[name] = "fp32"
        else:
            return None
    return types, constants


def _target() -> tuple:
    """(backend, arch, warp size): this GPU's, or TARGET in the interpreter."""
    if runtime.INTERPRET:
        return TARGET
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
        return (target.backend, target.arch, target.warp_size)
    except Exception:  # noqa: BLE001 - no driver after all: the interpreter's target
        return TARGET


# --- the child --- ---------------------------------------------------------------


class _Child:
    """A Python compiling kernels for ``target`` (``(backend, arch, warp size)``; by default
    ``_target()``, see :mod:`kvlab.course.checking.compile_child`)."""

    def __init__(self, target: tuple | None = None):
        self.workdir = Path(tempfile.mkdtemp(prefix="kvlab-compile-"))
        to_r, self.to_child = os.pipe()
        self.from_child, from_w = os.pipe()
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVLAB_INTERPRET")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("compile_child.py")), str(to_r),
             str(from_w), str(self.workdir), ",".join(map(str, target or _target()))],
            pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=env)
        os.close(to_r)
        os.close(from_w)
        hello = self.ask(None)
        self.ready = bool(hello and hello.get("ready"))

    def ask(self, request: dict | None) -> dict | None:
        try:
            if request is not None:
                send_msg(self.to_child, pickle.dumps(request))
            data, _ = recv_msg(self.from_child, TIMEOUT_S)
            return pickle.loads(data) if data is not None else None
        except (OSError, pickle.PickleError, EOFError):
            return None

    def close(self) -> None:
        for fd in (self.to_child, self.from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)


_CHILD: _Child | None = None


def _compile_in_child(shipped, types: dict, constants: dict) -> dict | None:
    global _CHILD
    if _CHILD is None or _CHILD.proc.poll() is not None:
        _CHILD = _Child()
    if not _CHILD.ready:
        return None
    answer = _CHILD.ask({"kernel": to_plain(shipped), "signature": types, "constexprs": constants})
    if answer is None:  # no answer in time, or the child died: start afresh next time
        _CHILD.close()
        _CHILD = None
    return answer


def close_child() -> None:
    global _CHILD
    if _CHILD is not None:
        _CHILD.close()
        _CHILD = None


atexit.register(close_child)


# --- the compiler's complaint, in the learner's terms ------------------------------------------

_LOOP = re.compile(r"Loop-carried variable (\w+) has initial type (\w+) but is re-assigned to "
                   r"(\w+)")
_BRANCHES = re.compile(r"Mismatched type for (\w+) between then block \((\w+)\) and else "
                       r"block \((\w+)\)")
_REDEFINED = re.compile(r"initial value for `(\w+)` is of type (\w+)\[\], but the (then|else) "
                        r"block redefines it as (\w+)\[\]")
_UNSUPPORTED = re.compile(r"unsupported AST node type: (\w+)")
_TL_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
             "i1": "int1"}
_CONSTRUCT = {"Break": "break", "Continue": "continue", "Try": "try", "With": "with",
              "Lambda": "lambda", "ListComp": "a list comprehension", "Yield": "yield"}


def _assigned_before(fn, name: str, line: int) -> str:
    """" (line 53: carry = 0)" for the last plain assignment of ``name`` above ``line``."""
    filename = fn.__code__.co_filename
    pattern = re.compile(rf"^\s*{re.escape(name)}\s*(:[^=]*)?=[^=]")
    for n in range(line - 1, max(0, fn.__code__.co_firstlineno - 1), -1):
        text = linecache.getline(filename, n)
        if pattern.match(text):
            return f" (line {n}: {text.split('#')[0].strip()})"
    return ""


def _explain(fn, complaint: str, line: int | None) -> str:
    m = _LOOP.search(complaint)
    if m:
        name, first, later = m.groups()
        where = _assigned_before(fn, name, line) if line else ""
        zero = ("write 0.0, not 0" if later.startswith(("fp", "bf")) else
                f"an {later} zero is tl.sum(tl.zeros([BLOCK], dtype=tl.{_TL_NAMES.get(later, later)}), "
                "axis=0), with your kernel's block size")
        return (f"In words: `{name}` is carried from one loop iteration to the next, so it must "
                f"keep one type; it enters the loop as {first}{where} and an iteration makes it "
                f"{later}. Give it type {later} before the loop ({zero}), or keep what you add "
                f"in {first}.")
    m = _REDEFINED.search(complaint)
    if m:
        name, first, branch, later = m.groups()
        where = _assigned_before(fn, name, line) if line else ""
        return (f"In words: `{name}` is {first} before the `if`{where} and the {branch} branch "
                f"makes it {later}; compiled code needs one type after the if: give it type "
                f"{later} before the if, or convert with .to(tl.{_TL_NAMES.get(first, first)}).")
    m = _BRANCHES.search(complaint)
    if m:
        name, a, b = m.groups()
        return (f"In words: `{name}` gets type {a} in the `if` branch and {b} in the `else` "
                "branch; compiled code needs one type after the if: convert one with .to(...).")
    m = _UNSUPPORTED.search(complaint)
    if m:
        what = _CONSTRUCT.get(m.group(1), m.group(1))
        return (f"In words: compiled Triton has no {what} inside a kernel (the interpreter runs "
                "the kernel as plain Python, so it accepted it).")
    return ""


def _words(answer: dict, fn) -> str:
    """The message for a kernel the compiler refused."""
    line = answer.get("line")
    where = f"line {line} of {fn.__name__}" if line else fn.__name__
    src = linecache.getline(fn.__code__.co_filename, line).strip() if line else ""
    if runtime.INTERPRET:
        head = (f"your kernel runs in Triton's interpreter but does not compile for a GPU: "
                f"Triton's compiler (for an sm_{TARGET[1]} GPU) refuses {where}")
        tail = "\n  The interpreter does not check this; a GPU does. Fix it, then check again."
    else:
        head = f"your kernel does not compile for a GPU: Triton's compiler refuses {where}"
        tail = ""
    why = _explain(fn, answer["complaint"], line)
    return (head + (f":\n    {src}" if src else "") + f"\n  {answer['complaint']}"
            + (f"\n  {why}" if why else "") + tail)
