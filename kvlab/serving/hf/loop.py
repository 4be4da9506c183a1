"""The serving loop of one :meth:`PagedGenerator.generate <kvlab.serving.hf.PagedGenerator.generate>`
call: its requests' states and the four parts of a step (chapter 10).

    schedule   who prefills (chunks of prompts begun earlier, then arrived requests while rows,
               the token budget and pages allow: kvlab.serving.hf.prefill) and who decodes; one
               mixed_step maps their pages
    launch     build the inputs and hand the forward pass to the device (kvlab.serving.hf.overlap)
    advance    complete_step with the step's tokens *pending*: the lengths move past the step,
               so the next step can be scheduled before anyone has read this one's tokens
    process    wait for the tokens; record them (EOS / max_new_tokens end a request); cache the
               prompts whose last chunk this was; release the finished requests whose last
               step is done

Without overlap the order is ``schedule n, launch n, advance n, process n``: a step is
processed before the next is scheduled (mini-sglang's ``normal_loop``). With overlap it is
``schedule n+1, launch n+1, process n, advance n+1``: the device runs step n+1 while the host
reads and records step n (mini-sglang's ``overlap_loop``). Before each schedule, chapter 12's
memory policy may make room (:mod:`kvlab.serving.hf.room`); if it must stop requests, the step in
flight is processed first. A step's tokens reach the host one step late, so:

* a decoding request's next input token is read **on the device** (``last_tokens[row]``, which
  every step writes; mini-sglang keeps a whole ``token_pool`` per row and position), and the
  host keeps :data:`PENDING` in its place in ``req.input_ids`` until it reads the token;
* a request that reaches ``max_new_tokens`` in step n is known at once and never scheduled
  at n+1; one that produced EOS in step n was already scheduled at n+1 (its token there is
  dropped), and it is not scheduled at n+2;
* a finished request is released (``cache_req(finished=True)``: its pages go to the prefix
  cache and the free list, its row to the waiting requests) exactly once, when the **last
  step it is in has completed**. Here kvlab departs from mini-sglang, which frees a request
  finished by EOS as soon as it reads that token, while the step it rides in still runs
  (``_process_last_data``; it defers only aborts of requests in flight,
  ``_free_pending_aborts``), relying on its streams' order; kvlab holds the pages one step
  longer so that no step can read a page that a finished request gave back, whatever
  device runs it (a worker thread on a CPU: :class:`~kvlab.serving.hf.overlap.ThreadQueue`);
* a prompt is cached only after the step that computed its last chunk completed, and before
  the lengths move past the step in flight: the cache never holds K/V still being computed.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from .overlap import DeviceQueue, StepTimes
from .prefill import PrefillAdder, Seq
from .room import Room

__all__ = ["PENDING", "StepInfo", "Launched", "ServingLoop"]

#: the host's stand-in for a token still on the device (never a real token id)
PENDING = -1


class StepInfo(NamedTuple):
    """One step of the loop, for ``on_step``: which requests (prompt indices) did what."""

    index: int
    prefill: list[int]    # admitted in this step: their prompts (or a first chunk) were computed
    decode: list[int]     # running: one new token each
    tokens: int           # tokens in the step's forward pass
    chunks: list[int]     # computed a chunk of a prompt begun in an earlier step
    padded_to: int        # a decode step run at this captured batch size (0: a packed step)
    stopped: list[int] = ()   # stopped by the memory policy before this step (chapter 12)
    resumed: list[int] = ()   # swapped back in before this step


@dataclass(eq=False)
class Launched:
    """A step handed to the device and not yet processed."""

    index: int
    prefill: list[Seq]          # computing (a chunk of) their prompts
    decode: list[Seq]           # one new token each
    new: list[Seq]              # admitted in this step
    batch: object               # kvlab.manager.req.ForwardBatch
    produces: list[bool]        # per entry: the step gives it a token (not a chunk that goes on)
    padded_to: int = 0          # the captured batch size a decode-only step ran at
    stopped: list[int] = field(default_factory=list)   # the memory policy's doing before it
    resumed: list[int] = field(default_factory=list)
    ticket: object = None
    times: list[float] = field(default_factory=list)   # host: schedule, launch start / end

    @property
    def seqs(self) -> list[Seq]:
        return self.prefill + self.decode


class ServingLoop:
    """One call's requests, moved through the steps by :meth:`run` (see the module docstring).

    ``gen`` is the :class:`~kvlab.serving.hf.PagedGenerator`; it supplies the manager, the rows, and
    ``_launch_step`` (the device work of a step)."""

    def __init__(self, gen, seqs: Sequence[Seq], *, eos: frozenset, overlap: bool,
                 queue: DeviceQueue, output_logits: bool = False,
                 on_step: Callable | None = None, ends: Sequence | None = None):
        self.gen, self.manager = gen, gen.manager
        self.eos, self.overlap, self.queue = eos, overlap, queue
        self.ends = list(ends) if ends is not None else [None] * len(seqs)   # end_after
        self.output_logits, self.on_step = output_logits, on_step
        self.waiting: deque[Seq] = deque(sorted(seqs, key=lambda s: s.arrival))
        self.chunked: list[Seq] = []     # admitted; their prompts are computed chunk by chunk
        self.running: list[Seq] = []     # decoding: one token per step
        self.uncached: list[Seq] = []    # admitted; prompt not in the prefix cache yet
        self.free_rows = list(range(gen.max_running))
        self.steps = 0
        self.timeline: list[StepTimes] = []
        self.stats = dict(requests=len(seqs), prefill_computed=0, prefill_cached=0, generated=0,
                          steps=0, prefill_steps=0, decode_steps=0, graph_steps=0, chunks=0,
                          decode_tokens=0, deferred=0, most_running=0)
        self.room = Room(gen, gen.policy.start(), self.stats)   # the memory policy (chapter 12)
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        last: Launched | None = None       # overlap: the step launched in the last round
        while self.waiting or self.chunked or self.running or self.room.swapped or last is not None:
            if last is not None and self.room.needs_room(self.running, self.chunked):
                # memory pressure: the policy stops requests, which must not ride a step in
                # flight and must know all their tokens -- so that step is processed first
                self.process(last, in_flight=None)
                last = None
            admit_new = self.room.make_room(self.waiting, self.chunked, self.running, self.free_rows)
            if self.room.stopped:      # stopped requests' prompts are no longer being computed
                self.uncached = [s for s in self.uncached if not s.req.finished]
            step = self.schedule(admit_new)
            processed = last is not None
            if processed:
                self.process(last, in_flight=step)
                last = None
            if step is not None:
                self.advance(step)
                if self.overlap:
                    last = step
                else:
                    self.process(step, in_flight=None)
            elif not processed:
                self.idle()

    def idle(self) -> None:
        """Nothing runs and nothing can be admitted: wait for the next arrival."""
        if not self.waiting or self.waiting[0].arrival <= self.now():
            raise AssertionError("kvlab.serving.hf: no request could be admitted to an idle pool")
        time.sleep(max(0.0, self.waiting[0].arrival - self.now()))

    # --- schedule and launch ---------------------------------------------------------------

    def schedule(self, admit_new: bool = True) -> Launched | None:
        """Choose and map the next step, then launch it; None if nothing can run now.
        ``admit_new``: the memory policy lets waiting requests in this step."""
        t0 = self.now()
        room = self.room
        adder = PrefillAdder(self.manager, self.gen.prefill_budget, chunked=self.gen.chunked_prefill,
                             holding=self.running + self.chunked, policy=room.run, room=room,
                             step_pages=room.step_pages(self.running))
        new = self._admit(adder, admit_new)
        prefill = adder.added
        if not prefill and not self.running:
            return None
        decode = list(self.running)
        room.record_step(prefill + decode, decode + list(dict.fromkeys(self.chunked + prefill)))
        batch = self.manager.mixed_step([s.req for s in prefill], [s.req for s in decode])
        # who gets a token: running requests, and prompts (or comebacks) whose last chunk this is
        produces = [s.req.device_len == s.req.input_len for s in prefill] + [True] * len(decode)
        step = Launched(self.steps, prefill, decode, new, batch, produces, stopped=list(room.stopped),
                        resumed=list(room.resumed), times=[t0, self.now()])
        self.steps += 1
        step.ticket, step.padded_to = self.gen._launch_step(batch, produces, self.queue,
                                                             overlap=self.overlap,
                                                             output_logits=self.output_logits)
        step.times.append(self.now())
        return step

    def _admit(self, adder: PrefillAdder, admit_new: bool) -> list[Seq]:
        """Chunks of prompts begun earlier first (they keep their rows and handles), then the
        arrived requests in order while rows, the budget and pages last; returns the new ones."""
        for seq in self.chunked:
            if not adder.add_chunk(seq):
                break
        new: list[Seq] = []
        now = self.now()
        for seq in list(self.waiting) if admit_new else []:
            if seq.arrival > now:
                break
            verdict = adder.try_admit(seq, self.free_rows, self.uncached)
            if verdict == "full":
                break
            if verdict == "added":
                self.waiting.remove(seq)
                self.uncached.append(seq)
                new.append(seq)
                if not seq.stops:              # a comeback's work is counted by kvlab.serving.hf.room
                    self.stats["prefill_cached"] += seq.cached
                    self.stats["prefill_computed"] += len(seq.prompt) - seq.cached
        self.stats["deferred"] += adder.deferred
        return new

    # --- after the launch: the lengths move on ---------------------------------------------

    def advance(self, step: Launched) -> None:
        """The step's requests move past it (``complete_step`` with its tokens pending); who
        decodes in the next step: those it gave a token that may still produce one."""
        pending = [PENDING if p else None for p in step.produces]
        self.manager.complete_step(step.batch, pending, cache_prompt=False)
        for seq, produced in zip(step.seqs, step.produces):
            seq.produced += produced
        gave = {s for s, p in zip(step.seqs, step.produces) if p}
        # prompts still in chunks: those that ran a chunk, and those that got none this step
        self.chunked = [s for s in dict.fromkeys(self.chunked + step.prefill) if s not in gave]
        self.running = [s for s in step.seqs if s in gave and not s.finished_by and s.produced < s.max_new]
        self._count(step)

    def _count(self, step: Launched) -> None:
        st = self.stats
        st["steps"] += 1
        st["prefill_steps"] += bool(step.prefill)
        st["decode_steps"] += not step.prefill
        st["graph_steps"] += bool(step.padded_to)
        st["chunks"] += step.produces[:len(step.prefill)].count(False)   # prompts cut short
        st["decode_tokens"] += len(step.decode)
        st["most_running"] = max(st["most_running"], len(step.batch))

    # --- process: the tokens reach the host ------------------------------------------------

    def process(self, step: Launched, in_flight: Launched | None) -> None:
        """Wait for ``step``'s tokens and record them; cache the prompts it finished; release
        the finished requests that are not in ``in_flight`` (the step launched after it)."""
        t0 = self.now()
        tokens_t, logits_t = self.queue.result(step.ticket)
        step.times.append(self.now())
        tokens = iter(tokens_t.tolist())
        rows = iter(logits_t.float()) if logits_t is not None else None
        now = self.now()
        for entry, (seq, produced) in enumerate(zip(step.seqs, step.produces)):
            if not produced:
                continue
            token = next(tokens)
            row = next(rows) if rows is not None else None
            if seq.finished_by:      # it ended a step ago (EOS): this entry only rode along
                continue
            seq.req.input_ids[step.batch.end[entry]] = token     # PENDING until now
            seq.tokens.append(token)
            seq.times.append(now)
            seq.token_steps.append(step.index)
            if row is not None:
                seq.logits.append(row)
            if token in self.eos or len(seq.tokens) == seq.max_new:
                seq.finished_by = "eos" if token in self.eos else "length"
            elif len(seq.tokens) == self.ends[seq.index]:
                seq.finished_by = "stop"       # end_after: an end of text the scheduler could not foresee
        # prompts (or comebacks) whose last chunk this was join the prefix cache (a finished
        # one: at its release)
        for seq, produced in zip(step.prefill, step.produces):
            if produced and not seq.finished_by:
                self.manager.cache_req(seq.req, finished=False)
                if seq in self.uncached:
                    self.uncached.remove(seq)
        riding = set(in_flight.seqs) if in_flight is not None else set()
        for seq in step.seqs:
            if seq.finished_by and not seq.req.finished and seq not in riding:
                self.release(seq)
        self.running = [s for s in self.running if not s.finished_by]
        self._record(step, t0)

    def release(self, seq: Seq) -> None:
        """End a finished request: its computed pages to the prefix cache, the rest and its row
        back (its last step is done)."""
        self.manager.cache_req(seq.req, finished=True)
        self.free_rows.append(seq.req.table_idx)
        if seq in self.uncached:
            self.uncached.remove(seq)

    def _record(self, step: Launched, t0: float) -> None:
        if self.queue.timeline:
            start, end = self.queue.device_span(step.ticket)
            self.timeline.append(StepTimes(
                step.index, len(step.batch), step.batch.num_tokens, not step.prefill,
                (step.times[0], step.times[1]), (step.times[1], step.times[2]), (t0, self.now()),
                (start - self.t0, end - self.t0), step.times[3]))
        if self.on_step is not None:
            self.on_step(StepInfo(step.index, [s.index for s in step.new],
                                  [s.index for s in step.decode], step.batch.num_tokens,
                                  [s.index for s in step.prefill if s not in step.new],
                                  step.padded_to, step.stopped, step.resumed))
