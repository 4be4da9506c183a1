"""The safety net around learner code (kvlab.check.sandbox): guard bands, child process, crashes."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import triton
import triton.language as tl

import kvlab.check  # noqa: F401  (installs the safety net into call_learner)
from kvlab.check import CheckFailed, LearnerRaised, call_learner, core, sandbox

needs_fork = pytest.mark.skipif(not sandbox.can_fork(),
                                reason="a child process is used only in the interpreter on Linux")


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
def store_far_away(dst, far):
    offs = tl.arange(0, 4)
    tl.store(dst + offs + far, offs.to(tl.int64))


@triton.jit
def scale_rows(table, stride_row, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    ptr = table + row * stride_row + offs
    tl.store(ptr, tl.load(ptr, mask=mask) * 10, mask=mask)


def _pair(device, n=5, dtype=torch.int64):
    src = torch.arange(1, n + 1, dtype=dtype, device=device)
    dst = torch.zeros(n, dtype=dtype, device=device)
    return src, dst


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


def test_objects_run_in_process_so_their_changes_stay(device):
    class Box:
        def __init__(self):
            self.items = []

    box = Box()

    def learner(b, x):
        b.items.append(int(x.sum()))

    call_learner(learner, box, torch.ones(3, device=device))
    assert box.items == [3]


@pytest.mark.parametrize("mode", ["auto", "inprocess"])
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


def test_methods_run_in_process_so_their_object_keeps_its_changes(device):
    class Counter:
        def __init__(self):
            self.calls = 0

        def bump(self, x):
            self.calls += int(x.numel())

    counter = Counter()
    call_learner(counter.bump, torch.ones(4, device=device))
    assert counter.calls == 4


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
    assert "`dst`: 3 value(s) written past the end, up to 3 element(s) out" in msg
    assert "`src`" not in msg.split("\n")[1]
    assert dst.tolist() == [1, 2, 3, 4, 5]  # the real data still came back


def test_store_before_the_start_is_named(device):
    src, dst = _pair(device)
    with pytest.raises(CheckFailed) as info:
        call_learner(copy_store_before, src, dst, 5, 2, BLOCK=8, grid=(1,))
    assert "`dst`: 2 value(s) written before its start, up to 2 element(s) before it" in str(
        info.value)
    assert info.value.band_writes == [sandbox.BandWrite("dst", "before", [2, 1], 5)]


@triton.jit
def store_one(dst, at):
    tl.store(dst + at, 1)


def test_a_store_at_the_edge_of_the_band_says_it_may_have_gone_further(device):
    dst = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(CheckFailed) as info:  # the last element of the band, no further
        call_learner(store_one, dst, 4 + sandbox.BAND - 1, grid=(1,))
    msg = str(info.value)
    assert f"`dst`: 1 value(s) written past the end, up to {sandbox.BAND} element(s) out" in msg
    assert "the whole guard band" in msg


# --- reads outside a tensor --------------------------------------------------------------


def test_wild_load_past_the_end_names_the_source(device):
    src, dst = _pair(device)
    with pytest.raises(CheckFailed) as info:
        call_learner(copy_wild_load, src, dst, 5, 2, BLOCK=8, grid=(1,))
    msg = str(info.value)
    assert "`dst[3]` holds the guard sentinel" in msg
    assert "read past the end of `src`" in msg


def test_wild_load_before_the_start_names_the_source(device):
    src, dst = _pair(device)
    with pytest.raises(CheckFailed) as info:
        call_learner(copy_wild_load, src, dst, 5, -1, BLOCK=8, grid=(1,))
    msg = str(info.value)
    assert "`dst[0]` holds the guard sentinel" in msg and "before the start of `src`" in msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int8])
def test_wild_load_is_recognised_for_each_dtype(device, dtype):
    src, dst = _pair(device, dtype=dtype)
    with pytest.raises(CheckFailed, match="read past the end of `src`"):
        call_learner(copy_wild_load, src, dst, 5, 1, BLOCK=8, grid=(1,))


def test_sentinels_are_distinct_per_argument_and_side():
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.float32,
                  torch.float16, torch.bfloat16, torch.float64):
        bits = [b for slot in range(sandbox._MAX_SENTINEL_SLOTS)
                for b in sandbox.sentinel_bits(slot, dtype)]
        assert len(set(bits)) == len(bits), dtype
    # float sentinels are NaNs, so arithmetic on a wild read stays visibly wrong
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = torch.empty(1, dtype=dtype)
        t.view(sandbox._int_view_dtype(dtype))[0] = sandbox._signed(
            sandbox.sentinel_bits(3, dtype)[1], sandbox._int_view_dtype(dtype))
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
    assert "looks computed from the guard sentinel" in str(info.value)
    assert "read past the end of `free_pages`" in str(info.value)


# --- crashes, exceptions, hangs ----------------------------------------------------------


@needs_fork
def test_a_kernel_that_segfaults_is_reported_and_the_process_survives(device):
    dst = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(CheckFailed) as info:
        call_learner(store_far_away, dst, 1 << 40, grid=(1,))
    msg = str(info.value)
    assert "crashed the interpreter (signal SIGSEGV)" in msg
    assert "unmasked load or store" in msg
    assert "in store_far_away" in msg and "tl.store(dst + offs + far" in msg
    # still alive, and a correct kernel still runs afterwards
    src, out = _pair(device)
    call_learner(copy_kernel, src, out, 5, BLOCK=8, grid=(1,))
    assert out.tolist() == [1, 2, 3, 4, 5]


@needs_fork
def test_a_python_function_killed_by_a_signal_is_reported():
    def learner(x):
        os.kill(os.getpid(), signal.SIGSEGV)

    with pytest.raises(CheckFailed, match=r"signal SIGSEGV") as info:
        call_learner(learner, torch.zeros(2))
    assert "in learner" in str(info.value)


@needs_fork
def test_abort_and_nonzero_exit_are_reported():
    with pytest.raises(CheckFailed, match=r"signal SIGABRT"):
        call_learner(lambda x: os.abort(), torch.zeros(2))
    with pytest.raises(CheckFailed, match=r"exited with status 3"):
        call_learner(lambda x: os._exit(3), torch.zeros(2))


@needs_fork
def test_an_exception_in_the_child_comes_back_with_its_line():
    def learner(x):
        return x[10]

    with pytest.raises(LearnerRaised) as info:
        call_learner(learner, torch.zeros(2))
    assert isinstance(info.value, CheckFailed)
    assert isinstance(info.value.original, IndexError)
    assert "IndexError" in str(info.value) and "return x[10]" in str(info.value)


@needs_fork
def test_an_exception_inside_a_kernel_names_the_kernel_line():
    @triton.jit
    def bad(x, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x + offs, tl.load(x + offs) + undefined_name)  # noqa: F821

    with pytest.raises(LearnerRaised) as info:
        call_learner(bad, torch.zeros(4), BLOCK=4, grid=(1,))
    assert "undefined_name" in str(info.value)


@needs_fork
def test_a_hang_is_stopped(monkeypatch):
    monkeypatch.setattr(sandbox, "TIMEOUT_S", 1.0)

    def learner(x):
        while True:
            pass

    with pytest.raises(CheckFailed, match="did not finish within 1 s"):
        call_learner(learner, torch.zeros(2))


@needs_fork
def test_prints_in_the_child_reach_the_parent(capsys):
    def learner(x):
        print("hello from the learner")

    call_learner(learner, torch.zeros(2))
    assert "hello from the learner" in capsys.readouterr().out


@needs_fork
def test_an_unpicklable_return_value_is_reported():
    with pytest.raises(LearnerRaised, match="could not be sent back"):
        call_learner(lambda x: (lambda: 1), torch.zeros(2))


# --- through the checker framework ---------------------------------------------------------


def test_run_cases_names_the_case_of_a_safety_net_failure(device):
    src, dst = _pair(device)

    def run_one(case):
        call_learner(copy_unmasked_store, src, dst, 5, BLOCK=8, grid=(1,))

    with pytest.raises(CheckFailed) as info:
        core.run_cases("copy", [core.Case("five values", {})], run_one, quiet=True)
    assert str(info.value).startswith("[five values] the safety net caught")
    assert info.value.case == "five values"


# --- one child for a whole checker run ------------------------------------------------------


@needs_fork
def test_one_child_serves_every_case_of_a_checker_run_and_ends_with_it():
    pids = []

    def learner(whole, tail, n):
        tail.fill_(n)  # written through one view, seen through the other (sent over the pipe)
        return os.getpid(), int(whole.sum())

    def run_one(case):
        whole = torch.zeros(6, dtype=torch.int64)
        pid, total = call_learner(learner, whole, whole[3:], case.args["n"])
        assert total == 3 * case.args["n"] and whole.tolist() == [0, 0, 0] + [case.args["n"]] * 3
        pids.append(pid)

    cases = [core.Case(f"n={n}", {"n": n}) for n in (1, 2, 3)]
    assert core.run_cases("reuse", cases, run_one, quiet=True) == 3
    assert len(set(pids)) == 1 and pids[0] != os.getpid()
    assert sandbox._WORKER is None  # the child ended with the checker run


@needs_fork
def test_a_crash_in_a_later_case_is_reported_and_the_next_run_starts_afresh():
    def learner(x, crash):
        if crash:
            os.kill(os.getpid(), signal.SIGSEGV)
        return int(x.sum())

    def run_one(case):
        call_learner(learner, torch.ones(3), case.args["crash"])

    cases = [core.Case("fine", {"crash": False}), core.Case("boom", {"crash": True})]
    with pytest.raises(CheckFailed, match=r"^\[boom\] the kernel crashed the interpreter"):
        core.run_cases("crash later", cases, run_one, quiet=True)
    assert sandbox._WORKER is None
    assert call_learner(learner, torch.ones(3), False) == 3


@needs_fork
def test_a_kernel_with_a_grid_function_runs_in_a_checker(device):
    def run_one(case):
        src, dst = _pair(device, n=case.args["n"])
        call_learner(copy_kernel, src, dst, case.args["n"], BLOCK=8,
                     grid=lambda meta: (1,))  # a lambda cannot be sent: a fresh child inherits it
        assert dst.tolist() == list(range(1, case.args["n"] + 1))

    assert core.run_cases("grid fn", [core.Case("3", {"n": 3}), core.Case("5", {"n": 5})],
                          run_one, quiet=True) == 2
