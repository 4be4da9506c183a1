"""Pictures of the radix prefix cache (chapter 05): the tree, and how it changes step by step.

Each node is a box labelled with its key cut into pages, the physical pages that hold its
KV, its ``ref_count`` and its last access (the LRU counter)::

                     root
                       |
                 [1 2|3 4]          <- key, one | per page boundary
                 pages 4,5          <- physical pages of the node's slots
                 ref 1 · t 3        <- locked once; last touched at tick 3
                 /        \\
           [5 6]          [7 8]

Colours: locked nodes (``ref_count > 0``) are orange; unlocked ones (evictable) blue. Where
nodes are too close for their whole labels, keys and page lists are shortened with ``…``
(first pages, then the last), so that no two boxes overlap.
Compared with an earlier snapshot (:meth:`RadixPrefixCache.snapshot
<kvlab.prefix.radix_cache.RadixPrefixCache.snapshot>`, plain data the cache hands out), new nodes get
a green border and nodes that are gone (evicted) are drawn faded with a dashed border.
"""
from __future__ import annotations

from typing import Sequence

from ...prefix.radix_node import NodeInfo, TreeSnapshot
from .legibility import MAX_WIDTH_IN

__all__ = ["NODE_KEY", "NodeInfo", "TreeSnapshot", "draw_tree", "draw_tree_steps", "tree_legend"]

LOCKED = "#fdae6b"
UNLOCKED = "#c6dbef"
NEW_EDGE = "#2ca02c"
GHOST = "#d9d9d9"
#: How to read a node's box (drawn under a tree with ``explain=True``, and by :func:`tree_legend`).
NODE_KEY = ("a box is a node: its tokens, | between pages · pages: the physical pages that hold them\n"
            "ref: locks on it (ref_count; > 0 = locked, never evicted) · t: its last access on the "
            "LRU clock (the oldest unlocked leaf is evicted first)")
#: Label shapes from whole to shortest: (pages of the key, tokens per page, page ids) shown.
_LABEL_LIMITS = ((4, 8, 4), (3, 4, 3), (2, 4, 3), (1, 4, 2), (1, 2, 1))


def _fmt_pages(pages: Sequence[tuple[int, ...]], limit: int = 4, tokens: int = 8) -> str:
    pages = [p if len(p) <= tokens else tuple(p[:tokens]) + ("…",) for p in pages]
    if len(pages) > limit:
        head = max(1, limit - 1)
        pages = list(pages[:head]) + [("…",)] + (list(pages[-1:]) if limit > 1 else [])
    return "[" + "|".join(" ".join(str(t) for t in p) for p in pages) + "]"


def _fmt_ids(ids: Sequence[int], limit: int = 4) -> str:
    ids = list(ids)
    if len(ids) > limit:
        return ",".join(map(str, ids[:max(1, limit - 2)])) + ",…," + str(ids[-1])
    return ",".join(map(str, ids))


def _label(n: NodeInfo, ghost: bool, limits: tuple[int, int, int]) -> str:
    key_pages, tokens, ids = limits
    if ghost:
        return f"{_fmt_pages(n.pages, key_pages, tokens)}\nevicted"
    return (f"{_fmt_pages(n.pages, key_pages, tokens)}\npages {_fmt_ids(n.page_ids, ids)}\n"
            f"ref {n.ref_count} · t {n.last_access}")


def _label_width_pt(label: str, fontsize: float) -> float:
    """About how wide a box of this label is (DejaVu Sans: ~0.62 em per character, plus padding)."""
    return max(len(line) for line in label.split("\n")) * fontsize * 0.62 + 0.7 * fontsize


def _fitting_limits(nodes, ghost_ids, pos, xlim: tuple[float, float], points_per_unit: float,
                    fontsize: float) -> tuple[int, int, int]:
    """The longest label shape whose boxes stay inside the axes and clear of their neighbours
    at the same depth (boxes at different depths are a row apart)."""
    by_depth: dict[int, list] = {}
    for n in nodes:
        by_depth.setdefault(pos[n.uid][1], []).append(n)
    for limits in _LABEL_LIMITS:
        fits = True
        for row in by_depth.values():
            row = sorted(row, key=lambda n: pos[n.uid][0])
            xs = [pos[n.uid][0] for n in row]
            half = [_label_width_pt(_label(n, n.uid in ghost_ids, limits), fontsize) / 2 for n in row]
            if (xs[0] - xlim[0]) * points_per_unit < half[0] or (xlim[1] - xs[-1]) * points_per_unit < half[-1]:
                fits = False
            if any(ha + hb + 3 > (xb - xa) * points_per_unit
                   for xa, xb, ha, hb in zip(xs, xs[1:], half, half[1:])):
                fits = False
        if fits:
            return limits
    return _LABEL_LIMITS[-1]


def _layout(nodes: Sequence[NodeInfo]) -> dict[int | None, tuple[float, int]]:
    """x by leaf order (depth-first, children sorted by key), y by depth; root is ``None``."""
    children: dict[int | None, list[NodeInfo]] = {}
    for n in nodes:
        children.setdefault(n.parent, []).append(n)
    for kids in children.values():
        kids.sort(key=lambda n: n.pages)
    pos: dict[int | None, tuple[float, int]] = {}
    next_x = [0.0]

    def place(uid, depth):
        kids = children.get(uid, [])
        if not kids:
            pos[uid] = (next_x[0], depth)
            next_x[0] += 1.0
            return
        for k in kids:
            place(k.uid, depth + 1)
        xs = [pos[k.uid][0] for k in kids]
        pos[uid] = ((min(xs) + max(xs)) / 2, depth)

    place(None, 0)
    return pos


def draw_tree(tree, ax=None, *, previous: TreeSnapshot | None = None, title: str | None = None,
              highlight: Sequence[int] = (), fontsize: float = 8.0, explain: bool = False):
    """Draw a cache (or a ``cache.snapshot()``) on ``ax``; return the Axes.

    ``previous``: an earlier snapshot; nodes new since then get a green border, nodes gone
    since then are drawn faded ("evicted"). ``highlight``: uids to outline in red (e.g. the
    node a handle points at). ``explain``: write :data:`NODE_KEY` under the tree.
    """
    import matplotlib.pyplot as plt

    # a cache, a TreeSnapshot, or chapter 11's HashSnapshot (one-page nodes; t = place in the queue)
    snap = tree.snapshot() if hasattr(tree, "snapshot") else tree
    now = {n.uid for n in snap.nodes}
    ghosts: list[NodeInfo] = []
    if previous is not None:
        alive = set(now)
        for n in previous.nodes:  # parents come before children in a snapshot
            if n.uid not in now and (n.parent is None or n.parent in alive):
                ghosts.append(n)
                alive.add(n.uid)
    old = {n.uid for n in previous.nodes} if previous is not None else now
    all_nodes = list(snap.nodes) + ghosts
    pos = _layout(all_nodes)
    ghost_ids = {g.uid for g in ghosts}

    if ax is None:
        width = max(3.0, 1.9 * max(1.0, max(x for x, _ in pos.values()) + 1))
        depth = max(d for _, d in pos.values())
        _, ax = plt.subplots(figsize=(min(width, MAX_WIDTH_IN), 1.0 + 1.1 * (depth + 1)))
    ax.set_axis_off()
    xs = [x for x, _ in pos.values()]
    depth = max(d for _, d in pos.values())
    xlim = (min(xs) - 0.6, max(xs) + 0.6)
    ax.set_xlim(*xlim)
    ax.set_ylim(-depth - 0.55, 0.45)
    points_per_unit = ax.get_position().width * ax.figure.get_figwidth() * 72 / (xlim[1] - xlim[0])
    limits = _fitting_limits(all_nodes, ghost_ids, pos, xlim, points_per_unit, fontsize)

    def y(d):  # depth 0 at the top
        return -d

    for n in all_nodes:  # edges first, under the boxes
        (x0, d0), (x1, d1) = pos[n.parent], pos[n.uid]
        ax.plot([x0, x1], [y(d0) - 0.12, y(d1) + 0.3], color="#bbbbbb" if n.uid in ghost_ids else "#555555",
                lw=1, ls="--" if n.uid in ghost_ids else "-", zorder=1)
    rx, rd = pos[None]
    ax.text(rx, y(rd), "root", ha="center", va="center", fontsize=fontsize,
            bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#555555"), zorder=3)
    for n in all_nodes:
        x, d = pos[n.uid]
        ghost = n.uid in ghost_ids
        label = _label(n, ghost, limits)
        fc = GHOST if ghost else (LOCKED if n.ref_count > 0 else UNLOCKED)
        ec = "#999999" if ghost else (NEW_EDGE if n.uid not in old else "#333333")
        if n.uid in highlight:
            ec = "#d62728"
        ax.text(x, y(d), label, ha="center", va="center", fontsize=fontsize,
                color="#888888" if ghost else "black", zorder=3, alpha=0.8 if ghost else 1.0,
                bbox=dict(boxstyle="round,pad=0.35", fc=fc, ec=ec,
                          lw=2.0 if (ec in (NEW_EDGE, "#d62728")) else 1.0,
                          ls="--" if ghost else "-"))
    if title is None:
        kind = "hash cache" if hasattr(snap, "free_queue") else "radix cache"
        title = (f"{kind} (P={snap.page_size}): {snap.evictable_size} evictable, "
                 f"{snap.protected_size} locked tokens")
    ax.set_title(title, fontsize=fontsize + 1)
    if explain:
        ax.text(0.5, -0.01, NODE_KEY, transform=ax.transAxes, ha="center", va="top",
                fontsize=max(7.0, fontsize - 1), color="#444444")
    return ax


def tree_legend(target) -> None:
    """A small legend for the colours of :func:`draw_tree`, on an Axes or a Figure."""
    from matplotlib.patches import Patch

    handles = [Patch(fc=UNLOCKED, ec="#333333", label="unlocked (evictable)"),
               Patch(fc=LOCKED, ec="#333333", label="locked (ref_count > 0)"),
               Patch(fc="white", ec=NEW_EDGE, lw=2, label="new this step"),
               Patch(fc=GHOST, ec="#999999", ls="--", label="evicted this step")]
    target.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=4,
                  fontsize=7.5, frameon=False, title=NODE_KEY, title_fontsize=7.5)


def draw_tree_steps(steps: Sequence[tuple[str, TreeSnapshot]], *, ncols: int | None = None,
                    panel_width: float = 4.2, panel_height: float = 2.7):
    """A row (or grid) of small trees, one per ``(title, snapshot)``; each compared with the
    one before it, so new and evicted nodes stand out. At most as many columns as fit in an
    output area (``MAX_WIDTH_IN``). Returns the Figure."""
    import matplotlib.pyplot as plt

    n = len(steps)
    ncols = min(ncols or n, max(1, int(MAX_WIDTH_IN // panel_width)))
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_width * ncols, panel_height * nrows),
                             squeeze=False)
    prev = None
    for i, (title, snap) in enumerate(steps):
        draw_tree(snap, axes[i // ncols][i % ncols], previous=prev, title=title, fontsize=7)
        prev = snap
    for j in range(n, nrows * ncols):
        axes[j // ncols][j % ncols].set_axis_off()
    fig.tight_layout(rect=(0, 0.75 / fig.get_figheight(), 1, 1))  # room for the legend and key
    tree_legend(fig)
    return fig
