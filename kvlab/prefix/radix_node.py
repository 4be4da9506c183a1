"""The pieces of the radix prefix cache (chapter 05): its nodes, the handles it hands out, and
the plain-data results and snapshots of its public calls.

:class:`~kvlab.prefix.radix_cache.RadixPrefixCache` is the tree that uses them. Everything here except
:class:`RadixNode` is plain data (named tuples and a frozen dataclass): safe to keep, compare
and draw after the cache has moved on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch

from ..base.errors import CacheMisuse

__all__ = ["RadixNode", "RadixCacheHandle", "MatchResult", "InsertResult", "SizeInfo", "NodeInfo",
           "TreeSnapshot"]


class RadixNode:
    """One edge of the tree: ``len(key)`` tokens (a multiple of page_size) and their slots."""

    def __init__(self, key: tuple[int, ...], value: torch.Tensor, uid: int, tick: int):
        self.key: tuple[int, ...] = key
        self.value: torch.Tensor = value  # int32 token slots, one per key token
        self.children: dict[tuple[int, ...], RadixNode] = {}  # first page of key -> child
        self.parent: RadixNode | None = None  # kept after eviction, so an eviction can be undone
        self.ref_count = 0  # locks held on this node or on any node below it
        self.last_access = tick  # LRU order: the clock value of the last match that used it
        self.uid = uid  # creation order; breaks LRU ties deterministically
        self.detached = False  # set when the node is evicted (its handles go stale)

    @property
    def length(self) -> int:
        return len(self.key)

    def is_leaf(self) -> bool:
        return not self.children

    def pages(self, page_size: int) -> list[tuple[int, ...]]:
        """The node's key cut into pages (what the drawings label a node with)."""
        return [self.key[i:i + page_size] for i in range(0, len(self.key), page_size)]

    def path_to_root(self) -> Iterator["RadixNode"]:
        """This node and its ancestors, up to (not including) the root."""
        node = self
        while node.parent is not None:
            yield node
            node = node.parent

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


class NodeInfo(NamedTuple):
    """A node as it was when the snapshot was taken."""

    uid: int
    parent: int | None  # uid of the parent; None for children of the root
    pages: tuple[tuple[int, ...], ...]  # key, page by page
    page_ids: tuple[int, ...]  # physical page of each key page
    ref_count: int
    last_access: int


class TreeSnapshot(NamedTuple):
    """The whole tree as plain data (:meth:`RadixPrefixCache.snapshot`); ``kvlab.course.viz`` draws it."""

    page_size: int
    nodes: tuple[NodeInfo, ...]  # parents before children
    clock: int  # the cache's access counter when the snapshot was taken
    evictable_size: int
    protected_size: int
