"""Plain-Python oracle for the hash-chained prefix cache (chapter 11).

No hashes at all: a cached page is known by the tuple of **every token from the start of the
prompt to the end of that page**, which is exactly what a chained hash stands for. Reference
counts are a list, the free queue a list (head first). Slow and obviously right; the tests and
checkers compare :class:`kvlab.prefix.hash_cache.HashPrefixCache` with it.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from ...base.errors import CacheMisuse, OutOfPages


class AllocationRef(NamedTuple):
    pages: tuple[int, ...]
    cached_len: int


class PagePoolRef:
    """``num_pages`` pages of ``page_size``; a page's key is its whole prefix (or ``None``)."""

    def __init__(self, num_pages: int, page_size: int, uncached_first: bool = False):
        self.page_size = page_size
        self.uncached_first = uncached_first
        self.refs = [0] * num_pages
        self.key: list[tuple[int, ...] | None] = [None] * num_pages
        self.page_of: dict[tuple[int, ...], int] = {}
        self.queue = list(range(num_pages))
        self.evicted = 0

    def cached_pages(self) -> set[int]:
        return set(self.page_of.values())

    def match_pages(self, ids: Sequence[int]) -> list[int]:
        """The pages of the longest cached run of whole pages from the start of ``ids``."""
        ids, P, pages = [int(t) for t in ids], self.page_size, []
        while (len(pages) + 1) * P <= len(ids):
            page = self.page_of.get(tuple(ids[:(len(pages) + 1) * P]))
            if page is None:
                break
            pages.append(page)
        return pages

    def _forget(self, page: int) -> None:
        if self.key[page] is not None:
            del self.page_of[self.key[page]]
            self.key[page] = None
            if self.refs[page] == 0:
                self.evicted += 1

    def _cache(self, page: int, key: tuple[int, ...]) -> None:
        owner = self.page_of.get(key)
        if owner is not None and owner != page:
            if self.refs[owner] > 0:
                return  # a page in use keeps the prefix; this one stays uncached
            self._forget(owner)
        self.key[page] = key
        self.page_of[key] = page

    def take_head(self) -> int:
        if not self.queue:
            raise OutOfPages(1, 0, "take_head")
        page = self.queue.pop(0)
        self._forget(page)
        self.refs[page] = 1
        return page

    def allocate(self, ids: Sequence[int]) -> AllocationRef:
        ids, P = [int(t) for t in ids], self.page_size
        hits = self.match_pages(ids)
        n_pages = -(-len(ids) // P)
        needed = n_pages - len(hits) + sum(1 for p in hits if self.refs[p] == 0)
        if needed > len(self.queue):
            raise OutOfPages(needed, len(self.queue), "allocate")
        for page in hits:
            if self.refs[page] == 0:
                self.queue.remove(page)
            self.refs[page] += 1
        pages = list(hits)
        for i in range(len(hits), n_pages):
            page = self.take_head()
            if (i + 1) * P <= len(ids):
                self._cache(page, tuple(ids[:(i + 1) * P]))
            pages.append(page)
        return AllocationRef(tuple(pages), len(hits) * P)

    def free(self, pages: Sequence[int]) -> None:
        for page in set(pages):
            if self.refs[page] < list(pages).count(page):
                raise CacheMisuse(f"page {page} has {self.refs[page]} reference(s) to drop")
        released = []
        for page in reversed(list(pages)):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                released.append(page)
        if self.uncached_first:
            fresh = [p for p in released if self.key[p] is None]
            self.queue = fresh + self.queue + [p for p in released if self.key[p] is not None]
        else:
            self.queue += released

    def append_token(self, pages: Sequence[int], ids: Sequence[int]) -> tuple[int, ...]:
        ids, P, pages = [int(t) for t in ids], self.page_size, list(pages)
        if len(pages) < -(-len(ids) // P):
            pages.append(self.take_head())
        if ids and len(ids) % P == 0 and self.key[pages[-1]] is None:
            self._cache(pages[-1], tuple(ids))
        return tuple(pages)
