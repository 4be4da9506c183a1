"""Chapter 08's pictures: attention reads K/V through the page table, and a tiny model served
through kvlab computes fewer prefill tokens for the same answers. Seeded, CPU-fast."""
from __future__ import annotations

import random

import torch

from ..viz.legibility import MAX_WIDTH_IN
from .figure_registry import figure

#: the chapter's tiny model on the CPU (a GPU run uses the same shape; sizes differ elsewhere)
SMALL_CONFIG = dict(vocab_size=96, num_layers=2, num_heads=2, head_dim=16, seed=0)


def shared_prompt_batches(seed: int = 0, n: int = 3, system_len: int = 14, vocab: int = 96,
                          question: tuple[int, int] = (2, 6)):
    """Two batches of prompts that share one system prompt (the second batch can hit the cache)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_len)]

    def batch():
        return [system + [rng.randrange(vocab) for _ in range(rng.randint(*question))] for _ in range(n)]

    return batch(), batch()


def gather_figure(page_size: int = 4):
    """Left: the page table of two requests. Right: the K pool, slots coloured by the request
    whose row points at them -- the request's tokens are scattered over the pool in pages."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from ..viz.heatmap import page_table_heatmap

    P = page_size
    num_pages = 8
    table = torch.full((2, 3 * P), -1, dtype=torch.int32)
    lens = [10, 6]
    pages = [[5, 1, 6], [3, 7]]
    for r, n in enumerate(lens):
        slots = [p * P + o for p in pages[r] for o in range(P)][:n]
        table[r, :n] = torch.tensor(slots, dtype=torch.int32)
    fig = plt.figure(figsize=(MAX_WIDTH_IN, 4.4))
    grid = fig.add_gridspec(2, 2, width_ratios=[1.2, 1], height_ratios=[1, 1.2])
    ax_t, ax_p, ax_note = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[1, :]), fig.add_subplot(grid[0, 1])
    ax_note.set_axis_off()
    ax_note.text(0.05, 0.5, "Each row lists where a request's tokens live.\nBelow, the pool: a request's "
                 "tokens are\nscattered over it, in whole pages; attention\ngathers them through the row.",
                 va="center", fontsize=8.5, color="#333333")
    page_table_heatmap(table, P, ax=ax_t, page_range=(0, num_pages - 1), colorbar=False,
                       title=f"page table (P={P}): row = request, value = slot")
    ax_t.set_yticks([0, 1])
    ax_t.set_yticklabels(["request A", "request B"], fontsize=8)
    colours = {0: "#6baed6", 1: "#fd8d3c"}
    owner = {}
    for r, n in enumerate(lens):
        for t in range(n):
            owner[int(table[r, t])] = (r, t)
    for s in range(num_pages * P):
        fc = colours[owner[s][0]] if s in owner else "#f0f0f0"
        ax_p.add_patch(Rectangle((s, 0), 0.95, 1, fc=fc, ec="#888888", lw=0.4))
        if s in owner:
            ax_p.text(s + 0.47, 0.5, f"t{owner[s][1]}", ha="center", va="center", fontsize=7.5)
    for p in range(num_pages + 1):
        ax_p.plot([p * P - 0.025, p * P - 0.025], [-0.15, 1.15], color="black", lw=1.0)
        if p < num_pages:
            ax_p.text(p * P + P / 2, -0.35, f"page {p}", ha="center", va="center", fontsize=7)
    ax_p.set_xlim(-0.5, num_pages * P + 0.5)
    ax_p.set_ylim(-0.7, 1.6)
    ax_p.set_axis_off()
    ax_p.set_title("K pool of one layer (slots 0..31): t3 = the request's token at position 3; "
                   "blue: request A's K vectors, orange: request B's", fontsize=9)
    fig.tight_layout()
    return fig


@figure("08_gather.png")
def gather_picture():
    return gather_figure()


def served_vs_contiguous(decode_attention: str = "triton", max_new_tokens: int = 4):
    """Serve two batches with a shared system prompt; return (contiguous, paged) Generations."""
    from ...serving.tiny_engine import PagedEngine, TinyConfig, TinyTransformer, generate_contiguous

    model = TinyTransformer(TinyConfig(**SMALL_CONFIG))
    first, second = shared_prompt_batches()
    engine = PagedEngine(model, page_size=4, num_pages=64, max_running=3, max_seq_len=48,
                         decode_attention=decode_attention)
    paged = [engine.generate(first, max_new_tokens), engine.generate(second, max_new_tokens)]
    contiguous = [generate_contiguous(model, first, max_new_tokens),
                  generate_contiguous(model, second, max_new_tokens)]
    return contiguous, paged


def prefill_bars(contiguous, paged, ax=None):
    """Prompt tokens computed per batch: a contiguous cache recomputes everything; the paged
    engine's second batch finds the shared system prompt in the prefix cache."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3))
    labels = ["batch 1", "batch 2"]
    x = range(len(labels))
    c = [g.prefill_tokens for g in contiguous]
    p = [g.prefill_tokens for g in paged]
    ax.bar([i - 0.2 for i in x], c, 0.4, color="#bdbdbd", label="contiguous KV cache")
    ax.bar([i + 0.2 for i in x], p, 0.4, color="#74c476", label="paged + prefix cache")
    for i in x:
        ax.text(i - 0.2, c[i], str(c[i]), ha="center", va="bottom", fontsize=8)
        ax.text(i + 0.2, p[i], str(p[i]), ha="center", va="bottom", fontsize=8)
    same = all(a.tokens == b.tokens for a, b in zip(contiguous, paged))
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("prompt tokens computed", fontsize=8)
    ax.set_ylim(0, max(c) * 1.3)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    ax.set_title("same generated tokens: " + ("yes" if same else "NO") +
                 "\nfewer prompt tokens computed\nwhen the prefix is cached", fontsize=9)
    return ax


@figure("08_prefill_saved.png")
def prefill_saved_picture():
    import matplotlib.pyplot as plt

    contiguous, paged = served_vs_contiguous("reference")
    fig, ax = plt.subplots(figsize=(6.5, 3))
    prefill_bars(contiguous, paged, ax)
    fig.tight_layout()
    return fig
