"""The allocator under adversarial input and failure: lengths near 2**63 whose sums would wrap,
absurd token counts, bools and ragged host lists, a pending refusal that must come first and
counters that must not count a refused call, a kernel launch that fails or is interrupted.

The overflow cases run in a child process: before the range checks, one of them corrupted the
free list and the next allocation crashed the interpreter (a segfault must fail a test, not
end the run).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from faults import Interrupted, failing

import kvlab
from kvlab import InvalidArgument, OutOfPages, PagedTokenAllocator
from kvlab.alloc import token_allocator
from kvlab.alloc.fast_alloc import alloc_extend_fast, extend_needs_from_host
from kvlab.alloc import fast_alloc_kernels as K

BIG = 1 << 63


def t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=kvlab.DEVICE)


# --- overflow: each length keeps the rules, the sums would wrap int64 (in a child process) ------

_PRELUDE = """
import numpy as np, torch, kvlab
from kvlab import InvalidArgument, OutOfPages, PagedTokenAllocator, token_allocator
from kvlab.alloc.fast_alloc import alloc_extend_fast
BIG = 1 << 63
def t(v):
    return torch.tensor(v, dtype=torch.int64, device=kvlab.DEVICE)
def host_forms(v):
    # every form of host lengths (small lists: Python; arrays: NumPy; int64 CPU tensors: C)
    return [list(v), np.array(v, dtype=np.int64), torch.tensor(v, dtype=torch.int64)]
def refused(alloc, call, error):
    before = alloc.state()
    try:
        call()
    except error as e:
        alloc.check_device_errors()
        assert alloc.state().equals(before), "a refused call changed the allocator"
        return e
    raise AssertionError(f"not refused: {call}")
def still_works(alloc):
    # the allocator hands out its next free page, and the free list holds only free pages
    free = alloc.free_pages.tolist()
    out = alloc.alloc_extend(t([0]), t([1]), t([-1]), 1).tolist()
    assert out == [free[0] * alloc.page_size], (out, free)
    assert sorted(alloc.free_pages.tolist()) == sorted(free[1:])
    assert all(0 <= p < alloc.num_pages for p in free)
"""


def run_child(code: str) -> None:
    """Run ``code`` in a fresh interpreter; a crash (a signal) or a failed assert fails the test."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    out = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=600, env=env)
    why = f"killed by signal {-out.returncode}" if out.returncode < 0 else f"exit status {out.returncode}"
    assert out.returncode == 0, f"the child process failed ({why}):\n{out.stderr[-4000:]}"


def test_lengths_near_2_63_that_fit_get_the_right_slots():
    """pre = 2**63 - 16, seq = 2**63 - 15 at P = 16: one token on one new page. Before, ceil(seq / P)
    wrapped: the head went negative, free_pages listed held pages, the next call crashed."""
    run_child("""
    for pre, seq in zip(host_forms([BIG - 16]), host_forms([BIG - 15])):
        for host in (True, False):
            alloc = PagedTokenAllocator(16, 16)
            alloc.alloc_extend(t([0]), t([16]), t([-1]), 16)          # page 0: slots 0..15
            kw = dict(prefix_lens_cpu=pre, seq_lens_cpu=seq) if host else {}
            out = alloc.alloc_extend(t([BIG - 16]), t([BIG - 15]), t([15]), 1, **kw)
            alloc.check_device_errors()
            assert out.tolist() == [16], (type(pre), host, out)
            assert alloc.free_pages.tolist() == list(range(2, 16))
            still_works(alloc)
    # two requests on the last partial pages of positions near 2**63, without host lengths
    alloc = PagedTokenAllocator(16, 4)
    alloc.alloc_extend(t([0, 0]), t([4, 4]), t([-1, -1]), 8)           # pages 0 and 1
    out = alloc.alloc_extend(t([BIG - 4] * 2), t([BIG - 3] * 2), t([3, 7]), 2)
    assert out.tolist() == [8, 12], out                                  # pages 2 and 3, not slot 0
    still_works(alloc)
    # the bare fast calls, every mode
    free = t([5, 6, 7])
    for kw in ({}, dict(extend_num_tokens=2), dict(extend_num_tokens=2, num_new_pages=2),
               dict(prefix_lens_cpu=[BIG - 4] * 2, seq_lens_cpu=[BIG - 3] * 2)):
        res = alloc_extend_fast(t([BIG - 4] * 2), t([BIG - 3] * 2), t([3, 7]), free, 4, **kw)
        assert res.out_indices.tolist() == [20, 24] and res.num_new_pages == 2, (kw, res)
    """)


def test_sums_that_wrap_int64_are_refused_with_the_allocator_unchanged():
    """Four requests of 2**62 tokens at P = 1 sum to 2**64: wrapped, 0 tokens (accepted before)."""
    run_child("""
    n = 4
    pre, seq, last = [0] * n, [1 << 62] * n, [-1] * n
    for P in (1, 16):
        alloc = PagedTokenAllocator(8, P)
        alloc.alloc_extend(t([0]), t([1]), t([-1]), 1)
        for form in host_forms(seq):
            for n_tokens, error in ((0, InvalidArgument), (5, InvalidArgument), (1 << 64, OutOfPages)):
                kw = dict(prefix_lens_cpu=[0] * n, seq_lens_cpu=form)
                for call_kw in (kw, {}):
                    e = refused(alloc, lambda: alloc.alloc_extend(t(pre), t(seq), t(last), n_tokens, **call_kw),
                                error)
                    if error is InvalidArgument:
                        assert e.argument == "extend_num_tokens", e
        # the last request's total wraps to exactly the count the caller gives
        seq5 = [1 << 62] * 3 + [(1 << 62) + 5]
        for kw in (dict(prefix_lens_cpu=[0] * n, seq_lens_cpu=seq5), {}):
            e = refused(alloc, lambda: alloc.alloc_extend(t(pre), t(seq5), t(last), 5, **kw), InvalidArgument)
            assert e.argument == "extend_num_tokens", e
        # pages that wrap: 2**62 pages per request at P = 2
        alloc2 = PagedTokenAllocator(8, 2)
        seq2 = [BIG - 1] * 3
        for kw in (dict(prefix_lens_cpu=[0] * 3, seq_lens_cpu=seq2), {}):
            refused(alloc2, lambda: alloc2.alloc_extend(t([0] * 3), t(seq2), t([-1] * 3), 3 * (BIG - 1), **kw),
                    OutOfPages)
        still_works(alloc)
        still_works(alloc2)
    # the bare call without counts: the kernel refuses (no slot handed out)
    try:
        alloc_extend_fast(t(pre), t(seq), t(last), t([0, 1]), 1)
    except (InvalidArgument, OutOfPages):
        pass
    else:
        raise AssertionError("a batch of 2**64 tokens was accepted")
    """)


def test_host_counts_are_exact_at_any_int64_length():
    """The counts of every host path (Python, NumPy, C) equal exact integer arithmetic, even
    where an int64 sum would wrap; the checksums wrap as the kernels' do."""
    from kvlab.alloc import host_checks as alloc_checks

    rng = np.random.default_rng(0)
    P_list = (1, 2, 16, 1024)
    for bs in (1, 3, 40, 300):
        for _ in range(20):
            scale = int(rng.integers(0, 63))
            pre = [int(x) for x in rng.integers(0, (1 << scale) + 1, bs)]
            seq = [min(BIG - 1, p + int(x)) for p, x in zip(pre, rng.integers(0, (1 << scale) + 1, bs))]
            if rng.random() < 0.3:
                seq[-1] = BIG - 1
            for P in P_list:
                ceil = lambda x: -(-x // P)  # noqa: E731
                want = (sum(seq) - sum(pre), sum(ceil(s) - ceil(p) for p, s in zip(pre, seq)))
                for form in (list, lambda v: np.array(v, dtype=np.int64), lambda v: torch.tensor(v)):
                    got = alloc_checks.extend_counts(form(pre), form(seq), P, bs)
                    assert (got.tokens, got.pages) == want, (bs, P, form)
                    assert tuple(got) == tuple(alloc_checks.extend_counts(pre, seq, P, bs))


# --- absurd counts without host lengths ---------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [1 << 40, 1 << 62, BIG - 1, 1 << 64])
def test_an_absurd_token_count_is_refused_before_any_allocation(n_tokens):
    """Without host lengths the count alone sizes the output: one that no free list of this size
    could hold surfaced torch's allocation error. Now the kernels' check pass (which writes
    nothing) says why, or, at 2**50 tokens and more, it is out of pages outright."""
    alloc = PagedTokenAllocator(8, 4)
    before = alloc.state()
    free = t([0, 1])
    calls = [lambda: alloc.alloc_extend(t([0]), t([4]), t([-1]), n_tokens),        # lengths sum to 4
             lambda: alloc_extend_fast(t([0]), t([4]), t([-1]), free, 4, extend_num_tokens=n_tokens)]
    if n_tokens < BIG:                                                          # lengths sum to it
        calls += [lambda: alloc.alloc_extend(t([0]), t([n_tokens]), t([-1]), n_tokens),
                  lambda: alloc_extend_fast(t([0]), t([n_tokens]), t([-1]), free, 4, extend_num_tokens=n_tokens)]
    for i, call in enumerate(calls):
        with pytest.raises((InvalidArgument, OutOfPages)) as e:
            call()
        if n_tokens >= 1 << 50 or i >= 2:
            assert isinstance(e.value, OutOfPages) and e.value.needed >= n_tokens // 4 - 1
        else:
            assert e.value.argument == "extend_num_tokens" and "sum to 4" in str(e.value)
        alloc.check_device_errors()
        assert alloc.state().equals(before)


# --- host lists: bools and ragged lists are refused ----------------------------------------------


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("where, bad", [("prefix_lens_cpu", [False, 0]), ("prefix_lens_cpu", [np.bool_(False), 0]),
                                        ("seq_lens_cpu", [True, 7]), ("seq_lens_cpu", [np.True_, 7])])
def test_bools_inside_host_lists_are_refused(where, bad, long):
    pre, seq = [0, 0], [1, 7]
    if long:  # (past the small-batch path: the NumPy path judges)
        bad = (pre if where == "prefix_lens_cpu" else seq) * 29 + bad
        pre, seq = pre * 30, seq * 30
    lens = dict(prefix_lens_cpu=pre, seq_lens_cpu=seq)
    lens[where] = bad
    alloc = PagedTokenAllocator(64, 4)
    before = alloc.state()
    bs = len(pre)
    with pytest.raises(InvalidArgument) as e:
        alloc.alloc_extend(t([0] * bs), t(seq), t([-1] * bs), sum(seq), **lens)
    assert e.value.argument.startswith(where) and "bool" in str(e.value)
    assert alloc.state().equals(before)
    with pytest.raises(InvalidArgument, match=where):
        extend_needs_from_host(lens["prefix_lens_cpu"], lens["seq_lens_cpu"], 4)
    if where == "seq_lens_cpu":
        with pytest.raises(InvalidArgument, match="bool"):
            alloc.alloc_decode(t(seq), t([-1] * bs), seq_lens_cpu=bad)


@pytest.mark.parametrize("ragged", [[[0], [6, 1]], [0, [6]], [[0, 1], 2]])
def test_a_ragged_host_list_is_an_invalid_argument(ragged):
    alloc = PagedTokenAllocator(8, 4)
    with pytest.raises(InvalidArgument, match="prefix_lens_cpu"):
        alloc.alloc_extend(t([0, 0]), t([6, 1]), t([-1, -1]), 7, prefix_lens_cpu=ragged, seq_lens_cpu=[6, 1])
    with pytest.raises(InvalidArgument, match="seq_lens_cpu"):
        alloc.alloc_decode(t([6, 1]), t([-1, -1]), seq_lens_cpu=ragged)


# --- deferred refusals: counters count only calls that stand, a pending refusal comes first -------


def _deferred(num_pages=16):
    """As on a GPU (no read of the device after a call with host lengths): one request of 3
    tokens on page 0."""
    alloc = PagedTokenAllocator(num_pages, 4, eager_errors=False)
    alloc.alloc_extend(t([0]), t([3]), t([-1]), 3, prefix_lens_cpu=[0], seq_lens_cpu=[3])
    alloc.check_device_errors()
    return alloc


def _refused_on_device(alloc, pages=10):
    """A call the host accepts and the kernel refuses: last_loc on page 5, which is free."""
    n = 4 * pages
    out = alloc.alloc_extend(t([4]), t([4 + n]), t([23]), n, prefix_lens_cpu=[4], seq_lens_cpu=[4 + n])
    assert out.tolist() == [-1] * n


def test_counters_do_not_count_a_call_the_kernel_refused():
    alloc = _deferred()
    before = alloc.state()
    _refused_on_device(alloc)
    assert alloc.num_free_pages == 15 and alloc.available_size() == 60
    assert alloc.free_pages.tolist() == before.free_pages.tolist() and alloc.state().equals(before)
    with pytest.raises(InvalidArgument, match="last_loc"):  # still pending: raised by the next reader
        alloc.check_device_errors()


@pytest.mark.parametrize("later", ["fits_only_without_the_refused_call", "bad_argument", "out_of_pages"])
def test_a_pending_refusal_is_raised_before_a_later_calls_own_error(later):
    alloc = _deferred()
    before = alloc.state()
    _refused_on_device(alloc)
    calls = {
        # 12 pages: free if the refused call took none (15), not if it had taken 10 (5)
        "fits_only_without_the_refused_call": lambda: alloc.alloc_extend(
            t([0]), t([48]), t([-1]), 48, prefix_lens_cpu=[0], seq_lens_cpu=[48]),
        "bad_argument": lambda: alloc.alloc_extend(t([0]), t([4]), t([-1]), 5, prefix_lens_cpu=[0],
                                                   seq_lens_cpu=[4]),
        "out_of_pages": lambda: alloc.alloc_decode(t([5] * 16), t([3] * 16), seq_lens_cpu=[5] * 16),
    }
    with pytest.raises(InvalidArgument) as e:
        calls[later]()
    assert e.value.argument == "last_loc[0]", e.value
    assert "earlier alloc_extend call" in str(e.value)
    assert alloc.state().equals(before)
    alloc.check_device_errors()  # nothing pending any more


def test_a_refusal_raised_by_its_own_call_does_not_say_earlier():
    alloc = PagedTokenAllocator(16, 4, eager_errors=True)
    alloc.alloc_extend(t([0]), t([3]), t([-1]), 3, prefix_lens_cpu=[0], seq_lens_cpu=[3])
    with pytest.raises(InvalidArgument) as e:
        _refused_on_device(alloc)
    assert e.value.argument == "last_loc[0]" and "earlier" not in str(e.value)


def test_a_deferred_refusal_names_the_call_it_is_for():
    alloc = _deferred()           # call 1
    alloc.alloc_decode(t([4]), t([2]), seq_lens_cpu=[4])  # call 2
    _refused_on_device(alloc)     # call 3
    with pytest.raises(InvalidArgument, match=r"earlier alloc_extend call \(call 3 of this allocator"):
        alloc.alloc_decode(t([5]), t([3]))


# --- a kernel launch that fails or is interrupted leaves no trace ---------------------------------


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("host", [False, True], ids=["no_host", "host_lengths"])
@pytest.mark.parametrize("impl", ["fast", "teaching"])
def test_an_interrupted_launch_leaves_the_allocator_as_it_was(monkeypatch, impl, host, when):
    alloc = PagedTokenAllocator(8, 4, impl=impl, eager_errors=False)
    alloc.alloc_extend(t([0]), t([3]), t([-1]), 3)
    before, page_free = alloc.state(), alloc._page_free.clone()
    for name in ("launch_extend", "launch_decode", "launch_extend_check", "launch_extend_fill"):
        monkeypatch.setattr(K, name, failing(getattr(K, name), 0, after=when == "after", error=Interrupted))
    monkeypatch.setattr(token_allocator, "launch_ready", lambda device: None)  # (a GPU's direct launch)
    kw = dict(prefix_lens_cpu=[3, 0], seq_lens_cpu=[9, 5]) if host else {}
    with pytest.raises(Interrupted):
        alloc.alloc_extend(t([3, 0]), t([9, 5]), t([2, -1]), 11, **kw)
    with pytest.raises(Interrupted):
        alloc.alloc_decode(t([4]), t([2]), **(dict(seq_lens_cpu=[4]) if host else {}))
    monkeypatch.undo()
    alloc.check_device_errors()  # nothing pending: the interrupted calls recorded nothing
    assert alloc.state().equals(before) and torch.equal(alloc._page_free, page_free)
    # and the allocator goes on as if they had never been made
    fresh = PagedTokenAllocator(8, 4, impl=impl)
    fresh.alloc_extend(t([0]), t([3]), t([-1]), 3)
    outs = [a.alloc_extend(t([3, 0]), t([9, 5]), t([2, -1]), 11).tolist() for a in (alloc, fresh)]
    assert outs[0] == outs[1]
