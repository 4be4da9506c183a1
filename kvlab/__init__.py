"""kvlab: a course, and a package, on how an LLM server manages its KV cache in pages.

Importing kvlab first decides the runtime (see :mod:`kvlab.runtime`): without CUDA it
switches Triton to its interpreter before any kernel is defined.

Public names are loaded lazily, so a chapter that only needs the page table does not
pay for (or break on) the simulator.
"""
from __future__ import annotations

import importlib
import os as _os

from . import runtime  # noqa: F401  (must run before any kernel module is imported)
from .errors import CacheMisuse, IntegrityError, InvalidArgument, KvlabError, OutOfPages
from .runtime import DEVICE, INTERPRET, runtime_report

__version__ = "0.1.0"

# name -> module that defines it (d2l-style: the package says where each thing lives)
_EXPORTS = {
    "div_ceil": "paging",
    "page_to_token": "paging",
    "write_page_table": "paging",
    "write_page_table_triton": "paging",
    "page_to_token_triton": "paging",
    "new_page_table": "paging",
    "UNMAPPED": "paging",
    "PagedTokenAllocator": "token_allocator",
    "RadixPrefixCache": "radix_cache",
    "MatchResult": "radix_cache",
    "InsertResult": "radix_cache",
    "Req": "req",
    "ForwardBatch": "req",
    "CacheManager": "cache_manager",
    "CacheRegions": "cache_manager",
    "KVPool": "kvcache",  # chapter 08
    "paged_decode_attention": "attention",
    "TinyTransformer": "engine",
    "PagedEngine": "engine",
    "simulate": "sim",  # chapter 07
    "SimConfig": "sim",
    "TimelineExplorer": "widgets",
    "alloc_extend_fast": "fast_alloc",  # chapter 09
    "alloc_decode_fast": "fast_alloc",
    "fast_paged_decode_attention": "attention",
    "HashPrefixCache": "hash_cache",  # chapter 11
    "HashCacheHandle": "hash_chain",
    "chain_hash": "hash_chain",
    "page_hashes": "hash_chain",
    "make_policy": "pressure",  # chapter 12
}
_SUBMODULES = {
    "kernels", "reference", "viz", "check", "solutions", "sim", "widgets",
    "kvcache", "attention", "engine", "bench", "paging", "token_allocator", "radix_cache",
    "cache_manager", "scenes", "runtime", "errors", "alloc_checks", "native_counts", "hash_cache",
    "hash_chain", "pressure",
    "hf",  # chapter 10 (needs the optional transformers: pip install 'transformers>=4.56')
}

__all__ = [
    "CacheMisuse", "IntegrityError", "InvalidArgument", "KvlabError", "OutOfPages",
    "DEVICE", "INTERPRET", "runtime_report", *_EXPORTS,
]


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


# KVLAB_FIGURE_AUDIT=<file> (the notebook tests set it) measures every figure rendered from
# here on, for the legibility test (kvlab.viz.legibility); unset, nothing is loaded.
if _os.environ.get("KVLAB_FIGURE_AUDIT"):
    from .viz.legibility import install_audit

    install_audit()
