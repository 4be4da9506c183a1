"""The host counts' C helper (kvlab.native_counts) gives what the NumPy code gives, and steps
aside (None) wherever the NumPy code must judge: broken rules, huge lengths, other layouts."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import InvalidArgument, alloc_checks, native_counts

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
    assert alloc_checks._native_extend(t([0]), t([huge]), 4, 1) is None   # lengths of 2**62 and more
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
