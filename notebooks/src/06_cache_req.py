# %% [markdown]
# # 06 · `cache_req`: settling a request's pages with the prefix cache
#
# **Time:** about 75 minutes. **Assumes:** chapter 02 (the page table, `allocate_paged`) and
# chapter 05 (the prefix cache: match, insert, handles, locks, evict).
#
# **Goal.** Put chapter 05's [prefix cache](glossary.md#prefix-cache), the [free list](glossary.md#free-list) and the [page table](glossary.md#page-table) together into
# mini-sglang's `CacheManager`, and follow its most delicate method, `cache_req`, through the
# **four [regions](glossary.md#region)** of a request's row. You will see a plain hit, the *duplicate* region that
# appears when two requests with one prompt are [prefilled](glossary.md#prefill) in the same batch, finished and
# unfinished tails, and a real bug of the [source design](glossary.md#source-design) (a page-table row left pointing at
# freed [pages](glossary.md#page)) and its fix. After every step one invariant is checked: every page is in
# exactly one place.

# %%
import random

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab import CacheManager, Req
from kvlab.alloc.paging import new_page_table
from kvlab.course.scenes.ch06_cache_req import scenarios
from kvlab.course.reference import cache_req_regions_ref
from kvlab.course.viz import (
    page_owner_strip,
    page_table_heatmap,
    region_bar,
    region_bars,
)

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
# When a request's prefill has run (and again when it finishes), `cache_req` hands its newly
# computed **whole pages** to the prefix cache, so later requests can share them, and decides
# what the request still owns. Four lengths decide everything; the exercises of this chapter
# use the same names:
#
# * `old` = `old_handle.cached_len`: the prefix the request found in the cache when admitted;
# * `already` = what `insert_prefix` answers: how much of the request's tokens the cache held
#   *before this insert* (mini-sglang calls it `cached_len`);
# * `new` = `new_handle.cached_len`: the request's whole pages, `req.cached_len // P * P`;
# * `req` = `req.cached_len`: every token whose KV the request has computed.
#
# Over `[0, req)` they make four regions:
#
# ```
# 0            old                  already               new                    req
# |    hit     |  duplicate (free it) |  newly inserted     |  tail (free if finished) |
# ```
#
# * **hit** `[0, old)`: in the cache before the prefill; the request's [handle](glossary.md#handle) covers it.
# * **duplicate** `[old, already)`: the request computed these, but *meanwhile another request
#   inserted the same tokens*. The cache keeps its own copy, so the request's pages here must
#   be freed or they leak.
# * **newly inserted** `[already, new)`: the request's pages now belong to the cache.
# * **tail** `[new, req)`: less than a page, not cacheable. A finished request frees it; an
#   unfinished one keeps decoding into it.
#
# Here are the four cache_req calls this chapter walks through, drawn as region bars (numbers:
# the [slot](glossary.md#token-slot) each position mapped before the call; hatched: returned to the free list).

# %% alt="Four scenarios of cache_req drawn as bars over a request's token positions: each bar is cut into the regions hit (cached before), newly inserted, duplicate (freed, hatched) and tail (a partial page), with the slot mapped at each position."
region_bars(scenarios(), title="cache_req: the four regions of [0, req.cached_len)")
plt.show()

# %% [markdown]
# ## Build-up 1: the manager's pieces
#
# `CacheManager(num_pages, page_size, page_table)` owns:
#
# * `free_slots`: the **[page start](glossary.md#page-start)** slot of every free page, `arange(num_pages) * P` at first;
#   `_allocate(n)` takes pages from the front and, when too few are free, [evicts](glossary.md#eviction) from the
#   prefix cache and appends `evicted[::P]` (evict returns token slots, the list wants pages);
# * `prefix_cache`: chapter 05's `RadixPrefixCache`;
# * `page_table`: chapter 02's table; `allocate_paged(reqs)` maps pages
#   `[div_ceil(cached_len, P), div_ceil(device_len, P))` of each request with one allocation and
#   one page-table write (the Triton writer of chapter 02 by default).
#
# kvlab's manager also **tracks running requests**, so it can check the [conservation law](glossary.md#conservation-law):
# free pages + pages in the cache + pages owned by running requests = all pages, each exactly once.
# `page_owners()` says where every page is; `check_integrity()` raises `IntegrityError` naming
# the first page that is lost or owned twice.
#
# A request starts with `admit(req)` (chapter 05): `match_req`, then [lock](glossary.md#lock) the hit's handle
# with **the request as its [owner](glossary.md#owner)**, then write the hit's slots into the request's row. Every
# lock the manager takes belongs to a request, and only that request's calls take it back.

# %%
P = 4
SYSTEM = list(range(100, 108))  # two pages of shared system prompt


def new_manager(num_pages, rows=4, remap_duplicates=True):
    """This chapter's managers: page_size 4, `rows` request rows of 32 positions."""
    return CacheManager(
        num_pages, P, new_page_table(rows, 32, P), remap_duplicates=remap_duplicates
    )


cm = new_manager(num_pages=12)
print("free_slots:", cm.free_slots.tolist(), "(page starts, P =", P, ")")
print("available tokens:", cm.available_size)
cm.check_integrity()

a = Req(SYSTEM + [1, 2], table_idx=0)  # 10 tokens
match = cm.admit(a)  # match_req + lock the hit (owner: a) + map it into the row
print(
    f"admit A: {match.cached_len} tokens hit; cached_len={a.cached_len},"
    f" device_len={a.device_len}"
)
cm.allocate_paged([a])
print("A's row:", cm.page_table[0, :12].tolist())
print("free_slots now:", cm.free_slots.tolist())
cm.check_integrity()
assert cm.page_table[0, :12].tolist() == list(range(12)) and cm.num_free_pages == 9, (
    f"A's row {cm.page_table[0, :12].tolist()}, {cm.num_free_pages} free pages")

# %% [markdown]
# ## Build-up 2: `cache_req` by hand
#
# The prefill ran; in mini-sglang's `Req`, `complete_one()` then sets `cached_len = device_len`
# (everything on the device is now computed) and `device_len += 1` (room for the next token).
# `cache_req(req, finished=False)` does, in order:
#
# 1. `insert_prefix(input_ids[:req], row[:req])` → `(already, new_handle)`;
# 2. unlock the old handle, as its owner, the request (only now: the insert walked the nodes
#    the old handle protects);
# 3. free the duplicate region `row[old:already]`, one entry per page;
# 4. finished: free the tail `row[new:]`; unfinished: lock `new_handle` (owner: the request)
#    and keep it as the request's handle.
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
print(
    f"old={old_len}  already={already}  new={new_handle.cached_len}  req={a.cached_len}"
)
duplicate_pages = row[old_len:already][::P]
tail = row[new_handle.cached_len:]
print(
    "duplicate pages to free:",
    duplicate_pages.tolist(),
    "| tail slots (kept, unfinished):",
    tail.tolist(),
)
assert (old_len, already, new_handle.cached_len) == (
    0,
    0,
    8,
) and duplicate_pages.numel() == 0, (
    f"old {old_len}, already {already}, cached {new_handle.cached_len}, duplicates"
    f" {duplicate_pages.tolist()}"
)

# %% [markdown]
# Nothing was cached before, so A's first two pages become the cache's and the 2-token tail
# stays with A. The real call does the same to the manager's cache, and returns what it did as a
# `kvlab.CacheRegions`, plain data that this chapter prints, draws and checks:
#
# | field | what it holds |
# |---|---|
# | `hit`, `duplicate`, `inserted`, `tail` | the four regions, each a `Region(start, end)` of positions |
# | `old_cached_len`, `already_cached_len`, `new_cached_len`, `req_cached_len` | the four lengths `old`, `already`, `new`, `req` |
# | `table_idx`, `page_size`, `finished` | the request's row, the page size, and whether the request ended |
# | `row_before` | the request's row over `[0, req)` before the call: the slot of each position |
# | `row_after` | the same positions after the call (it differs where a duplicate was remapped) |
# | `duplicate_slots`, `tail_slots` | the slots of the duplicate region, and of the tail |
# | `freed_pages` | the page starts the call gave back to the free list |
# | `remapped` | whether the duplicate part of the row now points at the cache's slots |

# %% alt="The page pool after cache_req of request A: pages 0 and 1 are cached and locked by A, page 2 is A's own tail page, and pages 3 to 11 are free."
regions_a = cm.cache_req(a, finished=False)
print(regions_a)
cm.check_integrity()
assert (regions_a.hit, regions_a.inserted, regions_a.tail) == (
    (0, 0),
    (0, 8),
    (8, 10),
), str(regions_a)
page_owner_strip(
    cm, title="after A: two pages cached (locked by A), A owns its tail page"
)
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
b.complete_one()  # (the prefill computed positions 8-10)
regions_b = cm.cache_req(b, finished=False)
print(f"B: hit {hit} tokens;", regions_b)
print("A's row:", cm.page_table[0, :12].tolist())
print("B's row:", cm.page_table[1, :12].tolist())
cm.check_integrity()
assert regions_b.hit == (0, 8) and regions_b.duplicate == (8, 8), str(regions_b)
assert torch.equal(cm.page_table[0, :8], cm.page_table[1, :8]), (  # the very same slots
    "B should read A's cached slots for its first two pages")

# %% [markdown]
# A and B now both lock the system prompt's node, each with a lock of its own. A lock is
# taken back only by the request that holds it: `cache_req` and `release_req` unlock as the
# request they are settling. An unlock on behalf of a request that holds no lock on the
# handle is refused with `CacheMisuse`, and nothing changes. Without owners a stray unlock
# would just lower a reference count: the pages would look [evictable](glossary.md#evictable) while A and B still
# read them, and the next eviction would hand them to someone else.

# %%
stranger = Req([1, 2, 3], table_idx=2)  # never admitted: it holds no lock
before = cm.prefix_cache.size_info
try:
    cm.unlock(a.cache_handle, owner=stranger)
except kvlab.CacheMisuse as e:
    print("CacheMisuse:", e)
else:
    raise AssertionError("an unlock by a request that holds no lock must be refused")
assert cm.prefix_cache.size_info == before, "a refused unlock changed the cache's sizes"
cm.check_integrity()

# %% [markdown]
# ## Scenario 2: one prompt, twice in one batch → the duplicate region
#
# C and D arrive together with the same 13-token prompt. Both are admitted *before* either is
# cached, so both hit only the 8 system tokens, and both get their own pages for positions
# 8-12. After the prefill, C is cached first and inserts positions 8-11. When D is cached,
# `insert_prefix` answers "12 already cached": D's page for positions 8-11 is a **duplicate**.

# %% [markdown]
# From here on, a prefill is the same four calls for a whole batch. `write_kv` stands in for
# the model: it records, for every slot a step writes, *which tokens* its KV was computed
# from. Then anyone can check whether a row reads the KV of its own tokens.

# %%
def write_kv(cm, req, kv):
    """Pretend to run the model: the slot of position p gets 'the KV of tokens [0, p]'.
    """
    if kv is None:
        return
    row = cm.page_table[req.table_idx, : req.device_len].tolist()
    for pos in range(req.cached_len, req.device_len):
        kv[row[pos]] = tuple(req.input_ids[: pos + 1])


def run_prefill(cm, reqs, kv=None):
    """One prefill batch: admit every request, one allocation, the model step,
    complete_one."""
    for r in reqs:
        cm.admit(r)
    cm.allocate_paged(reqs)
    for r in reqs:
        write_kv(cm, r, kv)
        r.complete_one()


c, d = Req(SYSTEM + [7, 7, 7, 7, 8], 2), Req(SYSTEM + [7, 7, 7, 7, 8], 3)
run_prefill(cm, [c, d])
print("C's row before:", cm.page_table[2, :16].tolist())
print("D's row before:", cm.page_table[3, :16].tolist())
regions_c = cm.cache_req(c, finished=False)
regions_d = cm.cache_req(d, finished=False)
print(regions_c)
print(regions_d, "| freed pages:", regions_d.freed_pages.tolist())
print("D's row after: ", cm.page_table[3, :16].tolist())
cm.check_integrity()
assert regions_d.duplicate == (8, 12) and regions_d.remapped, str(regions_d)
# D now reads C's cached pages
assert torch.equal(cm.page_table[3, :12], cm.page_table[2, :12]), (
    "D should read C's cached pages")
free_pages = set(cm.free_slots.tolist())
# no freed page in D's row
assert not {s - s % P for s in cm.page_table[3, :13].tolist()} & free_pages, (
    "a freed page is still in D's row")

# %% [markdown]
# Look at D's row: positions 8-11 used to map D's own page (slots 24-27); that page went back
# to the free list, and the row now maps C's cached slots instead. That last step is **not**
# in the source design, and the next scenario shows why it matters.
#
# ## Scenario 3: the source design's stale row, and the fix
#
# In mini-sglang's `cache_req`, the duplicate pages are freed while the request's page-table
# row still points at them. If the request is finished, nobody reads that row again. But
# mini-sglang's scheduler calls `cache_req(req, finished=False)` right after a request's
# prefill (it skips a chunked request that is still part-way through its prompt, and [decode](glossary.md#decode)
# steps do not call it; the other call is `finished=True` when the request ends). After that
# call the request keeps decoding, and its attention reads every position through the row:
# also the duplicate positions, from pages that are free, and that the next allocation hands
# to somebody else, who overwrites them.
#
# `CacheManager(..., remap_duplicates=False)` reproduces the source's behaviour. Here is the
# whole story, with a tiny pool of 6 pages: two requests with the same prompt in one prefill
# batch, both cached unfinished, then a newcomer that needs two pages. `wrong_reads` compares
# what each slot of a row holds with the KV of the row's own tokens.

# %%
def wrong_reads(cm, kv, prompt, row):
    """Positions of `row` (over the prompt) whose slot holds KV of other tokens."""
    slots = cm.page_table[row, : len(prompt)].tolist()
    return torch.tensor(
        [kv.get(s) != tuple(prompt[: p + 1]) for p, s in enumerate(slots)]
    )


def stale_row_story(remap_duplicates):
    manager, kv = (
        new_manager(num_pages=6, rows=3, remap_duplicates=remap_duplicates),
        {},
    )
    prompt = SYSTEM + [1, 2]
    first, second = Req(prompt, 0), Req(list(prompt), 1)
    # one batch: neither found the other in the cache
    run_prefill(manager, [first, second], kv)
    print(
        "  rows 0 and 1 after the prefill:",
        manager.page_table[0, :10].tolist(),
        manager.page_table[1, :10].tolist(),
    )
    manager.cache_req(first, finished=False)
    regions = manager.cache_req(second, finished=False)
    print(
        f"  row 1 cached: duplicate {tuple(regions.duplicate)}, freed pages"
        f" {regions.freed_pages.tolist()}; row 1 now"
        f" {manager.page_table[1, :10].tolist()}"
    )
    # needs two pages: exactly the ones row 1 gave back
    newcomer = Req([50 + i for i in range(8)], 2)
    run_prefill(manager, [newcomer], kv)
    print("  the newcomer's row 2:", manager.page_table[2, :8].tolist())
    return manager, kv, prompt


print("source design (remap_duplicates=False):")
cm_src, kv_src, prompt = stale_row_story(remap_duplicates=False)
bad = wrong_reads(cm_src, kv_src, prompt, row=1)
print(
    "positions of row 1 whose slot now holds another request's KV:",
    bad.nonzero().flatten().tolist(),
)
assert bad.any(), "the source design's row should read another request's KV here"
try:
    cm_src.check_integrity()
except kvlab.IntegrityError as e:
    print("check_integrity:", e)
else:
    raise AssertionError("the stale row must be caught")

# %% [markdown]
# `check_integrity` compares each running row's cached part with the slots of its locked
# handle, so it catches the [stale row](glossary.md#stale-row) *before* a newcomer overwrites anything. kvlab's default
# rewrites `row[old.cached_len : cached_len]` to `new_handle.get_matched_indices()` over the
# same range, so the row reads the cached copy, which is locked and safe:

# %% alt="Two page tables after two requests prefilled the same prompt: in the source design 8 positions of row 1 still point at pages that were freed (outlined in red), while kvlab remapped row 1 to the cached pages so that none does."
print("kvlab (remap_duplicates=True):")
cm_fix, kv_fix, prompt = stale_row_story(remap_duplicates=True)
assert not wrong_reads(cm_fix, kv_fix, prompt, row=1).any(), (
    "with the remap no position reads another request's KV")
cm_fix.check_integrity()

fig, axes = plt.subplots(2, 1, figsize=(8, 4.2))
for ax, (name, manager, kv) in zip(
    axes, [("source design", cm_src, kv_src), ("kvlab", cm_fix, kv_fix)]
):
    wrong = torch.zeros(3, 12, dtype=torch.bool)
    wrong[1, : len(prompt)] = wrong_reads(manager, kv, prompt, row=1)
    page_table_heatmap(
        manager.page_table[:3, :12],
        P,
        ax=ax,
        highlight=wrong,
        page_range=(0, 5),
        title=(
            f"{name}: {int(wrong.sum())} positions of row 1 read another request's KV"
        ),
    )
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Scenario 4: finished and unfinished tails
#
# Back to our manager. B decodes two tokens (the second crosses into a new page) and
# finishes. `cache_req(b, finished=True)` inserts B's whole pages, frees the tail page and
# every own page past it, and forgets B; the cache keeps B's pages unlocked (evictable) for
# future requests. A, still running, keeps its tail.

# %% alt="The regions of request B when it finishes after two decode steps: positions 0 to 7 are a hit, 8 to 11 newly inserted, and the partial last page, position 12, is a tail returned to the free list."
for token in (9, 10):
    b.append_token(token)
    # maps a new page only when device_len crosses a page boundary
    cm.allocate_paged([b])
    b.complete_one()
free_before = cm.num_free_pages
regions_fin = cm.cache_req(b, finished=True)
print(regions_fin, "| freed pages:", regions_fin.freed_pages.tolist())
print(
    "free pages:",
    free_before,
    "->",
    cm.num_free_pages,
    "| B still running?",
    b in cm.running,
)
cm.check_integrity()
assert (
    regions_fin.tail == (12, 13) and regions_fin.tail_freed and b not in cm.running
), str(regions_fin)
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
# When free pages run short, `allocate_paged` evicts unlocked cached pages. What if even
# evicting *all* of them would not be enough? mini-sglang's `_allocate` asks the cache to
# `evict((needed - free) * P)` tokens, and its `evict` starts with
# `assert size <= self.evictable_size`. With asserts on (Python's default) that check comes
# before anything is removed: nothing is lost, but the caller gets a bare `AssertionError`
# ("Cannot evict ...") rather than an error it could recognise and act on. Under `python -O`
# asserts are stripped, and the same call removes every evictable leaf and then fails with
# an `IndexError` from popping an empty heap: the cache is emptied, and the pages it gave up
# never reach the free list (the line that would append them is never run), so they are lost.
# (mini-sglang's scheduler normally never gets there: it admits a request only when its
# memory fits, chapter 07.)
#
# kvlab compares the need with `free + evictable` first and raises `OutOfPages`, a named
# error, with every piece of state unchanged, asserts or not.

# %% alt="The page pool after a refused allocation, unchanged: cached and locked pages, each row's own pages, one evictable page and the free pages, each in its own colour, none lost or owned twice."
# B's row is free again; 30 tokens = 8 pages
big = Req(list(range(300, 330)), table_idx=1)
cm.admit(big)
print(
    f"free pages {cm.num_free_pages}, evictable pages"
    f" {cm.prefix_cache.size_info.evictable_size // P}"
)
state = (cm.free_slots.clone(), cm.page_table.clone(), cm.prefix_cache.size_info)
try:
    cm.allocate_paged([big])
except kvlab.OutOfPages as e:
    print("OutOfPages:", e)
else:
    raise AssertionError("8 pages cannot fit")
assert torch.equal(state[0], cm.free_slots) and torch.equal(state[1], cm.page_table), (
    "a refused allocate_paged changed the free slots or the page table")
assert (
    state[2] == cm.prefix_cache.size_info
), "a refused allocate_paged changed the cache's sizes"
cm.release_req(big)  # give up on it: unlock its handle (as big), free its pages (none)
cm.check_integrity()
page_owner_strip(cm, title="after the refused allocation: nothing moved")
plt.show()

# %% [markdown]
# ## Validate against the reference, on random traces
#
# `kvlab.course.reference.cache_req_regions_ref` computes the four regions from the four lengths
# with plain comparisons. We drive a seeded random trace (prefills in batches from a few shared
# prompts, decode steps, finishes, aborts, a small pool so eviction happens) and after every
# `cache_req` compare the regions and the freed pages with the reference; after every step we
# check the conservation law and that every running request reads its own KV.

# %%
def run_trace(seed: int, page_size: int, steps: int = 40, remap: bool = True):
    rng = random.Random(seed)
    cm = CacheManager(4 * 16 // page_size, page_size,
                      kvlab.alloc.paging.new_page_table(4, 64, page_size),
                      remap_duplicates=remap)
    prompts = [
        [rng.randrange(3) for _ in range(rng.randrange(4, 30))] for _ in range(3)
    ]
    kv, calls, evictions = {}, 0, 0

    def cache(req, finished):
        nonlocal calls
        mapped = cm.allocated_pages(req) * page_size  # positions mapped before the call
        row = cm.page_table[req.table_idx, :mapped].tolist()
        regions = cm.cache_req(req, finished=finished)
        ref = cache_req_regions_ref(
            regions.old_cached_len,
            regions.already_cached_len,
            regions.new_cached_len,
            regions.req_cached_len,
            finished,
        )
        assert (regions.hit, regions.duplicate, regions.inserted, regions.tail) == (
            ref.hit,
            ref.duplicate,
            ref.inserted,
            ref.tail,
        ), f"regions {regions}, the reference {ref}"
        freed = [row[p] for s, e in ref.freed for p in range(s, e, page_size)]
        # pages mapped past the tail's page (a decode step's new page) go too
        if finished:
            freed += row[
                kvlab.div_ceil(req.cached_len, page_size) * page_size :: page_size
            ]
        assert sorted(freed) == sorted(regions.freed_pages.tolist()), (
            f"freed {sorted(regions.freed_pages.tolist())}, expected {sorted(freed)}")
        calls += 1

    for _ in range(steps):
        running = cm.running
        op = (
            rng.choice(["prefill", "prefill", "decode", "decode", "finish", "abort"])
            if running
            else "prefill"
        )
        if op == "prefill":
            rows = sorted(set(range(4)) - {r.table_idx for r in running})[
                : rng.randrange(1, 3)
            ]
            batch = [
                Req(
                    rng.choice(prompts)[: rng.randrange(1, 30)] + [rng.randrange(9)],
                    row,
                )
                for row in rows
            ]
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
            assert all(
                kv[row[p]] == tuple(r.input_ids[: p + 1]) for p in range(r.cached_len)
            ), f"row {r.table_idx} reads KV of other tokens"
    for r in cm.running:
        cache(r, True)
    info = cm.prefix_cache.size_info
    assert (
        info.protected_size == 0
        and cm.num_free_pages * page_size + info.evictable_size
        == cm.num_pages * page_size
    ), f"after the trace: {info}, {cm.num_free_pages} free pages of {cm.num_pages}"
    return calls, evictions


for page_size in (1, 4, 16):
    totals = [0, 0]
    for seed in range(kvlab.base.runtime.pick(cpu=3, gpu=10)):
        calls, evictions = run_trace(seed, page_size)
        totals = [totals[0] + calls, totals[1] + evictions]
    print(f"page_size {page_size:2d}: traces agree with the reference "
          f"({totals[0]} cache_req calls, {totals[1]} allocations that evicted)")
    assert totals[0] > 0, "no cache_req call was checked"

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
# The lengths are the diagram's `old`, `already` and `req`; `row_slots` is the request's row
# over `[0, req)` (read-only). Work out `new` yourself (what does `insert_prefix` keep?), then the four
# regions, then which pages go back: one entry per page, duplicates always, the tail only when
# finished. The [checker](glossary.md#checker) names the first wrong region. Hints:
# `kvlab.check.hint("cache_req_regions", 1)` (then 2, 3); a solution:
# `kvlab.solutions.show("cache_req_regions")`.


# %%
def my_cache_req_regions(
    row_slots, old_cached_len, already_cached_len, req_cached_len, page_size, finished
):
    """The four regions of [0, req_cached_len) as (start, end) pairs, and the page
    starts to free."""
    ### BEGIN SOLUTION
    new_cached_len = req_cached_len // page_size * page_size
    free = list(row_slots[old_cached_len:already_cached_len:page_size])
    if finished:
        free += list(row_slots[new_cached_len:req_cached_len:page_size])
    return {
        "hit": (0, old_cached_len),
        "duplicate": (old_cached_len, already_cached_len),
        "inserted": (already_cached_len, new_cached_len),
        "tail": (new_cached_len, req_cached_len),
        "free": free,
    }
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: cache_req_regions
    raise NotImplementedError(
        "find new_cached_len, the four regions, and the pages to free"
    )
    ### END STARTER


kvlab.check.cache_req_regions(my_cache_req_regions);

# %%
kvlab.check.hint("cache_req_regions", 1);
# kvlab.solutions.show("cache_req_regions")   # uncomment to read the reference solution

# %% [markdown]
# **Exercise `cache_req_remap`.** Now the row of a request that goes on running
# (`finished=False`). After the insert, the cache holds its own copy of the duplicate
# region's tokens: `cached_slots` (the new handle's `get_matched_indices()`, one slot per
# position of `[0, new)`). Write
#
# ```python
# fn(row_slots, cached_slots, old_cached_len, already_cached_len, page_size)
#     -> {"free": [page starts of the duplicate region], "row": [the row afterwards]}
# ```
#
# so that the duplicate pages go back to the free list *and* the row never points at them
# again (scenario 3's bug). `row_slots` and `cached_slots` are read-only: return a new row. The checker draws the row it expected over the one you returned,
# region by region. This is what it says about the source design's behaviour, which frees
# the duplicate pages and leaves the row as it was:


# %% alt="The checker's picture of the wrong answer: the expected and the returned page-table row of a request whose prompt was prefilled twice, with the 8 wrong duplicate positions outlined in red."
def free_without_remap(
    row_slots, cached_slots, old_cached_len, already_cached_len, page_size
):
    return {
        "free": list(row_slots[old_cached_len:already_cached_len:page_size]),
        "row": list(row_slots),
    }


try:
    kvlab.check.cache_req_remap(free_without_remap)
except kvlab.check.CheckFailed as e:
    print("CheckFailed:", e)
else:
    raise AssertionError("a row left pointing at freed pages must be rejected")

# %% [markdown]
# Your turn. Hints: `kvlab.check.hint("cache_req_remap", 1)`; a solution:
# `kvlab.solutions.show("cache_req_remap")`.


# %%
def my_cache_req_remap(
    row_slots, cached_slots, old_cached_len, already_cached_len, page_size
):
    """Free the duplicate region's pages; return them and the row the request reads
    afterwards."""
    ### BEGIN SOLUTION
    free = list(row_slots[old_cached_len:already_cached_len:page_size])
    row = list(row_slots)
    row[old_cached_len:already_cached_len] = cached_slots[
        old_cached_len:already_cached_len
    ]
    return {"free": free, "row": row}
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: cache_req_remap
    raise NotImplementedError(
        "free the duplicate pages, and make the row stop pointing at them"
    )
    ### END STARTER


kvlab.check.cache_req_remap(my_cache_req_remap);

# %% [markdown]
# ## Lift: your accounting vs `kvlab.CacheManager.cache_req`
#
# On random traces, every `cache_req` call's `CacheRegions` must match what your functions
# compute from the same row and lengths: the four regions, and, for the duplicate region and
# the tail, the pages freed; and for a request that goes on running, the row that
# `cache_req` leaves (`row_after`) must be the one your `my_cache_req_remap` returns. Until
# an exercise passes its checker, the reference solution stands in for it (the cell says so).

# %%
regions_fn = kvlab.check.choose(
    "cache_req_regions", my_cache_req_regions, kvlab.solutions.get("cache_req_regions")
)
remap_fn = kvlab.check.choose(
    "cache_req_remap", my_cache_req_remap, kvlab.solutions.get("cache_req_remap")
)

rng = random.Random(21)
checked = remapped = 0
for page_size in (1, 2, 4, 16):
    cm = CacheManager(
        64 // page_size * 4,
        page_size,
        kvlab.alloc.paging.new_page_table(4, 96, page_size),
    )
    prompts = [
        [rng.randrange(2) for _ in range(rng.randrange(2, 40))] for _ in range(2)
    ]
    for _ in range(8):
        batch = [
            Req(rng.choice(prompts)[: rng.randrange(1, 40)] + [7], row)
            for row in range(rng.randrange(1, 5))
        ]
        run_prefill(cm, batch)
        for r in batch:
            finished = rng.random() < 0.5
            got = cm.cache_req(r, finished=finished)
            if not finished:
                mine_row = remap_fn(
                    got.row_before.tolist(),
                    r.cache_handle.get_matched_indices().tolist(),
                    got.old_cached_len,
                    got.already_cached_len,
                    page_size,
                )
                # the checker takes the row and the pages as any sequence of ints:
                # compare as lists
                row, free = [int(x) for x in mine_row["row"]], sorted(
                    int(x) for x in mine_row["free"]
                )
                said = f"page_size {page_size}, row {r.table_idx}"
                assert (
                    row == got.row_after.tolist()
                ), f"{said}: your row {row}, cache_req's {got.row_after.tolist()}"
                assert free == sorted(got.freed_pages.tolist()), (
                    f"{said}: you free {free}, cache_req frees"
                    f" {sorted(got.freed_pages.tolist())}"
                )
                remapped += got.remapped
                cm.cache_req(r, finished=True)
            mine = regions_fn(
                got.row_before.tolist(),
                got.old_cached_len,
                got.already_cached_len,
                got.req_cached_len,
                page_size,
                finished,
            )
            said = f"page_size {page_size}, row {r.table_idx}, finished={finished}"
            differ = {
                k: (tuple(int(x) for x in mine[k]), tuple(v))
                for k, v in got.regions().items()
                if tuple(int(x) for x in mine[k]) != tuple(v)
            }
            assert not differ, f"{said}: regions (yours, cache_req's): {differ}"
            own_tail = (
                got.row_before[got.new_cached_len :][::page_size].tolist()
                if finished
                else []
            )
            free = sorted(int(x) for x in mine["free"])
            assert free == sorted(
                got.duplicate_slots[::page_size].tolist() + own_tail
            ), (
                f"{said}: you free {free}, the duplicates and the tail are "
                f"{sorted(got.duplicate_slots[::page_size].tolist() + own_tail)}"
            )
            assert set(free) <= set(
                got.freed_pages.tolist()
            ), f"{said}: you free {free}, cache_req {got.freed_pages.tolist()}"
            checked += 1
        cm.check_integrity()
print(f"the regions agree with kvlab.CacheManager.cache_req on {checked} calls; "
      f"the remapped rows on the unfinished ones ({remapped} of them remapped)")
assert remapped > 0, "no call remapped a row: the lift checked no remap"

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
#   finished request again, bad lengths, an unlock by a request that holds no lock) raises a
#   clear error and changes nothing.
# * The conservation law, free + cached + running = all pages, each once, is `check_integrity()`.
# * Lifted into `kvlab.CacheManager`, `kvlab.Req`, `kvlab.CacheRegions` (`kvlab/manager/cache_manager.py`);
#   pictures in `kvlab.course.viz.region_bar(s)` and `page_owner_strip`.
#
# Next: chapter 07 runs a whole serving loop on this manager and lets you scrub through it.
#
# ## Questions
#
# 1. `CacheManager._allocate` appends `evicted[::P]` to the free list. Drop the `[::P]`
#    stride (append every evicted token slot) and predict what breaks first: the next
#    allocation, the page table, or `check_integrity`? Then try it.
# 2. The duplicate region exists because two requests with the same prompt were admitted in
#    one batch, before either was cached. Could a server avoid computing the duplicate in the
#    first place? Sketch two ways, and say what each costs.

# %% [markdown] tags=["solution"]
# ### Discussion
#
# **1. Without the stride.** `evict` returns `P` token slots per page: `p*P, p*P+1, ...`. The
# free list is supposed to hold one page start per page. Without `[::P]` it gains `P` entries
# per evicted page, `P - 1` of which are not page starts. The first thing that notices is the
# conservation check (slot `p*P + 1` is "not the start of a page"); without the check, the
# next allocations hand out "pages" that start in the middle of another page, so two requests
# write the same slots, and one physical page appears in the free list up to `P` times. The
# cell below evicts one cached page and appends its slots the wrong way, on a copy:

# %% tags=["solution"]
demo = new_manager(num_pages=4, rows=1)
r0 = Req(SYSTEM + [1], 0)
run_prefill(demo, [r0])
demo.cache_req(r0, finished=True)  # its two system pages stay in the cache, unlocked
evicted = demo.prefix_cache.evict(1)  # one leaf: both pages, 8 token slots
demo.free_slots = torch.cat([demo.free_slots, evicted.to(torch.int32)])  # no [::P]
print("evicted slots:", evicted.tolist(), "| free list now:", demo.free_slots.tolist())
try:
    demo.check_integrity()
except kvlab.IntegrityError as e:
    print("IntegrityError:", e)

# %% [markdown] tags=["solution"]
# **2. Avoiding the duplicate.** (a) *Deduplicate within a batch*: when building a prefill
# batch, insert (or at least register) each admitted request's prompt before admitting the
# next one, so a second request with the same prefix matches the first one's pages and
# waits for them to be computed instead of computing its own; this needs a notion of "pages
# being computed" (readable after this step) and makes the second request depend on the
# first one's prefill. (b) *Delay the second request by one step*: admit at most one
# request per distinct prefix per batch; the second request is prefilled a step later and
# then hits the cache. Simple, costs the second request one step of latency. Either way the
# memory for the duplicate is never allocated, which matters when memory is short. Both
# need the scheduler to look at prefixes across the batch, which mini-sglang's scheduler
# does not do: it matches each request on its own and lets `cache_req` free the duplicate.
