"""Admission with a load-back: a request's cached prefix comes back from host memory and disk
into new device pages before its prefill computes the rest (chapter 13).

In the cache manager's words, and in the order a server does it::

    admit(req)                 match the prompt on the device, lock the hit, map it into the row
                               (positions [0, D): shared pages of the tree)
    host_chain / disk          the host-only nodes that continue the match, then the pages the
                               disk holds after them (read into host pages, checked first):
                               positions [D, E)
    allocate_paged([req])      device pages for [D, E): the request's own pages, from the front of
                               the free list (evicting as the write policy says)
    load_chain                 one batched copy host -> device for the whole range
    complete_one()             cached_len = E: the prefill computes [E, input_len) only

The loaded pages are the request's until it is cached: ``cache_req`` then finds the host-only
nodes on its way and gives them these device pages back (:meth:`~kvlab.prefix.tiered_cache.
TieredRadixCache.insert_prefix`); two requests that loaded the same prefix meanwhile are settled
as chapter 06's duplicates. This is :func:`kvlab.serving.pressure.restore_request` with the host
copy found by the cache instead of kept by the request. SGLang's ``HiRadixCache.load_back``
(``python/sglang/srt/mem_cache/hiradix_cache.py``, ``263bc85d``) instead gives the nodes their
device pages at once and locks them until the copy's event; it loads nothing under
``load_back_threshold = 10`` tokens. vLLM asks its connector for the tokens it can load beyond the
GPU's hit (``get_num_new_matched_tokens``), loads whole blocks between steps and counts them as
computed (``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``, ``73689081``).
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["LoadBack", "admit_with_load_back"]


class LoadBack(NamedTuple):
    """Where a request's prompt came from at admission, in tokens: the device's hit, the tokens
    loaded from host memory, and those (among them) first read from disk."""

    device: int
    host: int = 0
    disk: int = 0

    @property
    def cached(self) -> int:
        return self.device + self.host


class _Hold:
    """Keeps host pages pinned while their load-back is being set up."""

    def __init__(self):
        self.released = False

    def done(self) -> bool:
        return self.released

    def wait(self) -> None:
        return None


def admit_with_load_back(manager, req, *, spare_pages: int = 0, disk: bool = True) -> LoadBack:
    """Admit ``req`` (:meth:`~kvlab.CacheManager.admit`) and load back what the lower tiers hold of
    its prompt, as far as the free and evictable device pages allow while ``spare_pages`` stay
    available (for the rest of its prefill). All or nothing: on any failure the request is
    released again and the error propagates; what the cache learned from disk stays in it."""
    manager.admit(req)
    cache = manager.prefix_cache
    if not hasattr(cache, "host_chain"):
        return LoadBack(req.cached_len)
    P, D = manager.page_size, req.cached_len
    hold = _Hold()
    try:
        ids = req.input_ids[: req.input_len - 1]
        chain = cache.host_chain(ids, req.cache_handle)
        from_host = sum(n.length for n in chain)
        room = manager.available_pages - spare_pages
        if disk and room * P > from_host:
            after = chain[-1] if chain else req.cache_handle.node
            fetched = cache.fetch_from_disk(ids, after, D + from_host, keep=chain,
                                            max_pages=room - from_host // P)
            if fetched is not None:
                chain.append(fetched)
        chain = _fit(cache, chain, max(room, 0) * P)
        if not chain:
            return LoadBack(D)
        pages = [p for n in chain for p in n.host]
        cache.host.pin(pages, hold)                 # no eviction below may spill what we load
        end = D + sum(n.length for n in chain)
        req.device_len = end
        manager.allocate_paged([req])               # pages for [D, end): the request's own
        cache.load_chain(chain, manager.page_table[req.table_idx, D:end])
        req.complete_one()                          # cached_len = end; its prefill starts there
        return LoadBack(D, end - D, max(0, end - D - from_host))   # (the disk's pages come last)
    except BaseException:
        manager.release_req(req)                    # its pages back, its lock off
        raise
    finally:
        hold.released = True


def _fit(cache, chain: list, tokens: int) -> list:
    """The chain cut to at most ``tokens`` (whole pages; the last node split where it must)."""
    out, total = [], 0
    for node in chain:
        if total + node.length <= tokens:
            out.append(node)
            total += node.length
            continue
        take = (tokens - total) // cache.page_size * cache.page_size
        if take > 0:
            out.append(cache._split(node, take))
        break
    return out
