"""Chapter 02's pictures: a page table before and after one batch's write (new cells outlined)."""
from __future__ import annotations

import random
from typing import NamedTuple

import torch

from ...alloc.paging import UNMAPPED, div_ceil, new_page_table, page_to_token, write_page_table
from ..viz.legibility import MAX_WIDTH_IN
from .figure_registry import figure


class DemoRequest(NamedTuple):
    """A running request as the cache manager sees it (chapter 02's worked example)."""

    table_idx: int  # its row in the page table
    cached_len: int  # tokens whose KV slots are already mapped
    device_len: int  # tokens that need KV slots after this step


#: A prefill from scratch, a prefill after a prefix-cache hit, a decode inside a page, a decode
#: that crosses into a new page.
DEMO_REQUESTS = [DemoRequest(0, 0, 10), DemoRequest(1, 8, 13), DemoRequest(2, 6, 7), DemoRequest(3, 8, 9)]


def demo_batch(requests=DEMO_REQUESTS, page_size: int = 4, max_running_req: int = 4,
               max_seq_len: int = 16, seed: int = 0):
    """Before table, allocated slots and allocation_info for ``requests`` (pages from a shuffled pool).

    Before the step each row maps whole pages ``[0, div_ceil(cached_len, P))``.
    """
    rng = random.Random(seed)
    free = list(range(max_running_req * max_seq_len // page_size + 4))
    rng.shuffle(free)
    table = new_page_table(max_running_req, max_seq_len, page_size, device="cpu")
    for req in requests:  # what earlier steps already mapped
        old_pages = div_ceil(req.cached_len, page_size)
        if old_pages:
            starts = torch.tensor([free.pop() * page_size for _ in range(old_pages)], dtype=torch.int32)
            table[req.table_idx, : old_pages * page_size] = page_to_token(starts, page_size)
    allocation_info = []
    for req in requests:  # allocate_paged's arithmetic
        first_page = div_ceil(req.cached_len, page_size)
        last_page = div_ceil(req.device_len, page_size)
        if last_page > first_page:
            allocation_info.append((req.table_idx, first_page, last_page))
    needed_pages = sum(last - first for _, first, last in allocation_info)
    starts = torch.tensor([free.pop() * page_size for _ in range(needed_pages)], dtype=torch.int32)
    return table, page_to_token(starts, page_size), allocation_info


def before_after_figure(before: torch.Tensor, after: torch.Tensor, page_size: int, *,
                        title: str = "one batch's page-table write"):
    """Two heatmaps, before and after; cells the write changed are outlined in red."""
    import matplotlib.pyplot as plt

    from ..viz import page_table_heatmap

    changed = before != after
    mapped = torch.cat([before[before != UNMAPPED], after[after != UNMAPPED]]) // page_size
    pages = (int(mapped.min()), int(mapped.max())) if mapped.numel() else None  # one colour scale
    fig, (left, right) = plt.subplots(1, 2, figsize=(MAX_WIDTH_IN, 0.42 * before.shape[0] + 1.8))
    page_table_heatmap(before, page_size, ax=left, colorbar=False, title="before",
                       page_range=pages)
    page_table_heatmap(after, page_size, ax=right, highlight=changed, page_range=pages,
                       title=f"after ({int(changed.sum())} new entries outlined)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


@figure("02_page_table_write.png")
def fig_page_table_write():
    table, allocated, info = demo_batch()
    after = table.clone()
    write_page_table(after, allocated, info, 4)
    assert (after[table != UNMAPPED] == table[table != UNMAPPED]).all()
    return before_after_figure(table, after, 4, title=f"allocation_info = {info}: "
                                                        "rows 0,1,3 get new pages; row 2 still fits in its page")
