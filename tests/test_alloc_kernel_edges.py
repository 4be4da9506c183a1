"""The allocation kernels' arithmetic at the int64 edges: pages of lengths near 2**63, totals
that saturate instead of wrapping, a report word whose token count never spills into its page
count (interpreter and compiled alike); and, on a GPU, a direct launch (Triton's C launcher)
interrupted after its kernel ran leaves the allocator as it was."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from faults import Interrupted, failing

import kvlab
from kvlab import PagedTokenAllocator
from kvlab.alloc.kernel_checks import TOTAL_LIMIT, page_count, saturating_total
from kvlab.alloc.fast_alloc_kernels import report_word

BIG = 1 << 63


def t(values):
    return torch.tensor(values, dtype=torch.int64, device=kvlab.DEVICE)


@triton.jit
def _edges_kernel(x_ptr, out_ptr, n, page_size: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, page_count(x, page_size), mask=offs < n)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    total = saturating_total(zero, tl.where(offs < n, x, 0))
    tl.store(out_ptr + BLOCK, total)
    tl.store(out_ptr + BLOCK + 1, saturating_total(total, tl.where(offs < n, x, 0)))
    tl.store(out_ptr + BLOCK + 2, report_word(zero + 3, zero + (1 << 32) + 5))


@pytest.mark.parametrize("P", [1, 16, 1024])
def test_the_kernels_count_pages_and_totals_without_wrapping(P):
    values = [0, 1, P - 1, P, P + 1, 12345, BIG - 1, BIG - P, BIG - P - 1, (1 << 62) + 7]
    x = t(values)
    out = torch.zeros(16 + 3, dtype=torch.int64, device=kvlab.DEVICE)
    _edges_kernel[(1,)](x, out, len(values), P, BLOCK=16)
    got = out.tolist()
    assert got[: len(values)] == [-(-v // P) for v in values]          # ceil(x / P), even near 2**63
    assert got[16] >= TOTAL_LIMIT and got[17] >= TOTAL_LIMIT          # past the limit: saturated ...
    assert got[16] <= 2 * TOTAL_LIMIT and got[17] <= 2 * TOTAL_LIMIT  # ... never wrapped
    assert got[18] == (3 << 32) | 5                                    # tokens never spill into pages
    small = t([1, 2, 3])
    _edges_kernel[(1,)](small, out, 3, P, BLOCK=16)
    assert out.tolist()[16:18] == [6, 12]                              # exact below the limit


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [False, True])
def test_an_interrupted_direct_launch_leaves_the_allocator_as_it_was(decode):
    """The GPU's hot path (Triton's C launcher, with addresses): the kernel ran, then the host was
    interrupted before it moved its head."""
    alloc = PagedTokenAllocator(8, 4, eager_errors=False)
    assert alloc._direct is not None, "no direct launch for this Triton"
    alloc.alloc_extend(t([0]), t([3]), t([-1]), 3, prefix_lens_cpu=[0], seq_lens_cpu=[3])
    alloc.check_device_errors()
    before, page_free = alloc.state(), alloc._page_free.clone()
    kind = "decode" if decode else "extend"
    real = alloc._direct
    alloc._direct = real._replace(**{kind: failing(getattr(real, kind), 0, after=True, error=Interrupted)})
    with pytest.raises(Interrupted):
        if decode:
            alloc.alloc_decode(t([4, 1]), t([2, -1]), seq_lens_cpu=[4, 1])
        else:
            alloc.alloc_extend(t([3, 0]), t([9, 5]), t([2, -1]), 11, prefix_lens_cpu=[3, 0], seq_lens_cpu=[9, 5])
    alloc._direct = real
    alloc.check_device_errors()
    assert alloc.state().equals(before) and torch.equal(alloc._page_free, page_free)
