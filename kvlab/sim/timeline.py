"""What the serving-loop simulator records (chapter 07): one :class:`StepRecord` per step.

Each record is a small, self-contained snapshot -- plain tensors and tuples, no live
objects -- so a timeline can be scrubbed, plotted and compared after the run:

    step k:  events (arrived, admitted, chunked, finished, aborted, preempted)
             page table   rows 0..max_running-1, columns up to the longest mapped position
             free list    page ids in free-list order
             memory       pages: free | cached (evictable) | cached (locked) | private
             cache tree   the prefix cache's snapshot(): a TreeSnapshot (radix, drawn by
                          kvlab.viz.draw_tree) or a HashSnapshot (chapter 11's hash cache)
             last cache_req regions (if any this step)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["MemorySplit", "StepRecord", "RequestStats", "SimSummary", "Timeline"]


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
    preemptions: int = 0
    aborted: bool = False
    generated: int = 0


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

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Timeline:
    """Every step of one run, plus per-request statistics."""

    workload: str
    page_size: int
    num_pages: int
    max_running: int
    steps: list[StepRecord] = field(default_factory=list)
    requests: dict[int, RequestStats] = field(default_factory=dict)
    prefix_cache: str = "radix"          # which cache ran (kvlab.sim.caches.PREFIX_CACHES)
    cache_ops: object = None             # kvlab.sim.caches.CacheOpStats: calls and host time

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
        )
