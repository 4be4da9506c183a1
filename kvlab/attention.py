"""Attention that reads K/V through the page table (chapter 08), mini-sglang's attention layer.

Two operations the tiny model of :mod:`kvlab.engine` uses:

* :func:`paged_decode_attention` -- one new query per request attends to the request's tokens
  ``[0, seq_len)``, found through its page-table row: a checked wrapper around the Triton
  kernel (:mod:`kvlab.kernels.attention`); its plain-torch oracle is
  :func:`kvlab.reference.paged_decode_attention_reference`;
* :func:`causal_attention` -- plain causal attention of a block of queries (a prefill) over
  keys already gathered into one tensor.

Memory picture (one layer; the V pool has the same layout)::

    page_table (int32)                 k_pool  [num_slots, heads, head_dim]
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

from .args import is_int, next_pow2
from .errors import InvalidArgument
from .runtime import pick

__all__ = ["check_paged_attention_inputs", "paged_decode_attention", "causal_attention"]


def check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> None:
    """Every rule the kernel relies on, checked on the host before any launch.

    Rules: ``q`` is ``[batch, heads, head_dim]``; pools are ``[num_slots, heads, head_dim]``;
    ``table_idx`` names existing rows; ``1 <= seq_lens[b] <= page_table.shape[1]``; and every
    entry ``page_table[table_idx[b], :seq_lens[b]]`` is a slot in ``[0, num_slots)`` (an
    unmapped -1 or a stale slot would be read as K/V otherwise).
    """
    if q.dim() != 3:
        raise InvalidArgument("q", "shape [batch, heads, head_dim]", f"got {list(q.shape)}")
    batch, heads, head_dim = q.shape
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dim() != 3 or tuple(pool.shape[1:]) != (heads, head_dim):
            raise InvalidArgument(name, f"shape [num_slots, {heads}, {head_dim}] (heads, head_dim of q)",
                                  f"got {list(pool.shape)}")
    if k_pool.shape != v_pool.shape:
        raise InvalidArgument("v_pool", "same shape as k_pool",
                              f"{list(v_pool.shape)} vs {list(k_pool.shape)}")
    if page_table.dim() != 2:
        raise InvalidArgument("page_table", "2-D [rows, cols]", f"got {list(page_table.shape)}")
    table_idx = torch.as_tensor(table_idx).flatten().cpu()
    seq_lens = torch.as_tensor(seq_lens).flatten().cpu()
    if table_idx.numel() != batch or seq_lens.numel() != batch:
        raise InvalidArgument("table_idx/seq_lens", "one entry per query",
                              f"batch {batch}, table_idx {table_idx.numel()}, seq_lens {seq_lens.numel()}")
    rows, cols = page_table.shape
    num_slots = k_pool.shape[0]
    for b in range(batch):
        row, n = int(table_idx[b]), int(seq_lens[b])
        if not 0 <= row < rows:
            raise InvalidArgument(f"table_idx[{b}]", f"0 <= row < {rows} (page_table rows)", f"got {row}")
        if not 1 <= n <= cols:
            raise InvalidArgument(f"seq_lens[{b}]", f"1 <= seq_len <= {cols} (page_table columns)",
                                  f"got {n}")
        slots = page_table[row, :n]
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_slots:
            bad = int(((slots < 0) | (slots >= num_slots)).nonzero()[0])
            raise InvalidArgument(
                f"page_table[{row}, {bad}]", f"a mapped slot in [0, {num_slots}) for every position < seq_len",
                f"request {b} has seq_len {n} but position {bad} holds {int(slots[bad])}")


def paged_decode_attention(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                           scale: float | None = None, *, block_n: int | None = None) -> torch.Tensor:
    """Triton paged decode attention (one program per request and head), checked first.

    Same contract as the oracle :func:`kvlab.reference.paged_decode_attention_reference`. ``block_n`` (a power of two)
    is how many token columns a program reads per loop iteration; by default 32 on a GPU
    and 64 in the interpreter (fewer, wider iterations: the interpreter pays per operation).
    """
    from .kernels.attention import paged_decode_attention_kernel

    block_n = pick(cpu=64, gpu=32) if block_n is None else block_n
    check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
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
    )
    return out


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
