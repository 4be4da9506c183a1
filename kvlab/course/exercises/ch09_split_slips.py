"""Chapter 09's first pass, as slips compute it: the layouts ``split_attention``'s cases run on,
and the partial results a first pass with one known slip writes in Triton's interpreter.

The checker compares a wrong answer with each emulation: the one that matches names the slip.
An emulation reads memory as the interpreter under kvlab's safety net does, so a slip that
reads outside the pool is recognised by its values too::

    element of K/V the kernel addresses      value it gets
    inside the pool                          the pool's
    in the guard band (BAND elements)        NaN (the band's sentinel)
    farther out                              other=0.0 (the audit switches the lane off)

A NaN read makes its whole split NaN (its score is NaN, and so is the running max).
"""
from __future__ import annotations

import random

import torch

from ..reference.attention_ref import split_ranges_reference
from ..checking.guards import BAND


def spare_layout(seed: int, page_size: int, lens: list[int], heads: int, kv_heads: int, head_dim: int,
                 spare: int, last_in_use: bool = False):
    """Random K/V; each request's tokens on shuffled pages; ``spare`` pages nobody owns; rows
    shuffled. ``(q, k_pool, v_pool, page_table, rows, seq_lens)``.

    By default the spare pages are the last of the pool, so that a block reading past its page
    stays inside the pool and reads someone else's rows. ``last_in_use``: they are the first
    ones instead, the pool's last page is request 0's first (whole) page and the longest
    request sits in the table's last row, so a load that reaches past a K/V row or a page-table
    row reads past the end of its tensor."""
    rng = random.Random(seed)
    need = [-(-n // page_size) for n in lens]
    first = spare if last_in_use else 0
    pages = list(range(first, first + sum(need)))
    rng.shuffle(pages)
    rows = list(range(len(lens) + 1))
    rng.shuffle(rows)
    if last_in_use:
        top = pages.index(max(pages))
        pages[0], pages[top] = pages[top], pages[0]
        longest = max(range(len(lens)), key=lambda b: lens[b])
        bottom = rows.index(len(lens))
        rows[longest], rows[bottom] = rows[bottom], rows[longest]
    table = torch.full((len(lens) + 1, max(need) * page_size), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(lens):
        mine = pages[at:at + need[b]]
        at += need[b]
        table[rows[b], :n] = torch.tensor([p * page_size + i for p in mine for i in range(page_size)][:n])
    gen = torch.Generator().manual_seed(seed)
    slots = (sum(need) + spare) * page_size
    k = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(slots, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    return q, k, v, table, torch.tensor(rows[:len(lens)]), torch.tensor(lens)


#: mistakes in the block's loads the checker recognises (:func:`emulated_partials` gives their numbers)
SLIPS = {
    "first_query_head": "program (b, g, s) reads K/V head g * GROUP, the number of its first query "
    "head: the GROUP query heads g*GROUP .. g*GROUP+GROUP-1 share K/V head g (the program's own "
    "tl.program_id(1)), so the K/V address is slots * stride_kv_s + g * stride_kv_h",
    "head_zero": "every program reads K/V head 0: the group's K/V head is g = tl.program_id(1), at "
    "g * stride_kv_h within a slot's row",
    "consecutive": "the block reads consecutive slots from its first position's slot (page_table[row, n0] "
    "+ 0, 1, 2, ...): a block that crosses a page boundary then reads the slots after the page, "
    "not the next page of the row. Load one slot per position: page_table[row, offs_n]",
    "row_b": "the block reads page-table row b, the program's request number, instead of its row "
    "`row = table_idx[b]`: a request need not sit in the row of its own number. Row b is another "
    "request's (its slots, its length) or holds -1, and slot -1 reads before the start of the pool. "
    "Load the slots from page_table_ptr + row * stride_pt_row + offs_n",
    "inclusive": "the block's mask takes the split's end too (offs_n <= end): position `end` is not "
    "the split's (it is the next split's first, or past the request, where the page table holds -1 "
    "and slot -1 reads before the start of the pool). The positions are [start, end): mask_n = offs_n < end",
    "k_like_v": "K is loaded in V's shape, [BLOCK_N, BLOCK_D] (offsets kv[:, None] + offs_d[None, :]): "
    "with BLOCK_N == BLOCK_D, tl.dot(q, k) still runs, but it multiplies q by K's positions as if "
    "they were its head dimensions. tl.dot(q, K) needs K as [BLOCK_D, BLOCK_N]: offsets kv[None, :] "
    "+ offs_d[:, None], mask mask_n[None, :] & mask_d[:, None] (or tl.trans of the [BLOCK_N, BLOCK_D] load)",
}


def _flat_reader(t: torch.Tensor):
    """``read(addresses)``: elements of ``t`` (flat) as the interpreter under the audit reads them."""
    flat = t.reshape(-1).float()
    n = flat.numel()

    def read(addr: torch.Tensor) -> torch.Tensor:
        inside = (addr >= 0) & (addr < n)
        band = ((addr >= -BAND) & (addr < 0)) | ((addr >= n) & (addr < n + BAND))
        out = torch.zeros(addr.shape)
        out[inside] = flat[addr[inside]]
        out[band] = float("nan")
        return out

    return read


def _table_slot(table: torch.Tensor, row: int, t: int) -> int:
    """``page_table[row, t]`` read through the flat address ``row * width + t``: another row's
    entry past the row's end; past the table, a guard value (a slot far outside the pool) or,
    farther, the load's ``other=0``."""
    flat, width = table.reshape(-1), table.shape[1]
    at = row * width + t
    if 0 <= at < flat.numel():
        return int(flat[at])
    return -(1 << 40) if -BAND <= at < flat.numel() + BAND else 0


def _positions(slip: str, start: int, end: int, block_n: int) -> list[int]:
    """The positions a split reads: ``[start, end)``; with ``inclusive``, also ``end`` when it lies
    inside the split's last block."""
    extra = [end] if slip == "inclusive" and (end - start) % block_n else []
    return list(range(start, end)) + extra


def emulated_partials(q, k_pool, v_pool, page_table, table_idx, seq_lens, num_splits, block_n, scale,
                      slip: str):
    """The partial results ``(o, lse)`` a first pass with ``slip`` (a key of :data:`SLIPS`)
    writes in the interpreter, or ``None`` where the slip cannot run (``k_like_v`` needs
    BLOCK_N == BLOCK_D)."""
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    if slip == "k_like_v" and block_d != block_n:
        return None
    read_k, read_v = _flat_reader(k_pool), _flat_reader(v_pool)
    stride_s, stride_h = kv_heads * head_dim, head_dim
    d = torch.arange(head_dim)
    o = torch.full((batch, heads, num_splits, head_dim), float("nan"))
    lse = torch.full((batch, heads, num_splits), float("nan"))
    for b in range(batch):
        row = b if slip == "row_b" else int(table_idx[b])
        n = int(seq_lens[b])
        for s, (start, end) in enumerate(split_ranges_reference(n, num_splits, block_n)):
            if slip == "consecutive":
                slots = [_table_slot(page_table, row, n0) + i for n0 in range(start, end, block_n)
                         for i in range(min(block_n, end - n0))]
            else:
                slots = [_table_slot(page_table, row, t) for t in _positions(slip, start, end, block_n)]
            for h in range(heads):
                g = h // group
                kvh = {"first_query_head": g * group, "head_zero": 0}.get(slip, g)
                base = torch.tensor(slots, dtype=torch.int64)[:, None] * stride_s + kvh * stride_h
                k, v = read_k(base + d), read_v(base + d)           # [positions, head_dim]
                qh = q[b, h].float()
                if slip == "k_like_v":
                    scores = _scores_k_like_v(qh, k, start, end, block_n) * scale
                else:
                    scores = (k @ qh) * scale
                o[b, h, s] = torch.softmax(scores, 0) @ v
                lse[b, h, s] = torch.logsumexp(scores, 0)
                if bool(torch.isnan(scores).any()) or bool(torch.isnan(v).any()):
                    o[b, h, s], lse[b, h, s] = float("nan"), float("nan")
    return o, lse


def _scores_k_like_v(qh: torch.Tensor, k: torch.Tensor, start: int, end: int, block_n: int) -> torch.Tensor:
    """Scores when each block's K is ``[BLOCK_N, BLOCK_D]`` and tl.dot takes it as ``[BLOCK_D,
    BLOCK_N]``: position ``n0 + j`` scores ``sum_i q[i] * K[n0 + i, j]`` (0 past the row's
    head_dim, or past the split's end)."""
    head_dim = qh.shape[0]
    out = []
    for n0 in range(start, end, block_n):
        count = min(block_n, end - n0)
        block = torch.zeros(block_n, block_n)
        block[:count, :head_dim] = k[n0 - start:n0 - start + count]
        q_pad = torch.zeros(block_n)
        q_pad[:head_dim] = qh
        out.append((q_pad @ block)[:count])
    return torch.cat(out)
