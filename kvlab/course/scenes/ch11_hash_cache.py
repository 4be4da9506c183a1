"""Chapter 11's scenes and pictures: two requests that share a system prompt on the hash cache,
the free queue before and after a reuse, and the two caches measured on the same workloads."""
from __future__ import annotations

import torch

from ..viz.legibility import MAX_WIDTH_IN
from ...prefix.hash_cache import HashPrefixCache
from ...alloc.paging import UNMAPPED
from .figure_registry import figure

P = 4
SYSTEM = list(range(100, 112))            # 12 tokens: three full pages of system prompt
QUESTION_A = [1, 2, 3]                    # A ends in a partial page
QUESTION_B = [7, 8, 9, 10, 11]            # B fills one more page, then a partial one
QUESTION_C = [40 + i for i in range(18)]  # an unrelated prompt of five pages
QUESTION_D = [5, 5, 5]

#: the workloads the chapter measures (seeded; page size 4, pools from tight to ample)
COMPARED = ("shared_system_prompt", "multi_turn_chat", "few_shot", "random_prompts", "mixed")


def shared_system_prompt_scene(num_pages: int = 8):
    """A and B, one system prompt, on a hash cache of ``num_pages`` pages of 4 (nano-vllm's
    ``allocate``): returns the cache and ``[(label, token ids, pages), ...]``."""
    cache = HashPrefixCache(num_pages, P, device="cpu")
    rows = []
    for label, ids in (("A", SYSTEM + QUESTION_A), ("B", SYSTEM + QUESTION_B)):
        rows.append((label, ids, list(cache.allocate(ids).pages)))
    return cache, rows


def rows_page_table(rows) -> torch.Tensor:
    """A page table with one row per ``(label, ids, pages)``: position -> slot."""
    width = max(len(pages) for _, _, pages in rows) * P
    table = torch.full((len(rows), width), UNMAPPED, dtype=torch.int32)
    for r, (_, ids, pages) in enumerate(rows):
        slots = [p * P + i for p in pages for i in range(P)][: len(ids)]
        table[r, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return table


def free_queue_steps():
    """A and B finish; C (unrelated, five pages) takes the head of the queue, which evicts B's
    cached question page; C finishes; D, with the system prompt, takes its three cached pages
    back out of the queue and one new page from its head. Returns
    ``[(title, snapshot, highlight), ...]`` and the cache."""
    cache, rows = shared_system_prompt_scene()
    (_, _, pages_a), (_, _, pages_b) = rows
    cache.free(pages_a)
    cache.free(pages_b)
    head = cache.free_queue.head(5)
    steps = [("1. A and B finished: their pages queue last page first and keep their hashes "
              "(red: the five pages C takes next)", cache.snapshot(), head)]
    evicted = [p for p in head if cache.page_hash[p] is not None]
    c = cache.allocate(QUESTION_C)
    steps.append((f"2. C takes the 5 pages at the head: {', '.join(f'p{p}' for p in evicted)} loses its "
                  "hash (evicted); the system prompt's pages are next in line", cache.snapshot(), []))
    cache.free(c.pages)
    d = cache.allocate(SYSTEM + QUESTION_D)
    steps.append((f"3. C finished; D hits {d.cached_len} tokens: "
                  f"{', '.join(f'p{p}' for p in d.pages[:3])} leave the queue, and its new page "
                  f"p{d.pages[3]} comes from the head", cache.snapshot(), []))
    return steps, cache


@figure("11_hash_chain.png")
def hash_chain_figure():
    """The page table of A and B, and their chains of page hashes."""
    import matplotlib.pyplot as plt

    from ..viz import page_table_heatmap
    from ..viz.chains import draw_hash_chains

    cache, rows = shared_system_prompt_scene()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(MAX_WIDTH_IN, 4.6), gridspec_kw=dict(height_ratios=[1, 1.25]))
    page_table_heatmap(rows_page_table(rows), P, ax=top, title="page table: A and B map the same "
                       "three pages for the system prompt", row_label="request")
    top.set_yticks([0, 1], ["A", "B"])
    draw_hash_chains(cache.snapshot(), rows, bottom)
    fig.tight_layout()
    return fig


@figure("11_free_queue.png")
def free_queue_figure():
    from ..viz.chains import draw_free_queue_steps

    steps, _ = free_queue_steps()
    return draw_free_queue_steps(steps)


def measured_rows(seed: int = 0):
    """Every workload of :data:`COMPARED` on the three caches and three pool sizes (page size 4)."""
    from ...serving.sim import SimConfig, make_workload
    from ...serving.sim.compare import compare_caches

    return compare_caches([make_workload(name, seed=seed) for name in COMPARED], SimConfig(page_size=P))


@figure("11_cache_compare.png")
def cache_compare_figure():
    from ..viz.chains import draw_cache_comparison

    return draw_cache_comparison(measured_rows())
