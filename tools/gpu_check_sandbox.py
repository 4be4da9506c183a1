"""What the checkers' safety net costs, and a smoke test that it keeps the GPU usable.

    python tools/gpu_check_sandbox.py          # make gpu-check runs it after the tests

On a GPU, learner code runs in a *spawned* child process (kvlab.course.checking.workers): a crash or an
illegal address there cannot take the notebook's CUDA context with it. This script measures,
side by side in one run, what that costs per check, and prints one line per number:

* starting the child (a new Python importing torch and kvlab) and its CUDA init;
* the first call of a kernel in it (sending the source, compiling, running) and a warm call,
  next to the same kernel called in this process (first call = compile, then warm);
* a whole checker run (kvlab.check.alloc_decode on its reference kernel): in this process
  (KVLAB_SANDBOX=inprocess), in a fresh spawned child (start included), in the warm child,
  and the audit pass in Triton's interpreter that checker runs add on a GPU (KVLAB_AUDIT=0
  leaves it out);
* the compile check (kvlab.course.checking.compiled): a new learner kernel compiled for the GPU, cold,
  and the same kernel again (its verdict is kept).

Triton compiles into an empty cache directory here, so "compile" is a cold compile. Then it
plants an out-of-bounds store, an illegal address and a kernel the compiler refuses (a loop
carry that starts as an int32 and becomes an int64), and checks that each is reported and that
a CUDA tensor operation in this process still works afterwards (PASS/FAIL; exit status 1 on a
FAIL). Without a GPU the same runs in the interpreter (the child then runs Triton's interpreter).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kvlab-triton-cache-"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvlab  # noqa: E402  (first: without CUDA it switches Triton to its interpreter)
import kvlab.check  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kvlab.check import CheckFailed, call_learner  # noqa: E402
from kvlab.course.checking import compiled, sandbox, workers  # noqa: E402


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def copy_unmasked_store(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n, other=0))  # planted: store unmasked


@triton.jit
def store_far_away(dst, far):
    offs = tl.arange(0, 4)
    tl.store(dst + offs + far, offs.to(tl.int64))  # planted: an illegal address on a GPU


@triton.jit
def scan_int32_carry(x, out, n, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    carry = 0  # planted: an int32 that the loop makes an int64 (a GPU's compiler refuses it)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        v = tl.load(x + offs, mask=offs < n, other=0).to(tl.int64)
        tl.store(out + offs, carry + tl.cumsum(v, axis=0) - v, mask=offs < n)
        carry += tl.sum(v, axis=0)


@triton.jit
def scan_int64_carry(x, out, n, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        v = tl.load(x + offs, mask=offs < n, other=0).to(tl.int64)
        tl.store(out + offs, carry + tl.cumsum(v, axis=0) - v, mask=offs < n)
        carry += tl.sum(v, axis=0)


def seconds(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def row(what: str, value: str) -> None:
    print(f"  {what:<68} {value}", flush=True)


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quiet(fn):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


def costs(device) -> None:
    n = 1000
    src = torch.arange(n, dtype=torch.int64, device=device)
    dst = torch.zeros(n, dtype=torch.int64, device=device)
    sandbox.close_spawned()
    worker = sandbox._SPAWNED[kvlab.INTERPRET] = workers.SpawnWorker()
    row("spawned child: start (Python, torch and kvlab imports)",
        f"{worker.startup_s - worker.cuda_init_s:.2f} s")
    row("spawned child: CUDA init", f"{worker.cuda_init_s:.2f} s")
    with env(KVLAB_SANDBOX="spawn"):
        first = seconds(lambda: call_learner(copy_kernel, src, dst, n, BLOCK=1024, grid=(1,)))
        warm = seconds(lambda: call_learner(copy_kernel, src, dst, n, BLOCK=1024, grid=(1,)), 5)
    assert dst.tolist() == src.tolist()
    row("kernel in the child: first call (send source, compile, run)", f"{first:.2f} s")
    row("kernel in the child: warm call (guard bands, pipe both ways)", f"{warm * 1e3:.1f} ms")
    other = torch.zeros(n, dtype=torch.int64, device=device)

    @triton.jit
    def copy_here(src, dst, n, BLOCK: tl.constexpr):  # another kernel: compiles afresh here
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    def bare():
        copy_here[(1,)](src, other, n, BLOCK=1024)
        if device.type == "cuda":
            torch.cuda.synchronize()

    row("the same kernel in this process: first call (compile, run)", f"{seconds(bare):.2f} s")
    row("the same kernel in this process: warm call", f"{seconds(bare, 5) * 1e3:.2f} ms")

    x, out = src[:100], torch.zeros(100, dtype=torch.int64, device=device)
    compiled.close_child()
    cold = seconds(lambda: compiled.problem(scan_int64_carry, (x, out, 100), {"BLOCK": 32}))
    kept = seconds(lambda: compiled.problem(scan_int64_carry, (x, out, 100), {"BLOCK": 32}), 5)
    where = "in this process" if not kvlab.INTERPRET else "in its child, started first"
    row(f"compile check: a new kernel, cold ({where})", f"{cold:.2f} s")
    row("compile check: the same kernel again (verdict kept)", f"{kept * 1e6:.0f} us")

    from kvlab.alloc.alloc_kernels import alloc_decode_kernel

    def check():
        return quiet(lambda: kvlab.check.alloc_decode(alloc_decode_kernel, n_random=4))

    with env(KVLAB_SANDBOX="inprocess"):
        row("checker alloc_decode (11 cases): in this process", f"{seconds(check):.2f} s")
    if kvlab.INTERPRET:
        with env(KVLAB_SANDBOX="auto"):
            row("checker alloc_decode: in a forked child (the interpreter's default)",
                f"{seconds(check):.2f} s")
    sandbox.close_spawned()
    with env(KVLAB_SANDBOX="spawn", KVLAB_AUDIT="0"):
        row("checker alloc_decode: in a fresh spawned child (start included)",
            f"{seconds(check):.2f} s")
        row("checker alloc_decode: in the warm spawned child", f"{seconds(check):.2f} s")
    if not kvlab.INTERPRET:
        with env(KVLAB_SANDBOX="auto", KVLAB_AUDIT="1"):
            row("checker alloc_decode: warm child + audit pass (interpreter child starts)",
                f"{seconds(check):.2f} s")
            row("checker alloc_decode: warm child + audit pass (both children warm)",
                f"{seconds(check):.2f} s")


def safety(device) -> bool:
    ok = True

    def verdict(name: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= passed
        print(f"  {'PASS' if passed else 'FAIL'}  {name}" + ("" if passed else f"\n{detail}"))

    def gpu_still_works() -> bool:
        x = torch.arange(10, device=device)
        return int((x * x).sum()) == 285

    src = torch.arange(1, 6, dtype=torch.int64, device=device)
    dst = torch.zeros(5, dtype=torch.int64, device=device)
    try:
        call_learner(copy_unmasked_store, src, dst, 5, BLOCK=8, grid=(1,))
        verdict("a planted out-of-bounds store is reported", False, "  (it was not)")
    except CheckFailed as e:
        verdict("a planted out-of-bounds store is reported",
                "a write past the end of `dst`" in str(e), str(e))
    verdict("  ... and a tensor operation in this process works afterwards", gpu_still_works(), "")
    far = torch.zeros(4, dtype=torch.int64, device=device)
    try:
        call_learner(store_far_away, far, 1 << 40, grid=(1,))
        verdict("a planted illegal address is reported", False, "  (it was not)")
    except CheckFailed as e:
        verdict("a planted illegal address is reported", "far outside every tensor" in str(e), str(e))
    verdict("  ... and a tensor operation in this process works afterwards", gpu_still_works(), "")
    x, out = torch.arange(10, dtype=torch.int64, device=device), torch.zeros(10, dtype=torch.int64,
                                                                             device=device)
    try:
        call_learner(scan_int32_carry, x, out, 10, BLOCK=4, grid=(1,))
        verdict("a kernel the compiler refuses is reported", False, "  (it was not)")
    except CheckFailed as e:
        verdict("a kernel the compiler refuses is reported, with its line",
                e.label == "compile" and "Loop-carried variable carry" in str(e)
                and "carry = 0" in str(e), str(e))
    verdict("  ... and a tensor operation in this process works afterwards", gpu_still_works(), "")
    return ok


def main() -> int:
    info = kvlab.base.runtime.runtime_info()
    device = kvlab.DEVICE
    print(f"kvlab safety net: cost per check on {info.device_name} ({info.mode}), torch "
          f"{info.torch_version}, triton {info.triton_version}; Triton cache "
          f"{os.environ['TRITON_CACHE_DIR']} (cold)")
    costs(device)
    print("kvlab safety net: planted bugs")
    ok = safety(device)
    sandbox.close_spawned()
    compiled.close_child()
    print("gpu_check_sandbox: " + ("all PASS" if ok else "FAIL (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
