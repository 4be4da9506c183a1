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
    """Draw one :class:`~kvlab.cache_manager.CacheRegions` as a bar; return the Axes.

    ``regions`` may also be any object with ``regions()`` (name -> (start, end)),
    ``finished``, ``page_size``, ``req_cached_len`` and optionally ``row_before``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    n = regions.req_cached_len
    P = regions.page_size
    if ax is None:
        _, ax = plt.subplots(figsize=(min(14, 1.5 + 0.42 * max(n, 4)), 1.6))
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
                        fontsize=fontsize - 1)
        if end > start and (end - start) * 0.42 > 0.5:
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
        handles = [Patch(fc=REGION_COLOURS[k], label=REGION_NAMES[k]) for k in REGION_COLOURS]
        handles.append(Patch(fc="white", ec="black", hatch="///", label="returned to free list"))
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=5,
                  fontsize=fontsize, frameon=False)
    return ax


def region_bars(items: Sequence[tuple[str, object]], *, title: str | None = None,
                fontsize: float = 7.5):
    """Several bars stacked (one per ``(label, regions)``), sharing one legend. Returns the Figure."""
    import matplotlib.pyplot as plt

    longest = max((r.req_cached_len for _, r in items), default=4)
    fig, ax = plt.subplots(figsize=(min(14, 2.5 + 0.42 * max(longest, 4)), 0.6 + 0.9 * len(items)))
    for i, (label, regions) in enumerate(items):
        region_bar(regions, ax, label=label, y=-1.4 * i, legend=(i == len(items) - 1),
                   fontsize=fontsize)
    ax.set_ylim(-1.4 * (len(items) - 1) - 0.2, 1.3)
    ax.set_xlim(-0.2, longest + 0.2)
    if title:
        ax.set_title(title, fontsize=fontsize + 2)
    fig.tight_layout()
    return fig
