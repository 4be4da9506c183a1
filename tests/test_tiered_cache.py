"""The KV hierarchy's cache (chapter 13): kvlab.prefix.tiered_cache.TieredRadixCache under the cache
manager, with real copies on a CPU -- every load-back brings the right K/V, every page is in one
place, every write policy and page size; its plans agree with the oracle; the host tier's pins."""
from __future__ import annotations

import random

import pytest
import torch

from hierarchy_helpers import Scene
from kvlab.base.errors import CacheMisuse, InvalidArgument
from kvlab.course.reference.hierarchy_ref import (eviction_plan_ref, load_back_plan_ref)
from kvlab.prefix.host_tier import HostTier
from kvlab.prefix.tier_plans import TierNode, eviction_plan, load_back_plan
from kvlab.prefix.tiered_cache import TieredRadixCache

POLICIES = ("write_through", "write_through_selective", "write_back")


def conversations(rng, n=5, turns=4, P=4):
    """Multi-turn chats: each turn re-sends the history and adds a few tokens."""
    chats = [[rng.randrange(200) for _ in range(rng.randint(3, 3 * P))] for _ in range(n)]
    for _ in range(turns):
        for i in rng.sample(range(n), n):
            chats[i] = chats[i] + [rng.randrange(200) for _ in range(rng.randint(1, 2 * P))]
            yield chats[i]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_every_load_back_brings_the_right_kv(policy, page_size, tmp_path):
    rng = random.Random(page_size)
    scene = Scene(page_size, device_pages=max(4, 48 // page_size), host_pages=max(12, 160 // page_size),
                  policy=policy, max_len=256)
    for ids in conversations(rng):
        scene.serve(ids)
        scene.check()
    loaded = sum(lb.host for lb in scene.loads)
    assert loaded > 0, "the device pool was meant to be too small: some prefixes come back from the host"


@pytest.mark.parametrize("policy", POLICIES)
def test_copies_on_the_runtimes_device(policy, tmp_path):
    """The same conversations with the pool on kvlab.DEVICE: on a GPU the host tier is pinned and
    the transfers run on their own streams, and every loaded page is still right."""
    import kvlab

    scene = Scene(4, device_pages=12, host_pages=40, policy=policy, directory=tmp_path,
                  device=kvlab.DEVICE, max_len=256)
    for ids in conversations(random.Random(7)):
        scene.serve(ids)
        scene.check()
    assert sum(lb.host for lb in scene.loads) > 0
    assert scene.cache.persist() >= 0 and scene.cache.copies.collect()["h2d_bytes"] > 0


def test_a_hierarchy_hits_more_than_the_device_alone():
    chats = list(conversations(random.Random(3), n=6, turns=5))
    hits = {}
    for host_pages in (None, 64):
        scene = Scene(4, device_pages=12, host_pages=host_pages or 1, policy="write_through")
        for ids in chats:
            scene.serve(ids)
        hits[host_pages] = sum(lb.cached for lb in scene.loads)
    assert hits[64] > hits[None]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_disk_tier_serves_a_second_cache_on_the_same_directory(policy, tmp_path):
    chats = list(conversations(random.Random(4), n=4, turns=3))
    first = Scene(4, device_pages=8, host_pages=8, policy=policy, directory=tmp_path)
    for ids in chats:
        first.serve(ids)
    first.cache.persist()
    second = Scene(4, device_pages=8, host_pages=8, policy=policy, directory=tmp_path)
    cold = Scene(4, device_pages=8, host_pages=8, policy=policy)
    for ids in chats[-4:]:
        second.serve(ids)
        cold.serve(ids)
        second.check()
    warm_hits = sum(lb.disk for lb in second.loads)
    assert warm_hits > sum(lb.cached for lb in cold.loads), "the first cache's pages are on disk"


def test_plans_agree_with_the_oracle():
    rng = random.Random(0)
    for _ in range(300):
        nodes, n = [], rng.randint(1, 9)
        for uid in range(n):
            parent = rng.choice([None] + [x.uid for x in nodes])
            up_dev = parent is None or bool(nodes[parent].device_pages)
            dev = up_dev and rng.random() < 0.6
            host = (not dev) or rng.random() < 0.5
            pages = rng.randint(1, 3)
            nodes.append(TierNode(uid, parent, pages, tuple(range(pages)) if dev else (),
                                  tuple(range(pages)) if host else (), 0, rng.randrange(20),
                                  rng.random() < 0.2))
        locked = {x.uid for x in nodes if x.device_pages and rng.random() < 0.15}
        nodes = [x._replace(ref_count=int(any(y.uid in locked for y in nodes))) if x.uid in locked else x
                 for x in nodes]
        need, free = rng.randint(0, 8), rng.randint(0, 4)
        for policy in POLICIES:
            got, want = eviction_plan(nodes, need, free, policy), eviction_plan_ref(nodes, need, free, policy)
            assert (got.victims, got.spills, set(got.discarded)) == (want.victims, want.spills, set(want.discarded))
        path = [x for x in nodes if x.parent is None][:1]
        free_slots = [p * 4 for p in rng.sample(range(50), 12)]
        assert load_back_plan(path, free_slots, 4) == load_back_plan_ref(path, free_slots, 4)


def test_host_pages_come_in_runs_and_a_pinned_page_is_never_freed():
    host = HostTier(10, 4)
    a = host.take(3)
    assert a == [0, 1, 2]
    host.give_back([1])
    assert host.take(2) == [3, 4], "a run of neighbours before scattered pages"

    class Reading:
        def __init__(self):
            self.finished = False

        def done(self):
            return self.finished

        def wait(self):
            self.finished = True

    reading = Reading()
    host.pin([0], reading)
    with pytest.raises(CacheMisuse, match="load-back"):
        host.give_back([0, 2])
    assert host.num_free == 10 - 4, "a refused give_back frees nothing"
    reading.finished = True
    host.give_back([0, 2])
    with pytest.raises(InvalidArgument, match="in use"):
        host.give_back([0])


def test_bad_arguments_are_refused_by_name(tmp_path):
    host = HostTier(4, 4)
    with pytest.raises(InvalidArgument, match="policy"):
        TieredRadixCache(4, "cpu", host=host, policy="write_around")
    with pytest.raises(InvalidArgument, match="host"):
        TieredRadixCache(4, "cpu", host=8)
    with pytest.raises(InvalidArgument, match="host"):
        TieredRadixCache(2, "cpu", host=host)
    with pytest.raises(InvalidArgument, match="host_pages"):
        HostTier(0, 4)
    with pytest.raises(InvalidArgument, match="host_pages"):
        HostTier(True, 4)


def test_evict_leaves_refuses_a_list_that_already_holds_records():
    cache = TieredRadixCache(4, "cpu", host=HostTier(4, 4))
    with pytest.raises(InvalidArgument, match="into"):
        cache.evict_leaves(4, into=[None])
    assert cache.evict_leaves(4, into=[]) == []          # nothing cached: nothing to evict
