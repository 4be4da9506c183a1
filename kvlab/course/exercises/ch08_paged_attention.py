"""Chapter 08's warm-up exercise: ``kvlab.check.paged_attention(fn)``, paged decode attention in
plain torch (the kernel's exercise, ``paged_attention_kernel``, is in
:mod:`kvlab.course.exercises.ch08_attention_kernel`).

The learner first writes paged decode attention in plain torch::

    fn(q, k_pool, v_pool, page_table, table_idx, seq_lens) -> out

``q`` is ``[batch, heads, head_dim]`` (one new query per request), the pools are
``[num_slots, heads, head_dim]``, request ``b`` owns page-table row ``table_idx[b]`` and
attends to its positions ``[0, seq_lens[b])``, whose K/V live at the slots that row names.
``out`` is ``[batch, heads, head_dim]``; every argument is read-only. Checked against
:func:`kvlab.course.reference.paged_decode_attention_reference` (float32, ``atol=1e-4``); a failure
names the request and head and, when it recognises the mistake, says which one (the row not
used, the scale forgotten, one position too few, reading past ``seq_len``).
"""
from __future__ import annotations

import math
import random

import torch

from ...attention.kv_pool import random_paged_layout
from ..checking.core import Case, CheckFailed, call_learner, exercise, looks_like, run_cases
from ..checking.failures import Layout

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


def attention_layout(P: int, lens: list[int], seed: int, heads: int = 2, head_dim: int = 8):
    """Random K/V, and rows mapping each request to shuffled, disjoint pages (rows shuffled too)."""
    return tuple(random_paged_layout(seed, P, lens, heads=heads, head_dim=head_dim))


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, lens, kind="edge", seed=0):
        return Case(name, dict(P=P, lens=lens, seed=seed), kind)

    cases = [
        case("one request, one token", 4, [1]),
        case("page_size 1", 1, [5, 3]),
        case("page-aligned lengths", 4, [8, 4]),
        case("unaligned lengths", 4, [7, 2, 13]),
        case("rows out of order, many requests", 2, [3, 9, 1, 6, 4, 11]),
        case("page_size 64, a request longer than a page", 64, [70, 5]),
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
    width = table.shape[1]
    tries = {
        "it attends to one position too few, [0, seq_len - 1): the slice page_table[row, :n] "
        "already stops before n":
            lambda: paged_attention_solution(q, k, v, table, rows, lens - 1),
        "it reads past seq_len: position seq_len is not the request's (an unmapped -1 there "
        "reads the pool's last slot); the positions are [0, seq_len)":
            lambda: paged_attention_solution(q, k, v, table, rows, (lens + 1).clamp(max=width)),
        "it reads the whole row, past seq_len (unmapped -1 positions read the pool's last slot); "
        "take only page_table[row, :seq_len]":
            lambda: paged_attention_solution(q, k, v, table, rows, torch.full_like(lens, width)),
        "it reads slots 0..seq_len-1 of the pool directly: go through the page-table row":
            lambda: paged_attention_solution(
                q, k, v, torch.arange(table.shape[1], dtype=torch.int32).expand(table.shape), rows, lens),
        "it uses row b instead of row table_idx[b]":
            lambda: paged_attention_solution(q, k, v, table, torch.arange(len(lens)), lens),
        "it forgets the 1/sqrt(head_dim) scale":
            lambda: paged_attention_solution(q * math.sqrt(q.shape[-1]), k, v, table, rows, lens),
    }
    return looks_like(got, tries, ATOL)


@exercise(
    "paged_attention",
    chapter="08",
    order=1,
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
        args = attention_layout(a["P"], a["lens"], a["seed"])
        want = paged_decode_attention_reference(*args)
        where = f"  page_size {a['P']}, seq_lens {a['lens']}, rows {args[4].tolist()}"
        got = call_learner(fn, *[x.clone() for x in args], layout=Layout(inputs=where.strip()),
                           read_only=range(6))
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
