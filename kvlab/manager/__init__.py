"""The cache manager: mini-sglang's ``CacheManager`` over a prefix cache and the page table (chapter 06).

    req                Req (a request's lengths and row) and ForwardBatch (one step's inputs)
    cache_regions      CacheRegions: the four regions of a cache_req
    rules              the rules every door checks, and the conservation law of pages
    undo               how a call that failed part-way is taken back
    cache_manager      CacheManager: match_req, allocate_paged, cache_req, and the serving steps
"""
from __future__ import annotations

from ..base.lazy import lazy_exports

_EXPORTS = {"Req": "req", "ForwardBatch": "req", "CacheManager": "cache_manager",
            "CacheRegions": "cache_regions"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, ("req", "cache_regions", "rules", "undo",
                                                         "cache_manager"))
