"""Chapter 10's scenes: where kvlab plugs into a transformers model, a conversation that
re-sends its history, the pictures of what the prefix cache saved, a decode step padded
with the dummy row, and the host and device lanes of steps without and with overlap
scheduling. Seeded; the schematic and the padded step need no transformers."""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:
    import torch

from ..viz.legibility import MAX_WIDTH_IN
from .figure_registry import figure


def conversation_turns(seed: int = 0, turns: int = 4, vocab: int = 128, system_len: int = 24,
                       user_len: tuple[int, int] = (5, 9)) -> tuple[list[int], list[list[int]]]:
    """A system prompt and one user message per turn, as token ids (for a model without a
    tokenizer). Turn ``t``'s prompt is everything so far: system, then each earlier user
    message followed by the model's answer to it, then user message ``t``."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_len)]
    users = [[rng.randrange(vocab) for _ in range(rng.randint(*user_len))] for _ in range(turns)]
    return system, users


def conversation_bars(stats: Sequence[dict], ax=None, title: str | None = None):
    """Per turn: prompt tokens computed by the prefill vs served from the prefix cache."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    turns = range(1, len(stats) + 1)
    computed = [s["prefill_computed"] for s in stats]
    cached = [s["prefill_cached"] for s in stats]
    ax.bar(turns, cached, color="#74c476", label="served from the prefix cache")
    ax.bar(turns, computed, bottom=cached, color="#fd8d3c", label="computed (prefill)")
    for t, c, n in zip(turns, cached, computed):
        ax.text(t, c + n, f"{n}/{c + n}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(turns))
    ax.set_xlabel("turn (each re-sends the whole history)")
    ax.set_ylabel("prompt tokens")
    ax.set_title(title or "prompt tokens per turn: computed / sent")
    ax.legend(fontsize=8, loc="upper left")
    return ax


@figure("10_plug_in.png")
def plug_in_figure():
    """A decoder layer of the model, and the one box kvlab replaces: attention, which stores
    the step's K/V in the pool at the page table's slots and reads every earlier token back
    through the rows."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 3.9))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 4.4)
    ax.axis("off")
    model_boxes = ["embed", "RMSNorm", "q, k, v proj", "RoPE", "attention", "o_proj + residual",
                   "RMSNorm", "MLP + residual", "lm_head"]
    y = 3.7
    for i, name in enumerate(model_boxes):
        kvlab_box = name == "attention"
        fc = "#fdd0a2" if kvlab_box else "#deebf7"
        ax.add_patch(FancyBboxPatch((0.3, y - 0.3), 2.6, 0.28, boxstyle="round,pad=0.02",
                                    fc=fc, ec="#e6550d" if kvlab_box else "#6baed6", lw=1.5 if kvlab_box else 0.8))
        ax.text(1.6, y - 0.16, name + ("  (kvlab)" if kvlab_box else ""), ha="center", va="center",
                fontsize=8.5, weight="bold" if kvlab_box else None)
        if i < len(model_boxes) - 1:
            ax.annotate("", (1.6, y - 0.36), (1.6, y - 0.3), arrowprops=dict(arrowstyle="->", lw=0.7))
        y -= 0.4
    ax.text(1.6, 4.05, "the model's own code (transformers)", ha="center", fontsize=9)
    ax.text(0.05, 2.2, "× layers", rotation=90, va="center", fontsize=8, color="#555555")

    # the page table and the pool
    P = 4
    table = [[8, 9, 10, 11, 20, 21], [8, 9, 10, 11, 4, -1]]
    ax.text(5.2, 3.86, "page table\n(row = request, column = position)", ha="center", va="bottom",
            fontsize=9)
    for r, row in enumerate(table):
        for t, slot in enumerate(row):
            x, yy = 3.9 + t * 0.42, 3.4 - r * 0.42
            shared = t < 4
            fc = "#f0f0f0" if slot < 0 else ("#a1d99b" if shared else ("#9ecae1" if r == 0 else "#fdae6b"))
            ax.add_patch(Rectangle((x, yy), 0.4, 0.38, fc=fc, ec="#888888", lw=0.5))
            ax.text(x + 0.2, yy + 0.19, "" if slot < 0 else str(slot), ha="center", va="center", fontsize=7.5)
    ax.text(3.85, 3.59, "A", ha="right", va="center", fontsize=8)
    ax.text(3.85, 3.17, "B", ha="right", va="center", fontsize=8)
    ax.text(5.2, 2.75, "positions 0-3: one cached page, shared", ha="center", fontsize=7.5, color="#31a354")

    ax.text(8.9, 3.86, "K/V pool of one layer\n[slots, kv_heads, head_dim]", ha="center", va="bottom",
            fontsize=9)
    owner = {8: "#a1d99b", 9: "#a1d99b", 10: "#a1d99b", 11: "#a1d99b", 20: "#9ecae1", 21: "#9ecae1",
             4: "#fdae6b"}
    for s in range(24):
        x, yy = 7.0 + (s % 8) * 0.48, 3.4 - (s // 8) * 0.42
        ax.add_patch(Rectangle((x, yy), 0.46, 0.38, fc=owner.get(s, "#f7f7f7"), ec="#888888", lw=0.5))
        ax.text(x + 0.23, yy + 0.19, str(s), ha="center", va="center", fontsize=7)
    for r in range(3):                 # page borders: every P slots
        for b in (0, 4, 8):
            x = 7.0 + b * 0.48 - 0.01
            ax.plot([x, x], [3.4 - r * 0.42 - 0.02, 3.4 - r * 0.42 + 0.4], color="black", lw=1.4)
    ax.text(8.9, 2.1, f"pages of P={P} slots; a request's tokens sit wherever its pages are",
            ha="center", fontsize=7.5, color="#555555")

    ax.add_patch(FancyArrowPatch((2.95, 2.0), (3.9, 2.75), arrowstyle="->", mutation_scale=12,
                                 color="#e6550d", lw=1.2))
    ax.text(3.0, 1.55, "1. store this step's k, v at\n    page_table[row, position]\n"
                       "2. attend: several new tokens of a request (prompt): causal, in torch;\n"
                       "    one new token (decoding): the Triton paged kernel, query head h\n"
                       "    reads K/V head h // group (grouped-query attention)",
            fontsize=8, va="top", color="#7f2704")
    ax.add_patch(FancyArrowPatch((6.5, 3.2), (7.0, 3.2), arrowstyle="<->", mutation_scale=10,
                                 color="#555555", lw=0.8))
    fig.tight_layout()
    return fig


def conversation_rows(rows: Sequence, prompt_lens: Sequence[int], cached: Sequence[int],
                      page_size: int, ax=None, max_cells: int = 96):
    """One page-table row per turn (the conversation's row right after that turn's prefill),
    each position coloured by the turn that computed its K/V: every turn reuses the slots of
    all earlier turns and adds its own pages at the end.

    ``rows[t]``: the row's slots after turn ``t``'s prefill; ``prompt_lens[t]``: the prompt
    sent in turn ``t``; ``cached[t]``: its tokens served from the cache.
    """
    import numpy as np

    from ..viz import page_table_heatmap

    turns = len(rows)
    cols = max(prompt_lens)
    table = np.stack([np.asarray(r)[:cols] for r in rows]).astype(np.int64)
    position = np.arange(cols)[None, :]
    blank = position >= np.asarray(prompt_lens)[:, None]
    # position p was computed by the last turn that started computing at or before p
    starts = np.asarray(cached)
    owner = np.array([[int((starts <= p).nonzero()[0].max()) for p in range(cols)]] * turns)
    owner[blank] = -1
    ax = page_table_heatmap(table, page_size, ax=ax, empty=blank, categories=owner,
                            category_labels=[f"computed in turn {t + 1}" for t in range(turns)],
                            max_cells=max_cells, row_label="turn (row 0 each time)")
    ax.set_yticks(range(turns))
    ax.set_yticklabels([f"turn {t + 1}" for t in range(turns)], fontsize=8)
    return ax


class PaddedStep(NamedTuple):
    """One decode step padded to a captured batch size (plain data, on the CPU)."""

    page_table: "torch.Tensor"   # [rows + 1, cols]: the last row is the dummy request's
    page_size: int
    dummy_row: int
    dummy_page: int
    running: int                 # real entries; the rest are padding
    rows: list[int]              # per entry: page-table row
    positions: list[int]         # ... the position of its new token
    slots: list[int]             # ... where its K/V goes: page_table[row, position]


def padded_step(seed: int = 0, page_size: int = 4, running: int = 5, rows: int = 8,
                sizes: Sequence[int] = (1, 2, 4, 8), num_pages: int = 40) -> PaddedStep:
    """A small manager whose ``running`` requests (random prompt lengths, rows in random order)
    have prefilled; their next decode step, padded with the dummy row to the next size."""
    import torch

    from ...manager.cache_manager import CacheManager
    from ...serving.hf.graphs import pad_decode_batch
    from ...alloc.paging import new_page_table
    from ...manager.req import Req

    rng = random.Random(seed)
    table = new_page_table(rows, 6 * page_size, page_size, device="cpu")
    dummy_row, dummy_page = rows, num_pages
    table[dummy_row] = dummy_page * page_size          # every entry: the dummy page's first slot
    manager = CacheManager(num_pages, page_size, table, page_table_writer="host")
    free = rng.sample(range(rows), running)
    reqs = [Req([rng.randrange(100) for _ in range(rng.randint(2, 4 * page_size))], row) for row in free]
    manager.complete_step(manager.prefill(reqs), [rng.randrange(100) for _ in reqs])
    step = manager.decode_step(reqs)
    padded = pad_decode_batch(torch.tensor(step.table_idx), torch.tensor(step.start), table, sizes, dummy_row)
    return PaddedStep(table.clone(), page_size, dummy_row, dummy_page, running,
                      *(t.tolist() for t in padded))


@figure("10_padded_step.png")
def padded_step_figure(step: "PaddedStep | None" = None):
    """Top: the page table, each entry's cell outlined (what it writes and, up to it, reads);
    the dummy row maps only the dummy page. Below: the entries of the padded step."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    from ..viz import page_table_heatmap

    step = step if step is not None else padded_step()
    table = step.page_table.numpy()
    entries = len(step.rows)
    cols = max(step.positions) + 2
    hit = np.zeros(table.shape, dtype=bool)
    for r, p in zip(step.rows, step.positions):
        hit[r, p] = True
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(MAX_WIDTH_IN, 7.4), gridspec_kw=dict(height_ratios=[3, 2]))
    page_table_heatmap(table[:, :cols], step.page_size, ax=ax1, highlight=hit[:, :cols], colorbar=False,
                       annotate=True, row_label="page-table row")
    ax1.set_yticks(range(table.shape[0]))
    ax1.set_yticklabels([f"{r}" if r != step.dummy_row else f"{r} (dummy)" for r in range(table.shape[0])],
                        fontsize=9)
    ax1.set_title(f"page table, P={step.page_size}: outlined = the cell each batch entry writes;\n"
                  f"the dummy row maps page {step.dummy_page} only", fontsize=10)
    ax2.axis("off")
    ax2.set_xlim(0, entries + 1.6)
    ax2.set_ylim(0, 4.2)
    for y, (name, values) in zip((2.6, 1.7, 0.8), (("row", step.rows), ("position", step.positions),
                                                    ("slot", step.slots))):
        ax2.text(1.5, y + 0.35, name, ha="right", va="center", fontsize=10)
        for b, v in enumerate(values):
            pad = b >= step.running
            ax2.add_patch(Rectangle((1.6 + b, y), 0.95, 0.7, fc="#d9d9d9" if pad else "#c6dbef",
                                    ec="#555555", lw=0.6))
            ax2.text(2.075 + b, y + 0.35, str(v), ha="center", va="center", fontsize=10)
    for b in range(entries):
        ax2.text(2.075 + b, 3.55, str(b), ha="center", va="center", fontsize=9, color="#555555")
    ax2.text(1.5, 3.55, "entry", ha="right", va="center", fontsize=10)
    ax2.text(1.6 + step.running + (entries - step.running) / 2, 0.35, "padding: the dummy request",
             ha="center", va="center", fontsize=9, color="#555555")
    ax2.set_title(f"{step.running} running requests padded to the captured size {entries}", fontsize=10)
    fig.tight_layout()
    return fig


def long_prompt_workload(seed: int = 0, long_prompt: int = 60, short: int = 3):
    """``short`` requests that decode for a while, and one long prompt arriving at step 3:
    does it stall them (whole prompts) or share the steps with them (chunks)?"""
    from ...serving.sim.workloads import RequestSpec, Workload

    rng = random.Random(seed)

    def tokens(n):
        return tuple(rng.randrange(100) for _ in range(n))

    reqs = [RequestSpec(i, tokens(rng.randint(4, 8)), tokens(12), 0, tag="short") for i in range(short)]
    reqs.append(RequestSpec(short, tokens(long_prompt), tokens(4), 3, tag="long prompt"))
    return Workload("long_prompt", "short requests decoding, then one long prompt", tuple(reqs))


def prefill_per_step(timelines: dict, budget: int, ax=None):
    """Prompt tokens computed per step, one group of bars per run, the budget as a line; a
    dot where running requests decoded."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 3.2))
    width = 0.8 / len(timelines)
    colors = ["#fd8d3c", "#2e7d32", "#5b7fbf"]
    for j, (name, tl) in enumerate(timelines.items()):
        xs = [s.step - 0.4 + width * (j + 0.5) for s in tl.steps]
        ax.bar(xs, [s.prefill_tokens for s in tl.steps], width, color=colors[j % 3], label=name)
        ax.scatter([x for x, s in zip(xs, tl.steps) if s.decoded], [-2] * sum(bool(s.decoded) for s in tl.steps),
                   marker="|", color=colors[j % 3], s=40)
    ax.axhline(budget, color="black", ls="--", lw=1)
    ax.text(0, budget + 1, f"token budget per step ({budget})", fontsize=9, va="bottom")
    ax.set_xlabel("step (ticks below: running requests decoded in that step)")
    ax.set_ylabel("prompt tokens computed")
    ax.legend(fontsize=9, loc="upper right")
    return ax


# --- overlap scheduling: the two lanes of a run ----------------------------------------------


class OverlapRuns(NamedTuple):
    """The same prompts served without and with overlap scheduling."""

    timelines: dict          # "without overlap" / "with overlap" -> the steps (StepTimes as dicts)
    tokens: dict             # the same keys -> the new tokens of each prompt


def reference_decode_step(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    """A decode step in plain torch (store, then the reference attention): in the interpreter
    it is far quicker than a Triton kernel, so the host's share of a step stays visible."""
    from ...serving.hf.attention_steps import paged_attention_reference

    slots = page_table[rows, positions].long()
    k_pool[slots] = k.to(k_pool.dtype)
    v_pool[slots] = v.to(v_pool.dtype)
    return paged_attention_reference(q, k_pool, v_pool, page_table, rows, positions + 1, scale)


def overlap_runs(model=None, prompts: Sequence[Sequence[int]] | None = None, max_new_tokens: int = 6,
                 page_size: int = 4, **options) -> OverlapRuns:
    """Serve ``prompts`` twice with ``timeline=True``, overlap off then on, through
    :func:`reference_decode_step` (a tiny seeded Llama and 16 seeded prompts by default;
    ``options`` go to the generator). Without CUDA a worker thread plays the GPU."""
    from ...serving.hf import PagedGenerator, tiny_model

    model = model if model is not None else tiny_model("llama", seed=0)
    if prompts is None:
        rng = random.Random(3)
        prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(4, 12))]
                   for _ in range(16)]
    options = dict(dict(num_pages=256, decode_step=reference_decode_step), **options)
    timelines, tokens = {}, {}
    for name, overlap in (("without overlap", False), ("with overlap", True)):
        gen = PagedGenerator(model, page_size=page_size, overlap=overlap, **options)
        tokens[name] = gen.generate(prompts, max_new_tokens=max_new_tokens, timeline=True)
        timelines[name] = [s._asdict() for s in gen.timeline]
    return OverlapRuns(timelines, tokens)


def recorded_timelines(bench: dict) -> dict:
    """The GPU's decode steps at 64 running requests, without and with overlap, as the serving
    benchmark recorded them (``figures/bench.json``); empty if it recorded none."""
    saved = bench.get("serve", {}).get("timeline", {})
    names = {"no_overlap_64": "without overlap", "overlap_64": "with overlap"}
    return {label: saved[key] for key, label in names.items() if saved.get(key)}


def _titled(timelines: dict, where: str, count: int) -> dict:
    from ..viz.lanes import span, window

    out = {}
    for name, steps in timelines.items():
        w = window(steps, count)
        period = (w[-1]["device"][1] - w[0]["device"][1]) / max(1, len(w) - 1) * 1e3
        out[f"{where}, {name}: a decode step every {period:.1f} ms"] = (steps, span(w))
    return out


@figure("10_overlap_timeline.png")
def overlap_timeline_figure(timelines: dict | None = None, where: str = "", count: int = 4):
    """Host and device lanes of a few decode steps, without and with overlap scheduling: the
    GPU's steps the serving benchmark recorded (``figures/bench.json``), else a tiny run here."""
    from ..viz.lanes import lanes_figure

    if timelines is None:
        from .ch09_making_it_fast import load_bench

        try:
            timelines, where = recorded_timelines(load_bench()), "H200, Qwen3-0.6B's shape"
        except FileNotFoundError:
            timelines = {}
        if not timelines:
            timelines, where = overlap_runs().timelines, "CPU, a tiny model"
    return lanes_figure(_titled(timelines, where, count), width=MAX_WIDTH_IN)
