"""The host side of an allocation call: counting host lengths, no reads of the device when
host lengths are given, and the launcher that keeps a compiled kernel.

These run on the CPU (no kernel is launched: the launches are replaced by recorders), so the
interpreter runs check what the GPU runs would only show as time.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab import InvalidArgument, PagedTokenAllocator
from kvlab.alloc import host_checks as alloc_checks, token_allocator
from kvlab.alloc.fast_alloc import alloc_decode_fast, alloc_extend_fast
from kvlab.alloc import fast_alloc_kernels as K
from kvlab.base import launch


def t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=kvlab.DEVICE)


# --- host lengths: the Python path for small batches == the NumPy path == a plain reference ---


def _wrap64(x: int) -> int:
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _extend_ref(pre: list[int], seq: list[int], P: int) -> tuple:
    w = alloc_checks.checksum_weights(len(pre)).tolist()
    ceil = lambda x: -(-x // P)  # noqa: E731
    return (sum(s - p for p, s in zip(pre, seq)), sum(ceil(s) - ceil(p) for p, s in zip(pre, seq)),
            _wrap64(sum(p * x for p, x in zip(pre, w))), _wrap64(sum(s * x for s, x in zip(seq, w))))


def _decode_ref(seq: list[int], P: int) -> tuple:
    w = alloc_checks.checksum_weights(len(seq)).tolist()
    return (len(seq), sum((s - 1) % P == 0 for s in seq), 0, _wrap64(sum(s * x for s, x in zip(seq, w))))


FORMS = {"cpu_tensor": lambda v: torch.tensor(v, dtype=torch.int64), "list": list, "tuple": tuple,
         "numpy": lambda v: np.array(v, dtype=np.int64), "int32_tensor": lambda v: torch.tensor(v, dtype=torch.int32)}


@pytest.mark.parametrize("small_batch", [alloc_checks.SMALL_BATCH, 0], ids=["python_path", "numpy_path"])
@pytest.mark.parametrize("form", FORMS)
@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 20)), max_size=70),
       st.sampled_from([1, 2, 3, 16, 64]))
def test_host_counts_match_a_plain_reference(small_batch, form, requests, P):
    pre = [p for p, _ in requests]
    seq = [p + e for p, e in requests]
    if form == "int32_tensor":
        pre, seq = [p % (1 << 20) for p in pre], [p % (1 << 20) + e for p, e in requests]
    to = FORMS[form]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(alloc_checks, "SMALL_BATCH", small_batch)
        assert tuple(alloc_checks.extend_counts(to(pre), to(seq), P, len(pre))) == _extend_ref(pre, seq, P)
        dec = [s + 1 for s in seq]
        assert tuple(alloc_checks.decode_counts(to(dec), P, len(dec))) == _decode_ref(dec, P)


@pytest.mark.parametrize("small_batch", [alloc_checks.SMALL_BATCH, 0], ids=["python_path", "numpy_path"])
@pytest.mark.parametrize("bs", [3, 40])
def test_host_counts_name_the_first_broken_request(small_batch, bs, monkeypatch):
    monkeypatch.setattr(alloc_checks, "SMALL_BATCH", small_batch)
    pre, seq = [0] * bs, [5] * bs
    seq[bs - 1], pre[bs - 2] = 4, 6  # bs-2: seq < pre; bs-1: fine
    with pytest.raises(InvalidArgument, match=rf"seq_lens_cpu\[{bs - 2}\].*got seq 5 < pre 6"):
        alloc_checks.extend_counts(torch.tensor(pre), torch.tensor(seq), 4, bs)
    pre[1] = -1
    with pytest.raises(InvalidArgument, match=r"prefix_lens_cpu\[1\].*got -1"):
        alloc_checks.extend_counts(torch.tensor(pre), torch.tensor(seq), 4, bs)
    # a seq so negative that seq - pre wraps to a positive int64 is still refused
    with pytest.raises(InvalidArgument, match=r"seq_lens_cpu\[0\]"):
        alloc_checks.extend_counts(torch.tensor([1] + [0] * (bs - 1)), torch.tensor([-(1 << 63)] + [0] * (bs - 1)), 4)
    dec = [3] * bs
    dec[bs - 1] = 0
    with pytest.raises(InvalidArgument, match=rf"seq_lens_cpu\[{bs - 1}\].*got 0"):
        alloc_checks.decode_counts(np.array(dec), 4, bs)


def _outcome(fn, *args):
    try:
        return ("ok", tuple(fn(*args)))
    except InvalidArgument as e:
        return ("error", str(e))


@pytest.mark.parametrize("bad", [[True, 2], [1.0, 2], [np.int64(1), 2], [1 << 63, 2], [-(1 << 63) - 1, 2],
                                 (1, "2"), [0, 1 << 62], [3, (1 << 63) - 1]])
def test_short_host_lists_of_anything_but_small_ints_get_the_numpy_path_verdict(bad, monkeypatch):
    """The Python path takes plain ints with int64 totals; anything else gets the NumPy path's
    checks, errors and int64 arithmetic, exactly as if the Python path did not exist."""
    got = _outcome(alloc_checks.decode_counts, bad, 4, 2), _outcome(alloc_checks.extend_counts, [0, 1], bad, 4, 2)
    monkeypatch.setattr(alloc_checks, "SMALL_BATCH", 0)
    want = _outcome(alloc_checks.decode_counts, bad, 4, 2), _outcome(alloc_checks.extend_counts, [0, 1], bad, 4, 2)
    assert got == want


# --- with host lengths, the allocator reads nothing back from the device ---------------------

_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__array__",
          "nonzero", "unique", "equal")


@pytest.fixture
def device_reads(monkeypatch):
    """Every read-back of a tensor that is not a host copy (on a GPU: a sync), recorded by name.
    The launches are recorded instead of run (the interpreter reads tensors to emulate them)."""
    host_ptrs: set[int] = set()
    reads: list[str] = []
    launches: list[str] = []

    def guard(name, method):
        def wrapper(self, *args, **kwargs):
            if self.data_ptr() not in host_ptrs and not self.is_pinned():  # (pinned: host memory)
                reads.append(name)
            return method(self, *args, **kwargs)
        return wrapper

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    if torch.cuda.is_available():  # on a GPU the allocator waits for its stream, then reads pinned memory
        wait = torch.cuda.Stream.synchronize
        monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                            lambda self: (reads.append("synchronize"), wait(self))[1])
    for name in ("launch_extend", "launch_decode", "launch_extend_check", "launch_extend_fill"):
        monkeypatch.setattr(K, name, lambda *a, _n=name, **k: launches.append(_n))
    # on a GPU the allocator's hot path calls Triton's C launcher directly: send it the same way
    monkeypatch.setattr(token_allocator, "launch_ready", lambda device: None)

    def host(values):
        copy = torch.tensor(values, dtype=torch.int64)
        host_ptrs.add(copy.data_ptr())
        return copy

    return host, reads, launches


@pytest.mark.parametrize("bs", [3, 40])  # the Python path and the NumPy path
def test_host_lengths_path_reads_nothing_back(device_reads, bs):
    host, reads, launches = device_reads
    alloc = PagedTokenAllocator(4 * bs + 8, 4, eager_errors=False)
    pre, seq, last = [0] * bs, [5] * bs, [-1] * bs
    d_pre, d_seq, d_last = t(pre), t(seq), t(last)
    alloc.alloc_extend(d_pre, d_seq, d_last, 5 * bs, prefix_lens_cpu=host(pre), seq_lens_cpu=host(seq))
    alloc.alloc_extend(d_pre, d_seq, d_last, 5 * bs, prefix_lens_cpu=pre, seq_lens_cpu=seq)  # lists
    alloc.alloc_decode(t([6] * bs), t([4] * bs), seq_lens_cpu=host([6] * bs))
    alloc_extend_fast(d_pre, d_seq, d_last, t(list(range(2 * bs))), 4, prefix_lens_cpu=host(pre),
                      seq_lens_cpu=host(seq))
    alloc_decode_fast(t([5] * bs), t([3] * bs), t(list(range(bs))), 4, seq_lens_cpu=host([5] * bs))
    assert launches == ["launch_extend", "launch_extend", "launch_decode", "launch_extend", "launch_decode"]
    assert reads == []
    # the guard sees a read when there is one: without host lengths the call reads its page count
    alloc.alloc_decode(t([7] * bs), t([5] * bs))
    assert reads == (["item"] if alloc._report_host is None else ["synchronize"])


# --- the launcher: compiled kernel kept, device / stream / hooks asked for on every call -------


class _FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "function", "metadata"

    def _init_handles(self):
        pass

    @property
    def run(self):
        return lambda *a: self.log.append(("run", a[:4], a[9:]))

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("hooked", grid, args))


class _FakeKernel:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        def compile_and_launch(*args):
            self.log.append(("compile", grid, args))
            return _FakeCompiled(self.log)
        return compile_and_launch

    def warmup(self, *args, grid):
        self.log.append(("warmup", grid, args))
        return _FakeCompiled(self.log)


class _FakeDriver:
    device, stream = 0, 100

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return self.stream + device


def test_launcher_keeps_the_kernel_but_asks_for_device_stream_and_hooks_each_call(monkeypatch):
    import triton

    knobs = launch._KNOBS
    if knobs is None or not hasattr(getattr(knobs, "launch_enter_hook", None), "add"):
        pytest.skip("this Triton has no launch hook chains")
    driver, log = _FakeDriver(), []
    monkeypatch.setattr(triton.runtime.driver, "_active", driver)
    launcher = launch.Launcher(_FakeKernel(log))
    launcher.direct = True  # what it is on a GPU
    key = (16, torch.int64)
    launcher((2,), (1, 2), key)
    launcher((3,), (4, 5), key)
    driver.stream = 200  # a caller switched streams: the next launch goes there
    launcher((3,), (6, 7), (16, torch.int64))  # an equal key, another tuple
    assert log == [("compile", (2,), (1, 2)), ("run", (3, 1, 1, 100), (4, 5)), ("run", (3, 1, 1, 200), (6, 7))]
    driver.device = 1  # another device: its own compiled kernel
    launcher((1,), (8,), key)
    assert log[-1] == ("compile", (1,), (8,)) and len(launcher.compiled_keys) == 2
    driver.device = 0
    launcher((1,), (9,), key)
    assert log[-1] == ("run", (1, 1, 1, 200), (9,))
    hook = lambda *a: None  # noqa: E731  (a profiler's launch hook: the compiled kernel's own launcher runs)
    knobs.launch_enter_hook.add(hook)
    try:
        launcher((4,), (10,), key)
    finally:
        knobs.launch_enter_hook.remove(hook)
    assert log[-1] == ("hooked", (4, 1, 1), (10,))
    assert launcher.warmup((1,), (0,), ("other",)) >= 0 and log[-1][0] == "warmup"
    launcher((5,), (11,), ("other",))
    assert log[-1] == ("run", (5, 1, 1, 200), (11,))


class _FakeRun:
    """What c_entry reads of a compiled kernel's launcher (``compiled.run``)."""

    def __init__(self, launch_fn, **attrs):
        self.launch, self.launch_cooperative_grid, self.launch_pdl = launch_fn, False, False
        self.global_scratch_size = self.profile_scratch_size = 0
        self.__dict__.update(attrs)


class _FakeCompiledForEntry:
    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, 77, (4, 1, 0)


def test_c_entries_call_each_tritons_launcher_in_its_own_order():
    """The argument order of each known launcher (read from that Triton's driver.py)."""
    seen = []
    record = lambda *a: seen.append(a)  # noqa: E731
    launch._entry_triton36(_FakeRun(record), 77, (4, 1, 0))(5, 123, ("p", 9))
    assert seen[-1] == (5, 1, 1, 123, 77, False, False, None, None, (4, 1, 0), None, None, None, "p", 9)
    launch._entry_triton37(_FakeRun(record, arg_annotations="ann", kernel_signature=b"sig"), 77, (4, 1, 0))(
        5, 123, ("p", 9))
    assert seen[-1] == (5, 1, 1, 123, 77, False, False, (4, 1, 0), None, None, None, None, None, "ann", b"sig",
                        ("p", 9))


def test_c_entry_only_where_the_launcher_is_known(monkeypatch):
    builtin = len  # a C function, as Triton's launchers are
    compiled = _FakeCompiledForEntry(_FakeRun(builtin))
    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 6))
    assert launch.c_entry(compiled) is not None
    for attrs in ({"global_scratch_size": 64}, {"profile_scratch_size": 8}, {"gsan_enabled": True}):
        assert launch.c_entry(_FakeCompiledForEntry(_FakeRun(builtin, **attrs))) is None  # buffers to allocate
    assert launch.c_entry(_FakeCompiledForEntry(_FakeRun(lambda *a: None))) is None  # a Python wrapper
    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 8))
    assert launch.c_entry(compiled) is None  # 3.7+ launchers take annotations: this one has none
    assert launch.c_entry(_FakeCompiledForEntry(_FakeRun(builtin, arg_annotations=(), kernel_signature=b""))) \
        is not None
    monkeypatch.setattr(launch, "TRITON_VERSION", (4, 0))  # a Triton nobody has read: its own wrapper
    assert launch.c_entry(compiled) is None
    assert launch._version("3.10.0rc1") == (3, 10) and launch._version("3.6.0+git1") == (3, 6)
