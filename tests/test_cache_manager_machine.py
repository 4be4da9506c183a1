"""A hypothesis state machine drives CacheManager the way servers (and careless callers) do:
admits, allocations, cache_req finished or not, decodes, the serving words (prefill /
decode_step / complete_step), releases, locks and unlocks by holders and by non-holders, and
failures injected at every mutating step, as an error or an interrupt (a learner pressing
stop): the page-table write (half-way; the Triton writer's kernel launch, before or after the
kernel ran), eviction (between any two of its lines, or right after it returned), ``_free``,
the locks and the insert of ``cache_req`` / ``release_req`` (before or after their work), and in
every rule, any line run anywhere in the manager and the prefix cache (``fail``: the k-th line;
the call is then made again, and must do what it would have done).
After every step: check_integrity, page conservation (every page free, cached or owned by
exactly one running request), no two running requests share a slot, and every running request
reads the KV of its own tokens. Page sizes 1, 4, 16 and 64, on the radix cache (chapter 05) and
on the hash cache (chapter 11: there an eviction can also stop between the lines of the
``take_free`` that hands out each page).

A refused or failed call must leave every piece of state as it was (tests/cache_state.py); a
refused admission may only have stamped and split the tree (its match ran), never more, and so
may a failed cache_req (its insert's walk ran). The hash cache's match changes nothing: there a
failed call leaves it exactly as it was, the order of its free queue included.
"""
from __future__ import annotations

import random
from contextlib import nullcontext

import pytest
from cache_state import MANAGER_MODULES, assert_unchanged, manager_state
from faults import Boom, FailingKernel, Interrupted, failing, interrupt_at_line, patched
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvlab.alloc.paging_kernels
from kvlab import CacheManager, CacheMisuse, HashPrefixCache, OutOfPages, Req
from kvlab.alloc.paging import new_page_table

ROWS = 4


class WriteFailed(RuntimeError):
    """The injected failure of a page-table write."""


INJECTED = (Boom, Interrupted, WriteFailed)
#: a rule's failure: none, or an error or an interrupt at the k-th line run in the manager or the cache
FAIL = st.one_of(st.none(), st.none(), st.tuples(st.integers(1, 600), st.sampled_from([Interrupted, Boom])))
class CacheManagerMachine(RuleBasedStateMachine):
    page_size = 4
    prefix_cache = "radix"  # (not `cache`: that name is the cache_req rule below)

    @initialize(pages=st.integers(3, 9), seed=st.integers(0, 2**16),
                writer=st.sampled_from(["host", "host", "host", "triton"]))
    def setup(self, pages, seed, writer):
        P = self.page_size
        self.unit = max(P, 4)  # prompts span a few pages at every page size
        self.rng = random.Random(seed)
        self.num_pages = pages * self.unit // P
        table = new_page_table(ROWS, 6 * self.unit + 8, P, device="cpu" if writer == "host" else None)
        self.cm = CacheManager(self.num_pages, P, table, self.prefix_cache, page_table_writer=writer)
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

    def failing_writer(self, error=WriteFailed):
        """A page-table write that writes part of the table, then fails."""
        real = self.cm._write_page_table

        def write(allocated, allocation_info):
            row, first, last = allocation_info[0]
            real(allocated[: (last - first) * self.page_size], allocation_info[:1])
            raise error("the page-table write failed half-way")
        return write

    def attempt(self, call, reqs, *, stamps: bool = True) -> bool:
        """Run ``call`` with a failure injected into it: True if it ran to the end (the failure
        was never reached), else the failure propagated and nothing changed."""
        before = manager_state(self.cm, reqs, stamps=stamps)
        try:
            call()
        except INJECTED as e:
            assert_unchanged(before, manager_state(self.cm, reqs, stamps=stamps))
            event(f"failed, nothing changed: {type(e).__name__}")
            return False
        return True

    def run(self, call, reqs, fail):
        """``call()``; with ``fail``, first once with that failure injected: it must change
        nothing (a radix match may split and stamp the tree), and then the call is made again."""
        if fail is not None:
            k, error = fail
            before = manager_state(self.cm, reqs, stamps=False)
            with interrupt_at_line(MANAGER_MODULES, k, error=error) as seen:
                try:
                    return call()
                except (Boom, Interrupted):
                    assert seen[0] == k
            assert_unchanged(before, manager_state(self.cm, reqs, stamps=False))
            self.cm.check_integrity()
            event(f"failed at a line, nothing changed: {error.__name__}")
        return call()

    def allocated(self, batch) -> None:
        """The model step after a batch got its pages."""
        self.forward(batch)
        for r in batch:
            r.complete_one()
            r.append_token(self.rng.randrange(3))
        self.admitted.clear()

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
    @rule(fail=FAIL)
    def admit(self, fail):
        req = Req(self.prompt(), self.free_rows()[0])
        self.run(lambda: self.cm.admit(req), [req], fail)
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
        self.allocated(batch)

    @precondition(lambda self: self.running())
    @rule(fail=st.booleans(), fail_at=FAIL)
    def decode(self, fail, fail_at):
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
        step = self.run(lambda: self.cm.decode_step(batch), batch, fail_at)
        self.forward(batch)
        done = [self.rng.random() < 0.2 for _ in batch]
        tokens = [self.rng.randrange(3) for _ in batch]
        self.run(lambda: self.cm.complete_step(step, tokens, done), batch, fail_at)
        self.finished += [r for r, d in zip(batch, done) if d]

    @precondition(lambda self: self.free_rows())
    @rule(n=st.integers(1, ROWS), reserve=st.sampled_from([0, 0, 5]), fail=st.booleans(), fail_at=FAIL)
    def prefill_words(self, n, reserve, fail, fail_at):
        """Admit and map new prompts in one call. Refused (OutOfPages) or failed (``fail``: the
        page-table write interrupted half-way), it takes back what it admitted: nothing changed
        (on the hash cache, the free pages the admissions hit are back in their places)."""
        reqs = [Req(self.prompt(), row) for row in self.free_rows()[:n]]
        before = manager_state(self.cm, reqs, stamps=False)
        try:
            with patched(self.cm, "_write_page_table", self.failing_writer(Interrupted)) if fail else nullcontext():
                batch = self.cm.prefill(reqs, reserve_tokens=reserve)
        except (OutOfPages, Interrupted) as e:
            assert_unchanged(before, manager_state(self.cm, reqs, stamps=False))
            event(f"prefill failed, nothing changed: {type(e).__name__}")
            return
        self.forward(reqs)
        tokens = [self.rng.randrange(3) for _ in reqs]
        self.run(lambda: self.cm.complete_step(batch, tokens), reqs, fail_at)

    @precondition(lambda self: self.free_rows() and self.running())
    @rule(fail=FAIL)
    def mixed(self, fail):
        """New prompts and the running requests' next tokens in one step."""
        decode = [r for r in self.running() if r.device_len < self.max_len]
        new = [Req(self.prompt(), row) for row in self.free_rows()[:2]]
        if self.cm.pages_needed(new + decode) > self.cm.available_pages:
            return
        try:
            batch = self.run(lambda: self.cm.mixed_step(new, decode), new + decode, fail)
        except OutOfPages:  # (the admissions' hits may lock what the count called evictable)
            return
        self.forward(new + decode)
        tokens = [self.rng.randrange(3) for _ in batch.reqs]
        done = [False] * len(new) + [self.rng.random() < 0.3 for _ in decode]
        self.run(lambda: self.cm.complete_step(batch, tokens, done), new + decode, fail)
        self.finished += [r for r, d in zip(batch.reqs, done) if d]

    @precondition(lambda self: self.running())
    @rule(finished=st.booleans(), fail=FAIL)
    def cache(self, finished, fail):
        req = self.rng.choice(self.running())
        self.run(lambda: self.cm.cache_req(req, finished=finished), [req], fail)
        if finished:
            self.finished.append(req)

    @precondition(lambda self: self.cm.running)
    @rule(fail=FAIL)
    def release(self, fail):
        req = self.rng.choice(self.cm.running)
        self.run(lambda: self.cm.release_req(req), [req], fail)
        if req in self.admitted:
            self.admitted.remove(req)
        self.finished.append(req)

    @precondition(lambda self: self.finished)
    @rule()
    def misuse_a_finished_request(self):
        req = self.rng.choice(self.finished)
        self.refused(lambda: self.cm.cache_req(req, finished=True), CacheMisuse, [req])
        self.refused(lambda: self.cm.release_req(req), CacheMisuse, [req])

    @rule(owner=st.sampled_from([None, "outsider", 7]), fail=FAIL)
    def lock_by_an_outsider(self, owner, fail):
        handle = self.cm.prefix_cache.match_prefix(self.prompt()).handle
        if handle.cached_len:
            self.run(lambda: self.cm.lock(handle, owner=owner), (), fail)
            self.external.append((handle, owner))

    @precondition(lambda self: self.external)
    @rule(fail=FAIL)
    def unlock_by_the_holder(self, fail):
        handle, owner = self.external.pop(self.rng.randrange(len(self.external)))
        self.run(lambda: self.cm.unlock(handle, owner=owner), (), fail)

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

    # --- failures injected into every mutating step --------------------------------------------

    @precondition(lambda self: self.admitted)
    @rule(how=st.sampled_from(["interrupt_at_line", "interrupt_after", "error_after", "kernel_before",
                               "kernel_after", "write_interrupted"]), k=st.integers(1, 40))
    def allocate_with_a_failure(self, how, k):
        """Eviction stopped between any two of its lines (on the hash cache, or of the take_free
        it calls for each page) or right after it returned; the Triton writer's launch failing
        before or after its kernel ran; the write interrupted half-way."""
        batch, cm = list(self.admitted), self.cm
        if not 0 < cm.pages_needed(batch) <= cm.available_pages:
            return
        if cm.pages_needed(batch) > cm.num_free_pages:
            event("a failure while evicting")
        if how == "interrupt_at_line":
            where = type(cm.prefix_cache).evict_leaves
            if isinstance(cm.prefix_cache, HashPrefixCache) and k % 2:
                where, k = HashPrefixCache._take_free, k // 2 + 1
            with interrupt_at_line(where, k):
                done = self.attempt(lambda: cm.allocate_paged(batch), batch)
        elif how in ("interrupt_after", "error_after"):
            error = Interrupted if how == "interrupt_after" else Boom
            with patched(cm.prefix_cache, "evict_leaves", failing(cm.prefix_cache.evict_leaves, 0, after=True,
                                                                     error=error)):
                done = self.attempt(lambda: cm.allocate_paged(batch), batch)
        elif how.startswith("kernel"):
            if cm.page_table_writer != "triton":
                return
            kernel = kvlab.alloc.paging_kernels.write_page_table_kernel
            kvlab.alloc.paging_kernels.write_page_table_kernel = FailingKernel(kernel, after=how == "kernel_after",
                                                                         error=Interrupted)
            try:
                done = self.attempt(lambda: cm.allocate_paged(batch), batch)
            finally:
                kvlab.alloc.paging_kernels.write_page_table_kernel = kernel
        else:
            with patched(cm, "_write_page_table", self.failing_writer(Interrupted)):
                done = self.attempt(lambda: cm.allocate_paged(batch), batch)
        if done:
            self.allocated(batch)

    @precondition(lambda self: self.running())
    @rule(finished=st.booleans(), step=st.sampled_from([("_free", 0), ("_free", 1), ("unlock", 0), ("lock", 0),
                                                        ("insert_prefix", 0)]),
          after=st.booleans(), interrupt=st.booleans())
    def cache_with_a_failure(self, finished, step, after, interrupt):
        req, (where, k) = self.rng.choice(self.running()), step
        owner = self.cm.prefix_cache if where == "insert_prefix" else self.cm
        error = Interrupted if interrupt else Boom
        with patched(owner, where, failing(getattr(owner, where), k, after=after, error=error)):
            done = self.attempt(lambda: self.cm.cache_req(req, finished=finished), [req], stamps=False)
        if done and finished:
            self.finished.append(req)

    @precondition(lambda self: self.cm.running)
    @rule(where=st.sampled_from(["_free", "unlock"]), after=st.booleans(), interrupt=st.booleans())
    def release_with_a_failure(self, where, after, interrupt):
        req = self.rng.choice(self.cm.running)
        error = Interrupted if interrupt else Boom
        with patched(self.cm, where, failing(getattr(self.cm, where), 0, after=after, error=error)):
            done = self.attempt(lambda: self.cm.release_req(req), [req])
        if done:
            if req in self.admitted:
                self.admitted.remove(req)
            self.finished.append(req)

    @precondition(lambda self: self.running())
    @rule(k=st.integers(0, 3), interrupt=st.booleans())
    def complete_step_with_a_failure(self, k, interrupt):
        """complete_step settles its requests one cache_req at a time: a failure in the k-th
        takes back the earlier ones too (no token recorded, no length moved): the batch is as
        before, and the same call then completes it."""
        batch = [r for r in self.running() if r.device_len < self.max_len]
        if not batch or self.cm.pages_needed(batch) > self.cm.available_pages:
            return
        step = self.cm.decode_step(batch)
        self.forward(batch)
        done = [self.rng.random() < 0.5 for _ in batch]
        tokens = [self.rng.randrange(3) for _ in batch]
        with patched(self.cm, "_cache_req", failing(self.cm._cache_req, k, error=Interrupted if interrupt else Boom)):
            if not self.attempt(lambda: self.cm.complete_step(step, tokens, done), batch, stamps=False):
                event("complete_step failed part-way, taken back whole")
                self.cm.complete_step(step, tokens, done)
        self.finished += [r for r in batch if r not in self.cm.running]

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
        # no two running requests share a slot they write (their own pages; a cached prefix is
        # shared by design, read-only)
        written = [cm.page_table[r.table_idx, (r.cache_handle.cached_len if r.cache_handle else 0):
                                 cm.allocated_pages(r) * P].tolist() for r in cm.running]
        flat = [slot for slots in written for slot in slots]
        assert len(flat) == len(set(flat)), "two running requests write the same slot"
        for r in self.running():
            row = cm.page_table[r.table_idx, : r.cached_len].tolist()
            for pos, slot in enumerate(row):
                assert self.kv[slot] == hash(tuple(r.input_ids[: pos + 1])), \
                    f"row {r.table_idx} position {pos} reads another request's KV"


def _machine(page_size: int, cache: str = "radix"):
    machine = type(f"CacheManagerMachine{cache.title()}P{page_size}", (CacheManagerMachine,),
                   {"page_size": page_size, "prefix_cache": cache})
    machine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
    return machine.TestCase


TestCacheManagerP1 = _machine(1)
TestCacheManagerP4 = _machine(4)
TestCacheManagerP16 = _machine(16)
TestCacheManagerP64 = _machine(64)
TestCacheManagerHashP1 = _machine(1, "hash")
TestCacheManagerHashP4 = _machine(4, "hash")
TestCacheManagerHashP16 = _machine(16, "hash")
TestCacheManagerHashP64 = _machine(64, "hash")
