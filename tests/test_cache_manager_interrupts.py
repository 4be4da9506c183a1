"""Every serving call of the cache manager is all or nothing at every line, on both prefix caches.

Each call below runs again and again with an interrupt (or an error) at the k-th line run anywhere
in the manager and the prefix cache (its checks, its rollbacks, the cache's own lock, unlock,
insert, free and page allocation, the free queue's links), for k = 1, 2, ... until it runs to the
end. Each time: every piece of state is as before the call (the free list in order, the page
table, the cache page by page, the locks, the running rows, every field of the requests, their
tokens included; on the hash cache the free queue in order and the eviction count), the
conservation law holds, and the same call made again does exactly what it does on a manager that
never saw the failure: a failed call can simply be retried.

``complete_step`` whose second ``cache_req`` fails is taken back whole: the first request is not
left cached or finished, no token is recorded, no length moved.
"""
from __future__ import annotations

import pytest
from cache_state import MANAGER_MODULES, assert_unchanged, manager_state, without_ids
from faults import Boom, Interrupted, interrupt_at_line

from kvlab import CacheManager, Req
from kvlab.alloc.paging import new_page_table


def serving(cache: str, spare: int = 0):
    """a finished (its [1 2|3 4|5 6] cached; [5 6] free, on the hash cache mid-queue), b running
    on a's [1 2|3 4] with its own [9 9] cached and locked, c running; 2 pages free (+ ``spare``)."""
    cm = CacheManager(9 + spare, 2, new_page_table(6, 24, 2), cache, page_table_writer="host")
    a, b, c = Req([1, 2, 3, 4, 5, 6, 7], 0), Req([1, 2, 3, 4, 9, 9, 9], 1), Req([30, 31, 32], 2)
    cm.complete_step(cm.prefill([a]), [8], [True])
    cm.complete_step(cm.prefill([b]), [10])
    cm.complete_step(cm.prefill([c]), [33])
    assert cm.num_free_pages == 2 + spare and cm.available_pages == 3 + spare
    return cm, [a, b, c]


def _admit(cache):
    cm, reqs = serving(cache)
    d = Req([1, 2, 3, 4, 5, 6, 40], 3)  # hits all of a's pages: the lock takes [5 6] off the queue
    return cm, reqs + [d], lambda: cm.admit(d)


def _prefill_evicting(cache):
    cm, reqs = serving(cache)
    e = Req([50, 51, 52, 53, 54], 3)  # 3 pages: both free ones and a's [5 6], evicted
    return cm, reqs + [e], lambda: cm.prefill([e])


def _prefill_hits(cache):
    cm, reqs = serving(cache)
    d, f = Req([1, 2, 3, 4, 5, 6, 41], 3), Req([1, 2, 60], 4)
    return cm, reqs + [d, f], lambda: cm.prefill([d, f], reserve_tokens=1)


def _mixed_step(cache):
    cm, reqs = serving(cache)
    d = Req([1, 2, 3, 4, 70], 3)
    return cm, reqs + [d], lambda: cm.mixed_step([d], [reqs[1], reqs[2]])


def _decode_and_two_finish(cache):
    cm, reqs = serving(cache)
    batch = cm.decode_step([reqs[1], reqs[2]])
    return cm, reqs, lambda: cm.complete_step(batch, [11, 34], [True, True])


def _prefill_and_two_cached(cache):
    cm, reqs = serving(cache)
    d, f = Req([1, 2, 3, 4, 5, 6, 41], 3), Req([1, 2, 60, 61], 4)
    batch = cm.prefill([d, f])
    return cm, reqs + [d, f], lambda: cm.complete_step(batch, [42, 62], [False, False])


def _prefill_and_the_second_splits_the_first(cache):
    cm, reqs = serving(cache, spare=3)
    d, f = Req([80, 81, 82, 83, 84], 3), Req([80, 81, 90, 91, 92], 4)  # f's insert splits d's new node
    batch = cm.prefill([d, f])
    return cm, reqs + [d, f], lambda: cm.complete_step(batch, [85, 93], [False, False])


def _release(cache):
    cm, reqs = serving(cache)
    return cm, reqs, lambda: cm.release_req(reqs[1])


CALLS = {"admit": _admit, "prefill, evicting": _prefill_evicting, "prefill, hits": _prefill_hits,
         "mixed_step": _mixed_step, "complete_step, two finish": _decode_and_two_finish,
         "complete_step, two cached": _prefill_and_two_cached,
         "complete_step, the second splits the first": _prefill_and_the_second_splits_the_first,
         "release_req": _release}


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize("name", CALLS)
def test_a_call_failed_at_any_line_changes_nothing_and_can_be_made_again(name, cache):
    twin, twin_reqs, twin_call = CALLS[name](cache)
    twin_call()
    expected = without_ids(manager_state(twin, twin_reqs, stamps=False))
    k = 0
    while True:
        k += 1
        cm, reqs, call = CALLS[name](cache)
        before = manager_state(cm, reqs, stamps=False)
        with interrupt_at_line(MANAGER_MODULES, k, error=Boom if k % 3 == 0 else Interrupted) as seen:
            try:
                call()
            except (Boom, Interrupted):
                pass
        if seen[0] < k:
            break  # it ran to the end: it was stopped at each of its lines once
        assert_unchanged(before, manager_state(cm, reqs, stamps=False))
        cm.check_integrity()
        call()  # retried: made whole
        assert without_ids(manager_state(cm, reqs, stamps=False)) == expected, f"retried after line {k}"
    assert k > 100
    assert without_ids(manager_state(cm, reqs, stamps=False)) == expected
    cm.check_integrity()
