"""The safety net around learner code (kvlab.course.checking.sandbox): guard bands, the audit, program
orders, and the child processes (forked in the interpreter, spawned once CUDA is in use).

Every test here runs in both runtimes. Where the runtimes differ the test says what each one
reports: in the interpreter the audit sees each load and store (program, line); on a GPU a
direct call sees guard bands only, and a checker run adds the audit pass in Triton's
interpreter. Child-process tests run with every kind of child the runtime has: a fork and a
spawned Python in the interpreter, a spawned Python on a GPU. GPU-only tests (a planted
illegal address, the notebook's CUDA context afterwards) are marked ``gpu``.
"""
from __future__ import annotations

import os
import signal

import pytest
import torch
import triton
import triton.language as tl

import kvlab.check  # noqa: F401
from kvlab.base import runtime
from kvlab.check import CheckFailed, Layout, LearnerRaised, call_learner
from kvlab.course.checking import core, sandbox, workers
from kvlab.course.checking.audit import Order
from kvlab.course.checking.guards import BAND, BandWrite, int_view_dtype, sentinel_bits, signed
from kvlab.course.checking.walk import (ArgRef, from_refs, is_plain_data, map_tensors, tensors_in,
                              to_refs)

#: the kinds of child process this runtime has (a fork is unsafe once CUDA has started)
CHILD_KINDS = ["fork", "spawn"] if runtime.INTERPRET else ["spawn"]


@pytest.fixture(params=CHILD_KINDS)
def child(request, monkeypatch):
    """Run the test with each kind of child process of this runtime."""
    monkeypatch.setenv("KVLAB_SANDBOX", request.param)
    return request.param


# --- small kernels with planted bugs -----------------------------------------------------


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def copy_unmasked_store(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0))  # store not masked


@triton.jit
def copy_store_before(src, dst, n, shift, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs - shift, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def copy_wild_load(src, dst, n, shift, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs + shift), mask=mask)  # load not masked, shifted


@triton.jit
def copy_read_unused(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs), mask=mask)  # reads past src; never stored


@triton.jit
def store_far_away(dst, far):
    offs = tl.arange(0, 4)
    tl.store(dst + offs + far, offs.to(tl.int64))


@triton.jit
def store_one(dst, at):
    tl.store(dst + at, 1)


@triton.jit
def scale_rows(table, stride_row, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    ptr = table + row * stride_row + offs
    tl.store(ptr, tl.load(ptr, mask=mask) * 10, mask=mask)


@triton.jit
def arrival_order(counter, out):
    pid = tl.program_id(0)
    tl.store(out + pid, tl.atomic_add(counter, 1))  # the how-many-th program am I


@triton.jit
def every_program_stores_the_total(values, total):
    pid = tl.program_id(0)
    offs = tl.arange(0, 8)
    running = tl.sum(tl.load(values + offs, mask=offs <= pid, other=0))
    tl.store(total, running)  # a race: only the last program's running sum is the total


@triton.jit
def last_program_stores_the_total(values, total):
    pid = tl.program_id(0)
    offs = tl.arange(0, 8)
    running = tl.sum(tl.load(values + offs, mask=offs <= pid, other=0))
    if pid == tl.num_programs(0) - 1:
        tl.store(total, running)


@triton.jit
def two_parts(src, out, n):
    pid = tl.program_id(0)
    offs = tl.arange(0, 4)
    # ---- part 1: copy my first value
    tl.store(out + 2 * pid, tl.load(src + pid))
    # ---- part 2: copy a neighbour (reads past src for the last program)
    tl.store(out + 2 * pid + 1, tl.load(src + pid + 1))


@triton.jit
def no_comments(src, out, n):
    pid = tl.program_id(0)
    first = tl.load(src + pid)
    tl.store(out + 2 * pid, first)
    nxt = tl.load(src + pid + 1)
    tl.store(out + 2 * pid + 1, nxt)


def _pair(device, n=5, dtype=torch.int64):
    src = torch.arange(1, n + 1, dtype=dtype, device=device)
    dst = torch.zeros(n, dtype=dtype, device=device)
    return src, dst


def _only(case_name: str, run_one) -> CheckFailed:
    """The failure of a one-case checker run (the audit pass included on a GPU)."""
    with pytest.raises(CheckFailed) as info:
        core.run_cases("demo", [kvlab.check.Case(case_name, {})], run_one, quiet=True)
    return info.value


# --- the one walker over arguments -------------------------------------------------------------


def test_map_tensors_names_every_tensor_and_keeps_containers_without_changes():
    t0, t1 = torch.zeros(1), torch.ones(2)
    plain = [1, 2]
    args = (t0, {"row": t1, "ids": plain}, plain)
    assert [n for n, _ in tensors_in(args, "x")] == ["x[0]", "x[1]['row']"]
    swapped = map_tensors(args, lambda _, v: v + 1 if isinstance(v, torch.Tensor) else v)
    assert swapped[1]["ids"] is plain and swapped[2] is plain  # no tensor inside: the same object
    assert swapped[1]["row"].tolist() == [2.0, 2.0]
    refs = to_refs([t1, (t0, 3)], [t0, t1])
    assert refs == [ArgRef(1), (ArgRef(0), 3)]
    assert from_refs(refs, [t0, t1])[1][0] is t0
    assert is_plain_data(args) and not is_plain_data([object()])


# --- correct code passes through, results come back -----------------------------------------


def test_correct_kernel_results_come_back_in_place(device):
    src, dst = _pair(device)
    call_learner(copy_kernel, src, dst, 5, BLOCK=8, grid=(1,))
    assert dst.tolist() == [1, 2, 3, 4, 5]
    assert src.tolist() == [1, 2, 3, 4, 5]


def test_python_function_return_value_and_in_place_writes(device):
    src, dst = _pair(device)

    def learner(x, out):
        out += x
        return out, x * 2

    got_out, doubled = call_learner(learner, src, dst)
    assert got_out is dst  # the caller's own tensor, not the guarded view
    assert dst.tolist() == [1, 2, 3, 4, 5]
    assert doubled.tolist() == [2, 4, 6, 8, 10]


def test_strides_are_kept_for_a_non_contiguous_argument(device):
    base = torch.arange(4 * 8, dtype=torch.int32, device=device).reshape(4, 8)
    table = base[:, 2:6]  # rows of 4 inside rows of 8: stride(0) == 8
    call_learner(scale_rows, table, table.stride(0), 4, BLOCK=4, grid=(4,))
    expected = torch.arange(4 * 8, dtype=torch.int32).reshape(4, 8)
    expected[:, 2:6] *= 10
    assert base.cpu().tolist() == expected.tolist()


def test_arguments_sharing_memory_share_one_guard_buffer(device):
    whole = torch.zeros(6, dtype=torch.int64, device=device)

    def learner(a, tail):
        tail.fill_(7)  # written through one view ...
        return int(a.sum())  # ... and seen through the other

    assert call_learner(learner, whole, whole[3:]) == 21
    assert whole.tolist() == [0, 0, 0, 7, 7, 7]


def test_objects_and_methods_run_in_process_so_their_changes_stay(device):
    class Box:
        def __init__(self):
            self.items = []

        def bump(self, x):
            self.items.append(int(x.numel()))

    box = Box()
    call_learner(lambda b, x: b.items.append(int(x.sum())), box, torch.ones(3, device=device))
    call_learner(box.bump, torch.ones(4, device=device))
    assert box.items == [3, 4]


@pytest.mark.parametrize("mode", ["inprocess", *CHILD_KINDS])
def test_changes_to_list_and_dict_arguments_reach_the_caller(monkeypatch, mode):
    monkeypatch.setenv("KVLAB_SANDBOX", mode)
    store = {(1, 2): [0, 1]}
    log = []

    def learner(store, log, ids):
        store[(1, 2)].append(99)
        store[(3, 4)] = [2, 3]
        log.append(len(ids))

    call_learner(learner, store, log, [5, 6, 7])
    assert store == {(1, 2): [0, 1, 99], (3, 4): [2, 3]}
    assert log == [3]


def test_off_switch_runs_the_code_bare(monkeypatch, device):
    monkeypatch.setenv("KVLAB_SANDBOX", "off")
    seen = []
    call_learner(lambda x: seen.append(x), torch.ones(2, device=device))
    assert seen[0].data_ptr() != 0 and seen[0].numel() == 2


# --- writes outside a tensor -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "inprocess"])
def test_store_past_the_end_is_named_with_distance(monkeypatch, device, mode):
    monkeypatch.setenv("KVLAB_SANDBOX", mode)
    src, dst = _pair(device)
    with pytest.raises(CheckFailed) as info:
        call_learner(copy_unmasked_store, src, dst, 5, BLOCK=8, grid=(1,))
    msg = str(info.value)
    assert "a write past the end of `dst` (3 writes, up to 3 elements out)" in msg
    assert "`src`" not in msg.split("\n")[1]
    if runtime.INTERPRET:  # the audit saw the store itself: which program, which line
        assert "by program 0 (in copy_unmasked_store, line" in msg
        assert "tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0))" in msg
    assert dst.tolist() == [1, 2, 3, 4, 5]  # the real data still came back


def test_store_before_the_start_is_named(device):
    src, dst = _pair(device)
    with pytest.raises(CheckFailed) as info:
        call_learner(copy_store_before, src, dst, 5, 2, BLOCK=8, grid=(1,))
    assert "a write before the start of `dst` (2 writes, up to 2 elements out)" in str(info.value)
    assert info.value.band_writes == [BandWrite("dst", "before", [2, 1], 5)]


def test_a_store_at_the_edge_of_the_band_is_measured_or_said_to_go_further(device):
    dst = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(CheckFailed) as info:  # the last element of the band, no further
        call_learner(store_one, dst, 4 + BAND - 1, grid=(1,))
    msg = str(info.value)
    assert f"a write past the end of `dst` (up to {BAND} elements out" in msg
    if not runtime.INTERPRET:  # the band alone cannot tell; the audit saw the store itself
        assert "the whole guard band: it may have gone further" in msg


def test_a_far_away_store_is_reported_and_this_process_keeps_working(device):
    # in the interpreter the audit switches the store off before it touches memory; on a GPU
    # it is an illegal address in the spawned child, found afterwards in the interpreter
    dst = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(CheckFailed) as info:
        call_learner(store_far_away, dst, 1 << 40, grid=(1,))
    msg = str(info.value)
    assert "a write far outside every tensor (4 writes, about 1.1e+12 elements" in msg
    assert "tl.store(dst + offs + far, offs.to(tl.int64))" in msg
    if not runtime.INTERPRET:
        assert "CUDA error" in msg and "your notebook's GPU is fine" in msg
    assert dst.tolist() == [0, 0, 0, 0]
    assert torch.arange(3, device=device).sum().item() == 3  # this process's device still works


# --- reads outside a tensor --------------------------------------------------------------


def test_wild_load_past_the_end_names_the_source(device):
    src, dst = _pair(device)
    with pytest.raises(CheckFailed) as info:
        call_learner(copy_wild_load, src, dst, 5, 2, BLOCK=8, grid=(1,))
    msg = str(info.value)
    assert "a read past the end of `src`" in msg
    if runtime.INTERPRET:
        assert "(5 reads, up to 5 elements out) by program 0 (in copy_wild_load, line" in msg
    else:  # seen by the guard value it brought into the output
        assert "`dst[3]` holds a guard value" in msg


def test_wild_load_before_the_start_names_the_source(device):
    src, dst = _pair(device)
    with pytest.raises(CheckFailed) as info:
        call_learner(copy_wild_load, src, dst, 5, -1, BLOCK=8, grid=(1,))
    assert "a read before the start of `src`" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int8])
def test_wild_load_is_recognised_for_each_dtype(device, dtype):
    src, dst = _pair(device, dtype=dtype)
    with pytest.raises(CheckFailed, match="a read past the end of `src`"):
        call_learner(copy_wild_load, src, dst, 5, 1, BLOCK=8, grid=(1,))


def test_a_read_whose_value_is_never_stored_is_reported_in_a_checker_run(device):
    # the load is unmasked but the store is masked: no output ever shows the stray value
    def run_one(case):
        src, dst = _pair(device)
        call_learner(copy_read_unused, src, dst, 5, BLOCK=8, grid=(1,))
        assert dst.tolist() == [1, 2, 3, 4, 5]  # the answer itself is right

    msg = str(_only("five values", run_one))
    assert msg.startswith("[five values] the safety net caught memory accesses outside")
    assert "a read past the end of `src` (3 reads, up to 3 elements out) by program 0" in msg
    assert "tl.store(dst + offs, tl.load(src + offs), mask=mask)" in msg


def test_a_read_is_placed_in_the_part_of_the_kernel_that_made_it(device):
    src = torch.arange(3, dtype=torch.int64, device=device)
    segments = {"out": [kvlab.check.Segment(f"request {r}, part {p}", 2 * r + p - 1, 2 * r + p)
                        for r in range(3) for p in (1, 2)]}

    def run_one_with(kernel):
        def run_one(case):
            out = torch.zeros(6, dtype=torch.int64, device=device)
            call_learner(kernel, src, out, 3, grid=(3,),
                         layout=Layout("request", segments, inputs="src=[0, 1, 2]"))
        return run_one

    # from the kernel's own section comment, and (without comments) from the part it stores next
    for kernel in (two_parts, no_comments):
        msg = str(_only("three requests", run_one_with(kernel)))
        assert "a read past the end of `src` (up to 1 element out) by request 2, part 2" in msg
        assert "inputs: src=[0, 1, 2]" in msg


def test_findings_are_the_same_every_run(device):
    messages = set()
    for _ in range(3):
        src, dst = _pair(device)
        with pytest.raises(CheckFailed) as info:
            call_learner(copy_wild_load, src, dst, 5, 2, BLOCK=8, grid=(1,))
        messages.add(str(info.value))
    assert len(messages) == 1


def test_sentinels_are_distinct_per_argument_and_side():
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.float32,
                  torch.float16, torch.bfloat16, torch.float64):
        bits = [b for slot in range(24) for b in sentinel_bits(slot, dtype)]
        assert len(set(bits)) == len(bits), dtype
    # float sentinels are NaNs, so arithmetic on a wild read stays visibly wrong
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = torch.empty(1, dtype=dtype)
        t.view(int_view_dtype(dtype))[0] = signed(sentinel_bits(3, dtype)[1], int_view_dtype(dtype))
        assert torch.isnan(t).all(), dtype


def test_a_value_computed_from_a_sentinel_is_explained(device):
    free_pages = torch.tensor([3, 5], dtype=torch.int64, device=device)
    out = torch.zeros(3, dtype=torch.int64, device=device)

    def learner(free_pages, out):
        # reads one page too many and turns it into a slot: sentinel * page_size + 1
        for i in range(3):
            out[i] = free_pages.as_strided((3,), (1,))[i] * 4 + 1

    call_learner(learner, free_pages, out)  # the value is not a sentinel itself ...
    with pytest.raises(CheckFailed) as info:  # ... but the comparison explains it
        core.compare_flat([13, 21, 29], out, case="three slots", what="out_indices")
    assert "looks computed from the guard value" in str(info.value)
    assert "read past the end of `free_pages`" in str(info.value)


# --- the order of a grid's programs --------------------------------------------------------------


def test_orders_are_reversed_or_shuffled_never_forwards():
    assert Order("reversed").permutation(4) == [3, 2, 1, 0]
    for seed in range(20):
        order = Order("shuffled", seed).permutation(5)
        assert sorted(order) == list(range(5)) and order not in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0])
        assert order == Order("shuffled", seed).permutation(5)
    assert Order().permutation(3) == [0, 1, 2]


@pytest.mark.parametrize("order", [Order(), Order("reversed"), Order("shuffled", 3)])
def test_the_interpreter_runs_the_programs_in_the_order_asked(device, order):
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.full((5,), -1, dtype=torch.int32, device=device)
    got = sandbox.guarded_call(arrival_order, (counter, out), {}, (5,), order=order,
                               interpret=True)  # on a GPU: in the interpreter's child
    assert got.error is None and got.programs == 5
    arrival = out.tolist()
    assert [arrival.index(k) for k in range(5)] == order.permutation(5)


def test_a_race_on_one_value_is_reported_as_order_dependent(device):
    def run_one_with(kernel):
        def run_one(case):
            values = torch.tensor([1, 2, 3, 4], device=device)
            total = torch.zeros(1, dtype=torch.int64, device=device)
            call_learner(kernel, values, total, grid=(4,))
            if int(total) != 10:
                raise CheckFailed(f"total: expected 10, got {int(total)}", label="total")
        return run_one

    assert core.run_cases("race", [kvlab.check.Case("four", {})] * 3,
                          run_one_with(last_program_stores_the_total), quiet=True) == 3
    msg = str(_only("four values", run_one_with(every_program_stores_the_total)))
    assert "your kernel's answer depends on the order in which its programs run" in msg
    assert "right when they run 0, 1, 2, 3 (one after another)" in msg
    assert "wrong when they run 3, 2, 1, 0 (reversed)" in msg and "total: expected 10" in msg
    assert "pid == tl.num_programs(0) - 1" in msg


# --- crashes, exceptions, hangs: with each kind of child --------------------------------------


def test_a_python_function_killed_by_a_signal_is_reported(child, device):
    def learner(x):
        y = x + 1  # noqa: F841
        os.kill(os.getpid(), signal.SIGSEGV)

    with pytest.raises(CheckFailed) as info:
        call_learner(learner, torch.zeros(2, device=device))
    msg = str(info.value)
    assert "your code crashed the process running it (signal SIGSEGV)" in msg
    assert "in learner, line" in msg and "os.kill(os.getpid(), signal.SIGSEGV)" in msg
    assert torch.arange(3, device=device).sum().item() == 3  # still alive
    src, out = _pair(device)
    call_learner(copy_kernel, src, out, 5, BLOCK=8, grid=(1,))  # and the next call works
    assert out.tolist() == [1, 2, 3, 4, 5]


def test_nonzero_exit_is_reported(child):
    def learner(x):
        os._exit(3)

    with pytest.raises(CheckFailed, match=r"exited with status 3"):
        call_learner(learner, torch.zeros(2))


def test_an_exception_in_the_child_comes_back_with_its_line(child):
    def learner(x):
        return x[10]

    with pytest.raises(LearnerRaised) as info:
        call_learner(learner, torch.zeros(2))
    assert isinstance(info.value.original, IndexError)
    assert "IndexError" in str(info.value) and "return x[10]" in str(info.value)


def test_an_exception_inside_a_kernel_names_the_kernel_line(child, device):
    @triton.jit
    def bad(x, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x + offs, tl.load(x + offs) + undefined_name)  # noqa: F821

    # in the interpreter the kernel raises when it runs; compiled for a GPU, the compile check
    # refuses it before it runs: either way the message names the name and the kernel's line
    with pytest.raises(CheckFailed) as info:
        call_learner(bad, torch.zeros(4, device=device), BLOCK=4, grid=(1,))
    assert "undefined_name" in str(info.value)
    assert isinstance(info.value, LearnerRaised) or "does not compile for a GPU" in str(info.value)


def test_a_hang_is_stopped(child, monkeypatch):
    monkeypatch.setattr(workers, "TIMEOUT_S", 2.0)

    def learner(x):
        while True:
            pass

    with pytest.raises(CheckFailed, match="did not finish within 2 s"):
        call_learner(learner, torch.zeros(2))


def test_prints_and_an_unpicklable_return_value(child, capsys):
    def learner(x):
        print("hello from the learner")
        return x

    call_learner(learner, torch.zeros(2))
    assert "hello from the learner" in capsys.readouterr().out

    def returns_a_function(x):
        return returns_a_function

    with pytest.raises(LearnerRaised, match="could not be sent back"):
        call_learner(returns_a_function, torch.zeros(2))


def test_run_cases_names_the_case_of_a_safety_net_failure(device):
    src, dst = _pair(device)

    def run_one(case):
        call_learner(copy_unmasked_store, src, dst, 5, BLOCK=8, grid=(1,))

    err = _only("five values", run_one)
    assert str(err).startswith("[five values] the safety net caught")
    assert err.case == "five values"


def test_one_child_serves_every_case_of_a_checker_run(child):
    pids = []

    def learner(whole, tail, n):
        tail.fill_(n)  # written through one view, seen through the other (sent over the pipe)
        return os.getpid(), int(whole.sum())

    def run_one(case):
        whole = torch.zeros(6, dtype=torch.int64)
        pid, total = call_learner(learner, whole, whole[3:], case.args["n"])
        assert total == 3 * case.args["n"] and whole.tolist() == [0, 0, 0] + [case.args["n"]] * 3
        pids.append(pid)

    cases = [kvlab.check.Case(f"n={n}", {"n": n}) for n in (1, 2, 3)]
    assert core.run_cases("reuse", cases, run_one, quiet=True) == 3
    assert len(set(pids)) == 1 and pids[0] != os.getpid()
    assert sandbox._WORKER is None  # a fork ends with the checker run; a spawned child stays
    if child == "spawn":
        assert sandbox._SPAWNED[runtime.INTERPRET].alive


def test_a_crash_in_a_later_case_is_reported_and_the_next_call_starts_afresh(child):
    def learner(x, crash):
        if crash:
            os.kill(os.getpid(), signal.SIGSEGV)
        return int(x.sum())

    def run_one(case):
        call_learner(learner, torch.ones(3), case.args["crash"])

    cases = [kvlab.check.Case("fine", {"crash": False}), kvlab.check.Case("boom", {"crash": True})]
    with pytest.raises(CheckFailed, match=r"^\[boom\] your code crashed the process"):
        core.run_cases("crash later", cases, run_one, quiet=True)
    assert call_learner(learner, torch.ones(3), False) == 3


def test_a_kernel_with_a_grid_function_runs_in_a_checker(child, device):
    def run_one(case):
        src, dst = _pair(device, n=case.args["n"])
        call_learner(copy_kernel, src, dst, case.args["n"], BLOCK=8, grid=lambda meta: (1,))
        assert dst.tolist() == list(range(1, case.args["n"] + 1))

    cases = [kvlab.check.Case("3", {"n": 3}), kvlab.check.Case("5", {"n": 5})]
    assert core.run_cases("grid fn", cases, run_one, quiet=True) == 2


# --- the spawned child: functions travel by source ----------------------------------------------

SCALE = tl.constexpr(3)  # compiled Triton reads only constexpr globals


@triton.jit
def _times_scale(x):
    return x * SCALE


@triton.jit
def scale_with_helper(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, _times_scale(tl.load(src + offs, mask=mask)), mask=mask)


def test_a_spawned_child_rebuilds_kernels_helpers_globals_and_closures(monkeypatch, device):
    monkeypatch.setenv("KVLAB_SANDBOX", "spawn")
    src, dst = _pair(device)
    call_learner(scale_with_helper, src, dst, 5, BLOCK=8, grid=(1,))
    assert dst.tolist() == [3, 6, 9, 12, 15]
    offset = 100

    def learner(x):  # a closure over `offset`, defined inside a test
        return x + offset, os.getpid()

    value, pid = call_learner(learner, src)
    assert value.tolist() == [101, 102, 103, 104, 105] and pid != os.getpid()
    worker = sandbox._SPAWNED[runtime.INTERPRET]
    assert worker.alive and worker.startup_s > 0
    print(f"spawned child: start {worker.startup_s:.2f} s (CUDA init {worker.cuda_init_s:.2f} s)")


def test_a_line_in_a_spawned_child_is_the_line_of_the_original_file(monkeypatch):
    monkeypatch.setenv("KVLAB_SANDBOX", "spawn")

    def learner(x):
        return x[10]  # the line the message must quote

    with pytest.raises(LearnerRaised) as info:
        call_learner(learner, torch.zeros(2))
    assert "in learner, line" in str(info.value) and "return x[10]" in str(info.value)


# --- on a GPU: a learner's crash never takes the notebook's CUDA context with it ---------------


@pytest.mark.gpu
def test_gpu_an_out_of_bounds_store_is_reported_and_the_gpu_still_works():
    src, dst = _pair("cuda")
    with pytest.raises(CheckFailed) as info:
        call_learner(copy_unmasked_store, src, dst, 5, BLOCK=8, grid=(1,))
    assert "a write past the end of `dst` (3 writes, up to 3 elements out)" in str(info.value)
    assert dst.tolist() == [1, 2, 3, 4, 5]
    assert (torch.ones(1000, device="cuda") * 2).sum().item() == 2000


@pytest.mark.gpu
def test_gpu_an_illegal_address_is_a_readable_failure_and_the_gpu_still_works():
    dst = torch.zeros(4, dtype=torch.int64, device="cuda")
    with pytest.raises(CheckFailed) as info:
        call_learner(store_far_away, dst, 1 << 40, grid=(1,))
    msg = str(info.value)
    assert "CUDA error" in msg and "your notebook's GPU is fine" in msg
    assert "a write far outside every tensor" in msg  # found again in the interpreter
    x = torch.arange(10, device="cuda")
    assert (x * x).sum().item() == 285  # the notebook's own CUDA context is unharmed
    src, out = _pair("cuda")
    call_learner(copy_kernel, src, out, 5, BLOCK=8, grid=(1,))  # a fresh child takes over
    assert out.tolist() == [1, 2, 3, 4, 5]


@pytest.mark.gpu
def test_gpu_a_device_side_assert_in_python_code_is_reported_and_the_gpu_still_works():
    def learner(pool, slots):
        return pool[slots]  # slot 50 does not exist: a device-side assert on CUDA

    pool = torch.arange(8.0, device="cuda")
    with pytest.raises(CheckFailed) as info:
        call_learner(learner, pool, torch.tensor([1, 50], device="cuda"))
    assert "CUDA error" in str(info.value) or "index" in str(info.value).lower()
    assert torch.cuda.is_available() and (pool + 1).sum().item() == 36


@pytest.mark.gpu
def test_gpu_checker_runs_add_the_audit_pass_in_the_interpreter():
    def run_one(case):
        src, dst = _pair("cuda")
        call_learner(copy_read_unused, src, dst, 5, BLOCK=8, grid=(1,))

    msg = str(_only("five values", run_one))  # compiled, the stray read is invisible
    assert "a read past the end of `src`" in msg
    assert "found by running your kernel again in Triton's interpreter" in msg
