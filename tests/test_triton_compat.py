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
        pytest.skip("the interpreter fixes apply only in the interpreter")
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
