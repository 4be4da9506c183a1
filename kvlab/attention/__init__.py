"""Attention through the page table, and the KV pool it reads (chapter 08; fast in chapter 09).

    kv_pool            KVPool: K and V of every layer, one row per token slot
    paged_attention    paged_decode_attention (08) and fast_paged_decode_attention (09): checks,
                       splits, launches                                  decode_kernels (08)
                                                                         split_kernels (09)

``kvlab.attention`` was one module before it became this package: its names (``kvlab.attention.
choose_num_splits``, ...) still answer from :mod:`~kvlab.attention.paged_attention`.
"""
from __future__ import annotations

from ..base.lazy import lazy_exports

_EXPORTS = {
    "KVPool": "kv_pool", "paged_decode_attention": "paged_attention",
    "fast_paged_decode_attention": "paged_attention",
    "paged_decode_attention_kernel": "decode_kernels",
    "split_decode_kernel": "split_kernels", "merge_splits_kernel": "split_kernels",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, ("kv_pool", "paged_attention", "decode_kernels",
                                                         "split_kernels"), fallback="paged_attention")
