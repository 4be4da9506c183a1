"""Grouped-query paged attention (kvlab.serving.hf.attention_steps and the Triton kernel's KV_GROUP).

The kernel and the step are checked against the plain-torch reference on random layouts
(hypothesis) and on edge cases: page size 1, page-aligned and unaligned lengths, one request,
many requests with rows out of order, group sizes 1 to 4, a head_dim that is not a power of
two. Bad input is refused before anything is launched or written. No transformers needed.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab import InvalidArgument
from kvlab.serving.hf.attention_steps import (paged_attention_reference, paged_attention_step,
                                paged_decode_attention, prefill_attention)
from kvlab.attention.kv_pool import random_paged_layout

DEVICE = kvlab.DEVICE


def layout(seed, page_size, seq_lens, heads=4, kv_heads=2, head_dim=16, spare_pages=2):
    """Random K/V; each request on shuffled, disjoint pages; rows in shuffled order."""
    return random_paged_layout(seed, page_size, seq_lens, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, spare_pages=spare_pages, device=DEVICE)


def repeated_heads_reference(q, k, v, table, rows, lens):
    """GQA = multi-head attention with each K/V head repeated for its group (chapter 08's
    reference, which knows nothing of groups)."""
    from kvlab.course.reference.attention_ref import paged_decode_attention_reference

    group = q.shape[1] // k.shape[1]
    return paged_decode_attention_reference(q, k.repeat_interleave(group, 1),
                                            v.repeat_interleave(group, 1), table, rows, lens)


EDGE = {
    "page_size 1": (1, [5, 3], 4, 2, 16),
    "page-aligned lengths": (4, [8, 4], 4, 2, 16),
    "unaligned lengths": (4, [7, 2, 13], 4, 1, 16),
    "one request, one token": (16, [1], 4, 2, 16),
    "many requests, rows shuffled": (2, [3, 9, 1, 6, 4, 11], 6, 3, 16),
    "multi-head (group 1)": (4, [9, 5], 2, 2, 16),
    "head_dim 12 (masked lanes)": (4, [9, 5], 4, 2, 12),
    "longer than one block": (16, [70, 3], 4, 2, 16),
}


@pytest.mark.parametrize("name", EDGE)
def test_reference_is_chapter_08s_reference_with_repeated_heads(name):
    page_size, lens, heads, kv_heads, head_dim = EDGE[name]
    args = layout(0, page_size, lens, heads, kv_heads, head_dim)
    torch.testing.assert_close(paged_attention_reference(*args), repeated_heads_reference(*args),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", EDGE)
def test_kernel_matches_reference_on_edge_cases(name):
    page_size, lens, heads, kv_heads, head_dim = EDGE[name]
    args = layout(1, page_size, lens, heads, kv_heads, head_dim)
    torch.testing.assert_close(paged_decode_attention(*args), paged_attention_reference(*args),
                               atol=1e-5, rtol=1e-5)


@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 2, 4, 16]),
       lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       heads_kv=st.sampled_from([(2, 1), (4, 2), (4, 1), (6, 2), (3, 3)]),
       block_n=st.sampled_from([None, 16]))
def test_kernel_matches_reference_on_random_layouts(seed, page_size, lens, heads_kv, block_n):
    args = layout(seed, page_size, lens, *heads_kv)
    torch.testing.assert_close(paged_decode_attention(*args, block_n=block_n),
                               paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


def test_the_multi_head_wrapper_of_chapter_08_still_works():
    from kvlab.attention.paged_attention import paged_decode_attention as chapter_08

    args = layout(2, 4, [7, 12], heads=2, kv_heads=2)
    torch.testing.assert_close(chapter_08(*args), paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size, lens, heads, kv_heads", [
    (1, [5, 3], 4, 2), (4, [8, 1], 4, 2), (16, [20, 33, 2], 6, 3), (4, [9], 2, 2)])
def test_step_writes_exactly_the_new_slots_then_attends(page_size, lens, heads, kv_heads):
    q, k_pool, v_pool, table, rows, seq_lens = layout(3, page_size, lens, heads, kv_heads)
    positions = seq_lens - 1                      # the new token is each request's last
    g = torch.Generator().manual_seed(9)
    k_new = torch.randn(len(lens), kv_heads, k_pool.shape[2], generator=g).to(DEVICE)
    v_new = torch.randn(len(lens), kv_heads, k_pool.shape[2], generator=g).to(DEVICE)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    for b in range(len(lens)):
        slot = int(table[int(rows[b]), int(positions[b])])
        want_k[slot], want_v[slot] = k_new[b], v_new[b]
    out = paged_attention_step(q, k_new, v_new, k_pool, v_pool, table, rows, positions)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)   # nothing else touched
    torch.testing.assert_close(out, paged_attention_reference(q, want_k, want_v, table, rows, seq_lens),
                               atol=1e-5, rtol=1e-5)


def test_step_refuses_an_unmapped_position_before_writing():
    q, k_pool, v_pool, table, rows, seq_lens = layout(4, 4, [7, 2], 4, 2)
    k_new = torch.ones(2, 2, 16, device=DEVICE)
    before = k_pool.clone()
    with pytest.raises(InvalidArgument, match="page_table"):
        # position 7 of the 7-token request is unmapped (-1): writing there would hit the
        # pool's last slot
        paged_attention_step(q, k_new, k_new, k_pool, v_pool, table, rows, torch.tensor([7, 1]))
    assert torch.equal(k_pool, before)
    with pytest.raises(InvalidArgument, match="^k:"):
        paged_attention_step(q, k_new[:, :1], k_new, k_pool, v_pool, table, rows, seq_lens - 1)


@pytest.mark.parametrize("start, new", [(0, 1), (0, 9), (5, 4), (8, 8), (12, 1)])
def test_prefill_attention_is_one_decode_query_per_position(start, new):
    """Query t of a prefill attends exactly like a decode query with seq_len start + t + 1."""
    q, k_pool, v_pool, table, rows, _ = layout(5, 4, [start + new], 4, 2)
    g = torch.Generator().manual_seed(1)
    qs = torch.randn(new, 4, 16, generator=g).to(DEVICE)
    row = int(rows[0])
    out = prefill_attention(qs, k_pool, v_pool, table[row, :start + new].long(), start, 0.25)
    want = paged_attention_reference(qs, k_pool, v_pool, table, torch.full((new,), row),
                                     torch.arange(start + 1, start + new + 1), scale=0.25)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, argument", [
    (lambda a: {**a, "k": a["k"].repeat(1, 2, 1)[:, :3], "v": a["v"].repeat(1, 2, 1)[:, :3]},
     "k_pool"),                                                 # 4 heads cannot share 3 K/V heads
    (lambda a: {**a, "v": a["v"][:, :1]}, "v_pool"),
    (lambda a: {**a, "rows": torch.tensor([0, 9])}, "table_idx[1]"),
    (lambda a: {**a, "lens": torch.tensor([0, 2])}, "seq_lens[0]"),
    (lambda a: {**a, "lens": torch.tensor([8, 2])}, "page_table["),
    (lambda a: {**a, "lens": torch.tensor([7])}, "seq_lens"),
    (lambda a: {**a, "q": a["q"][0]}, "q"),
])
def test_bad_input_is_refused_before_launch(change, argument):
    q, k, v, table, rows, lens = layout(6, 4, [7, 2], 4, 2)
    a = change(dict(q=q, k=k, v=v, table=table, rows=rows, lens=lens))
    for fn in (paged_decode_attention, paged_attention_reference):
        with pytest.raises(InvalidArgument) as err:
            fn(a["q"], a["k"], a["v"], a["table"], a["rows"], a["lens"])
        assert err.value.argument.startswith(argument)
