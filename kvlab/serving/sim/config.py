"""The knobs of a simulator run (chapters 07, 11, 12): :class:`SimConfig`.

Checked field by field before a run starts (:mod:`kvlab.serving.sim.checks`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..pressure import CHAPTER_07

__all__ = ["SimConfig"]


@dataclass(frozen=True)
class SimConfig:
    """Knobs of a run. ``max_seq_len=None`` sizes the page table for the workload's longest request."""

    page_size: int = 16
    num_pages: int = 24
    max_running: int = 4
    prefill_budget: int = 128
    max_seq_len: int | None = None
    cache_after_prefill: bool = True     # cache_req(finished=False) right after prefill
    chunked_prefill: bool = False        # cut prompts into chunks of the budget left in a step
    remap_duplicates: bool = True        # False: the source design's stale row (caught by checks)
    page_table_writer: str = "host"      # "host" scatter (no kernel launch: fast in the interpreter) or "triton"
    max_steps: int = 5000
    prefix_cache: str = "radix"          # or "hash" / "hash_uncached_first" (chapter 11; kvlab.serving.sim.caches)
    policy: object = CHAPTER_07          # what to do when memory runs out (chapter 12): a name of
                                         # kvlab.serving.pressure.POLICIES or a kvlab.serving.pressure.Policy
