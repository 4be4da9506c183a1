# %% [markdown]
# # 11 · The hash-chained prefix cache: the other way to share a prefix
#
# **Time:** about 90 minutes. **Assumes:** chapters 05 and 06 (the radix prefix cache: match,
# insert, locks, eviction; `CacheManager` and `cache_req`) and chapter 07 (the simulator and its
# workloads); Python dicts and hashes. No Triton in this chapter.
#
# **Goal.** Chapters 05-06 shared prompt prefixes the way SGLang and mini-sglang do: a
# [prefix cache](glossary.md#prefix-cache) that is a [radix tree](glossary.md#radix-tree) of
# cached token runs, [locks](glossary.md#lock) on the path to the root, whole
# least-recently-used leaves [evicted](glossary.md#eviction) when memory runs short. vLLM, and its
# compact re-implementation nano-vllm, keep no tree at all: theirs is a
# [hash-chained prefix cache](glossary.md#hash-chained-prefix-cache). Each **full
# [page](glossary.md#page)** gets a hash **[chained](glossary.md#chained-hash)** from the previous
# page's hash and its own tokens, a dict maps [hash → page](glossary.md#hash-to-page-map), pages
# carry **[reference counts](glossary.md#reference-count)**, and a page nobody uses goes to a
# **[free queue](glossary.md#free-queue)** *with its hash*: it can still be found again, until
# the queue hands it out for other tokens. The free queue *is* the
# [eviction order](glossary.md#eviction-in-the-hash-cache).
#
# By the end you can say why a page's hash must cover its whole prefix, how a prompt is matched
# by walking the chain, what a reference count replaces, why the free queue is an LRU list and
# in which order a finished request's pages join it, what happens to a
# [partial last page](glossary.md#partial-page), and, measured on the same workloads through the
# same simulator, when the two designs give the same answer and when (and why) they do not.
#
# The code follows nano-vllm's `nanovllm/engine/block_manager.py` (GeeeekExplorer/nano-vllm,
# commit `2f352aea`) and vLLM's `vllm/v1/core/kv_cache_utils.py` (commit `001cabc1`),
# `block_pool.py` (`c59cb794`) and `kv_cache_manager.py` (`ace980e6`). Where kvlab departs from
# them, the text says so. vLLM and nano-vllm say *block* where this course says *page*.

# %%
import random

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab import CacheManager, HashPrefixCache, Req, chain_hash, page_hashes
from kvlab.prefix.hash_chain import short
from kvlab.alloc.paging import new_page_table
from kvlab.course.reference import PagePoolRef
from kvlab.course.scenes.ch11_hash_cache import (
    COMPARED,
    free_queue_figure,
    hash_chain_figure,
    measured_rows,
)
from kvlab.serving.sim import SimConfig, Simulator, make_workload
from kvlab.serving.sim.compare import comparison_table, lookup_cost, pool_sizes
from kvlab.course.viz import page_table_heatmap
from kvlab.course.viz.chains import (
    draw_cache_comparison,
    draw_hash_chains,
    draw_lookup_cost,
)

torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Intuition: one system prompt, two requests, no tree
#
# Requests A and B start with the same 12-token system prompt (three pages of 4). A arrives first
# and gets pages 0-3; B's first three pages are found in the cache (a [cache
# hit](glossary.md#cache-hit)), so B maps the *same* physical pages 0, 1, 2 and only its own
# question gets new pages. Below, the [page table](glossary.md#page-table) (colour = physical
# page) and the **hash chain** behind it: every full page is known by a hash of the previous
# page's hash and its own tokens; a partial last page has no hash.

# %% alt="Top: a page table where requests A and B map the same three pages for a system prompt; bottom: their hash chains, each full page hashed from the previous page's hash and its own tokens, the shared pages in orange and the partial last pages without a hash."
hash_chain_figure()
plt.show()

# %% [markdown]
# Compare with chapter 05: the radix tree found B's prefix by walking *down a tree of token runs*;
# the hash cache finds it by *recomputing B's page hashes and looking each one up in a dict*. No
# node is split, nothing is [stamped](glossary.md#lru-stamp), and the structure is flat: one dict
# and one list.
#
# ## Build-up 1: a page's hash must cover its whole prefix
#
# The KV of a token depends on every token before it. So a cached page may be reused only by
# a prompt that agrees with it **from the first token to the end of that page**. Chapter 05's
# page store keyed each page by exactly that: the tuple of all tokens up to the page's end. That
# key grows with the prompt. A **chained hash** is a fixed-size stand-in for it:
#
# ```
# h_0 = H(none, page_0)      h_1 = H(h_0, page_1)      h_2 = H(h_1, page_2)   ...
# ```
#
# `h_k` depends on `page_k` directly and on every earlier page through `h_{k-1}`, and computing it
# costs one page of tokens, whatever the prefix. nano-vllm's `BlockManager.compute_hash` is
# `xxh64(previous hash as 8 bytes + the page's token ids as bytes)`; vLLM's `hash_block_tokens`
# hashes the tuple `(parent_block_hash, token ids, extra keys)` and starts the chain from a seed,
# `NONE_HASH`. kvlab's `chain_hash` is BLAKE2b with a 16-byte digest over the parent's digest and
# the tokens as little-endian int64. **[Departure](glossary.md#departure):** `xxhash` is not one
# of kvlab's dependencies (torch, triton, numpy, matplotlib, ipywidgets), so kvlab uses `hashlib`,
# which also gives the same digest on every machine and in every run; Python's own `hash()` is
# salted per process and could not be printed or compared between runs.
#
# Why the parent must be in: two prompts whose page 1 holds the same tokens `[3 4]` after
# different first pages. Their page-1 KV differs; so must their hashes.

# %%
A, B = [1, 2, 3, 4], [9, 9, 3, 4]
print(
    "chained:     ",
    [short(h) for h in page_hashes(A, 2)],
    [short(h) for h in page_hashes(B, 2)],
)
print(
    "page alone:  ",
    short(chain_hash(None, [3, 4])),
    "for both: page 1 would be shared by mistake",
)
assert page_hashes(A, 2)[1] != page_hashes(B, 2)[1], (
    "page 1 of A and of B hold the same tokens after other first pages: their hashes"
    " must differ"
)
assert page_hashes(A, 2)[1] == chain_hash(chain_hash(None, [1, 2]), [3, 4]), (
    "page 1's hash should chain from page 0's")
# the partial page [5] has no hash
assert page_hashes([1, 2, 3, 4, 5], 2) == page_hashes(A, 2), (
    "the partial page [5] should get no hash")

# %% [markdown]
# ## Build-up 2: match by walking the chain
#
# `HashPrefixCache(num_pages, page_size)` is the whole pool: `ref_count[p]`, `page_hash[p]`,
# `hash_to_page` (the dict), and `free_queue` (head first). To match a prompt, hash its full
# pages one after another and look each hash up; the **first miss ends the match**, because
# every later hash is chained from the missing one. `cache.lookup(h, tokens)` also compares the
# page's stored tokens, as nano-vllm's `allocate` does (`blocks[block_id].token_ids !=
# token_ids`): a hash collision can never hand out a page with other tokens.
#
# `allocate(ids)` is nano-vllm's `allocate`: the cached chain first (each hit gets one more
# reference), then pages from the head of the free queue for the rest, and each new **full** page
# is cached at once. Matching gives whole pages only, exactly like chapter 05's tree: a prompt
# that leaves a cached chain inside a page matches up to the page before. Where the radix tree
# splits a node at that page boundary, the hash walk simply stops: the same answer.

# %%
cache = HashPrefixCache(num_pages=8, page_size=2, device="cpu")
a = cache.allocate([1, 2, 3, 4, 5])  # two full pages (cached) and a partial one
print("A:", a, "| hash_to_page:", {short(h): p for h, p in cache.hash_to_page.items()})
for prompt in ([1, 2, 3, 4, 9, 9], [1, 2, 3, 9], [1, 2, 3], [7, 2, 3, 4]):
    print(
        f"match {prompt}: {cache.match(prompt).cached_len} tokens on pages"
        f" {list(cache.match(prompt).pages)}"
    )
assert (
    cache.match([1, 2, 3, 4, 9, 9]).cached_len == 4
    and cache.match([1, 2, 3]).cached_len == 2
), "[1 2 3 4 9 9] should match 4 tokens and [1 2 3] 2"
assert cache.match([7, 2, 3, 4]).cached_len == 0, (  # [3 4] is cached only after [1 2]
    "[3 4] is cached only after [1 2]: [7 2 3 4] matches nothing")
# the partial page [5]: no hash, never shared
assert cache.page_hash[a.pages[2]] is None, (
    "the partial page [5] should have no hash")

# %% [markdown]
# ## Build-up 3: reference counts instead of locks
#
# In chapter 05 a running request *locked* its [handle](glossary.md#handle): one added to
# `ref_count` on every node from the handle's node up to the root. Here every page has its own
# count, and a sequence holds one reference on each page it maps, the cached chain included, so
# the effect is the same: a page some running sequence reads is never handed out. B below shares
# A's two cached pages (count 2), then each finishes. `free(pages)` drops one reference per page,
# **last page first** (nano-vllm's `deallocate`, vLLM's `KVCacheManager.free`: "We free the blocks
# in reverse order so that the tail blocks are evicted first"). A page whose count reaches zero
# joins the tail of the free queue and **keeps its hash**.

# %%
b = cache.allocate([1, 2, 3, 4, 6, 6, 6])
print("B:", b, "| ref counts", cache.ref_count)
assert b.cached_len == 4 and cache.ref_count[0] == cache.ref_count[1] == 2, (
    f"B hit {b.cached_len} tokens; ref counts {cache.ref_count}")
cache.free(a.pages)
print("A done: ref counts", cache.ref_count, "free queue", list(cache.free_queue))
cache.free(b.pages)
print("B done: ref counts", cache.ref_count, "free queue", list(cache.free_queue))
# the system prompt's pages queue last: used last
assert list(cache.free_queue)[-2:] == [1, 0], (
    f"free queue {list(cache.free_queue)}: the system prompt's pages should queue last")
# freed, and still findable
assert cache.match([1, 2, 3, 4, 6, 6, 6]).cached_len == 6, (
    "a freed prompt should still be found")
cache.check_integrity()

# %% [markdown]
# `check_integrity()` proves the cache's invariants, its version of chapter 06's
# [conservation law](glossary.md#conservation-law): every page is **free and uncached** (in the
# queue, no hash), **[free and cached](glossary.md#free-and-cached-page)** (in the queue, with its
# hash), or **referenced** (count > 0, not in the queue); `hash_to_page` and `page_hash` agree;
# and every cached page's hash is `chain_hash(its parent's hash, its tokens)`, so, page by page
# from the first, a hash stands for every token before it. A count never goes below zero:
# freeing a page with no reference left is refused before anything changes.

# %%
try:
    cache.free(b.pages)  # freed twice
except kvlab.CacheMisuse as e:
    print("CacheMisuse:", e)
else:
    raise AssertionError("a count must never go below zero")
cache.check_integrity()

# %% [markdown]
# ## Build-up 4: the free queue is the LRU list
#
# There is no `evict` call in nano-vllm. When `allocate` needs a new page it takes the head of
# the free queue; if that page still had a hash, the hash goes with it: *that* is the eviction.
# Freeing is not evicting. A hit on a free cached page takes it back **out of the middle** of the
# queue: vLLM's `FreeKVCacheBlockQueue` is a doubly linked list for exactly this (O(1) removal),
# nano-vllm calls `deque.remove` (O(n)). kvlab's `FreeQueue` is a doubly linked list too, with
# one difference: vLLM's `remove` clears a block's links, kvlab's page remembers the two it left,
# so that a call that fails half-way can put it back in its place. Three steps, page size 4,
# eight pages:

# %% alt="Three snapshots of the free queue as LRU order: the pages A and B leave queue up last page first and keep their hashes, C takes five pages from the head and one loses its hash, then D's 12-token hit takes three cached pages out of the queue."
free_queue_figure()
plt.show()

# %% [markdown]
# The queue is ordered by when each page was last released, and within one request the deep end
# comes first (vLLM's docstring of `FreeKVCacheBlockQueue`: the least recently used block is at
# the front, and of two blocks freed together the one with more hashed tokens, the tail of a
# chain, comes first). So a chain is eaten from its end, and a prompt's beginning, often a
# shared system prompt, survives longest, as the radix tree's leaf-first eviction does.
#
# One real difference with chapter 06's manager: a page *without* a hash (a partial page, a
# duplicate) has nothing to offer a later prompt, but in nano-vllm's queue it waits its turn like
# any other, so a cached page ahead of it is handed out first. vLLM's `BlockPool.free_blocks` (at
# `c59cb794`) puts such "fresh" blocks at the **front** of the queue (`prepend_n`) and cached ones
# at the back; the older `FreeKVCacheBlockQueue` in `kv_cache_utils.py` at `001cabc1` has no
# `prepend_n` (blocks join at the back only). kvlab offers both orders:
# `HashPrefixCache(..., uncached_first=True)` is vLLM's newer one, the
# [uncached-first order](glossary.md#uncached-first-order).

# %%
for uncached_first in (False, True):
    q = HashPrefixCache(6, 2, device="cpu", uncached_first=uncached_first)
    # pages 0, 1 cached; page 2 holds the partial [5]
    q.free(q.allocate([1, 2, 3, 4, 5]).pages)
    print(
        f"uncached_first={uncached_first}: free queue {list(q.free_queue)} (head first)"
    )
    assert list(q.free_queue).index(2) == (0 if uncached_first else 3), (
        f"uncached_first={uncached_first}: the partial page sits at"
        f" {list(q.free_queue).index(2)} in {list(q.free_queue)}"
    )

# %% [markdown]
# ## Build-up 5: the partial last page
#
# A partial page is never cached: its other slots will hold tokens nobody has seen yet. It gets a
# hash the moment it fills. nano-vllm's `may_append`, called before each
# [decode](glossary.md#decode) step with the new token appended: when the token starts a page, a
# new page is taken from the free queue; when it fills the last page, that page's hash is computed
# from the previous page's and registered. kvlab's `append_token(pages, input_ids)` does the same.

# %%
dec = HashPrefixCache(6, 2, device="cpu")
ids = [1, 2, 3]
pages = dec.allocate(ids).pages
for token in (4, 5, 6):
    ids.append(token)
    pages = dec.append_token(pages, ids)
    print(
        f"after {token}: pages {list(pages)}, last page's hash"
        f" {short(dec.page_hash[pages[-1]])}"
    )
assert pages == (0, 1, 2) and dec.page_hash[2] == page_hashes(ids, 2)[2], (
    f"pages {pages}, page 2's hash {short(dec.page_hash[2])}")
# the decoded pages are shared like prompt pages
assert dec.match(ids + [9]).cached_len == 6, (
    "the decoded pages should be found like prompt pages")

# %% [markdown]
# **When** a page is cached differs between the engines. nano-vllm registers a page's hash when it
# *allocates* the page, before the forward pass has computed its KV; vLLM's `allocate_slots`
# caches the full blocks of the tokens it schedules for this step (`cache_blocks`), also before
# the pass. In nano-vllm's scheduler, which calls `allocate` for one waiting sequence after the
# other, a sequence admitted to the same batch can then already hit them. kvlab's `CacheManager`
# keeps mini-sglang's order: `cache_req` inserts a page after the pass computed it. And the last
# prompt token is never a hit: `match_req` matches `input_ids[:-1]`, as vLLM's
# `get_computed_blocks` does (`max_cache_hit_length = request.num_tokens - 1`), so the
# [prefill](glossary.md#prefill) always has a position to compute logits from. nano-vllm's
# `allocate` at `2f352aea` counts every full page of the prompt, its last one included.
#
# ## Validate: against the oracle, on seeded random traces
#
# `kvlab.course.reference.PagePoolRef` is the same cache without hashes: a cached page is known by the
# tuple of every token up to its end, the free queue is a Python list. We drive both with the
# same random mix of new sequences (sharing two beginnings), decode steps, finished sequences
# and pages taken from the queue, and compare after every step: the pages and hits, every
# count, the queue in order, which pages are cached, and that each cached page's hash is the
# chained hash of its oracle key.

# %%
rng = random.Random(7)
for page_size in (1, 2, 4):
    for uncached_first in (False, True):
        pool = HashPrefixCache(
            10, page_size, device="cpu", uncached_first=uncached_first
        )
        ref = PagePoolRef(10, page_size, uncached_first)
        beginnings = [
            [rng.randrange(4) for _ in range(3 * page_size)] for _ in range(2)
        ]
        live = {}
        for step in range(60):
            op = rng.random()
            if op < 0.4 or not live:
                ids = rng.choice(beginnings)[: rng.randrange(1, 3 * page_size + 1)] + [
                    rng.randrange(4)
                ]
                if pool.pages_needed(ids) > len(pool.free_queue):
                    continue
                got = pool.allocate(ids)
                assert got == tuple(ref.allocate(ids)), (
                    f"step {step}: allocate gave {got}, the oracle"
                    f" {tuple(ref.allocate(ids))}"
                )
                live[step] = (ids, got.pages)
            elif op < 0.7:
                sid = rng.choice(sorted(live))
                ids, old = live[sid][0] + [rng.randrange(4)], live[sid][1]
                if len(old) < -(-len(ids) // page_size) and not pool.free_queue:
                    continue
                new = pool.append_token(old, ids)
                assert new == ref.append_token(old, ids), (
                    f"step {step}: append_token gave {new}, the oracle another")
                live[sid] = (ids, new)
            else:
                sid = rng.choice(sorted(live))
                pool.free(live[sid][1])
                ref.free(live.pop(sid)[1])
            assert pool.ref_count == ref.refs and list(pool.free_queue) == ref.queue, (
                f"step {step}: counts {pool.ref_count} vs {ref.refs}, queue"
                f" {list(pool.free_queue)} vs {ref.queue}"
            )
            assert {p: h for h, p in pool.hash_to_page.items()} == {
                p: page_hashes(list(key), page_size)[-1]
                for key, p in ref.page_of.items()
            }, f"step {step}: the cached pages differ from the oracle's"
            pool.check_integrity()
        print(
            f"page_size {page_size}, uncached_first={uncached_first}: 60 steps agree"
            f" ({pool.evicted_pages} evictions, {len(pool.hash_to_page)} pages cached"
            " at the end)"
        )

# %% [markdown]
# ## The picture: four requests through `CacheManager`, on the hash cache
#
# `CacheManager` (chapter 06) takes either cache: `prefix_cache="hash"`. The hash cache speaks the
# radix cache's words to it (`match_prefix`, `insert_prefix` after the pass, `lock_handle` for a
# reference on every page of a handle, `evict_leaves` for "pages, please", and the `undo_*` words
# with which the manager takes back a call that failed half-way) and keeps the free pages itself,
# so the manager's own [free list](glossary.md#free-list) stays empty. Chapter 05's four
# requests from two conversations, the same calls: equal colours are shared pages.

# %% alt="A page table of four requests served by the hash cache on pages of 4 slots, in which rows 0 and 2 share their first two pages and rows 1 and 3 share theirs."
P4 = 4
cm = CacheManager(
    num_pages=24,
    page_size=P4,
    page_table=new_page_table(4, 24, P4),
    prefix_cache="hash",
    page_table_writer="host",
)
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
page_table_heatmap(
    cm.page_table[:4, :20], P4, title="shared pages across rows (hash cache)"
)
plt.show()
# system_a's 2 whole pages
assert torch.equal(cm.page_table[2, :8], cm.page_table[0, :8]), (
    "rows 0 and 2 should share system_a's two pages")
# system_b + [4 5]: 2 pages
assert torch.equal(cm.page_table[3, :8], cm.page_table[1, :8]), (
    "rows 1 and 3 should share two pages")

# %% [markdown]
# ## Side by side, measured
#
# Now the question the two designs raise: which one is better, and when? Chapter 07's simulator
# runs on either cache (`SimConfig(prefix_cache=...)`), through the same `CacheManager`, on the
# same seeded workloads, and checks both after every step of their
# [timelines](glossary.md#timeline). Three caches:
#
# * `radix`: chapters 05-06. Free pages first; when they run out, whole least-recently-used
#   unlocked leaves (the LRU clock ticks on every match and insert).
# * `hash`: this chapter in nano-vllm's order: one free queue, in the order pages were released.
# * `hash_uncached_first`: the same, with pages that hold no hash queued at the head (vLLM).
#
# One caveat on the `hash` runs: they go through `CacheManager`, which settles a finished request
# in mini-sglang's order (insert its pages into the cache, then free its partial tail page),
# so the tail page joins the queue *behind* the request's own cached pages; nano-vllm's
# `deallocate` releases the tail page first, ahead of them. The `hash_uncached_first` runs are
# not affected: a page without a hash goes to the head either way.
#
# Five workloads (chapter 07's generators), each in three pools: `tight` (the longest request's
# pages: [preemptions](glossary.md#preemption)), `half` (twice that) and `ample` (every request's
# pages at once: nothing ever has to be evicted). Page size 4. Columns: hit tokens (prompt tokens
# taken from the cache), evicted tokens, `over` (evicted tokens no allocation asked for), peak and
# mean pages in use, preemptions, steps, the median host time of one `match_prefix` /
# `insert_prefix`, and the first step at which the run differs from the radix run in hits,
# evictions, admissions or where the pages are. The picture under the table draws two of those
# columns for every workload and pool: the hit rate, and the evicted tokens with the part no
# allocation asked for hatched.

# %% alt="Bars of the prefix-hit rate (top) and the evicted tokens (bottom) of the radix cache and the hash cache, on the same five seeded workloads with tight, half and ample pools of pages of 4 slots."
rows = measured_rows()
print(comparison_table(rows))
draw_cache_comparison(rows)
plt.show()

# %% [markdown]
# What the table says, and why.
#
# **Where they agree exactly.** With an ample pool, all three caches give the same hits, the
# same page split and the same admissions at *every* step ("never" in the last column): both
# designs cache whole pages only, match the longest cached run of whole pages (a *partial
# match* that leaves a cached chain inside a page ends on the same page boundary in both), and
# cache a prompt at the same moment (the manager's `cache_req`). The differences below all come
# from what each one throws away when memory runs short.

# %%
by = {(r.workload, r.pool, r.cache): r for r in rows}
for name in COMPARED:
    ample = [by[(name, "ample", c)] for c in ("radix", "hash", "hash_uncached_first")]
    assert (
        all(r.diverged_at is None for r in ample[1:])
        and len({r.hit_tokens for r in ample}) == 1
    ), f"{name}, ample pool: the caches part or hit differently"
    assert all(
        r.evicted_tokens == 0 for r in ample
    ), f"{name}, ample pool: something was evicted"
print("ample pools: the three caches agree step by step on every workload")

# %% [markdown]
# **Random prompts: hits only when memory is short.** No two of the random prompts begin with
# the same page, so none can reuse another's. Yet in the tight and half pools every cache takes
# a few prompt tokens from the cache (the `hit tok` column), and in the ample pool none. Those
# hits are a request's *own* pages: a request [preempted](glossary.md#preemption) to make room
# goes back to the queue, but the prompt pages its prefill computed stay cached (its
# `cache_req(finished=False)` inserted them), and when it is admitted again it finds them. An
# ample pool never preempts, so no request is admitted twice, and there is nothing to hit. Step
# by step: every step with hits admits a request that was preempted before (or in that same
# step, to be admitted again at once), and hits at most the whole pages of those requests'
# prompts.

# %%
prompt_of = {r.rid: r.prompt for r in make_workload("random_prompts", seed=0).requests}
firsts = [tuple(p[:P4]) for p in prompt_of.values()]
assert len(set(firsts)) == len(firsts), "two random prompts begin with the same page"
for pool in ("tight", "half", "ample"):
    rand = make_workload("random_prompts", seed=0)
    run = Simulator(
        rand, SimConfig(num_pages=pool_sizes(rand, P4)[pool], page_size=P4)
    ).run()
    preempted, hits = set(), 0
    for s in run.steps:
        preempted |= set(s.preempted)
        if s.hit_tokens:
            back = [rid for rid in s.admitted if rid in preempted]
            # their whole prompt pages
            most = sum(len(prompt_of[rid]) // P4 * P4 for rid in back)
            assert 0 < s.hit_tokens <= most, (
                f"{pool} pool, step {s.step}: {s.hit_tokens} hit tokens, "
                f"re-admitted after a preemption: {back}"
            )
            hits += s.hit_tokens
    print(
        f"random prompts, {pool:5s} pool: {len(preempted)} requests preempted, {hits}"
        " hit tokens, every one on a re-admitted request's own pages"
    )
    assert (hits > 0) == (pool != "ample") and (len(preempted) > 0) == (
        pool != "ample"
    ), (pool, hits, preempted)

# %% [markdown]
# **Eviction granularity.** The radix tree evicts a *whole leaf*, however many pages it holds
# and however few the allocation needs (chapter 05: `evict(1)` freed four tokens). The hash
# cache hands out exactly the pages an allocation takes, one at a time from the queue. The
# `over` column counts the difference: every radix run under pressure evicts tokens no
# allocation asked for; no hash run ever does. Those pages were still cached: a later request
# that shared them has to compute them again. In the tight and half pools of the mixed workload
# both hash caches take more prompt tokens from the cache than the tree does.

# %%
pressured = [r for r in rows if r.pool != "ample"]
assert all(r.over_evicted == 0 for r in pressured if r.cache != "radix"), (
    "a hash run evicted tokens no allocation asked for")
assert any(r.over_evicted > 0 for r in pressured if r.cache == "radix"), (
    "no radix run evicted more than asked for")
mixed_tight = {
    c: by[("mixed", "tight", c)] for c in ("radix", "hash", "hash_uncached_first")
}
for pool in ("tight", "half"):
    assert (
        min(by[("mixed", pool, c)].hit_tokens for c in ("hash", "hash_uncached_first"))
        > by[("mixed", pool, "radix")].hit_tokens
    ), f"{pool} pool of the mixed workload: the hash caches hit no more than the tree"
for c, r in mixed_tight.items():
    print(
        f"mixed, tight pool, {c:20s}: {r.hit_tokens} hit tokens, {r.evicted_tokens}"
        f" evicted, {r.over_evicted} of them beyond what allocations asked for"
    )

# %% [markdown]
# **Eviction order.** nano-vllm's single queue hands out the oldest released page *whether or not
# it holds a hash*: it may evict a cached page while a page without a hash (a partial page, which
# no prompt can ever hit) waits behind it. The radix design spends never-cached free pages
# first, and so does vLLM's order. In the multi-turn chat with half a pool that is the whole
# difference: `hash_uncached_first` and `radix` agree at every step, while `hash` evicts more and
# hits less. We can watch it happen by counting, in nano-vllm's order, the evictions made while
# a page without a hash waited further back in the queue:

# %%
chat = make_workload("multi_turn_chat", seed=0)
sim = Simulator(
    chat,
    SimConfig(num_pages=pool_sizes(chat, 4)["half"], page_size=4, prefix_cache="hash"),
)
hasty, take_free = [], sim.cache.take_free


def counting_take_free():
    head = sim.cache.free_queue.head(1)[0]
    if sim.cache.page_hash[head] is not None and any(
        sim.cache.page_hash[p] is None for p in sim.cache.free_queue
    ):
        hasty.append((sim.step_no, head))
    return take_free()


sim.cache.take_free = counting_take_free
sim.run()
print(
    f"{len(hasty)} cached pages handed out while a page without a hash waited behind"
    f" them: {hasty}"
)
half = {
    c: by[("multi_turn_chat", "half", c)]
    for c in ("radix", "hash", "hash_uncached_first")
}
assert hasty and half["hash_uncached_first"].diverged_at is None, (
    f"handed out while an uncached page waited: {hasty}; uncached-first parts at"
    f" {half['hash_uncached_first'].diverged_at}"
)
assert (
    half["hash"].hit_tokens
    < half["radix"].hit_tokens
    == half["hash_uncached_first"].hit_tokens
), f"hit tokens: {({c: r.hit_tokens for c, r in half.items()})}"

# %% [markdown]
# The order of cached pages differs too: the radix tree orders whole leaves by the last match
# or insert that used them (one stamp for every page of a node), the hash cache orders single
# pages by when the last sequence holding them let go. Where those orders differ, the two evict
# different pages, and the runs part at the step the table shows.
#
# **Lookup cost.** The hash cache hashes every page of the prompt before it can look anything
# up; the radix tree compares tokens as it walks. Timed side by side in one run, in turns, on the
# same fully cached prompts (page size 16), as a ratio:

# %% alt="A log-log line chart of the host microseconds one match_prefix takes against the number of cached prompt tokens, for the radix tree and for the hash chain."
costs = lookup_cost([64, 256, 1024, 4096], page_size=16, repeats=100)
for c in costs:
    print(
        f"{c.prompt_len:5d} tokens: radix {c.radix_us:7.1f} us, hash {c.hash_us:7.1f}"
        f" us -> hash/radix {c.ratio:.2f}"
    )
draw_lookup_cost(costs)
plt.show()

# %% [markdown]
# Both grow linearly with the prompt. In this Python code a hash lookup costs more than a tree
# walk (a BLAKE2b call per page against comparing the page's tokens; on the machine this chapter
# was written on the ratio was between about 1.5 and 2). The engines hide most of it: vLLM
# computes a request's block hashes **once**, when the request is created and as tokens are
# appended (`cache_full_blocks`' docstring: "The block hashes values are computed by the Request
# object immediately when it is created and when new tokens are appended"), so its lookup is a
# dict probe per page; kvlab's `match_prefix` hashes again on every call (a departure: simpler,
# and it keeps no per-request state). What the hash cache buys for it is the flat structure: no
# splits, no LRU stamps to maintain on every match, and an eviction that is a `popleft`.
#
# Two behaviours of nano-vllm's code at `2f352aea` that kvlab does not copy, both shown by the
# differential test `tests/test_hash_cache_nanovllm.py`, which drives a port of its block
# manager and `HashPrefixCache` with the same traces and finds them equal at every step
# otherwise:
#
# * **a [stale hash](glossary.md#stale-hash).** `_allocate_block` resets a reused block but leaves
#   its old hash in `hash_to_block_id`; `allocate` then compares only the block's token ids. If
#   the block is filled again with the *same tokens after another prefix*, a prompt with the old
#   prefix hits it and reads KV computed for the other prefix. kvlab drops the hash when the page
#   is handed out.
# * **[twin pages](glossary.md#twin-pages).** When two running sequences fill identical pages,
#   nano-vllm's dict points at the later one; kvlab keeps the earlier one (vLLM's
#   `BlockHashToBlockMap` keeps both, and `get_one_block` returns the first).

# %% [markdown]
# ## Your turn
#
# Four exercises, each on a real `HashPrefixCache`. The [checkers](glossary.md#checker) compare
# your answer with the oracle on named edge cases and seeded random ones, and say which case
# failed and how. A typical slip, a page hash without its parent, is caught like this:

# %%
# the slip: every page hashed alone
def page_hashes_without_parent(input_ids, page_size):
    return [
        chain_hash(None, input_ids[s : s + page_size])
        for s in range(0, len(input_ids) - page_size + 1, page_size)
    ]


try:
    kvlab.check.page_hashes(page_hashes_without_parent)
except kvlab.check.CheckFailed as e:
    print("CheckFailed:", str(e).splitlines()[0])
else:
    raise AssertionError("a hash without its parent must be rejected")

# %% [markdown]
# **Exercise `page_hashes`.** Write `my_page_hashes(input_ids, page_size) -> list`: a list with the chained
# hash (bytes) of every full page, with `chain_hash(parent, page_tokens)` (`parent=None` for the first).
# `input_ids` is read-only. Hints: `kvlab.check.hint("page_hashes", 1)`; `kvlab.solutions.show("page_hashes")` prints a
# reference solution.

# %%
def my_page_hashes(input_ids, page_size):
    """The chained hash of every full page of input_ids (a partial last page has none).
    """
    # lifted into kvlab.prefix.hash_chain.page_hashes
    ### BEGIN SOLUTION
    hashes, parent = [], None
    for start in range(0, len(input_ids) - page_size + 1, page_size):
        parent = chain_hash(parent, input_ids[start:start + page_size])
        hashes.append(parent)
    return hashes
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: page_hashes
    raise NotImplementedError("hash each full page with the previous page's hash")
    ### END STARTER


kvlab.check.page_hashes(my_page_hashes);

# %% [markdown]
# **Exercise `hash_match`.** Write `my_hash_match(cache, input_ids) -> (num_pages, slots)`: walk
# the prompt's full pages from the first, `h = chain_hash(parent, tokens)`, find the page with
# `cache.lookup(h, tokens)`, stop at the first miss. Return how many pages matched (an int) and
# their slots (a list of ints, `page * P + i`). The cache and `input_ids` are read-only: the checker compares every
# page's reference count, hash and tokens, `hash_to_page`, the free queue's order and
# `evicted_pages` after your call. Hints: `kvlab.check.hint("hash_match", 1)`.

# %%
def my_hash_match(cache, input_ids):
    """(matched full pages, their slots), walking the chain from the first page."""
    # lifted into kvlab.prefix.hash_cache.HashPrefixCache.match
    ### BEGIN SOLUTION
    P = cache.page_size
    pages, parent = [], None
    for start in range(0, len(input_ids) - P + 1, P):
        tokens = input_ids[start:start + P]
        parent = chain_hash(parent, tokens)
        page = cache.lookup(parent, tokens)
        if page is None:
            break  # every later hash chains from this one
        pages.append(page)
    return len(pages), [page * P + i for page in pages for i in range(P)]
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: hash_match
    raise NotImplementedError("hash, look up, stop at the first miss")
    ### END STARTER


kvlab.check.hash_match(my_hash_match);

# %% [markdown]
# **Exercise `allocate_pages`.** Write nano-vllm's `allocate` from the cache's building blocks:
# `my_allocate_pages(cache, input_ids) -> (pages, cached_len)`. While every page so far was a
# hit, hash the next full page and `cache.lookup` it; a hit gets `cache.take_cached(page)`. After
# the first miss every page is new: `cache.take_free()` (the head of the queue; a cached page
# loses its hash there), and a new **full** page becomes findable with
# `cache.cache_page(page, h, tokens, parent)`. Return the pages as a list (or a tuple) of ints and
# `cached_len` as an int. The checker gives only prompts that fit, and
# `input_ids` is read-only. Afterwards the whole cache must be as the reference leaves it: every
# page's reference count, hash, parent hash and tokens, `hash_to_page`, the free queue in order
# and `evicted_pages`. Hints: `kvlab.check.hint("allocate_pages", 1)`.

# %%
def my_allocate_pages(cache, input_ids):
    """Pages for a new sequence: its cached chain (hits), then new pages; (pages,
    cached_len)."""
    # lifted into kvlab.prefix.hash_cache.HashPrefixCache.allocate
    ### BEGIN SOLUTION
    P = cache.page_size
    pages, parent, cached_len, hitting = [], None, 0, True
    for start in range(0, len(input_ids), P):
        tokens = input_ids[start:start + P]
        full = len(tokens) == P
        h = chain_hash(parent, tokens) if full else None
        page = cache.lookup(h, tokens) if hitting and full else None
        if page is not None:
            cache.take_cached(page)  # one more reference; a free page leaves the queue
            cached_len += P
        else:
            hitting = False  # after a miss nothing further can hit
            page = cache.take_free()
            if full:
                cache.cache_page(page, h, tokens, parent)
        pages.append(page)
        parent = h
    return pages, cached_len
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: allocate_pages
    raise NotImplementedError(
        "hits first (take_cached), then take_free; cache new full pages"
    )
    ### END STARTER


kvlab.check.allocate_pages(my_allocate_pages);

# %% [markdown]
# **Exercise `free_pages`.** Write nano-vllm's `deallocate` on the cache's state:
# `my_free_pages(cache, pages)` drops one reference from each page (`cache.ref_count[page]`),
# **last page first**; a page whose count reaches zero joins the tail of `cache.free_queue`
# (`append`) and keeps its hash. If a page has no reference left to drop, raise an error
# *before changing anything*: a count never goes below zero. `pages` is read-only, and the rest
# of the cache is compared as after `allocate_pages`. Hints: `kvlab.check.hint("free_pages", 1)`.

# %%
def my_free_pages(cache, pages):
    """Drop one reference per page, last page first; a page nobody holds joins the free
    queue."""
    # lifted into kvlab.prefix.hash_cache.HashPrefixCache.free
    ### BEGIN SOLUTION
    for page in set(pages):
        if cache.ref_count[page] < list(pages).count(page):
            raise ValueError(f"page {page} has no reference left to drop")
    for page in reversed(pages):
        cache.ref_count[page] -= 1
        if cache.ref_count[page] == 0:
            cache.free_queue.append(page)  # it keeps its hash: still findable
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: free_pages
    raise NotImplementedError(
        "ref_count down, last page first; zero: append to the free queue"
    )
    ### END STARTER


kvlab.check.free_pages(my_free_pages);

# %% [markdown]
# ## Lift: the notebook's functions vs kvlab
#
# Your four functions against the ones [lifted](glossary.md#lift) into the package, on random
# prompts with shared beginnings: `kvlab.page_hashes` and `HashPrefixCache.match` / `allocate` /
# `free` on a twin cache, the same answers and the same state after every call. Until an exercise
# passes its checker, this cell uses the package's function in its place (`hash_match` has none
# of that shape: its reference solution), and says so. Your `allocate_pages` may return its
# pages as a list or a tuple (the checker takes both): the cell compares them as a tuple.

# %%
hashes_fn = kvlab.check.choose("page_hashes", my_page_hashes, kvlab.page_hashes)
match_fn = kvlab.check.choose(
    "hash_match", my_hash_match, kvlab.solutions.get("hash_match")
)
allocate_fn = kvlab.check.choose(
    "allocate_pages", my_allocate_pages, HashPrefixCache.allocate
)
free_fn = kvlab.check.choose("free_pages", my_free_pages, HashPrefixCache.free)

rng = random.Random(11)
for page_size in (1, 2, 4):
    mine, theirs = HashPrefixCache(12, page_size, device="cpu"), HashPrefixCache(
        12, page_size, device="cpu"
    )
    beginnings = [[rng.randrange(3) for _ in range(3 * page_size)] for _ in range(2)]
    live = []
    for _ in range(30):
        ids = rng.choice(beginnings)[: rng.randrange(0, 3 * page_size + 1)] + [
            rng.randrange(3)
        ]
        said = f"page_size {page_size}, prompt {ids}"
        assert hashes_fn(ids, page_size) == page_hashes(
            ids, page_size
        ), f"{said}: page hashes differ"
        n, slots = match_fn(mine, ids)
        want = theirs.match(ids)
        assert (n, slots) == (len(want.pages), want.get_matched_indices().tolist()), (
            f"{said}: your match ({n}, {slots}), the package's ({len(want.pages)},"
            f" {want.get_matched_indices().tolist()})"
        )
        if live and (
            rng.random() < 0.5 or theirs.pages_needed(ids) > len(theirs.free_queue)
        ):
            pages = live.pop(rng.randrange(len(live)))
            free_fn(mine, list(pages))
            theirs.free(pages)
        elif theirs.pages_needed(ids) <= len(theirs.free_queue):
            pages, cached_len = allocate_fn(mine, ids)
            done = theirs.allocate(ids)
            assert (tuple(pages), cached_len) == (done.pages, done.cached_len), (
                f"{said}: you allocated {tuple(pages)} with {cached_len} cached, the"
                f" package {done.pages} with {done.cached_len}"
            )
            live.append(tuple(pages))
        assert (
            mine.ref_count == theirs.ref_count
        ), f"{said}: ref_count {mine.ref_count}, the package's {theirs.ref_count}"
        assert list(mine.free_queue) == list(theirs.free_queue), (
            f"{said}: free queue {list(mine.free_queue)}, the package's"
            f" {list(theirs.free_queue)}"
        )
        assert (
            mine.hash_to_page == theirs.hash_to_page
        ), f"{said}: hash_to_page differs from the package's"
        mine.check_integrity()
print("page_hashes, hash_match, allocate_pages and free_pages agree with kvlab")

# %% [markdown]
# ## Summary
#
# * A full page is known by a **chained hash** of its parent page's hash and its tokens: a
#   fixed-size stand-in for "every token up to the end of this page", which is what a reusable
#   page must agree on. A page hashed alone would be shared between prompts that differ earlier.
# * A prompt is **matched by walking its chain** from the first page; the first miss ends it.
#   Whole pages only; a **partial last page** has no hash until a decode step fills it.
# * **Reference counts** replace the radix tree's locks: a sequence holds every page it maps.
# * The **free queue is the LRU list**: freed pages join its tail, last page first, *keeping
#   their hashes*; a hit takes a page back out of the middle; handing out the head is the
#   eviction. nano-vllm queues every freed page the same way, vLLM puts pages without a hash in
#   front (`uncached_first=True`).
# * Measured on the same workloads through the same `CacheManager`: with memory to spare the two
#   designs agree at every step; under pressure the hash cache evicts page by page where the
#   tree evicts whole leaves, and nano-vllm's order can evict a cached page before a useless one;
#   a hash lookup costs more host time unless, as in vLLM, each request's hashes are kept.
# * Lifted into `kvlab.HashPrefixCache` (`kvlab/prefix/hash_cache.py`) and `kvlab.chain_hash` /
#   `page_hashes` (`kvlab/prefix/hash_chain.py`); the comparison in `kvlab.serving.sim.compare`; pictures in
#   `kvlab.course.viz.chains`.
#
# ## Questions
#
# 1. SGLang's radix tree can run with `page_size = 1` and share a prompt token by token. What
#    would a hash cache with one-token pages cost, per token of a prompt, in hashing and in
#    dict entries? Where does that leave the choice of page size for each design?
# 2. Write a short sequence of requests after which nano-vllm's queue has thrown away a cached
#    prefix that vLLM's order (`uncached_first=True`) and the radix tree still hold. What does
#    the next request with that prefix pay?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# **1. One-token pages.** Every token becomes a page with its own hash: one hash call and one
# dict entry per token, and a lookup hashes every token of the prompt. The radix tree with
# `P = 1` compares tokens, which is cheap, and a node holds a whole run without a branch, so the
# tree stays small. The hash cache's cost is per page, not per token: it pays off with pages of
# many tokens, where one hash covers them all, at the price of sharing whole pages only. The
# first cell below counts the dict entries and hash calls for one 256-token prompt.
#
# **2. One queue for everything.** A finishes with a cached prefix `[1 2|3 4]` and a partial
# page; a short unrelated request B uses the never-used page and finishes: its page, which holds
# no hash, now waits *behind* A's cached pages. C needs two pages: nano-vllm's queue hands out
# A's partial page and then A's cached `[3 4]`, while B's useless page stays. The next request
# with A's prefix recomputes `[3 4]`. vLLM's order (and chapter 06's free list, which the tree
# only evicts from when it is empty) spends B's page instead; second cell.

# %% tags=["solution"]
prompt = list(range(256))
for P in (1, 4, 16, 64):
    h = HashPrefixCache(-(-256 // P), P, device="cpu")
    h.allocate(prompt)
    print(
        f"page size {P:2d}: {len(h.hash_to_page):3d} dict entries,"
        f" {len(page_hashes(prompt, P)):3d} hash calls per lookup"
    )


# %% tags=["solution"]
for uncached_first in (False, True):
    q = HashPrefixCache(4, 2, device="cpu", uncached_first=uncached_first)
    q.free(q.allocate([1, 2, 3, 4, 5]).pages)  # A: [1 2|3 4] cached, [5] partial
    q.free(q.allocate([7]).pages)              # B: one page, no hash, released after A
    q.allocate([8, 8, 8])                      # C: two pages from the head of the queue
    print(
        f"uncached_first={uncached_first}: the next [1 2 3 4 ...] hits"
        f" {q.match([1, 2, 3, 4, 9]).cached_len} tokens"
    )
