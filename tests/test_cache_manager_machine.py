"""A hypothesis state machine drives CacheManager the way servers (and careless callers) do:
admits, allocations, cache_req finished or not, decodes, the serving words (prefill /
decode_step / complete_step), releases, locks and unlocks by holders and by non-holders, and
page-table writes that fail half-way. After every step: check_integrity, page conservation,
and every running request reads the KV of its own tokens. Page sizes 1, 4, 16 and 64.

A refused call must leave every piece of state as it was (tests/cache_state.py); a refused
admission may only have stamped and split the tree (its match ran), never more.
"""
from __future__ import annotations

import random

import pytest
from cache_state import assert_unchanged, manager_state
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab import CacheManager, CacheMisuse, OutOfPages, Req
from kvlab.paging import new_page_table

ROWS = 4


class WriteFailed(RuntimeError):
    """The injected failure of a page-table write."""


class CacheManagerMachine(RuleBasedStateMachine):
    page_size = 4

    @initialize(pages=st.integers(3, 9), seed=st.integers(0, 2**16))
    def setup(self, pages, seed):
        P = self.page_size
        self.unit = max(P, 4)  # prompts span a few pages at every page size
        self.rng = random.Random(seed)
        self.num_pages = pages * self.unit // P
        table = new_page_table(ROWS, 6 * self.unit + 8, P, device="cpu")
        self.cm = CacheManager(self.num_pages, P, table, page_table_writer="host")
        self.max_len = table.shape[1]
        self.bases = [[self.rng.randrange(3) for _ in range(3 * self.unit)] for _ in range(2)]
        self.kv: dict[int, int] = {}  # slot -> fingerprint of the tokens its KV was computed from
        self.admitted: list[Req] = []  # admitted, pages not yet allocated
        self.external: list[tuple[object, object]] = []  # (handle, owner) locked by outsiders
        self.finished: list[Req] = []

    # --- helpers ------------------------------------------------------------------------------

    def running(self) -> list[Req]:
        return [r for r in self.cm.running if r not in self.admitted]

    def free_rows(self) -> list[int]:
        return sorted(set(range(ROWS)) - {r.table_idx for r in self.cm.running})

    def prompt(self) -> list[int]:
        base = self.rng.choice(self.bases)
        cut = self.rng.randrange(1, len(base) + 1)
        extra = [self.rng.randrange(50) for _ in range(self.rng.choice([0, 1, self.unit]))]
        return (base[:cut] + extra)[: 4 * self.unit] or [1]

    def forward(self, reqs) -> None:
        """The model: compute positions [cached_len, device_len) and write their KV."""
        for r in reqs:
            row = self.cm.page_table[r.table_idx, : r.device_len].tolist()
            for pos in range(r.cached_len, r.device_len):
                self.kv[row[pos]] = hash(tuple(r.input_ids[: pos + 1]))

    def failing_writer(self):
        """A page-table write that writes part of the table, then fails."""
        real = self.cm._write_page_table

        def write(allocated, allocation_info):
            row, first, last = allocation_info[0]
            real(allocated[: (last - first) * self.page_size], allocation_info[:1])
            raise WriteFailed("the page-table write failed half-way")
        return write

    def refused(self, call, error, reqs=()) -> None:
        before = manager_state(self.cm, reqs)
        evictable = self.cm.prefix_cache.size_info.evictable_size
        with pytest.raises(error):
            call()
        assert_unchanged(before, manager_state(self.cm, reqs))
        event(f"refused: {error.__name__}")
        if error is WriteFailed and self.cm.pages_needed(reqs) > self.cm.num_free_pages and evictable:
            event("refused: WriteFailed after evicting")

    # --- the rules ----------------------------------------------------------------------------

    @precondition(lambda self: self.free_rows())
    @rule()
    def admit(self):
        req = Req(self.prompt(), self.free_rows()[0])
        self.cm.admit(req)
        self.admitted.append(req)

    @precondition(lambda self: self.admitted)
    @rule(fail=st.booleans())
    def allocate_admitted(self, fail):
        batch = list(self.admitted)
        if fail and 0 < self.cm.pages_needed(batch) <= self.cm.available_pages:
            self.cm._write_page_table = self.failing_writer()
            try:
                self.refused(lambda: self.cm.allocate_paged(batch), WriteFailed, batch)
            finally:
                del self.cm._write_page_table
            return
        if self.cm.pages_needed(batch) > self.cm.available_pages:
            self.refused(lambda: self.cm.allocate_paged(batch), OutOfPages, batch)
            for r in batch:
                self.cm.release_req(r)
            self.admitted.clear()
            return
        self.cm.allocate_paged(batch)
        self.forward(batch)
        for r in batch:
            r.complete_one()
            r.append_token(self.rng.randrange(3))
        self.admitted.clear()

    @precondition(lambda self: self.running())
    @rule(fail=st.booleans())
    def decode(self, fail):
        batch = [r for r in self.running() if r.device_len < self.max_len]
        if not batch:
            return
        if fail and 0 < self.cm.pages_needed(batch) <= self.cm.available_pages:
            self.cm._write_page_table = self.failing_writer()
            try:
                self.refused(lambda: self.cm.decode_step(batch), WriteFailed, batch)
            finally:
                del self.cm._write_page_table
            return
        if self.cm.pages_needed(batch) > self.cm.available_pages:
            self.refused(lambda: self.cm.decode_step(batch), OutOfPages, batch)
            self.cm.release_req(self.rng.choice(batch))  # the scheduler retracts one
            return
        step = self.cm.decode_step(batch)
        self.forward(batch)
        done = [self.rng.random() < 0.2 for _ in batch]
        self.cm.complete_step(step, [self.rng.randrange(3) for _ in batch], done)
        self.finished += [r for r, d in zip(batch, done) if d]

    @precondition(lambda self: self.free_rows())
    @rule(n=st.integers(1, ROWS), reserve=st.sampled_from([0, 0, 5]))
    def prefill_words(self, n, reserve):
        reqs = [Req(self.prompt(), row) for row in self.free_rows()[:n]]
        try:
            batch = self.cm.prefill(reqs, reserve_tokens=reserve)
        except OutOfPages:
            assert all(r not in self.cm.running and r.cache_handle is None for r in reqs)
            return
        self.forward(reqs)
        self.cm.complete_step(batch, [self.rng.randrange(3) for _ in reqs])

    @precondition(lambda self: self.running())
    @rule(finished=st.booleans())
    def cache(self, finished):
        req = self.rng.choice(self.running())
        self.cm.cache_req(req, finished=finished)
        if finished:
            self.finished.append(req)

    @precondition(lambda self: self.cm.running)
    @rule()
    def release(self):
        req = self.rng.choice(self.cm.running)
        self.cm.release_req(req)
        if req in self.admitted:
            self.admitted.remove(req)
        self.finished.append(req)

    @precondition(lambda self: self.finished)
    @rule()
    def misuse_a_finished_request(self):
        req = self.rng.choice(self.finished)
        self.refused(lambda: self.cm.cache_req(req, finished=True), CacheMisuse, [req])
        self.refused(lambda: self.cm.release_req(req), CacheMisuse, [req])

    @rule(owner=st.sampled_from([None, "outsider", 7]))
    def lock_by_an_outsider(self, owner):
        handle = self.cm.prefix_cache.match_prefix(self.prompt()).handle
        if handle.cached_len:
            self.cm.lock(handle, owner=owner)
            self.external.append((handle, owner))

    @precondition(lambda self: self.external)
    @rule()
    def unlock_by_the_holder(self):
        handle, owner = self.external.pop(self.rng.randrange(len(self.external)))
        self.cm.unlock(handle, owner=owner)

    @rule(stranger=st.sampled_from([None, "stranger", "outsider"]))
    def unlock_by_a_non_holder(self, stranger):
        held = [(r.cache_handle, r) for r in self.cm.running
                if r.cache_handle is not None and r.cache_handle.cached_len] + self.external
        if not held:
            return
        handle, _ = self.rng.choice(held)
        owners = [r for r in self.cm.running] + [stranger]
        owner = self.rng.choice(owners)
        if self.cm.prefix_cache.is_locked_by(handle, owner):
            return
        self.refused(lambda: self.cm.unlock(handle, owner=owner), CacheMisuse, self.cm.running)

    # --- after every step ---------------------------------------------------------------------

    @invariant()
    def pages_are_conserved_and_rows_read_their_own_kv(self):
        if not hasattr(self, "cm"):
            return
        cm, P = self.cm, self.page_size
        cm.check_integrity()
        own = sum(cm.allocated_pages(r) - (r.cache_handle.cached_len if r.cache_handle else 0) // P
                  for r in cm.running)
        cached = cm.prefix_cache.size_info.total_size // P
        assert cm.num_free_pages + cached + own == self.num_pages
        for r in self.running():
            row = cm.page_table[r.table_idx, : r.cached_len].tolist()
            for pos, slot in enumerate(row):
                assert self.kv[slot] == hash(tuple(r.input_ids[: pos + 1])), \
                    f"row {r.table_idx} position {pos} reads another request's KV"


def _machine(page_size: int):
    machine = type(f"CacheManagerMachineP{page_size}", (CacheManagerMachine,), {"page_size": page_size})
    machine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
    return machine.TestCase


TestCacheManagerP1 = _machine(1)
TestCacheManagerP4 = _machine(4)
TestCacheManagerP16 = _machine(16)
TestCacheManagerP64 = _machine(64)
