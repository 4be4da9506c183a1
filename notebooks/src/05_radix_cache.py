# %% [markdown]
# # 05 · The radix prefix cache: requests that share a prefix share its pages
#
# **Goal.** Build the prefix cache of mini-sglang: a tree of cached token sequences whose KV
# pages a new request can reuse instead of recomputing. By the end you can say what
# `match_prefix`, `insert_prefix`, `lock_handle` and `evict` do to the tree, why every key is
# cut on **page boundaries**, why a request never matches its *last* prompt token, and which
# cached pages an out-of-memory server may throw away.
#
# Chapters 01-04 gave every request pages of its own. But requests repeat themselves: every
# turn of a chat re-sends the whole conversation, and thousands of requests start with the
# same system prompt. Their KV vectors are identical (same tokens, same positions, same
# model), so computing and storing them once per request wastes both GPU time and pages.

# %%
import random

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab import CacheManager, Req, RadixPrefixCache
from kvlab.scenes.ch05_radix import radix_steps, shared_prefix_figure
from kvlab.reference import PrefixStoreRef, page_aligned_len
from kvlab.viz import draw_tree, draw_tree_steps

torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Intuition: one system prompt, many requests
#
# Two requests begin with the same 12-token system prompt. The first one computes it and
# leaves its pages in the **prefix cache**; the second finds them there and maps the *same
# physical pages* into its own page-table row. Only its own question gets new pages. In the
# heatmap below, colour is the physical page: the first three pages of both rows are one and
# the same.

# %%
shared_prefix_figure()
plt.show()

# %% [markdown]
# ## Build-up 1: a prefix store made of whole pages
#
# What does "the cache holds a prefix" mean when memory comes in pages of `P` slots? The KV of
# a token depends on *every token before it*, so a cached page is only reusable by a request
# whose tokens agree **from the very start** up to the end of that page. And a page is the
# unit the page table maps: a request cannot borrow half a page and fill the other half with
# its own tokens, because the other half belongs to whoever wrote it.
#
# So the simplest correct store has one entry per cached page, keyed by *all the tokens from
# the start up to the end of that page*:
#
# ```
# P = 2, cached prompt [1 2 3 4 5 6 7]          key (prefix up to page end)  ->  page's slots
#                                                (1, 2)                          [6, 7]
# only whole pages: the 7th token is not cached  (1, 2, 3, 4)                    [8, 9]
#                                                (1, 2, 3, 4, 5, 6)              [10, 11]
# ```

# %%
P = 2


def page_store_insert(store: dict, input_ids: list, indices: list, page_size: int):
    """Insert the whole pages of input_ids; return (cached_len, new_entries), store unchanged."""
    insert_len = len(input_ids) // page_size * page_size  # only whole pages
    cached_len = 0
    while cached_len < insert_len and tuple(input_ids[:cached_len + page_size]) in store:
        cached_len += page_size  # already cached: the caller's slots here are duplicates
    new_entries = {tuple(input_ids[:start + page_size]): list(indices[start:start + page_size])
                   for start in range(cached_len, insert_len, page_size)}
    return cached_len, new_entries


def page_store_match(store: dict, input_ids: list, page_size: int) -> int:
    """Longest cached prefix of input_ids, in whole pages."""
    matched = 0
    while matched + page_size <= len(input_ids) and tuple(input_ids[:matched + page_size]) in store:
        matched += page_size
    return matched


store: dict = {}
cached_len, new = page_store_insert(store, [1, 2, 3, 4, 5, 6, 7], list(range(6, 13)), P)
store.update(new)
for key, slots in store.items():
    print(f"{str(key):22s} -> {slots}")
print("cached before:", cached_len)
assert cached_len == 0 and len(store) == 3  # 7 tokens = 3 whole pages + 1 token left over

# %% [markdown]
# A second prompt with the same first two pages finds them cached. `insert` says how many
# tokens were *already* cached (4): the caller computed its own copy of those, and those
# copies are now duplicates it must give back. Chapter 06 is about exactly that bookkeeping.

# %%
cached_len, new = page_store_insert(store, [1, 2, 3, 4, 8, 9, 10], list(range(20, 27)), P)
print("already cached:", cached_len, "| new entries:", new)
store.update(new)
assert cached_len == 4 and list(new) == [(1, 2, 3, 4, 8, 9)]
print("match [1 2 3 4 5 6 0]:", page_store_match(store, [1, 2, 3, 4, 5, 6, 0], P))
print("match [1 2 3]        :", page_store_match(store, [1, 2, 3], P), " (a lone half page never matches)")
assert page_store_match(store, [1, 2, 3, 4, 5, 6, 0], P) == 6
assert page_store_match(store, [1, 2, 3], P) == 2

# %% [markdown]
# This store is correct but wasteful: the key of page *k* repeats all *k* earlier pages, so
# a prompt of *n* pages stores about *n²/2* pages of keys, and matching hashes ever longer
# tuples. A **radix tree** stores each run of pages once: a node holds a sequence of whole
# pages that no cached prompt branches out of, its children hang off its end, and a child is
# found by its **first page** of tokens. Page-aligned everywhere:
#
# * a node's key is a whole number of pages, and its value is the KV slot of each key token;
# * a child is looked up by its first *page* (`tuple(ids[i:i + P])`), so fewer than `P`
#   remaining tokens can never match;
# * when a prompt leaves a node part-way, the node is **split** at the last whole matched page.
#
# `kvlab.RadixPrefixCache` is that tree (mini-sglang's `RadixPrefixCache`). Its nodes carry
# two more fields: `ref_count` (how many running requests use the node: locked nodes are never
# evicted) and `last_access` (an access counter for least-recently-used eviction; a counter
# rather than wall time, so every run of this notebook draws the same trees).

# %%
cache = RadixPrefixCache(page_size=2, device="cpu")
r = cache.insert_prefix([1, 2, 3, 4, 5, 6, 7], torch.arange(6, 13, dtype=torch.int32))
print(r)  # nothing was cached before; the handle covers the 6 inserted tokens
r = cache.insert_prefix([1, 2, 3, 4, 8, 9, 10], torch.arange(20, 27, dtype=torch.int32))
print("already cached:", r.cached_len, "| inserted handle covers", r.handle.cached_len, "tokens")
print("its slots:", r.handle.get_matched_indices().tolist())
for node in cache.nodes():
    print(f"  node {node.uid}: key {list(node.key)}, slots {node.value.tolist()}")
assert r.cached_len == 4 and r.handle.get_matched_indices().tolist() == [6, 7, 8, 9, 24, 25]
draw_tree(cache)
plt.show()

# %% [markdown]
# The second insert walked `[1 2|3 4]`, found that the first node continues with `[5 6]`
# while the prompt continues with `[8 9]`, and split the node after its second page. Its
# `[8 9]` became a new child with the caller's slots `24, 25` (the caller's slots `20..23`
# for the shared part were not taken: the cache already has `6..9`). The last token `10` is
# half a page and is not cached.
#
# ## Matching, and why `match_req` drops the last token
#
# `match_prefix(ids)` returns a **handle**: the matched length (`cached_len`) and the node it
# ends at; `handle.get_matched_indices()` gathers the slots from the root down. A match that
# ends inside a node splits it, so the handle always ends exactly at a node boundary.

# %%
m = cache.match_prefix([1, 2, 3, 4, 5, 0, 0])
print("cached_len:", m.cached_len, "slots:", m.handle.get_matched_indices().tolist())
assert m.cached_len == 4  # [5 0] is a different page from [5 6]
m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
assert m.cached_len == 6

# %% [markdown]
# A server does not match the whole prompt, though: `CacheManager.match_req` matches
# `input_ids[:input_len - 1]`. The prefill's job is to produce the logits of the *next*
# token, and those come out of the forward pass at the last prompt position. If every prompt
# token were a cache hit there would be nothing to run the model on, and no next token. Cutting
# the last token guarantees at least one position is computed. (With pages, the cut costs more
# than one token when the prompt ends exactly on a page boundary: that whole last page is
# recomputed.)

# %%
cm = CacheManager(num_pages=16, page_size=2,
                  page_table=kvlab.paging.new_page_table(2, 16, 2))
cm.prefix_cache.insert_prefix([1, 2, 3, 4, 5, 6], torch.arange(6, dtype=torch.int32))
for prompt in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]):
    hit = cm.match_req(Req(prompt, table_idx=0)).cached_len
    print(f"prompt {prompt}: full match {cm.prefix_cache.match_prefix(prompt).cached_len}, "
          f"match_req {hit}, tokens to compute {len(prompt) - hit}")
    assert len(prompt) - hit >= 1
assert cm.match_req(Req([1, 2, 3, 4, 5, 6], 0)).cached_len == 4

# %% [markdown]
# ## Locks, reference counts and LRU eviction, step by step
#
# A running request **locks** its handle: `lock_handle` adds one to the `ref_count` of every
# node from the handle's node up to the root, because the request reads all of them. Locked
# tokens count as `protected_size`; everything else is `evictable_size`. When the pool runs
# short, `evict(n)` removes **whole unlocked leaves**, least recently used first, until at least
# `n` tokens are freed (it may free more: a leaf goes whole). Removing a leaf may expose its
# parent as a new leaf, which can go next. A locked node is never a candidate, and its
# ancestors are locked too, so a running request's prefix can never disappear under it.
#
# The story below (page_size 2) inserts prompts A and D, inserts B (which shares A's system
# prompt and splits A's node), locks B as if it were running, matches a prompt C (touching A's
# branch, so it becomes *recently used*), evicts, then lets B finish (unlock) and evicts
# again. Green border: new in that step; orange: locked; faded: evicted.

# %%
steps, story_cache = radix_steps()
for title, snap in steps:
    print(f"{title:40s} evictable {snap.evictable_size:2d}  locked {snap.protected_size:2d}  "
          f"nodes {len(snap.nodes)}")
draw_tree_steps(steps, ncols=4, panel_width=3.6, panel_height=2.9)
plt.show()

# %% [markdown]
# Read the panels from "match C" on. After the match, the unlocked leaves are `[5 6]`
# (touched at tick 8) and `[20 21|22 23]` (last touched at tick 4). `evict(1)` asks for a
# single token, but a leaf goes whole, so 4 tokens of D come back; B's branch is locked and
# stays. When B finishes, unlocking takes its ref counts back to 0 all the way up: now
# `[8 9|10 11]` (tick 7) is older than `[5 6]` (tick 8), so it is the next to go.
#
# Finally, lock what is left of the system prompt (as a new request would) and ask for far
# more than is evictable: `evict` frees every unlocked leaf and returns what it got, and the
# locked node stays.

# %%
keep = story_cache.match_prefix([1, 2, 3, 4, 0]).handle
story_cache.lock_handle(keep)
info_before = story_cache.size_info
freed = story_cache.evict(100)  # more than is evictable: evict frees what it can
print("freed slots:", freed.tolist())
print("size before:", info_before, "after:", story_cache.size_info)
assert story_cache.size_info.protected_size == info_before.protected_size == 4  # locked: untouched
assert story_cache.size_info.evictable_size == 0
assert freed.numel() == info_before.evictable_size
assert keep.get_matched_indices().tolist() == [6, 7, 8, 9]

# %% [markdown]
# Two details matter for the cache manager in chapter 06:
#
# * `evict` returns **token slots** (`P` per page), while the free list holds **page starts**:
#   the manager appends `evicted[::P]`. Keep that stride straight or pages leak or double up.
# * `evict` in kvlab returns what it could when fewer tokens are evictable than asked. The
#   manager therefore checks `size_info.evictable_size` *before* evicting: when even evicting
#   everything would not be enough it raises `OutOfPages` without touching the cache.
#
# Unlocking something that is not locked is a bug in the caller, and kvlab says so:

# %%
_, handle = story_cache.insert_prefix([7, 7, 7, 7], torch.arange(40, 44, dtype=torch.int32))
try:
    story_cache.lock_handle(handle, unlock=True)
except kvlab.CacheMisuse as e:
    print("CacheMisuse:", e)
else:
    raise AssertionError("unlocking an unlocked handle must raise")

# %% [markdown]
# ## Validate against the reference
#
# `kvlab.reference.PrefixStoreRef` is the obviously-right version: a list of cached token
# sequences, a match is the longest common prefix with any of them, rounded down to whole
# pages. We insert seeded random prompts drawn from a few shared beginnings into both, and
# compare every match, every "already cached" length, and every handle's slots against the
# slots each page got when it was first inserted.

# %%
rng = random.Random(5)
for page_size in (1, 2, 4):
    tree, ref = RadixPrefixCache(page_size, device="cpu"), PrefixStoreRef(page_size)
    first_slots, next_slot = {}, 0
    beginnings = [[rng.randrange(4) for _ in range(8)] for _ in range(3)]
    for _ in range(40):
        ids = rng.choice(beginnings)[: rng.randrange(0, 9)] + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        slots = torch.arange(next_slot, next_slot + len(ids), dtype=torch.int32)
        next_slot += -(-len(ids) // page_size) * page_size
        if rng.random() < 0.5:  # insert
            already_ref, insert_len = ref.insert(ids)
            already, handle = tree.insert_prefix(ids, slots)
            assert (already, handle.cached_len) == (already_ref, insert_len)
            for k in range(already, insert_len, page_size):
                first_slots[tuple(ids[:k + page_size])] = slots[k:k + page_size].tolist()
        else:  # match
            m = tree.match_prefix(ids)
            assert m.cached_len == ref.match_len(ids) == page_aligned_len(m.cached_len, page_size)
            expect = [s for k in range(0, m.cached_len, page_size) for s in first_slots[tuple(ids[:k + page_size])]]
            assert m.handle.get_matched_indices().tolist() == expect
        tree.check_integrity()
    print(f"page_size {page_size}: 40 random operations agree with the reference; "
          f"{len(tree.nodes())} nodes hold {tree.size_info.total_size} tokens "
          f"(the page store would need {len(first_slots)} keys of up to {max(map(len, first_slots), default=0)} tokens)")

# %% [markdown]
# ## The picture: which rows share which pages
#
# Four requests from two conversations go through a `CacheManager` (chapter 06 builds it):
# each is **admitted** (match, lock, map the hit into its row), gets pages for the rest, runs
# its prefill, and is cached. Later arrivals map the earlier ones' pages. Colour = physical
# page; equal colours in different rows are shared pages.

# %%
P4 = 4
cm = CacheManager(num_pages=24, page_size=P4,
                  page_table=kvlab.paging.new_page_table(4, 24, P4))
system_a, system_b = list(range(100, 110)), list(range(200, 206))
prompts = [system_a + [1, 2, 3], system_b + [4, 5, 6, 7, 8], system_a + [9, 9, 9, 9, 9, 9], system_b + [4, 5, 6, 7, 1]]
for row, prompt in enumerate(prompts):
    req = Req(prompt, table_idx=row)
    hit = cm.admit(req).cached_len
    cm.allocate_paged([req])
    req.complete_one()
    cm.cache_req(req, finished=False)
    print(f"row {row}: {len(prompt)} tokens, {hit} from the cache")
cm.check_integrity()
kvlab.viz.page_table_heatmap(cm.page_table[:4, :20], P4, title="shared pages across rows")
plt.show()
assert torch.equal(cm.page_table[2, :8], cm.page_table[0, :8])  # system_a's 2 whole pages
assert torch.equal(cm.page_table[3, :8], cm.page_table[1, :8])  # system_b + [4 5]: 2 pages

# %% [markdown]
# ## Your turn
#
# **Exercise `match_prefix`.** Write `my_match_prefix(cache, input_ids) -> int`: walk a real
# `RadixPrefixCache` from `cache.root`, find each child by the next whole page
# (`node.children.get(tuple(...))`), count how far its `node.key` agrees with the prompt, round
# down to whole pages, and stop when the prompt leaves the tree. Only read the tree (no splits).
#
# **Exercise `match_req`.** Write `my_match_req(prefix_cache, input_ids)`: how a server matches
# a new request's prompt. Return what `prefix_cache.match_prefix` returns (a `MatchResult`; the
# matched length as an int is accepted too). Remember what the prefill is for: the checker
# tries a prompt that is cached whole, a one-token prompt, page size 1, and a prompt one page
# longer than the cache.
#
# **Exercise `insert_prefix`.** `page_store_insert` from the build-up is the answer to the
# second exercise; the checker runs it on edge cases (partial last pages, everything cached,
# equal page contents after a different first page, page size 1) and random ones.
#
# The cells below are pre-filled with working answers so that they pass; clear them and
# write your own. Stuck? `kvlab.check.hint("match_prefix", 1)` (then 2, 3) gives hints in
# steps, and `kvlab.solutions.show("match_prefix")` prints a reference solution (the same for
# `"match_req"`). A wrong answer is reported with the case it failed on, as below: the
# whole prompt matched, when the prefill needs its last token.

# %%
def my_match_prefix(cache, input_ids):
    P = cache.page_size
    node, matched = cache.root, 0
    while len(input_ids) - matched >= P:
        child = node.children.get(tuple(input_ids[matched:matched + P]))
        if child is None:
            break
        n = 0
        while n < child.length and matched + n < len(input_ids) and child.key[n] == input_ids[matched + n]:
            n += 1
        n = n // P * P
        matched += n
        if n < child.length:
            break
        node = child
    return matched


def my_match_req(prefix_cache, input_ids):
    return prefix_cache.match_prefix(input_ids[: len(input_ids) - 1])  # the last token is computed


kvlab.check.match_prefix(my_match_prefix)
kvlab.check.match_req(my_match_req)
kvlab.check.insert_prefix(page_store_insert)

# %%
kvlab.check.hint("match_prefix", 1)
# kvlab.solutions.show("match_prefix")   # uncomment to read the reference solution


def match_whole_prompt(prefix_cache, input_ids):  # a typical slip: the last token is matched too
    return prefix_cache.match_prefix(input_ids)


try:
    kvlab.check.match_req(match_whole_prompt)
except kvlab.check.CheckFailed as e:
    print("CheckFailed:", str(e).splitlines()[0])
else:
    raise AssertionError("matching the whole prompt must be rejected")

# %% [markdown]
# ## Lift: the notebook's functions vs kvlab
#
# Your `my_match_prefix` must agree with `kvlab.RadixPrefixCache.match_prefix`, your
# `my_match_req` with `kvlab.CacheManager.match_req`, and the page store's "already cached"
# length with `insert_prefix`'s, on random prompts with shared beginnings.

# %%
rng = random.Random(11)
for page_size in (1, 2, 4, 16):
    tree, page_store, next_slot = RadixPrefixCache(page_size, device="cpu"), {}, 0
    beginnings = [[rng.randrange(3) for _ in range(3 * page_size)] for _ in range(2)]
    for _ in range(25):
        ids = rng.choice(beginnings)[: rng.randrange(0, 3 * page_size + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 2 * page_size))]
        assert my_match_prefix(tree, ids) == tree.match_prefix(ids).cached_len == page_store_match(page_store, ids, page_size)
        if ids:  # a request has at least one token
            manager = CacheManager(1, page_size, kvlab.paging.new_page_table(1, 8, page_size), prefix_cache=tree)
            assert my_match_req(tree, ids).cached_len == manager.match_req(Req(ids, 0)).cached_len
        slots = list(range(next_slot, next_slot + len(ids)))
        next_slot += -(-len(ids) // page_size) * page_size
        mine, new_entries = page_store_insert(page_store, ids, slots, page_size)
        page_store.update(new_entries)
        theirs = tree.insert_prefix(ids, torch.tensor(slots, dtype=torch.int32))
        assert mine == theirs.cached_len
print("my_match_prefix, my_match_req and page_store_insert agree with kvlab")

# %% [markdown]
# ## Summary
#
# * A cached page is reusable only by a request whose tokens agree **from the start** to the
#   end of that page, and only **whole pages** are cached or shared: keys are page-aligned,
#   children are found by their first page, nodes split only on page boundaries.
# * `match_prefix` returns a handle (`cached_len`, slots via `get_matched_indices()`);
#   `match_req` matches `input_ids[:-1]` so the prefill always computes at least one position.
# * `insert_prefix` returns how much was **already cached**: the caller's copies of those
#   tokens are duplicates it must free (chapter 06).
# * `lock_handle` reference-counts the path to the root; locked tokens are protected, the rest
#   evictable. `evict(n)` removes whole unlocked least-recently-used leaves, may free more
#   than `n`, returns token slots (the free list wants `[::P]`), and in kvlab returns what it
#   could rather than failing: the manager checks `evictable_size` first.
# * Lifted into `kvlab.RadixPrefixCache` (`kvlab/radix_cache.py`); pictures in
#   `kvlab.viz.draw_tree` / `draw_tree_steps`.
#
# Next: chapter 06 puts the cache, the free list and the page table together in
# `CacheManager`, and follows `cache_req` through its four regions.
