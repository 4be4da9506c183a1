"""The plain-Python allocation oracles (chapters 03-04) against hand-worked examples and invariants."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.base.errors import InvalidArgument, OutOfPages
from kvlab.course.reference.alloc_ref import (alloc_decode_ref, alloc_extend_ref, kernel_page_reads_extend,
                                   pack_ret_value, pages_needed_extend, part_lengths,
                                   unpack_ret_value)

P64 = 64


def test_worked_example_from_the_source_design():
    # A: 70 -> 190 (last prefix token at offset 5 of page 5); B: 128 -> 260 (page-aligned prefix)
    free = [7, 3, 9, 5, 11]
    plan = alloc_extend_ref([70, 128], [190, 260], [5 * 64 + 5, 1 * 64 + 63], free, P64)
    assert part_lengths(70, 190, P64) == (58, 0, 62)
    assert part_lengths(128, 260, P64) == (0, 128, 4)
    assert plan.num_new_pages == 4
    assert plan.new_pages == [[7], [3, 9, 5]]
    assert [(s.req, s.part, s.end - s.start) for s in plan.spans] == [
        (0, 1, 58), (0, 3, 62), (1, 2, 128), (1, 3, 4)]
    out = plan.out_indices
    assert out[:58] == list(range(326, 384))                    # A fills its old page 5
    assert out[58:120] == list(range(7 * 64, 7 * 64 + 62))      # A's new page 7
    assert out[120:184] == list(range(3 * 64, 4 * 64))          # B's whole page 3
    assert out[184:248] == list(range(9 * 64, 10 * 64))         # B's whole page 9
    assert out[248:] == [5 * 64 + k for k in range(4)]          # B's new last page 5
    assert plan.parts[57] == (0, 1) and plan.parts[58] == (0, 3) and plan.parts[251] == (1, 3)
    assert plan.output_starts == [0, 120]
    assert unpack_ret_value(plan.ret_value) == (4, 252)
    assert plan.ret_value == (4 << 32) | 252


@pytest.mark.parametrize("pre,seq,P,expected", [
    (0, 0, 4, (0, 0, 0)),      # empty request
    (5, 5, 4, (0, 0, 0)),      # empty extend, unaligned prefix
    (5, 7, 4, (2, 0, 0)),      # stays in the old page
    (5, 8, 4, (3, 0, 0)),      # exactly fills the old page
    (5, 9, 4, (3, 0, 1)),      # spills onto one new page
    (4, 12, 4, (0, 8, 0)),     # aligned prefix, ends aligned: whole pages only
    (0, 3, 4, (0, 0, 3)),      # empty prefix: part 3 only
    (3, 9, 1, (0, 6, 0)),      # page size 1: everything is whole pages
])
def test_part_lengths_by_hand(pre, seq, P, expected):
    assert part_lengths(pre, seq, P) == expected


def test_page_size_one_every_token_is_a_page():
    plan = alloc_extend_ref([2, 0], [4, 1], [10, -1], [6, 2, 8], 1)
    assert plan.out_indices == [6, 2, 8]
    assert plan.num_new_pages == 3
    assert [p for _, p in plan.parts] == [2, 2, 2]


def test_out_of_pages_is_refused():
    with pytest.raises(OutOfPages, match="needs 2 new page"):
        alloc_extend_ref([0], [5], [-1], [1], 4)
    with pytest.raises(OutOfPages):
        alloc_decode_ref([1, 5], [-1, 15], [], 4)


@pytest.mark.parametrize("args,argument", [
    (([4], [3], [3]), "seq_lens[0]"),               # seq < pre
    (([4], [6], [4]), "last_loc[0]"),               # (last+1) % P != pre % P
    (([0], [2], [0]), "last_loc[0]"),               # empty prefix but last_loc + 1 not on a page start
    (([-1], [2], [-2]), "prefix_lens[0]"),          # negative length
    (([1, 2], [3], [0]), "seq_lens/last_loc"),      # lengths differ
])
def test_extend_rules(args, argument):
    with pytest.raises(InvalidArgument) as e:
        alloc_extend_ref(*args, free_pages=list(range(8)), page_size=4)
    assert e.value.argument == argument


def test_decode_by_hand():
    # P = 4: seq 5 -> token 4 starts page; seq 7 -> slot after last; seq 1 -> first page
    plan = alloc_decode_ref([5, 7, 1], [11, 21, -1], [9, 2], 4)
    assert plan.out_indices == [36, 22, 8]
    assert plan.takes_new_page == [True, False, True]
    assert plan.new_pages == [9, None, 2]
    assert plan.num_new_pages == 2


def test_decode_rules():
    with pytest.raises(InvalidArgument, match="seq_lens >= 1"):
        alloc_decode_ref([0], [-1], [0], 4)
    with pytest.raises(InvalidArgument, match="last_loc"):
        alloc_decode_ref([6], [5], [0], 4)  # token 5 sits at offset 1, so last_loc % 4 must be 0


def test_page_reads_show_the_overread_when_short():
    reads = kernel_page_reads_extend([0, 0], [5, 9], 4)
    assert reads == [[0, 1], [2, 3, 4]]
    assert [i for r in reads for i in r if i >= 4] == [4]  # with 4 free pages: one read past the end


def test_pack_roundtrip():
    assert unpack_ret_value(pack_ret_value(123, 4567)) == (123, 4567)
    assert unpack_ret_value(pack_ret_value(0, 0)) == (0, 0)


# --- random batches: invariants of the oracle itself -----------------------------------------


@st.composite
def extend_batches(draw):
    P = draw(st.sampled_from([1, 2, 4, 16, 64]))
    bs = draw(st.integers(1, 12))
    pre = [draw(st.integers(0, 300)) for _ in range(bs)]
    seq = [p + draw(st.one_of(st.just(0), st.integers(0, 300))) for p in pre]
    # each request's prefix ends somewhere on a page of its own, at the right offset
    last = [(1000 + r) * P + (p - 1) % P if p > 0 else -1 for r, p in enumerate(pre)]
    return P, pre, seq, last


@settings(max_examples=200)
@given(extend_batches())
def test_extend_oracle_invariants(batch):
    P, pre, seq, last = batch
    needed = pages_needed_extend(pre, seq, P)
    free = list(range(needed + 3))[::-1]  # distinct pages, not in order
    plan = alloc_extend_ref(pre, seq, last, free, P)
    assert len(plan.out_indices) == sum(s - p for p, s in zip(pre, seq)) == len(plan.parts)
    assert len(set(plan.out_indices)) == len(plan.out_indices)
    assert plan.num_new_pages == needed == sum(len(n) for n in plan.new_pages)
    assert [p for pages in plan.new_pages for p in pages] == free[:needed]
    for r, (p, s, lst) in enumerate(zip(pre, seq, last)):
        slots = plan.out_indices[plan.output_starts[r]:plan.output_starts[r] + s - p]
        own_pages = ({lst // P} if p > 0 else set()) | set(plan.new_pages[r])
        assert {x // P for x in slots} <= own_pages
        # logical position t of the request lives at offset t % P of its page
        assert [x % P for x in slots] == [t % P for t in range(p, s)]
