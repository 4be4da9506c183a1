"""Pictures of a benchmark result (the dict in ``bench.json``), for chapter 09 and ``figures/``.

Every function takes the result dict and returns a matplotlib Figure; none measures anything,
so they draw the same picture on a laptop as on the GPU that produced the numbers. Each is at
most an output area wide (``kvlab.course.viz.legibility``): one panel per page size, stacked.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..course.viz.legibility import MAX_WIDTH_IN
from .decode_report import plot_attention
from .memory_report import plot_memory
from .serve_report import plot_serve

COLORS = {"teaching": "#c0504d", "fast": "#2e7d32", "fast_host_lens": "#66bb6a",
          "fast_sync": "#a5d6a7", "torch": "#5b7fbf", "host_loop": "#c0504d", "triton": "#2e7d32",
          "seed_wrapper": "#8e6c8a", "teaching_host_lens": "#e6a09e"}
LABELS = {"teaching": "teaching (source design)", "fast": "fast (counts on host, no sync)",
          "fast_host_lens": "fast (host lengths)", "fast_sync": "fast (one sync)",
          "torch": "vectorised torch", "host_loop": "host loop + scatter", "triton": "Triton kernel",
          "seed_wrapper": "seed wrapper (source host code)"}
#: the public-call picture's paths and labels
PUBLIC_LABELS = {"fast_host_lens": "allocator, fast, host lengths (no sync)",
                 "fast": "allocator, fast (one sync)", "teaching": "allocator, teaching (one sync)",
                 "seed_wrapper": "seed wrapper (launch + .item())"}


def _title(res: dict, what: str) -> str:
    m = res["meta"]
    where = "SMOKE RUN (interpreter, not timings)" if res.get("smoke") else m["device"]
    return f"{what}\n{where}, torch {m['torch']}, triton {m['triton']}"


def _value(entry: dict):
    """Per call in a loop (what the targets use) when measured, else do_bench's median."""
    return entry.get("loop_us", entry.get("median_us"))


def _grouped_bars(ax, rows, names, key_label):
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, row in enumerate(rows):
            entry = row["paths"].get(name, {})
            x = i - 0.4 + width * (j + 0.5)
            if _value(entry) is not None:
                xs.append(x)
                ys.append(_value(entry))
            elif "skipped" in entry:  # written just above the axis, whatever the y scale
                ax.text(x, 0.02, "skipped: would recompile", rotation=90, ha="center", va="bottom",
                        fontsize=7.5, color=COLORS.get(name, "gray"), transform=ax.get_xaxis_transform())
        ax.bar(xs, ys, width, label=LABELS.get(name, name), color=COLORS.get(name))
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([key_label(r) for r in rows], fontsize=8)
    ax.set_yscale("log")


def _legend_below(fig, ax):
    handles, labels = ax.get_legend_handles_labels()
    ncol = len(labels) if sum(map(len, labels)) <= 90 else 2  # one row when it fits the width
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)


def _stacked_panels(n: int, panel_height: float, extra: float = 1.2, **kw):
    """``n`` panels one under the other, an output area wide; returns (fig, list of axes)."""
    fig, axes = plt.subplots(n, 1, figsize=(MAX_WIDTH_IN, panel_height * n + extra), squeeze=False, **kw)
    return fig, list(axes[:, 0])


def _bars_per_page_size(rows, names, key_label, *, panel_height, ylabel):
    """One panel of grouped bars per page size (shared y axis), stacked, legend below;
    returns (fig, axes)."""
    sizes = sorted({r["page_size"] for r in rows})
    fig, axes = _stacked_panels(max(1, len(sizes)), panel_height, sharey=True)
    for ax, P in zip(axes, sizes):
        _grouped_bars(ax, [r for r in rows if r["page_size"] == P], names, key_label)
        ax.set_title(f"page size {P}", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=8)
    _legend_below(fig, axes[0])
    return fig, axes


def plot_extend(res: dict, names=("teaching", "fast", "fast_sync", "torch")):
    """Time per alloc_extend call in a loop (do_bench's median where no loop was timed) per
    case, one panel per page size."""
    fig, axes = _bars_per_page_size(
        res["extend"], names, lambda r: f"{r['bs']}x{r['mean_extend']}, T={r['tokens']}",
        panel_height=2.3, ylabel="µs per call (log)")
    axes[-1].set_xlabel("batch x mean extend, T = tokens", fontsize=8)
    fig.suptitle(_title(res, "alloc_extend, steady state"), fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))
    return fig


def plot_recompile(res: dict):
    """First call of each path on shapes it has not seen: the teaching kernel recompiles."""
    rows = res["cold"]
    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 5.4))
    labels = [f"{r['case']} P={r['page_size']}, {r['teaching_lanes']} lanes" for r in rows]
    xs = range(len(rows))
    teach = [r["teaching_first_call_ms"] for r in rows]
    fast = [r["fast_first_call_ms"] for r in rows]
    ax.bar([x - 0.2 for x in xs], [t if t is not None else 0 for t in teach], 0.4,
           color=COLORS["teaching"], label="teaching: first call (compiles per power of two)")
    ax.bar([x + 0.2 for x in xs], fast, 0.4, color=COLORS["fast"],
           label="fast: first call (compiles once per page size)")
    for x, t in zip(xs, teach):
        if t is None:
            ax.text(x - 0.2, 0.02, "skipped: would recompile", rotation=90, ha="center", va="bottom",
                    fontsize=7, color=COLORS["teaching"], transform=ax.get_xaxis_transform())
    ax.axhline(20, color="gray", ls="--", lw=1)
    ax.text(len(rows) - 0.5, 21, "20 ms target", ha="right", va="bottom", fontsize=8, color="gray")
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7, rotation=90)  # one line each: neighbours never overlap
    ax.set_ylabel("first call, ms (log)")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(_title(res, "The recompile trap: first call on a new shape"), fontsize=10)
    fig.tight_layout()
    return fig


def plot_scaling(res: dict):
    """Fixed total tokens, growing batch: O(bs^2) prefix sums vs one scan."""
    rows = res["scaling"]
    fig, ax = plt.subplots(figsize=(6, 4))
    bss = [r["bs"] for r in rows]
    for name in ("teaching", "fast"):
        ax.plot(bss, [_value(r["paths"][name]) for r in rows], "o-", color=COLORS[name],
                label=LABELS[name])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"batch size (total tokens fixed at {rows[0]['tokens']})" if rows else "batch size")
    ax.set_ylabel("µs per call in a loop (log)")
    ax.legend(fontsize=8)
    ax.set_title(_title(res, "Prefix sums: every program re-sums (teaching) vs one scan (fast)"),
                 fontsize=9)
    fig.tight_layout()
    return fig


def plot_decode(res: dict, names=("teaching", "fast", "fast_sync", "torch")):
    fig, _ = _bars_per_page_size(res["decode"], names, lambda r: f"bs={r['bs']}",
                                 panel_height=2.0, ylabel="µs per step (log)")
    fig.suptitle(_title(res, "alloc_decode, one step"), fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))
    return fig


def plot_page_table(res: dict):
    rows = [r for r in res["page_table"] if "paths" in r]
    fig, _ = _bars_per_page_size(rows, ("host_loop", "triton"), lambda r: f"bs={r['bs']}, {r['slots']} slots",
                                 panel_height=2.2, ylabel="µs per write (log)")
    fig.suptitle(_title(res, "Page-table write: host loop + scatter vs one Triton launch"), fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))
    return fig


def plot_public_call(res: dict, page_size: int | None = None):
    """The public calls per case beside the launch floor: where the time of a call goes
    (``page_size``: the smallest measured, unless given)."""
    floor = res.get("floor", {}).get("paths", {})
    if page_size is None:
        page_size = min((r["page_size"] for r in res.get("public_extend", [])), default=16)
    panels = [("public_extend", "alloc_extend", lambda r: f"{r['case']}\nT={r['tokens']}"),
              ("public_decode", "alloc_decode", lambda r: f"bs={r['bs']}")]
    fig, axes = _stacked_panels(2, 2.9, extra=1.4, sharey=True)
    for ax, (key, title, label) in zip(axes, panels):
        rows = [r for r in res.get(key, []) if r["page_size"] == page_size]
        names = [n for n in PUBLIC_LABELS if any(n in r["paths"] for r in rows)]
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            xs = [i - 0.4 + width * (j + 0.5) for i, r in enumerate(rows) if "loop_us" in r["paths"].get(name, {})]
            ys = [r["paths"][name]["loop_us"] for r in rows if "loop_us" in r["paths"].get(name, {})]
            ax.bar(xs, ys, width, color=COLORS[name], label=PUBLIC_LABELS[name])
        for name, style, text in (("launch_kept", ":", "one launch"), ("launch_1_sync", "--", "launch + one sync")):
            if "loop_us" in floor.get(name, {}):
                ax.axhline(floor[name]["loop_us"], color="black", ls=style, lw=1)
                ax.text(-0.45, floor[name]["loop_us"] * 1.04, text, va="bottom", fontsize=7.5)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([label(r) for r in rows], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"PagedTokenAllocator.{title}, page size {page_size}", fontsize=9)
        ax.set_ylabel("µs per call (log)", fontsize=8)
        ax.tick_params(labelsize=8)
    _legend_below(fig, axes[0])
    fig.suptitle(_title(res, "Where the time of a public call goes"), fontsize=10)
    fig.tight_layout(rect=(0, 0.55 / fig.get_figheight(), 1, 1))
    return fig


#: file name -> plot function; ``python -m kvlab.bench`` writes all of them
PLOTS = {
    "09_bench_extend.png": plot_extend,
    "09_recompile_trap.png": plot_recompile,
    "09_prefix_sum_scaling.png": plot_scaling,
    "09_bench_decode.png": plot_decode,
    "09_page_table_write.png": plot_page_table,
    "09_public_call.png": plot_public_call,
    "10_bench_serve.png": plot_serve,
    "09_bench_attention.png": plot_attention,
    "12_bench_memory.png": plot_memory,
}
