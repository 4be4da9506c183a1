"""Attention whose K/V live in kvlab's pool, for models with grouped-query attention (chapter 10).

A Hugging Face model computes its queries, keys and values itself (projections, RoPE); all
this module does is the part a serving engine owns: **where K/V are kept** and **how
attention reads them back**. Everything here is plain torch plus the Triton kernel of
chapter 08 (:mod:`kvlab.kernels.attention`, which takes a ``KV_GROUP``); nothing imports
transformers, so the exercise and its checker run without it.

Shapes (one layer; GQA: ``heads = kv_heads * group``)::

    q            [batch, heads, head_dim]     one new query per request (decode)
    k, v         [batch, kv_heads, head_dim]  the same tokens' new keys and values
    k_pool       [num_slots, kv_heads, head_dim]   slot s holds the K of one token
    page_table   [rows, cols] int32           row r, position t -> slot

    query heads  h0 h1 h2 h3 | h4 h5 h6 h7      group = 4: query head h reads K/V head h // 4
    K/V heads         k0     |      k1

* :func:`paged_attention_reference` -- the obviously-right version (gather, repeat each K/V
  head for its group, softmax);
* :func:`paged_decode_attention` -- the Triton kernel, behind host checks;
* :func:`paged_attention_step` -- one decode step of one layer for a batch: write the new K/V
  at the slots the page table names, then paged attention over ``[0, position]`` (the
  chapter's exercise, and what :class:`kvlab.hf.PagedGenerator` runs for every decode token);
* :func:`prefill_attention` -- several new tokens of one request at once (a prompt), causal,
  through the row, in torch.
"""
from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument

__all__ = ["check_paged_attention_inputs", "check_rows_mapped", "paged_attention_reference", "paged_decode_attention",
           "check_step_inputs", "paged_attention_step", "prefill_attention"]


# --- host checks ------------------------------------------------------------------------


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


# --- the reference and the kernel --------------------------------------------------------


def paged_attention_reference(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                              scale: float | None = None) -> torch.Tensor:
    """Per request: gather its slots, give every query head its group's K/V head, softmax.

    Returns ``[batch, heads, head_dim]`` float32.
    """
    check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    batch, heads, head_dim = q.shape
    group = heads // k_pool.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(batch):
        row, n = int(table_idx[b]), int(seq_lens[b])
        slots = page_table[row, :n].long()                            # position t -> slot
        k = k_pool[slots].float().repeat_interleave(group, dim=1)     # [n, heads, head_dim]
        v = v_pool[slots].float().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def paged_decode_attention(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                           scale: float | None = None, *, block_n: int | None = None,
                           check: bool = True) -> torch.Tensor:
    """The Triton paged decode attention, with grouped-query attention; checked first.

    Same contract as :func:`paged_attention_reference` (float32 out). One program per
    ``(request, query head)``; query head ``h`` reads K/V head ``h // group``. ``check=False``
    skips the host checks, for a caller that has checked the same page table and lengths
    already (the serving loop checks once per step, not once per layer).
    """
    from ..kernels.attention import paged_decode_attention_kernel
    from ..runtime import pick

    block_n = pick(cpu=64, gpu=32) if block_n is None else block_n
    if check:
        check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    if not isinstance(block_n, int) or block_n < 1 or block_n & (block_n - 1):
        raise InvalidArgument("block_n", "a power of two", f"got {block_n}")
    batch, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
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
        q, k_pool, v_pool, page_table, table_idx, seq_lens, out, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1), head_dim,
        BLOCK_N=block_n, BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()),
        KV_GROUP=heads // k_pool.shape[1],
    )
    return out


# --- one decode step of one layer: store, then attend -------------------------------------


def check_step_inputs(q, k, v, k_pool, v_pool, page_table, rows, positions) -> None:
    """The rules of :func:`paged_attention_step`, checked before anything is written.

    ``k``, ``v``: ``[batch, kv_heads, head_dim]`` like the pools' rows; ``rows``,
    ``positions``: one per request; and the slot of every position ``0..positions[b]`` is
    mapped (so the new token's slot too: a ``-1`` would silently write the pool's last slot).
    """
    positions_t = torch.as_tensor(positions)
    check_paged_attention_inputs(q, k_pool, v_pool, page_table, rows, positions_t + 1)
    want = (q.shape[0], k_pool.shape[1], k_pool.shape[2])
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(name, f"shape [batch, kv_heads, head_dim] = {list(want)}", f"got {got}")


def paged_attention_step(q, k, v, k_pool, v_pool, page_table, rows, positions,
                         scale: float | None = None, *, check: bool = True) -> torch.Tensor:
    """One layer, one decode step, a whole batch: store the new K/V, then paged attention.

    Request ``b`` owns page-table row ``rows[b]``; its new token sits at position
    ``positions[b]``. Its key and value (``k[b]``, ``v[b]``, already rotated by the model)
    go to slot ``page_table[rows[b], positions[b]]`` of ``k_pool`` / ``v_pool``; then its
    query ``q[b]`` attends to positions ``[0, positions[b]]`` -- the new token included --
    through the row. Returns ``[batch, heads, head_dim]`` float32. Lifted from chapter 10
    (the exercise); ``check=False`` is for a caller that checked the step already.
    """
    if check:
        check_step_inputs(q, k, v, k_pool, v_pool, page_table, rows, positions)
    rows = torch.as_tensor(rows, device=page_table.device).long()
    positions = torch.as_tensor(positions, device=page_table.device).long()
    slots = page_table[rows, positions].long()        # where each request's new token goes
    k_pool[slots] = k.to(k_pool.dtype)
    v_pool[slots] = v.to(v_pool.dtype)
    return paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, scale,
                                  check=False)


# --- prefill: several new tokens of one request -------------------------------------------


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      slots: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of ``T`` new tokens at positions ``start .. start+T-1`` of one request.

    ``q``: ``[T, heads, head_dim]``; ``slots``: the request's slots of positions
    ``0 .. start+T-1`` (its page-table row), whose K/V -- the cached prefix and the new
    tokens -- are in the pools already. Query ``t`` sees positions ``<= start + t``.
    Returns ``[T, heads, head_dim]`` float32.
    """
    T, heads, _ = q.shape
    group = heads // k_pool.shape[1]
    k = k_pool[slots].float().repeat_interleave(group, dim=1)      # [S, heads, head_dim]
    v = v_pool[slots].float().repeat_interleave(group, dim=1)
    S = k.shape[0]
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale
    seen = torch.arange(S, device=q.device)[None, :] <= (start + torch.arange(T, device=q.device))[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)
