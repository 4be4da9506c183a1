"""The serving-loop simulator of chapter 07: workloads, a scheduler over the real
CacheManager, and the timeline it records (see :mod:`kvlab.sim.scheduler`)."""
from __future__ import annotations

from .scheduler import SimConfig, SimIntegrityError, Simulator, simulate  # noqa: F401
from .timeline import MemorySplit, RequestStats, SimSummary, StepRecord, Timeline  # noqa: F401
from .workloads import (WORKLOADS, RequestSpec, Workload, few_shot, make_workload, mixed,  # noqa: F401
                        multi_turn_chat, random_prompts, shared_system_prompt)
