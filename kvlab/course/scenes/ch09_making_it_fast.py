"""Chapter 09's pictures.

* ``09_fill_mapping.png``: how the fast fill splits a batch's output among programs: every
  program takes BLOCK consecutive output positions, finds each one's request by binary search
  in ``token_start``, and computes its slot with one formula (old page or new page).
* ``09_split_reads.png``: which program of decode attention reads which pages, chapter 08's
  kernel (one program per query head) beside chapter 09's (one per K/V head and split).
* ``09_bench_*.png``, ``09_recompile_trap.png``, ``09_prefix_sum_scaling.png``,
  ``09_page_table_write.png``, ``09_public_call.png``: the benchmark, drawn from
  ``figures/bench.json`` (measured on a GPU by ``python -m kvlab.bench``), so they render the
  same on a laptop.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ...bench import plots
from ..reference.alloc_ref import alloc_extend_ref, pages_for
from ..viz.legibility import MAX_WIDTH_IN
from .figure_registry import figure

BENCH_JSON = Path(__file__).resolve().parents[3] / "figures" / "bench.json"


def load_bench(path: "str | Path | None" = None) -> dict:
    """The saved GPU benchmark (``figures/bench.json``)."""
    from ...bench.report import load

    p = Path(path) if path is not None else BENCH_JSON
    if not p.exists():
        raise FileNotFoundError(f"{p} is missing: run `python -m kvlab.bench` on a GPU to produce it")
    return load(str(p))


def _syncs(n) -> str:
    return f"{n} sync" if n == 1 else f"{n} syncs"


def public_call_rows(bench: dict, page_size: int = 16) -> list[str]:
    """One line per public-call case of a saved benchmark: µs per call and syncs per call
    (``19.6 µs, 0 syncs``)."""
    names = ("fast_host_lens", "fast", "teaching", "seed_wrapper")
    width = 20
    lines = [f"{'alloc_extend':>17} " + " ".join(f"{n:>{width}}" for n in names)]
    for r in bench.get("public_extend", []):
        if r["page_size"] != page_size:
            continue
        cells = []
        for n in names:
            e = r["paths"].get(n, {})
            cells.append(f"{e['loop_us']:.1f} µs, {_syncs(e.get('syncs', '?'))}" if "loop_us" in e else "skipped")
        lines.append(f"{r['case'] + ' P=' + str(page_size):>17} " + " ".join(f"{c:>{width}}" for c in cells))
    return lines


def fill_mapping_figure(prefix_lens=(6, 4, 0, 9), seq_lens=(11, 4, 11, 15), page_size=4, block=8,
                        free_pages=(7, 3, 9, 5, 2, 8)):
    """Output positions coloured by request, split into programs of ``block`` positions."""
    P = page_size
    last, page = [], 20
    for p in prefix_lens:  # prefixes on pages 20, 21, ... (not in the free list)
        n = pages_for(p, P)
        page += n
        last.append((page - 1) * P + (p - 1) % P if p else -1)
    plan = alloc_extend_ref(list(prefix_lens), list(seq_lens), last, list(free_pages), P)
    T = len(plan.out_indices)
    starts = plan.output_starts
    colors = plt.get_cmap("tab10").colors

    fig, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, 0.62 * T + 2.5), 3.8))
    for t in range(T):
        r, part = plan.parts[t]
        ax.add_patch(Rectangle((t, 0), 1, 1, facecolor=colors[r % 10], alpha=0.35 if part == 1 else 0.8,
                               edgecolor="white", hatch="//" if part == 1 else None))
        ax.text(t + 0.5, 0.5, str(plan.out_indices[t]), ha="center", va="center", fontsize=7)
        ax.text(t + 0.5, -0.25, str(t), ha="center", va="center", fontsize=7, color="gray")
    for p0 in range(0, T + 1, block):  # program boundaries
        ax.axvline(p0, color="black", lw=2)
        if p0 < T:
            ax.text(p0 + min(block, T - p0) / 2, 1.35, f"program {p0 // block}: t = {p0}..{min(T, p0 + block) - 1}",
                    ha="center", fontsize=8)
    for r, s in enumerate(starts):
        ext = seq_lens[r] - prefix_lens[r]
        label = f"req {r}: token_start={s}" + (" (empty)" if ext == 0 else "")
        ax.annotate(label, xy=(s, 1.0), xytext=(s + 0.1, 1.9 + 0.35 * (r % 2)), fontsize=7,
                    color=colors[r % 10], arrowprops=dict(arrowstyle="-", color=colors[r % 10], lw=0.8))
    ax.set_xlim(-0.2, T + 0.2)
    ax.set_ylim(-0.5, 2.6)
    ax.axis("off")
    ax.set_title(f"Fast fill, page_size {P}, BLOCK {block}: each program finds its positions' requests\n"
                 f"in token_start (binary search); numbers are slots, t under each cell. Hatched = rest of\n"
                 f"the old page (last_loc + 1 + k); solid = new pages (free_pages[page_start + j] * P + pos % P)",
                 fontsize=9)
    return fig


def split_reads_plan(seq_lens=(21, 9, 3), page_size=3, block_n=8, num_splits=3, group=4, seed=3):
    """Requests on shuffled pages, and the positions each split program reads
    (:func:`kvlab.attention.paged_attention.split_ranges`: the kernel's own formula)."""
    import random

    from ...attention.paged_attention import split_ranges
    from ..viz.split_reads import SplitReads

    need = [-(-n // page_size) for n in seq_lens]
    pages = list(range(sum(need)))
    random.Random(seed).shuffle(pages)
    rows, at = [], 0
    for n, k in zip(seq_lens, need):
        rows.append([pages[at + t // page_size] for t in range(n)])
        at += k
    spans = [split_ranges(n, num_splits, block_n) for n in seq_lens]
    return SplitReads([chr(ord("A") + i) for i in range(len(seq_lens))], rows, spans, num_splits,
                      page_size, block_n, group)


def split_reads_figure(**kw):
    from ..viz.split_reads import draw_split_reads

    return draw_split_reads(split_reads_plan(**kw))


@figure("09_split_reads.png")
def _split_reads():
    return split_reads_figure()


@figure("09_fill_mapping.png")
def _fill_mapping():
    return fill_mapping_figure()


def _bench_figure(name):
    def draw():
        return plots.PLOTS[name](load_bench())
    return draw


for _name in plots.PLOTS:
    figure(_name)(_bench_figure(_name))
