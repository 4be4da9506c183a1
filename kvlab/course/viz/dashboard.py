"""Pictures of a simulator run (chapter 07): memory over time, hit rate, evictions, page-size
comparisons, and one step seen four ways (page table, free list, cache tree, regions).

Memory colours (the same in every picture)::

    free                 light grey   on the free list
    cached (evictable)   blue         in the prefix cache, no running request uses it
    cached (locked)      orange       in the prefix cache, locked by a running request
    private              purple       a running request's own pages (not cached)
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from .legibility import MAX_WIDTH_IN

MEMORY_COLOURS = {
    "free": "#e0e0e0",
    "cached_evictable": "#9ecae1",
    "cached_locked": "#fdae6b",
    "private": "#9e9ac8",
}
MEMORY_LABELS = {
    "free": "free",
    "cached_evictable": "cached (evictable)",
    "cached_locked": "cached (locked by a request)",
    "private": "private to a running request",
}
VIEWS = ("page table", "free list", "cache tree", "regions")


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def memory_over_time(timeline, ax=None, *, unit: str = "pages", legend: bool = True, title: str | None = None):
    """Stacked areas: where every page is at the end of each step. ``unit="slots"`` multiplies
    by the page size (to compare runs with different page sizes on one scale)."""
    ax = _axes(ax, (8, 3))
    mult = timeline.page_size if unit == "slots" else 1
    steps = np.arange(len(timeline))
    layers = [np.array([getattr(s.memory, k) for s in timeline.steps]) * mult
              for k in ("private", "cached_locked", "cached_evictable", "free")]
    keys = ["private", "cached_locked", "cached_evictable", "free"]
    ax.stackplot(steps, *layers, colors=[MEMORY_COLOURS[k] for k in keys],
                 labels=[MEMORY_LABELS[k] for k in keys], step="post")
    ax.set_xlim(0, max(len(timeline) - 1, 1))
    ax.set_ylim(0, timeline.num_pages * mult)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(title or f"memory over time ({timeline.workload}, P={timeline.page_size}, "
                 f"{timeline.num_pages} pages)", fontsize=9)
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return ax


def hit_rate_over_time(timeline, ax=None, *, title: str | None = None):
    """Bars: prompt tokens admitted per step, split into cache hits and computed; line: the
    cumulative hit rate (right axis)."""
    ax = _axes(ax, (8, 2.6))
    steps = np.arange(len(timeline))
    hit = np.array(timeline.series("hit_tokens"))
    prompt = np.array(timeline.series("prompt_tokens"))
    ax.bar(steps, prompt - hit, color="#bdbdbd", label="prompt tokens computed", width=0.9)
    ax.bar(steps, hit, bottom=prompt - hit, color="#74c476", label="prompt tokens hit in the cache", width=0.9)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("tokens admitted", fontsize=8)
    ax.tick_params(labelsize=7)
    twin = ax.twinx()
    twin.plot(steps, timeline.cumulative_hit_rate(), color="#238b45", lw=1.5, label="cumulative hit rate")
    twin.set_ylim(0, 1)
    twin.set_ylabel("hit rate", fontsize=8)
    twin.tick_params(labelsize=7)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or f"prefix hits (hit rate {timeline.summary().hit_rate:.0%})", fontsize=9)
    return ax


def evictions_over_time(timeline, ax=None, *, title: str | None = None):
    """Tokens evicted per step (bars), with preemptions and aborts marked."""
    ax = _axes(ax, (8, 2.2))
    steps = np.arange(len(timeline))
    ax.bar(steps, timeline.series("evicted_tokens"), color="#de2d26", width=0.9, label="tokens evicted")
    top = max(max(timeline.series("evicted_tokens"), default=0), 1)
    for s in timeline.steps:
        if s.preempted:
            ax.plot(s.step, top * 1.05, "v", color="#54278f", ms=6)
        if s.aborted:
            ax.plot(s.step, top * 1.05, "x", color="#636363", ms=6)
    from matplotlib.lines import Line2D

    handles = ax.get_legend_handles_labels()[0] + [
        Line2D([], [], marker="v", ls="", color="#54278f", label="preemption"),
        Line2D([], [], marker="x", ls="", color="#636363", label="abort")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_ylim(0, top * 1.2)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("tokens", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(title or "evictions", fontsize=9)
    return ax


def timeline_dashboard(timeline, *, step: int | None = None):
    """Memory, hits and evictions of one run, stacked on a shared step axis. Returns the Figure.

    ``step``: draw a vertical line there (the explorer's current step).
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(MAX_WIDTH_IN, 6.4), sharex=True,
                             gridspec_kw=dict(height_ratios=[1.4, 1, 0.8]))
    memory_over_time(timeline, axes[0])
    hit_rate_over_time(timeline, axes[1])
    evictions_over_time(timeline, axes[2])
    for ax in axes[:2]:
        ax.set_xlabel("")
    if step is not None:
        for ax in axes:
            ax.axvline(step, color="black", lw=0.8, ls=":")
    fig.tight_layout()
    return fig


def compare_page_sizes(timelines: Mapping[int, object]):
    """The same workload at several page sizes (``{page_size: timeline}``), side by side.

    Top row: memory over time in token slots (same scale for every page size). Bottom: what
    the page size buys and costs -- prompt tokens hit in the cache vs slots reserved in
    part-filled pages (mean over steps). Returns the Figure.
    """
    import matplotlib.pyplot as plt

    from matplotlib.patches import Patch

    sizes = list(timelines)
    fig = plt.figure(figsize=(MAX_WIDTH_IN, 6.4))
    grid = fig.add_gridspec(3, len(sizes), height_ratios=[1.3, 0.18, 1])
    top = max(t.num_pages * t.page_size for t in timelines.values())
    for i, P in enumerate(sizes):
        ax = fig.add_subplot(grid[0, i])
        memory_over_time(timelines[P], ax, unit="slots", legend=False,
                         title=f"P = {P}: {timelines[P].num_pages} pages")
        ax.set_ylim(0, top)
        if i:
            ax.set_ylabel("")
    keys = ("private", "cached_locked", "cached_evictable", "free")
    legend_ax = fig.add_subplot(grid[1, :])
    legend_ax.set_axis_off()
    legend_ax.legend(handles=[Patch(fc=MEMORY_COLOURS[k], label=MEMORY_LABELS[k]) for k in keys],
                     loc="center", ncol=4, fontsize=7.5, frameon=False)
    summaries = {P: timelines[P].summary() for P in sizes}
    ax = fig.add_subplot(grid[2, :])
    x = np.arange(len(sizes))
    w = 0.38
    hits = [summaries[P].hit_rate * 100 for P in sizes]
    waste = [summaries[P].mean_wasted_slots for P in sizes]
    b1 = ax.bar(x - w / 2, hits, w, color="#74c476", label="prompt tokens hit (%)")
    twin = ax.twinx()
    b2 = twin.bar(x + w / 2, waste, w, color="#fb6a4a", label="slots reserved but empty (mean per step)")
    for bars, axis, fmt in ((b1, ax, "{:.0f}%"), (b2, twin, "{:.0f}")):
        for bar in bars:
            axis.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), fmt.format(bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels([f"page size {P}" for P in sizes], fontsize=8)
    ax.set_ylabel("hit rate (%)", fontsize=8)
    twin.set_ylabel("empty slots in part-filled pages", fontsize=8)
    ax.set_ylim(0, max(hits + [1]) * 1.25)
    twin.set_ylim(0, max(waste + [1]) * 1.25)
    ax.legend([b1, b2], [b1.get_label(), b2.get_label()], loc="upper center", fontsize=7,
              frameon=False, ncol=2)
    name = next(iter(timelines.values())).workload
    ax.set_title(f"{name}: bigger pages match less of a shared prefix and leave more slots empty",
                 fontsize=9)
    fig.tight_layout()
    return fig


# --- one step, four views --------------------------------------------------------------


def _page_owners(record, num_pages: int, page_size: int) -> np.ndarray:
    """Per page: 0 free, 1 cached evictable, 2 cached locked, 3 private (from a snapshot)."""
    kind = np.full(num_pages, 3, dtype=np.int64)   # whatever is left belongs to a running request
    for node in record.tree.nodes:
        for p in node.page_ids:
            kind[p] = 2 if node.ref_count > 0 else 1
    for p in record.free_pages:
        kind[p] = 0
    return kind


def step_free_list(record, num_pages: int, page_size: int, ax=None):
    """Every page as a cell, coloured by owner; free pages numbered in free-list order
    (the allocator takes them from 1 upwards)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    kind = _page_owners(record, num_pages, page_size)
    per_row = min(num_pages, 16 if num_pages <= 64 else 32)
    n_rows = -(-num_pages // per_row)
    ax = _axes(ax, (min(MAX_WIDTH_IN, 0.5 * per_row + 1), 0.55 * n_rows + 1.2))
    colours = [MEMORY_COLOURS[k] for k in ("free", "cached_evictable", "cached_locked", "private")]
    order = {p: i + 1 for i, p in enumerate(record.free_pages)}
    for p in range(num_pages):
        r, c = divmod(p, per_row)
        ax.add_patch(Rectangle((c, -r), 0.95, 0.9, fc=colours[kind[p]], ec="#555555", lw=0.5))
        ax.text(c + 0.47, -r + 0.62, f"p{p}", ha="center", va="center", fontsize=7, color="#333333")
        if p in order and num_pages <= 96:
            ax.text(c + 0.47, -r + 0.25, f"#{order[p]}", ha="center", va="center", fontsize=7,
                    weight="bold")
    ax.set_xlim(-0.1, per_row)
    ax.set_ylim(-n_rows + 0.8, 1.0)
    ax.set_axis_off()
    ax.set_title(f"step {record.step}: every page by owner; pN = page N, #n = its place in the free "
                 f"list ({record.memory.free} free)", fontsize=9)
    ax.legend(handles=[Patch(fc=c, ec="#555555", label=MEMORY_LABELS[k])
                       for k, c in zip(("free", "cached_evictable", "cached_locked", "private"), colours)],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=7, frameon=False)
    plt.setp(ax.get_children(), clip_on=False)
    return ax


def step_page_table(record, num_pages: int, page_size: int, ax=None):
    """The page table at the end of the step: one row per request slot (labelled by rid)."""
    from .heatmap import page_table_heatmap

    table = record.page_table
    used = (table >= 0).any(0).nonzero()
    cols = int(used.max()) + 1 if used.numel() else page_size
    cols = min(table.shape[1], -(-max(cols, 1) // page_size) * page_size)
    ax = _axes(ax, (min(MAX_WIDTH_IN, 0.2 * cols + 3), 0.45 * table.shape[0] + 1.4))
    page_table_heatmap(table, page_size, cols=slice(0, cols), ax=ax, page_range=(0, num_pages - 1),
                       title=f"step {record.step}: page table (P={page_size})")
    ax.set_yticks(range(table.shape[0]))
    ax.set_yticklabels([f"row {r}: " + (f"req {rid}" if rid >= 0 else "free")
                        for r, rid in enumerate(record.row_rids)], fontsize=7)
    return ax


def step_tree(record, previous=None, ax=None, fontsize: float = 7.0):
    """The prefix cache at the end of the step (new nodes green-edged, evicted ones faded),
    with a line saying how to read a node."""
    from .tree import draw_tree

    n = max(len(record.tree.nodes), 1)
    ax = _axes(ax, (min(MAX_WIDTH_IN, 2.0 + 1.6 * n), 3.6))
    if not record.tree.nodes and previous is None:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "the prefix cache is empty", ha="center", va="center", fontsize=9)
        ax.set_title(f"step {record.step}: cache tree", fontsize=9)
        return ax
    draw_tree(record.tree, ax, previous=previous.tree if previous is not None else None,
              title=f"step {record.step}: prefix cache — {record.cache_evictable} evictable, "
                    f"{record.cache_protected} locked tokens", fontsize=fontsize, explain=True)
    return ax


def step_regions(record, ax=None):
    """The regions of the last ``cache_req`` up to this step (or a note if none happened yet)."""
    from .regions import region_bar

    regions = record.last_regions
    if regions is None:
        ax = _axes(ax, (8, 1.6))
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no cache_req yet", ha="center", va="center", fontsize=9)
        return ax
    ax = _axes(ax, (min(MAX_WIDTH_IN, 2.5 + 0.3 * max(regions.req_cached_len, 4)), 2.0))
    what = "finished" if regions.finished else "unfinished"
    region_bar(regions, ax, label=f"req {record.last_regions_rid}",
               show_slots=regions.req_cached_len <= 32)
    ax.set_title(f"step {record.last_regions_step}: cache_req(req {record.last_regions_rid}, {what})",
                 fontsize=9, pad=22)
    return ax


def draw_step(timeline, step: int, view: str = "page table", ax=None, fontsize: float = 7.0):
    """One of :data:`VIEWS` for ``timeline[step]``; returns the Axes."""
    if view not in VIEWS:
        raise ValueError(f"view: one of {VIEWS} (got {view!r})")
    if not 0 <= step < len(timeline):
        raise ValueError(f"step: 0 <= step < {len(timeline)} (got {step})")
    record = timeline[step]
    if view == "page table":
        return step_page_table(record, timeline.num_pages, timeline.page_size, ax)
    if view == "free list":
        return step_free_list(record, timeline.num_pages, timeline.page_size, ax)
    if view == "cache tree":
        return step_tree(record, timeline[step - 1] if step > 0 else None, ax, fontsize)
    return step_regions(record, ax)


def step_figure(timeline, step: int, view: str = "page table"):
    """A Figure holding one view of one step, with a line of what happened at that step."""
    import matplotlib.pyplot as plt

    sizes = {"page table": (MAX_WIDTH_IN, 3.6), "free list": (MAX_WIDTH_IN, 3.4), "cache tree": (MAX_WIDTH_IN, 4.4),
             "regions": (MAX_WIDTH_IN, 2.6)}
    fig, ax = plt.subplots(figsize=sizes[view])
    draw_step(timeline, step, view, ax, fontsize=8)
    fig.text(0.01, 0.005, describe_step(timeline[step]), fontsize=7.5, ha="left", va="bottom",
             color="#333333")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def describe_step(record) -> str:
    """One line: what happened at this step."""
    parts = []
    for name in ("arrived", "admitted", "finished", "aborted", "preempted"):
        rids = getattr(record, name)
        if rids:
            parts.append(f"{name} {', '.join(map(str, rids))}")
    if record.decoded:
        parts.append(f"decoded {len(record.decoded)}")
    if record.hit_tokens:
        parts.append(f"hit {record.hit_tokens} tok")
    if record.evicted_tokens:
        parts.append(f"evicted {record.evicted_tokens} tok")
    m = record.memory
    parts.append(f"pages: {m.free} free, {m.cached_evictable} cached evictable, {m.cached_locked} cached "
                 f"locked, {m.private} private")
    return f"step {record.step}: " + "; ".join(parts)


def step_grid(timeline, steps: Sequence[int], view: str = "page table"):
    """Several steps of one view in a column (a static stand-in for the explorer's slider)."""
    import matplotlib.pyplot as plt

    heights = {"page table": 2.4, "free list": 2.4, "cache tree": 3.6, "regions": 1.8}[view]
    fig, axes = plt.subplots(len(steps), 1, figsize=(MAX_WIDTH_IN, heights * len(steps)), squeeze=False)
    for ax, s in zip(axes[:, 0], steps):
        draw_step(timeline, s, view, ax)
    fig.tight_layout()
    return fig
