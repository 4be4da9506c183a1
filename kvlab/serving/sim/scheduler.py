"""A small, deterministic serving loop over the real kvlab parts (chapter 07).

Nothing is faked except the model: the token a request "generates" is read from its
workload spec. Memory goes through :class:`kvlab.CacheManager` exactly as a server would
drive it (mini-sglang's order):

    each step
    ┌──────────────────────────────────────────────────────────────────────────────┐
    │ 1 arrivals      specs whose time has come join the waiting queue (FIFO)     │
    │ 2 aborts        clients that gave up: release_req (nothing cached)          │
    │ 3 make room     the memory policy (kvlab.serving.pressure, SimConfig.policy): while │
    │                 the running requests' next tokens do not fit even after     │
    │                 eviction, stop its victim (kvlab.serving.sim.make_room; chapter 12)      │
    │   decode        every running request computes one token:                   │
    │                 decode_step(batch) maps a page when one crosses a page      │
    │                 boundary                                                    │
    │ 4 prefill       admit waiting requests while a row, the token budget and    │
    │                 memory allow: admit = match_req + lock + map the hit;       │
    │                 prefill(batch) maps their pages; complete_step then puts    │
    │                 the prompts' whole pages into the prefix cache              │
    │ 5 finish        a request with its whole answer: complete_step caches it    │
    │                 with cache_req(finished=True)                               │
    │ 6 check         check_integrity() + no running row reads a free page        │
    │ 7 record        a StepRecord snapshot                                       │
    └──────────────────────────────────────────────────────────────────────────────┘

Out of pages: a *waiting* request waits (it is not admitted until memory allows); a
*running* request that needs a page preempts the youngest running request, which goes
back to the front of the queue with everything it generated so far -- its prompt pages
stay in the prefix cache (unlocked), so its re-prefill is mostly a cache hit, unless
they were evicted meanwhile. That is the default policy, :data:`kvlab.serving.pressure.CHAPTER_07`;
chapter 12 compares it with the engines' four (``SimConfig(policy="reserve")``,
``"recompute"``, ``"retract"``, ``"swap"``), which also change what admission counts. The token budget bounds prefill tokens per step, but the
first admitted request of a step always goes -- unless ``chunked_prefill`` is on: then a
prompt gets ``min(budget left, tokens it still has to compute)`` tokens per step (mini-sglang's
``PrefillAdder``, ``scheduler/prefill.py``), keeps its row and its locked cache handle between
chunks, goes first in the next step, produces its first token with its last chunk and is
cached (``cache_req(finished=False)``) only then.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ...manager.cache_manager import CacheManager, ForwardBatch, Req
from ...base.errors import IntegrityError
from ...alloc.paging import new_page_table
from .caches import counting_cache, free_page_ids
from .checks import check_config, check_workload
from .config import SimConfig
from .make_room import SimRoom
from .timeline import MemorySplit, RequestStats, StepRecord, Timeline
from .workloads import RequestSpec, Workload

__all__ = ["SimConfig", "Simulator", "SimIntegrityError", "simulate"]


class SimIntegrityError(IntegrityError):
    """An invariant broke during a run: says at which step and for which request."""

    def __init__(self, step: int, rid: int | None, message: str, row: int | None = None):
        self.step = step
        self.rid = rid
        self.message = message
        who = f"request {rid}" if rid is not None else "no single request"
        super().__init__(f"step {step}, {who}: {message}", row=row)

    def __reduce__(self):
        return type(self), (self.step, self.rid, self.message, self.row)


@dataclass
class _Live:
    spec: RequestSpec
    input_ids: list[int]
    generated: int = 0
    req: Req | None = None
    admit_order: int = -1
    done: bool = False
    prefilled: bool = False     # its whole prompt is computed: it decodes
    max_new: int = 0            # the cap the scheduler knows (max_new_tokens)
    arrived: int = 0            # arrival order
    saved: int = 0              # positions it had computed when it was last stopped
    host_pages: int = 0         # swapped out: host pages holding its K/V


@dataclass
class _StepLog:
    arrived: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    decoded: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    chunked: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    evicted_tokens: int = 0
    regions: object | None = None
    regions_rid: int = -1
    swapped_in: list[int] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)
    recomputed_tokens: int = 0
    swap_out_tokens: int = 0
    swap_in_tokens: int = 0


class Simulator:
    """Runs a :class:`~kvlab.serving.sim.workloads.Workload` step by step; :meth:`run` returns a Timeline."""

    def __init__(self, workload: Workload, config: SimConfig = SimConfig(), device=None):
        policy = check_config(config)             # every rule first (kvlab.serving.sim.checks)
        max_seq_len = check_workload(workload, config)
        P = config.page_size
        self.workload = workload
        self.config = config
        self.page_table = new_page_table(config.max_running, max_seq_len, P, device)
        self.cache = counting_cache(config.prefix_cache, P, config.num_pages, self.page_table.device)
        self.manager = CacheManager(config.num_pages, P, self.page_table, self.cache,
                                    page_table_writer=config.page_table_writer,
                                    remap_duplicates=config.remap_duplicates)
        self.step_no = 0
        self._pending = list(workload.requests)
        self._waiting: deque[_Live] = deque()
        self._running: dict[int, _Live] = {}          # rid -> live, in admission order
        self._free_rows = list(range(config.max_running))
        self._finish_step: dict[int, int] = {}
        self._admits = 0
        self._last_regions: tuple = (None, -1, -1)   # (CacheRegions, rid, step) of the latest cache_req
        self._arrivals_seen = 0
        self.room = SimRoom(self, policy.start())
        self.timeline = Timeline(workload.name, P, config.num_pages, config.max_running,
                                 prefix_cache=config.prefix_cache, policy=policy.name)
        for r in workload.requests:
            self.timeline.requests[r.rid] = RequestStats(
                r.rid, r.tag, len(r.prompt), len(r.output),
                max_new=len(r.output) if r.max_new_tokens is None else r.max_new_tokens)

    # --- helpers --------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return not (self._pending or self._waiting or self._running or self.room.swapped)

    def _release(self, live: _Live) -> None:
        """Give a running request's pages back (nothing is cached) and free its row."""
        self.manager.release_req(live.req)
        self._free_row(live)

    def _enter(self, live: _Live, req: Req) -> None:
        """``live`` holds ``req``'s row now (admitted, or brought back from host memory)."""
        self._free_rows.remove(req.table_idx)
        live.req = req
        live.admit_order = self._admits
        self._admits += 1
        self._running[live.spec.rid] = live
        live.prefilled = False

    def _free_row(self, live: _Live) -> None:
        self._free_rows.append(live.req.table_idx)
        self._free_rows.sort()
        del self._running[live.spec.rid]
        live.req = None

    def _complete(self, batch: ForwardBatch, lives: list[_Live], log: _StepLog) -> None:
        """After the (pretend) forward pass: each request produced its next token (a chunk of
        a prompt that goes on produces none). The manager records them and caches what the
        phase asks; here the bookkeeping of a run."""
        chunk = [end < live.req.input_len for live, end in zip(lives, batch.end)]
        done = [not c and live.generated + 1 == len(live.spec.output) for live, c in zip(lives, chunk)]
        tokens = [None if c else live.spec.output[live.generated] for live, c in zip(lives, chunk)]
        settled = self.manager.complete_step(batch, tokens, done,
                                             cache_prompt=self.config.cache_after_prefill)
        live_of = {live.req: live for live in lives}
        if settled:
            req, log.regions = settled[-1]
            log.regions_rid = live_of[req].spec.rid
        for live, finished, chunked in zip(lives, done, chunk):
            if chunked:
                log.chunked.append(live.spec.rid)
                continue
            live.prefilled = True
            live.generated += 1
            stats = self.timeline.requests[live.spec.rid]
            stats.generated = live.generated
            if live.generated == 1:
                stats.first_token_step = self.step_no
            if batch.phase == "decode":
                log.decoded.append(live.spec.rid)
            if finished:
                self._free_row(live)
                live.done = True
                self._finish_step[live.spec.rid] = self.step_no
                self.timeline.requests[live.spec.rid].finish_step = self.step_no
                log.finished.append(live.spec.rid)

    # --- the phases (finish runs inside decode and prefill) ----------------------------

    def _arrivals(self, log: _StepLog) -> None:
        still = []
        for spec in self._pending:
            if spec.after is None:
                ready = spec.arrival <= self.step_no
            else:
                done_at = self._finish_step.get(spec.after)
                ready = done_at is not None and done_at + spec.arrival <= self.step_no
            if ready:
                max_new = len(spec.output) if spec.max_new_tokens is None else spec.max_new_tokens
                self._waiting.append(_Live(spec, list(spec.prompt), max_new=max_new,
                                           arrived=self._arrivals_seen))
                self._arrivals_seen += 1
                self.timeline.requests[spec.rid].arrival_step = self.step_no
                log.arrived.append(spec.rid)
            else:
                still.append(spec)
        self._pending = still

    def _aborts(self, log: _StepLog) -> None:
        for live in list(self._running.values()):
            limit = live.spec.abort_after
            if limit is not None and live.generated >= limit:
                self._release(live)
                live.done = True
                self._finish_step[live.spec.rid] = self.step_no  # a follow-up turn may come
                self.timeline.requests[live.spec.rid].aborted = True
                log.aborted.append(live.spec.rid)

    def _decode(self, log: _StepLog) -> None:
        lives = [live for live in self._running.values() if live.prefilled]
        if lives:
            batch = self.manager.decode_step([live.req for live in lives])
            self._complete(batch, lives, log)

    def _chunk(self, req: Req, budget: int) -> int:
        """Tokens ``req`` computes this step: the rest of its prompt, or with chunked prefill
        at most the budget left (mini-sglang: ``chunk_size = min(token_budget, remain_len)``)."""
        remain = req.input_len - req.cached_len
        return min(budget, remain) if self.config.chunked_prefill else remain

    def _prefill(self, log: _StepLog, admit: bool = True) -> None:
        lives: list[_Live] = []
        budget = self.config.prefill_budget
        room = self.room
        # prompts begun in an earlier step go first, on the row and handle they kept
        for live in [l for l in self._running.values() if not l.prefilled]:
            chunk = self._chunk(live.req, budget)
            live.req.device_len = live.req.cached_len + chunk
            if chunk <= 0 or (self.manager.pages_needed([l.req for l in lives] + [live.req])
                              > self.manager.available_pages):
                live.req.device_len = live.req.cached_len + 1
                budget = 0                         # no newcomer overtakes a prompt begun earlier
                break
            budget -= chunk
            lives.append(live)
        # what the running requests are promised beyond what they map (decoders have run)
        reserved = sum(room.promised(l, None if l in lives else l.req.cached_len)
                       for l in self._running.values())
        while (admit and self._waiting and self._free_rows
               and (budget > 0 or not self.config.chunked_prefill)):
            live = self._waiting[0]
            req = Req(list(live.input_ids), self._free_rows[0], rid=live.spec.rid)
            self.manager.admit(req)                # match_req + lock + map the hit into the row
            chunk = self._chunk(req, budget)
            req.device_len = req.cached_len + chunk
            over_budget = bool(lives) and chunk > budget
            # admit() locked the hit, so evictable pages are counted after it
            available = self.manager.available_pages
            no_memory = self.manager.pages_needed([l.req for l in lives] + [req]) > available
            live.req = req
            need = room.promised(live, new=True)
            if over_budget or no_memory or reserved + need > available:
                live.req = None
                self.manager.release_req(req)      # undo the admission: unlock, clear the row
                break
            reserved += need
            budget -= chunk
            self._waiting.popleft()
            self._enter(live, req)
            lives.append(live)
            log.admitted.append(live.spec.rid)
            log.hit_tokens += req.cached_len
            log.prompt_tokens += req.input_len
            stats = self.timeline.requests[live.spec.rid]
            if stats.first_admit_step < 0:
                stats.first_admit_step, stats.hit_tokens = self.step_no, req.cached_len
            if stats.preemptions:
                room.readmitted(live, log)
        if lives:
            batch = self.manager.prefill([live.req for live in lives])  # admitted above: maps pages
            log.prefill_tokens += batch.num_tokens
            self._complete(batch, lives, log)

    # --- checks and snapshots ---------------------------------------------------------

    def _rid_of_row(self, row: int) -> int | None:
        for rid, live in self._running.items():
            if live.req.table_idx == row:
                return rid
        return None

    def check(self) -> None:
        """Every invariant, naming the step and the request when one breaks."""
        P = self.config.page_size
        free = set(free_page_ids(self.manager, cached_too=True))  # no running row reads these
        for rid, live in self._running.items():
            req = live.req
            row = self.page_table[req.table_idx, : req.cached_len].tolist()
            for pos, slot in enumerate(row):
                if slot < 0:
                    raise SimIntegrityError(self.step_no, rid, f"row {req.table_idx} position {pos} "
                                            f"is unmapped but its KV was computed (cached_len={req.cached_len})",
                                            req.table_idx)
                if slot // P in free:
                    raise SimIntegrityError(self.step_no, rid, f"row {req.table_idx} position {pos} "
                                            f"points at slot {slot} on page {slot // P}, which is free",
                                            req.table_idx)
        try:
            self.manager.check_integrity()
        except IntegrityError as e:
            rid = self._rid_of_row(e.row) if e.row is not None else None
            raise SimIntegrityError(self.step_no, rid, str(e), e.row) from e

    def _snapshot(self, log: _StepLog) -> StepRecord:
        P = self.config.page_size
        info = self.cache.size_info
        private = wasted = 0
        row_rids = [-1] * self.config.max_running
        for rid, live in self._running.items():
            req = live.req
            mapped = self.manager.allocated_pages(req)
            handle_pages = req.cache_handle.cached_len // P if req.cache_handle is not None else 0
            private += mapped - handle_pages
            wasted += mapped * P - req.cached_len
            row_rids[req.table_idx] = rid
        memory = MemorySplit(self.manager.num_free_pages, info.evictable_size // P,
                             info.protected_size // P, private)
        return StepRecord(
            step=self.step_no, arrived=tuple(log.arrived), admitted=tuple(log.admitted),
            decoded=tuple(log.decoded), finished=tuple(log.finished), chunked=tuple(log.chunked),
            aborted=tuple(log.aborted),
            preempted=tuple(log.preempted), waiting=tuple(l.spec.rid for l in self._waiting),
            prefill_tokens=log.prefill_tokens, hit_tokens=log.hit_tokens,
            prompt_tokens=log.prompt_tokens, evicted_tokens=log.evicted_tokens,
            memory=memory, wasted_slots=wasted,
            page_table=self.page_table[: self.config.max_running].clone().cpu(),
            row_rids=tuple(row_rids), free_pages=free_page_ids(self.manager),
            tree=self.cache.snapshot(), cache_evictable=info.evictable_size, cache_protected=info.protected_size,
            last_regions=self._last_regions[0], last_regions_rid=self._last_regions[1],
            last_regions_step=self._last_regions[2],
            swapped_in=tuple(log.swapped_in), resumed=tuple(log.resumed),
            swapped=tuple(l.spec.rid for l in self.room.swapped),
            promised_pages=self.room.promised_pages(), recomputed_tokens=log.recomputed_tokens,
            swap_out_tokens=log.swap_out_tokens, swap_in_tokens=log.swap_in_tokens,
            host_pages=self.room.host_used, ratio=self.room.run.ratio)

    # --- driving ----------------------------------------------------------------------

    def step(self) -> StepRecord:
        """Run one step (arrivals, aborts, decode, prefill, finish), check it, record it."""
        log = _StepLog()
        evicted_before = self.cache.evicted_tokens
        self._arrivals(log)
        self._aborts(log)
        admit = self.room.make_room(log)          # the memory policy (kvlab.serving.sim.make_room)
        self._decode(log)
        self._prefill(log, admit)
        if not (log.decoded or log.admitted or log.chunked or self._running):
            self.room.run.on_idle()               # nothing ran: SGLang resets its ratio
        log.evicted_tokens = self.cache.evicted_tokens - evicted_before
        if log.regions is not None:
            self._last_regions = (log.regions, log.regions_rid, self.step_no)
        self.check()
        record = self._snapshot(log)
        self.timeline.steps.append(record)
        self.timeline.cache_ops = self.cache.op_stats()
        self.step_no += 1
        return record

    def run(self) -> Timeline:
        while not self.done:
            if self.step_no >= self.config.max_steps:
                raise RuntimeError(f"the run did not finish in max_steps={self.config.max_steps} steps "
                                   f"({len(self._waiting)} waiting, {len(self._running)} running)")
            self.step()
        return self.timeline


def simulate(workload: Workload, config: SimConfig | None = None, device=None, **overrides) -> Timeline:
    """Run ``workload`` to the end and return its :class:`~kvlab.serving.sim.timeline.Timeline`.

    ``overrides`` replace fields of ``config`` (e.g. ``simulate(w, page_size=1)``).
    """
    from dataclasses import fields, replace

    from ...base.errors import InvalidArgument

    config = config if config is not None else SimConfig()
    if not isinstance(config, SimConfig):
        raise InvalidArgument("config", "a kvlab.serving.sim.SimConfig", f"got {type(config).__name__}")
    known = [f.name for f in fields(SimConfig)]
    for name in overrides:
        if name not in known:
            raise InvalidArgument(name, f"a field of SimConfig ({', '.join(known)})", f"got {name}=...")
    return Simulator(workload, replace(config, **overrides), device).run()
