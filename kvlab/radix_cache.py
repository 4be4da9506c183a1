"""The radix prefix cache: requests that share a prompt prefix share its KV pages.

Built in chapter 05 (``notebooks/05_radix_cache.ipynb``); used by
:class:`kvlab.cache_manager.CacheManager` (chapter 06). The design follows mini-sglang's
``RadixPrefixCache``:

* a tree whose edges are token sequences; every node holds ``key`` (its tokens) and
  ``value`` (the physical KV slot of each of those tokens);
* keys are **page-aligned**: a node's length is a multiple of ``page_size`` and children are
  found by their first *page* of tokens, so only whole pages are ever cached or shared,
  and a node is only ever split on a page boundary;
* ``ref_count`` locks: a running request locks the path from its node up to the root, and a
  locked node is never evicted;
* LRU eviction of whole unlocked leaves, ordered by a deterministic access counter
  (not wall time, so every run of a chapter draws the same tree).

Memory picture (page_size P = 2; each box is one node, ``|`` separates pages)::

    root ── [1 2|3 4] ──┬── [5 6]        "1 2 3 4 5 6" cached
     slots: [8 9|2 3]   │   [10 11]
                        └── [7 8|9 9]    "1 2 3 4 7 8 9 9" shares the first node
                            [0 1|4 5]
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import torch

from .errors import CacheMisuse, InvalidArgument
from .runtime import default_device

__all__ = [
    "RadixNode", "RadixCacheHandle", "MatchResult", "InsertResult", "SizeInfo",
    "RadixPrefixCache", "as_token_list",
]


def as_token_list(input_ids, argument: str = "input_ids") -> list[int]:
    """Token ids as a Python list of ints (accepts a list, a tuple or a 1-D tensor)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 1:
            raise InvalidArgument(argument, "must be 1-D", f"got shape {tuple(input_ids.shape)}")
        return [int(t) for t in input_ids.tolist()]
    try:
        return [int(t) for t in input_ids]
    except TypeError:
        raise InvalidArgument(argument, "must be a sequence of token ids",
                              f"got {type(input_ids).__name__}") from None


class RadixNode:
    """One edge of the tree: ``len(key)`` tokens (a multiple of page_size) and their slots."""

    def __init__(self, key: tuple[int, ...], value: torch.Tensor | None, uid: int, tick: int):
        self.key: tuple[int, ...] = key
        self.value: torch.Tensor | None = value  # int32 token slots, one per key token
        self.children: dict[tuple[int, ...], RadixNode] = {}  # first page of key -> child
        self.parent: RadixNode | None = None
        self.ref_count = 0
        self.last_access = tick  # LRU order: the counter value of the last walk through here
        self.uid = uid  # creation order; breaks LRU ties deterministically
        self.detached = False  # set when the node is evicted (its handles go stale)

    @property
    def length(self) -> int:
        return len(self.key)

    def is_root(self) -> bool:
        return self.parent is None and not self.detached

    def is_leaf(self) -> bool:
        return not self.children

    def pages(self, page_size: int) -> list[tuple[int, ...]]:
        """The node's key cut into pages (what the drawings label a node with)."""
        return [self.key[i:i + page_size] for i in range(0, len(self.key), page_size)]

    def path_to_root(self) -> Iterator["RadixNode"]:
        node = self
        while node.parent is not None:
            yield node
            node = node.parent

    def depth_tokens(self) -> int:
        """Tokens from the root to the end of this node."""
        return sum(n.length for n in self.path_to_root())

    def __repr__(self) -> str:
        return (f"RadixNode(uid={self.uid}, key={list(self.key)}, ref_count={self.ref_count}, "
                f"last_access={self.last_access})")


@dataclass(frozen=True)
class RadixCacheHandle:
    """A matched or inserted prefix: the first ``cached_len`` tokens end at ``node``."""

    cached_len: int
    node: RadixNode

    def get_matched_indices(self) -> torch.Tensor:
        """The KV slots of the prefix, root first (a 1-D int32 tensor of ``cached_len`` slots)."""
        if self.node.detached:
            raise CacheMisuse("get_matched_indices: the handle's prefix was evicted; lock a handle "
                              "to keep its prefix in the cache")
        parts = [n.value for n in self.node.path_to_root()]
        parts.reverse()
        if not parts:
            return torch.empty(0, dtype=torch.int32, device=self.node.value.device)
        return torch.cat(parts)


class MatchResult(NamedTuple):
    """What :meth:`RadixPrefixCache.match_prefix` found. ``cuda_handle`` is the source's name."""

    handle: RadixCacheHandle

    @property
    def cuda_handle(self) -> RadixCacheHandle:
        return self.handle

    @property
    def cached_len(self) -> int:
        return self.handle.cached_len


class InsertResult(NamedTuple):
    """``cached_len``: tokens that were *already* cached before the insert; ``handle``: the
    inserted prefix (page-aligned, ``len(input_ids) // P * P`` tokens)."""

    cached_len: int
    handle: RadixCacheHandle


class SizeInfo(NamedTuple):
    """Cached tokens that could be evicted now, and those locked by running requests."""

    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class RadixPrefixCache:
    """Page-aligned radix tree of cached prefixes (chapter 05).

    ``evict(n)`` frees whole unlocked least-recently-used leaves until at least ``n`` tokens
    are freed, and **returns what it could** when fewer than ``n`` tokens are evictable (it
    never evicts a locked node and never raises for that): the caller decides whether that
    is enough. :class:`~kvlab.cache_manager.CacheManager` checks ``size_info.evictable_size``
    *before* evicting, so it never evicts and then fails.
    """

    def __init__(self, page_size: int, device: "torch.device | str | None" = None):
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgument("page_size", "must be a positive int", f"got {page_size!r}")
        self.page_size = page_size
        self.device = default_device(device)
        self._next_uid = 0
        self._now = 0  # monotonic, deterministic "time" for LRU: one tick per walk or insert
        self.reset()

    # --- bookkeeping ------------------------------------------------------------------

    def reset(self) -> torch.Tensor:
        """Drop every cached prefix and return their slots. Refuses while anything is locked."""
        if getattr(self, "root", None) is not None and self.protected_size > 0:
            raise CacheMisuse(f"reset: {self.protected_size} cached tokens are still locked "
                              "by running requests; unlock them first")
        freed = self.all_cached_indices() if getattr(self, "root", None) is not None else None
        self.root = RadixNode((), self._empty(), self._uid(), 0)
        self.root.ref_count = 1  # the root is always protected
        self.evictable_size = 0
        self.protected_size = 0
        return freed if freed is not None else self._empty()

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

    # --- matching ---------------------------------------------------------------------

    def _align(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _child_key(self, ids: Sequence[int], start: int) -> tuple[int, ...] | None:
        """Children are found by their first page; fewer than a page left: no child."""
        if len(ids) - start < self.page_size:
            return None
        return tuple(ids[start:start + self.page_size])

    def _split(self, node: RadixNode, pos: int) -> RadixNode:
        """Cut ``node`` at ``pos`` (a page boundary); return the new upper half."""
        assert 0 < pos < node.length and pos % self.page_size == 0
        parent = node.parent
        upper = RadixNode(node.key[:pos], node.value[:pos], self._uid(), node.last_access)
        upper.ref_count = node.ref_count  # every lock through node also runs through upper
        del parent.children[node.key[:self.page_size]]
        parent.children[upper.key[:self.page_size]] = upper
        upper.parent = parent
        node.key, node.value = node.key[pos:], node.value[pos:]
        upper.children[node.key[:self.page_size]] = node
        node.parent = upper
        return upper

    def _walk(self, ids: Sequence[int], *, touch: bool = True) -> tuple[RadixNode, int]:
        """Follow ``ids`` down the tree; split the last node if it matches only partly.

        ``touch=False`` only measures the match: no split, no LRU update (the node returned is
        then the last one matched whole)."""
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
            if touch:
                child.last_access = now
            if n < child.length:
                return (self._split(child, n) if touch else node), prefix_len
            node = child

    def match_prefix(self, input_ids) -> MatchResult:
        """The longest cached page-aligned prefix of ``input_ids`` (touches it for LRU)."""
        ids = as_token_list(input_ids)
        node, prefix_len = self._walk(ids)
        return MatchResult(RadixCacheHandle(prefix_len, node))

    # --- inserting --------------------------------------------------------------------

    def insert_prefix(self, input_ids, indices) -> InsertResult:
        """Cache the whole pages of ``input_ids`` with their slots ``indices``.

        Returns ``(cached_len, handle)``: how many tokens were cached *before* (those slots
        of ``indices`` are duplicates the caller still owns), and a handle for the
        ``len(input_ids) // page_size * page_size`` inserted tokens. The new node is
        unlocked (evictable) until someone locks the handle.
        """
        ids = as_token_list(input_ids)
        if not isinstance(indices, torch.Tensor):
            indices = torch.as_tensor(list(indices), dtype=torch.int32)
        if indices.dim() != 1 or indices.numel() != len(ids):
            raise InvalidArgument("indices", "one slot per token: len(indices) == len(input_ids)",
                                  f"got {indices.numel()} slots for {len(ids)} tokens")
        insert_len = self._align(len(ids))
        ids = ids[:insert_len]
        # check the slots to insert before the walk that splits a node and touches the LRU
        # order: a refused insert leaves the tree exactly as it was
        _, prefix_len = self._walk(ids, touch=False)
        new_value = indices[prefix_len:insert_len].to(device=self.device, dtype=torch.int32)
        self._check_whole_pages(new_value)
        node, prefix_len = self._walk(ids)
        if prefix_len < insert_len:
            new_node = RadixNode(tuple(ids[prefix_len:]), new_value.clone(), self._uid(),
                                 self._tick())
            new_node.parent = node
            node.children[new_node.key[:self.page_size]] = new_node
            self.evictable_size += new_node.length
            node = new_node
        return InsertResult(prefix_len, RadixCacheHandle(insert_len, node))

    def _check_whole_pages(self, slots: torch.Tensor) -> None:
        """Each page of slots must be one physical page: p*P, p*P+1, ..., p*P+P-1."""
        P = self.page_size
        if P == 1 or slots.numel() == 0:
            return
        pages = slots.view(-1, P).to(torch.int64)
        starts = pages[:, :1]
        ok = bool(((starts % P) == 0).all()) and bool(
            (pages == starts + torch.arange(P, device=pages.device)).all())
        if not ok:
            raise InvalidArgument("indices", "each page of slots must be one whole physical page "
                                  f"(p*{P}, p*{P}+1, ..., p*{P}+{P - 1})",
                                  f"got {slots.tolist()[:2 * P]}...")

    # --- locking ----------------------------------------------------------------------

    def lock_handle(self, handle: RadixCacheHandle, unlock: bool = False) -> None:
        """Add (or with ``unlock=True`` remove) one reference on every node from ``handle``'s
        node up to the root. Locked nodes are *protected*: never evicted."""
        if not isinstance(handle, RadixCacheHandle):
            raise InvalidArgument("handle", "must be a RadixCacheHandle from this cache",
                                  f"got {type(handle).__name__}")
        path = list(handle.node.path_to_root())
        if handle.node.detached or (path and path[-1].parent is not self.root):
            raise CacheMisuse("lock_handle: the handle's prefix is no longer in this cache "
                              "(it was evicted, or the handle belongs to another cache); "
                              "lock a handle right after match_prefix/insert_prefix")
        if unlock:
            unlocked = [n for n in path if n.ref_count <= 0]
            if unlocked:
                raise CacheMisuse(f"lock_handle(unlock=True): the handle is not locked "
                                  f"(node {unlocked[0].uid} has ref_count 0); every unlock "
                                  "must match an earlier lock")
            for node in path:
                node.ref_count -= 1
                if node.ref_count == 0:
                    self.evictable_size += node.length
                    self.protected_size -= node.length
        else:
            for node in path:
                if node.ref_count == 0:
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                node.ref_count += 1

    # --- eviction ---------------------------------------------------------------------

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free whole unlocked leaves, least recently used first, until ``num_tokens`` tokens
        are freed; return their token slots (page-aligned runs of ``page_size``).

        May free more than asked (a leaf goes whole). If fewer than ``num_tokens`` tokens are
        evictable it frees all of them and returns those: check ``size_info`` first when you
        need a guarantee.
        """
        if num_tokens <= 0:
            return self._empty()
        heap = [(n.last_access, n.uid, n) for n in self.nodes() if n.is_leaf() and n.ref_count == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        n_freed = 0
        while n_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key[:self.page_size]]
            node.parent, node.detached = None, True
            freed.append(node.value)
            n_freed += node.length
            self.evictable_size -= node.length
            if parent is not self.root and parent.is_leaf() and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return torch.cat(freed) if freed else self._empty()

    # --- checks -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Sizes add up; ref counts never exceed the parent's; keys are page-aligned."""
        from .errors import IntegrityError

        evictable = protected = 0
        for node in self.nodes():
            if node.length == 0 or node.length % self.page_size:
                raise IntegrityError(f"node {node.uid} has {node.length} tokens, "
                                     f"not a positive multiple of page_size {self.page_size}")
            if node.value is None or node.value.numel() != node.length:
                raise IntegrityError(f"node {node.uid}: key and value lengths differ")
            if node.parent is not self.root and node.ref_count > node.parent.ref_count:
                raise IntegrityError(f"node {node.uid} is locked {node.ref_count}x but its parent "
                                     f"only {node.parent.ref_count}x")
            if node.ref_count < 0:
                raise IntegrityError(f"node {node.uid} has negative ref_count")
            if node.ref_count == 0:
                evictable += node.length
            else:
                protected += node.length
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise IntegrityError(
                f"size_info says evictable={self.evictable_size}, protected={self.protected_size} "
                f"but the nodes add up to evictable={evictable}, protected={protected}")
