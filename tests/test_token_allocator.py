"""PagedTokenAllocator (teaching kernels) against the plain-Python oracles, on random batches.

Every allocation is compared with :mod:`kvlab.course.reference.alloc_ref` run on a copy of
``free_pages`` taken just before; the invariants are checked on the kernel's output as well,
so a wrong reference could not hide a wrong kernel.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab import InvalidArgument, OutOfPages, PagedTokenAllocator
from kvlab.course.reference.alloc_ref import alloc_decode_ref, alloc_extend_ref, pages_needed_extend


def t(values, device=None, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device or kvlab.DEVICE)


class Batch:
    """Requests that already own their prefix pages (allocated through the allocator itself)."""

    def __init__(self, alloc: PagedTokenAllocator, prefix_lens: list[int]):
        self.alloc = alloc
        self.pre = list(prefix_lens)
        n = sum(prefix_lens)
        slots = alloc.alloc_extend(t([0] * len(prefix_lens)), t(prefix_lens),
                                   t([-1] * len(prefix_lens)), n).tolist()
        self.slots: list[list[int]] = []
        at = 0
        for p in prefix_lens:
            self.slots.append(slots[at:at + p])
            at += p

    @property
    def last_loc(self) -> list[int]:
        return [s[-1] if s else -1 for s in self.slots]

    def pages_of(self, r: int) -> set[int]:
        return {x // self.alloc.page_size for x in self.slots[r]}


def extend_and_check(batch: Batch, seq_lens: list[int]) -> None:
    """Extend every request of ``batch`` to ``seq_lens`` and check the result thoroughly."""
    alloc, P, pre = batch.alloc, batch.alloc.page_size, batch.pre
    free_before = alloc.free_pages.tolist()
    needed = pages_needed_extend(pre, seq_lens, P)
    n_tokens = sum(s - p for p, s in zip(pre, seq_lens))
    if needed > len(free_before):
        before = alloc.state()
        with pytest.raises(OutOfPages, match=f"needs {needed} new page"):
            alloc.alloc_extend(t(pre), t(seq_lens), t(batch.last_loc), n_tokens)
        assert alloc.state().equals(before)
        return
    plan = alloc_extend_ref(pre, seq_lens, batch.last_loc, free_before, P)
    out = alloc.alloc_extend(t(pre), t(seq_lens), t(batch.last_loc), n_tokens)
    got = out.tolist()

    assert out.dtype == torch.int64 and out.numel() == n_tokens
    assert got == plan.out_indices                                  # equal to the reference
    assert len(set(got)) == len(got)                                # slots unique
    assert alloc.free_pages.tolist() == free_before[plan.num_new_pages:]  # consumed exactly
    taken = set(free_before[:plan.num_new_pages])
    all_old = [batch.pages_of(r) for r in range(len(pre))]
    for r, (p, s) in enumerate(zip(pre, seq_lens)):
        mine = got[plan.output_starts[r]:plan.output_starts[r] + s - p]
        pages = [x // P for x in mine]
        others_old = set().union(*(all_old[:r] + all_old[r + 1:])) if len(pre) > 1 else set()
        assert not set(pages) & others_old                          # never another request's page
        new = [pg for pg in pages if pg not in all_old[r]]
        assert set(new) <= taken                                    # new pages came off the free list
        assert [x % P for x in mine] == [k % P for k in range(p, s)]  # offset in page == position % P
        for i, x in enumerate(mine):                                # a slot that starts a page is aligned
            if i == 0 and p % P == 0 or i > 0 and pages[i] != pages[i - 1]:
                assert x % P == 0 and pages[i] not in all_old[r]
    # new pages are not shared between requests
    owners: dict[int, int] = {}
    for i, (r, _part) in enumerate(plan.parts):
        pg = got[i] // P
        if pg in taken:
            assert owners.setdefault(pg, r) == r
    for r in range(len(pre)):
        batch.slots[r] += got[plan.output_starts[r]:plan.output_starts[r] + seq_lens[r] - pre[r]]
    batch.pre = list(seq_lens)


# --- hand-worked cases ------------------------------------------------------------------------


def test_worked_example_reproduced_by_the_kernel():
    alloc = PagedTokenAllocator(16, 64)
    # A's prefix ends at offset 5 of page 2, B's fills page 1; free pages come out as 7, 3, 9, 5
    alloc.free_pages = t([7, 3, 9, 5, 11, 12])
    last_loc = [2 * 64 + 5, 1 * 64 + 63]
    out = alloc.alloc_extend(t([70, 128]), t([190, 260]), t(last_loc), 252)
    plan = alloc_extend_ref([70, 128], [190, 260], last_loc, [7, 3, 9, 5, 11, 12], 64)
    assert out.tolist() == plan.out_indices
    assert out[:58].tolist() == list(range(2 * 64 + 6, 3 * 64))        # A part 1
    assert out[58:120].tolist() == list(range(7 * 64, 7 * 64 + 62))    # A part 3
    assert out[120:248].tolist() == list(range(3 * 64, 4 * 64)) + list(range(9 * 64, 10 * 64))
    assert out[248:].tolist() == [5 * 64 + k for k in range(4)]        # B part 3
    assert alloc.free_pages.tolist() == [11, 12]
    assert alloc.ret_values.item() == (4 << 32) | 252


@pytest.mark.parametrize("P", [1, 4, 16, 64])
@pytest.mark.parametrize("prefix_lens,seq_lens", [
    ([0], [0]),                       # one empty request: nothing to do, no launch
    ([0], [1]),                       # one request, pre == 0, one token
    ([0, 0, 0], [5, 64, 65]),          # pre == 0 for all
    ([64, 128], [64, 200]),            # page-aligned prefixes, one empty extend
    ([3, 70, 1], [3, 190, 130]),       # unaligned prefixes, one empty extend
    ([5] * 9, [6, 7, 8, 9, 60, 64, 65, 128, 5]),  # many requests
])
def test_edge_cases(P, prefix_lens, seq_lens):
    # room for every prefix page plus every new page, and two to spare
    alloc = PagedTokenAllocator(pages_needed_extend([0] * len(seq_lens), seq_lens, P) + 2, P)
    batch = Batch(alloc, prefix_lens)
    free_before = alloc.num_free_pages
    extend_and_check(batch, seq_lens)
    assert alloc.num_free_pages == free_before - pages_needed_extend(prefix_lens, seq_lens, P)


def test_int32_inputs_are_accepted():
    alloc = PagedTokenAllocator(8, 4)
    out = alloc.alloc_extend(t([0, 0], dtype=torch.int32), t([3, 5], dtype=torch.int32),
                             t([-1, -1], dtype=torch.int32), 8)
    assert out.dtype == torch.int64
    assert out.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]


# --- random batches (hypothesis) ------------------------------------------------------------


@st.composite
def workloads(draw):
    P = draw(st.sampled_from([1, 2, 4, 16, 64]))
    bs = draw(st.integers(1, 6))
    pre = [draw(st.integers(0, 3 * P + 2)) for _ in range(bs)]
    seq = [p + draw(st.one_of(st.just(0), st.integers(0, 2 * P + 3))) for p in pre]
    prefix_pages = pages_needed_extend([0] * bs, pre, P)
    spare = draw(st.integers(-2, 6))  # sometimes too few pages for the extend
    num_pages = max(1, prefix_pages + max(0, pages_needed_extend(pre, seq, P) + spare))
    return P, pre, seq, num_pages


@given(workloads(), st.randoms(use_true_random=False))
def test_random_extends_match_the_reference(workload, rnd):
    P, pre, seq, num_pages = workload
    alloc = PagedTokenAllocator(num_pages, P)
    perm = list(range(num_pages))
    rnd.shuffle(perm)  # a scrambled free list, as after a while of serving
    alloc.free_pages = t(perm)
    batch = Batch(alloc, pre)
    extend_and_check(batch, seq)


@given(workloads(), st.integers(1, 5))
def test_random_decode_steps_match_the_reference(workload, steps):
    P, pre, _seq, num_pages = workload
    alloc = PagedTokenAllocator(num_pages + 2, P)
    batch = Batch(alloc, pre)
    for _ in range(steps):
        seq = [p + 1 for p in batch.pre]
        free_before = alloc.free_pages.tolist()
        needed = sum(1 for s in seq if (s - 1) % P == 0)
        if needed > len(free_before):
            before = alloc.state()
            with pytest.raises(OutOfPages):
                alloc.alloc_decode(t(seq), t(batch.last_loc))
            assert alloc.state().equals(before)
            return
        plan = alloc_decode_ref(seq, batch.last_loc, free_before, P)
        got = alloc.alloc_decode(t(seq), t(batch.last_loc)).tolist()
        assert got == plan.out_indices
        assert len(set(got)) == len(got)
        assert alloc.free_pages.tolist() == free_before[plan.num_new_pages:]
        for r, x in enumerate(got):
            others = set().union(*(batch.pages_of(q) for q in range(len(seq)) if q != r))
            assert x // P not in others
            assert (x % P == 0) == plan.takes_new_page[r] == ((seq[r] - 1) % P == 0)
            batch.slots[r].append(x)
        batch.pre = seq


# --- refusals leave everything as it was ---------------------------------------------------


def _refused(alloc, call, error):
    before = alloc.state()
    with pytest.raises(error) as e:
        call()
    assert alloc.state().equals(before)
    return e.value


def test_out_of_pages_names_needed_and_free_and_changes_nothing():
    alloc = PagedTokenAllocator(4, 4)
    alloc.alloc_extend(t([0]), t([9]), t([-1]), 9)  # 3 pages, 1 left
    err = _refused(alloc, lambda: alloc.alloc_extend(t([9, 0]), t([13, 1]), t([8 + 0, -1]), 5), OutOfPages)
    assert (err.needed, err.free) == (2, 1) and "needs 2" in str(err) and "only 1" in str(err)
    assert isinstance(err, RuntimeError)


@pytest.mark.parametrize("args,argument,rule", [
    ((t([4]), t([3]), t([3]), 0), "seq_lens[0]", "seq_lens >= prefix_lens"),
    ((t([4]), t([6]), t([4]), 2), "last_loc[0]", "(last_loc + 1) % page_size"),
    ((t([0]), t([2]), t([0]), 2), "last_loc[0]", "(last_loc + 1) % page_size"),
    ((t([-4]), t([2]), t([-1]), 6), "prefix_lens[0]", "prefix_lens >= 0"),
    ((t([0, 0]), t([2]), t([-1]), 2), "prefix_lens/seq_lens/last_loc", "same length"),
    ((t([0]), t([2]), t([-1]), 3), "extend_num_tokens", "sum(seq_lens - prefix_lens)"),
    ((t([0]), t([2.0], dtype=torch.float32), t([-1]), 2), "seq_lens", "dtype"),
    ((t([0]), t([2], dtype=torch.int16), t([-1]), 2), "seq_lens", "dtype"),
    (([0], t([2]), t([-1]), 2), "prefix_lens", "torch.Tensor"),
    ((t([4]), t([6]), t([999]), 2), "last_loc[0]", "0 <= last_loc"),
])
def test_bad_extend_arguments_are_refused_before_launch(args, argument, rule):
    alloc = PagedTokenAllocator(8, 4)
    err = _refused(alloc, lambda: alloc.alloc_extend(*args), InvalidArgument)
    assert err.argument == argument and rule in err.rule
    assert isinstance(err, ValueError)


def test_last_loc_on_a_free_page_is_refused():
    alloc = PagedTokenAllocator(8, 4)
    alloc.alloc_extend(t([0]), t([3]), t([-1]), 3)  # page 0 is allocated, slots 0..2
    err = _refused(alloc, lambda: alloc.alloc_extend(t([3]), t([6]), t([4 * 5 + 2]), 3), InvalidArgument)
    assert err.argument == "last_loc[0]" and "allocated page" in err.rule
    err = _refused(alloc, lambda: alloc.alloc_decode(t([4]), t([4 * 5 + 2])), InvalidArgument)
    assert err.argument == "last_loc[0]" and "allocated page" in err.rule
    assert alloc.alloc_decode(t([4]), t([2])).tolist() == [3]  # on its own page: fine


def test_empty_batches():
    alloc = PagedTokenAllocator(4, 4)
    assert alloc.alloc_extend(t([]), t([]), t([]), 0).numel() == 0
    assert alloc.alloc_decode(t([]), t([])).numel() == 0
    assert alloc.num_free_pages == 4


def test_wrong_device_is_refused():
    # on a GPU: allocator on cuda, inputs on the cpu; without one, an allocator on "meta"
    other = "cuda" if torch.cuda.is_available() else "meta"
    alloc = PagedTokenAllocator(8, 4, device=other)
    free_before = alloc.free_pages.clone()
    with pytest.raises(InvalidArgument) as e:
        alloc.alloc_extend(t([0], "cpu"), t([1], "cpu"), t([-1], "cpu"), 1)
    assert e.value.argument == "prefix_lens" and "device" in e.value.rule
    assert alloc.free_pages.shape == free_before.shape


@pytest.mark.parametrize("args,argument", [
    ((t([0]), t([-1])), "seq_lens[0]"),
    ((t([6]), t([5])), "last_loc[0]"),
    ((t([1, 2]), t([-1])), "seq_lens/last_loc"),
])
def test_bad_decode_arguments_are_refused(args, argument):
    alloc = PagedTokenAllocator(8, 4)
    err = _refused(alloc, lambda: alloc.alloc_decode(*args), InvalidArgument)
    assert err.argument == argument


@pytest.mark.parametrize("num_pages,page_size", [(0, 4), (4, 0), (4, 3), (4, 48), (1, 1 << 21)])
def test_bad_constructor_arguments(num_pages, page_size):
    with pytest.raises(InvalidArgument):
        PagedTokenAllocator(num_pages, page_size)


def test_unknown_impl_is_refused():
    with pytest.raises(InvalidArgument, match="impl"):
        PagedTokenAllocator(4, 4, impl="magic")


# --- free -------------------------------------------------------------------------------------


def test_free_returns_whole_pages_and_available_size_follows():
    alloc = PagedTokenAllocator(6, 4)
    assert alloc.available_size() == 24
    out = alloc.alloc_extend(t([0, 0]), t([6, 3]), t([-1, -1]), 9)  # pages 0, 1 | 2
    assert alloc.available_size() == 12 and alloc.free_pages.tolist() == [3, 4, 5]
    alloc.free(out[:6])                      # request 0's slots: pages 0 and 1
    assert alloc.free_pages.tolist() == [3, 4, 5, 0, 1]
    alloc.free(out[6:7])                     # one slot of page 2 frees the page
    assert alloc.free_pages.tolist() == [3, 4, 5, 0, 1, 2]
    assert alloc.available_size() == 24
    alloc.free(t([]))                        # nothing: fine
    assert alloc.num_free_pages == 6


@pytest.mark.parametrize("indices,rule", [
    ([0], "allocated"),           # page 0 is already free (double free)
    ([-1], "0 <= slot"),          # out of range
    ([24], "0 <= slot"),          # out of range (6 pages of 4)
    ([8, 8], "at most once"),     # the same slot twice
    ([8, 3], "allocated"),        # one good page, one already free: nothing changes
])
def test_free_refusals_change_nothing(indices, rule):
    alloc = PagedTokenAllocator(6, 4)
    alloc.alloc_extend(t([0]), t([12]), t([-1]), 12)  # pages 0, 1, 2 allocated
    alloc.free(t([0, 1, 2, 3]))                          # page 0 back
    err = _refused(alloc, lambda: alloc.free(t(indices)), InvalidArgument)
    assert rule in err.rule


def test_nothing_is_freed_twice():
    alloc = PagedTokenAllocator(4, 2)
    out = alloc.alloc_extend(t([0]), t([4]), t([-1]), 4)
    alloc.free(out)
    _refused(alloc, lambda: alloc.free(out), InvalidArgument)
    assert sorted(alloc.free_pages.tolist()) == [0, 1, 2, 3]


# --- the chapter checkers judge parts separately ---------------------------------------------


@triton.jit
def _part1_only_kernel(pre_lens_ptr, seq_lens_ptr, last_loc_ptr, free_page_ptr, out_indices,
                       ret_values, bs_upper: tl.constexpr, page_size: tl.constexpr,
                       max_num_extend_tokens: tl.constexpr):
    # a learner who has written part 1 and nothing else yet
    pid = tl.program_id(0)
    offs = tl.arange(0, bs_upper)
    seq_lens = tl.load(seq_lens_ptr + offs, mask=offs <= pid, other=0)
    pre_lens = tl.load(pre_lens_ptr + offs, mask=offs <= pid, other=0)
    seq_len = tl.load(seq_lens_ptr + pid)
    pre_len = tl.load(pre_lens_ptr + pid)
    start = tl.sum(seq_lens - pre_lens) - (seq_len - pre_len)
    n1 = tl.minimum(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len
    one_page = tl.arange(0, page_size)
    tl.store(out_indices + start + one_page, tl.load(last_loc_ptr + pid) + 1 + one_page,
             mask=one_page < n1)


def test_part_checkers_judge_only_their_part():
    from kvlab import check

    check.alloc_extend_part1(_part1_only_kernel, n_random=0)  # part 1 is right: passes
    with pytest.raises(check.CheckFailed) as e:
        check.alloc_extend_part2(_part1_only_kernel, n_random=0)
    msg = str(e.value)
    assert "part 2" in msg and "request 1" in msg and "got -1" in msg  # the worked example's B


def test_decode_checker_passes_the_teaching_kernel(capsys):
    from kvlab import check
    from kvlab.alloc.alloc_kernels import alloc_decode_kernel

    check.alloc_decode(alloc_decode_kernel, n_random=1)
    assert "✓ alloc_decode: all 9 cases pass (8 edge cases, 1 random)" in capsys.readouterr().out


def test_teaching_kernel_block_limit_is_refused_before_launch():
    from kvlab.alloc.token_allocator import _MAX_BLOCK

    alloc = PagedTokenAllocator(2, _MAX_BLOCK, impl="teaching")  # two huge pages: the page count is no obstacle
    n = _MAX_BLOCK + 1  # next_power_of_2 -> 2 * _MAX_BLOCK lanes: more than Triton allows
    err = _refused(alloc, lambda: alloc.alloc_extend(t([0]), t([n]), t([-1]), n), InvalidArgument)
    assert err.argument == "extend_num_tokens"


# --- host lengths: no sync; rules only the device can read are refused by the kernel --------


@pytest.mark.parametrize("impl", ["fast", "teaching"])
@given(st.sampled_from([1, 4, 16]), st.integers(0, 2**16), st.sampled_from(["list", "tensor", "none"]))
def test_host_lengths_give_the_same_slots(impl, P, seed, form):
    """The same steps with and without host copies of the lengths: same slots, same free list."""
    import random

    rng = random.Random(seed)
    allocs = [PagedTokenAllocator(40, P, impl=impl), PagedTokenAllocator(40, P, impl=impl)]
    lens: list[int] = []
    last: list[int] = []
    host = {"list": list, "tensor": lambda v: torch.tensor(v), "none": lambda v: None}[form]
    for _ in range(3):
        pre = lens + [0] * rng.randint(1, 2)
        seq = [p + rng.choice([0, 1, P, rng.randint(1, 2 * P + 3)]) for p in pre]
        lasts = last + [-1] * (len(pre) - len(last))
        n = sum(s - p for p, s in zip(pre, seq))
        outs = []
        for a, with_host in zip(allocs, (False, True)):
            kw = dict(prefix_lens_cpu=host(pre), seq_lens_cpu=host(seq)) if with_host and form != "none" else {}
            try:
                outs.append(a.alloc_extend(t(pre), t(seq), t(lasts), n, **kw).tolist())
            except OutOfPages:
                outs.append("oom")
        assert outs[0] == outs[1]
        assert allocs[0].free_pages.tolist() == allocs[1].free_pages.tolist()
        if outs[0] == "oom":
            return
        at, last = 0, []
        for p, s, old in zip(pre, seq, lasts):
            at += s - p
            last.append(outs[0][at - 1] if s > p else old)
        lens = seq
        dec = [s + 1 for s in lens]
        outs = []
        for a, with_host in zip(allocs, (False, True)):
            kw = dict(seq_lens_cpu=host(dec)) if with_host and form != "none" else {}
            try:
                outs.append(a.alloc_decode(t(dec), t(last), **kw).tolist())
            except OutOfPages:
                outs.append("oom")
        assert outs[0] == outs[1]
        if outs[0] == "oom":
            return
        lens, last = dec, outs[0]


def _deferred(P=4):
    """An allocator that does not read the device after each call (as on a GPU), with one
    request of 3 tokens on page 0."""
    alloc = PagedTokenAllocator(8, P, eager_errors=False)
    alloc.alloc_extend(t([0]), t([3]), t([-1]), 3, prefix_lens_cpu=[0], seq_lens_cpu=[3])
    alloc.check_device_errors()
    return alloc


@pytest.mark.parametrize("call,argument,rule", [
    # last_loc on page 5, which is free
    (lambda a: a.alloc_extend(t([3]), t([6]), t([22]), 3, prefix_lens_cpu=[3], seq_lens_cpu=[6]),
     "last_loc[0]", "allocated page"),
    # host copies that are not the device tensors (same totals, another order)
    (lambda a: a.alloc_extend(t([0, 3]), t([3, 4]), t([-1, 2]), 4, prefix_lens_cpu=[3, 0], seq_lens_cpu=[4, 3]),
     "prefix_lens_cpu/seq_lens_cpu", "same values"),
    # device seq_lens below the prefix, host copies fine
    (lambda a: a.alloc_extend(t([3]), t([2]), t([2]), 1, prefix_lens_cpu=[3], seq_lens_cpu=[4]),
     "seq_lens[0]", "seq_lens >= prefix_lens"),
    (lambda a: a.alloc_decode(t([4]), t([22]), seq_lens_cpu=[4]), "last_loc[0]", "allocated page"),
    (lambda a: a.alloc_decode(t([4, 1]), t([2, -1]), seq_lens_cpu=[1, 4]), "seq_lens_cpu", "same values"),
])
def test_a_refusal_found_on_the_device_is_raised_later_and_undone(call, argument, rule):
    """The kernel refuses before it writes anything: -1 slots, no page taken. The next call
    that reads the device raises the error; every allocation in between was refused too, and
    the allocator is back where it was before the refused call."""
    alloc = _deferred()
    before = alloc.state()
    out = call(alloc)                                   # no sync: nothing raised yet
    assert out.tolist() == [-1] * out.numel()
    later = alloc.alloc_decode(t([4]), t([2]), seq_lens_cpu=[4])   # a good call, after it
    assert later.tolist() == [-1]
    with pytest.raises(InvalidArgument) as e:
        alloc.check_device_errors()
    assert e.value.argument == argument and rule in e.value.rule
    assert alloc.state().equals(before)
    assert alloc.alloc_decode(t([4]), t([2]), seq_lens_cpu=[4]).tolist() == [3]  # works again
    alloc.check_device_errors()


@pytest.mark.parametrize("reader", ["alloc_without_host_lengths", "free"])
def test_the_next_reading_call_raises_a_pending_refusal_first(reader):
    alloc = _deferred()
    before = alloc.state()
    alloc.alloc_extend(t([3]), t([6]), t([22]), 3, prefix_lens_cpu=[3], seq_lens_cpu=[6])  # refused
    with pytest.raises(InvalidArgument, match="earlier alloc_extend call") as e:
        if reader == "free":
            alloc.free(t([0]))
        else:
            alloc.alloc_decode(t([4]), t([2]))
    assert e.value.argument == "last_loc[0]"
    assert alloc.state().equals(before)  # neither the refused call nor the reader changed it


def test_eager_errors_raise_at_the_call_itself():
    """Where reading the device costs nothing (a CPU, the default there) the call itself raises;
    on a GPU ``eager_errors=True`` buys the same for one sync per call."""
    alloc = PagedTokenAllocator(8, 4, eager_errors=True)
    assert PagedTokenAllocator(8, 4).eager_errors == (kvlab.DEVICE.type == "cpu")
    alloc.alloc_extend(t([0]), t([3]), t([-1]), 3, prefix_lens_cpu=[0], seq_lens_cpu=[3])
    before = alloc.state()
    with pytest.raises(InvalidArgument, match="allocated page"):
        alloc.alloc_extend(t([3]), t([6]), t([22]), 3, prefix_lens_cpu=[3], seq_lens_cpu=[6])
    assert alloc.state().equals(before)


@pytest.mark.parametrize("kw,argument", [
    (dict(prefix_lens_cpu=[0, 3]), "prefix_lens_cpu/seq_lens_cpu"),           # one of two
    (dict(prefix_lens_cpu=[0], seq_lens_cpu=[3]), "prefix_lens_cpu"),        # wrong length
    (dict(prefix_lens_cpu=[0, -3], seq_lens_cpu=[3, 4]), "prefix_lens_cpu[1]"),
    (dict(prefix_lens_cpu=[0, 3], seq_lens_cpu=[3, 2]), "seq_lens_cpu[1]"),
    (dict(prefix_lens_cpu=[0, 3], seq_lens_cpu=[3, 5]), "extend_num_tokens"),  # host says 5 tokens
    (dict(prefix_lens_cpu=[0.0, 3.0], seq_lens_cpu=[3, 4]), "prefix_lens_cpu"),
])
def test_host_length_rules_are_refused_before_any_launch(kw, argument):
    alloc = PagedTokenAllocator(8, 4, eager_errors=False)
    err = _refused(alloc, lambda: alloc.alloc_extend(t([0, 3]), t([3, 4]), t([-1, 2]), 4, **kw),
                   InvalidArgument)
    assert err.argument == argument
    assert alloc._calls == 0  # refused on the host: nothing launched


def test_out_of_pages_with_host_lengths_is_refused_before_any_launch():
    alloc = PagedTokenAllocator(2, 4, eager_errors=False)
    err = _refused(alloc, lambda: alloc.alloc_extend(t([0]), t([9]), t([-1]), 9, prefix_lens_cpu=[0],
                                                     seq_lens_cpu=[9]), OutOfPages)
    assert (err.needed, err.free) == (3, 2) and alloc._calls == 0


def test_free_pages_can_be_set_and_must_be_distinct_pages_of_the_pool():
    alloc = PagedTokenAllocator(6, 4)
    alloc.free_pages = t([5, 1, 3])
    assert alloc.num_free_pages == 3 and alloc._page_free.tolist() == [0, 1, 0, 1, 0, 1]
    for bad in ([1, 1], [6], [-1]):
        with pytest.raises(InvalidArgument, match="free_pages"):
            alloc.free_pages = t(bad)


# --- on the GPU: no sync with host lengths, one without, no compile after construction --------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fast", "teaching"])
def test_syncs_per_call(impl):
    """torch's sync debug mode: with host lengths the fast calls make none (it raises on one),
    without them exactly one (the page count); the teaching kernels always read back once."""
    import warnings

    P, bs = 16, 64
    alloc = PagedTokenAllocator(4096, P, impl=impl)
    pre = [0] * bs
    seq = [33 + (r % 40) for r in range(bs)]
    last = [-1] * bs
    d_pre, d_seq, d_last = t(pre), t(seq), t(last)
    cpu_pre, cpu_seq = torch.tensor(pre), torch.tensor(seq)
    n = sum(seq)
    torch.cuda.synchronize()

    def syncs(fn) -> int:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert (out >= 0).all()
        return sum("synchronizing" in str(w.message) for w in caught)

    with_host = syncs(lambda: alloc.alloc_extend(d_pre, d_seq, d_last, n, prefix_lens_cpu=cpu_pre,
                                                 seq_lens_cpu=cpu_seq))
    without = syncs(lambda: alloc.alloc_extend(d_pre, d_seq, d_last, n))
    dec_seq = t([s + 1 for s in seq])
    dec_cpu = dec_seq.cpu()
    dec_last = alloc.alloc_extend(d_pre, d_seq, d_last, n)[torch.cumsum(d_seq, 0) - 1]  # each one's last slot
    dec_host = syncs(lambda: alloc.alloc_decode(dec_seq, dec_last, seq_lens_cpu=dec_cpu))
    if impl == "fast":
        assert (with_host, without, dec_host) == (0, 1, 0)
        torch.cuda.set_sync_debug_mode("error")  # and none at all, as the mode that raises sees it
        try:
            alloc.alloc_extend(d_pre, d_seq, d_last, n, prefix_lens_cpu=cpu_pre, seq_lens_cpu=cpu_seq)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        assert (with_host, without, dec_host) == (1, 1, 1)
    alloc.check_device_errors()


@pytest.mark.gpu
def test_no_call_after_construction_compiles():
    """The constructor compiles every kernel the fast path uses; then batches of any size,
    up to 65,536 requests, are launches only (a compile would take hundreds of ms)."""
    import time

    from kvlab.alloc import fast_alloc_kernels as K

    P = 16
    alloc = PagedTokenAllocator(1 << 18, P)
    launchers = (K._FUSED, K._SCAN, K._FILL, K._DECODE)
    compiled = [len(k.compiled_keys) for k in launchers]
    jit_cache = [sum(len(c[0]) for c in k.kernel.device_caches.values()) for k in launchers]
    for bs in (1, 3, 1000, 1025, 3000, 4097, 10000, 65536):
        pre, seq = [0] * bs, [1 + (r % 3) for r in range(bs)]
        args = (t(pre), t(seq), t([-1] * bs), sum(seq))
        host = dict(prefix_lens_cpu=torch.tensor(pre), seq_lens_cpu=torch.tensor(seq))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = alloc.alloc_extend(*args, **host)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        assert ms < 100, f"first call at bs={bs} took {ms:.0f} ms: a compile?"
        ends = torch.cumsum(t(seq), 0) - 1
        alloc.alloc_decode(t([s + 1 for s in seq]), out[ends], seq_lens_cpu=[s + 1 for s in seq])
        alloc.free(out)
    alloc.check_device_errors()
    assert [len(k.compiled_keys) for k in launchers] == compiled
    assert [sum(len(c[0]) for c in k.kernel.device_caches.values()) for k in launchers] == jit_cache


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 16])
def test_direct_launch_gives_what_the_launcher_gives(P):
    """The hot path (Triton's C launcher called directly, pointers as addresses) and the
    ordinary launch give the same slots and leave the same state, call after call; a launch
    hook (a profiler) sends calls back through Triton's own launcher."""
    import random

    from kvlab.base import launch

    allocs = [PagedTokenAllocator(1 << 12, P) for _ in range(2)]
    if launch.TRITON_VERSION in launch.C_ENTRIES:
        assert allocs[0]._direct is not None  # the Tritons kvlab knows take the hot path
    allocs[1]._direct = None
    assert allocs[0].ret_values.is_pinned()
    rng = random.Random(P)
    lens = [0] * 40
    lasts = [[-1] * 40 for _ in allocs]
    for step in range(12):
        bs = rng.choice([1, 7, 40])
        pre = lens[:bs]
        seq = [p + rng.randrange(0, 3 * P + 2) for p in pre] if step % 3 else [p + 1 for p in pre]
        outs = []
        for a, last in zip(allocs, lasts):
            if step % 3:
                host = dict(prefix_lens_cpu=torch.tensor(pre), seq_lens_cpu=torch.tensor(seq)) if step % 2 else {}
                out = a.alloc_extend(t(pre), t(seq), t(last[:bs]), sum(seq) - sum(pre), **host)
                ends = torch.tensor(seq) - torch.tensor(pre)
                for r in range(bs):
                    if ends[r] > 0:
                        last[r] = int(out[int(ends[:r + 1].sum()) - 1])
            else:
                out = a.alloc_decode(t(seq), t(last[:bs]), **({"seq_lens_cpu": seq} if step % 2 else {}))
                last[:bs] = out.tolist()
            outs.append(out.tolist())
        assert outs[0] == outs[1]
        assert allocs[0].free_pages.tolist() == allocs[1].free_pages.tolist()
        assert allocs[0].ret_values.item() == allocs[1].ret_values.item()
        lens[:bs] = seq
    for a in allocs:
        a.check_device_errors()
    knobs = launch._KNOBS
    if knobs is not None and hasattr(getattr(knobs, "launch_enter_hook", None), "add"):
        seen = []
        hook = lambda *a: seen.append(1)  # noqa: E731
        knobs.launch_enter_hook.add(hook)
        try:
            assert launch.launch_ready(allocs[0].device.index) is None
            allocs[0].alloc_extend(t([0]), t([3]), t([-1]), 3, prefix_lens_cpu=[0], seq_lens_cpu=[3])
        finally:
            knobs.launch_enter_hook.remove(hook)
        assert seen  # the profiler saw the launch
