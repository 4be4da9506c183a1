"""The host and disk half of the tiered radix cache (chapter 13): a node's tiers, host copies,
making room in host memory, spilling to disk and fetching from it, and the load-back's copies.

:class:`~kvlab.prefix.tiered_cache.TieredRadixCache` inherits :class:`TierHost`. Every state
change here is one statement, and records what it took before the next line can fail, so an
interrupt (a learner pressing stop) leaves nothing half done: at worst a host copy written and not
yet used, or a page spilled that nobody needed to spill.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import torch

from .hash_chain import _chain
from .radix_node import RadixNode

__all__ = ["TieredNode", "Eviction", "TierHost"]


class TieredNode(RadixNode):
    """A radix node with tiers: ``value`` (device slots, empty when not on the device), ``host``
    (one host page per page, or ``None``), ``hashes`` (each page's chained hash, when there is a
    disk tier) and ``hits`` (inserts that reached it)."""

    def __init__(self, key, value, uid, tick, *, host=None, hashes=None, hits: int = 0):
        super().__init__(key, value, uid, tick)
        self.host: list[int] | None = host
        self.hashes: list[bytes] | None = hashes
        self.hits = hits

    @property
    def on_device(self) -> bool:
        return self.value.numel() > 0

    def __repr__(self) -> str:
        where = "+".join(t for t, on in (("device", self.on_device), ("host", bool(self.host))) if on)
        return f"TieredNode(uid={self.uid}, tokens={self.length}, {where or 'nowhere'}, ref_count={self.ref_count})"


class Eviction:
    """What one step of an eviction did to ``node`` (``action``: ``"drop"``, ``"copy"``,
    ``"forget"``, ``"spill"`` or ``"discard"``): ``value``, the device slots it freed (the manager
    reads them), ``taken``, the host pages a copy took."""

    __slots__ = ("node", "action", "value", "taken")

    def __init__(self, node: TieredNode, action: str, value: torch.Tensor):
        self.node, self.action, self.value, self.taken = node, action, value, None

    def __repr__(self) -> str:
        return f"Eviction({self.action} node {self.node.uid}, {self.value.numel()} device slots)"


class TierHost:
    """Host memory and disk for the tiered radix cache (see the module docstring)."""

    page_size: int
    root: TieredNode

    # --- hashes ------------------------------------------------------------------------------

    def _hashes_after(self, node: TieredNode, tokens: Sequence[int]) -> list[bytes] | None:
        """The chained hashes of the pages ``tokens`` (whole pages) continuing ``node``'s prefix;
        ``None`` without a disk tier (nobody needs them)."""
        if self.disk is None:
            return None
        parent = node.hashes[-1] if node is not self.root and node.hashes else None
        if node is not self.root and not node.hashes:
            parent = self._last_hash(node)
        out, P = [], self.page_size
        for i in range(0, len(tokens), P):
            parent = _chain(parent, tokens[i:i + P])
            out.append(parent)
        return out

    def _last_hash(self, node: TieredNode) -> bytes | None:
        """The chained hash of the last page of ``node``'s prefix, computed from the root."""
        path = list(node.path_to_root())[::-1]
        ids = [t for n in path for t in n.key]
        parent = None
        for i in range(0, len(ids), self.page_size):
            parent = _chain(parent, ids[i:i + self.page_size])
        return parent

    # --- host copies ---------------------------------------------------------------------------

    def wait_readers(self, pages: Sequence[int]) -> None:
        """Wait until no load-back reads ``pages`` any more."""
        for p in pages:
            for pending in list(self.host._readers.get(p, ())):
                pending.wait()
            self.host.pinned(p)

    def write_to_host(self, node: TieredNode, rec=None) -> bool:
        """Give ``node`` (on the device, no host copy) its host copy, making room by spilling;
        False when host memory has no room for it. ``rec``: an eviction's record (it notes the
        host pages taken)."""
        n = node.length // self.page_size
        if not self.make_host_room(n):
            return False
        self._host_depth += 1
        try:
            taken = self.host.take(n)                    # (taken, not yet the node's: see _repair)
            if rec is not None:
                rec.taken = taken
            pending = self.copies.save(node.value, taken) if self.copies is not None else None
            if pending is not None:
                self.host.mark_written(taken, pending)
            node.host = taken
        except BaseException:
            self._repair()
            raise
        self._host_depth -= 1
        self.stats["copied_to_host"] += n
        return True

    def make_host_room(self, n: int, records=None, keep: Sequence[TieredNode] = ()) -> bool:
        """Spill host-only leaves, least recently used first, until ``n`` host pages are free;
        never one a load-back reads, nor one of ``keep``. False when that is not enough."""
        if self.host.num_free >= n:
            return True
        keep = {id(k) for k in keep}

        def leaf(node):
            return (node is not self.root and not node.on_device and node.host and not node.children
                    and id(node) not in keep and not any(self.host.pinned(p) for p in node.host))

        heap = [(x.last_access, x.uid, x) for x in self.nodes() if leaf(x)]
        heapq.heapify(heap)
        while self.host.num_free < n and heap:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            self.spill(x, records)
            if leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return self.host.num_free >= n

    def spill(self, node: TieredNode, records=None, action: str = "spill") -> None:
        """A host-only leaf leaves host memory: its pages go to disk first (when there is a disk
        tier and it lacks them), then the node leaves the tree and its host pages are free. Once
        it has begun to leave it finishes, even when interrupted (a spill is never taken back)."""
        if records is not None:
            records.append(Eviction(node, action, self._empty()))
        pages = list(node.host)
        if self.disk is not None and node.hashes:
            self.host.wait_written(pages)
            for h, p in zip(node.hashes, pages):
                page = self.host.kv[p] if self.host.kv is not None else None
                if not self.disk.contains(h) and self.disk.write(h, page):
                    self.stats["disk_written"] += 1
        self.wait_readers(pages)
        self._host_depth += 1
        try:
            _, node.detached = node.parent.children.pop(node.key[:self.page_size]), True
            self.host.give_back(pages)                   # (out of the tree, not yet free: _repair)
            node.host = None
        except BaseException:
            self._repair()
            raise
        self._host_depth -= 1
        self.stats["spilled" if action == "spill" else "discarded"] += len(pages)

    def _repair(self) -> None:
        """Finish what an interrupted host step left: host pages that are neither free nor held by
        a node of the tree are freed (once no copy reads them). Read from the state itself."""
        if not self._host_depth:
            return
        held = {p for n in self.nodes() for p in (n.host or ())}
        limbo = [p for p in range(self.host.num_pages) if p not in held and not self.host._is_free(p)]
        self.wait_readers(limbo)
        self.host.give_back(limbo)
        self._host_depth = 0

    def _subtree(self, node: TieredNode) -> list[TieredNode]:
        """``node``'s descendants, children after their own children (deepest first)."""
        out, stack = [], [(c, False) for c in node.children.values()]
        while stack:
            x, done = stack.pop()
            if done:
                out.append(x)
            else:
                stack.append((x, True))
                stack.extend((c, False) for c in x.children.values())
        return out

    # --- disk -> host ------------------------------------------------------------------------

    def fetch_from_disk(self, input_ids: Sequence[int], after: TieredNode, pos: int,
                        keep: Sequence[TieredNode] = (), max_pages: int | None = None) -> TieredNode | None:
        """The pages of ``input_ids`` from ``pos`` on (``after`` ends there) that the disk holds,
        read into host pages and put in the tree as a host-only node under ``after``; ``None`` when
        the disk holds none of them (or host memory has no room). A page whose file is missing,
        damaged or foreign ends the run: it and what follows are computed instead."""
        if self.disk is None:
            return None
        P = self.page_size
        n_pages = (len(input_ids) - pos) // P if max_pages is None else min(max_pages, (len(input_ids) - pos) // P)
        if n_pages <= 0:
            return None
        hashes = self._hashes_after(after, input_ids[pos:pos + n_pages * P])
        run = self.disk.run_length(hashes)
        if run == 0 or not self.make_host_room(run, keep=list(keep) + [after]):
            return None
        self._host_depth += 1
        try:
            pages = self.host.take(run)                  # (not yet in the tree: see _repair)
            good = 0
            for h, p in zip(hashes[:run], pages):
                why = self.disk.read(h, self.host.kv[p] if self.host.kv is not None else None)
                if why:
                    self.stats["disk_rejected"] += why != "missing"
                    break
                good += 1
            self.host.give_back(pages[good:])
            node = None
            if good:
                node = TieredNode(tuple(input_ids[pos:pos + good * P]), self._empty(), self._uid(),
                                  self._tick(), host=pages[:good], hashes=hashes[:good])
                node.parent = after
                after.children[node.key[:P]] = node
                self.stats["disk_read"] += good
        except BaseException:
            self._repair()
            raise
        self._host_depth -= 1
        return node

    def persist(self) -> int:
        """Write every cached page the disk lacks, from its host copy or else from the device (a
        process that ends keeps its KV for the next one); returns the pages written."""
        if self.disk is None:
            return 0
        written = 0
        for node in self.nodes():
            missing = [i for i, h in enumerate(node.hashes or ()) if not self.disk.contains(h)]
            if not missing:
                continue
            if node.host:
                self.host.wait_written([node.host[i] for i in missing])
                pages = [self.host.kv[node.host[i]] if self.host.kv is not None else None for i in missing]
            else:
                staged = self.copies.read(node.value) if self.copies is not None else None
                pages = [staged[i] if staged is not None else None for i in missing]
            for i, page in zip(missing, pages):
                written += bool(self.disk.write(node.hashes[i], page))
        self.stats["disk_written"] += written
        return written

    # --- host -> device: a load-back's copies --------------------------------------------------

    def load_chain(self, chain: Sequence[TieredNode], slots: torch.Tensor) -> None:
        """Copy the host pages of ``chain`` (host-only nodes, in position order) into the device
        ``slots`` (one per position); their host pages stay pinned until the copy is done."""
        pages = [p for n in chain for p in n.host]
        # (a copy still filling one of them is waited for on the device, by the copies)
        pending = self.copies.load(pages, slots) if self.copies is not None else None
        if pending is not None:
            self.host.pin(pages, pending)
        self.stats["loaded"] += len(pages)
