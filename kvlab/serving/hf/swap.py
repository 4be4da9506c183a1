"""Host memory for swapped-out requests: their K/V copied page by page, and back (chapter 12).

When the ``"swap"`` policy (:mod:`kvlab.serving.pressure`) stops a request, its row's K/V -- positions
``[0, cached_len)`` of every layer -- is copied into pages of a host pool and its device pages
are freed. When it comes back, it gets fresh device pages and only the positions the prefix
cache no longer holds are copied back into them (:func:`kvlab.serving.pressure.resume_plan`)::

    device pool (KVPool.k/.v)                  host pool (HostKV.k/.v: pinned on CUDA,
    [layers, slots, heads, dim]                 a second CPU tensor without CUDA)
                                                [host pages, layers, P, heads, dim]
    row of B:  slot 36 37 38 39 | 8 9 10 11    host page 2: positions 0..3 of B
               positions 0..3   | 4..7  ─────► host page 5: positions 4..7 of B
    resumed:   (hit from cache) | 20 21 22 23 ◄─ positions 4..7 back from host page 5

A host page is one contiguous block of memory (all layers of ``P`` positions), so each page
goes in one copy; on CUDA the copies are asynchronous and ordered on the current stream, so
neither direction waits for the GPU (a copy back is queued after the copy out it reads).
SGLang's host pools (``python/sglang/srt/mem_cache/memory_pool_host.py``) are pinned the same
way; vLLM v0 kept ``num_cpu_blocks`` of them (``vllm/core/scheduler.py``, ``swap_out``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...base.args import check_int
from ...base.errors import InvalidArgument, OutOfPages

__all__ = ["HostKV"]


class HostKV:
    """``num_pages`` host pages of ``page_size`` positions for the K/V of ``pool``'s layout."""

    def __init__(self, pool, page_size: int, num_pages: int):
        self.page_size = check_int("page_size", page_size, minimum=1)
        self.num_pages = check_int("host_pages", num_pages, minimum=0)
        self.device = pool.device
        pinned = pool.device.type == "cuda"
        shape = (self.num_pages, pool.num_layers, self.page_size, pool.num_heads, pool.head_dim)
        self.k = torch.zeros(shape, dtype=pool.k.dtype, pin_memory=pinned)
        self.v = torch.zeros(shape, dtype=pool.v.dtype, pin_memory=pinned)
        self.bytes_per_token = 2 * pool.num_layers * pool.num_heads * pool.head_dim * pool.k.element_size()
        self.free_pages: list[int] = list(range(self.num_pages))

    def reset(self) -> None:
        """Every host page free again (what they held is no longer needed)."""
        self.free_pages = list(range(self.num_pages))

    def fits(self, positions: int) -> bool:
        return -(-positions // self.page_size) <= len(self.free_pages)

    def take(self, n: int) -> list[int]:
        """``n`` free host pages (the first of the free list), or :class:`~kvlab.OutOfPages`."""
        n = check_int("n", n, minimum=0)
        if n > len(self.free_pages):
            raise OutOfPages(n, len(self.free_pages), "host pages for a swapped-out request")
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def save(self, pool, slots: torch.Tensor) -> list[int]:
        """Copy the K/V at device ``slots`` (positions ``0, 1, ...`` of a row, in order) into
        free host pages; return the pages (page ``i`` holds positions ``[i*P, (i+1)*P)``)."""
        n, P = int(slots.numel()), self.page_size
        pages = self.take(-(-n // P))
        idx = slots.to(device=pool.device, dtype=torch.int64)
        try:
            for i, page in enumerate(pages):
                part = idx[i * P:(i + 1) * P]
                for host, dev in ((self.k, pool.k), (self.v, pool.v)):
                    host[page, :, : part.numel()].copy_(dev[:, part], non_blocking=True)
        except BaseException:
            self.free_pages = pages + self.free_pages   # all or nothing: the pages are free again
            raise
        return pages

    def load(self, pool, pages: Sequence[int], start: int, end: int, slots: torch.Tensor) -> None:
        """Copy positions ``[start, end)`` of a request saved in host ``pages`` into device
        ``slots`` (one slot per position, in order)."""
        P = self.page_size
        if slots.numel() != end - start or not 0 <= start <= end <= len(pages) * P:
            raise InvalidArgument("slots", f"one slot per position of [{start}, {end}) within "
                                  f"{len(pages)} host pages", f"got {slots.numel()} slots")
        idx = slots.to(device=pool.device, dtype=torch.int64)
        pos = start
        while pos < end:                              # one copy per host page touched
            page, off = pages[pos // P], pos % P
            m = min(P - off, end - pos)
            part = idx[pos - start:pos - start + m]
            for host, dev in ((self.k, pool.k), (self.v, pool.v)):
                dev[:, part] = host[page, :, off:off + m].to(pool.device, non_blocking=True)
            pos += m

    def release(self, pages: Sequence[int]) -> None:
        """Give host ``pages`` back (a request resumed, or will never resume)."""
        taken = set(range(self.num_pages)) - set(self.free_pages)
        bad = [p for p in pages if p not in taken]
        if bad or len(set(pages)) != len(pages):
            raise InvalidArgument("pages", "host pages that are in use, each once", f"got {list(pages)}")
        self.free_pages.extend(pages)
