"""The prefix caches the simulator runs on, counting what they do (chapters 07 and 11).

``SimConfig(prefix_cache=...)`` picks one; each is the real cache with two things added: the
tokens eviction took from it, and the host time of every ``match_prefix`` and
``insert_prefix`` (``time.perf_counter_ns`` around the call; the median is reported, as a
shared machine adds outliers; the numbers include Python's call overhead and say nothing
about a GPU)::

    "radix"                 chapter 05's tree (mini-sglang): free pages first, then whole
                            least-recently-used leaves
    "hash"                  chapter 11's hash cache, one free queue in release order
                            (nano-vllm's BlockManager)
    "hash_uncached_first"   the same, pages without a hash queued at the head
                            (vLLM's BlockPool.free_blocks)
"""
from __future__ import annotations

import statistics
import time
from typing import NamedTuple

from ...base.errors import InvalidArgument
from ...prefix.hash_cache import HashPrefixCache
from ...prefix.radix_cache import RadixNode, RadixPrefixCache

__all__ = ["PREFIX_CACHES", "CacheOpStats", "counting_cache", "free_page_ids"]

PREFIX_CACHES = ("radix", "hash", "hash_uncached_first")


class CacheOpStats(NamedTuple):
    """How often the cache was asked, and the median host time of one call, in microseconds."""

    matches: int
    match_us: float
    inserts: int
    insert_us: float
    asked_tokens: int = 0  # tokens the manager asked eviction for (it may take more: whole leaves)


def _median_us(ns: list[int]) -> float:
    return statistics.median(ns) / 1e3 if ns else 0.0


class _Timed:
    """Keeps the host nanoseconds of every ``match_prefix`` / ``insert_prefix`` call."""

    def _init_counts(self) -> None:
        self._ns: dict[str, list[int]] = {"match": [], "insert": []}
        self.asked_tokens = 0

    def evict_leaves(self, num_tokens: int, into: list | None = None):
        self.asked_tokens += num_tokens
        return super().evict_leaves(num_tokens, into)

    def _timed(self, what: str, call, *args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            self._ns[what].append(time.perf_counter_ns() - start)

    def match_prefix(self, input_ids):
        return self._timed("match", super().match_prefix, input_ids)

    def insert_prefix(self, input_ids, indices, **kwargs):
        return self._timed("insert", super().insert_prefix, input_ids, indices, **kwargs)

    def op_stats(self) -> CacheOpStats:
        m, i = self._ns["match"], self._ns["insert"]
        return CacheOpStats(len(m), _median_us(m), len(i), _median_us(i), self.asked_tokens)


class CountingRadixCache(_Timed, RadixPrefixCache):
    """The radix cache, counting the tokens its evictions free."""

    def __init__(self, page_size: int, device=None):
        self._init_counts()
        self.evicted_tokens = 0
        super().__init__(page_size, device)

    def evict_leaves(self, num_tokens: int, into: list | None = None) -> list[RadixNode]:
        start = len(into) if into is not None else 0  # (into may hold earlier nodes)
        evicted = super().evict_leaves(num_tokens, into)
        self.evicted_tokens += sum(node.length for node in evicted[start:])
        return evicted


class CountingHashCache(_Timed, HashPrefixCache):
    """The hash cache; ``evicted_tokens``: its cached pages handed out for other tokens."""

    def __init__(self, num_pages: int, page_size: int, device=None, *, uncached_first: bool = False):
        self._init_counts()
        super().__init__(num_pages, page_size, device, uncached_first=uncached_first)

    @property
    def evicted_tokens(self) -> int:
        return self.evicted_pages * self.page_size


def counting_cache(kind: str, page_size: int, num_pages: int, device=None):
    """A counting cache of ``kind`` (one of :data:`PREFIX_CACHES`)."""
    if kind == "radix":
        return CountingRadixCache(page_size, device)
    if kind in ("hash", "hash_uncached_first"):
        return CountingHashCache(num_pages, page_size, device, uncached_first=kind != "hash")
    raise InvalidArgument("config.prefix_cache", f"one of {PREFIX_CACHES}", f"got {kind!r}")


def free_page_ids(manager, *, cached_too: bool = False) -> tuple[int, ...]:
    """The manager's free pages in hand-out order: its free list, then (for a cache that keeps
    the free pages) the cache's free queue, without the cached ones unless ``cached_too``."""
    P = manager.page_size
    pages = [int(s) // P for s in manager.free_slots.tolist()]
    cache = manager.prefix_cache
    if getattr(cache, "keeps_free_pages", False):
        pages += [p for p in cache.free_queue if cached_too or cache.page_hash[p] is None]
    return tuple(pages)
