"""Chapter 02's exercise: ``kvlab.check.write_page_table(your_function)``.

The learner writes ``fn(page_table, allocated, allocation_info, page_size)`` that writes
``allocated`` into ``page_table`` in place: for each ``(table_idx, first_page, last_page)``
the next ``(last_page - first_page) * page_size`` slots go to
``page_table[table_idx, first_page*page_size : last_page*page_size]``. The whole table is
compared with :func:`kvlab.course.reference.write_page_table_ref`; a failure names the request
row, the logical column and the page of the first wrong cell. ``allocated`` and
``allocation_info`` are read-only, and a function that returns a new table instead of writing
into ``page_table`` is told so.
"""
from __future__ import annotations

import random

import torch

from ...base import runtime
from ...alloc.paging import new_page_table
from ..reference import write_page_table_ref
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..checking.failures import Layout


def write_page_table_solution(page_table: torch.Tensor, allocated: torch.Tensor,
                              allocation_info: list[tuple[int, int, int]], page_size: int) -> None:
    """Host-built row/column indices, then one scatter (as mini-sglang's _write_page_table)."""
    rows = torch.empty(len(allocated), dtype=torch.int64)
    cols = torch.empty(len(allocated), dtype=torch.int64)
    offset = 0
    for table_idx, first_page, last_page in allocation_info:
        first_pos, last_pos = first_page * page_size, last_page * page_size
        length = last_pos - first_pos
        rows[offset: offset + length] = table_idx
        cols[offset: offset + length] = torch.arange(first_pos, last_pos)
        offset += length
    page_table[rows.to(page_table.device), cols.to(page_table.device)] = allocated.to(page_table.dtype)


def _case(name: str, max_req: int, max_len: int, page_size: int, info: list[tuple[int, int, int]],
          kind: str = "edge", seed: int = 0) -> Case:
    return Case(name, {"max_req": max_req, "max_len": max_len, "page_size": page_size,
                       "info": info, "seed": seed}, kind)


def _cases(seed: int, n_random: int) -> list[Case]:
    cases = [
        _case("one request, two pages", 2, 12, 4, [(0, 0, 2)]),
        _case("page_size 1", 2, 6, 1, [(1, 2, 5), (0, 0, 1)]),
        _case("a request that already has pages (first_page > 0)", 3, 16, 4, [(1, 2, 4)]),
        _case("several requests, rows out of order", 4, 16, 4, [(3, 0, 1), (0, 1, 3), (2, 0, 4)]),
        _case("an entry with no new pages", 2, 8, 2, [(0, 1, 1), (1, 0, 2)]),
        _case("nothing to write", 2, 8, 4, []),
        _case("the dummy row and the last column", 2, 8, 4, [(2, 0, 2)]),
        _case("page_size 64, rows out of order", 3, 192, 64, [(2, 1, 3), (0, 0, 1), (3, 2, 3)]),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        page_size = rng.choice([1, 2, 4, 16, 64])
        pages_per_row = rng.randint(1, 4)
        max_req = rng.randint(1, 5)
        info = []
        for row in rng.sample(range(max_req + 1), rng.randint(1, max_req + 1)):
            first = rng.randint(0, pages_per_row - 1)
            info.append((row, first, rng.randint(first, pages_per_row)))
        cases.append(_case(f"random {i + 1} (page_size {page_size}, {len(info)} requests)", max_req,
                           pages_per_row * page_size, page_size, info, kind="random",
                           seed=rng.randrange(2**16)))
    return cases


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    a = case.args
    page_size = a["page_size"]
    table = new_page_table(a["max_req"], a["max_len"], page_size)
    # pages already mapped before this batch, so a write in the wrong place shows
    for row, first, _ in a["info"]:
        table[row, : first * page_size] = 900 + torch.arange(first * page_size, dtype=table.dtype,
                                                              device=table.device)
    needed = sum((last - first) for _, first, last in a["info"])
    gen = torch.Generator().manual_seed(a["seed"])
    page_ids = torch.randperm(max(needed, 1) * 3, generator=gen)[:needed]
    slots = (page_ids.repeat_interleave(page_size) * page_size
             + torch.arange(needed * page_size) % page_size)
    return table, slots.to(torch.int32).to(runtime.DEVICE)


@exercise(
    "write_page_table",
    chapter="02",
    hints=[
        "Walk allocation_info in order, keeping a running offset into allocated: each entry "
        "takes the next (last_page - first_page) * page_size slots.",
        "An entry covers the logical positions first_page*page_size up to last_page*page_size "
        "(not included) of row table_idx.",
        "Build two index tensors as long as allocated: rows (table_idx repeated) and cols "
        "(torch.arange(first_page*page_size, last_page*page_size) per entry), concatenated in order.",
        "Then one scatter writes everything: page_table[rows, cols] = allocated "
        "(move rows and cols to page_table.device first).",
    ],
    solution=write_page_table_solution,
)
def write_page_table(fn, *, seed: int = 0, n_random: int = 8) -> int:
    """Check ``fn(page_table, allocated, allocation_info, page_size)`` (writes in place)."""

    def run_one(case: Case) -> None:
        page_size, info = case.args["page_size"], case.args["info"]
        table, allocated = _inputs(case)
        expected = torch.tensor(write_page_table_ref(table.tolist(), allocated.tolist(), info, page_size),
                                dtype=torch.int64)
        got_table = table.clone()
        inputs = (f"page_table {tuple(table.shape)}, allocation_info={info}, "
                  f"page_size={page_size}")
        returned = call_learner(fn, got_table, allocated.clone(), list(info), page_size,
                                layout=Layout(inputs=inputs), read_only=(1, 2))
        got = got_table.detach().cpu().to(torch.int64)
        if got.shape != expected.shape:
            raise CheckFailed(f"[{case.name}] the page table changed shape: {tuple(got.shape)}, "
                              f"expected {tuple(expected.shape)}", case=case.name)
        wrong = (got != expected).flatten().nonzero().flatten().tolist()
        if not wrong:
            return
        if (isinstance(returned, torch.Tensor) and returned.shape == expected.shape
                and torch.equal(returned.detach().cpu().to(torch.int64), expected)):
            raise CheckFailed(
                f"[{case.name}] your function returned a new page table instead of writing into "
                f"page_table: the table the caller passed is left with {len(wrong)} cell(s) "
                "unwritten. Write in place (page_table[row, start:end] = ..., or one scatter "
                "page_table[rows, cols] = ...); a copy made inside the function (page_table.clone(), "
                "torch.where, page_table = ...) never reaches the caller", case=case.name,
                label="in place")
        cols = expected.shape[1]
        r, c = divmod(wrong[0], cols)
        page = c // page_size
        exp_row, got_row = expected[r].tolist(), got[r].tolist()
        lo, hi = page * page_size, min(cols, (page + 1) * page_size)
        owner = [i for i, (row, first, last) in enumerate(info) if row == r and first <= page < last]
        why = (f"allocation_info[{owner[0]}] = {info[owner[0]]} writes this page" if owner else
               "no allocation_info entry covers this cell: it should have been left as it was")
        raise CheckFailed(
            f"[{case.name}] page table differs in {len(wrong)} cell(s); first at request row {r}, "
            f"logical column {c} (page {page} of that row)\n"
            f"  expected page_table[{r}, {c}] = {exp_row[c]}, got {got_row[c]}  ({why})\n"
            f"  expected page_table[{r}, {lo}:{hi}] = {exp_row[lo:hi]}\n"
            f"  got      page_table[{r}, {lo}:{hi}] = {got_row[lo:hi]}",
            case=case.name, expected=expected.flatten(), got=got.flatten(), wrong=wrong,
            label=f"request row {r}, column {c}, page {page}", shape=tuple(expected.shape),
            what="page table", page_size=page_size)

    return run_cases("write_page_table", _cases(seed, n_random), run_one)
