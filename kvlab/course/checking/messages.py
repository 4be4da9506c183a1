"""Words for what happened in learner code: its own traceback lines, a crash, a CUDA error."""
from __future__ import annotations

import linecache
import os
import re
import signal
import traceback

_LIBRARY_PATH = re.compile(r"(site-packages|dist-packages|/lib/python\d)")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')
#: kvlab's own files (the checkers, and the package code a learner's function may call)
_KVLAB = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).replace(os.sep, "/") + "/"  # kvlab/


def is_learner_frame(filename: str) -> bool:
    """A frame of the learner's code: not Python's library, an installed package or kvlab."""
    path = filename.replace(os.sep, "/")
    return not (_LIBRARY_PATH.search(path) or os.path.abspath(filename).replace(os.sep, "/")
                .startswith(_KVLAB))


def learner_traceback(e: BaseException) -> str:
    """The frames of the learner's own code (notebook cells, their modules), then the error."""
    lines = []
    cause = e
    seen = set()
    while cause is not None and id(cause) not in seen:  # InterpreterError wraps the real one
        seen.add(id(cause))
        for fs in traceback.extract_tb(cause.__traceback__):
            if is_learner_frame(fs.filename):
                lines.append(f"  in {fs.name}, line {fs.lineno}: {(fs.line or '').strip()}")
        cause = cause.__cause__ or cause.__context__
    innermost = e
    while innermost.__cause__ is not None:
        innermost = innermost.__cause__
    out = list(dict.fromkeys(lines))
    if innermost is not e:
        out.append(f"  (inner error: {type(innermost).__name__}: {innermost})")
    return "\n".join(out)


#: what torch says when tensors of two devices meet (torch 2.x, CUDA and CPU wordings)
_DEVICE_MIX = re.compile(r"same device|not on the expected device|different from other tensors on")
#: ... and when a float tensor is used as an index
_FLOAT_INDEX = re.compile(r"tensors used as indices must be long")
#: the advice both end with: the same slip (a tensor made without dtype= and device=) shows as
#: the one or the other, by the device the check runs on
NEW_ENTRIES_ADVICE = ("make new entries from an input tensor x -- x.new_zeros(n), "
                      "x.new_full((n,), value) -- which keep its dtype and device")


def torch_error_hint(summary: str) -> str:
    """A line of advice for a torch error (``"RuntimeError: ..."``) a common slip causes, or "".

    ``torch.zeros(n)`` (or ``ones``, ``full``, ``empty``) without ``dtype=`` and ``device=``
    makes a float32 tensor on the CPU: beside a GPU's inputs torch refuses the mix of devices
    first, beside a CPU's it refuses the float index -- one slip, one piece of advice."""
    if _DEVICE_MIX.search(summary):
        why = ("tensors of two devices meet: a tensor your code made is not on the inputs' device "
               "(torch.zeros(n), torch.ones(n), torch.full(...) make CPU tensors unless told device=), "
               "or arithmetic mixes a CPU tensor with a GPU one (+=, +, *: only an assignment, "
               "x[i] = y, copies from one device to the other)")
    elif _FLOAT_INDEX.search(summary):
        why = ("an index tensor is float (torch.zeros(n), torch.ones(n), torch.full(...) make float32 "
               "unless told dtype=, and torch.cat of int64 and float32 is float32)")
    else:
        return ""
    return f"\n  hint: {why}: {NEW_ENTRIES_ADVICE}"


def is_cuda_error(e: BaseException) -> bool:
    """An error that leaves the process's CUDA context unusable (illegal address, device assert)."""
    text = f"{type(e).__name__}: {e}"
    return "CUDA error" in text or "AcceleratorError" in text or "illegal memory access" in text


def crash_message(signal_number: int | None, exit_code: int | None, crash_text: str,
                  renames: dict[str, str] | None = None) -> str:
    """What to tell the learner when the child process running their code died."""
    if signal_number is not None:
        try:
            name = signal.Signals(signal_number).name
        except ValueError:
            name = f"signal {signal_number}"
        what = f"your code crashed the process running it (signal {name})"
    else:
        what = f"the child process running your code exited with status {exit_code}"
    msg = (f"{what}: most likely an unmasked load or store far outside a tensor, or an "
           "index computed from garbage. Your notebook is fine: the crash happened in a "
           "separate process.")
    where = []
    for m in _FRAME.finditer(crash_text):  # most recent call first
        file = (renames or {}).get(m["file"], m["file"])
        if file.replace(os.sep, "/").endswith(("kvlab/course/checking/runner.py", "kvlab/course/checking/sandbox.py")):
            break  # frames from here on are the checker calling the learner's code
        if is_learner_frame(file):
            src = linecache.getline(file, int(m["line"])).strip()
            where.append(f"  in {m['name']}, line {m['line']}" + (f": {src}" if src else ""))
    if where:
        msg += "\n  It was running:\n" + "\n".join(dict.fromkeys(where))
    return msg


def cuda_error_message(summary: str, traceback_text: str) -> str:
    return (f"your code hit a CUDA error on the GPU ({summary.strip()}): most likely a load or "
            "store outside a tensor (mask every tl.load / tl.store whose offsets can reach past "
            "the data), or an index out of range. It happened in a separate process: your "
            "notebook's GPU is fine." + (f"\n{traceback_text}" if traceback_text.strip() else ""))


def timeout_message(seconds: float) -> str:
    return (f"your code did not finish within {seconds:.0f} s and was stopped. Look for a loop "
            "that never ends, or a grid far larger than intended.")
