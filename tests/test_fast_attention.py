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
from kvlab.attention.paged_attention import (MAX_SPLITS, FastConfig, check_attention_errors, choose_num_splits, fast_launches,
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


@pytest.mark.parametrize("splits", [1, 3])
def test_the_storing_kernel_writes_only_the_new_slots_and_reads_them_from_registers(splits):
    """The decode step's launch (STORE) under the memory audit: each request's new K/V lands in
    the slot of its last position and nowhere else, padded entries of a graph batch (the same
    dummy row at position 0) all write the dummy slot, and the output is attention over the
    pool as it is after the store."""
    from kvlab.course.checking import sandbox

    q, k, v, table, rows, lens = layout(9, 3, [7, 1, 12], 4, 2, 12)
    dummy = int(torch.tensor([r for r in range(table.shape[0]) if r not in rows.tolist()])[0])
    used = {int(table[int(r), t]) for r, n in zip(rows.tolist(), lens.tolist()) for t in range(n)}
    spare = min(set(range(k.shape[0])) - used)               # a slot no request owns: the dummy page's
    table = table.clone()
    table[dummy, 0] = spare
    rows = torch.cat([rows, torch.tensor([dummy, dummy], device=DEVICE)]).long()
    lens = torch.cat([lens, torch.tensor([1, 1], device=DEVICE)]).long()
    q = torch.cat([q, q[:2]])
    g = torch.Generator().manual_seed(4)
    new_k = torch.randn(5, 2, 12, generator=g).to(DEVICE)
    new_v = torch.randn(5, 2, 12, generator=g).to(DEVICE)
    want_k, want_v = k.clone(), v.clone()
    for b in range(3):
        slot = int(table[int(rows[b]), int(lens[b]) - 1])
        want_k[slot], want_v[slot] = new_k[b], new_v[b]
    kp, vp = k.clone(), v.clone()
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    for launch in fast_launches(q, kp, vp, table, rows, lens, out, 0.25, splits, SMALL, new_k=new_k, new_v=new_v):
        found = sandbox.guarded_call(launch.kernel, launch.args, launch.kwargs, launch.grid)
        assert found.error is None and found.accesses == [], found.accesses
    keep = torch.ones(k.shape[0], dtype=torch.bool, device=DEVICE)
    keep[spare] = False                                      # the dummy slot: whichever pad wrote last
    assert torch.equal(kp[keep], want_k[keep]) and torch.equal(vp[keep], want_v[keep])
    # one program per (entry, KV head) stores, and on a GPU the two pads' programs race (per
    # head, K against V, even per element): the dummy slot holds pad values, nothing else
    for pool, new in ((kp, new_k), (vp, new_v)):
        assert ((pool[spare] == new[3]) | (pool[spare] == new[4])).all(), pool[spare]
    want = paged_attention_reference(q[:3], want_k, want_v, table, rows[:3], lens[:3], scale=0.25)
    torch.testing.assert_close(out[:3], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 2])
def test_unmapped_slots_are_read_and_written_nowhere_even_unchecked(splits):
    """check=False (the decode step's launch): an entry whose row holds -1 (a request that rode
    a step after its pages went back) reads and writes nothing outside the pool; the others are
    served as usual."""
    from kvlab.course.checking import sandbox

    q, k, v, table, rows, lens = layout(10, 4, [9, 6], 4, 2, 12)
    table = table.clone()
    table[int(rows[1]), :6] = -1                            # request 1's row: released
    g = torch.Generator().manual_seed(5)
    new_k, new_v = torch.randn(2, 2, 12, generator=g).to(DEVICE), torch.randn(2, 2, 12, generator=g).to(DEVICE)
    kp, vp = k.clone(), v.clone()
    out = torch.zeros(q.shape, device=DEVICE)
    for launch in fast_launches(q, kp, vp, table, rows.long(), lens.long(), out, 0.25, splits, SMALL,
                                new_k=new_k, new_v=new_v):
        found = sandbox.guarded_call(launch.kernel, launch.args, launch.kwargs, launch.grid)
        assert found.error is None and found.accesses == [], found.accesses
    slot = int(table[int(rows[0]), 8])
    want_k, want_v = k.clone(), v.clone()
    want_k[slot], want_v[slot] = new_k[0], new_v[0]
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)        # request 1 wrote nothing
    torch.testing.assert_close(out[:1], paged_attention_reference(q[:1], want_k, want_v, table, rows[:1],
                                                                  lens[:1], scale=0.25), atol=1e-5, rtol=1e-5)


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
    (lambda a: {**a, "v": a["v"][:, :1]}, "v_pool"),
    (lambda a: {**a, "q": a["q"][0]}, "q"),
    (lambda a: {**a, "rows": a["rows"].float()}, "table_idx"),
    (lambda a: {**a, "lens": a["lens"][:1]}, "seq_lens"),
    (lambda a: {**a, "splits": 0}, "num_splits"),
    (lambda a: {**a, "splits": 2.0}, "num_splits"),
    (lambda a: {**a, "config": FastConfig(block_n=24)}, "config.block_n"),
    (lambda a: {**a, "config": FastConfig(block_n=8)}, "config.block_n"),
])
def test_bad_input_is_refused_before_launch(change, argument, kernel_run):
    from kvlab.attention import split_kernels as fast_attention

    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    kernel_run(fast_attention.split_decode_kernel, no_launch)
    q, k, v, table, rows, lens = layout(6, 4, [7, 2], 4, 2)
    a = change(dict(q=q, k=k, v=v, table=table, rows=rows, lens=lens, splits=None, config=None))
    with pytest.raises(InvalidArgument) as err:
        fast_paged_decode_attention(a["q"], a["k"], a["v"], a["table"], a["rows"], a["lens"],
                                    num_splits=a["splits"], config=a["config"])
    assert err.value.argument.startswith(argument)


DEVICE_RULES = {   # values only the device holds: the kernel refuses them (chapter 08's wording)
    "a length of 0": (lambda a: {**a, "lens": torch.tensor([0, 2], device=DEVICE)}, "seq_lens[0]", "got 0"),
    "a length past the columns": (lambda a: {**a, "lens": torch.tensor([7, 99], device=DEVICE)}, "seq_lens[1]",
                                  "got 99"),
    "an unmapped position": (lambda a: {**a, "lens": torch.tensor([8, 2], device=DEVICE)}, "page_table[",
                             "position 7 holds -1"),
    "a row outside the table": (lambda a: {**a, "rows": torch.tensor([0, 9], device=DEVICE)}, "table_idx[1]",
                                "got 9"),
    "a slot outside the pool": (lambda a: {**a, "table": a["table"].masked_fill(a["table"] == a["table"].max(),
                                                                                10**6)}, "page_table[", "1000000"),
}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", DEVICE_RULES)
def test_values_only_the_device_holds_are_refused_by_the_kernel(name, splits):
    """Rows, lengths and slots are checked inside the split kernel (no wait for the GPU): the
    refusal names the entry as chapter 08's host checks do. In the interpreter the call raises
    it; on a GPU the request's output is NaN and check_attention_errors() raises it."""
    change, argument, detail = DEVICE_RULES[name]
    q, k, v, table, rows, lens = layout(6, 4, [7, 2], 4, 2)
    a = change(dict(q=q, k=k, v=v, table=table, rows=rows, lens=lens))
    call = lambda: fast_paged_decode_attention(a["q"], a["k"], a["v"], a["table"], a["rows"],  # noqa: E731
                                               a["lens"], num_splits=splits, config=SMALL)
    if DEVICE.type == "cpu":
        with pytest.raises(InvalidArgument) as err:
            call()
    else:
        out = call()
        assert torch.isnan(out).any()
        with pytest.raises(InvalidArgument) as err:
            check_attention_errors()
    assert err.value.argument.startswith(argument)
    assert DEVICE.type != "cpu" or detail in str(err.value)
    check_attention_errors()                               # raised once: nothing pending after it
    good = fast_paged_decode_attention(q, k, v, table, rows, lens, num_splits=splits, config=SMALL)
    torch.testing.assert_close(good, paged_attention_reference(q, k, v, table, rows, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_a_refused_request_reads_nothing_outside_the_pool(splits):
    """Under the memory audit: a row outside the table, a length past it and slots outside the
    pool, checked by the kernel; only the good request's output is a number."""
    from kvlab.course.checking import sandbox

    q, k, v, table, rows, lens = layout(8, 3, [5, 9, 4, 6], 4, 2, 12)
    table = table.clone()
    table[int(rows[2]), 1] = k.shape[0] + 5                  # request 2: a slot past the pool
    rows = rows.clone().long()
    rows[0] = table.shape[0] + 3                             # request 0: no such row
    lens = lens.clone().long()
    lens[1] = table.shape[1] + 1                             # request 1: longer than the row
    out = torch.zeros(q.shape, device=DEVICE)
    status = torch.zeros(2, dtype=torch.int64, device=DEVICE)          # the first refusal, the flag
    for launch in fast_launches(q, k, v, table, rows, lens, out, 0.25, splits, SMALL, check=True, status=status):
        found = sandbox.guarded_call(launch.kernel, launch.args, launch.kwargs, launch.grid)
        assert found.error is None and found.accesses == [], found.accesses
    assert torch.isnan(out[:3]).all() and torch.isfinite(out[3]).all()
    want = paged_attention_reference(q[3:], k, v, table, rows[3:], lens[3:], scale=0.25)
    torch.testing.assert_close(out[3:], want, atol=1e-5, rtol=1e-5)
    assert status[0].item() != 0 and status[1].item() == 1


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
