# %% [markdown]
# # 00 · A tour: why an LLM server keeps its KV cache in pages
#
# **Time:** about 30 minutes. **Assumes:** Python and PyTorch basics (tensors, matrix
# products); nothing about serving, Triton or GPUs.
#
# **Goal.** By the end of this chapter you know *why* a server keeps a [KV cache](glossary.md#kv-cache) at all, the
# words the rest of the course uses for what a server does with it (**[prefill](glossary.md#prefill)**, **[decode](glossary.md#decode)**,
# **[extend](glossary.md#extend)**, a **[scheduler step](glossary.md#scheduler-step)**), *why* it cuts the cache into fixed-size [pages](glossary.md#page), what a
# **[page table](glossary.md#page-table)** is, and which runtime your notebook is on.
#
# Every token a model has seen leaves behind a key and a value vector in every layer: the
# **KV cache**. A server keeps those vectors in one big preallocated pool on the GPU and hands
# pieces of it to requests as they arrive, grow and finish. How it hands out those pieces
# decides how many requests fit at once, and that decides throughput.
#
# **Two real engines, one [source design](glossary.md#source-design).** The course rebuilds the memory manager of two
# serving engines: mini-sglang's `CacheManager` (whole pages, driven from the host) and
# SGLang's `PagedTokenToKVPoolAllocator` ([token slots](glossary.md#token-slot) for a whole batch in one Triton launch).
# It rebuilds them as the study notes it is made from describe them, and calls that snapshot
# **the source design**. The engines have moved on since: chapters say what SGLang does today
# where it differs, and mark as **[Departure](glossary.md#departure)** every place where kvlab deliberately does
# something else, with the reason. Words like these are collected, one or two sentences each,
# in the [glossary](glossary.md).

# %%
import random
import time

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab.course.scenes.ch00_tour import (
    THREE_REQUESTS,
    describe_step,
    first_page_table,
    fragmentation_figure,
    scheduler_timeline,
    sharing_table,
    timeline_figure,
)
from kvlab.course.viz import page_table_heatmap

torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Which runtime am I on?
#
# kvlab's kernels are written in [Triton](https://triton-lang.org). A Triton kernel is launched
# as a *grid* of **[program instances](glossary.md#program)** ("programs" for short): copies of the same function that
# differ only in their index, `tl.program_id(0)`, and each work on their own piece of the data
# (one request, or one block of a long array). With a CUDA GPU the kernels are compiled and the
# programs run in parallel. Without one, importing kvlab switches Triton to its **[interpreter](glossary.md#interpreter)**
# (`TRITON_INTERPRET=1`, set before any kernel is defined): each program then runs as NumPy code
# on the CPU, one after another.
#
# For the integer kernels of this course (every allocation and page-table kernel) the
# interpreter's answers are exactly the GPU's. Chapter 08's attention kernel works in floating
# point: there the interpreter agrees with the GPU only up to rounding (the checks allow about
# `1e-5`), because NumPy adds the same numbers in another order. Only speed differs otherwise,
# so the chapters choose small sizes in the interpreter with `kvlab.base.runtime.pick(cpu=..., gpu=...)`.

# %%
info = kvlab.runtime_report()
print()
print("tensors live on:", kvlab.DEVICE)
print(
    "a size chosen for this runtime:",
    kvlab.base.runtime.pick(cpu="small (interpreter)", gpu="large (GPU)"),
)

# %% [markdown]
# ## Why a KV cache at all?
#
# A model generates text one token at a time. To produce token `t` it runs attention: the new
# token's **query** is compared with the **keys** of all `t` tokens so far, and the result
# mixes their **values**. Keys and values are projections of each token's hidden state,
# `k = x @ W_k`, `v = x @ W_v`, and a token's key and value never change once computed.
#
# So there are two ways to generate `n` tokens:
#
# - **without a cache**, every step recomputes the keys and values of every earlier token:
#   step `t` projects `t` rows, `1 + 2 + ... + n = n(n+1)/2` rows in all;
# - **with a cache**, every step projects only the new token and appends its key and value to
#   a buffer: `n` rows in all. The buffer is the KV cache.
#
# One attention layer with random weights is enough to see it (the inputs `x` stand in for the
# hidden states a real model would compute; only the amount of work matters here). Both ways
# must give the same outputs:

# %%
d, n_tokens = 64, 256
g = torch.Generator().manual_seed(0)
W_q, W_k, W_v = (torch.randn(d, d, generator=g) / d**0.5 for _ in range(3))
x = torch.randn(n_tokens, d, generator=g)


def attend(q, K, V):
    """One query against the keys K and values V of every token so far."""
    return torch.softmax(K @ q / d**0.5, dim=0) @ V


def generate_without_cache(x):
    outs, rows_projected = [], 0
    for t in range(1, len(x) + 1):
        K, V = x[:t] @ W_k, x[:t] @ W_v  # every earlier token's key and value, again
        rows_projected += t
        outs.append(attend(x[t - 1] @ W_q, K, V))
    return torch.stack(outs), rows_projected


def generate_with_cache(x):
    # preallocated: a tiny pool
    K_cache, V_cache = torch.empty(len(x), d), torch.empty(len(x), d)
    outs, rows_projected = [], 0
    for t in range(1, len(x) + 1):
        # only the new token
        K_cache[t - 1], V_cache[t - 1] = x[t - 1] @ W_k, x[t - 1] @ W_v
        rows_projected += 1
        outs.append(attend(x[t - 1] @ W_q, K_cache[:t], V_cache[:t]))
    return torch.stack(outs), rows_projected


def best_time(fn, repeats=3):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(x)
        times.append(time.perf_counter() - start)
    return min(times), result


t_without, (out_without, rows_without) = best_time(generate_without_cache)
t_with, (out_with, rows_with) = best_time(generate_with_cache)
torch.testing.assert_close(out_with, out_without, atol=1e-5, rtol=1e-5)
assert rows_without == n_tokens * (n_tokens + 1) // 2 and rows_with == n_tokens, (
    f"rows projected: {rows_without} without the cache, {rows_with} with it, for"
    f" {n_tokens} tokens"
)
print(f"{n_tokens} tokens, d = {d}: same outputs either way")
print(
    f"  key/value rows projected: without cache {rows_without:6d}, with cache"
    f" {rows_with:4d} ({rows_without / rows_with:.0f}x fewer)"
)
print(
    f"  time on this machine:     without cache {1e3 * t_without:6.1f} ms, with cache "
    f"{1e3 * t_with:.1f} ms ({t_without / t_with:.1f}x faster)"
)

# %% [markdown]
# The work without a cache grows with the square of the length; with a cache it grows linearly
# (the attention itself, one query against `t` keys, is the same in both). The timing depends on
# your machine; the count of projected rows does not. Per step:

# %% alt="A line chart of the key/value rows a model projects at each generation step: without a cache the count grows with the step (t rows at step t), with a cache it stays at one row per step."
steps = torch.arange(1, n_tokens + 1)
fig, ax = plt.subplots(figsize=(7, 2.6))
ax.plot(steps, steps, label="without a cache: t rows at step t")
ax.plot(steps, torch.ones_like(steps), label="with a cache: 1 row per step")
ax.set_xlabel("generation step t")
ax.set_ylabel("key/value rows projected")
ax.legend(fontsize=8)
ax.set_title("what a KV cache saves, step by step", fontsize=9)
plt.show()

# %% [markdown]
# The price is memory: the cache keeps two vectors per token, in every layer. For a model shaped
# like Llama-3-8B (32 layers, 8 key/value heads of 128 numbers each, stored in bf16, 2 bytes a
# number):

# %%
layers, kv_heads, head_dim, bytes_per_number = 32, 8, 128, 2
# 2: a key and a value
bytes_per_token = 2 * layers * kv_heads * head_dim * bytes_per_number
print(f"{bytes_per_token / 1024:.0f} KiB of KV cache per token")
print(f"a 4096-token conversation: {4096 * bytes_per_token / 2**20:.0f} MiB")
print(
    f"a 40 GiB pool holds {40 * 2**30 // bytes_per_token:,} tokens, shared by every"
    " request"
)
assert (
    bytes_per_token == 128 * 1024
), f"{bytes_per_token} bytes per token, expected 128 KiB"

# %% [markdown]
# A few hundred thousand token slots, shared by every running request: that is the budget the
# rest of this course manages.
#
# ## Prefill, decode, extend, and a scheduler step
#
# A serving engine runs a loop. Each turn of the loop is a **scheduler step**: the scheduler picks
# a batch of requests, the allocator finds KV slots for the tokens this step adds, the model runs
# one forward pass over the batch, and each request that produced a token gets it appended.
# A request that is done hands its KV back: its whole pages go to the [prefix cache](glossary.md#prefix-cache) (chapter 05),
# where a later request with the same beginning can use them, and only what the cache does not
# keep is freed: the partly filled last page, and pages another request cached first
# (mini-sglang's `cache_req(finished=True)` in `python/minisgl/scheduler/cache.py`; chapter 06).
# Two kinds of batches:
#
# - **prefill**: a new request's prompt goes through the model in one pass, all its tokens at
#   once. That writes the prompt's keys and values into the cache and produces the first output
#   token. If part of the prompt is already cached (another request had the same beginning:
#   chapter 05), only the rest is computed. A prompt too long for one step's [token budget](glossary.md#token-budget) is
#   cut into pieces over several steps (*[chunked prefill](glossary.md#chunked-prefill)*); a piece that stops mid-prompt
#   samples no token.
# - **decode**: each running request feeds its newest token, the cache grows by exactly one
#   token per request, and each request gets its next token.
#
# **Extend** is the word SGLang's allocator uses for both: a step *extends* request `i` from
# `prefix_lens[i]` tokens in the cache (`pre`) to `seq_lens[i]` (`seq`), and needs
# `seq - pre` new KV slots. A prefill is an extend from `pre = 0` (or from a [cache hit](glossary.md#cache-hit), or from
# the previous chunk) to the prompt's length; a decode step is an extend by one,
# `seq = pre + 1`. Chapter 03 hands out slots for a whole batch of extends in one kernel launch,
# chapter 04 for a decode step.
#
# Below, three requests meet mini-sglang's scheduling policy: a step runs a prefill batch
# whenever some request waits for its prompt, else a decode batch of every running request.
# Each step may put at most 8 prompt tokens through the model. `A` arrives first, `B` at step 2,
# `C` at step 3 with an 11-token prompt.

# %% alt="A scheduler's timeline for requests A, B and C over seven steps: each cell shows a request's KV tokens before and after the step, coloured by prefill, prefill chunk or decode, with hatched cells where a request waits outside the batch."
timeline = scheduler_timeline(THREE_REQUESTS, prefill_budget=8)
for r in THREE_REQUESTS:
    print(r)
print()
for step in timeline:
    print(describe_step(step))
fig = timeline_figure(timeline, THREE_REQUESTS)
plt.show()

# %% [markdown]
# Read the picture column by column. Step 2 is a prefill of `B` alone: `A` is running, but a
# prefill step does not decode it, so it waits (that is mini-sglang's "prefill first" policy; other
# engines can mix prefill and decode in one batch). `C`'s prompt does not fit in one step's budget of 8 tokens, so
# step 3 extends it `0 → 8` and samples nothing, and step 4 extends it `8 → 11` and samples its
# first token. Step 5 decodes all three at once; `C` has its 2 tokens and finishes.
#
# Two checks on the numbers: every request ends with its prompt plus all but its last output
# token in the cache (the last token sampled is never fed back), and no prefill step puts more
# than 8 tokens through the model.

# %%
final = {}
for step in timeline:
    for e in step.work:
        final[e.name] = e.seq
    if step.kind == "prefill":
        assert sum(e.seq - e.pre for e in step.work) <= 8, (
            f"step {step.step}: a prefill step over the token budget of 8")
    else:
        # decode: one token per request
        assert all(e.seq == e.pre + 1 for e in step.work), (
            f"step {step.step}: a decode step that is not one token per request")
for r in THREE_REQUESTS:
    assert final[r.name] == r.prompt_len + r.output_len - 1, r
print("KV tokens at the end:", final)

# %% [markdown]
# ## Why not one contiguous block per request?
#
# Now the memory. The simplest plan gives each request one contiguous run of slots, long enough
# for the longest sequence it might reach (`max_seq_len`). But nobody knows in advance how long
# an answer will be, so most of every reservation sits empty, and the empty space belongs to
# *that* request: nobody else can use it. That is **internal fragmentation**, and as requests
# of different sizes come and go, the free space between reservations breaks into holes too
# short for a new request (**external fragmentation**).
#
# Paging fixes both, the same way an operating system does for RAM: cut the pool into pages
# of `page_size` slots, give a request whole pages *from anywhere* as it grows, and keep a
# small table per request saying which page holds which of its tokens. A request now wastes at
# most `page_size - 1` slots, in its last page, and any free page serves anyone.

# %% alt="Four requests of 11, 3, 7 and 14 tokens stored two ways: contiguous reservations of 16 slots each leave 29 of 64 slots unused, while pages of 4 slots scattered through the pool leave only 5 slots unused and 6 pages free."
fig = fragmentation_figure(lengths=(11, 3, 7, 14), max_seq_len=16, page_size=4)
plt.show()

# %% [markdown]
# Count it yourself: with contiguous reservations the four requests (35 tokens) hold all 64
# slots. With pages of 4 they hold `div_ceil(length, 4)` pages each (`kvlab.div_ceil(a, b)` is
# `ceil(a / b)` in integers): 3 + 1 + 2 + 4 = 10 pages = 40 slots, and 6 pages stay free.

# %%
lengths = [11, 3, 7, 14]
page_size = 4
pages_each = [kvlab.div_ceil(n, page_size) for n in lengths]
print("pages per request:", pages_each)
print("slots held, paged:", sum(pages_each) * page_size, "of", 4 * 16,
      "| slots held, contiguous:", 4 * 16)
assert sum(pages_each) == 10, f"{sum(pages_each)} pages in all, expected 10"
# waste < one page
assert all(p * page_size - n < page_size for p, n in zip(pages_each, lengths)), (
    f"more than a page wasted: pages {pages_each} for lengths {lengths}")

# %% [markdown]
# ## The page table
#
# A request's tokens now live in scattered pages, so the server keeps a **page table**: one
# row per running request, one column per logical token position, and in each cell the
# *physical slot* in the pool that holds that token's KV. An attention kernel reads a request's
# row to find its keys and values.
#
# In kvlab a page table starts full of `-1` ("unmapped"), with one spare row at the bottom
# (chapter 02 says why). The heatmap colours each mapped cell by its **physical page**
# (`slot // page_size`): a run of one colour is one page; blank cells are unmapped.

# %% alt="A heatmap of a first page table: one row per request slot, one column per logical position, each mapped cell coloured by its physical page, and white where a request's tokens end."
table, lengths = first_page_table(n_requests=5, max_seq_len=32, page_size=4, seed=0)
print("page table shape:", tuple(table.shape), "(rows = 5 request slots + 1 spare)")
print("request lengths:", lengths)
print("row 3:", table[3, :8].tolist(), "...")
ax = page_table_heatmap(table, 4, title="a first page table (colour = physical page)")
plt.show()

# %% [markdown]
# Check the picture against the numbers: each row is mapped exactly up to its request's length,
# and every mapped position of a page sits in the same physical page.

# %%
for row, n in enumerate(lengths):
    mapped = (table[row] != kvlab.UNMAPPED).sum().item()
    assert mapped == n, (row, mapped, n)
    slots = table[row, :n]
    # within one logical page, one physical page, consecutive slots
    for start in range(0, n, 4):
        chunk = slots[start:start + 4]
        assert (chunk // 4 == chunk[0] // 4).all() and (
            chunk - chunk[0] == torch.arange(len(chunk))
        ).all(), (
            f"row {row}, positions {start}..: slots {chunk.tolist()} are not one page"
            " in order"
        )
print("every row maps exactly its length; each logical page sits in one physical page")

# %% [markdown]
# ## Sharing: one prompt, many requests
#
# Pages buy something contiguous reservations never could: **sharing**. Many requests start
# with the same system prompt. Its KV is the same for all of them, so the server computes it
# once, keeps its pages, and points every new request's first table entries at them. Below,
# requests 0, 1 and 2 share their first two pages (same slots, same colours); request 3 has
# a different prompt. Chapter 05 builds the [radix tree](glossary.md#radix-tree) that finds such shared prefixes.

# %% alt="A page table of four requests with the slot number in every cell: requests 0, 1 and 2 hold the same two pages (slots 28-31 and 12-15) in their first eight positions, request 3 has pages of its own."
shared, P = sharing_table(page_size=4, seed=0)
ax = page_table_heatmap(
    shared, P, rows=slice(0, 4), title="requests 0-2 share their first two pages"
)
plt.show()
assert torch.equal(shared[0, :8], shared[1, :8]) and torch.equal(
    shared[1, :8], shared[2, :8]
), "requests 0, 1 and 2 should map the same slots for their first two pages"
assert not torch.equal(shared[3, :8], shared[0, :8]), (
    "request 3 has another prompt: it shares no page with request 0")

# %% [markdown]
# ## The heatmap at serving scale
#
# A real table is much bigger: 64 requests × 4096 positions is more cells than a screen has
# pixels. `page_table_heatmap` then shows one cell per page (or per block of pages) and says so
# in its title. The long white tails are positions no request has reached yet.

# %% alt="A downsampled heatmap of a 64-request by 4096-position page table, one cell per 16 positions: rows of scattered page colours, each ending in a long white tail where the request has not reached yet."
rows, cols, P = 64, 4096, 16
big, big_lengths = first_page_table(
    n_requests=rows - 1, max_seq_len=cols, page_size=P, seed=1
)
ax = page_table_heatmap(
    big, P, max_cells=512, title=f"{rows} request slots x {cols} positions"
)
ax.figure.set_size_inches(8.4, 6)
plt.show()

# %% [markdown]
# ## Your turn (a warm-up)
#
# Each chapter has exercises checked by `kvlab.check.<name>`. This one is small: write
# `pages_needed(lengths, page_size)`, the number of pages each request occupies, one int per
# request, in order, as a new list (`lengths` is read-only). Use `kvlab.div_ceil`.
#
# `kvlab.check.pages_needed(pages_needed)` tries named edge cases (no requests, a request with
# no tokens yet, `page_size = 1`, lengths that fill their last page exactly or spill one token
# over) and random batches, against the slow and obvious way: add pages until the tokens fit.
# Until you write the body, the [checker](glossary.md#checker) only says `not attempted yet`. Stuck?
# `kvlab.check.hint("pages_needed", 1)` (then 2, 3); a solution:
# `kvlab.solutions.show("pages_needed")`.

# %%
def pages_needed(lengths: list[int], page_size: int) -> list[int]:
    """How many pages of ``page_size`` slots each request occupies (its last page maybe
    partly)."""
    ### BEGIN SOLUTION
    return [kvlab.div_ceil(n, page_size) for n in lengths]
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: pages_needed
    raise NotImplementedError("one kvlab.div_ceil per request")
    ### END STARTER


kvlab.check.pages_needed(pages_needed);

# %%
kvlab.check.hint("pages_needed", 1);
# kvlab.solutions.show("pages_needed")   # uncomment to read a reference solution

# %% [markdown]
# ## The course map
#
# | # | chapter | you build ([lifted](glossary.md#lift) into kvlab) |
# |---|---|---|
# | 00 | [tour: why a KV cache, why pages; which runtime am I on](00_tour.ipynb) | runtime report, first heatmap |
# | 01 | [pages → token slots (and a Triton primer)](01_page_to_token.ipynb) | `page_to_token` (torch + Triton) |
# | 02 | [the page table](02_page_table.ipynb) | `write_page_table` ([pinned](glossary.md#pinned-memory) host indices + scatter; Triton) |
# | 03 | [the three-part `alloc_extend_kernel`](03_alloc_extend.ipynb) | `PagedTokenAllocator.alloc_extend` |
# | 04 | [decode, one token at a time](04_alloc_decode.ipynb) | `alloc_decode` |
# | 05 | [the radix prefix cache](05_radix_cache.ipynb) | `RadixPrefixCache` |
# | 06 | [`cache_req` region accounting](06_cache_req.ipynb) | `CacheManager` |
# | 07 | [a serving loop you can scrub through](07_serving_loop.ipynb) | simulator + ipywidgets explorer |
# | 08 | [capstone: attention through the page table](08_capstone_attention.ipynb) | [paged decode attention](glossary.md#paged-attention), tiny model |
# | 09 | [making it fast](09_making_it_fast.ipynb) | benchmarks, scalable kernels |
# | 10 | [serve a real model](10_serve_a_real_model.ipynb) | `kvlab.serving.hf.PagedGenerator`: a transformers model through `CacheManager` |
# | 11 | [the hash-chained prefix cache](11_hash_prefix_cache.ipynb) | `HashPrefixCache` (vLLM's and nano-vllm's prefix cache), measured beside the radix tree |
# | 12 | [when KV memory runs out](12_when_memory_runs_out.ipynb) | `kvlab.serving.pressure`: reserve, recompute, retract, swap; measured side by side |
# | 13 | [a KV hierarchy](13_kv_hierarchy.ipynb) | device, host memory and disk tiers of the prefix cache, loaded back on a hit; measured against GPU-only |
#
# Both source designs, mini-sglang's `CacheManager` and SGLang's `PagedTokenToKVPoolAllocator`,
# are rebuilt, tested against plain-Python references, and cleared of the hazards they carry.
# The package keeps them in the course's order, one folder per subsystem, as serving engines
# do (mini-sglang's `kvcache/`, `scheduler/`, `engine/`): `kvlab.alloc` (chapters 01-04),
# `kvlab.prefix` (05, 11), `kvlab.manager` (06), `kvlab.attention` (08-09), `kvlab.serving`
# (07, 10, 12), on top of `kvlab.base`; `kvlab.course` holds the checkers, pictures and scenes.
# The [glossary](glossary.md) has every term of the course.
#
# ## Summary
#
# - Without a KV cache every step recomputes every earlier token's keys and values (work grows
#   with the square of the length); the cache trades that for memory, about 128 KiB per token
#   for an 8-billion-parameter model.
# - A **scheduler step** runs one batch through the model: a **prefill** batch (prompts, maybe
#   in chunks) or a **decode** batch (one token per running request). Both **extend** each
#   request's KV from `pre` to `seq` tokens; decode is the case `seq = pre + 1`.
# - Contiguous per-request reservations waste most of the pool; pages waste less than one page
#   per request and let any free page serve any request.
# - A page table maps (request row, logical position) → physical slot; kvlab marks unmapped
#   entries with `-1` and keeps a spare row.
# - Pages make sharing a common prompt a matter of pointing table entries at the same pages.
# - Triton runs a kernel as a grid of program instances; `kvlab.runtime_report()` says whether
#   they run compiled on a GPU or one by one in the interpreter.
#
# Next: chapter 01 turns a list of pages into the token slots they hold.
#
# ## Questions
#
# 1. With the Llama-3-8B-shaped numbers above and a 40 GiB pool, how many requests of 4096
#    tokens fit at once? How many if each request must reserve a contiguous `max_seq_len` of
#    32768 tokens up front?
# 2. What does a server lose with a very small page (`page_size = 1`), and with a very large one
#    (`page_size = 4096`)? Think of the page table's size, the waste in last pages, and sharing
#    a prompt between requests.

# %% [markdown] tags=["solution"]
# ### Discussion
#
# 1. One token takes 128 KiB, so a 4096-token request takes 512 MiB and a 40 GiB pool holds
#    `40 GiB / 512 MiB = 80` of them, paged (each wastes less than one page). Reserving 32768
#    tokens (4 GiB) each up front fits only `10`, whatever the requests actually use: the
#    8x difference is the internal fragmentation of the picture above, at serving scale.
# 2. `page_size = 1` wastes nothing in last pages and lets requests share any prefix, token by
#    token, but the page table and every allocation then work per token: more entries to write
#    and read, and attention kernels gather single scattered slots. `page_size = 4096` makes the
#    bookkeeping tiny and reads long contiguous runs, but a short request wastes most of a
#    page, and two requests can share only whole 4096-token pages of identical prompt (chapter
#    05's radix cache matches whole pages). Chapter 07 lets you measure the trade-off on a
#    workload.
