"""Pictures of memory policies at work (chapter 12), drawn from plain data: a simulator run's
:class:`~kvlab.serving.sim.timeline.StepRecord` list, and rows of measured numbers.

* :func:`promised_memory` -- pages over time: in use (private and locked cached) and, hatched
  on top, the pages admission promised to running requests but no row maps yet;
* :func:`request_lanes` -- one lane per request: waiting, running, stopped and waiting again,
  swapped out; a stop is a ``v``, a comeback a ``^``;
* :func:`ratio_over_time` -- SGLang's ``new_token_ratio`` step by step;
* :func:`policy_bars` -- one measured number per policy and pool, per workload.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .dashboard import MEMORY_COLOURS

#: policy -> colour (kvlab.bench.memory_report uses the same)
POLICY_COLOURS = {"reserve": "#6a51a3", "recompute": "#e6550d", "retract": "#3182bd", "swap": "#31a354"}
LANE_COLOURS = {"waiting": "#d9d9d9", "running": "#9e9ac8", "stopped": "#fcbba1", "swapped": "#a1d99b"}


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def promised_memory(timeline, ax=None, *, title: str | None = None, legend: bool = True):
    """In-use pages per step, and the promised-but-unmapped pages hatched above them."""
    ax = _axes(ax, (6.6, 2.6))
    steps = np.arange(len(timeline))
    private = np.array([s.memory.private for s in timeline.steps])
    locked = np.array([s.memory.cached_locked for s in timeline.steps])
    promised = np.array([s.promised_pages for s in timeline.steps])
    ax.stackplot(steps, private, locked, colors=[MEMORY_COLOURS["private"], MEMORY_COLOURS["cached_locked"]],
                 labels=["private to a running request", "cached, locked by a request"], step="post")
    ax.fill_between(steps, private + locked, private + locked + promised, step="post", facecolor="none",
                    edgecolor="#54278f", hatch="////", lw=0.0, label="promised, not mapped yet")
    for s in timeline.steps:
        if s.preempted:
            ax.plot(s.step, timeline.num_pages * 0.97, "v", color="#cb181d", ms=5)
    ax.axhline(timeline.num_pages, color="black", lw=0.8)
    ax.set_xlim(0, max(len(timeline) - 1, 1))
    ax.set_ylim(0, timeline.num_pages * 1.05)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("pages", fontsize=8)
    ax.tick_params(labelsize=7)
    s = timeline.summary()
    ax.set_title(title or f"{timeline.policy}: {s.steps} steps, {s.mean_running:.1f} running at once, "
                 f"{s.preemptions} stopped", fontsize=9)
    if legend:
        from matplotlib.lines import Line2D

        handles = ax.get_legend_handles_labels()[0] + [
            Line2D([], [], marker="v", ls="", color="#cb181d", label="a request stopped")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return ax


def lanes(timeline) -> dict[int, list[str]]:
    """Per request, its state at the end of each step: ``""`` (not arrived or done),
    ``"waiting"``, ``"running"``, ``"stopped"`` (waiting again after a stop), ``"swapped"``."""
    out = {rid: [""] * len(timeline) for rid in timeline.requests}
    stopped: set[int] = set()
    for i, s in enumerate(timeline.steps):
        stopped |= set(s.preempted)
        stopped -= set(s.resumed) | set(s.swapped_in)
        for rid in s.waiting:
            out[rid][i] = "stopped" if rid in stopped else "waiting"
        for rid in s.swapped:
            out[rid][i] = "swapped"
        for rid in s.row_rids:
            if rid >= 0:
                out[rid][i] = "running"
    return out


def request_lanes(timeline, ax=None, *, rids: Sequence[int] | None = None, title: str | None = None):
    """One lane per request (``rids``: which ones): when it waits, runs, is stopped, swapped."""
    ax = _axes(ax, (6.6, 2.8))
    states = lanes(timeline)
    rids = list(rids if rids is not None else sorted(states))
    for y, rid in enumerate(rids):
        row = states[rid]
        for i, state in enumerate(row):
            if state:
                ax.barh(y, 1, left=i, height=0.8, color=LANE_COLOURS[state], lw=0)
    marks = {"v": [], "^": []}
    for s in timeline.steps:
        marks["v"] += [(s.step, rids.index(r)) for r in s.preempted if r in rids]
        marks["^"] += [(s.step, rids.index(r)) for r in set(s.resumed) | set(s.swapped_in) if r in rids]
    for m, pts in marks.items():
        if pts:
            ax.plot([p[0] + 0.5 for p in pts], [p[1] for p in pts], m, color="#cb181d" if m == "v" else "#006d2c", ms=5)
    ax.set_yticks(range(len(rids)), [f"req {r}" for r in rids], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, len(timeline))
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k if k != "stopped" else "waiting again (stopped)")
               for k, c in LANE_COLOURS.items()] + [
        Line2D([], [], marker="v", ls="", color="#cb181d", label="stopped"),
        Line2D([], [], marker="^", ls="", color="#006d2c", label="comes back")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or f"{timeline.policy}: who runs when", fontsize=9)
    return ax


def ratio_over_time(timelines, ax=None, *, title: str | None = None):
    """``new_token_ratio`` per step of each run in ``{label: timeline}``; stops marked."""
    ax = _axes(ax, (6.6, 2.2))
    for label, tl in timelines.items():
        line, = ax.plot(range(len(tl)), [s.ratio for s in tl.steps], lw=1.4, label=label)
        for s in tl.steps:
            if s.preempted:
                ax.plot(s.step, s.ratio, "v", color=line.get_color(), ms=5)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("new_token_ratio", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or "SGLang's estimate of what running requests will still need", fontsize=9)
    return ax


def policy_bars(rows, key: str, label: str, *, axes=None, pools: Sequence[str] | None = None):
    """``key`` of each row (``workload``, ``pool``, ``policy`` and the number), one panel per
    workload, bars grouped by pool."""
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    pools = list(pools or dict.fromkeys(r["pool"] for r in rows))
    policies = [p for p in POLICY_COLOURS if any(r["policy"] == p for r in rows)]
    if axes is None:
        _, axes = plt.subplots(1, len(workloads), figsize=(8.4, 2.4), squeeze=False, sharey=True)
        axes = axes[0]
    width = 0.8 / max(len(policies), 1)
    for ax, name in zip(axes, workloads):
        x = np.arange(len(pools))
        for k, policy in enumerate(policies):
            vals = [next((r[key] for r in rows if (r["workload"], r["pool"], r["policy"]) == (name, pool, policy)
                          and r.get(key) is not None), 0.0) for pool in pools]
            ax.bar(x + (k - (len(policies) - 1) / 2) * width, vals, width, color=POLICY_COLOURS[policy],
                   label=policy)
        ax.set_xticks(x, pools, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.set_title(name.replace("_", " "), fontsize=8)
    axes[0].set_ylabel(label, fontsize=8)
    axes[-1].legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return axes
