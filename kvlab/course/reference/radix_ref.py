"""Plain-Python oracles for the prefix cache (chapter 05) and ``cache_req`` (chapter 06).

No tree, no tensors: a prefix store is a list of cached token sequences, and a match is the
longest common prefix with any of them, cut down to whole pages. Slow and obviously right.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence


def page_aligned_len(n: int, page_size: int) -> int:
    """The whole pages of ``n`` tokens, in tokens: ``n // P * P`` (``page_aligned_len(10, 4) == 8``)."""
    return n // page_size * page_size


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


class PrefixStoreRef:
    """A page-aligned prefix store as a list of sequences (no eviction)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.sequences: list[tuple[int, ...]] = []

    def match_len(self, ids: Sequence[int]) -> int:
        """Longest cached prefix of ``ids`` in whole pages."""
        ids = [int(t) for t in ids]
        best = max((common_prefix_len(s, ids) for s in self.sequences), default=0)
        return page_aligned_len(best, self.page_size)

    def insert(self, ids: Sequence[int]) -> tuple[int, int]:
        """Cache the whole pages of ``ids``; return ``(already_cached_len, inserted_len)``."""
        ids = [int(t) for t in ids]
        insert_len = page_aligned_len(len(ids), self.page_size)
        already = self.match_len(ids[:insert_len])
        if insert_len:
            self.sequences.append(tuple(ids[:insert_len]))
        return already, insert_len


def match_len_ref(cached: Sequence[Sequence[int]], ids: Sequence[int], page_size: int) -> int:
    """Page-aligned match of ``ids`` against the cached sequences ``cached``."""
    store = PrefixStoreRef(page_size)
    store.sequences = [tuple(int(t) for t in s) for s in cached]
    return store.match_len(ids)


class RegionsRef(NamedTuple):
    """The four regions of ``[0, req_cached_len)`` as ``(start, end)`` pairs, and what is freed."""

    hit: tuple[int, int]
    duplicate: tuple[int, int]
    inserted: tuple[int, int]
    tail: tuple[int, int]
    tail_freed: bool
    freed: tuple[tuple[int, int], ...]  # position ranges whose pages go back to the free list


def cache_req_regions_ref(old_cached_len: int, already_cached_len: int, new_cached_len: int,
                          req_cached_len: int, finished: bool) -> RegionsRef:
    """The source design's region accounting, from the four lengths.

    ``old_cached_len``: the request's cache hit; ``already_cached_len``: what
    ``insert_prefix`` says was cached before it; ``new_cached_len``: the inserted length
    (``req_cached_len`` cut to whole pages); ``req_cached_len``: tokens computed.
    """
    if not 0 <= old_cached_len <= already_cached_len <= new_cached_len <= req_cached_len:
        raise ValueError("lengths must satisfy 0 <= old <= already <= new <= req_cached_len, got "
                         f"{old_cached_len}, {already_cached_len}, {new_cached_len}, {req_cached_len}")
    duplicate = (old_cached_len, already_cached_len)
    tail = (new_cached_len, req_cached_len)
    freed = [r for r in (duplicate, tail if finished else None) if r and r[1] > r[0]]
    return RegionsRef(
        hit=(0, old_cached_len), duplicate=duplicate,
        inserted=(already_cached_len, new_cached_len), tail=tail,
        tail_freed=bool(finished), freed=tuple(freed))
