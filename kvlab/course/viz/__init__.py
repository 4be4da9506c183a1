"""Pictures of the KV cache: page-table heatmaps, and (later chapters) trees and region bars.

Each picture function draws on a matplotlib Axes (``ax=`` or a new figure) and returns it.
"""
from __future__ import annotations

from .heatmap import HeatmapView, page_table_heatmap  # noqa: F401
from .tree import TreeSnapshot, draw_tree, draw_tree_steps  # noqa: F401  (chapter 05)
from .regions import REGION_COLOURS, page_owner_strip, region_bar, region_bars  # noqa: F401  (chapter 06)
from .dashboard import compare_page_sizes, draw_step, memory_over_time, step_figure, timeline_dashboard  # noqa: F401,E402  (chapter 07)
from .chains import draw_cache_comparison, draw_free_queue, draw_hash_chains  # noqa: F401,E402  (chapter 11)
