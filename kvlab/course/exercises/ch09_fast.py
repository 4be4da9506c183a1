"""Chapter 09's exercise: ``kvlab.check.extend_scan(your_kernel)``.

The learner writes the scan that replaces the teaching kernel's O(bs^2) re-summing: one
program walks the batch in blocks of ``BLOCK`` requests and keeps a running total (a
*carry*) between blocks, so one compilation serves every batch size::

    kernel[(1,)](prefix_lens, seq_lens, token_start, page_start, bs, page_size, BLOCK=BLOCK)

    token_start[r] = sum over q < r of (seq[q] - pre[q])                    (where r's slots begin)
    page_start[r]  = sum over q < r of (ceil(seq[q]/P) - ceil(pre[q]/P))    (r's first free page)

The checker runs it with several small ``BLOCK`` sizes (4 to 32), so that most batches span
several blocks (the carry matters) and a loop that steps by a fixed number shows, on named edge
cases and seeded random batches (page sizes 1 to 64), against plain Python. ``prefix_lens``
and ``seq_lens`` must be left as they were. The kernel is also compiled for a GPU
(:mod:`kvlab.course.checking.compiled`): a carry that starts as a Python ``0`` (int32) and becomes an
int64 runs in the interpreter but does not compile.
"""
from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from ...base import runtime
from ..reference.alloc_ref import pages_for
from ..checking.core import Case, CheckFailed, Segment, call_learner, compare_flat, exercise, run_cases
from ..checking.failures import Layout

NOT_WRITTEN = -1
CHECK_BLOCK = 8  # small on purpose: a batch of 20 spans three blocks
BLOCKS = (4, 8, 16, 32)  # the BLOCK sizes the cases use


@triton.jit
def extend_scan_solution(prefix_lens_ptr, seq_lens_ptr, token_start_ptr, page_start_ptr, bs,
                         page_size: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    carry_tokens = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)  # an int64 scalar 0
    carry_pages = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for start in range(0, bs, BLOCK):  # runtime bound: no recompile per batch size
        offs = start + lanes
        mask = offs < bs
        pre = tl.load(prefix_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        seq = tl.load(seq_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        extend = seq - pre
        pages = (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size
        # inclusive cumsum minus my own value = exclusive; plus everything before this block
        tl.store(token_start_ptr + offs, carry_tokens + tl.cumsum(extend, axis=0) - extend, mask=mask)
        tl.store(page_start_ptr + offs, carry_pages + tl.cumsum(pages, axis=0) - pages, mask=mask)
        carry_tokens += tl.sum(extend, axis=0)
        carry_pages += tl.sum(pages, axis=0)


def extend_scan_ref(prefix_lens: list[int], seq_lens: list[int], page_size: int):
    """``(token_start, page_start)``: exclusive prefix sums, with a plain loop."""
    token_start, page_start, t, p = [], [], 0, 0
    for pre, seq in zip(prefix_lens, seq_lens):
        token_start.append(t)
        page_start.append(p)
        t += seq - pre
        p += pages_for(seq, page_size) - pages_for(pre, page_size)
    return token_start, page_start


def run_scan_kernel(kernel, prefix_lens, seq_lens, page_size, block=CHECK_BLOCK,
                    layout: Layout | None = None):
    dev = runtime.DEVICE
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    bs = len(prefix_lens)
    token_start = torch.full((bs,), NOT_WRITTEN, dtype=torch.int64, device=dev)
    page_start = torch.full((bs,), NOT_WRITTEN, dtype=torch.int64, device=dev)
    call_learner(kernel, as_t(prefix_lens), as_t(seq_lens), token_start, page_start, bs, page_size,
                 grid=(1,), BLOCK=block, layout=layout, read_only=(0, 1))
    return token_start.cpu(), page_start.cpu()


def _case(name, pre, seq, P, kind="edge", block=CHECK_BLOCK):
    return Case(name, {"pre": pre, "seq": seq, "page_size": P, "block": block}, kind)


def _cases(seed: int, n_random: int) -> list[Case]:
    B = CHECK_BLOCK
    cases = [
        _case("one request", [3], [10], 4),
        _case("empty extends (seq == pre)", [5, 0, 7], [5, 0, 9], 4),
        _case(f"exactly one block ({B} requests)", [0] * B, list(range(1, B + 1)), 4),
        _case(f"one past a block ({B + 1} requests): the carry starts", [1] * (B + 1), [6] * (B + 1), 4),
        _case("page_size 1", [0, 2, 2], [3, 2, 7], 1),
        _case(f"three blocks, page_size 16 ({2 * B + 5} requests)",
              [(7 * r) % 20 for r in range(2 * B + 5)], [(7 * r) % 20 + r for r in range(2 * B + 5)], 16),
        _case("BLOCK 4: five blocks, page_size 64 (18 requests)", [(5 * r) % 70 for r in range(18)],
              [(5 * r) % 70 + 3 * r for r in range(18)], 64, block=4),
        _case("BLOCK 32, one block partly used (11 requests)", [r for r in range(11)],
              [2 * r + 1 for r in range(11)], 4, block=32),
        _case("BLOCK 16, page_size 1, two blocks (17 requests)", [0] * 17, list(range(1, 18)), 1,
              block=16),
    ]
    rng = random.Random(seed * 1000 + 9)
    for i in range(n_random):
        P = rng.choice([1, 4, 16, 64])
        bs = rng.randint(1, 4 * B)
        pre = [rng.randint(0, 3 * P) for _ in range(bs)]
        seq = [p + rng.choice([0, rng.randint(0, 3 * P + 1)]) for p in pre]
        block = rng.choice(BLOCKS)
        cases.append(_case(f"random {i + 1} (page_size {P}, {bs} requests, BLOCK {block})", pre,
                           seq, P, "random", block))
    return cases


@exercise(
    "extend_scan",
    chapter="09",
    hints=[
        "token_start[r] is an *exclusive* prefix sum: the total extend of the requests before r. "
        "tl.cumsum(x, axis=0) is inclusive; subtract x itself to make it exclusive.",
        "Walk the batch with a runtime loop, `for start in range(0, bs, BLOCK)`, and keep a carry "
        "(the sums of all earlier blocks) that you add to every value of the current block.",
        "Start the carry as an int64 scalar tensor: carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), "
        "axis=0); after each block, carry += tl.sum(extend, axis=0). Mask loads and stores with "
        "offs < bs (other=0).",
        "page_start is the same scan over new pages: (seq + P - 1) // P - (pre + P - 1) // P.",
    ],
    solution=extend_scan_solution,
)
def extend_scan(kernel, *, seed: int = 0, n_random: int = 4) -> int:
    """Check your scan kernel; prints one line when all cases pass."""

    def run_one(case: Case) -> None:
        pre, seq, P = case.args["pre"], case.args["seq"], case.args["page_size"]
        exp_tok, exp_pg = extend_scan_ref(pre, seq, P)
        B = case.args["block"]
        inputs = f"prefix_lens={pre}, seq_lens={seq}, page_size={P}, BLOCK={B}"
        got_tok, got_pg = run_scan_kernel(kernel, pre, seq, P, B, layout=Layout(inputs=inputs))
        segments = [Segment(f"request {r} (block {r // B}, lane {r % B})", r, r + 1) for r in range(len(pre))]
        note = f"\n  inputs: {inputs}\n  ({NOT_WRITTEN} = never written)"
        for what, exp, got in (("token_start", exp_tok, got_tok), ("page_start", exp_pg, got_pg)):
            try:
                compare_flat(torch.tensor(exp, dtype=torch.int64), got, case=case.name, what=what,
                             segments=segments)
            except CheckFailed as e:
                raise CheckFailed(str(e) + note, case=e.case, expected=e.expected, got=e.got,
                                  wrong=e.wrong, label=e.label) from None

    return run_cases("extend_scan", _cases(seed, n_random), run_one)
