"""The old import paths keep working: a learner's copy of a chapter, written before kvlab was
laid out by subsystem, still runs after a ``git pull`` (:mod:`kvlab.moved`).

:data:`CHAPTER_NAMES` and :data:`CHAPTER_FROM_IMPORTS` are every ``kvlab.*`` name and every
``from kvlab... import ...`` that the thirteen chapters used (their sources at the commit
before the move, in code and in prose): each must still resolve, to the same object the new
path gives.
"""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest

import kvlab
from kvlab.moved import KERNEL_NAMES, MOVED

#: every dotted kvlab name in chapters 00-12 before the move
CHAPTER_NAMES = (
    "kvlab", "kvlab.CacheManager", "kvlab.CacheManager.cache_req", "kvlab.CacheManager.match_req",
    "kvlab.CacheMisuse", "kvlab.CacheRegions", "kvlab.DEVICE", "kvlab.HashPrefixCache",
    "kvlab.INTERPRET", "kvlab.IntegrityError", "kvlab.InvalidArgument", "kvlab.OutOfPages",
    "kvlab.PagedTokenAllocator", "kvlab.PagedTokenAllocator.alloc_decode",
    "kvlab.PagedTokenAllocator.alloc_extend", "kvlab.RadixPrefixCache",
    "kvlab.RadixPrefixCache.match_prefix", "kvlab.Req", "kvlab.UNMAPPED", "kvlab.attention",
    "kvlab.attention.choose_num_splits", "kvlab.attention.fast_paged_decode_attention",
    "kvlab.attention.paged_decode_attention", "kvlab.bench", "kvlab.bench.cases",
    "kvlab.bench.paths.alloc_extend_torch", "kvlab.bench.public", "kvlab.bench.serve_report",
    "kvlab.bench.suite", "kvlab.chain_hash", "kvlab.check", "kvlab.check.CheckFailed",
    "kvlab.check.alloc_decode", "kvlab.check.alloc_extend_part1", "kvlab.check.alloc_extend_part2",
    "kvlab.check.alloc_extend_part3", "kvlab.check.allocate_pages",
    "kvlab.check.cache_req_regions", "kvlab.check.cache_req_remap", "kvlab.check.choose",
    "kvlab.check.decode_step", "kvlab.check.extend_scan", "kvlab.check.free_pages",
    "kvlab.check.hash_match", "kvlab.check.hint", "kvlab.check.insert_prefix",
    "kvlab.check.match_prefix", "kvlab.check.match_req", "kvlab.check.merge_splits",
    "kvlab.check.next_token_ratio", "kvlab.check.pad_decode_batch", "kvlab.check.page_hashes",
    "kvlab.check.page_to_token", "kvlab.check.paged_attention",
    "kvlab.check.paged_attention_kernel", "kvlab.check.paged_attention_step",
    "kvlab.check.pages_needed", "kvlab.check.resume_plan", "kvlab.check.split_attention",
    "kvlab.check.swap_out", "kvlab.check.victim_order", "kvlab.check.write_page_table",
    "kvlab.div_ceil", "kvlab.engine", "kvlab.engine.TinyTransformer", "kvlab.fast_alloc",
    "kvlab.hash_cache.HashPrefixCache.allocate", "kvlab.hash_cache.HashPrefixCache.free",
    "kvlab.hash_cache.HashPrefixCache.match", "kvlab.hash_chain", "kvlab.hash_chain.page_hashes",
    "kvlab.hf", "kvlab.hf.PagedGenerator", "kvlab.hf.SUPPORTED", "kvlab.hf.attention",
    "kvlab.hf.fuse", "kvlab.hf.graphs.DecodeGraphs", "kvlab.hf.graphs.dynamo_graphs",
    "kvlab.hf.loop.PENDING", "kvlab.hf.loop.ServingLoop", "kvlab.hf.loop.ServingLoop.run",
    "kvlab.hf.pad_decode_batch", "kvlab.hf.paged_attention_step",
    "kvlab.hf.paged_decode_attention", "kvlab.hf.plugin.eos_token_ids",
    "kvlab.hf.plugin.kvlab_attention", "kvlab.hf.prefill.PrefillAdder", "kvlab.hf.room",
    "kvlab.hf.swap", "kvlab.hf.swap.HostKV", "kvlab.hf.swap.HostKV.load",
    "kvlab.hf.swap.HostKV.save", "kvlab.kernels", "kvlab.kernels.alloc_decode_kernel",
    "kvlab.kernels.alloc_extend_kernel", "kvlab.kernels.attention.paged_decode_attention_kernel",
    "kvlab.kernels.fast_alloc", "kvlab.kernels.fast_attention", "kvlab.kernels.launch.Launcher",
    "kvlab.kernels.page_to_token_kernel", "kvlab.kernels.write_page_table_kernel", "kvlab.kvcache",
    "kvlab.kvcache.random_decode_step", "kvlab.native_counts", "kvlab.new_page_table",
    "kvlab.page_hashes", "kvlab.page_to_token", "kvlab.paging", "kvlab.paging.new_page_table",
    "kvlab.paging.page_to_token_triton", "kvlab.paging.write_page_table",
    "kvlab.paging.write_page_table_triton", "kvlab.pressure", "kvlab.pressure.CHAPTER_07",
    "kvlab.pressure.next_token_ratio", "kvlab.pressure.resume_plan", "kvlab.pressure.stop_request",
    "kvlab.pressure.victim_order", "kvlab.reference", "kvlab.reference.PagePoolRef",
    "kvlab.reference.PrefixStoreRef", "kvlab.reference.alloc",
    "kvlab.reference.alloc.alloc_extend_ref", "kvlab.reference.alloc_extend_ref",
    "kvlab.reference.attention", "kvlab.reference.cache_req_regions_ref",
    "kvlab.reference.page_to_token_ref", "kvlab.reference.split_partials_reference",
    "kvlab.runtime.INTERPRET", "kvlab.runtime.can_pin_memory", "kvlab.runtime.half_dtype",
    "kvlab.runtime.half_note", "kvlab.runtime.pick", "kvlab.runtime_report",
    "kvlab.scenes.ch00_tour", "kvlab.scenes.ch01_page_to_token", "kvlab.scenes.ch02_page_table",
    "kvlab.scenes.ch03_alloc_extend", "kvlab.scenes.ch04_alloc_decode", "kvlab.scenes.ch05_radix",
    "kvlab.scenes.ch06_cache_req", "kvlab.scenes.ch07_serving_loop", "kvlab.scenes.ch08_attention",
    "kvlab.scenes.ch09_making_it_fast", "kvlab.scenes.ch10_serve", "kvlab.scenes.ch11_hash_cache",
    "kvlab.scenes.ch12_memory", "kvlab.sim", "kvlab.sim.SimConfig", "kvlab.sim.Simulator",
    "kvlab.sim.compare", "kvlab.sim.compare.MEMORY_POOLS", "kvlab.solutions.get",
    "kvlab.solutions.show", "kvlab.viz", "kvlab.viz.draw_tree", "kvlab.viz.hash_chain",
    "kvlab.viz.page_table_heatmap", "kvlab.viz.pressure", "kvlab.viz.region_bar", "kvlab.viz.sim",
    "kvlab.widgets.explore", "kvlab.write_page_table", "kvlab.write_page_table_triton",
)
#: every ``from <module> import <name>`` of chapters 00-12 before the move, as "module:name"
CHAPTER_FROM_IMPORTS = (
    "kvlab.attention:FastConfig", "kvlab.attention:causal_attention",
    "kvlab.attention:check_paged_attention_inputs", "kvlab.attention:choose_num_splits",
    "kvlab.attention:fast_paged_decode_attention", "kvlab.attention:paged_decode_attention",
    "kvlab.bench.cases:make_extend_batch", "kvlab.bench.public:bench_floor",
    "kvlab.bench.public:bench_public_extend", "kvlab.bench.serve_report:plot_serve",
    "kvlab.bench.suite:loop_us", "kvlab.bench:paths", "kvlab.bench:plots",
    "kvlab.engine:PagedEngine", "kvlab.engine:TinyConfig", "kvlab.engine:TinyTransformer",
    "kvlab.engine:generate_contiguous", "kvlab.fast_alloc:alloc_decode_fast",
    "kvlab.fast_alloc:alloc_extend_fast", "kvlab.hash_chain:short",
    "kvlab.hf.attention:paged_attention_reference", "kvlab.hf:PagedGenerator",
    "kvlab.hf:graph_batch_sizes", "kvlab.hf:paged_attention_reference",
    "kvlab.hf:paged_decode_attention", "kvlab.hf:tiny_model", "kvlab.kernels:alloc_decode_kernel",
    "kvlab.kernels:alloc_extend_kernel", "kvlab.kernels:fast_alloc", "kvlab.kvcache:KVPool",
    "kvlab.kvcache:random_decode_step", "kvlab.kvcache:random_paged_layout",
    "kvlab.paging:div_ceil", "kvlab.paging:new_page_table", "kvlab.pressure:POLICIES",
    "kvlab.pressure:RequestView", "kvlab.pressure:RetractDecode", "kvlab.pressure:make_policy",
    "kvlab.pressure:next_token_ratio", "kvlab.pressure:resume_plan", "kvlab.pressure:victim_order",
    "kvlab.reference.alloc:alloc_decode_ref", "kvlab.reference.alloc:alloc_extend_ref",
    "kvlab.reference.alloc:kernel_page_reads_extend", "kvlab.reference.alloc:pages_for",
    "kvlab.reference.alloc:pages_needed_extend", "kvlab.reference.alloc:part_lengths",
    "kvlab.reference.alloc:unpack_ret_value", "kvlab.reference.attention:merge_splits_reference",
    "kvlab.reference.attention:split_partials_reference",
    "kvlab.reference.attention:split_ranges_reference", "kvlab.reference:PagePoolRef",
    "kvlab.reference:PrefixStoreRef", "kvlab.reference:cache_req_regions_ref",
    "kvlab.reference:page_aligned_len", "kvlab.reference:page_to_token_ref",
    "kvlab.reference:paged_decode_attention_reference", "kvlab.reference:write_page_table_ref",
    "kvlab.scenes.ch00_tour:THREE_REQUESTS", "kvlab.scenes.ch00_tour:describe_step",
    "kvlab.scenes.ch00_tour:first_page_table", "kvlab.scenes.ch00_tour:fragmentation_figure",
    "kvlab.scenes.ch00_tour:scheduler_timeline", "kvlab.scenes.ch00_tour:sharing_table",
    "kvlab.scenes.ch00_tour:timeline_figure",
    "kvlab.scenes.ch01_page_to_token:pages_to_slots_figure",
    "kvlab.scenes.ch02_page_table:DEMO_REQUESTS",
    "kvlab.scenes.ch02_page_table:before_after_figure",
    "kvlab.scenes.ch03_alloc_extend:draw_logical",
    "kvlab.scenes.ch03_alloc_extend:draw_page_reads",
    "kvlab.scenes.ch03_alloc_extend:prefill_then_extend",
    "kvlab.scenes.ch03_alloc_extend:small_example",
    "kvlab.scenes.ch03_alloc_extend:two_views_figure",
    "kvlab.scenes.ch03_alloc_extend:worked_example", "kvlab.scenes.ch04_alloc_decode:decode_steps",
    "kvlab.scenes.ch04_alloc_decode:draw_decode_steps",
    "kvlab.scenes.ch04_alloc_decode:example_history",
    "kvlab.scenes.ch05_radix:shared_prefix_figure", "kvlab.scenes.ch06_cache_req:scenarios",
    "kvlab.scenes.ch07_serving_loop:page_size_runs",
    "kvlab.scenes.ch07_serving_loop:pressured_run",
    "kvlab.scenes.ch07_serving_loop:step_views_figure",
    "kvlab.scenes.ch08_attention:gather_figure", "kvlab.scenes.ch08_attention:prefill_bars",
    "kvlab.scenes.ch08_attention:shared_prompt_batches",
    "kvlab.scenes.ch09_making_it_fast:fill_mapping_figure",
    "kvlab.scenes.ch09_making_it_fast:load_bench",
    "kvlab.scenes.ch09_making_it_fast:public_call_rows",
    "kvlab.scenes.ch09_making_it_fast:split_reads_figure",
    "kvlab.scenes.ch10_serve:conversation_bars", "kvlab.scenes.ch10_serve:conversation_rows",
    "kvlab.scenes.ch10_serve:conversation_turns", "kvlab.scenes.ch10_serve:long_prompt_workload",
    "kvlab.scenes.ch10_serve:overlap_runs", "kvlab.scenes.ch10_serve:overlap_timeline_figure",
    "kvlab.scenes.ch10_serve:padded_step", "kvlab.scenes.ch10_serve:padded_step_figure",
    "kvlab.scenes.ch10_serve:plug_in_figure", "kvlab.scenes.ch10_serve:prefill_per_step",
    "kvlab.scenes.ch10_serve:recorded_timelines", "kvlab.scenes.ch11_hash_cache:COMPARED",
    "kvlab.scenes.ch11_hash_cache:free_queue_figure",
    "kvlab.scenes.ch11_hash_cache:hash_chain_figure", "kvlab.scenes.ch11_hash_cache:measured_rows",
    "kvlab.scenes.ch12_memory:CHAPTER_WORKLOADS", "kvlab.scenes.ch12_memory:P",
    "kvlab.scenes.ch12_memory:bench_rows", "kvlab.scenes.ch12_memory:chapter_workload",
    "kvlab.scenes.ch12_memory:compared_rows", "kvlab.scenes.ch12_memory:leave_and_return_figure",
    "kvlab.scenes.ch12_memory:policy_compare_figure", "kvlab.scenes.ch12_memory:policy_run",
    "kvlab.scenes.ch12_memory:promised_pages_figure", "kvlab.sim.compare:comparison_table",
    "kvlab.sim.compare:lookup_cost", "kvlab.sim.compare:memory_pools",
    "kvlab.sim.compare:policy_table", "kvlab.sim.compare:pool_sizes", "kvlab.sim:RequestSpec",
    "kvlab.sim:SimConfig", "kvlab.sim:SimIntegrityError", "kvlab.sim:Simulator",
    "kvlab.sim:Workload", "kvlab.sim:make_workload", "kvlab.sim:multi_turn_chat",
    "kvlab.sim:shared_system_prompt", "kvlab.sim:simulate",
    "kvlab.viz.hash_chain:draw_cache_comparison", "kvlab.viz.hash_chain:draw_hash_chains",
    "kvlab.viz.hash_chain:draw_lookup_cost", "kvlab.viz.pressure:ratio_over_time",
    "kvlab.viz.sim:compare_page_sizes", "kvlab.viz.sim:describe_step",
    "kvlab.viz.sim:timeline_dashboard", "kvlab.viz:draw_tree", "kvlab.viz:draw_tree_steps",
    "kvlab.viz:page_owner_strip", "kvlab.viz:page_table_heatmap", "kvlab.viz:region_bar",
    "kvlab.viz:region_bars", "kvlab:CacheManager", "kvlab:HashPrefixCache",
    "kvlab:InvalidArgument", "kvlab:RadixPrefixCache", "kvlab:Req", "kvlab:alloc_checks",
    "kvlab:chain_hash", "kvlab:div_ceil", "kvlab:native_counts", "kvlab:page_hashes",
)


def resolve(dotted: str):
    """``kvlab.a.b.c`` as a chapter reaches it: attributes from ``import kvlab``, importing a
    module where an attribute is not there yet (as ``import kvlab.a.b`` would)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


@pytest.mark.parametrize("dotted", CHAPTER_NAMES)
def test_every_name_a_chapter_used_still_resolves(dotted):
    resolve(dotted)


@pytest.mark.parametrize("pair", CHAPTER_FROM_IMPORTS)
def test_every_from_import_a_chapter_used_still_works(pair):
    module, name = pair.split(":")
    namespace: dict = {}
    exec(f"from {module} import {name}", namespace)
    assert namespace[name] is not None


@pytest.mark.parametrize("old", sorted(m for m in MOVED if not m.endswith("__main__")))  # (those run)
def test_an_old_module_path_is_the_new_module_itself(old):
    moved = importlib.import_module(f"kvlab.{old}")
    new = importlib.import_module(f"kvlab.{MOVED[old]}")
    assert moved is new
    assert new.__spec__.name == f"kvlab.{MOVED[old]}", "the module keeps its own spec"
    assert new.__name__ == f"kvlab.{MOVED[old]}"


def test_the_old_kernels_package_answers_its_kernels_and_modules():
    import kvlab.kernels as kernels
    for name, old in KERNEL_NAMES.items():
        assert getattr(kernels, name) is getattr(importlib.import_module(f"kvlab.{MOVED[old]}"), name)
    from kvlab.kernels import fast_alloc
    assert fast_alloc is importlib.import_module("kvlab.alloc.fast_alloc_kernels")
    with pytest.raises(AttributeError):
        kernels.no_such_kernel  # noqa: B018


def test_a_patch_through_the_old_name_patches_the_new_module(monkeypatch):
    import kvlab.paging
    from kvlab.alloc import paging
    monkeypatch.setattr(kvlab.paging, "UNMAPPED", -7)
    assert paging.UNMAPPED == -7


def test_the_old_kvlab_attention_module_names_answer_from_the_package():
    from kvlab.attention import choose_num_splits, split_ranges
    from kvlab.attention.paged_attention import choose_num_splits as new
    assert choose_num_splits is new and callable(split_ranges)
    with pytest.raises(AttributeError):
        kvlab.attention.no_such_name  # noqa: B018


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError):
        kvlab.no_such_module  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvlab.no_such_module")


def test_python_dash_m_runs_an_old_module_path():
    """``python -m kvlab.scenes --help`` (the old path of ``kvlab.course.scenes``) still runs."""
    spec = importlib.util.find_spec("kvlab.scenes.__main__")
    assert spec is not None and spec.loader.get_code("kvlab.scenes.__main__") is not None
    run = subprocess.run([sys.executable, "-c", "import kvlab, runpy; "
                          "print(runpy._get_module_details('kvlab.scenes')[0])"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "kvlab.scenes.__main__" in run.stdout, run.stderr
