"""The hash-chained prefix cache read, never changed (chapter 11): its pages as the cache
manager's checks list them, its sizes, who holds which lock, the checks of page-id arguments, the
cache as plain data for drawings, and the proof of its invariants.

:class:`~kvlab.prefix.hash_cache.HashPrefixCache` inherits these, so that its own module holds the
algorithm: the building blocks, the block manager's words, the radix cache's words and the undo
of each step.
"""
from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

import torch

from ..base.args import check_int, check_int_vector, is_int
from ..base.errors import IntegrityError, InvalidArgument
from .hash_chain import FreeQueue, HashCacheHandle, HashSnapshot, PageHash, PageNode, chain_hash, short
from .radix_node import NodeInfo, SizeInfo

__all__ = ["HashCacheViews"]


class HashCacheViews:
    """Views and checks of :class:`~kvlab.prefix.hash_cache.HashPrefixCache`."""

    num_pages: int
    page_size: int
    device: torch.device
    ref_count: list[int]
    page_hash: list[PageHash | None]
    page_parent: list[PageHash | None]
    page_tokens: list[tuple[int, ...] | None]
    hash_to_page: dict[PageHash, int]
    free_queue: FreeQueue
    _locks: dict[tuple[Hashable, tuple[int, ...]], int]

    # --- page-id arguments --------------------------------------------------------------

    def _is_page(self, page) -> bool:
        return is_int(page) and 0 <= page < self.num_pages

    def _page(self, argument: str, page) -> int:
        """A page id: an int in ``[0, num_pages)``, else :class:`InvalidArgument` naming ``argument``."""
        page = check_int(argument, page)
        if not 0 <= page < self.num_pages:
            raise InvalidArgument(argument, f"a page id in [0, {self.num_pages})", f"got {page}")
        return page

    def _page_ids(self, argument: str, pages) -> list[int]:
        """Page ids: a list or tuple of ints (or a 1-D integer tensor), each in ``[0, num_pages)``."""
        if isinstance(pages, torch.Tensor):
            pages = check_int_vector(argument, pages).tolist()
        elif isinstance(pages, (str, bytes)) or not isinstance(pages, (list, tuple)):
            raise InvalidArgument(argument, "a list or tuple of page ids (ints)", f"got {type(pages).__name__}")
        if list(map(type, pages)).count(int) != len(pages):
            pages = [check_int(f"{argument}[{i}]", p) for i, p in enumerate(pages)]
        if pages and not (0 <= min(pages) and max(pages) < self.num_pages):
            i = next(i for i, p in enumerate(pages) if not 0 <= p < self.num_pages)
            raise InvalidArgument(f"{argument}[{i}]", f"a page id in [0, {self.num_pages})", f"got {pages[i]}")
        return list(pages)

    # --- locks ------------------------------------------------------------------------------

    def holds(self, handle) -> bool:
        """Whether every page of ``handle`` still carries its hash in this cache."""
        if not isinstance(handle, HashCacheHandle) or handle.cache is not self or len(handle.pages) != len(handle.hashes):
            return False
        n, page_hash = self.num_pages, self.page_hash
        try:
            return all(0 <= p < n and page_hash[p] == h for p, h in zip(handle.pages, handle.hashes))
        except TypeError:  # (a handle built by hand, with something else than page ids)
            return False

    def is_locked_by(self, handle, owner=None) -> bool:
        """Whether ``owner`` holds a lock on ``handle`` (the empty handle: always)."""
        if not self.holds(handle):
            return False
        return not handle.pages or self.locks_held(handle, owner) > 0

    def locks_held(self, handle, owner=None) -> int:
        """How many locks ``owner`` holds on ``handle`` (the empty handle, which locks nothing: 0)."""
        if not isinstance(handle, HashCacheHandle) or handle.cache is not self or not handle.pages:
            return 0
        try:
            return self._locks.get((owner, handle.pages), 0)
        except TypeError:  # an unhashable owner holds nothing
            return 0

    # --- sizes and snapshots ------------------------------------------------------------------

    @property
    def size_info(self) -> SizeInfo:
        """Cached tokens on free pages (evictable) and on referenced pages (protected)."""
        free = sum(1 for p in self.hash_to_page.values() if self.ref_count[p] == 0)
        return SizeInfo(free * self.page_size, (len(self.hash_to_page) - free) * self.page_size)

    @property
    def num_free_uncached(self) -> int:
        """Pages in the free queue without a hash (the cache manager counts them as free)."""
        return len(self.free_queue) - self.size_info.evictable_size // self.page_size

    def _slots(self, pages: Sequence[int]) -> torch.Tensor:
        P = self.page_size
        starts = torch.tensor(list(pages), dtype=torch.int32).unsqueeze(1) * P
        return (starts + torch.arange(P, dtype=torch.int32)).flatten().to(self.device)

    def nodes(self) -> list[PageNode]:
        """Every page in the cache's keeping (free, or cached), by page id."""
        pages = [p for p in range(self.num_pages) if self.ref_count[p] == 0 or self.page_hash[p] is not None]
        slots, P = self._slots(pages), self.page_size
        return [PageNode(p, slots[i * P:(i + 1) * P], self.ref_count[p]) for i, p in enumerate(pages)]

    def all_cached_indices(self) -> torch.Tensor:
        """The slots of every cached page."""
        return self._slots(sorted(self.hash_to_page.values()))

    def snapshot(self) -> HashSnapshot:
        """The cache as plain data: cached pages as one-page tree nodes (``last_access``: the
        page's place in the free queue, 1 = next out; 0 while referenced), and the queue."""
        place = {p: i + 1 for i, p in enumerate(self.free_queue)}
        nodes, order = [], {}

        def depth(p):  # parents before children: sort by chain depth
            d, h = 0, self.page_parent[p]
            while h is not None and h in self.hash_to_page and d <= self.num_pages:
                d, h = d + 1, self.page_parent[self.hash_to_page[h]]
            return d

        for p in sorted(self.hash_to_page.values(), key=lambda p: (depth(p), p)):
            parent = self.hash_to_page.get(self.page_parent[p]) if self.page_parent[p] else None
            order[p] = len(order)
            nodes.append(NodeInfo(p, parent if parent in order else None, (self.page_tokens[p],),
                                  (p,), self.ref_count[p], place.get(p, 0)))
        info = self.size_info
        return HashSnapshot(self.page_size, tuple(nodes),
                            tuple(sorted((p, h) for h, p in self.hash_to_page.items())),
                            tuple(self.free_queue), tuple(self.ref_count),
                            info.evictable_size, info.protected_size)

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless every page is free-and-uncached, free-and-cached
        or referenced; ``hash_to_page`` and ``page_hash`` agree; every cached page's hash is
        ``chain_hash(its parent's hash, its tokens)`` (so, page by page from the first, a hash
        stands for every token before it); and locks are held on cached pages only."""
        for p in range(self.num_pages):
            if self.ref_count[p] < 0:
                raise IntegrityError(f"page {p} has ref_count {self.ref_count[p]} (below zero)")
            if (self.ref_count[p] == 0) != (p in self.free_queue):
                raise IntegrityError(f"page {p} has ref_count {self.ref_count[p]} but is "
                                     f"{'' if p in self.free_queue else 'not '}in the free queue")
        if len(self.free_queue) != sum(1 for r in self.ref_count if r == 0):
            raise IntegrityError("the free queue holds a page twice or a page that does not exist")
        for h, p in self.hash_to_page.items():
            if self.page_hash[p] != h:
                raise IntegrityError(f"hash_to_page[{short(h)}] = page {p}, but page {p} carries "
                                     f"hash {short(self.page_hash[p])}")
        for p, h in enumerate(self.page_hash):
            if h is None:
                continue
            if self.hash_to_page.get(h) != p:
                raise IntegrityError(f"page {p} carries hash {short(h)} but hash_to_page sends it to "
                                     f"{self.hash_to_page.get(h)}")
            tokens = self.page_tokens[p]
            if tokens is None or len(tokens) != self.page_size or chain_hash(self.page_parent[p], tokens) != h:
                raise IntegrityError(f"page {p}: hash {short(h)} is not the chained hash of its "
                                     f"parent {short(self.page_parent[p])} and its tokens {tokens}")
        held = Counter()
        for (owner, pages), count in self._locks.items():
            for p in pages:
                if self.page_hash[p] is None:
                    raise IntegrityError(f"a lock of {owner!r} covers page {p}, which is not cached")
                held[p] += count
        for p, count in held.items():
            if self.ref_count[p] < count:
                raise IntegrityError(f"page {p} has ref_count {self.ref_count[p]} but {count} "
                                     "lock(s) are held on it")
