"""Plain-torch oracle for paged decode attention (chapter 08).

One new query per request attends to the request's tokens ``[0, seq_len)``, found through its
page-table row: gather the slots, softmax, weighted sum, one request at a time. The Triton
kernel (:func:`kvlab.attention.paged_decode_attention`), the exercise checker and the notebook
all compare against it.

This oracle keeps its own small checks instead of calling the kernel wrapper's host checks
(:func:`kvlab.attention.check_paged_attention_inputs`), as every oracle in
:mod:`kvlab.reference` keeps its own copies of small helpers: an oracle that shared a helper
with the code it checks would share that helper's bugs, and then agree with them.
"""
from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument

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
