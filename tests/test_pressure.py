"""kvlab.serving.pressure: the four memory policies of chapter 12, their constants and rules, and the
manager-level stop / restore both serving loops share."""
from __future__ import annotations

import random

import pytest
import torch

from kvlab import CacheManager, InvalidArgument, Req
from kvlab.base.args import div_ceil
from kvlab.alloc.paging import new_page_table
from kvlab.serving.pressure import (CHAPTER_07, POLICIES, RecomputeOnPreempt, RequestView, RetractDecode,
                            SwapToHost, make_policy, next_token_ratio, restore_request, resume_plan,
                            stop_request, victim_order)

from faults import Boom, failing


def view(key, prompt_len, generated, *, max_new=20, admitted=0, arrived=0, mapped=0, positions=None):
    positions = prompt_len + generated if positions is None else positions
    return RequestView(key, prompt_len, generated, max_new, positions, mapped, admitted, arrived)


def test_sglangs_constants():
    # python/sglang/global_config.py: 0.7, 0.14, 600, retract_decode_steps = 20
    p = RetractDecode()
    assert (p.init_ratio, p.min_ratio_factor, p.decay_steps, p.retract_decode_steps) == (0.7, 0.14, 600, 20)
    assert p.min_ratio == pytest.approx(0.098) and p.decay == pytest.approx((0.7 - 0.098) / 600)
    assert p.clip_max_new == 4096


def test_victim_orders():
    views = [view("a", 5, 3, admitted=0, arrived=2), view("b", 9, 1, admitted=3, arrived=0),
             view("c", 4, 1, admitted=1, arrived=3), view("d", 7, 9, admitted=2, arrived=1)]
    assert victim_order("recompute", views) == ["b", "d", "c", "a"]      # latest admitted first
    assert victim_order("swap", views) == ["c", "a", "d", "b"]           # latest arrival first
    # fewest outputs first; of b and c (one each) the longer prompt
    assert victim_order("retract", views) == ["b", "c", "a", "d"]
    with pytest.raises(InvalidArgument):
        victim_order("reserve", views)


def test_sglangs_victim_order_is_its_sort_then_pop():
    rng = random.Random(0)
    for _ in range(50):
        reqs = [(rng.randrange(5), rng.randrange(1, 9)) for _ in range(rng.randint(1, 6))]  # (out, in)
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i][0], -reqs[i][1]), reverse=True)
        popped = []
        while order:
            popped.append(order.pop())              # schedule_batch.py retract_decode
        views = [view(i, n, o) for i, (o, n) in enumerate(reqs)]
        got = victim_order("retract", views)
        assert [reqs[i] for i in got] == [reqs[i] for i in popped]


def test_the_ratio_decays_to_its_minimum_and_recovers_after_a_retraction():
    p = RetractDecode()
    ratio, seen = p.init_ratio, []
    for _ in range(700):
        ratio = next_token_ratio(p, ratio, retracted=False)
        seen.append(ratio)
    assert seen[0] == pytest.approx(0.7 - p.decay) and seen[-1] == pytest.approx(0.098)
    assert seen.index(min(seen)) <= 601 and min(seen) >= p.min_ratio - 1e-12
    remaining = [view(0, 5, 30, max_new=100), view(1, 5, 10, max_new=50)]
    jumped = next_token_ratio(p, ratio, retracted=True, remaining=remaining)
    assert jumped == pytest.approx((30 + 10 + 20 * 2) / 150)
    assert next_token_ratio(p, ratio, retracted=True, remaining=[view(0, 5, 90, max_new=100)]) == 1.0
    assert next_token_ratio(p, ratio, retracted=True, remaining=[]) == p.init_ratio


def test_what_each_policy_promises():
    P = 4
    running = view("r", 10, 3, max_new=20, positions=13, mapped=3)     # may map 29 positions in all
    assert make_policy("reserve").start().promised_pages(running, P) == div_ceil(29, P) - 3
    for name in ("recompute", "swap"):
        assert make_policy(name).start().promised_pages(running, P) == div_ceil(13, P) - 3 == 1
    run = make_policy("retract").start()
    assert run.promised_pages(running, P) == div_ceil(13 + 12, P) - 3       # ceil(0.7 * 17) = 12
    run.ratio = 0.1
    assert run.promised_pages(running, P) == div_ceil(13 + 2, P) - 3
    assert run.promised_pages(running, P, new=True) == div_ceil(29, P) - 3  # a newcomer: all of it
    assert run.unused_pages(running, P) == run.promised_pages(running, P) - 1


def test_resume_plans():
    assert resume_plan("swap", saved=9, hit=4, input_len=10) == (9, 4, (4, 9), (9, 10))
    assert resume_plan("recompute", saved=9, hit=4, input_len=10).recomputed == 5
    assert resume_plan("swap", saved=9, hit=4, input_len=10).recomputed == 0
    assert resume_plan("swap", saved=3, hit=8, input_len=12) == (3, 8, (8, 8), (8, 12))
    with pytest.raises(InvalidArgument):
        resume_plan("swap", saved=10, hit=0, input_len=10)


@pytest.mark.parametrize("spec, argument", [("lifo", "policy"), (None, "policy"),
                                            (RecomputeOnPreempt(), None)])
def test_make_policy(spec, argument):
    if argument is None:
        assert make_policy(spec) is spec
    else:
        with pytest.raises(InvalidArgument, match=argument):
            make_policy(spec)


@pytest.mark.parametrize("kw", [dict(init_ratio=0), dict(init_ratio=1.5), dict(init_ratio=float("nan")),
                                dict(decay_steps=True), dict(retract_decode_steps=1.5),
                                dict(clip_max_new=0)])
def test_bad_retract_settings_are_refused(kw):
    with pytest.raises(InvalidArgument):
        RetractDecode(**kw)


def test_bad_settings_of_the_other_policies_are_refused():
    with pytest.raises(InvalidArgument):
        RecomputeOnPreempt(keep_computed="yes")
    with pytest.raises(InvalidArgument):
        SwapToHost(host_pages=-2)
    assert set(POLICIES) == {"reserve", "recompute", "retract", "swap"}
    assert CHAPTER_07.on_preempt == "release" and CHAPTER_07.admit_after_preempt


# --- stop and restore through the cache manager -------------------------------------------------


def running_request(P=4, prompt_len=10, decoded=5, num_pages=16):
    """A manager and one request: prompt prefilled and cached, ``decoded`` tokens decoded."""
    cm = CacheManager(num_pages, P, new_page_table(2, 64, P), page_table_writer="host")
    req = Req(list(range(100, 100 + prompt_len)), table_idx=1)
    cm.complete_step(cm.prefill([req]), [7])
    for t in range(decoded):
        cm.complete_step(cm.decode_step([req]), [8 + t])
    return cm, req


@pytest.mark.parametrize("keep", [True, False])
def test_stop_then_restore_brings_back_what_the_cache_no_longer_holds(keep):
    P = 4
    cm, req = running_request(P)
    row = cm.page_table[1, : req.cached_len].clone()
    saved = stop_request(cm, req, keep=keep)
    assert saved == 10 + 5 and cm.running == []
    cm.check_integrity()
    back = Req(list(req.input_ids), table_idx=0)
    copied = []
    n = restore_request(cm, back, saved, lambda s, e, slots: copied.append((s, e, slots.tolist())))
    hit = saved // P * P if keep else 10 // P * P              # keep: every whole page was cached
    assert n == saved - hit and copied[0][:2] == (hit, saved) and len(copied[0][2]) == saved - hit
    assert back.cached_len == saved and back.device_len == saved + 1
    assert cm.page_table[0, :hit].tolist() == row[:hit].tolist()  # the cached pages themselves
    cm.check_integrity()


@pytest.mark.parametrize("where", ["allocate_paged", "copy"])
def test_a_restore_that_fails_changes_nothing(where):
    cm, req = running_request()
    saved = stop_request(cm, req, keep=False)
    before = (sorted(cm.free_slots.tolist()), cm.page_table.clone(), cm.prefix_cache.size_info)
    back = Req(list(req.input_ids), table_idx=0)
    copy = None
    if where == "allocate_paged":
        cm.allocate_paged = failing(cm.allocate_paged, 0)
    else:
        copy = failing(lambda s, e, slots: None, 0, after=True)
    with pytest.raises(Boom):
        restore_request(cm, back, saved, copy)
    assert (sorted(cm.free_slots.tolist()), cm.prefix_cache.size_info) == (before[0], before[2])
    assert torch.equal(cm.page_table, before[1]) and cm.running == []
    cm.check_integrity()
