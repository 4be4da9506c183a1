"""Host memory as the prefix cache's second tier: pages, who reads them, what is still arriving
(chapter 13).

A host page holds the K and V of ``page_size`` positions of every layer, one contiguous block
(SGLang's ``page_first`` layout; its ``layer_first`` keeps a layer's pages together instead:
``HiCacheController.move_indices``, ``python/sglang/srt/managers/cache_controller.py``,
sgl-project/sglang ``350cb879``)::

    kv[host_page]   [layers, 2 (K, V), page_size, kv_heads, head_dim]    pinned on CUDA,
                                                                         a second CPU tensor
                                                                         without one

A run of neighbouring host pages is one contiguous block too, so a load-back copies it to the
GPU in one transfer at the link's full speed (copies of small scattered pieces reach a fraction
of it: measured on an H200, 4-12 GB/s for a paged gather against 52 GB/s for one pinned block);
:meth:`HostTier.take` therefore hands out runs of neighbouring pages when it can.

Two things a page can be waiting for, each a *pending* copy (anything with ``done()`` and
``wait()``: a CUDA event, or nothing at all on a CPU where copies finish before they return):

* **readers**: a load-back copying the page to the GPU. The page must not be freed (nor its copy
  overwritten) until they are done: :meth:`give_back` refuses a pinned page;
* **a writer**: the copy that fills the page (from the GPU, or from disk). The page may be read
  once it has landed: :meth:`wait_written` waits for it (vLLM's ``complete_store``: "following
  this call, the blocks become loadable", ``vllm/v1/kv_offload/abstract.py``, ``70c98942``).
"""
from __future__ import annotations

import bisect
from typing import NamedTuple, Sequence

import torch

from ..base.args import check_int
from ..base.errors import CacheMisuse, InvalidArgument, OutOfPages

__all__ = ["KVLayout", "HostTier", "DONE"]


class KVLayout(NamedTuple):
    """What a page of K/V holds: the layers, K/V heads and head size of the model, its dtype."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        return (self.num_layers, 2, page_size, self.num_heads, self.head_dim)

    def page_bytes(self, page_size: int) -> int:
        n = 1
        for d in self.page_shape(page_size):
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class _Done:
    """A copy that has already finished (the CPU's copies, and nothing at all)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = _Done()


class HostTier:
    """``num_pages`` host pages of ``page_size`` positions. ``layout``: the K/V they hold (then
    ``kv`` is their memory: pinned when ``pin``); ``None``: pages as numbers only (a simulator's)."""

    def __init__(self, num_pages: int, page_size: int, layout: KVLayout | None = None, *,
                 pin: bool = False):
        self.num_pages = check_int("host_pages", num_pages, minimum=1)
        self.page_size = check_int("page_size", page_size, minimum=1)
        if layout is not None and not isinstance(layout, KVLayout):
            raise InvalidArgument("layout", "a kvlab.prefix.host_tier.KVLayout or None",
                                  f"got {type(layout).__name__}")
        self.layout = layout
        self.kv = None
        if layout is not None:
            self.kv = torch.zeros((self.num_pages, *layout.page_shape(page_size)), dtype=layout.dtype,
                                  pin_memory=bool(pin))
        self._free: list[int] = list(range(self.num_pages))     # sorted: runs are easy to find
        self._readers: dict[int, list] = {}
        self._writer: dict[int, object] = {}

    # --- free pages -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        return 0 if self.layout is None else self.layout.page_bytes(self.page_size)

    def free_pages(self) -> list[int]:
        return list(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free pages: the first run of ``n`` neighbours if there is one, else the lowest
        free pages (:class:`~kvlab.OutOfPages` when fewer than ``n`` are free)."""
        n = check_int("n", n, minimum=0)
        if n > len(self._free):
            raise OutOfPages(n, len(self._free), "host pages")
        free, start = self._free, self._first_run(n)
        if start is None:
            pages, self._free = free[:n], free[n:]
        else:
            pages, self._free = free[start:start + n], free[:start] + free[start + n:]
        return pages

    def _first_run(self, n: int) -> int | None:
        """Where the first run of ``n`` neighbouring free pages starts in the free list."""
        free, run = self._free, 0
        for i in range(len(free)):
            if i and free[i] != free[i - 1] + 1:
                run = i
            if i - run + 1 == n:
                return run
        return None

    def give_back(self, pages: Sequence[int]) -> None:
        """Free ``pages``. Refused (:class:`~kvlab.CacheMisuse`, nothing changed) for a page a
        load-back still reads, and :class:`~kvlab.InvalidArgument` for a page that is not in use."""
        pages = [check_int(f"pages[{i}]", p, minimum=0) for i, p in enumerate(pages)]
        bad = [p for p in pages if p >= self.num_pages or self._is_free(p)]
        if bad or len(set(pages)) != len(pages):
            raise InvalidArgument("pages", "host pages in use, each once", f"got {pages}")
        read = [p for p in pages if self.pinned(p)]
        if read:
            raise CacheMisuse(f"host page(s) {read} are read by a load-back still in flight: freeing "
                              "them now would let the next copy overwrite what it reads")
        self.wait_written(pages)              # (a copy still filling a page lands first)
        for p in pages:
            bisect.insort(self._free, p)

    def _is_free(self, page: int) -> bool:
        i = bisect.bisect_left(self._free, page)
        return i < len(self._free) and self._free[i] == page

    # --- copies in flight -------------------------------------------------------------------

    def pin(self, pages: Sequence[int], pending=DONE) -> None:
        """``pages`` are read by a copy that finishes with ``pending``: keep them until then."""
        for p in pages:
            self._readers.setdefault(p, []).append(pending)

    def pinned(self, page: int) -> bool:
        """Whether a copy still reads ``page`` (finished readers are forgotten on the way)."""
        readers = self._readers.get(page)
        if not readers:
            return False
        readers[:] = [r for r in readers if not r.done()]
        if not readers:
            del self._readers[page]
        return bool(readers)

    def mark_written(self, pages: Sequence[int], pending=DONE) -> None:
        """``pages`` are being filled by a copy that finishes with ``pending``."""
        for p in pages:
            self._writer[p] = pending

    def wait_written(self, pages: Sequence[int]) -> None:
        """Wait until what fills ``pages`` has landed (a no-op for pages already there)."""
        for p in pages:
            pending = self._writer.pop(p, None)
            if pending is not None:
                pending.wait()

    def check_integrity(self, used: Sequence[int]) -> None:
        """Every page is free or in ``used`` (the cache's), exactly once."""
        from ..base.errors import IntegrityError

        seen = sorted(list(used) + self._free)
        if seen != list(range(self.num_pages)):
            dupes = sorted({p for p in seen if seen.count(p) > 1})
            lost = sorted(set(range(self.num_pages)) - set(seen))
            raise IntegrityError(f"host pages: held twice {dupes[:8]}, lost {lost[:8]}")
