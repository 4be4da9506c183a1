"""Teaching kernels that hand out KV slots for a whole batch in one launch (chapters 03-04).

They mirror SGLang's ``alloc_extend_kernel`` / ``alloc_decode_kernel`` as the source design
wrote them (with ``ret_values`` and ``max_num_extend_tokens``; SGLang has changed them since,
see chapter 03), on purpose, hazards included, because the hazards are part of the lesson:

* one program per request; each program re-sums the lengths of *all* requests before it
  (a masked ``tl.sum`` over ``tl.arange(0, bs_upper)``): O(bs) work per program, O(bs^2) in all;
* ``max_num_extend_tokens`` is ``next_power_of_2(extend_num_tokens)``, a compile-time size:
  every new power of two compiles a new kernel, and every program touches that many lanes;
* the kernels load page ids from ``free_pages`` without knowing how many there are. The
  caller must make sure there are enough *before* launching (the source design launched
  first and checked afterwards, which reads past ``free_pages`` when pages run short).
  :class:`kvlab.PagedTokenAllocator` checks on the host first.

Two small departures from the source's text. Masked loads give ``other=0``: Triton documents
a masked-off lane without ``other`` as undefined, and these lanes enter the ``tl.sum``s (the
source leaves ``other`` out and relies on what the compiler happens to put there). And the
source's ``min(seq_len, ...)`` is written ``tl.minimum``: a style choice, not a fix, since
compiled Triton maps the built-in ``min`` to ``tl.minimum`` (``triton/language/core.py``,
``builtin_min``) and the interpreter runs it as Python's ``min``; SGLang writes ``min``.

The region comments (``# ---- ... ----``) mark what each exercise of chapter 03 writes;
``kvlab.solutions.show("alloc_extend_part1")`` prints only the region of part 1.

Memory layout of ``out_indices`` for the source's worked example (P = 64)::

    request A (70 -> 190)                 request B (128 -> 260)
    | part 1: 58 | part 3: 62 |           | part 2: 128          | part 3: 4 |
    0          58            120          120                   248         252
    last_loc+1..  newpage*64+0..61        2 whole new pages      newpage*64+0..3
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..base import runtime  # noqa: F401  (decides compiled vs interpreter before @triton.jit)


@triton.jit
def alloc_extend_kernel(
    pre_lens_ptr,        # [bs]   tokens already in the KV cache per request
    seq_lens_ptr,        # [bs]   tokens wanted after this batch
    last_loc_ptr,        # [bs]   slot of each request's last prefix token (-1 if none)
    free_page_ptr,       # [F]    free page ids; new pages come from the front
    out_indices,         # [sum(seq - pre)] one slot per new token, requests concatenated
    ret_values,          # [1]    int64: (total new pages << 32) | total new tokens
    bs_upper: tl.constexpr,               # next_power_of_2(bs)
    page_size: tl.constexpr,              # P, a power of two
    max_num_extend_tokens: tl.constexpr,  # next_power_of_2(sum(seq - pre)), >= 1
):
    pid = tl.program_id(0)  # this program serves request `pid`

    # ---- where do my slots go, and which free pages are mine? --------------------------
    # Load the lengths of requests 0..pid (masked lanes read 0) and sum them: the requests
    # before me decide my output offset and my first new page.
    load_offset = tl.arange(0, bs_upper)
    seq_lens = tl.load(seq_lens_ptr + load_offset, mask=load_offset <= pid, other=0)
    pre_lens = tl.load(pre_lens_ptr + load_offset, mask=load_offset <= pid, other=0)
    extend_lens = seq_lens - pre_lens

    seq_len = tl.load(seq_lens_ptr + pid)
    pre_len = tl.load(pre_lens_ptr + pid)
    extend_len = seq_len - pre_len

    sum_extend_lens = tl.sum(extend_lens)              # tokens of requests 0..pid
    output_start_loc = sum_extend_lens - extend_len    # tokens of requests 0..pid-1

    num_pages_after = (seq_lens + page_size - 1) // page_size
    num_pages_before = (pre_lens + page_size - 1) // page_size
    num_new_pages = num_pages_after - num_pages_before

    num_page_start_loc_self = (seq_len + page_size - 1) // page_size - (
        pre_len + page_size - 1
    ) // page_size                                     # new pages I take
    sum_num_new_pages = tl.sum(num_new_pages)          # new pages of requests 0..pid
    new_page_start_loc = sum_num_new_pages - num_page_start_loc_self  # my first one in free_pages

    # ---- ret_values (exercise alloc_extend_part3): the batch's totals, for the host ----
    # The last program has summed everyone: it reports the totals, packed in one int64.
    # (It comes before part 1 because parts 1 and 2 may return early.)
    if pid == tl.num_programs(0) - 1:
        merged_value = (sum_num_new_pages.to(tl.int64)) << 32 | sum_extend_lens.to(tl.int64)
        tl.store(ret_values, merged_value)

    # ---- part 1: fill the rest of my last, partly used page ----------------------------
    #   old page: [ prefix ... last_loc | last_loc+1 ... end of page ]
    last_loc = tl.load(last_loc_ptr + pid)
    num_part1 = (
        tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len
    )
    offset_one_page = tl.arange(0, page_size)
    tl.store(
        out_indices + output_start_loc + offset_one_page,
        last_loc + 1 + offset_one_page,
        mask=offset_one_page < num_part1,
    )
    if pre_len + num_part1 == seq_len:  # everything fitted in the old page
        return

    # ---- part 2: whole new pages --------------------------------------------------------
    #   free_pages[new_page_start_loc + k // P] * P + k % P,  k = 0 .. num_part2 - 1
    num_part2 = (
        seq_len // page_size * page_size
        - (pre_len + page_size - 1) // page_size * page_size
    )
    offset_many_page = tl.arange(0, max_num_extend_tokens)
    page_start = tl.load(
        free_page_ptr + new_page_start_loc + offset_many_page // page_size,
        mask=offset_many_page < num_part2,
        other=0,
    )
    tl.store(
        out_indices + output_start_loc + num_part1 + offset_many_page,
        page_start * page_size + offset_many_page % page_size,
        mask=offset_many_page < num_part2,
    )
    if pre_len + num_part1 + num_part2 == seq_len:  # ended on a page boundary
        return

    # ---- part 3: the partly filled new last page ---------------------------------------
    #   my last new page: [ 0 .. num_part3-1 written | rest free for later decode steps ]
    #   It is my LAST new page: free_pages[new_page_start_loc + num_page_start_loc_self - 1]
    #   (num_page_start_loc_self, SGLang's name, is this request's number of new pages).
    num_part3 = seq_len - seq_len // page_size * page_size
    start_loc = tl.load(free_page_ptr + new_page_start_loc + num_page_start_loc_self - 1)
    tl.store(
        out_indices + output_start_loc + num_part1 + num_part2 + offset_one_page,
        start_loc * page_size + offset_one_page,
        mask=offset_one_page < num_part3,
    )


@triton.jit
def alloc_decode_kernel(
    seq_lens_ptr,        # [bs]  lengths AFTER the new token (seq = pre + 1)
    last_loc_ptr,        # [bs]  slot of each request's last token
    free_page_ptr,       # [F]   free page ids
    out_indices,         # [bs]  one slot per request
    ret_values,          # [1]   int64: total new pages
    bs_upper: tl.constexpr,   # next_power_of_2(bs)
    page_size: tl.constexpr,  # P
):
    pid = tl.program_id(0)

    # Requests 0..pid grow by one token each; masked lanes get pre == seq, so they add 0 pages.
    load_offset = tl.arange(0, bs_upper)
    seq_lens = tl.load(seq_lens_ptr + load_offset, mask=load_offset <= pid, other=0)
    pre_lens = tl.where(load_offset <= pid, seq_lens - 1, seq_lens)

    seq_len = tl.load(seq_lens_ptr + pid)
    pre_len = seq_len - 1

    num_pages_after = (seq_lens + page_size - 1) // page_size
    num_pages_before = (pre_lens + page_size - 1) // page_size
    num_new_pages = num_pages_after - num_pages_before

    # 1 when my new token is the first of a page, i.e. (seq - 1) % P == 0; else 0
    num_page_start_loc_self = (seq_len + page_size - 1) // page_size - (
        pre_len + page_size - 1
    ) // page_size
    sum_num_new_pages = tl.sum(num_new_pages)
    new_page_start_loc = sum_num_new_pages - num_page_start_loc_self

    if pid == tl.num_programs(0) - 1:
        tl.store(ret_values, sum_num_new_pages.to(tl.int64))

    if num_page_start_loc_self == 0:
        # same page: right after my last token
        last_loc = tl.load(last_loc_ptr + pid)
        tl.store(out_indices + pid, last_loc + 1)
    else:
        # a fresh page: its first slot
        page = tl.load(free_page_ptr + new_page_start_loc)
        tl.store(out_indices + pid, page * page_size)
