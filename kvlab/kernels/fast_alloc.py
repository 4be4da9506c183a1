"""Fast slot allocation for a whole batch: one compilation for every shape (chapter 09).

The teaching kernels (:mod:`kvlab.kernels.alloc`, chapters 03-04) mirror the source design
and inherit its three costs. This module removes each one:

===================================  ============================================================
teaching kernel                      fast path (this module)
===================================  ============================================================
``tl.arange(0, next_power_of_2(T))`` fixed ``BLOCK`` lanes, runtime loop bounds: one compiled
a compile-time size: a new power of   kernel serves every batch size and token count
two of tokens recompiles (0.2-21 s)
each program re-sums every earlier   one scan (``tl.cumsum`` with a carry) computes all
length: O(bs^2)                       output offsets and first pages once: O(bs)
one program per request touches      one program per BLOCK *output tokens*: work is linear in
``next_power_of_2(T)`` lanes          tokens and balanced across programs, whatever the lengths
``ret_values.item()`` after launch:  the caller passes what it already knows on the host (its
a host sync every batch, and the      lengths, or the number of new pages): the out-of-pages
page count is known only *after*      decision is made before any launch, with no sync
the kernel has read ``free_pages``
===================================  ============================================================

Pipeline of one extend (``T`` new tokens, ``bs`` requests, ``F`` free pages)::

    host:  pages_needed (from host lengths, or one sync)  ->  OutOfPages?  (nothing launched yet)
    scan:  1 program   extend_lens [bs] --cumsum--> token_start [bs]  (where my slots go)
                       new_pages   [bs] --cumsum--> page_start  [bs]  (my first free page)
    fill:  cdiv(T, BLOCK) programs; output position t:
             r = request owning t      (binary search in token_start: O(log bs))
             k = t - token_start[r]    (my k-th new token; its position is pos = pre + k)
             pos <  ceil(pre/P)*P  ->  last_loc[r] + 1 + k                    (old page)
             pos >= ceil(pre/P)*P  ->  free_pages[page_start[r] + j] * P + pos % P
                                       with j = pos // P - ceil(pre/P)         (new pages)

For batches of up to ``FUSED_MAX_BATCH`` requests with the counts known on the host, scan and
fill share one launch (``extend_fused_kernel``): a launch costs ~10-25 us of host time, more
than the scan, so each fill program scans the batch itself (one vector cumsum: O(bs) per BLOCK
tokens, linear in tokens, never O(bs^2)) into a private scratch row. Each of the two variants
compiles once per page size (and once more if a caller asks for the packed ``report``).

The three parts of the teaching kernel become one formula per token. Every load and store
is masked against the tensor's length, so even inconsistent inputs cannot make the kernels
touch memory out of bounds (the host still validates what it can before launching).
"""
from __future__ import annotations

import inspect
import operator
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import runtime  # noqa: F401  (decides compiled vs interpreter before @triton.jit)
from ..errors import InvalidArgument, OutOfPages

#: Output tokens one fill program writes (a power of two; lanes of one vector).
EXTEND_BLOCK = 1024
#: Requests one scan step (or one decode step) handles at once; bigger batches loop.
BATCH_BLOCK = 1024
#: Batches of up to this many requests, with the counts known on the host, take one launch
#: (extend_fused_kernel); larger ones, or calls without host counts, take scan + fill.
FUSED_MAX_BATCH = BATCH_BLOCK


def _jit_options(ints: Sequence[str], pointers: Sequence[str]) -> dict:
    """Ask Triton not to specialise on integer values (``== 1``, ``% 16 == 0``) nor on pointer
    alignment, so a new batch size or a sliced ``free_pages`` never triggers a recompile."""
    opts: dict = {"do_not_specialize": list(ints)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        opts["do_not_specialize_on_alignment"] = list(pointers)
    return opts


# --- scan: output offsets and first pages, computed once ------------------------------------


@triton.jit
def _scan_batch(prefix_lens_ptr, seq_lens_ptr, scratch_ptr, bs,
                page_size: tl.constexpr, BLOCK: tl.constexpr):
    """Exclusive prefix sums of extend lengths and new-page counts, into ``scratch``::

        scratch = [ token_start (bs) | page_start (bs) | total tokens | total pages ]
        token_start[r]: where request r's slots begin in out_indices
        page_start[r]:  position in free_pages of request r's first new page
    """
    token_start_ptr = scratch_ptr
    page_start_ptr = scratch_ptr + bs
    totals_ptr = scratch_ptr + 2 * bs
    # One program walks the batch in blocks of BLOCK requests; `carry_*` holds the sums of
    # all earlier blocks, so each length is read once: O(bs) in all.
    #   extend_lens: [ 5 | 0 | 3 | 7 ]  ->  token_start: [ 0 | 5 | 5 | 8 ],  total 15
    lanes = tl.arange(0, BLOCK)
    carry_tokens = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    carry_pages = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for block_start in range(0, bs, BLOCK):
        offs = block_start + lanes
        mask = offs < bs
        pre = tl.load(prefix_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        seq = tl.load(seq_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        extend = seq - pre
        new_pages = (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size
        tl.store(token_start_ptr + offs, carry_tokens + tl.cumsum(extend, axis=0) - extend,
                 mask=mask)
        tl.store(page_start_ptr + offs, carry_pages + tl.cumsum(new_pages, axis=0) - new_pages,
                 mask=mask)
        carry_tokens += tl.sum(extend, axis=0)
        carry_pages += tl.sum(new_pages, axis=0)
    tl.store(totals_ptr + 0, carry_tokens)
    tl.store(totals_ptr + 1, carry_pages)
    return carry_tokens, carry_pages


@triton.jit(**_jit_options(["bs"], ["prefix_lens_ptr", "seq_lens_ptr", "scratch_ptr", "report_ptr"]))
def extend_scan_kernel(
    prefix_lens_ptr,     # [bs]  tokens already cached per request
    seq_lens_ptr,        # [bs]  tokens wanted after this batch
    scratch_ptr,         # [2*bs + 2] int64 out: token_start | page_start | totals
    report_ptr,          # [1] int64 out, if HAS_REPORT: (total pages << 32) | total tokens
    bs,                  # runtime batch size: no recompile per batch size
    page_size: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_REPORT: tl.constexpr,
):
    tokens, pages = _scan_batch(prefix_lens_ptr, seq_lens_ptr, scratch_ptr, bs, page_size, BLOCK)
    if HAS_REPORT:  # the teaching kernel's ret_values, for callers that keep reading it
        tl.store(report_ptr, (pages << 32) | tokens)


# --- fill: one slot per output token, one formula for all three parts ------------------------


@triton.jit
def _fill_tokens(t, prefix_lens_ptr, last_loc_ptr, free_pages_ptr, scratch_ptr, out_ptr,
                 bs, num_tokens, num_free, search_steps,
                 page_size: tl.constexpr, BLOCK: tl.constexpr):
    """Write ``out[t]`` for a vector ``t`` of output positions (masked past ``num_tokens``)."""
    token_start_ptr = scratch_ptr
    page_start_ptr = scratch_ptr + bs
    live = t < num_tokens

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
    old_page_end = (pre + page_size - 1) // page_size * page_size
    on_old_page = pos < old_page_end
    free_idx = first_page + pos // page_size - old_page_end // page_size
    wants_page = live & (on_old_page == 0)
    page = tl.load(free_pages_ptr + free_idx,
                   mask=wants_page & (free_idx >= 0) & (free_idx < num_free), other=0)
    slot = tl.where(on_old_page, last + 1 + k, page.to(tl.int64) * page_size + pos % page_size)
    tl.store(out_ptr + t, slot, mask=live)


@triton.jit(**_jit_options(["bs", "num_tokens", "num_free", "search_steps"],
                           ["prefix_lens_ptr", "last_loc_ptr", "free_pages_ptr", "scratch_ptr",
                            "out_ptr"]))
def extend_fill_kernel(
    prefix_lens_ptr,     # [bs]
    last_loc_ptr,        # [bs]  slot of each request's last prefix token
    free_pages_ptr,      # [num_free] free page ids; new pages come from the front
    scratch_ptr,         # [2*bs + 2] from extend_scan_kernel: token_start | page_start | totals
    out_ptr,             # [num_tokens] out: one slot per new token (int64)
    bs,
    num_tokens,
    num_free,
    search_steps,        # ceil(log2(bs)): binary-search rounds to find a token's request
    page_size: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # This program writes out_indices[t] for t in [pid*BLOCK, pid*BLOCK + BLOCK).
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _fill_tokens(t, prefix_lens_ptr, last_loc_ptr, free_pages_ptr, scratch_ptr, out_ptr,
                 bs, num_tokens, num_free, search_steps, page_size, BLOCK)


# --- batches of up to BATCH_BLOCK requests: scan and fill in one launch -----------------------


@triton.jit(**_jit_options(["bs", "num_tokens", "num_free", "search_steps"],
                           ["prefix_lens_ptr", "seq_lens_ptr", "last_loc_ptr", "free_pages_ptr",
                            "scratch_ptr", "out_ptr", "report_ptr"]))
def extend_fused_kernel(
    prefix_lens_ptr, seq_lens_ptr, last_loc_ptr, free_pages_ptr,
    scratch_ptr,         # [num_programs, 2*bs + 2] int64: one private row per program
    out_ptr,
    report_ptr,          # [1] int64, if HAS_REPORT: (total pages << 32) | total tokens
    bs, num_tokens, num_free, search_steps,
    page_size: tl.constexpr,
    BLOCK: tl.constexpr,        # output tokens per program
    BATCH: tl.constexpr,        # >= bs: the whole batch is one vector
    HAS_REPORT: tl.constexpr,
):
    # A launch costs ~10-25 us of host time, more than the whole scan, so for a batch that
    # fits one vector (bs <= BATCH) each program scans it itself -- one vector cumsum, O(bs)
    # per BLOCK output tokens, never O(bs^2) -- into its own scratch row, then fills its block.
    #   scratch row p: [ token_start (bs) | page_start (bs) | totals (2) ]
    #   a barrier makes the row's stores visible to all of the program's threads
    pid = tl.program_id(0)
    row = scratch_ptr + pid.to(tl.int64) * (2 * bs + 2)
    tokens, pages = _scan_batch(prefix_lens_ptr, seq_lens_ptr, row, bs, page_size, BATCH)
    if HAS_REPORT:
        if pid == 0:
            tl.store(report_ptr, (pages << 32) | tokens)
    tl.debug_barrier()
    t = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _fill_tokens(t, prefix_lens_ptr, last_loc_ptr, free_pages_ptr, row, out_ptr,
                 bs, num_tokens, num_free, search_steps, page_size, BLOCK)


# --- decode: one program, a vector of requests, one scan -------------------------------------


@triton.jit(**_jit_options(["bs", "num_free"],
                           ["seq_lens_ptr", "last_loc_ptr", "free_pages_ptr", "out_ptr", "report_ptr"]))
def decode_fast_kernel(
    seq_lens_ptr,        # [bs]  lengths AFTER the new token (seq = pre + 1)
    last_loc_ptr,        # [bs]
    free_pages_ptr,      # [num_free]
    out_ptr,             # [bs]  out: one slot per request (int64)
    report_ptr,          # [1]   int64 out, if HAS_REPORT: the number of new pages
    bs,
    num_free,
    page_size: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_REPORT: tl.constexpr,
):
    # A request needs a new page when its new token is the first of a page: (seq-1) % P == 0.
    # The k-th such request (counting in batch order) takes free_pages[k]: an exclusive scan.
    #   needs: [0 1 0 1 1]  ->  rank: [. 0 . 1 2]
    lanes = tl.arange(0, BLOCK)
    carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for block_start in range(0, bs, BLOCK):
        offs = block_start + lanes
        mask = offs < bs
        seq = tl.load(seq_lens_ptr + offs, mask=mask, other=1).to(tl.int64)
        last = tl.load(last_loc_ptr + offs, mask=mask, other=0).to(tl.int64)
        needs = ((seq - 1) % page_size == 0) & mask
        needs64 = needs.to(tl.int64)
        rank = carry + tl.cumsum(needs64, axis=0) - needs64
        page = tl.load(free_pages_ptr + rank, mask=needs & (rank < num_free), other=0)
        slot = tl.where(needs, page.to(tl.int64) * page_size, last + 1)
        tl.store(out_ptr + offs, slot, mask=mask)
        carry += tl.sum(needs64, axis=0)
    if HAS_REPORT:
        tl.store(report_ptr, carry)


# --- host side ---------------------------------------------------------------------------------


class FastExtend(NamedTuple):
    """Result of :func:`alloc_extend_fast`: the slots, and how many free pages they used."""

    out_indices: torch.Tensor   # [num_tokens] int64, requests concatenated
    num_new_pages: int          # the caller removes this many pages from the front of free_pages


class FastDecode(NamedTuple):
    """Result of :func:`alloc_decode_fast`."""

    out_indices: torch.Tensor   # [bs] int64
    num_new_pages: int


# Host-side checks. Every fast call runs them, so they are written for a few microseconds in
# all: one pass per argument, plain int arithmetic, no tensors built unless one is returned,
# and the slow work (finding *which* entry breaks a rule) only once a rule is known broken.

_INDEX_DTYPES = (torch.int32, torch.int64)


def _as_int_list(name: str, values) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise InvalidArgument(name, "a 1-D tensor or list", f"got shape {tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, list) and list(map(type, values)).count(int) == len(values):
        return values  # already plain ints (the type test runs in C): no copy
    return [int(v) for v in values]


def _check_device_tensor(name: str, t, bs: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(name, "a torch.Tensor", f"got {type(t).__name__}")
    if t.dim() != 1:
        raise InvalidArgument(name, "1-D", f"got shape {tuple(t.shape)}")
    if t.dtype not in _INDEX_DTYPES:
        raise InvalidArgument(name, "dtype int32 or int64", f"got {t.dtype}")
    if bs is not None and t.numel() != bs:
        raise InvalidArgument(name, "one entry per request", f"got {t.numel()}, expected {bs}")


def _raise_device_mismatch(owner: str, device: torch.device, **tensors: torch.Tensor) -> None:
    """Name the first of ``tensors`` that is not on ``device`` (called once a mismatch is known)."""
    for name, t in tensors.items():
        if t.device != device:
            raise InvalidArgument(name, f"on the same device as {owner}", f"got {t.device} and {device}")


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or value < 0:
        raise InvalidArgument(name, "an int >= 0", f"got {value!r}")


def _output(out: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """The caller's ``out`` after checking it fits, else a new int64 tensor of ``n``."""
    if out is None:
        return torch.empty(n, dtype=torch.int64, device=device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or out.dim() != 1 \
            or out.numel() != n or out.device != device or not out.is_contiguous():
        raise InvalidArgument("out", f"a contiguous 1-D int64 tensor of {n} on {device}",
                              f"got {getattr(out, 'dtype', type(out).__name__)}, "
                              f"shape {tuple(getattr(out, 'shape', ()))}")
    return out


def _check_report(report: torch.Tensor | None, device: torch.device) -> None:
    """A caller's ``report`` must be one int64 element on ``device``. Without one, the kernels
    get some other int64 tensor as a placeholder pointer and never write it (HAS_REPORT=False)."""
    if report is None:
        return
    if not isinstance(report, torch.Tensor) or report.dtype != torch.int64 or report.numel() != 1 \
            or report.device != device:
        raise InvalidArgument("report", f"an int64 tensor of one element on {device}",
                              f"got {getattr(report, 'dtype', type(report).__name__)}")


def _check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or page_size < 1:
        raise InvalidArgument("page_size", "an int >= 1", f"got {page_size!r}")


def extend_needs_from_host(prefix_lens_cpu, seq_lens_cpu, page_size: int) -> tuple[int, int]:
    """``(extend_num_tokens, num_new_pages)`` from lengths the caller has on the host.

    Also checks the rules that need the values (``0 <= pre <= seq``), so that nothing
    inconsistent is ever launched. No device sync: these are host lists or CPU tensors.
    """
    pre = _as_int_list("prefix_lens_cpu", prefix_lens_cpu)
    seq = _as_int_list("seq_lens_cpu", seq_lens_cpu)
    if len(pre) != len(seq):
        raise InvalidArgument("seq_lens_cpu", "same length as prefix_lens_cpu",
                              f"got {len(seq)} and {len(pre)}")
    if pre and min(pre) < 0:
        r = next(i for i, p in enumerate(pre) if p < 0)
        raise InvalidArgument(f"prefix_lens[{r}]", "prefix_lens >= 0", f"got {pre[r]}")
    if any(map(operator.lt, seq, pre)):  # some seq < pre (compared in C; found below)
        r = next(i for i, (p, s) in enumerate(zip(pre, seq)) if s < p)
        raise InvalidArgument(f"seq_lens[{r}]", "seq_lens >= prefix_lens",
                              f"got seq {seq[r]} < pre {pre[r]}")
    tokens = sum(seq) - sum(pre)
    if page_size == 1:
        return tokens, tokens
    P = page_size
    pages = sum([(s + P - 1) // P for s in seq]) - sum([(p + P - 1) // P for p in pre])
    return tokens, pages


def alloc_extend_fast(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                      free_pages: torch.Tensor, page_size: int, *,
                      extend_num_tokens: int | None = None,
                      num_new_pages: int | None = None,
                      prefix_lens_cpu=None, seq_lens_cpu=None,
                      out: torch.Tensor | None = None,
                      report: torch.Tensor | None = None) -> FastExtend:
    """Slots for a batched extend, same result as :func:`kvlab.reference.alloc_extend_ref`.

    Three ways to call it, from most to least host work avoided:

    * ``extend_num_tokens`` and ``num_new_pages`` given (the scheduler knows both): no host
      sync, no host loop; one launch (scan and fill fused) for up to ``FUSED_MAX_BATCH``
      requests, two (scan, fill) above.
    * ``prefix_lens_cpu`` and ``seq_lens_cpu`` given: both counts are computed on the host
      (and the lengths validated there); no device sync.
    * neither: the scan kernel computes the totals on the device and the host reads them
      once (one sync, the same one the source design pays for ``ret_values.item()``).

    In every mode the out-of-pages decision is made before the fill kernel (the only one that
    reads ``free_pages``) is launched; on :class:`OutOfPages` nothing has been written.
    ``free_pages`` is not modified: the caller drops ``num_new_pages`` pages from its front.
    ``out``, if given, receives the slots (a 1-D int64 tensor of ``extend_num_tokens``).
    ``report``, if given (an int64 tensor of one element), receives the teaching kernel's packed
    ``ret_values``, ``(num_new_pages << 32) | extend_num_tokens``, written on the device.
    """
    # fast accept: every tensor rule in one expression; if it fails, the named checks say which
    if not (isinstance(page_size, int) and page_size >= 1
            and isinstance(prefix_lens, Tensor) and isinstance(seq_lens, Tensor)
            and isinstance(last_loc, Tensor) and isinstance(free_pages, Tensor)
            and prefix_lens.dim() == 1 and free_pages.dim() == 1
            and seq_lens.shape == prefix_lens.shape and last_loc.shape == prefix_lens.shape
            and prefix_lens.dtype in _INDEX_DTYPES and seq_lens.dtype in _INDEX_DTYPES
            and last_loc.dtype in _INDEX_DTYPES and free_pages.dtype in _INDEX_DTYPES
            and seq_lens.device == prefix_lens.device == last_loc.device == free_pages.device):
        _check_page_size(page_size)
        _check_device_tensor("prefix_lens", prefix_lens)
        _check_device_tensor("seq_lens", seq_lens, prefix_lens.numel())
        _check_device_tensor("last_loc", last_loc, prefix_lens.numel())
        _check_device_tensor("free_pages", free_pages)
        _raise_device_mismatch("prefix_lens", prefix_lens.device, seq_lens=seq_lens,
                               last_loc=last_loc, free_pages=free_pages)
    bs = prefix_lens.numel()
    device = prefix_lens.device
    _check_report(report, device)

    if (prefix_lens_cpu is None) != (seq_lens_cpu is None):
        raise InvalidArgument("prefix_lens_cpu/seq_lens_cpu", "give both or neither")
    if prefix_lens_cpu is not None:
        host_tokens, host_pages = extend_needs_from_host(prefix_lens_cpu, seq_lens_cpu, page_size)
        if len(prefix_lens_cpu) != bs:
            raise InvalidArgument("prefix_lens_cpu", "one entry per request",
                                  f"got {len(prefix_lens_cpu)}, expected {bs}")
        if extend_num_tokens is not None and extend_num_tokens != host_tokens:
            raise InvalidArgument("extend_num_tokens", "== sum(seq_lens - prefix_lens)",
                                  f"got {extend_num_tokens}, the lengths sum to {host_tokens}")
        if num_new_pages is not None and num_new_pages != host_pages:
            raise InvalidArgument("num_new_pages", "== sum(ceil(seq/P) - ceil(pre/P))",
                                  f"got {num_new_pages}, the lengths need {host_pages}")
        extend_num_tokens, num_new_pages = host_tokens, host_pages
    if extend_num_tokens is not None:
        _check_count("extend_num_tokens", extend_num_tokens)
    if num_new_pages is not None:
        _check_count("num_new_pages", num_new_pages)

    if out is not None and extend_num_tokens is not None:
        _output(out, extend_num_tokens, device)  # refuse a wrong `out` before any launch
    num_free = free_pages.numel()
    if num_new_pages is not None and num_new_pages > num_free:
        raise OutOfPages(num_new_pages, num_free, "extend")  # before any launch
    if bs == 0:
        if extend_num_tokens not in (None, 0):
            raise InvalidArgument("extend_num_tokens", "0 for an empty batch", f"got {extend_num_tokens}")
        return FastExtend(torch.empty(0, dtype=torch.int64, device=device), 0)

    search_steps = max(1, (bs - 1).bit_length())
    has_report = report is not None
    if extend_num_tokens is not None and num_new_pages is not None and bs <= FUSED_MAX_BATCH:
        # counts known and the batch fits one vector: one launch does scan and fill
        out = _output(out, extend_num_tokens, device)
        if extend_num_tokens > 0:
            # ceil division in plain ints (triton.cdiv is a wrapped function: microseconds a call)
            n_programs = -(-extend_num_tokens // EXTEND_BLOCK)
            rows = torch.empty((n_programs, 2 * bs + 2), dtype=torch.int64, device=device)
            extend_fused_kernel[(n_programs,)](prefix_lens, seq_lens, last_loc, free_pages, rows, out,
                                               report if has_report else rows, bs, extend_num_tokens,
                                               num_free, search_steps, page_size=page_size,
                                               BLOCK=EXTEND_BLOCK, BATCH=BATCH_BLOCK,
                                               HAS_REPORT=has_report)
        elif has_report:
            report.fill_(0)  # nothing launched: zero pages, zero tokens
        return FastExtend(out, num_new_pages)

    # scan: offsets and first pages, plus the totals, in one int64 buffer (no slicing: every
    # torch call costs microseconds of host time, which is what this path saves)
    #   scratch = [ token_start (bs) | page_start (bs) | total tokens | total pages ]
    scratch = torch.empty(2 * bs + 2, dtype=torch.int64, device=device)
    extend_scan_kernel[(1,)](prefix_lens, seq_lens, scratch, report if has_report else scratch, bs,
                             page_size=page_size, BLOCK=BATCH_BLOCK, HAS_REPORT=has_report)

    if extend_num_tokens is None or num_new_pages is None:
        device_tokens, device_pages = scratch[2 * bs:].tolist()  # the one host sync of this mode
        if extend_num_tokens is not None and extend_num_tokens != device_tokens:
            raise InvalidArgument("extend_num_tokens", "== sum(seq_lens - prefix_lens)",
                                  f"got {extend_num_tokens}, the lengths sum to {device_tokens}")
        if num_new_pages is not None and num_new_pages != device_pages:
            raise InvalidArgument("num_new_pages", "== sum(ceil(seq/P) - ceil(pre/P))",
                                  f"got {num_new_pages}, the lengths need {device_pages}")
        if device_tokens < 0 or device_pages < 0:
            raise InvalidArgument("seq_lens", "seq_lens >= prefix_lens",
                                  f"the lengths sum to {device_tokens} tokens, {device_pages} pages")
        extend_num_tokens, num_new_pages = device_tokens, device_pages
        if num_new_pages > num_free:
            raise OutOfPages(num_new_pages, num_free, "extend")  # before the fill reads free_pages

    out = _output(out, extend_num_tokens, device)
    if extend_num_tokens > 0:
        n_programs = -(-extend_num_tokens // EXTEND_BLOCK)  # ceil division, plain ints
        extend_fill_kernel[(n_programs,)](prefix_lens, last_loc, free_pages, scratch, out,
                                          bs, extend_num_tokens, num_free, search_steps,
                                          page_size=page_size, BLOCK=EXTEND_BLOCK)
    return FastExtend(out, num_new_pages)


def decode_needs_from_host(seq_lens_cpu, page_size: int, bs: int | None = None) -> int:
    """New pages one decode step takes, from host lengths: ``#{r : (seq_r - 1) % P == 0}``.

    Checks ``seq_r >= 1`` and, when ``bs`` is given, that there is one length per request.
    """
    seq = _as_int_list("seq_lens_cpu", seq_lens_cpu)
    if bs is not None and len(seq) != bs:
        raise InvalidArgument("seq_lens_cpu", "one entry per request", f"got {len(seq)}, expected {bs}")
    if seq and min(seq) < 1:  # rare: find the first offender only now
        r = next(i for i, s in enumerate(seq) if s < 1)
        raise InvalidArgument(f"seq_lens[{r}]", "seq_lens >= 1 (the length after the new token)",
                              f"got {seq[r]}")
    if page_size == 1:
        return len(seq)
    return sum(1 for s in seq if (s - 1) % page_size == 0)


def alloc_decode_fast(seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor,
                      page_size: int, *, num_new_pages: int | None = None,
                      seq_lens_cpu=None, out: torch.Tensor | None = None,
                      report: torch.Tensor | None = None) -> FastDecode:
    """One slot per request for one decode step; same result as :func:`kvlab.reference.alloc_decode_ref`.

    With ``seq_lens_cpu`` (or ``num_new_pages``) there is no host sync and one launch; with
    neither, the page count is read from the device once (one sync) before the launch. With
    ``page_size == 1`` every request takes a page and nothing needs to be read at all.
    """
    # fast accept: every tensor rule in one expression; if it fails, the named checks say which
    if not (isinstance(page_size, int) and page_size >= 1
            and isinstance(seq_lens, Tensor) and isinstance(last_loc, Tensor)
            and isinstance(free_pages, Tensor)
            and seq_lens.dim() == 1 and free_pages.dim() == 1 and last_loc.shape == seq_lens.shape
            and seq_lens.dtype in _INDEX_DTYPES and last_loc.dtype in _INDEX_DTYPES
            and free_pages.dtype in _INDEX_DTYPES
            and seq_lens.device == last_loc.device == free_pages.device):
        _check_page_size(page_size)
        _check_device_tensor("seq_lens", seq_lens)
        _check_device_tensor("last_loc", last_loc, seq_lens.numel())
        _check_device_tensor("free_pages", free_pages)
        _raise_device_mismatch("seq_lens", seq_lens.device, last_loc=last_loc, free_pages=free_pages)
    bs = seq_lens.numel()
    device = seq_lens.device
    _check_report(report, device)
    if seq_lens_cpu is not None:
        host_pages = decode_needs_from_host(seq_lens_cpu, page_size, bs)
        if num_new_pages is not None and num_new_pages != host_pages:
            raise InvalidArgument("num_new_pages", "== #{r : (seq_lens[r] - 1) % P == 0}",
                                  f"got {num_new_pages}, the lengths need {host_pages}")
        num_new_pages = host_pages
    elif num_new_pages is None:
        if page_size == 1:
            num_new_pages = bs
        else:
            # one sync: read the page need (and the rule seq >= 1) before anything is launched
            seq_min, need = torch.stack([
                seq_lens.min().to(torch.int64) if bs else torch.ones((), dtype=torch.int64, device=device),
                ((seq_lens - 1) % page_size == 0).sum().to(torch.int64)]).tolist()
            if seq_min < 1:
                raise InvalidArgument("seq_lens", "seq_lens >= 1 (the length after the new token)",
                                      f"got a minimum of {seq_min}")
            num_new_pages = need
    _check_count("num_new_pages", num_new_pages)
    num_free = free_pages.numel()
    if num_new_pages > num_free:
        raise OutOfPages(num_new_pages, num_free, "decode step")  # before any launch
    out = _output(out, bs, device)
    if bs > 0:
        has_report = report is not None
        decode_fast_kernel[(1,)](seq_lens, last_loc, free_pages, out, report if has_report else out,
                                 bs, num_free, page_size=page_size, BLOCK=BATCH_BLOCK,
                                 HAS_REPORT=has_report)
    return FastDecode(out, num_new_pages)
