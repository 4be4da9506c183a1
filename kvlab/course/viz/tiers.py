"""Pictures of the KV hierarchy (chapter 13), drawn from plain data.

* :func:`draw_tier_tree` -- the radix tree coloured by where each node's KV lives: on the device
  only (dirty: no copy below), on the device with a host copy (clean), in host memory only; a
  thick border for a locked node, hatching for host pages a load-back reads (pinned)::

        root ── [dev+host] ── [dev] ── [host] ── [host]
                     └── [host]

* :func:`draw_copy_timeline` -- a few steps on three lanes (the compute stream, the copy stream
  to the device, the one from it): a load-back crossing the link while another request decodes;
* :func:`draw_hit_curves` -- prefix hit rate against the device pool's size, one line per
  hierarchy (GPU only, + host, + host + disk), and the unbounded cache's as a ceiling.

Every figure is at most 8.4 in wide, its text at least 7 pt.
"""
from __future__ import annotations

from typing import Sequence

#: where a node's KV lives -> (fill colour, legend)
TIER_COLOURS = {
    "dirty": ("#fdae6b", "device only (dirty: no copy below)"),
    "clean": ("#9ecae1", "device + host copy (clean)"),
    "host": ("#c7e9c0", "host memory only"),
}
LANE_COLOURS = {"compute": "#9e9ac8", "prefill": "#6a51a3", "h2d": "#31a354", "d2h": "#e6550d"}


def tier_of(node) -> str:
    if node.device_pages:
        return "clean" if node.host_pages else "dirty"
    return "host"


def _layout(nodes) -> dict:
    """uid -> (x, depth): leaves left to right, each parent above the middle of its children."""
    kids: dict = {}
    for n in nodes:
        kids.setdefault(n.parent, []).append(n)
    for v in kids.values():
        v.sort(key=lambda n: n.uid)
    pos, next_x = {}, [0.0]

    def place(n, depth):
        children = kids.get(n.uid, [])
        for c in children:
            place(c, depth + 1)
        if children:
            x = sum(pos[c.uid][0] for c in children) / len(children)
        else:
            x, next_x[0] = next_x[0], next_x[0] + 1.0
        pos[n.uid] = (x, depth)

    for root_child in kids.get(None, []):
        place(root_child, 1)
    return pos


def _label(n, page_size: int | None) -> str:
    head = f"node {n.uid} · {n.num_pages} page{'s' if n.num_pages != 1 else ''}"
    if n.pages and page_size:
        first = " ".join(str(t) for t in n.pages[0][:4]) + (" …" if len(n.pages[0]) > 4 or n.num_pages > 1 else "")
        head += f"\n[{first}]"
    parts = []
    if n.device_pages:
        parts.append("dev " + ",".join(map(str, n.device_pages[:3])) + ("…" if len(n.device_pages) > 3 else ""))
    if n.host_pages:
        parts.append("host " + ",".join(map(str, n.host_pages[:3])) + ("…" if len(n.host_pages) > 3 else ""))
    return head + "\n" + " · ".join(parts)


def draw_tier_tree(nodes: Sequence, ax=None, *, title: str = "", page_size: int | None = None,
                   legend: bool = True):
    """The tiered tree (``nodes``: :class:`~kvlab.prefix.tier_plans.TierNode` records)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    pos = _layout(nodes)
    width = max([x for x, _ in pos.values()] + [0]) + 1
    depth = max([d for _, d in pos.values()] + [1])
    if ax is None:
        _, ax = plt.subplots(figsize=(min(8.4, 1.6 + 1.35 * width), 0.6 + 0.95 * depth))
    by = {n.uid: n for n in nodes}
    for n in nodes:
        x, d = pos[n.uid]
        px, pd = (pos[n.parent] if n.parent is not None else ((width - 1) / 2, 0))
        ax.plot([px, x], [-pd, -d], color="#969696", lw=0.8, zorder=1)
    ax.plot([(width - 1) / 2], [0], "o", color="black", ms=4, zorder=3)
    ax.text((width - 1) / 2, 0.18, "root", ha="center", fontsize=7)
    for uid, (x, d) in pos.items():
        n = by[uid]
        fill = TIER_COLOURS[tier_of(n)][0]
        box = FancyBboxPatch((x - 0.45, -d - 0.3), 0.9, 0.6, boxstyle="round,pad=0.02", fc=fill,
                             ec="black", lw=2.2 if n.ref_count else 0.7, hatch="///" if n.pinned else None,
                             zorder=2)
        ax.add_patch(box)
        ax.text(x, -d, _label(n, page_size), ha="center", va="center", fontsize=7, zorder=4)
    ax.set_xlim(-0.6, width - 0.4)
    ax.set_ylim(-depth - 0.45, 0.45)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=9)
    if legend:
        handles = [Patch(fc=c, ec="black", lw=0.7, label=t) for c, t in TIER_COLOURS.values()]
        handles += [Patch(fc="white", ec="black", lw=2.2, label="locked by a running request"),
                    Patch(fc="white", ec="black", hatch="///", label="host pages a load-back reads")]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7,
                  frameon=False)
    return ax


def draw_copy_timeline(spans: Sequence[tuple[str, str, float, float]], ax=None, *, title: str = ""):
    """``spans``: ``(lane, label, start, end)`` in milliseconds; lanes ``"compute"``, ``"h2d"``
    (the copy stream to the device) and ``"d2h"`` (from it). A span labelled ``prefill ...`` on
    the compute lane is drawn darker."""
    import matplotlib.pyplot as plt

    lanes = ["d2h", "h2d", "compute"]
    names = {"compute": "compute stream", "h2d": "copy stream: host -> device", "d2h": "copy stream: device -> host"}
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 2.2))
    for lane, label, start, end in spans:
        y = lanes.index(lane)
        colour = LANE_COLOURS["prefill" if label.startswith("prefill") else lane]
        ax.barh(y, end - start, left=start, height=0.6, color=colour, edgecolor="black", lw=0.5)
        ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=7,
                color="white" if colour in ("#6a51a3", "#e6550d") else "black")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([names[x] for x in lanes], fontsize=7)
    ax.set_xlabel("time (ms)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


#: hierarchy -> colour of its line
CURVE_COLOURS = {"GPU only": "#6a51a3", "+ host": "#31a354", "+ host + disk": "#e6550d", "unbounded": "#636363"}


def draw_hit_curves(rows: Sequence[dict], ax=None, *, title: str = "", key: str = "hit"):
    """``rows``: dicts with ``config`` (a name of :data:`CURVE_COLOURS`), ``device_pages`` and
    ``key`` (a share of the prompt tokens found cached)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.0))
    for name, colour in CURVE_COLOURS.items():
        pts = sorted((r["device_pages"], r[key]) for r in rows if r["config"] == name)
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, [100 * y for y in ys], "o-" if name != "unbounded" else "--", color=colour, label=name,
                ms=3.5, lw=1.4)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("device pool (pages)", fontsize=8)
    ax.set_ylabel("prompt tokens found cached (%)", fontsize=8)
    ax.set_ylim(0, 100)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
