"""The checkers compile every learner kernel for a GPU (kvlab.course.checking.compiled): what the
interpreter runs but a GPU's compiler refuses is told with the learner's line, once per kernel;
a compiler that cannot run never blames the learner. Runs in the interpreter (compiled for
sm_90) and on a GPU (compiled for that GPU, refused before launch): `make gpu-check`."""
from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import kvlab  # noqa: F401  (first: decides compiled vs interpreter)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kvlab.base import runtime
from kvlab.check import CheckFailed, call_learner
from kvlab.course.checking import compiled

SCAN = textwrap.dedent('''
    import triton
    import triton.language as tl


    @triton.jit
    def my_scan(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        lanes = tl.arange(0, BLOCK)
        carry = {init}
        for start in range(0, n, BLOCK):
            offs = start + lanes
            x = tl.load(x_ptr + offs, mask=offs < n, other=0).to(tl.int64)
            tl.store(out_ptr + offs, carry + tl.cumsum(x, axis=0) - x, mask=offs < n)
            carry += tl.sum(x, axis=0)
''')


def _kernel(tmp_path, init: str, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(SCAN.format(init=init))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.my_scan


def _launch(kernel):
    x = torch.arange(10, dtype=torch.int64, device=runtime.DEVICE)
    out = torch.zeros_like(x)
    call_learner(kernel, x, out, 10, grid=(1,), BLOCK=4)
    return out


def test_a_loop_carry_that_changes_type_is_refused_with_the_learners_line(tmp_path):
    bad = _kernel(tmp_path, "0", "carry_int32")
    with pytest.raises(CheckFailed) as info:
        _launch(bad)
    msg = str(info.value)
    assert info.value.label == "compile"
    assert "does not compile for a GPU" in msg and "line 10 of my_scan" in msg
    assert "Loop-carried variable carry has initial type int32 but is re-assigned to int64" in msg
    assert "it enters the loop as int32 (line 9: carry = 0)" in msg


def test_a_kernel_that_compiles_runs_and_is_compiled_once(tmp_path, monkeypatch):
    good = _kernel(tmp_path, "tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)", "carry_int64")
    assert _launch(good).tolist() == [0, 0, 1, 3, 6, 10, 15, 21, 28, 36]
    asked = []
    monkeypatch.setattr(compiled, "_compile_in_child", lambda *a: asked.append(a) or {"ok": True})
    _launch(good)  # the verdict is kept: no second compile
    assert asked == []


def test_an_error_the_interpreter_raises_too_is_told_as_before(tmp_path):
    bad = _kernel(tmp_path, "undefined_name", "undefined")
    with pytest.raises(CheckFailed) as info:
        _launch(bad)
    assert "undefined_name" in str(info.value)
    assert (info.value.label != "compile") == runtime.INTERPRET  # on a GPU: refused before launch


@pytest.mark.skipif(not runtime.INTERPRET, reason="on a GPU the launch compiles the kernel itself")
def test_a_compiler_that_cannot_run_never_blames_the_learner(tmp_path, monkeypatch):
    bad = _kernel(tmp_path, "0", "no_compiler")
    monkeypatch.setattr(compiled, "_VERDICTS", {})
    monkeypatch.setattr(compiled, "_compile_in_child", lambda *a: None)
    _launch(bad)  # runs in the interpreter (or compiles on the GPU) as it did before the check


def test_the_check_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_GPU_COMPILE", "0")
    assert compiled.problem(_kernel(tmp_path, "0", "turned_off"), (), {}) is None


def test_a_child_without_a_working_compiler_says_so(monkeypatch):
    monkeypatch.setattr(compiled, "_target", lambda: ("cuda", 1, 32))  # no such GPU: the probe fails
    compiled.close_child()
    try:
        child = compiled._Child()
        assert child.ready is False
        child.close()
    finally:
        compiled.close_child()


def test_the_signature_follows_the_launch():
    @triton.jit
    def k(a_ptr, b_ptr, n, big, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 2):
        pass

    types, constants = compiled.signature(
        k.fn, (torch.zeros(2, dtype=torch.int64), torch.zeros(2), 5, 2**40, 0.5, True), {"BLOCK": 8})
    assert types == {"a_ptr": "*i64", "b_ptr": "*fp32", "n": "i32", "big": "i64", "scale": "fp32",
                     "flag": "i1", "BLOCK": "constexpr", "MODE": "constexpr"}
    assert constants == {"BLOCK": 8, "MODE": 2}
