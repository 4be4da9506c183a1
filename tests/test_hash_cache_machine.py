"""A hypothesis state machine drives chapter 11's HashPrefixCache as nano-vllm's block manager and
the cache manager do, and worse: sequences allocated, decoded (``append_token``) and freed, locks
and unlocks by several owners, pages taken from the head of the queue (``evict_leaves``) and
inserted (``insert_prefix``), hits taken by hand (``take_cached``), and arguments that break a
rule, and the undo words a caller's rollback uses. Every mutating call may fail: an interrupt (a
learner pressing stop) or an error raised at the k-th line run anywhere in the cache's modules
(the call, the building blocks it calls, the free queue's links, the notes that take it back).

A refused or failed call leaves the cache exactly as it was: every page's count, hash, parent and
tokens, ``hash_to_page``, the free queue in order, the locks, the eviction count. After every step:
``check_integrity``; every page's reference count is exactly what the live sequences, the locks
and the pages the caller took account for (no page lost, no reference too many); and a hit is
only ever served on a page whose KV was computed for the same prefix.
"""
from __future__ import annotations

import random

import pytest
from cache_state import hash_cache_state
from faults import Boom, Interrupted, interrupt_at_line
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvlab.prefix.hash_cache
import kvlab.prefix.hash_cache_undo
import kvlab.prefix.hash_cache_views
import kvlab.prefix.hash_chain
from kvlab import HashPrefixCache
from kvlab.base.errors import CacheMisuse, InvalidArgument, KvlabError, OutOfPages

#: every line run here can be interrupted
MODULES = [kvlab.prefix.hash_cache, kvlab.prefix.hash_cache_undo, kvlab.prefix.hash_cache_views, kvlab.prefix.hash_chain]
FAIL = st.one_of(st.none(), st.tuples(st.integers(1, 300), st.sampled_from([Interrupted, Boom])))


class HashCacheMachine(RuleBasedStateMachine):
    page_size = 2

    @initialize(pages=st.integers(2, 10), seed=st.integers(0, 2**16), uncached_first=st.booleans())
    def setup(self, pages, seed, uncached_first):
        P = self.page_size
        self.rng = random.Random(seed)
        self.cache = HashPrefixCache(pages, P, device="cpu", uncached_first=uncached_first)
        self.bases = [[self.rng.randrange(3) for _ in range(3 * P)] for _ in range(2)]
        self.seqs: list[tuple[list[int], tuple[int, ...]]] = []  # (ids, pages) of live sequences
        self.locks: list[tuple[object, str]] = []  # (handle, owner), one entry per lock
        self.mine: list[int] = []  # pages the caller took (evict_leaves, take_cached), one per reference
        self.kv: dict[int, tuple[int, ...]] = {}  # page -> the prefix its KV was computed for

    # --- helpers ------------------------------------------------------------------------------

    def prompt(self) -> list[int]:
        base = self.rng.choice(self.bases)
        return base[: self.rng.randrange(1, len(base) + 1)] + [self.rng.randrange(5)
                                                              for _ in range(self.rng.randrange(3))]

    def attempt(self, call, fail):
        """``call()`` with ``fail`` injected: ``(True, result)`` when it ran to the end, ``(False,
        None)`` when the injected failure propagated, and then the cache is as it was."""
        before = hash_cache_state(self.cache)
        if fail is None:
            return True, call()
        k, error = fail
        with interrupt_at_line(MODULES, k, error=error) as seen:
            try:
                result = call()
            except (Interrupted, Boom) as e:
                assert seen[0] == k, f"not injected: {e!r}"
                assert hash_cache_state(self.cache) == before, f"changed by a call that failed: {e}"
                event(f"failed at a line, nothing changed: {error.__name__}")
                return False, None
        return True, result

    def refused(self, call, errors=KvlabError) -> None:
        before = hash_cache_state(self.cache)
        with pytest.raises(errors) as caught:
            call()
        assert hash_cache_state(self.cache) == before
        event(f"refused: {type(caught.value).__name__}")

    def computed(self, ids: list[int], pages, cached_len: int) -> None:
        """The model's forward pass: the hits must hold the KV of their prefix; the new pages get it."""
        P = self.page_size
        for i, page in enumerate(pages):
            prefix = tuple(ids[: min((i + 1) * P, len(ids))])
            if i < cached_len // P:
                assert self.kv.get(page) == prefix, f"page {page} hit, but holds the KV of {self.kv.get(page)}"
            else:
                self.kv[page] = prefix

    # --- the block manager's words ---------------------------------------------------------------

    @rule(fail=FAIL)
    def allocate(self, fail):
        ids = self.prompt()
        if self.cache.pages_needed(ids) > len(self.cache.free_queue):
            self.refused(lambda: self.cache.allocate(ids), OutOfPages)
            return
        done, got = self.attempt(lambda: self.cache.allocate(ids), fail)
        if done:
            self.computed(ids, got.pages, got.cached_len)
            self.seqs.append((ids, got.pages))

    @precondition(lambda self: self.seqs)
    @rule(fail=FAIL)
    def free(self, fail):
        i = self.rng.randrange(len(self.seqs))
        done, _ = self.attempt(lambda: self.cache.free(self.seqs[i][1]), fail)
        if done:
            self.seqs.pop(i)
            if 0 in self.cache.ref_count:  # a count never goes below zero
                self.refused(lambda: self.cache.free([self.cache.ref_count.index(0)]), CacheMisuse)

    @precondition(lambda self: self.seqs)
    @rule(fail=FAIL, token=st.integers(0, 4))
    def append_token(self, fail, token):
        i = self.rng.randrange(len(self.seqs))
        ids, pages = self.seqs[i]
        ids = ids + [token]
        if len(pages) < -(-len(ids) // self.page_size) and not self.cache.free_queue:
            self.refused(lambda: self.cache.append_token(pages, ids), OutOfPages)
            return
        done, got = self.attempt(lambda: self.cache.append_token(pages, ids), fail)
        if done:
            self.kv[got[-1]] = tuple(ids)  # the next pass computes the new token's KV
            self.seqs[i] = (ids, got)

    # --- the radix cache's words -----------------------------------------------------------------

    @rule(fail=FAIL, owner=st.sampled_from(["a", "b"]))
    def lock(self, fail, owner):
        ids = self.prompt()
        handle = self.cache.match(ids)
        self.computed(ids, handle.pages, handle.cached_len)
        if not handle.pages:
            return
        done, _ = self.attempt(lambda: self.cache.lock_handle(handle, owner=owner), fail)
        if done:
            self.locks.append((handle, owner))

    @precondition(lambda self: self.locks)
    @rule(fail=FAIL)
    def unlock(self, fail):
        i = self.rng.randrange(len(self.locks))
        handle, owner = self.locks[i]
        self.refused(lambda: self.cache.lock_handle(handle, unlock=True, owner="c"), CacheMisuse)  # never locks
        done, _ = self.attempt(lambda: self.cache.lock_handle(handle, unlock=True, owner=owner), fail)
        if done:
            self.locks.pop(i)

    @rule(fail=FAIL, n=st.integers(0, 4))
    def take_from_the_head(self, fail, n):
        done, taken = self.attempt(lambda: self.cache.evict_leaves(n * self.page_size), fail)
        if done:
            assert len(taken) == min(n, len(taken) + len(self.cache.free_queue))
            for t in taken:
                self.kv.pop(t.page, None)  # handed out: whatever it held is gone
            self.mine += [t.page for t in taken]

    @precondition(lambda self: self.mine)
    @rule(fail=FAIL)
    def insert_mine(self, fail):
        """The caller computed a prompt's KV on pages it took, and caches them."""
        alone = [p for p in dict.fromkeys(self.mine) if self.mine.count(p) == 1 and self.cache.ref_count[p] == 1
                 and self.cache.page_hash[p] is None]
        if not alone:
            return
        ids = self.prompt()
        hit = self.cache.match(ids)
        self.computed(ids, hit.pages, hit.cached_len)
        P = self.page_size
        new = alone[: max(0, len(ids) // P - len(hit.pages))]
        ids = ids[: (len(hit.pages) + len(new)) * P]
        slots = [p * P + j for p in hit.pages + tuple(new) for j in range(P)]
        done, got = self.attempt(lambda: self.cache.insert_prefix(ids, slots), fail)
        if done:
            assert got.cached_len == hit.cached_len and got.handle.pages == hit.pages + tuple(new)
            for p in new:
                self.mine.remove(p)
            self.computed(ids, got.handle.pages, hit.cached_len)

    @precondition(lambda self: self.mine)
    @rule(fail=FAIL)
    def give_mine_back(self, fail):
        pages = self.rng.sample(self.mine, self.rng.randrange(1, len(self.mine) + 1))
        done, _ = self.attempt(lambda: self.cache.free(pages), fail)
        if done:
            for p in pages:
                self.mine.remove(p)

    @rule(fail=FAIL)
    def hit_by_hand(self, fail):
        cached = sorted(self.cache.hash_to_page.values())
        if not cached:
            return
        page = self.rng.choice(cached)
        done, _ = self.attempt(lambda: self.cache.take_cached(page), fail)
        if done:
            self.mine.append(page)

    # --- a caller's rollback words, themselves interrupted ------------------------------------------

    @rule(fail=FAIL, n=st.integers(1, 4))
    def take_and_undo(self, fail, n):
        """evict_leaves then undo_evict; a lock then undo_lock: the undo may fail too (nothing
        changed), and made again it leaves the cache as before the step, queue order included."""
        before = hash_cache_state(self.cache)
        taken = self.cache.evict_leaves(n * self.page_size)
        done, _ = self.attempt(lambda: self.cache.undo_evict(taken), fail)
        if not done:
            self.cache.undo_evict(taken)
        assert hash_cache_state(self.cache) == before
        handle = self.cache.match(self.prompt())
        if handle.pages:
            self.cache.lock_handle(handle, owner="u")
            done, _ = self.attempt(lambda: self.cache.undo_lock(handle, "u"), fail)
            if not done:
                self.cache.undo_lock(handle, "u")
            assert hash_cache_state(self.cache) == before

    # --- arguments that break a rule: refused before any change -----------------------------------

    @rule(which=st.integers(0, 13))
    def a_bad_argument(self, which):
        cache, n = self.cache, self.cache.num_pages
        held = next((p for p, r in enumerate(cache.ref_count) if r), None)
        free = next((p for p, r in enumerate(cache.ref_count) if not r), None)
        calls = [
            lambda: cache.allocate([1, 2**63]),           # not an int64
            lambda: cache.allocate([1, True]),            # a bool is not a token
            lambda: cache.allocate("12"),
            lambda: cache.free(5),
            lambda: cache.free(None),
            lambda: cache.free([n]),
            lambda: cache.free([-1]),
            lambda: cache.append_token([-1], [1]),
            lambda: cache.append_token([free if free is not None else n], [1, 2]),  # an unheld page
            lambda: cache.append_token([held if held is not None else 0], [1.5]),
            lambda: cache.lock_handle(cache.match([]), unlock=1),
            lambda: cache.evict_leaves(-2),
            lambda: cache.take_cached(n),
            lambda: cache.cache_page(0, "h", [1, 2], None),
        ]
        self.refused(calls[which], (InvalidArgument, CacheMisuse, OutOfPages))

    # --- after every step ---------------------------------------------------------------------

    @invariant()
    def every_reference_is_accounted_for(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        cache.check_integrity()
        expect = [0] * cache.num_pages
        for _, pages in self.seqs:
            for p in pages:
                expect[p] += 1
        for handle, _ in self.locks:
            for p in handle.pages:
                expect[p] += 1
        for p in self.mine:
            expect[p] += 1
        assert cache.ref_count == expect, "a page lost, or a reference too many"


def _machine(page_size: int):
    machine = type(f"HashCacheMachineP{page_size}", (HashCacheMachine,), {"page_size": page_size})
    machine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
    return machine.TestCase


TestHashCacheP1 = _machine(1)
TestHashCacheP2 = _machine(2)
TestHashCacheP4 = _machine(4)
