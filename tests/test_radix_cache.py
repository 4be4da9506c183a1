"""kvlab.RadixPrefixCache (chapter 05): page-aligned matching against a plain-Python oracle,
splits on page boundaries, lock/unlock accounting, LRU eviction, and every misuse error."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab import CacheMisuse, IntegrityError, InvalidArgument, RadixPrefixCache
from kvlab.course.reference import PrefixStoreRef, page_aligned_len


def slots(start: int, n: int) -> torch.Tensor:
    """``n`` consecutive token slots from ``start`` (whole pages when start is page-aligned)."""
    return torch.arange(start, start + n, dtype=torch.int32)


def keys(cache: RadixPrefixCache) -> list[list[int]]:
    return [list(n.key) for n in cache.nodes()]


# --- matching and inserting ---------------------------------------------------------------


def test_empty_cache_matches_nothing():
    cache = RadixPrefixCache(4)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.handle.cached_len == 0 and m.cuda_handle is m.handle
    assert m.handle.get_matched_indices().numel() == 0
    assert cache.size_info == (0, 0)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_insert_caches_whole_pages_only(page_size):
    cache = RadixPrefixCache(page_size)
    ids = list(range(100, 111))  # 11 tokens
    already, handle = cache.insert_prefix(ids, slots(0, 11))
    assert already == 0
    assert handle.cached_len == page_aligned_len(11, page_size)
    assert cache.size_info.evictable_size == handle.cached_len
    assert handle.get_matched_indices().tolist() == list(range(handle.cached_len))
    # a second insert of the same ids finds them all cached and adds nothing
    again = cache.insert_prefix(ids, slots(40, 11))
    assert again.cached_len == handle.cached_len
    assert cache.size_info.evictable_size == handle.cached_len
    assert again.handle.get_matched_indices().tolist() == list(range(handle.cached_len))


def test_match_is_page_aligned_and_splits_on_page_boundaries():
    cache = RadixPrefixCache(2)
    cache.insert_prefix([1, 2, 3, 4, 5, 6, 7, 8], slots(10, 8))
    # 1 2 | 3 4 | 5 9: the third page differs in its second token -> two pages match
    m = cache.match_prefix([1, 2, 3, 4, 5, 9])
    assert m.cached_len == 4
    assert m.handle.get_matched_indices().tolist() == [10, 11, 12, 13]
    assert keys(cache) == [[1, 2, 3, 4], [5, 6, 7, 8]]  # split at 4, a page boundary
    # a lone partial page never matches
    assert cache.match_prefix([1]).cached_len == 0
    assert cache.match_prefix([1, 2, 3]).cached_len == 2
    cache.check_integrity()


def test_branching_insert_shares_the_common_pages():
    cache = RadixPrefixCache(2)
    cache.insert_prefix([1, 2, 3, 4, 5, 6], slots(0, 6))
    already, h = cache.insert_prefix([1, 2, 3, 4, 7, 8, 9], slots(20, 7))
    assert already == 4 and h.cached_len == 6
    assert h.get_matched_indices().tolist() == [0, 1, 2, 3, 24, 25]
    assert sorted(keys(cache)) == [[1, 2, 3, 4], [5, 6], [7, 8]]
    assert cache.size_info.evictable_size == 8
    cache.check_integrity()


def test_insert_rejects_mismatched_lengths_and_split_pages():
    cache = RadixPrefixCache(4)
    with pytest.raises(InvalidArgument, match="indices"):
        cache.insert_prefix([1, 2, 3, 4], slots(0, 3))
    with pytest.raises(InvalidArgument, match="whole physical page"):
        cache.insert_prefix([1, 2, 3, 4], torch.tensor([0, 1, 2, 7], dtype=torch.int32))
    with pytest.raises(InvalidArgument, match="whole physical page"):
        cache.insert_prefix([1, 2, 3, 4], slots(2, 4))  # starts mid-page
    assert cache.nodes() == [] and cache.size_info == (0, 0)
    with pytest.raises(InvalidArgument, match="page_size"):
        RadixPrefixCache(0)


def test_refused_insert_does_not_split_or_touch_the_tree():
    # the new part [2, 4) diverges inside node [1 2 3 4]: a walk would split it; the slots
    # are refused first, so the node, the clock and the LRU order stay as they were
    cache = RadixPrefixCache(2)
    cache.insert_prefix([1, 2, 3, 4], slots(0, 4))
    before = ([(n.uid, n.key, n.last_access) for n in cache.nodes()], cache.clock)
    with pytest.raises(InvalidArgument, match="whole physical page"):
        cache.insert_prefix([1, 2, 5, 6], torch.tensor([0, 1, 5, 4], dtype=torch.int32))
    assert ([(n.uid, n.key, n.last_access) for n in cache.nodes()], cache.clock) == before
    cache.check_integrity()
    # the same insert with good slots does split, and inserts after the cached page
    already, handle = cache.insert_prefix([1, 2, 5, 6], slots(4, 4))
    assert already == 2 and handle.get_matched_indices().tolist() == [0, 1, 6, 7]
    assert sorted(keys(cache)) == [[1, 2], [3, 4], [5, 6]]


# --- locking ----------------------------------------------------------------------------


def test_lock_moves_tokens_between_evictable_and_protected():
    cache = RadixPrefixCache(2)
    _, h1 = cache.insert_prefix([1, 2, 3, 4], slots(0, 4))
    _, h2 = cache.insert_prefix([1, 2, 3, 4, 5, 6], slots(0, 6))
    cache.lock_handle(h2)
    assert cache.size_info == (0, 6)
    cache.lock_handle(h1)
    assert cache.size_info == (0, 6)
    assert [n.ref_count for n in cache.nodes()] == [2, 1]
    cache.lock_handle(h2, unlock=True)
    assert cache.size_info == (2, 4)
    cache.lock_handle(h1, unlock=True)
    assert cache.size_info == (6, 0)
    cache.check_integrity()


def test_unlocking_an_unlocked_handle_raises_and_changes_nothing():
    cache = RadixPrefixCache(2)
    _, h = cache.insert_prefix([1, 2, 3, 4], slots(0, 4))
    with pytest.raises(CacheMisuse, match="not locked"):
        cache.lock_handle(h, unlock=True)
    cache.lock_handle(h)
    cache.lock_handle(h, unlock=True)
    with pytest.raises(CacheMisuse, match="not locked"):
        cache.lock_handle(h, unlock=True)
    assert cache.size_info == (4, 0)
    cache.check_integrity()


def test_locking_an_evicted_handle_raises():
    cache = RadixPrefixCache(2)
    _, h = cache.insert_prefix([1, 2], slots(0, 2))
    assert cache.evict(2).tolist() == [0, 1]
    with pytest.raises(CacheMisuse, match="no longer in this cache"):
        cache.lock_handle(h)
    with pytest.raises(InvalidArgument, match="handle"):
        cache.lock_handle("not a handle")


def test_each_owner_takes_back_only_its_own_locks():
    cache = RadixPrefixCache(2)
    _, short = cache.insert_prefix([1, 2], torch.arange(2, dtype=torch.int32))
    _, long = cache.insert_prefix([1, 2, 3, 4], torch.arange(4, dtype=torch.int32))
    cache.lock_handle(long, owner="A")
    cache.lock_handle(short, owner="B")
    assert cache.is_locked_by(long, "A") and not cache.is_locked_by(long, "B")
    with pytest.raises(CacheMisuse, match="owner 'B'"):
        cache.lock_handle(long, unlock=True, owner="B")  # B locked the shorter prefix only
    with pytest.raises(CacheMisuse):
        cache.lock_handle(short, unlock=True, owner="A")
    assert [n.ref_count for n in cache.nodes()] == [2, 1]
    cache.check_integrity()
    cache.lock_handle(long, unlock=True, owner="A")
    cache.lock_handle(short, unlock=True, owner="B")
    assert cache.size_info == (4, 0)
    with pytest.raises(InvalidArgument, match="owner"):
        cache.lock_handle(short, owner=["not", "hashable"])
    cache.check_integrity()


def test_the_root_handle_protects_nothing_and_locking_it_is_a_no_op():
    cache = RadixPrefixCache(4)
    root = cache.match_prefix([1, 2]).handle
    assert root.cached_len == 0
    cache.lock_handle(root, owner="x")
    cache.lock_handle(root, unlock=True, owner="y")
    assert cache.is_locked_by(root, "anyone") and cache.size_info == (0, 0)
    cache.check_integrity()


def test_check_integrity_counts_locks_against_ref_counts():
    cache = RadixPrefixCache(2)
    _, h = cache.insert_prefix([1, 2], torch.arange(2, dtype=torch.int32))
    cache.lock_handle(h, owner="A")
    cache.nodes()[0].ref_count += 1  # a lock nobody holds
    with pytest.raises(IntegrityError, match="1 lock"):
        cache.check_integrity()


def test_the_split_node_keeps_its_stamp_on_the_lower_half():
    cache = RadixPrefixCache(2)
    cache.insert_prefix([1, 2, 3, 4], torch.arange(4, dtype=torch.int32))
    stamp = cache.nodes()[0].last_access
    cache.match_prefix([1, 2, 9, 9])
    upper, lower = cache.nodes()
    assert upper.key == (1, 2) and upper.last_access == cache.clock
    assert lower.key == (3, 4) and lower.last_access == stamp < cache.clock


# --- eviction ---------------------------------------------------------------------------


def test_evict_takes_least_recently_used_leaves_first():
    cache = RadixPrefixCache(2)
    cache.insert_prefix([1, 2, 3, 4], slots(0, 4))  # A: oldest
    cache.insert_prefix([5, 6], slots(4, 2))  # B
    cache.insert_prefix([7, 8], slots(6, 2))  # C
    cache.match_prefix([1, 2, 3, 4, 9])  # touch A: now B is the least recently used
    assert cache.evict(1).tolist() == [4, 5]  # a whole leaf goes, more than asked
    assert cache.evict(2).tolist() == [6, 7]
    assert cache.evict(2).tolist() == [0, 1, 2, 3]
    assert cache.size_info == (0, 0) and cache.nodes() == []


def test_evict_never_touches_locked_nodes_and_returns_what_it_can():
    cache = RadixPrefixCache(2)
    _, h = cache.insert_prefix([1, 2, 3, 4], slots(0, 4))
    cache.insert_prefix([1, 2, 3, 4, 5, 6], slots(0, 6))
    cache.insert_prefix([9, 9], slots(8, 2))
    cache.lock_handle(h)
    freed = cache.evict(100)  # more than evictable: frees all unlocked, raises nothing
    assert sorted(freed.tolist()) == [4, 5, 8, 9]
    assert cache.size_info == (0, 4)
    assert h.get_matched_indices().tolist() == [0, 1, 2, 3]
    assert cache.evict(0).numel() == 0
    cache.lock_handle(h, unlock=True)
    assert cache.evict(1).tolist() == [0, 1, 2, 3]


def test_evicting_a_leaf_exposes_its_parent():
    cache = RadixPrefixCache(1)
    cache.insert_prefix([1, 2], slots(0, 2))
    cache.insert_prefix([1, 3], torch.tensor([0, 5], dtype=torch.int32))
    # tree: [1] -> {[2], [3]}; evicting 3 tokens must remove both leaves and then the parent
    assert sorted(cache.evict(3).tolist()) == [0, 1, 5]
    assert cache.nodes() == []


def test_reset_refuses_while_locked_and_returns_the_slots():
    cache = RadixPrefixCache(2)
    _, h = cache.insert_prefix([1, 2, 3, 4], slots(0, 4))
    cache.lock_handle(h)
    with pytest.raises(CacheMisuse, match="locked"):
        cache.reset()
    cache.lock_handle(h, unlock=True)
    assert sorted(cache.reset().tolist()) == [0, 1, 2, 3]
    assert cache.nodes() == [] and cache.size_info == (0, 0)


def test_check_integrity_catches_wrong_sizes():
    cache = RadixPrefixCache(2)
    cache.insert_prefix([1, 2], slots(0, 2))
    cache.evictable_size += 2
    with pytest.raises(IntegrityError, match="size_info"):
        cache.check_integrity()


def test_tensor_ids_work_like_lists():
    cache = RadixPrefixCache(2)
    cache.insert_prefix(torch.tensor([1, 2, 3, 4]), slots(0, 4))
    assert cache.match_prefix(torch.tensor([1, 2, 3, 4, 5])).cached_len == 4
    with pytest.raises(InvalidArgument, match="1-D"):
        cache.match_prefix(torch.zeros(2, 2, dtype=torch.int64))


# --- random operations against the oracle -----------------------------------------------

PROMPTS = st.lists(st.integers(0, 3), min_size=0, max_size=24)


@given(data=st.data())
def test_random_inserts_match_the_oracle(data):
    """Inserts, matches, locks and evictions in random order. The oracle knows which tokens
    are cached (a list of sequences) and which slot each cached page got first."""
    page_size = data.draw(st.sampled_from([1, 2, 4]), label="page_size")
    cache = RadixPrefixCache(page_size)
    ref = PrefixStoreRef(page_size)
    first_slots: dict[tuple, list[int]] = {}  # page-aligned prefix -> slots of its last page
    next_page = 0
    locked: list = []
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        op = data.draw(st.sampled_from(["insert", "insert", "match", "lock", "evict"]))
        ids = data.draw(PROMPTS, label="ids")
        if op == "insert":
            n = len(ids)
            ind = slots(next_page * page_size, n)  # fresh whole pages
            next_page += -(-n // page_size)
            already_ref, insert_len = ref.insert(ids)
            already, handle = cache.insert_prefix(ids, ind)
            assert (already, handle.cached_len) == (already_ref, insert_len)
            for k in range(already, insert_len, page_size):
                first_slots.setdefault(tuple(ids[:k + page_size]), ind[k:k + page_size].tolist())
        elif op == "match":
            m = cache.match_prefix(ids)
            assert m.cached_len == ref.match_len(ids)
            expect = [s for k in range(0, m.cached_len, page_size)
                      for s in first_slots[tuple(ids[:k + page_size])]]
            assert m.handle.get_matched_indices().tolist() == expect
        elif op == "lock":
            m = cache.match_prefix(ids)
            cache.lock_handle(m.handle)
            locked.append((tuple(ids[:m.cached_len]), m.handle.get_matched_indices().tolist(), m.handle))
        else:
            n = data.draw(st.integers(0, 20), label="evict")
            before = cache.size_info
            freed = cache.evict(n).tolist()
            assert len(freed) == before.evictable_size - cache.size_info.evictable_size
            assert len(freed) >= min(n, before.evictable_size)
            assert cache.size_info.protected_size == before.protected_size
            # the oracle forgets everything and relearns what the tree still holds
            ref.sequences = [_path_ids(node) for node in cache.nodes() if node.is_leaf()]
            first_slots = {p: s for p, s in first_slots.items() if ref.match_len(p) == len(p)}
        cache.check_integrity()
        for prefix, idx, handle in locked:  # locked prefixes survive every eviction
            assert not handle.node.detached
            assert cache.match_prefix(list(prefix)).cached_len >= len(prefix)
            assert handle.get_matched_indices().tolist() == idx
    all_slots = cache.all_cached_indices().tolist()
    assert len(all_slots) == len(set(all_slots)) == cache.size_info.total_size


def _path_ids(node) -> tuple:
    parts = [n.key for n in node.path_to_root()]
    return tuple(t for key in reversed(parts) for t in key)


def test_snapshot_is_plain_data_that_outlives_the_cache_state():
    cache = RadixPrefixCache(2)
    _, h = cache.insert_prefix([1, 2, 3, 4], slots(4, 4))
    cache.insert_prefix([1, 2, 7, 7], slots(12, 4))
    cache.lock_handle(h, owner="A")
    snap = cache.snapshot()
    assert snap.page_size == 2 and snap.clock == cache.clock
    assert (snap.evictable_size, snap.protected_size) == (2, 4)
    by_pages = {n.pages: n for n in snap.nodes}
    top = by_pages[((1, 2),)]
    assert top.parent is None and top.page_ids == (2,) and top.ref_count == 1
    assert by_pages[((3, 4),)].parent == top.uid and by_pages[((7, 7),)].page_ids == (7,)
    cache.evict(2)
    cache.lock_handle(h, unlock=True, owner="A")
    assert len(snap.nodes) == 3 and top.ref_count == 1  # the snapshot did not move with the cache
    assert all(isinstance(n, tuple) for n in snap.nodes)


def test_evict_leaves_and_undo_evict_put_the_tree_back():
    cache = RadixPrefixCache(1)
    cache.insert_prefix([1, 2], slots(0, 2))
    cache.insert_prefix([1, 3], torch.tensor([0, 5], dtype=torch.int32))
    before = cache.snapshot()
    evicted = cache.evict_leaves(3)  # both leaves, then their parent
    assert [n.key for n in evicted][-1] == (1,) and cache.nodes() == []
    cache.undo_evict(evicted)
    assert cache.snapshot() == before
    cache.check_integrity()
    evicted = cache.evict_leaves(1)  # one leaf under [1]
    cache.insert_prefix([1, 2], slots(20, 2))  # the tree changed meanwhile
    cache.insert_prefix([1, 3], slots(30, 2))
    with pytest.raises(CacheMisuse, match="cannot go back"):
        cache.undo_evict(evicted)


def test_matched_indices_of_an_evicted_handle_raise():
    cache = RadixPrefixCache(2)
    _, h = cache.insert_prefix([1, 2], slots(0, 2))
    cache.evict(2)
    with pytest.raises(CacheMisuse, match="evicted"):
        h.get_matched_indices()


# --- the drawing --------------------------------------------------------------------------


def test_tree_drawing_marks_locked_new_and_evicted_nodes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.course.viz.tree import LOCKED, NEW_EDGE, draw_tree

    cache = RadixPrefixCache(2)
    _, keep = cache.insert_prefix([1, 2, 3, 4], slots(0, 4))
    cache.insert_prefix([9, 9], slots(8, 2))
    cache.lock_handle(keep)
    before = cache.snapshot()
    cache.evict(2)  # the unlocked [9 9] goes
    cache.insert_prefix([1, 2, 3, 4, 5, 6], slots(0, 6))  # a new child under the locked node
    ax = draw_tree(cache, previous=before)
    texts = {t.get_text(): t for t in ax.texts}
    assert "[9 9]\nevicted" in texts
    locked = [t for k, t in texts.items() if k.startswith("[1 2|3 4]")]
    assert len(locked) == 1 and matplotlib.colors.to_hex(locked[0].get_bbox_patch().get_facecolor()) == LOCKED
    new = [t for k, t in texts.items() if k.startswith("[5 6]")]
    assert matplotlib.colors.to_hex(new[0].get_bbox_patch().get_edgecolor()) == NEW_EDGE
    assert "ref 1 · t" in locked[0].get_text()
    plt.close("all")


@pytest.mark.parametrize("into", [(), [None], "nodes"])
def test_evict_leaves_fills_only_an_empty_list_of_the_callers(into):
    """``into`` is for a rollback: a list that already holds something would mix this call's
    nodes with others (and undo_evict would put those back too), so it is refused unchanged."""
    cache = RadixPrefixCache(2)
    cache.insert_prefix([1, 2, 3, 4], slots(0, 4))
    before = [(n.uid, n.key, n.last_access) for n in cache.nodes()]
    kept = list(into) if isinstance(into, list) else into
    with pytest.raises(InvalidArgument, match="into"):
        cache.evict_leaves(2, into=into)
    assert [(n.uid, n.key, n.last_access) for n in cache.nodes()] == before and into == kept
    mine: list = []
    assert cache.evict_leaves(2, into=mine) is mine and [list(n.key) for n in mine] == [[1, 2, 3, 4]]
