"""The fast allocation kernels (chapter 09) against the plain-Python references and the
teaching kernels: random batches, page sizes 1/16/64, empty extends, one and many requests,
every calling mode; out-of-pages and bad input refused before any launch (host rules) or by
the kernel before it writes anything (device rules)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.base import runtime
from kvlab.bench import paths as X
from kvlab.bench.cases import make_decode_batch, make_extend_batch
from kvlab.base.errors import InvalidArgument, OutOfPages
from kvlab.alloc import host_checks as alloc_checks
from kvlab.alloc import fast_alloc_kernels as fast_alloc
from kvlab.alloc.fast_alloc import alloc_decode_fast, alloc_extend_fast, decode_needs_from_host, extend_needs_from_host
from kvlab.course.reference.alloc_ref import alloc_decode_ref, alloc_extend_ref

PAGE_SIZES = [1, 16, 64]
EXTEND_MODES = ["counts", "host_lens", "sync"]


def _t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=runtime.DEVICE)


def _extend(pre, seq, last, free, P, mode, dtype=torch.int64):
    kw = {}
    if mode == "counts":
        ref = alloc_extend_ref(pre, seq, last, free, P)
        kw = dict(extend_num_tokens=ref.num_extend_tokens, num_new_pages=ref.num_new_pages)
    elif mode == "host_lens":
        kw = dict(prefix_lens_cpu=pre, seq_lens_cpu=seq)
    return alloc_extend_fast(_t(pre, dtype), _t(seq, dtype), _t(last), _t(free), P, **kw)


@st.composite
def extend_batches(draw, max_bs=12):
    P = draw(st.sampled_from(PAGE_SIZES))
    bs = draw(st.integers(1, max_bs))
    pre = [draw(st.integers(0, 3 * P + 5)) for _ in range(bs)]
    ext = [draw(st.one_of(st.just(0), st.just(P), st.integers(0, 4 * P + 7))) for _ in range(bs)]
    seq = [p + e for p, e in zip(pre, ext)]
    # each request's prefix on its own pages, then the free pages (shuffled)
    last, page = [], 0
    for p in pre:
        n = -(-p // P)
        page += n
        last.append((page - 1) * P + (p - 1) % P if p else -1)
    need = sum(-(-s // P) - -(-p // P) for p, s in zip(pre, seq))
    free = list(range(page, page + need + draw(st.integers(0, 5))))
    random.Random(draw(st.integers(0, 2**16))).shuffle(free)
    return pre, seq, last, free, P


@given(extend_batches(), st.sampled_from(EXTEND_MODES), st.sampled_from([torch.int32, torch.int64]),
       st.sampled_from([0, fast_alloc.FUSED_MAX_BATCH]))
def test_extend_equals_reference(batch, mode, dtype, fused_max):
    pre, seq, last, free, P = batch
    ref = alloc_extend_ref(pre, seq, last, free, P)
    saved = fast_alloc.FUSED_MAX_BATCH
    fast_alloc.FUSED_MAX_BATCH = fused_max  # 0: always the two-launch path (scan, then fill)
    try:
        got = _extend(pre, seq, last, free, P, mode, dtype)
    finally:
        fast_alloc.FUSED_MAX_BATCH = saved
    assert got.out_indices.dtype == torch.int64
    assert got.out_indices.tolist() == ref.out_indices
    assert got.num_new_pages == ref.num_new_pages


@given(extend_batches(max_bs=6))
def test_extend_equals_teaching_kernel(batch):
    pre, seq, last, free, P = batch
    if sum(s - p for p, s in zip(pre, seq)) == 0:
        return  # the teaching kernel needs at least one lane of work
    b = make_extend_batch(len(pre), 1, P)  # a shell; fill in this batch
    b.prefix_lens, b.seq_lens, b.last_loc, b.free_pages = _t(pre), _t(seq), _t(last), _t(free)
    b.extend_num_tokens = sum(s - p for p, s in zip(pre, seq))
    b.num_new_pages = alloc_extend_ref(pre, seq, last, free, P).num_new_pages
    t_out, t_pages = X.teaching_extend(b)
    f_out, f_pages = X.fast_extend(b)
    assert torch.equal(t_out, f_out) and t_pages == f_pages


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_extend_edge_cases(P):
    cases = {
        "one request, empty prefix, page-aligned": ([0], [2 * P]),
        "one request, unaligned both ends": ([P // 2 + 1], [3 * P + 1]),
        "stays inside the old page": ([1], [min(P, 2)]),
        "all extends empty": ([5, 0, 7], [5, 0, 7]),
        "empty extends between others": ([0, 3, P, 2], [P + 1, 3, 2 * P, 2 * P + 3]),
        "prefix ends on a page boundary": ([P, 2 * P], [P + 1, 4 * P]),
    }
    for name, (pre, seq) in cases.items():
        last, page = [], 0
        for p in pre:
            page += -(-p // P)
            last.append((page - 1) * P + (p - 1) % P if p else -1)
        free = list(range(page + 40, page, -1))
        ref = alloc_extend_ref(pre, seq, last, free, P)
        for mode in EXTEND_MODES:
            got = _extend(pre, seq, last, free, P, mode)
            assert got.out_indices.tolist() == ref.out_indices, (name, mode)
            assert got.num_new_pages == ref.num_new_pages, (name, mode)


def test_extend_many_requests_many_blocks():
    # more requests than one scan block, more tokens than one fill block
    bs = fast_alloc.BATCH_BLOCK + 37
    rng = random.Random(3)
    P = 16
    lens = [rng.choice([0, 1, 2, 17]) for _ in range(bs)]
    lens[5] = fast_alloc.EXTEND_BLOCK + 300  # one long request spans several fill programs
    b = make_extend_batch(bs, 1, P, extend_lens=lens, seed=1)
    ref = alloc_extend_ref(b.prefix_cpu, b.seq_cpu, b.last_loc.tolist(), b.free_pages.tolist(), P)
    for fn in (X.fast_extend, X.fast_extend_host_lens, X.fast_extend_sync, X.torch_extend):
        out, pages = fn(b)
        assert out.tolist() == ref.out_indices, fn.__name__
        assert pages == ref.num_new_pages


def test_extend_one_launch_path_with_several_programs():
    # bs <= FUSED_MAX_BATCH with counts known: each program scans the batch into its own row
    P = 16
    b = make_extend_batch(5, 1, P, extend_lens=[1500, 0, 700, 1, 900], seed=4)
    ref = alloc_extend_ref(b.prefix_cpu, b.seq_cpu, b.last_loc.tolist(), b.free_pages.tolist(), P)
    out, pages = X.fast_extend(b)
    assert out.tolist() == ref.out_indices and pages == ref.num_new_pages


def test_worked_example_from_the_source_design():
    # P = 64: A 70 -> 190, B 128 -> 260; out = [A 58 | A 62 | B 128 | B 4], 4 new pages
    P, free = 64, [7, 3, 9, 5, 11]
    last = [1 * P + 5, 2 * P + 63]  # A's prefix ends at offset 5 of page 1, B's at the end of page 2
    got = _extend([70, 128], [190, 260], last, free, P, "sync")
    out = got.out_indices.tolist()
    assert got.num_new_pages == 4 and len(out) == 252
    assert out[:58] == list(range(last[0] + 1, last[0] + 59))
    assert out[58:120] == [7 * P + k for k in range(62)]
    assert out[120:248] == [3 * P + k for k in range(64)] + [9 * P + k for k in range(64)]
    assert out[248:] == [5 * P + k for k in range(4)]


class _Spy:
    """Stands in for a launcher: records launches, or fails the test on one."""

    def __init__(self, launcher=None):
        self.launcher, self.grids = launcher, []

    def __call__(self, grid, args, key=()):
        self.grids.append(grid)
        if self.launcher is None:
            raise AssertionError("a kernel was launched although the host could refuse first")
        self.launcher(grid, args, key)


@pytest.mark.parametrize("mode", ["counts", "host_lens", "sync", "sync_no_tokens"])
def test_extend_out_of_pages_is_refused_before_free_pages_is_read(mode, monkeypatch):
    """With host counts: before any launch. Without: the check+scan refuses on the device and
    the fill never reads free_pages (one launch fused: its programs refuse before reading)."""
    P = 16
    pre, seq, last = [0, 3], [40, 50], [-1, 2]
    need = alloc_extend_ref(pre, seq, last, list(range(100)), P).num_new_pages
    free = _t(list(range(need - 1)))
    before = free.clone()
    spies = {name: _Spy(getattr(fast_alloc, name) if mode.startswith("sync") and name != "_FILL" else None)
             for name in ("_FUSED", "_SCAN", "_FILL")}
    for name, spy in spies.items():
        monkeypatch.setattr(fast_alloc, name, spy)
    kw = {"counts": dict(extend_num_tokens=87, num_new_pages=need),
          "host_lens": dict(prefix_lens_cpu=pre, seq_lens_cpu=seq), "sync": dict(extend_num_tokens=87),
          "sync_no_tokens": {}}[mode]
    with pytest.raises(OutOfPages) as e:
        alloc_extend_fast(_t(pre), _t(seq), _t(last), free, P, **kw)
    assert e.value.needed == need and e.value.free == need - 1
    assert torch.equal(free, before) and spies["_FILL"].grids == []
    launched = sum(len(spy.grids) for spy in spies.values())
    assert launched == {"counts": 0, "host_lens": 0, "sync": 1, "sync_no_tokens": 1}[mode]


def test_extend_bad_input_is_refused_by_name():
    P = 4
    with pytest.raises(InvalidArgument, match="seq_lens_cpu\\[1\\]"):
        alloc_extend_fast(_t([0, 5]), _t([3, 4]), _t([-1, 4]), _t([0, 1, 2]), P,
                          prefix_lens_cpu=[0, 5], seq_lens_cpu=[3, 4])
    with pytest.raises(InvalidArgument, match="extend_num_tokens"):
        alloc_extend_fast(_t([0]), _t([3]), _t([-1]), _t([0, 1]), P, extend_num_tokens=4,
                          prefix_lens_cpu=[0], seq_lens_cpu=[3])
    with pytest.raises(InvalidArgument, match="seq_lens"):
        alloc_extend_fast(_t([0, 5]), _t([3]), _t([-1, 4]), _t([0, 1]), P)
    with pytest.raises(InvalidArgument, match="free_pages"):
        alloc_extend_fast(_t([0]), _t([3]), _t([-1]), _t([[0, 1]]), P)
    with pytest.raises(InvalidArgument, match="page_size"):
        alloc_extend_fast(_t([0]), _t([3]), _t([-1]), _t([0, 1]), 0)
    with pytest.raises(InvalidArgument, match="seq_lens\\[1\\]: seq_lens >= prefix_lens"):  # device-only mode
        alloc_extend_fast(_t([0, 9]), _t([3, 4]), _t([-1, 0]), _t(list(range(9))), P)
    with pytest.raises(InvalidArgument, match="last_loc\\[1\\]: \\(last_loc \\+ 1\\)"):  # found by the kernel
        alloc_extend_fast(_t([0, 5]), _t([3, 6]), _t([-1, 3]), _t(list(range(9))), P, extend_num_tokens=4)


def test_a_bare_call_that_cannot_sync_returns_minus_one_for_what_the_kernel_refuses():
    """With the counts given nothing waits for the GPU: a batch the kernel refuses (here a
    last_loc off its page offset, and a wrong page count) comes back as -1 slots."""
    P = 4
    got = alloc_extend_fast(_t([0, 5]), _t([3, 6]), _t([-1, 3]), _t(list(range(9))), P,
                            extend_num_tokens=4, num_new_pages=1)
    assert got.out_indices.tolist() == [-1] * 4
    got = alloc_extend_fast(_t([0]), _t([3]), _t([-1]), _t(list(range(9))), P,
                            extend_num_tokens=3, num_new_pages=2)  # the lengths need 1 page
    assert got.out_indices.tolist() == [-1] * 3
    got = alloc_decode_fast(_t([6, 1]), _t([4, -1]), _t([7, 8]), P, num_new_pages=2)  # needs 1
    assert got.out_indices.tolist() == [-1, -1]


def test_extend_empty_batch():
    got = alloc_extend_fast(_t([]), _t([]), _t([]), _t([1, 2]), 16, extend_num_tokens=0)
    assert got.out_indices.numel() == 0 and got.num_new_pages == 0


# --- decode ---------------------------------------------------------------------------------


@st.composite
def decode_batches(draw, max_bs=40):
    P = draw(st.sampled_from(PAGE_SIZES))
    bs = draw(st.integers(1, max_bs))
    seq = [draw(st.one_of(st.integers(1, 4 * P + 3), st.just(P + 1), st.just(1))) for _ in range(bs)]
    last, page = [], 0
    for s in seq:
        page += -(-(s - 1) // P)
        last.append((page - 1) * P + (s - 2) % P if s > 1 else -1)
    need = sum(1 for s in seq if (s - 1) % P == 0)
    free = list(range(page, page + need + draw(st.integers(0, 3))))
    random.Random(draw(st.integers(0, 2**16))).shuffle(free)
    return seq, last, free, P


@given(decode_batches(), st.sampled_from(["counts", "host_lens", "sync"]))
def test_decode_equals_reference(batch, mode):
    seq, last, free, P = batch
    ref = alloc_decode_ref(seq, last, free, P)
    kw = {"counts": dict(num_new_pages=ref.num_new_pages), "host_lens": dict(seq_lens_cpu=seq),
          "sync": {}}[mode]
    got = alloc_decode_fast(_t(seq), _t(last), _t(free), P, **kw)
    assert got.out_indices.tolist() == ref.out_indices
    assert got.num_new_pages == ref.num_new_pages


@given(decode_batches(max_bs=12))
def test_decode_equals_teaching_kernel(batch):
    seq, last, free, P = batch
    b = make_decode_batch(len(seq), P)
    b.seq_lens, b.last_loc, b.free_pages = _t(seq), _t(last), _t(free)
    b.num_new_pages = sum(1 for s in seq if (s - 1) % P == 0)
    t_out, t_pages = X.teaching_decode(b)
    f_out, f_pages = X.fast_decode(b)
    assert torch.equal(t_out, f_out) and t_pages == f_pages


def test_decode_many_requests_many_blocks():
    b = make_decode_batch(fast_alloc.BATCH_BLOCK * 2 + 5, 4, seed=2)
    ref = alloc_decode_ref(b.seq_cpu, b.last_loc.tolist(), b.free_pages.tolist(), 4)
    for fn in (X.fast_decode, X.fast_decode_sync, X.torch_decode):
        out, pages = fn(b)
        assert out.tolist() == ref.out_indices and pages == ref.num_new_pages, fn.__name__


@pytest.mark.parametrize("mode", ["counts", "host_lens", "sync"])
def test_decode_out_of_pages_raises_before_any_launch(mode, monkeypatch):
    P = 4
    seq, last = [1, 5, 9, 3], [-1, 3, 7, 13]
    spy = _Spy(fast_alloc._DECODE if mode == "sync" else None)
    monkeypatch.setattr(fast_alloc, "_DECODE", spy)
    free = _t([20, 21])
    kw = {"counts": dict(num_new_pages=3), "host_lens": dict(seq_lens_cpu=seq), "sync": {}}[mode]
    out = torch.full((4,), 99, dtype=torch.int64, device=runtime.DEVICE)
    with pytest.raises(OutOfPages):
        alloc_decode_fast(_t(seq), _t(last), free, P, out=out, **kw)
    assert len(spy.grids) == (1 if mode == "sync" else 0) and free.tolist() == [20, 21]
    assert out.tolist() == ([-1] * 4 if mode == "sync" else [99] * 4)  # refused: nothing handed out


def test_decode_bad_input_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="seq_lens_cpu\\[1\\]"):
        alloc_decode_fast(_t([3, 0]), _t([1, -1]), _t([0]), 4, seq_lens_cpu=[3, 0])
    with pytest.raises(InvalidArgument, match="seq_lens\\[1\\]: seq_lens >= 1"):
        alloc_decode_fast(_t([3, 0]), _t([1, -1]), _t([0]), 4)
    with pytest.raises(InvalidArgument, match="num_new_pages"):
        alloc_decode_fast(_t([1, 2]), _t([-1, 4]), _t([0, 1]), 4, num_new_pages=2, seq_lens_cpu=[1, 2])


# --- the vectorised-torch path the benchmark compares -----------------------------------------


@given(extend_batches())
def test_torch_extend_equals_reference(batch):
    pre, seq, last, free, P = batch
    ref = alloc_extend_ref(pre, seq, last, free, P)
    out = X.alloc_extend_torch(_t(pre), _t(seq), _t(last), _t(free), P, ref.num_extend_tokens,
                               ref.num_new_pages)
    assert out.tolist() == ref.out_indices


# --- one compilation for every shape (compiled Triton only) ---------------------------------


@pytest.mark.gpu
def test_one_compilation_serves_every_shape():
    """After one compile, a new batch size, token count or sliced free list is a plain launch
    (well under a millisecond on a GPU); a recompile would take hundreds of milliseconds."""
    import time

    P = 16
    # compile each variant once: one launch (bs <= FUSED_MAX_BATCH), scan + fill (larger batches)
    X.fast_extend(make_extend_batch(2, 8, P, seed=99))
    X.fast_extend(make_extend_batch(fast_alloc.FUSED_MAX_BATCH + 1, 2, P, seed=99))
    shapes = [(1, 5), (3, 1000), (64, 17), (7, 4096), (200, 33), (1, 70000), (1500, 3)]
    for i, (bs, mean) in enumerate(shapes):
        b = make_extend_batch(bs, mean, P, seed=i)
        b.free_pages = b.free_pages[i % 3:]  # a sliced free list: an unaligned pointer
        ref = alloc_extend_ref(b.prefix_cpu, b.seq_cpu, b.last_loc.tolist(), b.free_pages.tolist(), P)
        b.num_new_pages = ref.num_new_pages
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, _ = X.fast_extend(b)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        assert ms < 50, f"first call on shape bs={bs}, T={b.extend_num_tokens} took {ms:.1f} ms (recompiled?)"
        assert out.tolist() == ref.out_indices


def test_kernels_are_exported():
    assert kvlab.alloc.fast_alloc_kernels.extend_fill_kernel is fast_alloc.extend_fill_kernel
    assert kvlab.alloc_extend_fast is alloc_extend_fast


# --- PagedTokenAllocator(impl="fast"), the default --------------------------------------------


def test_allocator_defaults_to_the_fast_path():
    assert kvlab.PagedTokenAllocator(4, 4).impl == "fast"


@given(st.sampled_from(PAGE_SIZES), st.integers(0, 2**16))
def test_allocator_fast_and_teaching_agree_step_by_step(P, seed):
    """Same batches through both impls: same slots, same free list, same ret_values."""
    rng = random.Random(seed)
    allocs = {impl: kvlab.PagedTokenAllocator(48, P, impl=impl) for impl in ("fast", "teaching")}
    lens: list[int] = []      # tokens per live request
    slots: list[list[int]] = []
    for _ in range(4):
        if lens and rng.random() < 0.4:  # one decode step for every live request
            seq = [n + 1 for n in lens]
            last = [s[-1] if s else -1 for s in slots]
            outs = {}
            for impl, a in allocs.items():
                try:
                    outs[impl] = a.alloc_decode(_t(seq), _t(last)).tolist()
                except OutOfPages:
                    outs[impl] = "oom"
            assert outs["fast"] == outs["teaching"]
            if outs["fast"] != "oom":
                lens = seq
                slots = [s + [o] for s, o in zip(slots, outs["fast"])]
        else:  # extend the live requests and add new ones
            pre = lens + [0] * rng.randint(1, 2)
            seq = [p + rng.choice([0, 1, P, rng.randint(1, 2 * P + 3)]) for p in pre]
            last = [s[-1] if s else -1 for s in slots] + [-1] * (len(pre) - len(slots))
            n = sum(s - p for p, s in zip(pre, seq))
            outs = {}
            for impl, a in allocs.items():
                try:
                    outs[impl] = a.alloc_extend(_t(pre), _t(seq), _t(last), n).tolist()
                except OutOfPages:
                    outs[impl] = "oom"
            assert outs["fast"] == outs["teaching"]
            if outs["fast"] != "oom":
                got = outs["fast"]
                new_slots, at = [], 0
                for i, (p, s) in enumerate(zip(pre, seq)):
                    mine = slots[i] if i < len(slots) else []
                    new_slots.append(mine + got[at:at + s - p])
                    at += s - p
                lens, slots = seq, new_slots
        assert allocs["fast"].free_pages.tolist() == allocs["teaching"].free_pages.tolist()
        assert allocs["fast"].ret_values.item() == allocs["teaching"].ret_values.item()


def test_allocator_fast_out_of_pages_leaves_state_unchanged():
    a = kvlab.PagedTokenAllocator(3, 16)
    before = a.state()
    with pytest.raises(OutOfPages):
        a.alloc_extend(_t([0, 0]), _t([40, 20]), _t([-1, -1]), 60)
    assert a.state().equals(before)
    with pytest.raises(OutOfPages):
        a.alloc_decode(_t([1, 1, 1, 1]), _t([-1, -1, -1, -1]))
    assert a.state().equals(before)


# --- the host wrappers: every rule checked before any launch, with little host work ------------


@pytest.fixture
def no_launch(monkeypatch):
    for launcher in ("_DECODE", "_SCAN", "_FILL", "_FUSED"):
        monkeypatch.setattr(fast_alloc, launcher, _Spy())


def test_tensor_on_another_device_is_named(no_launch):
    meta = torch.zeros(2, dtype=torch.int64, device="meta")  # a device the checks must notice
    with pytest.raises(InvalidArgument, match="last_loc.*same device as seq_lens"):
        alloc_decode_fast(_t([1, 5]), meta, _t([0, 1]), 4, num_new_pages=1)
    with pytest.raises(InvalidArgument, match="free_pages.*same device as seq_lens"):
        alloc_decode_fast(_t([1, 5]), _t([-1, 3]), meta, 4, num_new_pages=1)
    with pytest.raises(InvalidArgument, match="seq_lens.*same device as prefix_lens"):
        alloc_extend_fast(_t([0, 0]), meta, _t([-1, -1]), _t([0, 1]), 4, extend_num_tokens=2, num_new_pages=2)
    with pytest.raises(InvalidArgument, match="free_pages.*same device as prefix_lens"):
        alloc_extend_fast(_t([0, 0]), _t([1, 1]), _t([-1, -1]), meta, 4, extend_num_tokens=2, num_new_pages=2)


@pytest.mark.parametrize("bad", [torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), [0]])
def test_bad_report_is_refused_before_any_launch(bad, no_launch):
    if isinstance(bad, torch.Tensor):
        bad = bad.to(runtime.DEVICE)
    with pytest.raises(InvalidArgument, match="report"):
        alloc_decode_fast(_t([1, 5]), _t([-1, 3]), _t([0, 1]), 4, num_new_pages=1, report=bad)
    for kw in (dict(extend_num_tokens=3, num_new_pages=1), {}):  # one-launch and scan+fill modes
        with pytest.raises(InvalidArgument, match="report"):
            alloc_extend_fast(_t([0]), _t([3]), _t([-1]), _t([0, 1]), 4, report=bad, **kw)


def test_seq_lens_cpu_is_checked_once_and_fully(no_launch):
    with pytest.raises(InvalidArgument, match="seq_lens_cpu.*one entry per request"):
        alloc_decode_fast(_t([1, 5]), _t([-1, 3]), _t([0, 1]), 4, seq_lens_cpu=[1])
    with pytest.raises(InvalidArgument, match="seq_lens_cpu\\[2\\]"):
        alloc_decode_fast(_t([1, 5, 0]), _t([-1, 3, 4]), _t([0, 1]), 4, seq_lens_cpu=[1, 5, 0])
    with pytest.raises(InvalidArgument, match="prefix_lens_cpu\\[1\\]"):
        alloc_extend_fast(_t([0, -2]), _t([3, 4]), _t([-1, 0]), _t([0, 1]), 4,
                          prefix_lens_cpu=[0, -2], seq_lens_cpu=[3, 4])


@pytest.mark.parametrize("lens", [lambda v: v, lambda v: torch.tensor(v), lambda v: torch.tensor(v, dtype=torch.int32),
                                  lambda v: tuple(v), lambda v: np.array(v)])
def test_host_lengths_in_any_int_container(lens):
    """Lists and tuples of ints, CPU tensors and NumPy arrays of any integer dtype."""
    pre, seq, P = [0, 5, 17], [3, 5, 40], 16
    assert extend_needs_from_host(lens(pre), lens(seq), P) == (3 + 0 + 23, 1 + 0 + (3 - 2))
    assert decode_needs_from_host(lens([1, 17, 18, 33]), P) == 3


@pytest.mark.parametrize("bad,rule", [
    ([1.0, 2.0], "integers"), ([True, False], "not a bool"), (np.array([1.5]), "integers"),
    (torch.tensor([[1, 2]]), "1-D"), ("12", "list of ints"), (torch.tensor([1.0]), "integers"),
])
def test_host_lengths_refuse_what_is_not_ints(bad, rule):
    with pytest.raises(InvalidArgument, match=rule) as e:
        decode_needs_from_host(bad, 4)
    assert e.value.argument in ("seq_lens_cpu", "seq_lens_cpu[0]")


def test_host_lengths_on_a_device_are_refused():
    if runtime.DEVICE.type == "cpu":
        pytest.skip("needs a device other than the host")
    with pytest.raises(InvalidArgument, match="on the host"):
        decode_needs_from_host(_t([1, 2]), 4)


def test_checksum_weights_match_the_kernels():
    """A host copy equal to the device tensor is accepted; the same totals in another order
    are not (the checksum weighs each request by its position)."""
    P = 4
    pre, seq, last, free = [0, 4], [4, 8], [-1, 3], list(range(2, 9))
    ok = alloc_extend_fast(_t(pre), _t(seq), _t(last), _t(free), P, prefix_lens_cpu=pre, seq_lens_cpu=seq)
    assert ok.out_indices.tolist() == alloc_extend_ref(pre, seq, last, free, P).out_indices
    swapped = alloc_extend_fast(_t(pre), _t(seq), _t(last), _t(free), P, prefix_lens_cpu=[4, 0],
                                seq_lens_cpu=[8, 4])
    assert swapped.out_indices.tolist() == [-1] * 8
    w = alloc_checks.checksum_weights(3)
    assert len(set(w.tolist())) == 3 and w.dtype == np.int64


def test_host_path_uses_plain_int_arithmetic(monkeypatch):
    """triton.cdiv on the host costs microseconds per call; the wrappers use integer division."""
    import triton

    def boom(*args):
        raise AssertionError("triton.cdiv called on the host path")

    monkeypatch.setattr(triton, "cdiv", boom)
    P = 4
    pre, seq, last = [0, 3], [2500, 9], [-1, 2]
    need = alloc_extend_ref(pre, seq, last, list(range(2000)), P)
    free = list(range(10, 10 + need.num_new_pages))
    for kw in (dict(extend_num_tokens=need.num_extend_tokens, num_new_pages=need.num_new_pages), {}):
        got = alloc_extend_fast(_t(pre), _t(seq), _t(last), _t(free), P, **kw)
        assert got.out_indices.tolist() == alloc_extend_ref(pre, seq, last, free, P).out_indices


@pytest.mark.parametrize("name,bad", [
    ("seq_lens", [1, 5]), ("seq_lens", _t([[1, 5]])), ("seq_lens", _t([1.0, 5.0], torch.float32)),
    ("last_loc", _t([-1])), ("last_loc", _t([-1, 3], torch.float64)), ("last_loc", (-1, 3)),
    ("free_pages", _t([[0, 1]])), ("free_pages", _t([0, 1], torch.int16)),
    ("page_size", 0), ("page_size", 4.0), ("page_size", "4"),
])
def test_every_broken_rule_is_named_not_waved_through(name, bad, no_launch):
    """The wrappers accept good input with one combined test; anything it rejects must be
    explained by the check for that argument (and never reach a kernel)."""
    dec = dict(seq_lens=_t([1, 5]), last_loc=_t([-1, 3]), free_pages=_t([0, 1]), page_size=4)
    ext = dict(prefix_lens=_t([0, 4]), seq_lens=_t([1, 6]), last_loc=_t([-1, 3]), free_pages=_t([0, 1]),
               page_size=4)
    dec[name] = ext[name] = bad
    with pytest.raises(InvalidArgument, match=name):
        alloc_decode_fast(**dec, num_new_pages=1)
    with pytest.raises(InvalidArgument, match=name):
        alloc_extend_fast(**ext, extend_num_tokens=3, num_new_pages=1)
