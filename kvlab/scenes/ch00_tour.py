"""Chapter 00's pictures: why pages (contiguous reservations waste memory), sharing, a first page table."""
from __future__ import annotations

import random
from typing import Sequence

import torch

from ..paging import new_page_table, page_to_token, write_page_table
from . import figure

_REQUEST_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
                   "#8c8c8c"]


def _cell(ax, x, y, color, *, hatch=None, text=None, edge="0.55"):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor=edge, lw=0.6, hatch=hatch))
    if text is not None:
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7, color="white")


def fragmentation_figure(lengths: Sequence[int] = (11, 3, 7, 14), max_seq_len: int = 16,
                         page_size: int = 4, seed: int = 0):
    """Contiguous per-request reservations (top) vs the same requests in pages (bottom).

    Both panels show the same KV pool of ``len(lengths) * max_seq_len`` slots.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_req = len(lengths)
    pool = n_req * max_seq_len
    n_pages = pool // page_size
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 3.9),
                                      gridspec_kw={"height_ratios": [n_req, 2.2]})

    # Top: each request owns a contiguous run of max_seq_len slots; the unused tail is lost.
    wasted = 0
    for r, n in enumerate(lengths):
        for t in range(max_seq_len):
            used = t < n
            wasted += not used
            _cell(top, t, r, _REQUEST_COLORS[r] if used else "white", hatch=None if used else "///")
    top.set_xlim(0, max_seq_len)
    top.set_ylim(n_req, 0)
    top.set_yticks([r + 0.5 for r in range(n_req)], [f"request {r} ({n} tok)" for r, n in enumerate(lengths)],
                   fontsize=8)
    top.set_xticks([])
    top.set_title(f"contiguous: every request reserves max_seq_len = {max_seq_len} slots up front — "
                  f"{wasted} of {pool} slots ({100 * wasted / pool:.0f}%) reserved but unused", fontsize=9,
                  loc="left")

    # Bottom: the same pool cut into pages; a request takes div_ceil(len, P) pages from a free list.
    rng = random.Random(seed)
    free = list(range(n_pages))
    rng.shuffle(free)
    owner = [-1] * pool
    fill = [False] * pool
    taken = 0
    for r, n in enumerate(lengths):
        pages = free[taken: taken + -(-n // page_size)]
        taken += len(pages)
        for k, p in enumerate(pages):
            for o in range(page_size):
                owner[p * page_size + o] = r
                fill[p * page_size + o] = k * page_size + o < n
    per_row = pool // 2
    tail_waste = sum(1 for s in range(pool) if owner[s] >= 0 and not fill[s])
    for s in range(pool):
        row, col = divmod(s, per_row)
        r = owner[s]
        if r < 0:
            _cell(bottom, col, row, "white")
        elif fill[s]:
            _cell(bottom, col, row, _REQUEST_COLORS[r])
        else:
            _cell(bottom, col, row, _REQUEST_COLORS[r], hatch="///", edge="0.55")
            bottom.patches[-1].set_alpha(0.35)
    for b in range(0, per_row + 1, page_size):
        bottom.axvline(b, color="0.15", lw=1.2)
    bottom.set_xlim(0, per_row)
    bottom.set_ylim(2, 0)
    bottom.set_yticks([])
    bottom.set_xticks([p * page_size + page_size / 2 for p in range(per_row // page_size)],
                      [f"page {p}" for p in range(per_row // page_size)], fontsize=6)
    free_pages = n_pages - taken
    bottom.set_title(f"paged (page_size = {page_size}): requests take whole pages from anywhere in the pool — "
                     f"{tail_waste} slots unused in last pages, {free_pages} pages "
                     f"({free_pages * page_size} slots) still free for new requests", fontsize=9, loc="left")
    handles = [Patch(facecolor=_REQUEST_COLORS[r], label=f"request {r}") for r in range(n_req)]
    handles.append(Patch(facecolor="white", edgecolor="0.4", hatch="///", label="reserved, unused"))
    fig.legend(handles=handles, loc="lower center", ncol=n_req + 1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def sharing_table(page_size: int = 4, seed: int = 0) -> tuple[torch.Tensor, int]:
    """A page table where requests 0-2 share a 2-page system prompt (same physical pages)."""
    table = new_page_table(4, 6 * page_size, page_size, device="cpu")
    rng = random.Random(seed)
    shared_pages = [7, 3]  # the prompt's pages, computed once and mapped by every sharer
    free = [p for p in range(24) if p not in shared_pages]
    rng.shuffle(free)
    shared = torch.tensor(shared_pages) * page_size
    own_pages = {0: 3, 1: 2, 2: 4, 3: 3}
    info, starts = [], []
    for row, n in own_pages.items():
        first = 2 if row < 3 else 0  # request 3 has a different prompt: no sharing
        info.append((row, first, first + n))
        starts += [free.pop() * page_size for _ in range(n)]
    for row in range(3):
        table[row, : 2 * page_size] = page_to_token(shared, page_size).to(torch.int32)
    allocated = page_to_token(torch.tensor(starts, dtype=torch.int32), page_size)
    write_page_table(table, allocated, info, page_size)
    return table, page_size


def first_page_table(n_requests: int = 5, max_seq_len: int = 32, page_size: int = 4, seed: int = 0):
    """A seeded batch: random lengths, pages from a shuffled free list; returns (table, lengths)."""
    rng = random.Random(seed)
    table = new_page_table(n_requests, max_seq_len, page_size, device="cpu")
    free = list(range(n_requests * max_seq_len // page_size))
    rng.shuffle(free)
    lengths = [rng.randint(1, max_seq_len) for _ in range(n_requests)]
    info, starts = [], []
    for row, n in enumerate(lengths):
        pages = -(-n // page_size)
        info.append((row, 0, pages))
        starts += [free.pop() * page_size for _ in range(pages)]
    write_page_table(table, page_to_token(torch.tensor(starts, dtype=torch.int32), page_size), info,
                     page_size)
    # the last page of a request is only partly used: unmap the positions past its length
    for row, n in enumerate(lengths):
        table[row, n:] = -1
    return table, lengths


@figure("00_fragmentation.png")
def fig_fragmentation():
    return fragmentation_figure()


@figure("00_sharing.png")
def fig_sharing():
    from ..viz import page_table_heatmap

    table, page_size = sharing_table()
    ax = page_table_heatmap(table, page_size, rows=slice(0, 4),
                            title="requests 0-2 share one system prompt: their first two pages are "
                                  "the same physical pages (same colours, same slots)")
    ax.figure.set_size_inches(9, 2.6)
    return ax.figure


@figure("00_first_page_table.png")
def fig_first_page_table():
    from ..viz import page_table_heatmap

    table, lengths = first_page_table()
    ax = page_table_heatmap(table, 4, title=f"a first page table: {len(lengths)} requests of lengths "
                                             f"{lengths} (last row: the spare dummy row)",
                            annotate=False)
    ax.figure.set_size_inches(10, 2.8)
    return ax.figure
