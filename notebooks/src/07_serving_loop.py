# %% [markdown]
# # 07 · A serving loop you can scrub through
#
# **Time:** about 60 minutes. **Assumes:** chapters 05 and 06 (`CacheManager`, `cache_req`);
# chapter 00's prefill, decode and scheduler steps.
#
# **Goal.** Put every piece of chapters 01-06 to work at once: a small, deterministic server
# loop that admits requests, matches their prefixes, allocates [pages](glossary.md#page) for [prefill](glossary.md#prefill) and [decode](glossary.md#decode),
# caches finished requests, [evicts](glossary.md#eviction) when memory runs short, and checks after *every* step that
# no page was lost, leaked or handed to two [owners](glossary.md#owner). Then watch it run: memory over time, the
# prefix hit rate, evictions, the same traffic at page sizes 1, 16 and 64, and a slider that
# takes you through the run step by step.
#
# There is no model here. The simulator moves memory exactly as a server would, but the token
# a request "generates" is read from its workload. Chapter 08 puts a real (tiny) model on top.

# %%
import random

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab import CacheManager, Req
from kvlab.course.scenes.ch07_serving_loop import (
    page_size_runs,
    pressured_run,
    step_views_figure,
)
from kvlab.alloc.paging import div_ceil, new_page_table
from kvlab.serving.sim import (
    RequestSpec,
    SimConfig,
    SimIntegrityError,
    Simulator,
    Workload,
    make_workload,
    multi_turn_chat,
    shared_system_prompt,
    simulate,
)
from kvlab.course.viz.dashboard import (
    compare_page_sizes,
    describe_step,
    timeline_dashboard,
)

torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Intuition: one step of a server
#
# As chapter 00 put it, a server runs in **[scheduler steps](glossary.md#scheduler-step)**: each step puts a batch through
# the model. Newly admitted requests compute their prompt (*prefill*), running requests compute
# one more token each (*decode*); either way each request is *[extended](glossary.md#extend)* by the tokens the step
# computes. mini-sglang runs a step as a prefill batch or as a decode batch; this chapter's
# simulator, `kvlab.serving.sim`, does both in one step (decode the running requests, then prefill
# the newly admitted ones), which keeps runs short. Around each forward pass, the memory
# manager does its work:
#
# ```
#             arrivals ──► waiting queue ──admit──► running ──finish──► prefix cache
#                           (FIFO)        │          │  ▲                (pages stay,
#                                         │          │  └─ decode: +1 token per step
#   admit  = match_req + lock the hit     │          │     (a new page at each page
#            + map the hit into its row   │          │      boundary)
#   prefill = allocate_paged(batch)       │          └─ kvlab.serving.sim only: preempted
#            then cache_req(finished=False)             when a decode needs a page and
#                                                       none is left: back to the queue
#                                                       (see "The simulator")
# ```
#
# Here is what that looks like for a mixed workload squeezed into 24 pages of 4 [slots](glossary.md#token-slot). Every
# page is always in exactly one of four places: free (grey), cached and [evictable](glossary.md#evictable) (blue),
# cached and [locked](glossary.md#lock) by a running request (orange), or private to one running request (purple).

# %% alt="Three panels over the steps of a serving run under memory pressure: pages by owner (private, cached and locked, cached and evictable, free), prompt tokens computed or hit in the prefix cache with the cumulative hit rate, and the tokens evicted at each step with preemptions marked."
fig = timeline_dashboard(pressured_run())
plt.show()

# %% [markdown]
# Read it from left to right: the purple and orange bands are requests at work; blue is the
# [prefix cache](glossary.md#prefix-cache) filling up with finished prompts; when the grey runs out, the red bars below
# show the cache giving pages back (eviction), and a ▼ marks a running request pushed back
# into the queue ([preemption](glossary.md#preemption)). Green bars in the middle are prompt tokens that did **not**
# have to be computed because the cache had them.
#
# ## Build-up 1: workloads a server sees
#
# A workload is a list of requests: a prompt, the answer the "model" will give, an arrival
# step. The generators are seeded, so the same call always gives the same traffic.

# %%
w = shared_system_prompt(
    seed=0, n_requests=5, system_len=12, user_len=(3, 6), output_len=(5, 8)
)
for r in w.requests:
    print(
        f"request {r.rid}: arrives at step {r.arrival}, prompt {len(r.prompt):2d}"
        f" tokens {list(r.prompt[:14])}..., answers {len(r.output)} tokens"
    )
# the shared system prompt
assert all(r.prompt[:12] == w.requests[0].prompt[:12] for r in w.requests), (
    "every request should start with the same 12-token system prompt")

chat = multi_turn_chat(seed=0, n_conversations=1, turns=3)
for r in chat.requests:
    print(f"{r.tag}: prompt {len(r.prompt)} tokens, after request {r.after}")
# each turn's prompt is the whole conversation so far: the previous prompt + its answer
# + more
for prev, nxt in zip(chat.requests, chat.requests[1:]):
    assert nxt.prompt[:prev.total_len] == prev.prompt + prev.output, (
        f"{nxt.tag}: its prompt does not start with {prev.tag}'s prompt and answer")

# %% [markdown]
# ## Build-up 2: one request through the CacheManager, by hand
#
# The lengths of chapter 06 drive everything: `cached_len` = tokens whose KV is computed,
# `device_len` = tokens that will be on the device after the coming step.
#
# 1. **admit**: `match_req` (the prompt minus its last token), lock the hit, map it into the row;
# 2. **prefill**: `allocate_paged([req])` maps pages `[div_ceil(cached_len, P), div_ceil(device_len, P))`;
#    the forward pass computes the prompt; the sampled token is appended and `complete_one()`
#    moves `cached_len` up to `device_len` and `device_len` one further;
# 3. **cache the prompt**: `cache_req(req, finished=False)` puts its whole pages in the prefix
#    cache (so a request arriving *while this one still runs* can already share them);
# 4. **decode**: each step `allocate_paged` again — a new page only when `cached_len` sits on a
#    page boundary — then append + `complete_one()`;
# 5. **finish**: `cache_req(req, finished=True)` caches what was computed and frees the tail.

# %%
P = 4
table = new_page_table(max_running_req=2, max_seq_len=32, page_size=P)
manager = CacheManager(
    num_pages=8, page_size=P, page_table=table, page_table_writer="host"
)
spec = w.requests[0]
req = Req(list(spec.prompt), table_idx=0)

manager.admit(req)
print(
    f"admitted: cached_len={req.cached_len} (cache is empty),"
    f" device_len={req.device_len}"
)
manager.allocate_paged([req])
req.append_token(spec.output[0])
req.complete_one()
regions = manager.cache_req(req, finished=False)
print(
    f"after prefill: cached_len={req.cached_len}, device_len={req.device_len},"
    f" {regions}"
)
manager.check_integrity()

for token in spec.output[1:]:
    pages_before = manager.num_free_pages
    manager.allocate_paged([req])  # a new page only when cached_len % P == 0
    print(
        f"decode position {req.device_len - 1} (cached_len={req.cached_len:2d}):"
        f" {pages_before - manager.num_free_pages} new page(s), row"
        f" {table[0, :req.device_len].tolist()}"
    )
    req.append_token(token)
    req.complete_one()
    manager.check_integrity()
regions = manager.cache_req(req, finished=True)
print("finished:", regions)
manager.check_integrity()
assert manager.running == [] and (table[0] == -1).all(), (
    f"still running: {manager.running}, or row 0 still mapped")

# %% [markdown]
# ## Build-up 3: the next request finds the system prompt
#
# The second request shares the 12-token system prompt. `admit` finds it in the cache: whole
# pages only (12 is 3 pages of 4), and those pages are now mapped into row 1 *and* kept in the
# tree. The request computes only the rest of its prompt.

# %%
spec2 = w.requests[1]
req2 = Req(list(spec2.prompt), table_idx=1)
manager.admit(req2)
print(
    f"request 1: prompt {len(spec2.prompt)} tokens, hit {req2.cached_len} -> computes "
    f"{req2.device_len - req2.cached_len}"
)
print("its row starts with the cached slots:", table[1, :req2.cached_len].tolist())
assert (
    req2.cached_len == 12
), f"request 1 hit {req2.cached_len} tokens, expected the 12 of the system prompt"
# the very slots request 0 wrote
assert table[1, :12].tolist() == regions.row_before[:12].tolist(), (
    "request 1 should map the very slots request 0 wrote")
manager.release_req(req2)  # (abort it: we only wanted to see the hit)
manager.check_integrity()

# %% [markdown]
# ## Your turn: one decode step
#
# Build-up 2 decoded one request by hand. A server does it for a whole batch at once, and
# some of the batch finish in that step. Write `my_decode_step(manager, reqs, next_tokens,
# done)`: for running requests `reqs` (each with `cached_len == device_len - 1`: the step
# computes the KV of its last token), map new pages where needed, record each request's token
# (`next_tokens[i]`) and advance it, and hand the requests marked `done[i]` back to the cache
# as finished (`next_tokens` and `done` are read-only). The order of the calls matters. `kvlab.check.decode_step` runs it against the
# reference on named scenarios (page size 1, page boundaries, requests finishing, exactly
# enough memory) and random ones, and compares the [page table](glossary.md#page-table), the [free list](glossary.md#free-list), every request's
# lengths, and the integrity check. Your function then drives the serving loop below.
# Hints: `kvlab.check.hint("decode_step", 1)` (up to 3); the reference:
# `kvlab.solutions.show("decode_step")`.

# %%
def my_decode_step(manager, reqs, next_tokens, done):
    """One decode step for a batch of running requests; the done ones finish."""
    ### BEGIN SOLUTION
    # pages first: decided from the lengths before the step
    manager.allocate_paged(reqs)
    for req, token in zip(reqs, next_tokens):
        req.append_token(token)
        req.complete_one()
    for req, finished in zip(reqs, done):
        if finished:
            manager.cache_req(req, finished=True)
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: decode_step
    raise NotImplementedError("pages, then tokens, then finishing")
    ### END STARTER


kvlab.check.decode_step(my_decode_step);

# %%
kvlab.check.hint("decode_step", 1);
# kvlab.solutions.show("decode_step")   # uncomment to read the reference solution

# %% [markdown]
# ## The loop, by hand
#
# Now the whole loop, written out. Each step: arrivals join the queue; every running request
# decodes one token, with **your** `my_decode_step` once it has passed its [checker](glossary.md#checker) (until
# then the reference stands in, and the cell says which one runs); then waiting requests are
# admitted while a page-table row is free, and prefilled in **one** `allocate_paged` call.
# (This version has memory to spare; the kvlab version below adds the [token budget](glossary.md#token-budget), aborts,
# eviction-aware admission and preemption.)

# %%
decode_step = kvlab.check.choose(
    "decode_step", my_decode_step, kvlab.solutions.get("decode_step")
)


def run_by_hand(workload, page_size, num_pages, max_running):
    """The serving loop with plenty of memory; returns (page table, free list) after
    each step."""
    table = new_page_table(max_running, workload.max_total_len, page_size)
    manager = CacheManager(num_pages, page_size, table, page_table_writer="host")
    # running: rid -> [spec, req, generated]
    pending, waiting, running = list(workload.requests), [], {}
    free_rows, finished_at, snapshots, step = list(range(max_running)), {}, [], 0
    while pending or waiting or running:
        # 1. arrivals (a chat turn arrives some steps after the previous turn finished)
        for spec in list(pending):
            ready = (
                spec.arrival <= step
                if spec.after is None
                else spec.after in finished_at
                and finished_at[spec.after] + spec.arrival <= step
            )
            if ready:
                pending.remove(spec)
                waiting.append([spec, None, 0])
        # 2. decode every running request
        live = list(running.values())
        if live:
            done = [g + 1 == len(s.output) for s, _, g in live]
            decode_step(
                manager,
                [r for _, r, _ in live],
                [s.output[g] for s, _, g in live],
                done,
            )
            for entry, finished in zip(live, done):
                entry[2] += 1
                if finished:
                    spec, req, _ = entry
                    del running[spec.rid]
                    free_rows.append(req.table_idx)
                    free_rows.sort()
                    finished_at[spec.rid] = step
        # 3. admit and prefill (one allocate_paged for the batch)
        batch = []
        while waiting and free_rows:
            entry = waiting.pop(0)
            entry[1] = Req(list(entry[0].prompt), table_idx=free_rows.pop(0))
            manager.admit(entry[1])
            batch.append(entry)
        if batch:
            manager.allocate_paged([r for _, r, _ in batch])
            for entry in batch:
                spec, req, _ = entry
                req.append_token(spec.output[0])
                req.complete_one()
                entry[2] = 1
                if len(spec.output) == 1:
                    manager.cache_req(req, finished=True)
                    free_rows.append(req.table_idx)
                    free_rows.sort()
                    finished_at[spec.rid] = step
                else:
                    manager.cache_req(req, finished=False)
                    running[spec.rid] = entry
        manager.check_integrity()
        snapshots.append((table[:max_running].clone(), manager.free_slots.clone()))
        step += 1
    return snapshots


steps = run_by_hand(w, page_size=4, num_pages=64, max_running=4)
print(f"{len(steps)} steps; free pages at the end: {len(steps[-1][1])} of 64 "
      f"(the rest hold the prefix cache)")

# %% [markdown]
# ## The simulator: `kvlab.serving.sim`
#
# `kvlab.serving.sim.Simulator` is that loop, [lifted](glossary.md#lift) into the package and made to survive memory
# pressure. Its rules (see `kvlab/serving/sim/scheduler.py`):
#
# * **a waiting request waits** until a row is free, the step's prefill **token budget** allows
#   it (the first request of a step always goes: there is no [chunked prefill](glossary.md#chunked-prefill)), and its pages fit
#   in *free + evictable* pages — counted *after* `admit` locked its own hit;
# * **a running request that needs a page and finds none** (even after eviction) preempts the
#   *youngest* running request: its pages go back, its prompt and everything it generated go to
#   the front of the queue; its prompt pages stay in the prefix cache, so its re-prefill is
#   mostly a hit — unless they were evicted meanwhile;
# * **a client that gives up** (`abort_after`) is released: nothing of it is cached;
# * **after every step** it runs `check_integrity()` and checks that no running row maps a free
#   page; a broken invariant stops the run with an error naming the step and the request.
#
# **How a real server avoids preemption, and why this simulator does not.** mini-sglang never
# preempts a running request. Its prefill scheduler admits a request only when the tokens it
# will need in all, the part of its prompt still to compute plus its whole output length
# (`max_tokens`), fits in `available_size` (free plus evictable tokens) together with what
# every running request may still generate and what this step has already admitted. Memory
# for the whole answer is set aside at admission, so no decode step can run short. The price:
# a reservation sits idle until the answer grows into it, and is never used at all when the
# answer stops early (an end-of-sequence token), so fewer requests run at once. (SGLang, for
# comparison, can also *retract* running requests when a decode step runs short.)
# `kvlab.serving.sim` admits on the prompt's pages alone and preempts when a decode runs short. That
# packs memory tighter, and it is the interesting case for this course: eviction under
# pressure, preemption and re-prefill from the cache all happen in small runs, where the
# integrity checks watch every step.
#
# Let us step through the pressured run for a few steps, then run it to the end.

# %%
sim = Simulator(
    make_workload("mixed", seed=0), SimConfig(page_size=4, num_pages=24, max_running=4)
)
for _ in range(6):
    print(describe_step(sim.step()))
timeline = sim.run()
summary = timeline.summary()
print(summary)
print(f"hit rate {summary.hit_rate:.0%}")

# %% [markdown]
# ## Validate: the invariants, checked again from the recorded timeline
#
# The simulator already checked every step while running. Here we check the *recording*
# independently: at every step the four kinds of page add up to all pages, no page is both
# free and cached, no running row maps a free page, a free row maps nothing; at the end
# nothing is running, every page is free or evictable, and every request ended exactly once.
#
# A run's [timeline](glossary.md#timeline), a `Timeline`, holds one `StepRecord` per step (`tl.steps`, or `tl[k]`), and the run's
# `num_pages` and `page_size`. The fields of a step `s` that `check_timeline` reads:
#
# | field | what it holds |
# |---|---|
# | `s.step` | the step's number |
# | `s.memory` | a `MemorySplit` of the pages at the end of the step: `free`, `cached_evictable`, `cached_locked`, `private`; `.total` adds them up, `.in_use` is locked + private |
# | `s.free_pages` | the free list: page ids, in the order the allocator hands them out |
# | `s.page_table` | the page table at the end of the step, one row per request slot (a CPU copy) |
# | `s.row_rids` | the request id that owns each row, `-1` for a free row |
# | `s.tree` | the prefix cache's `snapshot()`: `s.tree.nodes` has one `NodeInfo` per node, whose `page_ids` are the physical pages the node holds (beside its `pages` of tokens, `ref_count` and `last_access`) |
# | `s.finished`, `s.aborted` | the request ids that ended at this step |

# %%
def check_timeline(tl, workload):
    for s in tl.steps:
        assert s.memory.total == tl.num_pages, f"step {s.step}"
        free = set(s.free_pages)
        cached = [p for node in s.tree.nodes for p in node.page_ids]
        assert len(cached) == len(set(cached)) and not free & set(
            cached
        ), f"step {s.step}"
        for row, rid in enumerate(s.row_rids):
            mapped = s.page_table[row][s.page_table[row] >= 0]
            if rid < 0:
                assert mapped.numel() == 0, f"step {s.step}: free row {row} maps slots"
            else:
                assert not free & set(
                    (mapped // tl.page_size).tolist()
                ), f"step {s.step}: req {rid}"
    last = tl[-1]
    assert (
        last.memory.in_use == 0
        and last.memory.free + last.memory.cached_evictable == tl.num_pages
    ), f"at the end: {last.memory} of {tl.num_pages} pages"
    ended = sorted(r for s in tl.steps for r in s.finished + s.aborted)
    assert ended == list(range(len(workload))), f"requests that ended: {ended}"


check_timeline(timeline, make_workload("mixed", seed=0))
for seed in range(3):
    for name in [
        "shared_system_prompt",
        "multi_turn_chat",
        "few_shot",
        "random_prompts",
        "mixed",
    ]:
        for P in (1, 16, 64):
            wl = make_workload(name, seed=seed)
            # barely room for two requests
            tight = div_ceil(wl.max_total_len, P) + 2
            check_timeline(simulate(wl, page_size=P, num_pages=tight), wl)
print(
    "invariants hold on 45 runs (5 workloads x 3 page sizes x 3 seeds), all under"
    " memory pressure"
)

# %% [markdown]
# What does it look like when an invariant breaks? The [source design](glossary.md#source-design)'s hazard from chapter 06:
# two requests with the *same* prompt are prefilled in one batch; the second one's pages
# duplicate the first one's, `cache_req(finished=False)` frees them — and, without kvlab's fix
# (`remap_duplicates=False`), leaves the request's row pointing at the freed pages. The very
# next check stops the run and says where:

# %%
prompt = tuple(range(100, 120))
twins = Workload(
    "twins",
    "the same prompt twice, at once",
    (RequestSpec(0, prompt, (1, 2, 3), 0), RequestSpec(1, prompt, (4, 5, 6), 0)),
)
# kvlab remaps the row: fine
check_timeline(simulate(twins, page_size=4, num_pages=20), twins)
try:
    simulate(twins, page_size=4, num_pages=20, remap_duplicates=False)
    raise AssertionError("the stale row should have been caught")
except SimIntegrityError as err:
    print(err)
    assert err.step == 0 and err.rid == 1, (
        f"caught at step {err.step}, request {err.rid}: expected step 0, request 1")

# %% [markdown]
# ## Pictures: page sizes 1, 16 and 64
#
# The same shared-system-prompt traffic, with the same memory in *slots* (512), at three page
# sizes. Small pages match more of a shared prefix (the cache only keeps whole pages: with a
# 40-token system prompt, P=16 keeps 32 of it and P=64 none) and leave no slot empty; big
# pages waste the unused end of every request's last page and hit less. (Real servers still
# like big pages: fewer page-table entries and larger contiguous reads — chapter 09.)

# %% alt="The same workload with pages of 1, 16 and 64 slots: memory by owner over the steps for each page size, then bars of the prompt tokens hit (73%, 58% and 0%) against the slots reserved but empty, which grow with the page size."
runs = page_size_runs()
compare_page_sizes(runs)
plt.show()
for P, tl in runs.items():
    s = tl.summary()
    print(
        f"P={P:2d}: hit rate {s.hit_rate:4.0%}, prompt tokens computed"
        f" {s.prefill_tokens}, mean empty slots in part-filled pages"
        f" {s.mean_wasted_slots:.1f}"
    )
assert (
    runs[1].summary().hit_rate
    > runs[16].summary().hit_rate
    > runs[64].summary().hit_rate
), (
    f"hit rates {[runs[p].summary().hit_rate for p in (1, 16, 64)]} for pages of 1,"
    " 16, 64"
)
assert (
    runs[1].summary().mean_wasted_slots == 0 < runs[16].summary().mean_wasted_slots
), (
    f"empty slots {[runs[p].summary().mean_wasted_slots for p in (1, 16)]} for pages of"
    " 1, 16"
)

# %% [markdown]
# ## Scrub through the run
#
# Move the slider (or press ▶) and pick a view: the **page table** (rows = requests, colour =
# physical page), the **free list** (every page by owner; free ones numbered in the order the
# allocator will hand them out), the **cache tree** (orange = locked by a running request,
# blue = evictable, green border = new this step, faded = just evicted), and the **[regions](glossary.md#region)** of
# the latest `cache_req`. Without a widget front end (a notebook viewer, CI) you see a picture
# of the current view instead.

# %% alt="The timeline explorer's page-table view at step 12: two running requests' rows mapped to scattered pages, two free rows, and a line counting the pages free, cached and private."
explorer = kvlab.course.widgets.explore(timeline, "page table", step=12)

# %% [markdown]
# The same four views of one busy step, side by side:

# %% alt="Four views of the serving loop at one step: the page table coloured by page, every page of the pool by owner, the prefix cache's radix tree with its locked nodes, and the regions of one cache_req call."
step_views_figure()
plt.show()

# %% [markdown]
# ## Lift: the loop by hand vs `kvlab.serving.sim`
#
# With memory to spare (no eviction, no preemption, no budget limit), the simulator must make
# exactly the same decisions as `run_by_hand`: the same page table and the same free list,
# in the same order, after every step — on every workload without aborts, for random seeds.
#
# The simulator drives the manager through the same calls as your `my_decode_step`, split in
# two around the forward pass, as a server must: `CacheManager.decode_step(reqs)` maps the
# step's pages and returns a `ForwardBatch` (the positions the model computes, and the KV
# slots `out_loc` it writes them to); `CacheManager.complete_step(batch, next_tokens, done)`
# then appends the produced tokens, calls `complete_one` and caches the finished requests.
# Your decode step is those two calls with nothing in between.

# %%
rng = random.Random(7)
for trial in range(6):
    name = rng.choice(
        ["shared_system_prompt", "multi_turn_chat", "few_shot", "random_prompts"]
    )
    wl = make_workload(name, seed=rng.randrange(1000))
    P = rng.choice([1, 4, 16])
    pages = 8 * div_ceil(wl.max_total_len, P) * 4
    by_hand = run_by_hand(wl, P, pages, max_running=4)
    lifted = simulate(
        wl, page_size=P, num_pages=pages, max_running=4, prefill_budget=10**6
    )
    assert len(by_hand) == len(lifted), (name, len(by_hand), len(lifted))
    for (table_h, free_h), rec in zip(by_hand, lifted.steps):
        assert torch.equal(table_h.cpu(), rec.page_table), (name, rec.step)
        assert (free_h // P).tolist() == list(rec.free_pages), (name, rec.step)
    print(f"{name:22s} P={P:2d}: {len(lifted)} steps identical")

# %% [markdown]
# ## Summary
#
# * A server step = decode for the running requests + prefill for newly admitted ones; the
#   memory manager's calls come in a fixed order: `admit` (match + lock + map),
#   `allocate_paged` (one per batch), `append_token` + `complete_one`, `cache_req`. kvlab's
#   `CacheManager.decode_step` / `prefill` and `complete_step` package them around the
#   forward pass.
# * Under memory pressure a waiting request waits; a running one that needs a page evicts
#   unlocked cache pages first, then preempts the youngest request (whose prompt stays cached).
# * Every page is always in exactly one place: free, cached (evictable or locked), or private
#   to one running request. Checking that after every step catches bugs at the step they
#   happen, naming the request — the stale-row hazard of chapter 06 among them.
# * Page size trades hit granularity and empty slots (small pages win both here) against the
#   cost of managing more pages.
# * A real server like mini-sglang reserves each request's whole output at admission and
#   never preempts; `kvlab.serving.sim` admits on the prompt alone and preempts, to pack memory
#   tighter and to show the hard cases.
#
# Next, chapter 08 puts a tiny transformer on top and proves the whole manager correct: the
# tokens it generates through the page table equal those of a plain contiguous [KV cache](glossary.md#kv-cache).
#
# ## Questions
#
# 1. Pick a page size for this workload: the shared-system-prompt traffic of the pictures
#    above, with 512 slots of KV memory. What do you gain and lose between `P = 1`, `4`,
#    `16`, `32` and `64`? Which would you choose, and what would change your mind?
# 2. Give `kvlab.serving.sim` mini-sglang's admission rule (reserve each request's output at
#    admission). Which of this chapter's pictures change, and how? When is reserving the
#    better policy?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# **1. A page size.** Run the same traffic at more page sizes and look at both sides:
# what small pages buy (prefix hits, no empty slots) and what big pages buy (fewer entries
# to manage: page-table entries per request, free-list operations, and, on a GPU, longer
# contiguous reads in attention).

# %% tags=["solution"]
sizes = page_size_runs(page_sizes=(1, 4, 16, 32, 64))
for P_, tl in sizes.items():
    s_ = tl.summary()
    entries = max(
        div_ceil(r.prompt_len + r.output_len, P_) for r in tl.requests.values()
    )
    print(
        f"P={P_:2d}: hit rate {s_.hit_rate:4.0%}, prompt tokens computed"
        f" {s_.prefill_tokens:4d}, mean empty slots {s_.mean_wasted_slots:5.1f}, pages"
        f" of the longest request {entries:3d}"
    )

# %% [markdown] tags=["solution"]
# The 40-token system prompt decides most of it: any `P` that divides 40 caches all of it
# (`P = 1, 4`, and `8` would too); `P = 16` keeps 32 tokens, `P = 32` 32, `P = 64` none. So
# `P = 4` (or 8) gets almost the hit rate of `P = 1` with a quarter (an eighth) of the pages
# to manage, and far fewer empty slots than `P = 16`. What would change the choice: a GPU attention kernel
# that wants at least 16 tokens per page to read memory efficiently, much longer requests
# (the page-table cost grows), or a system prompt whose length is not under our control
# (then the expected loss is about `P / 2` tokens per shared prefix).
#
# **2. Reserving at admission.** With reservation, a request is admitted only when its whole
# output fits, so fewer requests run at once: the purple band gets thinner, the grey (free)
# band wider, the ▼ preemption marks disappear, and requests wait longer in the queue before
# their first token. Evictions still happen (the reservation counts evictable pages as
# available). Reserving is the better policy when outputs are short and predictable, when a
# preempted request is expensive to resume (a long prompt evicted from the cache must be
# prefilled again), or when latency guarantees matter more than throughput. Admitting on the
# prompt alone wins when outputs often end early, because the reserved tail is then memory
# that nobody uses.
