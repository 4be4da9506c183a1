"""Triton kernels for chapters 01 and 02: page starts -> token slots, and page-table writes.

Both kernels take every size as a *runtime* argument and walk long inputs with a runtime
loop (or a 1-D grid) over fixed-size blocks, so one compilation serves every length; only
the block size is a compile-time constant. Every load and store is masked. The host
wrappers in :mod:`kvlab.alloc.paging` validate bounds before launching.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..base.launch import jit_options


@triton.jit
def page_to_token_kernel(
    page_starts_ptr,  # [num_pages] page-start slots (page id * page_size)
    out_ptr,  # [num_pages * page_size] every slot of those pages, in order
    num_tokens,  # num_pages * page_size
    page_size,
    BLOCK: tl.constexpr,  # output slots per program (a power of two)
):
    """One lane per output slot: ``out[i] = page_starts[i // page_size] + i % page_size``.

    out:          | p0 p0+1 .. p0+P-1 | p1 p1+1 .. p1+P-1 | ...
    lane i reads: |  page i // P,  offset i % P           |
    """
    pid = tl.program_id(0).to(tl.int64)
    token = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    in_range = token < num_tokens
    page = token // page_size
    offset = token % page_size
    start = tl.load(page_starts_ptr + page, mask=in_range, other=0).to(tl.int64)
    slot = start + offset
    tl.store(out_ptr + token, slot.to(out_ptr.dtype.element_ty), mask=in_range)


# no specialisation on the number of runs (== 1, a multiple of 16) or on where the slots start
# (a free list sliced anywhere): one compilation serves every write, so a serving loop that
# compiled it at start-up never compiles again
@triton.jit(**jit_options(["num_requests"], ["allocated_ptr"]))
def write_page_table_kernel(
    page_table_ptr,  # [rows, row_stride] the page table (int32 or int64)
    row_stride,  # elements between two rows of the page table
    allocated_ptr,  # [total] new slots, requests concatenated
    meta_ptr,  # [4, num_requests] int64: row, first_page, last_page, offset into allocated
    num_requests,
    page_size,
    BLOCK: tl.constexpr,  # columns written per loop step (a power of two)
):
    """One program per request: copy its run of ``allocated`` into its row of the table.

    allocated:  | req 0 slots  | req 1 slots      | ...
                ^ offset[0]    ^ offset[1]
    page_table[row[r], first_page[r]*P : last_page[r]*P] = allocated[offset[r] : ...]
    """
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(meta_ptr + r)
    first_page = tl.load(meta_ptr + num_requests + r)
    last_page = tl.load(meta_ptr + 2 * num_requests + r)
    offset = tl.load(meta_ptr + 3 * num_requests + r)
    first_col = first_page * page_size
    length = (last_page - first_page) * page_size
    row_base = page_table_ptr + row * row_stride + first_col
    src_base = allocated_ptr + offset
    # A runtime loop: the trip count depends on this request's length, not on the compile.
    for block_start in range(0, length, BLOCK):
        k = block_start + tl.arange(0, BLOCK).to(tl.int64)
        in_range = k < length
        slots = tl.load(src_base + k, mask=in_range, other=0)
        tl.store(row_base + k, slots.to(page_table_ptr.dtype.element_ty), mask=in_range)
