"""Chapter 10's second exercise: ``kvlab.check.pad_decode_batch(fn)``.

A CUDA graph replays a decode step at the batch size it was captured at, so a step of ``n``
running requests is padded up to the smallest captured size that holds it. The learner writes
that padding::

    fn(rows, positions, page_table, sizes, dummy_row) -> (rows, positions, slots)

``rows[b]``, ``positions[b]``: request ``b``'s page-table row and the position of its new token
(int64 tensors). Returned: three 1-D tensors on the inputs' device, each of length ``size`` (the
smallest of ``sizes`` that is ``>= n``): rows and positions int64, slots of the page table's
dtype (``page_table[rows, positions]``) or int64. Their entries: the real ones unchanged, then
padded entries of the dummy request -- row ``dummy_row``, position 0 -- and every entry's slot
``page_table[row, position]``. The dummy row maps only the dummy page, so a padded entry writes
and reads nothing of anyone's. A batch larger than every size is returned as it is (it runs
without a graph). ``rows``, ``positions``, ``page_table`` and ``sizes`` are read-only.

Checked against :func:`kvlab.serving.hf.graphs.pad_decode_batch` on edge cases and seeded random
steps: first the types, then the size, then rows, positions and slots entry by entry (padded
entries apart from real ones); a slip is named when it alone gives the answer
(:mod:`kvlab.course.checking.slips`). Every parameter varies: page sizes 1 to 64, batches of 1 to 10
requests (one request whose size is not captured too), captured sizes in any order and not only
powers of two, and the dummy row anywhere in the table (the last row only in some cases, row 0
never), while the requests sit in shuffled rows on shuffled pages.
"""
from __future__ import annotations

import random

import torch

from ...base import runtime
from ...attention.kv_pool import DUMMY_PAGE, random_decode_step
from ..checking.answers import expect_parts, expect_tensor, fail
from ..checking.core import Case, CheckFailed, Segment, call_learner, compare_flat, exercise, run_cases
from ..checking.slips import equal_tensors, recognised


def pad_decode_batch_solution(rows, positions, page_table, sizes, dummy_row):
    """Find the size, add entries of the dummy request, then look every entry's slot up."""
    n = len(rows)
    size = next((s for s in sorted(sizes) if s >= n), n)   # larger than every size: unpadded
    rows = torch.cat([rows, rows.new_full((size - n,), dummy_row)])
    positions = torch.cat([positions, positions.new_zeros(size - n)])
    return rows, positions, page_table[rows, positions]


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, lens, sizes, kind="edge", seed=0, dummy="middle"):
        return Case(name, dict(P=P, lens=lens, sizes=sizes, seed=seed, dummy=dummy), kind)

    cases = [
        case("5 running requests, captured sizes 1 2 4 8", 4, [5, 9, 2, 13, 7], [1, 2, 4, 8]),
        case("exactly a captured size: nothing to pad", 4, [3, 8, 6, 1], [1, 2, 4, 8]),
        case("one request", 2, [4], [1, 2, 4]),
        case("one request, size 1 not captured: pads to 2", 4, [6], [2, 4]),
        case("one request, only size 8 captured", 1, [3], [8]),
        case("page_size 1, 3 requests pad to 4", 1, [3, 1, 6], [1, 2, 4, 8]),
        case("sizes given out of order", 4, [2, 5, 9], [8, 16, 1, 4, 2]),
        case("larger than every captured size: unpadded", 4, [3, 4, 5, 6, 7], [1, 2, 4]),
        case("mini-sglang's sizes up to 16 (1, 2, 4, then multiples of 8), 9 requests", 16, [17, 3, 30, 1, 16, 8, 25, 2, 11],
             [1, 2, 4, 8, 16]),
        case("sizes 1 2 4 8 12 16 24, 10 requests pad to 12 (not to a power of two)", 2,
             [4, 1, 7, 3, 5, 2, 8, 6, 1, 3], [1, 2, 4, 8, 12, 16, 24]),
        case("the dummy row is the table's last, as in PagedGenerator", 4, [6, 2, 9], [4, 8], dummy="last"),
        case("page_size 64: 3 requests pad to 4", 64, [65, 1, 130], [1, 2, 4, 8]),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        P = rng.choice([1, 2, 4, 16, 64])
        n = rng.randint(1, 10)
        sizes = rng.sample([1, 2, 3, 4, 6, 8, 12, 16], rng.randint(1, 4))  # in any order
        cases.append(case(f"random {i + 1} (page_size {P}, {n} requests, sizes {sizes})", P,
                          [rng.randint(1, 3 * P + 3) for _ in range(n)], sizes, "random",
                          rng.randrange(1000), rng.choice(["middle", "last"])))
    return cases


def _dummy_row(where: str, table_rows: int, seed: int) -> int:
    """The dummy row of a case: the table's last row, or one in the middle (never row 0)."""
    return table_rows if where == "last" else random.Random(seed).randint(1, table_rows - 1)


def _want_size(n: int, sizes) -> int:
    return next((s for s in sorted(sizes) if s >= n), n)


def _padded(a: dict, size: int, pad_row=None, pad_pos=None, slots=None):
    """(rows, positions, slots) padded to ``size``: with the dummy request, or a slip's rows,
    positions or slots."""
    rows, positions, table, n = a["rows"], a["positions"], a["page_table"], len(a["rows"])
    if size < n:
        rows, positions = rows[:size], positions[:size]
    pad = max(0, size - n)
    pad_row = a["dummy_row"] if pad_row is None else pad_row
    r = torch.cat([rows, torch.full((pad,), pad_row, dtype=rows.dtype)]) if pad else rows
    pos = torch.cat([positions, torch.full((pad,), 0 if pad_pos is None else pad_pos,
                                           dtype=positions.dtype)]) if pad else positions
    return r, pos, table[r, pos] if slots is None else slots(r, pos)


def _slips(a: dict, sizes) -> dict:
    """What known slips return for this step (:func:`kvlab.course.checking.slips.recognised`)."""
    n, want = len(a["rows"]), _want_size(len(a["rows"]), sizes)
    last = int(a["rows"][-1]) if n else 0
    two = 1 << max(n - 1, 0).bit_length()
    return {
        "it took the first size that holds the batch in the order given: sizes may come in any "
        "order, take the smallest that holds it":
            lambda: _padded(a, next(s for s in sizes if s >= n)),
        "it always pads to the largest captured size: pad to the smallest one that holds the "
        "batch (fewer wasted entries)": lambda: _padded(a, max(sizes)),
        "it did not pad at all: a graph runs only at its captured size": lambda: _padded(a, n),
        "it pads to the next power of two: pad to the smallest of the captured sizes that holds "
        "the batch (they need not be powers of two)": lambda: _padded(a, two if n <= max(sizes) else n),
        "padded entries use row 0: a real request's row, whose page would then be written by "
        "every padded entry -- use the dummy row": lambda: _padded(a, want, pad_row=0),
        "padded entries use row -1: that is the table's last row, not the dummy row; name "
        "dummy_row itself": lambda: _padded(a, want, pad_row=-1),
        f"padded entries use the table's last row ({a['page_table'].shape[0] - 1}): the dummy row "
        f"is dummy_row ({a['dummy_row']}) wherever it is (PagedGenerator's happens to be the last)":
            lambda: _padded(a, want, pad_row=a["page_table"].shape[0] - 1),
        "it repeated the last real entry: its request's slot would be written twice":
            lambda: _padded(a, want, pad_row=last, pad_pos=int(a["positions"][-1])),
        "padded entries copy the last real position: the dummy request is at position 0 (its "
        "row maps the dummy page there)": lambda: _padded(a, want, pad_pos=int(a["positions"][-1])),
        "slots = positions: a slot is found through the row, page_table[row, position]":
            lambda: _padded(a, want, slots=lambda r, pos: pos),
        "padded entries got slot -1: look the slot up in the dummy row like any entry's":
            lambda: _padded(a, want, slots=lambda r, pos: torch.cat(
                [a["page_table"][r[:n], pos[:n]], torch.full((len(r) - n,), -1)])),
    }


def _check_types(case: str, got, a: dict, device) -> tuple:
    rows, positions, slots = expect_parts(case, got, ("rows", "positions", "slots"))
    for what, t in (("rows", rows), ("positions", positions)):
        expect_tensor(case, what, t, dtypes=(torch.int64,), device=device)
    table_dtype = a["page_table"].dtype
    expect_tensor(case, "slots", slots, dtypes=tuple(dict.fromkeys((table_dtype, torch.int64))),
                  device=device, meaning="page_table[rows, positions]")
    for what, t in (("rows", rows), ("positions", positions), ("slots", slots)):
        if t.dim() != 1:
            raise fail(case, f"{what} should be 1-D (one entry per request and padded entry), "
                             f"got shape {tuple(t.shape)}")
    return rows.cpu(), positions.cpu(), slots.cpu()


@exercise(
    "pad_decode_batch",
    chapter="10",
    order=2,
    hints=[
        "The size first: the smallest of sizes that is >= len(rows) (sizes may come in any "
        "order). If none is, nothing is padded: return the three of them for the batch as it is.",
        "Padded entries are the dummy request: torch.cat([rows, rows.new_full((size - n,), dummy_row)]) "
        "and torch.cat([positions, positions.new_zeros(size - n)]) -- position 0, where the dummy "
        "row maps the dummy page.",
        "Then every entry's slot, real or padded, the same way: slots = page_table[rows, positions] "
        "(advanced indexing with the two padded tensors).",
    ],
    solution=pad_decode_batch_solution,
)
def pad_decode_batch(fn, *, seed: int = 0, n_random: int = 4) -> int:
    """Check ``fn(rows, positions, page_table, sizes, dummy_row) -> (rows, positions, slots)``."""

    def run_one(case: Case) -> None:
        c = case.args
        table_rows = 10 if len(c["lens"]) <= 9 else len(c["lens"]) + 1
        a = random_decode_step(c["seed"], c["P"], c["lens"], table_rows,
                               _dummy_row(c["dummy"], table_rows, c["seed"] + sum(c["lens"])))._asdict()
        want = pad_decode_batch_solution(a["rows"], a["positions"], a["page_table"], c["sizes"], a["dummy_row"])
        on = {k: v.to(runtime.DEVICE, copy=True) for k, v in a.items() if isinstance(v, torch.Tensor)}
        got = call_learner(fn, on["rows"], on["positions"], on["page_table"], list(c["sizes"]), a["dummy_row"],
                           read_only=(0, 1, 2, 3))
        n = len(c["lens"])
        where = (f"\n  {n} running requests, captured sizes {list(c['sizes'])}, dummy_row {a['dummy_row']} "
                 f"(it maps slot {DUMMY_PAGE * c['P']}, the dummy page's first)")
        got = _check_types(case.name, got, a, on["rows"].device)
        size = _want_size(n, c["sizes"])
        if all(len(g) == size for g in got) and all(equal_tensors(w, g) for w, g in zip(want, got)):
            return
        why = recognised(got, _slips(a, list(c["sizes"])), equal_tensors)
        lengths = [len(g) for g in got]
        if lengths != [size] * 3:
            raise CheckFailed(f"[{case.name}] every returned tensor has {size} entries (the smallest "
                              f"captured size >= {n}, or {n} when none is), got lengths {lengths}"
                              + why + where, case=case.name)
        segments = [Segment("real entries", 0, n)] + ([Segment("padded entries", n, size)] if size > n else [])
        for what, w, g in zip(("rows", "positions", "slots"), want, got):
            try:
                compare_flat(w, g.to(torch.int64), case=case.name, what=what, segments=segments)
            except CheckFailed as err:
                raise err.extend(why + where) from None

    return run_cases("pad_decode_batch", _cases(seed, n_random), run_one)
