"""Pictures of the hash-chained prefix cache (chapter 11): the chains of hashes of a few
sequences, the free queue, and the radix tree and the hash cache measured side by side.

Each function draws plain data (a :class:`~kvlab.prefix.hash_chain.HashSnapshot`, lists of pages,
the rows of :func:`kvlab.serving.sim.compare.compare_caches`) on ``ax`` or a new figure::

    A   [ p0          ]    [ p1          ]    [ p2      ]      box: the page, its tokens and
        [ 1 2 3 4     ] -> [ 5 6 7 8     ] -> [ 9 · · · ]      its hash (4 hex digits); a partial
        [ h 3f1a      ]    [ h 77c2      ]    [ no hash ]      last page has none (dashed)
    B   [ p0 ...      ] -> [ p1 ...      ] -> [ p5 ...  ]      orange: a page several rows map

    free queue:  [p6 no hash] [p4 eacd] ... [p0 7c3d]  |  [p3 ref 1] ...
                 head: next out                 tail       held by sequences
"""
from __future__ import annotations

from typing import Sequence

from ...prefix.hash_chain import HashSnapshot, short
from .legibility import MAX_WIDTH_IN

__all__ = ["draw_hash_chains", "draw_free_queue", "draw_free_queue_steps", "draw_cache_comparison",
           "draw_lookup_cost", "CACHE_COLOURS"]

SHARED = "#fdae6b"      # a page more than one sequence maps
OWN = "#c6dbef"         # a cached page one sequence maps
PARTIAL = "#ffffff"     # a partial last page: no hash
FREE_CACHED = "#9ecae1"
FREE_UNCACHED = "#f0f0f0"
_RED = "#d62728"     # pages the next step takes
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
                     ax=None, *, title: str | None = None, fontsize: float = 8.0):
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
        ax.text(-0.15, y, label, ha="right", va="center", fontsize=fontsize + 1.5, weight="bold")
        for i, page in enumerate(pages):
            tokens = list(ids[i * P:(i + 1) * P])
            full = len(tokens) == P
            fc = PARTIAL if not full else (SHARED if users[page] > 1 else OWN)
            ax.add_patch(FancyBboxPatch((i * 1.5 + 0.05, y - 0.4), 1.2, 0.8,
                                        boxstyle="round,pad=0.02", fc=fc, ec="#333333",
                                        ls="-" if full else "--", lw=0.9))
            h = hashes.get(page) if full else None
            centre = i * 1.5 + 0.65
            ax.text(centre, y + 0.24, f"p{page}", ha="center", va="center", fontsize=fontsize + 0.5,
                    weight="bold")
            ax.text(centre, y + 0.0, _tokens(tokens, P), ha="center", va="center", fontsize=fontsize,
                    family="monospace")
            ax.text(centre, y - 0.24, f"h {short(h, 2)}" if h else "no hash (partial)",
                    ha="center", va="center", fontsize=fontsize, color="#333333",
                    family="monospace" if h else None)
            if i:
                ax.annotate("", xy=(i * 1.5 + 0.05, y), xytext=(i * 1.5 - 0.25, y),
                            arrowprops=dict(arrowstyle="->", color="#555555", lw=0.9))
    ax.set_xlim(-0.7, width * 1.5)
    ax.set_ylim(-len(rows) + 0.5, 0.5)
    ax.set_axis_off()
    ax.set_title(title or f"hash chains (P={P}): a page's hash is H(previous page's hash, its tokens); "
                 "orange: a page several rows map", fontsize=fontsize + 1.5)
    return ax


def draw_free_queue(snapshot: HashSnapshot, ax=None, *, title: str | None = None,
                    highlight: Sequence[int] = (), fontsize: float = 8.0):
    """Every page of the pool in one strip: the free queue first, head (next out) on the left
    (cached pages blue with their hash, pages without one grey), then the pages sequences hold
    (orange, with their reference count). ``highlight`` outlines pages in red. Returns the Axes."""
    from matplotlib.patches import Rectangle

    hashes = dict(snapshot.hashes)
    queue = list(snapshot.free_queue)
    held = [p for p, r in enumerate(snapshot.ref_counts) if r > 0]
    n = len(snapshot.ref_counts)
    ax = _axes(ax, (min(MAX_WIDTH_IN, 0.9 * n + 1.0), 1.4))
    gap = 0.6 if queue and held else 0.0
    cells = [(i, p) for i, p in enumerate(queue)] + [(len(queue) + gap + i, p) for i, p in enumerate(held)]
    for x, page in cells:
        in_queue = page in queue
        fc = (FREE_CACHED if page in hashes else FREE_UNCACHED) if in_queue else SHARED
        ax.add_patch(Rectangle((x + 0.04, 0), 0.92, 0.9, fc=fc, ec=_RED if page in highlight else "#555555",
                               lw=2.2 if page in highlight else 0.7))
        ax.text(x + 0.5, 0.63, f"p{page}", ha="center", va="center", fontsize=fontsize + 1, weight="bold")
        below = (short(hashes[page], 2) if page in hashes else "no hash") if in_queue else \
            f"ref {snapshot.ref_counts[page]}"
        ax.text(x + 0.5, 0.27, below, ha="center", va="center", fontsize=fontsize,
                family="monospace" if in_queue and page in hashes else None)
    grey = dict(ha="center", va="top", fontsize=fontsize - 0.5, color="#555555")
    if queue:  # where the queue gives out its next page, and where freed pages join it
        ax.text(0.5, -0.08, "head: next out", **grey)
        if len(queue) > 1:
            ax.text(len(queue) - 0.5, -0.08, "tail", **grey)
    if held:
        ax.text(len(queue) + gap + len(held) / 2, -0.08, "held by sequences (not in the queue)", **grey)
    ax.set_xlim(-0.05, n + gap + 0.05)
    ax.set_ylim(-0.38, 0.95)
    ax.set_axis_off()
    ax.set_title(title or f"free queue: {len(queue)} pages; {len(held)} held", fontsize=fontsize + 0.5,
                 loc="left")
    return ax


def draw_free_queue_steps(steps: Sequence[tuple[str, HashSnapshot, Sequence[int]]], *,
                          width: float = 9.2):
    """One free queue per ``(title, snapshot, highlight)``, stacked, at most an output area
    wide (:data:`kvlab.course.viz.legibility.MAX_WIDTH_IN`). Returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(steps), 1, figsize=(min(width, MAX_WIDTH_IN), 1.45 * len(steps) + 0.4),
                             squeeze=False)
    for ax, (title, snap, highlight) in zip(axes[:, 0], steps):
        draw_free_queue(snap, ax, title=title, highlight=highlight)
    fig.legend(handles=[Patch(fc=FREE_CACHED, ec="#555555", label="free, cached (findable by its hash)"),
                        Patch(fc=FREE_UNCACHED, ec="#555555", label="free, no hash"),
                        Patch(fc=SHARED, ec="#555555", label="held (reference count > 0)"),
                        Patch(fc="white", ec=_RED, lw=2, label="taken by the next step")],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1), h_pad=0.6)
    return fig


def draw_cache_comparison(rows, *, caches: Sequence[str] | None = None):
    """The hit rate and the evicted tokens of every workload and pool size, one bar per cache
    (the rows of :func:`kvlab.serving.sim.compare.compare_caches`); the hatched top of an eviction bar
    is what no allocation asked for (whole radix leaves). One column per workload, every panel
    of a row on one scale, at most an output area wide. Returns the Figure."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch

    workloads = list(dict.fromkeys(r.workload for r in rows))
    pools = list(dict.fromkeys(r.pool for r in rows))
    caches = list(caches or dict.fromkeys(r.cache for r in rows))
    by = {(r.workload, r.pool, r.cache): r for r in rows}
    fig, axes = plt.subplots(2, len(workloads), figsize=(MAX_WIDTH_IN, 4.6), sharey="row", squeeze=False)
    x = np.arange(len(pools))
    w = 0.84 / len(caches)
    for j, name in enumerate(workloads):
        top, bottom = axes[0, j], axes[1, j]
        for k, cache in enumerate(caches):
            runs = [by[(name, pool, cache)] for pool in pools]
            at = x + (k - (len(caches) - 1) / 2) * w
            colour = CACHE_COLOURS.get(cache)
            top.bar(at, [100 * r.hit_rate for r in runs], w, color=colour)
            asked = [r.evicted_tokens - r.over_evicted for r in runs]
            bottom.bar(at, asked, w, color=colour)
            bottom.bar(at, [r.over_evicted for r in runs], w, bottom=asked, color=colour, alpha=0.45,
                       hatch="////", edgecolor="white", lw=0)
        top.set_title(name.replace("_", " "), fontsize=8.5)
        top.set_xticks(x, [""] * len(pools))
        bottom.set_xticks(x, pools, fontsize=7.5)
        bottom.set_xlabel(" / ".join(str(by[(name, p, caches[0])].num_pages) for p in pools) + " pages",
                          fontsize=7.5)
        for ax in (top, bottom):
            ax.tick_params(labelsize=7.5, length=2)
            ax.spines[["top", "right"]].set_visible(False)
    axes[0, 0].set_ylabel("hit rate (% of\nprompt tokens)", fontsize=8)
    axes[1, 0].set_ylabel("evicted tokens", fontsize=8)
    handles = [Patch(color=CACHE_COLOURS.get(c), label=c) for c in caches]
    handles.append(Patch(fc="#999999", alpha=0.45, hatch="////", ec="white", label="evicted, asked by no allocation"))
    fig.suptitle("the same seeded workloads on each cache, page size 4; pools tight / half / ample",
                 fontsize=9, y=0.995)
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=7.5, frameon=False,
               bbox_to_anchor=(0.5, 0.96))
    fig.tight_layout(rect=(0, 0, 1, 0.935), w_pad=0.6)
    return fig


def draw_lookup_cost(costs, ax=None):
    """Median host microseconds of one ``match_prefix`` by prompt length, both caches
    (:func:`kvlab.serving.sim.compare.lookup_cost`). Returns the Axes."""
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
