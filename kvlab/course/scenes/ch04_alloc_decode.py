"""Chapter 04's picture: decode steps, one token per request per step; new pages stand out.

``decode_steps`` runs the reference allocator step by step; ``draw_decode_steps`` draws one
small page table per step (the notebook uses both, the figure below is the same drawing).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from ..viz.legibility import MAX_WIDTH_IN
from ..reference.alloc_ref import alloc_decode_ref, alloc_extend_ref, pages_for
from .figure_registry import figure

#: category ids (tab10 colours in this order)
EARLIER, SAME_PAGE, NEW_PAGE = 0, 1, 2
CATEGORY_LABELS = {
    EARLIER: "earlier tokens",
    SAME_PAGE: "this step: last_loc + 1 (same page)",
    NEW_PAGE: "this step: first slot of a new page",
}


class DecodeStep(NamedTuple):
    seq_lens: list[int]        # lengths after this step's token
    out_indices: list[int]     # the slot each request got
    takes_new_page: list[bool]
    free_pages: list[int]      # free list AFTER the step
    table: np.ndarray          # [bs, width] slot per logical position after the step, -1 = none


def decode_steps(prefix_lens: Sequence[int], steps: int, page_size: int,
                 free_pages: Sequence[int], width: int | None = None) -> list[DecodeStep]:
    """Prefill every request to ``prefix_lens``, then run ``steps`` decode steps (reference)."""
    P, n = page_size, len(prefix_lens)
    first = alloc_extend_ref([0] * n, list(prefix_lens), [-1] * n, list(free_pages), P)
    free = list(free_pages)[first.num_new_pages:]
    slots = [first.out_indices[s:s + p] for s, p in zip(first.output_starts, prefix_lens)]
    width = width or pages_for(max(prefix_lens) + steps, P) * P
    history = []
    for _ in range(steps):
        seq = [len(s) + 1 for s in slots]
        plan = alloc_decode_ref(seq, [s[-1] if s else -1 for s in slots], free, P)
        free = free[plan.num_new_pages:]
        for r, x in enumerate(plan.out_indices):
            slots[r].append(x)
        table = np.full((n, width), -1, dtype=np.int64)
        for r, s in enumerate(slots):
            table[r, :len(s)] = s
        history.append(DecodeStep(seq, plan.out_indices, plan.takes_new_page, list(free), table))
    return history


def draw_decode_steps(history: Sequence[DecodeStep], page_size: int, axes, names=None,
                      first_step: int = 1):
    """One small page table per step; this step's cells coloured by same page / new page.

    ``first_step`` numbers the titles (a slider that draws one step at a time passes its own).
    """
    from ..viz import page_table_heatmap

    for k, (step, ax) in enumerate(zip(history, axes)):
        cats = np.where(step.table >= 0, EARLIER, -1)
        for r, s in enumerate(step.seq_lens):
            cats[r, s - 1] = NEW_PAGE if step.takes_new_page[r] else SAME_PAGE
        new = [r for r, t in enumerate(step.takes_new_page) if t]
        page_table_heatmap(step.table, page_size, categories=cats, category_labels=CATEGORY_LABELS,
                           ax=ax, annotate=True, row_label="request",
                           title=f"step {k + first_step}: seq_lens = {step.seq_lens}; "
                                 + (f"new page for request(s) {new}" if new else "no new page")
                                 + f"; free_pages -> {step.free_pages[:6]}"
                                 + ("..." if len(step.free_pages) > 6 else ""))
        if names is not None:
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names, fontsize=7)
        if k and ax.get_legend() is not None:
            ax.get_legend().remove()
        if k < len(history) - 1:
            ax.set_xlabel("")
    return axes


def example_history() -> list[DecodeStep]:
    """Three requests on pages of 4, at different offsets in their last page; five steps."""
    return decode_steps([3, 6, 4], 5, 4, [2, 7, 0, 5, 9, 1, 3, 8, 4, 6, 10, 11])


@figure("04_alloc_decode_steps.png")
def fig_decode_steps():
    import matplotlib.pyplot as plt

    history = example_history()
    fig, axes = plt.subplots(len(history), 1, figsize=(MAX_WIDTH_IN, 1.5 * len(history) + 0.6), sharex=True)
    draw_decode_steps(history, 4, axes)
    fig.suptitle("alloc_decode, step by step (page_size 4): a request takes a new page exactly "
                 "when (seq - 1) % 4 == 0", fontsize=10)
    fig.tight_layout()
    return fig
