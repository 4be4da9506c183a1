"""How ``python -m kvlab.bench`` times things (chapter 09).

Three clocks, each for one question:

* :func:`first_call_ms`: one synchronised call, wall time: includes any compilation.
* :func:`median_us`: ``triton.testing.do_bench``'s median (CUDA events, L2 flushed between
  calls): the kernel's own time. It hides host time behind the flush, so it flatters paths
  that do not sync; the targets never use it.
* :func:`interleaved_loop_us`: the time per call of many back-to-back calls between two CUDA
  events, host launch overhead and syncs included -- what a caller in a loop sees. The paths
  of one case take turns, round by round, so drift lands on all of them alike. The targets
  use this one.

Without CUDA (a smoke run) every clock is ``perf_counter`` and nothing is a timing claim.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

import torch
import triton

from ..base import runtime

#: per-call-in-a-loop timing: back-to-back calls per timed block, and rounds per path
LOOP_CALLS, LOOP_ROUNDS = 50, 15
#: rounds run first and dropped (see :func:`interleaved_loop_us`): at least this many, for at
#: least this long
WARMUP_ROUNDS, WARMUP_S = 3, 0.3
#: smoke run: enough rounds to exercise the rotation, one call each (no timing claims)
SMOKE_LOOP_CALLS, SMOKE_LOOP_ROUNDS = 1, 3


def sync() -> None:
    if torch.cuda.is_available() and not runtime.INTERPRET:
        torch.cuda.synchronize()


def first_call_ms(fn: Callable[[], object]) -> float:
    """Wall time of one call, synchronised: includes any compilation it triggers."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def median_us(fn: Callable[[], object], smoke: bool) -> float:
    """Median time of one call in microseconds (CUDA events); on the CPU one timed call."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def host_us(fn: Callable[[], object], calls: int = 200, rounds: int = 7) -> float:
    """Host time per call (``perf_counter``), median over rounds: for host-only work."""
    fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return median(samples)


def time_block_us(fn: Callable[[], object], calls: int, smoke: bool) -> float:
    """Time per call of ``calls`` back-to-back calls of ``fn``: between two CUDA events recorded
    on an idle GPU (host launch overhead and any host syncs included), or ``perf_counter`` on
    the CPU (smoke)."""
    if smoke:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def rotation(names: list[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: ``names`` rotated left by it (a b c, b c a, c a b, ...)."""
    k = round_index % len(names) if names else 0
    return names[k:] + names[:k]


def median(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2]


def interleaved_loop_us(fns: dict[str, Callable[[], object]], smoke: bool, *,
                        calls: int | None = None, rounds: int | None = None,
                        resets: dict[str, Callable[[], object]] | None = None,
                        time_block: Callable[[Callable[[], object], int, bool], float] = time_block_us,
                        ) -> dict[str, dict]:
    """Per-call time in a loop of every path of one case, measured side by side::

        round 0: teaching fast fast_sync torch
        round 1: fast fast_sync torch teaching
        round 2: fast_sync torch teaching fast      ... each block: `calls` back-to-back calls

    On a GPU warm-up rounds (at least ``WARMUP_ROUNDS``, for at least ``WARMUP_S`` seconds) are
    run the same way first and dropped.
    ``resets[name]``, if given, runs (untimed) before each of that path's blocks: a path that
    consumes state (an allocator's free pages) starts every block from the same state.
    Returns ``{name: {"loop_us": median over rounds, "loop_rounds_us": [per round]}}``.
    One untimed call of each path comes first.
    """
    calls = calls or (SMOKE_LOOP_CALLS if smoke else LOOP_CALLS)
    rounds = rounds or (SMOKE_LOOP_ROUNDS if smoke else LOOP_ROUNDS)
    resets = resets or {}
    names = list(fns)
    for name in names:
        if name in resets:
            resets[name]()
        fns[name]()  # warm: nothing compiles or allocates for the first time inside a block
    samples: dict[str, list[float]] = {name: [] for name in names}
    # warm-up rounds, run the same way and dropped: after a pause (a compile, a new allocator)
    # the GPU's clocks take a while to come back up; at least WARMUP_ROUNDS, and WARMUP_S seconds
    t0, i, timed = time.perf_counter(), 0, 0
    while timed < rounds:
        warming = not smoke and (i < WARMUP_ROUNDS or time.perf_counter() - t0 < WARMUP_S)
        for name in rotation(names, i):
            if name in resets:
                resets[name]()
            us = time_block(fns[name], calls, smoke)
            if not warming:
                samples[name].append(us)
        timed += 0 if warming else 1
        i += 1
    return {name: {"loop_us": median(s), "loop_rounds_us": s} for name, s in samples.items()}


def loop_us(fn: Callable[[], object], smoke: bool, calls: int | None = None,
            rounds: int | None = None) -> float:
    """Per-call time in a loop of one path alone. To compare paths use :func:`interleaved_loop_us`."""
    return interleaved_loop_us({"path": fn}, smoke, calls=calls, rounds=rounds)["path"]["loop_us"]


def round_ratios(row: dict, num: str, den: str) -> list[float] | None:
    """Per-round ratios of two paths of a case: round i of ``num`` over round i of ``den``, which
    were timed next to each other (see :func:`interleaved_loop_us`); None if not measured."""
    a = row["paths"].get(num, {}).get("loop_rounds_us")
    b = row["paths"].get(den, {}).get("loop_rounds_us")
    if not a or not b or len(a) != len(b) or min(b) <= 0:
        return None
    return [x / y for x, y in zip(a, b)]


def count_syncs(fn: Callable[[], object]) -> int | None:
    """Device->host syncs one call of ``fn`` makes, as torch's sync debug mode reports them
    (None without CUDA)."""
    if not torch.cuda.is_available() or runtime.INTERPRET:
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing" in str(w.message) for w in caught)
