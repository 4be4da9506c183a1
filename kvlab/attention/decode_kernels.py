"""Paged decode attention in Triton: each request reads its K/V through its page-table row.

Built in chapter 08 (capstone); chapter 10 adds grouped-query attention (GQA). One program
per ``(request, query head)``:

    page_table row r = table_idx[b]      K pool (one layer)              V pool (same slots)
    ┌────┬────┬────┬────┬────┬──┐        slot 0  [h0|h1|...] head_dim    slot 0  [...]
    │ 12 │ 13 │ 40 │ 41 │ -1 │..│  ──►   ...                             ...
    └────┴────┴────┴────┴────┴──┘        slot 12 [  k(t=0) for head h ]  slot 12 [ v(t=0) ]
      t=0  t=1  t=2  t=3                 slot 40 [  k(t=2) for head h ]  slot 40 [ v(t=2) ]

The program walks the request's tokens ``[0, seq_len)`` in blocks of ``BLOCK_N`` columns
(a *runtime* loop bound: no recompilation per length), gathers the slots of the block from
the row, loads those K and V rows, and keeps an online softmax (running max ``m``, running
sum ``l``, running weighted sum ``acc``) so the scores never need to fit in memory at once.

Grouped-query attention (Llama 3, SmolLM2, Qwen2): the pools hold fewer K/V heads than the
query has heads, and ``KV_GROUP`` consecutive query heads read the same K/V head::

    query heads   h0  h1 | h2  h3        KV_GROUP = 2: query head h reads K/V head h // 2
    K/V heads       k0   |   k1

``KV_GROUP = 1`` (the default) is ordinary multi-head attention: one K/V head per query head.

Every load is masked; the host (:func:`kvlab.attention.paged_attention.paged_decode_attention`, which chapter
10 also uses for GQA) checks before launch that rows, lengths and every slot the kernel will
read are in range.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_attention_kernel(
    q_ptr,            # [batch, heads, head_dim] float32: the one new query per request
    k_pool_ptr,       # [num_slots, heads // KV_GROUP, head_dim]: this layer's K pool
    v_pool_ptr,       # [num_slots, heads // KV_GROUP, head_dim]: this layer's V pool
    page_table_ptr,   # [rows, cols] int32: logical token position -> physical slot
    table_idx_ptr,    # [batch] int32/int64: which page-table row each request owns
    seq_lens_ptr,     # [batch] int32/int64: tokens of each request to attend to (>= 1)
    out_ptr,          # [batch, heads, head_dim] float32
    scale,            # 1 / sqrt(head_dim)
    stride_q_b, stride_q_h,
    stride_kv_s, stride_kv_h,
    stride_pt_row,
    stride_o_b, stride_o_h,
    head_dim,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_GROUP: tl.constexpr = 1,   # query heads per K/V head (GQA); 1 = multi-head attention
):
    b = tl.program_id(0)
    h = tl.program_id(1)          # the query head
    kv_h = h // KV_GROUP          # the K/V head it reads
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h + offs_d,
                mask=mask_d, other=0.0).to(tl.float32)

    # online softmax state: running max, running sum of exp, running weighted V sum
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)

    for start in range(0, seq_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        # the page-table row says where each token of this block lives in the pool
        slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0)
        slots = slots.to(tl.int64)
        kv_offs = slots[:, None] * stride_kv_s + kv_h * stride_kv_h + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_pool_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[None, :] * k, 1) * scale
        scores = tl.where(mask_n, scores, -float("inf"))

        m_new = tl.maximum(tl.max(scores, 0), m_i)
        alpha = tl.exp(m_i - m_new)        # rescales what was summed under the old max
        p = tl.exp(scores - m_new)         # masked lanes: exp(-inf) = 0
        v = tl.load(v_pool_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new

    out = acc / l_i
    tl.store(out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h + offs_d, out, mask=mask_d)
