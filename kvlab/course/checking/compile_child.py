"""The child Python that compiles learner kernels for a GPU (:mod:`kvlab.course.checking.compiled`).

Started as::

    python kvlab/course/checking/compile_child.py <in_fd> <out_fd> <workdir> <backend,arch,warp_size>

without ``TRITON_INTERPRET`` and without importing kvlab (whose import turns the interpreter on
where there is no GPU): only the standard library, Triton, and the ``shipping`` and ``pipes``
modules of ``kvlab.check``, loaded from their files. Each request is a kernel by source (as the
safety net sends one to a spawned child), its launch's signature and constexprs; the answer is
:func:`verdict`. It first compiles a small kernel of its own; if that fails, the compiler cannot
run here, it says so once (``ready: False``) and is asked nothing, so that a broken tool is never
blamed on the learner. This module imports only the standard library.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import re
import sys
import textwrap
from pathlib import Path

_PROBE = textwrap.dedent('''
    import triton
    import triton.language as tl


    @triton.jit
    def kvlab_probe(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        total = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
        for start in range(0, n, BLOCK):
            total += tl.sum(tl.load(x_ptr + start + offs, mask=start + offs < n, other=0), axis=0)
        tl.store(x_ptr, total)
''')


def verdict(kernel, signature: dict, constexprs: dict, target: tuple) -> dict:
    """``{"ok": True}``, or what the compiler said: ``{"ok": False, "complaint": ..., "line":
    (the kernel's file line, or None), "stage": "front end" or "back end"}``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError

    try:
        triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                       target=GPUTarget(*target))
    except CompilationError as e:
        return {"ok": False, "stage": "front end", "complaint": _complaint(e),
                "line": _line(kernel, e)}
    except Exception as e:  # noqa: BLE001 - a later stage (layouts, LLVM, ptxas) refused it
        return {"ok": False, "stage": "back end", "complaint": f"{type(e).__name__}: {e}"[:1500],
                "line": None}
    return {"ok": True}


def _complaint(e) -> str:
    """The compiler's own words: the innermost error, without Triton's source excerpt."""
    inner = e
    while isinstance(inner.__cause__, Exception):
        inner = inner.__cause__
    if inner is not e and not hasattr(inner, "node"):
        return f"{type(inner).__name__}: {inner}" if str(inner) else type(inner).__name__
    text = str(getattr(inner, "error_message", None) or inner).strip()
    wrapped = re.fullmatch(r"\w+(?:Error|Exception)\((['\"])(.*)\1\)", text, re.S)
    return wrapped.group(2) if wrapped else text


def _line(kernel, e) -> int | None:
    """The line of the kernel's file the compiler points at (the outermost node in the kernel)."""
    node = getattr(e, "node", None)
    lineno = getattr(node, "lineno", None)
    fn = getattr(kernel, "fn", None)
    if lineno is None or fn is None:
        return None
    import inspect

    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    def_at = next((i for i, text in enumerate(lines) if text.lstrip().startswith("def ")), 0)
    return first + def_at + lineno - 1


# --- the child's side ---------------------------------------------------------------------------


def _sibling(name: str):
    """A module of kvlab.check loaded from its file alone (no package import: no torch, no kvlab)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"kvlab_compile_child_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _probe(workdir: Path, target: tuple) -> str | None:
    """None when a small known-good kernel compiles here, else why not."""
    path = workdir / "kvlab_probe.py"
    path.write_text(_PROBE)
    try:
        spec = importlib.util.spec_from_file_location("kvlab_probe", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        answer = verdict(module.kvlab_probe, {"x_ptr": "*i64", "n": "i32", "BLOCK": "constexpr"},
                         {"BLOCK": 16}, target)
    except Exception as e:  # noqa: BLE001 - no compiler here
        return f"{type(e).__name__}: {e}"
    return None if answer["ok"] else answer["complaint"]


def main() -> None:
    in_fd, out_fd, workdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    target = tuple(sys.argv[4].split(","))
    target = (target[0], int(target[1]), int(target[2]))
    pipes, shipping = _sibling("pipes"), _sibling("shipping")
    broken = _probe(workdir, target)
    pipes.send_msg(out_fd, pickle.dumps({"ready": broken is None, "why": broken}))
    built: dict = {}
    while True:
        data, _ = pipes.recv_msg(in_fd, None)
        if data is None:
            return
        ask = pickle.loads(data)
        try:
            kernel = shipping.rebuild(shipping.from_plain(ask["kernel"]), workdir, built)
        except Exception as e:  # noqa: BLE001 - it cannot be rebuilt here: no verdict
            answer = {"ok": None, "why": f"{type(e).__name__}: {e}"}
        else:
            answer = verdict(kernel, ask["signature"], ask["constexprs"], target)
        pipes.send_msg(out_fd, pickle.dumps(answer))


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: compiled, not interpreted
    main()
