"""kvlab: a course, and a package, on how an LLM server manages its KV cache in pages.

The package is laid out by subsystem, in the order of the course::

    base/        errors, argument rules, the runtime (GPU or interpreter), Triton's launch path
    alloc/       pages, the page table, the token allocator and their kernels   (chapters 01-04, 09)
    prefix/      the radix and the hash-chained prefix caches                  (05, 11)
    manager/     CacheManager: requests, regions, all-or-nothing calls          (06)
    attention/   the KV pool and paged decode attention, with their kernels     (08, 09)
    serving/     the simulator, the tiny engine, PagedGenerator, memory policies (07, 08, 10, 12)
    course/      checkers, exercises, solutions, references, scenes, pictures, widgets
    bench/       the benchmarks (python -m kvlab.bench)

Importing kvlab first decides the runtime (:mod:`kvlab.base.runtime`): without CUDA it switches
Triton to its interpreter before any kernel is defined. The names below are kvlab's public
ones, loaded lazily, so a chapter that needs only the page table does not pay for (or break
on) the simulator. ``kvlab.check`` and ``kvlab.solutions`` are the learner's doors to the
course; the module paths kvlab had before its subsystems (``kvlab.paging``, ...) keep working
(:mod:`kvlab.moved`).
"""
from __future__ import annotations

import importlib
import os as _os

from .base import runtime  # noqa: F401  (must run before any kernel module is imported)
from .base.errors import CacheMisuse, IntegrityError, InvalidArgument, KvlabError, OutOfPages
from .base.runtime import DEVICE, INTERPRET, runtime_report
from .moved import MOVED as _MOVED, install as _install_moved

_install_moved()

__version__ = "0.1.0"

# name -> module that defines it (d2l-style: the package says where each thing lives)
_EXPORTS = {
    "div_ceil": "alloc.paging",  # chapters 01-02
    "page_to_token": "alloc.paging",
    "write_page_table": "alloc.paging",
    "write_page_table_triton": "alloc.paging",
    "page_to_token_triton": "alloc.paging",
    "new_page_table": "alloc.paging",
    "UNMAPPED": "alloc.paging",
    "PagedTokenAllocator": "alloc.token_allocator",  # chapters 03-04
    "RadixPrefixCache": "prefix.radix_cache",  # chapter 05
    "MatchResult": "prefix.radix_cache",
    "InsertResult": "prefix.radix_cache",
    "Req": "manager.req",  # chapter 06
    "ForwardBatch": "manager.req",
    "CacheManager": "manager.cache_manager",
    "CacheRegions": "manager.cache_manager",
    "simulate": "serving.sim",  # chapter 07
    "SimConfig": "serving.sim",
    "TimelineExplorer": "course.widgets",
    "KVPool": "attention.kv_pool",  # chapter 08
    "paged_decode_attention": "attention.paged_attention",
    "TinyTransformer": "serving.tiny_engine",
    "PagedEngine": "serving.tiny_engine",
    "alloc_extend_fast": "alloc.fast_alloc",  # chapter 09
    "alloc_decode_fast": "alloc.fast_alloc",
    "fast_paged_decode_attention": "attention.paged_attention",
    "HashPrefixCache": "prefix.hash_cache",  # chapter 11
    "HashCacheHandle": "prefix.hash_chain",
    "chain_hash": "prefix.hash_chain",
    "page_hashes": "prefix.hash_chain",
    "make_policy": "serving.pressure",  # chapter 12
}
#: the subsystems, and the learner's doors to the course
_SUBMODULES = {"base", "alloc", "prefix", "manager", "attention", "serving", "course", "bench", "moved"}
_DOORS = {"check": "course.check", "solutions": "course.solutions"}

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
    if name in _DOORS or name in _MOVED or name == "kernels":
        # kvlab.check, kvlab.solutions, and every old top-level module (kvlab.paging, ...):
        # imported by their old name, which kvlab.moved answers with the module itself
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES | set(_DOORS))


# KVLAB_FIGURE_AUDIT=<file> (the notebook tests set it) measures every figure rendered from
# here on, for the legibility test (kvlab.course.viz.legibility); unset, nothing is loaded.
if _os.environ.get("KVLAB_FIGURE_AUDIT"):
    from .course.viz.legibility import install_audit

    install_audit()
