"""The pieces of the hash-chained prefix cache (chapter 11): the chained page hash, the free
queue, and the plain-data results of the cache's calls.

:class:`~kvlab.prefix.hash_cache.HashPrefixCache` is the cache that uses them. The design is vLLM's
and nano-vllm's: a full page is known by a hash **chained** from its parent page's hash and
its own token ids, so one hash stands for every token from the start of the prompt to the
end of that page::

    page 0            page 1                 page 2
    [1 2 3 4]         [5 6 7 8]              [9 10 11 12]
    h0 = H(-, p0)     h1 = H(h0, p1)         h2 = H(h1, p2)     H = BLAKE2b-128

Departure: nano-vllm hashes with xxh64 (``xxhash``) and vLLM with SHA-256 over a CBOR
encoding; kvlab uses ``hashlib.blake2b`` (16-byte digests) over the parent's digest and the
token ids as little-endian int64, which needs nothing beyond Python's standard library and
gives the same digest on every machine and in every run (Python's own ``hash()`` is salted
per process, so it could not be compared between runs or shown in a figure).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch

from ..base.args import check_int, check_page_size, check_token_ids, is_int
from ..base.errors import CacheMisuse, InvalidArgument

__all__ = ["PageHash", "chain_hash", "page_hashes", "check_hashable_ids", "check_int64", "short", "FreeQueue",
           "HashCacheHandle", "Allocation", "TakenPage", "PageNode", "HashSnapshot"]

#: A page's chained hash: 16 bytes (vLLM's ``BlockHash`` is ``bytes`` too).
PageHash = bytes
DIGEST_SIZE = 16
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def chain_hash(parent: PageHash | None, page_tokens: Sequence[int]) -> PageHash:
    """The hash of one full page: BLAKE2b over the parent page's hash and this page's tokens.

    ``parent`` is ``None`` for the first page of a prompt (nano-vllm passes ``-1`` there, vLLM
    a seed ``NONE_HASH``). Two pages with the same tokens after different prefixes get
    different hashes, because their parents differ.
    """
    if parent is not None and not isinstance(parent, bytes):
        raise InvalidArgument("parent", "None (a first page) or the parent page's hash (bytes)",
                              f"got {type(parent).__name__}")
    return _chain(parent, check_hashable_ids("page_tokens", page_tokens))


def _chain(parent: PageHash | None, page_tokens: Sequence[int]) -> PageHash:
    """:func:`chain_hash` of ids already checked (the caches' own walks)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    if parent is not None:
        h.update(parent)
    h.update(struct.pack(f"<{len(page_tokens)}q", *page_tokens))
    return h.digest()


def check_hashable_ids(argument: str, token_ids) -> list[int]:
    """Token ids (:func:`kvlab.base.args.check_token_ids`) that are hashed as int64: each in
    ``[-2**63, 2**63)``, else :class:`InvalidArgument` naming the argument and the first one."""
    return check_int64(argument, check_token_ids(argument, token_ids))


def check_int64(argument: str, ids: list[int], start: int = 0) -> list[int]:
    """``ids[start:]`` (ints already) each fit in int64, else :class:`InvalidArgument` naming the
    first one that does not (``argument[i]``). Returns ``ids``."""
    tail = ids[start:] if start > 0 else ids
    if tail and not (INT64_MIN <= min(tail) and max(tail) <= INT64_MAX):
        i = next(i for i, t in enumerate(tail) if not INT64_MIN <= t <= INT64_MAX)
        raise InvalidArgument(f"{argument}[{max(start, 0) + i}]", "token ids fit in int64 (a page is "
                              "hashed as int64 token ids)", f"got {tail[i]}")
    return ids


def page_hashes(input_ids: Sequence[int], page_size: int) -> list[PageHash]:
    """The chained hash of every **full** page of ``input_ids`` (a partial last page has none)."""
    return _page_hashes(check_hashable_ids("input_ids", input_ids), check_page_size(page_size))


def _page_hashes(input_ids: Sequence[int], page_size: int) -> list[PageHash]:
    out: list[PageHash] = []
    parent = None
    for start in range(0, len(input_ids) - page_size + 1, page_size):
        parent = _chain(parent, input_ids[start:start + page_size])
        out.append(parent)
    return out


def short(h: PageHash | None, n: int = 4) -> str:
    """A hash as a few hex digits, for printing and drawing (``-`` for no hash)."""
    return "-" if h is None else h.hex()[: 2 * n]


_HEAD, _TAIL = -1, -2  # the free queue's two ends (page ids are >= 0)


class FreeQueue:
    """The free pages, in the order they are handed out again: the head goes first.

    A doubly linked list, as vLLM's ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``),
    so that a page can leave from the middle in O(1) (a cache hit on a free page); nano-vllm uses
    a ``deque`` and ``remove`` (O(n)). The links are two dicts, page -> neighbour, between a fake
    head and tail. vLLM's ``remove`` clears a block's links; here a page taken out remembers the
    neighbours it left, so that :meth:`restore` can put it back exactly there in O(1) while the
    list around it is as it was (Knuth's "dancing links"): a caller that takes pages out and then
    has to roll back restores them in reverse order, and the queue is as before, order included.

    ``journal``: ``None``, or a list that gets one entry per link or unlink *before* it happens
    (the hash cache's calls set it while they run); :meth:`undo` takes an entry back, so a call
    that fails part-way plays its entries back, last first, and the queue is as it was.
    """

    def __init__(self, pages: Iterable[int] = ()):
        self._next: dict[int, int] = {_HEAD: _TAIL}
        self._prev: dict[int, int] = {_TAIL: _HEAD}
        self._left: dict[int, tuple[int, int]] = {}  # page taken out -> (its prev, its next) then
        self.journal: list | None = None
        for page in pages:
            self.append(page)

    def __len__(self) -> int:
        return len(self._next) - 1

    def __contains__(self, page: int) -> bool:
        try:
            return page in self._next and page != _HEAD
        except TypeError:  # an unhashable "page" is in no queue
            return False

    def __iter__(self) -> Iterator[int]:
        page = self._next[_HEAD]
        while page != _TAIL:
            yield page
            page = self._next[page]

    def __repr__(self) -> str:
        return f"FreeQueue({list(self)})"

    def _link(self, page: int, prev: int, nxt: int) -> None:
        page = check_int("page", page, minimum=0)
        if page in self:
            raise CacheMisuse(f"page {page} is already in the free queue")
        if self.journal is not None:  # noted first: undo finds the queue before or after this
            self.journal.append((True, page, prev, nxt, self._left.get(page)))
        self._next[prev], self._prev[page], self._next[page], self._prev[nxt] = page, prev, nxt, page
        self._left.pop(page, None)

    def _unlink(self, page: int) -> None:
        if not is_int(page) or page not in self:
            raise CacheMisuse(f"page {page!r} is not in the free queue")
        prev, nxt = self._prev[page], self._next[page]
        if self.journal is not None:
            self.journal.append((False, page, prev, nxt, self._left.get(page)))
        self._next[prev], self._prev[nxt], self._left[page] = nxt, prev, (prev, nxt)
        del self._prev[page], self._next[page]

    def undo(self, entry: tuple) -> None:
        """Take back one :attr:`journal` entry, the latest not taken back yet, whether or not its
        link or unlink ran (a call may stop just after noting it): the three pages it touched get
        their links of before, and the page what it remembered."""
        linked, page, prev, nxt, left = entry
        if linked:
            self._next[prev], self._prev[nxt] = nxt, prev
            self._next.pop(page, None)
            self._prev.pop(page, None)
        else:
            self._next[prev], self._prev[page], self._next[page], self._prev[nxt] = page, prev, nxt, page
        if left is None:
            self._left.pop(page, None)
        else:
            self._left[page] = left

    def append(self, page: int) -> None:
        """Put ``page`` at the tail: it is handed out after every page already queued."""
        self._link(page, self._prev[_TAIL], _TAIL)

    def appendleft(self, page: int) -> None:
        """Put ``page`` at the head: it is handed out next."""
        self._link(page, _HEAD, self._next[_HEAD])

    def remove(self, page: int) -> None:
        """Take ``page`` out of the queue wherever it is (a cache hit on a free page)."""
        self._unlink(page)

    def popleft(self) -> int:
        """Take the head page."""
        if not self:
            raise CacheMisuse("the free queue is empty")
        page = self._next[_HEAD]
        self._unlink(page)
        return page

    def can_restore(self, page: int) -> bool:
        """Whether :meth:`restore` can put ``page`` back: it was taken out, and the two pages it
        left between are neighbours again."""
        prev, nxt = self._left.get(page, (None, None)) if is_int(page) else (None, None)
        return page not in self and prev is not None and self._next.get(prev) == nxt

    def restore(self, page: int) -> None:
        """Put ``page`` back exactly where it was taken out from (a caller's rollback; undo several
        removals last first). Refuses (:class:`CacheMisuse`, nothing changed) when the queue around
        that place changed since."""
        if not self.can_restore(page):
            raise CacheMisuse(f"page {page!r} cannot go back into the free queue where it was taken "
                              "from (the queue changed since)")
        self._link(page, *self._left[page])

    def head(self, n: int) -> list[int]:
        """The first ``n`` pages, without taking them."""
        n = check_int("n", n, minimum=0)
        out, page = [], self._next[_HEAD]
        while len(out) < n and page != _TAIL:
            out.append(page)
            page = self._next[page]
        return out


@dataclass(frozen=True)
class HashCacheHandle:
    """A matched or inserted prefix of the hash cache: ``cached_len`` tokens on ``pages``,
    page ``i`` known by ``hashes[i]``. It stays valid while every page still carries its hash
    (a page reused for other tokens loses it); lock it to keep it so. Two handles are equal when
    they cover the same pages of the same cache: then a lock on one is a lock on the other."""

    cached_len: int
    pages: tuple[int, ...]
    hashes: tuple[PageHash, ...]
    cache: object = field(repr=False)

    def __repr__(self) -> str:
        return (f"HashCacheHandle(cached_len={self.cached_len}, pages={list(self.pages)}, "
                f"hashes=[{', '.join(short(h) for h in self.hashes)}])")

    def get_matched_indices(self) -> torch.Tensor:
        """The KV slots of the prefix, first page first (a 1-D int32 tensor of ``cached_len`` slots)."""
        cache = self.cache
        if not cache.holds(self):
            raise CacheMisuse("get_matched_indices: a page of the handle's prefix was reused for "
                              "other tokens; lock a handle to keep its prefix in the cache")
        P = cache.page_size
        starts = torch.tensor(self.pages, dtype=torch.int32).unsqueeze(1) * P
        slots = (starts + torch.arange(P, dtype=torch.int32)).flatten()
        return slots.to(cache.device)


class Allocation(NamedTuple):
    """What :meth:`HashPrefixCache.allocate <kvlab.prefix.hash_cache.HashPrefixCache.allocate>` gave a
    sequence: one page per (full or partial) page of its tokens, the first ``cached_len //
    page_size`` of them cache hits."""

    pages: tuple[int, ...]
    cached_len: int


class TakenPage(NamedTuple):
    """A page taken from the head of the free queue, with what it held before (for an undo).
    ``value``: its token slots (the radix cache's evicted nodes have the same field)."""

    page: int
    hash: PageHash | None
    parent: PageHash | None
    tokens: tuple[int, ...] | None
    value: torch.Tensor

    @property
    def length(self) -> int:
        return self.value.numel()


class PageNode(NamedTuple):
    """A page in the cache's keeping (free, or cached), as the cache manager's checks list it."""

    uid: int  # the page id
    value: torch.Tensor  # its token slots
    ref_count: int


class HashSnapshot(NamedTuple):
    """The hash cache as plain data (:meth:`HashPrefixCache.snapshot
    <kvlab.prefix.hash_cache.HashPrefixCache.snapshot>`), for drawing and comparing.

    ``nodes`` has one :class:`~kvlab.prefix.radix_node.NodeInfo` per cached page (parent: the page
    that holds the parent hash, when that one is cached too), so the drawings of the radix
    tree can show the same pages as a tree of one-page nodes.
    """

    page_size: int
    nodes: tuple  # of kvlab.prefix.radix_node.NodeInfo, parents before children
    hashes: tuple[tuple[int, PageHash], ...]  # (page, hash) of every cached page
    free_queue: tuple[int, ...]  # head first
    ref_counts: tuple[int, ...]  # per page
    evictable_size: int
    protected_size: int
