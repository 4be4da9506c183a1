"""How the hash-chained prefix cache's calls happen whole or not at all, and the words with which
a caller takes back one of its steps (chapter 11).

:class:`~kvlab.prefix.hash_cache.HashPrefixCache` inherits these, so that its own module reads like the
algorithm.

**Whole or not at all.** Every call that changes the cache (its public words, the building blocks
included) runs under :func:`whole`. While it runs, each write first notes what it overwrites: a
page's reference count, hash, parent hash and tokens (``_note_page``), an entry of
``hash_to_page`` (``_note_hash``) or of the locks (``_note_lock``), each link and unlink of the
free queue (in the queue's ``journal``); the eviction count and the last insert's record are kept
when the call starts. If the call fails or is interrupted anywhere (a ``KeyboardInterrupt``, a
learner pressing stop, between any two lines), the notes are played back and the error
propagates: the cache is as it was, free queue order included. A note comes before its write,
so a write that never happened is "restored" to the value it still holds::

    allocate ─► note page 7 (ref 0, hash h7) ─► unlink 7 from the queue ─► ref_count[7] = 1 ─► ✗
             ◄─ page 7: ref 0, hash h7 ◄─ queue: 7 back between its old neighbours ◄─ play back

A call made from inside another (``allocate`` takes its hits with ``_take_cached``; ``evict``
calls ``evict_leaves``) belongs to the outer one.

**A caller's rollback.** The cache manager's calls span several calls of the cache; when one of
its steps fails, it takes back the cache's earlier ones with ``undo_evict``, ``undo_lock``,
``undo_free`` and ``undo_insert``. Each reads what happened from the cache itself (so it also
works when a step ran but its caller never heard back) and puts each page back in its place in
the free queue, not just back.
"""
from __future__ import annotations

import functools
from typing import Hashable, Sequence

from ..base.args import check_slots
from ..base.errors import CacheMisuse, InvalidArgument
from .hash_cache_views import HashCacheViews
from .hash_chain import PageHash, TakenPage

__all__ = ["HashCacheUndo", "whole"]

_ABSENT = object()  # a note that a dict had no such key


class _Notes:
    """What one call of the cache overwrote: the first value of everything it wrote."""

    __slots__ = ("pages", "hashes", "locks", "queue", "evicted", "displaced")

    def __init__(self, evicted: int, displaced: dict[int, int]):
        self.pages: dict[int, tuple] = {}  # page -> (ref_count, hash, parent, tokens)
        self.hashes: dict[PageHash, object] = {}  # hash -> its page in hash_to_page, or _ABSENT
        self.locks: dict[tuple, object] = {}  # (owner, pages) -> its count, or _ABSENT
        self.queue: list[tuple] = []  # the free queue's journal: every link and unlink, in order
        self.evicted, self.displaced = evicted, displaced


def whole(method):
    """Run a method of the cache whole or not at all (see the module docstring)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._notes is not None:  # called by another call of this cache: part of that one
            return method(self, *args, **kwargs)
        notes = _Notes(self.evicted_pages, dict(self._displaced))
        try:
            self._notes, self.free_queue.journal = notes, notes.queue
            result = method(self, *args, **kwargs)
            self._notes = self.free_queue.journal = None
            return result  # (inside the try: an interrupt on any line before here is played back)
        except BaseException:
            self._notes = self.free_queue.journal = None
            self._play_back(notes)
            raise

    return call


class HashCacheUndo(HashCacheViews):
    """The notes and the writes of :class:`~kvlab.prefix.hash_cache.HashPrefixCache`, the play-back of a
    call that failed, and a caller's undo words."""

    _notes: _Notes | None
    _displaced: dict[int, int]
    evicted_pages: int

    # --- the writes: each notes what it overwrites first ----------------------------------------

    def _note_page(self, page: int) -> None:
        notes = self._notes
        if notes is not None and page not in notes.pages:
            notes.pages[page] = (self.ref_count[page], self.page_hash[page], self.page_parent[page],
                                 self.page_tokens[page])

    def _note_hash(self, h: PageHash) -> None:
        notes = self._notes
        if notes is not None and h not in notes.hashes:
            notes.hashes[h] = self.hash_to_page.get(h, _ABSENT)

    def _set_ref(self, page: int, count: int) -> None:
        self._note_page(page)
        self.ref_count[page] = count

    def _set_hash(self, page: int, h: PageHash, parent: PageHash | None, tokens: tuple[int, ...]) -> None:
        """``page`` carries ``h`` (chained from ``parent`` over ``tokens``), and ``h`` finds it."""
        self._note_page(page)
        self._note_hash(h)
        self.page_hash[page], self.page_parent[page], self.page_tokens[page] = h, parent, tokens
        self.hash_to_page[h] = page

    def _forget(self, page: int) -> None:
        """``page`` loses its hash; a free page that does is handed out for other tokens: an
        eviction, counted."""
        h = self.page_hash[page]
        if h is None:
            return
        self._note_page(page)
        self._note_hash(h)
        if self.hash_to_page.get(h) == page:
            del self.hash_to_page[h]
        self.page_hash[page] = self.page_parent[page] = self.page_tokens[page] = None
        if self.ref_count[page] == 0:
            self.evicted_pages += 1

    def _set_lock(self, key: tuple[Hashable, tuple[int, ...]], count: int) -> None:
        notes = self._notes
        if notes is not None and key not in notes.locks:
            notes.locks[key] = self._locks.get(key, _ABSENT)
        if count:
            self._locks[key] = count
        else:
            self._locks.pop(key, None)

    def _play_back(self, notes: _Notes) -> None:
        """Put back everything a failed call wrote: the free queue's links last first, then every
        page, hash and lock as the call found it."""
        for entry in reversed(notes.queue):
            self.free_queue.undo(entry)
        for page, (ref, h, parent, tokens) in notes.pages.items():
            self.ref_count[page], self.page_hash[page] = ref, h
            self.page_parent[page], self.page_tokens[page] = parent, tokens
        for table, noted in ((self.hash_to_page, notes.hashes), (self._locks, notes.locks)):
            for key, value in noted.items():
                if value is _ABSENT:
                    table.pop(key, None)
                else:
                    table[key] = value
        self.evicted_pages, self._displaced = notes.evicted, notes.displaced

    # --- a caller's rollback: each undo_* takes back one step, last step first -------------
    #
    # Each reads what happened from the cache itself, so that it also works when the step was
    # stopped part-way or its caller never heard back; each is valid only while nothing else
    # changed the cache since. Together they leave the cache as it was, free queue order included.

    @whole
    def undo_evict(self, taken: Sequence[TakenPage]) -> None:
        """Put the pages of an :meth:`evict_leaves` call back at the head of the free queue, in
        their order, with their hashes. A page recorded but not taken (the eviction was stopped
        part-way, or taken back whole) stays where it is. Refuses (:class:`CacheMisuse`, nothing
        changed) when a page was taken by someone else."""
        if not isinstance(taken, (list, tuple)) or not all(
                isinstance(t, TakenPage) and self._is_page(t.page) for t in taken):
            raise InvalidArgument("taken", "the list evict_leaves returned (TakenPage records of "
                                  "this cache's pages)", f"got {type(taken).__name__}")
        back = [t for t in taken if t.page not in self.free_queue]
        for t in back:
            if self.ref_count[t.page] > 1 or self.page_hash[t.page] not in (None, t.hash) or (
                    t.hash is not None and self.hash_to_page.get(t.hash, t.page) != t.page):
                raise CacheMisuse(f"undo_evict: page {t.page} cannot go back (the cache changed)")
        for t in reversed(back):
            if t.hash is not None:
                if self.page_hash[t.page] is None:
                    self.evicted_pages -= 1  # (taking it counted it when the hash went)
                self._set_hash(t.page, t.hash, t.parent, t.tokens)
            self._set_ref(t.page, 0)
            self.free_queue.appendleft(t.page)

    @whole
    def undo_lock(self, handle, owner=None) -> None:
        """Take back the latest lock ``owner`` took on ``handle``: as an unlock, except that each
        page the lock took out of the free queue goes back to its place there (not to the tail,
        where an unlock queues it), so the queue is as the lock found it."""
        held = self.locks_held(handle, owner)
        if held == 0:
            raise CacheMisuse(f"undo_lock: the handle (pages {list(getattr(handle, 'pages', ()))}) "
                              f"is not locked by {owner!r}"[:160])
        self._set_lock((owner, handle.pages), held - 1)
        for page in reversed(handle.pages):  # the lock took them first to last
            self._set_ref(page, self.ref_count[page] - 1)
            if self.ref_count[page] == 0:
                self.free_queue.restore(page)

    @whole
    def undo_free(self, pages: Sequence[int]) -> None:
        """Take back those of ``pages`` that a :meth:`free` left in the free queue without a hash:
        each is held once again, as before the free (the caller held it alone). Pages held, or
        with a hash, stay as they are."""
        for page in self._page_ids("pages", pages):
            if page in self.free_queue and self.page_hash[page] is None:
                self.free_queue.remove(page)
                self._set_ref(page, 1)

    @whole
    def undo_insert(self, slots) -> None:
        """Take back what an :meth:`insert_prefix` call cached on the caller's ``slots`` (those it
        passed that it held alone, without a hash): each of their pages that carries a hash now
        loses it (no eviction: nothing was handed out) and is the caller's again, held once, out
        of the free queue; a free page whose stale hash the insert took gets it back."""
        starts = check_slots("slots", slots)[:: self.page_size].tolist()
        pages = self._page_ids("slots", [s // self.page_size for s in starts])
        for page in reversed(pages):
            h, parent, tokens = self.page_hash[page], self.page_parent[page], self.page_tokens[page]
            if h is None:
                continue
            if page in self.free_queue:
                self.free_queue.remove(page)
            self._set_ref(page, 1)
            self._forget(page)  # (held: not counted as an eviction)
            displaced = self._displaced.pop(page, None)
            if displaced is not None and self.ref_count[displaced] == 0 and self.page_hash[displaced] is None:
                self._set_hash(displaced, h, parent, tokens)  # it held them before the insert
                self.evicted_pages -= 1  # (the insert counted it when it took the hash)
