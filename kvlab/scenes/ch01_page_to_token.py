"""Chapter 01's picture: page starts picked from the pool -> the token slots they own, in order."""
from __future__ import annotations

from typing import Sequence

import torch

from ..paging import page_to_token
from .registry import figure


def pages_to_slots_figure(page_ids: Sequence[int] = (4, 1, 6), page_size: int = 4, num_pages: int = 8):
    """Top: the KV pool, the chosen pages coloured in list order. Bottom: ``page_to_token``'s output."""
    import matplotlib.pyplot as plt

    from ..viz import page_table_heatmap

    labels = [f"page {p} (start {p * page_size})" for p in page_ids]
    pool = torch.arange(num_pages * page_size).view(1, -1)
    order = torch.full_like(pool, -1)
    for k, p in enumerate(page_ids):
        order[0, p * page_size:(p + 1) * page_size] = k
    starts = torch.tensor([p * page_size for p in page_ids], dtype=torch.int32)
    slots = page_to_token(starts, page_size).view(1, -1)
    slot_order = torch.arange(slots.numel()).view(1, -1) // page_size

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, 0.36 * pool.shape[1]), 2.9))
    page_table_heatmap(pool, page_size, categories=order, category_labels=labels, ax=top,
                       annotate=True, row_label="",
                       title=f"the KV pool: {num_pages} pages of {page_size} slots; "
                             f"page_starts = {starts.tolist()}")
    page_table_heatmap(slots, page_size, categories=slot_order, category_labels=labels, ax=bottom,
                       annotate=True, row_label="",
                       title=f"page_to_token(page_starts, {page_size}): every slot of those pages, "
                             "page after page")
    bottom.set_xlabel("index in the output", fontsize=8)
    top.set_xlabel("slot in the pool", fontsize=8)
    for ax in (top, bottom):
        ax.set_yticks([])
    bottom.get_legend().remove()
    bottom.set_xlim(-0.5, pool.shape[1] - 0.5)  # same cell width as the pool above
    fig.tight_layout()
    return fig


@figure("01_page_to_token.png")
def fig_page_to_token():
    return pages_to_slots_figure()

