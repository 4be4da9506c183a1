"""Chapter 01's picture: page starts picked from the pool -> the token slots they own, in order."""
from __future__ import annotations

from typing import Sequence

import torch

from ...alloc.paging import page_to_token
from ..viz.legibility import MAX_WIDTH_IN
from .figure_registry import figure

#: Most slots drawn in one row of the pool; a bigger pool wraps onto more rows.
POOL_ROW_SLOTS = 32


def pages_to_slots_figure(page_ids: Sequence[int] = (4, 1, 6), page_size: int = 4, num_pages: int = 8):
    """Top: the KV pool, the chosen pages coloured in list order (rows of at most
    ``POOL_ROW_SLOTS`` slots, whole pages each). Bottom: ``page_to_token``'s output."""
    import matplotlib.pyplot as plt

    from ..viz import page_table_heatmap

    labels = [f"page {p} (start {p * page_size})" for p in page_ids]
    n_slots = num_pages * page_size
    per_row = max(page_size, POOL_ROW_SLOTS // page_size * page_size)
    n_rows = -(-n_slots // per_row)
    pool = torch.full((n_rows * per_row,), -1)
    pool[:n_slots] = torch.arange(n_slots)
    order = torch.full_like(pool, -1)
    for k, p in enumerate(page_ids):
        order[p * page_size:(p + 1) * page_size] = k
    pool, order = pool.view(n_rows, per_row), order.view(n_rows, per_row)
    starts = torch.tensor([p * page_size for p in page_ids], dtype=torch.int32)
    slots = page_to_token(starts, page_size).view(1, -1)
    slot_order = torch.arange(slots.numel()).view(1, -1) // page_size
    width = max(slots.shape[1], min(per_row, n_slots))
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(min(MAX_WIDTH_IN, 0.27 * width + 2.6), 0.45 * (n_rows + 1) + 2.3),
        gridspec_kw=dict(height_ratios=[n_rows, 1]))
    page_table_heatmap(pool, page_size, categories=order, category_labels=labels, ax=top,
                       annotate=True, row_label="",
                       title=f"the KV pool: {num_pages} pages of {page_size} slots; "
                             f"page_starts = {starts.tolist()}")
    page_table_heatmap(slots, page_size, categories=slot_order, category_labels=labels, ax=bottom,
                       annotate=True, row_label="",
                       title=f"page_to_token(page_starts, {page_size}): every slot of those pages, "
                             "page after page")
    bottom.set_xlabel("index in the output", fontsize=8)
    if n_rows > 1:  # each row of the pool is a run of slots: the numbers in the cells say which
        top.set_xticks([])
        top.set_xlabel("slots of the pool, row after row (the number in a cell is its slot)", fontsize=8)
        top.set_yticks(range(n_rows), [f"{r * per_row}-{(r + 1) * per_row - 1}" for r in range(n_rows)],
                       fontsize=7)
    else:
        top.set_xlabel("slot in the pool", fontsize=8)
        top.set_yticks([])
    bottom.set_yticks([])
    bottom.get_legend().remove()
    bottom.set_xlim(-0.5, width - 0.5)  # same cell width as the pool above
    top.set_xlim(-0.5, width - 0.5)
    fig.tight_layout()
    return fig


@figure("01_page_to_token.png")
def fig_page_to_token():
    return pages_to_slots_figure()
