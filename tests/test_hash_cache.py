"""Chapter 11's hash-chained prefix cache: against the plain-Python oracle on random traces, its
invariants, its errors, and its use by CacheManager and the simulator."""
from __future__ import annotations

import random

import pytest
import torch
from cache_state import hash_cache_state
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab import CacheManager, HashPrefixCache, Req
from kvlab.base.errors import CacheMisuse, IntegrityError, InvalidArgument, OutOfPages
from kvlab.prefix.hash_chain import FreeQueue, TakenPage, chain_hash, page_hashes
from kvlab.alloc.paging import new_page_table
from kvlab.course.reference import PagePoolRef


def state(cache: HashPrefixCache) -> dict:
    return dict(refs=list(cache.ref_count), hashes=list(cache.page_hash), map=dict(cache.hash_to_page),
                queue=list(cache.free_queue), locks=dict(cache._locks), evicted=cache.evicted_pages)


def agree(cache: HashPrefixCache, ref: PagePoolRef) -> None:
    assert cache.ref_count == ref.refs
    assert list(cache.free_queue) == ref.queue
    assert set(cache.hash_to_page.values()) == ref.cached_pages()
    for key, page in ref.page_of.items():  # a page's hash stands for its whole prefix
        assert cache.page_hash[page] == page_hashes(list(key), cache.page_size)[-1]
    assert cache.evicted_pages == ref.evicted
    cache.check_integrity()


# --- the chained hash ----------------------------------------------------------------------


def test_the_chained_hash_is_the_same_on_every_machine_and_run():
    # BLAKE2b-128 over nothing (no parent) and the tokens 1, 2 as little-endian int64
    assert chain_hash(None, [1, 2]).hex() == __import__("hashlib").blake2b(
        (1).to_bytes(8, "little") + (2).to_bytes(8, "little"), digest_size=16).hexdigest()
    assert len(chain_hash(None, [1, 2])) == 16


def test_a_page_hash_covers_its_whole_prefix():
    a, b = page_hashes([1, 2, 3, 4], 2), page_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]  # the same page [3 4] after another first page
    assert a[1] == chain_hash(chain_hash(None, [1, 2]), [3, 4])
    assert chain_hash(None, [3, 4]) not in (a[1], b[1])  # without the parent it would collide
    assert page_hashes([1, 2, 3], 2) == a[:1]  # a partial last page has no hash
    assert page_hashes([], 4) == [] and page_hashes([5], 1) == [chain_hash(None, [5])]
    with pytest.raises(InvalidArgument, match="int64"):
        chain_hash(None, [1 << 70])


def test_the_free_queue_keeps_its_order_and_refuses_double_entries():
    q = FreeQueue([3, 1, 2])
    q.remove(1)
    q.append(1)
    q.appendleft(7)
    assert list(q) == [7, 3, 2, 1] and q.head(2) == [7, 3] and q.popleft() == 7
    with pytest.raises(CacheMisuse):
        q.append(3)
    with pytest.raises(CacheMisuse):
        q.remove(9)


# --- the block manager's words against the oracle ------------------------------------------


OPS = st.lists(st.tuples(st.sampled_from(["new", "decode", "finish", "take"]), st.integers(0, 10**6)),
               min_size=5, max_size=40)


@given(ops=OPS, page_size=st.sampled_from([1, 2, 4]), uncached_first=st.booleans())
def test_random_traces_agree_with_the_oracle(ops, page_size, uncached_first):
    rng = random.Random(len(ops) * 7 + page_size)
    prompts = [[rng.randrange(5) for _ in range(3 * page_size)] for _ in range(2)]
    cache = HashPrefixCache(10, page_size, device="cpu", uncached_first=uncached_first)
    ref = PagePoolRef(10, page_size, uncached_first)
    live: dict[int, tuple[list[int], tuple[int, ...]]] = {}
    for n, (op, x) in enumerate(ops):
        r = random.Random(x)
        if op == "new" or not live:
            ids = r.choice(prompts)[: r.randrange(3 * page_size + 1)] + [r.randrange(5) for _ in range(r.randrange(3))]
            if not ids:
                continue
            try:
                got = cache.allocate(ids)
            except OutOfPages:
                with pytest.raises(OutOfPages):
                    ref.allocate(ids)
                continue
            assert got == tuple(ref.allocate(ids))
            live[n] = (ids, got.pages)
        elif op == "decode":
            sid = r.choice(sorted(live))
            ids, pages = live[sid]
            ids = ids + [r.randrange(5)]
            if len(pages) < -(-len(ids) // page_size) and not cache.free_queue:
                continue
            pages = cache.append_token(pages, ids)
            assert pages == ref.append_token(live[sid][1], ids)
            live[sid] = (ids, pages)
        elif op == "finish":
            sid = r.choice(sorted(live))
            cache.free(live[sid][1])
            ref.free(live.pop(sid)[1])
        else:  # the cache manager's "pages, please": the head of the queue
            n_pages = r.randrange(0, 3)
            taken = cache.evict_leaves(n_pages * page_size)
            assert [t.page for t in taken] == [ref.take_head() for _ in range(min(n_pages, len(ref.queue)))]
            cache.free([t.page for t in taken])
            ref.free([t.page for t in taken])
        agree(cache, ref)


def test_allocation_hits_the_cached_chain_and_caches_its_new_full_pages():
    cache = HashPrefixCache(8, 2, device="cpu")
    first = cache.allocate([1, 2, 3, 4, 5])
    assert first == ((0, 1, 2), 0)
    assert cache.page_hash[2] is None  # [5] is half a page: never cached
    second = cache.allocate([1, 2, 3, 4, 9, 9])
    assert second.cached_len == 4 and second.pages[:2] == (0, 1) and cache.ref_count[:2] == [2, 2]
    cache.free(first.pages)
    assert list(cache.free_queue) == [4, 5, 6, 7, 2]  # pages 0 and 1 are still held by second
    cache.free(second.pages)
    assert list(cache.free_queue) == [4, 5, 6, 7, 2, 3, 1, 0]  # last page first: the deep end goes first
    third = cache.allocate([1, 2, 3, 4, 7])
    assert third == ((0, 1, 4), 4)  # a hit takes a free cached page back out of the queue
    cache.check_integrity()


def test_a_freed_page_stays_findable_until_the_queue_hands_it_out():
    cache = HashPrefixCache(3, 2, device="cpu")
    cache.free(cache.allocate([1, 2, 3, 4]).pages)  # queue: 2 | 1 0
    assert cache.match([1, 2, 3, 4]).cached_len == 4
    cache.allocate([7, 7])  # takes page 2 (never cached)
    assert cache.match([1, 2, 3, 4]).cached_len == 4 and cache.evicted_pages == 0
    cache.allocate([8, 8])  # takes page 1: [3 4] is evicted, its hash dropped
    assert cache.match([1, 2, 3, 4]).cached_len == 2 and cache.evicted_pages == 1
    cache.check_integrity()


def test_uncached_first_puts_freed_pages_without_a_hash_at_the_head():
    nano, vllm = (HashPrefixCache(6, 2, device="cpu", uncached_first=u) for u in (False, True))
    for cache in (nano, vllm):
        cache.free(cache.allocate([1, 2, 3, 4, 5]).pages)
    assert list(nano.free_queue) == [3, 4, 5, 2, 1, 0]
    assert list(vllm.free_queue) == [2, 3, 4, 5, 1, 0]


def test_decode_fills_the_partial_page_and_caches_it_when_full():
    cache = HashPrefixCache(6, 2, device="cpu")
    ids = [1, 2, 3]
    pages = cache.allocate(ids).pages
    ids.append(4)
    pages = cache.append_token(pages, ids)  # [3 4] is full now: cached
    assert pages == (0, 1) and cache.page_hash[1] == page_hashes(ids, 2)[1]
    ids.append(5)
    pages = cache.append_token(pages, ids)  # 5 starts a new page
    assert pages == (0, 1, 2) and cache.page_hash[2] is None
    cache.check_integrity()


# --- refusals change nothing ---------------------------------------------------------------


def test_a_count_never_goes_below_zero():
    cache = HashPrefixCache(4, 2, device="cpu")
    got = cache.allocate([1, 2, 3])
    cache.free(got.pages)
    before = state(cache)
    with pytest.raises(CacheMisuse, match="freed twice"):
        cache.free(got.pages)
    with pytest.raises(CacheMisuse):
        cache.free([3, 3])
    assert state(cache) == before


def test_out_of_pages_is_decided_before_anything_changes():
    cache = HashPrefixCache(3, 2, device="cpu")
    cache.allocate([1, 2, 3, 4])
    before = state(cache)
    with pytest.raises(OutOfPages):
        cache.allocate([5, 6, 7, 8])
    assert state(cache) == before and cache.pages_needed([1, 2, 3, 4, 5]) == 1


def test_insert_and_lock_follow_the_radix_cache_contract():
    cache = HashPrefixCache(8, 2, device="cpu")
    slots = cache.evict(6)  # three pages for the caller: 0, 1, 2
    assert slots.tolist() == [0, 1, 2, 3, 4, 5]
    already, handle = cache.insert_prefix([1, 2, 3, 4, 5], slots[:5])
    assert already == 0 and handle.cached_len == 4 and handle.pages == (0, 1)
    assert cache.ref_count[:3] == [0, 0, 1]  # inserted pages are evictable until locked
    cache.lock_handle(handle, owner="a")
    assert cache.is_locked_by(handle, "a") and not cache.is_locked_by(handle, "b")
    with pytest.raises(CacheMisuse, match="not locked by"):
        cache.lock_handle(handle, unlock=True, owner="b")
    assert cache.size_info == (0, 4)
    assert cache.match_prefix([1, 2, 3, 4, 9]).handle.get_matched_indices().tolist() == [0, 1, 2, 3]
    mine = cache.evict(2)  # page 3 for the caller; its first two pages are duplicates
    again = cache.insert_prefix([1, 2, 3, 4, 6, 6], torch.cat([torch.arange(10, 14), mine]))
    assert again.cached_len == 4 and again.handle.pages == (0, 1, 3)
    with pytest.raises(InvalidArgument, match="held by the caller alone"):
        cache.insert_prefix([1, 2, 8, 8], [0, 1, 14, 15])  # page 7 is free, not the caller's
    with pytest.raises(InvalidArgument, match="one slot per token"):
        cache.insert_prefix([1, 2], [0])
    cache.lock_handle(handle, unlock=True, owner="a")
    cache.check_integrity()


def test_a_handle_whose_page_was_reused_cannot_be_locked():
    cache = HashPrefixCache(2, 2, device="cpu")
    pages = cache.evict(4)
    _, handle = cache.insert_prefix([1, 2, 3, 4], pages)
    cache.evict(4)  # both pages handed out again: the prefix is gone
    assert not cache.holds(handle)
    with pytest.raises(CacheMisuse, match="reused"):
        cache.lock_handle(handle, owner="a")
    with pytest.raises(CacheMisuse):
        handle.get_matched_indices()


def test_undo_evict_puts_pages_and_hashes_back():
    cache = HashPrefixCache(4, 2, device="cpu")
    cache.free(cache.allocate([1, 2, 3, 4]).pages)
    before = state(cache)
    taken = cache.evict_leaves(6)  # pages 2, 3 (never used) and 1 ([3 4], evicted)
    assert cache.match([1, 2, 3, 4]).cached_len == 2 and cache.evicted_pages == 1
    cache.undo_evict(taken)
    assert state(cache) == before


# --- a caller's rollback: every step and its undo leave the cache exactly as it was ----------


def test_the_free_queue_puts_pages_back_where_they_were_taken_from():
    q = FreeQueue([5, 1, 4, 2, 3])
    for page in (1, 4, 3):
        q.remove(page)
    q.append(9)
    assert list(q) == [5, 2, 9] and not q.can_restore(3)  # 3 left from the end, where 9 is now
    q.remove(9)
    for page in (3, 4, 1):  # last taken out, first put back
        q.restore(page)
    assert list(q) == [5, 1, 4, 2, 3] and len(q) == 5
    q.remove(4)
    q.remove(2)
    with pytest.raises(CacheMisuse, match="changed"):
        q.restore(4)  # its right neighbour has gone meanwhile
    assert list(q) == [5, 1, 3]


def test_undo_lock_puts_the_free_pages_it_took_back_in_their_places():
    cache = HashPrefixCache(8, 2, device="cpu")
    for ids in ([1, 2, 3, 4], [5, 6, 7, 8]):  # both chains cached and free, [1 2|3 4] in the middle
        cache.free(cache.allocate(ids).pages)
    before = state(cache)
    handle = cache.match([1, 2, 3, 4])
    assert handle == cache.match([1, 2, 3, 4]) and handle != cache.match([1, 2])  # the same pages, the same lock
    cache.lock_handle(handle, owner="a")
    cache.lock_handle(handle, owner="a")
    assert cache.locks_held(handle, "a") == 2 and cache.locks_held(handle, "b") == 0
    with pytest.raises(CacheMisuse, match="not locked by 'b'"):
        cache.undo_lock(handle, "b")
    cache.undo_lock(handle, "a")
    cache.undo_lock(handle, "a")
    assert state(cache) == before
    cache.lock_handle(handle, owner="a")
    cache.lock_handle(handle, unlock=True, owner="a")  # an unlock queues them last: just used
    assert list(cache.free_queue)[-2:] == [1, 0] and state(cache) != before
    cache.check_integrity()


def test_undo_evict_copes_with_an_eviction_stopped_part_way():
    cache = HashPrefixCache(6, 2, device="cpu")
    cache.free(cache.allocate([1, 2, 3, 4, 5, 6]).pages)  # queue: 3 4 5 | 2 1 0 (cached)
    before = state(cache)
    taken = cache.evict_leaves(2 * 4)
    taken.append(TakenPage(1, cache.page_hash[1], cache.page_parent[1], cache.page_tokens[1],
                           cache._slots([1])))  # recorded, not taken yet
    cache.free_queue.popleft()  # take_free stopped after its first line: out of the queue only
    cache.undo_evict(taken)
    assert state(cache) == before
    other = cache.evict_leaves(2 * 6)
    cache.take_cached(other[0].page)  # someone else holds it now
    with pytest.raises(CacheMisuse, match="cannot go back"):
        cache.undo_evict(other)
    cache.free([other[0].page])
    cache.undo_evict(other)
    assert state(cache) == before


def test_undo_insert_gives_a_stale_hash_back_to_the_free_page_it_was_taken_from():
    cache = HashPrefixCache(8, 2, device="cpu")
    cache.free(cache.allocate([1, 2, 3, 4]).pages)  # queue: 2..7 | 1 0
    cache.take_cached(1)  # (building blocks) page 1 now queued after page 0 ...
    cache.free([1])
    taken = cache.evict_leaves(7 * 2)  # ... so [1 2] goes and page 1 keeps a stale [3 4] hash
    mine = [t for t in taken if t.page in (2, 3)]
    cache.free([t.page for t in taken if t not in mine])
    stale = cache.page_hash[1]
    assert stale is not None and cache.match([1, 2, 3, 4]).cached_len == 0
    before = state(cache)
    slots = torch.cat([t.value for t in mine])
    assert cache.insert_prefix([1, 2, 3, 4], slots).handle.pages == (2, 3)
    assert cache.hash_to_page[stale] == 3 and cache.page_hash[1] is None
    cache.undo_insert(slots)
    assert state(cache) == before and cache.hash_to_page[stale] == 1
    cache.check_integrity()


def test_undo_free_takes_back_only_the_pages_freed_without_a_hash():
    cache = HashPrefixCache(6, 2, device="cpu")
    held = cache.allocate([1, 2, 3]).pages  # [1 2] cached, [3] not
    before = state(cache)
    cache.free(held)
    cache.undo_free(held)
    assert cache.ref_count[held[1]] == 1 and held[1] not in cache.free_queue
    assert cache.ref_count[held[0]] == 0  # a cached page is another step's to put back
    cache.take_cached(held[0])
    assert state(cache) == before
    cache.check_integrity()


STEPS = ["evict", "lock", "insert", "free"]


@given(ops=OPS, page_size=st.sampled_from([1, 2, 4]), uncached_first=st.booleans(),
       step=st.sampled_from(STEPS), seed=st.integers(0, 10**6))
def test_every_step_and_its_undo_leave_the_cache_as_it_was(ops, page_size, uncached_first, step, seed):
    """Any state the block manager's words reach, then one step of the radix cache's words and
    its undo: the cache is as it was, free queue order, hashes and eviction count included."""
    rng, P = random.Random(seed), page_size
    prompts = [[rng.randrange(3) for _ in range(3 * P)] for _ in range(2)]
    cache = HashPrefixCache(10, P, device="cpu", uncached_first=uncached_first)
    live: list[tuple[int, ...]] = []
    for op, x in ops:  # a random state: sequences allocated and freed, prefixes locked
        r = random.Random(x)
        ids = r.choice(prompts)[: r.randrange(1, 3 * P + 1)] + [r.randrange(9) for _ in range(r.randrange(2))]
        if op in ("new", "decode") and cache.pages_needed(ids) <= len(cache.free_queue):
            live.append(cache.allocate(ids).pages)
        elif op == "finish" and live:
            cache.free(live.pop(r.randrange(len(live))))
        elif cache.match(ids).pages:
            cache.lock_handle(cache.match(ids), owner=r.choice(["a", "b"]))
    rng.shuffle(live)
    for pages in live[: rng.randrange(len(live) + 1)]:  # freed chains queue behind one another
        cache.free(pages)
    ids = rng.choice(prompts)[: rng.randrange(1, 3 * P + 1)] + [7] * rng.randrange(P + 1)
    if step in ("insert", "free"):  # the caller's own pages first, as the cache manager takes them
        mine = cache.evict_leaves(min(len(ids), P * len(cache.free_queue)))
        ids = ids[: len(mine) * P]
    before = hash_cache_state(cache)
    if step == "evict":
        cache.undo_evict(cache.evict_leaves(P * rng.randrange(len(cache.free_queue) + 1)))
    elif step == "lock":  # the prompt with the most free pages to take out of the queue
        handle = max((cache.match(p) for p in prompts), key=lambda h: sum(p in cache.free_queue for p in h.pages))
        cache.lock_handle(handle, owner="c")
        if handle.pages:  # (the empty handle locks nothing)
            cache.undo_lock(handle, "c")
    elif step == "insert":
        slots = torch.cat([t.value for t in mine])[: len(ids)] if mine else torch.empty(0, dtype=torch.int32)
        cache.insert_prefix(ids, slots)
        cache.undo_insert(slots)
    else:
        pages = [t.page for t in mine]
        cache.free(pages)
        cache.undo_free(pages)
    assert hash_cache_state(cache) == before
    cache.check_integrity()


# --- check_integrity catches each broken invariant ------------------------------------------


def _break(how: str) -> HashPrefixCache:
    cache = HashPrefixCache(6, 2, device="cpu")
    got = cache.allocate([1, 2, 3, 4, 5])
    if how == "referenced page in the queue":
        cache.free_queue.append(got.pages[0])
    elif how == "negative count":
        cache.ref_count[5] = -1
    elif how == "hash map disagrees":
        del cache.hash_to_page[cache.page_hash[1]]
    elif how == "a hash that ignores the parent":
        h = chain_hash(None, [3, 4])
        del cache.hash_to_page[cache.page_hash[1]]
        cache.page_hash[1], cache.hash_to_page[h] = h, 1
    elif how == "a lock on an uncached page":
        cache._locks[("x", (2,))] = 1
    return cache


@pytest.mark.parametrize("how", ["referenced page in the queue", "negative count", "hash map disagrees",
                                 "a hash that ignores the parent", "a lock on an uncached page"])
def test_check_integrity_names_each_broken_invariant(how):
    with pytest.raises(IntegrityError):
        _break(how).check_integrity()
    _break("nothing").check_integrity()


# --- the cache manager and the simulator on the hash cache ----------------------------------


def test_the_cache_manager_serves_requests_on_the_hash_cache():
    P = 2
    cm = CacheManager(8, P, new_page_table(3, 16, P), prefix_cache="hash", page_table_writer="host")
    assert cm.num_free_pages == 8 and len(cm.free_slots) == 0  # the free pages live in the cache
    a = Req([1, 2, 3, 4, 5], 0)
    cm.complete_step(cm.prefill([a]), [6])  # [1 2|3 4] cached, locked by a
    b = Req([1, 2, 3, 4, 9, 9, 9], 1)
    cm.prefill([b])
    assert b.cached_len == 4 and cm.page_table[1, :4].tolist() == cm.page_table[0, :4].tolist()
    cm.check_integrity()
    cm.release_req(b)
    cm.complete_step(cm.decode_step([a]), [7], [True])
    assert cm.prefix_cache.size_info.protected_size == 0 and cm.available_pages == 8
    cm.check_integrity()
    with pytest.raises(InvalidArgument, match="num_pages"):
        CacheManager(8, P, new_page_table(1, 8, P), prefix_cache=HashPrefixCache(9, P))


def test_a_failed_page_table_write_on_the_hash_cache_rolls_everything_back(monkeypatch):
    cm = CacheManager(5, 4, new_page_table(3, 20, 4), prefix_cache="hash", page_table_writer="host")
    a = Req(list(range(12)), 0)
    cm.complete_step(cm.prefill([a]), [0], [True])  # 3 cached pages in the queue, 2 never used
    b, c = Req([70 + i for i in range(6)], 1), Req([80 + i for i in range(9)], 2)
    for r in (b, c):
        cm.admit(r)

    def fail(*args):
        raise RuntimeError("the write failed")

    monkeypatch.setattr(kvlab.manager.cache_manager, "write_page_table", fail)
    before = (state(cm.prefix_cache), cm.page_table.tolist())
    with pytest.raises(RuntimeError, match="write failed"):
        cm.allocate_paged([b, c])
    assert (state(cm.prefix_cache), cm.page_table.tolist()) == before
    cm.check_integrity()


@pytest.mark.parametrize("name", ["shared_system_prompt", "multi_turn_chat", "few_shot", "random_prompts", "mixed"])
def test_with_room_to_spare_the_two_caches_agree_step_by_step(name):
    from kvlab.serving.sim import SimConfig, make_workload, simulate

    w = make_workload(name, seed=3)
    runs = {kind: simulate(w, SimConfig(num_pages=400, page_size=4, prefix_cache=kind))
            for kind in ("radix", "hash", "hash_uncached_first")}
    hits = {k: t.series("hit_tokens") for k, t in runs.items()}
    memory = {k: t.series("memory") for k, t in runs.items()}
    assert hits["radix"] == hits["hash"] == hits["hash_uncached_first"]
    assert memory["radix"] == memory["hash_uncached_first"]
    assert sum(t.summary().evicted_tokens for t in runs.values()) == 0


@pytest.mark.parametrize("kind", ["hash", "hash_uncached_first"])
def test_the_simulator_runs_on_the_hash_cache_under_pressure(kind):
    from kvlab.serving.sim import SimConfig, make_workload, simulate

    workload = make_workload("mixed", seed=1)
    timeline = simulate(workload, SimConfig(num_pages=20, page_size=4, prefix_cache=kind))
    s = timeline.summary()  # every step was checked (check_integrity of manager and cache)
    assert s.evicted_tokens > 0 and s.hit_tokens > 0 and s.finished + s.aborted == len(workload)
    assert all(r.memory.total == 20 for r in timeline.steps)
    assert timeline.cache_ops.matches > 0 and timeline.cache_ops.insert_us > 0


def test_a_prefix_cache_is_named_or_refused():
    from kvlab.serving.sim import SimConfig, make_workload, simulate

    with pytest.raises(InvalidArgument, match="config.prefix_cache"):
        simulate(make_workload("random_prompts", seed=0, n_requests=2), SimConfig(prefix_cache="tree"))
    with pytest.raises(InvalidArgument, match='"radix", "hash"'):
        CacheManager(4, 2, new_page_table(1, 8, 2), prefix_cache="tree")
    with pytest.raises(InvalidArgument, match="page_size"):
        CacheManager(4, 2, new_page_table(1, 8, 2), prefix_cache=HashPrefixCache(4, 4))


def test_the_chapter_scenes_tell_the_story_they_draw():
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.course.scenes.ch11_hash_cache import free_queue_figure, free_queue_steps, hash_chain_figure

    steps, cache = free_queue_steps()
    (_, first, taken), (_, second, _), (_, third, _) = steps
    assert first.free_queue == (6, 7, 3, 5, 4, 2, 1, 0) and list(taken) == [6, 7, 3, 5, 4]
    assert 4 not in dict(second.hashes) and second.free_queue == (2, 1, 0)  # B's [7 8 9 10] evicted
    assert {0, 1, 2} <= {p for p, r in enumerate(third.ref_counts) if r}  # D hit the system prompt
    cache.check_integrity()
    for fig in (hash_chain_figure(), free_queue_figure()):
        assert fig.axes


# --- a hash is never trusted alone; every argument is checked before the first change ------------


def test_a_forced_collision_between_pages_after_different_prefixes_is_no_hit(monkeypatch):
    """The parent is compared too: with a hash that ignores it (every page after any prefix
    collides with its twin), a page computed after [1 2] is never served after [9 9]."""
    import hashlib
    import struct

    def weak(parent, tokens):
        return hashlib.blake2b(struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()

    monkeypatch.setattr(kvlab.prefix.hash_cache, "_chain", weak)
    cache = HashPrefixCache(8, 2, device="cpu")
    a = cache.allocate([1, 2, 3, 4])
    b = cache.allocate([9, 9, 3, 4])  # its [3 4] collides with a's
    assert b.cached_len == 0 and b.pages[1] != a.pages[1]
    cache.free(b.pages)
    c = cache.allocate([9, 9, 3, 4, 5])
    assert c.cached_len == 2 and c.pages[1] != a.pages[1], "a page computed after another prefix was served"
    assert cache.match([9, 9, 3, 4]).pages == c.pages[:1]
    assert cache.lookup(weak(None, [3, 4]), [3, 4]) == a.pages[1]  # (without the parent: the tokens only)
    assert cache.lookup(weak(None, [3, 4]), [3, 4], weak(None, [9, 9])) is None
    assert cache.lookup(weak(None, [3, 4]), [3, 4], weak(None, [1, 2])) == a.pages[1]


@pytest.mark.parametrize("call, argument", [
    (lambda c, held, free: c.allocate([1, 2**63, 3]), "input_ids[1]"),
    (lambda c, held, free: c.allocate([1, True]), "input_ids[1]"),
    (lambda c, held, free: c.append_token([free], [1, 2, 3]), "pages[0]"),  # a page it does not hold
    (lambda c, held, free: c.append_token([-1], [1, 2]), "pages[0]"),
    (lambda c, held, free: c.append_token(list(held), [1, 2, 3, 4, 5, 6, 7, 8]), "pages"),  # too few pages
    (lambda c, held, free: c.append_token(list(held), []), "input_ids"),
    (lambda c, held, free: c.free(5), "pages"),
    (lambda c, held, free: c.free(None), "pages"),
    (lambda c, held, free: c.free([99]), "pages[0]"),
    (lambda c, held, free: c.free([held[0], "1"]), "pages[1]"),
    (lambda c, held, free: c.take_cached(-3), "page"),
    (lambda c, held, free: c.cache_page(free, b"short", [1, 2], None), "h"),
    (lambda c, held, free: c.lookup("h", [1, 2]), "h"),
    (lambda c, held, free: c.evict_leaves(2, into=()), "into"),
    (lambda c, held, free: c.evict_leaves(2, into=[None]), "into"),  # not empty: whose pages?
    (lambda c, held, free: c.lock_handle(c.match([1, 2]), unlock="yes"), "unlock"),
])
def test_a_bad_argument_is_refused_by_name_before_any_change(call, argument):
    cache = HashPrefixCache(6, 2, device="cpu")
    held = cache.allocate([1, 2, 3]).pages
    free = list(cache.free_queue)[0]
    before = hash_cache_state(cache)
    with pytest.raises(InvalidArgument) as caught:
        call(cache, held, free)
    assert caught.value.argument == argument
    assert hash_cache_state(cache) == before
