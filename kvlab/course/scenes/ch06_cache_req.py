"""Chapter 06's pictures: cache_req's four regions, and the stale page-table row of the source
design next to kvlab's remapped one."""
from __future__ import annotations

import torch

from ...manager.cache_manager import CacheManager, CacheRegions, Req
from ...alloc.paging import new_page_table
from .figure_registry import figure

P = 4
SYSTEM = list(range(100, 108))  # two pages of shared system prompt


def new_manager(num_pages: int = 12, rows: int = 4, *, remap_duplicates: bool = True,
                page_table_writer: str = "triton") -> CacheManager:
    """The chapter's small manager: page_size 4, ``rows`` request rows of 32 positions."""
    return CacheManager(num_pages, P, new_page_table(rows, 32, P),  # on the runtime's device
                        page_table_writer=page_table_writer, remap_duplicates=remap_duplicates)


def prefill(cm: CacheManager, reqs: list[Req], kv: dict | None = None) -> None:
    """The manager's prefill (admit + map pages), the model step (KV of each position = the
    tokens it saw), then complete_one; no token is sampled and nothing is cached yet: the
    chapter calls cache_req itself, to look at its regions."""
    batch = cm.prefill(reqs)
    for r in reqs:
        write_kv(cm, r, kv)
    cm.complete_step(batch, None, cache_prompt=False)


def decode(cm: CacheManager, req: Req, token: int, kv: dict | None = None) -> None:
    """One decode step of ``req`` whose next input is ``token``: map a page if it crosses a
    page boundary, the model step, complete_one."""
    req.append_token(token)
    batch = cm.decode_step([req])
    write_kv(cm, req, kv)
    cm.complete_step(batch, None)


def write_kv(cm: CacheManager, req: Req, kv: dict | None) -> None:
    """Pretend to run the model: slot of position p gets 'the KV of tokens [0, p]'."""
    if kv is None:
        return
    row = cm.page_table[req.table_idx, : req.device_len].tolist()  # one device->host copy
    for pos in range(req.cached_len, req.device_len):
        kv[row[pos]] = tuple(req.input_ids[: pos + 1])


def scenarios(page_table_writer: str = "triton") -> list[tuple[str, CacheRegions]]:
    """The chapter's four cache_req calls, in order, on one manager."""
    cm = new_manager(page_table_writer=page_table_writer)
    out = []
    a = Req(SYSTEM + [1, 2], 0)  # 10 tokens, nothing cached yet
    prefill(cm, [a])
    out.append(("A: first prefill (nothing cached)", cm.cache_req(a, finished=False)))
    b = Req(SYSTEM + [3, 4, 5], 1)  # hits A's two system pages
    prefill(cm, [b])
    out.append(("B: plain hit", cm.cache_req(b, finished=False)))
    c, d = Req(SYSTEM + [7, 7, 7, 7, 8], 2), Req(SYSTEM + [7, 7, 7, 7, 8], 3)  # same prompt, one batch
    prefill(cm, [c, d])
    cm.cache_req(c, finished=False)
    out.append(("D: same prompt as C, same batch", cm.cache_req(d, finished=False)))
    for token in (9, 10):  # two decode steps; the second crosses into a new page
        decode(cm, b, token)
    out.append(("B finishes after two decode steps", cm.cache_req(b, finished=True)))
    cm.check_integrity()
    return out


@figure("06_cache_req_regions.png")
def cache_req_regions_figure():
    from ..viz.regions import region_bars

    return region_bars(scenarios("host"), title="cache_req: the four regions of [0, req.cached_len)")


def stale_row_demo(remap_duplicates: bool, page_table_writer: str = "triton"):
    """Two requests with one prompt in one batch, both cached unfinished, then a newcomer
    takes the freed pages. Returns ``(manager, kv, prompt)``."""
    cm = new_manager(num_pages=6, rows=3, remap_duplicates=remap_duplicates,
                     page_table_writer=page_table_writer)
    kv: dict = {}
    prompt = SYSTEM + [1, 2]
    a, b = Req(prompt, 0), Req(list(prompt), 1)
    prefill(cm, [a, b], kv)
    cm.cache_req(a, finished=False)
    cm.cache_req(b, finished=False)
    c = Req([50 + i for i in range(8)], 2)  # needs two pages: exactly the ones b gave back
    prefill(cm, [c], kv)
    return cm, kv, prompt


def wrong_reads(cm: CacheManager, kv: dict, prompt: list[int], row: int = 1) -> torch.Tensor:
    """Positions of ``row`` (over the prompt) whose slot holds KV of other tokens."""
    slots = cm.page_table[row, : len(prompt)].tolist()
    return torch.tensor([kv.get(s) != tuple(prompt[: p + 1]) for p, s in enumerate(slots)])


@figure("06_stale_row.png")
def stale_row_figure():
    import matplotlib.pyplot as plt

    from ..viz import page_table_heatmap

    fig, axes = plt.subplots(2, 1, figsize=(8, 4.2))
    for ax, remap, name in ((axes[0], False, "source design (remap_duplicates=False)"),
                            (axes[1], True, "kvlab (duplicate region remapped)")):
        cm, kv, prompt = stale_row_demo(remap, "host")
        table = cm.page_table[:3, :12]
        bad = torch.zeros_like(table, dtype=torch.bool)
        bad[1, : len(prompt)] = wrong_reads(cm, kv, prompt)
        page_table_heatmap(table, P, ax=ax, highlight=bad, page_range=(0, 5),
                           title=f"{name}: {int(bad.sum())} positions of row 1 read another "
                                 "request's KV")
    fig.tight_layout()
    return fig
