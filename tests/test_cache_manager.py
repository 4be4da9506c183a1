"""kvlab.CacheManager (chapter 06): region accounting, the duplicate-region remap, eviction,
OutOfPages with unchanged state, every misuse error, and random request traces that check
the conservation law and "every request reads its own KV" after every step."""
from __future__ import annotations

import random

import pytest
import torch
from cache_state import assert_unchanged, manager_state
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import (CacheManager, CacheMisuse, IntegrityError, InvalidArgument, OutOfPages,
                   Req)
from kvlab.alloc.paging import UNMAPPED, new_page_table
from kvlab.course.reference import cache_req_regions_ref


def manager(num_pages=8, page_size=4, rows=4, max_len=64, writer="host", **kw) -> CacheManager:
    table = new_page_table(rows, max_len, page_size)  # the runtime's device: the Triton writer needs it
    return CacheManager(num_pages, page_size, table, page_table_writer=writer, **kw)


def prefill(cm: CacheManager, reqs: list[Req], kv: dict | None = None) -> None:
    """admit + allocate + 'forward' (write the KV fingerprints) + complete_one."""
    for r in reqs:
        cm.admit(r)
    cm.allocate_paged(reqs)
    for r in reqs:
        forward(cm, r, kv)


def forward(cm: CacheManager, req: Req, kv: dict | None) -> None:
    """The model step: compute positions [cached_len, device_len) and write their KV.
    Each slot's 'KV' is the token prefix it was computed from, so a slot read by the
    wrong request (or a freed and reused slot) shows up as a different prefix."""
    if kv is not None:
        row = cm.page_table[req.table_idx, : req.device_len].tolist()  # one device->host copy
        for pos in range(req.cached_len, req.device_len):
            kv[row[pos]] = tuple(req.input_ids[: pos + 1])
    req.complete_one()


def snapshot(cm: CacheManager):
    """Every piece of the manager's state, and the fields of its running requests."""
    return manager_state(cm, cm.running)


assert_same = assert_unchanged


# --- the happy paths ----------------------------------------------------------------------


def test_free_slots_start_as_page_starts():
    cm = manager(num_pages=5, page_size=4)
    assert cm.free_slots.tolist() == [0, 4, 8, 12, 16]
    assert cm.free_slots.dtype == torch.int32
    assert cm.available_size == 20
    cm.check_integrity()


def test_match_req_drops_the_last_token():
    cm = manager(page_size=2)
    cm.prefix_cache.insert_prefix([1, 2, 3, 4], torch.arange(4, dtype=torch.int32))
    assert cm.match_req(Req([1, 2, 3, 4], 0)).cached_len == 2  # [1,2,3] -> one whole page
    assert cm.match_req(Req([1, 2, 3, 4, 5], 0)).cached_len == 4
    with pytest.raises(InvalidArgument, match="at least one token"):
        cm.match_req(Req([], 0))


def test_plain_hit_maps_the_cached_pages_and_allocates_the_rest():
    cm = manager(page_size=4)
    a = Req(list(range(10)), 0)
    prefill(cm, [a])
    regions = cm.cache_req(a, finished=True)
    assert (regions.hit, regions.inserted, regions.tail) == ((0, 0), (0, 8), (8, 10))
    cm.check_integrity()
    b = Req(list(range(9)) + [77, 78], 1)
    match = cm.admit(b)
    assert match.cached_len == 8 and b.cached_len == 8
    assert cm.page_table[1, :8].tolist() == match.handle.get_matched_indices().tolist()
    cm.allocate_paged([b])
    assert cm.allocated_pages(b) == 3
    cm.check_integrity()
    forward(cm, b, None)
    regions = cm.cache_req(b, finished=False)
    assert regions.hit == (0, 8) and regions.duplicate == (8, 8) and regions.tail == (8, 11)
    cm.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_duplicate_region_is_freed_and_the_row_remapped(page_size):
    cm = manager(num_pages=40 // page_size, page_size=page_size)
    prompt = list(range(10))
    a, b = Req(prompt, 0), Req(list(prompt), 1)
    prefill(cm, [a, b])  # same prompt, one batch: neither hits the cache
    ra = cm.cache_req(a, finished=False)
    rb = cm.cache_req(b, finished=False)
    P = page_size
    aligned = 10 // P * P
    assert ra.inserted == (0, aligned) and ra.duplicate == (0, 0)
    assert rb.duplicate == (0, aligned) and rb.inserted == (aligned, aligned)
    assert rb.freed_pages.tolist() == rb.row_before[:aligned][::P].tolist()
    assert rb.remapped
    # b's row now reads a's cached slots over the duplicate region, its own tail after it
    assert cm.page_table[1, :aligned].tolist() == cm.page_table[0, :aligned].tolist()
    assert not set(cm.page_table[1, :10].tolist()) & set(cm.free_slots.tolist())
    cm.check_integrity()
    ref = cache_req_regions_ref(rb.old_cached_len, rb.already_cached_len, rb.new_cached_len,
                                rb.req_cached_len, rb.finished)
    assert (rb.hit, rb.duplicate, rb.inserted, rb.tail) == (ref.hit, ref.duplicate, ref.inserted, ref.tail)


def test_the_source_designs_stale_row_is_caught_and_reads_the_wrong_kv():
    cm = manager(num_pages=6, page_size=4, remap_duplicates=False)
    kv: dict = {}
    prompt = list(range(10))
    a, b = Req(prompt, 0), Req(list(prompt), 1)
    prefill(cm, [a, b], kv)
    cm.cache_req(a, finished=False)
    rb = cm.cache_req(b, finished=False)
    assert not rb.remapped
    stale_pages = {s - s % 4 for s in cm.page_table[1, :8].tolist()}
    assert stale_pages == set(cm.free_slots.tolist()) == {12, 16}  # b's row maps two free pages
    with pytest.raises(IntegrityError, match="stale page-table row"):
        cm.check_integrity()
    # a new request takes the freed pages and overwrites their KV: b would now read it
    c = Req([50 + i for i in range(8)], 2)
    prefill(cm, [c], kv)
    wrong = [p for p in range(8) if kv[int(cm.page_table[1, p])] != tuple(prompt[: p + 1])]
    assert wrong, "b's stale row should now point at c's KV"


def test_finished_tail_is_freed_unfinished_tail_is_kept():
    for finished in (False, True):
        cm = manager(num_pages=8, page_size=4)
        a = Req(list(range(10)), 0)
        prefill(cm, [a])
        free_before = cm.num_free_pages
        r = cm.cache_req(a, finished=finished)
        assert r.tail == (8, 10) and r.tail_freed == finished
        assert cm.num_free_pages == free_before + (1 if finished else 0)
        assert (a in cm.running) != finished
        if finished:
            assert (cm.page_table[0] == UNMAPPED).all()
        cm.check_integrity()


def test_finish_frees_pages_mapped_past_cached_len():
    # a decode step allocated the next page, then the request finished: nothing may leak
    cm = manager(num_pages=8, page_size=4)
    a = Req(list(range(8)), 0)
    prefill(cm, [a])  # cached_len 8, device_len 9
    a.append_token(5)
    cm.allocate_paged([a])  # maps page 2 for position 8
    assert cm.allocated_pages(a) == 3
    cm.cache_req(a, finished=True)
    cm.check_integrity()
    assert cm.num_free_pages == 8 - 2 and cm.prefix_cache.size_info.evictable_size == 8


def test_release_req_frees_own_pages_and_unlocks():
    cm = manager(num_pages=8, page_size=4)
    a = Req(list(range(10)), 0)
    prefill(cm, [a])
    cm.cache_req(a, finished=True)
    b = Req(list(range(9)) + [42, 43, 44], 1)
    cm.admit(b)
    cm.allocate_paged([b])
    assert cm.prefix_cache.size_info.protected_size == 8
    freed = cm.release_req(b)
    assert len(freed) == 1  # its one own page; the cached 8 tokens stay cached
    assert cm.prefix_cache.size_info == (8, 0)
    assert b.finished and b not in cm.running
    cm.check_integrity()
    with pytest.raises(CacheMisuse, match="not running"):
        cm.release_req(b)


@pytest.mark.parametrize("writer", ["host", "triton"])
def test_page_table_writers_agree(writer):
    cm = manager(num_pages=12, page_size=4, writer=writer)
    reqs = [Req(list(range(n)), i) for i, n in enumerate([3, 9, 4])]
    prefill(cm, reqs)
    assert cm.page_table[0, :4].tolist() == [0, 1, 2, 3]
    assert cm.page_table[1, :12].tolist() == list(range(4, 16))
    assert cm.page_table[2, :4].tolist() == list(range(16, 20))
    assert (cm.page_table[:, 12:] == UNMAPPED).all()
    cm.check_integrity()


def test_allocation_evicts_whole_pages_when_short():
    cm = manager(num_pages=4, page_size=4)
    a = Req(list(range(12)), 0)
    prefill(cm, [a])
    cm.cache_req(a, finished=True)  # 3 pages cached (12 tokens), 1 free
    assert cm.num_free_pages == 1 and cm.available_size == 16
    b = Req([90 + i for i in range(8)], 1)
    cm.admit(b)
    cm.allocate_paged([b])  # needs 2 pages: evicts the one cached leaf (3 pages)
    assert cm.prefix_cache.size_info.total_size == 0
    # free [12] + evicted pages [0, 4, 8] (page starts, not token slots); b takes [12, 0]
    assert cm.page_table[1, :8].tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
    assert cm.free_slots.tolist() == [4, 8]
    assert all(s % 4 == 0 for s in cm.free_slots.tolist())
    cm.check_integrity()


# --- errors and unchanged state -------------------------------------------------------


def test_out_of_pages_changes_nothing_and_does_not_evict():
    cm = manager(num_pages=5, page_size=4)
    a = Req(list(range(8)), 0)
    prefill(cm, [a])
    cm.cache_req(a, finished=True)  # 2 pages evictable, 3 free
    b = Req([70 + i for i in range(30)], 1)  # needs 8 pages > 3 + 2
    cm.admit(b)
    before = snapshot(cm)
    with pytest.raises(OutOfPages, match="needs 8 new page"):
        cm.allocate_paged([b])
    assert_same(before, snapshot(cm))
    cm.check_integrity()
    cm.release_req(b)
    cm.check_integrity()


def test_triton_writer_refuses_a_strided_table_before_taking_or_evicting_pages():
    # rows that are not contiguous: the Triton writer cannot write them. The refusal must come
    # before any page is taken, and before the prefix cache is evicted to make room
    table = new_page_table(64, 4, 4).T  # 4 rows x 65 positions, stride(1) == 4
    cm = CacheManager(3, 4, table, page_table_writer="host")
    a = Req(list(range(8)), 0)
    prefill(cm, [a])
    cm.cache_req(a, finished=True)  # 2 pages cached, 1 free
    cm.page_table_writer = "triton"
    b = Req([70 + i for i in range(9)], 1)  # needs 3 pages: 1 free + 2 to evict
    cm.admit(b)
    before = snapshot(cm)
    with pytest.raises(InvalidArgument, match=r"stride\(1\) == 1"):
        cm.allocate_paged([b])
    assert_same(before, snapshot(cm))
    cm.check_integrity()


def test_misuse_errors_raise_before_changing_anything():
    cm = manager(num_pages=8, page_size=4, rows=2, max_len=16)
    a = Req(list(range(6)), 0)
    prefill(cm, [a])
    before = snapshot(cm)
    cases = [
        (lambda: cm.allocate_paged([Req([1, 2], 5)]), InvalidArgument, "table_idx"),
        (lambda: cm.allocate_paged([Req([1, 2], 1), Req([3], 1)]), InvalidArgument, "appears twice"),
        (lambda: cm.allocate_paged([Req([1] * 20, 1)]), InvalidArgument, "fit the page table"),
        (lambda: cm.allocate_paged([Req([1, 2], 1, cached_len=3, device_len=2)]), InvalidArgument,
         "cached_len <= device_len"),
        (lambda: cm.allocate_paged([Req([1, 2, 3, 4, 5], 1, cached_len=4)]), InvalidArgument,
         "matched prefix"),
        (lambda: cm.allocate_paged([Req([1, 2], 0)]), InvalidArgument, "another running request"),
        (lambda: cm.cache_req(Req([1, 2], 1), finished=True), CacheMisuse, "not running"),
        (lambda: cm.admit(Req([1, 2], 0)), InvalidArgument, "already used"),
        (lambda: cm.admit(Req([1] * 17, 1)), InvalidArgument, "fit the page table"),
        (lambda: cm.prefix_cache.insert_prefix([1, 2, 3, 4], torch.arange(3, dtype=torch.int32)),
         InvalidArgument, "len\\(indices\\) == len\\(input_ids\\)"),
        (lambda: CacheManager(4, 4, cm.page_table, page_table_writer="gpu"), InvalidArgument,
         "page_table_writer"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
        assert_same(before, snapshot(cm))
    # cached_len beyond the mapped pages, and beyond device_len
    a.cached_len, a.device_len = 12, 13
    with pytest.raises(InvalidArgument, match="must be mapped"):
        cm.cache_req(a, finished=False)
    a.cached_len, a.device_len = 8, 7
    with pytest.raises(InvalidArgument, match="cached_len <= device_len"):
        cm.cache_req(a, finished=False)
    a.cached_len, a.device_len = 6, 7
    assert_same(before, snapshot(cm))
    # allocating the same pages twice would leak the first ones
    a.device_len = 9
    cm.allocate_paged([a])
    with pytest.raises(InvalidArgument, match="where the row's pages end"):
        a.cached_len = 4
        cm.allocate_paged([a])
    a.cached_len = 6


def test_unlocking_an_unlocked_handle_through_the_manager():
    cm = manager(page_size=2)
    _, h = cm.prefix_cache.insert_prefix([1, 2], torch.arange(2, dtype=torch.int32))
    with pytest.raises(CacheMisuse, match="not locked"):
        cm.unlock(h)


def test_caching_a_request_twice_after_it_finished_raises():
    cm = manager()
    a = Req(list(range(10)), 0)
    prefill(cm, [a])
    cm.cache_req(a, finished=True)
    before = snapshot(cm)
    with pytest.raises(CacheMisuse, match="not running"):
        cm.cache_req(a, finished=True)
    assert_same(before, snapshot(cm))


def test_check_integrity_names_a_lost_and_a_doubly_owned_page():
    cm = manager(num_pages=4, page_size=4)
    cm.free_slots = cm.free_slots[1:]
    with pytest.raises(IntegrityError, match="page 0 is lost"):
        cm.check_integrity()
    cm.free_slots = torch.tensor([0, 0, 4, 8, 12], dtype=torch.int32)
    with pytest.raises(IntegrityError, match="page 0 .* in 2 places: free, free"):
        cm.check_integrity()


# --- random traces ----------------------------------------------------------------------


def run_trace(data, page_size: int, writer: str, steps_max: int = 14) -> None:
    """Drive a random serving trace and check every invariant after every step."""
    P = page_size
    rng = random.Random(data.draw(st.integers(0, 2**16), label="seed"))
    unit = max(P, 4)  # prompt lengths scale with the page size
    num_pages = data.draw(st.integers(3, 10), label="num_pages") * unit // P
    rows = 4
    cm = manager(num_pages=num_pages, page_size=P, rows=rows, max_len=8 * unit + 16, writer=writer)
    common = [[rng.randrange(3) for _ in range(rng.randrange(1, 4 * unit))] for _ in range(3)]
    kv: dict[int, tuple] = {}
    rid = 0
    max_len = cm.page_table.shape[1]

    def new_prompt():
        base = rng.choice(common)
        cut = rng.randrange(1, len(base) + 1)
        extra = [rng.randrange(100) for _ in range(rng.choice([0, 1, unit, 2 * unit]))]
        return (base[:cut] + extra)[: 4 * unit] or [1]

    def check():
        cm.check_integrity()
        owners = cm.page_owners()
        free = {int(s) for s in cm.free_slots.tolist()}
        own_sets = []
        for req in cm.running:
            row = cm.page_table[req.table_idx].tolist()
            handle_len = req.cache_handle.cached_len if req.cache_handle else 0
            assert req.cache_handle is None or not req.cache_handle.node.detached  # never evicted
            for pos in range(req.cached_len):
                slot = row[pos]
                assert slot - slot % P not in free, f"row {req.table_idx} pos {pos} maps a free slot"
                who = owners[slot // P]
                assert who == [f"row {req.table_idx}"] or who[0].startswith("cache node")
                # the KV there was computed from this request's own tokens
                assert kv[slot] == tuple(req.input_ids[: pos + 1]), f"row {req.table_idx} pos {pos}"
            own = {s // P for s in row[handle_len: cm.allocated_pages(req) * P]}
            for other in own_sets:
                assert not own & other, "two running requests own the same page"
            own_sets.append(own)

    for _ in range(data.draw(st.integers(2, steps_max), label="steps")):
        op = data.draw(st.sampled_from(["prefill", "prefill", "decode", "finish", "abort", "flush"]),
                       label="op")
        running = cm.running
        if op == "prefill":
            free_rows = sorted(set(range(rows)) - {r.table_idx for r in running})
            if not free_rows:
                continue
            n = data.draw(st.integers(1, len(free_rows)), label="batch")
            batch = []
            for row in free_rows[:n]:
                prompt = new_prompt() if not batch or rng.random() < 0.5 else list(batch[0].input_ids)
                batch.append(Req(prompt, row, rid=rid))
                rid += 1
            for r in batch:
                cm.admit(r)
            before = snapshot(cm)
            try:
                cm.allocate_paged(batch)
            except OutOfPages:
                assert_same(before, snapshot(cm))
                for r in batch:
                    cm.release_req(r)
                check()
                continue
            for r in batch:
                forward(cm, r, kv)
                r.append_token(rng.randrange(3))
            for r in batch:
                cm.cache_req(r, finished=False)
        elif op == "decode":
            batch = [r for r in running if r.device_len < max_len]
            if not batch:
                continue
            before = snapshot(cm)
            try:
                cm.allocate_paged(batch)
            except OutOfPages:
                assert_same(before, snapshot(cm))
                cm.release_req(rng.choice(batch))  # the scheduler retracts one
                check()
                continue
            for r in batch:
                forward(cm, r, kv)
                r.append_token(rng.randrange(3))
            if rng.random() < 0.3:  # sometimes cache a running request mid-way (chunked prefill)
                cm.cache_req(rng.choice(batch), finished=False)
        elif op == "flush":  # everything finishes: the cache fills with evictable prefixes
            for req in running:
                cm.cache_req(req, finished=True)
        elif op in ("finish", "abort") and running:
            req = rng.choice(running)
            if op == "finish":
                cm.cache_req(req, finished=True)
            else:
                cm.release_req(req)
            with pytest.raises(CacheMisuse):
                cm.cache_req(req, finished=True)
        check()

    for req in cm.running:
        cm.cache_req(req, finished=True)
    check()
    info = cm.prefix_cache.size_info
    assert info.protected_size == 0
    assert cm.num_free_pages * P + info.evictable_size == num_pages * P  # everything freed or cached


@pytest.mark.parametrize("page_size", [1, 16])
@given(data=st.data())
def test_random_traces_keep_every_invariant(page_size, data):
    run_trace(data, page_size, "host")


@settings(max_examples=6)
@given(data=st.data())
def test_random_traces_with_the_triton_page_table_writer(data):
    run_trace(data, data.draw(st.sampled_from([1, 4]), label="page_size"), "triton", steps_max=8)


# --- the drawings -------------------------------------------------------------------------


def test_region_bar_draws_one_cell_per_position_and_hatches_what_is_freed():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from kvlab.course.viz import page_owner_strip, region_bar

    cm = manager(num_pages=10, page_size=4)
    prompt = list(range(10))
    a, b = Req(prompt, 0), Req(list(prompt), 1)
    prefill(cm, [a, b])
    cm.cache_req(a, finished=False)
    regions = cm.cache_req(b, finished=True)  # duplicate [0, 8) and tail [8, 10) both freed
    ax = region_bar(regions)
    cells = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(cells) == 10
    assert sum(bool(p.get_hatch()) for p in cells) == 10
    plt.close("all")
    cm.free_slots = torch.cat([cm.free_slots, cm.free_slots[:1]])  # break it: a page twice
    ax = page_owner_strip(cm)
    red = [p for p in ax.patches if matplotlib.colors.to_hex(p.get_edgecolor()) == "#d62728"]
    assert len(red) == 1
    plt.close("all")


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_and_host_writers_build_the_same_tables(seed):
    """One seeded serving sequence on two managers: identical page tables after every step."""
    rng = random.Random(seed)
    P = 4
    cms = [manager(num_pages=12, page_size=P, writer=w) for w in ("host", "triton")]
    reqs = [[Req([rng.randrange(3) for _ in range(rng.randrange(1, 14))], row) for row in range(3)]
            for _ in cms]
    reqs[1] = [Req(list(r.input_ids), r.table_idx) for r in reqs[0]]
    for cm, batch in zip(cms, reqs):
        prefill(cm, batch)
    assert torch.equal(cms[0].page_table, cms[1].page_table)
    for _ in range(6):
        token = rng.randrange(3)
        for cm, batch in zip(cms, reqs):
            for r in batch:
                r.append_token(token)
            cm.allocate_paged(batch)
            for r in batch:
                r.complete_one()
        assert torch.equal(cms[0].page_table, cms[1].page_table)
        for cm in cms:
            cm.check_integrity()
