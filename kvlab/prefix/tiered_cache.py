"""The radix prefix cache over a KV hierarchy: device, host memory, disk (chapter 13).

:class:`TieredRadixCache` is chapter 05's tree in which every node knows where its KV lives: on
the device (``value``: its token slots, as before; empty when it is not there), in host memory
(``host``: one host page per page of the node, or ``None``) and, by its pages' chained hashes
(``hashes``), on disk. It speaks the radix cache's words, so :class:`~kvlab.CacheManager` runs
on it unchanged; the differences are where the words meet the tiers:

* ``match_prefix`` walks every tier but returns the handle of the deepest node **on the device**
  (the part a request can use at once); :meth:`host_chain` names the host-only nodes after it,
  which a load-back (:mod:`kvlab.serving.load_back`) copies into new device pages;
* ``insert_prefix`` gives a host-only node its device pages back when a request computed or
  loaded them ("already cached" counts only the device part, so the manager keeps those pages
  as the tree's), counts the hits and writes host copies as the write policy says;
* ``evict_leaves`` frees device pages as :func:`~kvlab.prefix.tier_plans.eviction_plan` decides:
  a clean node keeps its host copy, a dirty one is written back or forgotten, and host memory
  makes room by spilling its oldest host-only leaves to disk (never one a load-back reads).

``size_info`` counts device tokens only: what eviction can free and what locks protect. The
copies themselves are the ``copies`` object's (:class:`kvlab.serving.kv_copies.KVCopies` moves
real K/V; ``None`` keeps the bookkeeping alone, as the simulator does). The host and disk halves
of the bookkeeping are in :mod:`kvlab.prefix.tier_host`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..base.args import check_bool, check_empty_list, check_token_ids, div_ceil
from ..base.errors import CacheMisuse, IntegrityError, InvalidArgument
from .radix_cache import InsertResult, MatchResult, RadixCacheHandle, RadixPrefixCache
from .radix_node import RadixNode
from .tier_host import Eviction, TierHost, TieredNode
from .tier_plans import TierNode, eviction_plan
from .write_policy import make_write_policy

__all__ = ["TieredRadixCache", "TieredNode", "Eviction"]


class TieredRadixCache(TierHost, RadixPrefixCache):
    """The radix tree over device, host (``host``, a :class:`~kvlab.prefix.host_tier.HostTier`)
    and optionally disk (``disk``, a :class:`~kvlab.prefix.disk_store.DiskStore`) with the write
    ``policy`` of :mod:`kvlab.prefix.write_policy`; ``copies`` moves the K/V (or ``None``)."""

    def __init__(self, page_size: int, device=None, *, host, policy="write_through_selective",
                 disk=None, copies=None):
        from .host_tier import HostTier

        if not isinstance(host, HostTier):
            raise InvalidArgument("host", "a kvlab.prefix.host_tier.HostTier", f"got {type(host).__name__}")
        if host.page_size != page_size:
            raise InvalidArgument("host", "pages of the cache's page_size", f"{host.page_size} != {page_size}")
        for name in ("contains", "run_length", "write", "read"):
            if disk is not None and not callable(getattr(disk, name, None)):
                raise InvalidArgument("disk", "None or a store with contains/run_length/write/read",
                                      f"got {type(disk).__name__}")
        self.policy = make_write_policy(policy, "policy")
        self.host, self.disk, self.copies = host, disk, copies
        self.stats = dict(copied_to_host=0, loaded=0, spilled=0, discarded=0, forgotten=0,
                          disk_written=0, disk_read=0, disk_rejected=0, written_back=0)
        self._host_depth = 0                             # > 0: a host step was interrupted
        super().__init__(page_size, device)

    # --- bookkeeping --------------------------------------------------------------------------

    def reset(self) -> torch.Tensor:
        """Drop every cached prefix in every tier (its host pages freed once no copy reads them);
        return the device slots. Refuses while anything is locked."""
        if self.root is not None and self._locks:
            raise CacheMisuse(f"reset: {self.protected_size} cached tokens are still locked")
        if self.root is not None:
            self._repair()
        freed = self.all_cached_indices() if self.root is not None else self._empty()
        if self.root is not None:
            held = [p for n in self.nodes() if n.host for p in n.host]
            self.wait_readers(held)
            self.host.give_back(held)
        self.root = TieredNode((), self._empty(), self._uid(), 0)
        self.root.ref_count = 1
        self.evictable_size = self.protected_size = 0
        self._locks = {}
        return freed

    def all_cached_indices(self) -> torch.Tensor:
        parts = [n.value for n in self.nodes() if n.on_device]
        return torch.cat(parts) if parts else self._empty()

    def snapshot(self):
        """The device part of the tree, as chapter 05 draws it (:meth:`tier_snapshot`: all tiers)."""
        from .radix_node import NodeInfo, TreeSnapshot

        P = self.page_size
        nodes = [NodeInfo(n.uid, None if n.parent is self.root else n.parent.uid, tuple(n.pages(P)),
                          tuple(int(s) // P for s in n.value[::P].tolist()), n.ref_count, n.last_access)
                 for n in self.nodes() if n.on_device]
        return TreeSnapshot(P, tuple(nodes), self.clock, self.evictable_size, self.protected_size)

    def tier_snapshot(self, *, page_ids: bool = True) -> tuple[TierNode, ...]:
        """Every node as a :class:`~kvlab.prefix.tier_plans.TierNode`, parents first.
        ``page_ids=False`` leaves the device page numbers out (no read of the device)."""
        P = self.page_size
        out = []
        for n in self.nodes():
            pages = n.length // P
            dev = ((tuple(int(s) // P for s in n.value[::P].tolist()) if page_ids else (0,) * pages)
                   if n.on_device else ())
            out.append(TierNode(n.uid, None if n.parent is self.root else n.parent.uid, pages, dev,
                                tuple(n.host or ()), n.ref_count, n.last_access,
                                any(self.host.pinned(p) for p in n.host or ()),
                                tuple(n.pages(P)) if page_ids else (), n.hits))
        return tuple(out)

    # --- matching -----------------------------------------------------------------------------

    def _split(self, node: TieredNode, pos: int) -> TieredNode:
        """Cut ``node`` at ``pos`` in every tier; return the new upper half (see the base)."""
        assert 0 < pos < node.length and pos % self.page_size == 0
        parent, P, k = node.parent, self.page_size, pos // self.page_size
        upper = TieredNode(node.key[:pos], node.value[:pos], self._uid(), node.last_access,
                           host=None if node.host is None else node.host[:k],
                           hashes=None if node.hashes is None else node.hashes[:k], hits=node.hits)
        upper.ref_count, upper.parent = node.ref_count, parent
        upper.children[node.key[pos:pos + P]] = node
        host, hashes = (None if node.host is None else node.host[k:]), (None if node.hashes is None
                                                                        else node.hashes[k:])
        # one statement: the tree never shows half a split
        (parent.children[node.key[:P]], node.parent, node.key, node.value, node.host,
         node.hashes) = upper, upper, node.key[pos:], node.value[pos:], host, hashes
        return upper

    def match_prefix(self, input_ids) -> MatchResult:
        """The longest cached prefix **on the device** (stamps the nodes it uses in every tier)."""
        ids = check_token_ids("input_ids", input_ids)
        self._repair()
        node, prefix_len = self._walk(ids)
        while node is not self.root and not node.on_device:
            prefix_len -= node.length
            node = node.parent
        return MatchResult(RadixCacheHandle(prefix_len, node))

    def host_chain(self, input_ids, handle: RadixCacheHandle) -> list[TieredNode]:
        """The host-only nodes that continue ``input_ids`` after ``handle`` (a device match of
        them), whole nodes, root first: what a load-back copies in. A node matched part-way is
        split so that the chain ends on a node."""
        ids = check_token_ids("input_ids", input_ids)
        self._repair()
        node, pos, chain = handle.node, handle.cached_len, []
        while True:
            key = self._child_key(ids, pos)
            child = node.children.get(key) if key is not None else None
            if child is None or child.on_device or not child.host:
                return chain
            n = self.page_size
            limit = min(child.length, len(ids) - pos)
            while n < limit and child.key[n] == ids[pos + n]:
                n += 1
            n = self._align(n)
            if n < child.length:
                child = self._split(child, n)
            chain.append(child)
            node, pos = child, pos + child.length
            if n < child.length:
                return chain

    # --- inserting ----------------------------------------------------------------------------

    def _device_len(self, ids: Sequence[int]) -> int:
        """How many tokens of ``ids`` (whole pages) the tree holds **on the device**, from the
        start (no stamp, no split: a node matched part-way counts with its matched pages)."""
        node, pos = self.root, 0
        while True:
            key = self._child_key(ids, pos)
            child = node.children.get(key) if key is not None else None
            if child is None or not child.on_device:
                return pos
            n, limit = self.page_size, min(child.length, len(ids) - pos)
            while n < limit and child.key[n] == ids[pos + n]:
                n += 1
            pos += self._align(n)
            if self._align(n) < child.length:
                return pos
            node = child

    def insert_prefix(self, input_ids, indices, *, check_pages: bool = True) -> InsertResult:
        """Cache the whole pages of ``input_ids`` at ``indices``, in every tier it reaches.

        Returns ``(cached_len, handle)`` as the radix cache does, where ``cached_len`` counts the
        prefix that was **on the device** before: the slots after it are the tree's now (host-only
        nodes on the way take theirs as their device copy). Then each node on the way counts a
        hit and gets its host copy when the write policy says so."""
        check_bool("check_pages", check_pages)
        ids = check_token_ids("input_ids", input_ids)
        indices = self._check_indices(indices)
        if indices.numel() != len(ids):
            raise InvalidArgument("indices", "one slot per token: len(indices) == len(input_ids)",
                                  f"got {indices.numel()} slots for {len(ids)} tokens")
        insert_len = self._align(len(ids))
        ids = ids[:insert_len]
        self._repair()
        device_len = self._device_len(ids)
        new_value = indices[device_len:insert_len].to(device=self.device, dtype=torch.int32)
        if check_pages:
            self._check_whole_pages(new_value)
        node, prefix_len = self._walk(ids)               # (splits where the walk ends)
        pos, at = 0, self.root
        while pos < prefix_len:                          # host-only nodes: their device copy back
            at = at.children[tuple(ids[pos:pos + self.page_size])]
            if not at.on_device:
                value = new_value[pos - device_len: pos - device_len + at.length].clone()
                at.value, self.evictable_size = value, self.evictable_size + at.length
            pos += at.length
        if prefix_len < insert_len:
            new_node = TieredNode(tuple(ids[prefix_len:]), new_value[prefix_len - device_len:].clone(),
                                  self._uid(), self._tick(), hashes=self._hashes_after(node, ids[prefix_len:]))
            new_node.parent = node
            node.children[new_node.key[:self.page_size]], self.evictable_size = (
                new_node, self.evictable_size + new_node.length)
            node = new_node
        self._count_hits(node)
        return InsertResult(device_len, RadixCacheHandle(insert_len, node))

    def _count_hits(self, end: TieredNode) -> None:
        """One more hit on every node from the root to ``end``; write the host copies it earns."""
        if self.policy.at_eviction:
            return
        path = list(end.path_to_root())[::-1]
        for n in path:
            n.hits += 1
        for n in path:                                   # parents first: a copy never lacks its prefix
            if n.host is None and n.on_device and self.policy.copies_on_hit(n.hits):
                if not self.write_to_host(n):
                    return

    def undo_insert(self, slots) -> None:
        """Take back what an :meth:`insert_prefix` call put on the caller's ``slots``: a node it
        created leaves the tree (unless it got a host copy meanwhile: then it keeps only that), a
        host-only node it gave device pages to is host-only again."""
        from ..base.args import check_slots

        starts = set(check_slots("slots", slots)[:: self.page_size].tolist())
        removed = True
        while removed:
            removed = False
            for node in self.nodes():
                if (node.on_device and not node.ref_count and not self._device_children(node)
                        and int(node.value[0]) in starts):
                    self._leave_device(node, forget=node.host is None)
                    removed = True

    # --- eviction -----------------------------------------------------------------------------

    @staticmethod
    def _device_children(node: TieredNode) -> bool:
        return any(c.on_device for c in node.children.values())

    def _leave_device(self, node: TieredNode, *, forget: bool) -> None:
        """The node's device copy goes (its pages are the caller's now); ``forget``: and the node
        leaves the tree (it must have no children then)."""
        if forget:
            del node.parent.children[node.key[:self.page_size]]
            node.detached, self.evictable_size = True, self.evictable_size - node.length
        else:
            node.value, self.evictable_size = self._empty(), self.evictable_size - node.length

    def evict_leaves(self, num_tokens: int, into: list | None = None) -> list[Eviction]:
        """Free at least ``num_tokens`` device tokens as :func:`~kvlab.prefix.tier_plans.eviction_plan`
        decides; return the :class:`Eviction` records (each ``value``: the device slots it freed),
        each put in ``into`` before its change, for :meth:`undo_evict`."""
        from ..base.args import check_int

        num_tokens = check_int("num_tokens", num_tokens, minimum=0)
        check_empty_list("into", into)
        records: list = [] if into is None else into
        if num_tokens == 0:
            return records
        self._repair()
        nodes = {n.uid: n for n in self.nodes()}
        plan = eviction_plan(self.tier_snapshot(page_ids=False), div_ceil(num_tokens, self.page_size),
                             self.host.num_free, self.policy)
        for uid in plan.spills:
            self.spill(nodes[uid], records)
        for uid, action in plan.victims:
            node = nodes[uid]
            rec = Eviction(node, action, node.value)
            records.append(rec)                          # recorded first: undo reads how far it got
            if action == "copy" and self.write_to_host(node, rec):
                self.stats["written_back"] += 1
            elif action == "copy":                       # (no room after all: nowhere to keep it)
                action = rec.action = "forget"
            if action == "forget":
                self.stats["forgotten"] += 1
                for below in self._subtree(node):        # its host-only nodes go with it
                    self.spill(below, records, action="discard")
            self._leave_device(node, forget=action == "forget")
        return records

    def undo_evict(self, evicted: Sequence) -> None:
        """Put back the device side of an :meth:`evict_leaves` call, last first, read from the
        state itself. What it spilled stays spilled (those host pages may hold other K/V now: a
        cache may forget, never remember wrongly), and a copy it wrote stays (a clean copy)."""
        if not isinstance(evicted, (list, tuple)) or not all(isinstance(r, Eviction) for r in evicted):
            raise InvalidArgument("evicted", "the list evict_leaves returned (Eviction records)",
                                  f"got {type(evicted).__name__}")
        self._repair()                                   # (host pages taken and never attached)
        for rec in reversed(evicted):
            node = rec.node
            if rec.action in ("spill", "discard"):
                continue
            if node.detached:
                parent, key = node.parent, node.key[:self.page_size]
                if parent is None or parent.detached or key in parent.children:
                    raise CacheMisuse(f"undo_evict: node {node.uid} cannot go back (the tree changed)")
                node.value = rec.value
                parent.children[key], node.detached = node, False
                self.evictable_size += node.length
            elif not node.on_device:
                node.value, self.evictable_size = rec.value, self.evictable_size + node.length

    # --- checks -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The radix cache's rules on the device part, and the tiers': every node somewhere, the
        device part closed under parents, one host page per page of a host copy, every host page
        in exactly one node or free."""
        P, held = self.page_size, {}
        for (owner, locked), count in self._locks.items():
            if locked.detached or not locked.on_device:
                raise IntegrityError(f"a lock is held on node {locked.uid}, which is not on the device")
            for node in locked.path_to_root():
                held[node] = held.get(node, 0) + count
        evictable = protected = 0
        used: list[int] = []
        for node in self.nodes():
            if node.length == 0 or node.length % P:
                raise IntegrityError(f"node {node.uid} has {node.length} tokens, not whole pages of {P}")
            if node.on_device and node.value.numel() != node.length:
                raise IntegrityError(f"node {node.uid}: key and device slots differ in length")
            if not node.on_device and not node.host:
                raise IntegrityError(f"node {node.uid} is in no tier (neither device nor host)")
            if node.on_device and node.parent is not self.root and not node.parent.on_device:
                raise IntegrityError(f"node {node.uid} is on the device under node {node.parent.uid}, "
                                     "which is not (the device part must be closed under parents)")
            if node.host is not None and len(node.host) != node.length // P:
                raise IntegrityError(f"node {node.uid}: {len(node.host)} host pages for {node.length // P} pages")
            if node.ref_count != held.get(node, 0):
                raise IntegrityError(f"node {node.uid} has ref_count {node.ref_count} but "
                                     f"{held.get(node, 0)} lock(s) are held on it or below it")
            used.extend(node.host or ())
            if node.on_device:
                evictable += node.length if node.ref_count == 0 else 0
                protected += node.length if node.ref_count else 0
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise IntegrityError(f"size_info says evictable={self.evictable_size}, protected="
                                 f"{self.protected_size}; the device nodes add up to {evictable}, {protected}")
        self.host.check_integrity(used)
