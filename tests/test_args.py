"""The shared argument checks: one rule and one wording at every door."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab.base.args import (check_int, check_int_vector, check_page_size, check_token_ids, div_ceil,
                        is_int, next_pow2)
from kvlab.base.errors import CacheMisuse, IntegrityError, InvalidArgument, OutOfPages
from kvlab.serving.sim.scheduler import SimIntegrityError


@given(st.integers(0, 10**6), st.integers(1, 4096))
def test_div_ceil_is_ceiling_division(a, b):
    assert div_ceil(a, b) == -(-a // b)


@given(st.integers(0, 2**20))
def test_next_pow2_is_the_smallest_power_of_two_at_least_n(n):
    p = next_pow2(n)
    assert p >= max(n, 1) and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


@pytest.mark.parametrize("value", [0, 7, np.int64(3), torch.tensor(5)])
def test_integers_are_ints(value):
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 2.0, 2.5, "3", None,
                                   torch.tensor([1]), torch.tensor(1.0), torch.tensor(True)])
def test_non_integers_are_refused_by_name(value):
    assert not is_int(value)
    with pytest.raises(InvalidArgument, match=r"^num_pages: must be an int"):
        check_int("num_pages", value)


def test_check_int_bounds():
    assert check_int("n", np.int32(4), minimum=1) == 4
    with pytest.raises(InvalidArgument, match=r"n: must be >= 1 \(got 0\)"):
        check_int("n", 0, minimum=1)
    with pytest.raises(InvalidArgument, match="page_size: must be an int"):
        check_page_size(True)
    with pytest.raises(InvalidArgument, match="page_size: must be >= 1"):
        check_page_size(0)


@pytest.mark.parametrize("ids, expected", [
    ([1, 2, 3], [1, 2, 3]), ((4, 5), [4, 5]), ([], []), ([np.int64(7)], [7]),
    (torch.tensor([9, 8], dtype=torch.int32), [9, 8]),
])
def test_token_ids_accepted(ids, expected):
    got = check_token_ids("req.input_ids", ids)
    assert got == expected and all(type(t) is int for t in got)


@pytest.mark.parametrize("ids, where", [
    ("123", "req.input_ids"), ("abc", "req.input_ids"), ([1.5, 2.7], r"req.input_ids\[0\]"),
    ([1, True], r"req.input_ids\[1\]"), ([[1, 2]], r"req.input_ids\[0\]"), (5, "req.input_ids"),
    (torch.tensor([1.0]), "req.input_ids"), (torch.tensor([[1, 2]]), "req.input_ids"),
])
def test_token_ids_refused_by_name(ids, where):
    with pytest.raises(InvalidArgument, match=rf"^{where}: must"):
        check_token_ids("req.input_ids", ids)


def test_int_vector():
    t = torch.arange(3)
    assert check_int_vector("x", t) is t
    for bad in ([1, 2], torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2)):
        with pytest.raises(InvalidArgument, match=r"^x: must"):
            check_int_vector("x", bad)


@pytest.mark.parametrize("error", [
    InvalidArgument("seq_lens[3]", "seq_lens >= prefix_lens", "got seq 2 < pre 5"),
    InvalidArgument("page_size", "a power of two"),
    OutOfPages(7, 2, "decode step"),
    IntegrityError("page 4 is owned twice", row=3),
    CacheMisuse("unlock by a non-holder"),
    SimIntegrityError(12, 5, "page 9 leaked", row=2),
])
def test_errors_travel_through_pickle(error):
    """A checker's child process sends errors back pickled: they arrive whole, fields and all."""
    import pickle

    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)


def test_check_empty_list_takes_none_or_an_empty_list_only():
    from kvlab.base.args import check_empty_list

    mine: list = []
    assert check_empty_list("into", None) is None and check_empty_list("into", mine) is mine
    for bad, got in (([1], "a list of 1"), ((), "tuple"), ("x", "str")):
        with pytest.raises(InvalidArgument, match=got) as err:
            check_empty_list("into", bad)
        assert err.value.argument == "into"
