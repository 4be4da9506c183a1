"""Fast slot allocation for a whole batch (chapter 09): the Triton kernels and thin launchers.

The teaching kernels (:mod:`kvlab.alloc.alloc_kernels`, chapters 03-04) mirror the source design
and inherit its costs. The kernels here remove each one:

===================================  ============================================================
teaching kernel                      fast kernels (this module)
===================================  ============================================================
``tl.arange(0, next_power_of_2(T))`` fixed ``BLOCK`` lanes, runtime loop bounds, integers typed
a compile-time size: a new power of   ``tl.int64``: one compiled kernel serves every batch size
two of tokens recompiles (0.2-21 s)   and token count
each program re-sums every earlier   one scan (``tl.cumsum`` with a carry) computes all output
length: O(bs^2)                       offsets and first pages: O(bs) per program
one program per request touches      one program per BLOCK *output tokens*: work is linear in
``next_power_of_2(T)`` lanes          tokens and balanced across programs, whatever the lengths
``ret_values.item()`` after launch:  the verdict on the whole batch is made inside the kernel,
a host sync every batch, and the      before it writes anything; the host reads it only when it
page count is known only *after*      has nothing better (no host copy of the lengths): at most
the kernel has read ``free_pages``    one sync, never one per rule
===================================  ============================================================

Pipeline of one extend (``T`` new tokens, ``bs`` requests, ``F`` free pages)::

    check+scan  every rule of every request, the totals, and two exclusive scans:
                  extend_lens [bs] --cumsum--> token_start [bs]   (where my slots go)
                  new_pages   [bs] --cumsum--> page_start  [bs]   (my first free page)
                -> one verdict for the batch: 0 (go ahead) or the code of a refusal
    fill        one program per BLOCK output tokens; output position t:
                  r = request owning t      (binary search in token_start: O(log bs))
                  k = t - token_start[r]    (my k-th new token; its position is pos = pre + k)
                  pos <  ceil(pre/P)*P  ->  last_loc[r] + 1 + k                   (old page)
                  pos >= ceil(pre/P)*P  ->  free_pages[page_start[r] + j] * P + pos % P
                                            with j = pos // P - ceil(pre/P)        (new pages)

Up to ``FUSED_MAX_BATCH`` requests each fill program runs check+scan itself into a private
scratch row, so one launch does everything (a launch costs more host time than the scan);
above it one scan program writes the row and the verdict, and the fill programs read them.

The checks inside the kernels' own pass are in :mod:`kvlab.alloc.kernel_checks`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..base import runtime  # noqa: F401  (decides compiled vs interpreter before @triton.jit)
from .kernel_checks import (NONE_BAD, bad_request, check_and_scan, checksum_weight, decode_lane_code,
                           first_bad_key, page_count, record, verdict)
from ..base.launch import Entry, Launcher, jit_options

#: Output tokens one fill program writes (a power of two; lanes of one vector).
EXTEND_BLOCK = 1024
#: Requests one check+scan step (or one decode step) handles at once; bigger batches loop.
BATCH_BLOCK = 1024
#: Batches of up to this many requests take one launch (each program scans the batch
#: itself); larger ones take two (one scan program, then the fill programs).
FUSED_MAX_BATCH = 4096
#: ... as long as the repeated scans stay small: programs x requests (and the scratch rows,
#: 16 bytes per request and program) at most this
FUSED_MAX_SCANS = 1 << 21



# --- fill: one slot per output token, one formula for all three parts -------------------------


@triton.jit
def _fill_tokens(t, refused, prefix_lens_ptr, last_loc_ptr, free_pages_ptr, page_free_ptr, row_ptr,
                 out_ptr, bs, num_tokens, free_head, num_free, pool_pages, search_steps,
                 page_size: tl.constexpr, BLOCK: tl.constexpr):
    """Write ``out[t]`` for a vector ``t`` of output positions (masked past ``num_tokens``);
    -1 everywhere if the batch was ``refused``."""
    token_start_ptr = row_ptr
    page_start_ptr = row_ptr + bs
    live = t < num_tokens
    go = (live & (refused == 0)) != 0

    # Which request owns output position t? The last r with token_start[r] <= t.
    # Invariant: token_start[lo] <= t < token_start[hi] (token_start[bs] would be T).
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = lo + bs
    for _ in range(search_steps):
        mid = (lo + hi) // 2                       # lo <= mid < hi <= bs: always in bounds
        go_right = tl.load(token_start_ptr + mid, mask=live, other=0) <= t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    r = lo

    pre = tl.load(prefix_lens_ptr + r, mask=live, other=0).to(tl.int64)
    last = tl.load(last_loc_ptr + r, mask=live, other=0).to(tl.int64)
    k = t - tl.load(token_start_ptr + r, mask=live, other=0)   # my k-th new token
    first_page = tl.load(page_start_ptr + r, mask=live, other=0)
    pos = pre + k                                                 # its logical position

    # request r's old page ends at ceil(pre/P)*P; tokens past it go on new pages
    #   | old page: last+1 .. | new page 0 | new page 1 | ... | last new page (maybe partial) |
    # (counted in pages: ceil(pre/P)*P itself may not fit int64 when pre is near 2**63)
    pre_pages = page_count(pre, page_size)
    on_old_page = pos // page_size < pre_pages
    free_idx = first_page + pos // page_size - pre_pages
    takes_page = (go & (on_old_page == 0) & (free_idx >= 0) & (free_idx < num_free)) != 0
    page = tl.load(free_pages_ptr + free_head + free_idx, mask=takes_page, other=0).to(tl.int64)
    slot = tl.where(on_old_page, last + 1 + k, page * page_size + pos % page_size)
    tl.store(out_ptr + t, tl.where(refused != 0, -1, slot), mask=live)
    # the pages this program hands out are allocated from now on (no pool: nothing to mark)
    mark = (takes_page & (page >= 0) & (page < pool_pages)) != 0
    tl.store(page_free_ptr + page, tl.zeros([BLOCK], dtype=tl.int8), mask=mark)


@triton.jit
def report_word(pages, tokens):
    """``(pages << 32) | tokens``, the teaching kernels' ``ret_values``; the host reads the pages
    (``>> 32``), so the tokens are masked to 32 bits: 2**32 tokens or more never spill into them."""
    return (pages << 32) | (tokens & 0xFFFFFFFF)


# --- the kernels ------------------------------------------------------------------------------

_INTS = ["bs", "num_tokens", "free_head", "num_free", "pool_pages", "host_pages", "host_copies",
         "host_sum_pre", "host_sum_seq", "call_id", "sticky", "search_steps", "write_out"]
_POINTERS = ["prefix_lens_ptr", "seq_lens_ptr", "last_loc_ptr", "free_pages_ptr", "page_free_ptr",
             "status_ptr", "report_ptr", "scratch_ptr", "out_ptr"]
_OPTIONS = jit_options(_INTS, _POINTERS)


def _jit(fn):
    """``triton.jit`` with :data:`_OPTIONS` for the parameters ``fn`` has."""
    import inspect

    names = set(inspect.signature(fn).parameters)
    opts = {k: [n for n in v if n in names] for k, v in _OPTIONS.items()}
    return triton.jit(**opts)(fn)


@_jit
def extend_fused_kernel(
    prefix_lens_ptr, seq_lens_ptr, last_loc_ptr,   # [bs] each
    free_pages_ptr,      # free list; this call's free pages are [free_head, free_head + num_free)
    page_free_ptr,       # [pool_pages] int8, 1 = free (pool_pages == 0: a bare call, no pool)
    status_ptr,          # [STATUS_WORDS] int64: the verdict, for the host
    report_ptr,          # [1] int64: (pages << 32) | tokens, on success
    scratch_ptr,         # [num_programs, 2*bs] int64: one private row per program
    out_ptr,             # [num_tokens] int64 out: one slot per new token
    bs: tl.int64, num_tokens: tl.int64, free_head: tl.int64, num_free: tl.int64,
    pool_pages: tl.int64,
    host_pages: tl.int64,    # the caller's page count, or -1
    host_copies: tl.int64,   # 1: compare with the host copies (pages, checksums, tokens)
    host_sum_pre: tl.int64, host_sum_seq: tl.int64,
    call_id: tl.int64, sticky: tl.int64, search_steps: tl.int64,
    page_size: tl.constexpr,
    BLOCK: tl.constexpr,     # output tokens per program
    BATCH: tl.constexpr,     # requests per check+scan step
):
    # Each program checks and scans the whole batch itself (O(bs) per BLOCK output tokens,
    # never O(bs^2)) into its own scratch row, reaches the same verdict as every other
    # program, then fills its block.   scratch row p: [ token_start (bs) | page_start (bs) ]
    pid = tl.program_id(0)
    row = scratch_ptr + pid.to(tl.int64) * (2 * bs)
    prior = tl.load(status_ptr) * sticky
    first_bad, tokens, pages, sum_pre, sum_seq = check_and_scan(
        prefix_lens_ptr, seq_lens_ptr, last_loc_ptr, page_free_ptr, row, bs, pool_pages, page_size, BATCH)
    code = verdict(first_bad, tokens, pages, sum_pre, sum_seq, num_tokens, host_pages, host_copies,
                    host_sum_pre, host_sum_seq, num_free)
    refused = (code != 0) | (prior != 0)
    if pid == 0:
        pre, seq, last = bad_request(first_bad, prefix_lens_ptr, seq_lens_ptr, last_loc_ptr)
        record(status_ptr, report_ptr, report_word(pages, tokens), code, prior, sticky, first_bad, pre, seq,
                last, tokens, pages, num_tokens, host_pages, num_free, call_id, free_head)
    tl.debug_barrier()  # the row's stores visible to all of this program's threads
    t = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _fill_tokens(t, refused, prefix_lens_ptr, last_loc_ptr, free_pages_ptr, page_free_ptr, row, out_ptr,
                 bs, num_tokens, free_head, num_free, pool_pages, search_steps, page_size, BLOCK)


@_jit
def extend_scan_kernel(
    prefix_lens_ptr, seq_lens_ptr, last_loc_ptr, page_free_ptr, status_ptr, report_ptr,
    scratch_ptr,         # [2*bs + 1] int64 out: token_start | page_start | refused
    bs: tl.int64,
    num_tokens: tl.int64,    # the caller's token count, or -1
    num_free: tl.int64, free_head: tl.int64, pool_pages: tl.int64, host_pages: tl.int64,
    host_copies: tl.int64, host_sum_pre: tl.int64, host_sum_seq: tl.int64, call_id: tl.int64,
    sticky: tl.int64,
    page_size: tl.constexpr,
    BATCH: tl.constexpr,
):
    # One program: the check+scan of a batch too large to repeat in every fill program.
    prior = tl.load(status_ptr) * sticky
    first_bad, tokens, pages, sum_pre, sum_seq = check_and_scan(
        prefix_lens_ptr, seq_lens_ptr, last_loc_ptr, page_free_ptr, scratch_ptr, bs, pool_pages,
        page_size, BATCH)
    code = verdict(first_bad, tokens, pages, sum_pre, sum_seq, num_tokens, host_pages, host_copies,
                    host_sum_pre, host_sum_seq, num_free)
    pre, seq, last = bad_request(first_bad, prefix_lens_ptr, seq_lens_ptr, last_loc_ptr)
    record(status_ptr, report_ptr, report_word(pages, tokens), code, prior, sticky, first_bad, pre, seq,
            last, tokens, pages, num_tokens, host_pages, num_free, call_id, free_head)
    tl.store(scratch_ptr + 2 * bs, ((code != 0) | (prior != 0)).to(tl.int64))


@_jit
def extend_fill_kernel(
    prefix_lens_ptr, last_loc_ptr, free_pages_ptr, page_free_ptr,
    scratch_ptr,         # [2*bs + 1] from extend_scan_kernel: token_start | page_start | refused
    out_ptr,
    bs: tl.int64, num_tokens: tl.int64, free_head: tl.int64, num_free: tl.int64,
    pool_pages: tl.int64, search_steps: tl.int64,
    page_size: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # This program writes out_indices[t] for t in [pid*BLOCK, pid*BLOCK + BLOCK).
    refused = tl.load(scratch_ptr + 2 * bs)
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _fill_tokens(t, refused, prefix_lens_ptr, last_loc_ptr, free_pages_ptr, page_free_ptr, scratch_ptr,
                 out_ptr, bs, num_tokens, free_head, num_free, pool_pages, search_steps, page_size, BLOCK)


@_jit
def decode_fast_kernel(
    seq_lens_ptr,        # [bs] lengths AFTER the new token (seq = pre + 1)
    last_loc_ptr,        # [bs]
    free_pages_ptr, page_free_ptr, status_ptr, report_ptr,
    out_ptr,             # [bs] out: one slot per request (int64)
    bs: tl.int64, free_head: tl.int64, num_free: tl.int64, pool_pages: tl.int64,
    host_pages: tl.int64, host_copies: tl.int64, host_sum_seq: tl.int64, call_id: tl.int64,
    sticky: tl.int64,
    write_out: tl.int64,     # 0: check and count only (the teaching path launches its own kernel)
    page_size: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program. Pass 1 checks every request and counts the new pages; pass 2 hands them
    # out. A request needs a new page when its new token is the first of a page: (seq-1) % P
    # == 0; the k-th such request (in batch order) takes free_pages[k]: an exclusive scan.
    #   needs: [0 1 0 1 1]  ->  rank: [. 0 . 1 2]
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    pages, sum_seq = zero, zero
    first_bad = zero + NONE_BAD
    prior = tl.load(status_ptr) * sticky
    for block_start in range(0, bs, BLOCK):
        offs = block_start + lanes
        mask = offs < bs
        seq = tl.load(seq_lens_ptr + offs, mask=mask, other=1).to(tl.int64)
        last = tl.load(last_loc_ptr + offs, mask=mask, other=-1).to(tl.int64)
        code = decode_lane_code(seq, last, mask, page_free_ptr, pool_pages, page_size)
        first_bad = tl.minimum(first_bad, first_bad_key(code, offs))
        pages += tl.sum((((seq - 1) % page_size == 0) & mask).to(tl.int64), axis=0)
        sum_seq += tl.sum(tl.where(mask, seq, 0) * checksum_weight(offs), axis=0)
    code = verdict(first_bad, bs, pages, zero, sum_seq, bs, host_pages, host_copies, zero,
                    host_sum_seq, num_free)
    refused = (code != 0) | (prior != 0)
    r = tl.where(first_bad != NONE_BAD, first_bad // 16, 0)
    seq_r = tl.load(seq_lens_ptr + r).to(tl.int64)
    record(status_ptr, report_ptr, pages, code, prior, sticky, first_bad, seq_r - 1, seq_r,
            tl.load(last_loc_ptr + r).to(tl.int64), bs, pages, bs, host_pages, num_free, call_id,
            free_head)
    carry = zero
    for block_start in range(0, bs * write_out, BLOCK):
        offs = block_start + lanes
        mask = offs < bs
        seq = tl.load(seq_lens_ptr + offs, mask=mask, other=1).to(tl.int64)
        last = tl.load(last_loc_ptr + offs, mask=mask, other=0).to(tl.int64)
        needs = ((seq - 1) % page_size == 0) & mask
        needs64 = needs.to(tl.int64)
        rank = carry + tl.cumsum(needs64, axis=0) - needs64
        takes_page = (needs & (refused == 0) & (rank < num_free)) != 0
        page = tl.load(free_pages_ptr + free_head + rank, mask=takes_page, other=0).to(tl.int64)
        slot = tl.where(needs, page * page_size, last + 1)
        tl.store(out_ptr + offs, tl.where(refused != 0, -1, slot), mask=mask)
        mark = (takes_page & (page >= 0) & (page < pool_pages)) != 0
        tl.store(page_free_ptr + page, tl.zeros([BLOCK], dtype=tl.int8), mask=mark)
        carry += tl.sum(needs64, axis=0)


# --- thin launchers ---------------------------------------------------------------------------
# Arguments are the kernels' parameters in signature order (constexprs last); the host API
# (kvlab.alloc.fast_alloc, kvlab.alloc.token_allocator) validates them first.

_FUSED = Launcher(extend_fused_kernel)
_SCAN = Launcher(extend_scan_kernel)
_FILL = Launcher(extend_fill_kernel)
_DECODE = Launcher(decode_fast_kernel)


def _key(page_size: int, *tensors: torch.Tensor) -> tuple:
    return (page_size,) + tuple(t.dtype for t in tensors)


def int64_key(page_size: int, n: int) -> tuple:
    """The key of a launch whose ``n`` length / free-list tensors are all int64."""
    return (page_size,) + (torch.int64,) * n


def search_steps(bs: int) -> int:
    """Steps of the fill's binary search over ``bs`` requests' token starts."""
    return (bs - 1).bit_length() or 1


def fill_programs(num_tokens: int) -> int:
    """Fill programs of an extend of ``num_tokens`` (at least one: the checks always run)."""
    return (num_tokens + EXTEND_BLOCK - 1) // EXTEND_BLOCK or 1  # ceil division in plain ints


def fused(bs: int, num_tokens: int) -> bool:
    """Whether an extend takes one launch (each program scans the batch) or two."""
    return bs <= FUSED_MAX_BATCH and ((num_tokens + EXTEND_BLOCK - 1) // EXTEND_BLOCK or 1) * bs <= FUSED_MAX_SCANS


def extend_scratch_words(bs: int, num_tokens: int) -> int:
    """int64 words of scratch one extend needs (a private row per program when fused)."""
    programs = (num_tokens + EXTEND_BLOCK - 1) // EXTEND_BLOCK or 1
    if bs <= FUSED_MAX_BATCH and programs * bs <= FUSED_MAX_SCANS:
        return programs * 2 * bs
    return 2 * bs + 1


def launch_extend(prefix_lens, seq_lens, last_loc, free_pages, page_free, status, report, scratch, out,
                  bs: int, num_tokens: int, free_head: int, num_free: int, pool_pages: int,
                  host_pages: int, host_copies: int, host_sum_pre: int, host_sum_seq: int,
                  call_id: int, sticky: int, page_size: int, key: tuple | None = None) -> None:
    """Check, scan and fill one extend: one launch up to FUSED_MAX_BATCH requests, else two.
    ``key``: :func:`int64_key` when the caller knows every tensor is int64 (saves looking).
    (The sizes are plain arithmetic here, not calls: this runs on every allocation.)"""
    programs = (num_tokens + EXTEND_BLOCK - 1) // EXTEND_BLOCK or 1
    if key is None:
        key = _key(page_size, prefix_lens, seq_lens, last_loc, free_pages)
    if bs <= FUSED_MAX_BATCH and programs * bs <= FUSED_MAX_SCANS:
        _FUSED((programs,), (prefix_lens, seq_lens, last_loc, free_pages, page_free, status, report, scratch,
                             out, bs, num_tokens, free_head, num_free, pool_pages, host_pages, host_copies,
                             host_sum_pre, host_sum_seq, call_id, sticky, search_steps(bs),
                             page_size, EXTEND_BLOCK, BATCH_BLOCK), key)
        return
    launch_extend_check(prefix_lens, seq_lens, last_loc, page_free, status, report, scratch, bs, num_tokens,
                        free_head, num_free, pool_pages, host_pages, host_copies, host_sum_pre,
                        host_sum_seq, call_id, sticky, page_size)
    launch_extend_fill(prefix_lens, last_loc, free_pages, page_free, scratch, out, bs, num_tokens,
                       free_head, num_free, pool_pages, page_size)


def launch_extend_check(prefix_lens, seq_lens, last_loc, page_free, status, report, scratch,
                        bs: int, num_tokens: int, free_head: int, num_free: int, pool_pages: int,
                        host_pages: int, host_copies: int, host_sum_pre: int, host_sum_seq: int,
                        call_id: int, sticky: int, page_size: int) -> None:
    """The check+scan alone (one program): ``scratch = [token_start | page_start | refused]``."""
    _SCAN((1,), (prefix_lens, seq_lens, last_loc, page_free, status, report, scratch, bs, num_tokens,
                 num_free, free_head, pool_pages, host_pages, host_copies, host_sum_pre, host_sum_seq,
                 call_id, sticky, page_size, BATCH_BLOCK),
          _key(page_size, prefix_lens, seq_lens, last_loc))


def launch_extend_fill(prefix_lens, last_loc, free_pages, page_free, scratch, out, bs: int,
                       num_tokens: int, free_head: int, num_free: int, pool_pages: int,
                       page_size: int) -> None:
    """The fill after :func:`launch_extend_check` (it reads the verdict from ``scratch``)."""
    if num_tokens == 0:
        return
    _FILL((fill_programs(num_tokens),),
          (prefix_lens, last_loc, free_pages, page_free, scratch, out, bs, num_tokens, free_head,
           num_free, pool_pages, search_steps(bs), page_size, EXTEND_BLOCK),
          _key(page_size, prefix_lens, last_loc, free_pages))


def launch_decode(seq_lens, last_loc, free_pages, page_free, status, report, out, bs: int,
                  free_head: int, num_free: int, pool_pages: int, host_pages: int, host_copies: int,
                  host_sum_seq: int, call_id: int, sticky: int, write_out: int, page_size: int,
                  key: tuple | None = None) -> None:
    """Check and hand out one decode step (``write_out=0``: check and count only)."""
    _DECODE((1,), (seq_lens, last_loc, free_pages, page_free, status, report, out, bs, free_head,
                   num_free, pool_pages, host_pages, host_copies, host_sum_seq, call_id, sticky,
                   write_out, page_size, BATCH_BLOCK),
            key if key is not None else _key(page_size, seq_lens, last_loc, free_pages))


class DirectKernels(NamedTuple):
    """The allocator's two hot kernels, compiled for one CUDA device, as C entries
    (:data:`kvlab.base.launch.Entry`): ``entry(programs, stream, args)`` with ``args`` the
    kernel's parameters in signature order, pointers as tensors or addresses. Launch only after
    :func:`kvlab.base.launch.launch_ready` gives the stream."""

    device: int
    extend: Entry    # extend_fused_kernel (int64 inputs): batches where fused(bs, tokens)
    decode: Entry    # decode_fast_kernel (int64 inputs)


def direct_kernels(page_size: int, device: torch.device) -> DirectKernels | None:
    """The :class:`DirectKernels` of ``page_size`` on ``device`` after :func:`warm_up`, or None
    (the interpreter, another device type, a Triton whose launcher kvlab does not know)."""
    if device.type != "cuda":
        return None
    extend = _FUSED.entry_for(device.index, int64_key(page_size, 4))
    decode = _DECODE.entry_for(device.index, int64_key(page_size, 3))
    return DirectKernels(device.index, extend, decode) if extend and decode else None


def warm_up(page_size: int, device: torch.device, fill: bool = True) -> dict[str, float]:
    """Compile every kernel an allocator of ``page_size`` launches (int64 inputs), without
    launching; returns the seconds each took (0.0 when it was compiled already, or in the
    interpreter, which compiles nothing). ``fill=False``: only the checks (the teaching path)."""
    i64 = dict(dtype=torch.int64, device=device)
    v = torch.zeros(2, **i64)
    flags = torch.zeros(1, dtype=torch.int8, device=device)
    ints = (1,) * 12
    key = (page_size, torch.int64, torch.int64, torch.int64, torch.int64)
    seconds = {
        "extend_scan_kernel": _SCAN.warmup((1,), (v, v, v, flags, v, v, v) + ints[:11]
                                           + (page_size, BATCH_BLOCK), key[:4]),
        "decode_fast_kernel": _DECODE.warmup((1,), (v, v, v, flags, v, v, v) + ints[:10]
                                             + (page_size, BATCH_BLOCK), key[:4]),
    }
    if fill:
        seconds["extend_fused_kernel"] = _FUSED.warmup((1,), (v, v, v, v, flags, v, v, v, v) + ints
                                                       + (page_size, EXTEND_BLOCK, BATCH_BLOCK), key)
        seconds["extend_fill_kernel"] = _FILL.warmup((1,), (v, v, v, flags, v, v) + ints[:6]
                                                     + (page_size, EXTEND_BLOCK), key[:1] + key[2:])
    return seconds
