"""Every Triton kernel of kvlab, and every exercise's solution kernel, compiles for Colab's T4
(sm_75), an A100 (sm_80) and an H100/H200 (sm_90), with the dtypes the chapters use on each
(:mod:`kvlab.base.gpus`: 16-bit K/V in float16 on sm_75, bfloat16 from sm_80 on). No GPU needed:
Triton's compiler takes an explicit ``GPUTarget`` (``tests/gpu_targets.py``). A kernel that no
line of :data:`SPECS` reaches fails the test: a new ``@triton.jit`` kernel needs its line.

**A new kernel: one line in SPECS**, ``Spec(chapters, call)``: ``call(float_dtype)`` launches
the kernel the way a chapter does, on small CPU tensors (it runs in the interpreter, where
every launch is recorded with its argument types and constexprs); ``floats=True`` calls it once
per float dtype a chapter uses on each GPU (float32 and that GPU's 16-bit type). Helpers a
kernel calls (``@triton.jit`` functions without a launch of their own) are compiled with it.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import kvlab  # noqa: F401  (first: decides compiled vs interpreter)
from gpu_targets import Launch, compile_for_each, jit_functions, reached, record
from kvlab.base import gpus
from kvlab.attention.paged_attention import FastConfig, fast_launches, paged_decode_attention
from kvlab.bench.public import empty_kernel
from kvlab.course.exercises import ch08_attention_kernel as ch08, ch09_fast as ch09
from kvlab.course.exercises import ch09_merge_splits as ch09_merge, ch09_split_attention as ch09_split
from kvlab.alloc.fast_alloc import alloc_decode_fast, alloc_extend_fast
from kvlab.alloc import fast_alloc_kernels as fast_kernels
from kvlab.attention.kv_pool import random_paged_layout
from kvlab.alloc.paging import new_page_table, page_to_token_triton, write_page_table_triton
from kvlab.alloc.token_allocator import PagedTokenAllocator

FLOATS_BY_ARCH = {arch: (torch.float32, gpus.half_for_arch(arch)) for arch in gpus.CI_ARCHS}
DEV = kvlab.DEVICE  # the interpreter's CPU here; a GPU under `make gpu-check`


def i64(*values):
    return torch.tensor(values, dtype=torch.int64, device=DEV)


def arange(start, stop):
    return torch.arange(start, stop, device=DEV)


def allocate(impl: str):
    """Chapter 03/04's batch on pages of 4: a prefill of 5 and 3 tokens, then one decode step."""
    a = PagedTokenAllocator(num_pages=16, page_size=4, device=DEV, impl=impl)
    out = a.alloc_extend(i64(0, 0), i64(5, 3), i64(-1, -1), 8)
    a.alloc_decode(i64(6, 4), out[[4, 7]])


def extend_fast(two_launches: bool = False):
    """Chapter 09's extend: one fused launch, or (batches past FUSED_MAX_BATCH) scan, then fill."""
    with _fused_max(0 if two_launches else fast_kernels.FUSED_MAX_BATCH):
        alloc_extend_fast(i64(3, 0), i64(9, 5), i64(2, -1), arange(1, 9), 4)


@contextmanager
def _fused_max(bs: int):
    old, fast_kernels.FUSED_MAX_BATCH = fast_kernels.FUSED_MAX_BATCH, bs
    try:
        yield
    finally:
        fast_kernels.FUSED_MAX_BATCH = old


def attention(dtype, kv_heads=None):
    """Chapter 08/10's paged decode attention with K/V in ``dtype`` (GQA when kv_heads < heads)."""
    q, k, v, table, rows, lens = random_paged_layout(0, 4, [5, 9], heads=4, kv_heads=kv_heads,
                                                     head_dim=16, device=DEV)
    paged_decode_attention(q, k.to(dtype), v.to(dtype), table, rows, lens)


def fast_attention(dtype, num_splits: int):
    """Chapter 09's fast decode attention as a GPU launches it: with a 16-bit pool, tl.dot in that
    type (LOW_PRECISION; the interpreter multiplies in float32 instead); one split writes the
    output directly, more launch the merge."""
    q, k, v, table, rows, lens = random_paged_layout(0, 16, [40, 70], heads=8, kv_heads=2,
                                                     head_dim=64, device=DEV)
    out = torch.empty(q.shape, dtype=torch.float32, device=DEV)
    for launch in fast_launches(q, k.to(dtype), v.to(dtype), table, rows.to(DEV, torch.int64),
                                lens.to(DEV, torch.int64), out, 0.125, num_splits, FastConfig()):
        kwargs = {k: v for k, v in launch.kwargs.items() if k not in ("num_warps", "num_stages")}
        if "LOW_PRECISION" in kwargs:
            kwargs["LOW_PRECISION"] = dtype != torch.float32
        launch.kernel[launch.grid](*launch.args, **kwargs)


def merge_inputs(batch=2, heads=4, splits=3, head_dim=16):
    """Chapter 09's merge exercise: each split's output and log-sum-exp, and the lengths."""
    o = torch.randn(batch, heads, splits, head_dim, device=DEV)
    return o, torch.randn(batch, heads, splits, device=DEV), i64(40, 70), splits


@dataclass(frozen=True)
class Spec:
    chapters: str                         # where the launch comes from ("08 10")
    call: Callable[[torch.dtype], object]  # launches the kernel(s) as the chapter does
    floats: bool = False                   # once per float dtype of each GPU


# One line per way the chapters launch a kernel (see the module docstring).
SPECS = [
    Spec("01", lambda f: page_to_token_triton(i64(8, 0, 20), 4)),
    Spec("01", lambda f: page_to_token_triton(i64(8, 0, 20).to(torch.int32), 4)),
    Spec("02", lambda f: write_page_table_triton(new_page_table(2, 8, 4, device=DEV), arange(0, 12), [(0, 0, 2), (1, 0, 1)], 4)),
    Spec("03 04", lambda f: allocate("teaching")),
    Spec("09", lambda f: allocate("fast")),
    Spec("09", lambda f: extend_fast()),
    Spec("09", lambda f: extend_fast(two_launches=True)),
    Spec("09", lambda f: alloc_decode_fast(i64(6, 4), i64(4, 6), arange(2, 9), 4)),
    Spec("09", lambda f: empty_kernel[(1,)](i64(0), 1)),
    Spec("08 10", attention, floats=True),
    Spec("10", lambda f: attention(f, kv_heads=2), floats=True),
    # the exercises' solution kernels, launched by their checkers' own helpers
    Spec("08", lambda f: ch08.run_attention_kernel(ch08.paged_attention_kernel_solution,
                                                   *random_paged_layout(0, 4, [5, 9], device=DEV), block_n=8)),
    Spec("09", lambda f: ch09.run_scan_kernel(ch09.extend_scan_solution, [3, 0, 4], [9, 5, 4], 4)),
    Spec("09 10", lambda f: fast_attention(f, num_splits=1), floats=True),
    Spec("09 10", lambda f: fast_attention(f, num_splits=2), floats=True),
    Spec("09", lambda f: ch09_split.run_split_kernel(ch09_split.split_attention_solution,
                                                     *ch09_split.spare_layout(0, 4, [40, 9], 8, 2, 16, 1), 2, 16)),
    Spec("09", lambda f: ch09_merge.run_merge_kernel(ch09_merge.merge_splits_solution, *merge_inputs(), 16)),
]


def _launches() -> dict[int, list[Launch]]:
    """Each arch's launches: every spec, with that arch's float dtypes."""
    by_dtype: dict[torch.dtype | None, list[Launch]] = {}
    for spec in SPECS:
        for dtype in ({d for ds in FLOATS_BY_ARCH.values() for d in ds} if spec.floats else {None}):
            what = f"chapter {spec.chapters}" + (f", {dtype}".replace("torch.", "") if dtype else "")
            by_dtype.setdefault(dtype, []).extend(record(lambda: spec.call(dtype), what))
    return {arch: list(dict.fromkeys([*by_dtype[None], *(x for d in floats for x in by_dtype.get(d, []))]))
            for arch, floats in FLOATS_BY_ARCH.items()}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, list[Launch]]:
    return _launches()


def test_every_kernel_and_helper_of_the_package_is_compiled_by_a_spec(launches):
    functions = jit_functions()
    assert len(functions) >= 20, sorted(functions)  # the walk found the package's kernels
    missing = set(functions) - reached([x for xs in launches.values() for x in xs], functions)
    assert not missing, (f"@triton.jit functions no line of SPECS (tests/test_gpu_targets.py) "
                         f"launches or reaches: {sorted(missing)}; add a Spec that launches each")


def test_the_specs_cover_the_chapters_float_dtypes_on_each_gpu(launches):
    assert FLOATS_BY_ARCH[75] == (torch.float32, torch.float16)  # a T4: no bfloat16 arithmetic
    assert FLOATS_BY_ARCH[80] == FLOATS_BY_ARCH[90] == (torch.float32, torch.bfloat16)
    pools = {arch: {t for x in xs if x.name.endswith("paged_decode_attention_kernel")
                    for p, t in x.types if p == "k_pool_ptr"} for arch, xs in launches.items()}
    assert pools == {75: {"*fp32", "*fp16"}, 80: {"*fp32", "*bf16"}, 90: {"*fp32", "*bf16"}}


def test_every_launch_compiles_for_sm75_sm80_and_sm90(launches, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # really compile
    started = time.monotonic()
    refused = compile_for_each(launches)
    seconds = time.monotonic() - started
    count = sum(map(len, launches.values()))
    assert not refused, "Triton's compiler refused:\n" + "\n".join(refused)
    print(f"compiled {count} launches for {', '.join(f'sm_{a}' for a in launches)} in {seconds:.0f} s")


FP8 = '''\
import triton
import triton.language as tl


@triton.jit
def to_fp8(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs).to(tl.float8e4nv).to(tl.float32))
'''


def test_a_kernel_an_older_gpu_cannot_compile_is_refused_for_that_gpu(tmp_path):
    """float8 e4m3 (fp8e4nv) needs sm_89: refused for sm_75 and sm_80, compiled for sm_90."""
    import importlib.util

    from gpu_targets import _launch, compile_for

    (tmp_path / "fp8_kernel.py").write_text(FP8)
    spec = importlib.util.spec_from_file_location("fp8_kernel", tmp_path / "fp8_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.zeros(16, device=DEV)
    launch = _launch(module.to_fp8, (x, x), {"BLOCK": 16}, "planted")
    assert "fp8e4nv not supported" in " ".join(compile_for([launch], 75))
    assert compile_for([launch], 90) == []
