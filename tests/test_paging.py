"""kvlab.alloc.paging (chapters 01-02) against the plain-Python references, plus every validation rule."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab import InvalidArgument
from kvlab.alloc.paging import (UNMAPPED, check_write_page_table, new_page_table, page_to_token,
                          page_to_token_triton, write_page_table, write_page_table_triton)
from kvlab.course.reference import page_to_token_ref, write_page_table_ref

PAGE_SIZES = [1, 2, 16, 64]
PAGE_TO_TOKEN = [page_to_token, page_to_token_triton]
WRITERS = [write_page_table, write_page_table_triton]


# --- div_ceil ----------------------------------------------------------------------------


def test_div_ceil_ints_and_tensors():
    assert [kvlab.div_ceil(a, 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    a = torch.arange(10)
    assert kvlab.div_ceil(a, 4).tolist() == [kvlab.div_ceil(int(x), 4) for x in a]


# --- page_to_token -----------------------------------------------------------------------


@pytest.mark.parametrize("fn", PAGE_TO_TOKEN, ids=lambda f: f.__name__)
def test_page_to_token_example(fn, device):
    out = fn(torch.tensor([4, 8], dtype=torch.int32, device=device), 4)
    assert out.tolist() == list(range(4, 12))
    assert out.dtype == torch.int32 and out.device.type == device.type


@pytest.mark.parametrize("fn", PAGE_TO_TOKEN, ids=lambda f: f.__name__)
def test_page_to_token_is_identity_for_page_size_one(fn, device):
    starts = torch.tensor([7, 3, 0], dtype=torch.int64, device=device)
    assert fn(starts, 1) is starts


@pytest.mark.parametrize("fn", PAGE_TO_TOKEN, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_page_to_token_empty(fn, dtype, device):
    out = fn(torch.empty(0, dtype=dtype, device=device), 16)
    assert out.numel() == 0 and out.dtype == dtype


@pytest.mark.parametrize("fn", PAGE_TO_TOKEN, ids=lambda f: f.__name__)
@given(data=st.data())
def test_page_to_token_matches_reference(fn, data):
    page_size = data.draw(st.sampled_from(PAGE_SIZES))
    page_ids = data.draw(st.lists(st.integers(0, 5000), max_size=40))
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    starts = torch.tensor([p * page_size for p in page_ids], dtype=dtype, device=kvlab.DEVICE)
    before = starts.clone()
    out = fn(starts, page_size)
    assert out.tolist() == page_to_token_ref(starts.tolist(), page_size)
    assert out.dtype == dtype and out.device == starts.device
    assert torch.equal(starts, before)


def test_page_to_token_triton_large_ids_do_not_overflow():
    page_size = 64
    starts = torch.tensor([(2**31 // page_size - 1) * page_size, 2**40], dtype=torch.int64,
                          device=kvlab.DEVICE)
    assert page_to_token_triton(starts, page_size).tolist() == page_to_token_ref(starts.tolist(), page_size)


def test_page_to_token_triton_spans_several_programs():
    # more output slots than one program's block: the grid must cover them all
    starts = torch.arange(37, dtype=torch.int32, device=kvlab.DEVICE) * 16
    assert page_to_token_triton(starts, 16).tolist() == list(range(37 * 16))


@pytest.mark.parametrize("fn", PAGE_TO_TOKEN, ids=lambda f: f.__name__)
@pytest.mark.parametrize("starts, page_size, argument", [
    (torch.tensor([4, 6]), 4, "page_starts[1]"),        # not a multiple of page_size
    (torch.tensor([-4, 0]), 4, "page_starts[0]"),       # negative
    (torch.tensor([[0, 4]]), 4, "page_starts"),         # 2-D
    (torch.tensor([0.0, 4.0]), 4, "page_starts"),       # float
    ([0, 4], 4, "page_starts"),                         # not a tensor
    (torch.tensor([0, 4]), 0, "page_size"),             # page_size < 1
    (torch.tensor([0, 4]), 2.0, "page_size"),           # page_size not an int
])
def test_page_to_token_rejects_bad_input(fn, starts, page_size, argument):
    with pytest.raises(InvalidArgument) as err:
        fn(starts, page_size)
    assert err.value.argument == argument
    assert isinstance(err.value, ValueError)


def test_page_to_token_triton_rejects_small_int_dtype():
    with pytest.raises(InvalidArgument, match="int32 or int64"):
        page_to_token_triton(torch.tensor([0, 4], dtype=torch.int16), 4)


# --- new_page_table ----------------------------------------------------------------------


def test_new_page_table_shape_and_fill():
    table = new_page_table(max_running_req=3, max_seq_len=10, page_size=4)
    assert table.shape == (4, 12)  # +1 dummy row; 10 rounded up to 3 pages of 4
    assert table.dtype == torch.int32 and table.device == kvlab.DEVICE
    assert (table == UNMAPPED).all()
    assert new_page_table(2, 16, 16).shape == (3, 16)
    with pytest.raises(InvalidArgument, match="max_running_req"):
        new_page_table(0, 16, 4)
    with pytest.raises(InvalidArgument, match="page_size"):
        new_page_table(2, 16, 0)


# --- write_page_table --------------------------------------------------------------------


def random_write(rng: random.Random, page_size: int, rows: int, pages_per_row: int,
                 aligned_tail: bool):
    """A random batch: some rows get a run of new pages after some already-mapped ones."""
    cols = pages_per_row * page_size
    if not aligned_tail and page_size > 1:
        cols += rng.randrange(1, page_size)  # a table whose width is not page-aligned
    info = []
    for row in rng.sample(range(rows), rng.randint(0, rows)):
        first = rng.randint(0, pages_per_row)
        last = rng.randint(first, pages_per_row)
        info.append((row, first, last))
    total = sum((last - first) * page_size for _, first, last in info)
    allocated = rng.sample(range(10 * total + 10), total)
    return cols, info, allocated


@pytest.mark.parametrize("writer", WRITERS, ids=lambda f: f.__name__)
@given(data=st.data())
def test_write_page_table_matches_reference(writer, data):
    page_size = data.draw(st.sampled_from(PAGE_SIZES))
    rows = data.draw(st.integers(1, 6))
    pages_per_row = data.draw(st.integers(1, 4))
    aligned = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2**16))
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    cols, info, allocated = random_write(random.Random(seed), page_size, rows, pages_per_row, aligned)
    rng = torch.Generator().manual_seed(seed)
    start = torch.randint(-1, 50, (rows, cols), generator=rng, dtype=dtype).to(kvlab.DEVICE)
    table = start.clone()
    writer(table, torch.tensor(allocated, dtype=dtype, device=kvlab.DEVICE), info, page_size)
    assert table.tolist() == write_page_table_ref(start.tolist(), allocated, info, page_size)
    assert table.dtype == dtype


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_host_and_triton_paths_agree(page_size):
    rng = random.Random(page_size)
    for _ in range(3):
        cols, info, allocated = random_write(rng, page_size, rows=8, pages_per_row=4, aligned_tail=True)
        base = new_page_table(7, cols, page_size)
        a, b = base.clone(), base.clone()
        alloc = torch.tensor(allocated, dtype=torch.int32, device=kvlab.DEVICE)
        write_page_table(a, alloc, info, page_size)
        write_page_table_triton(b, alloc, info, page_size)
        assert torch.equal(a, b)


@pytest.mark.parametrize("writer", WRITERS, ids=lambda f: f.__name__)
def test_write_page_table_edge_cases(writer, device):
    # one request, page_size 1
    table = new_page_table(1, 5, 1, device=device)
    writer(table, torch.tensor([9, 3, 7], dtype=torch.int32, device=device), [(0, 1, 4)], 1)
    assert table[0].tolist() == [-1, 9, 3, 7, -1]
    # empty allocation: nothing written
    table = new_page_table(2, 8, 4, device=device)
    writer(table, torch.empty(0, dtype=torch.int32, device=device), [], 4)
    writer(table, torch.empty(0, dtype=torch.int32, device=device), [(0, 1, 1), (1, 2, 2)], 4)
    assert (table == UNMAPPED).all()
    # a long run (several kernel blocks) ending exactly at the last column
    table = new_page_table(1, 64 * 6, 64, device=device)
    alloc = torch.arange(1000, 1000 + 64 * 5, dtype=torch.int64, device=device)
    writer(table, alloc, [(1, 1, 6)], 64)
    assert table[1].tolist() == [-1] * 64 + list(range(1000, 1000 + 64 * 5))
    assert (table[0] == UNMAPPED).all()
    # adjacent (touching, not overlapping) runs in the same row are fine
    table = new_page_table(1, 8, 2, device=device)
    writer(table, torch.arange(8, dtype=torch.int32, device=device), [(0, 0, 2), (0, 2, 4)], 2)
    assert table[0].tolist() == list(range(8))


BAD_WRITES = [
    # (description, allocation_info, number of allocated slots, expected argument, rule fragment)
    ("length", [(0, 0, 2)], 7, "allocated", "sum of"),
    ("row too big", [(0, 0, 1), (4, 0, 1)], 8, "allocation_info[1]", "table_idx"),
    ("row negative", [(-1, 0, 1)], 4, "allocation_info[0]", "table_idx"),
    ("first > last", [(1, 2, 1)], 0, "allocation_info[0]", "first_page <= last_page"),
    ("first negative", [(1, -1, 1)], 8, "allocation_info[0]", "first_page must be >= 0"),
    ("past the columns", [(0, 2, 4)], 8, "allocation_info[0]", "columns"),
    ("overlap", [(2, 0, 2), (1, 0, 1), (2, 1, 3)], 20, "allocation_info[2]", "overlap"),
    ("not a triple", [(0, 1)], 4, "allocation_info[0]", "three ints"),
]


@pytest.mark.parametrize("writer", WRITERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", BAD_WRITES, ids=lambda c: c[0])
def test_write_page_table_rejects_bad_info_and_leaves_table_untouched(writer, case, device):
    _, info, n_alloc, argument, rule = case
    table = new_page_table(3, 12, 4, device=device)  # shape (4, 12): rows 0..3, pages 0..2
    table[0, :4] = torch.arange(4, dtype=torch.int32)
    before = table.clone()
    with pytest.raises(InvalidArgument) as err:
        writer(table, torch.arange(n_alloc, dtype=torch.int32, device=device), info, 4)
    assert err.value.argument == argument
    assert rule in str(err.value)
    assert torch.equal(table, before)


@pytest.mark.parametrize("writer", WRITERS, ids=lambda f: f.__name__)
def test_write_page_table_rejects_bad_tensors(writer, device):
    table = new_page_table(1, 8, 4, device=device)
    before = table.clone()
    alloc = torch.arange(4, dtype=torch.int32, device=device)
    cases = [
        (table.float(), alloc, 4, "page_table"),
        (table[0], alloc, 4, "page_table"),
        (table, alloc.float(), 4, "allocated"),
        (table, alloc.view(2, 2), 4, "allocated"),
        (table, alloc.tolist(), 4, "allocated"),
        (table, alloc, 0, "page_size"),
    ]
    if device.type != "meta":
        cases.append((table, alloc.to("meta"), 4, "allocated"))  # wrong device
    for tab, al, ps, argument in cases:
        with pytest.raises(InvalidArgument) as err:
            writer(tab, al, [(0, 0, 1)], ps)
        assert err.value.argument == argument, (argument, str(err.value))
    assert torch.equal(table, before)


def test_validation_returns_offsets():
    table = new_page_table(3, 16, 4)
    runs = check_write_page_table(table, torch.zeros(20, dtype=torch.int32, device=table.device), [(0, 0, 2), (2, 1, 4)], 4)
    assert [(r.table_idx, r.first_page, r.last_page, r.offset) for r in runs] == [(0, 0, 2, 0), (2, 1, 4, 8)]


@pytest.mark.gpu
def test_triton_paths_reject_cpu_tensors_when_compiled():
    table = new_page_table(1, 8, 4, device="cpu")
    with pytest.raises(InvalidArgument, match="CUDA"):
        write_page_table_triton(table, torch.arange(4, dtype=torch.int32), [(0, 0, 1)], 4)
    assert (table == UNMAPPED).all()
    with pytest.raises(InvalidArgument, match="CUDA"):
        page_to_token_triton(torch.tensor([0, 4]), 4)


@pytest.mark.parametrize("fn", PAGE_TO_TOKEN, ids=lambda f: f.__name__)
def test_page_to_token_value_check_can_be_skipped_but_shape_checks_cannot(fn, device):
    odd = torch.tensor([4, 6], device=device)
    assert fn(odd, 4, check_values=False).tolist() == [4, 5, 6, 7, 6, 7, 8, 9]  # no sync, no check
    with pytest.raises(InvalidArgument):
        fn(odd.view(1, 2), 4, check_values=False)


@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from([1, 2, 4]),
       st.lists(st.tuples(st.integers(-1, 5), st.integers(-1, 5), st.integers(-1, 6)), min_size=1, max_size=6),
       st.integers(0, 1))
def test_bulk_check_agrees_with_the_entry_by_entry_rules(max_req, pages, P, entries, extra):
    """The fast bulk check accepts exactly the writes the precise rules accept, with the same runs."""
    from kvlab.alloc.paging import _check_write_entry_by_entry, _bulk_checked_entries

    table = new_page_table(max_req, pages * P, P)
    total = sum(max(0, last - first) * P for _, first, last in entries) + extra
    allocated = torch.zeros(total, dtype=torch.int32, device=table.device)
    try:
        exact = [tuple(r) for r in _check_write_entry_by_entry(table, allocated, entries, P)]
    except InvalidArgument:
        exact = None
    fast = _bulk_checked_entries(table, allocated, entries, P)
    if fast is None:
        assert exact is None
    else:
        assert list(zip(*fast.tolist())) == exact


@pytest.mark.parametrize("form", ["list", "ndarray", "tensor"])
def test_allocation_info_as_an_array_is_checked_the_same(form, device):
    """An [n, 3] integer array (or CPU tensor) takes the vectorised check without converting
    entry by entry; its refusals name the entry like the list's."""
    import numpy as np

    P = 4
    good = [(0, 0, 2), (2, 1, 3)]
    bad = [(0, 0, 2), (0, 1, 3)]  # overlapping runs in row 0
    as_form = {"list": list, "ndarray": np.array, "tensor": torch.tensor}[form]
    table = new_page_table(3, 16, P, device=device)
    runs = check_write_page_table(table, torch.zeros(16, dtype=torch.int32, device=device), as_form(good), P)
    assert [tuple(r) for r in runs] == [(0, 0, 2, 0), (2, 1, 3, 8)]
    with pytest.raises(InvalidArgument, match="overlap") as e:
        check_write_page_table(table, torch.zeros(16, dtype=torch.int32, device=device), as_form(bad), P)
    assert e.value.argument == "allocation_info[1]"
