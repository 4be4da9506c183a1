"""Checks inside the allocation kernels' own pass (chapter 09): the rules, the verdict, the report.

Some rules can only be read on the device: ``last_loc`` must lie on an allocated page, and
a caller's host copies of the lengths must match the device tensors. Reading them back would
cost a device->host sync per call, so the kernels check them themselves, before writing::

    every program:  check+scan the batch  ->  the verdict (all programs compute the same one)
      verdict 0:    fill my slots, mark my new pages allocated in page_free
      refused:      write -1 into my slots; nothing else changes
    program 0:      record a refusal in `status` (the first one since the host last looked),
                    and this call's totals

``status`` holds int64 words, in the order of :data:`STATUS_FIELDS`. The host reads it with
the sync it makes anyway (a call without host lengths needs the page count), or at the next
such point; :mod:`kvlab.alloc.host_checks` turns a refusal into the error that names the rule.
Every load and store is masked against its tensor's length, so even inconsistent input
cannot make a kernel touch memory out of bounds.

No sum wraps unnoticed. Lengths may be anything below 2**63, so ``seq + P - 1`` could wrap:
a request's pages are ``seq // P + (seq % P != 0)`` instead. The batch's totals (tokens and new
pages) add per-request terms clamped to :data:`TOTAL_LIMIT` (2**50) and saturate there, so they
are exact below the limit and at least the limit otherwise; a batch whose totals reach it is
refused as out of pages (no pool comes near: its output alone would be 8 PiB). The checksums
wrap on purpose, on the host as here: they are only compared.
"""
from __future__ import annotations

import enum

import triton
import triton.language as tl

from ..base import runtime  # noqa: F401  (decides compiled vs interpreter before @triton.jit)


class Refusal(enum.IntEnum):
    """Why a kernel refused a batch (``status[0]``); 0 is no refusal."""

    PREFIX_NEGATIVE = 1        # prefix_lens[r] < 0
    SEQ_BELOW_PREFIX = 2       # seq_lens[r] < prefix_lens[r]
    LAST_LOC_OFFSET = 3        # (last_loc + 1) % P != prefix_len % P
    LAST_LOC_OUTSIDE = 4       # a non-empty prefix whose last_loc is not a slot of the pool
    LAST_LOC_ON_FREE_PAGE = 5  # ... or lies on a page that is free
    SEQ_BELOW_ONE = 6          # decode: seq_lens[r] < 1
    TOKENS_MISMATCH = 7        # the caller's token count != sum(seq - pre) on the device
    PAGES_MISMATCH = 8         # the caller's page count != the pages the device lengths need
    HOST_COPIES_DIFFER = 9     # the host copies of the lengths are not the device tensors
    OUT_OF_PAGES = 10          # more new pages than free pages


#: The words of ``status``, by position (written by :func:`record`).
STATUS_FIELDS = ("code", "index", "prefix_len", "seq_len", "last_loc", "device_tokens",
                 "device_pages", "host_tokens", "host_pages", "num_free", "call_id", "free_head",
                 "last_tokens", "last_pages")
STATUS_WORDS = 16

_PREFIX_NEGATIVE = tl.constexpr(int(Refusal.PREFIX_NEGATIVE))
_SEQ_BELOW_PREFIX = tl.constexpr(int(Refusal.SEQ_BELOW_PREFIX))
_LAST_LOC_OFFSET = tl.constexpr(int(Refusal.LAST_LOC_OFFSET))
_LAST_LOC_OUTSIDE = tl.constexpr(int(Refusal.LAST_LOC_OUTSIDE))
_LAST_LOC_ON_FREE_PAGE = tl.constexpr(int(Refusal.LAST_LOC_ON_FREE_PAGE))
_SEQ_BELOW_ONE = tl.constexpr(int(Refusal.SEQ_BELOW_ONE))
_TOKENS_MISMATCH = tl.constexpr(int(Refusal.TOKENS_MISMATCH))
_PAGES_MISMATCH = tl.constexpr(int(Refusal.PAGES_MISMATCH))
_HOST_COPIES_DIFFER = tl.constexpr(int(Refusal.HOST_COPIES_DIFFER))
_OUT_OF_PAGES = tl.constexpr(int(Refusal.OUT_OF_PAGES))
#: "no request broke a rule": larger than any ``index * 16 + code``
NONE_BAD = tl.constexpr(1 << 62)
#: totals at or above this are refused as out of pages (terms are clamped, totals saturate here)
_TOTAL_LIMIT = tl.constexpr(1 << 50)
TOTAL_LIMIT = int(_TOTAL_LIMIT.value)
#: checksum weights: w(i) = h ^ (h >> 29), h = (i + 1) * _MIX (int64, wrapping); the host
#: computes the same in NumPy (kvlab.alloc.host_checks.checksum_weights)
_MIX = tl.constexpr(0x5851F42D4C957F2D)
MIX = int(_MIX.value)


@triton.jit
def checksum_weight(i):
    h = (i + 1) * _MIX
    return h ^ (h >> 29)


# --- the rules, per request (one lane each) ---------------------------------------------------


@triton.jit
def last_loc_code(pre, last, mask, page_free_ptr, pool_pages, page_size: tl.constexpr):
    """The first ``last_loc`` rule a lane breaks (0: none). ``pool_pages == 0``: no pool to
    check against (a bare call), only the offset rule."""
    offset_ok = ((last + 1) % page_size + page_size) % page_size == pre % page_size
    has_prefix = pre > 0
    check_pool = pool_pages > 0
    # (x != 0 keeps a mask boolean where a scalar joins it: the interpreter widens bool & scalar)
    outside = (has_prefix & check_pool & ((last < 0) | (last >= pool_pages * page_size))) != 0
    on_page = (mask & has_prefix & check_pool & (outside == 0)) != 0
    page = tl.where(on_page, last // page_size, 0)
    page_is_free = tl.load(page_free_ptr + page, mask=on_page, other=0) != 0
    return tl.where(offset_ok == 0, _LAST_LOC_OFFSET,
                    tl.where(outside, _LAST_LOC_OUTSIDE,
                             tl.where(page_is_free, _LAST_LOC_ON_FREE_PAGE, 0)))


@triton.jit
def decode_lane_code(seq, last, mask, page_free_ptr, pool_pages, page_size: tl.constexpr):
    """The first rule a decode request breaks (0: none); its prefix is ``seq - 1`` tokens."""
    code = tl.where(seq < 1, _SEQ_BELOW_ONE, last_loc_code(seq - 1, last, mask, page_free_ptr, pool_pages, page_size))
    return tl.where(mask, code, 0)


@triton.jit
def page_count(x, page_size: tl.constexpr):
    """``ceil(x / page_size)`` for ``x >= 0``, without the ``x + page_size - 1`` that wraps near 2**63."""
    return x // page_size + (x % page_size != 0).to(tl.int64)


@triton.jit
def saturating_total(carry, terms):
    """``carry + sum(terms)``, exact while below :data:`TOTAL_LIMIT`, else at least it: each term
    is clamped to the limit (a block of 1024 sums to at most 2**60) and the total stops at 2**51
    (no int64 sum here can wrap)."""
    return tl.minimum(carry + tl.sum(tl.minimum(terms, _TOTAL_LIMIT), axis=0), 2 * _TOTAL_LIMIT)


@triton.jit
def first_bad_key(code, offs):
    """``index * 16 + code`` of the first lane with a nonzero code, else ``NONE_BAD``."""
    return tl.min(tl.where(code > 0, offs * 16 + code, NONE_BAD), axis=0)


@triton.jit
def check_and_scan(prefix_lens_ptr, seq_lens_ptr, last_loc_ptr, page_free_ptr, row_ptr,
                    bs, pool_pages, page_size: tl.constexpr, BATCH: tl.constexpr):
    """One pass over the batch: every rule of every request, the totals, the checksums, and::

        row = [ token_start (bs) | page_start (bs) ]   exclusive scans, where each request's
                                                       slots begin and its first free page

    Returns ``(first_bad, tokens, pages, sum_pre, sum_seq)``; ``first_bad`` is
    ``index * 16 + code`` of the first request that breaks a rule, else ``NONE_BAD``.
    """
    lanes = tl.arange(0, BATCH).to(tl.int64)
    zero = tl.sum(tl.zeros([BATCH], dtype=tl.int64), axis=0)
    tokens, pages, sum_pre, sum_seq = zero, zero, zero, zero
    first_bad = zero + NONE_BAD
    # one program walks the batch in blocks; the carries hold the sums of all earlier blocks
    #   extend_lens: [ 5 | 0 | 3 | 7 ]  ->  token_start: [ 0 | 5 | 5 | 8 ],  tokens 15
    for block_start in range(0, bs, BATCH):
        offs = block_start + lanes
        mask = offs < bs
        pre = tl.load(prefix_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        seq = tl.load(seq_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        last = tl.load(last_loc_ptr + offs, mask=mask, other=-1).to(tl.int64)
        code = tl.where(pre < 0, _PREFIX_NEGATIVE,
                        tl.where(seq < pre, _SEQ_BELOW_PREFIX,
                                 last_loc_code(pre, last, mask, page_free_ptr, pool_pages, page_size)))
        code = tl.where(mask, code, 0)
        first_bad = tl.minimum(first_bad, first_bad_key(code, offs))
        extend = seq - pre
        new_pages = page_count(seq, page_size) - page_count(pre, page_size)
        # (the scans are exact whenever the batch is accepted: its totals are then below the limit)
        tl.store(row_ptr + offs, tokens + tl.cumsum(extend, axis=0) - extend, mask=mask)
        tl.store(row_ptr + bs + offs, pages + tl.cumsum(new_pages, axis=0) - new_pages, mask=mask)
        tokens = saturating_total(tokens, extend)
        pages = saturating_total(pages, new_pages)
        weight = checksum_weight(offs)
        sum_pre += tl.sum(pre * weight, axis=0)
        sum_seq += tl.sum(seq * weight, axis=0)
    return first_bad, tokens, pages, sum_pre, sum_seq


@triton.jit
def verdict(first_bad, tokens, pages, sum_pre, sum_seq, num_tokens, host_pages, host_copies,
             host_sum_pre, host_sum_seq, num_free):
    """The batch's refusal code (0: go ahead). A broken rule of a request comes first; then
    host copies that differ from the device tensors; then the caller's counts; then pages
    (more than are free, or totals at :data:`TOTAL_LIMIT`: more than any pool holds)."""
    lane = tl.where(first_bad != NONE_BAD, first_bad % 16, 0)
    copies_differ = (host_copies != 0) & ((tokens != num_tokens) | (pages != host_pages)
                                          | (sum_pre != host_sum_pre) | (sum_seq != host_sum_seq))
    tokens_differ = (num_tokens >= 0) & (tokens != num_tokens)
    pages_differ = (host_pages >= 0) & (pages != host_pages)
    # (.to: a decode step passes its batch size, an int32 scalar in the interpreter, as tokens)
    too_many = (pages > num_free) | (pages.to(tl.int64) >= _TOTAL_LIMIT) | (tokens.to(tl.int64) >= _TOTAL_LIMIT)
    return tl.where(lane != 0, lane,
                    tl.where(copies_differ, _HOST_COPIES_DIFFER,
                             tl.where(tokens_differ, _TOKENS_MISMATCH,
                                      tl.where(pages_differ, _PAGES_MISMATCH,
                                               tl.where(too_many, _OUT_OF_PAGES, 0)))))


@triton.jit
def record(status_ptr, report_ptr, report_value, code, prior, sticky, first_bad, pre, seq, last,
            tokens, pages, num_tokens, host_pages, num_free, call_id, free_head):
    """Program 0's report. A refusal is recorded unless an earlier one still waits for the
    host (``sticky``: an allocator keeps the first; a bare call overwrites every time).
    ``report`` gets ``report_value`` (the teaching kernels' ``ret_values``), or -1 if refused."""
    if (prior == 0) & ((code != 0) | (sticky == 0)):
        tl.store(status_ptr + 0, code.to(tl.int64))
        tl.store(status_ptr + 1, tl.where(first_bad != NONE_BAD, first_bad // 16, -1))
        tl.store(status_ptr + 2, pre)
        tl.store(status_ptr + 3, seq)
        tl.store(status_ptr + 4, last)
        tl.store(status_ptr + 5, tokens)
        tl.store(status_ptr + 6, pages)
        tl.store(status_ptr + 7, num_tokens)
        tl.store(status_ptr + 8, host_pages)
        tl.store(status_ptr + 9, num_free)
        tl.store(status_ptr + 10, call_id)
        tl.store(status_ptr + 11, free_head)
    tl.store(status_ptr + 12, tokens)
    tl.store(status_ptr + 13, pages)
    # the teaching kernels' ret_values, or -1: refused (the one word a syncing caller reads)
    tl.store(report_ptr, tl.where((code == 0) & (prior == 0), report_value, -1))


@triton.jit
def bad_request(first_bad, prefix_lens_ptr, seq_lens_ptr, last_loc_ptr):
    """``(pre, seq, last)`` of the first request that broke a rule (request 0's if none did)."""
    r = tl.where(first_bad != NONE_BAD, first_bad // 16, 0)
    return (tl.load(prefix_lens_ptr + r).to(tl.int64), tl.load(seq_lens_ptr + r).to(tl.int64),
            tl.load(last_loc_ptr + r).to(tl.int64))
