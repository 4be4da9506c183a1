"""The radix prefix cache: requests that share a prompt prefix share its KV pages.

Built in chapter 05 (``notebooks/05_radix_cache.ipynb``); used by
:class:`kvlab.manager.cache_manager.CacheManager` (chapter 06). The design follows mini-sglang's
``RadixPrefixCache``:

* a tree whose edges are token sequences; every node holds ``key`` (its tokens) and
  ``value`` (the physical KV slot of each of those tokens);
* keys are **page-aligned**: a node's length is a multiple of ``page_size`` and children are
  found by their first *page* of tokens, so only whole pages are ever cached or shared,
  and a node is only ever split on a page boundary;
* ``ref_count`` locks: a running request locks the path from its node up to the root, and a
  locked node is never evicted. Unlike the source, a lock has an **owner** (the request that
  took it): only that owner can take it back, so one request's stray unlock can never expose
  another request's pages to eviction;
* LRU eviction of whole unlocked leaves, ordered by a deterministic access clock (not wall
  time, so every run of a chapter draws the same tree). The clock ticks once per walk (a
  match or an insert); the walk stamps the nodes it *used* with that tick. When a match ends
  inside a node, the node is split on the page boundary and only the matched upper half is
  stamped: the lower half was not used and keeps its old stamp.

Memory picture (page_size P = 2; each box is one node, ``|`` separates pages)::

    root ── [1 2|3 4] ──┬── [5 6]        "1 2 3 4 5 6" cached
     slots: [8 9|2 3]   │   [10 11]
                        └── [7 8|9 9]    "1 2 3 4 7 8 9 9" shares the first node
                            [0 1|4 5]
"""
from __future__ import annotations

import heapq
from typing import Hashable, Sequence

import torch

from ..base.args import check_bool, check_device, check_empty_list, check_int, check_page_size, check_slots, check_token_ids, check_whole_pages
from ..base.errors import CacheMisuse, IntegrityError, InvalidArgument
from .radix_node import (InsertResult, MatchResult, NodeInfo, RadixCacheHandle, RadixNode, SizeInfo,
                         TreeSnapshot)
from ..base.runtime import default_device

__all__ = [
    "RadixNode", "RadixCacheHandle", "MatchResult", "InsertResult", "SizeInfo", "NodeInfo",
    "TreeSnapshot", "RadixPrefixCache",
]


def _owner_name(owner) -> str:
    """How an error message names a lock's owner."""
    if owner is None:
        return "the anonymous owner (owner=None)"
    if hasattr(owner, "table_idx"):
        return f"the request in row {owner.table_idx}"
    return f"owner {owner!r}"[:80]


class RadixPrefixCache:
    """Page-aligned radix tree of cached prefixes (chapter 05).

    ``evict(n)`` frees whole unlocked least-recently-used leaves until at least ``n`` tokens
    are freed, and **returns what it could** when fewer than ``n`` tokens are evictable (it
    never evicts a locked node and never raises for that): the caller decides whether that
    is enough. :class:`~kvlab.manager.cache_manager.CacheManager` checks ``size_info.evictable_size``
    *before* evicting, so it never evicts and then fails.
    """

    def __init__(self, page_size: int, device: "torch.device | str | None" = None):
        self.page_size = check_page_size(page_size)
        self.device = default_device(check_device("device", device))
        self._next_uid = 0
        self._now = 0  # the LRU clock: one tick per walk (match or insert)
        self.root: RadixNode | None = None
        self.reset()

    # --- bookkeeping ------------------------------------------------------------------

    def reset(self) -> torch.Tensor:
        """Drop every cached prefix and return their slots. Refuses while anything is locked."""
        if self.root is not None and self._locks:
            raise CacheMisuse(f"reset: {self.protected_size} cached tokens are still locked "
                              "by running requests; unlock them first")
        freed = self.all_cached_indices() if self.root is not None else self._empty()
        self.root = RadixNode((), self._empty(), self._uid(), 0)
        self.root.ref_count = 1  # the root is always protected
        self.evictable_size = 0
        self.protected_size = 0
        # who holds which lock: (owner, the locked handle's node) -> how many times
        self._locks: dict[tuple[Hashable, RadixNode], int] = {}
        return freed

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int32, device=self.device)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_size, self.protected_size)

    @property
    def clock(self) -> int:
        """The last access-counter value handed out (for drawings: 'now')."""
        return self._now

    def _tick(self) -> int:
        self._now += 1
        return self._now

    def _uid(self) -> int:
        self._next_uid += 1
        return self._next_uid - 1

    def nodes(self) -> list[RadixNode]:
        """Every node except the root, parents before children (depth-first, keys sorted)."""
        out: list[RadixNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append(node)
            stack.extend(node.children[k] for k in sorted(node.children, reverse=True))
        return out

    def all_cached_indices(self) -> torch.Tensor:
        """Every slot held by the tree (for integrity checks)."""
        parts = [n.value for n in self.nodes()]
        return torch.cat(parts) if parts else self._empty()

    def snapshot(self) -> TreeSnapshot:
        """The tree as plain data, for drawing later (``kvlab.course.viz.draw_tree``) or comparing."""
        P = self.page_size
        nodes = []
        for node in self.nodes():
            parent = None if node.parent is self.root else node.parent.uid
            page_ids = tuple(int(s) // P for s in node.value[::P].tolist())
            nodes.append(NodeInfo(node.uid, parent, tuple(node.pages(P)), page_ids, node.ref_count,
                                  node.last_access))
        return TreeSnapshot(P, tuple(nodes), self.clock, self.evictable_size, self.protected_size)

    # --- matching ---------------------------------------------------------------------

    def _align(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _child_key(self, ids: Sequence[int], start: int) -> tuple[int, ...] | None:
        """Children are found by their first page; fewer than a page left: no child."""
        if len(ids) - start < self.page_size:
            return None
        return tuple(ids[start:start + self.page_size])

    def _split(self, node: RadixNode, pos: int) -> RadixNode:
        """Cut ``node`` at ``pos`` (a page boundary); return the new upper half.

        Both halves keep the node's LRU stamp. ``node`` stays the lower half, so the handles
        and locks that point at it still cover exactly the same tokens."""
        assert 0 < pos < node.length and pos % self.page_size == 0
        parent, P = node.parent, self.page_size
        upper = RadixNode(node.key[:pos], node.value[:pos], self._uid(), node.last_access)
        upper.ref_count, upper.parent = node.ref_count, parent  # every lock through node also runs through upper
        upper.children[node.key[pos:pos + P]] = node
        # one statement: the tree never shows half a split (upper keeps node's first page as its key)
        parent.children[node.key[:P]], node.parent, node.key, node.value = upper, upper, node.key[pos:], node.value[pos:]
        return upper

    def _walk(self, ids: Sequence[int], *, touch: bool = True) -> tuple[RadixNode, int]:
        """Follow ``ids`` down the tree; return the last node matched and the matched length.

        With ``touch`` (one clock tick) every node the match used is stamped, and a node
        matched only partly is split so that the match ends on a node. ``touch=False`` only
        measures the match: no split, no stamp (the node returned is then the last one
        matched whole)."""
        node, prefix_len = self.root, 0
        now = self._tick() if touch else 0
        while True:
            key = self._child_key(ids, prefix_len)
            child = node.children.get(key) if key is not None else None
            if child is None:
                return node, prefix_len
            # the first page matches (that is how we found the child); how many more?
            n = self.page_size
            limit = min(child.length, len(ids) - prefix_len)
            while n < limit and child.key[n] == ids[prefix_len + n]:
                n += 1
            n = self._align(n)  # a partly matched page does not count
            prefix_len += n
            if n < child.length:  # the match ends inside this node
                if not touch:
                    return node, prefix_len
                used = self._split(child, n)  # only the matched upper half was used
                used.last_access = now
                return used, prefix_len
            if touch:
                child.last_access = now
            node = child

    def match_prefix(self, input_ids) -> MatchResult:
        """The longest cached page-aligned prefix of ``input_ids``; stamps the nodes it uses."""
        ids = check_token_ids("input_ids", input_ids)
        node, prefix_len = self._walk(ids)
        return MatchResult(RadixCacheHandle(prefix_len, node))

    # --- inserting --------------------------------------------------------------------

    def insert_prefix(self, input_ids, indices, *, check_pages: bool = True) -> InsertResult:
        """Cache the whole pages of ``input_ids`` with their slots ``indices``.

        Returns ``(cached_len, handle)``: how many tokens were cached *before* (those slots
        of ``indices`` are duplicates the caller still owns), and a handle for the
        ``len(input_ids) // page_size * page_size`` inserted tokens. The new node is
        unlocked (evictable) until someone locks the handle. ``check_pages=False``: the
        caller vouches that each page of slots is one whole physical page (the cache
        manager's rows are), so the slots' values are not read back (a wait for the GPU).
        """
        check_bool("check_pages", check_pages)
        ids = check_token_ids("input_ids", input_ids)
        indices = self._check_indices(indices)
        if indices.numel() != len(ids):
            raise InvalidArgument("indices", "one slot per token: len(indices) == len(input_ids)",
                                  f"got {indices.numel()} slots for {len(ids)} tokens")
        insert_len = self._align(len(ids))
        ids = ids[:insert_len]
        # check the slots to insert before the walk that splits a node and ticks the clock:
        # a refused insert leaves the tree exactly as it was
        _, prefix_len = self._walk(ids, touch=False)
        new_value = indices[prefix_len:insert_len].to(device=self.device, dtype=torch.int32)
        if check_pages:
            self._check_whole_pages(new_value)
        node, prefix_len = self._walk(ids)
        if prefix_len < insert_len:
            new_node = RadixNode(tuple(ids[prefix_len:]), new_value.clone(), self._uid(),
                                 self._tick())
            new_node.parent = node
            # one statement: the new leaf and the size that counts it come together
            node.children[new_node.key[:self.page_size]], self.evictable_size = (
                new_node, self.evictable_size + new_node.length)
            node = new_node
        return InsertResult(prefix_len, RadixCacheHandle(insert_len, node))

    @staticmethod
    def _check_indices(indices) -> torch.Tensor:
        """Slots as a 1-D integer tensor: a tensor, or a list/tuple of ints (not bools or floats)."""
        return check_slots("indices", indices)

    def _check_whole_pages(self, slots: torch.Tensor) -> None:
        """Each page of slots must be one physical page: p*P, p*P+1, ..., p*P+P-1."""
        check_whole_pages("indices", slots, self.page_size)

    # --- locking ----------------------------------------------------------------------

    def lock_handle(self, handle: RadixCacheHandle, unlock: bool = False, *, owner=None) -> None:
        """Lock (or with ``unlock=True`` unlock) ``handle`` for ``owner``.

        A lock adds one reference on every node from the handle's node up to the root; locked
        nodes are *protected*: never evicted. ``owner`` says who holds the lock (the cache
        manager passes the request; ``None`` is one more owner, "anonymous"). An unlock must
        come from an owner that holds a lock on this handle, else :class:`CacheMisuse` and
        nothing changes. The root handle (``cached_len == 0``) protects nothing: locking or
        unlocking it does nothing.
        """
        self._check_handle(handle)
        try:
            hash(owner)
        except TypeError:
            raise InvalidArgument("owner", "must be hashable (a Req, a string, an int, None)",
                                  f"got {type(owner).__name__}") from None
        if handle.node is self.root:
            return
        record = (owner, handle.node)
        held = self._locks.get(record, 0)
        if not isinstance(unlock, bool):
            raise InvalidArgument("unlock", "must be a bool", f"got {unlock!r}")
        if unlock and held == 0:
            others = sum(c for (_, node), c in self._locks.items() if node is handle.node)
            raise CacheMisuse(
                f"lock_handle(unlock=True): the handle is not locked by {_owner_name(owner)} "
                f"(node {handle.node.uid}; {others} lock(s) on it held by other owners). Only "
                "the owner that locked a handle may unlock it, once per lock")
        # ==== whole or not at all: what the path held before, put back if anything fails ====
        path = list(handle.node.path_to_root())
        counts, sizes, step = [node.ref_count for node in path], self.size_info, -1 if unlock else 1
        try:
            if held + step:
                self._locks[record] = held + step
            else:
                del self._locks[record]
            for node in path:
                node.ref_count += step
                if node.ref_count == (0 if unlock else 1):  # it just became evictable (or protected)
                    self.evictable_size, self.protected_size = (self.evictable_size - step * node.length,
                                                                self.protected_size + step * node.length)
        except BaseException:  # (an interrupt part-way: no lock half taken, no count off by one)
            for node, count in zip(path, counts):
                node.ref_count = count
            self.evictable_size, self.protected_size = sizes
            if held:
                self._locks[record] = held
            else:
                self._locks.pop(record, None)
            raise

    def is_locked_by(self, handle: RadixCacheHandle, owner=None) -> bool:
        """Whether ``owner`` holds a lock on ``handle`` (the root handle: always locked)."""
        if not isinstance(handle, RadixCacheHandle) or handle.node.detached:
            return False
        if handle.node is self.root:
            return True
        try:
            return self._locks.get((owner, handle.node), 0) > 0
        except TypeError:  # an unhashable owner holds nothing
            return False

    def locks_held(self, handle: RadixCacheHandle, owner=None) -> int:
        """How many locks ``owner`` holds on ``handle`` (the root handle, which locks nothing: 0)."""
        if not isinstance(handle, RadixCacheHandle) or handle.node is self.root:
            return 0
        try:
            return self._locks.get((owner, handle.node), 0)
        except TypeError:  # an unhashable owner holds nothing
            return 0

    def _check_handle(self, handle) -> None:
        if not isinstance(handle, RadixCacheHandle):
            raise InvalidArgument("handle", "must be a RadixCacheHandle from this cache",
                                  f"got {type(handle).__name__}")
        if handle.node is self.root:
            return
        path = list(handle.node.path_to_root())
        if handle.node.detached or path[-1].parent is not self.root:
            raise CacheMisuse("lock_handle: the handle's prefix is no longer in this cache "
                              "(it was evicted, or the handle belongs to another cache); "
                              "lock a handle right after match_prefix/insert_prefix")

    # --- eviction ---------------------------------------------------------------------

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free whole unlocked leaves, least recently used first, until ``num_tokens`` tokens
        are freed; return their token slots (page-aligned runs of ``page_size``).

        May free more than asked (a leaf goes whole). If fewer than ``num_tokens`` tokens are
        evictable it frees all of them and returns those: check ``size_info`` first when you
        need a guarantee.
        """
        evicted = self.evict_leaves(num_tokens)
        return torch.cat([n.value for n in evicted]) if evicted else self._empty()

    def evict_leaves(self, num_tokens: int, into: list | None = None) -> list[RadixNode]:
        """:meth:`evict`, returning the evicted nodes in eviction order (their ``value`` holds
        the freed slots), so that :meth:`undo_evict` can put them back. ``into``: the caller's
        list, which gets each node before it is detached (and is returned): a caller that may
        have to roll back passes its own, so that a failure or an interrupt part-way through
        (a learner pressing stop) loses no node already evicted."""
        num_tokens = check_int("num_tokens", num_tokens, minimum=0)
        check_empty_list("into", into)
        evicted: list[RadixNode] = [] if into is None else into
        if num_tokens == 0:
            return evicted
        heap = [(n.last_access, n.uid, n) for n in self.nodes() if n.is_leaf() and n.ref_count == 0]
        heapq.heapify(heap)
        n_freed = 0
        while n_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            evicted.append(node)  # recorded first: undo_evict tells how far the next lines got
            del parent.children[node.key[:self.page_size]]
            # one statement: the size and the flag undo_evict reads change together
            self.evictable_size, node.detached = self.evictable_size - node.length, True
            n_freed += node.length  # (node.parent stays: undo_evict re-attaches the node there)
            if parent is not self.root and parent.is_leaf() and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return evicted

    def undo_evict(self, evicted: Sequence[RadixNode]) -> None:
        """Put back the nodes of an :meth:`evict_leaves` call, last evicted first (a caller's
        rollback when what it evicted for could not be finished). Only valid while nothing
        else changed the tree since. A node recorded but not yet detached (the eviction was
        stopped part-way) is left where it is."""
        if not isinstance(evicted, (list, tuple)) or not all(isinstance(n, RadixNode) for n in evicted):
            raise InvalidArgument("evicted", "the list evict_leaves returned (RadixNode)",
                                  f"got {type(evicted).__name__}")
        for node in reversed(evicted):
            parent, key = node.parent, node.key[:self.page_size]
            if parent is not None and not node.detached and parent.children.get(key) is node:
                continue  # recorded, never detached
            if parent is None or parent.detached or key in parent.children:
                raise CacheMisuse(f"undo_evict: node {node.uid} cannot go back (the tree changed "
                                  "since it was evicted)")
            parent.children[key] = node
            if node.detached:  # (else it was stopped before its size was taken)
                self.evictable_size, node.detached = self.evictable_size + node.length, False

    def undo_lock(self, handle: RadixCacheHandle, owner=None) -> None:
        """Take back the latest lock ``owner`` took on ``handle`` (a caller's rollback): an unlock,
        as the tree keeps no order a lock changed (the hash cache's free queue does)."""
        self.lock_handle(handle, unlock=True, owner=owner)

    def undo_insert(self, slots) -> None:
        """Take back what an :meth:`insert_prefix` call added on the caller's ``slots`` (those it
        passed that were in no node before): the unlocked leaf that starts on one of them. A
        caller's rollback, read from the tree itself, so it also works when the insert ran but its
        caller never got the handle. A node split by the insert's walk stays split (the same
        pages, as a match leaves them), and so does a node of the insert that a later walk split:
        both halves start on the caller's slots, the upper one a leaf once the lower one is gone."""
        starts = set(check_slots("slots", slots)[:: self.page_size].tolist())
        removed = True
        while removed:
            removed = False
            for node in self.nodes():
                if node.is_leaf() and not node.ref_count and int(node.value[0]) in starts:
                    del node.parent.children[node.key[:self.page_size]]
                    self.evictable_size, node.detached = self.evictable_size - node.length, True
                    removed = True

    # --- checks -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Sizes add up; keys are page-aligned; every node's ``ref_count`` is exactly the
        number of locks held on it or below it, each by a recorded owner."""
        held: dict[RadixNode, int] = {}
        for (owner, locked), count in self._locks.items():
            if locked.detached:
                raise IntegrityError(f"{_owner_name(owner)} holds a lock on evicted node {locked.uid}")
            for node in locked.path_to_root():
                held[node] = held.get(node, 0) + count
        evictable = protected = 0
        for node in self.nodes():
            if node.length == 0 or node.length % self.page_size:
                raise IntegrityError(f"node {node.uid} has {node.length} tokens, "
                                     f"not a positive multiple of page_size {self.page_size}")
            if node.value is None or node.value.numel() != node.length:
                raise IntegrityError(f"node {node.uid}: key and value lengths differ")
            if node.ref_count != held.get(node, 0):
                raise IntegrityError(f"node {node.uid} has ref_count {node.ref_count} but "
                                     f"{held.get(node, 0)} lock(s) are held on it or below it")
            if node.ref_count == 0:
                evictable += node.length
            else:
                protected += node.length
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise IntegrityError(
                f"size_info says evictable={self.evictable_size}, protected={self.protected_size} "
                f"but the nodes add up to evictable={evictable}, protected={protected}")
