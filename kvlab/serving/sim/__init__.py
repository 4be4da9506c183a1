"""The serving-loop simulator of chapter 07: workloads, a scheduler over the real
CacheManager, and the timeline it records (see :mod:`kvlab.serving.sim.scheduler`).

    workloads, config, checks    what a run serves, its knobs, and the rules checked before it
    scheduler, timeline          the loop over CacheManager (07), and what each step records
    caches, compare              the prefix caches it runs on; two caches or policies side by
                                 side (11, 12)
    make_room                    the memory policy at work before each step (12)
"""
from __future__ import annotations

from .scheduler import SimConfig, SimIntegrityError, Simulator, simulate  # noqa: F401
from .timeline import MemorySplit, RequestStats, SimSummary, StepRecord, Timeline  # noqa: F401
from .workloads import (WORKLOADS, RequestSpec, Workload, few_shot, make_workload, mixed,  # noqa: F401
                        multi_turn_chat, random_prompts, shared_system_prompt)
