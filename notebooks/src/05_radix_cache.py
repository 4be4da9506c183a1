# %% [markdown]
# # 05 · The radix prefix cache: requests that share a prefix share its pages
#
# **Time:** about 75 minutes. **Assumes:** chapters 00-02 (pages, the page table, rows); trees
# and dictionaries in Python. No Triton in this chapter.
#
# **Goal.** Build the [prefix cache](glossary.md#prefix-cache) of mini-sglang: a tree of cached token sequences whose KV
# [pages](glossary.md#page) a new request can reuse instead of recomputing. By the end you can say what
# `match_prefix`, `insert_prefix`, `lock_handle` and `evict` do to the tree, why every key is
# cut on **page boundaries**, why a request never matches its *last* prompt token, who may
# unlock what, and which cached pages an out-of-memory server may throw away.
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
from kvlab.course.scenes.ch05_radix import shared_prefix_figure
from kvlab.course.reference import PrefixStoreRef, page_aligned_len
from kvlab.course.viz import draw_tree, draw_tree_steps

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

# %% alt="A page table of two requests with one system prompt: both rows hold the same three pages (slots 0-11) for the shared prompt, then pages of their own."
shared_prefix_figure()
plt.show()

# %% [markdown]
# ## Build-up 1: a prefix store made of whole pages
#
# What does "the cache holds a prefix" mean when memory comes in pages of `P` [slots](glossary.md#token-slot)? The KV of
# a token depends on *every token before it*, so a cached page is only reusable by a request
# whose tokens agree **from the very start** up to the end of that page. And a page is the
# unit the [page table](glossary.md#page-table) maps: a request cannot borrow half a page and fill the other half with
# its own tokens, because the other half belongs to whoever wrote it.
#
# So the simplest correct store has one entry per cached page, keyed by *all the tokens from
# the start up to the end of that page*. Here is the store after a server cached the prompt
# `[1 2 3 4 5 6 7]`, whose KV it had computed into slots `6..12` (page size 2):
#
# ```
# P = 2, cached prompt [1 2 3 4 5 6 7]          key (prefix to page end) -> slots
#                                                (1, 2)                      [6, 7]
# only whole pages: the 7th token is not cached  (1, 2, 3, 4)                [8, 9]
#                                                (1, 2, 3, 4, 5, 6)          [10, 11]
# ```
#
# Matching a new prompt against it walks page by page from the start, as long as the prefix
# up to the end of the next page is a key:

# %%
P = 2
store = {(1, 2): [6, 7], (1, 2, 3, 4): [8, 9], (1, 2, 3, 4, 5, 6): [10, 11]}


def page_store_match(store: dict, input_ids: list, page_size: int) -> int:
    """Longest cached prefix of input_ids, in whole pages."""
    matched = 0
    while (
        matched + page_size <= len(input_ids)
        and tuple(input_ids[: matched + page_size]) in store
    ):
        matched += page_size
    return matched


print("match [1 2 3 4 5 6 0]:", page_store_match(store, [1, 2, 3, 4, 5, 6, 0], P))
print(
    "match [1 2 3]        :",
    page_store_match(store, [1, 2, 3], P),
    " (a lone half page never matches)",
)
print(
    "match [9 2 3 4]      :",
    page_store_match(store, [9, 2, 3, 4], P),
    " (the first page differs: nothing)",
)
assert page_store_match(store, [1, 2, 3, 4, 5, 6, 0], P) == 6, (
    f"matched {page_store_match(store, [1, 2, 3, 4, 5, 6, 0], P)}, expected 6")
assert page_store_match(store, [1, 2, 3], P) == 2, (
    f"matched {page_store_match(store, [1, 2, 3], P)}, expected 2")
assert page_store_match(store, [9, 2, 3, 4], P) == 0, (
    f"matched {page_store_match(store, [9, 2, 3, 4], P)}, expected 0")

# %% [markdown]
# **Inserting** is the other half. Say a second request with prompt `[1 2 3 4 8 9 10]` ran
# with *its own* slots `20..26` and now offers them to the store. Its first two pages are
# already there (keys `(1, 2)` and `(1, 2, 3, 4)`), so the insert reports **4 tokens already
# cached**: the request's own copies of those (slots `20..23`) are duplicates that it must
# give back (chapter 06 is about exactly that bookkeeping). Its third page is new: one entry
# `(1, 2, 3, 4, 8, 9) -> [24, 25]`. The last token, `10`, is half a page and is not cached.
# Writing that insert is the third exercise of this chapter; here is its effect:

# %%
store[(1, 2, 3, 4, 8, 9)] = [24, 25]  # the one new whole page of [1 2 3 4 8 9 10]
print("match [1 2 3 4 8 9 10]:", page_store_match(store, [1, 2, 3, 4, 8, 9, 10], P))
assert page_store_match(store, [1, 2, 3, 4, 8, 9, 10], P) == 6, (
    f"matched {page_store_match(store, [1, 2, 3, 4, 8, 9, 10], P)}, expected 6")

# %% [markdown]
# ## Build-up 2: the radix tree
#
# This store is correct but wasteful: the key of page *k* repeats all *k* earlier pages, so
# a prompt of *n* pages stores about *n²/2* pages of keys, and matching hashes ever longer
# tuples. A **[radix tree](glossary.md#radix-tree)** stores each run of pages once: a node holds a sequence of whole
# pages that no cached prompt branches out of, its children hang off its end, and a child is
# found by its **first page** of tokens. Page-aligned everywhere:
#
# * a node's key is a whole number of pages, and its value is the KV slot of each key token;
# * a child is looked up by its first *page* (`tuple(ids[i:i + P])`), so fewer than `P`
#   remaining tokens can never match;
# * when a prompt leaves a node part-way, the node is **split** at the last whole matched page.
#
# `kvlab.RadixPrefixCache` is that tree (mini-sglang's `RadixPrefixCache`). Its answers come
# as **[handles](glossary.md#handle)**. A handle is the cache's receipt for a prefix it holds: `handle.cached_len`
# says how many tokens the prefix has, `handle.node` is the tree node where it ends, and
# `handle.get_matched_indices()` gathers the prefix's KV slots from the root down to that
# node. A request keeps the handle of its cached prefix for as long as it runs (and [locks](glossary.md#lock) it,
# as we will see). `insert_prefix(ids, slots)` returns the length that was already cached and
# a handle for the inserted prefix:

# %% alt="A radix tree on pages of 2 tokens: under the root, the shared node [1 2|3 4] on pages 3 and 4 branches into the leaves [5 6] and [8 9]; no node is locked and all 8 tokens are evictable."
cache = RadixPrefixCache(page_size=2, device="cpu")
r = cache.insert_prefix([1, 2, 3, 4, 5, 6, 7], torch.arange(6, 13, dtype=torch.int32))
print(
    "already cached:",
    r.cached_len,
    "| the handle covers",
    r.handle.cached_len,
    "tokens:",
    r.handle.get_matched_indices().tolist(),
)
r = cache.insert_prefix([1, 2, 3, 4, 8, 9, 10], torch.arange(20, 27, dtype=torch.int32))
print(
    "already cached:",
    r.cached_len,
    "| the handle covers",
    r.handle.cached_len,
    "tokens:",
    r.handle.get_matched_indices().tolist(),
)
for node in cache.nodes():
    print(f"  node {node.uid}: key {list(node.key)}, slots {node.value.tolist()}")
assert r.cached_len == 4 and r.handle.get_matched_indices().tolist() == [
    6,
    7,
    8,
    9,
    24,
    25,
], f"already cached {r.cached_len}, slots {r.handle.get_matched_indices().tolist()}"
draw_tree(cache)
plt.show()

# %% [markdown]
# The second insert walked `[1 2|3 4]`, found that the first node continues with `[5 6]`
# while the prompt continues with `[8 9]`, and split the node after its second page. Its
# `[8 9]` became a new child with the caller's slots `24, 25` (the caller's slots `20..23`
# for the shared part were not taken: the cache already has `6..9`). The last token `10` is
# half a page and is not cached. The handle of the second insert ends at the new node `[8 9]`
# and its slots run through the shared node above it.
#
# ## Matching, and the LRU clock
#
# `match_prefix(ids)` returns a handle too (inside a `MatchResult`, whose `cached_len` is the
# handle's). A match that ends inside a node splits it, so a handle always ends exactly at a
# node boundary.
#
# Every node also carries `last_access`, a stamp of the **[LRU clock](glossary.md#lru-stamp)**: when memory runs short,
# the cache [evicts](glossary.md#eviction) the *least recently used* pages first, and the stamps say which those are.
# The clock is a counter, `cache.clock`, not wall time (mini-sglang stamps nodes with
# `time.monotonic_ns()`; a counter makes every run of this notebook draw the same trees). It
# ticks on every `match_prefix` and every `insert_prefix`, and that call stamps **only the
# nodes it actually used** with the new value: the nodes whose tokens the matched prefix runs
# through. A node the walk did not enter keeps its stamp. And when the prompt leaves the tree
# in the middle of a node, the node is split: the upper, matched half gets the new stamp, the
# lower half keeps the old one, because nobody just read it.

# %%
def stamps(cache):
    return {tuple(node.key): node.last_access for node in cache.nodes()}


before = stamps(cache)
m = cache.match_prefix([1, 2, 3, 4, 5, 0, 0])
after = stamps(cache)
print(
    "cached_len:",
    m.cached_len,
    "slots:",
    m.handle.get_matched_indices().tolist(),
    "| clock now",
    cache.clock,
)
for key in after:
    print(f"  node {list(key)}: last_access {before[key]} -> {after[key]}")
# [5 0] is a different page from [5 6]
assert m.cached_len == 4, f"matched {m.cached_len}, expected 4"
assert after[(1, 2, 3, 4)] == cache.clock, (  # used: stamped
    f"the node used has stamp {after[(1, 2, 3, 4)]}, the clock is {cache.clock}")
# not entered: unchanged
assert after[(5, 6)] == before[(5, 6)] and after[(8, 9)] == before[(8, 9)], (
    f"a node the match never entered was stamped: {before} -> {after}")
assert (
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).cached_len == 6
), "[1 2 3 4 5 6 7 8] should match 6 tokens"

# %% [markdown]
# Now a match that ends *inside* a node. In a fresh cache holding one three-page node,
# matching `[1 2 3 4 9 9]` uses two of its pages: the node is split into `[1 2|3 4]` (used,
# stamped) and `[5 6]` (not used, keeps its old stamp).

# %%
small = RadixPrefixCache(page_size=2, device="cpu")
small.insert_prefix([1, 2, 3, 4, 5, 6], torch.arange(6, dtype=torch.int32))
old_stamp = small.nodes()[0].last_access
m = small.match_prefix([1, 2, 3, 4, 9, 9])
print(f"matched {m.cached_len}; clock {small.clock}; old stamp {old_stamp}")
for node in small.nodes():
    print(f"  node {list(node.key)}: last_access {node.last_access}")
assert stamps(small) == {(1, 2, 3, 4): small.clock, (5, 6): old_stamp}, (
    f"stamps {stamps(small)}: only the node the match used is stamped")

# %% [markdown]
# **[Departure](glossary.md#departure): the split's upper half gets the new stamp.** mini-sglang leaves it old. Its
# `split_at` creates the upper node with the split node's `timestamp`, and its `_tree_walk`
# returns right after the split, before the line that stamps the node it walked into
# (`node.timestamp = tic`; `python/minisgl/kvcache/radix_cache.py`). So there a prefix a
# request has just matched keeps the stamp of its last *whole* use. kvlab stamps it because the
# match did use those pages: once the lower half is evicted, the upper half is a leaf, and with
# an old stamp it would be evicted ahead of prefixes nobody has read for longer.
#
# **Why the printed clock jumps by 2 on an insert.** An `insert_prefix` that adds a node ticks
# the clock twice: once for its walk down the tree (stamping the nodes the prompt shares with
# the cache), and once more for the new node, so a new leaf is always newer than the path above
# it. mini-sglang has the same order in real time: its walk reads `tic = time.monotonic_ns()`,
# and the new node reads the clock again when it is created. An insert with nothing new to add
# ticks once. That is why the two inserts of the first tree above left the clock at 4, and the
# stamps in it are 2, 3 and 4:

# %%
clocked = RadixPrefixCache(page_size=2, device="cpu")
ticks = []
# new, one more page, nothing new
for ids in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]):
    before_clock = clocked.clock
    clocked.insert_prefix(ids, torch.arange(len(ids), dtype=torch.int32))
    ticks.append(clocked.clock - before_clock)
print("clock ticks per insert:", ticks, "| stamps:", stamps(clocked))
assert ticks == [2, 2, 1], f"clock ticks per insert {ticks}, expected [2, 2, 1]"
# the third insert's walk stamped both
assert stamps(clocked) == {(1, 2, 3, 4): 5, (5, 6): 5}, (
    f"stamps {stamps(clocked)}, expected 5 for both nodes")

# %% [markdown]
# ## Why `match_req` drops the last token
#
# A server does not match the whole prompt, though. The object it matches for is a request,
# `kvlab.Req` (mini-sglang's `Req`): its `input_ids`, its row in the page table `table_idx`,
# and two lengths, `cached_len` (tokens whose KV is computed) and `device_len` (tokens that
# will have KV after the coming step). `CacheManager.match_req(req)` (chapter 06 builds the
# manager) matches `input_ids[:input_len - 1]`. The [prefill](glossary.md#prefill)'s job (chapter 00) is to produce
# the logits of the *next* token, and those come out of the forward pass at the last prompt
# position. If every prompt token were a [cache hit](glossary.md#cache-hit) there would be nothing to run the model
# on, and no next token. Cutting the last token guarantees at least one position is
# computed. (With pages, the cut costs more than one token when the prompt ends exactly on a
# page boundary: that whole last page is recomputed.)

# %%
cm = CacheManager(num_pages=16, page_size=2,
                  page_table=kvlab.alloc.paging.new_page_table(2, 16, 2))
cm.prefix_cache.insert_prefix([1, 2, 3, 4, 5, 6], torch.arange(6, dtype=torch.int32))
for prompt in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]):
    hit = cm.match_req(Req(prompt, table_idx=0)).cached_len
    print(
        f"prompt {prompt}: full match"
        f" {cm.prefix_cache.match_prefix(prompt).cached_len}, match_req {hit}, tokens"
        f" to compute {len(prompt) - hit}"
    )
    assert len(prompt) - hit >= 1, f"prompt {prompt}: nothing left to compute"
assert cm.match_req(Req([1, 2, 3, 4, 5, 6], 0)).cached_len == 4, (
    "match_req should leave the last page of a fully cached prompt to compute")

# %% [markdown]
# ## Locks, owners and LRU eviction, step by step
#
# A running request **locks** its handle: `lock_handle(handle, owner=req)` adds one to the
# `ref_count` of every node from the handle's node up to the root, because the request reads
# all of them. Locked tokens count as `protected_size`; everything else is `evictable_size`.
# When the pool runs short, `evict(n)` removes **whole unlocked leaves**, smallest
# `last_access` first, until at least `n` tokens are freed (it may free more: a leaf goes
# whole). Removing a leaf may expose its parent as a new leaf, which can go next. A locked node
# is never a candidate, and its ancestors are locked too, so a running request's prefix can
# never disappear under it.
#
# A lock has an **[owner](glossary.md#owner)**: the request that took it (`owner=`; a cache manager passes the
# `Req`). Only a holder may take its lock back: `lock_handle(handle, unlock=True, owner=...)`
# by an owner that holds no lock on that handle raises `CacheMisuse` and changes nothing.
# Reference counts alone cannot tell whose lock an unlock removes: one request unlocking twice
# would silently unprotect pages another request is still reading. (mini-sglang's locks have
# no owner: its unlock only asserts that no `ref_count` goes below zero.)
#
# The story below (page size 2) runs four prompts through one cache, the way a server would:
# A and D are cached; B arrives, matches A's system prompt `[1 2|3 4]` (splitting A's node),
# computes the rest on fresh pages, is cached and locked because it keeps running; C is
# matched (touching A's branch, so it becomes *recently used*); memory runs short (`evict`);
# B finishes (unlock) and memory runs short again. `fresh_slots` plays the page allocator.

# %% alt="Eight snapshots of a radix tree, one per step of the story: inserting A and D, inserting B (which splits a node), locking B, matching C, evicting the least recently used leaf, unlocking B and evicting again, with new nodes outlined in green, locked nodes in orange and evicted ones greyed."
story = RadixPrefixCache(page_size=2, device="cpu")
A, B, C, D = (
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 8, 9, 10, 11],
    [1, 2, 3, 4, 5, 6, 12, 13],
    [20, 21, 22, 23, 24],
)
next_page = 3


def fresh_slots(n):
    """Slots of n tokens on new whole pages, handed out in order (the page allocator's
    job)."""
    global next_page
    start = next_page * story.page_size
    next_page += -(-n // story.page_size)
    return torch.arange(start, start + n, dtype=torch.int32)


steps = []


def record(title):
    steps.append((title, story.snapshot()))
    info = story.size_info
    leaves = [
        f"{list(n.key)}@{n.last_access}"
        for n in story.nodes()
        if n.is_leaf() and n.ref_count == 0
    ]
    print(
        f"{title:38s} evictable {info.evictable_size:2d}  locked"
        f" {info.protected_size:2d}  unlocked leaves (key@last_access):"
        f" {', '.join(leaves)}"
    )


story.insert_prefix(A, fresh_slots(len(A)))
record("insert A (7 tokens): 3 whole pages")
story.insert_prefix(D, fresh_slots(len(D)))
record("insert D: a second branch")

# B is admitted: its match splits A's node after [1 2|3 4]
hit_b = story.match_prefix(B[:-1])
slots_b = torch.cat(
    [hit_b.handle.get_matched_indices(), fresh_slots(len(B) - hit_b.cached_len)]
)
# after its prefill, B's whole pages are cached
_, handle_b = story.insert_prefix(B, slots_b)
record("insert B: split after [1 2|3 4]")
story.lock_handle(handle_b, owner="B")  # B keeps running: its prefix must stay
record("lock B (owner B; B is running)")

match_c = story.match_prefix(C[:-1])
record(f"match C: {match_c.cached_len} tokens hit")
freed_1 = story.evict(1)
record("evict(1): least recently used leaf")
story.lock_handle(handle_b, unlock=True, owner="B")  # B finishes
record("B finishes: unlock (owner B)")
freed_2 = story.evict(4)
record("evict(4): B's leaf is older than [5 6]")

print(
    "evict(1) freed slots", freed_1.tolist(), "| evict(4) freed slots", freed_2.tolist()
)
# a leaf goes whole: 4 tokens for evict(1)
assert freed_1.numel() == 4 and freed_2.numel() == 4, (
    f"evict freed {freed_1.numel()} and {freed_2.numel()} slots, expected a whole leaf"
    " (4) each"
)
draw_tree_steps(steps, ncols=2)
plt.show()

# %% [markdown]
# Read the printed stamps from "match C" on. The match stamped A's system prompt and `[5 6]`;
# the unlocked leaves are then `[5 6]` (just used) and `[20 21|22 23]` (D, untouched since
# it was inserted). `evict(1)` asks for a single token, but a leaf goes whole, so D's 4
# tokens come back; B's branch is locked and stays. When B finishes, unlocking takes its ref
# counts back to 0 all the way up: now `[8 9|10 11]`, stamped when B was inserted, is older
# than `[5 6]`, so it is the next to go.
#
# Finally, lock what is left of the system prompt (as a new request E would) and ask for far
# more than is [evictable](glossary.md#evictable): `evict` frees every unlocked leaf and returns what it got, and the
# locked node stays.

# %%
keep = story.match_prefix([1, 2, 3, 4, 0]).handle
story.lock_handle(keep, owner="E")
info_before = story.size_info
freed = story.evict(100)  # more than is evictable: kvlab's evict frees what it can
print("freed slots:", freed.tolist())
print("size before:", info_before, "after:", story.size_info)
# locked: untouched
assert story.size_info.protected_size == info_before.protected_size == 4, (
    f"protected {story.size_info.protected_size} of {info_before.protected_size}: a"
    " locked node was evicted"
)
assert story.size_info.evictable_size == 0, (
    f"{story.size_info.evictable_size} tokens still evictable after evict(100)")
assert freed.numel() == info_before.evictable_size, (
    f"freed {freed.numel()}, evictable before: {info_before.evictable_size}")
assert keep.get_matched_indices().tolist() == [6, 7, 8, 9], (
    f"the locked handle now covers {keep.get_matched_indices().tolist()}")

# %% [markdown]
# Two details matter for the cache manager in chapter 06:
#
# * `evict` returns **token slots** (`P` per page), while the [free list](glossary.md#free-list) holds **[page starts](glossary.md#page-start)**:
#   the manager appends `evicted[::P]`. Keep that stride straight or pages leak or double up.
# * When fewer tokens are evictable than asked, kvlab's `evict` frees what it can and returns
#   it; mini-sglang's `evict` instead asserts `size <= evictable_size` before it removes
#   anything. Either way the caller must check first: kvlab's manager compares the need with
#   `size_info.evictable_size` and raises `OutOfPages` without touching the cache.
#
# Misuse of locks is a bug in the caller, and kvlab says so instead of corrupting the counts.
# An unlock by a request that holds no lock on the handle is refused, and nothing changes:

# %%
info_before = story.size_info
try:
    story.lock_handle(keep, unlock=True, owner="B")  # B never locked this handle: E did
except kvlab.CacheMisuse as e:
    print("CacheMisuse:", e)
else:
    raise AssertionError("an unlock by a request that holds no lock must be refused")
# E's lock is untouched
assert story.size_info == info_before and keep.node.ref_count == 1, (
    "a refused unlock changed the sizes or E's lock")
story.lock_handle(keep, unlock=True, owner="E")  # the holder may unlock
assert story.size_info.protected_size == 0, (
    f"{story.size_info.protected_size} tokens still protected after E unlocked")

_, handle = story.insert_prefix([7, 7, 7, 7], torch.arange(40, 44, dtype=torch.int32))
try:
    story.lock_handle(handle, unlock=True)  # never locked at all
except kvlab.CacheMisuse as e:
    print("CacheMisuse:", e)
else:
    raise AssertionError("unlocking an unlocked handle must raise")

# %% [markdown]
# ## Validate against the reference
#
# `kvlab.course.reference.PrefixStoreRef` is the obviously-right version: a list of cached token
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
        ids = rng.choice(beginnings)[: rng.randrange(0, 9)] + [
            rng.randrange(4) for _ in range(rng.randrange(0, 6))
        ]
        slots = torch.arange(next_slot, next_slot + len(ids), dtype=torch.int32)
        next_slot += -(-len(ids) // page_size) * page_size
        if rng.random() < 0.5:  # insert
            already_ref, insert_len = ref.insert(ids)
            already, handle = tree.insert_prefix(ids, slots)
            assert (already, handle.cached_len) == (already_ref, insert_len), (
                f"page_size {page_size}, insert {ids}: tree says"
                f" {(already, handle.cached_len)}, the reference"
                f" {(already_ref, insert_len)}"
            )
            for k in range(already, insert_len, page_size):
                first_slots[tuple(ids[: k + page_size])] = slots[
                    k : k + page_size
                ].tolist()
        else:  # match
            m = tree.match_prefix(ids)
            assert (
                m.cached_len
                == ref.match_len(ids)
                == page_aligned_len(m.cached_len, page_size)
            ), (
                f"page_size {page_size}, match {ids}: tree {m.cached_len}, the"
                f" reference {ref.match_len(ids)}"
            )
            expect = [
                s
                for k in range(0, m.cached_len, page_size)
                for s in first_slots[tuple(ids[: k + page_size])]
            ]
            assert m.handle.get_matched_indices().tolist() == expect, (
                f"page_size {page_size}, match {ids}: slots"
                f" {m.handle.get_matched_indices().tolist()}, expected {expect}"
            )
        tree.check_integrity()
    print(
        f"page_size {page_size}: 40 random operations agree with the reference;"
        f" {len(tree.nodes())} nodes hold {tree.size_info.total_size} tokens (the page"
        f" store would need {len(first_slots)} keys of up to"
        f" {max(map(len, first_slots), default=0)} tokens)"
    )

# %% [markdown]
# ## The picture: which rows share which pages
#
# Four requests from two conversations go through a `CacheManager` (chapter 06 builds it).
# Four of its calls appear here, in the order a server makes them:
#
# * `cm.admit(req)` starts a request: `match_req`, then **lock** the hit's handle with the
#   request as owner, then write the hit's slots into the request's page-table row. It sets
#   `req.cache_handle` and `req.cached_len` (the hit's length).
# * `cm.allocate_paged([req])` maps pages for the rest of the prompt (chapter 02's write).
# * The model's prefill would now compute the prompt's KV. `req.complete_one()` records that a
#   forward step finished: `cached_len = device_len` (everything on the device now has KV) and
#   `device_len += 1` (room for the token the step produced).
# * `cm.cache_req(req, finished=False)` inserts the request's whole pages into the prefix
#   cache, so later requests can share them; the request keeps running.
#
# Later arrivals map the earlier ones' pages. Colour = physical page; equal colours in
# different rows are shared pages.

# %% alt="A page table of four requests on pages of 4 slots in which rows 0 and 2 share their first two pages and rows 1 and 3 share theirs, each then continuing on pages of its own."
P4 = 4
cm = CacheManager(num_pages=24, page_size=P4,
                  page_table=kvlab.alloc.paging.new_page_table(4, 24, P4))
system_a, system_b = list(range(100, 110)), list(range(200, 206))
prompts = [
    system_a + [1, 2, 3],
    system_b + [4, 5, 6, 7, 8],
    system_a + [9, 9, 9, 9, 9, 9],
    system_b + [4, 5, 6, 7, 1],
]
for row, prompt in enumerate(prompts):
    req = Req(prompt, table_idx=row)
    hit = cm.admit(req).cached_len
    cm.allocate_paged([req])
    req.complete_one()
    cm.cache_req(req, finished=False)
    print(f"row {row}: {len(prompt)} tokens, {hit} from the cache")
cm.check_integrity()
kvlab.course.viz.page_table_heatmap(
    cm.page_table[:4, :20], P4, title="shared pages across rows"
)
plt.show()
# system_a's 2 whole pages
assert torch.equal(cm.page_table[2, :8], cm.page_table[0, :8]), (
    "rows 0 and 2 should share system_a's two pages")
# system_b + [4 5]: 2 pages
assert torch.equal(cm.page_table[3, :8], cm.page_table[1, :8]), (
    "rows 1 and 3 should share two pages")

# %% [markdown]
# ## Your turn
#
# Three exercises. Each [checker](glossary.md#checker) runs your function on named edge cases and on seeded random
# ones, and says which case failed and how. Here is what a failure looks like: a typical slip
# in the second exercise, matching the whole prompt, is caught with the case it failed on.

# %%
# the slip: the last token is matched too
def match_whole_prompt(prefix_cache, input_ids):
    return prefix_cache.match_prefix(input_ids)


try:
    kvlab.check.match_req(match_whole_prompt)
except kvlab.check.CheckFailed as e:
    print("CheckFailed:", str(e).splitlines()[0])
else:
    raise AssertionError("matching the whole prompt must be rejected")

# %% [markdown]
# **Exercise `match_prefix`.** Write `my_match_prefix(cache, input_ids) -> int`: walk a real
# `RadixPrefixCache` from `cache.root`, find each child by the next whole page
# (`node.children.get(tuple(...))`), count how far its `node.key` agrees with the prompt, round
# down to whole pages, and stop when the prompt leaves the tree. Only read the tree (no splits,
# no stamps: the checker compares every node, its LRU stamp and the clock) and `input_ids`. Stuck? `kvlab.check.hint("match_prefix", 1)` (then 2, 3) gives hints in steps,
# and `kvlab.solutions.show("match_prefix")` prints a reference solution.

# %%
def my_match_prefix(cache, input_ids):
    """The page-aligned length of the longest prefix of input_ids that the tree holds.

    Start at cache.root; a child is node.children.get(tuple(<the next P tokens>));
    compare
    child.key with the prompt token by token, round down to whole pages, stop when the
    prompt leaves the tree. Return an int. Do not change the tree.
    """
    ### BEGIN SOLUTION
    P = cache.page_size
    node, matched = cache.root, 0
    while len(input_ids) - matched >= P:
        child = node.children.get(tuple(input_ids[matched:matched + P]))
        if child is None:
            break
        n = 0
        while (
            n < child.length
            and matched + n < len(input_ids)
            and child.key[n] == input_ids[matched + n]
        ):
            n += 1
        n = n // P * P
        matched += n
        if n < child.length:
            break
        node = child
    return matched
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: match_prefix
    raise NotImplementedError("walk the tree from cache.root, one whole page at a time")
    ### END STARTER


kvlab.check.match_prefix(my_match_prefix);

# %%
kvlab.check.hint("match_prefix", 1);
# kvlab.solutions.show("match_prefix")   # uncomment to read the reference solution

# %% [markdown]
# **Exercise `match_req`.** Write `my_match_req(prefix_cache, input_ids)`: how a server matches
# a new request's prompt. Return what `prefix_cache.match_prefix` returns (a `MatchResult`; the
# matched length as an int is accepted too); `input_ids` is read-only, and the tree must end as
# one match leaves it. Remember what the prefill is for: the checker
# tries a prompt that is cached whole, a one-token prompt, page size 1, and a prompt one page
# longer than the cache. Hints: `kvlab.check.hint("match_req", 1)`.

# %%
def my_match_req(prefix_cache, input_ids):
    """Match a new request's prompt the way CacheManager.match_req does."""
    ### BEGIN SOLUTION
    # the last token is computed
    return prefix_cache.match_prefix(input_ids[: len(input_ids) - 1])
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: match_req
    raise NotImplementedError("match the prompt, keeping what the prefill needs")
    ### END STARTER


kvlab.check.match_req(my_match_req);

# %% [markdown]
# **Exercise `insert_prefix`** (the third). Write the insert of the page store from build-up 1:
# `my_page_store_insert(store, input_ids, indices, page_size) -> (cached_len, new_entries)`.
# `store` maps `tuple(prefix up to the end of a page) -> that page's slots`; `indices` holds
# one slot per token of `input_ids`. Return how many tokens were already cached from the
# start (whole pages), and a dict of the entries to add: one per new *whole* page. Leave
# `store` itself unchanged (`store`, `input_ids` and `indices` are read-only). The checker tries partial last pages, everything cached, equal
# page contents after a different first page, and page size 1.
# Hints: `kvlab.check.hint("insert_prefix", 1)`.

# %%
def my_page_store_insert(store: dict, input_ids: list, indices: list, page_size: int):
    """Insert the whole pages of input_ids; return (cached_len, new_entries), store
    unchanged."""
    ### BEGIN SOLUTION
    insert_len = len(input_ids) // page_size * page_size  # only whole pages
    cached_len = 0
    while (
        cached_len < insert_len and tuple(input_ids[: cached_len + page_size]) in store
    ):
        # already cached: the caller's slots here are duplicates
        cached_len += page_size
    new_entries = {
        tuple(input_ids[: start + page_size]): list(indices[start : start + page_size])
        for start in range(cached_len, insert_len, page_size)
    }
    return cached_len, new_entries
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: insert_prefix
    raise NotImplementedError(
        "walk the whole pages: which are in the store already, which are new?"
    )
    ### END STARTER


kvlab.check.insert_prefix(my_page_store_insert);

# %% [markdown]
# ## Lift: the notebook's functions vs kvlab
#
# Your `my_match_prefix` must agree with `kvlab.RadixPrefixCache.match_prefix`, your
# `my_match_req` with `kvlab.CacheManager.match_req`, and your page store's "already cached"
# length with `insert_prefix`'s, on random prompts with shared beginnings. Until an exercise
# passes its checker, this cell uses the reference solution in its place (and says so).

# %%
match_prefix_fn = kvlab.check.choose(
    "match_prefix", my_match_prefix, kvlab.solutions.get("match_prefix")
)
match_req_fn = kvlab.check.choose(
    "match_req", my_match_req, kvlab.solutions.get("match_req")
)
insert_fn = kvlab.check.choose(
    "insert_prefix", my_page_store_insert, kvlab.solutions.get("insert_prefix")
)

rng = random.Random(11)
for page_size in (1, 2, 4, 16):
    tree, page_store, next_slot = RadixPrefixCache(page_size, device="cpu"), {}, 0
    beginnings = [[rng.randrange(3) for _ in range(3 * page_size)] for _ in range(2)]
    for _ in range(25):
        ids = rng.choice(beginnings)[: rng.randrange(0, 3 * page_size + 1)] + [
            rng.randrange(3) for _ in range(rng.randrange(0, 2 * page_size))
        ]
        said = f"page_size {page_size}, prompt {ids}"
        # the checkers take a length as an int or a one-element tensor, a match as a
        # MatchResult
        # or its length, new entries keyed by any sequence of tokens: compare them as
        # ints and lists
        mine, theirs = (
            int(match_prefix_fn(tree, ids)),
            tree.match_prefix(ids).cached_len,
        )
        assert mine == theirs == page_store_match(page_store, ids, page_size), (
            f"{said}: your match_prefix {mine}, kvlab's {theirs}, the page store's"
            f" {page_store_match(page_store, ids, page_size)}"
        )
        if ids:  # a request has at least one token
            manager = CacheManager(
                1,
                page_size,
                kvlab.alloc.paging.new_page_table(1, 8, page_size),
                prefix_cache=tree,
            )
            got = match_req_fn(tree, ids)
            mine, theirs = (
                int(getattr(got, "cached_len", got)),
                manager.match_req(Req(ids, 0)).cached_len,
            )
            assert (
                mine == theirs
            ), f"{said}: your match_req {mine}, CacheManager.match_req {theirs}"
        slots = list(range(next_slot, next_slot + len(ids)))
        next_slot += -(-len(ids) // page_size) * page_size
        mine, new_entries = insert_fn(page_store, ids, slots, page_size)
        page_store.update(
            {tuple(k): [int(x) for x in v] for k, v in dict(new_entries).items()}
        )
        theirs = tree.insert_prefix(ids, torch.tensor(slots, dtype=torch.int32))
        assert (
            int(mine) == theirs.cached_len
        ), f"{said}: your insert found {int(mine)} cached, kvlab's {theirs.cached_len}"
print("match_prefix, match_req and the page-store insert agree with kvlab")

# %% [markdown]
# ## Summary
#
# * A cached page is reusable only by a request whose tokens agree **from the start** to the
#   end of that page, and only **whole pages** are cached or shared: keys are page-aligned,
#   children are found by their first page, nodes split only on page boundaries.
# * A **handle** names a cached prefix: its length (`cached_len`) and the node it ends at;
#   `get_matched_indices()` gives its slots. `match_req` matches `input_ids[:-1]` so the
#   prefill always computes at least one position.
# * `insert_prefix` returns how much was **already cached**: the caller's copies of those
#   tokens are duplicates it must free (chapter 06).
# * The **LRU clock** ticks on every match and insert, which stamp only the nodes they used.
# * `lock_handle` reference-counts the path to the root, and every lock has an **owner**: an
#   unlock by a non-holder is refused. Locked tokens are protected, the rest evictable.
#   `evict(n)` removes whole unlocked least-recently-used leaves, may free more than `n`,
#   returns token slots (the free list wants `[::P]`), and in kvlab returns what it could
#   rather than failing: the manager checks `evictable_size` first.
# * Lifted into `kvlab.RadixPrefixCache` (`kvlab/prefix/radix_cache.py`); pictures in
#   `kvlab.course.viz.draw_tree` / `draw_tree_steps`.
#
# Next: chapter 06 puts the cache, the free list and the page table together in
# `CacheManager`, and follows `cache_req` through its four [regions](glossary.md#region).
#
# ## Questions
#
# 1. Real servers often use pages of 16 tokens or more. With this tree, a prompt that shares
#    30 tokens with a cached one reuses only 16 of them. What would it take to share the
#    other 14? Who owns the rest of that page, and what would the new request do with it?
# 2. LRU evicts the leaf used longest ago. Write a short sequence of requests in which LRU
#    evicts exactly the pages that the next request needs. What would a better policy look
#    at, and what would it cost to maintain?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# **1. Sharing part of a page.** The page holding tokens 16-31 of the cached prompt has KV for
# 14 shared tokens and 2 others. The new request cannot map that page: its own tokens 30 and
# 31 would have to go into slots that another prompt's KV occupies (and that other requests
# may be reading). Two ways out, both with a cost:
#
# * **copy on write**: give the new request a fresh page, copy the 14 shared KV rows into it
#   (one small copy kernel per layer), and compute only from token 30 on. Saves 14 tokens of
#   prefill per hit at the price of a copy and a slightly more complex `match` (it must
#   report the partial page and its slots);
# * **smaller pages**: `P = 1` shares everything but multiplies page-table entries, free-list
#   operations and attention's gathers (chapter 07 compares page sizes).
#
# The cell below shows what the chapter's tree gives at `P = 16`: 16 of the 30 shared tokens.

# %% tags=["solution"]
tree16 = RadixPrefixCache(page_size=16, device="cpu")
cached_prompt = list(range(1000, 1048))
tree16.insert_prefix(cached_prompt, torch.arange(48, dtype=torch.int32))
new_prompt = cached_prompt[:30] + [7] * 18
print("shared tokens:", 30, "| matched:", tree16.match_prefix(new_prompt).cached_len)

# %% [markdown] tags=["solution"]
# **2. When LRU is wrong.** A cache of two pages' room for prefixes, prompts with system
# prompts X and Y, and a request stream `X Y Z X Y Z ...` where Z is unrelated and large: each
# Z evicts the least recently used of X and Y, which is exactly the one coming next (the
# classic cyclic pattern where LRU always misses). A better policy weighs how often a prefix
# is hit and how expensive it is to recompute (its length), for example LFU with aging or
# "cost-aware" eviction (length times hit count); it needs a hit counter per node and a
# priority queue keyed on a score that changes on every hit, so eviction no longer pops
# plain timestamps. Locks do not change: a locked node is never a candidate, whatever its score.
