"""Serving: the loops that drive the cache manager, and what they do when memory runs out.

    tiny_engine        the tiny model and PagedEngine (chapter 08's capstone)
    sim/               the serving-loop simulator (07), its cache comparisons (11) and memory
                       policies (12)
    hf/                a transformers model served through CacheManager: PagedGenerator (10),
                       CUDA graphs and overlap (09-10), making room and swapping (12)
    pressure           the memory policies of chapter 12: reserve, recompute, retract, swap
"""
from __future__ import annotations

from ..base.lazy import lazy_exports

_EXPORTS = {"TinyTransformer": "tiny_engine", "PagedEngine": "tiny_engine", "make_policy": "pressure",
            "simulate": "sim", "SimConfig": "sim", "PagedGenerator": "hf"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, ("tiny_engine", "sim", "hf", "pressure"))
