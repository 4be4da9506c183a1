"""Chapter 04's exercise: ``kvlab.check.alloc_decode(your_kernel)``.

The learner writes a Triton kernel with the teaching kernel's signature::

    kernel[(bs,)](seq_lens, last_loc, free_pages, out_indices, ret_values, bs_upper, page_size)

that gives every request one slot for its new token: ``last_loc + 1`` while the page has
room, the first slot of the next free page when ``(seq - 1) % page_size == 0``. It is run
on named edge cases and seeded random batches against
:func:`kvlab.course.reference.alloc_ref.alloc_decode_ref`; a failure names the request and whether it
should have taken a new page, and says in words what it recognises (a request's very first
token given ``last_loc + 1``, masked-off lanes counted as page starts). The inputs
(``seq_lens``, ``last_loc``, ``free_pages``) must be left as they were. Free pages never include
page 0 (SGLang keeps it back), so slot 0 is never right by accident; some cases use page ids
whose slots pass 2**31 (slot arithmetic must stay in int64), and the programs run in a changed
order (a race on ``ret_values`` shows).
"""
from __future__ import annotations

import random

import torch

from ...base import runtime
from ...alloc.alloc_kernels import alloc_decode_kernel
from ..reference.alloc_ref import alloc_decode_ref, pages_for
from .ch03_extend_parts import STALE_RET, stale_ret_note
from ..checking.core import Case, CheckFailed, Segment, call_learner, compare_flat, exercise, run_cases
from ..checking.failures import Layout

NOT_WRITTEN = -1
BIG_PAGE = 2**31  # page ids from BIG_PAGE // page_size: every slot at least 2**31


def _next_pow2(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


def decode_case_inputs(seq_lens: list[int], page_size: int, seed: int = 0,
                       spare_pages: int = 2, big: bool = False) -> tuple[list[int], list[int]]:
    """``(last_loc, free_pages)``: each request's first ``seq - 1`` tokens on pages of its own,
    from pages 1, 2, ... (page 0 is kept back) in a shuffled order.

    ``big``: page ids start at ``2**31 // page_size``, so every slot is at least 2**31.
    """
    rng = random.Random(seed)
    P = page_size
    pre = [s - 1 for s in seq_lens]
    n_prefix = sum(pages_for(p, P) for p in pre)
    n_new = sum(1 for s in seq_lens if (s - 1) % P == 0)
    first = BIG_PAGE // P if big else 1
    pages = list(range(first, first + n_prefix + n_new + spare_pages))
    rng.shuffle(pages)
    last_loc, at = [], 0
    for p in pre:
        n = pages_for(p, P)
        mine = pages[at:at + n]
        at += n
        last_loc.append(mine[-1] * P + (p - 1) % P if p > 0 else -1)
    return last_loc, pages[at:]


def run_decode_kernel(kernel, seq_lens, last_loc, free_pages, page_size,
                      layout: Layout | None = None):
    """Launch ``kernel`` as the allocator does; return ``(out_indices, ret_value)`` on the CPU."""
    dev = runtime.DEVICE
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    bs = len(seq_lens)
    out = torch.full((bs,), NOT_WRITTEN, dtype=torch.int64, device=dev)
    ret = torch.full((1,), STALE_RET, dtype=torch.int64, device=dev)  # as a reused buffer
    call_learner(kernel, as_t(seq_lens), as_t(last_loc), as_t(free_pages), out, ret,
                 _next_pow2(bs), page_size, grid=(bs,), layout=layout, read_only=(0, 1, 2))
    return out.cpu(), int(ret.cpu()[0])


def _case(name: str, seq: list[int], page_size: int, kind: str = "edge", seed: int = 0,
          big: bool = False, spare: int = 2) -> Case:
    return Case(name, {"seq": seq, "page_size": page_size, "seed": seed, "big": big,
                       "spare": spare}, kind)


def _cases(seed: int, n_random: int) -> list[Case]:
    cases = [
        _case("one request, same page", [6], 4),
        _case("one request crossing into a new page", [5], 4),
        _case("page_size 1: every token takes a page", [1, 2, 7], 1),
        _case("page_size 1, five requests (lanes past pid are masked off)", [4, 1, 9, 2, 6], 1,
              spare=4),
        _case("first token of a request (seq == 1, last_loc == -1)", [1, 3], 4),
        _case("page_size 64: first tokens between others", [2, 1, 65, 1, 7], 64),
        _case("several cross at once", [5, 9, 2, 13, 4], 4),
        _case("page_size 64, slots past 2**31 (page ids from 2**31 // page_size: int64 slot "
              "arithmetic)", [65, 64, 129, 2], 64, big=True),
    ]
    rng = random.Random(seed * 1000 + 4)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 16, 64])
        bs = rng.randint(1, 8)
        seq = [rng.choice([rng.randint(1, 3 * P + 1), rng.randint(0, 3) * P + 1]) for _ in range(bs)]
        cases.append(_case(f"random {i + 1} (page_size {P}, {bs} requests)", seq, P, kind="random",
                           seed=rng.randrange(2**16), big=i % 2 == 1))
    return cases


@exercise(
    "alloc_decode",
    chapter="04",
    hints=[
        "seq_lens are lengths AFTER the new token, so the new token is number seq - 1 (from 0). "
        "It starts a page exactly when (seq - 1) % page_size == 0.",
        "Otherwise the slot is simply last_loc + 1: the next slot of the same page.",
        "A request that starts a page takes free_pages[k], where k counts the requests before it "
        "that also start a page: offs_bs = tl.arange(0, bs_upper); load seq_lens with "
        "mask=offs_bs <= pid (other=0), count the ones with (seq - 1) % page_size == 0 (and "
        "offs_bs <= pid) with tl.sum; that count includes you, so k = count - 1.",
        "Write ret_values (the total new pages) from the last program: "
        "if pid == tl.num_programs(0) - 1: tl.store(ret_values, total.to(tl.int64)).",
    ],
    solution=alloc_decode_kernel,
)
def alloc_decode(kernel, *, seed: int = 0, n_random: int = 4) -> int:
    """Check your ``alloc_decode_kernel``; prints one line when all cases pass."""

    def run_one(case: Case) -> None:
        seq, P = case.args["seq"], case.args["page_size"]
        last_loc, free_pages = decode_case_inputs(seq, P, case.args["seed"], case.args["spare"],
                                                  big=case.args["big"])
        plan = alloc_decode_ref(seq, last_loc, free_pages, P)
        inputs = f"seq_lens={seq}, last_loc={last_loc}, free_pages={free_pages}, page_size={P}"
        segments = [Segment(f"request {r}, " + ("new page: free_pages[{}] * page_size".format(plan.page_reads[r])
                                                if plan.takes_new_page[r] else "same page: last_loc + 1"),
                            r, r + 1) for r in range(len(seq))]
        got, ret = run_decode_kernel(kernel, seq, last_loc, free_pages, P,
                                     Layout("request", {"out_indices": segments}, inputs))
        try:
            compare_flat(torch.tensor(plan.out_indices, dtype=torch.int64), got, case=case.name,
                         what="out_indices", segments=segments)
        except CheckFailed as e:
            note = (f"{_diagnose(plan, seq, last_loc, free_pages, P, got)}\n  inputs: {inputs}"
                    f"\n  ({NOT_WRITTEN} = a slot your kernel never wrote)")
            raise CheckFailed(str(e) + note, case=e.case, expected=e.expected, got=e.got,
                              wrong=e.wrong, label=e.label, shape=e.shape, segments=e.segments,
                              what=e.what) from None
        if ret != plan.num_new_pages:
            lanes = (f"\n  {ret} is bs_upper = {_next_pow2(len(seq))}: {_MASKED}"
                     if P == 1 and ret == _next_pow2(len(seq)) != plan.num_new_pages else "")
            raise CheckFailed(f"[{case.name}] ret_values holds {ret}; expected {plan.num_new_pages} "
                              f"(the number of requests that took a new page){lanes}"
                              f"{stale_ret_note(ret, plan.num_new_pages)}",
                              case=case.name, label="ret_values")

    return run_cases("alloc_decode", _cases(seed, n_random), run_one)


_MASKED = ("looks like the masked-off lanes are counted as page starts: lanes past pid load "
           "seq = other = 0, and at page_size 1 (0 - 1) % 1 == 0 holds for them too. Count only "
           "the lanes offs_bs <= pid: ((seq_lens - 1) % page_size == 0) & (offs_bs <= pid)")


def _diagnose(plan, seq, last_loc, free_pages, P: int, got: torch.Tensor) -> str:
    """Name the slip behind the first wrong request, when it is one kvlab knows."""
    wrong = [r for r in range(len(seq)) if int(got[r]) != plan.out_indices[r]]
    if not wrong:
        return ""
    r, value = wrong[0], int(got[wrong[0]])
    if plan.takes_new_page[r] and last_loc[r] == -1 and value == last_loc[r] + 1:
        return (f"\n  request {r} has no slot yet (seq = 1, last_loc = -1): its first token starts "
                f"a page and takes free_pages[{plan.page_reads[r]}]; last_loc + 1 = 0 is slot 0, "
                "not its page. Decide by the new token's position, (seq - 1) % page_size == 0 (in "
                "Triton % keeps the sign: -1 % page_size is -1, not page_size - 1)")
    if plan.takes_new_page[r] and value == last_loc[r] + 1:
        return (f"\n  request {r} was given last_loc + 1, but its new token (number seq - 1 = "
                f"{seq[r] - 1}) is the first of a page: it takes a new page")
    if not plan.takes_new_page[r] and value % P == 0 and value // P in free_pages:
        return (f"\n  request {r} was given the first slot of a free page, but its page still has "
                "room: (seq - 1) % page_size != 0, so its slot is last_loc + 1")
    if P == 1 and plan.takes_new_page[r]:
        upper = _next_pow2(len(seq))
        count = sum(plan.takes_new_page[: r + 1]) + (upper - 1 - r)
        if count - 1 < len(free_pages) and value == free_pages[count - 1] * P:
            return "\n  " + _MASKED
    return ""
