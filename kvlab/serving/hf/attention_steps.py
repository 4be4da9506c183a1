"""Attention whose K/V live in kvlab's pool, for models with grouped-query attention (chapter 10).

A Hugging Face model computes its queries, keys and values itself (projections, RoPE); all
this module does is the part a serving engine owns: **where K/V are kept** and **how
attention reads them back**. Everything here is plain torch plus the Triton kernel of
chapter 08 (:mod:`kvlab.attention.decode_kernels`, which takes a ``KV_GROUP``); nothing imports
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
* :func:`kvlab.attention.paged_attention.paged_decode_attention` -- chapter 08's Triton kernel behind its host
  checks, which takes grouped-query attention (re-exported here);
* :func:`kvlab.attention.paged_attention.fast_paged_decode_attention` -- chapter 09's fast kernels (a K/V
  group's query heads in one program, a split over the sequence), the same contract;
* :func:`paged_attention_step` -- one decode step of one layer for a batch: write the new K/V
  at the slots the page table names, then paged attention over ``[0, position]`` (the
  chapter's exercise, and what :class:`kvlab.serving.hf.PagedGenerator` runs for every decode token;
  ``impl="fast"``, the default, reads through chapter 09's kernels, ``"teaching"`` through
  chapter 08's);
* :func:`prefill_attention` -- several new tokens of one request at once (a prompt or a chunk
  of one), causal, through the row, with torch's ``scaled_dot_product_attention``.
"""
from __future__ import annotations

import math

import torch

from ...base.args import check_int, check_scale, is_int
from ...attention.paged_attention import (check_paged_attention_inputs, check_rows_mapped, fast_paged_decode_attention,
                         paged_decode_attention)
from ...base.errors import InvalidArgument

__all__ = ["check_paged_attention_inputs", "check_rows_mapped", "paged_attention_reference",
           "paged_decode_attention", "fast_paged_decode_attention", "ATTENTION_IMPLS",
           "check_impl", "check_step_inputs", "paged_attention_step", "warm_up_fast_kernels", "prefill_mask",
           "check_prefill_inputs", "prefill_attention"]

#: the decode kernels a step can read through: chapter 09's fast ones, chapter 08's
ATTENTION_IMPLS = ("fast", "teaching")


def check_impl(impl, argument: str = "impl") -> str:
    if impl not in ATTENTION_IMPLS:
        raise InvalidArgument(argument, f"one of {ATTENTION_IMPLS} (chapter 09's kernels or chapter 08's)",
                              f"got {impl!r}")
    return impl


# --- the reference ----------------------------------------------------------------------


def paged_attention_reference(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                              scale: float | None = None) -> torch.Tensor:
    """Per request: gather its slots, give every query head its group's K/V head, softmax.

    Returns ``[batch, heads, head_dim]`` float32.
    """
    check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    scale = check_scale(scale)
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


# --- one decode step of one layer: store, then attend -------------------------------------


def check_step_inputs(q, k, v, k_pool, v_pool, page_table, rows, positions) -> None:
    """The rules of :func:`paged_attention_step`, checked before anything is written.

    ``k``, ``v``: ``[batch, kv_heads, head_dim]`` like the pools' rows; ``rows``,
    ``positions``: one per request; and the slot of every position ``0..positions[b]`` is
    mapped (so the new token's slot too: a ``-1`` would silently write the pool's last slot).
    """
    if not isinstance(positions, torch.Tensor) and not (isinstance(positions, (list, tuple))
                                                          and all(is_int(p) for p in positions)):
        raise InvalidArgument("positions", "an int tensor or a list of ints, one per request",
                              f"got {type(positions).__name__}")
    positions_t = torch.as_tensor(positions)
    check_paged_attention_inputs(q, k_pool, v_pool, page_table, rows, positions_t + 1)
    want = (q.shape[0], k_pool.shape[1], k_pool.shape[2])
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(name, f"shape [batch, kv_heads, head_dim] = {list(want)}", f"got {got}")


def paged_attention_step(q, k, v, k_pool, v_pool, page_table, rows, positions,
                         scale: float | None = None, *, check: bool = True, impl: str = "fast",
                         slots: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One layer, one decode step, a whole batch: store the new K/V, then paged attention.

    Request ``b`` owns page-table row ``rows[b]``; its new token sits at position
    ``positions[b]``. Its key and value (``k[b]``, ``v[b]``, already rotated by the model)
    go to slot ``page_table[rows[b], positions[b]]`` of ``k_pool`` / ``v_pool``; then its
    query ``q[b]`` attends to positions ``[0, positions[b]]`` -- the new token included --
    through the row. Returns ``[batch, heads, head_dim]`` in ``out_dtype`` (float32 by
    default). Lifted from chapter 10 (the exercise); ``check=False`` is for a caller that
    checked the step already.

    ``impl``: ``"fast"`` (chapter 09's kernels) or ``"teaching"`` (chapter 08's). ``slots``
    and ``seq_lens`` (``page_table[rows, positions]`` and ``positions + 1``) may be given by a
    caller that computed them once for every layer of the step.
    """
    check_impl(impl)
    if check:
        check_step_inputs(q, k, v, k_pool, v_pool, page_table, rows, positions)
        scale = check_scale(scale)
    rows = torch.as_tensor(rows, device=page_table.device).long()
    positions = torch.as_tensor(positions, device=page_table.device).long()
    if slots is None:
        slots = page_table[rows, positions].long()    # where each request's new token goes
    if seq_lens is None:
        seq_lens = positions + 1
    k_pool[slots] = k.to(k_pool.dtype)
    v_pool[slots] = v.to(v_pool.dtype)
    if impl == "fast":
        return fast_paged_decode_attention(q, k_pool, v_pool, page_table, rows, seq_lens, scale,
                                           out_dtype=out_dtype, check=False)
    return paged_decode_attention(q, k_pool, v_pool, page_table, rows, seq_lens, scale,
                                  check=False).to(out_dtype)


def warm_up_fast_kernels(k_pool, v_pool, page_table, row: int, heads: int, dtype: torch.dtype) -> None:
    """Compile both variants of chapter 09's decode kernels now (one split, written directly;
    several, then merged) by attending once from ``row``'s position 0 each way: a server
    meets both as its batch grows, and should compile neither while it serves."""
    q = torch.zeros(1, heads, k_pool.shape[2], dtype=dtype, device=k_pool.device)
    one = torch.tensor([row], device=page_table.device)
    for splits in (1, 2):
        fast_paged_decode_attention(q, k_pool, v_pool, page_table, one, torch.ones_like(one),
                                    num_splits=splits, out_dtype=dtype, check=False)


# --- prefill: several new tokens of one request -------------------------------------------


def prefill_mask(start: int, T: int, group: int, device=None) -> torch.Tensor:
    """Which positions each query of a prefill reads: ``[group * T, start + T]`` bool.

    Query ``t`` (at position ``start + t``) reads positions ``<= start + t``; the ``T`` rows
    repeat once per query head of a K/V head's group (see :func:`prefill_attention`)."""
    seen = torch.arange(start + T, device=device)[None, :] <= (start + torch.arange(T, device=device))[:, None]
    return seen.repeat(group, 1)


def check_prefill_inputs(q, k_pool, v_pool, slots, start, scale, mask) -> None:
    """The rules of :func:`prefill_attention`, checked before anything is read (a few waits
    for the GPU: the slots' values)."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.dtype.is_floating_point:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(name, "a 3-D floating tensor", f"got {got}")
    T, heads, d = q.shape
    if k_pool.shape != v_pool.shape or k_pool.shape[2] != d or k_pool.shape[1] < 1 or heads % k_pool.shape[1]:
        raise InvalidArgument("k_pool", f"[slots, kv_heads, {d}] like v_pool, kv_heads dividing {heads} "
                              "query heads", f"got {list(k_pool.shape)} and {list(v_pool.shape)}")
    start = check_int("start", start, minimum=0)
    if T < 1:
        raise InvalidArgument("q", "at least one query", "got none")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype.is_floating_point \
            or slots.dtype == torch.bool or slots.numel() != start + T:
        got = list(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise InvalidArgument("slots", f"a 1-D integer tensor of start + T = {start + T} slots", f"got {got}")
    if slots.device != k_pool.device or not bool(((slots >= 0) & (slots < k_pool.shape[0])).all()):
        raise InvalidArgument("slots", f"slots in [0, {k_pool.shape[0]}) on the pools' device",
                              f"got {slots.device}")
    check_scale(scale)
    want = (heads // k_pool.shape[1] * T, start + T)
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                             or tuple(mask.shape) != want):
        raise InvalidArgument("mask", f"None or a bool tensor {list(want)} (prefill_mask)",
                              f"got {getattr(mask, 'shape', type(mask).__name__)}")


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      slots: torch.Tensor, start: int, scale: float | None, *,
                      mask: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """Causal attention of ``T`` new tokens at positions ``start .. start+T-1`` of one request.

    ``q``: ``[T, heads, head_dim]``; ``slots``: the request's slots of positions
    ``0 .. start+T-1`` (its page-table row), whose K/V -- the cached prefix and the new
    tokens -- are in the pools already. Query ``t`` sees positions ``<= start + t``.
    Returns ``[T, heads, head_dim]`` in ``q``'s dtype.

    Grouped-query attention without copying K/V for each query head: the ``group`` query
    heads of one K/V head become ``group * T`` queries of that head (``mask``, from
    :func:`prefill_mask`, says what each reads; a step builds it once for all layers)::

        q [T, heads, d] -> [kv_heads, group * T, d]      k, v [kv_heads, S, d]

    ``check=False`` skips :func:`check_prefill_inputs`, for a serving loop that built the
    step itself.
    """
    if check:
        check_prefill_inputs(q, k_pool, v_pool, slots, start, scale, mask)
    T, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    if mask is None:
        mask = prefill_mask(start, T, group, q.device)
    k = k_pool[slots].transpose(0, 1).to(q.dtype)                 # [kv_heads, S, d]
    v = v_pool[slots].transpose(0, 1).to(q.dtype)
    grouped = q.transpose(0, 1).reshape(kv_heads, group * T, head_dim)  # head h = kv * group + g
    # four dimensions (batch 1): with three, torch runs its plain matrix-product path on a GPU
    # (torch 2.11 on an H200); with four, a fused kernel (kvlab.serving.hf.step.PREFILL_BACKENDS)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped[None], k[None], v[None], attn_mask=mask[None, None], scale=scale)[0]
    return out.reshape(heads, T, head_dim).transpose(0, 1)
