"""The host counts of an allocation in one C call (chapter 09).

With host copies of the lengths, a public allocation call counts on the host what the batch
needs (tokens, new pages, the checksums the kernel compares) and checks the rules on every
request (:func:`kvlab.alloc_checks.extend_counts`). In NumPy that is about ten calls, each
about a microsecond of dispatch whatever the batch size: on a server CPU more than the launch
itself. The same pass written as one C loop is one call::

    per request r:   bad      |= pre[r] < 0  or  seq[r] < pre[r]  or  seq[r] >= 2**62
                     tokens   += seq[r] - pre[r]
                     pages    += ceil(seq[r] / P) - ceil(pre[r] / P)      (shifts: P = 2**s)
                     sum_pre  += pre[r] * w[r]      sum_seq += seq[r] * w[r]   (wrapping, as NumPy)

The C source below is compiled once per machine with the system's C compiler (the one Triton
uses for its launchers) into kvlab's cache folder, and loaded with :mod:`ctypes` when an
allocator is built. It covers the common case only: int64, contiguous CPU tensors, P a power
of two, every rule kept. Anything else, including a broken rule (to name the request) or
lengths of 2**62 and more, goes to the NumPy code, which gives the same answers (a test
compares them on random batches). Without a compiler, or with ``KVLAB_NO_NATIVE=1``, NumPy
does everything; :func:`status` says which.
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

/* out: tokens, pages, sum_pre, sum_seq. Returns nonzero if a request breaks a rule. */
int64_t kvlab_extend_counts(const int64_t *pre, const int64_t *seq, const int64_t *w, int64_t n,
                            int64_t shift, int64_t *out) {
    const uint64_t m = ((uint64_t)1 << shift) - 1;
    uint64_t tokens = 0, pages = 0, sum_pre = 0, sum_seq = 0, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t a = pre[i], b = seq[i];
        const uint64_t ua = (uint64_t)a, ub = (uint64_t)b;   /* unsigned: wrapping, never UB */
        bad |= (uint64_t)(a < 0) | (uint64_t)(b < a) | (uint64_t)(b >= ((int64_t)1 << 62));
        tokens += ub - ua;
        pages += ((ub + m) >> shift) - ((ua + m) >> shift);
        sum_pre += ua * (uint64_t)w[i];
        sum_seq += ub * (uint64_t)w[i];
    }
    out[0] = (int64_t)tokens; out[1] = (int64_t)pages; out[2] = (int64_t)sum_pre; out[3] = (int64_t)sum_seq;
    return (int64_t)bad;
}

/* out: pages, sum_seq. Returns nonzero if a request has seq < 1. */
int64_t kvlab_decode_counts(const int64_t *seq, const int64_t *w, int64_t n, int64_t shift, int64_t *out) {
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
    """Compile :data:`SOURCE` into ``path`` (written under a temporary name, then renamed:
    several processes may build at once, and none ever loads a half-written file)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, lib = os.path.join(tmp, "counts.c"), os.path.join(tmp, "counts.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([cc, "-O3", "-shared", "-fPIC", "-o", lib, src], check=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        os.replace(lib, path)


def _load():
    if os.environ.get("KVLAB_NO_NATIVE"):
        return None, "off (KVLAB_NO_NATIVE is set): NumPy counts"
    cc = _compiler()
    machine = f"{sys.platform}-{platform.machine()}"  # (a shared home may serve other machines)
    tag = hashlib.sha256((SOURCE + machine + (cc or "")).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"counts-{tag}.so")
    try:
        if not os.path.exists(path):
            if cc is None:
                return None, "no C compiler found (set CC): NumPy counts"
            _build(path, cc)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build or load {path} ({type(e).__name__}): NumPy counts"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvlab_extend_counts.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
    lib.kvlab_decode_counts.argtypes = [ptr, ptr, i64, i64, ptr]
    lib.kvlab_extend_counts.restype = lib.kvlab_decode_counts.restype = i64
    return lib, f"C ({path})"


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
    None (no helper, or a request the NumPy code must judge). ``weights_addr``: ``n`` int64
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
