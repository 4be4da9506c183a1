"""Page-table heatmaps (chapter 00 onwards): which physical page backs each logical position.

Picture conventions::

              logical position (columns) ->      | = page boundary (every page_size columns)
    request 0 [ p3 p3 p3 p3 | p7 p7 p7 p7 |  .  .  .  . ]
    request 1 [ p0 p0 p0 .  |  .  .  .  . |  .  .  .  . ]     . = unmapped: drawn blank (white)

Colour = physical page (``slot // page_size``), or, with ``categories=``, a qualitative
colour per category (e.g. part 1/2/3 of an extend in chapter 03). Wide tables are
downsampled by whole pages: one cell per block of columns, showing the block's first
mapped entry; the title says so.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np

from ...alloc.paging import UNMAPPED
from .legibility import MAX_WIDTH_IN

#: Default size limits before downsampling (columns) and before thinning labels.
MAX_COLUMNS = 512
_ANNOTATE_LIMIT = 160  # cells; above this the slot numbers would not be legible
_HIGHLIGHT = "#d62728"


class HeatmapView(NamedTuple):
    """What was drawn: the displayed grid and how it maps back to the page table."""

    values: np.ndarray  # float, NaN where blank; pages (or categories) per displayed cell
    block: int  # table columns per displayed cell (1 = no downsampling)
    row_ids: np.ndarray  # page-table row of each displayed row
    col_start: int  # first table column shown


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, on any device
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _select(a: np.ndarray, rows, cols) -> tuple[np.ndarray, np.ndarray, int]:
    row_ids = np.arange(a.shape[0])
    if rows is not None:
        row_ids = row_ids[rows] if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)
    col_start, col_stop = 0, a.shape[1]
    if cols is not None:
        if isinstance(cols, slice):
            col_start, col_stop, step = cols.indices(a.shape[1])
            if step != 1:
                raise ValueError("cols: a slice with step 1 (downsampling is automatic)")
        else:
            col_stop = min(int(cols), a.shape[1])
    return row_ids, np.arange(col_start, col_stop), col_start


def _first_mapped_per_block(values: np.ndarray, blank: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Downsample columns: each block shows its first non-blank value (blank if it has none)."""
    n_rows, n_cols = values.shape
    n_blocks = -(-n_cols // block)
    pad = n_blocks * block - n_cols
    v = np.pad(values, ((0, 0), (0, pad))).reshape(n_rows, n_blocks, block)
    b = np.pad(blank, ((0, 0), (0, pad)), constant_values=True).reshape(n_rows, n_blocks, block)
    first = np.argmax(~b, axis=2)  # index of the first mapped entry (0 if none)
    picked = np.take_along_axis(v, first[..., None], axis=2)[..., 0]
    return picked, b.all(axis=2)


def page_table_heatmap(page_table, page_size: int, *, rows=None, cols=None, empty=UNMAPPED,
                       ax=None, title: str | None = None, highlight=None, categories=None,
                       category_labels: "Sequence[str] | Mapping[int, str] | None" = None,
                       max_cells: int = MAX_COLUMNS, annotate: bool | None = None,
                       colorbar: bool = True, cmap: str = "viridis", row_label: str = "request slot",
                       page_range: "tuple[int, int] | None" = None):
    """Draw a page table: rows = request slots, columns = logical positions, colour = page.

    page_table: 2-D tensor or array of physical slots. ``empty`` is the value meaning
        "unmapped" (default ``-1``) or a boolean mask (True = unmapped); those cells are blank.
    rows / cols: which rows (slice or list) and columns (slice, or a count from 0) to show.
    highlight: boolean mask, same shape as ``page_table``: those cells get a red outline
        (checkers use it to mark wrong cells).
    categories: int array, same shape: colour by category (qualitative colours + legend,
        names from ``category_labels``) instead of by page; negative = blank.
    max_cells: most columns drawn; wider views show one cell per block of whole pages.
    annotate: write the slot number in each cell (default: when the view is small).
    page_range: (lowest, highest) page of the colour scale, to give several pictures one scale.

    Returns the matplotlib Axes (the drawn grid is in ``ax.kvlab_view``, a :class:`HeatmapView`).
    """
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size: must be an int >= 1 (got {page_size!r})")
    table = _to_numpy(page_table).astype(np.int64)
    if table.ndim != 2:
        raise ValueError(f"page_table: must be 2-D (got shape {table.shape})")
    if isinstance(empty, (int, np.integer)):
        blank_full = table == empty
    else:
        blank_full = _to_numpy(empty).astype(bool)
        if blank_full.shape != table.shape:
            raise ValueError(f"empty: a mask must have the table's shape {table.shape}")
    cat_full = None
    if categories is not None:
        cat_full = _to_numpy(categories).astype(np.int64)
        if cat_full.shape != table.shape:
            raise ValueError(f"categories: must have the table's shape {table.shape}")
        blank_full = blank_full | (cat_full < 0)
    hi_full = None
    if highlight is not None:
        hi_full = _to_numpy(highlight).astype(bool)
        if hi_full.shape != table.shape:
            raise ValueError(f"highlight: must have the table's shape {table.shape}")

    row_ids, col_ids, col_start = _select(table, rows, cols)
    sub = table[np.ix_(row_ids, col_ids)]
    blank = blank_full[np.ix_(row_ids, col_ids)]
    shown = (cat_full[np.ix_(row_ids, col_ids)] if cat_full is not None else sub // page_size)

    # Downsample wide views by whole pages, so a displayed cell never straddles two pages.
    n_cols = shown.shape[1]
    block = 1
    if n_cols > max_cells:
        pages_per_cell = -(-n_cols // (max_cells * page_size))
        block = pages_per_cell * page_size
        shown, blank = _first_mapped_per_block(shown, blank, block)
        sub = _first_mapped_per_block(sub, blank_full[np.ix_(row_ids, col_ids)], block)[0]
    values = np.where(blank, np.nan, shown.astype(float))

    if ax is None:  # at most an output area wide (kvlab.course.viz.legibility)
        width = min(MAX_WIDTH_IN, max(4.0, 0.32 * values.shape[1] + 1.5))
        height = min(9.0, max(1.6, 0.34 * values.shape[0] + 1.0))
        _, ax = plt.subplots(figsize=(width, height))

    if cat_full is not None:
        n_cat = int(np.nanmax(values)) + 1 if np.isfinite(values).any() else 1
        base = plt.get_cmap("tab10")
        cm = ListedColormap([base(i % 10) for i in range(max(n_cat, 1))]).with_extremes(bad="white")
        im = ax.imshow(np.ma.masked_invalid(values), cmap=cm, vmin=-0.5, vmax=max(n_cat, 1) - 0.5,
                       aspect="auto", interpolation="nearest")
        present = sorted({int(v) for v in values[np.isfinite(values)]})
        names = (category_labels if category_labels is not None else {})
        handles = [Patch(facecolor=cm(c), edgecolor="0.3",
                         label=str(names[c]) if (isinstance(names, Mapping) and c in names)
                         or (not isinstance(names, Mapping) and c < len(names)) else f"category {c}")
                   for c in present]
        if handles:
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                      frameon=False)
    else:
        cm = plt.get_cmap(cmap).with_extremes(bad="white")
        finite = values[np.isfinite(values)]
        vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if page_range is not None:
            vmin, vmax = float(page_range[0]), float(page_range[1])
        im = ax.imshow(np.ma.masked_invalid(values), cmap=cm, vmin=vmin, vmax=max(vmax, vmin + 1),
                       aspect="auto", interpolation="nearest")
        if colorbar and finite.size:
            cb = ax.figure.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
            cb.set_label("physical page (slot // page_size)", fontsize=8)
            cb.ax.tick_params(labelsize=7)

    n_rows_shown, n_cells = values.shape
    # Grid frame: a light border round each row; page boundaries as vertical lines.
    ax.set_xlim(-0.5, n_cells - 0.5)
    ax.set_ylim(n_rows_shown - 0.5, -0.5)
    boundaries = []
    if block == 1:
        first_boundary = (-(-col_start // page_size)) * page_size - col_start
        boundaries = list(range(first_boundary, n_cells + 1, page_size)) if page_size > 1 else []
    elif block > page_size:
        boundaries = list(range(0, n_cells + 1))  # every displayed cell is a whole block of pages
    if boundaries and len(boundaries) <= 128:
        for b in boundaries:
            ax.axvline(b - 0.5, color="0.35", lw=0.6 if len(boundaries) < 64 else 0.3)
    for r in range(n_rows_shown + 1):
        if n_rows_shown <= 64:
            ax.axhline(r - 0.5, color="0.8", lw=0.4)

    # Axis ticks in table coordinates: at page starts (about 16 of them), rows by request slot.
    if block == 1:
        first_boundary = (-(-col_start // page_size)) * page_size - col_start
        n_pages = max(1, n_cells // page_size)
        tick_cells = np.arange(first_boundary, n_cells, page_size * max(1, -(-n_pages // 16)))
    else:
        tick_cells = np.arange(0, n_cells, max(1, -(-n_cells // 16)))
    ax.set_xticks(tick_cells)
    ax.set_xticklabels([str(col_start + c * block) for c in tick_cells], fontsize=7)
    row_step = max(1, int(np.ceil(n_rows_shown / 24)))
    ax.set_yticks(np.arange(0, n_rows_shown, row_step))
    ax.set_yticklabels([str(row_ids[i]) for i in range(0, n_rows_shown, row_step)], fontsize=7)
    ax.set_xlabel("logical position (column)" + (f" — one cell per {block} positions" if block > 1 else ""),
                  fontsize=8)
    ax.set_ylabel(row_label, fontsize=8)

    if annotate is None:
        annotate = block == 1 and n_rows_shown * n_cells <= _ANNOTATE_LIMIT
    if annotate:
        for r in range(n_rows_shown):
            for c in range(n_cells):
                if not np.isnan(values[r, c]):
                    rgba = im.cmap(im.norm(values[r, c]))
                    dark = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] < 0.5
                    ax.text(c, r, str(int(sub[r, c])), ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")

    if hi_full is not None:
        hi = hi_full[np.ix_(row_ids, col_ids)]
        if block > 1:
            pad = (-hi.shape[1]) % block
            hi = np.pad(hi, ((0, 0), (0, pad))).reshape(hi.shape[0], -1, block).any(axis=2)
        marks = [Rectangle((c - 0.5, r - 0.5), 1, 1) for r, c in zip(*np.nonzero(hi))]
        if marks:
            ax.add_collection(PatchCollection(marks, facecolor="none", edgecolor=_HIGHLIGHT,
                                              linewidth=1.6, zorder=5))

    full_title = title if title is not None else f"page table (page_size={page_size})"
    if block > 1:
        full_title += f"\n[downsampled: each cell = {block} positions ({block // page_size} page(s)), " \
                      "showing its first mapped entry]"
    ax.set_title(full_title, fontsize=9)
    ax.kvlab_view = HeatmapView(values=values, block=block, row_ids=row_ids, col_start=col_start)
    return ax
