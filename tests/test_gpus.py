"""Which GPUs the course runs on (kvlab.base.gpus): the runtime report names the GPU and whether every
chapter runs on it, and a chapter that keeps K/V in 16 bits picks float16 on Colab's T4 (sm_75,
no bfloat16 arithmetic) and bfloat16 from sm_80 on, and says so. The GPUs are faked: torch's
CUDA queries answer as a T4, an A10, an H200 or a V100 would."""
from __future__ import annotations

import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import jupytext
import pytest
import torch

import kvlab
from kvlab.base import gpus, runtime

ROOT = Path(__file__).resolve().parents[1]
T4, A10, H200, V100 = ("Tesla T4", (7, 5)), ("NVIDIA A10", (8, 6)), ("NVIDIA H200", (9, 0)), \
    ("Tesla V100-SXM2-16GB", (7, 0))


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(T4)``: torch sees that GPU and kvlab runs compiled (no kernel is launched)."""
    def use(gpu):
        name, capability = gpu
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        monkeypatch.setattr(runtime, "INTERPRET", False)
    return use


@pytest.mark.parametrize("gpu, half, headline", [
    (T4, torch.float16, "sm_75: every chapter runs on it"),
    (A10, torch.bfloat16, "sm_86: every chapter should run on it"),
    (H200, torch.bfloat16, "sm_90: every chapter runs on it"),
    (V100, torch.float16, "sm_70: chapters may not run on it (older than sm_75)"),
])
def test_each_gpu_gets_its_16_bit_type_and_a_verdict(gpu, half, headline):
    fit = gpus.fit(*gpu)
    assert fit.half == half and fit.headline() == headline


def test_the_runtime_line_names_a_t4_and_says_every_chapter_runs(fake_gpu):
    fake_gpu(T4)
    text = str(runtime.runtime_info())
    first, _, rest = text.partition("\n")
    assert first == "kvlab runtime: gpu (Tesla T4, sm_75: every chapter runs on it)"
    assert "CI compiles every kernel for sm_75, sm_80, sm_90" in rest
    assert "chapters keep 16-bit K/V in float16 here (bfloat16 needs sm_80)" in rest


def test_the_runtime_line_warns_on_a_gpu_older_than_every_ci_target(fake_gpu):
    fake_gpu(V100)
    text = str(runtime.runtime_info())
    assert "Tesla V100-SXM2-16GB, sm_70: chapters may not run on it" in text
    assert "KVLAB_INTERPRET=1" in text


@pytest.mark.skipif(not runtime.INTERPRET, reason="on a GPU the GPU decides")
def test_the_interpreter_keeps_16_bit_kv_in_bfloat16():
    assert runtime.half_dtype() == torch.bfloat16
    assert runtime.half_note(torch.bfloat16) == "bfloat16 (Triton's interpreter, on the CPU)"


def _chapter_cell(prefix: str, starts_with: str) -> str:
    source = next((ROOT / "notebooks" / "src").glob(f"{prefix}_*.py"))
    cells = jupytext.reads(source.read_text(), fmt="py:percent").cells
    (cell,) = [c for c in cells if c.cell_type == "code" and c.source.startswith(starts_with)]
    return cell.source


@pytest.mark.parametrize("gpu, dtype, said", [
    (T4, "torch.float16", "float16, not bfloat16: this Tesla T4 (sm_75) has no bfloat16 arithmetic"),
    (H200, "torch.bfloat16", "bfloat16 (this NVIDIA H200, sm_90, computes in it)"),
])
def test_chapter_08_keeps_its_16_bit_pool_in_the_type_the_gpu_computes_in(monkeypatch, gpu, dtype,
                                                                            said):
    """Chapter 08's cell, run as it is: the dtype choice sees the faked GPU; its kernel runs in
    the interpreter on the CPU, with the pool in the type chosen."""
    from kvlab.attention.paged_attention import paged_decode_attention
    from kvlab.attention.kv_pool import random_paged_layout
    from kvlab.course.reference import paged_decode_attention_reference

    monkeypatch.setattr(runtime, "_gpu", lambda: gpus.fit(*gpu))
    code = _chapter_cell("08", "HALF = kvlab.base.runtime.half_dtype()")
    namespace = {
        "kvlab": kvlab, "torch": torch, "paged_decode_attention": paged_decode_attention,
        "paged_decode_attention_reference": paged_decode_attention_reference,
        "random_layout": lambda seed, page_size, seq_lens: random_paged_layout(
            seed, page_size, seq_lens, heads=2, head_dim=16, device=kvlab.DEVICE),
    }
    printed = io.StringIO()
    with redirect_stdout(printed):
        exec(compile(code, "08_capstone_attention.py", "exec"), namespace)  # noqa: S102
    assert str(namespace["HALF"]) == dtype and namespace["k_h"].dtype == namespace["HALF"]
    out = printed.getvalue()
    assert f"16-bit K/V here: {said}" in out
    assert re.search(r"✓ 2 bytes per number instead of 4: (\d+) bytes of K/V instead of (\d+)", out)
