"""Chapter 12's scenes and pictures: the four memory policies on the simulator, and the
measured rows of ``python -m kvlab.bench --memory`` when ``figures/bench.json`` holds them.

The workloads are the simulator's generators with the seed and sizes below (the benchmark runs
the same generators, larger, on a real model); page size 4; pools from
:data:`kvlab.serving.sim.compare.MEMORY_POOLS`. Every run is seeded and takes well under a second, and
is kept: the chapter's checks, tables and pictures share one run of each (workload, pool,
policy)."""
from __future__ import annotations

import json
import os

from ...serving.sim import make_workload, simulate
from ...serving.sim.compare import MEMORY_POOLS, memory_pools, policy_row
from .figure_registry import figure

P = 4
#: the chapter's workloads: arguments of kvlab.serving.sim.make_workload (seed 0)
CHAPTER_WORKLOADS = {
    "eos_long_tail": dict(n_requests=32, prompt_len=(8, 32), max_new_tokens=64, tail=1.5, typical=6,
                          mean_gap=0.5),
    "long_prompt_burst": dict(n_short=6, n_long=6, prompt_len=(48, 96), output_len=(24, 48)),
    "shared_system_prompt": dict(n_requests=16, system_len=40, user_len=(4, 16), output_len=(8, 24),
                                 mean_gap=0.5),
    "long_answers": dict(n_requests=24, prompt_len=(4, 12), max_new_tokens=32, at_least=0.9, mean_gap=0.25),
}
POLICY_ORDER = ("reserve", "recompute", "retract", "swap")


def chapter_workload(name: str = "eos_long_tail"):
    return make_workload(name, seed=0, **CHAPTER_WORKLOADS[name])


_RUNS: dict = {}   # (policy, workload, pool, config) -> Timeline: each run once per process


def policy_run(policy, name: str = "eos_long_tail", pool: str = "tight", **config):
    """One simulator run of the chapter's workload ``name`` in ``pool`` with ``policy`` (kept:
    the same arguments give the same run, which only reads)."""
    key = (policy, name, pool, tuple(sorted(config.items())))
    if key not in _RUNS:
        w = chapter_workload(name)
        _RUNS[key] = simulate(w, page_size=P, num_pages=memory_pools(w, P)[pool], policy=policy,
                              max_running=16, **config)
    return _RUNS[key]


def compared_rows():
    """Every workload x pool x policy on the simulator, as kvlab.serving.sim.compare.compare_policies
    gives them (from the kept runs)."""
    return [policy_row(chapter_workload(name), pool, policy_run(policy, name, pool))
            for name in CHAPTER_WORKLOADS for pool in MEMORY_POOLS for policy in POLICY_ORDER]


def bench_rows(path: str | None = None):
    """The real model's rows from ``figures/bench.json`` (``None`` when it holds none), and
    what produced them."""
    path = path or os.path.join(os.path.dirname(__file__), "..", "..", "figures", "bench.json")
    try:
        with open(path) as f:
            memory = json.load(f).get("memory")
    except (OSError, ValueError):
        return None
    if not memory or memory.get("smoke"):
        return None
    return memory


def host_full_stops(timeline) -> list[tuple[int, int, int]]:
    """``(step, request, host pages in use)`` of each stop of a swap run that went to the queue
    instead of host memory: the host pool had no room for it, so it was preempted by recompute."""
    return [(st.step, rid, st.host_pages) for st in timeline.steps for rid in st.preempted
            if rid not in st.swapped]


def tokens_order(bench: dict, workload: str, pool: str) -> list[tuple[str, float]]:
    """The policies of ``bench``'s rows for ``workload`` in ``pool``, fastest first, with their
    tokens/s (rows that failed or were skipped are left out)."""
    rows = [r for r in bench["rows"] if (r["workload"], r["pool"]) == (workload, pool) and "error" not in r]
    return sorted(((r["policy"], r["tokens_per_s"]) for r in rows), key=lambda pr: -pr[1])


def where_retract_sits(bench: dict, workload: str = "eos_long_tail", pool: str = "tight") -> str:
    """Where retract's tokens/s lands against reserve's and recompute's in the recorded run: the
    chapter's sentence, read from the rows (never written from memory)."""
    speed = dict(tokens_order(bench, workload, pool))
    if not {"reserve", "recompute", "retract"} <= set(speed):
        return f"{workload}, {pool} memory: the run holds no rows of reserve, recompute and retract"
    low, high = sorted(("reserve", "recompute"), key=speed.get)
    r = speed["retract"]
    place = (f"below both {low} and {high}" if r < speed[low] else f"above both {low} and {high}"
             if r > speed[high] else f"between {low} and {high}")
    return (f"{workload}, {pool} memory: retract served {r:.0f} tokens/s, {place} "
            f"(reserve {speed['reserve']:.0f}, recompute {speed['recompute']:.0f})")


def retraction_cost(bench: dict, workload: str = "long_answers", pool: str = "tight") -> str:
    """What retraction cost in the recorded run, where answers outran SGLang's estimate."""
    by = {r["policy"]: r for r in bench["rows"] if (r["workload"], r["pool"]) == (workload, pool)
          and "error" not in r}
    if not {"reserve", "recompute", "retract"} <= set(by):
        return f"{workload}, {pool} memory: the run holds no rows of reserve, recompute and retract"
    r = by["retract"]
    return (f"{workload}, {pool} memory: retract retracted {r.get('retractions', r['stops'])} time(s) and "
            f"computed {r['recomputed_tokens']} positions again; {r['tokens_per_s']:.0f} tokens/s against "
            f"reserve's {by['reserve']['tokens_per_s']:.0f} and recompute's {by['recompute']['tokens_per_s']:.0f}")


@figure("12_promised_pages.png")
def promised_pages_figure():
    """Reserve vs recompute on EOS-heavy answers, tight memory: pages in use, and promised."""
    import matplotlib.pyplot as plt

    from ..viz.policies import promised_memory

    runs = [policy_run("reserve"), policy_run("recompute")]
    fig, axes = plt.subplots(2, 1, figsize=(8.4, 4.4), sharex=True)
    promised_memory(runs[0], axes[0])
    promised_memory(runs[1], axes[1], legend=False)
    axes[1].set_xlim(0, max(map(len, runs)) - 1)       # one step axis for both runs
    axes[0].set_xlabel("")
    fig.tight_layout()
    return fig


@figure("12_leave_and_return.png")
def leave_and_return_figure():
    """Who runs when: a shared system prompt in tight memory, recompute and swap."""
    import matplotlib.pyplot as plt

    from ..viz.policies import request_lanes

    runs = [policy_run(p, "shared_system_prompt") for p in ("recompute", "swap")]
    fig, axes = plt.subplots(2, 1, figsize=(8.4, 5.6), sharex=True)
    for ax, tl in zip(axes, runs):
        request_lanes(tl, ax, rids=range(10))
    axes[0].set_xlabel("")
    axes[1].get_legend().remove()
    fig.tight_layout()
    return fig


@figure("12_policy_compare.png")
def policy_compare_figure(rows=None):
    """Tokens per step and requests running at once, every policy, workload and pool."""
    import matplotlib.pyplot as plt

    from ..viz.policies import policy_bars

    rows = rows or compared_rows()
    fig, axes = plt.subplots(2, len(CHAPTER_WORKLOADS), figsize=(8.4, 4.4), sharey="row")
    policy_bars(rows, "tokens_per_step", "new tokens / step", axes=axes[0])
    policy_bars(rows, "mean_running", "running at once", axes=axes[1])
    for ax in axes[1]:
        ax.set_title("")
    axes[1][-1].get_legend().remove()
    fig.tight_layout()
    return fig
