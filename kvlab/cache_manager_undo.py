"""How the cache manager takes back a call that failed part-way (chapter 06).

:class:`~kvlab.cache_manager.CacheManager` inherits these. A call that fails after its first
change (an error, or a ``KeyboardInterrupt``, a learner pressing stop, between any two of its
lines) puts every change back, last change first, before the error propagates. What to put back
is read from the state itself, not from flags set after each step: a step may have been stopped
just after it ran. The prefix cache takes back its own steps, with the same words on both caches
(:class:`~kvlab.radix_cache.RadixPrefixCache`, :class:`~kvlab.hash_cache.HashPrefixCache`):
``undo_evict`` (``allocate_paged``'s eviction), ``undo_lock``, ``undo_insert``, and on a cache
that keeps the free pages, ``undo_free``. The hash cache's free queue is an order (its LRU
list), so each of them puts its pages back in their places, not just back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .cache_manager_checks import CacheManagerChecks, _Running
from .paging import UNMAPPED
from .req import Req

if TYPE_CHECKING:
    from .radix_cache import RadixCacheHandle

__all__ = ["CacheManagerUndo"]


class CacheManagerUndo(CacheManagerChecks):
    """The rollbacks of :class:`~kvlab.cache_manager.CacheManager`'s ``prefill`` / ``mixed_step``
    (the admissions), ``cache_req`` and ``release_req``."""

    _cache_keeps_free_pages: bool

    def _undo_admit(self, req: Req) -> None:
        """Take back an :meth:`admit` of a step that failed: the request's lock (``undo_lock``: on
        the hash cache, the free pages it took go back to their places in the free queue, where
        an unlock would queue them last), its row and its record. Its fields are the caller's."""
        handle = req.cache_handle
        if handle is not None and self.prefix_cache.locks_held(handle, req):
            self.prefix_cache.undo_lock(handle, owner=req)
        self.page_table[req.table_idx, : self._handle_len(req)] = UNMAPPED
        del self._running[req.table_idx]

    def _undo_req_steps(self, req: Req, rec: _Running, row_before: torch.Tensor, free_before: torch.Tensor,
                        old_handle: RadixCacheHandle | None, held: int, inserting: bool = False,
                        new_handle: RadixCacheHandle | None = None) -> None:
        """Put back what a failed ``cache_req`` (``inserting``) or ``release_req`` changed, last
        change first, read from the state itself (a step may have been interrupted just after it
        ran): the request's locks (it held ``held`` on its old handle, none on another; a lock it
        took is taken back with ``undo_lock``, which puts the hash cache's free pages back in
        their places), the pages ``_free`` gave back, what its insert cached, its row, its record
        and its fields. Every page of the row from the old handle's end on was the request's own
        before the call: held by it alone, in no node, with no hash."""
        cache, P = self.prefix_cache, self.page_size
        old_len = old_handle.cached_len if old_handle is not None else 0
        if old_handle is not None:  # the unlock came last (the new handle may be the old one)
            while cache.locks_held(old_handle, req) > held:
                cache.undo_lock(old_handle, owner=req)
            for _ in range(held - cache.locks_held(old_handle, req)):
                cache.lock_handle(old_handle, owner=req)
        if new_handle is not None and new_handle != old_handle:
            for _ in range(cache.locks_held(new_handle, req)):
                cache.undo_lock(new_handle, owner=req)
        own = row_before[old_len:]
        self.free_slots = free_before
        if self._cache_keeps_free_pages:  # _free gave them to the cache's free queue
            cache.undo_free((own[::P] // P).tolist())
        if inserting:
            cache.undo_insert(own[: req.cached_len - old_len])
        self.page_table[req.table_idx, : row_before.numel()] = row_before
        self._running[req.table_idx] = rec
        req.cache_handle, req.finished = old_handle, False
