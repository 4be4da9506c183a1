"""What the KV hierarchy decides, as plain functions of plain data (chapter 13): which nodes an
eviction frees and how, and what a load-back copies where.

:class:`~kvlab.prefix.tiered_cache.TieredRadixCache` takes every decision through these two
functions, on a snapshot of its nodes (:class:`TierNode` records), so the chapter's exercises
and the cache cannot disagree. A node is *on the device* when it has device pages, *on the host*
when it has host pages; the device part of the tree is closed under parents (a node on the
device has its parent there too), and a node that is nowhere leaves the tree::

    root ── A [dev 3 7 | host 0 1] ── B [dev 9 | host -] ── C [dev - | host 5 6]
            clean: eviction drops      dirty: write-back      host only: a hit loads it
            the device copy only       copies it first        back into new device pages

SGLang's ``HiRadixCache.evict`` (``python/sglang/srt/mem_cache/hiradix_cache.py``, ``263bc85d``)
pops device leaves by priority (LRU), evicts a backed-up one with ``_evict_backuped`` (the node
stays, ``value = None``), writes a dirty one back under ``write_back`` and deletes it otherwise
(``_evict_regular``); ``evict_host`` frees only the host copies of nodes already off the device,
leaves first, skipping any with ``host_ref_counter > 0`` (a prefetch or a backup in flight).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from ..base.errors import InvalidArgument

__all__ = ["TierNode", "EvictionPlan", "eviction_plan", "LoadBackPlan", "load_back_plan", "ACTIONS"]

#: what an eviction does to a victim
ACTIONS = ("copy", "drop", "forget")


class TierNode(NamedTuple):
    """A node of the tiered tree as plain data."""

    uid: int
    parent: int | None              # None for a child of the root
    num_pages: int
    device_pages: tuple[int, ...]   # () when not on the device
    host_pages: tuple[int, ...]     # () when it has no host copy
    ref_count: int = 0              # locks on it or below it
    last_access: int = 0
    pinned: bool = False            # a load-back in flight reads its host pages
    pages: tuple = ()               # its tokens, page by page (for drawings)
    hits: int = 0


class EvictionPlan(NamedTuple):
    """``victims``: ``(uid, action)`` in eviction order; ``spills``: host-only leaves whose host
    pages go to make room for the copies (to disk when there is one), in order; ``discarded``:
    the nodes left under a forgotten victim, which leave the tree with it."""

    victims: tuple[tuple[int, str], ...]
    spills: tuple[int, ...]
    discarded: tuple[int, ...] = ()

    @property
    def copies(self) -> tuple[int, ...]:
        return tuple(u for u, a in self.victims if a == "copy")


def _kids(nodes: Sequence[TierNode]) -> dict:
    kids: dict = {}
    for n in nodes:
        kids.setdefault(n.parent, []).append(n)
    return kids


def _lru(candidates):
    return min(candidates, key=lambda n: (n.last_access, n.uid))


def eviction_plan(nodes: Sequence[TierNode], need_pages: int, host_free: int, policy,
                  host_tier: bool = True) -> EvictionPlan:
    """Free at least ``need_pages`` device pages (``policy``: a write policy or its name).

    1. Victims, least recently used ``(last_access, uid)`` first, until enough pages are freed:
       nodes on the device, unlocked, none of whose children is still on the device.
    2. Each clean victim (it has a host copy) is ``"drop"``; a dirty one is ``"copy"`` under a
       write-back policy while host memory has room, else ``"forget"``.
    3. Room for the copies: ``host_free`` pages, then host-only leaves that no load-back reads,
       oldest first, spilled until the copies fit; the copies take the room in eviction order.
    4. A forgotten victim takes what is left under it along (``discarded``: host-only nodes, and
       victims before it that kept only their host copy).
    """
    from .write_policy import make_write_policy

    at_eviction = make_write_policy(policy, "policy").at_eviction and host_tier
    kids = _kids(nodes)
    device = {n.uid for n in nodes if n.device_pages}
    victims: list[TierNode] = []
    chosen: set[int] = set()
    freed = 0
    while freed < need_pages:
        candidates = [n for n in nodes if n.uid in device and n.uid not in chosen and n.ref_count == 0
                      and all(c.uid not in device or c.uid in chosen for c in kids.get(n.uid, ()))]
        if not candidates:
            break
        victim = _lru(candidates)
        victims.append(victim)
        chosen.add(victim.uid)
        freed += victim.num_pages
    want = sum(v.num_pages for v in victims if not v.host_pages) if at_eviction else 0
    spills, gone, room = [], set(), host_free
    while room < want:
        leaves = [n for n in nodes if n.uid not in device and n.host_pages and n.uid not in gone
                  and not n.pinned and all(c.uid in gone for c in kids.get(n.uid, ()))]
        if not leaves:
            break
        leaf = _lru(leaves)
        gone.add(leaf.uid)
        spills.append(leaf.uid)
        room += leaf.num_pages
    actions, discarded, forgotten = [], [], set()
    for v in victims:
        if v.host_pages:
            actions.append((v.uid, "drop"))
        elif at_eviction and v.num_pages <= room:
            room -= v.num_pages
            actions.append((v.uid, "copy"))
        else:
            actions.append((v.uid, "forget"))
            forgotten.add(v.uid)
            stack = list(kids.get(v.uid, ()))
            while stack:
                n = stack.pop()
                if n.uid not in gone and n.uid not in forgotten and n.uid not in discarded:
                    discarded.append(n.uid)
                    stack.extend(kids.get(n.uid, ()))
    return EvictionPlan(tuple(actions), tuple(spills), tuple(discarded))


class LoadBackPlan(NamedTuple):
    """``device_pages``: the pages a load-back takes (the front of the free list, in order);
    ``copies``: ``(host page, device page)`` per page, in position order; ``slots``: the row's
    device slots for the positions it loads."""

    device_pages: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    slots: tuple[int, ...]


def load_back_plan(path: Sequence[TierNode], free_slots: Sequence[int], page_size: int) -> LoadBackPlan:
    """The load-back of a match along ``path`` (its nodes, root first): the nodes on the device
    are hits as they are; each page of the host-only nodes after them is copied into a page taken
    from the front of ``free_slots`` (the manager's free list: each free page's first slot)."""
    P = page_size
    host: list[int] = []
    for n in path:
        if n.device_pages:
            if host:
                raise InvalidArgument("path", "the nodes on the device first", f"node {n.uid} follows host-only ones")
            continue
        if not n.host_pages:
            break
        host.extend(n.host_pages)
    free = [int(s) for s in free_slots]
    if len(host) > len(free):
        raise InvalidArgument("free_slots", f"at least {len(host)} free pages", f"got {len(free)}")
    device = [s // P for s in free[: len(host)]]
    slots = tuple(d * P + i for d in device for i in range(P))
    return LoadBackPlan(tuple(device), tuple(zip(host, device)), slots)
