"""The simulator's memory policy at work (chapter 12): make room, bring swapped requests back.

:class:`~kvlab.serving.sim.scheduler.Simulator` asks this before each step's decode, with the policy of
``SimConfig(policy=...)`` (:mod:`kvlab.serving.pressure`; by default chapter 07's)::

    make_room   every request holding a row needs one more token's page this step (a decoding
                request's next position; a prompt in chunks, its next token at least); while
                that does not fit in free + evictable pages, stop the policy's victim:
                  keep     cache_req(finished=True), then the queue       (recompute)
                  release  release_req, then the queue                    (retract; chapter 07)
                  swap     its positions [0, cached_len) "copied" to host pages, release_req
    ratio       retract: SGLang's new_token_ratio decays, or jumps after a retraction
    swap_in     if nothing was stopped this step: swapped requests come back, oldest arrival
                first, into fresh pages for what the prefix cache no longer holds
    admit?      may waiting requests be admitted this step (the scheduler's prefill phase)

The simulator has no K/V to move: a swap counts host pages and positions, the copies a real
server makes (kvlab.serving.hf.swap does them for a real model).
"""
from __future__ import annotations

from ...base.args import div_ceil
from ..pressure import PolicyRun, RequestView, restore_request, stop_request
from ...manager.req import Req

__all__ = ["SimRoom"]


class SimRoom:
    """One run's policy state and host pool (in pages)."""

    def __init__(self, sim, run: PolicyRun):
        self.sim, self.run = sim, run
        self.P = sim.config.page_size
        host = getattr(run.policy, "host_pages", None)
        self.host_capacity = sim.config.num_pages if host is None else host
        self.host_used = 0
        self.swapped: list = []      # _Live records in host memory, oldest arrival first
        self.stopped: list = []      # rids stopped in the current step

    def view(self, live, positions: int | None = None) -> RequestView:
        req, spec = live.req, live.spec
        return RequestView(spec.rid, len(spec.prompt), live.generated, live.max_new,
                           req.device_len if positions is None else positions,
                           self.sim.manager.allocated_pages(req), live.admit_order, live.arrived)

    def promised(self, live, positions: int | None = None, *, new: bool = False) -> int:
        return self.run.promised_pages(self.view(live, positions), self.P, new=new)

    # --- before the decode --------------------------------------------------------------------

    def make_room(self, log) -> bool:
        """Stop what the coming step cannot hold; return whether waiting requests may be admitted."""
        sim, manager = self.sim, self.sim.manager
        self.stopped = []
        if self.run.policy.preempts:
            while sim._running and manager.pages_needed(
                    [live.req for live in sim._running.values()]) > manager.available_pages:
                views = [self.view(live) for live in sim._running.values()]
                self._stop(sim._running[self.run.victim(views).key], log)
            decoding = [live for live in sim._running.values() if live.prefilled]
            if decoding or self.stopped:
                self.run.after_decode(retracted=bool(self.stopped),
                                      remaining=[self.view(live) for live in decoding])
            if self.swapped and not self.stopped:
                self._swap_in(log)
        return (not self.stopped or self.run.policy.admit_after_preempt) and not self.swapped

    def _stop(self, live, log) -> None:
        sim, how = self.sim, self.run.policy.on_preempt
        ids, saved = list(live.req.input_ids), live.req.cached_len
        host_pages = div_ceil(saved, self.P)
        if how == "swap" and self.host_used + host_pages <= self.host_capacity:
            stop_request(sim.manager, live.req, keep=False)
            self.host_used += host_pages
            live.host_pages = host_pages
            self.swapped.append(live)
            self.swapped.sort(key=lambda x: x.arrived)
            log.swap_out_tokens += saved
        else:  # recompute, retract (and a swap the host pool cannot hold: recompute instead)
            stop_request(sim.manager, live.req, keep=how in ("keep", "swap"))
            if self.run.policy.requeue == "back":
                sim._waiting.append(live)
            else:
                sim._waiting.appendleft(live)
        sim._free_row(live)
        live.input_ids, live.saved, live.prefilled = ids, saved, False
        sim.timeline.requests[live.spec.rid].preemptions += 1
        log.preempted.append(live.spec.rid)
        self.stopped.append(live.spec.rid)

    def _swap_in(self, log) -> None:
        sim, manager = self.sim, self.sim.manager
        while self.swapped and sim._free_rows:
            live = self.swapped[0]
            # every page up to what it had computed and one more token (its hit counted too:
            # admission locks it), beside the running requests' coming step
            need = div_ceil(live.saved + 1, self.P)
            if manager.pages_needed([x.req for x in sim._running.values()]) + need > manager.available_pages:
                break
            req = Req(list(live.input_ids), sim._free_rows[0], rid=live.spec.rid)
            back = restore_request(manager, req, live.saved)
            self.swapped.pop(0)
            self.host_used -= live.host_pages
            live.host_pages = 0
            sim._enter(live, req)
            log.swapped_in.append(live.spec.rid)
            log.swap_in_tokens += back

    # --- after the prefill ----------------------------------------------------------------------

    def readmitted(self, live, log) -> None:
        """A stopped request was admitted again: count what it computes again."""
        again = max(0, live.saved - live.req.cached_len)
        self.sim.timeline.requests[live.spec.rid].recomputed += again
        log.recomputed_tokens += again
        log.resumed.append(live.spec.rid)

    def promised_pages(self) -> int:
        """Pages promised to running requests beyond what their rows map (at rest)."""
        return sum(self.promised(live, live.req.cached_len) for live in self.sim._running.values())
