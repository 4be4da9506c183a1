"""Region bars for ``cache_req`` (chapter 06): the four regions of ``[0, req.cached_len)``.

One bar per call, one cell per token position, coloured by region, with page boundaries
and (for small requests) the physical slot each position mapped before the call::

    position  0   1   2   3 | 4   5   6   7 | 8   9
              [ hit         | duplicate     | tail  ]      P = 4
    slot      12  13  14  15| 20  21  22  23| 8   9
                              ^ freed: another request cached these tokens first

Freed positions are hatched; a tail kept by an unfinished request is not.
"""
from __future__ import annotations

from typing import Sequence

from .legibility import MAX_WIDTH_IN

REGION_COLOURS = {
    "hit": "#74c476",  # in the cache before the prefill
    "duplicate": "#fb6a4a",  # computed here, cached meanwhile by another request: freed
    "inserted": "#6baed6",  # newly inserted into the cache by this request
    "tail": "#fdd0a2",  # not a whole page: freed when finished, kept otherwise
}
REGION_NAMES = {
    "hit": "hit (cached before)",
    "duplicate": "duplicate (freed)",
    "inserted": "newly inserted",
    "tail": "tail (partial page)",
}


def region_bar(regions, ax=None, *, label: str | None = None, y: float = 0.0,
               show_slots: bool | None = None, legend: bool = True, fontsize: float = 7.5):
    """Draw one :class:`~kvlab.manager.cache_manager.CacheRegions` as a bar; return the Axes.

    ``regions`` may also be any object with ``regions()`` (name -> (start, end)),
    ``finished``, ``page_size``, ``req_cached_len`` and optionally ``row_before``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = regions.req_cached_len
    P = regions.page_size
    if ax is None:
        _, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, 1.5 + 0.42 * max(n, 4)), 1.6))
    if show_slots is None:
        show_slots = n <= 40
    row = getattr(regions, "row_before", None)
    slots = row.tolist() if row is not None else None
    for name, (start, end) in regions.regions().items():
        freed = name == "duplicate" or (name == "tail" and regions.finished)
        for pos in range(start, end):
            ax.add_patch(Rectangle((pos, y), 1, 0.8, fc=REGION_COLOURS[name], ec="white", lw=0.5,
                                   hatch="///" if freed else None))
            if show_slots and slots is not None:
                ax.text(pos + 0.5, y + 0.4, str(slots[pos]), ha="center", va="center",
                        fontsize=max(7.0, fontsize - 1))
        # a name goes above its region when it fits (cells are ~0.42 inch = ~30 pt wide)
        if end > start and (end - start) * 30 >= len(name) * fontsize * 0.6:
            ax.text((start + end) / 2, y + 0.95, name, ha="center", va="bottom", fontsize=fontsize)
    for b in range(0, n + 1, P):  # page boundaries
        ax.plot([b, b], [y - 0.05, y + 0.85], color="black", lw=1.2 if P > 1 else 0.4)
    if label is not None:
        ax.text(-0.3, y + 0.4, label, ha="right", va="center", fontsize=fontsize)
    ax.set_xlim(-0.2, max(n, 1) + 0.2)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("token position" + (" (numbers: slot mapped before cache_req)" if show_slots else ""),
                  fontsize=fontsize)
    ax.tick_params(labelsize=fontsize)
    if legend:
        ax.legend(handles=region_legend_handles(), loc="upper center", bbox_to_anchor=(0.5, -0.45),
                  ncol=5, fontsize=fontsize, frameon=False)
    return ax


def region_legend_handles():
    from matplotlib.patches import Patch

    handles = [Patch(fc=REGION_COLOURS[k], label=REGION_NAMES[k]) for k in REGION_COLOURS]
    handles.append(Patch(fc="white", ec="black", hatch="///", label="returned to free list"))
    return handles


def region_bars(items: Sequence[tuple[str, object]], *, title: str | None = None,
                fontsize: float = 7.5):
    """Several bars stacked (one per ``(label, regions)``), sharing one legend. Returns the Figure."""
    import matplotlib.pyplot as plt

    longest = max((r.req_cached_len for _, r in items), default=4)
    fig, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, 2.5 + 0.42 * max(longest, 4)), 1.2 + 0.8 * len(items)))
    for i, (label, regions) in enumerate(items):
        region_bar(regions, ax, label=label, y=-1.4 * i, legend=False, fontsize=fontsize)
    ax.set_ylim(-1.4 * (len(items) - 1) - 0.2, 1.3)
    ax.set_xlim(-0.2, longest + 0.2)
    if title:
        ax.set_title(title, fontsize=fontsize + 2)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.legend(handles=region_legend_handles(), loc="lower center", ncol=5, fontsize=fontsize,
               frameon=False)
    return fig


def page_owner_strip(manager, ax=None, *, title: str | None = None, fontsize: float = 7.5):
    """One cell per physical page, coloured by where it is: free, in the prefix cache
    (locked or evictable), or held by a running request's row. Pages found in no place or
    in two places (a broken manager) are outlined in red. Returns the Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    owners = manager.page_owners()
    locked_nodes = {f"cache node {n.uid}" for n in manager.prefix_cache.nodes() if n.ref_count > 0}
    rows = sorted({w for who in owners.values() for w in who if w.startswith("row ")})
    row_colours = ["#9e9ac8", "#fd8d3c", "#e377c2", "#8c6d31", "#17becf", "#bcbd22", "#7f7f7f",
                   "#393b79"]
    colour = {"free": "#f0f0f0"}
    for i, r in enumerate(rows):
        colour[r] = row_colours[i % len(row_colours)]
    n = len(owners)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, 1.5 + 0.35 * n), 1.3))
    for page, who in sorted(owners.items()):
        if len(who) == 1:
            w = who[0]
            fc = colour.get(w, "#fdae6b" if w in locked_nodes else "#c6dbef")
            ec, lw = "white", 0.8
        else:
            fc, ec, lw = "white", "#d62728", 2.0
        ax.add_patch(Rectangle((page, 0), 1, 1, fc=fc, ec=ec, lw=lw))
        if n <= 48:
            ax.text(page + 0.5, 0.5, str(page), ha="center", va="center", fontsize=max(7.0, fontsize - 1))
    ax.set_xlim(0, n)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xticks([])
    for side in ("left", "right", "top", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [Patch(fc="#f0f0f0", label="free"), Patch(fc="#c6dbef", label="cached, evictable"),
               Patch(fc="#fdae6b", label="cached, locked")]
    handles += [Patch(fc=colour[r], label=f"own pages of {r}") for r in rows]
    handles.append(Patch(fc="white", ec="#d62728", lw=2, label="lost / owned twice"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.05), ncol=min(6, len(handles)),
              fontsize=fontsize, frameon=False)
    ax.set_title(title or f"where each of the {n} pages is", fontsize=fontsize + 1)
    return ax
