"""Chapter 10's second exercise: ``kvlab.check.pad_decode_batch(fn)``.

A CUDA graph replays a decode step at the batch size it was captured at, so a step of ``n``
running requests is padded up to the smallest captured size that holds it. The learner writes
that padding::

    fn(rows, positions, page_table, sizes, dummy_row) -> (rows, positions, slots)

``rows[b]``, ``positions[b]``: request ``b``'s page-table row and the position of its new token
(int64 tensors). Returned, each of length ``size`` (the smallest of ``sizes`` that is
``>= n``): the real lanes unchanged, then padded lanes of the dummy request -- row
``dummy_row``, position 0 -- and every lane's slot ``page_table[row, position]``. The dummy
row maps only the dummy page, so a padded lane writes and reads nothing of anyone's. A batch
larger than every size is returned as it is (it runs without a graph). ``rows``, ``positions``,
``page_table`` and ``sizes`` are read-only.

Checked against :func:`kvlab.hf.graphs.pad_decode_batch` on edge cases and seeded random
steps: first the size, then rows, positions and slots lane by lane (padded lanes apart from
real ones); a recognised slip is named. Every parameter varies: page sizes 1 to 64, batches of
1 to 10 requests, captured sizes in any order and not only powers of two, and the dummy row
anywhere in the table (the last row only in some cases, row 0 never), while the requests sit
in shuffled rows on shuffled pages.
"""
from __future__ import annotations

import random

import torch

from .. import runtime
from .core import Case, CheckFailed, Segment, call_learner, compare_flat, exercise, run_cases

#: what the dummy row maps in a case: the first slot of page ``DUMMY_PAGE``
DUMMY_PAGE = 30


def pad_decode_batch_solution(rows, positions, page_table, sizes, dummy_row):
    """Find the size, add lanes of the dummy request, then look every lane's slot up."""
    n = len(rows)
    size = next((s for s in sorted(sizes) if s >= n), n)   # larger than every size: unpadded
    rows = torch.cat([rows, rows.new_full((size - n,), dummy_row)])
    positions = torch.cat([positions, positions.new_zeros(size - n)])
    return rows, positions, page_table[rows, positions]


def step_case(P: int, lens: list[int], table_rows: int, seed: int, dummy_row: int | None = None) -> dict:
    """A page table of ``table_rows`` rows plus the dummy row (``dummy_row``, the last by
    default): request ``b`` holds ``lens[b]`` positions on shuffled pages in a shuffled row of
    the others; its new token is its last."""
    rng = random.Random(seed)
    dummy = table_rows if dummy_row is None else dummy_row
    cols = max(lens) // P * P + P
    table = torch.full((table_rows + 1, cols), -1, dtype=torch.int32)
    table[dummy] = DUMMY_PAGE * P
    pages = rng.sample(range(DUMMY_PAGE), sum(-(-n // P) for n in lens))
    rows = rng.sample([r for r in range(table_rows + 1) if r != dummy], len(lens))
    for row, n in zip(rows, lens):
        mine = [pages.pop() for _ in range(-(-n // P))]
        table[row, :len(mine) * P] = torch.tensor([p * P + i for p in mine for i in range(P)])
    return dict(rows=torch.tensor(rows, dtype=torch.int64),
                positions=torch.tensor([n - 1 for n in lens], dtype=torch.int64),
                page_table=table, dummy_row=dummy)


def _cases(seed: int, n_random: int) -> list[Case]:
    def case(name, P, lens, sizes, kind="edge", seed=0, dummy="middle"):
        return Case(name, dict(P=P, lens=lens, sizes=sizes, seed=seed, dummy=dummy), kind)

    cases = [
        case("5 running requests, captured sizes 1 2 4 8", 4, [5, 9, 2, 13, 7], [1, 2, 4, 8]),
        case("exactly a captured size: nothing to pad", 4, [3, 8, 6, 1], [1, 2, 4, 8]),
        case("one request", 2, [4], [1, 2, 4]),
        case("page_size 1, 3 requests pad to 4", 1, [3, 1, 6], [1, 2, 4, 8]),
        case("sizes given out of order", 4, [2, 5, 9], [8, 1, 4, 2]),
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


def _diagnose_size(n: int, sizes, got: int) -> str:
    if got != _want_size(n, sizes) and got == next((s for s in sizes if s >= n), None):
        return ("\n  looks like it took the first size that holds the batch in the order given: "
                "sizes may come in any order, take the smallest that holds it")
    if got == max(sizes) and got != _want_size(n, sizes):
        return ("\n  looks like it always pads to the largest captured size: pad to the smallest "
                "one that holds the batch (fewer wasted lanes)")
    if got == n and n <= max(sizes):
        return "\n  looks like it did not pad at all: a graph runs only at its captured size"
    if n > max(sizes):
        return ("\n  no captured size holds this batch: return it unpadded (the step runs "
                "without a graph)")
    if got == 1 << max(n - 1, 0).bit_length():
        return ("\n  looks like it pads to the next power of two: pad to the smallest of the "
                "captured sizes that holds the batch (they need not be powers of two)")
    return ""


def _diagnose_lanes(a: dict, what: str, got: torch.Tensor) -> str:
    n, dummy = a["n"], a["dummy_row"]
    pad = got[n:]
    if what == "rows" and pad.numel():
        if bool((pad == 0).all()) and dummy != 0:
            return ("\n  looks like padded lanes use row 0: a real request's row, whose page would "
                    "then be written by every padded lane -- use the dummy row")
        if bool((pad == -1).all()):
            return ("\n  looks like padded lanes use row -1: that is the table's last row, not "
                    "the dummy row; name dummy_row itself")
        if bool((pad == a["page_table"].shape[0] - 1).all()):
            return (f"\n  looks like padded lanes use the table's last row ({a['page_table'].shape[0] - 1}): "
                    f"the dummy row is dummy_row ({dummy}) wherever it is (PagedGenerator's happens "
                    "to be the last)")
        if bool((pad == got[n - 1]).all()):
            return "\n  looks like it repeated the last real lane: its request would be written twice"
    if what == "positions" and pad.numel() and n and bool((pad == got[n - 1]).all()):
        return ("\n  looks like padded lanes copy the last real position: the dummy request is "
                "at position 0 (its row maps the dummy page there)")
    if what == "slots":
        if bool((got == a["positions_padded"]).all()):
            return "\n  looks like slots = positions: a slot is found through the row, page_table[row, position]"
        if bool((got[n:] == -1).all()) and got.numel() > n:
            return "\n  looks like padded lanes got slot -1: look it up in the dummy row like any lane"
    return ""


@exercise(
    "pad_decode_batch",
    chapter="10",
    hints=[
        "The size first: the smallest entry of sizes that is >= len(rows) (sizes may come in any "
        "order). If none is, nothing is padded: return the three of them for the batch as it is.",
        "Padded lanes are the dummy request: torch.cat([rows, rows.new_full((size - n,), dummy_row)]) "
        "and torch.cat([positions, positions.new_zeros(size - n)]) -- position 0, where the dummy "
        "row maps the dummy page.",
        "Then every lane's slot, real or padded, the same way: slots = page_table[rows, positions] "
        "(advanced indexing with the two padded tensors).",
    ],
    solution=pad_decode_batch_solution,
)
def pad_decode_batch(fn, *, seed: int = 0, n_random: int = 4) -> int:
    """Check ``fn(rows, positions, page_table, sizes, dummy_row) -> (rows, positions, slots)``."""

    def run_one(case: Case) -> None:
        c = case.args
        table_rows = 10 if len(c["lens"]) <= 9 else len(c["lens"]) + 1
        a = step_case(c["P"], c["lens"], table_rows, c["seed"], _dummy_row(c["dummy"], table_rows, c["seed"] + sum(c["lens"])))
        want = pad_decode_batch_solution(a["rows"], a["positions"], a["page_table"], c["sizes"], a["dummy_row"])
        on = {k: v.to(runtime.DEVICE, copy=True) for k, v in a.items() if isinstance(v, torch.Tensor)}
        got = call_learner(fn, on["rows"], on["positions"], on["page_table"], list(c["sizes"]), a["dummy_row"],
                           read_only=(0, 1, 2, 3))
        n = len(c["lens"])
        where = (f"\n  {n} running requests, captured sizes {list(c['sizes'])}, dummy_row {a['dummy_row']} "
                 f"(it maps slot {DUMMY_PAGE * c['P']}, the dummy page's first)")
        if not (isinstance(got, (tuple, list)) and len(got) == 3):
            raise CheckFailed(f"[{case.name}] return three tensors (rows, positions, slots), got "
                              f"{type(got).__name__}" + where, case=case.name)
        size = _want_size(n, c["sizes"])
        lengths = [len(g) if hasattr(g, "__len__") else None for g in got]
        if lengths != [size] * 3:
            raise CheckFailed(f"[{case.name}] every returned tensor has {size} lanes (the smallest "
                              f"captured size >= {n}), got lengths {lengths}"
                              + _diagnose_size(n, c["sizes"], next((x for x in lengths if x), 0)) + where,
                              case=case.name)
        segments = [Segment("real lanes", 0, n)] + ([Segment("padded lanes", n, size)] if size > n else [])
        info = dict(a, n=n, positions_padded=want[1])
        for what, w, g in zip(("rows", "positions", "slots"), want, got):
            g_cpu = torch.as_tensor(g).cpu().to(torch.int64) if isinstance(g, torch.Tensor) else g
            try:
                compare_flat(w, g_cpu, case=case.name, what=what, segments=segments)
            except CheckFailed as err:
                hint = _diagnose_lanes(info, what, g_cpu) if isinstance(g_cpu, torch.Tensor) else ""
                raise err.extend(hint + where) from None

    return run_cases("pad_decode_batch", _cases(seed, n_random), run_one)
