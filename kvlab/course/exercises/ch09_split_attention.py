"""Chapter 09's decode-attention exercise, part 1: ``kvlab.check.split_attention(kernel)``, the
block loads of the first pass (part 2, the merge, is :mod:`kvlab.course.exercises.ch09_merge_splits`).

One program per ``(request, K/V head g, split s)`` serves the ``GROUP`` query heads
``g * GROUP .. g * GROUP + GROUP - 1``; it walks the positions of its split in blocks of
``BLOCK_N`` and writes its partial result: the normalised output ``o[b, h, s]`` and the
log-sum-exp ``lse[b, h, s]`` of each of its query heads. The learner writes what one block
reads::

    positions  n0 .. n0 + BLOCK_N - 1     (offs_n; mask_n: < end of the split)
    slots      page_table[row, offs_n]    one per position: a block may span several pages,
                                          and a request's pages need not be adjacent
    K          [BLOCK_D, BLOCK_N]         K/V head g of those slots (ready for tl.dot(q, K))
    V          [BLOCK_N, BLOCK_D]

The checker launches it (``run_split_kernel``) with blocks of 16 and 32 positions (the
smallest ``tl.dot``), page sizes 1 to 16 on shuffled pages (a block that assumes its slots are
consecutive reads other requests' rows), grouped and plain multi-head attention, splits that
hold nothing, a model's own ``scale``, and pools whose last slots (and page tables whose last
row) are in use with a head size below ``BLOCK_D``, where an unmasked load reads past the end;
and compares every live split of every query head with
:func:`kvlab.course.reference.split_partials_reference`. A wrong answer that a known slip gives
(:mod:`kvlab.course.exercises.ch09_split_slips`) is told by that slip, before any read outside the pool
it made. Every argument but ``o`` and ``lse`` is
read-only; the kernel is also compiled for a GPU (:mod:`kvlab.course.checking.compiled`).
"""
from __future__ import annotations

import math
import random

import torch
import triton
import triton.language as tl

from ...base import runtime
from ..reference.attention_ref import split_partials_reference, split_ranges_reference
from .ch09_split_slips import SLIPS, emulated_partials, spare_layout  # noqa: F401  (spare_layout: merge_splits)
from ..checking.core import Case, CheckFailed, call_learner, exercise, pending_findings, run_cases

ATOL = 1e-4


@triton.jit
def split_attention_solution(q_ptr, k_pool_ptr, v_pool_ptr, page_table_ptr, table_idx_ptr,
                             seq_lens_ptr, o_ptr, lse_ptr, scale, num_splits, stride_q_b,
                             stride_q_h, stride_kv_s, stride_kv_h, stride_pt_row, stride_o_b,
                             stride_o_h, stride_o_s, stride_l_b, stride_l_h, head_dim,
                             GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)  # the K/V head: its GROUP query heads share it
    s = tl.program_id(2)  # the split
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # whole blocks
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:  # a split past the request's end has nothing to read
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = g * GROUP + offs_h  # the query heads of this program
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            # ---- the block's loads ----
            slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv = slots * stride_kv_s + g * stride_kv_h  # each position's row of K/V head g
            k = tl.load(k_pool_ptr + kv[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None],
                        other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]
            v = tl.load(v_pool_ptr + kv[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :],
                        other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            # ---- the online softmax of chapter 08, every query head of the group at once ----
            scores = tl.dot(q, k, input_precision="ieee") * scale  # [BLOCK_H, BLOCK_N]
            scores = tl.where(mask_n[None, :], scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + s * stride_o_s + offs_d[None, :]
        tl.store(o_ptr + out, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(lse_ptr + b.to(tl.int64) * stride_l_b + heads * stride_l_h + s, m_i + tl.log(l_i), mask=mask_h)


def run_split_kernel(kernel, q, k_pool, v_pool, page_table, table_idx, seq_lens, num_splits: int,
                     block_n: int, scale: float | None = None):
    """Launch a first-pass kernel of the chapter's signature on the grid ``(batch, kv_heads,
    num_splits)``; returns ``(o, lse)`` on the CPU, NaN wherever nothing was written."""
    from ...attention.paged_attention import check_paged_attention_inputs

    check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    dev = runtime.DEVICE
    q, k_pool, v_pool = (x.to(dev, torch.float32).contiguous() for x in (q, k_pool, v_pool))
    page_table = page_table.to(dev).contiguous()
    table_idx = torch.as_tensor(table_idx).to(dev, torch.int64)
    seq_lens = torch.as_tensor(seq_lens).to(dev, torch.int64)
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    o = torch.full((batch, heads, num_splits, head_dim), float("nan"), device=dev)
    lse = torch.full((batch, heads, num_splits), float("nan"), device=dev)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    call_learner(kernel, q, k_pool, v_pool, page_table, table_idx, seq_lens, o, lse, scale, num_splits,
                 q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), page_table.stride(0),
                 o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), head_dim,
                 grid=(batch, kv_heads, num_splits), GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
                 BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), read_only=range(6))
    return o.cpu(), lse.cpu()


def _layout(a: dict):
    return spare_layout(a["seed"], a["P"], a["lens"], a["heads"], a["kv_heads"], a["head_dim"],
                        spare=a["block_n"] // a["P"] + 2, last_in_use=a.get("last", False))


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, lens, splits, block_n=16, heads=8, kv_heads=2, head_dim=16, scale=1.0, kind="edge",
             seed=0, last=False):
        return Case(name, dict(P=P, lens=lens, splits=splits, block_n=block_n, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, scale=scale / math.sqrt(head_dim), seed=seed, last=last), kind)

    cases = [
        case("one request, one token, four K/V heads", 4, [1], 1, kv_heads=4),
        case("page_size 3: every block crosses pages", 3, [40, 7], 1, kv_heads=4),
        case("one split per request, page_size 1", 1, [20, 33], 1),
        case("three splits, page_size 4, ragged lengths", 4, [70, 5, 33], 3),
        case("more splits than blocks: some hold nothing", 3, [17, 2], 6),
        case("page_size 16 = BLOCK_N, lengths ending mid-page", 16, [45, 18], 2),
        case("plain multi-head attention (GROUP 1)", 4, [30, 9], 2, heads=3, kv_heads=3),
        case("one K/V head for all 6 query heads", 2, [25], 2, heads=6, kv_heads=1),
        case("head_dim 12 (masked lanes), BLOCK_N 32", 8, [50, 12], 2, block_n=32, head_dim=12),
        case("BLOCK_N 32, four splits of 40 positions: one block each", 4, [40], 4, block_n=32),
        case("scale 0.3 (a model's own), four K/V heads", 4, [37], 3, heads=8, kv_heads=4,
             scale=0.3 * math.sqrt(16)),
        # a load that reaches past a K/V row or the page-table row stays inside the tensors above
        # (spare pages at the end, head_dim == BLOCK_D); here it reads past their ends
        case("the pool's last slots in use, head_dim 12 (BLOCK_D 16)", 4, [24, 9], 2, head_dim=12, last=True),
        case("the pool's last slots and the table's last row in use, head_dim 20 (BLOCK_D 32), BLOCK_N 32",
             8, [40, 17], 3, block_n=32, heads=4, kv_heads=2, head_dim=20, last=True),
    ]
    rng = random.Random(seed * 1000 + 91)
    for i in range(n_random):
        P = rng.choice([1, 2, 3, 4, 8, 16])
        kv = rng.choice([1, 2, 3])
        cases.append(case(f"random {i + 1} (page_size {P})", P, [rng.randint(1, 70) for _ in range(rng.randint(1, 3))],
                          rng.randint(1, 5), rng.choice([16, 32]), kv * rng.choice([1, 2, 4]), kv, kind="random",
                          seed=rng.randrange(1000), scale=rng.choice([1.0, 0.5, 2.0])))
    return cases


def _same(a: torch.Tensor, b: torch.Tensor, live: torch.Tensor) -> bool:
    return torch.allclose(a[live], b[live], atol=ATOL, equal_nan=True)


def _slip_named(a: dict, args, o, lse, o_want, lse_want, live) -> str | None:
    """The key of the SLIPS entry whose emulation gives the learner's numbers (NaN included),
    among those that change this case's answer; ``None`` when none does."""
    for slip in SLIPS:
        wrong = emulated_partials(*args, a["splits"], a["block_n"], a["scale"], slip)
        if wrong is None or (_same(wrong[0], o_want, live) and _same(wrong[1], lse_want, live)):
            continue
        if _same(wrong[0], o, live) and _same(wrong[1], lse, live):
            return slip
    return None


def _compare(case: Case, args, got, want) -> None:
    a = case.args
    (o, lse), (o_want, lse_want) = got, want
    live = ~torch.isnan(lse_want)                                   # [batch, heads, splits]
    err = torch.nan_to_num((o - o_want).abs().amax(-1), nan=float("inf"))
    err_l = torch.nan_to_num((lse - lse_want).abs(), nan=float("inf"))
    bad = live & ((err > ATOL) | (err_l > ATOL))
    if not bool(bad.any()):
        return
    b, h, s = (int(x) for x in bad.nonzero()[0])
    group = a["heads"] // a["kv_heads"]
    slip = _slip_named(a, args, o, lse, o_want, lse_want, live)
    why = "" if slip is None else "\n  looks like " + SLIPS[slip]
    spans = split_ranges_reference(int(args[5][b]), a["splits"], a["block_n"])
    row = int(args[4][b])
    # a slip recognised behind reads outside the pool is the cause: told before those reads
    label = "named cause" if slip is not None and pending_findings() else f"request {b}, query head {h}, split {s}"
    raise CheckFailed(
        f"[{case.name}] request {b} (page-table row {row}), query head {h} (K/V head {h // group}), split {s} "
        f"(positions {spans[s][0]}..{spans[s][1] - 1}): o off by {float(err[b, h, s]):.3g}, lse off by "
        f"{float(err_l[b, h, s]):.3g} (tolerance {ATOL})\n  expected o {o_want[b, h, s, :3].tolist()} ..., "
        f"lse {float(lse_want[b, h, s]):.4f}\n  got      o {o[b, h, s, :3].tolist()} ..., lse "
        f"{float(lse[b, h, s]):.4f}{why}\n  page_size {a['P']}, seq_lens {a['lens']}, rows {args[4].tolist()}, "
        f"num_splits {a['splits']}, BLOCK_N {a['block_n']}, head_dim {a['head_dim']}, {a['heads']} query heads "
        f"on {a['kv_heads']} K/V heads (GROUP {group}), scale {a['scale']:.4g}", case=case.name, label=label)


@exercise(
    "split_attention",
    chapter="09",
    hints=[
        "One slot per position: slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n, "
        "mask=mask_n, other=0). The block's positions are consecutive in the row, not in the pool: "
        "pages are wherever the allocator found them.",
        "The program serves the GROUP query heads of K/V head g = tl.program_id(1), so every load "
        "reads K/V head g: the row of slot t's K/V head g starts at t * stride_kv_s + g * stride_kv_h.",
        "K as [BLOCK_D, BLOCK_N] for tl.dot(q, k): offsets kv[None, :] + offs_d[:, None] with the mask "
        "mask_n[None, :] & mask_d[:, None]; V as [BLOCK_N, BLOCK_D]: kv[:, None] + offs_d[None, :]. "
        "Load with other=0.0 and convert with .to(tl.float32).",
    ],
    solution=split_attention_solution,
)
def split_attention(kernel, *, seed: int = 0, n_random: int = 3) -> int:
    """Check your first pass (the block's loads): every split's o and lse, every query head."""

    def run_one(case: Case) -> None:
        a = case.args
        args = _layout(a)
        want = split_partials_reference(*args, a["splits"], a["block_n"], a["scale"])
        got = run_split_kernel(kernel, *[x.clone() for x in args], a["splits"], a["block_n"], a["scale"])
        _compare(case, args, got, want)

    return run_cases("split_attention", _cases(seed, n_random), run_one)
