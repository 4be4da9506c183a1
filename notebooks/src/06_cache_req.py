# %% [markdown]
# # 06 · `cache_req`: settling a request's pages with the prefix cache
#
# **Goal.** Put chapter 05's prefix cache, the free list and the page table together into
# mini-sglang's `CacheManager`, and follow its most delicate method, `cache_req`, through the
# **four regions** of a request's row. You will see a plain hit, the *duplicate* region that
# appears when two requests with one prompt are prefilled in the same batch, finished and
# unfinished tails, and a real bug of the source design (a page-table row left pointing at
# freed pages) and its fix. After every step one invariant is checked: every page is in
# exactly one place.

# %%
import random

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab import CacheManager, Req
from kvlab.scenes.ch06_cache_req import (P, SYSTEM, new_manager, prefill, scenarios, stale_row_demo,
                                          wrong_reads, write_kv)
from kvlab.reference import cache_req_regions_ref
from kvlab.viz import page_owner_strip, page_table_heatmap, region_bar, region_bars

torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Intuition: who owns which page of a row
#
# A running request's page-table row has two parts:
#
# ```
# position  0 ............ handle.cached_len ............... pages mapped * P
# row       [ cached slots: the prefix cache's, | the request's own pages:     ]
#           [ shared, locked by its handle      | allocate_paged gave them     ]
# ```
#
# When a prefill (or a decode) has computed more tokens, `cache_req` hands the newly computed
# **whole pages** to the prefix cache, so later requests can share them, and decides what the
# request still owns. Over `[0, req.cached_len)` that makes four regions:
#
# ```
# 0          old.cached_len        cached_len        new.cached_len        req.cached_len
# |   hit     |  duplicate (free it) |  newly inserted  |  tail (free if finished) |
# ```
#
# * **hit** `[0, old.cached_len)`: in the cache before the prefill; the request's handle covers it.
# * **duplicate** `[old.cached_len, cached_len)`: the request computed these, but *meanwhile
#   another request inserted the same tokens*. `insert_prefix` answers `cached_len` (already
#   cached) and keeps its own copy, so the request's pages here must be freed or they leak.
# * **newly inserted** `[cached_len, new.cached_len)`: the request's pages now belong to the cache.
# * **tail** `[new.cached_len, req.cached_len)`: less than a page, not cacheable. A finished
#   request frees it; an unfinished one keeps decoding into it.
#
# Here are the four cache_req calls this chapter walks through, drawn as region bars (numbers:
# the slot each position mapped before the call; hatched: returned to the free list).

# %%
region_bars(scenarios(), title="cache_req: the four regions of [0, req.cached_len)")
plt.show()

# %% [markdown]
# ## Build-up 1: the manager's pieces
#
# `CacheManager(num_pages, page_size, page_table)` owns:
#
# * `free_slots`: the **page start** slot of every free page, `arange(num_pages) * P` at first;
#   `_allocate(n)` takes pages from the front and, when too few are free, evicts from the
#   prefix cache and appends `evicted[::P]` (evict returns token slots, the list wants pages);
# * `prefix_cache`: chapter 05's `RadixPrefixCache`;
# * `page_table`: chapter 02's table; `allocate_paged(reqs)` maps pages
#   `[div_ceil(cached_len, P), div_ceil(device_len, P))` of each request with one allocation and
#   one page-table write (the Triton writer of chapter 02 by default).
#
# kvlab's manager also **tracks running requests**, so it can check the conservation law:
# free pages + pages in the cache + pages owned by running requests = all pages, each exactly once.
# `page_owners()` says where every page is; `check_integrity()` raises `IntegrityError` naming
# the first page that is lost or owned twice.

# %%
cm = new_manager(num_pages=12)
print("free_slots:", cm.free_slots.tolist(), "(page starts, P =", P, ")")
print("available tokens:", cm.available_size)
cm.check_integrity()

a = Req(SYSTEM + [1, 2], table_idx=0)  # 10 tokens
match = cm.admit(a)  # match_req + lock the hit + map it into the row
print(f"admit A: {match.cached_len} tokens hit; cached_len={a.cached_len}, device_len={a.device_len}")
cm.allocate_paged([a])
print("A's row:", cm.page_table[0, :12].tolist())
print("free_slots now:", cm.free_slots.tolist())
cm.check_integrity()
assert cm.page_table[0, :12].tolist() == list(range(12)) and cm.num_free_pages == 9

# %% [markdown]
# ## Build-up 2: `cache_req` by hand
#
# The prefill ran; in mini-sglang's `Req`, `complete_one()` then sets `cached_len = device_len`
# (everything on the device is now computed) and `device_len += 1` (room for the next token).
# `cache_req(req, finished=False)` does, in order:
#
# 1. `insert_prefix(input_ids[:cached_len], row[:cached_len])` → `(cached_len, new_handle)`;
# 2. unlock the old handle (only now: the insert walked the nodes the old handle protects);
# 3. free the duplicate region `row[old.cached_len : cached_len]`, one entry per page;
# 4. finished: free the tail `row[new.cached_len:]`; unfinished: lock `new_handle` and keep it.
#
# Let's do these steps by hand on A, on a scratch copy of the cache (inserting A's own slots
# into the manager's real cache behind its back would make them look like duplicates of
# themselves), and then compare with `cm.cache_req`.

# %%
import copy

a.complete_one()
scratch = copy.deepcopy(cm.prefix_cache)
row = cm.page_table[0, : a.cached_len].clone()
old_len = a.cache_handle.cached_len
already, new_handle = scratch.insert_prefix(a.input_ids[: a.cached_len], row)
print(f"old.cached_len={old_len}  already cached={already}  new.cached_len={new_handle.cached_len}  "
      f"req.cached_len={a.cached_len}")
duplicate_pages = row[old_len:already][::P]
tail = row[new_handle.cached_len:]
print("duplicate pages to free:", duplicate_pages.tolist(), "| tail slots (kept, unfinished):", tail.tolist())
assert (old_len, already, new_handle.cached_len) == (0, 0, 8) and duplicate_pages.numel() == 0

# %% [markdown]
# Nothing was cached before, so A's first two pages become the cache's and the 2-token tail
# stays with A. The real call does the same to the manager's cache, and records the regions:

# %%
regions_a = cm.cache_req(a, finished=False)
print(regions_a)
cm.check_integrity()
assert (regions_a.hit, regions_a.inserted, regions_a.tail) == ((0, 0), (0, 8), (8, 10))
page_owner_strip(cm, title="after A: two pages cached (locked by A), A owns its tail page")
plt.show()

# %% [markdown]
# ## Scenario 1: a plain hit
#
# B shares A's system prompt. `admit` matches `input_ids[:-1]`, finds A's two pages, locks them
# and maps them into B's row; B only gets pages for positions 8 onwards.

# %%
b = Req(SYSTEM + [3, 4, 5], table_idx=1)
hit = cm.admit(b).cached_len
cm.allocate_paged([b])
b.complete_one()
regions_b = cm.cache_req(b, finished=False)
print(f"B: hit {hit} tokens;", regions_b)
print("A's row:", cm.page_table[0, :12].tolist())
print("B's row:", cm.page_table[1, :12].tolist())
cm.check_integrity()
assert regions_b.hit == (0, 8) and regions_b.duplicate == (8, 8)
assert torch.equal(cm.page_table[0, :8], cm.page_table[1, :8])  # the very same slots

# %% [markdown]
# ## Scenario 2: one prompt, twice in one batch → the duplicate region
#
# C and D arrive together with the same 13-token prompt. Both are admitted *before* either is
# cached, so both hit only the 8 system tokens, and both get their own pages for positions
# 8-12. After the prefill, C is cached first and inserts positions 8-11. When D is cached,
# `insert_prefix` answers "12 already cached": D's page for positions 8-11 is a **duplicate**.

# %%
c, d = Req(SYSTEM + [7, 7, 7, 7, 8], 2), Req(SYSTEM + [7, 7, 7, 7, 8], 3)
prefill(cm, [c, d])
print("C's row before:", cm.page_table[2, :16].tolist())
print("D's row before:", cm.page_table[3, :16].tolist())
regions_c = cm.cache_req(c, finished=False)
regions_d = cm.cache_req(d, finished=False)
print(regions_c)
print(regions_d, "| freed pages:", regions_d.freed_pages.tolist())
print("D's row after: ", cm.page_table[3, :16].tolist())
cm.check_integrity()
assert regions_d.duplicate == (8, 12) and regions_d.remapped
assert torch.equal(cm.page_table[3, :12], cm.page_table[2, :12])  # D now reads C's cached pages
free_pages = set(cm.free_slots.tolist())
assert not {s - s % P for s in cm.page_table[3, :13].tolist()} & free_pages  # no freed page in D's row

# %% [markdown]
# Look at D's row: positions 8-11 used to map D's own page (slots 24-27); that page went back
# to the free list, and the row now maps C's cached slots instead. That last step is **not**
# in the source design, and the next scenario shows why it matters.
#
# ## Scenario 3: the source design's stale row, and the fix
#
# In mini-sglang's `cache_req`, the duplicate pages are freed while the request's page-table
# row still points at them. If the request is finished, nobody reads that row again. But with
# `finished=False` (after every prefill, and for chunked prefill) the request keeps decoding,
# and its attention reads positions 8-11 through the row: from pages that are free, and that
# the next allocation hands to somebody else, who overwrites them.
#
# `CacheManager(..., remap_duplicates=False)` reproduces the source's behaviour. We run the
# story with a tiny pool, pretend to run the model (each slot's "KV" records which tokens it
# was computed from), and let a newcomer take the freed pages.

# %%
cm_src, kv_src, prompt = stale_row_demo(remap_duplicates=False)
bad = wrong_reads(cm_src, kv_src, prompt)
print("row 1 (source design):", cm_src.page_table[1, :10].tolist())
print("row 2 (the newcomer): ", cm_src.page_table[2, :8].tolist())
print("positions of row 1 whose slot now holds another request's KV:", bad.nonzero().flatten().tolist())
assert bad.any()
try:
    cm_src.check_integrity()
except kvlab.IntegrityError as e:
    print("check_integrity:", e)
else:
    raise AssertionError("the stale row must be caught")

# %% [markdown]
# `check_integrity` compares each running row's cached part with the slots of its locked
# handle, so it catches the stale row *before* a newcomer overwrites anything. kvlab's default
# rewrites `row[old.cached_len : cached_len]` to `new_handle.get_matched_indices()` over the
# same range, so the row reads the cached copy, which is locked and safe:

# %%
cm_fix, kv_fix, prompt = stale_row_demo(remap_duplicates=True)
print("row 1 (kvlab):", cm_fix.page_table[1, :10].tolist())
assert not wrong_reads(cm_fix, kv_fix, prompt).any()
cm_fix.check_integrity()

fig, axes = plt.subplots(2, 1, figsize=(8, 4.2))
for ax, (name, manager, kv) in zip(axes, [("source design", cm_src, kv_src), ("kvlab", cm_fix, kv_fix)]):
    wrong = torch.zeros(3, 12, dtype=torch.bool)
    wrong[1, : len(prompt)] = wrong_reads(manager, kv, prompt)
    page_table_heatmap(manager.page_table[:3, :12], P, ax=ax, highlight=wrong, page_range=(0, 5),
                       title=f"{name}: {int(wrong.sum())} positions of row 1 read another request's KV")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Scenario 4: finished and unfinished tails
#
# Back to our manager. B decodes two tokens (the second crosses into a new page) and
# finishes. `cache_req(b, finished=True)` inserts B's whole pages, frees the tail page and
# every own page past it, and forgets B; the cache keeps B's pages unlocked (evictable) for
# future requests. A, still running, keeps its tail.

# %%
for token in (9, 10):
    b.append_token(token)
    cm.allocate_paged([b])  # maps a new page only when device_len crosses a page boundary
    b.complete_one()
free_before = cm.num_free_pages
regions_fin = cm.cache_req(b, finished=True)
print(regions_fin, "| freed pages:", regions_fin.freed_pages.tolist())
print("free pages:", free_before, "->", cm.num_free_pages, "| B still running?", b in cm.running)
cm.check_integrity()
assert regions_fin.tail == (12, 13) and regions_fin.tail_freed and b not in cm.running
region_bar(regions_fin)
plt.show()

# %% [markdown]
# Caching B again would free its pages a second time; kvlab refuses (as it refuses to unlock
# an unlocked handle):

# %%
try:
    cm.cache_req(b, finished=True)
except kvlab.CacheMisuse as e:
    print("CacheMisuse:", e)
else:
    raise AssertionError("caching a finished request twice must raise")

# %% [markdown]
# ## Out of pages: decide first, then evict
#
# When free pages run short, `allocate_paged` evicts unlocked cached pages. But if even
# evicting *all* of them would not be enough, the source design evicts, then fails an assert:
# the cache is gone and nothing was allocated. kvlab compares the need with
# `free + evictable` first and raises `OutOfPages` with every piece of state unchanged.

# %%
big = Req(list(range(300, 330)), table_idx=1)  # B's row is free again; 30 tokens = 8 pages
cm.admit(big)
print(f"free pages {cm.num_free_pages}, evictable pages {cm.prefix_cache.size_info.evictable_size // P}")
state = (cm.free_slots.clone(), cm.page_table.clone(), cm.prefix_cache.size_info)
try:
    cm.allocate_paged([big])
except kvlab.OutOfPages as e:
    print("OutOfPages:", e)
else:
    raise AssertionError("8 pages cannot fit")
assert torch.equal(state[0], cm.free_slots) and torch.equal(state[1], cm.page_table)
assert state[2] == cm.prefix_cache.size_info
cm.release_req(big)  # give up on it: unlock its handle, free its pages (none)
cm.check_integrity()
page_owner_strip(cm, title="after the refused allocation: nothing moved")
plt.show()

# %% [markdown]
# ## Validate against the reference, on random traces
#
# `kvlab.reference.cache_req_regions_ref` computes the four regions from the four lengths
# with plain comparisons. We drive a seeded random trace (prefills in batches from a few shared
# prompts, decode steps, finishes, aborts, a small pool so eviction happens) and after every
# `cache_req` compare the regions and the freed pages with the reference; after every step we
# check the conservation law and that every running request reads its own KV.

# %%
def run_trace(seed: int, page_size: int, steps: int = 40, remap: bool = True):
    rng = random.Random(seed)
    cm = CacheManager(4 * 16 // page_size, page_size,
                      kvlab.paging.new_page_table(4, 64, page_size),
                      remap_duplicates=remap)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    kv, calls, evictions = {}, 0, 0

    def cache(req, finished):
        nonlocal calls
        mapped = cm.allocated_pages(req) * page_size  # positions mapped before the call
        row = cm.page_table[req.table_idx, :mapped].tolist()
        regions = cm.cache_req(req, finished=finished)
        ref = cache_req_regions_ref(regions.old_cached_len, regions.already_cached_len,
                                    regions.new_cached_len, regions.req_cached_len, finished)
        assert (regions.hit, regions.duplicate, regions.inserted, regions.tail) == (
            ref.hit, ref.duplicate, ref.inserted, ref.tail)
        freed = [row[p] for s, e in ref.freed for p in range(s, e, page_size)]
        if finished:  # pages mapped past the tail's page (a decode step's new page) go too
            freed += row[kvlab.div_ceil(req.cached_len, page_size) * page_size::page_size]
        assert sorted(freed) == sorted(regions.freed_pages.tolist())
        calls += 1

    for _ in range(steps):
        running = cm.running
        op = rng.choice(["prefill", "prefill", "decode", "decode", "finish", "abort"]) if running else "prefill"
        if op == "prefill":
            rows = sorted(set(range(4)) - {r.table_idx for r in running})[: rng.randrange(1, 3)]
            batch = [Req(rng.choice(prompts)[: rng.randrange(1, 30)] + [rng.randrange(9)], row) for row in rows]
            for r in batch:
                cm.admit(r)
            before = cm.prefix_cache.size_info.total_size
            try:
                cm.allocate_paged(batch)
            except kvlab.OutOfPages:
                for r in batch:
                    cm.release_req(r)
                continue
            evictions += cm.prefix_cache.size_info.total_size < before
            for r in batch:
                write_kv(cm, r, kv)
                r.complete_one()
                r.append_token(rng.randrange(9))
            for r in batch:
                cache(r, False)
        elif op == "decode" and running:
            batch = [r for r in running if r.device_len < 64]
            try:
                cm.allocate_paged(batch)
            except kvlab.OutOfPages:
                cm.release_req(rng.choice(batch))
                continue
            for r in batch:
                write_kv(cm, r, kv)
                r.complete_one()
                r.append_token(rng.randrange(9))
        elif op in ("finish", "abort") and running:
            r = rng.choice(running)
            if op == "finish":
                cache(r, True)
            else:
                cm.release_req(r)
        cm.check_integrity()
        for r in cm.running:  # every running request reads the KV of its own tokens
            row = cm.page_table[r.table_idx].tolist()
            assert all(kv[row[p]] == tuple(r.input_ids[: p + 1]) for p in range(r.cached_len))
    for r in cm.running:
        cache(r, True)
    info = cm.prefix_cache.size_info
    assert info.protected_size == 0 and cm.num_free_pages * page_size + info.evictable_size == cm.num_pages * page_size
    return calls, evictions


for page_size in (1, 4, 16):
    totals = [0, 0]
    for seed in range(kvlab.runtime.pick(cpu=3, gpu=10)):
        calls, evictions = run_trace(seed, page_size)
        totals = [totals[0] + calls, totals[1] + evictions]
    print(f"page_size {page_size:2d}: traces agree with the reference "
          f"({totals[0]} cache_req calls, {totals[1]} allocations that evicted)")
    assert totals[0] > 0

# %% [markdown]
# ## Your turn
#
# **Exercise `cache_req_regions`.** Write the accounting at the heart of `cache_req`:
#
# ```python
# fn(row_slots, old_cached_len, already_cached_len, req_cached_len, page_size, finished)
#     -> {"hit": (s, e), "duplicate": (s, e), "inserted": (s, e), "tail": (s, e),
#         "free": [page starts to return to the free list]}
# ```
#
# Work out `new_cached_len` yourself (what does `insert_prefix` keep?), then the four regions,
# then which pages go back: one entry per page, duplicates always, the tail only when finished.
# The checker names the first wrong region. The cell is pre-filled with a working answer;
# clear it and write your own. Hints: `kvlab.check.hint("cache_req_regions", 1)` (then 2, 3);
# a solution: `kvlab.solutions.show("cache_req_regions")`.

# %%
def my_cache_req_regions(row_slots, old_cached_len, already_cached_len, req_cached_len, page_size, finished):
    new_cached_len = req_cached_len // page_size * page_size
    free = list(row_slots[old_cached_len:already_cached_len:page_size])
    if finished:
        free += list(row_slots[new_cached_len:req_cached_len:page_size])
    return {"hit": (0, old_cached_len), "duplicate": (old_cached_len, already_cached_len),
            "inserted": (already_cached_len, new_cached_len), "tail": (new_cached_len, req_cached_len),
            "free": free}


kvlab.check.cache_req_regions(my_cache_req_regions)

# %%
kvlab.check.hint("cache_req_regions", 1)
# kvlab.solutions.show("cache_req_regions")   # uncomment to read the reference solution

# %% [markdown]
# **Exercise `cache_req_remap`.** Now the row of a request that goes on running
# (`finished=False`). After the insert, the cache holds its own copy of the duplicate
# region's tokens: `cached_slots` (the new handle's `get_matched_indices()`, one slot per
# position of `[0, new_cached_len)`). Write
#
# ```python
# fn(row_slots, cached_slots, old_cached_len, already_cached_len, page_size)
#     -> {"free": [page starts of the duplicate region], "row": [the row afterwards]}
# ```
#
# so that the duplicate pages go back to the free list *and* the row never points at them
# again (scenario 3's bug). The checker draws the row it expected over the one you returned,
# region by region. Hints: `kvlab.check.hint("cache_req_remap", 1)`; a solution:
# `kvlab.solutions.show("cache_req_remap")`.

# %%
def my_cache_req_remap(row_slots, cached_slots, old_cached_len, already_cached_len, page_size):
    free = list(row_slots[old_cached_len:already_cached_len:page_size])
    row = list(row_slots)
    row[old_cached_len:already_cached_len] = cached_slots[old_cached_len:already_cached_len]
    return {"free": free, "row": row}


kvlab.check.cache_req_remap(my_cache_req_remap)

# %% [markdown]
# This is what the source design's row looks like to the checker: the duplicate pages are
# freed and the row is left as it was.

# %%
def free_without_remap(row_slots, cached_slots, old_cached_len, already_cached_len, page_size):
    return {"free": list(row_slots[old_cached_len:already_cached_len:page_size]), "row": list(row_slots)}


try:
    kvlab.check.cache_req_remap(free_without_remap)
except kvlab.check.CheckFailed as e:
    print("CheckFailed:", e)
else:
    raise AssertionError("a row left pointing at freed pages must be rejected")

# %% [markdown]
# ## Lift: your accounting vs `kvlab.CacheManager.cache_req`
#
# On random traces, every `cache_req` call's `CacheRegions` must match what your functions
# compute from the same row and lengths: the four regions, and, for the duplicate region and
# the tail, the pages freed; and for a request that goes on running, the row that
# `cache_req` leaves (`row_after`) must be the one your `my_cache_req_remap` returns.

# %%
rng = random.Random(21)
checked = remapped = 0
for page_size in (1, 2, 4, 16):
    cm = CacheManager(64 // page_size * 4, page_size, kvlab.paging.new_page_table(4, 96, page_size))
    prompts = [[rng.randrange(2) for _ in range(rng.randrange(2, 40))] for _ in range(2)]
    for _ in range(8):
        batch = [Req(rng.choice(prompts)[: rng.randrange(1, 40)] + [7], row) for row in range(rng.randrange(1, 5))]
        prefill(cm, batch)
        for r in batch:
            finished = rng.random() < 0.5
            got = cm.cache_req(r, finished=finished)
            if not finished:
                mine_row = my_cache_req_remap(got.row_before.tolist(), r.cache_handle.get_matched_indices().tolist(),
                                              got.old_cached_len, got.already_cached_len, page_size)
                assert mine_row["row"] == got.row_after.tolist()
                assert sorted(mine_row["free"]) == sorted(got.freed_pages.tolist())
                remapped += got.remapped
                cm.cache_req(r, finished=True)
            mine = my_cache_req_regions(got.row_before.tolist(), got.old_cached_len, got.already_cached_len,
                                        got.req_cached_len, page_size, finished)
            assert all(tuple(mine[k]) == tuple(v) for k, v in got.regions().items())
            own_tail = got.row_before[got.new_cached_len:][::page_size].tolist() if finished else []
            assert sorted(mine["free"]) == sorted(got.duplicate_slots[::page_size].tolist() + own_tail)
            assert set(mine["free"]) <= set(got.freed_pages.tolist())
            checked += 1
        cm.check_integrity()
print(f"my_cache_req_regions agrees with kvlab.CacheManager.cache_req on {checked} calls; "
      f"my_cache_req_remap on the rows of the unfinished ones ({remapped} of them remapped)")
assert remapped > 0

# %% [markdown]
# ## Summary
#
# * `CacheManager` keeps free pages (`free_slots`, page starts), the prefix cache and the page
#   table in step; `allocate_paged` maps `[div_ceil(cached_len, P), div_ceil(device_len, P))` per
#   request with one allocation and one page-table write, evicting cached pages when short.
# * `cache_req` splits `[0, req.cached_len)` into **hit**, **duplicate** (freed: another request
#   cached the same tokens first), **newly inserted** and **tail** (freed when finished); the old
#   handle is unlocked only after the insert, the new one locked when the request goes on.
# * The source design frees the duplicate pages while the row still maps them; kvlab remaps
#   that part of the row to the cached slots (`remap_duplicates=True`, the default), as your
#   `my_cache_req_remap` does.
# * `OutOfPages` is decided before anything is evicted; misuse (unlocking twice, caching a
#   finished request again, bad lengths) raises a clear error and changes nothing.
# * The conservation law, free + cached + running = all pages, each once, is `check_integrity()`.
# * Lifted into `kvlab.CacheManager`, `kvlab.Req`, `kvlab.CacheRegions` (`kvlab/cache_manager.py`);
#   pictures in `kvlab.viz.region_bar(s)` and `page_owner_strip`.
#
# Next: chapter 07 runs a whole serving loop on this manager and lets you scrub through it.
