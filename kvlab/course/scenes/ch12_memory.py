"""Chapter 12's scenes and pictures: the four memory policies on the simulator, and the
measured rows of ``python -m kvlab.bench --memory`` when ``figures/bench.json`` holds them.

The workloads are the simulator's generators with the seed and sizes below (the benchmark runs
the same generators, larger, on a real model); page size 4; pools from
:data:`kvlab.serving.sim.compare.MEMORY_POOLS`. Every run is seeded and takes well under a second."""
from __future__ import annotations

import json
import os

from ...serving.sim import make_workload, simulate
from ...serving.sim.compare import compare_policies, memory_pools
from .figure_registry import figure

P = 4
#: the chapter's workloads: arguments of kvlab.serving.sim.make_workload (seed 0)
CHAPTER_WORKLOADS = {
    "eos_long_tail": dict(n_requests=32, prompt_len=(8, 32), max_new_tokens=64, tail=1.5, typical=6,
                          mean_gap=0.5),
    "long_prompt_burst": dict(n_short=6, n_long=6, prompt_len=(48, 96), output_len=(24, 48)),
    "shared_system_prompt": dict(n_requests=16, system_len=40, user_len=(4, 16), output_len=(8, 24),
                                 mean_gap=0.5),
}
POLICY_ORDER = ("reserve", "recompute", "retract", "swap")


def chapter_workload(name: str = "eos_long_tail"):
    return make_workload(name, seed=0, **CHAPTER_WORKLOADS[name])


def policy_run(policy, name: str = "eos_long_tail", pool: str = "tight", **config):
    """One simulator run of the chapter's workload ``name`` in ``pool`` with ``policy``."""
    w = chapter_workload(name)
    return simulate(w, page_size=P, num_pages=memory_pools(w, P)[pool], policy=policy, max_running=16,
                    **config)


def compared_rows():
    """Every workload x pool x policy on the simulator (kvlab.serving.sim.compare.compare_policies)."""
    from ...serving.sim import SimConfig

    return compare_policies([chapter_workload(n) for n in CHAPTER_WORKLOADS],
                            SimConfig(page_size=P, max_running=16), POLICY_ORDER)


def bench_rows(path: str | None = None):
    """The real model's rows from ``figures/bench.json`` (``None`` when it holds none), and
    what produced them."""
    path = path or os.path.join(os.path.dirname(__file__), "..", "..", "..", "figures", "bench.json")
    try:
        with open(path) as f:
            memory = json.load(f).get("memory")
    except (OSError, ValueError):
        return None
    if not memory or memory.get("smoke"):
        return None
    return memory


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
    fig, axes = plt.subplots(2, 3, figsize=(8.4, 4.4), sharey="row")
    policy_bars(rows, "tokens_per_step", "new tokens / step", axes=axes[0])
    policy_bars(rows, "mean_running", "running at once", axes=axes[1])
    for ax in axes[1]:
        ax.set_title("")
    axes[1][-1].get_legend().remove()
    fig.tight_layout()
    return fig
