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

__all__ = ["check_paged_attention_inputs", "check_rows_mapped", "paged_decode_attention",
           "FastConfig", "choose_num_splits", "split_ranges", "fast_paged_decode_attention",
           "fast_launches",
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
    if k_pool.dim() != 3 or k_pool.shape[2] != head_dim:
        raise InvalidArgument("k_pool", f"shape [num_slots, kv_heads, {head_dim}] (head_dim of q)",
                              f"got {list(k_pool.shape)}")
    kv_heads = k_pool.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise InvalidArgument("k_pool", f"kv_heads must divide the {heads} query heads "
                              "(grouped-query attention)", f"got {kv_heads} K/V heads")
    if v_pool.shape != k_pool.shape:
        raise InvalidArgument("v_pool", "same shape as k_pool",
                              f"{list(v_pool.shape)} vs {list(k_pool.shape)}")
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


class FastConfig(NamedTuple):
    """How :func:`fast_paged_decode_attention` launches its split kernel (compile-time choices).

    The default is the variant that measured fastest on an H200 at batch 64, where the floor
    is tightest, among blocks of 32, 64 and 128 positions, 2-8 warps and 2-3 pipeline stages
    (bfloat16, 32 query heads on 8 K/V heads of 64)."""

    block_n: int = 128         # positions per block (a power of two >= 16)
    use_dot: bool = True       # scores with tl.dot (the group's heads padded to 16 rows)
    num_warps: int = 4
    num_stages: int = 2


#: programs per streaming multiprocessor the split aims for (on an H200, 2 measured faster than
#: 4 and 8 at batch 64, where fewer splits mean no merge to launch)
PROGRAMS_PER_SM = 2
#: a split holds at least this many positions: shorter ones cost more to merge than they save
MIN_SPLIT_TOKENS = 256
#: at most this many splits (the partial results grow with it)
MAX_SPLITS = 64
#: streaming multiprocessors assumed in the interpreter (few: every program runs on the CPU)
INTERPRETER_SMS = 2


def streaming_multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, kv_heads: int, context: int, sms: int, block_n: int = 64) -> int:
    """How many programs share one request's positions, per K/V head.

    Enough ``batch * kv_heads * splits`` programs to keep ``PROGRAMS_PER_SM`` on each of the
    ``sms`` multiprocessors, but no split shorter than ``MIN_SPLIT_TOKENS`` positions of the
    longest ``context``, and at most ``MAX_SPLITS``. A batch that fills the GPU by itself
    gets one split (no merge)::

        batch 1,   8 K/V heads, context 32768, 132 SMs:  ceil(264 / 8) = 33 splits
        batch 1,   8 K/V heads, context 512:             512 / 256 = 2 splits
        batch 64,  8 K/V heads, context 4096:            ceil(264 / 512) = 1 split
    """
    programs = max(1, batch * kv_heads)
    want = div_ceil(PROGRAMS_PER_SM * sms, programs)
    by_context = div_ceil(max(1, context), max(MIN_SPLIT_TOKENS, block_n))
    return int(max(1, min(want, by_context, MAX_SPLITS)))


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
    """Paged decode attention on chapter 09's fast kernels; the contract and the checks of
    :func:`paged_decode_attention` (grouped-query attention included).

    ``num_splits`` programs share each request's positions per K/V head (default:
    :func:`choose_num_splits` from the batch, the K/V heads and ``max_context``, the longest
    length expected, by default the page table's columns); one split writes the output
    directly, more launch the merge. ``q`` may be in any float dtype (the model's); the
    output is ``out_dtype`` (float32 by default, as the oracle's). ``config``: block size and
    launch options (:class:`FastConfig`'s defaults). ``check=False`` skips the host checks,
    for a caller that checked the same rows and lengths already.
    """
    if check:
        check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    config = FastConfig() if config is None else config
    if not is_int(config.block_n) or config.block_n < 16 or config.block_n & (config.block_n - 1):
        raise InvalidArgument("config.block_n", "a power of two >= 16", f"got {config.block_n!r}")
    device = q.device
    if num_splits is None:
        context = page_table.shape[1] if max_context is None else max_context
        num_splits = choose_num_splits(batch, kv_heads, context, streaming_multiprocessors(device),
                                       config.block_n)
    if not is_int(num_splits) or num_splits < 1:
        raise InvalidArgument("num_splits", "an int >= 1", f"got {num_splits!r}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if q.stride(2) != 1:
        q = q.contiguous()
    k_pool, v_pool, page_table = k_pool.contiguous(), v_pool.contiguous(), page_table.contiguous()
    table_idx = torch.as_tensor(table_idx).to(device=device, dtype=torch.int64)
    seq_lens = torch.as_tensor(seq_lens).to(device=device, dtype=torch.int64)
    out = torch.empty((batch, heads, head_dim), dtype=out_dtype, device=device)
    if batch == 0:
        return out
    for launch in fast_launches(q, k_pool, v_pool, page_table, table_idx, seq_lens, out, scale,
                                num_splits, config):
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return out


class Launch(NamedTuple):
    """One kernel launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


def fast_launches(q, k_pool, v_pool, page_table, table_idx, seq_lens, out, scale: float,
                  num_splits: int, config: FastConfig) -> list[Launch]:
    """The launches of :func:`fast_paged_decode_attention` on prepared arguments (int64 rows and
    lengths on the device, ``out`` allocated): the split kernel, then the merge unless there is
    one split. Kept apart so that a test can run them under the memory audit."""
    from .split_kernels import merge_splits_kernel, split_decode_kernel

    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    low = k_pool.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
    block_d = max(16, next_pow2(head_dim))
    direct = num_splits == 1
    if direct:
        o, lse = out, out                       # lse is not read by a DIRECT launch
        so, sl = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        o = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
        so, sl = (o.stride(0), o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1))
    launches = [Launch(split_decode_kernel, (batch, kv_heads, num_splits), (
        q, k_pool, v_pool, page_table, table_idx, seq_lens, o, lse, scale, num_splits,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), page_table.stride(0),
        *so, *sl, head_dim), dict(
        GROUP=group, BLOCK_H=max(16 if config.use_dot else 1, next_pow2(group)),
        BLOCK_N=config.block_n, BLOCK_D=block_d, USE_DOT=config.use_dot, LOW_PRECISION=low,
        DIRECT=direct, num_warps=config.num_warps, num_stages=config.num_stages))]
    if not direct:
        launches.append(Launch(merge_splits_kernel, (batch, heads), (
            o, lse, seq_lens, out, num_splits, *so, *sl, out.stride(0), out.stride(1), head_dim),
            dict(BLOCK_N=config.block_n, BLOCK_D=block_d)))
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
