# %% [markdown]
# # 09 · Making it fast
#
# **Time:** about 110 minutes, and 30 more for the optional part on host costs. **Assumes:**
# chapters 03 and 04 (the teaching kernels), chapter 08 (paged decode attention, the online
# softmax); the optional part also CUDA streams and pinned memory (chapter 02).
#
# **Goal.** Chapters 03 and 04 rebuilt SGLang's `alloc_extend_kernel` and `alloc_decode_kernel`
# as the [source design](glossary.md#source-design) wrote them. They are correct, and they carry three costs that only show
# up on a GPU under load. This chapter measures each one, removes it, and checks that the faster
# kernels hand out exactly the same [slots](glossary.md#token-slot):
#
# 1. **The [recompile trap](glossary.md#recompile-trap).** `tl.arange(0, next_power_of_2(extend_num_tokens))` is a
#    *compile-time* size. Every new power of two of tokens (or of the batch size) compiles a new
#    kernel: a fraction of a second to many seconds, in the middle of serving.
# 2. **O(bs²) prefix sums.** Each [program](glossary.md#program) re-sums the lengths of every request before it.
# 3. **A host [sync](glossary.md#sync) per batch.** `ret_values.item()` waits for the GPU on every call, and the
#    [page](glossary.md#page) count arrives only *after* the kernel has already read `free_pages`.
#
# Then it does the same for chapter 08's paged decode attention: measured against the memory
# floor, rebuilt so that every K/V byte is read once by enough programs to fill the GPU, and
# followed by the rest of the decode step.
#
# The numbers in this chapter were measured on an H200 by `python -m kvlab.bench` and saved in
# `figures/bench.json`, so the plots read the same on a laptop. On a GPU the chapter also
# re-measures a few cases live.
#
# > **SGLang today.** The source design is a snapshot. SGLang's allocator
# > (`python/sglang/srt/mem_cache/allocator.py` on its main branch, read at commit `02e29cb`)
# > has since fixed part of what this chapter measures, and kept the rest:
# >
# > | | the source design (chapters 03-04, this chapter's "teaching" path) | SGLang today |
# > |---|---|---|
# > | part 2 of `alloc_extend_kernel` | `tl.arange(0, max_num_extend_tokens)`, a `constexpr`: a compilation per power of two of tokens | a loop with a runtime bound over blocks of `BLOCK_EXTEND = 4096` [lanes](glossary.md#lane): one compilation for every [extend](glossary.md#extend) length |
# > | how many pages were taken | the last program packs them into [`ret_values`](glossary.md#ret-values); the host reads it back (`.item()`: a sync) | `ret_values` and `max_num_extend_tokens` are gone: the host counts the new pages from `seq_lens_cpu` and `prefix_lens_cpu` (`get_num_new_pages`), no sync |
# > | the batch size | `bs_upper = next_power_of_2(bs)`, a `constexpr` | the same: a compilation per power of two of the batch size |
# > | where a request's output starts | every program re-sums the lengths of the batch: O(bs²) | the same |
# > | out of pages | decided after the launch, once the kernel has read `free_pages` | the same: the kernel is launched first, and `alloc_extend` returns `None` afterwards if the pages were short |
# >
# > So cost 1 is half gone upstream (tokens no longer recompile, batch sizes still do), cost 3's
# > sync is gone but its check still comes after the launch, and cost 2 is untouched. The fast
# > path of this chapter removes all three.

# %%
import inspect
import random

import matplotlib.pyplot as plt
import torch
import triton

import kvlab
from kvlab.bench import paths as bench_paths
from kvlab.bench import plots as bench_plots
from kvlab.bench.cases import make_extend_batch
from kvlab.course.scenes.ch09_making_it_fast import fill_mapping_figure, load_bench
from kvlab.alloc import fast_alloc_kernels as fast_alloc
from kvlab.alloc.fast_alloc import alloc_decode_fast, alloc_extend_fast
from kvlab.course.reference.alloc_ref import (
    alloc_decode_ref,
    alloc_extend_ref,
    pages_for,
)

torch.manual_seed(0)
rng = random.Random(0)
device = kvlab.DEVICE
bench = load_bench()
meta = bench["meta"]
print("device:", device)
print(
    f"saved benchmark: {meta['device']}, torch {meta['torch']}, triton"
    f" {meta['triton']}, {meta['date']}"
)

# %% [markdown]
# ## The picture: where the time goes
#
# Each bar is the time of one `alloc_extend` call *per call in a loop* of back-to-back calls
# (CUDA events around 50 calls: host launch overhead and host syncs included, as a serving loop
# pays them). Red is the teaching path (the source design), green the fast path of this
# chapter, light green the fast path when it has to read the page count back from the GPU
# (one sync), blue the same allocation written with vectorised torch operations.

# %% alt="Bar charts, one per page size (1, 16 and 64), of microseconds per alloc_extend call on a log scale for several batch shapes, comparing the teaching kernel, the fast kernels with and without a sync, and vectorised torch, measured on the GPU the title names."
fig = bench_plots.plot_extend(bench)
plt.show()

# %% [markdown]
# Three things stand out. The torch version is the slowest by far: some twenty small operations,
# each a launch of its own. The teaching kernel is *skipped* on the 256×2048 batch: that batch
# has 524,288 new tokens, so the teaching kernel would need `tl.arange(0, 524288)`, and compiling
# that takes minutes (past about a million it does not compile at all). And the fast path does
# not care how many tokens a batch has: its cost is almost flat.
#
# ## Cost 1: the recompile trap
#
# Triton compiles a kernel once for every distinct set of `tl.constexpr` values. The teaching
# kernel has three: `bs_upper = next_power_of_2(bs)`, `page_size`, and
# `max_num_extend_tokens = next_power_of_2(extend_num_tokens)` (SGLang today has dropped the
# third, see the box above). A server sees batches of every size. How many different kernels
# does a realistic stream of batches need?

# %%
def teaching_compile_key(bs: int, extend_num_tokens: int, page_size: int):
    """The constexpr values the teaching extend kernel is compiled for."""
    return (
        triton.next_power_of_2(bs),
        page_size,
        triton.next_power_of_2(extend_num_tokens),
    )


keys, first_seen = set(), []
# a stream of prefill batches: 1-64 requests, 16-4096 new tokens each
for step in range(2000):
    bs = rng.randint(1, 64)
    tokens = sum(rng.randint(16, 4096) for _ in range(bs))
    key = teaching_compile_key(bs, tokens, 64)
    if key not in keys:
        keys.add(key)
        first_seen.append(step)
print(f"{len(keys)} different teaching kernels for 2000 batches; "
      f"new ones still appear at step {first_seen[-1]}")
print("a few of them (bs_upper, page_size, lanes):", sorted(keys)[:4], "...")

# %% [markdown]
# Each of those is a compilation *the first time that shape arrives*. The saved benchmark timed
# the first call of each path on shapes it had not seen, in a fresh process: red, the teaching
# path (it compiles); green, the fast path after its kernels were compiled once, for any shape.
# The dashed line is the 20 ms target.

# %% alt="A log-scale bar chart of the first call's time on each new batch shape: the teaching kernel compiles again for every power of two and lands far above the 20 ms target line, the fast kernel compiles once per page size and stays below it."
fig = bench_plots.plot_recompile(bench)
plt.show()
teach_ms = [
    r["teaching_first_call_ms"] for r in bench["cold"] if r["teaching_first_call_ms"]
]
fast_ms = [r["fast_first_call_ms"] for r in bench["cold"] if r["fast_compiled_before"]]
print(f"teaching first calls: {min(teach_ms):.0f} .. {max(teach_ms):.0f} ms")
print(f"fast first calls on unseen shapes: {min(fast_ms):.2f} .. {max(fast_ms):.2f} ms")

# %% [markdown]
# The fix is to make every size a *runtime* value. The fast kernels take `bs` and the token count
# as ordinary arguments, loop over them in blocks of a fixed `BLOCK` (a compile-time power of
# two, the same for every call), and tell Triton not to specialise on those integers
# (`do_not_specialize`): by default Triton compiles separate versions for an integer equal to 1
# and for one divisible by 16, which would bring a small version of the trap back.
#
# ## Cost 2: prefix sums, O(bs²)
#
# Program `pid` of the teaching kernel loads the lengths of requests `0 .. pid` (a [masked](glossary.md#mask)
# `tl.arange(0, bs_upper)`) and sums them, to learn where its output starts and which free page
# is its first. Every program does this, so the batch as a whole loads `bs × bs_upper` lengths,
# twice. A single [scan](glossary.md#scan) does the same job with `bs` loads:

# %%
def lengths_loaded(bs: int) -> tuple[int, int]:
    teaching = bs * triton.next_power_of_2(bs) * 2  # every program: two masked vectors
    # one pass over prefix_lens and seq_lens
    scan = bs * 2
    return teaching, scan


for bs in (1, 64, 1024, 16384):
    t, s = lengths_loaded(bs)
    print(f"bs={bs:>6}: teaching loads {t:>12,} lengths, one scan loads {s:>7,}")

# %% [markdown]
# On a GPU the small batches are cheap either way: thousands of loads are nothing. The cost
# becomes visible when the batch is large. The benchmark kept the total fixed at 16,384 tokens
# and grew the batch (fewer tokens per request):

# %% alt="A log-scale line chart of microseconds per call against batch size at a fixed total of tokens: the teaching kernel, where every program re-sums the prefix, climbs steeply at large batches, while the fast kernel's single scan stays low."
fig = bench_plots.plot_scaling(bench)
plt.show()

# %% [markdown]
# ## Cost 3: the host sync
#
# After the launch, the teaching path reads `ret_values.item()`: the host waits until the GPU has
# run the kernel, to learn how many pages were taken. That wait costs tens of microseconds per
# batch, and it is also the *safety* hazard of chapter 03: the page count is known only after the
# kernel has already read `free_pages`. (SGLang today counts the pages on the host instead, so
# it does not wait, but it still compares them with `free_pages` only after the launch.)
#
# But the scheduler that builds a batch *already knows* its lengths on the host: it decided them.
# So the fast path takes the counts (`extend_num_tokens`, `num_new_pages`, or the [host lengths](glossary.md#host-lengths)
# themselves) as arguments, decides out-of-pages *before* launching, and never waits. Compare the
# fast path with and without the sync:

# %%
for row in bench["extend"]:
    if row["page_size"] != 64:
        continue
    p = row["paths"]
    teach = p["teaching"].get("loop_us")
    print(
        f"{row['case']:>9} ({row['tokens']:>7} tokens): teaching"
        f" {('%.0f' % teach) if teach else 'skipped':>7} us | fast, no sync"
        f" {p['fast']['loop_us']:5.0f} us | fast, one sync"
        f" {p['fast_sync']['loop_us']:5.0f} us"
    )

# %% [markdown]
# ## Build it: one formula per token
#
# The teaching kernel writes each request in [three parts](glossary.md#three-parts) (rest of the old page, whole new pages,
# the partial last page). Look at one output token instead. Request `r` grows from `pre` to
# `seq`; its `k`-th new token has logical position `pos = pre + k`. Its old page ends at
# `old_end = ceil(pre / P) * P`. Then
#
# - `pos < old_end`: it goes right after the prefix, at `last_loc + 1 + k`;
# - otherwise it is on new page number `j = pos // P - old_end // P` of this request, which is
#   `free_pages[page_start[r] + j]`, at offset `pos % P`.
#
# Parts 1, 2 and 3 all fall out of this. What each token needs from its request is `pre`,
# [`last_loc`](glossary.md#last-loc), and two exclusive prefix sums: `token_start[r]` (where `r`'s slots begin in the
# output) and `page_start[r]` (`r`'s first page in `free_pages`). Build it in torch, printing
# shapes as we go, on the source's worked example (P = 64, A: 70 → 190, B: 128 → 260):

# %%
P = 64
pre = torch.tensor([70, 128])
seq = torch.tensor([190, 260])
# A's prefix ends at offset 5 of page 1
last_loc = torch.tensor([1 * P + 5, 2 * P + 63])
free_pages = torch.tensor([7, 3, 9, 5, 11])

extend = seq - pre
new_pages = (seq + P - 1) // P - (pre + P - 1) // P
# exclusive prefix sums: computed once
token_start = torch.cumsum(extend, 0) - extend
page_start = torch.cumsum(new_pages, 0) - new_pages
T = int(extend.sum())
print("extend", extend.tolist(), " new_pages", new_pages.tolist())
print(
    "token_start", token_start.tolist(), " page_start", page_start.tolist(), " T =", T
)

t = torch.arange(T)                                   # every output position
# its request: last r with start <= t
r = torch.searchsorted(token_start, t, right=True) - 1
k = t - token_start[r]
pos = pre[r] + k
old_end = (pre[r] + P - 1) // P * P
on_old = pos < old_end
j = pos // P - old_end // P
page = free_pages[torch.where(on_old, 0, page_start[r] + j)]
slots = torch.where(on_old, last_loc[r] + 1 + k, page * P + pos % P)
print("r", tuple(r.shape), " slots", tuple(slots.shape))

ref = alloc_extend_ref(
    pre.tolist(), seq.tolist(), last_loc.tolist(), free_pages.tolist(), P
)
assert (
    slots.tolist() == ref.out_indices
), "the torch build-up's slots differ from the reference's"
print(
    "A:",
    slots[:3].tolist(),
    "...",
    slots[57:60].tolist(),
    "... | B:",
    slots[120:122].tolist(),
    "...",
    slots[-4:].tolist(),
)

# %% [markdown]
# `out_indices` is one flat list; what it means shows in the [page table](glossary.md#page-table). Put each request's
# prefix in its row (A's 70 tokens on pages 0 and 1, so its last prefix token is slot
# `1 * 64 + 5`; B's 128 tokens on pages 4 and 2, ending at slot `2 * 64 + 63`), then write
# each request's part of `out_indices` at its new positions `[pre, seq)`. Every position must
# land at its own offset within a page (`slot % P == position % P`): that is what makes the
# row readable page by page.

# %% alt="The worked example written into a page table on pages of 64 slots: requests A and B, each row coloured by physical page, their prefix pages first, then the pages out_indices gave them."
rows = torch.full((2, int(seq.max())), -1, dtype=torch.int64)
# A's prefix: pages 0, 1
rows[0, :70] = torch.cat([0 * P + torch.arange(64), 1 * P + torch.arange(6)])
# B's prefix: pages 4, 2
rows[1, :128] = torch.cat([4 * P + torch.arange(64), 2 * P + torch.arange(64)])
assert [int(rows[0, 69]), int(rows[1, 127])] == last_loc.tolist(), (
    f"last prefix slots {[int(rows[0, 69]), int(rows[1, 127])]}, last_loc"
    f" {last_loc.tolist()}"
)
for r_ in range(2):
    n_new = int(extend[r_])
    rows[r_, int(pre[r_]) : int(seq[r_])] = slots[
        int(token_start[r_]) : int(token_start[r_]) + n_new
    ]
mapped = rows >= 0
assert bool(((rows % P) == (torch.arange(rows.shape[1]) % P))[mapped].all()), (
    "a position is not at its offset t % P")
for r_, name in enumerate("AB"):
    print(f"{name}'s row, page by page:", (rows[r_, : int(seq[r_])][::P] // P).tolist())
fig, ax = plt.subplots(figsize=(8.4, 1.8))
kvlab.course.viz.page_table_heatmap(
    rows,
    P,
    ax=ax,
    row_label="request (A, B)",
    title=(
        "the worked example written into a page table: prefix pages, then out_indices"
    ),
)
plt.show()

# %% [markdown]
# `torch.searchsorted` found each token's request by binary search in `token_start`: `log2(bs)`
# steps per token, so the work is linear in the number of tokens. Empty requests (`seq == pre`)
# need no care: their `token_start` equals the next one's, and "the *last* `r` with
# `token_start[r] <= t`" skips them.
#
# Wrapped as a function (the same formula as `kvlab.bench.paths.alloc_extend_torch` and the
# Triton fill):

# %%
def extend_slots_torch(pre, seq, last_loc, free_pages, page_size, starts=None):
    """Slots of a batched extend: one formula per output token (this chapter's
    build-up).

    ``starts``: ``(token_start, page_start)`` from elsewhere (a scan kernel); default:
    cumsum.
    """
    P = page_size
    extend = seq - pre
    new_pages = (seq + P - 1) // P - (pre + P - 1) // P
    if starts is None:
        token_start = torch.cumsum(extend, 0) - extend
        page_start = torch.cumsum(new_pages, 0) - new_pages
    else:
        token_start, page_start = starts
    t = torch.arange(int(extend.sum()), device=pre.device)
    r = torch.searchsorted(token_start, t, right=True) - 1
    k = t - token_start[r]
    pos = pre[r] + k
    old_end = (pre[r] + P - 1) // P * P
    on_old = pos < old_end
    table = free_pages if free_pages.numel() else free_pages.new_zeros(1)
    page = table[torch.where(on_old, 0, page_start[r] + pos // P - old_end // P)]
    return torch.where(on_old, last_loc[r] + 1 + k, page * P + pos % P)


# %% [markdown]
# ## The kernels
#
# `kvlab.alloc.fast_alloc_kernels` does the same on the GPU, in one of two shapes:
#
# - **Two launches** (large batches): `extend_scan_kernel`, one program, walks the batch in blocks
#   of 1024 requests with a running [*carry*](glossary.md#carry), checks each request and writes `token_start` and
#   `page_start`; then `extend_fill_kernel`, one program per 1024 output tokens, applies the formula
#   above.
# - **One launch** (up to `FUSED_MAX_BATCH` = 4096 requests, while the repeated scans stay small): a
#   launch costs more host time than the whole scan, so `extend_fused_kernel` lets each program
#   check and scan the batch itself (vector `cumsum`s, O(bs) per 1024 tokens, never O(bs²)) into its
#   own scratch row before filling.
#
# Both compile once per page size, when the allocator is built. Here is the fill, the heart of it:

# %%
print(inspect.getsource(fast_alloc._fill_tokens.fn))

# %% [markdown]
# And the host side decides everything it can judge *before* it launches anything: the counts
# the host lengths give, and out of pages (the rules only the device can read, such as `last_loc`
# lying on an allocated page, are judged in the kernel's own pass before it writes a slot):

# %%
src = inspect.getsource(alloc_extend_fast)
print(
    src[src.index("    if prefix_lens_cpu is not None:") : src.index("    if bs == 0:")]
)

# %% [markdown]
# ## Validate against the reference
#
# Random batches (seeded), page sizes 1, 16 and 64, some empty extends, in the three calling
# modes: counts known, host lengths known, and device tensors only (one sync). Every result must
# equal `kvlab.course.reference.alloc_extend_ref` slot for slot.

# %%
def random_extend_batch(rng, P, max_bs=6):
    bs = rng.randint(1, max_bs)
    pre = [rng.randint(0, 3 * P) for _ in range(bs)]
    seq = [p + rng.choice([0, rng.randint(1, 4 * P + 3)]) for p in pre]
    last, page = [], 0
    for p in pre:  # each prefix on pages of its own
        page += pages_for(p, P)
        last.append((page - 1) * P + (p - 1) % P if p else -1)
    need = sum(pages_for(s, P) - pages_for(p, P) for p, s in zip(pre, seq))
    free = list(range(page, page + need + 3))
    rng.shuffle(free)
    return pre, seq, last, free


as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
n_trials = kvlab.base.runtime.pick(cpu=6, gpu=200)
for trial in range(n_trials):
    P = rng.choice([1, 16, 64])
    pre_l, seq_l, last_l, free_l = random_extend_batch(rng, P)
    ref = alloc_extend_ref(pre_l, seq_l, last_l, free_l, P)
    modes = {
        "counts": dict(
            extend_num_tokens=ref.num_extend_tokens, num_new_pages=ref.num_new_pages
        ),
        "host lengths": dict(prefix_lens_cpu=pre_l, seq_lens_cpu=seq_l),
        "one sync": {},
    }
    for mode, kw in modes.items():
        got = alloc_extend_fast(
            as_t(pre_l), as_t(seq_l), as_t(last_l), as_t(free_l), P, **kw
        )
        assert got.out_indices.tolist() == ref.out_indices, (trial, mode)
        assert got.num_new_pages == ref.num_new_pages, (
            f"trial {trial}, {mode}: {got.num_new_pages} new pages, expected"
            f" {ref.num_new_pages}"
        )
    assert (
        extend_slots_torch(
            as_t(pre_l), as_t(seq_l), as_t(last_l), as_t(free_l), P
        ).tolist()
        == ref.out_indices
    ), f"trial {trial}: the torch build-up's slots differ from the reference's"
print(
    f"fast extend == reference on {n_trials} random batches x 3 modes (and the torch"
    " build-up)"
)

# %% [markdown]
# Out of pages must be refused before any kernel reads `free_pages`, with nothing changed:

# %%
pre_l, seq_l, last_l = [0, 3], [40, 50], [-1, 2]
short = as_t(list(range(5)))  # 6 pages are needed at P = 16
try:
    alloc_extend_fast(
        as_t(pre_l),
        as_t(seq_l),
        as_t(last_l),
        short,
        16,
        prefix_lens_cpu=pre_l,
        seq_lens_cpu=seq_l,
    )
    raise AssertionError("should have raised")
except kvlab.OutOfPages as err:
    print("refused:", err)
assert short.tolist() == list(
    range(5)
), f"a refused call changed free_pages: {short.tolist()}"

# %% [markdown]
# Decode gets the same treatment: one program, a vector of requests, one scan over "does this
# request start a page?", and with the host lengths no sync at all:

# %%
for trial in range(n_trials):
    P = rng.choice([1, 16, 64])
    seq_l = [
        rng.choice([1, P + 1, rng.randint(1, 4 * P)]) for _ in range(rng.randint(1, 40))
    ]
    last_l, page = [], 0
    for s in seq_l:
        page += pages_for(s - 1, P)
        last_l.append((page - 1) * P + (s - 2) % P if s > 1 else -1)
    free_l = list(range(page, page + len(seq_l)))
    ref = alloc_decode_ref(seq_l, last_l, free_l, P)
    got = alloc_decode_fast(
        as_t(seq_l), as_t(last_l), as_t(free_l), P, seq_lens_cpu=seq_l
    )
    assert (
        got.out_indices.tolist() == ref.out_indices
        and got.num_new_pages == ref.num_new_pages
    ), f"trial {trial}: fast decode's slots or page count differ from the reference's"
print(f"fast decode == reference on {n_trials} random steps")

# %% [markdown]
# ## The picture of the fill
#
# How the output of one batch is shared among programs (`BLOCK` = 8 here so it fits; the kernel
# uses 1024). Program boundaries ignore request boundaries: a program may serve parts of several
# requests, and one long request may span many programs. Work is balanced whatever the lengths.

# %% alt="The fast fill kernel on pages of 4 slots with blocks of 8 positions: three programs each find, by binary search in token_start, which request owns each output position, and write its slot, hatched on the request's old page and solid on new pages."
fig = fill_mapping_figure()
plt.show()

# %% [markdown]
# ## Measure it yourself (GPU only)
#
# On a GPU this cell times the teaching and the fast path on a few of the benchmark's batches,
# in this process. In the [interpreter](glossary.md#interpreter) the timings would mean nothing, so it only says so.

# %%
if kvlab.INTERPRET:
    print("interpreter: no live timings (see the saved benchmark above)")
else:
    from kvlab.bench.suite import loop_us

    for bs, mean in [(1, 4096), (64, 512), (256, 128)]:
        b = make_extend_batch(bs, mean, 64)
        teach = loop_us(lambda: bench_paths.teaching_extend(b), smoke=False)
        fast = loop_us(lambda: bench_paths.fast_extend(b), smoke=False)
        print(
            f"{bs}x{mean}: teaching {teach:6.1f} us, fast {fast:6.1f} us, fast/teaching"
            f" {fast / teach:.2f}"
        )

# %% [markdown]
# ## Your turn: the scan with a carry
#
# Write the scan kernel: one program, a runtime loop over the batch in blocks of `BLOCK`
# requests, and a carry between blocks, so that one compilation serves every batch size.
#
# ```
# kernel[(1,)](prefix_lens, seq_lens, token_start, page_start, bs, page_size, BLOCK=BLOCK)
# token_start[r] = sum of (seq - pre) over requests before r
# page_start[r]  = sum of (ceil(seq/P) - ceil(pre/P)) over requests before r
#
# BLOCK = 4, extend = [5 0 3 7 | 2 4]
#   block 0: cumsum [5 5 8 15] - extend -> [0 5 5 8], + carry 0  -> token_start[0:4]
#            carry = 0 + 15
#   block 1: cumsum [2 6]      - extend -> [0 2],     + carry 15 -> token_start[4:6]
#                                                                   = [15 17]
# ```
#
# **The carry is an int64 scalar, from the start.** A value carried from one loop iteration
# to the next must keep one type for the whole loop. Write `carry = 0` and Triton makes it an
# `int32` scalar; after `carry += tl.sum(extend, axis=0)` it is `int64` (the lengths are loaded
# and converted with `.to(tl.int64)`, so their sums are `int64`). Compiled Triton refuses such a
# kernel: *"Loop-carried variable carry has initial type int32 but is re-assigned to int64 in
# loop! Please make sure that the type stays consistent."* The interpreter does not check
# this and runs the kernel without complaint, so a scan that passes in the interpreter could fail
# to compile on a GPU; the [checker](glossary.md#checker) therefore also compiles your kernel for
# a GPU (Triton compiles without one) and tells you, with the line. Start the carry as an `int64`
# scalar instead, the sum of a block of `int64` zeros: `tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)`
# (the kernels in `kvlab.alloc.fast_alloc_kernels` do the same).
#
# Within a block, `tl.cumsum(x, axis=0)` is what `torch.cumsum` is on the host: the
# *inclusive* running sum of the block's lanes (`[5 0 3 7]` gives `[5 5 8 15]`); subtract `x`
# to make it exclusive, as above.
#
# The checker runs your kernel with `BLOCK` from 4 to 32, so most batches span several blocks;
# `prefix_lens` and `seq_lens` are read-only.
# Stuck? `kvlab.check.hint("extend_scan", 1)` (then 2, 3, 4), and as a last resort
# `kvlab.solutions.show("extend_scan")`.

# %%
import triton.language as tl  # noqa: E402


@triton.jit
def my_extend_scan(prefix_lens_ptr, seq_lens_ptr, token_start_ptr, page_start_ptr, bs,
                   page_size: tl.constexpr, BLOCK: tl.constexpr):
    """Exclusive prefix sums of extend lengths and of new pages, BLOCK requests at a
    time."""
    ### BEGIN SOLUTION
    lanes = tl.arange(0, BLOCK)
    carry_tokens = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    carry_pages = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for start in range(0, bs, BLOCK):
        offs = start + lanes
        mask = offs < bs
        pre = tl.load(prefix_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        seq = tl.load(seq_lens_ptr + offs, mask=mask, other=0).to(tl.int64)
        extend = seq - pre
        pages = (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size
        tl.store(
            token_start_ptr + offs,
            carry_tokens + tl.cumsum(extend, axis=0) - extend,
            mask=mask,
        )
        tl.store(
            page_start_ptr + offs,
            carry_pages + tl.cumsum(pages, axis=0) - pages,
            mask=mask,
        )
        carry_tokens += tl.sum(extend, axis=0)
        carry_pages += tl.sum(pages, axis=0)
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: extend_scan
    pass
    ### END STARTER


kvlab.check.extend_scan(my_extend_scan);

# %%
kvlab.check.hint("extend_scan", 1);
# kvlab.solutions.show("extend_scan")   # uncomment to read a reference solution

# %% [markdown]
# ## Lift: your scan and the notebook's fill vs kvlab's
#
# Your `my_extend_scan` gives every request its `token_start` and `page_start`, and the
# build-up's formula (`extend_slots_torch`) turns them into slots. Together they must hand out
# exactly the slots of the package's fast path, on fresh random batches of up to 20 requests
# (several blocks of 8). Until your scan has passed its checker, the reference solution stands
# in for it, and the cell says so.

# %%
scan_kernel = kvlab.check.choose(
    "extend_scan", my_extend_scan, kvlab.solutions.get("extend_scan")
)


def scan_starts(kernel, pre, seq, page_size, block=8):
    """(token_start, page_start) of a batch, from a scan kernel: one program, BLOCK
    requests at a time."""
    token_start, page_start = torch.empty_like(pre), torch.empty_like(pre)
    kernel[(1,)](pre, seq, token_start, page_start, len(pre), page_size, BLOCK=block)
    return token_start, page_start


for trial in range(kvlab.base.runtime.pick(cpu=5, gpu=100)):
    P = rng.choice([1, 16, 64])
    pre_l, seq_l, last_l, free_l = random_extend_batch(rng, P, max_bs=20)
    pre_t, seq_t = as_t(pre_l), as_t(seq_l)
    starts = scan_starts(scan_kernel, pre_t, seq_t, P)
    extend, new_pages = seq_t - pre_t, (seq_t + P - 1) // P - (pre_t + P - 1) // P
    assert torch.equal(starts[0], torch.cumsum(extend, 0) - extend), (
        f"page_size {P}: token starts {starts[0].tolist()}, expected"
        f" {(torch.cumsum(extend, 0) - extend).tolist()}"
    )
    assert torch.equal(starts[1], torch.cumsum(new_pages, 0) - new_pages), (
        f"page_size {P}: page starts {starts[1].tolist()}, expected"
        f" {(torch.cumsum(new_pages, 0) - new_pages).tolist()}"
    )
    mine = extend_slots_torch(
        pre_t, seq_t, as_t(last_l), as_t(free_l), P, starts=starts
    )
    theirs = alloc_extend_fast(pre_t, seq_t, as_t(last_l), as_t(free_l), P,
                               prefix_lens_cpu=pre_l, seq_lens_cpu=seq_l)
    assert torch.equal(mine, theirs.out_indices), (
        f"page_size {P}, pre {pre_l}, seq {seq_l}: the slots from your scan differ from"
        " alloc_extend_fast's"
    )
print("your scan + the notebook's extend_slots_torch == kvlab's alloc_extend_fast")

# %% [markdown]
# ## Decode attention at the memory floor
#
# So far this chapter made the *allocator* fast. The kernel a decode step spends most of its
# attention time in is chapter 08's paged decode attention, and it has a cost of its own that
# only a GPU shows. Decode attention does almost no arithmetic: every K/V row it loads takes
# part in one dot product per query head and is never used again. So its time is bounded below
# by the bytes it must read divided by the GPU's memory bandwidth, the
# [memory floor](glossary.md#memory-floor), and a good kernel is one that gets close to it.
#
# Two things keep chapter 08's kernel far from that floor:
#
# 1. **It reads K/V several times.** Real models use
#    [grouped-query attention](glossary.md#grouped-query-attention) (chapter 10 serves one):
#    `heads` query heads share `kv_heads` K/V heads, and query head `h` reads K/V head
#    `h // group` with `group = heads // kv_heads` (Llama 3.2 1B: 32 query heads on 8 K/V heads,
#    a group of 4). Chapter 08's kernel runs one program per `(request, query head)`, so the 4
#    programs of a group each load the same K/V rows: 4 times the bytes.
# 2. **It runs too few programs.** One request of 32,768 tokens gives it 32 programs, each
#    walking 32,768 positions alone, on a GPU with 132 streaming multiprocessors.
#
# `python -m kvlab.bench --attention` measures it on a GPU beside a new kernel and transformers'
# own attention (`scaled_dot_product_attention` on contiguous K/V), at the shapes of that model
# (bfloat16, pages of 16); `figures/bench.md` names the run saved with the course. The floor is the bytes a call must move (K/V once, the
# page-table entries, `q` and the output) divided by the bandwidth of a large device-to-device
# copy measured in the same run:

# %%
att = bench["attention"]
bw = att["bandwidth"]
print(f"copy bandwidth: {bw['gb_per_s']:.0f} GB/s on {att['meta']['device']}")
print(
    f"{'batch':>5} {'context':>7} {'floor µs':>9} {'chapter 08':>11} {'x floor':>8}"
    f" {'chapter 09':>11} {'x floor':>8}"
)
for r in att["kernel"]:
    if r.get("skipped"):
        continue
    t, f = r["paths"]["teaching"], r["paths"]["fast"]
    print(
        f"{r['batch']:>5} {r['ctx']:>7} {r['floor_us']:>9.1f} {t['us']:>11.1f}"
        f" {t['ratio_to_floor']:>8.1f} {f['us']:>11.1f} {f['ratio_to_floor']:>8.2f}"
    )

# %% [markdown]
# Chapter 08's kernel stays several times above the floor at every shape, and worst for one long
# request. Its K/V traffic explains the first part in bytes: per call it reads the K/V rows of
# a K/V head once per query head of the group. The GPU's L2 cache can serve some of those
# repeated reads (the 4 programs of a group run at about the same time), so the time is not
# exactly 4 times the floor, but every byte that misses the L2 is paid again:

# %%
shape = att["shape"]
group = shape["heads"] // shape["kv_heads"]
r = next(r for r in att["kernel"] if (r["batch"], r["ctx"]) == (64, 4096))
b = r["bytes"]
print(
    f"batch 64, context 4096: K/V {b['kv'] / 1e6:.0f} MB; chapter 08's programs read"
    f" {b['teaching_design'] / 1e6:.0f} MB by design ({group} query heads per K/V"
    f" head), chapter 09's {b['fast_design'] / 1e6:.0f} MB"
)

# %% [markdown]
# ### The picture: which program reads which pages
#
# Three requests of 21, 9 and 3 tokens on shuffled pages of 3 (a page is labelled with its
# physical number `p`). Top: chapter 08's programs for request A, one per query head; each
# reads every page. Bottom: the new kernel's programs, one per `(request, K/V head, split)`:
# each serves all 4 query heads of its K/V head, and a request's positions are cut into
# [splits](glossary.md#split) of whole blocks, one program each, so that even one request keeps
# several programs busy. A split past a request's end has nothing to read and exits at once.

# %% alt="Which program reads which pages for three requests of 21, 9 and 3 tokens on pages of 3: chapter 08's kernel runs one program per query head, so each of request A's 4 heads reads every page, while chapter 09's runs one program per K/V head and split, reading each page once for all 4 heads, with splits past a request's end reading nothing."
from kvlab.course.scenes.ch09_making_it_fast import split_reads_figure

split_reads_figure()
plt.show()

# %% [markdown]
# ### Build-up 1: the query heads of a group in one program
#
# For one request and one K/V head, the 4 query heads of the group are a `[group, head_dim]`
# matrix, the K rows of a block a `[BLOCK_N, head_dim]` one, and their scores one matrix
# product, `q @ K^T`: `[group, BLOCK_N]`. K is loaded once and used by every head. In Triton
# that is `tl.dot(q, k)` with `k` loaded as `[head_dim, BLOCK_N]`; `tl.dot` needs at least 16
# rows, so a program pads its `group` heads to `BLOCK_H = 16` rows (masked: padding costs
# arithmetic, which is free here, not bytes). The weighted sum of V is a second product,
# `p @ V`. In torch, on one request:

# %%
from kvlab.serving.hf.attention_steps import paged_attention_reference
from kvlab.attention.kv_pool import random_paged_layout
from kvlab.course.reference.attention_ref import (
    merge_splits_reference,
    split_partials_reference,
    split_ranges_reference,
)

q, k_pool, v_pool, table, rows_, lens = random_paged_layout(
    0, 3, [14], heads=8, kv_heads=2, head_dim=16
)
# K/V head 1: query heads 4..7
g, grp = 1, 4
slots = table[int(rows_[0]), :14].long()
q_group = q[0, g * grp:(g + 1) * grp]                                # [group, head_dim]
# [n, head_dim]: read once
k_rows, v_rows = k_pool[slots, g], v_pool[slots, g]
scores = q_group @ k_rows.T / 4.0                                    # [group, n]
together = torch.softmax(scores, -1) @ v_rows                        # [group, head_dim]
print(
    "q_group",
    tuple(q_group.shape),
    "K rows",
    tuple(k_rows.shape),
    "scores",
    tuple(scores.shape),
)
one_by_one = torch.stack(
    [
        torch.softmax(q[0, h] @ k_pool[slots, h // grp].T / 4.0, -1)
        @ v_pool[slots, h // grp]
        # chapter 08: a head at a time
        for h in range(g * grp, (g + 1) * grp)
    ]
)
torch.testing.assert_close(together, one_by_one)
print("the group's heads in one product == one head at a time")

# %% [markdown]
# ### Build-up 2: split the positions, then merge with the log-sum-exp
#
# A split `s` covers positions `[start, end)` and ends with what chapter 08's kernel ends with:
# the running max `m_s`, the sum `l_s` of `exp(score - m_s)` and the weighted sum `acc_s`. It
# writes two things: its normalised output `o_s = acc_s / l_s` and the
# [log-sum-exp](glossary.md#log-sum-exp) of its scores, `lse_s = m_s + log(l_s)`, the log of
# `sum exp(score)` over the split. The whole softmax weighs each split by its share of the
# total sum, `exp(lse_s) / sum_t exp(lse_t)`:
#
#     out = sum_s exp(lse_s) o_s / sum_s exp(lse_s)
#         = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)     M = max_s lse_s
#
# The two lines are equal, but only the second can be computed: a score of 100 makes
# `exp(lse)` overflow float32. A second, tiny kernel does this merge, one program per
# `(request, query head)`, walking the splits with the online softmax of chapter 08, the splits
# playing the part of blocks. (SGLang's Triton decode attention is built the same way: a first
# kernel with 16 query heads of a group per program and `tl.dot`, splits rounded to whole blocks,
# and a second kernel that merges them by log-sum-exp, in
# `python/sglang/srt/layers/attention/triton_ops/decode_attention.py`.) Splits hold whole blocks of `BLOCK_N` positions,
# `ceil(ceil(seq_len / num_splits) / BLOCK_N) * BLOCK_N` each, computed by every program
# from its request's own length. In torch, with scores large enough to overflow:

# %%
print(
    "splits of a 300-token request, 4 splits, blocks of 64:",
    split_ranges_reference(300, 4, 64),
)
q, k_pool, v_pool, table, rows_, lens = random_paged_layout(
    1, 3, [40, 7], heads=8, kv_heads=2, head_dim=16
)
q = q * 60                                                        # scores of hundreds
o, lse = split_partials_reference(
    q, k_pool, v_pool, table, rows_, lens, num_splits=3, block_n=16
)
live = [len(split_ranges_reference(int(n), 3, 16)) for n in lens]
print("o", tuple(o.shape), "lse", tuple(lse.shape), "live splits per request", live)
print("lse of request 0, head 0:", [round(float(x), 1) for x in lse[0, 0, :live[0]]])
w = torch.exp(lse[0, 0, :live[0]])
print(
    "exp(lse) without the max:",
    w.tolist(),
    "->",
    (w[:, None] * o[0, 0, : live[0]]).sum(0)[:2] / w.sum(),
)
merged = merge_splits_reference(o, lse, live)
torch.testing.assert_close(
    merged, paged_attention_reference(q, k_pool, v_pool, table, rows_, lens)
)
print("with the max subtracted: the merge == attention over all positions at once")

# %% [markdown]
# ### Build-up 3: how many splits
#
# More splits mean more programs, but each costs a partial result and the merge a second
# launch. `kvlab.attention.paged_attention.choose_num_splits` aims for two programs per streaming
# multiprocessor (the H200 has 132) from the batch and the K/V heads, with no split shorter
# than 256 positions of the longest context the page table allows. A batch that fills the GPU
# by itself gets one split, and then the first kernel writes the output directly and the merge
# is not launched. The number of splits is a *runtime* argument, like every length here: a new
# batch or a longer context never compiles a new kernel (the fast kernels have few compiled
# variants: per pool dtype, group, head size, and one split or several).

# %%
from kvlab.attention.paged_attention import choose_num_splits

for batch, context in [
    (1, 32768),
    (1, 4096),
    (1, 512),
    (16, 4096),
    (64, 4096),
    (256, 32768),
]:
    print(f"batch {batch:>3}, 8 K/V heads, context {context:>5}: "
          f"{choose_num_splits(batch, 8, context, sms=132):>2} split(s)")

# %% [markdown]
# ## Your turn: the block's loads (part 1)
#
# The first kernel runs one program per `(request b, K/V head g, split s)`: `g` is
# `tl.program_id(1)` and the program serves query heads `g * GROUP .. g * GROUP + GROUP - 1`
# (`heads` in the kernel, padded to `BLOCK_H` rows). Everything is written except what one block
# reads. Write it:
#
# 1. the block's slots, **one per position**: `page_table[row, offs_n]`, masked with `mask_n`.
#    A block is `BLOCK_N` consecutive positions of the row; their pages are wherever the
#    allocator found them, so a block that crosses a page boundary continues on some other page
#    of the pool;
# 2. `k`: the rows of **K/V head `g`** of those slots, as `[BLOCK_D, BLOCK_N]` (ready for
#    `tl.dot(q, k)`), and `v` as `[BLOCK_N, BLOCK_D]`; mask both with `mask_n` and `mask_d`
#    (`other=0.0`) and convert to `tl.float32`. Slot `t`'s K/V head `g` starts at
#    `t * stride_kv_s + g * stride_kv_h`.
#
# `kvlab.check.split_attention` launches your kernel with blocks of 16 and 32 positions, pages of
# 1 to 16 tokens on shuffled pages, grouped and plain multi-head attention, splits that hold
# nothing, and pools whose last slots are in use with a head size below `BLOCK_D` (where a load
# that forgets `mask_d` reads past the end of the pool), and compares every split's `o` and
# `lse` with `kvlab.course.reference.split_partials_reference`.
# Only `o` and `lse` are written. Hints: `kvlab.check.hint("split_attention", 1)` (up to 3);
# the reference: `kvlab.solutions.show("split_attention")`.


# %%
@triton.jit
def my_split_attention_kernel(
    q_ptr,
    k_pool_ptr,
    v_pool_ptr,
    page_table_ptr,
    table_idx_ptr,
    seq_lens_ptr,
    o_ptr,
    lse_ptr,
    scale,
    num_splits,
    stride_q_b,
    stride_q_h,
    stride_kv_s,
    stride_kv_h,
    stride_pt_row,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    stride_l_b,
    stride_l_h,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)  # the K/V head: its GROUP query heads share it
    s = tl.program_id(2)  # the split
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # whole blocks
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:  # a split past the request's end has nothing to read
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = g * GROUP + offs_h  # the query heads of this program
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q = tl.load(
            q_ptr
            + b.to(tl.int64) * stride_q_b
            + heads[:, None] * stride_q_h
            + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)
        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            ### BEGIN SOLUTION
            slots = tl.load(
                page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0
            ).to(tl.int64)
            # each position's row of K/V head g
            kv = slots * stride_kv_s + g * stride_kv_h
            k = tl.load(
                k_pool_ptr + kv[None, :] + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            ).to(
                tl.float32
            )  # [BLOCK_D, BLOCK_N]
            v = tl.load(
                v_pool_ptr + kv[:, None] + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            ).to(
                tl.float32
            )  # [BLOCK_N, BLOCK_D]
            ### END SOLUTION
            ### BEGIN STARTER
            # YOUR CODE HERE: split_attention
            # slots of the block (one per position), then k [BLOCK_D, BLOCK_N] and v
            # [BLOCK_N, BLOCK_D]
            ### END STARTER
            scores = tl.dot(q, k, input_precision="ieee") * scale  # [BLOCK_H, BLOCK_N]
            scores = tl.where(mask_n[None, :], scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = (
            b.to(tl.int64) * stride_o_b
            + heads[:, None] * stride_o_h
            + s * stride_o_s
            + offs_d[None, :]
        )
        tl.store(
            o_ptr + out, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :]
        )
        tl.store(
            lse_ptr + b.to(tl.int64) * stride_l_b + heads * stride_l_h + s,
            m_i + tl.log(l_i),
            mask=mask_h,
        )


kvlab.check.split_attention(my_split_attention_kernel);

# %%
kvlab.check.hint("split_attention", 1);
# kvlab.solutions.show("split_attention")   # uncomment to read the reference solution

# %% [markdown]
# ## Your turn: the merge (part 2)
#
# The second kernel runs one program per `(request b, query head h)`. It computes the number of
# live splits of its request as the first kernel cut them, loads each split's `lse` and `o`, and
# keeps the online softmax of chapter 08 over them: a running max `m`, a running `total` of
# `exp(lse - m)` and `acc` of `exp(lse - m) * o`. Write the update inside the loop: `m_new`,
# `alpha` (what rescales everything summed under the old max), this split's weight `w`, then
# `acc`, `total` and `m`. `kvlab.check.merge_splits` feeds it partial results of random layouts,
# among them scores that rise from split to split, fall, and overflow `exp` without the max,
# lengths that end exactly on a split, and head sizes below `BLOCK_D`; `o`, `lse` and `seq_lens`
# are read-only. Hints: `kvlab.check.hint("merge_splits", 1)` (up to
# 3); the reference: `kvlab.solutions.show("merge_splits")`.


# %%
@triton.jit
def my_merge_splits_kernel(
    o_ptr,
    lse_ptr,
    seq_lens_ptr,
    out_ptr,
    num_splits,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    stride_l_b,
    stride_l_h,
    stride_out_b,
    stride_out_h,
    head_dim,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # as the first pass
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    live = tl.cdiv(seq_len, split_len)  # the splits that hold positions of this request
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    m = -float("inf")  # the largest lse so far
    total = 0.0  # sum of exp(lse_s - m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # sum of exp(lse_s - m) * o_s
    for s in range(0, live):
        lse = tl.load(lse_ptr + b * stride_l_b + h * stride_l_h + s)
        o = tl.load(
            o_ptr + b * stride_o_b + h * stride_o_h + s * stride_o_s + offs_d,
            mask=mask_d,
            other=0.0,
        )
        ### BEGIN SOLUTION
        m_new = tl.maximum(m, lse)
        # rescales what was summed under the old max (0 at first)
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)  # this split's weight, at most 1
        acc = acc * alpha + w * o
        total = total * alpha + w
        m = m_new
        ### END SOLUTION
        ### BEGIN STARTER
        # YOUR CODE HERE: merge_splits
        # m_new, alpha and w from lse; then acc, total and m
        ### END STARTER
    tl.store(
        out_ptr + b * stride_out_b + h * stride_out_h + offs_d, acc / total, mask=mask_d
    )


kvlab.check.merge_splits(my_merge_splits_kernel);

# %%
kvlab.check.hint("merge_splits", 1);
# kvlab.solutions.show("merge_splits")   # uncomment to read the reference solution

# %% [markdown]
# ## Lift: your two kernels vs `kvlab.attention.paged_attention.fast_paged_decode_attention`
#
# The package's kernels (`kvlab.attention.split_kernels`) are these two, plus what a GPU needs:
# `tl.dot` in the pool's 16-bit dtype there (exact float32 in the interpreter, whose `tl.dot`
# gets bfloat16 matrices wrong), blocks of 128 positions (64 for heads of 128 values), the
# one-split shortcut, and the checks of chapter 08's wrapper moved into the kernel (the optional
# part at the end says why). Their public wrapper, `kvlab.attention.paged_attention.fast_paged_decode_attention`,
# refuses what chapter 08's wrapper refuses. Your kernels (each once it passes its checker; until then
# the reference stands in), launched one after the other, must give what it gives, and what
# the oracle gives, on random layouts: page sizes 1, 3 and 16, grouped and plain multi-head
# attention, ragged lengths, one to five splits.

# %%
from kvlab.attention.paged_attention import FastConfig, fast_paged_decode_attention

split_kernel = kvlab.check.choose(
    "split_attention", my_split_attention_kernel, kvlab.solutions.get("split_attention")
)
merge_kernel = kvlab.check.choose(
    "merge_splits", my_merge_splits_kernel, kvlab.solutions.get("merge_splits")
)


def notebook_fast_attention(
    q, k_pool, v_pool, page_table, rows, lens, num_splits, block_n=16
):
    """The two passes of this section: partial results per split, then their merge."""
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    o = torch.empty(batch, heads, num_splits, head_dim, device=q.device)
    lse = torch.empty(batch, heads, num_splits, device=q.device)
    out = torch.empty(batch, heads, head_dim, device=q.device)
    rows, lens = rows.to(q.device, torch.int64), lens.to(q.device, torch.int64)
    block_d = max(16, triton.next_power_of_2(head_dim))
    split_kernel[(batch, kv_heads, num_splits)](
        q,
        k_pool,
        v_pool,
        page_table,
        rows,
        lens,
        o,
        lse,
        1.0 / head_dim**0.5,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        page_table.stride(0),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        lse.stride(0),
        lse.stride(1),
        head_dim,
        GROUP=heads // kv_heads,
        BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    merge_kernel[(batch, heads)](
        o,
        lse,
        lens,
        out,
        num_splits,
        o.stride(0),
        o.stride(1),
        o.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out


rng_lift = random.Random(9)
for trial in range(kvlab.base.runtime.pick(cpu=4, gpu=40)):
    P = [1, 3, 16][trial % 3]
    heads, kv_heads = rng_lift.choice([(8, 2), (4, 4), (6, 1)])
    args = random_paged_layout(
        200 + trial,
        P,
        [rng_lift.randint(1, 60) for _ in range(rng_lift.randint(1, 3))],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=16,
        device=device,
    )
    splits = rng_lift.randint(1, 5)
    ours = notebook_fast_attention(*args, num_splits=splits)
    theirs = fast_paged_decode_attention(
        *args, num_splits=splits, config=FastConfig(block_n=16)
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        theirs, paged_attention_reference(*args), atol=1e-5, rtol=1e-5
    )
print("your two kernels == kvlab's fast_paged_decode_attention == the oracle")

# %% [markdown]
# ## The rest of the step: compile it before capturing it
#
# Attention is one kernel per layer; a decode step of a transformers model is hundreds. Around
# each attention call the layer runs the model's own code, op by op: the norms (a cast, a
# square, a mean, a reciprocal square root, two multiplications), rotary embeddings, the
# activation, residual additions, each a kernel of a few microseconds that reads and writes
# its whole input. Chapter 10 replays the decode step from a CUDA graph, which removes the
# *host's* cost of launching them, not the GPU's cost of running them one after the other.
# `torch.compile` removes that: it traces the layer and fuses each run of small operations into
# one generated kernel. vLLM compiles its models by default; SGLang has `--enable-torch-compile`,
# which compiles the decode forward with `torch.compile(..., dynamic=False)` for the batch sizes
# it captures up to `--torch-compile-max-bs` (32 by default), and replays the larger ones
# uncompiled (`get_batch_sizes_to_capture` and `patch_model` in
# `python/sglang/srt/model_executor/cuda_graph_runner.py`, sgl-project/sglang `0021673c`).
#
# `kvlab.serving.hf.PagedGenerator(..., compile_decode=True)` does it for the padded decode step, at
# start-up, before the graphs are captured (`kvlab.serving.hf.graphs.DecodeGraphs`), in two ways that
# keep it from compiling again while it serves:
#
# * the attention call is left out: `kvlab.serving.hf.plugin.kvlab_attention` is
#   `torch.compiler.disable`-d, a [graph break](glossary.md#graph-break) where a layer calls it.
#   The K/V store and the Triton kernels run as they are, and the pieces between two attention
#   calls (and so every layer) share one compiled version;
# * the batch size is a symbolic size (`dynamic=True`): every captured size uses the same
#   compiled code, instead of one compilation per size.
#
# Compiling fuses the small operations; it leaves the matrix products as they are, one library
# call each. At 64 running requests those are small too: each reads a few megabytes of weights
# and costs a few microseconds however little it reads, and a Llama, Qwen2 or Qwen3 layer does
# seven of them, three (q, k, v) and two (gate, up) of the same input. Serving engines load
# each group's weights side by side and compute it in one product (vLLM's `QKVParallelLinear`
# and `MergedColumnParallelLinear`): the same bytes, two launches instead of five.
# `kvlab.serving.hf.fuse` does the same to the model `PagedGenerator` serves, in place and without a
# copy (each projection's weight becomes a view of the group's rows), and `DecodeGraphs` runs
# its decode step that way; outside the step the model runs transformers' own code.
#
# Whether anything compiled after start-up is counted, not assumed:
# `kvlab.serving.hf.graphs.dynamo_graphs()` is the number of graphs `torch.compile` has built in the
# process, taken at the end of start-up and again after serving. The saved run measured the
# whole decode step of chapter 10's serving model (replayed from its CUDA graph) against its
# floor, the weights, every K/V byte of the contexts and the logits:

# %%
st = att["step"]
for r in st["rows"]:
    cells = ", ".join(
        f"{name} {e['replay_us'] / 1e3:.2f} ms ({e['ratio_to_floor']:.2f}x)"
        for name, e in r["paths"].items()
    )
    print(f"{r['batch']:>3} running requests: floor {r['floor_us'] / 1e3:.2f} ms "
          f"({r['bytes']['floor'] / 1e9:.2f} GB); {cells}")
print(
    "start-up:",
    ", ".join(f"{n} {s:.1f} s" for n, s in st["startup_s"].items()),
    "| graphs torch.compile built while serving:"
    f" {st.get('graphs_built_while_serving')}",
)

# %% [markdown]
# Compiling costs start-up time (the start-up line above: the compiled generator beside the
# others) and buys a shorter step at every size captured, so `PagedGenerator` compiles by default where it captures graphs (a
# GPU), and not in the interpreter, where there are no graphs to capture and compiling would
# only slow a chapter down (`compile_decode=` overrides it either way).
#
# Most of those seconds are the same work every time: the same model code, the same symbolic
# batch size, the same versions of torch and Triton. `torch.compile` caches what its last stage
# builds on disk (the compiled graphs and the Triton kernels it generated), by default in the
# system's temporary folder; `kvlab.serving.hf.compile_cache` points it at a folder of kvlab's own, one
# per torch, Triton and GPU, so the second start on a machine loads the kernels instead of
# compiling them. Only tracing the Python code and capturing the graphs are left. The saved run
# built the serving generator twice in fresh processes, on new, empty cache folders:

# %%
boot = att.get("startup")
if boot and "warm" in boot:
    starts = [f"{k}: {v['seconds']:.1f} s" for k, v in boot.items()
              if isinstance(v, dict) and "seconds" in v]
    cold = boot["cold"]
    print(", ".join(starts), f"({cold.get('sizes')} batch sizes captured,",
          f"{cold.get('dynamo_graphs')} graphs compiled)")
else:
    print("the saved run predates this measurement:",
          "python -m kvlab.bench --attention records it")

# %% [markdown]
# The targets of the saved run, and the whole picture:

# %% alt="Left: decode attention time over the memory floor on a log scale for batches of 1 to 256 and contexts of 512 to 32768 tokens, chapter 08's kernel far above, chapter 09's kernel and transformers' SDPA near the floor; right: the whole decode step's replay time over the floor with the fast kernels, with torch.compile, and with chapter 08's kernel, measured on the GPU the title names."
for t in att["targets"]:
    verdict = "n/a" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
    print(f"[{verdict}] {t['name']}: {t['measured']} ({t['rule']})")
fig = bench_plots.plot_attention(bench)
plt.show()

# %% [markdown]
# ### Where the step's time goes
#
# A ratio says how far the step is from its floor, not why. The floor is a sum, and so is the
# step: each of its few hundred kernels has bytes it must move, and so a floor of its own.
# `kvlab.bench.step_profile` profiles the CUDA-graph replay with `torch.profiler`, sorts the
# kernels into the kinds of work a layer does and puts each kind's time beside its floor. The
# picture is drawn from profiles saved in `figures/09_step_profile.json` and in the saved
# benchmark run (when it has one): faded, the step before its attention kernel stored the new
# K/V itself (the file names the commit), solid, the step the saved run measured.
#
# Read each bar against its black line:
#
# * **attention** moves most of the bytes (every K/V row of every context) and is the one kind
#   near its floor: at 256 running requests the GPU is full of programs; at 64 it has fewer
#   programs than it could run at once, and a program has few blocks to walk;
# * the **K/V store** was two `index_put` kernels per layer, 56 per step, to write 15 MB: a
#   few microseconds each, whatever they write. Question 3 below asks whether the split kernel
#   could store them itself: kvlab's now does, so a run recorded since has no such bar;
# * **matrix products** read every weight once, 1.2 GB, the output projection's included; at 64
#   running requests each is a few microseconds, well above what its bytes take;
# * **norms, rotary, activation**: what `torch.compile` fused, several small kernels per layer,
#   each far above its tiny floor: their time is the cost of a kernel, not of its bytes.

# %% alt="Horizontal bars, one panel for 64 and one for 256 running requests, of the decode step's GPU time per kind of kernel (attention, K/V store, matrix products, norms/rotary/activation, greedy choice, copies), a faded bar for the recorded run before the changes and a solid one after, with a black line at each kind's floor: attention close to its floor, the small kernels far above theirs, the K/V store gone after."
from kvlab.bench.decode_report import plot_step_profile
from kvlab.course.scenes.ch09_making_it_fast import step_profile_runs

runs = step_profile_runs(bench)
for run in runs:
    for r in run["rows"]:
        ratio = r["replay_us"] / r["floor_us"]
        print(f"{run['label']}: {r['batch']} running, {r['replay_us']:.0f} µs, "
              f"{ratio:.2f}x its floor of {r['floor_us']:.0f} µs")
fig = plot_step_profile(runs)
plt.show()

# %% [markdown]
# ## Optional: where the time of a public call goes
#
# *This part is optional.* It follows the host's side of a call, down to Triton's C launcher,
# pointers passed as addresses and [pinned](glossary.md#pinned-memory) memory: what matters when you tune a serving loop
# on a GPU. Nothing after it depends on it; skip to the summary if you like.
#
# A serving engine never calls these kernels bare. It calls `kvlab.PagedTokenAllocator`
# (`alloc_extend`, `alloc_decode`): host code that checks the arguments, counts the pages,
# launches, and takes the pages off the [free list](glossary.md#free-list). On a small batch the kernel itself runs for a
# few microseconds, so what a caller waits for is almost all host time, of three kinds:
#
# - **the [launch floor](glossary.md#launch-floor)**: the host work of one Triton launch, even of a kernel that does
#   nothing. `kernel[grid](...)` binds every argument and looks the compiled kernel up on every
#   call; the allocator keeps the compiled kernel and launches it directly
#   (`kvlab.base.launch.Launcher`), which is allowed because its kernels compile once for
#   every batch (integers typed `tl.int64`, no value or alignment specialisation). On its hot
#   path it goes one step further: it calls the compiled kernel's C launcher itself (skipping
#   the Python object around it) and passes its pointers as addresses, because for a tensor the
#   launcher calls `data_ptr()` and asks the CUDA driver whether the address is a device
#   pointer, a third of a microsecond per pointer, seven to nine pointers per launch;
# - **syncs**: `.item()`, `int(tensor)`, `.tolist()`, `if tensor.any():` on a GPU tensor make
#   the host wait until the GPU has finished everything queued, then copy the answer back. The
#   host cannot queue the next launch meanwhile, so the two stop overlapping;
# - **the host's own work**: checks, counting pages, allocating the output. Counting is the
#   surprise: in NumPy it takes about ten calls, and a NumPy call costs about a microsecond of
#   dispatch whatever the batch size, so counting 64 requests cost more than the launch. The
#   same pass as one C loop is one call (`kvlab.alloc.native_counts`, built once per machine with
#   the C compiler Triton uses for its own launchers; NumPy does it where there is none).
#
# The saved H200 run times each public call side by side with the [seed wrapper](glossary.md#seed-wrapper) (the source
# design's host code: one launch, `ret_values.item()`, the slice) and with the floor:

# %% alt="Log-scale bars of where the time of a public alloc_extend call (top) and alloc_decode call (bottom) goes for several batch sizes, comparing the fast allocator with and without a sync, the teaching allocator and the source's wrapper, against the cost of one launch and of a launch with a sync."
from kvlab.course.scenes.ch09_making_it_fast import public_call_rows

floor = bench["floor"]["paths"]
for name, what in [
    ("launch", "empty kernel, kernel[grid]()"),
    ("launch_kept", "empty kernel, compiled kernel kept"),
    ("launch_1_sync", "kept launch + one .item()"),
    ("launch_7_syncs", "kept launch + seven .item()"),
]:
    print(f"{what:>36}: {floor[name]['loop_us']:6.1f} µs per call")
sync_cost = floor["launch_1_sync"]["loop_us"] - floor["launch_kept"]["loop_us"]
print(f"one sync adds {sync_cost:.1f} µs to a call, even with nothing left to wait for")
print()
for row in public_call_rows(bench, page_size=16):
    print(row)
fig = bench_plots.plot_public_call(bench)
plt.show()

# %% [markdown]
# Read the picture against the two lines, one launch and one launch plus one sync. No public
# call reaches the floor: besides its launch the allocator checks the arguments, counts pages
# from the host copies and allocates the output, and on small batches that host work, not the
# GPU, sets the time of a call (compare the bars with the two lines). What the host lengths buy
# is the *wait*: with them the call never stops for the GPU, so
# a serving loop goes on preparing the next step while the kernel runs; without them it waits
# once, for the page count it needs before it may hand out pages. The seed wrapper waits once
# too, and its kernel recompiles per power of two and sums in O(bs²): its bars grow with the
# batch, the allocator's barely move. `figures/bench.md` has every case, the targets, and which
# of them this run met.
#
# ### Why checks must not cost syncs
#
# The first version of this allocator checked every rule the obvious way:
# `bad = (last_loc + 1) % P != prefix_lens % P; if bad.any(): raise ...`, one rule after another.
# Each `if` on a GPU tensor is a sync; seven of them cost more than the allocation itself (the
# `launch_7_syncs` line above), and fast and teaching kernels looked the same because the checks
# dominated. Turning the checks off is no answer: a wrong `last_loc` silently writes one request's
# KV into another's page. So the checks stay, and move to where they cost nothing:
#
# - rules on the lengths run on the **host copies** the scheduler already has
#   (`prefix_lens_cpu=`, `seq_lens_cpu=`), one pass over the whole batch (in C, or a few NumPy
#   operations). The same pass keeps every count exact: a length may be anything below 2**63,
#   and four requests of 2**62 tokens must not add up to a wrapped 0;
# - rules that need device data (`last_loc` on an allocated page, host copies equal to the
#   device tensors, via a checksum) run **inside the kernel's own pass**: every program checks
#   the whole batch before it writes anything and reaches the same verdict; a refused batch gets
#   slots of -1 and takes no page. The refusal is recorded on the device and raised by the next
#   call that reads the device anyway (a call without host lengths, `free`,
#   `check_device_errors()`, or a call the host refuses: the older error comes first), with the
#   allocator rolled back to just before the refused call. Until then the allocator's counters
#   (`num_free_pages`, `free_pages`) still count only the calls that stand: reading one after a
#   call with host lengths is a read of the device too.
#
# And where a call must wait (no host lengths: the page count has to come from the GPU), it
# waits once and copies nothing: the kernel writes its verdict into `ret_values`, which on a GPU
# is *pinned* host memory the GPU can write directly, so after the one wait for the stream the
# host reads the word where it lies. `.item()` on a GPU tensor would queue a copy and wait for
# that too.
#
# Here is that path on a small allocator (`eager_errors=False` makes it behave as on a GPU even
# in the interpreter, where reading the device would cost nothing):

# %%
t = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
alloc = kvlab.PagedTokenAllocator(num_pages=8, page_size=4, eager_errors=False)
# page 0, slots 0..2
alloc.alloc_extend(t([0]), t([3]), t([-1]), 3, prefix_lens_cpu=[0], seq_lens_cpu=[3])
before = alloc.state()
refused = alloc.alloc_extend(
    t([3]), t([6]), t([22]), 3, prefix_lens_cpu=[3], seq_lens_cpu=[6]
)  # 22: page 5, free
print("the call returned without waiting; its slots:", refused.tolist())
print(
    "free pages:",
    alloc.num_free_pages,
    "(the refused call's page is not counted: this read waits for the device)",
)
assert alloc.num_free_pages == 7, (
    f"{alloc.num_free_pages} free pages, expected 7 (the refused call's page not"
    " counted)"
)
try:
    alloc.check_device_errors()  # the one read of the device
    raise AssertionError("should have been refused")
except kvlab.InvalidArgument as err:
    print("raised at the next read:", err)
assert alloc.state().equals(before), "the refused call changed the allocator"
good = alloc.alloc_extend(
    t([3]), t([6]), t([2]), 3, prefix_lens_cpu=[3], seq_lens_cpu=[6]
)
print("with last_loc on the request's own page:", good.tolist())
alloc.check_device_errors()

# %% [markdown]
# Counting runs on the host, so it can be timed here on any machine: the same batch of 1024
# requests counted by the C helper and by the NumPy code (a NumPy array takes the NumPy path),
# with identical answers.

# %%
import timeit

from kvlab.alloc import host_checks as alloc_checks, native_counts

print("host counts:", native_counts.status())
pre_cpu = torch.tensor([rng.randrange(0, 500) for _ in range(1024)])
seq_cpu = pre_cpu + torch.tensor([rng.randrange(0, 300) for _ in range(1024)])
in_c = alloc_checks.extend_counts(pre_cpu, seq_cpu, 16)
in_numpy = alloc_checks.extend_counts(pre_cpu.numpy(), seq_cpu.numpy(), 16)
assert in_c == in_numpy, f"the C helper says {in_c}, NumPy {in_numpy}"
print(f"tokens {in_c.tokens}, new pages {in_c.pages}")
for label, args in [
    ("CPU tensors (C if built)", (pre_cpu, seq_cpu)),
    ("NumPy arrays", (pre_cpu.numpy(), seq_cpu.numpy())),
]:
    runs = timeit.repeat(
        lambda: alloc_checks.extend_counts(*args, 16), number=200, repeat=5
    )
    print(f"{label:>26}: {min(runs) / 200 * 1e6:5.1f} µs per count")

# %% [markdown]
# On a GPU the next cell measures it live: the floor, then one batch of 64 requests through every
# path, with the syncs each call makes counted by torch's sync debug mode. In the interpreter
# there is nothing to time (every program runs on the CPU); the saved numbers above are the
# measurement.

# %%
if kvlab.base.runtime.INTERPRET:
    print("interpreter: no live timings; see the saved H200 run above")
else:
    from kvlab.bench.public import bench_floor, bench_public_extend

    quiet = dict(smoke=False, log=lambda *a: None)
    live_floor = bench_floor(**quiet)["paths"]
    print(", ".join(f"{k} {v['loop_us']:.1f} µs" for k, v in live_floor.items()))
    live = bench_public_extend([(64, 512)], [16], **quiet)[0]
    for name, entry in live["paths"].items():
        print(
            f"{name:>20}: {entry['loop_us']:6.1f} µs per call, {entry['syncs']} sync(s)"
            " per call"
        )

# %% [markdown]
# ### The attention call: the same discipline
#
# `kvlab.attention.paged_attention.fast_paged_decode_attention` is a public call too, and chapter 08's wrapper,
# whose checks it started with, checks the obvious way: every row in range, every length in
# `[1, columns]`, every slot a request reads inside the pool, each an `if bad.any():` on a GPU
# tensor. On the H200 that made the call cost about 400 µs for kernels of a few microseconds,
# and about 100 µs even with the checks off (two launches through `kernel[grid]`, a device
# query for the split count, three allocations). Transformers' SDPA decode on the same shapes
# costs about 30 µs. The fast call now keeps every check and pays for none of them with a wait:
#
# - **what the host can judge, once**: types, shapes, dtypes, devices, strides, `scale`,
#   `num_splits`, `config`, `out_dtype` are judged the first time a combination is seen and
#   remembered as a plan (`kvlab.attention.attention_plan`), keyed by the shapes and the options *and
#   their types*: in Python `True == 1` and `numpy.int64(2) == 2`, so a cache keyed by values
#   alone would let a bool through on the back of a good int;
# - **what only the device knows, in the kernel**: the split kernel checks its request's row,
#   length and every slot it is about to read. A request that breaks a rule reads nothing
#   outside the pool and gets a NaN output, and the first refusal is written into a word of
#   [pinned](glossary.md#pinned-memory) memory. The host never waits for it: the next checked
#   call reads the word where it lies and raises it, or `check_attention_errors()` waits for the
#   GPU and raises it (in the interpreter, where reading costs nothing, the call raises at once);
# - **the launches**: after a plan's first call its two kernels are launched through their C
#   launchers with addresses, as the allocator's are, and the split count comes from the number
#   of multiprocessors, asked once per device.

# %%
from kvlab.attention.attention_rules import check_attention_errors

q, k_pool, v_pool, table, rows_, lens = random_paged_layout(2, 4, [6, 3], heads=4,
kv_heads=2, head_dim=16,
                                                            device=device)
bad_rows = rows_.clone()
# request 1 names a row the table does not have
bad_rows[1] = table.shape[0] + 2
try:
    fast_paged_decode_attention(q, k_pool, v_pool, table, bad_rows, lens)
    # on a GPU the refusal is raised here
    check_attention_errors()
    raise AssertionError("should have been refused")
except kvlab.InvalidArgument as err:
    print("refused:", err)
public = att.get("public")
if public:
    for r in public:
        p = r["paths"]
        calls = ", ".join(f"{name} {e['wall_us']:.0f} µs ({e['syncs']} syncs)"
                          for name, e in p.items())
        print(f"batch {r['batch']:>2} x {r['ctx']}: {calls}",
              f"| checked fast call / SDPA: {p['fast']['vs_sdpa']:.2f}")
else:
    print("the saved run predates this measurement:",
          "python -m kvlab.bench --attention records it")

# %% [markdown]
# ## Summary
#
# - **Compile once.** Sizes that vary per batch must be runtime arguments; loop over them in
#   fixed blocks. The teaching kernel recompiles per power of two of tokens (seconds each, in
#   the saved run); the fast one compiles once per page size and then costs well under a
#   millisecond on a shape it has never seen.
# - **Scan once.** Exclusive prefix sums give every request its output offset and first page;
#   one scan replaces every program re-summing its predecessors.
# - **Don't ask the GPU what the host knows.** With the counts from the scheduler there is no
#   sync, and out-of-pages is decided before anything reads `free_pages`.
# - **One formula per token.** The three parts of the source design are one expression of the
#   token's position; programs split the output evenly, whatever the request lengths.
# - **Launches cost host time.** On small batches the kernels finish in microseconds and the
#   host's launch overhead dominates; that is why the fast path uses one launch where it can,
#   and why the vectorised torch version (twenty launches) is the slowest of all.
# - **Host work is counted in calls, not elements.** A NumPy or Python-wrapper call costs about
#   a microsecond whatever it does: count the batch in one C call, launch through the C
#   launcher with addresses, and wait (when a call must) on pinned memory instead of `.item()`.
# - **Checks on values only the device holds belong in the kernel.** The fast attention call
#   judges shapes and options once per combination, and lets its kernel refuse a bad row,
#   length or slot, reporting through pinned memory: every check kept, no wait.
# - **Decode attention is bytes.** Measure it against the memory floor; read each K/V byte once
#   (the query heads of a group in one program, `tl.dot` for their scores), cut long requests
#   into splits so the GPU has programs to run, and merge the splits with the log-sum-exp,
#   subtracting the largest one. The rest of a decode step is many small kernels:
#   `torch.compile` before capture fuses them.
#
# `kvlab.PagedTokenAllocator` uses the fast path by default (`impl="fast"`); `impl="teaching"`
# keeps the chapter 03-04 kernels. `kvlab.serving.hf.PagedGenerator` decodes with this chapter's
# attention kernels (`attention="fast"`, the default; `"teaching"` keeps chapter 08's) and
# compiles its captured decode step (`compile_decode`). The full tables are in `figures/bench.md`.
#
# ## Questions
#
# 1. SGLang today loops over part 2 in blocks of 4096 and counts pages on the host, but keeps
#    `bs_upper` as a `constexpr`. For a server whose [prefill](glossary.md#prefill) batches have 1 to 256 requests,
#    how many versions of its extend kernel get compiled (per page size)? How would you get
#    that down to one, and what would each option cost?
# 2. The fast path uses one launch (`extend_fused_kernel`, every program scans the batch
#    itself) for batches of up to 4096 requests (while programs × requests stays under 2²¹),
#    and two launches (scan, then fill) above.
#    Which batches make the one-launch version do more work than the two-launch one, and why
#    is one launch still the better choice for most batches a server sees?
# 3. A decode step stores each request's new K/V with two torch `index_put` kernels per layer,
#    then the split kernel reads them back. Could the split kernel store them itself? Which
#    program would, and what must it make sure of before any program reads that slot?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# **1. Compilations per batch size.** `bs_upper = next_power_of_2(bs)` takes 9 values for
# `bs` in 1..256, so 9 compilations per page size, each paid the first time a batch of that
# size class arrives (in the middle of serving, unless the server warms them up at start):

# %% tags=["solution"]
print(
    "versions for bs = 1..256:",
    len({triton.next_power_of_2(bs) for bs in range(1, 257)}),
)

# %% [markdown] tags=["solution"]
# To get to one: (a) make `bs` a runtime argument and compute the offsets with a scan that
# walks the batch in fixed blocks with a carry (this chapter's `extend_scan_kernel`, one more
# launch, or each program scanning for itself as `extend_fused_kernel` does: O(bs) per
# program instead of O(bs²) in all); (b) compute `token_start` and `page_start` on the host,
# where `seq_lens_cpu` and `prefix_lens_cpu` already are, and pass them as tensors: no scan
# on the GPU at all, at the cost of a host-to-device copy of `2 × bs` integers per batch;
# (c) warm up all 9 versions at start-up: no code change, but start-up time and nine
# binaries per page size.
#
# **2. One launch or two.** In the fused kernel each of the `cdiv(T, 1024)` fill programs
# scans all `bs` lengths itself, so the batch as a whole does `bs × cdiv(T, 1024)` loads of
# lengths; the two-launch version does `bs` (one scan) plus a second launch. The fused one
# does more work when both are large, e.g. 1024 requests with 1024 tokens each: 1024
# programs each re-reading 1024 lengths, a million loads, about as many as the slots it
# writes. But most prefill batches are small (a few to a few hundred requests), and for
# those the repeated scan is a handful of vector loads per program, while a second launch
# costs host time on every call; a serving loop of small launches is bound by the host, as
# the benchmark above shows for the torch version with its twenty launches. Saving a launch
# wins there. The
# switch (`FUSED_MAX_BATCH = 4096` requests, `FUSED_MAX_SCANS = 2²¹` repeated loads) bounds that
# repeated work: each fused program walks the batch in blocks of `BATCH_BLOCK = 1024` lanes with
# a carry, and past the bounds the repeated scans would cost the GPU more than a second launch
# costs the host.
#
# **3. Storing the new K/V in the kernel.** Every program of a request and K/V head reads its
# own split, and exactly one split holds the new token's position `seq_len - 1`: the last live
# one. That program can store `k[b, g]` and `v[b, g]` at `page_table[row, seq_len - 1]`, saving
# two launches per layer (and the lookup of the slot). What it must make sure of: that no
# program reads the slot while it is being written. No *other* program reads it as long as the
# splits do not overlap and only the last one contains the new position (padded entries of a
# CUDA-graph batch all write the dummy slot, but none reads it). The storing program itself
# could store first and then read the row back, with a barrier between (`tl.debug_barrier()`:
# the threads that load a row are not always those that stored it). kvlab's split kernel does
# without the read: every program loads the new row from `k`/`v` into registers, masks the new
# position out of its pool loads and puts the registers' row in its place (`STORE` in
# `kvlab.attention.split_kernels`). The price is a kernel that does two jobs, and a contract
# (`paged_attention_step`: store, then attend) that the kernel now keeps in a way the host
# cannot check; the profile above shows what it bought.
