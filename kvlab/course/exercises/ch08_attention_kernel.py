"""Chapter 08's kernel exercise: ``kvlab.check.paged_attention_kernel(kernel)``, the
online-softmax update inside the paged-attention Triton kernel (the torch warm-up,
``paged_attention``, is in :mod:`kvlab.course.exercises.ch08_paged_attention`).

The same attention as a Triton kernel, one program per ``(request, head)``, walking the
request's tokens in blocks of ``BLOCK_N``. The learner writes the **online-softmax update** inside the loop: from the block's masked ``scores`` and
its ``v`` rows, the new running max, the rescale factor of what was summed before, the
block's weights, and the new ``acc``, ``l_i`` and ``m_i``::

    block:      [ s0 s1 s2 s3 ]  [ s4 s5 s6 s7 ]  [ s8  -inf -inf -inf ]   (masked lanes: -inf)
    m_i:   -inf ──max──► m1 ──────max──► m2 ──────max──► m3
    acc, l_i:    0 ──×exp(m_old - m_new) + this block's exp(s - m_new)-weighted sums──► ...
    out = acc / l_i

The checker launches the learner's kernel (``run_attention_kernel``) with blocks smaller
than most requests (``BLOCK_N`` 4 to 16), so the rescale between blocks matters, on scores that
rise from block to block, fall, fall steeply (a block max without the running max overflows
``alpha``), and are large enough that ``exp`` overflows without the running max; with the
default ``scale`` and others, and ``BLOCK_D`` larger than ``head_dim``. The inputs are
read-only; only ``out`` is written.
"""
from __future__ import annotations

import math
import random

import torch
import triton
import triton.language as tl

from ...base import runtime  # noqa: F401  (decides compiled vs interpreter before @triton.jit)
from .ch08_paged_attention import ATOL, attention_layout
from ..checking.core import Case, CheckFailed, call_learner, exercise, pending_findings, run_cases


@triton.jit
def paged_attention_kernel_solution(q_ptr, k_pool_ptr, v_pool_ptr, page_table_ptr, table_idx_ptr,
                                    seq_lens_ptr, out_ptr, scale, stride_q_b, stride_q_h,
                                    stride_kv_s, stride_kv_h, stride_pt_row, stride_o_b,
                                    stride_o_h, head_dim, BLOCK_N: tl.constexpr,
                                    BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h + offs_d, mask=mask_d, other=0.0)
    m_i = -float("inf")  # running max of the scores so far
    l_i = 0.0  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running sum of exp(score - m_i) * v
    for start in range(0, seq_len, BLOCK_N):  # a runtime bound: no recompile per length
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        slots = tl.load(page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_offs = slots[:, None] * stride_kv_s + h * stride_kv_h + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_pool_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.where(mask_n, tl.sum(q[None, :] * k, 1) * scale, -float("inf"))
        v = tl.load(v_pool_ptr + kv_offs, mask=kv_mask, other=0.0)
        m_new = tl.maximum(tl.max(scores, 0), m_i)  # masked lanes (-inf) never win
        alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max (0 at first)
        p = tl.exp(scores - m_new)  # this block's weights; exp(-inf) = 0 on masked lanes
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h + offs_d, acc / l_i, mask=mask_d)


def run_attention_kernel(kernel, q, k_pool, v_pool, page_table, table_idx, seq_lens, block_n: int,
                         scale: float | None = None, block_d: int | None = None):
    """Launch a paged-attention kernel of the chapter's signature; return ``out``.

    The host checks come first (:func:`kvlab.attention.paged_attention.check_paged_attention_inputs`), as
    in the chapter's wrapper; ``out`` starts as NaN, so a position never written shows.
    ``scale`` defaults to ``1/sqrt(head_dim)``, ``block_d`` to the next power of two (at least
    16). The inputs must come back unchanged.
    """
    from ...attention.paged_attention import check_paged_attention_inputs

    check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    dev = runtime.DEVICE
    q, k_pool, v_pool = (x.to(dev, torch.float32).contiguous() for x in (q, k_pool, v_pool))
    page_table = page_table.to(dev).contiguous()
    table_idx = torch.as_tensor(table_idx).to(dev, torch.int64)
    seq_lens = torch.as_tensor(seq_lens).to(dev, torch.int64)
    batch, heads, head_dim = q.shape
    out = torch.full((batch, heads, head_dim), float("nan"), dtype=torch.float32, device=dev)
    call_learner(kernel, q, k_pool, v_pool, page_table, table_idx, seq_lens, out,
                 1.0 / math.sqrt(head_dim) if scale is None else scale, q.stride(0), q.stride(1),
                 k_pool.stride(0), k_pool.stride(1), page_table.stride(0), out.stride(0),
                 out.stride(1), head_dim, grid=(batch, heads), BLOCK_N=block_n,
                 BLOCK_D=block_d or max(16, triton.next_power_of_2(head_dim)), read_only=range(6))
    return out.cpu()


#: Mistakes in the online-softmax update that the checker recognises (its torch emulation
#: of the kernel, with that one mistake, gives the learner's numbers).
KERNEL_SLIPS = {
    "acc is not rescaled: acc = acc * alpha + ... (what was summed under the old max must be "
    "scaled by alpha = exp(m_i - m_new) when the max grows)": "acc",
    "l_i is not rescaled: l_i = l_i * alpha + tl.sum(p, 0)": "l",
    "m_i is never updated (m_i = m_new after the block): alpha is then 0 in every block, so "
    "only the last block counts": "m",
    "p = exp(scores) without the running max: the weights must be exp(scores - m_new), on the "
    "same scale that alpha rescales acc and l_i to": "p",
    "m_i is updated before alpha is computed: alpha = exp(m_i - m_new) is then exp(0) = 1 and "
    "nothing summed under the old max is rescaled. Compute alpha (and p) from the old m_i; set "
    "m_i = m_new last": "mfirst",
    "m_new is the block's own max, without the running max: after a block of large scores, a "
    "block of smaller ones makes alpha = exp(m_i - m_new) overflow to inf. Take "
    "m_new = tl.maximum(tl.max(scores, 0), m_i)": "blockmax",
}


def blocked_attention(q, k_pool, v_pool, page_table, table_idx, seq_lens, block_n: int,
                      slip: str | None = None, scale: float | None = None) -> torch.Tensor:
    """The kernel's algorithm in torch, block by block (``slip``: one of KERNEL_SLIPS' values)."""
    batch, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    for b in range(batch):
        slots = page_table[int(table_idx[b]), : int(seq_lens[b])].long()
        for h in range(heads):
            m, l, acc = torch.tensor(-math.inf), torch.tensor(0.0), torch.zeros(head_dim)
            for start in range(0, len(slots), block_n):
                blk = slots[start:start + block_n]
                scores = (k_pool[blk, h].float() @ q[b, h].float()) * scale
                m_new = scores.max() if slip == "blockmax" else torch.maximum(scores.max(), m)
                alpha = torch.tensor(1.0) if slip == "mfirst" else torch.exp(m - m_new)
                p = torch.exp(scores if slip == "p" else scores - m_new)
                acc = (acc if slip == "acc" else acc * alpha) + p @ v_pool[blk, h].float()
                l = (l if slip == "l" else l * alpha) + p.sum()
                m = m if slip == "m" else m_new
            out[b, h] = acc / l
    return out


def _kernel_layout(a: dict):
    """The case's tensors: a random layout, with the scores shaped as the case asks."""
    q, k, v, table, rows, lens = attention_layout(a["P"], a["lens"], a["seed"], head_dim=a["head_dim"])
    scale = a.get("scale", 1.0 / math.sqrt(a["head_dim"]))
    if a["scores"] in ("rising", "falling", "steep"):
        # score of position t = +-t/2 (rising: every block brings a new max; falling: the first
        # does), or 100 - 30 t (steep: a later block's max is far below the running max)
        q = torch.zeros_like(q)
        q[:, :, 0] = 1.0 / scale  # q . k * scale = k[..., 0]
        for b, n in enumerate(a["lens"]):
            slots = table[int(rows[b]), :n].long()
            t = torch.arange(n, dtype=torch.float32)[:, None]
            k[slots, :, 0] = {"rising": 0.5 * t, "falling": -0.5 * t, "steep": 100 - 30 * t}[a["scores"]]
    elif a["scores"] == "large":
        q = q * 60.0  # scores of a few hundred: exp overflows float32 without the running max
    return q, k, v, table, rows, lens


def _kernel_cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, lens, block_n, scores="random", head_dim=8, kind="edge", seed=0, scale=1.0,
             block_d=None):
        # scale: a multiple of the default 1/sqrt(head_dim) (real models pass their own)
        return Case(name, dict(P=P, lens=lens, block_n=block_n, scores=scores, head_dim=head_dim,
                               seed=seed, scale=scale / math.sqrt(head_dim), block_d=block_d), kind)

    cases = [
        case("one request, one token", 4, [1], 4),
        case("one block per request (seq_len <= BLOCK_N)", 4, [3, 4], 4),
        case("several blocks, scores rising: every block brings a new max", 4, [13], 4, "rising"),
        case("several blocks, scores falling: the first block holds the max", 4, [13], 4, "falling"),
        case("large scores: exp overflows without the running max", 2, [9, 5], 4, "large"),
        case("page_size 1, a partly masked last block", 1, [6, 3], 4),
        case("rows out of order, many requests", 2, [3, 9, 1, 6, 4, 11], 4),
        case("head_dim 12 (masked lanes of head_dim)", 4, [9, 5], 4, head_dim=12),
        case("scores fall steeply: a later block's max is far below the running max", 4, [13],
             4, "steep"),
        case("scale 0.3 (a model's own, not 1/sqrt(head_dim)), BLOCK_N 8", 4, [17, 6], 8,
             scale=0.3 * math.sqrt(8)),
        case("page_size 64, BLOCK_N 16, BLOCK_D 32", 64, [70, 9], 16, block_d=32),
    ]
    rng = random.Random(seed * 1000 + 8)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 16])
        cases.append(case(f"random {i + 1} (page_size {P})", P,
                          [rng.randint(1, 3 * P + 9) for _ in range(rng.randint(1, 4))],
                          rng.choice([4, 8, 16]), rng.choice(["random", "rising", "large"]),
                          kind="random", seed=rng.randrange(1000), scale=rng.choice([1.0, 0.5, 2.0])))
    return cases


@exercise(
    "paged_attention_kernel",
    chapter="08",
    order=2,
    hints=[
        "Per block: the new running max is the larger of m_i and the block's largest score, "
        "m_new = tl.maximum(tl.max(scores, 0), m_i). Masked lanes hold -inf, so they never win.",
        "alpha = tl.exp(m_i - m_new) rescales everything summed under the old max (it is 0 in the "
        "first block, where m_i = -inf); p = tl.exp(scores - m_new) are this block's weights "
        "(exp(-inf) = 0 on masked lanes).",
        "acc = acc * alpha + tl.sum(p[:, None] * v, 0); l_i = l_i * alpha + tl.sum(p, 0); then "
        "m_i = m_new. Build-up 3's torch online_softmax_attention is the same update.",
    ],
    solution=paged_attention_kernel_solution,
)
def paged_attention_kernel(kernel, *, seed: int = 0, n_random: int = 4) -> int:
    """Check your paged-attention kernel (the online-softmax update in its loop)."""
    from ..reference import paged_decode_attention_reference

    def run_one(case: Case) -> None:
        a = case.args
        args = _kernel_layout(a)
        want = paged_decode_attention_reference(*args, scale=a["scale"])
        got = run_attention_kernel(kernel, *[x.clone() for x in args], block_n=a["block_n"],
                                   scale=a["scale"], block_d=a["block_d"])
        where = (f"  page_size {a['P']}, seq_lens {a['lens']}, BLOCK_N {a['block_n']} "
                 f"(blocks per request: {[-(-n // a['block_n']) for n in a['lens']]}), "
                 f"scores {a['scores']}, head_dim {a['head_dim']}, scale {a['scale']:.4g}")
        finite = torch.isfinite(got)
        err = torch.nan_to_num((got - want).abs(), nan=float("inf"))
        if bool((err <= ATOL).all()):
            return
        b, h = divmod(int(err.amax(-1).flatten().argmax()), want.shape[1])
        why = ""
        for message, slip in KERNEL_SLIPS.items():
            wrong = blocked_attention(*args, block_n=a["block_n"], slip=slip, scale=a["scale"])
            if torch.allclose(wrong, got, atol=ATOL, equal_nan=True):
                why = "\n  looks like " + message
                break
        if not why and not bool(finite[b, h].all()) and pending_findings():
            why = ("\n  your output holds NaN there: a read outside the tensors (above) brought in a "
                   "guard value, which is NaN, and NaN spreads through every sum it enters")
        elif not why and not bool(finite[b, h].all()):
            why = ("\n  your output holds inf/NaN there: an exp overflowed float32 (exp of a large "
                   "score, or of scores - m_i while m_i is still -inf). Subtract the new running "
                   "max, p = exp(scores - m_new), and rescale with alpha = exp(m_i - m_new), which "
                   "is 0, not NaN, in the first block")
        raise CheckFailed(
            f"[{case.name}] request {b}, head {h}: off by up to {float(err[b, h].max()):.3g} "
            f"(tolerance {ATOL})\n  expected {want[b, h, :4].tolist()} ...\n  got      "
            f"{got[b, h, :4].tolist()} ...{why}\n{where}",
            case=case.name, label=f"request {b}, head {h}")

    return run_cases("paged_attention_kernel", _kernel_cases(seed, n_random), run_one)
