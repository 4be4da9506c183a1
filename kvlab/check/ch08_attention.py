"""Chapter 08's exercise: ``kvlab.check.paged_attention(fn)``.

The learner writes paged decode attention in plain torch::

    fn(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> out

``q`` is ``[batch, heads, head_dim]`` (one new query per request), the pools are
``[num_slots, heads, head_dim]``, request ``b`` owns page-table row ``table_idx[b]`` and
attends to its positions ``[0, seq_lens[b])``, whose K/V live at the slots that row names.
``out`` is ``[batch, heads, head_dim]``. Checked against
:func:`kvlab.reference.paged_decode_attention_reference` (float32, ``atol=1e-4``); a failure
names the request and head and, when it recognises the mistake, says which one.
"""
from __future__ import annotations

import math
import random

import torch

from .core import Case, CheckFailed, call_learner, exercise, run_cases
from .failures import Layout

ATOL = 1e-4


def paged_attention_solution(q, k_pool, v_pool, page_table, table_idx, seq_lens):
    """Per request: the row's first seq_len slots -> gather K, V -> softmax(q.K / sqrt(d)) V."""
    out = torch.empty_like(q, dtype=torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for b in range(q.shape[0]):
        row, n = int(table_idx[b]), int(seq_lens[b])
        slots = page_table[row, :n].long()                  # logical position -> physical slot
        k, v = k_pool[slots].float(), v_pool[slots].float()  # [n, heads, head_dim]
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def _layout(P: int, lens: list[int], seed: int, heads: int = 2, head_dim: int = 8):
    """Random K/V, and rows mapping each request to shuffled, disjoint pages (rows shuffled too)."""
    rng = random.Random(seed)
    per_req = [-(-n // P) for n in lens]
    num_pages = sum(per_req) + 2
    pages = list(range(num_pages))
    rng.shuffle(pages)
    rows = list(range(len(lens) + 1))
    rng.shuffle(rows)
    table = torch.full((len(lens) + 1, max(per_req) * P), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(lens):
        mine = pages[taken:taken + per_req[b]]
        taken += per_req[b]
        table[rows[b], :n] = torch.tensor([p * P + o for p in mine for o in range(P)][:n], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages * P, heads, head_dim, generator=g)
    v = torch.randn(num_pages * P, heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k, v, table, torch.tensor(rows[:len(lens)]), torch.tensor(lens)


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, lens, kind="edge", seed=0):
        return Case(name, dict(P=P, lens=lens, seed=seed), kind)

    cases = [
        case("one request, one token", 4, [1]),
        case("page_size 1", 1, [5, 3]),
        case("page-aligned lengths", 4, [8, 4]),
        case("unaligned lengths", 4, [7, 2, 13]),
        case("rows out of order, many requests", 2, [3, 9, 1, 6, 4, 11]),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 16])
        cases.append(case(f"random {i + 1} (page_size {P})", P,
                          [rng.randint(1, 3 * P + 3) for _ in range(rng.randint(1, 4))],
                          "random", rng.randrange(1000)))
    return cases


def _diagnose(args, got) -> str:
    """Name a common mistake when the learner's output matches it."""
    q, k, v, table, rows, lens = args
    tries = {
        "it reads slots 0..seq_len-1 of the pool directly: go through the page-table row":
            lambda: paged_attention_solution(
                q, k, v, torch.arange(table.shape[1], dtype=torch.int32).expand(table.shape), rows, lens),
        "it uses row b instead of row table_idx[b]":
            lambda: paged_attention_solution(q, k, v, table, torch.arange(len(lens)), lens),
        "it forgets the 1/sqrt(head_dim) scale":
            lambda: paged_attention_solution(q * math.sqrt(q.shape[-1]), k, v, table, rows, lens),
    }
    for message, make in tries.items():
        try:
            wrong = make()
        except Exception:  # noqa: BLE001 - a wrong variant may not even run on this input
            continue
        if wrong.shape == got.shape and torch.allclose(wrong, got, atol=ATOL):
            return "\n  looks like " + message
    return ""


@exercise(
    "paged_attention",
    chapter="08",
    hints=[
        "Work one request at a time: row = table_idx[b], n = seq_lens[b]. The slots of its tokens "
        "are page_table[row, :n] - positions n and beyond may be unmapped (-1).",
        "Gather with those slots: k = k_pool[slots] is [n, heads, head_dim]. Scores per head are "
        "q[b] . k over head_dim, times 1/sqrt(head_dim): torch.einsum('hd,nhd->hn', q[b], k).",
        "softmax over the n positions (dim=-1), then the weighted sum of v: "
        "torch.einsum('hn,nhd->hd', weights, v). Convert slots with .long() before indexing.",
    ],
    solution=paged_attention_solution,
)
def paged_attention(fn, *, seed: int = 0, n_random: int = 6) -> int:
    """Check ``fn(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> [batch, heads, head_dim]``."""
    from ..reference import paged_decode_attention_reference

    def run_one(case: Case) -> None:
        a = case.args
        args = _layout(a["P"], a["lens"], a["seed"])
        want = paged_decode_attention_reference(*args)
        where = f"  page_size {a['P']}, seq_lens {a['lens']}, rows {args[4].tolist()}"
        got = call_learner(fn, *[x.clone() for x in args], layout=Layout(inputs=where.strip()))
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise CheckFailed(f"[{case.name}] return a tensor of shape {tuple(want.shape)} "
                              f"[batch, heads, head_dim], got {shape}\n{where}", case=case.name)
        err = (got.float().cpu() - want).abs()
        if not bool((err <= ATOL).all()) or not bool(torch.isfinite(got).all()):
            err = torch.nan_to_num(err, nan=float("inf"))
            b, h = divmod(int(err.amax(-1).flatten().argmax()), want.shape[1])
            raise CheckFailed(
                f"[{case.name}] request {b}, head {h}: off by up to {float(err[b, h].max()):.3g} "
                f"(tolerance {ATOL})\n  expected {want[b, h, :4].tolist()} ...\n  got      "
                f"{got[b, h, :4].float().tolist()} ...{_diagnose(args, got.float().cpu())}\n{where}",
                case=case.name, label=f"request {b}, head {h}")

    return run_cases("paged_attention", _cases(seed, n_random), run_one)
