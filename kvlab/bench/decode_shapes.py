"""What the decode-attention benchmarks share (chapter 09): the bandwidth that sets a floor, a
paged case of the serving model's attention shape, transformers' SDPA call beside it, and the
clock (``do_bench`` of a CUDA-graph replay). Used by ``--attention`` (:mod:`kvlab.bench.decode`,
:mod:`kvlab.bench.decode_call`) and ``--serve`` (:mod:`kvlab.bench.serve`)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from ..base import runtime

COPY_BYTES, SMOKE_COPY_BYTES = 1 << 31, 1 << 20


def sync_device() -> None:
    if runtime.DEVICE.type == "cuda":
        torch.cuda.synchronize()


def bench_us(fn, smoke: bool) -> float:
    """Median time of one call, µs: ``do_bench`` (CUDA events, L2 flushed first) on a GPU; one
    timed call in the interpreter (no claim)."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def graphed(fn, smoke: bool):
    """``fn`` captured in a CUDA graph (its replay), after one eager call that compiles what it
    uses; in the interpreter ``fn`` itself."""
    fn()
    if smoke:
        return fn
    sync_device()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    sync_device()
    return graph.replay


def copy_bandwidth(smoke: bool) -> dict:
    """Device-to-device copy: ``dst.copy_(src)`` reads and writes ``nbytes`` each."""
    n = SMOKE_COPY_BYTES if smoke else COPY_BYTES
    src = torch.empty(n, dtype=torch.uint8, device=runtime.DEVICE)
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), smoke)
    return dict(bytes_copied=n, us=us, gb_per_s=2 * n / us / 1e3)


def paged_case(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, page_size: int,
               dtype: torch.dtype, seed: int = 0):
    """A pool with every request's ``ctx`` tokens on shuffled pages (seeded): ``(q, k_pool,
    v_pool, page_table, rows, seq_lens)`` on the runtime's device."""
    device = runtime.DEVICE
    pages_per = -(-ctx // page_size)
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(batch * pages_per, generator=gen).view(batch, pages_per)
    table = (pages[:, :, None] * page_size + torch.arange(page_size)).view(batch, -1)[:, :ctx]
    table = table.to(device, torch.int32).contiguous()
    torch.manual_seed(seed)
    slots = batch * pages_per * page_size
    k = torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    rows = torch.arange(batch, device=device)
    return q, k, v, table, rows, torch.full((batch,), ctx, device=device)


def sdpa_call(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, dtype, scale):
    """transformers' SDPA attention on one decode query per request, K/V contiguous
    ``[batch, kv_heads, ctx, head_dim]`` as its cache keeps them (values random: timing only)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device = runtime.DEVICE
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=dtype)
    return lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale, is_causal=False)
