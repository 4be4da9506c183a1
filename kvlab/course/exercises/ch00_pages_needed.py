"""Chapter 00's warm-up: ``kvlab.check.pages_needed(your_function)``.

The learner writes ``fn(lengths, page_size)`` returning, for each request of ``lengths[i]``
tokens, how many pages of ``page_size`` slots it occupies: ``ceil(lengths[i] / page_size)``,
the last page maybe partly used. The checker runs named edge cases first (no requests, a
request of 0 tokens, page_size 1, lengths that fill their last page exactly or spill one
token over), then seeded random batches, against the slow and obvious oracle: add pages one
by one until the tokens fit. ``lengths`` is read-only.
"""
from __future__ import annotations

import numbers
import random
from typing import Sequence

import torch

from ...base.args import div_ceil
from ..checking.core import Case, CheckFailed, Segment, call_learner, compare_flat, exercise, run_cases


def pages_by_counting(lengths: Sequence[int], page_size: int) -> list[int]:
    """The oracle: for each request, add whole pages until its tokens fit."""
    out = []
    for n in lengths:
        pages = 0
        while pages * page_size < n:
            pages += 1
        out.append(pages)
    return out


def pages_needed_solution(lengths: list[int], page_size: int) -> list[int]:
    """Pages each request occupies: ``ceil(n / page_size)`` per request, in order."""
    return [div_ceil(n, page_size) for n in lengths]


def _case(name: str, lengths: list[int], page_size: int, kind: str = "edge") -> Case:
    return Case(name, {"lengths": lengths, "page_size": page_size}, kind)


def _cases(seed: int, n_random: int) -> list[Case]:
    cases = [
        _case("the chapter's example: lengths [11, 3, 7, 14], page_size 4", [11, 3, 7, 14], 4),
        _case("page_size 1 (a page is one slot)", [5, 0, 3], 1),
        _case("lengths that fill their last page exactly", [4, 8, 64], 4),
        _case("one token spills into a new page", [5, 9, 65], 4),
        _case("a request with no tokens yet needs no page", [0, 1, 0], 16),
        _case("no requests at all", [], 4),
        _case("page_size larger than every request", [1, 30, 63], 64),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        page_size = rng.choice([1, 2, 4, 16, 64])
        lengths = [rng.randint(0, 300) for _ in range(rng.randint(1, 8))]
        cases.append(_case(f"random {i + 1} (page_size {page_size}, {len(lengths)} requests)",
                           lengths, page_size, kind="random"))
    return cases


@exercise(
    "pages_needed",
    chapter="00",
    hints=[
        "A request of n tokens needs ceil(n / page_size) pages: whole pages, the last one maybe "
        "partly used. A request of 0 tokens needs none.",
        "kvlab.div_ceil(n, page_size) is ceil(n / page_size) in integers only, "
        "(n + page_size - 1) // page_size: no floats, so no rounding surprises for big n.",
        "One value per request, in the same order: [kvlab.div_ceil(n, page_size) for n in lengths].",
    ],
    solution=pages_needed_solution,
)
def pages_needed(fn, *, seed: int = 0, n_random: int = 8) -> int:
    """Check ``fn(lengths, page_size)`` against the counting oracle; prints one line when all pass."""

    def run_one(case: Case) -> None:
        lengths, page_size = case.args["lengths"], case.args["page_size"]
        expected = pages_by_counting(lengths, page_size)
        got = call_learner(fn, list(lengths), page_size, read_only=(0,))
        if isinstance(got, torch.Tensor):
            got = got.flatten().tolist()
        if got is None or isinstance(got, (int, float, str)) or not hasattr(got, "__len__"):
            raise CheckFailed(f"[{case.name}] return a list with one int per request, not "
                              f"{type(got).__name__}", case=case.name)
        not_ints = [v for v in got if not isinstance(v, numbers.Integral) or isinstance(v, bool)]
        if not_ints:
            kinds = sorted({type(v).__name__ for v in not_ints})
            raise CheckFailed(f"[{case.name}] every entry should be an int; got {', '.join(kinds)} "
                              f"in {list(got)[:8]} (integer division // keeps ints; / makes floats)",
                              case=case.name)
        segments = [Segment(f"request {i} ({n} tokens)", i, i + 1) for i, n in enumerate(lengths)]
        compare_flat(torch.tensor(expected, dtype=torch.int64),
                     torch.tensor(list(got), dtype=torch.int64), case=case.name,
                     what="pages per request", segments=segments)

    return run_cases("pages_needed", _cases(seed, n_random), run_one)
