"""The host counts of an allocation in one C call (chapter 09).

With host copies of the lengths, a public allocation call counts on the host what the batch
needs (tokens, new pages, the checksums the kernel compares) and checks the rules on every
request (:func:`kvlab.alloc.host_checks.extend_counts`). In NumPy that is about ten calls, each
about a microsecond of dispatch whatever the batch size: on a server CPU more than the launch
itself. The same pass written as one C loop is one call::

    per request r:   bad      |= pre[r] < 0  or  seq[r] < pre[r]
                     tokens   += seq[r] - pre[r]                          (unsigned 64-bit:
                     pages    += ceil(seq[r] / P) - ceil(pre[r] / P)       no term wraps, and
                     high     |= tokens | pages                            bit 63 of high says
                     sum_pre  += pre[r] * w[r]      sum_seq += seq[r] * w[r]   a total reached 2**63)

The checksums wrap (as NumPy's int64 sums and the kernels' do): they are compared, never
used as sizes. The totals are: each term is below 2**63, so a total that reaches 2**63 does
so without wrapping 64 bits first, and sets bit 63 for good.

The C source below is compiled once per machine with the system's C compiler (the one Triton
uses for its launchers) into kvlab's cache folder, with its size and SHA-256 written beside it,
and loaded with :mod:`ctypes` when an allocator is built. Before loading, the file is checked
against that record (a library cut short would crash the interpreter on load: it is rebuilt
instead); after binding, the helper counts a few batches whose answers are known. It covers
the common case only: int64, contiguous CPU tensors, P a power of two, every rule kept, totals
below 2**63. Anything else, including a broken rule (to name the request) or totals of 2**63
and more (counted exactly, in Python integers), goes to the NumPy code, which gives the same
answers (a test compares them on random batches). Without a compiler, with a helper that
cannot be built, loaded, bound or trusted, or with ``KVLAB_NO_NATIVE=1``, NumPy does
everything; :func:`status` says which, and why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

SOURCE = r"""
#include <stdint.h>
/* exported whatever the compiler's default visibility (-fvisibility=hidden would hide them) */
#define KVLAB_EXPORT __attribute__((visibility("default")))

/* out: tokens, pages, sum_pre, sum_seq. Returns nonzero if a request breaks a rule or a total
   reaches 2**63. Unsigned arithmetic: wrapping, never undefined. */
KVLAB_EXPORT int64_t kvlab_extend_counts(const int64_t *pre, const int64_t *seq, const int64_t *w,
                                         int64_t n, int64_t shift, int64_t *out) {
    const uint64_t m = ((uint64_t)1 << shift) - 1;
    uint64_t tokens = 0, pages = 0, sum_pre = 0, sum_seq = 0, bad = 0, high = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t a = pre[i], b = seq[i];
        const uint64_t ua = (uint64_t)a, ub = (uint64_t)b;
        bad |= (uint64_t)(a < 0) | (uint64_t)(b < a);
        tokens += ub - ua;                                    /* each term < 2**63 ... */
        pages += ((ub + m) >> shift) - ((ua + m) >> shift);   /* (ub + m < 2**64: no wrap) */
        high |= tokens | pages;                               /* ... so bit 63 marks a total >= 2**63 */
        sum_pre += ua * (uint64_t)w[i];
        sum_seq += ub * (uint64_t)w[i];
    }
    out[0] = (int64_t)tokens; out[1] = (int64_t)pages; out[2] = (int64_t)sum_pre; out[3] = (int64_t)sum_seq;
    return (int64_t)(bad | (high >> 63));
}

/* out: pages, sum_seq. Returns nonzero if a request has seq < 1. */
KVLAB_EXPORT int64_t kvlab_decode_counts(const int64_t *seq, const int64_t *w, int64_t n, int64_t shift, int64_t *out) {
    const uint64_t m = ((uint64_t)1 << shift) - 1;
    uint64_t pages = 0, sum_seq = 0, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = seq[i];
        bad |= (uint64_t)(b < 1);
        pages += (uint64_t)(m == 0) | (uint64_t)((((uint64_t)b) & m) == 1);  /* (seq - 1) % P == 0 */
        sum_seq += (uint64_t)b * (uint64_t)w[i];
    }
    out[0] = (int64_t)pages; out[1] = (int64_t)sum_seq;
    return (int64_t)bad;
}
"""

_LOCK = threading.Lock()
_STATE: dict = {"lib": None, "tried": False, "status": "not loaded yet"}


def cache_dir() -> str:
    """Where the compiled helper is kept: ``$KVLAB_CACHE_DIR``, else ``~/.cache/kvlab``."""
    root = os.environ.get("KVLAB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvlab")
    return root


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(path: str, cc: str) -> None:
    """Compile :data:`SOURCE` into ``path``, with its size and SHA-256 in ``path + ".sha256"``
    (each written under a temporary name, then renamed: several processes may build at once,
    and none ever loads a half-written file)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, lib, record = (os.path.join(tmp, name) for name in ("counts.c", "counts.so", "counts.sha256"))
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([cc, "-O3", "-shared", "-fPIC", "-o", lib, src], check=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        with open(lib, "rb") as f:
            data = f.read()
        with open(record, "w") as f:
            f.write(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
        os.replace(record, path + ".sha256")
        os.replace(lib, path)


def _intact(path: str) -> bool:
    """Whether ``path`` is the library its build recorded (size and SHA-256): a file cut short,
    overwritten or without its record is not loaded."""
    try:
        with open(path + ".sha256") as f:
            size, digest = f.read().split()
        with open(path, "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return False
    return len(data) == int(size) and hashlib.sha256(data).hexdigest() == digest


def _bind(lib) -> None:
    """Declare the helper's two functions (AttributeError if the library lacks them)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvlab_extend_counts.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
    lib.kvlab_decode_counts.argtypes = [ptr, ptr, i64, i64, ptr]
    lib.kvlab_extend_counts.restype = lib.kvlab_decode_counts.restype = i64


def _self_test(lib) -> str | None:
    """Count batches whose answers are known; what went wrong, or None."""
    arr = lambda *v: (ctypes.c_int64 * len(v))(*v)  # noqa: E731
    w, out = arr(1, 2, 3), arr(0, 0, 0, 0)
    got = lib.kvlab_extend_counts(arr(0, 3, 5), arr(5, 70, 5), w, 3, 4, out), out[:]
    if got != (0, [72, 5, 21, 160]):  # P = 16: tokens, pages, sum(pre * w), sum(seq * w)
        return f"extend counts {got}"
    if not lib.kvlab_extend_counts(arr(0, 0), arr(1 << 62, 1 << 62), w, 2, 0, out):
        return "a total of 2**63 tokens went unnoticed"
    if not lib.kvlab_extend_counts(arr(4), arr(3), w, 1, 0, out):
        return "seq < pre went unnoticed"
    got = lib.kvlab_decode_counts(arr(1, 17, 5), w, 3, 4, out), out[:2]
    return None if got == (0, [2, 50]) else f"decode counts {got}"


def _load():
    if os.environ.get("KVLAB_NO_NATIVE"):
        return None, "off (KVLAB_NO_NATIVE is set): NumPy counts"
    cc = _compiler()
    machine = f"{sys.platform}-{platform.machine()}"  # (a shared home may serve other machines)
    tag = hashlib.sha256((SOURCE + machine + (cc or "")).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"counts-{tag}.so")
    step, note = "build", ""
    try:
        if not _intact(path):
            if cc is None:
                return None, "no C compiler found (set CC): NumPy counts"
            if os.path.exists(path):
                note = "; rebuilt: the cached copy did not match its recorded size and checksum"
            _build(path, cc)
            if not _intact(path):
                raise OSError("the library just built does not match its record")
        step = "load"
        lib = ctypes.CDLL(path)
        step = "bind"
        _bind(lib)
        problem = _self_test(lib)
    except Exception as e:  # any failure: NumPy counts, and why
        return None, f"could not {step} {path} ({type(e).__name__}: {e}): NumPy counts"[:500]
    if problem:
        return None, f"{path} failed its self-test ({problem}): NumPy counts"
    return lib, f"C ({path}{note})"


def load() -> bool:
    """Build (once per machine) and load the helper; True if it is in use. Allocators call it
    when they are built, so that no allocation call waits for a compiler."""
    if not _STATE["tried"]:
        with _LOCK:
            if not _STATE["tried"]:
                _STATE["lib"], _STATE["status"] = _load()
                _STATE["tried"] = True
    return _STATE["lib"] is not None


def status() -> str:
    """How host counts are made here: in C (and from where), or NumPy and why."""
    load()
    return _STATE["status"]


_OUT4, _OUT2 = ctypes.c_int64 * 4, ctypes.c_int64 * 2


def extend(pre_addr: int, seq_addr: int, weights_addr: int, n: int, shift: int) -> list | None:
    """``[tokens, pages, sum_pre, sum_seq]`` of ``n`` int64 lengths at the two addresses, or
    None (no helper, a request the NumPy code must judge, or a total of 2**63 or more). ``weights_addr``: ``n`` int64
    checksum weights; ``shift``: log2 of the page size."""
    lib = _STATE["lib"]
    if lib is None:
        return None
    out = _OUT4()
    return None if lib.kvlab_extend_counts(pre_addr, seq_addr, weights_addr, n, shift, out) else out[:]


def decode(seq_addr: int, weights_addr: int, n: int, shift: int) -> list | None:
    """``[pages, sum_seq]`` of a decode step's ``n`` int64 lengths (after the new token), or None."""
    lib = _STATE["lib"]
    if lib is None:
        return None
    out = _OUT2()
    return None if lib.kvlab_decode_counts(seq_addr, weights_addr, n, shift, out) else out[:]
