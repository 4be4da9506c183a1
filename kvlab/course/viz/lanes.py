"""A serving loop's steps on two lanes: what the host did, and what the device ran (chapter 10).

Each step is a record of plain numbers (``kvlab.serving.hf.StepTimes`` as a dict: seconds on one
clock)::

    host    | schedule | launch |  wait for the tokens  | record |      (per step, in order)
    device  |          |        |######## forward ######|        |

Without overlap scheduling the host's bars and the device's never run at once; with it the
host schedules and launches step n+1 while the device still runs step n, and the device's
bars touch. :func:`draw_lanes` draws one run; :func:`lanes_figure` several, one above the other,
on the same time scale.
"""
from __future__ import annotations

from typing import Sequence

#: part of a step -> (colour, label)
PARTS = {"schedule": ("#6baed6", "host: schedule (admit, map pages)"),
         "launch": ("#fd8d3c", "host: launch (build inputs, hand over)"),
         "wait": ("#e0e0e0", "host: waiting for the step's tokens"),
         "record": ("#74c476", "host: record tokens, cache, release"),
         "device": ("#31a354", "device: forward pass")}


def _get(step, name):
    return step[name] if isinstance(step, dict) else getattr(step, name)


def window(steps: Sequence, count: int = 4, *, decode_only: bool = True) -> list:
    """``count`` consecutive steps from the middle of a run (decode-only ones if asked)."""
    pool = [s for s in steps if _get(s, "decode_only") or not decode_only] or list(steps)
    mid = max(0, len(pool) // 2 - count // 2)
    return pool[mid: mid + count]


def span(steps: Sequence) -> tuple[float, float]:
    """From the first step's planning to the last one's device end (seconds)."""
    return _get(steps[0], "schedule")[0], max(_get(s, "device")[1] for s in steps)


def draw_lanes(steps: Sequence, ax, *, title: str = "", start: float | None = None,
               scale: float = 1e3, label_steps: bool = True) -> float:
    """Draw ``steps`` on ``ax``: the host lane on top, the device lane below; time in ms from
    ``start`` (default: the first step's schedule; parts before it are cut off). Returns the
    last time drawn (ms)."""
    start = _get(steps[0], "schedule")[0] if start is None else start
    end = 0.0

    def bar(y, a, b, part, hatch=None):
        nonlocal end
        a, b = (a - start) * scale, (b - start) * scale
        end = max(end, b)
        ax.broken_barh([(a, max(b - a, 1e-6))], (y - 0.3, 0.6), facecolors=PARTS[part][0],
                       edgecolors="white", linewidth=0.5, hatch=hatch)

    for s in steps:
        sched, launch, proc, dev = (_get(s, k) for k in ("schedule", "launch", "process", "device"))
        got = s.get("tokens_at") if isinstance(s, dict) else getattr(s, "tokens_at", None)
        if not got:     # not recorded: the host had the tokens once the device step ended
            got = min(max(proc[0], dev[1]), proc[1])
        bar(1, *sched, "schedule")
        bar(1, *launch, "launch")
        if got and proc[0] <= got <= proc[1]:
            bar(1, proc[0], got, "wait")
            bar(1, got, proc[1], "record")
        else:
            bar(1, *proc, "record")
        bar(0, *dev, "device")
        if label_steps and dev[1] > start:
            mid = ((max(dev[0], start) + dev[1]) / 2 - start) * scale
            ax.text(mid, 0, f"step {_get(s, 'index')}", ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["device", "host"], fontsize=8)
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlabel("ms", fontsize=8)
    ax.tick_params(labelsize=7)
    if title:
        ax.set_title(title, fontsize=8, loc="left")
    return end


def lanes_figure(runs: dict, *, width: float = 8.4, suptitle: str = ""):
    """One two-lane panel per run, on one time scale. ``runs``: ``{title: (steps, (t0, t1))}``
    -- every step that meets the span ``[t0, t1]`` (seconds) is drawn, cut to it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(runs), 1, figsize=(width, 1.25 * len(runs) + 0.9), squeeze=False)
    longest = 0.0
    for (title, (steps, (t0, t1))), ax in zip(runs.items(), axes[:, 0]):
        shown = [s for s in steps if _get(s, "device")[1] >= t0 and _get(s, "schedule")[0] <= t1]
        draw_lanes(shown, ax, title=title, start=t0)
        longest = max(longest, (t1 - t0) * 1e3)
    for ax in axes[:, 0]:
        ax.set_xlim(0, longest * 1.02)
    handles = [Patch(facecolor=c, label=label) for c, label in PARTS.values()]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7, frameon=False)
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout(rect=(0, 0.12 if len(runs) > 1 else 0.2, 1, 1))
    return fig
