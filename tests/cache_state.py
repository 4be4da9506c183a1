"""Every piece of a cache manager's state, as plain data, for "a refused call changes nothing".

Shared by the cache-manager tests and the state machine. It reads private fields on purpose:
the point is to see *everything* a call could have changed, not only what the API shows.
"""
from __future__ import annotations

import kvlab.manager.cache_manager
import kvlab.manager.rules
import kvlab.manager.undo
import kvlab.manager.cache_regions
import kvlab.prefix.hash_cache
import kvlab.prefix.hash_cache_undo
import kvlab.prefix.hash_cache_views
import kvlab.prefix.hash_chain
import kvlab.prefix.radix_cache
import kvlab.prefix.radix_node
import kvlab.manager.req

#: the cache manager and both prefix caches: tests interrupt a call at any line run in these
MANAGER_MODULES = [kvlab.manager.cache_manager, kvlab.manager.rules, kvlab.manager.undo,
                   kvlab.manager.cache_regions, kvlab.manager.req, kvlab.prefix.radix_cache, kvlab.prefix.radix_node, kvlab.prefix.hash_cache,
                   kvlab.prefix.hash_cache_undo, kvlab.prefix.hash_cache_views, kvlab.prefix.hash_chain]


def cache_state(cache, *, stamps: bool = True) -> dict:
    """The radix tree node by node, its sizes, its clock and who holds which lock.

    ``stamps=False`` leaves out the LRU stamps, the clock and node boundaries (a match splits a
    node and stamps what it used, and that is all it changes): the tree is then compared page
    by page, as ``(token path to the page's end, slots, ref_count)``.

    The hash cache (chapter 11), whose match changes nothing, is compared whole either way:
    :func:`hash_cache_state`.
    """
    if hasattr(cache, "free_queue"):
        return hash_cache_state(cache)
    locks = sorted((id(owner), node.uid, count) for (owner, node), count in getattr(cache, "_locks", {}).items())
    if stamps:
        nodes = [(n.uid, n.key, tuple(n.value.tolist()), n.ref_count, n.last_access,
                  None if n.parent is cache.root else n.parent.uid) for n in cache.nodes()]
        return dict(nodes=nodes, size=tuple(cache.size_info), clock=cache.clock, locks=locks)
    pages = []
    for node in cache.nodes():
        path = [t for n in reversed(list(node.path_to_root())) for t in n.key]
        start = len(path) - node.length
        values = node.value.tolist()
        for p in range(0, node.length, cache.page_size):
            pages.append((tuple(path[: start + p + cache.page_size]),
                          tuple(values[p: p + cache.page_size]), node.ref_count))
    locked = sorted((id(owner), len([t for n in node.path_to_root() for t in n.key]), count)
                    for (owner, node), count in getattr(cache, "_locks", {}).items())
    return dict(pages=sorted(pages), size=tuple(cache.size_info), locks=locked)


def hash_cache_state(cache) -> dict:
    """Every page's reference count, hash, parent hash and tokens, ``hash_to_page``, the free
    queue in its order (the LRU list), the eviction count, the sizes and who holds which lock."""
    locks = sorted((id(owner), pages, count) for (owner, pages), count in cache._locks.items())
    return dict(refs=list(cache.ref_count), hashes=list(cache.page_hash), parents=list(cache.page_parent),
                tokens=list(cache.page_tokens), map=dict(cache.hash_to_page), queue=list(cache.free_queue),
                evicted=cache.evicted_pages, size=tuple(cache.size_info), locks=locks)


def req_state(req) -> tuple:
    return (id(req), tuple(req.input_ids), req.table_idx, req.cached_len, req.device_len,
            req.cache_handle, req.finished, req.prompt_len)


def manager_state(cm, reqs=(), *, stamps: bool = True) -> dict:
    """Free list (in order), page table, tree, running rows and the given requests' fields."""
    return dict(
        free=cm.free_slots.tolist(),
        table=cm.page_table.tolist(),
        cache=cache_state(cm.prefix_cache, stamps=stamps),
        running=[(row, id(rec.req), rec.alloc_pages) for row, rec in sorted(cm._running.items())],
        reqs=[req_state(r) for r in reqs],
    )


def assert_unchanged(before: dict, after: dict) -> None:
    for key in before:
        assert before[key] == after[key], f"{key} changed"


def without_ids(state: dict) -> dict:
    """A manager's state with the identities of its requests and nodes left out (to compare two
    managers that went through the same calls)."""
    cache = dict(state["cache"], locks=sorted(lock[1:] for lock in state["cache"]["locks"]))
    reqs = [(r[1], r[3], r[4], r[6], r[5].cached_len if r[5] is not None else None) for r in state["reqs"]]
    return dict(state, cache=cache, running=[(row, pages) for row, _, pages in state["running"]], reqs=reqs)
