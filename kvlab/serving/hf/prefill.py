"""Who prefills in the next step, and how much of each prompt (chapter 10).

mini-sglang decides this in its ``PrefillAdder`` (``python/minisgl/scheduler/prefill.py``),
once per step, walking the waiting requests in order:

* **a token budget**: at most ``token_budget`` prompt tokens are computed per step
  (``max_extend_tokens``, 8192 by default in ``scheduler/config.py``); a request gets
  ``chunk_size = min(token_budget, remain_len)`` of what it still has to compute, and a
  request cut short (a ``ChunkedReq``) goes first in the next step, **keeping its page-table
  row and its locked cache handle** -- so one long prompt cannot stall the running decodes
  for a whole step of its own;
* **admission by memory**: a new request is admitted only if a page-table row is free and
  what it may still need (its uncached prompt and its whole answer) fits beside what the
  admitted ones may still need (``reserved_size``), counting evictable cached pages as free;
  the first that does not fit stops the walk.

kvlab counts the same reservation in pages: a request may still allocate
``div_ceil(prompt + max_new_tokens - 1, P)`` pages minus those its row maps now (the last
new token's K/V is never computed), so no step can run out of pages half-way.

kvlab adds one rule of its own (SGLang's in-batch prefix sharing): a prompt that shares whole
pages with a prompt still being computed (admitted this step, or in chunks) waits until that
prompt's pages are in the prefix cache, then reads them from there instead of computing them
again. It steps aside for the requests behind it rather than stopping the walk.

Chapter 12 makes the reservation a policy (:mod:`kvlab.serving.pressure`): what a request that holds
a row may still take is ``policy.promised_pages`` -- its whole answer (``"reserve"``, the rule
above), an estimate (``"retract"``), or only the coming step (``"recompute"``, ``"swap"``). A
policy that promises less can run short later, so each step's chunks and newcomers must also
fit in the pages that are really left this step, after the running requests' next token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ...base.args import div_ceil
from ..pressure import PolicyRun, RequestView, ReserveWhole

__all__ = ["Seq", "PrefillAdder", "shared_pages", "request_view"]


@dataclass(eq=False)
class Seq:
    """One prompt's journey through the serving loop."""

    index: int
    prompt: list[int]
    max_new: int = 1              # new tokens it may produce (its max_new_tokens)
    arrival: float = 0.0          # seconds after the call began when it may be admitted
    req: object = None            # kvlab.Req while admitted
    cached: int = 0               # prompt tokens found in the prefix cache at admission
    produced: int = 0             # tokens its steps produced, those still on the way included
    tokens: list[int] = field(default_factory=list)     # the tokens the host has read back
    times: list[float] = field(default_factory=list)    # when each reached the host (s)
    logits: list[torch.Tensor] = field(default_factory=list)
    finished_by: str = ""
    # chapter 12: a request stopped to make room, and brought back (kvlab.serving.hf.room)
    admitted: int = -1            # admission order (a comeback is a new admission)
    stops: int = 0                # times it was preempted, retracted or swapped out
    saved: int = 0                # positions it had computed when it last stopped
    recomputed: int = 0           # positions computed again after its comebacks
    host_pages: list[int] = field(default_factory=list)   # swapped out: where its K/V waits
    token_steps: list[int] = field(default_factory=list)  # the step that produced each token

    @property
    def input_ids(self) -> list[int]:
        """What its row holds: the prompt and every token generated so far."""
        return self.prompt + self.tokens

    @property
    def remain(self) -> int:
        """Input tokens whose K/V is still to be computed (the prompt's, or a comeback's)."""
        return self.req.input_len - self.req.cached_len


def request_view(seq: Seq, manager) -> RequestView:
    """What a memory policy reads of ``seq`` (its tokens still on the way counted: with overlap
    scheduling the host reads a step's tokens one step late)."""
    return RequestView(seq, len(seq.prompt), seq.produced, seq.max_new, seq.req.device_len,
                       manager.allocated_pages(seq.req), seq.admitted, seq.index)


def shared_pages(a: Sequence[int], b: Sequence[int], page_size: int) -> int:
    """Tokens of the whole pages ``a`` and ``b`` start with in common (list slices compare at
    C speed: a binary search over the number of pages, not a loop over tokens)."""
    lo, hi = 0, min(len(a), len(b)) // page_size
    if hi and a[:page_size] != b[:page_size]:     # most pairs differ from their first page on
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * page_size] == b[:mid * page_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo * page_size


class PrefillAdder:
    """One step's prefill plan: chunks of running prompts first, then new requests while a
    row, the token budget and memory allow. ``chunked=False``: no chunks -- the budget then
    bounds whole prompts, and the first prompt of a step always goes whole. ``policy``: what
    requests that hold a row are promised (default: their whole answer); ``step_pages``: the
    pages the running requests' next tokens take in this step."""

    def __init__(self, manager, token_budget: int, *, chunked: bool, holding: Sequence[Seq],
                 policy: PolicyRun | None = None, step_pages: int = 0, room=None):
        self.manager = manager
        self.P = manager.page_size
        self.token_budget = token_budget
        self.chunked = chunked
        self.run = policy if policy is not None else ReserveWhole().start()
        self.room = room              # kvlab.serving.hf.room.Room: told of each admission
        # pages the requests holding rows (``holding``), and those admitted now, may still take
        self.reserved = sum(self.run.promised_pages(self.view(s), self.P) for s in holding)
        self.step_used = step_pages   # pages this step maps so far (running requests first)
        self.added: list[Seq] = []   # this step's prefills, in order
        self.deferred = 0

    def view(self, seq: Seq) -> RequestView:
        return request_view(seq, self.manager)

    def _chunk(self, seq: Seq) -> int:
        """Tokens ``seq`` computes this step: the rest of its input, or with chunked prefill at
        most the budget left; a policy that promised only the coming step also cuts it to the
        pages really left (a whole prompt goes whole or not at all)."""
        chunk = seq.remain if not self.chunked else min(self.token_budget, seq.remain)
        if self.run.policy.preempts:
            room = self.manager.available_pages - self.step_used
            fits = (self.manager.allocated_pages(seq.req) + room) * self.P - seq.req.cached_len
            chunk = min(chunk, fits) if self.chunked else (chunk if chunk <= fits else 0)
        return chunk

    def _take(self, seq: Seq, chunk: int) -> bool:
        """Give ``seq`` its chunk of this step's budget: ``req.device_len`` marks its end."""
        if chunk <= 0 or (not self.chunked and self.added and chunk > self.token_budget):
            return False
        self.token_budget -= chunk
        seq.req.device_len = seq.req.cached_len + chunk
        self.step_used += div_ceil(seq.req.device_len, self.P) - self.manager.allocated_pages(seq.req)
        self.added.append(seq)
        return True

    def add_chunk(self, seq: Seq) -> bool:
        """The next chunk of a prompt admitted earlier (its row and handle are kept)."""
        return self._take(seq, self._chunk(seq))

    def try_admit(self, seq: Seq, free_rows: list[int], computing: Sequence[Seq]) -> str:
        """Admit ``seq`` if a row, the budget and memory allow: ``"added"``; ``"wait"``: it
        shares whole pages with a prompt still being computed (the walk goes on);
        ``"full"``: no room (the walk stops). ``computing``: prompts not yet cached."""
        from ...manager.req import Req

        if not free_rows or self.token_budget <= 0:
            return "full"
        ids = seq.input_ids
        req = Req(list(ids), table_idx=free_rows[0])
        hit = self.manager.match_req(req).handle.cached_len      # ids[:-1] in the radix cache
        shared = max((shared_pages(ids[:-1], other.input_ids, self.P)
                      for other in list(computing) + self.added), default=0)
        if shared > hit:
            self.deferred += 1
            return "wait"
        seq.req = req
        self.manager.admit(req)           # match + lock the hit + map it into the row
        chunk = self._chunk(seq)
        req.device_len = req.cached_len + max(chunk, 0)
        need = self.run.promised_pages(self.view(seq), self.P, new=True)
        step = div_ceil(req.device_len, self.P) - self.manager.allocated_pages(req)
        if (self.reserved + need > self.manager.available_pages
                or self.step_used + step > self.manager.available_pages or not self._take(seq, chunk)):
            self.manager.release_req(req)   # not now: rows, pages and locks as before
            seq.req = None
            return "full"
        self.reserved += need
        if seq.stops == 0:
            seq.cached = req.cached_len
        free_rows.pop(0)
        if self.room is not None:
            self.room.admitted(seq)
        return "added"
