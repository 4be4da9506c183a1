"""Chapter 08's kernel exercise: ``kvlab.check.paged_attention_kernel`` grades the online-softmax
update inside a Triton paged-attention kernel.

The reference solution passes; an untouched starter is reported as not attempted without
running; typical slips in the update are rejected, and the message names the slip.
"""
from __future__ import annotations

import importlib.util
import inspect
import itertools
import textwrap

import pytest
import triton
import triton.language as tl

import kvlab.check as check
from kvlab.check import CheckFailed
from kvlab.course.exercises import ch08_attention_kernel as ch08_attention

_counter = itertools.count()


@triton.jit
def starter_kernel(q_ptr, k_pool_ptr, v_pool_ptr, page_table_ptr, table_idx_ptr, seq_lens_ptr,
                   out_ptr, scale, stride_q_b, stride_q_h, stride_kv_s, stride_kv_h, stride_pt_row,
                   stride_o_b, stride_o_h, head_dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    for start in range(0, 4, BLOCK_N):
        # YOUR CODE HERE: paged_attention_kernel
        pass


def _variant(old: str, new: str, tmp_path):
    """The reference kernel with ``old`` replaced by ``new``, loaded from a real file (Triton
    reads a kernel's source)."""
    src = textwrap.dedent(inspect.getsource(ch08_attention.paged_attention_kernel_solution.fn))
    assert old in src, old
    path = tmp_path / f"variant_{next(_counter)}.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update({k: v for k, v in vars(ch08_attention).items() if not k.startswith("__")})
    spec.loader.exec_module(module)
    return module.paged_attention_kernel_solution


def test_the_reference_kernel_passes(capsys):
    check.paged_attention_kernel(ch08_attention.paged_attention_kernel_solution, n_random=2)
    assert "✓ paged_attention_kernel" in capsys.readouterr().out
    assert check.status("paged_attention_kernel") == "passed"


def test_a_starter_is_not_attempted_and_returns_nothing(capsys):
    assert check.paged_attention_kernel(starter_kernel) is None
    out = capsys.readouterr().out
    assert out.count("not attempted yet: paged_attention_kernel") == 1
    assert check.status("paged_attention_kernel") == "not attempted"


SLIPS = [
    ("acc = acc * alpha + ", "acc = acc + ", "acc is not rescaled"),
    ("l_i = l_i * alpha + ", "l_i = l_i + ", "l_i is not rescaled"),
    ("        m_i = m_new\n", "        m_new = m_new\n", "m_i is never updated"),
    ("p = tl.exp(scores - m_new)", "p = tl.exp(scores)", "without the running max"),
    ("p = tl.exp(scores - m_new)", "p = tl.exp(scores - m_i)", "holds inf/NaN"),
]


@pytest.mark.parametrize("old,new,says", SLIPS, ids=[s[2] for s in SLIPS])
def test_a_slip_in_the_update_is_rejected_and_named(old, new, says, tmp_path):
    with pytest.raises(CheckFailed) as info:
        check.paged_attention_kernel(_variant(old, new, tmp_path), n_random=0)
    msg = str(info.value)
    assert says in msg and "request" in msg and "head" in msg, msg


def test_the_blocked_emulation_matches_the_reference():
    from kvlab.course.reference import paged_decode_attention_reference

    for seed, scores in [(0, "random"), (1, "rising"), (2, "large")]:
        args = ch08_attention._kernel_layout(dict(P=2, lens=[9, 3, 12], seed=seed, scores=scores,
                                                  head_dim=8))
        got = ch08_attention.blocked_attention(*args, block_n=4)
        want = paged_decode_attention_reference(*args)
        assert (got - want).abs().max() < 1e-4
