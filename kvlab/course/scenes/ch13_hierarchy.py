"""Chapter 13's scenes and pictures: a tiered tree after a few conversations, a load-back crossing
the link while another request decodes, hit rates against the device pool's size, and the rows
of ``python -m kvlab.bench --hierarchy`` when ``figures/bench.json`` holds them.

The conversations are :mod:`kvlab.serving.sim.conversations`' with the plans below (seeded); the
caches are the real :class:`~kvlab.prefix.tiered_cache.TieredRadixCache` on page numbers only
(:mod:`kvlab.serving.sim.tier_sim`). Every scene takes well under a few seconds on a CPU."""
from __future__ import annotations

import json
import os

from ...serving.sim.conversations import ChatPlan, chat_turns, working_set
from ...serving.sim.tier_sim import H200_HOST, NVME_DISK, HierarchyConfig, simulate_hierarchy, summary
from .figure_registry import figure

P = 4
#: the picture's few short conversations (tokens in pages of 4)
TREE_PLAN = ChatPlan(conversations=3, turns=3, first=(6, 10), question=(3, 6), answer=(2, 4), vocab=50, seed=3)
#: the hit-rate sweep's conversations: long histories that come back after the others
SWEEP_PLAN = ChatPlan(conversations=16, turns=6, first=(200, 800), question=(30, 200), answer=(20, 60),
                      history_cap=3000, seed=0)
SWEEP_PAGE = 16
#: device pools of the sweep, as shares of the working set
SWEEP_SHARES = (1 / 8, 1 / 4, 1 / 2, 1.0)
#: measured on an H200 (the chapter's sources): the decode step of 64 requests, in ms
H200_DECODE_STEP_MS = 2.289


def tier_tree_scene(policy: str = "write_back", device_pages: int = 9, host_pages: int = 14):
    """The tiered tree (``TierNode`` records) after :data:`TREE_PLAN`'s turns, served one by one."""
    from ...alloc.paging import new_page_table
    from ...manager.cache_manager import CacheManager, Req
    from ...prefix.host_tier import HostTier
    from ...prefix.tiered_cache import TieredRadixCache
    from ...serving.load_back import admit_with_load_back

    cache = TieredRadixCache(P, "cpu", host=HostTier(host_pages, P), policy=policy)
    manager = CacheManager(device_pages, P, new_page_table(1, 64, P, device="cpu"), prefix_cache=cache,
                           page_table_writer="host")
    history: dict = {}
    for turn in chat_turns(TREE_PLAN):
        ids = history.get(turn.conversation, []) + list(turn.message)
        req = Req(list(ids), table_idx=0)
        admit_with_load_back(manager, req)
        req.device_len = req.input_len
        manager.complete_step(manager.mixed_step([req], []), [40 + turn.index])
        manager.complete_step(manager.decode_step([req]), [41 + turn.index], [True])
        history[turn.conversation] = ids + [40 + turn.index]
    return cache.tier_snapshot()


@figure("13_tier_tree.png")
def tier_tree_figure():
    from ..viz.tiers import draw_tier_tree

    nodes = tier_tree_scene()
    ax = draw_tier_tree(nodes, title="Where each node's KV lives after nine turns of three chats "
                                     "(9 device pages, 14 host pages, write-back)", page_size=P)
    return ax.figure


def hit_rate_rows(shares=SWEEP_SHARES) -> list[dict]:
    """Hit rates of :data:`SWEEP_PLAN` for device pools of ``shares`` x its working set: GPU only,
    + a host tier twice the pool (SGLang's default ``--hicache-ratio 2``), + that and a disk, and
    unbounded; write-through."""
    turns = chat_turns(SWEEP_PLAN)
    total = working_set(turns) // SWEEP_PAGE + 1
    longest = SWEEP_PLAN.history_cap // SWEEP_PAGE + 2         # the longest conversation fits alone
    rows = []
    for share in shares:
        pages = max(longest, int(total * share))
        host = H200_HOST._replace(pages=2 * pages)
        configs = {"GPU only": HierarchyConfig(pages, page_size=SWEEP_PAGE),
                   "+ host": HierarchyConfig(pages, host, write_policy="write_through", page_size=SWEEP_PAGE),
                   "+ host + disk": HierarchyConfig(pages, host, NVME_DISK, write_policy="write_through",
                                                    page_size=SWEEP_PAGE)}
        for name, config in configs.items():
            rows.append(dict(config=name, device_pages=pages, share=share,
                             **summary(simulate_hierarchy(turns, config))))
    ceiling = summary(simulate_hierarchy(turns, HierarchyConfig(2 * total, page_size=SWEEP_PAGE)))
    rows += [dict(config="unbounded", device_pages=r["device_pages"], share=r["share"], **ceiling)
             for r in rows if r["config"] == "GPU only"]
    return rows


@figure("13_hit_rate.png")
def hit_rate_figure(rows=None):
    from ..viz.tiers import draw_hit_curves

    rows = rows if rows is not None else hit_rate_rows()
    ax = draw_hit_curves(rows, title="Multi-turn chats: what each hierarchy finds cached")
    return ax.figure


def copy_timeline_spans(history_tokens: int = 8192, token_bytes: int = 12288, new_tokens: int = 256,
                        prefill_tokens_per_s: float = 40000.0) -> list[tuple[str, str, float, float]]:
    """A modelled few milliseconds on an H200: decode steps of 64 requests (2.289 ms each,
    measured), a load-back of ``history_tokens`` crossing the link at the measured 52.7 GB/s during
    the first, the returning request's prefill in the next step, and its new pages' write-through
    copy during the one after."""
    step = H200_DECODE_STEP_MS
    load = 1e3 * H200_HOST.seconds(history_tokens * token_bytes)
    prefill = 1e3 * new_tokens / prefill_tokens_per_s
    write = 1e3 * H200_HOST.seconds(new_tokens * token_bytes, read=False)
    t1 = step
    t2 = t1 + step + prefill
    return [("compute", "decode step n", 0.0, t1),
            ("h2d", f"load-back: {history_tokens} tokens", 0.15, 0.15 + load),
            ("compute", "decode n+1", t1, t1 + step), ("compute", "prefill B", t1 + step, t2),
            ("d2h", "write-through of B's new pages", t2 + 0.05, t2 + 0.05 + write),
            ("compute", "decode step n+2", t2, t2 + step)]


@figure("13_copy_timeline.png")
def copy_timeline_figure():
    from ..viz.tiers import draw_copy_timeline

    ax = draw_copy_timeline(copy_timeline_spans(), title="A returning chat's 8k-token history crosses the "
                            "link while the others decode (modelled: an H200's measured numbers)")
    return ax.figure


def recorded_spans(timeline: dict, window_ms: float = 60.0) -> list[tuple[str, str, float, float]]:
    """The spans of a timeline recorded by ``python -m kvlab.bench --hierarchy`` (its first
    ``window_ms``), in ms: the steps on the compute lane (a prefill darker), every transfer on its
    copy lane (labelled with its size when it is wide enough to hold it)."""
    out = []
    for s in timeline["steps"]:
        a, b = (1e3 * t for t in s["device"])
        if a < window_ms:
            out.append(("compute", "" if s["decode_only"] else "prefill", a, min(b, window_ms)))
    for t in timeline["transfers"]:
        a, b = 1e3 * t["start"], 1e3 * t["end"]
        if a < window_ms:
            label = f"{t['bytes'] / 2**20:.0f} MiB" if b - a > window_ms / 12 else ""
            out.append(("h2d" if t["direction"] == "h2d" else "d2h", label, a, min(b, window_ms)))
    return out


def bench_rows(path: str | None = None):
    """The real model's rows from ``figures/bench.json`` (``None`` when it holds no GPU run)."""
    path = path or os.path.join(os.path.dirname(__file__), "..", "..", "..", "figures", "bench.json")
    try:
        with open(path) as f:
            part = json.load(f).get("hierarchy")
    except (OSError, ValueError):
        return None
    if not part or part.get("smoke"):
        return None
    return part
