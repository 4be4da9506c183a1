"""Arguments a learner's function must only read: a copy before the call, a comparison after.

A function can return the right answer and still change what it was given: ``input_ids.pop()``,
``row_slots[p] = ...; return row_slots``, ``q *= scale``. The caller's data is then wrong, and no
comparison of results shows it. A checker names the arguments its exercise's statement calls
read-only (``call_learner(..., read_only=(0, 1))``); :func:`freeze` copies each one before the
call and :func:`first_change` says in words how it changed::

    argument        what is compared                       how a change is told
    tensor          shape, dtype, every value (NaN = NaN)  "q[1, 0, 3] was 0.52, now 0.18 (16 of 64 changed)"
    list, dict      every item, deep                       "input_ids had 12 items, now 11: the last one (7) is gone"
    prefix cache    every node (key, slots, locks, LRU     "node [5, 6] (positions 4..5): its LRU stamp
                    stamp, parent), the clock, the sizes    last_access was 2, now 3"
    hash cache      every page (ref_count, hash, parent,   "page 3: its reference count ref_count was
                    tokens), hash_to_page, the free queue   0, now 1" (:mod:`kvlab.course.checking.pool_state`)
                    in order, evicted_pages, the locks

:func:`tree_state` and :func:`tree_difference` also compare a learner's tree with the
reference's (chapter 07's decode step).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import torch

from ...prefix.hash_cache import HashPrefixCache
from ...prefix.radix_cache import RadixPrefixCache
from .failures import fmt_values
from .pool_state import PoolState, pool_difference, pool_state


class NodeState(NamedTuple):
    """One node of a prefix cache, named by its path (the tokens from the root to its end)."""

    key: tuple[int, ...]
    slots: tuple[int, ...]
    ref_count: int
    last_access: int


class TreeState(NamedTuple):
    """A whole prefix cache as plain data: what a read-only walk must leave exactly as it was."""

    page_size: int
    nodes: dict  # path (tuple of tokens) -> NodeState
    clock: int
    evictable_size: int
    protected_size: int
    locks: tuple  # sorted (owner, path, count)


def tree_state(cache: RadixPrefixCache, owner: Callable[[Any], Hashable] = id) -> TreeState:
    """Every node, the LRU clock, the sizes and the locks (owners told by ``owner(obj)``)."""
    nodes, paths = {}, {id(cache.root): ()}
    for node in cache.nodes():  # parents before children
        path = paths[id(node.parent)] + tuple(node.key)
        paths[id(node)] = path
        nodes[path] = NodeState(tuple(node.key), tuple(int(s) for s in node.value.tolist()),
                                node.ref_count, node.last_access)
    locks = tuple(sorted((str(owner(who)), paths.get(id(node), ("?",)), count)
                         for (who, node), count in getattr(cache, "_locks", {}).items()))
    return TreeState(cache.page_size, nodes, cache.clock, cache.evictable_size,
                     cache.protected_size, locks)


def _node_name(path: tuple, node: NodeState) -> str:
    start = len(path) - len(node.key)
    return f"node {fmt_values(node.key, 8)} (positions {start}..{len(path) - 1})"


_FIELDS = {"key": "its key", "slots": "its slots", "ref_count": "its lock count ref_count",
           "last_access": "its LRU stamp last_access"}


def tree_difference(before: TreeState, after: TreeState, *, old: str = "was",
                    new: str = "now") -> str | None:
    """The first way ``after`` differs from ``before``, in words; None when they are equal.
    ``old``/``new`` word the two sides ("was 2, now 3"; "should be 2, is 3")."""
    gone = [p for p in before.nodes if p not in after.nodes]
    added = [p for p in after.nodes if p not in before.nodes]
    if added:
        what = "a node split in two" if gone else "an extra node"
        return f"{what}: {_node_name(added[0], after.nodes[added[0]])}"
    if gone:
        return f"{_node_name(gone[0], before.nodes[gone[0]])} is missing"
    for path, was in before.nodes.items():
        cur = after.nodes[path]
        for field, words in _FIELDS.items():
            if getattr(was, field) != getattr(cur, field):
                return (f"{_node_name(path, was)}: {words} {old} {getattr(was, field)}, "
                        f"{new} {getattr(cur, field)}")
    if before.clock != after.clock:
        return (f"the LRU clock {old} {before.clock}, {new} {after.clock} (it ticks once per "
                "match_prefix or insert_prefix call)")
    for field in ("evictable_size", "protected_size", "locks"):
        if getattr(before, field) != getattr(after, field):
            return f"{field} {old} {getattr(before, field)}, {new} {getattr(after, field)}"
    return None


# --- read-only arguments ---------------------------------------------------------------------


class Frozen(NamedTuple):
    """A read-only argument as it was before the call."""

    name: str
    value: Any  # the caller's object (the learner got this one, or a view of it)
    copy: Any  # its contents then


_UNCHECKED = object()


def freeze(name: str, value: Any) -> Frozen:
    if isinstance(value, torch.Tensor):
        return Frozen(name, value, value.detach().clone())
    if isinstance(value, RadixPrefixCache):
        return Frozen(name, value, tree_state(value))
    if isinstance(value, HashPrefixCache):
        return Frozen(name, value, pool_state(value))
    if isinstance(value, (list, tuple, dict, set, int, float, str, bool, type(None))):
        return Frozen(name, value, copy.deepcopy(value))
    return Frozen(name, value, _UNCHECKED)  # an object kvlab cannot copy: not compared


def freeze_args(names: list[str], args: tuple, kwargs: dict, read_only) -> list[Frozen]:
    """Copies of the read-only arguments (positions in ``args`` or keyword names), named as
    the learner's function names them (``names``: its parameters)."""
    frozen = []
    for which in read_only:
        if isinstance(which, int) and which < len(args):
            name = names[which] if which < len(names) else f"argument {which + 1}"
            frozen.append(freeze(name, args[which]))
        elif isinstance(which, str) and which in kwargs:
            frozen.append(freeze(which, kwargs[which]))
    return frozen


def first_change(frozen: Frozen) -> str | None:
    """How the argument changed since :func:`freeze`, in words; None when it did not."""
    name, value, old = frozen
    if old is _UNCHECKED:
        return None
    if isinstance(value, torch.Tensor):
        return _tensor_change(name, old, value)
    if isinstance(value, RadixPrefixCache):
        return tree_difference(old, tree_state(value))
    if isinstance(value, HashPrefixCache):
        try:
            return pool_difference(old, pool_state(value))
        except Exception as e:  # noqa: BLE001 - the learner broke its state beyond reading
            return f"`{name}` can no longer be read as a cache: {type(e).__name__}: {e}"
    return _plain_change(name, old, value)


def _tensor_change(name: str, old: torch.Tensor, new: torch.Tensor) -> str | None:
    if new.shape != old.shape or new.dtype != old.dtype:
        return (f"`{name}` was {tuple(old.shape)} {old.dtype}, now {tuple(new.shape)} {new.dtype}")
    a, b = old.detach().cpu(), new.detach().cpu()
    same = a == b
    if a.dtype.is_floating_point or a.dtype.is_complex:
        same |= torch.isnan(a) & torch.isnan(b)
    if bool(same.all()):
        return None
    wrong = (~same).nonzero()
    at = tuple(int(i) for i in wrong[0])
    where = f"{name}[{', '.join(map(str, at))}]" if at else name
    return (f"{where} was {_item(a[at])}, now {_item(b[at])} ({len(wrong)} of {a.numel()} "
            "values changed)")


def _item(x: torch.Tensor) -> str:
    v = x.item()
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _plain_change(name: str, old: Any, new: Any) -> str | None:
    try:
        if old == new and type(old) is type(new):
            return None
    except Exception:  # noqa: BLE001 - e.g. tensors inside: compare item by item below
        pass
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        if len(new) != len(old):
            gone = [x for x in old if x not in new][:3]
            return (f"`{name}` had {len(old)} item{'s' * (len(old) != 1)}, now {len(new)}"
                    + (f": {gone} {'is' if len(gone) == 1 else 'are'} gone" if gone else ""))
        fields = getattr(type(old), "_fields", None)   # a NamedTuple: its fields by name
        if fields is None and _reordered(old, new):
            i = next(j for j, (a, b) in enumerate(zip(old, new)) if _differs(a, b))
            return (f"`{name}` holds the same items in another order (sorted or reversed in place?): "
                    f"`{name}[{i}]` was {_short(old[i])}, now {_short(new[i])}")
        for i, (a, b) in enumerate(zip(old, new)):
            why = _plain_change(f"{name}.{fields[i]}" if fields else f"{name}[{i}]", a, b)
            if why:
                return why
    if isinstance(old, dict) and isinstance(new, dict):
        for k in old:
            if k not in new:
                return f"`{name}` lost the key {_short(k)}"
        for k in new:
            if k not in old:
                return f"`{name}` has a new key {_short(k)}"
        for k in old:
            why = _plain_change(f"{name}[{_short(k)}]", old[k], new[k])
            if why:
                return why
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        return _tensor_change(name, old, new)
    try:
        if old == new and type(old) is type(new):
            return None
    except Exception:  # noqa: BLE001
        pass
    return f"`{name}` was {_short(old)}, now {_short(new)}"


def _differs(a: Any, b: Any) -> bool:
    try:
        return not (a == b and type(a) is type(b))
    except Exception:  # noqa: BLE001 - e.g. tensors inside: count it as changed
        return True


def _reordered(old: Sequence, new: Sequence) -> bool:
    """The same items (by their repr), not in the same order."""
    try:
        return sorted(map(repr, old)) == sorted(map(repr, new)) and any(map(_differs, old, new))
    except Exception:  # noqa: BLE001
        return False


def _short(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_ADVICE = {
    "tree": "Only read the tree (cache.root, node.children, node.key): match_prefix and "
            "insert_prefix stamp the nodes they use, tick the clock and may split a node",
    "pool": "Only read the cache (cache.lookup, cache.page_size, cache.ref_count): take_cached, "
            "take_free, cache_page, allocate and free change it, and so does moving a page in "
            "cache.free_queue (its order is the eviction order)",
    "plain": "Work on a copy (list(x), x.clone()) or build a new result",
}


def message(changes: list[tuple[str, str]], frozen: list[Frozen] = ()) -> str:
    """The finding: which read-only arguments changed (``(name, how)`` pairs), and how.
    ``frozen``: the copies, to advise on the kind of argument that changed."""
    names = ", ".join(f"`{name}`" for name, _ in changes)
    lines = "".join(f"\n  {how}" for _, how in changes)
    one = len(changes) == 1
    kinds = {type(f.copy) for f in frozen if f.name in dict(changes)}
    advice = _ADVICE["tree" if TreeState in kinds else "pool" if PoolState in kinds else "plain"]
    return (f"your code changed {names}, {'an argument' if one else 'arguments'} it must only "
            f"read:{lines}\n  {'It is an input' if one else 'They are inputs'} your function must "
            f"not change: the caller still uses it afterwards. {advice}")
