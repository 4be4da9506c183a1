"""Prefix caches: KV that requests share (chapter 05: the radix tree; chapter 11: chained hashes).

    radix_node         nodes, handles, plain-data results and snapshots of the tree
    radix_cache        RadixPrefixCache: match_prefix, insert_prefix, evict, locks (05)
    hash_chain         the chained page hash, the free queue, handles and snapshots (11)
    hash_cache_views   the hash cache read: sizes, locks held, checks, snapshots
    hash_cache_undo    each hash-cache call whole or not at all
    hash_cache         HashPrefixCache: the page pool itself, keyed by chained hashes (11)
    write_policy       when a device page gets its host copy: write-through(-selective), write-back (13)
    host_tier          host memory as pages: runs, pins, copies still arriving (13)
    disk_store         one file per page, keyed by chained hash and model identity, checked (13)
    tier_plans         the eviction and load-back plans, as plain functions (13)
    tier_host          the host and disk half of the tiered tree (13)
    tiered_cache       TieredRadixCache: the radix tree over device, host and disk (13)

The caches speak the same words, so ``CacheManager`` runs on any of them.
"""
from __future__ import annotations

from ..base.lazy import lazy_exports

_EXPORTS = {
    "RadixPrefixCache": "radix_cache", "MatchResult": "radix_cache", "InsertResult": "radix_cache",
    "HashPrefixCache": "hash_cache", "HashCacheHandle": "hash_chain", "chain_hash": "hash_chain",
    "page_hashes": "hash_chain",
    "TieredRadixCache": "tiered_cache", "HostTier": "host_tier", "DiskStore": "disk_store",
    "WRITE_POLICIES": "write_policy",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, (
    "radix_node", "radix_cache", "hash_chain", "hash_cache_views", "hash_cache_undo", "hash_cache",
    "write_policy", "host_tier", "disk_store", "tier_plans", "tier_host", "tiered_cache"))
