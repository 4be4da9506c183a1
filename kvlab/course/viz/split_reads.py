"""Which program reads which pages in decode attention (chapter 09).

Two pictures of the same requests, drawn from plain data (each position's physical page, and
each program's range of positions)::

    chapter 08: one program per (request, query head)   chapter 09: one per (request, K/V head, split)
    (A, h0)  [ p7 p7 p7 p7 | p2 p2 p2 p2 | p9 .. ]       A  [ s0 s0 s0 s0 | s0 s0 s0 s0 | s1 s1 .. ]
    (A, h1)  [ p7 p7 p7 p7 | p2 p2 p2 p2 | p9 .. ]       B  [ s0 s0 s0 | .. ]
    ...  every K/V page read by each query head          every K/V page read once, for the group

Cells are positions; thick lines are page boundaries (the physical page above each page),
dashed lines block boundaries; colour is the program that reads the position.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from .legibility import MAX_WIDTH_IN

_SPLIT_COLOURS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"]
_HEAD_COLOUR = "#c0504d"


class SplitReads(NamedTuple):
    """What the picture shows, as plain data."""

    names: Sequence[str]                       # each request's name
    pages: Sequence[Sequence[int]]             # request -> physical page of each position
    spans: Sequence[Sequence[tuple[int, int]]]  # request -> [start, end) of each live split
    num_splits: int
    page_size: int
    block_n: int
    group: int                                 # query heads per K/V head


def _row(ax, y: float, pages: Sequence[int], page_size: int, block_n: int, colour_of, label: str,
         show_pages: bool) -> None:
    from matplotlib.patches import Rectangle

    n = len(pages)
    for t in range(n):
        ax.add_patch(Rectangle((t, y), 1, 0.8, facecolor=colour_of(t), edgecolor="white", lw=0.5))
    for t in range(0, n + 1):
        if t % page_size == 0 or t == n:
            ax.plot([t, t], [y - 0.05, y + 0.85], color="black", lw=1.6)
        elif t % block_n == 0:
            ax.plot([t, t], [y - 0.05, y + 0.85], color="black", lw=0.9, ls="--")
        if show_pages and t % page_size == 0 and t < n:
            ax.text(t + min(page_size, n - t) / 2, y + 0.4, f"p{pages[t]}", ha="center", va="center",
                    fontsize=7, color="white", fontweight="bold")
    ax.text(-0.6, y + 0.4, label, ha="right", va="center", fontsize=8)


def draw_split_reads(plan: SplitReads, *, first: int = 0):
    """The two panels: chapter 08's programs on request ``first`` (one per query head of a
    group), chapter 09's on every request (one per split, the group's heads together)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    longest = max(len(p) for p in plan.pages)
    rows_top, rows_bottom = plan.group, len(plan.pages)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(min(MAX_WIDTH_IN, 8.4), 1.2 + 0.42 * (rows_top + rows_bottom) + 1.2),
                                      gridspec_kw={"height_ratios": [rows_top + 0.8, rows_bottom + 1.6]})
    name = plan.names[first]
    for h in range(plan.group):
        _row(top, rows_top - 1 - h, plan.pages[first], plan.page_size, plan.block_n,
             lambda t: _HEAD_COLOUR, f"({name}, query head {h})", show_pages=True)
    top.set_title(f"chapter 08: one program per (request, query head). The {plan.group} query heads of a group\n"
                  f"each read every page of {name}'s K/V head: {plan.group} reads of each page", fontsize=8)
    for i, (pages, spans) in enumerate(zip(plan.pages, plan.spans)):
        def colour(t, spans=spans):
            s = next(j for j, (a, b) in enumerate(spans) if a <= t < b)
            return _SPLIT_COLOURS[s % len(_SPLIT_COLOURS)]
        _row(bottom, rows_bottom - 1 - i, pages, plan.page_size, plan.block_n, colour,
             f"{plan.names[i]}: {len(pages)} tokens", show_pages=True)
        idle = plan.num_splits - len(spans)
        if idle:
            which = (f"split {len(spans)}" if idle == 1 else f"splits {len(spans)}..{plan.num_splits - 1}")
            bottom.text(len(pages) + 0.4, rows_bottom - 1 - i + 0.4, f"{which}: nothing to read, exit{'s' if idle == 1 else ''}",
                        fontsize=7, va="center")
    bottom.set_title(f"chapter 09: one program per (request, K/V head, split); {plan.num_splits} splits of whole "
                     f"blocks of {plan.block_n} positions.\nEach page is read once, for all {plan.group} query heads "
                     "of the group", fontsize=8)
    handles = [Patch(color=_SPLIT_COLOURS[s], label=f"split {s}") for s in range(min(plan.num_splits, 6))]
    bottom.legend(handles=handles, fontsize=7, loc="lower right", ncol=len(handles), frameon=False,
                  bbox_to_anchor=(1.0, -0.32))
    for ax, rows in ((top, rows_top), (bottom, rows_bottom)):
        ax.set_xlim(-0.2, longest + 0.2)
        ax.set_ylim(-0.3, rows + 0.1)
        ax.axis("off")
    bottom.text(0, -0.55, f"thick line: page boundary (p = the physical page); dashed: a block boundary inside a "
                f"page (BLOCK_N = {plan.block_n}).\nA block may span pages that are not adjacent in the pool: "
                "its slots come from the row, one per position", fontsize=7, va="top")
    fig.tight_layout()
    return fig
