"""Where each module went: the old import paths of kvlab, kept working.

Until the package was laid out by subsystem (base, alloc, prefix, manager, attention, serving,
course, bench) its modules sat side by side at the top (``kvlab.paging``, ``kvlab.cache_manager``,
``kvlab.check.ch03_alloc_extend``, ``kvlab.kernels.alloc``, ...). A learner's copy of a chapter,
written before the move, still imports those paths; :data:`MOVED` says where each module lives
now, and a finder on ``sys.meta_path`` answers an old path with the module at the new one --
the very same module object, so ``kvlab.paging.page_to_token is kvlab.alloc.paging.page_to_token``
and a patch through either name patches both::

    import kvlab.paging                     # -> kvlab.alloc.paging
    from kvlab.check.core import run_cases  # -> kvlab.course.checking.core
    from kvlab.kernels import alloc_extend_kernel   # the old kernels package, rebuilt here

New code imports the new paths (``tests/test_moved.py`` keeps every old path a chapter used
resolving, and CONTRIBUTING's map says where things are).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

#: old module (under ``kvlab.``) -> where it lives now
MOVED: dict[str, str] = {
    "args": "base.args",
    "errors": "base.errors",
    "gpus": "base.gpus",
    "kernels.launch": "base.launch",
    "runtime": "base.runtime",
    "triton_compat": "base.triton_compat",
    "kernels.alloc": "alloc.alloc_kernels",
    "fast_alloc": "alloc.fast_alloc",
    "kernels.fast_alloc": "alloc.fast_alloc_kernels",
    "alloc_checks": "alloc.host_checks",
    "kernels.alloc_checks": "alloc.kernel_checks",
    "native_counts": "alloc.native_counts",
    "paging": "alloc.paging",
    "kernels.paging": "alloc.paging_kernels",
    "token_allocator": "alloc.token_allocator",
    "alloc_verdict": "alloc.verdict",
    "hash_cache": "prefix.hash_cache",
    "hash_cache_undo": "prefix.hash_cache_undo",
    "hash_cache_views": "prefix.hash_cache_views",
    "hash_chain": "prefix.hash_chain",
    "radix_cache": "prefix.radix_cache",
    "radix_node": "prefix.radix_node",
    "cache_manager": "manager.cache_manager",
    "cache_regions": "manager.cache_regions",
    "req": "manager.req",
    "cache_manager_checks": "manager.rules",
    "cache_manager_undo": "manager.undo",
    "kernels.attention": "attention.decode_kernels",
    "kvcache": "attention.kv_pool",
    "kernels.fast_attention": "attention.split_kernels",
    "hf": "serving.hf",
    "hf.attention": "serving.hf.attention_steps",
    "hf.fuse": "serving.hf.fuse",
    "hf.generator": "serving.hf.generator",
    "hf.graphs": "serving.hf.graphs",
    "hf.loop": "serving.hf.loop",
    "hf.models": "serving.hf.models",
    "hf.overlap": "serving.hf.overlap",
    "hf.plugin": "serving.hf.plugin",
    "hf.prefill": "serving.hf.prefill",
    "hf.room": "serving.hf.room",
    "hf.step": "serving.hf.step",
    "hf.swap": "serving.hf.swap",
    "pressure": "serving.pressure",
    "sim": "serving.sim",
    "sim.caches": "serving.sim.caches",
    "sim.checks": "serving.sim.checks",
    "sim.compare": "serving.sim.compare",
    "sim.config": "serving.sim.config",
    "sim.room": "serving.sim.make_room",
    "sim.scheduler": "serving.sim.scheduler",
    "sim.timeline": "serving.sim.timeline",
    "sim.workloads": "serving.sim.workloads",
    "engine": "serving.tiny_engine",
    "check": "course.check",
    "check.catalog": "course.check.catalog",
    "check.review": "course.check.review",
    "check.answers": "course.checking.answers",
    "check.audit": "course.checking.audit",
    "check.cells": "course.checking.cells",
    "check.compile_child": "course.checking.compile_child",
    "check.compiled": "course.checking.compiled",
    "check.core": "course.checking.core",
    "check.failures": "course.checking.failures",
    "check.findings": "course.checking.findings",
    "check.guards": "course.checking.guards",
    "check.inputs": "course.checking.inputs",
    "check.messages": "course.checking.messages",
    "check.picture": "course.checking.picture",
    "check.pipes": "course.checking.pipes",
    "check.pool_state": "course.checking.pool_state",
    "check.progress_file": "course.checking.progress_file",
    "check.registry": "course.checking.registry",
    "check.runner": "course.checking.runner",
    "check.sandbox": "course.checking.sandbox",
    "check.shipping": "course.checking.shipping",
    "check.slips": "course.checking.slips",
    "check.walk": "course.checking.walk",
    "check.workers": "course.checking.workers",
    "colab": "course.colab",
    "check.ch00_tour": "course.exercises.ch00_pages_needed",
    "check.ch01_paging": "course.exercises.ch01_paging",
    "check.ch02_page_table": "course.exercises.ch02_write_page_table",
    "check.ch03_alloc_extend": "course.exercises.ch03_extend_parts",
    "check.ch04_alloc_decode": "course.exercises.ch04_decode_kernel",
    "check.ch05_radix": "course.exercises.ch05_match",
    "check.ch05_page_store": "course.exercises.ch05_page_store",
    "check.ch06_cache_req": "course.exercises.ch06_regions",
    "check.ch07_serving": "course.exercises.ch07_serving",
    "check.ch08_attention_kernel": "course.exercises.ch08_attention_kernel",
    "check.ch08_attention": "course.exercises.ch08_paged_attention",
    "check.ch09_fast": "course.exercises.ch09_fast",
    "check.ch09_merge_splits": "course.exercises.ch09_merge_splits",
    "check.ch09_split_attention": "course.exercises.ch09_split_attention",
    "check.ch10_graphs": "course.exercises.ch10_graphs",
    "check.ch10_hf": "course.exercises.ch10_hf",
    "check.ch11_hash_alloc": "course.exercises.ch11_hash_alloc",
    "check.ch11_hash_chain": "course.exercises.ch11_hash_chain",
    "check.ch12_choose": "course.exercises.ch12_choose",
    "check.ch12_swap": "course.exercises.ch12_swap",
    "reference": "course.reference",
    "reference.alloc": "course.reference.alloc_ref",
    "reference.attention": "course.reference.attention_ref",
    "reference.hashchain": "course.reference.hash_chain_ref",
    "reference.paging": "course.reference.paging_ref",
    "reference.radix": "course.reference.radix_ref",
    "scenes": "course.scenes",
    "scenes.__main__": "course.scenes.__main__",
    "scenes.ch00_tour": "course.scenes.ch00_tour",
    "scenes.ch01_page_to_token": "course.scenes.ch01_page_to_token",
    "scenes.ch02_page_table": "course.scenes.ch02_page_table",
    "scenes.ch03_alloc_extend": "course.scenes.ch03_alloc_extend",
    "scenes.ch04_alloc_decode": "course.scenes.ch04_alloc_decode",
    "scenes.ch05_radix": "course.scenes.ch05_radix",
    "scenes.ch06_cache_req": "course.scenes.ch06_cache_req",
    "scenes.ch07_serving_loop": "course.scenes.ch07_serving_loop",
    "scenes.ch08_attention": "course.scenes.ch08_attention",
    "scenes.ch09_making_it_fast": "course.scenes.ch09_making_it_fast",
    "scenes.ch10_serve": "course.scenes.ch10_serve",
    "scenes.ch11_hash_cache": "course.scenes.ch11_hash_cache",
    "scenes.ch12_memory": "course.scenes.ch12_memory",
    "scenes.registry": "course.scenes.figure_registry",
    "scenes.render": "course.scenes.render",
    "solutions": "course.solutions",
    "viz": "course.viz",
    "viz.hash_chain": "course.viz.chains",
    "viz.sim": "course.viz.dashboard",
    "viz.heatmap": "course.viz.heatmap",
    "viz.lanes": "course.viz.lanes",
    "viz.legibility": "course.viz.legibility",
    "viz.pressure": "course.viz.policies",
    "viz.regions": "course.viz.regions",
    "viz.split_reads": "course.viz.split_reads",
    "viz.tree": "course.viz.tree",
    "widgets": "course.widgets",
    "bench.attention": "bench.decode",
    "bench.attention_report": "bench.decode_report",
}

#: the old ``kvlab.kernels`` package re-exported its kernels by name: name -> old module
KERNEL_NAMES = {
    "page_to_token_kernel": "kernels.paging", "write_page_table_kernel": "kernels.paging",
    "paged_decode_attention_kernel": "kernels.attention",
    "alloc_decode_kernel": "kernels.alloc", "alloc_extend_kernel": "kernels.alloc",
    "decode_fast_kernel": "kernels.fast_alloc", "extend_fill_kernel": "kernels.fast_alloc",
    "extend_fused_kernel": "kernels.fast_alloc", "extend_scan_kernel": "kernels.fast_alloc",
    "merge_splits_kernel": "kernels.fast_attention", "split_decode_kernel": "kernels.fast_attention",
}
#: old packages that no longer exist as one folder: rebuilt as a module that answers their names
DISSOLVED = {"kernels"}


def new_name(old: str) -> str | None:
    """The module an old dotted path (``kvlab.paging``) stands for now, or None."""
    if not old.startswith("kvlab."):
        return None
    rest = old[len("kvlab."):]
    if rest in MOVED:
        return "kvlab." + MOVED[rest]
    return None


def _dissolved_package(name: str) -> types.ModuleType:
    """``kvlab.kernels`` as it was: its kernels by name, its modules through :data:`MOVED`."""
    short = name[len("kvlab."):]
    module = types.ModuleType(name, f"kvlab's old {short!r} package (moved: see kvlab.moved)")
    module.__path__ = []  # a package: its old submodules import through the finder

    def __getattr__(attr: str):
        if attr in KERNEL_NAMES:
            return getattr(importlib.import_module("kvlab." + MOVED[KERNEL_NAMES[attr]]), attr)
        if f"{short}.{attr}" in MOVED:
            return importlib.import_module(f"{name}.{attr}")
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    module.__getattr__ = __getattr__
    return module


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old path with the module at its new one (the same object)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in (f"kvlab.{d}" for d in DISSOLVED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        target_name = new_name(fullname)
        if target_name is None:
            return None
        real = importlib.util.find_spec(target_name)
        spec = importlib.machinery.ModuleSpec(fullname, self,
                                              is_package=real is not None and real.submodule_search_locations is not None)
        spec.loader_state = target_name
        return spec

    def create_module(self, spec):
        if spec.loader_state is None:
            return _dissolved_package(spec.name)
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = (spec.loader_state, module.__spec__)
        return module

    def exec_module(self, module):
        # importlib set the alias spec on the real module: give the module its own back
        state = getattr(module.__spec__, "loader_state", None)
        if isinstance(state, tuple):
            module.__spec__ = state[1]

    def get_code(self, fullname):
        """For ``python -m kvlab.<old path>``: the new module's code."""
        target_name = new_name(fullname)
        real = importlib.util.find_spec(target_name) if target_name else None
        return real.loader.get_code(target_name) if real is not None else None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
