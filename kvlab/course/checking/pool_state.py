"""A hash-chained prefix cache as plain data, and the first way two of them differ, in words.

The exercises of chapter 11 hand the learner a real :class:`~kvlab.prefix.hash_cache.HashPrefixCache`.
A match must leave it exactly as it was (:mod:`kvlab.course.checking.inputs` compares it as a read-only
argument); an allocation or a free must leave it exactly as the reference leaves it. Both compare
everything the cache keeps::

    per page     ref_count, page_hash, page_parent, page_tokens
    the cache    hash_to_page, the free queue in order (head first), evicted_pages, the locks

and say the first difference the way the learner reads the cache: "page 3: its reference count
ref_count was 0, now 1", "the free queue (head first) was [4, 2, 7], now [2, 7, 4]".
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ...prefix.hash_cache import HashPrefixCache
from ...prefix.hash_chain import short


class PageState(NamedTuple):
    """One page of the pool."""

    ref_count: int
    page_hash: bytes | None
    page_parent: bytes | None
    page_tokens: tuple[int, ...] | None


class PoolState(NamedTuple):
    """The whole cache: what a read-only call must leave as it was, and a write as the
    reference leaves it."""

    page_size: int
    pages: tuple[PageState, ...]
    hash_to_page: tuple  # sorted (hash, page) pairs
    free_queue: tuple[int, ...]  # head first
    evicted_pages: int
    locks: tuple  # sorted (owner, pages, count)


def pool_state(cache: HashPrefixCache) -> PoolState:
    """A copy of everything ``cache`` keeps, as plain data."""
    tokens = [None if t is None else tuple(t) for t in cache.page_tokens]
    pages = tuple(PageState(*page) for page in zip(cache.ref_count, cache.page_hash,
                                                  cache.page_parent, tokens))
    locks = tuple(sorted((repr(owner), tuple(held), count)
                         for (owner, held), count in getattr(cache, "_locks", {}).items()))
    return PoolState(cache.page_size, pages, tuple(sorted(cache.hash_to_page.items(), key=repr)),
                     tuple(cache.free_queue), cache.evicted_pages, locks)


_PAGE_FIELDS = {"ref_count": "its reference count ref_count", "page_hash": "its hash page_hash",
                "page_parent": "its parent's hash page_parent", "page_tokens": "its tokens page_tokens"}


def _shown(field: str, value: Any) -> str:
    if field in ("page_hash", "page_parent"):
        return short(value)
    return "None" if value is None else str(list(value) if field == "page_tokens" else value)


def pool_difference(before: PoolState, after: PoolState, *, old: str = "was",
                    new: str = "now") -> str | None:
    """The first way ``after`` differs from ``before``, in words; None when they are equal.
    ``old``/``new`` word the two sides ("was 2, now 3"; "should be 2, is 3")."""
    if len(before.pages) != len(after.pages):
        return f"the pool {old} {len(before.pages)} pages, {new} {len(after.pages)}"
    for page, (was, cur) in enumerate(zip(before.pages, after.pages)):
        for field, words in _PAGE_FIELDS.items():
            a, b = getattr(was, field), getattr(cur, field)
            if a != b:
                return f"page {page}: {words} {old} {_shown(field, a)}, {new} {_shown(field, b)}"
    was, cur = dict(before.hash_to_page), dict(after.hash_to_page)
    for h in sorted(set(was) | set(cur)):
        if was.get(h) == cur.get(h):
            continue
        if h not in cur:
            return f"hash_to_page {old} sending hash {short(h)} to page {was[h]}; {new} it has no such hash"
        if h not in was:
            return f"hash_to_page {old} without hash {short(h)}; {new} it sends it to page {cur[h]}"
        return f"hash_to_page {old} sending hash {short(h)} to page {was[h]}, {new} to page {cur[h]}"
    if before.free_queue != after.free_queue:
        return (f"the free queue (head first) {old} {list(before.free_queue)}, {new} "
                f"{list(after.free_queue)}")
    if before.evicted_pages != after.evicted_pages:
        return (f"evicted_pages (cached pages handed out for other tokens) {old} "
                f"{before.evicted_pages}, {new} {after.evicted_pages}")
    if before.locks != after.locks:
        return (f"the lock table (owner, pages, count) {old} {list(before.locks)}, {new} "
                f"{list(after.locks)}")
    return None
