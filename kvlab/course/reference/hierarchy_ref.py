"""Plain-Python oracle for the KV hierarchy (chapter 13): eviction plans, load-back plans, disk
keys and the rule for trusting a stored page.

Everything here works on plain data: a node of the tree is anything with the attributes ``uid``,
``parent`` (a uid, or ``None`` under the root), ``num_pages``, ``device_pages`` (a tuple, empty
when the node is not on the device), ``host_pages`` (likewise for host memory), ``ref_count``,
``last_access`` and ``pinned`` (an in-flight load-back reads its host pages). Slow and obviously
right: the tests and the checkers compare :mod:`kvlab.prefix` with it. It keeps its own copies
of the small helpers (the chained hash among them): an oracle must not share a bug with the code
it checks.
"""
from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple, Sequence

from ...base.errors import InvalidArgument

#: the write policies: when a device page gets its host copy
WRITE_POLICIES_REF = ("write_through", "write_through_selective", "write_back")
#: what a file header of the disk store holds (see kvlab.prefix.disk_store)
HEADER_FIELDS_REF = ("model", "dtype", "shape", "page_size", "page_hash", "payload_bytes", "checksum")


class EvictionPlanRef(NamedTuple):
    """``victims``: ``(uid, action)`` in eviction order, action ``"copy"`` (write it back to host
    memory first), ``"drop"`` (its host copy stays; the device copy goes) or ``"forget"`` (no
    copy anywhere: the node leaves the tree); ``spills``: host-only leaves whose host pages are
    freed for the copies (to disk when there is a disk tier), in the order they go; ``discarded``:
    the host-only nodes under a forgotten victim, which leave the tree with it."""

    victims: tuple[tuple[int, str], ...]
    spills: tuple[int, ...]
    discarded: tuple[int, ...] = ()


def _children(nodes) -> dict:
    kids: dict = {}
    for n in nodes:
        kids.setdefault(n.parent, []).append(n)
    return kids


def eviction_plan_ref(nodes: Sequence, need_pages: int, host_free: int, policy: str,
                      host_tier: bool = True) -> EvictionPlanRef:
    """Free at least ``need_pages`` device pages, least recently used first.

    A victim is a node on the device, unlocked, none of whose children is on the device (children
    are evicted first); whole nodes go, oldest ``(last_access, uid)`` first, until enough pages
    are freed or none is left. A victim with a host copy is *clean*: ``"drop"``. A *dirty* one
    (no host copy) is ``"copy"`` under ``"write_back"`` when host memory has room, else
    ``"forget"`` (under the write-through policies a node without its copy was not worth one).
    Host room: ``host_free`` pages, plus those of host-only leaves that no load-back reads
    (``pinned``), spilled oldest first as the copies need them, never one of this plan's victims;
    the copies take the room in eviction order (the first ones first). A forgotten victim takes
    every node under it still in the tree along (``discarded``: host-only ones, and victims
    before it that kept only their host copy)."""
    if policy not in WRITE_POLICIES_REF:
        raise InvalidArgument("policy", f"one of {WRITE_POLICIES_REF}", f"got {policy!r}")
    kids = _children(nodes)
    on_device = {n.uid for n in nodes if n.device_pages}
    victims: list = []
    freed = 0
    while freed < need_pages:
        chosen = {v.uid for v in victims}
        candidates = [n for n in nodes if n.uid in on_device and n.uid not in chosen and n.ref_count == 0
                      and not any(c.uid in on_device and c.uid not in chosen for c in kids.get(n.uid, []))]
        if not candidates:
            break
        victim = min(candidates, key=lambda n: (n.last_access, n.uid))
        victims.append(victim)
        freed += victim.num_pages
    want = sum(v.num_pages for v in victims if not v.host_pages) if policy == "write_back" and host_tier else 0
    spills: list[int] = []
    room = host_free
    gone = set()
    while room < want:
        leaves = [n for n in nodes if n.uid not in on_device and n.host_pages and n.uid not in gone
                  and not n.pinned and all(c.uid in gone for c in kids.get(n.uid, []))]
        if not leaves:
            break
        leaf = min(leaves, key=lambda n: (n.last_access, n.uid))
        gone.add(leaf.uid)
        spills.append(leaf.uid)
        room += leaf.num_pages
    actions, discarded, forgotten = [], [], set()
    for v in victims:
        if v.host_pages:
            actions.append((v.uid, "drop"))
        elif policy == "write_back" and host_tier and v.num_pages <= room:
            room -= v.num_pages
            actions.append((v.uid, "copy"))
        else:
            actions.append((v.uid, "forget"))
            forgotten.add(v.uid)
            below = list(kids.get(v.uid, []))
            while below:
                n = below.pop()
                if n.uid not in gone and n.uid not in forgotten and n.uid not in discarded:
                    discarded.append(n.uid)
                    below.extend(kids.get(n.uid, []))
    return EvictionPlanRef(tuple(actions), tuple(spills), tuple(discarded))


class LoadBackPlanRef(NamedTuple):
    """``device_pages``: the pages a load-back takes (the first of the free list, in order);
    ``copies``: ``(host page, device page)`` per page loaded, in position order; ``slots``: the
    row's device slots for the positions loaded."""

    device_pages: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    slots: tuple[int, ...]


def load_back_plan_ref(path: Sequence, free_slots: Sequence[int], page_size: int) -> LoadBackPlanRef:
    """The plan for a match along ``path`` (the matched nodes, root first): its nodes on the
    device are hits already; every node after them holds its pages on the host only, and each of
    those pages is copied into a new device page. ``free_slots`` is the manager's free list: the
    *first slot* of each free page (``page * page_size``), taken from the front."""
    P = page_size
    host_pages: list[int] = []
    for n in path:
        if n.device_pages:
            if host_pages:
                raise InvalidArgument("path", "the device part first (a node on the device under a "
                                      "host-only one cannot be)", f"node {n.uid}")
            continue
        if not n.host_pages:
            break
        host_pages.extend(n.host_pages)
    if len(host_pages) > len(free_slots):
        raise InvalidArgument("free_slots", f"at least {len(host_pages)} free pages", f"got {len(free_slots)}")
    device = [s // P for s in list(free_slots)[: len(host_pages)]]
    slots = [d * P + i for d in device for i in range(P)]
    return LoadBackPlanRef(tuple(device), tuple(zip(host_pages, device)), tuple(slots))


# --- the disk tier: keys and trust --------------------------------------------------------------


def chain_hash_ref(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chapter 11's chained page hash, restated: BLAKE2b-128 over the parent's hash and the page's
    token ids as little-endian int64."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *[int(t) for t in tokens]))
    return h.digest()


def disk_key_ref(model: str, page_hash: bytes) -> str:
    """The file name of a page: BLAKE2b-128 of the model's identity, a zero byte and the page's
    chained hash, in hex. The same tokens under another model get another key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(model.encode())
    h.update(b"\0")
    h.update(page_hash)
    return h.hexdigest()


def page_keys_ref(model: str, input_ids: Sequence[int], page_size: int) -> list[str]:
    """The disk key of every whole page of ``input_ids`` (a partial last page has none)."""
    keys, parent = [], None
    for start in range(0, len(input_ids) // page_size * page_size, page_size):
        parent = chain_hash_ref(parent, input_ids[start:start + page_size])
        keys.append(disk_key_ref(model, parent))
    return keys


def trusted_ref(identity, parent: bytes | None, tokens: Sequence[int], header: dict,
                payload: bytes) -> str:
    """Why a stored page may not be loaded, or ``""`` when it may. ``identity`` has ``model``,
    ``dtype``, ``shape`` (a page's tensor shape) and ``page_size``; the page is ``tokens`` after
    the page whose chained hash is ``parent``. Every field of the header must be the one this
    model and this page would write, and the payload must be exactly ``payload_bytes`` long and
    hash (BLAKE2b-128, hex) to the header's checksum, computed from the bytes read now."""
    if not isinstance(header, dict) or not set(HEADER_FIELDS_REF) <= set(header):
        return "header"
    if header["model"] != identity.model:
        return "model"
    if header["dtype"] != identity.dtype or tuple(header["shape"]) != tuple(identity.shape):
        return "layout"
    if header["page_size"] != identity.page_size or len(tokens) != identity.page_size:
        return "layout"
    if header["page_hash"] != chain_hash_ref(parent, tokens).hex():
        return "page_hash"
    size = 1
    for d in identity.shape:
        size *= d
    if header["payload_bytes"] != size * identity.itemsize or len(payload) != header["payload_bytes"]:
        return "length"
    if hashlib.blake2b(bytes(payload), digest_size=16).hexdigest() != header["checksum"]:
        return "checksum"
    return ""
