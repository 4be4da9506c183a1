"""The allocation paths the benchmark compares, as plain functions of a batch (chapter 09).

Each returns ``(out_indices, num_new_pages)`` and leaves the batch untouched (the caller
would drop ``num_new_pages`` pages from the front of ``free_pages``), so one batch can be
timed again and again.

* ``teaching_*``: the source design's host code, as it is: launch with the compile-time
  sizes ``next_power_of_2(bs)`` and ``next_power_of_2(T)``, read ``ret_values.item()`` (a
  host sync), then slice. (Here the pool always has enough pages, so its launch-then-check
  order does no harm; :class:`kvlab.PagedTokenAllocator` checks first.)
* ``fast_*``: :func:`kvlab.alloc.fast_alloc.alloc_extend_fast` and friends, in their three modes.
* ``torch_*``: the same allocation written with vectorised torch operations, no Triton.
"""
from __future__ import annotations

import torch

from ..base.args import next_pow2
from ..base.errors import OutOfPages
from ..alloc.fast_alloc import alloc_decode_fast, alloc_extend_fast
from .cases import DecodeBatch, ExtendBatch


# --- extend -------------------------------------------------------------------------------


def teaching_extend(b: ExtendBatch, ret_values: torch.Tensor | None = None):
    """The source design's ``alloc_extend``: one launch, ``.item()``, slice."""
    from ..alloc.alloc_kernels import alloc_extend_kernel

    if ret_values is None:
        ret_values = torch.zeros(1, dtype=torch.int64, device=b.prefix_lens.device)
    out = torch.empty(b.extend_num_tokens, dtype=torch.int64, device=b.prefix_lens.device)
    alloc_extend_kernel[(b.bs,)](b.prefix_lens, b.seq_lens, b.last_loc, b.free_pages, out,
                                 ret_values, next_pow2(b.bs), b.page_size,
                                 next_pow2(b.extend_num_tokens))
    num_new_pages = int(ret_values.item()) >> 32  # the host sync of every batch
    if num_new_pages > b.free_pages.numel():
        raise OutOfPages(num_new_pages, b.free_pages.numel(), "extend")
    return out, num_new_pages


def fast_extend(b: ExtendBatch):
    """Fast path, counts known on the host (the scheduler has them): no sync, one launch."""
    r = alloc_extend_fast(b.prefix_lens, b.seq_lens, b.last_loc, b.free_pages, b.page_size,
                          extend_num_tokens=b.extend_num_tokens, num_new_pages=b.num_new_pages)
    return r.out_indices, r.num_new_pages


def fast_extend_host_lens(b: ExtendBatch):
    """Fast path given the host lengths: counts and rules checked on the host, no sync."""
    r = alloc_extend_fast(b.prefix_lens, b.seq_lens, b.last_loc, b.free_pages, b.page_size,
                          prefix_lens_cpu=b.prefix_cpu, seq_lens_cpu=b.seq_cpu)
    return r.out_indices, r.num_new_pages


def fast_extend_sync(b: ExtendBatch):
    """Fast path with device tensors only: the totals are read back once (one sync)."""
    r = alloc_extend_fast(b.prefix_lens, b.seq_lens, b.last_loc, b.free_pages, b.page_size,
                          extend_num_tokens=b.extend_num_tokens)
    return r.out_indices, r.num_new_pages


def torch_extend(b: ExtendBatch):
    """Vectorised torch: every output token finds its request with ``repeat_interleave``."""
    return alloc_extend_torch(b.prefix_lens, b.seq_lens, b.last_loc, b.free_pages, b.page_size,
                              b.extend_num_tokens, b.num_new_pages), b.num_new_pages


def alloc_extend_torch(prefix_lens, seq_lens, last_loc, free_pages, page_size: int,
                       extend_num_tokens: int, num_new_pages: int) -> torch.Tensor:
    """The fast kernel's formula in torch ops (about 20 small launches, no sync)."""
    if num_new_pages > free_pages.numel():
        raise OutOfPages(num_new_pages, free_pages.numel(), "extend")
    P = page_size
    dev = prefix_lens.device
    pre, seq, last = prefix_lens.long(), seq_lens.long(), last_loc.long()
    ext = seq - pre
    owner = torch.repeat_interleave(torch.arange(pre.numel(), device=dev), ext,
                                    output_size=extend_num_tokens)           # request of each token
    token_start = torch.cumsum(ext, 0) - ext
    new_pages = (seq + P - 1) // P - (pre + P - 1) // P
    page_start = torch.cumsum(new_pages, 0) - new_pages
    k = torch.arange(extend_num_tokens, device=dev) - token_start[owner]
    pos = pre[owner] + k
    old_page_end = ((pre + P - 1) // P * P)[owner]
    on_old = pos < old_page_end
    free_idx = torch.where(on_old, 0, page_start[owner] + pos // P - old_page_end // P)
    # tokens on their old page index nothing: gather from a table that has a row 0 anyway
    table = free_pages if free_pages.numel() else free_pages.new_zeros(1)
    return torch.where(on_old, last[owner] + 1 + k, table[free_idx] * P + pos % P)


# --- decode -------------------------------------------------------------------------------


def teaching_decode(b: DecodeBatch, ret_values: torch.Tensor | None = None):
    from ..alloc.alloc_kernels import alloc_decode_kernel

    if ret_values is None:
        ret_values = torch.zeros(1, dtype=torch.int64, device=b.seq_lens.device)
    out = torch.empty(b.bs, dtype=torch.int64, device=b.seq_lens.device)
    alloc_decode_kernel[(b.bs,)](b.seq_lens, b.last_loc, b.free_pages, out, ret_values,
                                 next_pow2(b.bs), b.page_size)
    num_new_pages = int(ret_values.item())
    if num_new_pages > b.free_pages.numel():
        raise OutOfPages(num_new_pages, b.free_pages.numel(), "decode step")
    return out, num_new_pages


def fast_decode(b: DecodeBatch):
    """Fast decode, page count known on the host: no sync, one launch."""
    r = alloc_decode_fast(b.seq_lens, b.last_loc, b.free_pages, b.page_size,
                          num_new_pages=b.num_new_pages)
    return r.out_indices, r.num_new_pages


def fast_decode_sync(b: DecodeBatch):
    """Fast decode from device tensors only: the page count is read back once."""
    r = alloc_decode_fast(b.seq_lens, b.last_loc, b.free_pages, b.page_size)
    return r.out_indices, r.num_new_pages


def torch_decode(b: DecodeBatch):
    P = b.page_size
    needs = (b.seq_lens - 1) % P == 0
    rank = torch.cumsum(needs.long(), 0) - needs.long()
    page = b.free_pages[torch.where(needs, rank, 0).clamp_(max=max(b.free_pages.numel() - 1, 0))]
    return torch.where(needs, page * P, b.last_loc + 1), b.num_new_pages


EXTEND_PATHS = {
    "teaching": teaching_extend,
    "fast": fast_extend,
    "fast_host_lens": fast_extend_host_lens,
    "fast_sync": fast_extend_sync,
    "torch": torch_extend,
}
DECODE_PATHS = {
    "teaching": teaching_decode,
    "fast": fast_decode,
    "fast_sync": fast_decode_sync,
    "torch": torch_decode,
}
