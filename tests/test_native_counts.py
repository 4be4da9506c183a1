"""The host counts' C helper (kvlab.alloc.native_counts) gives what the NumPy code gives, and steps
aside (None) wherever the NumPy code must judge: broken rules, totals of 2**63, other layouts.
A damaged cached copy, or a compiler whose library cannot be bound or trusted, never crashes the
interpreter: the helper is rebuilt, or NumPy counts and status() says why."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import InvalidArgument
from kvlab.alloc import host_checks as alloc_checks, native_counts

pytestmark = pytest.mark.skipif(not native_counts.load(), reason="no C compiler here: NumPy counts only")


def numpy_extend(pre, seq, P, bs=None):
    """The NumPy code's answer (NumPy arrays never take the C path)."""
    return alloc_checks.extend_counts(np.array(pre, dtype=np.int64), np.array(seq, dtype=np.int64), P, bs)


def numpy_decode(seq, P, bs=None):
    return alloc_checks.decode_counts(np.array(seq, dtype=np.int64), P, bs)


def outcome(fn, *args):
    try:
        return fn(*args)
    except InvalidArgument as e:
        return str(e)


lengths = st.integers(0, 1 << 40)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(lengths, st.integers(0, 1 << 40)), max_size=80), st.sampled_from([1, 2, 16, 64, 1024]))
def test_extend_counts_in_c_match_numpy(pairs, P):
    pre = [a for a, _ in pairs]
    seq = [a + d for a, d in pairs]
    got = alloc_checks._native_extend(torch.tensor(pre, dtype=torch.int64), torch.tensor(seq, dtype=torch.int64),
                                      P, len(pre))
    assert got is not None and got == numpy_extend(pre, seq, P)
    assert alloc_checks.extend_counts(torch.tensor(pre, dtype=torch.int64), torch.tensor(seq, dtype=torch.int64),
                                      P, len(pre)) == got


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 1 << 50), max_size=80), st.sampled_from([1, 2, 16, 64]))
def test_decode_counts_in_c_match_numpy(seq, P):
    got = alloc_checks._native_decode(torch.tensor(seq, dtype=torch.int64), P, len(seq))
    assert got is not None and got == numpy_decode(seq, P)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 40), st.integers(-5, 40)), min_size=1, max_size=40),
       st.sampled_from([1, 4, 16]))
def test_a_broken_rule_goes_to_numpy_which_names_the_request(pairs, P):
    pre = [a for a, _ in pairs]
    seq = [b for _, b in pairs]
    t_pre, t_seq = torch.tensor(pre, dtype=torch.int64), torch.tensor(seq, dtype=torch.int64)
    broken = any(a < 0 or b < a for a, b in pairs)
    assert (alloc_checks._native_extend(t_pre, t_seq, P, len(pre)) is None) == broken
    # the public function answers as the NumPy code does: the same counts, or the same error
    assert outcome(alloc_checks.extend_counts, t_pre, t_seq, P, len(pre)) == outcome(numpy_extend, pre, seq, P)
    dec = [b + 1 for b in seq]
    assert outcome(alloc_checks.decode_counts, torch.tensor(dec), P) == outcome(numpy_decode, dec, P)


def test_what_the_c_helper_leaves_to_numpy():
    t = lambda v, **k: torch.tensor(v, dtype=torch.int64, **k)  # noqa: E731
    huge = 1 << 62
    assert alloc_checks._native_extend(t([0, 0]), t([huge, huge]), 4, 2) is None  # a total of 2**63
    assert alloc_checks._native_extend(t([0, huge]), t([huge, 2 * huge - 1]), 4, 2) is not None  # below it
    assert alloc_checks._native_extend(t([0, 1]), t([5, 6]), 3, 2) is None  # P not a power of two
    strided = t([0, 9, 1, 9])[::2]
    assert alloc_checks._native_extend(strided, t([5, 6]), 4, 2) is None  # not contiguous
    assert alloc_checks._native_extend(t([0]).int(), t([5]).int(), 4, 1) is None  # int32
    assert alloc_checks._native_extend(t([0, 1]), t([5, 6]), 4, 3) is None  # not bs long
    assert alloc_checks._native_decode(t([0]), 4, 1) is None  # seq < 1
    # and the public functions still answer those (the NumPy code)
    assert alloc_checks.extend_counts(strided, t([5, 6]), 4, 2) == numpy_extend([0, 1], [5, 6], 4)
    assert alloc_checks.extend_counts(t([0, 1]), t([5, 6]), 3, 2) == numpy_extend([0, 1], [5, 6], 3)


def test_status_names_the_helper():
    assert native_counts.status().startswith("C (") and native_counts.cache_dir() in native_counts.status()


@pytest.mark.parametrize("env, expect", [({"KVLAB_NO_NATIVE": "1"}, "off (KVLAB_NO_NATIVE"),
                                         ({"CC": "/bin/false"}, "could not build"),
                                         ({}, "C (")])
def test_a_fresh_cache_builds_it_or_falls_back_to_numpy(tmp_path, env, expect):
    """A new cache folder: built with the compiler (or not, and NumPy counts instead); the
    counts are the same either way."""
    code = ("from kvlab import native_counts, alloc_checks; import torch; "
            "print(native_counts.status()); "
            "print(tuple(alloc_checks.extend_counts(torch.tensor([0, 3]), torch.tensor([5, 70]), 16, 2)))")
    run_env = {k: v for k, v in os.environ.items() if k not in ("KVLAB_NO_NATIVE", "CC")}
    run_env.update(KVLAB_CACHE_DIR=str(tmp_path), **env)
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    status, counts = out.stdout.strip().splitlines()
    assert status.startswith(expect)
    assert counts == str(tuple(numpy_extend([0, 3], [5, 70], 16)))


# --- a damaged helper or an odd compiler: never a crash, NumPy counts and the reason ------------

_CHILD = ("from kvlab import PagedTokenAllocator, alloc_checks, native_counts; import torch; "
          "PagedTokenAllocator(8, 4); print(native_counts.status()); "
          "print(tuple(alloc_checks.extend_counts(torch.tensor([0, 3]), torch.tensor([5, 70]), 16, 2)))")


def _child(cache: Path, **env) -> str:
    """Build an allocator and count a batch in a fresh interpreter with the cache folder
    ``cache``; returns the helper's status (the counts are checked here)."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("KVLAB_NO_NATIVE", "CC")}
    run_env.update(KVLAB_CACHE_DIR=str(cache), **env)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=run_env, capture_output=True, text=True, timeout=300)
    why = f"killed by signal {-out.returncode}" if out.returncode < 0 else f"exit status {out.returncode}"
    assert out.returncode == 0, f"the child process failed ({why}):\n{out.stderr[-3000:]}"
    status, counts = out.stdout.strip().splitlines()
    assert counts == str(tuple(numpy_extend([0, 3], [5, 70], 16)))
    return status


def _helpers(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.suffix == ".so")


@pytest.mark.parametrize("damage", ["truncated", "zeroed_tail", "empty", "checksum_missing"])
def test_a_damaged_cached_helper_is_rebuilt_never_loaded(tmp_path, damage):
    """A library cut short (ELF header intact) used to kill the interpreter (SIGBUS) when the
    first allocator was built. The size and checksum written beside it at build time are
    checked before it is loaded: a damaged one is rebuilt."""
    assert _child(tmp_path).startswith("C (")
    (lib,) = _helpers(tmp_path)
    data = lib.read_bytes()
    assert data[:4] == b"\x7fELF"
    if damage == "truncated":
        lib.write_bytes(data[: len(data) // 2])
    elif damage == "zeroed_tail":
        lib.write_bytes(data[: len(data) // 2] + bytes(len(data) - len(data) // 2))
    elif damage == "empty":
        lib.write_bytes(b"")
    else:
        for p in tmp_path.iterdir():
            if p != lib:
                p.unlink()
    status = _child(tmp_path)
    assert status.startswith("C (") and "rebuilt" in status, status
    assert _helpers(tmp_path) == [lib] and lib.read_bytes() == data


def _compiler(tmp_path: Path, flags: str, source: str | None = None) -> str:
    """A C compiler wrapper: the system's, with ``flags`` added, compiling ``source`` instead of
    the file it is given when ``source`` is set."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if source is None:
        script = f'#!/bin/sh\nexec {cc} {flags} "$@"\n'
    else:
        other = tmp_path / "other.c"
        other.write_text(source)
        script = ('#!/bin/sh\nout=""\nwhile [ $# -gt 0 ]; do case "$1" in -o) out="$2"; shift 2;; '
                  f'*) shift;; esac; done\nexec {cc} -O1 -shared -fPIC {flags} -o "$out" {other}\n')
    path = tmp_path / "cc-wrapper"
    path.write_text(script)
    path.chmod(0o755)
    return str(path)


def test_a_compiler_that_hides_symbols_still_gives_a_working_helper(tmp_path):
    """``-fvisibility=hidden`` used to make every allocator raise ``undefined symbol``: the
    helper's functions say they are exported."""
    status = _child(tmp_path / "cache", CC=_compiler(tmp_path, "-fvisibility=hidden"))
    assert status.startswith("C ("), status


@pytest.mark.parametrize("flags, source, reason", [
    ("-Dkvlab_extend_counts=renamed_extend", None, "could not bind"),        # a symbol is missing
    ("", "long kvlab_extend_counts(const long *a, const long *b, const long *w, long n, long s, long *o)"
         "{ o[0] = o[1] = o[2] = o[3] = 7; return 0; }\n"
         "long kvlab_decode_counts(const long *a, const long *w, long n, long s, long *o)"
         "{ o[0] = o[1] = 7; return 0; }\n", "self-test"),                 # loads, binds, counts wrong
])
def test_a_helper_that_cannot_bind_or_counts_wrong_falls_back_to_numpy(tmp_path, flags, source, reason):
    status = _child(tmp_path / "cache", CC=_compiler(tmp_path, flags, source))
    assert "NumPy counts" in status and reason in status, status
