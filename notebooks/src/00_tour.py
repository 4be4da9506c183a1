# %% [markdown]
# # 00 · A tour: why an LLM server keeps its KV cache in pages
#
# **Goal.** By the end of this chapter you know *why* serving engines cut the KV cache into
# fixed-size pages, what a **page table** is, which runtime your notebook is on, and where the
# course goes from here.
#
# Every token a model has seen leaves behind a key and a value vector in every layer: the
# **KV cache**. A server keeps those vectors in one big preallocated pool on the GPU and hands
# pieces of it to requests as they arrive, grow and finish. How it hands out those pieces
# decides how many requests fit at once, and that decides throughput.

# %%
import random

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab.scenes.ch00_tour import first_page_table, fragmentation_figure, sharing_table
from kvlab.viz import page_table_heatmap

torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Which runtime am I on?
#
# kvlab's kernels are written in [Triton](https://triton-lang.org). With a CUDA GPU they are
# compiled to GPU code. Without one, importing kvlab switches Triton to its **interpreter**
# (`TRITON_INTERPRET=1`, set before any kernel is defined): each program instance of a kernel
# then runs as NumPy code on the CPU, one after another. The answers are the same, bit for bit;
# only speed differs, so the chapters choose small sizes in the interpreter with
# `kvlab.runtime.pick(cpu=..., gpu=...)`.

# %%
info = kvlab.runtime_report()
print()
print("tensors live on:", kvlab.DEVICE)
print("a size chosen for this runtime:", kvlab.runtime.pick(cpu="small (interpreter)", gpu="large (GPU)"))

# %% [markdown]
# ## Why not one contiguous block per request?
#
# The simplest plan gives each request one contiguous run of slots, long enough for the
# longest sequence it might reach (`max_seq_len`). But nobody knows in advance how long an
# answer will be, so most of every reservation sits empty, and the empty space belongs to
# *that* request: nobody else can use it. That is **internal fragmentation**, and as requests
# of different sizes come and go, the free space between reservations breaks into holes too
# short for a new request (**external fragmentation**).
#
# Paging fixes both, the same way an operating system does for RAM: cut the pool into pages
# of `page_size` slots, give a request whole pages *from anywhere* as it grows, and keep a
# small table per request saying which page holds which of its tokens. A request now wastes at
# most `page_size - 1` slots, in its last page, and any free page serves anyone.

# %%
fig = fragmentation_figure(lengths=(11, 3, 7, 14), max_seq_len=16, page_size=4)
plt.show()

# %% [markdown]
# Count it yourself: with contiguous reservations the four requests (35 tokens) hold all 64
# slots. With pages of 4 they hold `div_ceil(length, 4)` pages each: 3 + 1 + 2 + 4 = 10 pages
# = 40 slots, and 6 pages stay free.

# %%
lengths = [11, 3, 7, 14]
page_size = 4
pages_each = [kvlab.div_ceil(n, page_size) for n in lengths]
print("pages per request:", pages_each)
print("slots held, paged:", sum(pages_each) * page_size, "of", 4 * 16,
      "| slots held, contiguous:", 4 * 16)
assert sum(pages_each) == 10
assert all(p * page_size - n < page_size for p, n in zip(pages_each, lengths))  # waste < one page

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

# %%
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
    for start in range(0, n, 4):  # within one logical page, one physical page, consecutive slots
        chunk = slots[start:start + 4]
        assert (chunk // 4 == chunk[0] // 4).all() and (chunk - chunk[0] == torch.arange(len(chunk))).all()
print("every row maps exactly its length; each logical page sits in one physical page")

# %% [markdown]
# ## Sharing: one prompt, many requests
#
# Pages buy something contiguous reservations never could: **sharing**. Many requests start
# with the same system prompt. Its KV is the same for all of them, so the server computes it
# once, keeps its pages, and points every new request's first table entries at them. Below,
# requests 0, 1 and 2 share their first two pages (same slots, same colours); request 3 has
# a different prompt. Chapter 05 builds the radix tree that finds such shared prefixes.

# %%
shared, P = sharing_table(page_size=4, seed=0)
ax = page_table_heatmap(shared, P, rows=slice(0, 4), title="requests 0-2 share their first two pages")
plt.show()
assert torch.equal(shared[0, :8], shared[1, :8]) and torch.equal(shared[1, :8], shared[2, :8])
assert not torch.equal(shared[3, :8], shared[0, :8])

# %% [markdown]
# ## The heatmap at serving scale
#
# A real table is much bigger: 64 requests × 4096 positions is more cells than a screen has
# pixels. `page_table_heatmap` then shows one cell per page (or per block of pages) and says so
# in its title. The long white tails are positions no request has reached yet.

# %%
rows, cols, P = kvlab.runtime.pick(cpu=(64, 4096, 16), gpu=(64, 4096, 16))
big, big_lengths = first_page_table(n_requests=rows - 1, max_seq_len=cols, page_size=P, seed=1)
ax = page_table_heatmap(big, P, max_cells=512, title=f"{rows} request slots x {cols} positions")
ax.figure.set_size_inches(10, 6)
plt.show()

# %% [markdown]
# ## Your turn (a warm-up)
#
# Each chapter ends with an exercise checked by `kvlab.check.<name>`. This chapter's is small:
# compute how many pages each request needs with `kvlab.div_ceil`, for a page size you pick,
# and check the totals against a plain loop. (Chapter 01's exercise is the first with a checker:
# `kvlab.check.page_to_token`.)

# %%
def pages_needed(lengths: list[int], page_size: int) -> list[int]:
    # your code: one div_ceil per request
    return [kvlab.div_ceil(n, page_size) for n in lengths]


rng = random.Random(0)
for _ in range(100):
    P = rng.choice([1, 2, 4, 16, 64])
    ls = [rng.randint(0, 300) for _ in range(rng.randint(1, 8))]
    expected = []
    for n in ls:  # the slow, obvious way: add pages until the tokens fit
        pages = 0
        while pages * P < n:
            pages += 1
        expected.append(pages)
    assert pages_needed(ls, P) == expected, (ls, P)
print("pages_needed agrees with the slow loop on 100 random batches")

# %% [markdown]
# ## The course map
#
# | # | chapter | you build (lifted into kvlab) |
# |---|---|---|
# | 00 | tour: why pages; which runtime am I on | runtime report, first heatmap |
# | 01 | pages → token slots | `page_to_token` (torch + Triton) |
# | 02 | the page table | `write_page_table` (pinned host indices + scatter; Triton) |
# | 03 | the three-part `alloc_extend_kernel` | `PagedTokenAllocator.alloc_extend` |
# | 04 | decode, one token at a time | `alloc_decode` |
# | 05 | the radix prefix cache | `RadixPrefixCache` |
# | 06 | `cache_req` region accounting | `CacheManager` |
# | 07 | a serving loop you can scrub through | simulator + ipywidgets explorer |
# | 08 | capstone: attention through the page table | paged decode attention, tiny model |
# | 09 | making it fast | benchmarks, scalable kernels |
#
# Two real designs guide the course: mini-sglang's `CacheManager` (whole pages, driven from the
# host) and SGLang's `PagedTokenToKVPoolAllocator` (token slots for a whole batch in one Triton
# launch). We rebuild both, test them against plain-Python references, and fix the hazards
# they carry.
#
# ## Summary
#
# - Contiguous per-request reservations waste most of the pool; pages waste less than one page
#   per request and let any free page serve any request.
# - A page table maps (request row, logical position) → physical slot; kvlab marks unmapped
#   entries with `-1` and keeps a spare row.
# - Pages make sharing a common prompt a matter of pointing table entries at the same pages.
# - `kvlab.runtime_report()` says whether kernels run compiled on a GPU or in Triton's interpreter.
#
# Next: chapter 01 turns a list of pages into the token slots they hold.
