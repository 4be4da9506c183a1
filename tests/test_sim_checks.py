"""The simulator refuses, up front and by name, what could never run: requests that can never
arrive, a config field of the wrong type, an empty workload; and its workload generators and
comparisons never leak a raw Python or torch error for a bad argument (issue 33)."""
from __future__ import annotations

import math

import pytest

from kvlab import InvalidArgument
from kvlab.serving.sim import RequestSpec, SimConfig, Simulator, Workload, make_workload, simulate
from kvlab.serving.sim.compare import compare_caches, lookup_cost, pool_sizes


def wl(*specs) -> Workload:
    return Workload("w", "", tuple(specs))


def spec(rid, arrival=0, **kw) -> RequestSpec:
    return RequestSpec(rid, (1, 2, 3), (4, 5), arrival, **kw)


@pytest.mark.parametrize("arrival", [math.nan, math.inf, -1, 10**9, 5000, "3", True, None])
def test_a_request_that_can_never_arrive_is_refused(arrival):
    with pytest.raises(InvalidArgument, match=r"workload request 1\.arrival"):
        Simulator(wl(spec(0), spec(1, arrival)))


@pytest.mark.parametrize("after, why", [(1, "itself"), (7, "missing"), (-1, "negative"), (1.0, "float")])
def test_after_must_name_another_request(after, why):
    with pytest.raises(InvalidArgument, match=r"workload request 1\.after"):
        Simulator(wl(spec(0), spec(1, after=after)))


def test_requests_waiting_for_each_other_are_refused():
    with pytest.raises(InvalidArgument, match="no cycle"):
        Simulator(wl(spec(0, after=2), spec(1), spec(2, after=0)))
    simulate(wl(spec(0), spec(1, after=0), spec(2, 1, after=1)), num_pages=8)  # a chain is fine


def test_an_arrival_below_max_steps_runs_and_one_at_it_is_refused():
    simulate(wl(spec(0, 30)), max_steps=40, num_pages=4)
    with pytest.raises(InvalidArgument, match="< 40"):
        Simulator(wl(spec(0, 40)), SimConfig(max_steps=40))


@pytest.mark.parametrize("field, value", [
    ("prefill_budget", math.nan), ("prefill_budget", "8"), ("prefill_budget", 8.0), ("prefill_budget", 0),
    ("prefill_budget", True), ("num_pages", 2.5), ("max_running", 0), ("max_steps", None),
    ("page_size", False), ("max_seq_len", 1.5), ("chunked_prefill", 1), ("cache_after_prefill", "yes"),
    ("remap_duplicates", None), ("page_table_writer", "gpu"), ("prefix_cache", "lru"),
    ("policy", "lifo"), ("policy", 3)])
def test_every_config_field_is_checked_by_name(field, value):
    from dataclasses import replace

    with pytest.raises(InvalidArgument, match=rf"config\.{field}"):
        Simulator(make_workload("few_shot"), replace(SimConfig(), **{field: value}))


def test_a_config_that_is_not_one_is_refused():
    with pytest.raises(InvalidArgument, match="config"):
        Simulator(make_workload("few_shot"), {"page_size": 4})
    with pytest.raises(InvalidArgument, match="config"):
        simulate(make_workload("few_shot"), {"page_size": 4})
    with pytest.raises(InvalidArgument, match="page_sizes"):
        simulate(make_workload("few_shot"), page_sizes=4)


@pytest.mark.parametrize("workload, argument", [
    (Workload("empty", "", ()), "workload.requests"), ([spec(0)], "workload"),
    (wl(spec(1)), "workload.requests"), (wl(spec(0), spec(0)), "workload.requests"),
    (wl(RequestSpec(0, (), (1,), 0)), r"workload request 0\.prompt"),
    (wl(RequestSpec(0, (1,), (1.5,), 0)), r"workload request 0\.output"),
    (wl(spec(0, abort_after=0)), r"workload request 0\.abort_after"),
    (wl(spec(0, max_new_tokens=1)), r"workload request 0\.max_new_tokens")])
def test_bad_workloads_are_refused_by_name(workload, argument):
    with pytest.raises(InvalidArgument, match=argument):
        Simulator(workload)


def test_max_new_tokens_must_fit_alone():
    with pytest.raises(InvalidArgument, match="must fit in memory alone"):
        Simulator(wl(spec(0, max_new_tokens=40)), SimConfig(page_size=4, num_pages=8))
    simulate(wl(spec(0, max_new_tokens=29)), page_size=4, num_pages=8)      # 32 positions: fits


@pytest.mark.parametrize("name, kw, argument", [
    ("few_shot", dict(n_requests=0), "n_requests"), ("few_shot", dict(n_requests=2.0), "n_requests"),
    ("random_prompts", dict(mean_gap=math.inf), "mean_gap"), ("random_prompts", dict(mean_gap=-1), "mean_gap"),
    ("random_prompts", dict(mean_gap=math.nan), "mean_gap"), ("random_prompts", dict(abort_fraction=2), "abort_fraction"),
    ("mixed", dict(scale=0), "scale"), ("mixed", dict(n_requests=3), "n_requests"),
    ("multi_turn_chat", dict(think_steps=-1), "think_steps"), ("eos_long_tail", dict(tail=0), "tail"),
    ("eos_long_tail", dict(max_new_tokens=0), "max_new_tokens"), ("long_prompt_burst", dict(prompt_len=(9, 3)), "prompt_len")])
def test_make_workload_names_the_bad_argument(name, kw, argument):
    with pytest.raises(InvalidArgument, match=argument):
        make_workload(name, **kw)


@pytest.mark.parametrize("seed", [None, 1.5, "x"])
def test_a_seed_is_an_int(seed):
    with pytest.raises(InvalidArgument, match="seed"):
        make_workload("random_prompts", seed=seed)


@pytest.mark.parametrize("call, argument", [
    (lambda w: pool_sizes(w, 0), "page_size"), (lambda w: pool_sizes(Workload("e", "", ()), 4), "workload"),
    (lambda w: compare_caches([w], pools=("huge",)), "pools"), (lambda w: compare_caches([w], caches=()), "caches"),
    (lambda w: compare_caches([w], caches=("lru",)), "caches"), (lambda w: compare_caches(w), "workloads"),
    (lambda w: compare_caches([w], SimConfig(page_size=0)), "config.page_size"),
    (lambda w: lookup_cost([64], repeats=0), "repeats"), (lambda w: lookup_cost([0]), r"prompt_lens\[0\]"),
    (lambda w: lookup_cost([64], page_size=-4), "page_size"), (lambda w: lookup_cost(64), "prompt_lens"),
    (lambda w: lookup_cost([64], seed=-1), "seed")])
def test_comparisons_refuse_bad_arguments_by_name(call, argument):
    with pytest.raises(InvalidArgument, match=argument):
        call(make_workload("few_shot", n_requests=2))
