"""``alloc_extend_fast`` / ``alloc_decode_fast``: the fast kernels as plain functions (chapter 09).

They take a free list and return slots, leaving ``free_pages`` alone (the caller drops
``num_new_pages`` pages from its front): the building blocks chapter 09 times and checks.
:class:`kvlab.PagedTokenAllocator` calls the same kernels and adds the state they lack (which
pages are allocated, a record of refusals).

Three ways to call them, from most to least host work avoided:

* the counts given (``extend_num_tokens`` and ``num_new_pages``): no host loop, no sync;
* host copies of the lengths given (``prefix_lens_cpu`` / ``seq_lens_cpu``): the counts and
  the length rules come from the host copies (vectorised), no sync;
* neither: the kernel counts on the device and the host reads the result once (one sync).

The kernels check every rule of every request themselves before writing anything (see
:mod:`kvlab.alloc.fast_alloc_kernels`). A bare call with the counts or host lengths never waits for
the GPU, so it cannot raise for what only the device sees: a batch the kernel refuses comes
back as slots of -1 (``FastExtend.refused`` says whether to look). A call that syncs raises.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .host_checks import (INDEX_DTYPES, capacity_error, check_count, check_devices, check_index_tensor,
                           decode_counts, extend_counts, fits)
from .verdict import DeviceReport, refusal_error
from ..base.args import check_page_size
from ..base.errors import InvalidArgument, OutOfPages
from . import fast_alloc_kernels as K
from .kernel_checks import STATUS_WORDS, TOTAL_LIMIT


class FastExtend(NamedTuple):
    """Result of :func:`alloc_extend_fast`: the slots, and how many free pages they used."""

    out_indices: torch.Tensor   # [num_tokens] int64, requests concatenated (-1: refused)
    num_new_pages: int          # the caller removes this many pages from the front of free_pages


class FastDecode(NamedTuple):
    """Result of :func:`alloc_decode_fast`."""

    out_indices: torch.Tensor   # [bs] int64
    num_new_pages: int


# per device: [status (STATUS_WORDS) | a spare report word], and a one-byte stand-in for the
# page_free map a bare call does not have (pool_pages = 0: the kernels never read it)
_AUX: dict = {}


def _aux(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    aux = _AUX.get(device)
    if aux is None:
        words = torch.zeros(STATUS_WORDS + 1, dtype=torch.int64, device=device)
        aux = _AUX[device] = (words[:STATUS_WORDS], words[STATUS_WORDS:],
                              torch.zeros(1, dtype=torch.int8, device=device))
    return aux


def _check_output(out, n: int, device: torch.device) -> Tensor:
    """The caller's ``out`` after checking it fits, else a new int64 tensor of ``n``."""
    if out is None:
        return torch.empty(n, dtype=torch.int64, device=device)
    if not isinstance(out, Tensor) or out.dtype != torch.int64 or out.dim() != 1 \
            or out.numel() != n or out.device != device or not out.is_contiguous():
        raise InvalidArgument("out", f"must be a contiguous 1-D int64 tensor of {n} on {device}",
                              f"got {getattr(out, 'dtype', type(out).__name__)}, "
                              f"shape {tuple(getattr(out, 'shape', ()))}")
    return out


def _check_report(report, device: torch.device) -> None:
    if report is not None and not (isinstance(report, Tensor) and report.dtype == torch.int64
                                   and report.numel() == 1 and report.device == device):
        raise InvalidArgument("report", f"must be an int64 tensor of one element on {device}",
                              f"got {getattr(report, 'dtype', type(report).__name__)}")


def _check_tensors(owner: str, page_size, **tensors) -> None:
    """Every tensor rule in one pass for good input (1-D int32/int64 tensors on one device, all
    but the last with one entry per request); the named checks say which rule failed."""
    ts = list(tensors.values())
    first = ts[0]
    if type(page_size) is int and page_size >= 1 and isinstance(first, Tensor):
        device, shape = first.device, first.shape
        for i, t in enumerate(ts):
            if not (isinstance(t, Tensor) and t.dtype in INDEX_DTYPES and t.dim() == 1 and t.device == device
                    and (t.shape == shape or i == len(ts) - 1)):
                break
        else:
            return
    check_page_size(page_size)
    for name, t in tensors.items():
        check_index_tensor(name, t)
    check_devices(owner, first.device, **tensors)
    bs = first.numel()
    for name, t in list(tensors.items())[1:-1]:
        check_index_tensor(name, t, bs)


def alloc_extend_fast(prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor, free_pages: Tensor,
                      page_size: int, *, extend_num_tokens: int | None = None,
                      num_new_pages: int | None = None, prefix_lens_cpu=None, seq_lens_cpu=None,
                      out: Tensor | None = None, report: Tensor | None = None) -> FastExtend:
    """Slots for a batched extend, same result as :func:`kvlab.course.reference.alloc_extend_ref`.

    Out of pages is refused before any kernel reads ``free_pages`` (host counts), or by the
    kernel before it reads them (no host counts), in both cases with nothing written.
    ``out``, if given, receives the slots; ``report``, if given (one int64), receives the
    teaching kernel's packed ``ret_values``, ``(num_new_pages << 32) | extend_num_tokens``.
    """
    _check_tensors("prefix_lens", page_size, prefix_lens=prefix_lens, seq_lens=seq_lens,
                   last_loc=last_loc, free_pages=free_pages)
    bs, device = prefix_lens.numel(), prefix_lens.device
    _check_report(report, device)
    host = None
    if (prefix_lens_cpu is None) != (seq_lens_cpu is None):
        raise InvalidArgument("prefix_lens_cpu/seq_lens_cpu", "give both or neither")
    if prefix_lens_cpu is not None:
        host = extend_counts(prefix_lens_cpu, seq_lens_cpu, page_size, bs)
        for name, given, counted in (("extend_num_tokens", extend_num_tokens, host.tokens),
                                     ("num_new_pages", num_new_pages, host.pages)):
            if given is not None and given != counted:
                raise InvalidArgument(name, f"{name} == what the host lengths need",
                                      f"got {given}, the lengths need {counted}")
        extend_num_tokens, num_new_pages = host.tokens, host.pages
    if extend_num_tokens is not None:
        check_count("extend_num_tokens", extend_num_tokens)
    if num_new_pages is not None:
        check_count("num_new_pages", num_new_pages)
        if num_new_pages > free_pages.numel():
            raise OutOfPages(num_new_pages, free_pages.numel(), "extend")  # before any launch
    # a count no free list of this size could hold: the scan (one sync) says why, before any output
    beyond = extend_num_tokens is not None and not fits(extend_num_tokens, free_pages.numel(), bs, page_size)
    if beyond and (extend_num_tokens >= TOTAL_LIMIT or bs == 0):  # (past the kernels' limit: no scan)
        raise capacity_error(extend_num_tokens, free_pages.numel(), bs, page_size)
    if extend_num_tokens is not None and not beyond:
        out = _check_output(out, extend_num_tokens, device)
    if bs == 0:
        if extend_num_tokens not in (None, 0):
            raise InvalidArgument("extend_num_tokens", "0 for an empty batch", f"got {extend_num_tokens}")
        return FastExtend(_check_output(out, 0, device), 0)

    status, spare, no_pool = _aux(device)
    report = spare if report is None else report
    pre, seq, last = prefix_lens.contiguous(), seq_lens.contiguous(), last_loc.contiguous()
    free = free_pages.contiguous()
    sums = (host.sum_pre, host.sum_seq) if host else (0, 0)
    host_pages = -1 if num_new_pages is None else num_new_pages
    # free_head, num_free, pool_pages (none), host_pages, host_copies, sums, call_id, sticky (no)
    common = (0, free.numel(), 0, host_pages, int(host is not None)) + sums + (0, 0)
    if extend_num_tokens is None or beyond:
        # the token count decides the output's size: scan first, read it, then fill
        scratch = torch.empty(2 * bs + 1, dtype=torch.int64, device=device)
        K.launch_extend_check(pre, seq, last, no_pool, status, report, scratch, bs,
                              -1 if extend_num_tokens is None else extend_num_tokens, *common, page_size)
        rep = DeviceReport.from_words(status.tolist())  # the one sync of this mode
        if rep.code:
            raise refusal_error(rep, page_size, "extend")
        if beyond:  # (the scan cannot accept such a count)
            raise capacity_error(extend_num_tokens, free.numel(), bs, page_size)
        extend_num_tokens, num_new_pages = rep.last_tokens, rep.last_pages
        out = _check_output(out, extend_num_tokens, device)
        K.launch_extend_fill(pre, last, free, no_pool, scratch, out, bs, extend_num_tokens, 0,
                             free.numel(), 0, page_size)
        return FastExtend(out, num_new_pages)

    scratch = torch.empty(K.extend_scratch_words(bs, extend_num_tokens), dtype=torch.int64, device=device)
    K.launch_extend(pre, seq, last, free, no_pool, status, report, scratch, out, bs, extend_num_tokens,
                    *common, page_size)
    if num_new_pages is None:
        rep = DeviceReport.from_words(status.tolist())  # the one sync of this mode
        if rep.code:
            raise refusal_error(rep, page_size, "extend")
        num_new_pages = rep.last_pages
    return FastExtend(out, num_new_pages)


def alloc_decode_fast(seq_lens: Tensor, last_loc: Tensor, free_pages: Tensor, page_size: int, *,
                      num_new_pages: int | None = None, seq_lens_cpu=None, out: Tensor | None = None,
                      report: Tensor | None = None) -> FastDecode:
    """One slot per request for one decode step; same result as :func:`kvlab.course.reference.alloc_decode_ref`.

    With ``seq_lens_cpu`` (or ``num_new_pages``): no sync, one launch. With neither: one
    launch, then the page count (and the verdict) is read once.
    """
    _check_tensors("seq_lens", page_size, seq_lens=seq_lens, last_loc=last_loc, free_pages=free_pages)
    bs, device = seq_lens.numel(), seq_lens.device
    _check_report(report, device)
    host = None
    if seq_lens_cpu is not None:
        host = decode_counts(seq_lens_cpu, page_size, bs)
        if num_new_pages is not None and num_new_pages != host.pages:
            raise InvalidArgument("num_new_pages", "num_new_pages == what the host lengths need",
                                  f"got {num_new_pages}, the lengths need {host.pages}")
        num_new_pages = host.pages
    if num_new_pages is not None:
        check_count("num_new_pages", num_new_pages)
        if num_new_pages > free_pages.numel():
            raise OutOfPages(num_new_pages, free_pages.numel(), "decode step")  # before any launch
    out = _check_output(out, bs, device)
    if bs == 0:
        return FastDecode(out, 0)
    status, spare, no_pool = _aux(device)
    seq, last, free = seq_lens.contiguous(), last_loc.contiguous(), free_pages.contiguous()
    K.launch_decode(seq, last, free, no_pool, status, spare if report is None else report, out, bs, 0,
                    free.numel(), 0, -1 if num_new_pages is None else num_new_pages,
                    int(host is not None), host.sum_seq if host else 0, 0, 0, 1, page_size)
    if num_new_pages is None:
        rep = DeviceReport.from_words(status.tolist())  # the one sync of this mode
        if rep.code:
            raise refusal_error(rep, page_size, "decode step", decode=True)
        num_new_pages = rep.last_pages
    return FastDecode(out, num_new_pages)


def extend_needs_from_host(prefix_lens_cpu, seq_lens_cpu, page_size: int) -> tuple[int, int]:
    """``(extend_num_tokens, num_new_pages)`` from host lengths (checked: ``0 <= pre <= seq``)."""
    counts = extend_counts(prefix_lens_cpu, seq_lens_cpu, page_size)
    return counts.tokens, counts.pages


def decode_needs_from_host(seq_lens_cpu, page_size: int, bs: int | None = None) -> int:
    """New pages one decode step takes, from host lengths (checked: ``seq >= 1``)."""
    return decode_counts(seq_lens_cpu, page_size, bs).pages
