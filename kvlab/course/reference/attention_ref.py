"""Plain-torch oracle for paged decode attention (chapter 08).

One new query per request attends to the request's tokens ``[0, seq_len)``, found through its
page-table row: gather the slots, softmax, weighted sum, one request at a time. The Triton
kernel (:func:`kvlab.attention.paged_attention.paged_decode_attention`), the exercise checker and the notebook
all compare against it.

This oracle keeps its own small checks instead of calling the kernel wrapper's host checks
(:func:`kvlab.attention.paged_attention.check_paged_attention_inputs`), as every oracle in
:mod:`kvlab.course.reference` keeps its own copies of small helpers: an oracle that shared a helper
with the code it checks would share that helper's bugs, and then agree with them.
"""
from __future__ import annotations

import math

import torch

from ...base.errors import InvalidArgument

__all__ = ["paged_decode_attention_reference"]


def _check(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> tuple[list[int], list[int]]:
    """The rules the gather relies on, with plain loops; returns the rows and lengths as lists."""
    if q.dim() != 3 or k_pool.dim() != 3 or tuple(k_pool.shape) != tuple(v_pool.shape) \
            or tuple(k_pool.shape[1:]) != tuple(q.shape[1:]):
        raise InvalidArgument("q/k_pool/v_pool", "q [batch, heads, head_dim], pools [num_slots, "
                              "heads, head_dim] of the same shape",
                              f"got {list(q.shape)}, {list(k_pool.shape)}, {list(v_pool.shape)}")
    rows = [int(r) for r in torch.as_tensor(table_idx).flatten().tolist()]
    lens = [int(n) for n in torch.as_tensor(seq_lens).flatten().tolist()]
    if len(rows) != q.shape[0] or len(lens) != q.shape[0]:
        raise InvalidArgument("table_idx/seq_lens", "one entry per query",
                              f"batch {q.shape[0]}, {len(rows)} rows, {len(lens)} lengths")
    table = page_table.tolist()
    for b, (row, n) in enumerate(zip(rows, lens)):
        if not 0 <= row < len(table):
            raise InvalidArgument(f"table_idx[{b}]", f"0 <= row < {len(table)}", f"got {row}")
        if not 1 <= n <= len(table[row]):
            raise InvalidArgument(f"seq_lens[{b}]", f"1 <= seq_len <= {len(table[row])}", f"got {n}")
        for t in range(n):
            if not 0 <= table[row][t] < k_pool.shape[0]:
                raise InvalidArgument(f"page_table[{row}, {t}]", f"a mapped slot in [0, {k_pool.shape[0]})",
                                      f"got {table[row][t]}")
    return rows, lens


def paged_decode_attention_reference(q, k_pool, v_pool, page_table, table_idx, seq_lens,
                                     scale: float | None = None) -> torch.Tensor:
    """The obviously-right version: per request, gather its slots, softmax, weighted sum.

    ``q``: ``[batch, heads, head_dim]``; pools ``[num_slots, heads, head_dim]``.
    Returns ``[batch, heads, head_dim]`` float32.
    """
    rows, lens = _check(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, (row, n) in enumerate(zip(rows, lens)):
        slots = [int(page_table[row, t]) for t in range(n)]      # token t lives at slot slots[t]
        k = k_pool[slots].float()                                  # [n, heads, head_dim]
        v = v_pool[slots].float()
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        weights = torch.softmax(scores, dim=-1)                    # [heads, n]
        out[b] = torch.einsum("hn,nhd->hd", weights, v)
    return out


# --- chapter 09: the split over the sequence and its merge --------------------------------


def split_ranges_reference(seq_len: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """The positions ``[start, end)`` of each split of a request that holds any: splits of whole
    blocks, ``ceil(ceil(seq_len / num_splits) / block_n) * block_n`` positions each, in order;
    the last one shorter. ``(300, 4, 64)`` gives ``[(0, 128), (128, 256), (256, 300)]``."""
    per = -(-(-(-seq_len // num_splits)) // block_n) * block_n
    return [(start, min(start + per, seq_len)) for start in range(0, seq_len, per)]


def split_partials_reference(q, k_pool, v_pool, page_table, table_idx, seq_lens, num_splits: int,
                             block_n: int, scale: float | None = None):
    """Each split's partial result, as the first pass of chapter 09 writes it: ``o[b, h, s]`` =
    attention of query head ``h`` over the positions of split ``s`` alone, and ``lse[b, h, s]``
    = the log of the sum of ``exp(score)`` over them. Grouped-query attention: query head
    ``h`` reads K/V head ``h // (heads // kv_heads)``. Splits that hold no position are NaN.
    Returns ``(o [batch, heads, num_splits, head_dim], lse [batch, heads, num_splits])``, float32.
    """
    batch, heads, head_dim = q.shape
    group = heads // k_pool.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    o = torch.full((batch, heads, num_splits, head_dim), float("nan"))
    lse = torch.full((batch, heads, num_splits), float("nan"))
    for b in range(batch):
        row, n = int(table_idx[b]), int(seq_lens[b])
        for s, (start, end) in enumerate(split_ranges_reference(n, num_splits, block_n)):
            slots = [int(page_table[row, t]) for t in range(start, end)]
            k = k_pool[slots].float().cpu().repeat_interleave(group, dim=1)   # [len, heads, d]
            v = v_pool[slots].float().cpu().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[b].float().cpu(), k) * scale
            o[b, :, s] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
            lse[b, :, s] = torch.logsumexp(scores, dim=-1)
    return o, lse


def merge_splits_reference(o, lse, live: list[int]) -> torch.Tensor:
    """The whole attention from the splits' partials: request ``b`` has ``live[b]`` splits, and
    ``out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)`` with ``M`` the largest ``lse``
    (subtracting it keeps every ``exp`` at most 1). Returns ``[batch, heads, head_dim]``."""
    batch, heads, _, head_dim = o.shape
    out = torch.empty(batch, heads, head_dim)
    for b in range(batch):
        n = live[b]
        m = lse[b, :, :n].max(dim=-1, keepdim=True).values                # [heads, 1]
        w = torch.exp(lse[b, :, :n] - m)                                   # [heads, n]
        out[b] = (w[:, :, None] * o[b, :, :n]).sum(1) / w.sum(-1, keepdim=True)
    return out
