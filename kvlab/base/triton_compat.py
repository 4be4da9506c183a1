"""Known problems of Triton's interpreter with the NumPy beside it, and kvlab's fixes for them.

kvlab runs every kernel in Triton's interpreter when there is no GPU. The interpreter is
plain Python over NumPy arrays, so a NumPy release can break an older Triton. kvlab keeps a
table of such pairs (:data:`KNOWN_ISSUES`). For each one it either applies a small fix when
it is imported (the same change Triton itself made later, applied only to the versions that
need it) or, where no fix exists, :func:`kvlab.runtime_report` says so in plain words with
the command that mends it.

The one known today:

* **Triton < 3.7 with NumPy >= 2.4** (triton-lang/triton issue 9171, fixed in Triton 3.7 by
  PR 9172). The interpreter turns a scalar inside a kernel into a Python int with
  ``int(array)`` on a one-element array, which NumPy 2.4 refuses ("only 0-dimensional arrays
  can be converted to Python scalars"). Any kernel whose loop bound is a runtime value
  (``for start in range(0, n, BLOCK)``) fails. The fix squeezes the array to zero dimensions
  first, exactly as Triton 3.7 does.

And one speed-up (:data:`SPEEDUPS`), for every version: inside a kernel, each call of a
``@triton.jit`` helper makes the interpreter patch ``triton.language`` again, although the
launch around it already did and nothing has undone it (``_patch_lang``: ``inspect.getmembers``
of the language's modules, a few hundred attributes, per call and per program). kvlab skips
that repeat; results are the same, an interpreted decode step takes about a quarter less time.
"""
from __future__ import annotations

import inspect
import os
import threading
from typing import NamedTuple

__all__ = ["KnownIssue", "KNOWN_ISSUES", "SPEEDUPS", "applied_fixes", "apply_fixes", "version_tuple",
           "versions", "problems", "OLDEST_TRITON"]

#: The oldest Triton kvlab declares and tests (CI runs it in a second environment).
OLDEST_TRITON = (3, 6, 0)


def version_tuple(text: str) -> tuple[int, ...]:
    """``"3.6.0+git1a2b"`` -> ``(3, 6, 0)``: the leading numeric parts of a version string."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


class KnownIssue(NamedTuple):
    """A Triton/NumPy pair known to break the interpreter, and how kvlab deals with it."""

    key: str
    summary: str
    triton_below: tuple[int, ...]  # affected: triton < this
    numpy_from: tuple[int, ...]  # affected: numpy >= this
    upstream: str
    remedy: str  # what a learner can do when kvlab's fix is not applied

    def affects(self, triton_version: str, numpy_version: str) -> bool:
        return (version_tuple(triton_version) < self.triton_below
                and version_tuple(numpy_version) >= self.numpy_from)


KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        key="interpreter-int-of-array",
        summary="Triton's interpreter converts kernel scalars with int() on a one-element array, "
                "which NumPy 2.4 refuses; kernels with runtime loop bounds fail",
        triton_below=(3, 7),
        numpy_from=(2, 4),
        upstream="triton-lang/triton issue 9171 (fixed in Triton 3.7 by PR 9172)",
        remedy="pip install 'triton>=3.7'  (or: pip install 'numpy<2.4')",
    ),
)

_APPLIED: list[str] = []


def versions() -> tuple[str, str]:
    """The installed Triton and NumPy versions (``"not installed"`` when missing)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a hard dependency
        triton_version = "not installed"
    try:
        import numpy

        numpy_version = numpy.__version__
    except ImportError:  # pragma: no cover - torch and triton need numpy
        numpy_version = "not installed"
    return triton_version, numpy_version


def _fix_interpreter_int_of_array() -> bool:
    """Triton 3.7's ``__index__`` for interpreter tensors, installed on an older interpreter."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_kvlab_fixed", False):
        return original is not None

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # what Triton 3.7 does: a one-element array becomes 0-d before int()
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._kvlab_fixed = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True


_FIXES = {"interpreter-int-of-array": _fix_interpreter_int_of_array}


def _skip_repatching_in_jit_helpers() -> bool:
    """Triton's interpreter patches ``triton.language`` (``_patch_lang``) when a launch starts
    (``GridExecutor.__call__``, undone when it ends) and again at *every* call of a jit helper
    inside the kernel (``InterpretedFunction.__call__``, never undone: the launch's undo covers
    it). Here a helper's call skips the repeat when the launch on this thread already patched
    the same modules and they are still patched (``tl.load`` is no builtin); anything else --
    a helper that sees ``triton.language.core`` where its kernel saw only ``triton.language``,
    a call outside a launch -- gets Triton's own ``_patch_lang``, and inside a launch what it
    patched is undone with the launch's patch (Triton leaves it patched)."""
    from triton.runtime import interpreter
    import triton.language as tl

    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or getattr(original, "_kvlab_fixed", False):
        return original is not None
    if executor is None or scope_type is None or is_builtin is None:
        return False
    launch = executor.__call__
    # the launch running on this thread: the language modules it patched, and its undo list
    this_thread = threading.local()

    def _patch_lang(fn):
        patched = getattr(this_thread, "langs", None)
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)]
        if (patched and langs and all(id(lang) in patched for lang in langs)
                and not any(is_builtin(getattr(lang, "load", None)) for lang in langs)):
            return scope_type()          # nothing to do, nothing to undo
        scope = original(fn)
        if patched is not None:
            patched.update(id(lang) for lang in langs)
            first = getattr(this_thread, "scope", None)
            if first is None:
                this_thread.scope = scope          # the launch's own: undone when it ends
            elif isinstance(getattr(first, "_changes", None), list) and isinstance(
                    getattr(scope, "_changes", None), list):
                # a helper's own patch, which Triton never undoes: undone with the launch's,
                # first (its records hold the launch's patched values as the originals)
                first._changes.extend(scope._changes)
                scope._changes = []
        return scope

    def __call__(self, *args, **kwargs):
        outer = getattr(this_thread, "langs", None), getattr(this_thread, "scope", None)
        this_thread.langs, this_thread.scope = set(), None   # filled by this launch's _patch_lang
        try:
            return launch(self, *args, **kwargs)
        finally:
            this_thread.langs, this_thread.scope = outer

    _patch_lang._kvlab_fixed = True
    interpreter._patch_lang = _patch_lang
    executor.__call__ = __call__
    return True


#: Speed-ups of the interpreter kvlab applies to every Triton version it runs (same results,
#: less time); ``KVLAB_NO_TRITON_FIXES=1`` turns them off with the fixes.
SPEEDUPS = {"interpreter-jit-helper-repatch": _skip_repatching_in_jit_helpers}


def apply_fixes() -> list[str]:
    """Apply the fix of every known issue that affects the installed pair, and the
    :data:`SPEEDUPS`; returns their keys.

    Called by :mod:`kvlab.base.runtime` when kernels run in the interpreter. Idempotent.
    ``KVLAB_NO_TRITON_FIXES=1`` turns the fixes off (to see the upstream behaviour).
    """
    if os.environ.get("KVLAB_NO_TRITON_FIXES", "").strip() not in ("", "0"):
        return list(_APPLIED)
    triton_version, numpy_version = versions()
    wanted = [(issue.key, _FIXES[issue.key]) for issue in KNOWN_ISSUES
              if issue.affects(triton_version, numpy_version)] + list(SPEEDUPS.items())
    for key, fix in wanted:
        if key in _APPLIED:
            continue
        try:
            ok = fix()
        except Exception:  # noqa: BLE001 - a fix that cannot apply is reported, not fatal
            ok = False
        if ok:
            _APPLIED.append(key)
    return list(_APPLIED)


def applied_fixes() -> list[str]:
    """Keys of the known issues whose fix, and of the speed-ups, kvlab applied in this process."""
    return list(_APPLIED)


def problems(interpreting: bool) -> list[str]:
    """Plain-words warnings about the installed versions (empty when all is well)."""
    triton_version, numpy_version = versions()
    out = []
    if triton_version != "not installed" and version_tuple(triton_version) < OLDEST_TRITON:
        oldest = ".".join(map(str, OLDEST_TRITON))
        out.append(f"Triton {triton_version} is older than kvlab supports (>= {oldest}, the oldest "
                   f"version tested). Fix: pip install 'triton>={oldest}'")
    if interpreting:
        for issue in KNOWN_ISSUES:
            if issue.affects(triton_version, numpy_version) and issue.key not in _APPLIED:
                out.append(f"Triton {triton_version} with NumPy {numpy_version} is known to break "
                           f"the interpreter: {issue.summary} ({issue.upstream}). kvlab's fix is "
                           f"not applied in this process. Fix: {issue.remedy}")
    return out
