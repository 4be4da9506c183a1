"""Paged decode attention at the memory floor: grouped heads, a split over the sequence, a merge
(chapter 09). The readable first version is chapter 08's :mod:`kvlab.attention.decode_kernels`.

Decode attention does almost no arithmetic per byte: every K/V row it loads is used for one
dot product per query head. Its time is the time to read K/V, so a fast kernel is one that
reads each K/V byte **once** and keeps enough programs in flight to use the whole memory
system. Chapter 08's kernel runs one program per ``(request, query head)``: with grouped-query
attention the ``group`` query heads of one K/V head each read that head's K/V, ``group`` times
in all, and a batch of one long request runs only ``heads`` programs on a GPU with over a
hundred streaming multiprocessors. Here:

* **one program per (request, K/V head, split)** serves all ``group`` query heads of the K/V
  head: it loads a block of K rows once and computes the ``[group, BLOCK_N]`` scores with one
  ``tl.dot`` (the heads padded to ``BLOCK_H >= 16`` rows, the smallest ``tl.dot``);
* **a split over the sequence** (FlashDecoding's split-K): the request's positions are cut
  into ``num_splits`` ranges of whole ``BLOCK_N`` blocks, one program each, so a short batch
  of long requests still fills the GPU. Each program writes its partial result: the
  normalised output ``o_s`` of its range and the log-sum-exp ``lse_s = m_s + log(l_s)`` of its
  scores;
* **the merge** (:func:`merge_splits_kernel`, one program per ``(request, query head)``) is the
  online softmax once more, over splits instead of blocks: with ``M = max_s lse_s``,
  ``out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)``. Subtracting ``M`` is what keeps
  ``exp`` finite (a score of 100 makes ``exp(lse)`` overflow float32).

SGLang's Triton decode attention is built the same way (``_fwd_grouped_kernel_stage1`` and
``_fwd_kernel_stage2`` in ``python/sglang/srt/layers/attention/triton_ops/decode_attention.py``:
``BLOCK_H = 16`` query heads of a group per program with ``tl.dot``, a split's length rounded up
to whole blocks of ``MIN_BLOCK_KV = 32``, a second kernel merging by log-sum-exp).

Which program reads what, for one request of 300 tokens on K/V head ``g`` (``BLOCK_N = 64``,
``num_splits = 4``: each split holds ``ceil(ceil(300 / 4) / 64) = 2`` blocks)::

    positions  0 ........ 127 | 128 ...... 255 | 256 .. 299 | (nothing left)
    program    (b, g, 0)      | (b, g, 1)      | (b, g, 2)  | (b, g, 3): exits at once
    reads      K/V head g of the slots the row names, each block's slots gathered one per token
    writes     o[b, h, s, :], lse[b, h, s] for the group's query heads h = g*group .. g*group+group-1

A block is ``BLOCK_N`` consecutive *positions* of the row; their slots come from the row one
per position, so a block may span several pages (``page_size < BLOCK_N``) or part of one, and
the page size is not a parameter at all. Blocks and splits start at multiples of ``BLOCK_N``:
with a power-of-two page size up to ``BLOCK_N`` every block covers whole pages.

``num_splits`` is a runtime argument (``do_not_specialize``): the host picks it from the
batch, the K/V heads and the longest context the page table allows, and a new value never
compiles a new kernel; each request's split length is computed in the kernel from its own
length. With one split the program writes the final output itself (``DIRECT``) and the merge
is not launched. Compiled variants: per pool dtype, ``group``, head size and ``DIRECT``.

Every load is masked; the host (:func:`kvlab.attention.paged_attention.fast_paged_decode_attention`) checks
first that rows, lengths and every slot the kernel will read are in range.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..base.launch import jit_options

#: runtime integers the kernels must not be specialised on (a new value must not recompile)
_OPTIONS = jit_options(["num_splits"], [])


@triton.jit(**_OPTIONS)
def split_decode_kernel(
    q_ptr,            # [batch, heads, head_dim] (any float dtype; head_dim contiguous)
    k_pool_ptr,       # [num_slots, kv_heads, head_dim]: this layer's K pool
    v_pool_ptr,       # [num_slots, kv_heads, head_dim]
    page_table_ptr,   # [rows, cols] int32/int64: position -> slot
    table_idx_ptr,    # [batch]: each request's row
    seq_lens_ptr,     # [batch]: positions [0, seq_len) to attend to (>= 1)
    out_ptr,          # DIRECT: [batch, heads, head_dim]; else o: [batch, heads, splits, head_dim] fp32
    lse_ptr,          # [batch, heads, splits] float32 (not read when DIRECT)
    scale,            # the model's softmax scale
    num_splits,       # programs per (request, K/V head) along the sequence
    stride_q_b, stride_q_h,
    stride_kv_s, stride_kv_h,
    stride_pt_row,
    stride_o_b, stride_o_h, stride_o_s,
    stride_l_b, stride_l_h,
    head_dim,
    GROUP: tl.constexpr,          # query heads per K/V head
    BLOCK_H: tl.constexpr,        # GROUP padded to a power of two (>= 16 with USE_DOT)
    BLOCK_N: tl.constexpr,        # positions per block
    BLOCK_D: tl.constexpr,        # head_dim padded to a power of two
    USE_DOT: tl.constexpr,        # scores and weighted sums with tl.dot (else broadcast-and-sum)
    LOW_PRECISION: tl.constexpr,  # tl.dot in the pool's 16-bit dtype (else float32, exact)
    DIRECT: tl.constexpr,         # one split: write the final output, no merge
):
    b = tl.program_id(0)
    g = tl.program_id(1)                         # the K/V head
    s = tl.program_id(2)                         # the split
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # this request's split: whole blocks, the same for all its programs (merge computes it too)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = g * GROUP + offs_h                # the query heads this program serves
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if LOW_PRECISION:
            q = q.to(k_pool_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float32)
        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")   # running max per head
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)                   # running sum of exp
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)          # running weighted V sum
        kv_head = g.to(tl.int64) * stride_kv_h
        for n0 in range(start, end, BLOCK_N):                         # runtime bounds
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            # one slot per position: a block may span pages, which need not be adjacent
            slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0)
            slots = slots.to(tl.int64)
            # K as [BLOCK_D, BLOCK_N] (ready for q @ K^T), V as [BLOCK_N, BLOCK_D]: read once
            k = tl.load(k_pool_ptr + slots[None, :] * stride_kv_s + kv_head + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            v = tl.load(v_pool_ptr + slots[:, None] * stride_kv_s + kv_head + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            if not LOW_PRECISION:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if USE_DOT:
                if LOW_PRECISION:
                    scores = tl.dot(q, k)
                else:
                    scores = tl.dot(q, k, input_precision="ieee")
            else:
                scores = tl.sum(q.to(tl.float32)[:, :, None] * k.to(tl.float32)[None, :, :], 1)
            scores = tl.where(mask_n[None, :], scores * scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)                               # 0 in the first block
            p = tl.exp(scores - m_new[:, None])                       # 0 on masked positions
            if USE_DOT:
                if LOW_PRECISION:
                    pv = tl.dot(p.to(v.dtype), v)
                else:
                    pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        o = acc / l_i[:, None]
        offs_o = b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + offs_d[None, :]
        if DIRECT:
            tl.store(out_ptr + offs_o, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        else:
            tl.store(out_ptr + offs_o + s * stride_o_s, o, mask=mask_h[:, None] & mask_d[None, :])
            tl.store(lse_ptr + b.to(tl.int64) * stride_l_b + heads * stride_l_h + s, m_i + tl.log(l_i),
                     mask=mask_h)


@triton.jit(**_OPTIONS)
def merge_splits_kernel(
    o_ptr,            # [batch, heads, splits, head_dim] float32: each split's normalised output
    lse_ptr,          # [batch, heads, splits] float32: each split's log-sum-exp
    seq_lens_ptr,     # [batch]
    out_ptr,          # [batch, heads, head_dim]
    num_splits,
    stride_o_b, stride_o_h, stride_o_s,
    stride_l_b, stride_l_h,
    stride_out_b, stride_out_h,
    head_dim,
    BLOCK_N: tl.constexpr,        # the split kernel's block: splits hold whole blocks
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    live = tl.cdiv(seq_len, split_len)           # the splits that hold positions of this request
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    base_o = o_ptr + b.to(tl.int64) * stride_o_b + h.to(tl.int64) * stride_o_h
    base_l = lse_ptr + b.to(tl.int64) * stride_l_b + h.to(tl.int64) * stride_l_h
    m = -float("inf")                            # the largest lse so far
    total = 0.0                                  # sum of exp(lse_s - m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # sum of exp(lse_s - m) * o_s
    for s in range(0, live):
        lse = tl.load(base_l + s)
        o = tl.load(base_o + s * stride_o_s + offs_d, mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)                # rescale what was summed under the old max
        w = tl.exp(lse - m_new)
        acc = acc * alpha + w * o
        total = total * alpha + w
        m = m_new
    tl.store(out_ptr + b.to(tl.int64) * stride_out_b + h.to(tl.int64) * stride_out_h + offs_d,
             (acc / total).to(out_ptr.dtype.element_ty), mask=mask_d)
