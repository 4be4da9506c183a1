"""The hash-chained prefix cache: vLLM's and nano-vllm's answer to prefix sharing.

Built in chapter 11 (``notebooks/11_hash_prefix_cache.ipynb``), beside the radix tree of
chapters 05-06. There is no tree. The cache *is* the page pool:

* every full page that holds a prompt's KV is known by a **chained hash**
  (:func:`~kvlab.prefix.hash_chain.chain_hash` of its parent page's hash and its own tokens), and a
  dict ``hash_to_page`` finds it again. A partial last page has no hash and is never shared;
* **reference counts** instead of locks: a page is held by every sequence that maps it;
* a page whose count falls to zero goes to the tail of the **free queue** *with its hash*: it
  stays findable (a later prompt can take it back, a hit) until the queue hands it out for
  other tokens, which drops the hash. Handing out the head of the queue is the eviction: the
  free queue is the LRU order, and a sequence's pages are freed last page first, so the deep
  end of a chain goes before its beginning (vLLM's ``KVCacheManager.free``, nano-vllm's
  ``BlockManager.deallocate``).

Every page is in one of three states, which :meth:`HashPrefixCache.check_integrity` proves::

    free, uncached    in the free queue, no hash          (never used, or a partial page)
    free, cached      in the free queue, with its hash    (a hit takes it back out)
    referenced        ref_count > 0, not in the queue     (hash or not: mapped by a sequence)

Two sets of words. The block manager's (nano-vllm's ``allocate`` / ``deallocate`` /
``may_append``): :meth:`~HashPrefixCache.match`, :meth:`~HashPrefixCache.allocate`,
:meth:`~HashPrefixCache.free`, :meth:`~HashPrefixCache.append_token`, built in the chapter from
the building blocks ``lookup``, ``take_cached``, ``take_free``, ``cache_page``. And the radix
cache's, so that :class:`~kvlab.manager.cache_manager.CacheManager` (and the simulator of chapter 07)
can run on either cache: ``match_prefix``, ``insert_prefix``, ``lock_handle`` (a reference on
every page of a handle, with an owner), ``evict_leaves`` (take pages from the head of the
queue), ``size_info``, and the words with which the manager takes back a call that failed
half-way (``locks_held``, ``undo_evict``, ``undo_lock``, ``undo_insert``, ``undo_free``): the
free queue is an order, so each puts its pages back in their places in it, not just back.
Because this cache keeps the free pages itself (``keeps_free_pages``), the manager leaves its
own free list empty and hands freed pages back through :meth:`free`.

Every call checks all its arguments before its first change (:class:`~kvlab.base.errors.InvalidArgument`
naming the argument), and every call that changes the cache happens whole or not at all, also
when it is interrupted between any two of its lines (:mod:`kvlab.prefix.hash_cache_undo`).

Departures, each said where it happens: BLAKE2b instead of xxh64/SHA-256
(:mod:`kvlab.prefix.hash_chain`); a reused page's hash leaves ``hash_to_page`` at once (nano-vllm at
commit 2f352ae leaves the entry and relies on comparing the page's tokens); one page per hash
(vLLM's ``BlockHashToBlockMap`` may hold duplicates); ``uncached_first=True`` puts freed pages
without a hash at the head of the queue (vLLM's ``BlockPool.free_blocks`` does, nano-vllm does
not).
"""
from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

import torch

from ..base.args import check_bool, check_device, check_empty_list, check_int, check_page_size, check_slots, check_token_ids, check_whole_pages, div_ceil
from ..base.errors import CacheMisuse, InvalidArgument, OutOfPages
from .hash_cache_undo import HashCacheUndo, whole
from .hash_chain import (DIGEST_SIZE, Allocation, FreeQueue, HashCacheHandle, PageHash, TakenPage, _chain,
                         _page_hashes, chain_hash, check_hashable_ids, check_int64, page_hashes, short)
from .radix_node import InsertResult, MatchResult
from ..base.runtime import default_device

__all__ = ["HashPrefixCache", "HashCacheHandle", "Allocation", "chain_hash", "page_hashes"]


#: the most slots a pool may have: its slots are int32, as the page table's
MAX_SLOTS = 1 << 31
#: ``lookup``'s ``parent`` when the caller gives none: the page's parent is not compared
UNCHECKED = type("Unchecked", (), {"__repr__": lambda self: "UNCHECKED"})()


class HashPrefixCache(HashCacheUndo):
    """A pool of ``num_pages`` pages of ``page_size`` slots whose full pages are cached by
    chained hash (chapter 11). See the module docstring for the states and the two sets of words.

    State (read it freely; change it only through the methods): ``ref_count[p]``,
    ``page_hash[p]`` / ``page_parent[p]`` / ``page_tokens[p]`` (``None`` for an uncached page),
    ``hash_to_page`` and ``free_queue`` (a :class:`~kvlab.prefix.hash_chain.FreeQueue`, head first).
    ``evicted_pages`` counts cached pages handed out for other tokens.
    """

    #: the free pages live here, not in a cache manager's free list
    keeps_free_pages = True

    def __init__(self, num_pages: int, page_size: int, device: "torch.device | str | None" = None, *,
                 uncached_first: bool = False):
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        self.page_size = check_page_size(page_size)
        if self.num_pages * self.page_size > MAX_SLOTS:
            raise InvalidArgument("num_pages", "num_pages * page_size slots fit in int32 (at most 2**31)",
                                  f"got {self.num_pages} * {self.page_size}")
        if not isinstance(uncached_first, bool):
            raise InvalidArgument("uncached_first", "must be a bool", f"got {uncached_first!r}")
        self.uncached_first = uncached_first
        self.device = default_device(check_device("device", device))
        self.ref_count = [0] * self.num_pages
        self.page_hash: list[PageHash | None] = [None] * self.num_pages
        self.page_parent: list[PageHash | None] = [None] * self.num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * self.num_pages
        self.hash_to_page: dict[PageHash, int] = {}
        self.free_queue = FreeQueue(range(self.num_pages))  # page ids in order at first
        self._locks: dict[tuple[Hashable, tuple[int, ...]], int] = {}  # (owner, pages) -> count
        self.evicted_pages = 0
        # the latest insert_prefix's record for undo_insert: page it cached -> the free page whose
        # stale hash it took (see cache_page)
        self._displaced: dict[int, int] = {}
        self._notes = None  # what the running call overwrote (kvlab.prefix.hash_cache_undo)

    # --- the building blocks -----------------------------------------------------------

    def lookup(self, h: PageHash, tokens: Sequence[int], parent=UNCHECKED) -> int | None:
        """The page cached under hash ``h`` holding exactly ``tokens``, or ``None``.

        The tokens are compared too (nano-vllm does; vLLM's older ``BlockHash`` carried them),
        and with ``parent`` (the parent page's hash, ``None`` for a first page) the page's parent
        as well, so that not even a hash collision can hand out a page computed after another
        prefix: :meth:`match` and :meth:`allocate` always give it."""
        if not isinstance(h, bytes):
            raise InvalidArgument("h", "a page's hash (bytes, from chain_hash)", f"got {type(h).__name__}")
        if parent is not UNCHECKED and parent is not None and not isinstance(parent, bytes):
            raise InvalidArgument("parent", "None (a first page) or the parent page's hash (bytes)",
                                  f"got {type(parent).__name__}")
        return self._find(h, check_hashable_ids("tokens", tokens), parent)

    def _find(self, h: PageHash, tokens: Sequence[int], parent=UNCHECKED) -> int | None:
        page = self.hash_to_page.get(h)
        if page is None or self.page_tokens[page] != tuple(tokens):
            return None
        if parent is not UNCHECKED and self.page_parent[page] != parent:
            return None  # a collision: the same hash after another prefix
        return page

    @whole
    def take_cached(self, page: int) -> None:
        """One more reference on a cached ``page`` (a hit); a free page leaves the free queue."""
        self._take_cached(self._page("page", page))

    def _take_cached(self, page: int) -> None:
        if self.ref_count[page] == 0:
            self.free_queue.remove(page)
        self._set_ref(page, self.ref_count[page] + 1)

    @whole
    def take_free(self) -> int:
        """Hand out the head of the free queue with one reference; a cached page loses its hash
        there (that is the eviction)."""
        return self._take_free()

    def _take_free(self) -> int:
        if not self.free_queue:
            raise OutOfPages(1, 0, "take_free")
        page = self.free_queue.popleft()
        self._forget(page)
        self._set_ref(page, 1)
        return page

    @whole
    def cache_page(self, page: int, h: PageHash, tokens: Sequence[int], parent: PageHash | None) -> None:
        """Make a full page findable under ``h`` (its chained hash from ``parent`` and ``tokens``).

        A free page that still holds ``h`` (it lost its parent to the queue: no prompt can
        reach it any more) gives it up; a page in use keeps it, and ``page`` stays uncached.
        A building block: it trusts its caller that ``h`` is ``chain_hash(parent, tokens)`` and
        that ``page`` holds their KV (:meth:`check_integrity` proves the first)."""
        page = self._page("page", page)
        if not isinstance(h, bytes) or len(h) != DIGEST_SIZE:
            raise InvalidArgument("h", f"a page's hash ({DIGEST_SIZE} bytes, from chain_hash)", f"got {h!r}"[:80])
        if parent is not None and not isinstance(parent, bytes):
            raise InvalidArgument("parent", "None (a first page) or the parent page's hash (bytes)",
                                  f"got {type(parent).__name__}")
        self._cache_page(page, h, check_hashable_ids("tokens", tokens), parent)

    def _cache_page(self, page: int, h: PageHash, tokens: Sequence[int], parent: PageHash | None) -> None:
        owner = self.hash_to_page.get(h)
        if owner is not None and owner != page:
            if self.ref_count[owner] > 0:
                return
            self._forget(owner)
        self._forget(page)
        self._set_hash(page, h, parent, tuple(tokens))

    # --- the block manager's words (nano-vllm's allocate / deallocate / may_append) ----

    def match(self, input_ids) -> HashCacheHandle:
        """The longest cached chain of full pages from the start of ``input_ids``. Reads only."""
        return self._match(check_hashable_ids("input_ids", input_ids))

    def _match(self, ids: list[int]) -> HashCacheHandle:
        P = self.page_size
        pages, hashes, parent = [], [], None
        for start in range(0, len(ids) - P + 1, P):
            tokens = ids[start:start + P]
            h = _chain(parent, tokens)
            page = self._find(h, tokens, parent)
            if page is None:
                break  # a chain cannot skip a page: every later hash depends on this one
            pages.append(page)
            hashes.append(h)
            parent = h
        return HashCacheHandle(len(pages) * P, tuple(pages), tuple(hashes), self)

    def pages_needed(self, input_ids) -> int:
        """Free-queue pages :meth:`allocate` would take: new pages plus hits that are free now."""
        ids = check_hashable_ids("input_ids", input_ids)
        return self._pages_needed(ids, self._match(ids))

    def _pages_needed(self, ids: list[int], hit: HashCacheHandle) -> int:
        return div_ceil(len(ids), self.page_size) - len(hit.pages) + sum(
            1 for p in hit.pages if self.ref_count[p] == 0)

    @whole
    def allocate(self, input_ids) -> Allocation:
        """Pages for a new sequence of ``input_ids``: its cached chain (hits, one more reference
        each), then pages from the head of the free queue for the rest; every new *full* page
        is cached at once (nano-vllm's ``allocate``). All or nothing: :class:`OutOfPages`
        before any change when the queue is short."""
        ids = check_hashable_ids("input_ids", input_ids)
        hit = self._match(ids)
        needed = self._pages_needed(ids, hit)
        if needed > len(self.free_queue):
            raise OutOfPages(needed, len(self.free_queue), "allocate")
        P = self.page_size
        for page in hit.pages:
            self._take_cached(page)
        pages, parent = list(hit.pages), (hit.hashes[-1] if hit.hashes else None)
        for start in range(hit.cached_len, len(ids), P):
            tokens = ids[start:start + P]
            page = self.take_free()
            if len(tokens) == P:
                h = _chain(parent, tokens)
                self._cache_page(page, h, tokens, parent)
                parent = h
            pages.append(page)
        return Allocation(tuple(pages), hit.cached_len)

    @whole
    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page, **last page first**; a page nobody holds any more
        joins the free queue and keeps its hash. Refuses (:class:`CacheMisuse`, nothing
        changed) to drop a reference a page does not have: a count never goes below zero."""
        pages = self._page_ids("pages", pages)
        self._check_release(pages, "free")
        self._release(pages)

    def _check_release(self, pages: list[int], what: str) -> None:
        for page, times in Counter(pages).items():
            if self.ref_count[page] < times:
                raise CacheMisuse(f"{what}: page {page} has {self.ref_count[page]} reference(s), "
                                  f"{times} would be dropped (freed twice, or never allocated?)")

    def _release(self, pages: list[int]) -> None:
        released = []
        for page in reversed(pages):  # the tail of a chain is evicted before its beginning
            self._set_ref(page, self.ref_count[page] - 1)
            if self.ref_count[page] == 0:
                released.append(page)
        fresh = [p for p in released if self.page_hash[p] is None]
        for page in released:
            if self.page_hash[page] is not None or not self.uncached_first:
                self.free_queue.append(page)
        for page in reversed(fresh if self.uncached_first else []):
            self.free_queue.appendleft(page)  # vLLM: free_block_queue.prepend_n(fresh_blocks)

    @whole
    def append_token(self, pages: Sequence[int], input_ids) -> tuple[int, ...]:
        """After a decode step appended one token (``input_ids`` includes it): a new page when
        the token starts one, and the last page cached when the token fills it (nano-vllm's
        ``may_append``). ``pages``: the sequence's pages (each held by it), before the token or
        after. Returns the sequence's pages."""
        pages, ids = self._validate_append(pages, input_ids)
        P = self.page_size
        if len(pages) < div_ceil(len(ids), P):
            pages.append(self.take_free())
        if len(ids) % P == 0 and self.page_hash[pages[-1]] is None:
            parent = None
            if len(pages) > 1:  # a page that twins one in use carries no hash: chain from the tokens
                parent = self.page_hash[pages[-2]] or _page_hashes(ids[:-P], P)[-1]
            self._cache_page(pages[-1], _chain(parent, ids[-P:]), ids[-P:], parent)
        return tuple(pages)

    def _validate_append(self, pages, input_ids) -> tuple[list[int], list[int]]:
        """Every rule of :meth:`append_token`, checked before anything changes (per token: only
        what this call reads or writes, the sequence's last pages and its last page of tokens)."""
        ids, pages, P = check_token_ids("input_ids", input_ids), self._page_ids("pages", pages), self.page_size
        if not ids:
            raise InvalidArgument("input_ids", "the sequence with its new token (at least one token)", "got []")
        check_int64("input_ids", ids, len(ids) - P)  # (the tokens this call may hash)
        before, after = div_ceil(len(ids) - 1, P), div_ceil(len(ids), P)
        if len(pages) not in (before, after):
            raise InvalidArgument("pages", f"the sequence's pages before the token ({before}) or after "
                                  f"it ({after}) for {len(ids)} tokens", f"got {len(pages)} pages")
        for i in range(max(0, after - 2), len(pages)):  # the pages it caches or chains from
            if self.ref_count[pages[i]] == 0:
                raise InvalidArgument(f"pages[{i}]", "a page the sequence holds (ref_count > 0: "
                                      "from allocate or append_token)", f"page {pages[i]} is free")
        if len(pages) < after and not self.free_queue:
            raise OutOfPages(1, 0, "append_token")
        parent = pages[after - 2] if after > 1 else None  # the page before the one the token fills
        if len(ids) % P == 0 and parent is not None and self.page_tokens[parent] not in (None, tuple(ids[-2 * P:-P])):
            raise InvalidArgument("input_ids", "the tokens the sequence's pages hold",
                                  f"page {parent} holds {list(self.page_tokens[parent])}"[:120])
        if len(ids) % P == 0 and parent is not None and self.page_hash[parent] is None:
            check_int64("input_ids", ids)  # (a twin page: the chain is hashed from the tokens)
        if len(set(pages)) != len(pages):
            raise InvalidArgument("pages", "a sequence's pages are distinct", f"got {pages}"[:120])
        return pages, ids

    # --- the radix cache's words, for CacheManager ----------------------------------------

    def match_prefix(self, input_ids) -> MatchResult:
        """:meth:`match` as the radix cache answers it (a ``MatchResult`` holding the handle)."""
        return MatchResult(self.match(input_ids))

    @whole
    def insert_prefix(self, input_ids, indices, *, check_pages: bool = True) -> InsertResult:
        """Cache the full pages of ``input_ids`` whose KV sits in ``indices`` (one slot per token).

        Returns ``(cached_len, handle)``: how many tokens were cached before (the caller's
        slots there are duplicates it still holds) and a handle for the inserted full pages.
        Every new page must be held by the caller alone (one reference, no hash); that
        reference passes to the cache, so the pages are evictable until someone locks the
        handle (the radix cache's new node is unlocked too). ``check_pages`` is the radix
        cache's word; this cache reads the pages' ids anyway, so it always checks them."""
        check_bool("check_pages", check_pages)
        ids = check_hashable_ids("input_ids", input_ids)
        indices = check_slots("indices", indices)
        if indices.numel() != len(ids):
            raise InvalidArgument("indices", "one slot per token: len(indices) == len(input_ids)",
                                  f"got {indices.numel()} slots for {len(ids)} tokens")
        P = self.page_size
        insert_len = len(ids) // P * P
        hit = self._match(ids[:insert_len])
        new_slots = indices[hit.cached_len:insert_len]
        check_whole_pages("indices", new_slots, P)
        new_pages = [int(s) // P for s in new_slots[::P].tolist()]
        for page in new_pages:
            if not 0 <= page < self.num_pages:
                raise InvalidArgument("indices", f"slots of pages in [0, {self.num_pages})",
                                      f"page {page}")
            if self.ref_count[page] != 1 or self.page_hash[page] is not None or new_pages.count(page) > 1:
                raise InvalidArgument("indices", "a page to insert is held by the caller alone and "
                                      "not cached yet", f"page {page}: ref_count {self.ref_count[page]},"
                                      f" hash {short(self.page_hash[page])}")
        hashes = list(hit.hashes)
        self._displaced = {}
        for i, page in enumerate(new_pages):
            tokens = ids[hit.cached_len + i * P: hit.cached_len + (i + 1) * P]
            parent = hashes[-1] if hashes else None
            h = _chain(parent, tokens)
            owner = self.hash_to_page.get(h)
            if owner is not None and self.ref_count[owner] == 0:
                self._displaced[page] = owner  # recorded first: undo_insert gives its hash back
            self._cache_page(page, h, tokens, parent)
            hashes.append(h)
        self._release(new_pages)  # the caller's reference passes to the cache
        handle = HashCacheHandle(insert_len, hit.pages + tuple(new_pages), tuple(hashes), self)
        return InsertResult(hit.cached_len, handle)

    @whole
    def lock_handle(self, handle: HashCacheHandle, unlock: bool = False, *, owner=None) -> None:
        """Take (or with ``unlock=True`` give back) one reference on every page of ``handle``
        for ``owner``. Only an owner that holds a lock may unlock it (:class:`CacheMisuse`
        otherwise, nothing changed). The empty handle protects nothing."""
        if not isinstance(handle, HashCacheHandle):
            raise InvalidArgument("handle", "must be a HashCacheHandle from this cache",
                                  f"got {type(handle).__name__}")
        if not isinstance(unlock, bool):
            raise InvalidArgument("unlock", "must be a bool", f"got {unlock!r}")
        if not self.holds(handle):
            raise CacheMisuse("lock_handle: a page of the handle's prefix was reused for other "
                              "tokens (or the handle belongs to another cache); lock a handle right "
                              "after match_prefix/insert_prefix")
        try:
            key = (owner, handle.pages)
            held = self._locks.get(key, 0)
        except TypeError:
            raise InvalidArgument("owner", "must be hashable (a Req, a string, an int, None)",
                                  f"got {type(owner).__name__}") from None
        if not handle.pages:
            return
        if unlock:
            if held == 0:
                raise CacheMisuse(f"lock_handle(unlock=True): the handle (pages {list(handle.pages)}) "
                                  f"is not locked by {owner!r}"[:160] + ". Only the owner that locked "
                                  "a handle may unlock it, once per lock")
            self._check_release(list(handle.pages), "lock_handle(unlock=True)")
            self._set_lock(key, held - 1)
            self._release(list(handle.pages))
        else:
            self._set_lock(key, held + 1)
            for page in handle.pages:
                self._take_cached(page)

    @whole
    def evict_leaves(self, num_tokens: int, into: list | None = None) -> list[TakenPage]:
        """Take ``div_ceil(num_tokens, P)`` pages (or all there are) from the head of the free
        queue, one reference each, cached ones losing their hash; return them in order (each with
        what it held, and its slots in ``value``) so that :meth:`undo_evict` can put them back.
        The cache manager's word for "pages, please". ``into``: the caller's list, which gets each
        page before it is taken (and is returned); a call that fails is taken back whole, its
        pages in the queue again, where :meth:`undo_evict` leaves them."""
        check_empty_list("into", into)
        n = min(div_ceil(check_int("num_tokens", num_tokens, minimum=0), self.page_size),
                len(self.free_queue))
        taken: list[TakenPage] = [] if into is None else into
        for page in self.free_queue.head(n):
            taken.append(TakenPage(page, self.page_hash[page], self.page_parent[page],
                                   self.page_tokens[page], self._slots([page])))
            self.take_free()  # (the building block: a notebook may watch it)
        return taken

    @whole
    def evict(self, num_tokens: int) -> torch.Tensor:
        """:meth:`evict_leaves`, returning the token slots of the pages taken."""
        taken = self.evict_leaves(num_tokens)
        return torch.cat([t.value for t in taken]) if taken else self._slots([])
