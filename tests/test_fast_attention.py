"""Chapter 09's fast paged decode attention (kvlab.attention.split_kernels) against the oracle.

Grouped query heads in one program, a split over the sequence and the merge of the splits:
checked against ``kvlab.serving.hf.paged_attention_reference`` on random layouts (hypothesis) and on
edge cases -- ragged lengths, one-token contexts, contexts that end mid-page, page sizes 1, 3
and 16, grouped-query and plain multi-head attention, float32 and bfloat16 pools, more splits
than a request has blocks -- under the memory audit (no access outside a tensor), and with
chapter 08's host checks refusing bad input before any launch.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab import InvalidArgument
from kvlab.attention.paged_attention import (MAX_SPLITS, FastConfig, choose_num_splits, fast_launches,
                             fast_paged_decode_attention, paged_decode_attention)
from kvlab.serving.hf.attention_steps import paged_attention_reference
from kvlab.attention.kv_pool import random_paged_layout

DEVICE = kvlab.DEVICE
SMALL = FastConfig(block_n=16)        # small blocks: most requests span several, splits hold few


def layout(seed, page_size, lens, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32):
    q, k, v, table, rows, seq_lens = random_paged_layout(seed, page_size, lens, heads=heads,
                                                         kv_heads=kv_heads, head_dim=head_dim,
                                                         device=DEVICE)
    return q, k.to(dtype), v.to(dtype), table, rows, seq_lens


def tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


EDGE = {   # page size, lengths, query heads, K/V heads, head_dim
    "page_size 1, ragged": (1, [5, 1, 17], 4, 2, 16),
    "page_size 3, contexts end mid-page": (3, [7, 2, 13, 3], 4, 2, 16),
    "page_size 16, one request of one token": (16, [1], 4, 2, 16),
    "page_size 16, mid-page and page-aligned": (16, [33, 16, 70, 1], 8, 2, 16),
    "plain multi-head attention (group 1)": (4, [9, 6, 22], 3, 3, 16),
    "one K/V head for all (group 6)": (3, [11, 40], 6, 1, 16),
    "head_dim 12 (masked lanes)": (4, [9, 5], 4, 2, 12),
    "Llama 3.2 1B heads (32 on 8, head_dim 64)": (16, [50, 3], 32, 8, 64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("splits", [1, 3, 64], ids=lambda s: f"{s} split(s)")
@pytest.mark.parametrize("name", EDGE)
def test_fast_kernel_matches_the_oracle_on_edge_cases(name, splits, dtype):
    page_size, lens, heads, kv_heads, head_dim = EDGE[name]
    args = layout(1, page_size, lens, heads, kv_heads, head_dim, dtype)
    got = fast_paged_decode_attention(*args, num_splits=splits, config=SMALL)
    assert got.dtype == torch.float32 and got.shape == args[0].shape
    torch.testing.assert_close(got, paged_attention_reference(*args), **tolerance(dtype))


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 3, 4, 16]),
       lens=st.lists(st.integers(1, 70), min_size=1, max_size=5),
       heads_kv=st.sampled_from([(2, 1), (4, 2), (4, 4), (6, 2), (8, 2), (3, 3)]),
       splits=st.integers(1, 9), block_n=st.sampled_from([16, 32]), use_dot=st.booleans(),
       head_dim=st.sampled_from([8, 16, 24]), bf16=st.booleans())
def test_fast_kernel_matches_the_oracle_on_random_layouts(seed, page_size, lens, heads_kv, splits,
                                                          block_n, use_dot, head_dim, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    args = layout(seed, page_size, lens, *heads_kv, head_dim=head_dim, dtype=dtype)
    got = fast_paged_decode_attention(*args, num_splits=splits,
                                      config=FastConfig(block_n=block_n, use_dot=use_dot))
    torch.testing.assert_close(got, paged_attention_reference(*args), **tolerance(dtype))


def test_default_splits_and_the_model_scale_and_output_dtype():
    args = layout(2, 16, [40, 7], 8, 2, 16)
    want = paged_attention_reference(*args, scale=0.3)
    got = fast_paged_decode_attention(*args, 0.3)                 # splits chosen by the host
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    half = fast_paged_decode_attention(*args, 0.3, num_splits=2, config=SMALL, out_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, atol=2e-2, rtol=2e-2)


def test_the_split_merge_survives_scores_that_overflow_exp():
    """Scores of several hundred: exp(lse) of a split overflows float32, so the merge must
    subtract the largest lse first; the splits' maxima differ by hundreds."""
    q, k, v, table, rows, lens = layout(3, 4, [61, 30], 4, 2, 16)
    k = k.clone()
    for b, n in enumerate(lens.tolist()):
        slots = table[int(rows[b]), :n].long()
        k[slots, :, 0] = torch.linspace(-300, 300, n, device=DEVICE)[:, None]   # rising per split
    q = torch.zeros_like(q)
    q[:, :, 0] = math.sqrt(16)                                         # score = k[..., 0]
    want = paged_attention_reference(q, k, v, table, rows, lens)
    got = fast_paged_decode_attention(q, k, v, table, rows, lens, num_splits=4, config=SMALL)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_teaching_and_the_fast_kernel_agree():
    args = layout(4, 3, [1, 29, 64, 5], 6, 2, 16)
    torch.testing.assert_close(fast_paged_decode_attention(*args, num_splits=2, config=SMALL),
                               paged_decode_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_the_kernels_never_touch_memory_outside_their_tensors(splits):
    """Both launches under the safety net's audit (guard bands around every tensor): ragged
    lengths, a page size of 3, a row that ends mid-page, splits that hold nothing."""
    from kvlab.course.checking import sandbox

    args = layout(5, 3, [1, 20, 8], 4, 2, 12)
    q, k, v, table, rows, lens = args
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    launches = fast_launches(q, k, v, table, rows.long(), lens.long(), out, 0.25, splits, SMALL)
    assert len(launches) == (1 if splits == 1 else 2)
    for launch in launches:
        found = sandbox.guarded_call(launch.kernel, launch.args, launch.kwargs, launch.grid)
        assert found.error is None and found.accesses == [], found.accesses
    torch.testing.assert_close(out, paged_attention_reference(*args, scale=0.25), atol=1e-5, rtol=1e-5)


def test_choose_num_splits_fills_the_gpu_and_no_more():
    from kvlab.attention.paged_attention import MIN_SPLIT_TOKENS, PROGRAMS_PER_SM

    assert choose_num_splits(256, 8, 32768, sms=132) == 1          # the batch fills the GPU
    assert choose_num_splits(64, 8, 4096, sms=132) == 1
    assert choose_num_splits(16, 8, 4096, sms=132) == math.ceil(PROGRAMS_PER_SM * 132 / 128)
    assert choose_num_splits(1, 8, 32768, sms=132) == math.ceil(PROGRAMS_PER_SM * 132 / 8)
    assert choose_num_splits(1, 1, 1 << 20, sms=132) == MAX_SPLITS   # at most MAX_SPLITS
    assert choose_num_splits(1, 8, 512, sms=132) == 512 // MIN_SPLIT_TOKENS   # splits of >= 256
    assert choose_num_splits(1, 8, 1, sms=132) == 1
    assert choose_num_splits(0, 8, 100, sms=132) == 1


@pytest.mark.parametrize("change, argument", [
    (lambda a: {**a, "lens": torch.tensor([0, 2])}, "seq_lens[0]"),
    (lambda a: {**a, "lens": torch.tensor([8, 2])}, "page_table["),       # position 7: unmapped
    (lambda a: {**a, "rows": torch.tensor([0, 9])}, "table_idx[1]"),
    (lambda a: {**a, "v": a["v"][:, :1]}, "v_pool"),
    (lambda a: {**a, "q": a["q"][0]}, "q"),
    (lambda a: {**a, "splits": 0}, "num_splits"),
    (lambda a: {**a, "splits": 2.0}, "num_splits"),
    (lambda a: {**a, "config": FastConfig(block_n=24)}, "config.block_n"),
    (lambda a: {**a, "config": FastConfig(block_n=8)}, "config.block_n"),
])
def test_bad_input_is_refused_before_launch(change, argument, monkeypatch):
    from kvlab.attention import split_kernels as fast_attention

    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(fast_attention.split_decode_kernel, "run", no_launch)
    q, k, v, table, rows, lens = layout(6, 4, [7, 2], 4, 2)
    a = change(dict(q=q, k=k, v=v, table=table, rows=rows, lens=lens, splits=None, config=None))
    with pytest.raises(InvalidArgument) as err:
        fast_paged_decode_attention(a["q"], a["k"], a["v"], a["table"], a["rows"], a["lens"],
                                    num_splits=a["splits"], config=a["config"])
    assert err.value.argument.startswith(argument)


def test_an_empty_batch_launches_nothing():
    q, k, v, table, rows, lens = layout(7, 4, [5], 4, 2)
    out = fast_paged_decode_attention(q[:0], k, v, table, rows[:0], lens[:0])
    assert out.shape == (0, 4, 16)


@given(seq_len=st.integers(1, 5000), splits=st.integers(1, 70), block_n=st.sampled_from([16, 32, 64, 128]))
def test_split_ranges_cover_each_position_once_in_whole_blocks(seq_len, splits, block_n):
    from kvlab.attention.paged_attention import split_ranges
    from kvlab.course.reference.attention_ref import split_ranges_reference

    spans = split_ranges(seq_len, splits, block_n)
    assert spans == split_ranges_reference(seq_len, splits, block_n)
    assert spans[0][0] == 0 and spans[-1][1] == seq_len and len(spans) <= splits
    assert all(a < b and a % block_n == 0 for a, b in spans)
    assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))   # no gap, no overlap


def test_the_picture_of_which_program_reads_which_pages_shows_the_kernels_splits():
    from kvlab.course.scenes.ch09_making_it_fast import split_reads_plan

    plan = split_reads_plan()
    for pages, spans in zip(plan.pages, plan.spans):
        assert [t for a, b in spans for t in range(a, b)] == list(range(len(pages)))
        assert all(pages[t] == pages[t - t % plan.page_size] for t in range(len(pages)))   # whole pages
    assert len({p for pages in plan.pages for p in pages}) == sum(-(-len(p) // plan.page_size) for p in plan.pages)
