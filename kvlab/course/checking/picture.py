"""Pictures of a failed check: expected vs got, with the wrong cells outlined.

Used by every "your turn" cell of the course (chapters 01-06): when a checker fails inside
a notebook, :func:`kvlab.course.checking.core.run_cases` calls :func:`show_failure` before re-raising,
so the learner sees *where* the answer is wrong as well as reading it::

    expected │ 4  5  6  7 │ 8  9 10 11 │ 12 ...      one row of cells per output,
    got      │ 4  5  6  7 │ 9 10 11 12 │ 12 ...      wrong cells outlined in red,
               request 0    request 1                the checker's labels underneath

A flat output (slots, token indices) is drawn as two strips; a table (the page table) as two
heatmaps side by side. Outside a notebook nothing is drawn: the message says it all.
"""
from __future__ import annotations

import textwrap
from typing import Sequence

import torch

from ..viz.legibility import MAX_WIDTH_IN
from . import cells

#: Cells drawn at most per strip; a longer output shows a window around the first wrong cell.
#: (32 cells of an output area's width keep a 3-digit number at 7 pt inside its cell.)
MAX_CELLS = 32
#: Columns of a table beyond which its cells get colours but no numbers.
MAX_ANNOTATED_COLUMNS = 16


def front_end_present() -> bool:
    """True inside a Jupyter kernel (something can display a figure), False in plain Python."""
    return cells.in_kernel()


def show_failure(err) -> bool:
    """Display the failure picture of ``err`` when in a notebook. Returns whether it drew one."""
    if not front_end_present():
        return False
    fig = failure_figure(err)
    if fig is None:
        return False
    import matplotlib.pyplot as plt
    from IPython.display import display

    display(fig)
    plt.close(fig)
    return True


def failure_figure(err):
    """A matplotlib Figure of expected vs got for a :class:`CheckFailed`, or None if it has no data."""
    if not isinstance(err.expected, torch.Tensor) or not isinstance(err.got, torch.Tensor):
        writes = getattr(err, "band_writes", None)
        return band_figure(writes) if writes else None
    exp = err.expected.detach().flatten().cpu().to(torch.int64)
    got = err.got.detach().flatten().cpu().to(torch.int64)
    shape = tuple(err.shape or ())
    title = str(err.args[0]).splitlines()[0] if err.args else "check failed"
    if len(shape) == 2 and exp.numel() == got.numel() == shape[0] * shape[1] and exp.numel():
        return table_figure(exp.reshape(shape), got.reshape(shape), title=title,
                            what=err.what or "table", page_size=getattr(err, "page_size", None))
    return strip_figure(exp, got, segments=err.segments, title=title, what=err.what or "output")


def _window(n_exp: int, n_got: int, wrong: Sequence[int]) -> tuple[int, int]:
    n = max(n_exp, n_got)
    if n <= MAX_CELLS:
        return 0, n
    first = wrong[0] if wrong else min(n_exp, n_got)
    lo = max(0, min(first - MAX_CELLS // 4, n - MAX_CELLS))
    return lo, lo + MAX_CELLS


def strip_figure(expected: torch.Tensor, got: torch.Tensor, *, segments=(), title: str = "",
                 what: str = "output"):
    """Two strips of cells, expected over got; cells that differ outlined in red."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n_exp, n_got = expected.numel(), got.numel()
    wrong = [i for i in range(max(n_exp, n_got))
             if i >= n_exp or i >= n_got or int(expected[i]) != int(got[i])]
    lo, hi = _window(n_exp, n_got, wrong)
    width = hi - lo
    fig, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, 1.2 + 0.36 * max(width, 4)), 2.1))
    rows = [("expected", expected), ("got", got)]
    values = torch.cat([expected, got]) if n_exp + n_got else torch.zeros(1)
    vmin, vmax = int(values.min()), int(values.max())
    cmap = plt.get_cmap("viridis")
    for r, (name, vals) in enumerate(rows):
        y = 1 - r
        for i in range(lo, hi):
            x = i - lo
            if i >= vals.numel():
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor="white", edgecolor="#bbbbbb",
                                       hatch="//", lw=0.5))
                continue
            v = int(vals[i])
            shade = (v - vmin) / (vmax - vmin) if vmax > vmin else 0.5
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=cmap(0.15 + 0.7 * shade),
                                   edgecolor="white", lw=0.5))
            if width <= MAX_CELLS:  # a long number stands on end rather than shrinking
                ax.text(x + 0.5, y + 0.5, str(v), ha="center", va="center", fontsize=7,
                        rotation=0 if len(str(v)) <= 3 else 90, color="white")
    for i in wrong:
        if lo <= i < hi:
            ax.add_patch(Rectangle((i - lo, 0), 1, 2, fill=False, edgecolor="red", lw=2))
    for seg in segments or ():
        a, b = max(seg.start, lo), min(seg.end, hi)
        if a >= b:
            continue
        ax.plot([a - lo + 0.1, b - lo - 0.1], [-0.15, -0.15], color="black", lw=1)
        ax.text((a + b) / 2 - lo, -0.3, seg.label, ha="center", va="top", fontsize=7)
    ax.set_xlim(0, width)
    ax.set_ylim(-0.9 if segments else -0.1, 2.05)
    ax.set_yticks([1.5, 0.5], ["expected", "got"])
    step = max(1, width // 16)
    ax.set_xticks([x + 0.5 for x in range(0, width, step)],
                  [str(lo + x) for x in range(0, width, step)], fontsize=7)
    ax.set_xlabel(f"index in {what}" + (f" (showing {lo}..{hi - 1} of "
                                        f"{max(n_exp, n_got)})" if (lo, hi) != (0, max(n_exp, n_got))
                                        else "") + f"; {len(wrong)} wrong, outlined in red",
                  fontsize=8)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="x", length=0)
    ax.set_title(textwrap.fill(title, int(fig.get_figwidth() * 13)), fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def table_figure(expected: torch.Tensor, got: torch.Tensor, *, title: str = "",
                 what: str = "table", page_size: int | None = None):
    """Two heatmaps (expected, got) of a 2-D output; cells that differ outlined in red.

    With ``page_size`` (a page table), the course's page-table heatmap draws each side
    (colour = physical page); otherwise a plain heatmap of the values.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows, cols = expected.shape
    wrong = (expected != got).nonzero().tolist()
    if page_size:
        try:
            return _page_table_pair(expected, got, page_size, title=title, n_wrong=len(wrong))
        except Exception:  # noqa: BLE001 - fall back to the plain heatmap below
            pass
    vmin = int(min(expected.min(), got.min()))
    vmax = int(max(expected.max(), got.max()))
    fig, axes = plt.subplots(1, 2, figsize=(min(MAX_WIDTH_IN, 2 + 0.5 * cols * 2), 1.2 + 0.35 * rows),
                             squeeze=False)
    for ax, name, vals in zip(axes[0], ("expected", "got"), (expected, got)):
        ax.imshow(vals.numpy(), cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto",
                  interpolation="nearest")
        if rows * cols <= 400 and cols <= MAX_ANNOTATED_COLUMNS:
            for r in range(rows):
                for c in range(cols):
                    ax.text(c, r, str(int(vals[r, c])), ha="center", va="center", fontsize=7,
                            color="white")
        for r, c in wrong:
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
        ax.set_title(f"{name} {what}", fontsize=9)
        ax.set_xlabel("column (logical token position)", fontsize=8)
        ax.set_ylabel("row", fontsize=8)
    fig.suptitle(textwrap.fill(f"{title}  ({len(wrong)} wrong cells, outlined in red)",
                               int(fig.get_figwidth() * 13)), fontsize=9, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def _page_table_pair(expected: torch.Tensor, got: torch.Tensor, page_size: int, *, title: str,
                     n_wrong: int):
    import matplotlib.pyplot as plt

    from ..viz import page_table_heatmap

    rows, cols = expected.shape
    mask = (expected != got).numpy()
    fig, axes = plt.subplots(1, 2, figsize=(min(MAX_WIDTH_IN, 3 + 0.45 * cols * 2), 1.6 + 0.4 * rows),
                             squeeze=False)
    for ax, name, vals in zip(axes[0], ("expected", "got"), (expected, got)):
        page_table_heatmap(vals, page_size, ax=ax, highlight=mask, title=f"{name} page table",
                           colorbar=False)
    fig.suptitle(textwrap.fill(f"{title}  ({n_wrong} wrong cells, outlined in red)",
                               int(fig.get_figwidth() * 13)), fontsize=9, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def band_figure(writes, *, shown_data: int = 6, shown_band: int = 12):
    """Each argument written outside: its last (or first) data cells, then the guard band,
    with the overwritten band cells in red. ``writes``: :class:`kvlab.course.checking.guards.BandWrite`s."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(len(writes), 1, figsize=(MAX_WIDTH_IN, 0.3 + 1.1 * len(writes)), squeeze=False)
    for ax, w in zip(axes[:, 0], writes):
        far = max(w.distances)
        n_band = min(max(shown_band, far + 1), 40)
        n_data = min(shown_data, w.length)
        hit = set(w.distances)
        # x positions: data cells at 0..n_data-1 then band at n_data..; mirrored for "before"
        for k in range(n_data):
            x = k if w.side == "after" else n_band + k
            ax.add_patch(Rectangle((x, 0), 1, 1, facecolor="#4c72b0", edgecolor="white"))
        for d in range(1, n_band + 1):
            x = n_data + d - 1 if w.side == "after" else n_band - d
            color = "#d62728" if d in hit else "#dddddd"
            ax.add_patch(Rectangle((x, 0), 1, 1, facecolor=color, edgecolor="white"))
        edge = n_data if w.side == "after" else n_band
        ax.axvline(edge, color="black", lw=2)
        ax.text(edge, 1.15, " end of the data" if w.side == "after" else "start of the data ",
                ha="left" if w.side == "after" else "right", fontsize=8)
        ax.set_xlim(-0.2, n_data + n_band + 0.2)
        ax.set_ylim(-0.1, 1.6)
        ax.set_yticks([])
        ax.set_xticks([])
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
        where = "past the end" if w.side == "after" else "before the start"
        ax.set_title(f"`{w.argument}` ({w.length} elements): {len(w.distances)} write(s) {where}, "
                     f"up to {far} out" + (" (more not shown)" if far > n_band else "")
                     + "  —  blue: data, grey: guard band, red: overwritten",
                     fontsize=9, loc="left")
    fig.tight_layout()
    return fig
