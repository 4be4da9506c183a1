"""Pictures of the hash-chained prefix cache (chapter 11): the chains of hashes of a few
sequences, the free queue, and the radix tree and the hash cache measured side by side.

Each function draws plain data (a :class:`~kvlab.hash_chain.HashSnapshot`, lists of pages,
the rows of :func:`kvlab.sim.compare.compare_caches`) on ``ax`` or a new figure::

    request A   [p0 1 2 3 4] -> [p1 5 6 7 8] -> [p2 9 ·  ·  ·]     box: page, its tokens,
                  h 3f1a          h 77c2          no hash           its hash (4 hex digits)
    request B   [p0 ...]     -> [p1 ...]     -> [p5 4 4 4 4]     the same page = the same box colour
"""
from __future__ import annotations

from typing import Sequence

from ..hash_chain import HashSnapshot, short

__all__ = ["draw_hash_chains", "draw_free_queue", "draw_free_queue_steps", "draw_cache_comparison",
           "draw_lookup_cost", "CACHE_COLOURS"]

SHARED = "#fdae6b"      # a page more than one sequence maps
OWN = "#c6dbef"         # a cached page one sequence maps
PARTIAL = "#ffffff"     # a partial last page: no hash
FREE_CACHED = "#9ecae1"
FREE_UNCACHED = "#f0f0f0"
CACHE_COLOURS = {"radix": "#6a51a3", "hash": "#e6550d", "hash_uncached_first": "#31a354"}


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def _tokens(tokens: Sequence[int], page_size: int, limit: int = 4) -> str:
    shown = [str(t) for t in tokens[:limit]] + (["…"] if len(tokens) > limit else [])
    return " ".join(shown + ["·"] * max(0, min(page_size, limit) - len(tokens)))


def draw_hash_chains(snapshot: HashSnapshot, rows: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                     ax=None, *, title: str | None = None, fontsize: float = 7.5):
    """Each row ``(label, token_ids, pages)`` as a chain of page boxes: the page id, its tokens,
    its hash (a partial last page has none), an arrow from each page to the next (the next
    hash is computed from this one). Pages several rows map are orange. Returns the Axes."""
    from matplotlib.patches import FancyBboxPatch

    P = snapshot.page_size
    hashes = dict(snapshot.hashes)
    width = max(len(pages) for _, _, pages in rows)
    ax = _axes(ax, (1.9 * width + 1.6, 0.95 * len(rows) + 0.7))
    users: dict[int, int] = {}
    for _, _, pages in rows:
        for p in set(pages):
            users[p] = users.get(p, 0) + 1
    for r, (label, ids, pages) in enumerate(rows):
        y = -r
        ax.text(-0.15, y, label, ha="right", va="center", fontsize=fontsize + 0.5, weight="bold")
        for i, page in enumerate(pages):
            tokens = list(ids[i * P:(i + 1) * P])
            full = len(tokens) == P
            fc = PARTIAL if not full else (SHARED if users[page] > 1 else OWN)
            ax.add_patch(FancyBboxPatch((i * 1.5 + 0.05, y - 0.36), 1.2, 0.72,
                                        boxstyle="round,pad=0.02", fc=fc, ec="#333333",
                                        ls="-" if full else "--", lw=0.9))
            h = hashes.get(page) if full else None
            ax.text(i * 1.5 + 0.65, y + 0.15, f"p{page}: {_tokens(tokens, P)}", ha="center",
                    va="center", fontsize=fontsize, family="monospace")
            ax.text(i * 1.5 + 0.65, y - 0.17, f"h {short(h, 2)}" if h else "no hash (partial)",
                    ha="center", va="center", fontsize=fontsize - 0.5, color="#333333")
            if i:
                ax.annotate("", xy=(i * 1.5 + 0.05, y), xytext=(i * 1.5 - 0.25, y),
                            arrowprops=dict(arrowstyle="->", color="#555555", lw=0.9))
    ax.set_xlim(-1.3, width * 1.5)
    ax.set_ylim(-len(rows) + 0.45, 0.55)
    ax.set_axis_off()
    ax.set_title(title or f"hash chains (P={P}): a page's hash is H(previous page's hash, its tokens)",
                 fontsize=fontsize + 1.5)
    return ax


def draw_free_queue(snapshot: HashSnapshot, ax=None, *, title: str | None = None,
                    highlight: Sequence[int] = (), fontsize: float = 7.5):
    """Every page of the pool in one strip: the free queue first, head (next out) on the left
    (cached pages blue with their hash, pages without one grey), then the referenced pages
    (orange, with their count). ``highlight`` outlines pages in red. Returns the Axes."""
    from matplotlib.patches import Rectangle

    hashes = dict(snapshot.hashes)
    queue = list(snapshot.free_queue)
    held = [p for p, r in enumerate(snapshot.ref_counts) if r > 0]
    n = len(snapshot.ref_counts)
    ax = _axes(ax, (0.75 * n + 2.5, 1.3))
    cells = [(i, p) for i, p in enumerate(queue)] + [(len(queue) + 0.4 + i, p) for i, p in enumerate(held)]
    for x, page in cells:
        in_queue = page in queue
        fc = (FREE_CACHED if page in hashes else FREE_UNCACHED) if in_queue else SHARED
        ax.add_patch(Rectangle((x, 0), 0.92, 0.9, fc=fc, ec="#d62728" if page in highlight else "#555555",
                               lw=2.0 if page in highlight else 0.7))
        ax.text(x + 0.46, 0.62, f"p{page}", ha="center", va="center", fontsize=fontsize)
        below = short(hashes[page], 2) if page in hashes else "-"
        if not in_queue:
            below = f"ref {snapshot.ref_counts[page]}"
        ax.text(x + 0.46, 0.27, below, ha="center", va="center", fontsize=fontsize - 1, family="monospace")
    ax.annotate("next out", xy=(0.0, 0.45), xytext=(-1.5, 0.45), fontsize=fontsize, va="center",
                arrowprops=dict(arrowstyle="->", color="#555555"))
    if held:
        ax.text(len(queue) + 0.2, 0.45, "|", ha="center", va="center", fontsize=fontsize + 8, color="#999999")
    ax.set_xlim(-1.6, n + 0.5)
    ax.set_ylim(-0.1, 1.0)
    ax.set_axis_off()
    ax.set_title(title or f"free queue: {len(queue)} pages; {len(held)} referenced", fontsize=fontsize + 1.5,
                 loc="left")
    return ax


def draw_free_queue_steps(steps: Sequence[tuple[str, HashSnapshot, Sequence[int]]], *, width: float = 10.0):
    """One free queue per ``(title, snapshot, highlight)``, stacked. Returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(steps), 1, figsize=(width, 1.25 * len(steps) + 0.5), squeeze=False)
    for ax, (title, snap, highlight) in zip(axes[:, 0], steps):
        draw_free_queue(snap, ax, title=title, highlight=highlight)
    fig.legend(handles=[Patch(fc=FREE_CACHED, ec="#555555", label="free, cached (findable by its hash)"),
                        Patch(fc=FREE_UNCACHED, ec="#555555", label="free, no hash"),
                        Patch(fc=SHARED, ec="#555555", label="referenced (not in the queue)"),
                        Patch(fc="white", ec="#d62728", lw=2, label="taken by the next step")],
               loc="lower center", ncol=4, fontsize=7.5, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def draw_cache_comparison(rows, *, caches: Sequence[str] | None = None):
    """Prefix-hit tokens and evicted tokens of every workload and pool size, one bar per cache
    (the rows of :func:`kvlab.sim.compare.compare_caches`). Returns the Figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    workloads = list(dict.fromkeys(r.workload for r in rows))
    pools = list(dict.fromkeys(r.pool for r in rows))
    caches = list(caches or dict.fromkeys(r.cache for r in rows))
    by = {(r.workload, r.pool, r.cache): r for r in rows}
    fig, axes = plt.subplots(2, len(workloads), figsize=(3.1 * len(workloads), 4.6), squeeze=False)
    x = np.arange(len(pools))
    w = 0.8 / len(caches)
    for j, name in enumerate(workloads):
        for k, cache in enumerate(caches):
            runs = [by[(name, pool, cache)] for pool in pools]
            axes[0, j].bar(x + (k - (len(caches) - 1) / 2) * w, [r.hit_tokens for r in runs], w,
                           color=CACHE_COLOURS.get(cache), label=cache)
            axes[1, j].bar(x + (k - (len(caches) - 1) / 2) * w, [r.evicted_tokens for r in runs], w,
                           color=CACHE_COLOURS.get(cache))
        axes[0, j].set_title(name.replace("_", " "), fontsize=9)
        axes[0, j].set_xticks(x, [""] * len(pools))
        axes[1, j].set_xticks(x, [f"{p}\n{by[(name, p, caches[0])].num_pages} pages" for p in pools],
                              fontsize=7)
    axes[0, 0].set_ylabel("prefix-hit tokens", fontsize=8)
    axes[1, 0].set_ylabel("evicted tokens", fontsize=8)
    for ax in axes.flat:
        ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7, frameon=False)
    fig.suptitle("the same seeded workloads on each cache: prefix-hit tokens (top), evicted "
                 "tokens (bottom)", fontsize=9)
    fig.tight_layout()
    return fig


def draw_lookup_cost(costs, ax=None):
    """Median host microseconds of one ``match_prefix`` by prompt length, both caches
    (:func:`kvlab.sim.compare.lookup_cost`). Returns the Axes."""
    ax = _axes(ax, (4.6, 3.0))
    lens = [c.prompt_len for c in costs]
    ax.plot(lens, [c.radix_us for c in costs], "o-", color=CACHE_COLOURS["radix"], label="radix tree")
    ax.plot(lens, [c.hash_us for c in costs], "s-", color=CACHE_COLOURS["hash"], label="hash chain")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (all cached)", fontsize=8)
    ax.set_ylabel("host µs per match_prefix (median)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, frameon=False)
    ax.set_title("lookup cost", fontsize=9)
    return ax
