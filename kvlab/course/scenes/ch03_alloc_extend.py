"""Chapter 03's pictures: the three parts of a batched extend, and the out-of-memory hazard.

The notebook imports these helpers too (``from kvlab.course.scenes.ch03_alloc_extend import ...``)
so the figures in ``figures/`` and the chapter's pictures are the same drawings.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from ..reference.alloc_ref import ExtendPlan, alloc_extend_ref, kernel_page_reads_extend, pages_for
from ..viz.legibility import MAX_WIDTH_IN
from .figure_registry import figure

#: category ids of the pictures (colours come from tab10 in this order)
PREFIX, PART1, PART2, PART3 = 0, 1, 2, 3
CATEGORY_LABELS = {
    PREFIX: "prefix (already in the KV cache)",
    PART1: "part 1: rest of the old page",
    PART2: "part 2: whole new pages",
    PART3: "part 3: new last page",
}


class ExtendPicture(NamedTuple):
    """A batch extended from ``pre`` to ``seq``, with every slot labelled (for drawing)."""

    table: np.ndarray        # [bs, aligned max seq] physical slot per logical position, -1 = none
    categories: np.ndarray   # same shape: PREFIX / PART1 / PART2 / PART3, -1 = none
    plan: ExtendPlan         # the extend itself (reference)
    free_before: list[int]   # free_pages just before the extend
    page_size: int


def prefill_then_extend(prefix_lens: Sequence[int], seq_lens: Sequence[int], page_size: int,
                        free_pages: Sequence[int]) -> ExtendPicture:
    """Give each request its prefix (a first extend from 0), then extend it to ``seq_lens``.

    Both steps take pages from the front of ``free_pages`` (the reference allocator), so the
    prefix pages and the new pages never overlap.
    """
    P, n = page_size, len(prefix_lens)
    first = alloc_extend_ref([0] * n, list(prefix_lens), [-1] * n, list(free_pages), P)
    free_before = list(free_pages)[first.num_new_pages:]
    prefix_slots = [first.out_indices[s:s + p] for s, p in zip(first.output_starts, prefix_lens)]
    last_loc = [sl[-1] if sl else -1 for sl in prefix_slots]
    plan = alloc_extend_ref(list(prefix_lens), list(seq_lens), last_loc, free_before, P)
    width = max(1, pages_for(max(seq_lens), P) * P)
    table = np.full((n, width), -1, dtype=np.int64)
    cats = np.full((n, width), -1, dtype=np.int64)
    for r, sl in enumerate(prefix_slots):
        table[r, :len(sl)] = sl
        cats[r, :len(sl)] = PREFIX
    for i, (slot, (r, part)) in enumerate(zip(plan.out_indices, plan.parts)):
        pos = prefix_lens[r] + (i - plan.output_starts[r])
        table[r, pos] = slot
        cats[r, pos] = part
    return ExtendPicture(table, cats, plan, free_before, P)


def draw_logical(pic: ExtendPicture, ax, names: Sequence[str] | None = None, title: str | None = None,
                 annotate: bool | None = None):
    """Rows = requests, columns = token positions; colour = prefix / part 1 / 2 / 3."""
    from ..viz import page_table_heatmap

    page_table_heatmap(pic.table, pic.page_size, categories=pic.categories,
                       category_labels=CATEGORY_LABELS, ax=ax, annotate=annotate, row_label="request",
                       title=title or f"logical view: row = request, column = token position "
                                      f"(page_size={pic.page_size}); a number = the physical slot it got")
    if names is not None:
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
    return ax


def draw_pool(pic: ExtendPicture, num_pages: int, ax, names: Sequence[str] | None = None,
              title: str | None = None, annotate: bool | None = None, max_cells: int = 1024):
    """Rows = requests, columns = physical slots of the pool; a cell shows the token position there."""
    from ..viz import page_table_heatmap

    n, P = pic.table.shape[0], pic.page_size
    pos = np.full((n, num_pages * P), -1, dtype=np.int64)
    cats = np.full_like(pos, -1)
    for r in range(n):
        for c in range(pic.table.shape[1]):
            slot = pic.table[r, c]
            if slot >= 0:
                pos[r, slot] = c
                cats[r, slot] = pic.categories[r, c]
    page_table_heatmap(pos, P, categories=cats, category_labels=CATEGORY_LABELS, ax=ax,
                       annotate=annotate, row_label="request", max_cells=max_cells,
                       title=title or "physical view: row = request, column = slot in the KV pool; "
                                      "a number = the token position stored there")
    ax.set_xlabel("physical slot in the KV pool", fontsize=8)
    if names is not None:
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
    return ax


def two_views_figure(pic: ExtendPicture, num_pages: int, names: Sequence[str],
                     pool_names: Sequence[str], *, annotate: bool | None = None,
                     logical_title: str | None = None, pool_title: str | None = None):
    """The logical view over the physical view of one extend, one legend under both."""
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(MAX_WIDTH_IN, 4.8))
    draw_logical(pic, top, names=names, annotate=annotate, title=logical_title)
    draw_pool(pic, num_pages, bottom, names=pool_names, annotate=annotate, title=pool_title)
    legend = top.get_legend()
    handles, labels = legend.legend_handles, [t.get_text() for t in legend.get_texts()]
    top.get_legend().remove()
    bottom.get_legend().remove()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def worked_example() -> ExtendPicture:
    """The source design's example: P = 64, A 70 -> 190, B 128 -> 260 (4 new pages)."""
    return prefill_then_extend([70, 128], [190, 260], 64, [4, 0, 2, 7, 3, 9, 5, 1, 6, 8])


@figure("03_alloc_extend_parts.png")
def fig_worked_example():
    pic = worked_example()
    return two_views_figure(
        pic, 10, ["A: 70 -> 190", "B: 128 -> 260"], ["A", "B"],
        logical_title="alloc_extend on the worked example (page_size 64): out_indices = "
                      "[A 58 | A 62 | B 128 | B 4], 4 new pages",
        pool_title=f"where those slots are in the pool (10 pages; free_pages before = {pic.free_before})")


def small_example() -> ExtendPicture:
    """Three requests on pages of 4: unaligned prefix, aligned prefix, empty prefix."""
    return prefill_then_extend([3, 4, 0], [9, 12, 2], 4, [5, 2, 9, 0, 7, 3, 10, 1, 8, 6, 4, 11])


@figure("03_alloc_extend_small.png")
def fig_small_example():
    pic = small_example()
    return two_views_figure(
        pic, 12, ["r0: 3 -> 9", "r1: 4 -> 12", "r2: 0 -> 2"], ["r0", "r1", "r2"], annotate=True,
        logical_title="logical view: column = token position, a number = the physical slot it got "
                      "(page_size 4)",
        pool_title="physical view: column = slot in the pool, a number = the token position stored "
                   f"there\n(free_pages before = {pic.free_before})")


def draw_page_reads(prefix_lens: Sequence[int], seq_lens: Sequence[int], page_size: int,
                    free_pages: Sequence[int], ax=None, names: Sequence[str] | None = None):
    """Which positions of ``free_pages`` each request's program loads; reads past the end in red.

    This is the original order's hazard: the kernel runs before anyone has checked that
    ``len(free_pages)`` covers every read.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    reads = kernel_page_reads_extend(prefix_lens, seq_lens, page_size)
    F = len(free_pages)
    total = max([F] + [i + 1 for r in reads for i in r])
    own_figure = ax is None
    if own_figure:
        _, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, max(6.0, 0.55 * total + 2)),
                                      1.2 + 0.45 * (len(reads) + 1)))
    colours = plt.get_cmap("tab10")
    # row 0: free_pages itself, then one row per request
    for i in range(total):
        inside = i < F
        ax.add_patch(Rectangle((i, 0), 1, 1, facecolor="0.92" if inside else "white",
                               edgecolor="0.4" if inside else "#d62728",
                               linestyle="-" if inside else "--", lw=1))
        ax.text(i + 0.5, 0.5, str(free_pages[i]) if inside else "?", ha="center", va="center",
                fontsize=8, color="black" if inside else "#d62728")
    for r, rr in enumerate(reads):
        for i in rr:
            past = i >= F
            ax.add_patch(Rectangle((i, r + 1.15), 1, 0.7, facecolor=colours(r % 10),
                                   edgecolor="#d62728" if past else "none", lw=2 if past else 0,
                                   hatch="//" if past else None, alpha=0.85))
    ax.axvline(F, color="#d62728", lw=1.5)
    ax.text(F + 0.05, -0.35, f" end of free_pages (len {F})", color="#d62728", fontsize=8, va="center")
    ax.set_xlim(-0.2, total + 0.2)
    ax.set_ylim(len(reads) + 1.1, -0.6)
    labels = ["free_pages"] + [(names[r] if names else f"request {r}") + " reads" for r in range(len(reads))]
    ax.set_yticks([0.5] + [r + 1.5 for r in range(len(reads))])
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks([i + 0.5 for i in range(total)])
    ax.set_xticklabels([str(i) for i in range(total)], fontsize=7)
    ax.set_xlabel("position in free_pages", fontsize=8)
    for s in ax.spines.values():
        s.set_visible(False)
    n_past = sum(1 for rr in reads for i in rr if i >= F)
    ax.set_title(f"launch first, check later: the programs read {n_past} position(s) past the end "
                 f"of free_pages (hatched)" if n_past else "every read is inside free_pages",
                 fontsize=9)
    ax.legend(handles=[Patch(facecolor="white", edgecolor="#d62728", hatch="//",
                             label="read past the end")], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if own_figure:  # the legend beside the axes stays inside the figure
        ax.figure.tight_layout()
    return ax


@figure("03_alloc_extend_oom.png")
def fig_oom_hazard():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 2.4))
    draw_page_reads([3, 4, 0], [9, 12, 10], 4, [7, 3, 10, 1, 8], ax=ax, names=["r0", "r1", "r2"])
    fig.tight_layout()
    return fig
