"""Prefix caches: KV that requests share (chapter 05: the radix tree; chapter 11: chained hashes).

    radix_node         nodes, handles, plain-data results and snapshots of the tree
    radix_cache        RadixPrefixCache: match_prefix, insert_prefix, evict, locks (05)
    hash_chain         the chained page hash, the free queue, handles and snapshots (11)
    hash_cache_views   the hash cache read: sizes, locks held, checks, snapshots
    hash_cache_undo    each hash-cache call whole or not at all
    hash_cache         HashPrefixCache: the page pool itself, keyed by chained hashes (11)

Both caches speak the same words, so ``CacheManager`` runs on either.
"""
from __future__ import annotations

from ..base.lazy import lazy_exports

_EXPORTS = {
    "RadixPrefixCache": "radix_cache", "MatchResult": "radix_cache", "InsertResult": "radix_cache",
    "HashPrefixCache": "hash_cache", "HashCacheHandle": "hash_chain", "chain_hash": "hash_chain",
    "page_hashes": "hash_chain",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, (
    "radix_node", "radix_cache", "hash_chain", "hash_cache_views", "hash_cache_undo", "hash_cache"))
