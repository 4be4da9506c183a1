"""The Triton/NumPy compatibility range: known-broken pairs are mended or reported in plain words."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvlab
from kvlab.base import runtime, triton_compat
from kvlab.base.triton_compat import KNOWN_ISSUES, version_tuple

INT_OF_ARRAY = next(i for i in KNOWN_ISSUES if i.key == "interpreter-int-of-array")


@pytest.mark.parametrize("text, expected", [
    ("3.6.0", (3, 6, 0)), ("3.7.1+git8f2a", (3, 7, 1)), ("2.4.0rc1", (2, 4, 0)),
    ("2.4", (2, 4)), ("3.10.0.dev20260101", (3, 10, 0)),
])
def test_version_tuple(text, expected):
    assert version_tuple(text) == expected


@pytest.mark.parametrize("triton_v, numpy_v, affected", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.4.0", True), ("3.5.1", "2.5.0", True),
    ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False), ("3.9.0", "2.4.6", False),
])
def test_the_int_of_array_issue_names_the_affected_pairs(triton_v, numpy_v, affected):
    assert INT_OF_ARRAY.affects(triton_v, numpy_v) is affected


def test_report_names_triton_and_numpy_versions(capsys):
    info = kvlab.runtime_report()
    out = capsys.readouterr().out
    triton_v, numpy_v = triton_compat.versions()
    assert info.triton_version == triton_v and info.numpy_version == numpy_v
    assert f"triton {triton_v}" in out and f"numpy {numpy_v}" in out


def test_the_fix_is_applied_exactly_when_the_installed_pair_needs_it():
    if not runtime.INTERPRET:
        pytest.skip("needs the Triton interpreter (make test, no CUDA): its fixes apply only there")
    affected = INT_OF_ARRAY.affects(*triton_compat.versions())
    assert ("interpreter-int-of-array" in triton_compat.applied_fixes()) is affected
    assert triton_compat.problems(True) == []  # nothing left to warn about


def test_a_kernel_with_a_runtime_loop_bound_runs():
    """The failing shape of the issue: ``for start in range(0, n, BLOCK)`` with n a runtime value."""
    import triton
    import triton.language as tl

    @triton.jit
    def block_sums(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
        tl.store(out_ptr, tl.sum(acc, axis=0))

    x = torch.arange(37, dtype=torch.int64, device=runtime.DEVICE)
    out = torch.zeros(1, dtype=torch.int64, device=runtime.DEVICE)
    block_sums[(1,)](x, out, x.numel(), BLOCK=8)
    assert int(out) == sum(range(37))


def test_an_unmended_broken_pair_is_reported_with_the_fix(monkeypatch):
    monkeypatch.setattr(triton_compat, "versions", lambda: ("3.6.0", "2.4.6"))
    monkeypatch.setattr(triton_compat, "_APPLIED", [])
    (warning,) = triton_compat.problems(True)
    assert "Triton 3.6.0 with NumPy 2.4.6" in warning and "9171" in warning
    assert "pip install 'triton>=3.7'" in warning
    assert triton_compat.problems(False) == []  # compiled kernels do not use the interpreter


def test_a_triton_older_than_the_range_is_reported(monkeypatch):
    monkeypatch.setattr(triton_compat, "versions", lambda: ("3.2.0", "2.3.0"))
    (warning,) = triton_compat.problems(False)
    assert "older than kvlab supports" in warning and "triton>=3.6" in warning


def test_fixes_can_be_turned_off_and_the_report_then_warns():
    """In a fresh process with KVLAB_NO_TRITON_FIXES=1, an affected pair is warned about."""
    code = ("import kvlab, kvlab.base.triton_compat as c; i = kvlab.base.runtime.runtime_info(); "
            "print(c.KNOWN_ISSUES[0].affects(*c.versions()), i.mode, len(i.warnings), i.fixes)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "KVLAB_NO_TRITON_FIXES": "1"}).stdout
    affected, mode, n_warnings, fixes = out.split(maxsplit=3)
    assert fixes.strip() == "()"
    expected = 1 if (affected == "True" and mode == "interpreter") else 0
    assert int(n_warnings) == expected


def _interpreting():
    if not runtime.INTERPRET:
        pytest.skip("needs the Triton interpreter (make test, no CUDA): its speed-ups apply only there")


import triton  # noqa: E402  (after kvlab: it decides the interpreter)
import triton.language as tl  # noqa: E402


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _twice_plus_one(x):
    return _twice(x) + 1


@triton.jit
def _rows_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """4 programs calling a helper 3 times each (that helper calls another)."""
    row = tl.program_id(0)
    offs = row * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(x_ptr + offs)
    for _ in range(3):
        value = _twice_plus_one(value)
    tl.store(out_ptr + offs, value)


# a helper defined where only triton.language.core is in sight (its kernel's launch patches
# triton.language alone)
from triton_core_helper import plus_three as _plus_three  # noqa: E402


@triton.jit
def _core_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _plus_three(tl.load(x_ptr + offs)))


def test_jit_helpers_do_not_patch_the_language_again_and_give_the_same_values(monkeypatch):
    """The speed-up: one launch of 4 programs that call a helper 3 times each (that helper
    calls another) patches triton.language once, not 25 times; values as before."""
    _interpreting()
    from triton.runtime import interpreter

    assert "interpreter-jit-helper-repatch" in triton_compat.applied_fixes()
    calls = []
    builtin_patch = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: (calls.append(pkg), builtin_patch(pkg, *a)))
    x = torch.arange(32, dtype=torch.int64, device=runtime.DEVICE)
    out = torch.empty_like(x)
    _rows_kernel[(4,)](x, out, BLOCK=8)
    expected = x.clone()
    for _ in range(3):
        expected = expected * 2 + 1
    assert torch.equal(out, expected)
    assert calls.count(tl) == 1, f"triton.language patched {calls.count(tl)} times in one launch"


def test_a_helper_seeing_another_language_module_still_gets_it_patched():
    """Its kernel's launch patched triton.language only; the helper uses triton.language.core:
    that one is patched (Triton's own way), or ``core.full`` would run unpatched and fail."""
    _interpreting()
    x = torch.arange(8, dtype=torch.int64, device=runtime.DEVICE)
    out = torch.empty_like(x)
    _core_kernel[(1,)](x, out, BLOCK=8)
    assert torch.equal(out, x + 3)


def test_the_language_is_restored_after_a_launch_with_helpers():
    """After the launch nothing of triton.language stays patched (its builtins are builtins)."""
    _interpreting()
    x = torch.arange(32, dtype=torch.int64, device=runtime.DEVICE)
    _rows_kernel[(4,)](x, torch.empty_like(x), BLOCK=8)
    _core_kernel[(1,)](x[:8], torch.empty_like(x[:8]), BLOCK=8)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.full)
    assert tl.core.is_builtin(tl.core.load)


def test_the_speed_up_is_off_with_the_fixes():
    code = ("import kvlab, kvlab.base.triton_compat as c; from triton.runtime import interpreter as i; "
            "print(c.applied_fixes(), getattr(i._patch_lang, '_kvlab_fixed', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "KVLAB_NO_TRITON_FIXES": "1"}).stdout
    assert out.split() == ["[]", "False"]
