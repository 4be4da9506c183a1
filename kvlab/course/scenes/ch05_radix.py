"""Chapter 05's pictures: a radix prefix cache changing step by step, and shared pages."""
from __future__ import annotations

import torch

from ..viz.legibility import MAX_WIDTH_IN
from ...prefix.radix_cache import RadixPrefixCache
from .figure_registry import figure

#: Three chat prompts (page_size 2): a shared system prompt [1 2 3 4], then different questions.
PROMPT_A = [1, 2, 3, 4, 5, 6, 7]
PROMPT_B = [1, 2, 3, 4, 8, 9, 10, 11]
PROMPT_C = [1, 2, 3, 4, 5, 6, 12, 13]
PROMPT_D = [20, 21, 22, 23, 24]  # another conversation altogether


def radix_steps(page_size: int = 2):
    """Run the chapter's story on a fresh cache; return ``[(title, snapshot), ...]`` and the cache.

    Slots come from a small pool handed out page by page, as a cache manager would.
    """
    cache = RadixPrefixCache(page_size, device="cpu")
    next_page = [3]

    def fresh(n):  # n tokens' worth of new whole pages
        pages = -(-n // page_size)
        start = next_page[0] * page_size
        next_page[0] += pages
        return torch.arange(start, start + n, dtype=torch.int32)

    steps = []
    cache.insert_prefix(PROMPT_A, fresh(len(PROMPT_A)))
    steps.append(("insert A (7 tokens): 3 whole pages", cache.snapshot()))
    cache.insert_prefix(PROMPT_D, fresh(len(PROMPT_D)))
    steps.append(("insert D: a second branch", cache.snapshot()))
    _, handle_b = cache.insert_prefix(PROMPT_B, torch.cat([cache.match_prefix(PROMPT_B).handle
                                                           .get_matched_indices(),
                                                           fresh(len(PROMPT_B) - 4)]))
    steps.append(("insert B: split after [1 2|3 4]", cache.snapshot()))
    cache.lock_handle(handle_b)
    steps.append(("lock B (B is running)", cache.snapshot()))
    match_c = cache.match_prefix(PROMPT_C[:-1])
    steps.append((f"match C: {match_c.cached_len} tokens hit", cache.snapshot()))
    cache.evict(1)
    steps.append(("evict(1): least recently used leaf", cache.snapshot()))
    cache.lock_handle(handle_b, unlock=True)
    steps.append(("B finishes: unlock B", cache.snapshot()))
    cache.evict(4)
    steps.append(("evict(4): B's leaf is older than [5 6]", cache.snapshot()))
    return steps, cache


@figure("05_radix_steps.png")
def radix_steps_figure():
    from ..viz.tree import draw_tree_steps

    steps, _ = radix_steps()
    return draw_tree_steps(steps, ncols=2)


@figure("05_shared_prefix.png")
def shared_prefix_figure():
    """Two requests with one system prompt: their page-table rows share the cached pages."""
    import matplotlib.pyplot as plt

    from ...manager.cache_manager import CacheManager, Req
    from ...alloc.paging import new_page_table
    from ..viz import page_table_heatmap

    P = 4
    system = list(range(100, 112))  # 12 tokens: 3 pages of system prompt
    cm = CacheManager(16, P, new_page_table(3, 24, P, device="cpu"), page_table_writer="host")
    first = Req(system + [1, 2, 3], 0)
    batch = cm.prefill([first])            # admit + map its pages
    cm.complete_step(batch, [4])           # the forward pass produced 4; the prompt is cached
    second = Req(system + [7, 8, 9, 10, 11], 1)
    cm.prefill([second])                   # hits the 3 cached pages of the system prompt
    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 2.2))
    page_table_heatmap(cm.page_table[:2, :20], P, ax=ax,
                       title="two requests, one system prompt: the first 3 pages are shared")
    return fig
