"""Chapter 00's scenes: a scheduler's timeline (prefill, decode, extend), why pages (contiguous
reservations waste memory), sharing, a first page table."""
from __future__ import annotations

import random
from typing import NamedTuple, Sequence

import torch

from ...alloc.paging import new_page_table, page_to_token, write_page_table
from ..viz.legibility import MAX_WIDTH_IN
from .figure_registry import figure

_REQUEST_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
                   "#8c8c8c"]


# --- a scheduler's timeline: prefill, decode, extend --------------------------------------


class TimelineRequest(NamedTuple):
    """A request as the scheduler sees it: when it arrives, its prompt, how many tokens to generate."""

    name: str
    arrives: int  # the first step it can be scheduled in
    prompt_len: int
    output_len: int  # tokens to generate; the request finishes when it has sampled them all


class Extend(NamedTuple):
    """What one scheduler step does to one request: its KV grows from ``pre`` to ``seq`` tokens."""

    name: str
    pre: int  # tokens in the KV cache before the step (prefix_lens)
    seq: int  # tokens in the KV cache after it (seq_lens)
    samples: bool  # whether the step samples a next token for it (a prompt chunk does not)


class SchedulerStep(NamedTuple):
    """One iteration of the serving loop: one batch, one forward pass."""

    step: int
    kind: str  # "prefill" or "decode"
    work: list[Extend]
    waiting: list[str]  # arrived, but not in this step's batch
    finished: list[str]  # done after this step: their pages are freed


#: Three requests: A alone, then B joins, then C, whose prompt is longer than one step's budget.
THREE_REQUESTS = (TimelineRequest("A", 0, 6, 4), TimelineRequest("B", 2, 4, 3),
                  TimelineRequest("C", 3, 11, 2))


def scheduler_timeline(requests: Sequence[TimelineRequest] = THREE_REQUESTS,
                       prefill_budget: int = 8, max_steps: int = 100) -> list[SchedulerStep]:
    """Run mini-sglang's scheduling policy on ``requests`` and record every step.

    The policy (mini-sglang's ``Scheduler._schedule_next_batch``): a step runs a **prefill**
    batch when some request is waiting for its prompt, else a **decode** batch of every running
    request. A prefill batch takes waiting requests in arrival order, up to ``prefill_budget``
    prompt tokens in all; a prompt that does not fit is cut (chunked prefill) and its next
    piece goes first in a later step. The step that completes a prompt samples the request's
    first output token; a decode step feeds each running request its newest token (its KV
    grows by one) and samples the next. A request is finished when it has sampled
    ``output_len`` tokens.
    """
    in_cache = {r.name: 0 for r in requests}
    sampled = {r.name: 0 for r in requests}
    done: set[str] = set()
    steps: list[SchedulerStep] = []
    for step in range(max_steps):
        arrived = [r for r in requests if r.arrives <= step and r.name not in done]
        if not arrived and all(r.arrives <= step for r in requests):
            break
        waiting = [r for r in arrived if in_cache[r.name] < r.prompt_len]
        running = [r for r in arrived if in_cache[r.name] >= r.prompt_len]
        work: list[Extend] = []
        if waiting:
            kind, budget = "prefill", prefill_budget
            for r in waiting:
                if budget == 0:
                    break
                pre = in_cache[r.name]
                seq = min(r.prompt_len, pre + budget)
                budget -= seq - pre
                work.append(Extend(r.name, pre, seq, samples=seq == r.prompt_len))
        elif running:
            kind = "decode"
            work = [Extend(r.name, in_cache[r.name], in_cache[r.name] + 1, True) for r in running]
        else:
            kind = "idle"
        finished = []
        for e in work:
            in_cache[e.name] = e.seq
            if e.samples:
                sampled[e.name] += 1
                out_len = next(r.output_len for r in requests if r.name == e.name)
                if sampled[e.name] == out_len:
                    finished.append(e.name)
                    done.add(e.name)
        scheduled = {e.name for e in work}
        steps.append(SchedulerStep(step, kind, work,
                                   [r.name for r in arrived if r.name not in scheduled], finished))
    return steps


def describe_step(s: SchedulerStep) -> str:
    """One line per step, in the words of chapters 03-04 (``pre -> seq`` per request)."""
    parts = []
    for e in s.work:
        what = f"{e.name} {e.pre}->{e.seq}"
        if s.kind == "prefill" and not e.samples:
            what += " (a chunk: no token sampled)"
        parts.append(what)
    line = f"step {s.step}: {s.kind} batch [{', '.join(parts)}]"
    if s.waiting:
        line += f"; waiting: {', '.join(s.waiting)}"
    if s.finished:
        line += (f"; finished: {', '.join(s.finished)} (whole pages kept in the prefix cache, "
                 "the rest freed)")
    return line


_PREFILL, _CHUNK, _DECODE, _WAIT = "#4c72b0", "#9db4d8", "#dd8452", "0.85"


def timeline_figure(steps: Sequence[SchedulerStep] | None = None,
                    requests: Sequence[TimelineRequest] = THREE_REQUESTS):
    """Rows = requests, columns = scheduler steps; each cell says what the step did to the request."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    steps = list(steps) if steps is not None else scheduler_timeline(requests)
    names = [r.name for r in requests]
    fig, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, 1.15 * len(steps) + 2.4), 0.75 * len(names) + 1.6))
    for s in steps:
        for e in s.work:
            y = names.index(e.name)
            colour = _DECODE if s.kind == "decode" else (_PREFILL if e.samples else _CHUNK)
            ax.add_patch(Rectangle((s.step, y), 1, 1, facecolor=colour, edgecolor="white", lw=2))
            label = f"{e.pre}→{e.seq}" + ("\n+1 token" if e.samples else "\nno token")
            ax.text(s.step + 0.5, y + 0.5, label, ha="center", va="center", fontsize=7.5,
                    color="white" if colour != _CHUNK else "black")
        for name in s.waiting:
            y = names.index(name)
            ax.add_patch(Rectangle((s.step, y), 1, 1, facecolor=_WAIT, edgecolor="white", lw=2,
                                   hatch="///"))
            ax.text(s.step + 0.5, y + 0.5, "waits", ha="center", va="center", fontsize=7)
        for name in s.finished:
            ax.text(s.step + 1.05, names.index(name) + 0.5, "done", ha="left", va="center",
                    fontsize=7, color="#c44e52")
    ax.set_xlim(0, len(steps) + 0.5)
    ax.set_ylim(len(names), 0)
    ax.set_xticks([s.step + 0.5 for s in steps],
                  [f"step {s.step}\n{s.kind}" for s in steps], fontsize=7.5)
    ax.set_yticks([i + 0.5 for i in range(len(names))],
                  [f"{r.name} (prompt {r.prompt_len}, {r.output_len} out)" for r in requests],
                  fontsize=8)
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title("a scheduler's timeline: each cell shows the KV tokens before → after the step",
                 fontsize=9, loc="left")
    handles = [Patch(facecolor=_PREFILL, label="prefill (extend from pre to the whole prompt)"),
               Patch(facecolor=_CHUNK, label="prefill chunk (an extend that stops mid-prompt)"),
               Patch(facecolor=_DECODE, label="decode (extend by one token)"),
               Patch(facecolor=_WAIT, hatch="///", label="arrived, not in this step's batch")]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=7.5, frameon=False)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    return fig


def _cell(ax, x, y, color, *, hatch=None, text=None, edge="0.55"):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor=edge, lw=0.6, hatch=hatch))
    if text is not None:
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7, color="white")


def fragmentation_figure(lengths: Sequence[int] = (11, 3, 7, 14), max_seq_len: int = 16,
                         page_size: int = 4, seed: int = 0):
    """Contiguous per-request reservations (top) vs the same requests in pages (bottom).

    Both panels show the same KV pool of ``len(lengths) * max_seq_len`` slots.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_req = len(lengths)
    pool = n_req * max_seq_len
    n_pages = pool // page_size
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(MAX_WIDTH_IN, 4.3),
                                      gridspec_kw={"height_ratios": [n_req, 2.2]})

    # Top: each request owns a contiguous run of max_seq_len slots; the unused tail is lost.
    wasted = 0
    for r, n in enumerate(lengths):
        for t in range(max_seq_len):
            used = t < n
            wasted += not used
            _cell(top, t, r, _REQUEST_COLORS[r] if used else "white", hatch=None if used else "///")
    top.set_xlim(0, max_seq_len)
    top.set_ylim(n_req, 0)
    top.set_yticks([r + 0.5 for r in range(n_req)], [f"request {r} ({n} tok)" for r, n in enumerate(lengths)],
                   fontsize=8)
    top.set_xticks([])
    top.set_title(f"contiguous: every request reserves max_seq_len = {max_seq_len} slots up front —\n"
                  f"{wasted} of {pool} slots ({100 * wasted / pool:.0f}%) reserved but unused", fontsize=9,
                  loc="left")

    # Bottom: the same pool cut into pages; a request takes div_ceil(len, P) pages from a free list.
    rng = random.Random(seed)
    free = list(range(n_pages))
    rng.shuffle(free)
    owner = [-1] * pool
    fill = [False] * pool
    taken = 0
    for r, n in enumerate(lengths):
        pages = free[taken: taken + -(-n // page_size)]
        taken += len(pages)
        for k, p in enumerate(pages):
            for o in range(page_size):
                owner[p * page_size + o] = r
                fill[p * page_size + o] = k * page_size + o < n
    per_row = pool // 2
    tail_waste = sum(1 for s in range(pool) if owner[s] >= 0 and not fill[s])
    for s in range(pool):
        row, col = divmod(s, per_row)
        r = owner[s]
        if r < 0:
            _cell(bottom, col, row, "white")
        elif fill[s]:
            _cell(bottom, col, row, _REQUEST_COLORS[r])
        else:
            _cell(bottom, col, row, _REQUEST_COLORS[r], hatch="///", edge="0.55")
            bottom.patches[-1].set_alpha(0.35)
    for b in range(0, per_row + 1, page_size):
        bottom.axvline(b, color="0.15", lw=1.2)
    bottom.set_xlim(0, per_row)
    bottom.set_ylim(2, 0)
    bottom.set_yticks([])
    bottom.set_xticks([p * page_size + page_size / 2 for p in range(per_row // page_size)],
                      [f"page {p}" for p in range(per_row // page_size)], fontsize=7)
    free_pages = n_pages - taken
    bottom.set_title(f"paged (page_size = {page_size}): requests take whole pages from anywhere in the pool —\n"
                     f"{tail_waste} slots unused in last pages, {free_pages} pages "
                     f"({free_pages * page_size} slots) still free for new requests", fontsize=9, loc="left")
    handles = [Patch(facecolor=_REQUEST_COLORS[r], label=f"request {r}") for r in range(n_req)]
    handles.append(Patch(facecolor="white", edgecolor="0.4", hatch="///", label="reserved, unused"))
    fig.legend(handles=handles, loc="lower center", ncol=n_req + 1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def sharing_table(page_size: int = 4, seed: int = 0) -> tuple[torch.Tensor, int]:
    """A page table where requests 0-2 share a 2-page system prompt (same physical pages)."""
    table = new_page_table(4, 6 * page_size, page_size, device="cpu")
    rng = random.Random(seed)
    shared_pages = [7, 3]  # the prompt's pages, computed once and mapped by every sharer
    free = [p for p in range(24) if p not in shared_pages]
    rng.shuffle(free)
    shared = torch.tensor(shared_pages) * page_size
    own_pages = {0: 3, 1: 2, 2: 4, 3: 3}
    info, starts = [], []
    for row, n in own_pages.items():
        first = 2 if row < 3 else 0  # request 3 has a different prompt: no sharing
        info.append((row, first, first + n))
        starts += [free.pop() * page_size for _ in range(n)]
    for row in range(3):
        table[row, : 2 * page_size] = page_to_token(shared, page_size).to(torch.int32)
    allocated = page_to_token(torch.tensor(starts, dtype=torch.int32), page_size)
    write_page_table(table, allocated, info, page_size)
    return table, page_size


def first_page_table(n_requests: int = 5, max_seq_len: int = 32, page_size: int = 4, seed: int = 0):
    """A seeded batch: random lengths, pages from a shuffled free list; returns (table, lengths)."""
    rng = random.Random(seed)
    table = new_page_table(n_requests, max_seq_len, page_size, device="cpu")
    free = list(range(n_requests * max_seq_len // page_size))
    rng.shuffle(free)
    lengths = [rng.randint(1, max_seq_len) for _ in range(n_requests)]
    info, starts = [], []
    for row, n in enumerate(lengths):
        pages = -(-n // page_size)
        info.append((row, 0, pages))
        starts += [free.pop() * page_size for _ in range(pages)]
    write_page_table(table, page_to_token(torch.tensor(starts, dtype=torch.int32), page_size), info,
                     page_size)
    # the last page of a request is only partly used: unmap the positions past its length
    for row, n in enumerate(lengths):
        table[row, n:] = -1
    return table, lengths


@figure("00_timeline.png")
def fig_timeline():
    return timeline_figure()


@figure("00_fragmentation.png")
def fig_fragmentation():
    return fragmentation_figure()


@figure("00_sharing.png")
def fig_sharing():
    from ..viz import page_table_heatmap

    table, page_size = sharing_table()
    ax = page_table_heatmap(table, page_size, rows=slice(0, 4),
                            title="requests 0-2 share one system prompt: their first two pages are "
                                  "the same physical pages (same colours, same slots)")
    ax.figure.set_size_inches(MAX_WIDTH_IN, 2.6)
    return ax.figure


@figure("00_first_page_table.png")
def fig_first_page_table():
    from ..viz import page_table_heatmap

    table, lengths = first_page_table()
    ax = page_table_heatmap(table, 4, title=f"a first page table: {len(lengths)} requests of lengths "
                                             f"{lengths} (last row: the spare dummy row)",
                            annotate=False)
    ax.figure.set_size_inches(MAX_WIDTH_IN, 2.8)
    return ax.figure
