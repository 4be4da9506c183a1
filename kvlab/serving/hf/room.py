"""The generator's "make room" phase: a memory policy at work before each step (chapter 12).

:class:`kvlab.serving.hf.PagedGenerator` runs this before it plans a step's prefill. With the
``"reserve"`` policy it does nothing (admission promised every request its whole answer). The
other policies (:mod:`kvlab.serving.pressure`) admitted on less, so a step may not fit::

    1. the coming step needs, for every request that holds a row, the pages of one more token
       (a decoding request's next position; a prompt in chunks, at least one more token);
       while that does not fit in free + evictable pages, stop the policy's victim:
         recompute  cache_req(finished=True), back to the front of the queue
         retract    release_req, back to the end of the queue
         swap       copy its row's K/V to host pages (kvlab.serving.hf.swap), release_req, set aside
    2. retract: the new_token_ratio moves (decays, or jumps after a retraction)
    3. swap: if nothing was swapped out in this step, swapped requests come back first, in
       arrival order: a fresh row, the prefix cache's hit, new pages for the rest of what
       they had computed, filled from host memory (kvlab.serving.pressure.restore_request)
    4. say whether new requests may be admitted in this step (not after a preemption or a
       retraction; not while any request is swapped out)

A stopped request keeps its tokens: it comes back with its prompt and everything it generated
as its input, so its answer continues exactly where it stopped.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from ...base.args import div_ceil
from ..pressure import PolicyRun, RequestView, restore_request, stop_request
from .prefill import Seq, request_view

__all__ = ["Room"]


class Room:
    """One ``generate`` call's policy state, and the make-room phase of each step."""

    def __init__(self, gen, run: PolicyRun, stats: dict):
        self.gen, self.run, self.stats = gen, run, stats
        self.manager = gen.manager
        self.P = gen.page_size
        self.swapped: list[Seq] = []      # swapped out, in arrival order (prompt index)
        self.admissions = 0
        self.stopped: list[int] = []      # prompt indices stopped / brought back in this step
        self.resumed: list[int] = []
        if gen.host is not None:
            gen.host.reset()              # what an earlier call left there is no longer needed
        for key in ("preemptions", "retractions", "swaps_out", "swaps_in", "recomputed_tokens",
                    "swapped_out_bytes", "swapped_in_bytes", "reserved_unused", "running_sum"):
            stats[key] = 0

    def view(self, seq: Seq) -> RequestView:
        return request_view(seq, self.manager)

    def admitted(self, seq: Seq) -> None:
        """``seq`` was just admitted (``PrefillAdder.try_admit``): its order, and what a
        comeback computes again (positions it had computed that the cache no longer holds)."""
        seq.admitted = self.admissions
        self.admissions += 1
        if seq.stops:
            again = max(0, seq.saved - seq.req.cached_len)
            seq.recomputed += again
            self.stats["recomputed_tokens"] += again

    # --- the phase --------------------------------------------------------------------------

    def needs_room(self, running: list, chunked: list) -> bool:
        """The coming step does not fit: someone must be stopped (never with ``"reserve"``)."""
        holders = running + chunked
        return (self.run.policy.preempts and bool(holders)
                and self.manager.pages_needed([s.req for s in holders]) > self.manager.available_pages)

    def make_room(self, waiting: deque, chunked: list, running: list, free_rows: list) -> bool:
        """Run steps 1-4 of the module docstring; return whether new requests may be admitted."""
        self.stopped, self.resumed = [], []
        if not self.run.policy.preempts:
            return True
        holders = running + chunked
        while holders and self.manager.pages_needed([s.req for s in holders]) > self.manager.available_pages:
            victim = self.run.victim([self.view(s) for s in holders]).key
            holders.remove(victim)
            (running if victim in running else chunked).remove(victim)
            self._stop(victim, waiting, free_rows)
        if running or self.stopped:
            self.run.after_decode(retracted=bool(self.stopped), remaining=[self.view(s) for s in running])
        if self.swapped and not self.stopped:
            self._swap_in(running + chunked, chunked, free_rows)
        return (not self.stopped or self.run.policy.admit_after_preempt) and not self.swapped

    def _stop(self, seq: Seq, waiting: deque, free_rows: list) -> None:
        how, req = self.run.policy.on_preempt, seq.req
        host = self.gen.host
        if how == "swap" and host is not None and host.fits(req.cached_len):
            seq.host_pages = host.save(self.gen.pool, self.gen.page_table[req.table_idx, : req.cached_len])
            seq.saved = stop_request(self.manager, req, keep=False)
            self.swapped.append(seq)
            self.swapped.sort(key=lambda s: s.index)
            self.stats["swaps_out"] += 1
            self.stats["swapped_out_bytes"] += seq.saved * host.bytes_per_token
        else:  # recompute, retract (and a swap the host pool cannot hold: recompute instead)
            seq.saved = stop_request(self.manager, req, keep=how in ("keep", "swap"))
            if self.run.policy.requeue == "back":
                waiting.append(seq)
            else:
                waiting.appendleft(seq)
            self.stats["retractions" if self.run.name == "retract" else "preemptions"] += 1
        seq.stops += 1
        free_rows.append(req.table_idx)
        self.stopped.append(seq.index)

    def _swap_in(self, holders: list, chunked: list, free_rows: list) -> None:
        """Bring swapped requests back while a row and memory allow (oldest arrival first)."""
        from ...manager.req import Req

        host, pool = self.gen.host, self.gen.pool
        while self.swapped and free_rows:
            seq = self.swapped[0]
            req = Req(seq.input_ids, table_idx=free_rows[0])
            # every page up to what it had computed, and one more token (its hit counted as if
            # it had to be taken too: admission locks it), beside the others' coming step
            need = div_ceil(seq.saved + 1, self.P)
            if self.manager.pages_needed([s.req for s in holders]) + need > self.manager.available_pages:
                break

            def copy_back(start, end, slots, seq=seq):
                host.load(pool, seq.host_pages, start, end, slots)

            seq.req = req
            back = restore_request(self.manager, req, seq.saved, copy_back)
            host.release(seq.host_pages)
            seq.host_pages = []
            self.swapped.pop(0)
            free_rows.pop(0)
            self.admitted(seq)
            chunked.append(seq)              # it continues as a prompt: at least its last token
            holders.append(seq)
            self.resumed.append(seq.index)
            self.stats["swaps_in"] += 1
            self.stats["swapped_in_bytes"] += back * host.bytes_per_token

    def step_pages(self, running: list) -> int:
        """Pages the running requests' next tokens take in this step (0 for a policy that
        promised them everything already: admission never needs the number then)."""
        if not self.run.policy.preempts:
            return 0
        return self.manager.pages_needed([s.req for s in running])

    # --- what each step records -------------------------------------------------------------

    def record_step(self, step_reqs: Sequence, holders: Sequence[Seq]) -> None:
        """After admission: requests in the step, and pages promised but still unmapped."""
        self.stats["running_sum"] += len(step_reqs)
        self.stats["reserved_unused"] += sum(self.run.unused_pages(self.view(s), self.P)
                                             for s in holders)
