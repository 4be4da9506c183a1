"""Chapter 03's exercises: complete the three parts of ``alloc_extend_kernel``.

The learner writes a Triton kernel with the teaching kernel's signature::

    kernel[(bs,)](pre_lens, seq_lens, last_loc, free_pages, out_indices, ret_values,
                  bs_upper, page_size, max_num_extend_tokens)

and fills it in one part at a time. Each checker runs the kernel on named edge cases, then
seeded random batches, and compares only the slots of *its* part with
:func:`kvlab.course.reference.alloc_ref.alloc_extend_ref`:

* ``alloc_extend_part1`` - the rest of each request's old page (``last_loc + 1 ...``);
* ``alloc_extend_part2`` - whole new pages;
* ``alloc_extend_part3`` - the partly filled new last page, and the packed ``ret_values``.

``out_indices`` starts filled with -1, so a slot the kernel never wrote shows as -1. A failure
names the case, the request and the part, the first wrong slot, expected vs got (the context
shows ``·`` at the positions of the other parts); a load or store outside an argument is named
with the request and part that made it. Each part is also judged against the region it owns:
in the interpreter the audit sees which line wrote each slot, so a part whose stores land in
another part's positions is named as the cause (a part-1 length that is one page too long for
a page-aligned prefix shifts parts 2 and 3 too, and is blamed on part 1, not on them). The
kernel's inputs (``pre_lens``, ``seq_lens``, ``last_loc``, ``free_pages``) must be left as they
were. The parts are done in order: part 2 starts where part 1 ends, so the checker of part 2
(or 3) says so when part 1 (or 2) is still the starter. Free pages never start at page 0 (as in
SGLang, page 0 is kept back), so no slot is right by accident; some cases use page ids whose
slots pass 2**31 (slot arithmetic must stay in int64), and the programs run in a changed order
(a race on ``ret_values`` shows).
"""
from __future__ import annotations

import random
from typing import NamedTuple

import torch

from ...base import runtime
from ...alloc.alloc_kernels import alloc_extend_kernel
from ..reference.alloc_ref import (ExtendPlan, alloc_extend_ref, pages_for, pages_needed_extend,
                               part_lengths, unpack_ret_value)
from ..checking.core import (Case, CheckFailed, Segment, call_learner, compare_flat, exercise, last_stores,
                   pending_findings, run_cases)
from ..checking.failures import Layout, fmt_values, label_at
from ..checking.findings import region_of, statement_at
from ..checking.registry import not_attempted

NOT_WRITTEN = -1
#: a first page id whose slots (page * page_size) are at or past 2**31 for every page size used
BIG_PAGE = 2**31
#: the chapter's worked example, with its last_loc and free_pages (P = 64)
WORKED = dict(pre=[70, 128], seq=[190, 260], last_loc=[2 * 64 + 5, 1 * 64 + 63],
              free=[7, 3, 9, 5, 11, 12], page_size=64)
#: the kernel's read-only inputs (pre_lens, seq_lens, last_loc, free_pages) and its output
READ_ONLY, OUT = (0, 1, 2, 3), 4
#: what ret_values holds before the launch: the allocator keeps one ret_values from call to
#: call, so a kernel must store it, not add to it (no report can be negative)
STALE_RET = -7777


def stale_ret_note(ret: int, expected: int) -> str:
    """Why ``ret`` is wrong, when it shows that the kernel did not store ``ret_values``."""
    if ret == STALE_RET:
        return (f"\n  ret_values still holds {STALE_RET}, its value before the launch: the last "
                "program must store the total (tl.store, not an add: the allocator keeps one "
                "ret_values from call to call, so it does not start at 0)")
    if ret == STALE_RET + expected:
        return (f"\n  that is {STALE_RET} (its value before the launch) + the right total: your "
                "kernel adds to ret_values; store it instead (the allocator keeps one ret_values "
                "from call to call, so it does not start at 0)")
    return ""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


def extend_case_inputs(prefix_lens: list[int], seq_lens: list[int], page_size: int, seed: int = 0,
                       spare_pages: int = 2, big: bool = False) -> tuple[list[int], list[int]]:
    """``(last_loc, free_pages)`` for a batch: every prefix on pages of its own, a shuffled free list.

    Prefix pages are drawn first (request by request), the free list gets the remaining
    pages in a seeded random order: exactly enough for the batch plus ``spare_pages``. Page 0
    is never used (SGLang keeps it back), so slot 0 is never a right answer.
    ``big``: page ids start at ``2**31 // page_size``, so every slot is at least 2**31.
    """
    rng = random.Random(seed)
    P = page_size
    n_prefix = sum(pages_for(p, P) for p in prefix_lens)
    n_new = pages_needed_extend(prefix_lens, seq_lens, P)
    first = BIG_PAGE // P if big else 1
    pages = list(range(first, first + n_prefix + n_new + spare_pages))
    rng.shuffle(pages)
    last_loc, at = [], 0
    for p in prefix_lens:
        n = pages_for(p, P)
        mine = pages[at:at + n]
        at += n
        last_loc.append(mine[-1] * P + (p - 1) % P if p > 0 else -1)
    return last_loc, pages[at:]


def run_extend_kernel(kernel, prefix_lens, seq_lens, last_loc, free_pages, page_size,
                      layout: Layout | None = None):
    """Launch ``kernel`` the way the allocator does; return ``(out_indices, ret_value)`` on the CPU.
    ``ret_values`` starts as :data:`STALE_RET`, as a reused buffer would.

    The inputs must come back unchanged; in the interpreter the audit keeps every store into
    ``out_indices`` (:func:`kvlab.course.checking.core.last_stores`)."""
    dev = runtime.DEVICE
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    n_tokens = sum(s - p for p, s in zip(prefix_lens, seq_lens))
    out = torch.full((n_tokens,), NOT_WRITTEN, dtype=torch.int64, device=dev)
    ret = torch.full((1,), STALE_RET, dtype=torch.int64, device=dev)
    bs = len(prefix_lens)
    call_learner(kernel, as_t(prefix_lens), as_t(seq_lens), as_t(last_loc), as_t(free_pages), out, ret,
                 _next_pow2(bs), page_size, _next_pow2(n_tokens), grid=(bs,), layout=layout,
                 read_only=READ_ONLY, track_stores=(OUT,))
    return out.cpu(), int(ret.cpu()[0])


def plan_segments(plan: ExtendPlan) -> list[Segment]:
    """One labelled segment per request part, e.g. ``Segment("request 1, part 3", 248, 252)``."""
    return [Segment(s.label, s.start, s.end) for s in plan.spans]


def _case(name: str, pre: list[int], seq: list[int], page_size: int, kind: str = "edge",
          seed: int = 0, big: bool = False, last_loc=None, free=None) -> Case:
    return Case(name, {"pre": pre, "seq": seq, "page_size": page_size, "seed": seed, "big": big,
                       "last_loc": last_loc, "free": free}, kind)


def _cases(part: int, seed: int, n_random: int) -> list[Case]:
    cases = [
        _case("the chapter's worked example: A 70->190, B 128->260, page_size 64",
              WORKED["pre"], WORKED["seq"], 64, last_loc=WORKED["last_loc"], free=WORKED["free"]),
        _case("page_size 1", [2, 0, 5], [4, 3, 6], 1),
        _case("one request, unaligned prefix", [5], [19], 4),
        _case("page-aligned prefixes", [8, 4], [20, 6], 4),
        _case("page-aligned prefix first, page_size 64", [128, 5], [300, 70], 64),
        _case("empty prefixes (pre == 0, last_loc == -1)", [0, 0, 0], [3, 4, 9], 4),
        _case("empty extends between others", [6, 3, 9], [6, 13, 9], 4),
        _case("stays inside the old page", [1, 17], [3, 20], 16),
        _case("many requests", [3, 0, 16, 7, 1, 30, 12, 5], [9, 16, 40, 7, 33, 31, 12, 20], 16),
        _case("slots past 2**31 (page ids from 2**31 // page_size: int64 slot arithmetic)",
              [70, 128, 5], [190, 260, 200], 64, big=True),
    ]
    rng = random.Random(seed * 1000 + part)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 16, 64])
        bs = rng.randint(1, 5)
        pre = [rng.choice([0, rng.randint(0, 3 * P), rng.randint(0, 3) * P]) for _ in range(bs)]
        seq = [p + rng.choice([0, rng.randint(1, 2 * P + 3), rng.randint(0, P)]) for p in pre]
        if sum(seq) == sum(pre):
            seq[0] += 1  # at least one new token, so there is something to launch for
        cases.append(_case(f"random {i + 1} (page_size {P}, {bs} requests)", pre, seq, P,
                           kind="random", seed=rng.randrange(2**16), big=i % 2 == 1))
    return cases


def _check_part(kernel, part: int, case: Case) -> tuple[ExtendPlan, int]:
    a = case.args
    pre, seq, P = a["pre"], a["seq"], a["page_size"]
    last_loc, free_pages = ((a["last_loc"], a["free"]) if a["free"] is not None else
                            extend_case_inputs(pre, seq, P, a["seed"], big=a["big"]))
    plan = alloc_extend_ref(pre, seq, last_loc, free_pages, P)
    context = (f"pre={pre}, seq={seq}, last_loc={last_loc}, free_pages={free_pages[:8]}"
               f"{'...' if len(free_pages) > 8 else ''}, page_size={P}")
    layout = Layout("request", {"out_indices": plan_segments(plan)}, context)
    got, ret = run_extend_kernel(kernel, pre, seq, last_loc, free_pages, P, layout)
    # a part's stores outside its own positions: from this part or an earlier one (whose
    # length moves this one), or from a later one into this part's positions
    spills = [s for s in part_spills(plan, pre, seq, P, last_stores())
              if s.part <= part or s.owner.endswith(f"part {part}")]
    if any(s.part == part for s in spills):
        raise CheckFailed(spill_message(spills[0]) + f"\n  inputs: {context}", case=case.name,
                          label="part region")
    exp = torch.tensor(plan.out_indices, dtype=torch.int64)
    mine = (torch.tensor([p == part for _, p in plan.parts], dtype=torch.bool)
            if got.numel() == exp.numel() else None)
    try:
        compare_flat(exp, got, case=case.name, what="out_indices", segments=plan_segments(plan),
                     owned=mine)
    except CheckFailed as e:
        note = (f"\n  inputs: {context}\n  (this exercise checks part {part} only: · marks the "
                f"positions of the other parts; {NOT_WRITTEN} = a slot your kernel never wrote)")
        if spills:  # another part wrote into this part's positions: that is the cause
            raise CheckFailed(spill_message(spills[0]) + "\n  and so, in part "
                              f"{part}'s positions: " + e.message.split("] ", 1)[-1] + note,
                              case=case.name, label="part region") from None
        raise CheckFailed(str(e) + note, case=e.case, expected=e.expected, got=e.got, wrong=e.wrong,
                          label=e.label, shape=e.shape, segments=e.segments, what=e.what) from None
    if spills and pending_findings():  # the safety net saw the consequences: name the cause
        raise CheckFailed(spill_message(spills[0]) + f"\n  inputs: {context}", case=case.name,
                          label="part region")
    return plan, ret


class Spill(NamedTuple):
    """Stores of one part of one request that landed in positions another part owns."""

    part: int
    req: int
    owns: tuple[int, int]  # the positions [start, end) of out_indices this part owns
    positions: list[int]  # where it wrote instead, outside them, a wrong value
    written: list[int]
    expected: list[int]
    owner: str  # whose positions those are ("request 1, part 2")
    line: str  # the kernel's line that stored them


def part_spills(plan: ExtendPlan, pre, seq, P: int, stores) -> list[Spill]:
    """Each part's stores (the audit's, attributed by the kernel's ``part N`` comments) that
    wrote a wrong value outside the positions the part owns, earliest part first."""
    owns = {}
    for r, (p, s) in enumerate(zip(pre, seq)):
        at = plan.output_starts[r]
        for k, n in enumerate(part_lengths(p, s, P), start=1):
            owns[(r, k)] = (at, at + n)
            at += n
    found: dict[tuple[int, int], Spill] = {}
    for st in stores:
        region = region_of(st.filename, st.line, st.function)
        if region is None or not st.program:
            continue
        key = (st.program[0], int(region.split()[-1]))
        if key not in owns:
            continue
        lo, hi = owns[key]
        for i, v in zip(st.indices, st.values):
            if not lo <= i < hi and i < len(plan.out_indices) and int(v) != plan.out_indices[i]:
                spill = found.setdefault(key, Spill(
                    key[1], key[0], (lo, hi), [], [], [], label_at(i, plan_segments(plan)) or "",
                    f"line {st.line}: {statement_at(st.filename, st.line)}" if st.line else ""))
                spill.positions.append(i)
                spill.written.append(int(v))
                spill.expected.append(plan.out_indices[i])
    return sorted(found.values(), key=lambda s: (s.part, s.req))


def spill_message(s: Spill) -> str:
    lo, hi = s.owns
    owns = (f"out_indices[{lo}:{hi}] ({hi - lo} slots: num_part{s.part} = {hi - lo})" if hi > lo
            else f"no position here (num_part{s.part} = 0)")
    at = sorted(s.positions)
    where = (f"out_indices[{at[0]}:{at[-1] + 1}]" if at == list(range(at[0], at[-1] + 1))
             else f"out_indices{fmt_values(at, 6)}")
    return (f"request {s.req}, part {s.part} wrote {len(at)} slot(s) outside its own positions, "
            f"at {where}, which belong to {s.owner}"
            + (f" ({s.line})" if s.line else "") + f"\n  request {s.req}'s part {s.part} owns "
            f"{owns}: check its length and its store's mask\n  written there: {fmt_values(s.written, 8)}\n  expected:"
            f"      {fmt_values(s.expected, 8)}\n  (the later parts of a request start where the "
            "earlier ones end, so a wrong length moves them too)")


def _needs_earlier_parts(kernel, part: int) -> None:
    """The parts are done in order: part 2 starts where part 1 ends (num_part1)."""
    for earlier in range(1, part):
        why = not_attempted(kernel, f"alloc_extend_part{earlier}")
        if why is not None:
            raise CheckFailed(
                f"part {earlier} is still the starter ({why}). Do the parts in order: part "
                f"{part}'s slots start where part {earlier}'s end (out_indices + "
                f"output_start_loc + num_part1{' + num_part2' if part == 3 else ''}), so "
                f"kvlab.check.alloc_extend_part{earlier} has to pass first.", label="order")


_COMMON_HINT = ("Lengths first, with the starter's pre_page_end = ceil(pre/P)*P and "
                "seq_page_start = floor(seq/P)*P: num_part1 = min(seq_len, pre_page_end) - pre_len "
                "(write it tl.minimum(...) or min(...): the same in Triton), num_part2 = "
                "seq_page_start - pre_page_end, num_part3 = seq_len - seq_page_start.")


@exercise(
    "alloc_extend_part1",
    chapter="03", order=1,
    hints=[
        "Part 1 fills the rest of the request's last, partly used page: the slots right after "
        "last_loc, i.e. last_loc + 1, last_loc + 2, ... (load last_loc from last_loc_ptr + pid).",
        _COMMON_HINT,
        "offs_page = tl.arange(0, page_size) covers at most one page: store last_loc + 1 + offs_page "
        "at out_indices + output_start_loc + offs_page with mask=offs_page < num_part1.",
        "output_start_loc (given) is where this request's slots begin: the new tokens of the "
        "requests before it, summed with the masked load over offs_bs. Your part 1 starts there.",
    ],
    solution=alloc_extend_kernel,
    solution_regions=("part 1:",),
)
def alloc_extend_part1(kernel, *, seed: int = 0, n_random: int = 4) -> int:
    """Check part 1 (old page) of your ``alloc_extend_kernel``; prints one line when all pass."""
    return run_cases("alloc_extend_part1", _cases(1, seed, n_random),
                     lambda case: _check_part(kernel, 1, case))


@exercise(
    "alloc_extend_part2",
    chapter="03", order=2, after="alloc_extend_part1",
    hints=[
        "Part 2 covers whole new pages. This request's new pages are free_pages[new_page_start_loc], "
        "free_pages[new_page_start_loc + 1], ...; new_page_start_loc (given) counts the new pages "
        "of the requests before it.",
        _COMMON_HINT,
        "With k = tl.arange(0, max_num_extend_tokens): page = tl.load(free_page_ptr + "
        "new_page_start_loc + k // page_size, mask=k < num_part2, other=0); slot = page * page_size "
        "+ k % page_size.",
        "Part 2's slots follow part 1's: store at out_indices + output_start_loc + num_part1 + k, "
        "with the same mask.",
    ],
    solution=alloc_extend_kernel,
    solution_regions=("part 2:",),
)
def alloc_extend_part2(kernel, *, seed: int = 0, n_random: int = 4) -> int:
    """Check part 2 (whole new pages) of your ``alloc_extend_kernel``."""
    _needs_earlier_parts(kernel, 2)
    return run_cases("alloc_extend_part2", _cases(2, seed, n_random),
                     lambda case: _check_part(kernel, 2, case))


@exercise(
    "alloc_extend_part3",
    chapter="03", order=3, after="alloc_extend_part2",
    hints=[
        "Part 3 is the request's last new page, filled from offset 0 to seq % page_size - 1. "
        "This exercise also writes ret_values (the starter marks both places).",
        "That page is the request's LAST new page: free_pages[new_page_start_loc + "
        "num_new_pages_self - 1], i.e. tl.load(free_page_ptr + new_page_start_loc + "
        "num_new_pages_self - 1).",
        "Its slots follow parts 1 and 2: out_indices + output_start_loc + num_part1 + num_part2 + "
        "offs_page, value page * page_size + offs_page, mask offs_page < num_part3.",
        "ret_values: the last program (pid == tl.num_programs(0) - 1) has summed every request; it "
        "stores (sum_num_new_pages.to(tl.int64) << 32) | sum_extend_lens.to(tl.int64). It must do "
        "so before part 1, since parts 1 and 2 may return early.",
    ],
    solution=alloc_extend_kernel,
    solution_regions=("ret_values", "part 3:"),
)
def alloc_extend_part3(kernel, *, seed: int = 0, n_random: int = 4) -> int:
    """Check part 3 (new last page) of your ``alloc_extend_kernel``, and its ``ret_values``."""
    _needs_earlier_parts(kernel, 3)

    def run_one(case: Case) -> None:
        plan, ret = _check_part(kernel, 3, case)
        if ret != plan.ret_value:
            why = stale_ret_note(ret, plan.ret_value)
            got = "" if why or ret < 0 else " = ({} pages << 32) | {} tokens".format(*unpack_ret_value(ret))
            raise CheckFailed(
                f"[{case.name}] ret_values holds {ret:#x}{got}; expected {plan.ret_value:#x} = "
                f"({plan.num_new_pages} << 32) | {plan.num_extend_tokens}{why}", case=case.name,
                label="ret_values")

    return run_cases("alloc_extend_part3", _cases(3, seed, n_random), run_one)
