"""Chapter 01's exercise: ``kvlab.check.page_to_token(your_function)``.

The learner writes ``fn(page_starts, page_size)`` returning every token slot of the given
pages, in order, with the input's dtype and device. The checker runs named edge cases
first (page_size 1, one page, no pages, pages out of order, large page ids), then seeded
random ones, against :func:`kvlab.course.reference.page_to_token_ref`. ``page_starts`` is read-only
(returning it as it is, for ``page_size == 1``, is fine).
"""
from __future__ import annotations

import random

import torch

from ...base import runtime
from ..reference import page_to_token_ref
from ..checking.core import Case, CheckFailed, Segment, call_learner, compare_flat, exercise, run_cases
from ..checking.failures import Layout


def page_to_token_solution(page_starts: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of the pages starting at ``page_starts`` (page id * page_size), in order."""
    if page_size == 1:
        return page_starts  # one slot per page: the starts already are the slots
    offsets = torch.arange(page_size, dtype=page_starts.dtype, device=page_starts.device)
    # [num_pages, 1] + [page_size] -> [num_pages, page_size] -> flat, page after page
    return (page_starts.unsqueeze(1) + offsets).flatten()


def _case(name: str, page_ids: list[int], page_size: int, dtype=torch.int32, kind: str = "edge") -> Case:
    return Case(name, {"page_ids": page_ids, "page_size": page_size, "dtype": dtype}, kind)


def _cases(seed: int, n_random: int) -> list[Case]:
    cases = [
        _case("the example: pages [4, 8] with page_size 4", [1, 2], 4),
        _case("page_size 1 (a page is one slot)", [5, 0, 3], 1),
        _case("a single page", [3], 8),
        _case("no pages at all", [], 4),
        _case("pages out of order", [6, 1, 4, 0], 4),
        _case("large page ids (int64)", [2**31 // 16 + 5, 7], 16, torch.int64),
        _case("page_size 64, int64", [2, 0, 9], 64, torch.int64),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        page_size = rng.choice([1, 2, 4, 16, 64])
        ids = rng.sample(range(512), rng.randint(0, 12))
        dtype = rng.choice([torch.int32, torch.int64])
        cases.append(_case(f"random {i + 1} (page_size {page_size}, {len(ids)} pages)", ids,
                           page_size, dtype, kind="random"))
    return cases


@exercise(
    "page_to_token",
    chapter="01",
    hints=[
        "Each page start p owns the slots p, p+1, ..., p + page_size - 1; the answer lists them "
        "page after page.",
        "Make a column of starts and a row of offsets 0..page_size-1, add them (broadcasting), "
        "then read the result row by row.",
        "offsets = torch.arange(page_size, dtype=page_starts.dtype, device=page_starts.device); "
        "(page_starts.unsqueeze(1) + offsets) has shape [num_pages, page_size]; .flatten() it.",
        "When page_size == 1 every page is one slot: return page_starts itself.",
    ],
    solution=page_to_token_solution,
)
def page_to_token(fn, *, seed: int = 0, n_random: int = 8) -> int:
    """Check ``fn(page_starts, page_size)`` against the reference; prints one line when all pass."""

    def run_one(case: Case) -> None:
        page_size, dtype = case.args["page_size"], case.args["dtype"]
        starts = torch.tensor([p * page_size for p in case.args["page_ids"]], dtype=dtype,
                              device=runtime.DEVICE)
        expected = page_to_token_ref(starts.tolist(), page_size)
        inputs = f"page_starts={starts.tolist()} ({dtype}), page_size={page_size}"
        got = call_learner(fn, starts.clone(), page_size, layout=Layout(inputs=inputs),
                           read_only=(0,))
        if not isinstance(got, torch.Tensor):
            raise CheckFailed(f"[{case.name}] return a torch.Tensor, not {type(got).__name__}",
                              case=case.name)
        if got.dim() != 1:
            raise CheckFailed(f"[{case.name}] return the slots as a 1-D tensor, page after page; "
                              f"got shape {tuple(got.shape)} (.flatten() it)", case=case.name)
        segments = [Segment(f"page {k} (start {s})", k * page_size, (k + 1) * page_size)
                    for k, s in enumerate(starts.tolist())]
        compare_flat(torch.tensor(expected, dtype=torch.int64), got, case=case.name,
                     what="slots", segments=segments)
        if got.dtype != dtype:
            raise CheckFailed(f"[{case.name}] the result's dtype is {got.dtype}; keep the input's "
                              f"dtype {dtype} (build the offsets with dtype=page_starts.dtype)",
                              case=case.name)
        if got.device != starts.device:
            raise CheckFailed(f"[{case.name}] the result is on {got.device}; keep the input's "
                              f"device {starts.device}", case=case.name)

    return run_cases("page_to_token", _cases(seed, n_random), run_one)
