"""What the serving-loop simulator records (chapter 07): one :class:`StepRecord` per step.

Each record is a small, self-contained snapshot -- plain tensors and tuples, no live
objects -- so a timeline can be scrubbed, plotted and compared after the run:

    step k:  events (arrived, admitted, chunked, finished, aborted, preempted)
             page table   rows 0..max_running-1, columns up to the longest mapped position
             free list    page ids in free-list order
             memory       pages: free | cached (evictable) | cached (locked) | private
             cache tree   the prefix cache's snapshot(): a TreeSnapshot (radix, drawn by
                          kvlab.course.viz.draw_tree) or a HashSnapshot (chapter 11's hash cache)
             last cache_req regions (if any this step)
             pressure     (chapter 12) who was stopped, swapped back or resumed; pages promised
                          beyond what rows map; tokens computed again; tokens copied to and
                          from host memory; SGLang's new_token_ratio (retract)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["MemorySplit", "StepRecord", "RequestStats", "SimSummary", "Timeline", "percentile"]


class MemorySplit(NamedTuple):
    """Where every page is at the end of a step (they add up to ``num_pages``)."""

    free: int
    cached_evictable: int    # in the prefix cache, no running request uses it
    cached_locked: int       # in the prefix cache and locked by a running request
    private: int             # owned by one running request (not in the cache)

    @property
    def total(self) -> int:
        return self.free + self.cached_evictable + self.cached_locked + self.private

    @property
    def in_use(self) -> int:
        return self.cached_locked + self.private


@dataclass(frozen=True)
class StepRecord:
    step: int
    arrived: tuple[int, ...]
    admitted: tuple[int, ...]            # rids prefilled this step
    decoded: tuple[int, ...]             # rids that decoded one token this step
    finished: tuple[int, ...]
    aborted: tuple[int, ...]             # clients that gave up (released, nothing cached)
    preempted: tuple[int, ...]           # released to make room; re-queued
    waiting: tuple[int, ...]             # still queued after this step
    prefill_tokens: int                  # tokens whose KV was computed by this step's prefill
    hit_tokens: int                      # prompt tokens taken from the cache at admission
    prompt_tokens: int                   # prompt tokens of the admitted requests
    evicted_tokens: int                  # tokens evicted from the prefix cache this step
    memory: MemorySplit
    wasted_slots: int                    # allocated private slots past each request's device_len
    page_table: torch.Tensor             # [max_running, cols] int32 (cropped copy, on CPU)
    row_rids: tuple[int, ...]            # rid owning each row (-1: free row)
    free_pages: tuple[int, ...]          # free list, in order (page ids)
    tree: object                         # the prefix cache's snapshot() (TreeSnapshot or HashSnapshot)
    cache_evictable: int                 # size_info, in tokens
    cache_protected: int
    last_regions: object | None = None   # the latest kvlab.CacheRegions up to this step
    last_regions_rid: int = -1           # ... of which request
    last_regions_step: int = -1          # ... made at which step
    chunked: tuple[int, ...] = ()        # rids that computed a chunk of their prompt, not its end
    # chapter 12: what the memory policy did (kvlab.serving.pressure)
    swapped_in: tuple[int, ...] = ()     # brought back from host memory (restored into new pages)
    resumed: tuple[int, ...] = ()        # admitted again after a preemption or retraction
    swapped: tuple[int, ...] = ()        # waiting in host memory at the end of the step
    promised_pages: int = 0              # pages promised to running requests beyond what they map
    recomputed_tokens: int = 0           # positions computed again by this step's comebacks
    swap_out_tokens: int = 0             # positions copied to host memory
    swap_in_tokens: int = 0              # positions copied back
    host_pages: int = 0                  # host pages in use at the end of the step
    ratio: float | None = None           # new_token_ratio (retract), after this step


@dataclass
class RequestStats:
    rid: int
    tag: str
    prompt_len: int
    output_len: int
    arrival_step: int = -1
    first_admit_step: int = -1
    finish_step: int = -1
    hit_tokens: int = 0        # at its first admission
    preemptions: int = 0       # times it was stopped (preempted, retracted or swapped out)
    aborted: bool = False
    generated: int = 0
    max_new: int = 0           # the cap the scheduler knows (its output may end earlier: EOS)
    first_token_step: int = -1
    recomputed: int = 0        # positions computed again after its comebacks

    @property
    def ttft(self) -> int | None:
        """Steps from arrival to its first token, that step included."""
        return None if self.first_token_step < 0 else self.first_token_step - self.arrival_step + 1

    @property
    def tpot(self) -> float | None:
        """Steps per output token after the first (``None`` for a one-token answer)."""
        if self.finish_step < 0 or self.generated < 2:
            return None
        return (self.finish_step - self.first_token_step) / (self.generated - 1)


class SimSummary(NamedTuple):
    steps: int
    finished: int
    aborted: int
    preemptions: int
    prompt_tokens: int
    hit_tokens: int
    prefill_tokens: int
    evicted_tokens: int
    peak_in_use_pages: int
    mean_wasted_slots: float
    # chapter 12 (preemptions above counts every stop: preempted, retracted, swapped out)
    recomputed_tokens: int = 0
    swapped_tokens: int = 0         # positions copied to host memory
    mean_running: float = 0.0       # requests holding a row, per step
    mean_promised_pages: float = 0.0
    ttft_p50: float = 0.0           # steps, over the requests that produced a token
    ttft_p99: float = 0.0
    tpot_p50: float = 0.0
    tpot_p99: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _mean(values) -> float:
    return sum(values) / len(values) if values else 0.0


def percentile(values, q: float) -> float:
    """The ``q``-th percentile by nearest rank (0.0 for no values): p99 of 10 values is the largest."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return float(ordered[int(rank) - 1])


@dataclass
class Timeline:
    """Every step of one run, plus per-request statistics."""

    workload: str
    page_size: int
    num_pages: int
    max_running: int
    steps: list[StepRecord] = field(default_factory=list)
    requests: dict[int, RequestStats] = field(default_factory=dict)
    prefix_cache: str = "radix"          # which cache ran (kvlab.serving.sim.caches.PREFIX_CACHES)
    cache_ops: object = None             # kvlab.serving.sim.caches.CacheOpStats: calls and host time
    policy: str = "recompute"            # the memory policy's name (kvlab.serving.pressure)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> StepRecord:
        return self.steps[i]

    def series(self, name: str) -> list:
        """One field over time, e.g. ``series("hit_tokens")``."""
        return [getattr(s, name) for s in self.steps]

    def cumulative_hit_rate(self) -> list[float]:
        out, hit, total = [], 0, 0
        for s in self.steps:
            hit += s.hit_tokens
            total += s.prompt_tokens
            out.append(hit / total if total else 0.0)
        return out

    def summary(self) -> SimSummary:
        steps = self.steps
        ttft = [r.ttft for r in self.requests.values() if r.ttft is not None]
        tpot = [r.tpot for r in self.requests.values() if r.tpot is not None]
        return SimSummary(
            steps=len(steps),
            finished=sum(len(s.finished) for s in steps),
            aborted=sum(len(s.aborted) for s in steps),
            preemptions=sum(len(s.preempted) for s in steps),
            prompt_tokens=sum(s.prompt_tokens for s in steps),
            hit_tokens=sum(s.hit_tokens for s in steps),
            prefill_tokens=sum(s.prefill_tokens for s in steps),
            evicted_tokens=sum(s.evicted_tokens for s in steps),
            peak_in_use_pages=max((s.memory.in_use for s in steps), default=0),
            mean_wasted_slots=(sum(s.wasted_slots for s in steps) / len(steps)) if steps else 0.0,
            recomputed_tokens=sum(s.recomputed_tokens for s in steps),
            swapped_tokens=sum(s.swap_out_tokens for s in steps),
            mean_running=_mean([sum(r >= 0 for r in s.row_rids) for s in steps]),
            mean_promised_pages=_mean([s.promised_pages for s in steps]),
            ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
            tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99),
        )
