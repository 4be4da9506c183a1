"""A hypothesis state machine drives PagedTokenAllocator as a scheduler does, and worse: extends
and decode steps with or without host lengths (lists, NumPy arrays, CPU tensors), frees,
batches only the kernel can refuse (a refusal that stays pending until the host reads the
device, as on a GPU), and kernel launches that fail or are interrupted before or after the
kernel ran.

After every step: every page is free or owned by exactly one live request, no two live
requests share a slot, the free list and the kernels' page_free map agree, and the counters
count only calls that stand. A call that fails leaves the allocator as it was; while a refusal
is pending, every allocation is refused too (-1 slots) or raises that refusal first.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from faults import Boom, Interrupted, failing
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvlab
from kvlab import InvalidArgument, OutOfPages, PagedTokenAllocator
from kvlab.alloc import token_allocator
from kvlab.alloc import fast_alloc_kernels as K

FORMS = {"none": None, "list": list, "numpy": lambda v: np.array(v, dtype=np.int64),
         "tensor": lambda v: torch.tensor(v, dtype=torch.int64)}


def t(values):
    return torch.tensor(values, dtype=torch.int64, device=kvlab.DEVICE)


def ceil(x: int, P: int) -> int:
    return -(-x // P)


class AllocatorMachine(RuleBasedStateMachine):
    page_size = 4

    @initialize(pages=st.integers(2, 10), eager=st.booleans(), impl=st.sampled_from(["fast", "fast", "teaching"]))
    def setup(self, pages, eager, impl):
        self.num_pages = pages
        self.alloc = PagedTokenAllocator(pages, self.page_size, impl=impl, eager_errors=eager)
        self.reqs: dict[int, list[int]] = {}  # live request -> its slots, position by position
        self.next_id = 0
        self.pending = False  # a refusal the kernel recorded that the host has not raised yet

    # --- helpers ------------------------------------------------------------------------------

    def owned_pages(self) -> int:
        return sum(ceil(len(s), self.page_size) for s in self.reqs.values())

    def call(self, fn, needed: int, *, host: bool):
        """Run an allocation; returns its slots, or None if it was refused (and checks how)."""
        fits = needed <= self.num_pages - self.owned_pages()
        before = self.alloc.free_pages.tolist()
        try:
            out = fn()
        except InvalidArgument as e:  # only a pending refusal, raised first
            assert self.pending and "earlier" in str(e), e
            self.pending = False
            event("a pending refusal raised by a later call")
        except OutOfPages:
            assert not fits or self.pending, "refused a batch that fits"
            if self.pending:  # (the host judged with the refused call's pages counted: it read the device)
                self.pending = False
        else:
            if self.pending:
                assert host and out.tolist() == [-1] * out.numel(), "an allocation while a refusal is pending"
                event("refused too: a refusal is pending")
                return None
            assert fits, "handed out more pages than were free"
            return out.tolist()
        assert self.alloc.free_pages.tolist() == before or not self.pending
        return None

    def batch(self, data, new: int):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, max_size=3)) if self.reqs else []
        return rids + [None] * new

    # --- the rules ----------------------------------------------------------------------------

    @rule(data=st.data(), new=st.integers(0, 2), form=st.sampled_from(sorted(FORMS)))
    def extend(self, data, new, form):
        P, rids = self.page_size, self.batch(data, new)
        pre = [len(self.reqs[r]) if r is not None else 0 for r in rids]
        ext = [data.draw(st.integers(0, 3 * P + 1)) for _ in rids]
        seq = [p + e for p, e in zip(pre, ext)]
        last = [self.reqs[r][-1] if r is not None and self.reqs[r] else -1 for r in rids]
        needed = sum(ceil(s, P) - ceil(p, P) for p, s in zip(pre, seq))
        to = FORMS[form]
        kw = dict(prefix_lens_cpu=to(pre), seq_lens_cpu=to(seq)) if to else {}
        out = self.call(lambda: self.alloc.alloc_extend(t(pre), t(seq), t(last), sum(ext), **kw), needed,
                        host=bool(kw))
        if out is None:
            return
        at = 0
        for r, e in zip(rids, ext):
            if r is None:
                r, self.next_id = self.next_id, self.next_id + 1
                self.reqs[r] = []
            self.reqs[r] += out[at:at + e]
            at += e

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), form=st.sampled_from(sorted(FORMS)))
    def decode(self, data, form):
        rids = [r for r in self.batch(data, 0) if self.reqs[r]]
        seq = [len(self.reqs[r]) + 1 for r in rids]
        needed = sum((s - 1) % self.page_size == 0 for s in seq)
        to = FORMS[form]
        kw = dict(seq_lens_cpu=to(seq)) if to else {}
        out = self.call(lambda: self.alloc.alloc_decode(t(seq), t([self.reqs[r][-1] for r in rids]), **kw),
                        needed, host=bool(kw))
        for r, slot in zip(rids, out or []):
            self.reqs[r].append(slot)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        r = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs[r]
        if self.pending:
            with pytest.raises(InvalidArgument, match="earlier"):
                self.alloc.free(t(slots))
            self.pending = False
        self.alloc.free(t(slots))
        del self.reqs[r]

    @rule()
    def a_batch_only_the_kernel_refuses(self):
        """last_loc on a free page: the host lengths are fine, the kernel refuses."""
        free = self.alloc.free_pages.tolist()
        if len(free) < 2:
            return
        P = self.page_size
        before = self.alloc.state()
        call = lambda: self.alloc.alloc_extend(t([P]), t([P + 1]), t([free[-1] * P + P - 1]), 1,  # noqa: E731
                                               prefix_lens_cpu=[P], seq_lens_cpu=[P + 1])
        try:
            out = call()
        except InvalidArgument as e:  # the call read the verdict (its own, or a pending one first)
            assert self.alloc.eager_errors or self.alloc.impl == "teaching" or self.pending, e
            assert ("earlier" in str(e)) == self.pending, e
            self.pending = False
        else:  # refused on the device, not raised yet
            assert out.tolist() == [-1] and not self.alloc.eager_errors
            self.pending = True
        assert self.alloc.state().equals(before)

    @rule()
    def check_device_errors(self):
        if self.pending:
            with pytest.raises(InvalidArgument, match="earlier"):
                self.alloc.check_device_errors()
            self.pending = False
        self.alloc.check_device_errors()

    @precondition(lambda self: self.owned_pages() < self.num_pages)
    @rule(decode=st.booleans(), host=st.booleans(), after=st.booleans(), error=st.sampled_from([Boom, Interrupted]))
    def a_launch_fails(self, decode, host, after, error):
        """The kernel launch raises (before its kernel ran, or after: a learner's interrupt
        while the interpreter runs it): the allocator is left as it was."""
        before, page_free = self.alloc.free_pages.tolist(), self.alloc._page_free.tolist()
        P, alloc = self.page_size, self.alloc
        ready = [r for r in self.reqs if self.reqs[r] and len(self.reqs[r]) % P]  # (a decode takes no page)
        if decode and ready:
            r = ready[0]
            seq, last = len(self.reqs[r]) + 1, self.reqs[r][-1]
            call = lambda: alloc.alloc_decode(t([seq]), t([last]), **(dict(seq_lens_cpu=[seq]) if host else {}))  # noqa
            launch = "launch_decode"
        else:
            kw = dict(prefix_lens_cpu=[0], seq_lens_cpu=[P]) if host else {}
            call = lambda: alloc.alloc_extend(t([0]), t([P]), t([-1]), P, **kw)  # noqa: E731
            launch = "launch_extend" if alloc.impl == "fast" else "launch_extend_check"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(K, launch, failing(getattr(K, launch), 0, after=after, error=error))
            mp.setattr(token_allocator, "launch_ready", lambda device: None)  # (a GPU's direct launch)
            try:
                call()
            except (Boom, Interrupted):
                assert alloc.free_pages.tolist() == before, "a failed launch changed the free list"
                assert alloc._page_free.tolist() == page_free, "a failed launch left pages marked"
                event(f"launch failed: {error.__name__}, after={after}")
                return
            except InvalidArgument as e:  # the pending refusal, raised by the call first
                assert self.pending and "earlier" in str(e), e
                self.pending = False
                return
        raise AssertionError("the injected failure was not reached")

    # --- after every step ---------------------------------------------------------------------

    @invariant()
    def every_page_free_or_owned_once_and_no_slot_shared(self):
        if not hasattr(self, "alloc"):
            return
        P, alloc = self.page_size, self.alloc
        free = alloc.free_pages.tolist()
        owners: dict[int, int] = {}
        slots = [s for r in self.reqs.values() for s in r]
        assert len(slots) == len(set(slots)), "two live requests share a slot"
        for r, mine in self.reqs.items():
            assert all(s >= 0 for s in mine), "a live request holds a -1 slot"
            for page in {s // P for s in mine}:
                assert owners.setdefault(page, r) == r, f"page {page} is owned by two requests"
        assert len(free) == len(set(free)) and not set(free) & set(owners), "a page is free and owned"
        assert sorted(free + list(owners)) == list(range(self.num_pages)), "a page is lost"
        assert alloc.num_free_pages == len(free) == self.num_pages - self.owned_pages()
        assert alloc._page_free.tolist() == [int(p in set(free)) for p in range(self.num_pages)]


def _machine(page_size: int):
    machine = type(f"AllocatorMachineP{page_size}", (AllocatorMachine,), {"page_size": page_size})
    machine.TestCase.settings = settings(max_examples=30, stateful_step_count=15, deadline=None)
    return machine.TestCase


TestAllocatorP1 = _machine(1)
TestAllocatorP4 = _machine(4)
TestAllocatorP16 = _machine(16)
