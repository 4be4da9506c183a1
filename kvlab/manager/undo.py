"""How the cache manager takes back a call that failed part-way (chapter 06).

:class:`~kvlab.manager.cache_manager.CacheManager` inherits these. A call that fails after its first
change (an error, or a ``KeyboardInterrupt``, a learner pressing stop, between any two of its
lines) puts every change back, last change first, before the error propagates. What to put back
is read from the state itself, not from flags set after each step: a step may have been stopped
just after it ran. Each call keeps, before its first change, what a rollback needs (the records
below: the free list, the part of the page table it writes, the rows' records, the locks held),
so that a caller of several steps (``mixed_step`` admits, then maps; ``complete_step`` caches
one request after another) can also take back steps that ran to the end.

The prefix cache takes back its own steps, with the same words on both caches
(:class:`~kvlab.prefix.radix_cache.RadixPrefixCache`, :class:`~kvlab.prefix.hash_cache.HashPrefixCache`):
``undo_evict`` (``allocate_paged``'s eviction), ``undo_lock``, ``undo_insert``, and on a cache
that keeps the free pages, ``undo_free``. The hash cache's free queue is an order (its LRU
list), so each of them puts its pages back in their places, not just back. Each call of the
cache itself happens whole or not at all (a lock is never half taken).
"""
from __future__ import annotations

from .rules import CacheManagerChecks, _Running
from ..alloc.paging import UNMAPPED
from .req import Req

__all__ = ["CacheManagerUndo"]


class _Allocation:
    """What ``allocate_paged`` needs to be taken back: the free list before (a tensor the manager
    replaces, never writes), what its eviction took (filled as it takes), the rectangle of the
    page table it writes and its contents before, and each row's mapped pages before (``None``:
    no record)."""

    __slots__ = ("free_before", "evicted", "rect", "table_before", "records")

    def __init__(self, free_before, rect, table_before, records: dict[int, int | None]):
        self.free_before, self.evicted, self.rect = free_before, [], rect
        self.table_before, self.records = table_before, records


class _Settling:
    """What ``cache_req`` / ``release_req`` needs to be taken back: the request's record, its row
    and the free list before, the handle it held and how many locks on it, its ``cached_len``,
    whether the call inserts, and the handle the insert made (set as soon as it is known)."""

    __slots__ = ("rec", "row_before", "free_before", "old_handle", "held", "cached_len", "inserting",
                 "new_handle")

    def __init__(self, rec, row_before, free_before, old_handle, held, cached_len, inserting):
        self.rec, self.row_before, self.free_before = rec, row_before, free_before
        self.old_handle, self.held, self.cached_len = old_handle, held, cached_len
        self.inserting, self.new_handle = inserting, None


class CacheManagerUndo(CacheManagerChecks):
    """The rollbacks of :class:`~kvlab.manager.cache_manager.CacheManager`'s ``admit``, ``allocate_paged``,
    ``prefill`` / ``mixed_step``, ``cache_req``, ``release_req`` and ``complete_step``."""

    _cache_keeps_free_pages: bool

    # --- admit ------------------------------------------------------------------------------

    def _undo_admit(self, req: Req, handle, held: int) -> None:
        """Take back an admission of ``req`` on ``handle`` (it held ``held`` locks on it before):
        the lock it took (``undo_lock``: on the hash cache, the free pages it took go back to
        their places in the free queue, where an unlock would queue them last), its row and its
        record. Its fields are the caller's."""
        while self.prefix_cache.locks_held(handle, req) > held:
            self.prefix_cache.undo_lock(handle, owner=req)
        self.page_table[req.table_idx, : handle.cached_len] = UNMAPPED
        if self._is_running(req):
            del self._running[req.table_idx]

    def _undo_step(self, allocation: "_Allocation | None", admitted, fields) -> None:
        """Take back a serving step: its mapping (``allocation``, whether it ran part-way or to
        the end), then each admission of ``admitted``, last first, then every request's fields
        (``(req, fields)`` pairs, as :meth:`_fields` kept them)."""
        if allocation is not None:
            self._undo_allocation(allocation)
        for req in reversed(admitted):
            if self._is_running(req):  # (admitted: it holds one lock more than before)
                handle = req.cache_handle
                self._undo_admit(req, handle, max(0, self.prefix_cache.locks_held(handle, req) - 1))
        for req, before in fields:
            self._put_fields(req, before)

    # --- allocate_paged ---------------------------------------------------------------------

    def _allocation(self, allocation_info, new_reqs, needed_pages: int) -> _Allocation:
        """The record :meth:`_undo_allocation` needs, kept before the allocation changes anything."""
        rows = [row for row, _, _ in allocation_info] + [r.table_idx for r in new_reqs]
        records = {row: self._running[row].alloc_pages if row in self._running else None for row in rows}
        rect = table_before = None
        if needed_pages > 0:
            P = self.page_size
            # one rectangle of the table, kept by slicing: indexing with a list of rows would
            # copy that list to the GPU from pageable memory, a wait for the GPU on every step
            rect = (slice(min(r for r, _, _ in allocation_info), max(r for r, _, _ in allocation_info) + 1),
                    slice(min(first for _, first, _ in allocation_info) * P,
                          max(last for _, _, last in allocation_info) * P))
            table_before = self.page_table[rect].clone()
        return _Allocation(self.free_slots, rect, table_before, records)

    def _undo_allocation(self, undo: _Allocation) -> None:
        """Take back an allocation, whole or part-way: the rows' records, the page table, the
        eviction, the free list."""
        for row, pages in undo.records.items():
            if pages is None:
                self._running.pop(row, None)
            elif row in self._running:
                self._running[row].alloc_pages = pages
        if undo.rect is not None:
            self.page_table[undo.rect] = undo.table_before
        self.prefix_cache.undo_evict(undo.evicted)
        self.free_slots = undo.free_before

    # --- cache_req / release_req ------------------------------------------------------------

    def _settling(self, req: Req, rec: _Running, inserting: bool) -> _Settling:
        """The record :meth:`_undo_settling` needs, kept before ``cache_req`` / ``release_req``
        changes anything."""
        row_before = self.page_table[req.table_idx, : rec.alloc_pages * self.page_size].clone()
        return _Settling(rec, row_before, self.free_slots, req.cache_handle,
                         self.prefix_cache.locks_held(req.cache_handle, req), req.cached_len, inserting)

    def _undo_settling(self, req: Req, undo: _Settling) -> None:
        """Put back what a ``cache_req`` (``inserting``) or ``release_req`` changed, whether it
        failed part-way or ran to the end, last change first, read from the state itself: the
        request's locks (it held ``held`` on its old handle, none on another; a lock it took is
        taken back with ``undo_lock``, which puts the hash cache's free pages back in their
        places), the pages ``_free`` gave back, what its insert cached, its row, its record and
        its fields. Every page of the row from the old handle's end on was the request's own
        before the call: held by it alone, in no node, with no hash."""
        cache, P = self.prefix_cache, self.page_size
        old_handle, held, new_handle = undo.old_handle, undo.held, undo.new_handle
        old_len = old_handle.cached_len if old_handle is not None else 0
        if old_handle is not None:  # the unlock came last (the new handle may be the old one)
            while cache.locks_held(old_handle, req) > held:
                cache.undo_lock(old_handle, owner=req)
            for _ in range(held - cache.locks_held(old_handle, req)):
                cache.lock_handle(old_handle, owner=req)
        if new_handle is not None and new_handle != old_handle:
            for _ in range(cache.locks_held(new_handle, req)):
                cache.undo_lock(new_handle, owner=req)
        own = undo.row_before[old_len:]
        self.free_slots = undo.free_before
        if self._cache_keeps_free_pages:  # _free gave them to the cache's free queue
            cache.undo_free((own[::P] // P).tolist())
        if undo.inserting:
            cache.undo_insert(own[: undo.cached_len - old_len])
        self.page_table[req.table_idx, : undo.row_before.numel()] = undo.row_before
        self._running[req.table_idx] = undo.rec
        req.cache_handle, req.finished = old_handle, False

    # --- fields of a request ----------------------------------------------------------------

    @staticmethod
    def _fields(req: Req) -> tuple:
        """What the serving steps change on a request: its tokens' count, lengths, handle, flag."""
        return (len(req.input_ids), req.cached_len, req.device_len, req.cache_handle, req.finished)

    @staticmethod
    def _put_fields(req: Req, fields: tuple) -> None:
        n, req.cached_len, req.device_len, req.cache_handle, req.finished = fields
        del req.input_ids[n:]
