"""Attention that reads K/V through the page table (chapter 08), mini-sglang's attention layer.

Two operations the tiny model of :mod:`kvlab.serving.tiny_engine` uses:

* :func:`paged_decode_attention` -- one new query per request attends to the request's tokens
  ``[0, seq_len)``, found through its page-table row: a checked wrapper around the Triton
  kernel (:mod:`kvlab.attention.decode_kernels`); its plain-torch oracle is
  :func:`kvlab.course.reference.paged_decode_attention_reference`;
* :func:`fast_paged_decode_attention` -- the same contract, same checks, on chapter 09's fast
  kernels (:mod:`kvlab.attention.split_kernels`): the query heads of a K/V group in one
  program, a split over the sequence, a merge of the splits;
* :func:`causal_attention` -- plain causal attention of a block of queries (a prefill) over
  keys already gathered into one tensor.

Memory picture (one layer; the V pool has the same layout)::

    page_table (int32)                 k_pool  [num_slots, kv_heads, head_dim]
    row = table_idx, col = position    ┌──────────────────────────────┐
    ┌───┬───┬───┬───┬────┐             │ slot 0                       │
    │ 8 │ 9 │10 │11 │ 20 │ ──────────► │ ...                          │
    └───┴───┴───┴───┴────┘             │ slot 8..11  tokens 0..3      │ (one page, P = 4)
                                       │ slot 20     token 4          │ (a new page)
                                       └──────────────────────────────┘
"""
from __future__ import annotations

import math

import torch

from typing import NamedTuple

from ..base.args import check_scale, div_ceil, is_int, next_pow2
from ..base.errors import InvalidArgument
from ..base.runtime import pick
from .attention_options import (MAX_SPLITS, MIN_SPLIT_TOKENS, PROGRAMS_PER_SM, FastConfig,  # noqa: F401
                                choose_num_splits, streaming_multiprocessors)
from .attention_plan import attend
from .attention_rules import check_attention_errors, check_pool_shapes

__all__ = ["check_paged_attention_inputs", "check_rows_mapped", "paged_decode_attention",
           "FastConfig", "choose_num_splits", "split_ranges", "fast_paged_decode_attention",
           "check_attention_errors", "fast_launches",
           "causal_attention"]


def check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> None:
    """Every rule the kernel relies on, checked on the host before any launch.

    ``q`` is ``[batch, heads, head_dim]``; the pools are ``[num_slots, kv_heads, head_dim]``
    with ``heads % kv_heads == 0``; ``table_idx`` names existing rows;
    ``1 <= seq_lens[b] <= page_table.shape[1]``; every entry of
    ``page_table[table_idx[b], :seq_lens[b]]`` is a slot in ``[0, num_slots)``.
    """
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("page_table", page_table)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(name, "must be a torch.Tensor", f"got {type(t).__name__}")
    if q.dim() != 3:
        raise InvalidArgument("q", "shape [batch, heads, head_dim]", f"got {list(q.shape)}")
    batch, heads, head_dim = q.shape
    check_pool_shapes(heads, head_dim, k_pool, v_pool)
    if page_table.dim() != 2 or page_table.dtype not in (torch.int32, torch.int64):
        raise InvalidArgument("page_table", "a 2-D int32/int64 tensor [rows, cols]",
                              f"got {page_table.dtype} {list(page_table.shape)}")
    table_idx = torch.as_tensor(table_idx).flatten()
    seq_lens = torch.as_tensor(seq_lens).flatten()
    for name, t in (("table_idx", table_idx), ("seq_lens", seq_lens)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InvalidArgument(name, "integers", f"got {t.dtype}")
        if t.numel() != batch:
            raise InvalidArgument(name, f"one entry per query (batch {batch})", f"got {t.numel()}")
    if batch:
        check_rows_mapped(page_table, table_idx, seq_lens, k_pool.shape[0])


def check_rows_mapped(page_table, table_idx, seq_lens, num_slots: int) -> None:
    """Rows exist, ``1 <= seq_lens[b] <= columns``, and every slot of
    ``page_table[table_idx[b], :seq_lens[b]]`` is in ``[0, num_slots)`` (a few host syncs)."""
    rows, cols = page_table.shape
    table_idx = torch.as_tensor(table_idx).to(page_table.device, torch.int64).flatten()
    seq_lens = torch.as_tensor(seq_lens).to(page_table.device, torch.int64).flatten()
    bad_row = (table_idx < 0) | (table_idx >= rows)
    if bool(bad_row.any()):
        b = int(bad_row.nonzero()[0])
        raise InvalidArgument(f"table_idx[{b}]", f"0 <= row < {rows} (page_table rows)",
                              f"got {int(table_idx[b])}")
    bad_len = (seq_lens < 1) | (seq_lens > cols)
    if bool(bad_len.any()):
        b = int(bad_len.nonzero()[0])
        raise InvalidArgument(f"seq_lens[{b}]", f"1 <= seq_len <= {cols} (page_table columns)",
                              f"got {int(seq_lens[b])}")
    slots = page_table[table_idx]                                     # [batch, cols]
    used = torch.arange(cols, device=slots.device)[None, :] < seq_lens[:, None]
    bad = used & ((slots < 0) | (slots >= num_slots))
    if bool(bad.any()):
        b, t = (int(x) for x in bad.nonzero()[0])
        row = int(table_idx[b])
        raise InvalidArgument(
            f"page_table[{row}, {t}]", f"a mapped slot in [0, {num_slots}) for every position < seq_len",
            f"request {b} has seq_len {int(seq_lens[b])} but position {t} holds {int(slots[b, t])}")


def paged_decode_attention(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                           scale: float | None = None, *, block_n: int | None = None,
                           check: bool = True) -> torch.Tensor:
    """Triton paged decode attention (one program per request and head), checked first.

    Same contract as the oracle :func:`kvlab.course.reference.paged_decode_attention_reference`. ``block_n`` (a power of two)
    is how many token columns a program reads per loop iteration; by default 32 on a GPU
    and 64 in the interpreter (fewer, wider iterations: the interpreter pays per operation).

    Grouped-query attention (chapter 10): the pools may hold ``kv_heads`` heads for ``heads``
    query heads (``heads % kv_heads == 0``); query head ``h`` reads K/V head
    ``h // (heads // kv_heads)``. ``check=False`` skips the host checks, for a caller that
    checked the same page table and lengths already (a serving loop checks once per step,
    not once per layer).
    """
    from .decode_kernels import paged_decode_attention_kernel

    block_n = pick(cpu=64, gpu=32) if block_n is None else block_n
    if check:
        check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
        scale = check_scale(scale)
    if not is_int(block_n) or block_n < 1 or block_n & (block_n - 1):
        raise InvalidArgument("block_n", "a power of two", f"got {block_n!r}")
    batch, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    device = q.device
    q = q.contiguous().float()
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    page_table = page_table.contiguous()
    table_idx = torch.as_tensor(table_idx).to(device=device, dtype=torch.int64).contiguous()
    seq_lens = torch.as_tensor(seq_lens).to(device=device, dtype=torch.int64).contiguous()
    out = torch.empty((batch, heads, head_dim), dtype=torch.float32, device=device)
    if batch == 0:
        return out
    paged_decode_attention_kernel[(batch, heads)](
        q, k_pool, v_pool, page_table, table_idx, seq_lens, out, float(scale),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1), head_dim,
        BLOCK_N=int(block_n), BLOCK_D=max(16, next_pow2(head_dim)),
        KV_GROUP=heads // k_pool.shape[1],
    )
    return out


# --- the fast kernels of chapter 09 ---------------------------------------------------------


def split_ranges(seq_len: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """The positions ``[start, end)`` each program of one request and K/V head reads, as the
    split kernel computes them (splits that hold nothing left out): whole blocks of
    ``block_n``, ``ceil(ceil(seq_len / num_splits) / block_n) * block_n`` positions a split."""
    per = div_ceil(div_ceil(seq_len, num_splits), block_n) * block_n
    return [(start, min(start + per, seq_len)) for start in range(0, seq_len, per)]


def fast_paged_decode_attention(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                                scale: float | None = None, *, num_splits: int | None = None,
                                config: FastConfig | None = None, out_dtype: torch.dtype = torch.float32,
                                max_context: int | None = None, check: bool = True) -> torch.Tensor:
    """Paged decode attention on chapter 09's fast kernels; the contract and the rules of
    :func:`paged_decode_attention` (grouped-query attention included).

    ``num_splits`` programs share each request's positions per K/V head (default:
    :func:`choose_num_splits` from the batch, the K/V heads and ``max_context``, the longest
    length expected, by default the page table's columns); one split writes the output
    directly, more launch the merge. ``q`` may be in any float dtype (the model's); the
    output is ``out_dtype`` (float32 by default, as the oracle's). ``config``: block size and
    launch options (:class:`FastConfig`'s defaults).

    The checks cost no wait for the GPU (:mod:`kvlab.attention.attention_plan`): the rules on the
    arguments' kinds are judged on the host once per combination of shapes, dtypes and
    options; the rules on the rows, lengths and slots (values on the device) run in the
    kernel, which reads nothing outside the pool for a request that breaks one and gives it a
    NaN output. In the interpreter the call raises the refusal itself; on a GPU the next
    checked call on the device raises it, or :func:`check_attention_errors`, which waits.
    ``check=False`` turns the kernel's checks off (and the host's shape rules), for a caller
    that checked the same rows and lengths already.
    """
    return attend(q, k_pool, v_pool, page_table, table_idx, seq_lens, scale=scale, num_splits=num_splits,
                  config=config, out_dtype=out_dtype, max_context=max_context, check=check)


class Launch(NamedTuple):
    """One kernel launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


def fast_launches(q, k_pool, v_pool, page_table, table_idx, seq_lens, out, scale: float,
                  num_splits: int, config: FastConfig, *, check: bool = False, status=None,
                  new_k=None, new_v=None) -> list[Launch]:
    """The launches of :func:`fast_paged_decode_attention` on prepared arguments (int64 rows and
    lengths on the device, ``out`` allocated, contiguous pools): the split kernel, then the
    merge unless there is one split. Kept apart so that a test can run them under the memory
    audit. ``check``: the kernel's checks, recording into ``status`` (two int64 words: the first
    refusal, and a flag that there is one); ``new_k``/``new_v``: the decode step's store first."""
    from .split_kernels import merge_splits_kernel, split_decode_kernel

    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    low = k_pool.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
    block_d = max(16, next_pow2(head_dim))
    direct = num_splits == 1
    status = torch.zeros(2, dtype=torch.int64, device=q.device) if status is None else status
    store = new_k is not None
    new_k, new_v = (q, q) if new_k is None else (new_k, new_v)
    if direct:
        o, lse = out, out                       # lse is not read by a DIRECT launch
        so, sl = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        o = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
        so, sl = (o.stride(0), o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1))
    rows, cols = page_table.shape
    launches = [Launch(split_decode_kernel, (batch, kv_heads, num_splits), (
        q, k_pool, v_pool, page_table, table_idx, seq_lens, new_k, new_v, o, lse, status[0:1], status[1:2], scale,
        num_splits,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), page_table.stride(0),
        *((*new_k.stride()[:2], *new_v.stride()[:2]) if store else (0, 0, 0, 0)),
        *so, *sl, head_dim, rows, cols, k_pool.shape[0]), dict(
        GROUP=group, BLOCK_H=max(16 if config.use_dot else 1, next_pow2(group)),
        BLOCK_N=config.block_n, BLOCK_D=block_d, USE_DOT=config.use_dot, LOW_PRECISION=low,
        DIRECT=direct, CHECK=check, STORE=store, num_warps=config.num_warps,
        num_stages=config.num_stages))]
    if not direct:
        launches.append(Launch(merge_splits_kernel, (batch, heads), (
            o, lse, table_idx, seq_lens, out, num_splits, *so, *sl, out.stride(0), out.stride(1), head_dim,
            rows, cols), dict(BLOCK_N=config.block_n, BLOCK_D=block_d, CHECK=check)))
    return launches


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """Plain attention of ``T`` queries at positions ``q_offset..q_offset+T-1`` over keys ``0..S-1``.

    ``q``: ``[T, heads, head_dim]``; ``k``, ``v``: ``[S, heads, head_dim]``. Query ``t`` sees
    keys ``s <= q_offset + t`` (causal).
    """
    T, S = q.shape[0], k.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    allowed = torch.arange(S, device=q.device)[None, :] <= (q_offset + torch.arange(T, device=q.device))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)
