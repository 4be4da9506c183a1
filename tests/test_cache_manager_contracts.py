"""The cache manager keeps its promises under misuse and failure (chapters 05-06).

* locks have owners: an unlock by anyone but the holder raises CacheMisuse and changes nothing;
* allocate_paged (and prefill) are all or nothing: a page-table write that fails after pages
  were taken, or cached pages evicted, leaves every piece of state as it was;
* every door refuses bools, floats and strings where it wants ints, state unchanged;
* LRU: a match stamps only the nodes it used;
* the serving words: pages_needed / available_pages, prefill / decode_step / complete_step.

Every refused call is followed by a comparison of *all* state (tests/cache_state.py).
"""
from __future__ import annotations

import pytest
import torch
from cache_state import MANAGER_MODULES, assert_unchanged, manager_state, without_ids
from faults import Boom, Interrupted, failing, interrupt_at_line

import kvlab.manager.cache_manager
from kvlab import (CacheManager, CacheMisuse, HashPrefixCache, IntegrityError, InvalidArgument,
                   OutOfPages, RadixPrefixCache, Req)
from kvlab.alloc.paging import new_page_table


def manager(num_pages=8, page_size=4, rows=4, max_len=64, writer="host", **kw) -> CacheManager:
    return CacheManager(num_pages, page_size, new_page_table(rows, max_len, page_size),
                        page_table_writer=writer, **kw)


#: the prefix caches a manager runs on: chapter 05's radix tree, chapter 11's hash cache
CACHES = ["radix", "hash"]


def run_prefill(cm: CacheManager, reqs: list[Req], token: int = 0) -> None:
    """admit + allocate + the forward pass + the sampled token, by hand (works on any version)."""
    for r in reqs:
        cm.admit(r)
    cm.allocate_paged(reqs)
    for r in reqs:
        r.complete_one()
        r.append_token(token)


# --- locks have owners --------------------------------------------------------------------


def test_an_unlock_by_a_non_holder_is_refused_and_the_holders_pages_stay_protected():
    # the reproduction: B runs with its prefix locked; a handle matched on the same prefix,
    # never locked by its caller, is unlocked. Before owners, that dropped B's lock and the
    # next allocation evicted exactly the slots B's row maps
    cm = manager(num_pages=4, page_size=4)
    a = Req(list(range(12)), 0)
    run_prefill(cm, [a])
    cm.cache_req(a, finished=True)  # [0..12) cached: 3 pages, evictable; 1 page free
    b = Req(list(range(12)) + [50], 1)
    cm.admit(b)  # locks the 12 cached tokens for b
    cm.allocate_paged([b])
    stranger = cm.match_req(Req(list(range(13)), 2)).handle  # same prefix, never locked
    before = manager_state(cm, [a, b])
    with pytest.raises(CacheMisuse, match="not locked by the anonymous owner"):
        cm.unlock(stranger)
    with pytest.raises(CacheMisuse, match="not locked by"):
        cm.unlock(stranger, owner=a)  # a finished request holds nothing either
    assert_unchanged(before, manager_state(cm, [a, b]))
    c = Req([90, 91, 92, 93, 94], 2)  # needs 2 pages: only 1 free, and b's 3 are locked
    cm.admit(c)
    with pytest.raises(OutOfPages):
        cm.allocate_paged([c])
    cm.release_req(c)
    assert b.cache_handle.get_matched_indices().tolist() == list(range(12))
    cm.check_integrity()


def test_two_argument_lock_and_unlock_still_pair_up_anonymously():
    cm = manager(page_size=2)
    _, h = cm.prefix_cache.insert_prefix([1, 2, 3, 4], torch.arange(4, dtype=torch.int32))
    cm.lock(h)
    cm.lock(h)
    assert cm.prefix_cache.size_info.protected_size == 4
    cm.unlock(h)
    cm.unlock(h)
    assert cm.prefix_cache.size_info == (4, 0)
    with pytest.raises(CacheMisuse, match="not locked"):
        cm.unlock(h)
    cm.prefix_cache.check_integrity()  # (its slots were inserted behind the manager's back)


def test_the_manager_locks_with_the_request_as_owner():
    cm = manager(page_size=2)
    a = Req([1, 2, 3, 4, 5], 0)
    run_prefill(cm, [a])
    cm.cache_req(a, finished=False)
    assert cm.prefix_cache.is_locked_by(a.cache_handle, a)
    assert not cm.prefix_cache.is_locked_by(a.cache_handle, None)
    before = manager_state(cm, [a])
    with pytest.raises(CacheMisuse):
        cm.unlock(a.cache_handle)  # anonymous: not the holder
    assert_unchanged(before, manager_state(cm, [a]))
    cm.unlock(a.cache_handle, owner=a)  # the holder may; the manager then sees the broken row
    with pytest.raises(IntegrityError, match="not locked by the request") as err:
        cm.check_integrity()
    assert err.value.row == 0
    with pytest.raises(CacheMisuse, match="not locked by the request"):
        cm.cache_req(a, finished=True)


def test_a_request_that_skips_admit_must_hold_its_prefix_lock():
    cm = manager(page_size=2)
    a = Req([1, 2, 3, 4, 5], 0)
    run_prefill(cm, [a])
    cm.cache_req(a, finished=True)  # [1 2|3 4] cached
    h = cm.prefix_cache.match_prefix([1, 2, 3, 4]).handle
    cm.lock(h)  # anonymously: not the request's lock
    cm.page_table[1, :4] = h.get_matched_indices()
    r = Req([1, 2, 3, 4, 5, 6], 1, cached_len=4, cache_handle=h)
    before = manager_state(cm, [r])
    with pytest.raises(InvalidArgument, match="locked by its request"):
        cm.allocate_paged([r])
    assert_unchanged(before, manager_state(cm, [r]))
    cm.lock(h, owner=r)
    cm.allocate_paged([r])
    cm.unlock(h)
    cm.check_integrity()


# --- allocate_paged is all or nothing -------------------------------------------------------


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("writer", ["host", "triton"])
def test_a_failed_page_table_write_rolls_back_pages_evictions_and_the_table(monkeypatch, writer, cache):
    cm = manager(num_pages=5, page_size=4, writer=writer, prefix_cache=cache)
    a = Req(list(range(12)), 0)
    run_prefill(cm, [a])
    cm.cache_req(a, finished=True)  # 3 pages cached (evictable), 2 free
    b, c = Req([70 + i for i in range(6)], 1), Req([80 + i for i in range(9)], 2)
    for r in (b, c):
        cm.admit(r)  # 2 + 3 pages: all 2 free ones and an eviction of the cached leaf
    real = kvlab.manager.cache_manager.write_page_table_triton if writer == "triton" \
        else kvlab.manager.cache_manager.write_page_table

    def half_then_fail(page_table, allocated, allocation_info, page_size):
        row, first, last = allocation_info[0]
        real(page_table, allocated[: (last - first) * page_size], allocation_info[:1], page_size)
        raise Boom("the write failed half-way")

    monkeypatch.setattr(kvlab.manager.cache_manager, "write_page_table_triton" if writer == "triton"
                        else "write_page_table", half_then_fail)
    before = manager_state(cm, [a, b, c])
    with pytest.raises(Boom, match="half-way"):
        cm.allocate_paged([b, c])
    assert_unchanged(before, manager_state(cm, [a, b, c]))
    cm.check_integrity()
    monkeypatch.setattr(kvlab.manager.cache_manager, "write_page_table_triton" if writer == "triton"
                        else "write_page_table", real)
    cm.allocate_paged([b, c])  # the same call goes through once the writer works
    assert cm.prefix_cache.size_info.total_size == 0 and cm.num_free_pages == 0
    cm.check_integrity()


@pytest.mark.parametrize("cache", CACHES)
def test_a_failed_prefill_releases_what_it_admitted_and_restores_the_requests(monkeypatch, cache):
    cm = manager(num_pages=6, page_size=2, prefix_cache=cache)
    a = Req([1, 2, 3, 4, 5], 0)
    cm.complete_step(cm.prefill([a]), [6])  # caches [1 2|3 4]; a keeps running
    b = Req([1, 2, 3, 4, 9, 9, 9], 1)
    def fail(allocated, allocation_info):
        raise Boom("the page-table write failed")

    monkeypatch.setattr(cm, "_write_page_table", fail)
    before = manager_state(cm, [a, b], stamps=False)
    with pytest.raises(Boom):
        cm.prefill([b])
    assert_unchanged(before, manager_state(cm, [a, b], stamps=False))
    with pytest.raises(OutOfPages, match="room for 9"):
        cm.prefill([b], reserve_tokens=9)
    assert_unchanged(before, manager_state(cm, [a, b], stamps=False))
    cm.check_integrity()


# --- every door refuses what is not an int -------------------------------------------------


def _running_manager():
    cm = manager(num_pages=8, page_size=4, rows=3, max_len=32)
    a = Req(list(range(9)), 0)
    run_prefill(cm, [a])
    cm.cache_req(a, finished=False)
    return cm, a


BAD_CALLS = {
    "CacheManager(page_size=True)": (lambda cm, a: CacheManager(4, True, cm.page_table), "page_size"),
    "CacheManager(num_pages=True)": (lambda cm, a: CacheManager(True, 4, cm.page_table), "num_pages"),
    "CacheManager(page_size=4.0)": (lambda cm, a: CacheManager(4, 4.0, cm.page_table), "page_size"),
    "RadixPrefixCache(True)": (lambda cm, a: RadixPrefixCache(True), "page_size"),
    "Req(table_idx=True)": (lambda cm, a: Req([1, 2], table_idx=True), "table_idx"),
    "Req(table_idx=1.0)": (lambda cm, a: Req([1, 2], table_idx=1.0), "table_idx"),
    "Req([1.5, 2.7])": (lambda cm, a: Req([1.5, 2.7], 1), r"input_ids\[0\]"),
    "Req('123')": (lambda cm, a: Req("123", 1), "input_ids"),
    "Req('abc')": (lambda cm, a: Req("abc", 1), "input_ids"),
    "Req([1, True])": (lambda cm, a: Req([1, True], 1), r"input_ids\[1\]"),
    "Req([[1, 2]])": (lambda cm, a: Req([[1, 2]], 1), r"input_ids\[0\]"),
    "Req(cached_len=0.5)": (lambda cm, a: Req([1, 2], 1, cached_len=0.5), "cached_len"),
    "evict(2.5)": (lambda cm, a: cm.prefix_cache.evict(2.5), "num_tokens"),
    "evict(True)": (lambda cm, a: cm.prefix_cache.evict(True), "num_tokens"),
    "evict(-1)": (lambda cm, a: cm.prefix_cache.evict(-1), "num_tokens"),
    "match_prefix('1234')": (lambda cm, a: cm.prefix_cache.match_prefix("1234"), "input_ids"),
    "insert_prefix(float slots)": (lambda cm, a: cm.prefix_cache.insert_prefix(
        [1, 2, 3, 4], [0.0, 1.0, 2.0, 3.0]), r"indices\[0\]"),
    "insert_prefix(float tensor)": (lambda cm, a: cm.prefix_cache.insert_prefix(
        [1, 2, 3, 4], torch.arange(4.0)), "integer dtype"),
    "insert_prefix(negative slots)": (lambda cm, a: cm.prefix_cache.insert_prefix(
        [1, 2, 3, 4], torch.arange(-4, 0)), "indices"),
    "cache_req(finished=1)": (lambda cm, a: cm.cache_req(a, finished=1), "finished"),
    "allocate_paged(a Req)": (lambda cm, a: cm.allocate_paged(a), "reqs"),
    "pages_needed(extra_tokens=1.5)": (lambda cm, a: cm.pages_needed([a], extra_tokens=1.5),
                                       "extra_tokens"),
    "prefill(reserve_tokens=True)": (lambda cm, a: cm.prefill([Req([1, 2], 1)], reserve_tokens=True),
                                     "reserve_tokens"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_a_bad_argument_is_refused_with_state_unchanged(name):
    cm, a = _running_manager()
    call, argument = BAD_CALLS[name]
    before = manager_state(cm, [a])
    with pytest.raises(InvalidArgument, match=argument):
        call(cm, a)
    assert_unchanged(before, manager_state(cm, [a]))
    cm.check_integrity()


@pytest.mark.parametrize("field,value", [("cached_len", 9.0), ("device_len", True), ("table_idx", True)])
def test_lengths_set_by_hand_to_non_ints_are_refused_at_the_next_door(field, value):
    cm, a = _running_manager()
    before = manager_state(cm, [a])
    saved = getattr(a, field)
    setattr(a, field, value)
    for call in (lambda: cm.allocate_paged([a]), lambda: cm.cache_req(a, finished=True),
                 lambda: cm.release_req(a), lambda: cm.decode_step([a])):
        with pytest.raises(InvalidArgument, match=field):
            call()
    setattr(a, field, saved)
    assert_unchanged(before, manager_state(cm, [a]))
    cm.check_integrity()


def test_integer_likes_that_are_not_bools_are_accepted():
    import numpy as np

    r = Req(torch.tensor([3, 4, 5]), np.int64(1), cached_len=np.int32(0))
    assert r.input_ids == [3, 4, 5] and r.table_idx == 1 and type(r.table_idx) is int
    assert Req((np.int64(7), 8), 0).input_ids == [7, 8]


# --- LRU: a match stamps only what it used ---------------------------------------------------


def test_a_partial_match_does_not_refresh_the_unmatched_half():
    # page size 1, 10 pages: cache [1 2 3 4 0], then [7 8 9]; run [1 2 5] (uses [1 2]); a
    # 3-page request must then evict the least recently used leaf, [3 4 0], not [7 8 9]
    cm = manager(num_pages=10, page_size=1, rows=3, max_len=16)
    for prompt in ([1, 2, 3, 4, 0], [7, 8, 9]):
        r = Req(prompt, 0)
        run_prefill(cm, [r])
        r.input_ids.pop()  # the sampled token is not part of the cached conversation
        cm.cache_req(r, finished=True)
    third = Req([1, 2, 5], 0)
    run_prefill(cm, [third])
    cm.cache_req(third, finished=True)
    assert cm.num_free_pages == 1
    big = Req([60, 61, 62], 1)
    cm.admit(big)
    cm.allocate_paged([big])  # needs 3 pages: 1 free + 2 evicted
    cached = {tuple(n.key) for n in cm.prefix_cache.nodes()}
    assert (7, 8, 9) in cached, "the leaf [7 8 9] was used more recently than [3 4 0]"
    assert not any(3 in key for key in cached)
    cm.check_integrity()


# --- the serving words ----------------------------------------------------------------------


def test_prefill_decode_complete_is_the_hand_written_sequence():
    by_hand, by_words = manager(num_pages=6, page_size=4), manager(num_pages=6, page_size=4)
    prompts = [list(range(7)), list(range(5)) + [40, 41]]
    reqs_h = [Req(list(p), i) for i, p in enumerate(prompts)]
    reqs_w = [Req(list(p), i) for i, p in enumerate(prompts)]
    assert by_words.pages_needed(reqs_w) == 4 and by_words.available_pages == 6
    assert by_words.pages_needed(reqs_w, extra_tokens=2) == 6
    # by hand: admit, allocate, forward, append + complete, cache the prompts
    run_prefill(by_hand, reqs_h, token=9)
    for r in reqs_h:
        by_hand.cache_req(r, finished=False)
    batch = by_words.prefill(reqs_w)
    assert batch.phase == "prefill" and batch.extend_lens == (7, 7) and batch.num_tokens == 14
    assert batch.positions().tolist() == list(range(7)) * 2
    assert batch.out_loc().tolist() == by_words.page_table[0, :7].tolist() + by_words.page_table[1, :7].tolist()
    assert batch.input_ids().tolist() == prompts[0] + prompts[1]
    settled = by_words.complete_step(batch, [9, 9])
    assert [req for req, _ in settled] == reqs_w and not any(regions.finished for _, regions in settled)
    for step, token in enumerate([3, 4]):
        by_hand.allocate_paged(reqs_h)
        for r in reqs_h:
            r.complete_one()
            r.append_token(token)
        last = step == 1
        if last:
            for r in reqs_h:
                by_hand.cache_req(r, finished=True)
        batch = by_words.decode_step(reqs_w)
        assert batch.positions().tolist() == [7 + step] * 2 and batch.seq_lens().tolist() == [8 + step] * 2
        by_words.complete_step(batch, [token, token], [last, last])
        assert manager_state(by_hand)["table"] == manager_state(by_words)["table"]
        assert by_hand.free_slots.tolist() == by_words.free_slots.tolist()
    assert [r.input_ids for r in reqs_h] == [r.input_ids for r in reqs_w]
    assert by_words.running == [] and all(r.finished for r in reqs_w)
    by_words.check_integrity()


def test_complete_step_refuses_a_second_call_and_bad_tokens_changing_nothing():
    cm = manager(num_pages=6, page_size=4)
    r = Req([1, 2, 3], 0)
    batch = cm.prefill([r])
    before = manager_state(cm, [r])
    for call, error, match in [
        (lambda: cm.complete_step(batch, [1, 2]), InvalidArgument, "next_tokens"),
        (lambda: cm.complete_step(batch, [1.5]), InvalidArgument, r"next_tokens\[0\]"),
        (lambda: cm.complete_step(batch, [1], [1]), InvalidArgument, r"done\[0\]"),
        (lambda: cm.complete_step(batch, "1"), InvalidArgument, "next_tokens"),
        (lambda: cm.complete_step("batch", [1]), InvalidArgument, "batch"),
        (lambda: cm.decode_step([Req([1], 1)]), CacheMisuse, "not running"),
    ]:
        with pytest.raises(error, match=match):
            call()
        assert_unchanged(before, manager_state(cm, [r]))
    cm.complete_step(batch, [4], [True])
    with pytest.raises(CacheMisuse):
        cm.complete_step(batch, [4], [True])
    cm.check_integrity()


def test_integrity_errors_name_the_row():
    cm = manager(num_pages=4, page_size=2)
    a = Req([1, 2, 3], 1)
    cm.prefill([a])
    cm.free_slots = torch.cat([cm.free_slots, cm.page_table[1, :1]])  # a's page is also free
    with pytest.raises(IntegrityError) as err:
        cm.check_integrity()
    assert err.value.row == 1
    cm.free_slots = cm.free_slots[1:-1]  # a free page lost: no single row to blame
    with pytest.raises(IntegrityError, match="lost") as err:
        cm.check_integrity()
    assert err.value.row is None


def test_a_mixed_step_is_a_prefill_and_a_decode_step_in_one_allocation(monkeypatch):
    """Continuous batching: new prompts and decoding requests share one allocate_paged and one
    forward batch; complete_step caches only the new prompts and ends only the done requests."""
    split, mixed = manager(num_pages=8, page_size=4), manager(num_pages=8, page_size=4)
    runs = {}
    for cm in (split, mixed):
        a = Req([1, 2, 3, 4, 5, 6], 0)
        cm.complete_step(cm.prefill([a]), [7])
        runs[id(cm)] = (a, Req([1, 2, 3, 4, 8, 9, 10], 1))
    # the same step written as two: decode a, then prefill b
    a, b = runs[id(split)]
    split.complete_step(split.decode_step([a]), [11])
    split.complete_step(split.prefill([b]), [12])
    # and as one
    a2, b2 = runs[id(mixed)]
    writes = []
    real = mixed.allocate_paged
    monkeypatch.setattr(mixed, "allocate_paged", lambda reqs: (writes.append(list(reqs)), real(reqs)))
    batch = mixed.mixed_step([b2], [a2])
    assert writes == [[b2, a2]], "one allocate_paged for the whole step"
    assert batch.phase == "mixed" and batch.prefilling == (True, False)
    assert batch.extend_lens == (3, 1) and batch.positions().tolist() == [4, 5, 6, 6]
    settled = mixed.complete_step(batch, [12, 11], [False, True])
    assert [(r, reg.finished) for r, reg in settled] == [(b2, False), (a2, True)]
    assert a2.finished and not b2.finished and b2.cached_len == 7 and b2.input_ids[-1] == 12
    split.cache_req(a, finished=True)
    assert [r.input_ids for r in (a, b)] == [r.input_ids for r in (a2, b2)]
    assert sorted(split.free_slots.tolist()) == sorted(mixed.free_slots.tolist())
    for cm in (split, mixed):
        cm.check_integrity()


@pytest.mark.parametrize("cache", CACHES)
def test_a_failed_mixed_step_releases_its_new_requests_and_leaves_the_running_ones(monkeypatch, cache):
    cm = manager(num_pages=6, page_size=2, prefix_cache=cache)
    a = Req([1, 2, 3, 4, 5], 0)
    cm.complete_step(cm.prefill([a]), [6])
    b = Req([1, 2, 3, 4, 9, 9, 9], 1)
    before = manager_state(cm, [a, b], stamps=False)

    def fail(allocated, allocation_info):
        raise Boom("the page-table write failed")

    monkeypatch.setattr(cm, "_write_page_table", fail)
    with pytest.raises(Boom):
        cm.mixed_step([b], [a])
    assert_unchanged(before, manager_state(cm, [a, b], stamps=False))
    with pytest.raises(CacheMisuse, match=r"decode_step: reqs\[0\]"):
        cm.mixed_step([], [b])  # b is not running: it cannot decode
    assert_unchanged(before, manager_state(cm, [a, b], stamps=False))
    cm.check_integrity()


def test_a_chunk_of_a_prompt_produces_no_token_and_is_cached_only_after_its_last_chunk():
    """Chunked prefill: the request keeps its row and handle between chunks; a chunk's entry
    of next_tokens is None; the prompt is cached (cache_req(finished=False)) after its last
    chunk, as mini-sglang's scheduler does."""
    cm = manager(num_pages=8, page_size=4)
    prompt = list(range(10, 21))                      # 11 tokens
    r = Req(list(prompt), 0)
    cm.admit(r)
    handle = r.cache_handle
    r.device_len = 4                                  # chunk 1: positions 0..3
    batch = cm.prefill([r])
    before = manager_state(cm, [r])
    for call, match in [(lambda: cm.complete_step(batch, [5]), r"next_tokens\[0\]"),
                        (lambda: cm.complete_step(batch, [None], [True]), r"next_tokens\[0\]")]:
        with pytest.raises(InvalidArgument, match=match):
            call()
        assert_unchanged(before, manager_state(cm, [r]))
    assert cm.complete_step(batch, [None]) == []      # nothing cached yet
    assert (r.cached_len, r.input_ids, r.cache_handle) == (4, prompt, handle)
    r.device_len = 9                                  # chunk 2: positions 4..8
    batch = cm.mixed_step([r], [])
    assert batch.start == (4,) and batch.end == (9,) and batch.prefilling == (True,)
    assert cm.complete_step(batch, [None]) == []
    r.device_len = 11                                 # the last chunk: the first token comes
    settled = cm.complete_step(cm.mixed_step([r], []), [7])
    assert [req for req, _ in settled] == [r] and r.input_ids == prompt + [7]
    assert r.cache_handle.cached_len == 8             # its whole pages, now in the cache
    assert cm.prefix_cache.match_prefix(prompt).handle.cached_len == 8
    cm.check_integrity()


# --- cache_req and release_req are all or nothing; an interrupted eviction loses no page ----------
#
# On both prefix caches: chapter 05's radix tree and chapter 11's hash cache, whose free queue is
# an order (its LRU list): a failed call leaves the queue in the same order, hash_to_page and the
# eviction count as they were.


def _two_computed_the_same_pages(page_size=2, cache="radix", others="running"):
    """b and c both hit a's cached [1 2|3 4] and computed [5 6|7 8]; c cached them first. b's
    cache_req then frees a duplicate region (remapping its row) and inserts a new node [20 21].

    ``others="finished"``: a and c have finished by then, so b alone holds [1 2|3 4] (its unlock
    frees them) and the [5 6|7 8] it hits are free (on the hash cache: in the middle of the free
    queue, where its lock takes them from and its rollback must put them back)."""
    cm = manager(num_pages=16, page_size=page_size, rows=3, max_len=16, prefix_cache=cache)
    a = Req([1, 2, 3, 4, 5], 0)
    run_prefill(cm, [a])
    cm.cache_req(a, finished=False)
    b, c = Req([1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22], 1), Req([1, 2, 3, 4, 5, 6, 7, 8, 30], 2)
    run_prefill(cm, [b, c])
    cm.cache_req(c, finished=others == "finished")
    if others == "finished":
        cm.cache_req(a, finished=True)
        if cache == "hash":
            queue, hit = list(cm.prefix_cache.free_queue), cm.prefix_cache.match([1, 2, 3, 4, 5, 6, 7, 8]).pages
            assert all(0 < queue.index(p) < len(queue) - 1 for p in hit[2:]), "b's hits lie mid-queue"
    return cm, [a, b, c]


def _inject(cm, where: str, k: int, after: bool, error=Boom):
    """Make the k-th call of one of cache_req's steps fail (patched on the instance)."""
    owner = cm.prefix_cache if where == "insert_prefix" else cm
    setattr(owner, where, failing(getattr(owner, where), k, after=after, error=error))


#: the steps of cache_req(finished=...): (finished, the method, which of its calls)
CACHE_REQ_STEPS = [(finished, where, 0) for finished in (True, False) for where in ("insert_prefix", "unlock", "_free")] \
    + [(True, "_free", 1), (False, "lock", 0)]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("others", ["running", "finished"])
@pytest.mark.parametrize("after", [False, True], ids=["before_its_work", "after_its_work"])
@pytest.mark.parametrize("finished, where, k", CACHE_REQ_STEPS)
def test_a_cache_req_that_fails_at_any_step_changes_nothing(where, k, finished, after, others, cache):
    """Before, a failure in _free (after insert_prefix and the unlock) left the request running
    without its prefix lock and its new node evictable while its row mapped it."""
    cm, reqs = _two_computed_the_same_pages(cache=cache, others=others)
    twin, twin_reqs = _two_computed_the_same_pages(cache=cache, others=others)
    before = manager_state(cm, reqs, stamps=False)
    _inject(cm, where, k, after, error=Interrupted if after else Boom)
    with pytest.raises((Boom, Interrupted)):
        cm.cache_req(reqs[1], finished=finished)
    assert_unchanged(before, manager_state(cm, reqs, stamps=False))
    cm.check_integrity()
    # and the same call then does what it does on a manager that never saw the failure
    vars(cm).pop(where, None)
    vars(cm.prefix_cache).pop(where, None)
    cm.cache_req(reqs[1], finished=finished)
    twin.cache_req(twin_reqs[1], finished=finished)
    assert without_ids(manager_state(twin, twin_reqs, stamps=False)) == \
        without_ids(manager_state(cm, reqs, stamps=False))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("others", ["running", "finished"])
@pytest.mark.parametrize("finished", [True, False])
def test_a_cache_req_interrupted_between_any_two_lines_changes_nothing(finished, others, cache):
    """Any line run anywhere: the manager's, its checks' and rollbacks', the prefix cache's own
    (inside its insert, free, lock and unlock)."""
    for k in range(1, 2000):
        cm, reqs = _two_computed_the_same_pages(cache=cache, others=others)
        before = manager_state(cm, reqs, stamps=False)
        with interrupt_at_line(MANAGER_MODULES, k) as seen:
            try:
                cm.cache_req(reqs[1], finished=finished)
            except Interrupted:
                pass
        if seen[0] < k:
            break  # it ran to the end: every line has been interrupted once
        assert_unchanged(before, manager_state(cm, reqs, stamps=False))
        cm.check_integrity()
    assert 50 < k < 2000


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("others", ["running", "finished"])
@pytest.mark.parametrize("where, after", [("_free", True), ("unlock", False), ("unlock", True)])
def test_a_release_req_that_fails_changes_nothing(where, after, others, cache):
    cm, reqs = _two_computed_the_same_pages(cache=cache, others=others)
    before = manager_state(cm, reqs)
    _inject(cm, where, 0, after, error=Interrupted)
    with pytest.raises(Interrupted):
        cm.release_req(reqs[1])
    assert_unchanged(before, manager_state(cm, reqs))
    cm.check_integrity()


def _evicting_allocation(cache="radix"):
    """Three cached leaves (2 + 1 + 2 pages) and 3 free pages; the request admitted last needs 7
    pages: its allocation evicts every leaf (on the hash cache: takes the head of the free
    queue, cached pages and free ones in its order)."""
    cm = manager(num_pages=8, page_size=2, rows=4, max_len=32, prefix_cache=cache)
    for row, prompt in enumerate(([10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33, 34])):
        r = Req(prompt, row)
        run_prefill(cm, [r])
        cm.cache_req(r, finished=True)
    big = Req(list(range(100, 114)), 3)
    cm.admit(big)
    return cm, big


#: a function to interrupt between any two of its lines while an allocation evicts
EVICTIONS = {"radix": RadixPrefixCache.evict_leaves, "hash": HashPrefixCache.evict_leaves,
             "hash, inside take_free": HashPrefixCache._take_free}


@pytest.mark.parametrize("where", EVICTIONS)
def test_an_allocation_interrupted_anywhere_in_its_eviction_loses_no_page(where):
    """Before, a KeyboardInterrupt inside evict_leaves lost the pages of the nodes it had
    detached already: they never reached the rollback list."""
    cache = where.split(",")[0]
    cm, big = _evicting_allocation(cache)
    assert cm.num_free_pages == 3 and cm.pages_needed([big]) == 7
    for k in range(1, 400):
        cm, big = _evicting_allocation(cache)
        before = manager_state(cm, [big])
        with interrupt_at_line(EVICTIONS[where], k) as seen:
            try:
                cm.allocate_paged([big])
            except Interrupted:
                pass
        if seen[0] < k:
            break
        assert_unchanged(before, manager_state(cm, [big]))
        cm.check_integrity()
    assert 10 < k < 400
    cm.check_integrity()
    assert cm.available_pages == 1 and cm.allocated_pages(big) == 7
    if cache == "radix":
        assert cm.prefix_cache.size_info.total_size == 0


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("after", [False, True])
def test_an_allocation_whose_eviction_call_fails_loses_no_page(after, cache):
    cm, big = _evicting_allocation(cache)
    before = manager_state(cm, [big])
    cm.prefix_cache.evict_leaves = failing(cm.prefix_cache.evict_leaves, 0, after=after, error=Interrupted)
    with pytest.raises(Interrupted):
        cm.allocate_paged([big])
    assert_unchanged(before, manager_state(cm, [big]))
    cm.check_integrity()


@pytest.mark.parametrize("cache", CACHES)
def test_a_failed_prefill_puts_the_free_pages_it_hit_back_in_their_places(monkeypatch, cache):
    """The requests a failed prefill admitted give their locks back with undo_lock, not an
    unlock: on the hash cache, the free cached pages they hit go back to their places in the
    free queue (an unlock would queue them last, as if they had just been used)."""
    cm = manager(num_pages=8, page_size=2, prefix_cache=cache)
    a, b = Req([1, 2, 3, 4, 5], 0), Req([9, 8, 7, 6, 5], 1)
    for r in (a, b):  # a's [1 2|3 4] free and cached, b's pages queued after them
        cm.complete_step(cm.prefill([r]), [6], [True])
    c = Req([1, 2, 3, 4, 7, 7], 2)
    before = manager_state(cm, [a, b, c], stamps=False)

    def fail(allocated, allocation_info):
        raise Boom("the page-table write failed")

    monkeypatch.setattr(cm, "_write_page_table", fail)
    with pytest.raises(Boom):
        cm.prefill([c])
    assert_unchanged(before, manager_state(cm, [a, b, c], stamps=False))
    cm.check_integrity()
    if cache == "hash":
        queue = list(cm.prefix_cache.free_queue)
        assert queue.index(cm.prefix_cache.match([1, 2, 3, 4]).pages[0]) < len(queue) - 2
