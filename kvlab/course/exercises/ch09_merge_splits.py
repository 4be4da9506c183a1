"""Chapter 09's decode-attention exercise, part 2: ``kvlab.check.merge_splits(kernel)``, the
second pass that merges the splits' partial results (part 1, the first pass, is
:mod:`kvlab.course.exercises.ch09_split_attention`).

Split ``s`` of a request left, for query head ``h``, its normalised output ``o_s`` and the
log-sum-exp of its scores ``lse_s = m_s + log(l_s)``. The whole attention is the softmax over
all positions, which weighs each split by its share of the total ``sum exp(score)``::

    out = sum_s exp(lse_s) o_s / sum_s exp(lse_s)             (right, and overflows: lse of 100
        = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)      makes exp(lse) = inf in float32)

with ``M`` the largest ``lse``. One program per ``(request, query head)`` walks the request's
live splits with a runtime loop and keeps chapter 08's online softmax over them: a running
max ``m``, a running ``total`` and ``acc``, rescaled by ``alpha = exp(m - m_new)`` when the
max grows. The learner writes that update.

The checker builds the partials with :func:`kvlab.course.reference.split_partials_reference` from
random layouts (scores small, rising from split to split, falling, or large enough that a plain
``exp`` overflows; lengths that end exactly on a split; head sizes below ``BLOCK_D`` with the
last request filling every split, where a load of ``o`` without ``mask_d`` reads past its end),
launches the kernel (``run_merge_kernel``), and compares with
:func:`kvlab.course.reference.merge_splits_reference`; ``o``, ``lse`` and ``seq_lens`` are read-only.
A wrong answer is told by the slip that gives it (:data:`SLIPS`; when several give the same
NaN, the other cases decide, or all are named); a NaN no slip explains is told by what can make
it: an overflow only if some ``lse`` can overflow ``exp``, else 0/0 or a split that holds nothing.
"""
from __future__ import annotations

import math
import random

import torch
import triton
import triton.language as tl

from ...base import runtime
from ..reference.attention_ref import merge_splits_reference, split_partials_reference, split_ranges_reference
# (through split_attention's module: it registers its exercise first, the chapter's order)
from .ch09_split_attention import spare_layout
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases, second_look

ATOL = 1e-4


@triton.jit
def merge_splits_solution(o_ptr, lse_ptr, seq_lens_ptr, out_ptr, num_splits, stride_o_b, stride_o_h,
                          stride_o_s, stride_l_b, stride_l_h, stride_out_b, stride_out_h, head_dim,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # as the first pass
    live = tl.cdiv(seq_len, split_len)  # the splits that hold positions of this request
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    m = -float("inf")  # the largest lse so far
    total = 0.0  # sum of exp(lse_s - m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # sum of exp(lse_s - m) * o_s
    for s in range(0, live):
        lse = tl.load(lse_ptr + b * stride_l_b + h * stride_l_h + s)
        o = tl.load(o_ptr + b * stride_o_b + h * stride_o_h + s * stride_o_s + offs_d, mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max (0 at first)
        w = tl.exp(lse - m_new)  # this split's weight, at most 1
        acc = acc * alpha + w * o
        total = total * alpha + w
        m = m_new
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_d, acc / total, mask=mask_d)


def run_merge_kernel(kernel, o, lse, seq_lens, num_splits: int, block_n: int):
    """Launch a merge kernel of the chapter's signature on the grid ``(batch, heads)``; returns
    ``out`` on the CPU (NaN where nothing was written)."""
    dev = runtime.DEVICE
    o, lse = o.to(dev, torch.float32).contiguous(), lse.to(dev, torch.float32).contiguous()
    seq_lens = torch.as_tensor(seq_lens).to(dev, torch.int64)
    batch, heads, _, head_dim = o.shape
    out = torch.full((batch, heads, head_dim), float("nan"), device=dev)
    call_learner(kernel, o, lse, seq_lens, out, num_splits, o.stride(0), o.stride(1), o.stride(2),
                 lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), head_dim, grid=(batch, heads),
                 BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), read_only=(0, 1, 2))
    return out.cpu()


#: mistakes in the merge the checker recognises (its emulation gives the learner's numbers)
SLIPS = {
    "nomax": "the splits are weighted by exp(lse) without the max correction: exp(lse) overflows to "
    "inf once a split's lse passes ~88 (float32), and inf / inf is NaN. Subtract the running max: "
    "w = exp(lse - m_new), and rescale what came before by alpha = exp(m - m_new)",
    "acc": "acc is not rescaled when the max grows: acc = acc * alpha + w * o",
    "total": "total is not rescaled when the max grows: total = total * alpha + w",
    "alpha1": "alpha is 1: what was summed under the old max is not rescaled when the max grows "
    "(alpha = exp(m - m_new) multiplies both acc and total)",
    "mfixed": "m is never updated (m = m_new after each split): alpha and w are then measured from "
    "-inf, not from the largest lse so far",
    "average": "the splits are averaged with equal weights: a split's weight is its share of the "
    "softmax's sum, exp(lse_s - M) / sum_s exp(lse_s - M)",
    "after": "acc and total are rescaled after this split is added, (acc + w * o) * alpha: at the first "
    "split alpha = exp(m - m_new) = exp(-inf) = 0 wipes its weight, so with one split total is 0 at "
    "the store and acc / total = 0 / 0 = NaN. Rescale what came before, then add: acc = acc * alpha + w * o",
    "w_old_max": "the weight is measured from the old max, w = exp(lse - m): at the first split m is "
    "still -inf and exp(lse - m) = exp(inf) = inf (inf / inf = NaN). w = exp(lse - m_new)",
    "none": "the merge walks no split: acc and total stay 0 and the store writes 0 / 0 = NaN. The loop "
    "runs over the live splits, range(0, cdiv(seq_len, split_len))",
    "dead": "the merge also reads splits that hold nothing: a split whose positions would start at or "
    "past seq_len is never written by the first pass (NaN here; on a GPU whatever the memory held). "
    "Walk the live splits only, range(0, cdiv(seq_len, split_len))",
}


def emulated_merge(o, lse, live: list[int], slip: str) -> torch.Tensor:
    """The merge's online update in torch, with one of SLIPS."""
    batch, heads, splits, head_dim = o.shape
    walk = {"none": [0] * batch, "dead": [splits] * batch}.get(slip, live)
    out = torch.empty(batch, heads, head_dim)
    for b in range(batch):
        for h in range(heads):
            m, total, acc = torch.tensor(-math.inf), torch.tensor(0.0), torch.zeros(head_dim)
            for s in range(walk[b]):
                x = lse[b, h, s]
                m_new = torch.maximum(m, x)
                alpha = torch.tensor(1.0) if slip in ("nomax", "alpha1") else torch.exp(m - m_new)
                w = torch.exp(x) if slip == "nomax" else (torch.tensor(1.0) if slip == "average" else
                                                         torch.exp(x - (m if slip == "w_old_max" else m_new)))
                if slip == "after":
                    acc, total = (acc + w * o[b, h, s]) * alpha, (total + w) * alpha
                else:
                    acc = (acc if slip in ("acc", "average") else acc * alpha) + w * o[b, h, s]
                    total = (total if slip in ("total", "average") else total * alpha) + w
                m = m if slip == "mfixed" else m_new
            out[b, h] = acc / total
    return out


#: the largest x whose exp is finite in float32 (log of its largest value)
EXP_LIMIT = math.log(torch.finfo(torch.float32).max)


def not_finite_why(got_bh: torch.Tensor, lse_live: torch.Tensor, live: int, splits: int) -> str:
    """What a non-finite output of one (request, head) says, when no known slip gives it: an exp
    overflowed only if some lse can overflow it; otherwise a 0/0 (nothing weighted) or a NaN read."""
    top = float(lse_live.max()) if lse_live.numel() else float("nan")
    if top > EXP_LIMIT:
        return (f"your output holds inf/NaN there, and the largest lse of its live splits is {top:.1f}: "
                f"exp({top:.1f}) overflows float32 (above {EXP_LIMIT:.1f}). Weigh each split by "
                "exp(lse - m_new), never by exp(lse)")
    nothing = (f"; splits {live}..{splits - 1} of this request hold nothing (never written: NaN here, "
               "whatever the memory held on a GPU), and reading one gives NaN" if live < splits else "")
    if bool(torch.isnan(got_bh).any()):
        return (f"your output holds NaN there, though no exp of these lse can overflow (the largest is "
                f"{top:.2f}, and exp(lse - m_new) is at most 1): in float32 NaN comes from 0 / 0, inf - inf "
                "or 0 * inf. total is 0 at the store when no split was weighted (a guard that skips every "
                "split, a loop that runs none, a weight multiplied by alpha = exp(-inf) = 0 at the first "
                f"split), and exp(lse - m) while m is still -inf is inf{nothing}")
    return (f"your output holds inf there, though no exp of these lse can overflow (the largest is {top:.2f}): "
            "acc / total with a total of 0 and an acc that is not")


def _gives(wrong: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> bool:
    """The emulation gives the learner's numbers (NaN where theirs is) and not the right ones."""
    return (torch.allclose(wrong, got, atol=ATOL, equal_nan=True)
            and not torch.allclose(wrong, want, atol=ATOL, equal_nan=True))


def _narrowed(kernel, slips: list[str], others: list[Case]) -> list[str]:
    """The slips whose emulation also gives the kernel's numbers on the other cases, case by
    case until at most one is left (those runs' own findings are not the failed case's)."""
    for other in others:
        a = other.args
        o, lse, lens, live = _partials(a)
        try:
            with second_look():
                got = run_merge_kernel(kernel, o.clone(), lse.clone(), lens, a["splits"], a["block_n"])
        except Exception:  # noqa: BLE001 - a case the kernel cannot run tells nothing here
            continue
        slips = [slip for slip in slips
                 if torch.allclose(emulated_merge(o, lse, live, slip), got, atol=ATOL, equal_nan=True)]
        if len(slips) <= 1:
            break
    return slips


def _partials(a: dict):
    q, k, v, table, rows, lens = spare_layout(a["seed"], a["P"], a["lens"], a["heads"], a["kv_heads"],
                                              a["head_dim"], 2)
    if a["scores"] == "large":
        q = q * 40.0            # scores of hundreds: exp(lse) overflows float32
    elif a["scores"] in ("rising", "falling"):
        q = torch.zeros_like(q)
        q[:, :, 0] = math.sqrt(a["head_dim"])  # score = k[..., 0] (scale 1/sqrt(head_dim)): rising or falling
        for b, n in enumerate(a["lens"]):
            slots = table[int(rows[b]), :n].long()
            t = torch.arange(n, dtype=torch.float32)[:, None]
            k[slots, :, 0] = (1.0 if a["scores"] == "rising" else -1.0) * t   # lse below 88: no overflow
    o, lse = split_partials_reference(q, k, v, table, rows, lens, a["splits"], a["block_n"])
    live = [len(split_ranges_reference(n, a["splits"], a["block_n"])) for n in a["lens"]]
    return o, lse, lens, live


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, lens, splits, scores="random", block_n=16, P=4, heads=4, kv_heads=2, kind="edge", seed=0,
             head_dim=16):
        return Case(name, dict(lens=lens, splits=splits, scores=scores, block_n=block_n, P=P, heads=heads,
                               kv_heads=kv_heads, seed=seed, head_dim=head_dim), kind)

    cases = [
        case("two splits, scores of a few units", [40, 25], 2),
        case("one split: the merge passes it through", [20, 3], 1),
        case("scores rise from split to split: every split a new max", [70], 4, "rising"),
        case("scores fall: the first split holds the max", [70], 4, "falling"),
        case("large scores: exp(lse) overflows float32 without the max", [60, 33], 3, "large"),
        case("more splits than blocks: some hold nothing", [17, 2], 6),
        case("lengths ending exactly on a split: the next split holds nothing", [32, 48], 4),
        case("BLOCK_N 32, ragged lengths, page_size 3", [90, 31, 1], 3, block_n=32, P=3),
        case("plain multi-head attention, five splits", [75, 40], 5, heads=3, kv_heads=3),
        # the last request's every split live and head_dim below BLOCK_D: a load of o that reaches
        # past head_dim reads past the end of o (above, head_dim == BLOCK_D: it never does)
        case("head_dim 12 (BLOCK_D 16): the last request fills every split", [9, 70], 3, head_dim=12),
        case("head_dim 20 (BLOCK_D 32), BLOCK_N 32, large scores", [33, 100], 4, "large", block_n=32,
             head_dim=20),
    ]
    rng = random.Random(seed * 1000 + 92)
    for i in range(n_random):
        cases.append(case(f"random {i + 1}", [rng.randint(1, 80) for _ in range(rng.randint(1, 3))],
                          rng.randint(1, 6), rng.choice(["random", "large", "rising"]), rng.choice([16, 32]),
                          rng.choice([1, 3, 4, 16]), kind="random", seed=rng.randrange(1000)))
    return cases


@exercise(
    "merge_splits",
    chapter="09",
    hints=[
        "This is chapter 08's online softmax over splits instead of blocks: a split's lse plays the "
        "part of a score and its o the part of a V row. m_new = tl.maximum(m, lse).",
        "alpha = tl.exp(m - m_new) rescales what was summed under the old max (0 for the first split, "
        "where m = -inf); w = tl.exp(lse - m_new) is this split's weight, at most 1.",
        "acc = acc * alpha + w * o; total = total * alpha + w; then m = m_new. The store divides: "
        "acc / total.",
    ],
    solution=merge_splits_solution,
)
def merge_splits(kernel, *, seed: int = 0, n_random: int = 3) -> int:
    """Check your merge of the splits (the online update over a request's splits)."""

    cases = _cases(seed, n_random)

    def run_one(case: Case) -> None:
        a = case.args
        o, lse, lens, live = _partials(a)
        want = merge_splits_reference(o, lse, live)
        got = run_merge_kernel(kernel, o.clone(), lse.clone(), lens, a["splits"], a["block_n"])
        err = torch.nan_to_num((got - want).abs(), nan=float("inf"))
        if bool((err <= ATOL).all()):
            return
        b, h = divmod(int(err.amax(-1).flatten().argmax()), want.shape[1])
        why = ""
        slips = [slip for slip in SLIPS if _gives(emulated_merge(o, lse, live, slip), got, want)]
        if len(slips) > 1:  # NaN everywhere fits several: the other cases may tell them apart
            slips = _narrowed(kernel, slips, [c for c in cases if c is not case])
        if len(slips) == 1:
            why = "\n  looks like " + SLIPS[slips[0]]
        elif slips:
            why = ("\n  it gives what each of these slips gives (no case tells them apart):"
                   + "".join(f"\n  - {SLIPS[slip]}" for slip in slips))
        elif not bool(torch.isfinite(got[b, h]).all()):
            why = "\n  " + not_finite_why(got[b, h], lse[b, h, :live[b]], live[b], a["splits"])
        raise CheckFailed(
            f"[{case.name}] request {b}, query head {h}: off by up to {float(err[b, h].max()):.3g} "
            f"(tolerance {ATOL})\n  expected {want[b, h, :4].tolist()} ...\n  got      "
            f"{got[b, h, :4].tolist()} ...{why}\n  lse of its {live[b]} live split(s): "
            f"{[round(float(x), 2) for x in lse[b, h, :live[b]]]}; seq_lens {a['lens']}, num_splits "
            f"{a['splits']}, BLOCK_N {a['block_n']}, head_dim {a['head_dim']}", case=case.name,
            label=f"request {b}, query head {h}")

    return run_cases("merge_splits", cases, run_one)
