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

import os
from typing import Sequence

import torch

from ...base.args import check_int, check_int_vector, is_int
from ...base.errors import InvalidArgument, OutOfPages

__all__ = ["HostKV", "host_pool_pages"]


def _host_memory() -> int | None:
    """Bytes of physical memory on this machine (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def host_pool_pages(policy, host_pages, num_pages: int) -> int | None:
    """The host pool of a generator with ``policy`` (a :class:`~kvlab.serving.pressure.Policy`), in pages:
    ``host_pages`` or the policy's own ``host_pages`` (they must agree when both are given), else
    ``num_pages`` (as large as the device pool); None for a policy that never swaps, which takes
    no ``host_pages``. The simulator sizes its host pool the same way (:mod:`kvlab.serving.sim.make_room`)."""
    from ..pressure import make_policy

    policy = make_policy(policy)
    num_pages = check_int("num_pages", num_pages, minimum=0)
    if host_pages is not None:
        host_pages = check_int("host_pages", host_pages, minimum=0)
    if policy.on_preempt != "swap":
        if host_pages is not None:
            raise InvalidArgument("host_pages", 'only with a policy that swaps ("swap" or a SwapToHost)',
                                  f"got host_pages={host_pages} with the {policy.name!r} policy")
        return None
    own = getattr(policy, "host_pages", None)
    if host_pages is not None and own is not None and host_pages != own:
        raise InvalidArgument("host_pages", "the policy's host_pages or this one, not two sizes",
                              f"got host_pages={host_pages}, policy.host_pages={own}")
    for size in (host_pages, own):
        if size is not None:
            return size
    return num_pages


class HostKV:
    """``num_pages`` host pages of ``page_size`` positions for the K/V of ``pool``'s layout.

    Every call checks its arguments before it changes anything (the free list, what the pages
    hold, the device pool) and refuses with :class:`~kvlab.InvalidArgument`. Which positions of
    each host page :meth:`save` filled is kept on the host, so :meth:`load` refuses positions
    nobody saved (they would bring back zeros, or another request's K/V) without asking the
    device. The slots' values are checked against the pool (one wait for the GPU when they are on
    it); ``check=False`` skips that for slots the caller vouches for (the generator's page table).
    """

    def __init__(self, pool, page_size: int, num_pages: int):
        k, v = getattr(pool, "k", None), getattr(pool, "v", None)
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4
                and v.shape == k.shape and v.dtype == k.dtype):
            raise InvalidArgument("pool", "a KVPool (k and v of [layers, slots, heads, head_dim])",
                                  f"got {type(pool).__name__}")
        self.page_size = check_int("page_size", page_size, minimum=1)
        self.num_pages = check_int("host_pages", num_pages, minimum=0)
        layers, _, heads, head_dim = k.shape
        self.bytes_per_token = 2 * layers * heads * head_dim * k.element_size()
        size, memory = self.num_pages * self.page_size * self.bytes_per_token, _host_memory()
        if memory is not None and size > memory:
            raise InvalidArgument("host_pages", f"a host pool within this machine's memory ({memory / 2**30:.1f} "
                                  "GiB)", f"got {self.num_pages} pages of {self.page_size} positions: "
                                  f"{size / 2**30:.3g} GiB")
        self.device = k.device
        pinned = k.device.type == "cuda"
        shape = (self.num_pages, layers, self.page_size, heads, head_dim)
        self.k = torch.zeros(shape, dtype=k.dtype, pin_memory=pinned)
        self.v = torch.zeros(shape, dtype=v.dtype, pin_memory=pinned)
        self.free_pages: list[int] = list(range(self.num_pages))
        self._saved: dict[int, int] = {}   # host page -> positions save() wrote into it (from its start)

    def reset(self) -> None:
        """Every host page free again (what they held is no longer needed)."""
        self.free_pages = list(range(self.num_pages))
        self._saved.clear()

    def fits(self, positions: int) -> bool:
        positions = check_int("positions", positions, minimum=0)
        return -(-positions // self.page_size) <= len(self.free_pages)

    def take(self, n: int) -> list[int]:
        """``n`` free host pages (the first of the free list), or :class:`~kvlab.OutOfPages`.
        They hold nothing :meth:`load` may read until :meth:`save` fills them."""
        n = check_int("n", n, minimum=0)
        if n > len(self.free_pages):
            raise OutOfPages(n, len(self.free_pages), "host pages for a swapped-out request")
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def saved_positions(self, page: int) -> int:
        """How many positions (from the page's start) :meth:`save` wrote into host ``page``."""
        return self._saved.get(page, 0)

    def save(self, pool, slots: torch.Tensor, *, check: bool = True) -> list[int]:
        """Copy the K/V at device ``slots`` (positions ``0, 1, ...`` of a row, in order) into
        free host pages; return the pages (page ``i`` holds positions ``[i*P, (i+1)*P)``)."""
        self._check_pool(pool)
        slots = self._check_slots(pool, slots, check)
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
        for i, page in enumerate(pages):
            self._saved[page] = min(P, n - i * P)
        return pages

    def load(self, pool, pages: Sequence[int], start: int, end: int, slots: torch.Tensor, *,
             check: bool = True) -> None:
        """Copy positions ``[start, end)`` of a request saved in host ``pages`` into device
        ``slots`` (one slot per position, in order)."""
        P = self.page_size
        self._check_pool(pool)
        pages = self._check_pages(pages)
        start = check_int("start", start, minimum=0)
        end = check_int("end", end, minimum=start)
        if end > len(pages) * P:
            raise InvalidArgument("end", f"<= len(pages) * page_size = {len(pages) * P} (positions "
                                  "the pages hold)", f"got {end}")
        for i in range(start // P, -(-end // P)):     # every page touched holds its part, saved
            want = min(P, end - i * P)
            if self._saved.get(pages[i], 0) < want:
                raise InvalidArgument("pages", "host pages save() filled, holding every position "
                                      "of [start, end)", f"host page {pages[i]} (positions {i * P}.."
                                      f"{i * P + want - 1}) holds {self._saved.get(pages[i], 0)} saved")
        slots = self._check_slots(pool, slots, check)
        if slots.numel() != end - start:
            raise InvalidArgument("slots", f"one slot per position of [{start}, {end})",
                                  f"got {slots.numel()} slots")
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
        pages = self._check_pages(pages)
        self.free_pages.extend(pages)
        for page in pages:
            self._saved.pop(page, None)

    # --- the rules, checked before anything changes ----------------------------------------

    def _check_pool(self, pool) -> None:
        """``pool`` has the layout and dtype these host pages were made for, on their device."""
        k, v = getattr(pool, "k", None), getattr(pool, "v", None)
        layout = tuple(self.k.shape[i] for i in (1, 3, 4))   # layers, heads, head_dim
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4
                and v.shape == k.shape and (k.shape[0], k.shape[2], k.shape[3]) == layout
                and k.dtype == self.k.dtype and v.dtype == self.v.dtype
                and k.device.type == self.device.type):
            raise InvalidArgument("pool", f"a KVPool of {layout[0]} layers, {layout[1]} heads of "
                                  f"{layout[2]}, {self.k.dtype}, on {self.device.type} (what these host "
                                  "pages were made for)", f"got {type(pool).__name__}")

    def _check_slots(self, pool, slots, check: bool) -> torch.Tensor:
        """A 1-D integer tensor of device slots, on the host or the pool's device; with
        ``check``, each in ``[0, pool.num_slots)`` (read from the device: one wait)."""
        slots = check_int_vector("slots", slots)
        if slots.device.type != "cpu" and slots.device != pool.k.device:
            raise InvalidArgument("slots", f"on the host or on the pool's device ({pool.k.device})",
                                  f"got {slots.device}")
        if check and slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= pool.k.shape[1]:
                raise InvalidArgument("slots", f"slots of the pool, in [0, {pool.k.shape[1]})",
                                      f"got min {lo}, max {hi}")
        return slots

    def _check_pages(self, pages) -> list[int]:
        """A list (or tuple) of host pages in use, each once, as ints."""
        if isinstance(pages, (str, bytes)) or not isinstance(pages, (list, tuple)):
            raise InvalidArgument("pages", "a list of host pages (ints)", f"got {type(pages).__name__}")
        free = set(self.free_pages)
        out = []
        for i, page in enumerate(pages):
            if not is_int(page) or isinstance(page, torch.Tensor):
                raise InvalidArgument(f"pages[{i}]", "a host page: an int (not a bool or a float)",
                                      f"got {type(page).__name__} {page!r}")
            page = int(page)
            if not 0 <= page < self.num_pages or page in free:
                raise InvalidArgument(f"pages[{i}]", f"a host page in use, in [0, {self.num_pages}) and "
                                      "not free", f"got {page}" + (" (free)" if page in free else ""))
            out.append(page)
        if len(set(out)) != len(out):
            raise InvalidArgument("pages", "each host page once", f"got {list(out)}")
        return out
