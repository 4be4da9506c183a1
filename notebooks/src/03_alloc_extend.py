# %% [markdown]
# # 03 · The three-part `alloc_extend_kernel`
#
# **Time:** about 90 minutes. **Assumes:** chapters 00-02, and chapter 01's Triton primer in
# particular (`tl.program_id`, `tl.num_programs`, masks, `other=0`, masked sums).
#
# **Goal.** Rebuild the heart of SGLang's `PagedTokenToKVPoolAllocator`: one Triton launch that
# hands out a KV [slot](glossary.md#token-slot) to *every* new token of *every* request in a batch. You will derive the
# [three parts](glossary.md#three-parts) of the kernel by hand on the source's worked example, see how each [program](glossary.md#program) finds
# its place with the [masked](glossary.md#mask) sums of chapter 01's primer, run the kernel and validate it against a
# plain-Python reference, write its slots into a [page table](glossary.md#page-table), see what goes wrong when [pages](glossary.md#page) run
# out (and how the allocator avoids it), compare the source's kernel with SGLang's today, and
# finally write the three parts yourself.
#
# **The terms.** Chapter 00 called a step that grows a request's KV from `pre` to `seq` tokens an
# **[extend](glossary.md#extend)**; a [prefill](glossary.md#prefill) is an extend from 0 (or from a [prefix-cache hit](glossary.md#cache-hit), or from the previous
# chunk of a long prompt). The allocator receives one value per request, for a whole batch:
#
# | name | meaning |
# |---|---|
# | `prefix_lens` | tokens already in the [KV cache](glossary.md#kv-cache) before this batch (`pre`) |
# | `seq_lens` | tokens the request should have after this batch (`seq`) |
# | [`last_loc`](glossary.md#last-loc) | the physical slot of the last prefix token (`-1` when `pre == 0`) |
# | `extend_num_tokens` | new tokens in the whole batch, `sum(seq - pre)` |
# | `out_indices` | the answer: one physical slot per new token, requests one after another |
#
# Slots come in pages of `P = page_size`: page `k` owns slots `k*P ... k*P + P - 1`. A request
# keeps writing into its last page until it is full, then takes a fresh page from the front of
# `free_pages`. Because the token at logical position `t` always sits at offset `t % P` of its
# page, `last_loc` and `pre` must agree: `(last_loc + 1) % P == pre % P`.

# %%
import random

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

import kvlab
from kvlab.course.scenes.ch02_page_table import before_after_figure
from kvlab.course.scenes.ch03_alloc_extend import (
    draw_logical,
    draw_page_reads,
    prefill_then_extend,
    small_example,
    two_views_figure,
    worked_example,
)
from kvlab.alloc.alloc_kernels import alloc_extend_kernel
from kvlab.course.reference.alloc_ref import (
    alloc_extend_ref,
    kernel_page_reads_extend,
    pages_needed_extend,
    part_lengths,
    unpack_ret_value,
)

torch.manual_seed(0)
device = kvlab.DEVICE
print("device:", device)

# %% [markdown]
# ## The picture
#
# Three requests on pages of 4 slots. `r0` has 3 tokens cached and grows to 9; `r1` has exactly
# one full page (4) and grows to 12; `r2` is new (0 → 2). The two panels show the same slots
# from two sides, so read their numbers differently:
#
# - **top, logical view**: a column is a *token position* of the request; the number in it is
#   the *physical slot* that position got;
# - **bottom, physical view**: a column is a *slot of the pool*; the number in it is the *token
#   position* stored there.
#
# Colour says *how* the slot was found, in both:
#
# - **part 1** (orange) fills the rest of the request's last, partly used page: `last_loc + 1, ...`
# - **part 2** (green) takes whole new pages;
# - **part 3** (red) takes one more new page and fills only its beginning.

# %% alt="Two views of one alloc_extend for three requests on pages of 4 slots: the logical view gives each token position its physical slot, the physical view shows the same slots in the pool, coloured by prefix, part 1 (rest of the old page), part 2 (whole new pages) and part 3 (a new last page)."
pic = small_example()
fig = two_views_figure(
    pic,
    12,
    ["r0: 3 -> 9", "r1: 4 -> 12", "r2: 0 -> 2"],
    ["r0", "r1", "r2"],
    annotate=True,
)
plt.show()
print("free_pages before the extend:", pic.free_before)
print("out_indices:", pic.plan.out_indices)

# %% [markdown]
# ## The three parts by hand: the worked example
#
# The [source design](glossary.md#source-design)'s example has `P = 64` and two requests:
#
# - **A**: `pre = 70`, `seq = 190`. Its 70 cached tokens are positions 0..69; the last of them,
#   position 69, sits at offset `69 % 64 = 5` of its second page, so the first new token,
#   position 70, goes to offset 6 (`70 % 64`): `last_loc + 1`.
# - **B**: `pre = 128`, `seq = 260` (a page-aligned prefix: two full pages).
#
# With `ceil(pre/P)*P` = the end of the prefix's last page and `floor(seq/P)*P` = the start of
# the request's last page after the extend:
#
# ```
# num_part1 = min(seq, ceil(pre/P)*P) - pre       rest of the old page
# num_part2 = floor(seq/P)*P - ceil(pre/P)*P      whole new pages
# num_part3 = seq - floor(seq/P)*P                the new last page, partly filled
# ```
#
# (If part 1 already reaches `seq`, the request stays in its old page and parts 2 and 3 are 0.)

# %%
P = 64
for name, pre, seq in [("A", 70, 190), ("B", 128, 260)]:
    ceil_pre = -(-pre // P) * P
    floor_seq = seq // P * P
    n1 = min(seq, ceil_pre) - pre
    n2 = floor_seq - ceil_pre
    n3 = seq - floor_seq
    new_pages = -(-seq // P) - (-(-pre // P))
    print(
        f"{name}: pre={pre:3d} seq={seq:3d}  ceil(pre/P)*P={ceil_pre:3d} "
        f" floor(seq/P)*P={floor_seq:3d}  ->  part1={n1:3d}  part2={n2:3d} "
        f" part3={n3:2d}   new pages={new_pages}"
    )
    assert (n1, n2, n3) == part_lengths(pre, seq, P), (
        f"{name}: parts ({n1}, {n2}, {n3}), the reference says"
        f" {part_lengths(pre, seq, P)}"
    )

assert part_lengths(70, 190, 64) == (
    58,
    0,
    62,
), f"A: {part_lengths(70, 190, 64)}, expected (58, 0, 62)"
assert part_lengths(128, 260, 64) == (
    0,
    128,
    4,
), f"B: {part_lengths(128, 260, 64)}, expected (0, 128, 4)"
print(
    "4 new pages in all; out_indices = [A 58 | A 62 | B 128 | B 4] =",
    58 + 62 + 128 + 4,
    "slots",
)

# %% [markdown]
# A needs no new page for its first 58 tokens (they fill its old page up to offset 63) and one
# new page for the remaining 62. B's prefix ends exactly on a page boundary, so part 1 is empty;
# it takes two whole pages (128 tokens) and a third page for the last 4.
#
# ## Who writes where? One program per request
#
# The kernel runs one program per request (`grid = (bs,)`). Every program writes its slots into
# one shared `out_indices`, so it must know **where its slots start** (the new tokens of all
# requests before it) and **which free pages are its own** (the new pages of all requests before
# it; pages are handed out from the front of `free_pages` in request order). There is no
# communication between programs: each one loads the lengths of requests `0..pid`, with a mask,
# and sums them itself. That is primer 4 of chapter 01 (`sum_upto_kernel`), twice:
#
# ```
# load_offset = tl.arange(0, bs_upper)          # bs_upper = next_power_of_2(bs)
# seq_lens = tl.load(seq_lens_ptr + load_offset, mask=load_offset <= pid, other=0)
# output_start_loc   = tl.sum(seq_lens - pre_lens) - my_extend_len
# new_page_start_loc = tl.sum(new_pages_of_each) - my_new_pages
# ```
#
# The same in torch, for the worked example:

# %%
pre_lens = torch.tensor([70, 128])
seq_lens = torch.tensor([190, 260])
bs = len(pre_lens)
bs_upper = triton.next_power_of_2(bs)
load_offset = torch.arange(bs_upper)
for pid in range(bs):
    mask = load_offset <= pid                            # requests 0..pid
    seq_m = torch.zeros(bs_upper, dtype=torch.int64)     # masked lanes read 0 (other=0)
    pre_m = torch.zeros(bs_upper, dtype=torch.int64)
    seq_m[mask] = seq_lens[: pid + 1]
    pre_m[mask] = pre_lens[: pid + 1]
    new_pages_each = (seq_m + P - 1) // P - (pre_m + P - 1) // P
    my_len = int(seq_lens[pid] - pre_lens[pid])
    my_pages = int(new_pages_each[pid])
    output_start_loc = int((seq_m - pre_m).sum()) - my_len
    new_page_start_loc = int(new_pages_each.sum()) - my_pages
    print(
        f"program {pid}: mask={mask.int().tolist()} "
        f" output_start_loc={output_start_loc:3d} "
        f" new_page_start_loc={new_page_start_loc}  (takes"
        f" free_pages[{new_page_start_loc}:{new_page_start_loc + my_pages}])"
    )
assert (output_start_loc, new_page_start_loc) == (120, 1), (
    f"program 1 starts at {output_start_loc} and page {new_page_start_loc}, expected"
    " 120 and 1"
)

# %% [markdown]
# Every program re-sums *all* earlier requests: `bs` programs × `bs` [lanes](glossary.md#lane) = O(bs²) work for a
# batch. Fine for a few hundred requests; chapter 09 does it with one prefix sum instead.
#
# ## One program, written out in plain Python
#
# Before the kernel, here is what a single program does, as a Python function writing into a
# shared list. Running it for every `pid` (in any order: programs are independent) gives the
# whole answer.

# %%
def one_program(pid, pre_lens, seq_lens, last_loc, free_pages, out, P):
    pre, seq = pre_lens[pid], seq_lens[pid]
    out_start = sum(s - p for p, s in zip(pre_lens[:pid], seq_lens[:pid]))
    page_start = sum(
        -(-s // P) - (-(-p // P)) for p, s in zip(pre_lens[:pid], seq_lens[:pid])
    )
    my_pages = -(-seq // P) - (-(-pre // P))
    # part 1: the rest of the old page, right after last_loc
    n1 = min(seq, -(-pre // P) * P) - pre
    for k in range(n1):
        out[out_start + k] = last_loc[pid] + 1 + k
    if pre + n1 == seq:
        return
    # part 2: whole new pages
    n2 = seq // P * P - (-(-pre // P)) * P
    for k in range(n2):
        out[out_start + n1 + k] = free_pages[page_start + k // P] * P + k % P
    if pre + n1 + n2 == seq:
        return
    # part 3: the new last page, from offset 0
    n3 = seq - seq // P * P
    last_page = free_pages[page_start + my_pages - 1]
    for k in range(n3):
        out[out_start + n1 + n2 + k] = last_page * P + k


# the worked example: A's prefix ends at offset 5 of page 2, B's fills page 1
ex_pre, ex_seq, ex_last, ex_free = (
    [70, 128],
    [190, 260],
    [2 * 64 + 5, 1 * 64 + 63],
    [7, 3, 9, 5, 11, 12],
)
out = [None] * sum(s - p for p, s in zip(ex_pre, ex_seq))
for pid in reversed(range(2)):  # order does not matter
    one_program(pid, ex_pre, ex_seq, ex_last, ex_free, out, 64)
print("A part 1:", out[:3], "...", out[55:58])
print("A part 3:", out[58:61], "...", out[117:120], " (page 7)")
print("B part 2:", out[120:123], "...", out[245:248], " (pages 3, 9)")
print("B part 3:", out[248:], " (page 5)")
assert out == alloc_extend_ref(ex_pre, ex_seq, ex_last, ex_free, 64).out_indices, (
    "one_program's slots differ from the reference's")

# %% [markdown]
# ## The kernel
#
# `kvlab.alloc.alloc_kernels.alloc_extend_kernel` is `one_program` as one Triton program, mirroring the source
# design line by line. Its first half is the bookkeeping above, in Triton (every piece is from
# chapter 01's primer: `tl.program_id`, a masked `tl.load` with `other=0`, `tl.sum`, and
# `tl.arange` over a power of two):
#
# ```python
# pid = tl.program_id(0)                               # this program serves request pid
# offs_bs = tl.arange(0, bs_upper)       # bs_upper = next_power_of_2(bs): a constexpr
# seq_lens = tl.load(seq_lens_ptr + offs_bs, mask=offs_bs <= pid, other=0)  # 0..pid
# pre_lens = tl.load(pre_lens_ptr + offs_bs, mask=offs_bs <= pid, other=0)
# seq_len = tl.load(seq_lens_ptr + pid)
# pre_len = tl.load(pre_lens_ptr + pid)
# sum_extend_lens = tl.sum(seq_lens - pre_lens)             # new tokens of 0..pid
# output_start_loc = sum_extend_lens - (seq_len - pre_len)  # ... of 0..pid-1
# num_new_pages = ((seq_lens + page_size - 1) // page_size
#                  - (pre_lens + page_size - 1) // page_size)
# num_new_pages_self = ((seq_len + page_size - 1) // page_size
#                       - (pre_len + page_size - 1) // page_size)
# sum_num_new_pages = tl.sum(num_new_pages)                 # new pages of 0..pid
# new_page_start_loc = sum_num_new_pages - num_new_pages_self  # my first free page
# ```
#
# (The source calls `offs_bs` `load_offset` and `num_new_pages_self` `num_page_start_loc_self`;
# this chapter uses names that say what they hold.) Its second half is `one_program`'s three
# loops, written as masked stores: that is **your exercise** at the end of this chapter, so the
# chapter runs the package's kernel until then.
#
# Three sizes are [compile-time constants](glossary.md#constexpr) (`tl.constexpr`), because each is a `tl.arange` length:
# `bs_upper = next_power_of_2(bs)` for the masked sums, `page_size` for parts 1 and 3 (at most
# one page each), and `max_num_extend_tokens = next_power_of_2(extend_num_tokens)` for part 2,
# which may span many pages. On a GPU every new value of one of them compiles a new kernel:
# a cost chapter 09 measures and removes.
#
# Two small departures from the source's text. The masked loads give `other=0`: Triton documents
# a masked-off lane without `other` as undefined, and these lanes go into `tl.sum` (the source
# leaves `other` out). And part 1's `min(seq_len, ...)` is written `tl.minimum(...)`: a style
# choice, not a fix, since compiled Triton turns the built-in `min` into `tl.minimum` and the
# [interpreter](glossary.md#interpreter) runs it as Python's `min` (SGLang writes `min`).
#
# Launch it on the worked example, exactly as the allocator does:

# %%
def launch_extend(kernel, pre, seq, last, free_pages, P):
    """Run an alloc_extend kernel on lists; return (out_indices, ret_value)."""
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    n_tokens = sum(s - p for p, s in zip(pre, seq))
    out = torch.full((n_tokens,), -1, dtype=torch.int64, device=device)
    ret = torch.zeros(1, dtype=torch.int64, device=device)
    bs = len(pre)
    kernel[(bs,)](
        as_t(pre),
        as_t(seq),
        as_t(last),
        as_t(free_pages),
        out,
        ret,
        triton.next_power_of_2(bs),
        P,
        max(1, triton.next_power_of_2(n_tokens)),
    )
    return out.cpu(), int(ret.item())


out, ret = launch_extend(alloc_extend_kernel, ex_pre, ex_seq, ex_last, ex_free, 64)
assert (
    out.tolist() == alloc_extend_ref(ex_pre, ex_seq, ex_last, ex_free, 64).out_indices
), "the kernel's slots differ from the reference's"
# A 58: old page 2
assert out[:58].tolist() == list(range(2 * 64 + 6, 3 * 64)), (
    f"A's part 1: {out[:58].tolist()[:4]} ...")
# A 62: new page 7
assert out[58:120].tolist() == list(range(7 * 64, 7 * 64 + 62)), (
    f"A's part 3: {out[58:120].tolist()[:4]} ...")
assert out[120:248].tolist() == list(range(3 * 64, 4 * 64)) + list(
    range(9 * 64, 10 * 64)
), (  # B 128
    f"B's part 2: {out[120:248].tolist()[:4]} ..."
)
# B 4: new page 5
assert out[248:].tolist() == [5 * 64 + k for k in range(4)], (
    f"B's part 3: {out[248:].tolist()}")
print("the kernel reproduces [A 58 | A 62 | B 128 | B 4]")

# %% [markdown]
# ### `ret_values`: two counts in one int64
#
# The host needs two numbers back: how many pages to remove from `free_pages`, and how many
# tokens were written. The last program has summed every request, so it packs both into one
# 64-bit integer, pages in the high 32 bits, tokens in the low 32:
# `(num_new_pages << 32) | extend_num_tokens`. One `.item()` reads it: the host waits for the GPU
# to finish the kernel and copy the number back (a *[sync](glossary.md#sync)*). The store comes before part 1 in the
# kernel, because parts 1 and 2 may `return` early.

# %%
pages, tokens = ret >> 32, ret & 0xFFFF_FFFF
print(
    f"ret_values = {ret:#x} = {ret}  ->  pages = ret >> 32 = {pages}, tokens = ret &"
    f" 0xFFFFFFFF = {tokens}"
)
assert (pages, tokens) == unpack_ret_value(ret) == (4, 252), (
    f"pages {pages}, tokens {tokens}: expected 4 and 252")

# %% [markdown]
# ## Validate against the reference on random batches
#
# `kvlab.course.reference.alloc_ref.alloc_extend_ref` is the same computation as plain Python loops, request
# by request. Random batches with page sizes 1, 16 and 64; prefixes that are empty, page-aligned
# or not; some empty extends (`seq == pre`). Prefixes live on pages of their own and the [free list](glossary.md#free-list)
# is shuffled, as it would be after a while of serving.

# %%
def random_batch(rng, P, bs):
    pre = [
        rng.choice([0, rng.randint(0, 3 * P), rng.randint(1, 3) * P]) for _ in range(bs)
    ]
    seq = [p + rng.choice([0, rng.randint(1, P), rng.randint(P, 3 * P)]) for p in pre]
    n_prefix_pages = sum(-(-p // P) for p in pre)
    pages = list(range(n_prefix_pages + pages_needed_extend(pre, seq, P) + 3))
    rng.shuffle(pages)
    last, at = [], 0
    # each prefix on pages of its own; last_loc at offset (p - 1) % P of its last page
    for p in pre:
        n = -(-p // P)
        last.append(pages[at + n - 1] * P + (p - 1) % P if p else -1)
        at += n
    return pre, seq, last, pages[at:]


rng = random.Random(0)
n_trials = kvlab.base.runtime.pick(cpu=9, gpu=200)
seen = {"aligned": 0, "unaligned": 0, "empty prefix": 0, "empty extend": 0}
for trial in range(n_trials):
    P = [1, 16, 64][trial % 3]
    pre, seq, last, free = random_batch(rng, P, rng.randint(1, 6))
    got, ret = launch_extend(alloc_extend_kernel, pre, seq, last, free, P)
    plan = alloc_extend_ref(pre, seq, last, free, P)
    assert got.tolist() == plan.out_indices, (P, pre, seq)
    assert unpack_ret_value(ret) == (plan.num_new_pages, len(plan.out_indices)), (
        f"ret_values {unpack_ret_value(ret)}, expected ({plan.num_new_pages},"
        f" {len(plan.out_indices)})"
    )
    assert len(set(got.tolist())) == got.numel(), (  # no slot handed out twice
        f"a slot handed out twice in {got.tolist()}")
    seen["aligned"] += sum(p > 0 and p % P == 0 for p in pre)
    seen["unaligned"] += sum(p % P != 0 for p in pre)
    seen["empty prefix"] += pre.count(0)
    seen["empty extend"] += sum(p == s for p, s in zip(pre, seq))
print(f"kernel == reference on {n_trials} random batches; requests seen: {seen}")
assert all(v > 0 for v in seen.values()), f"some kind of request never came up: {seen}"

# %% [markdown]
# ## The allocator around the kernel
#
# `kvlab.PagedTokenAllocator` owns `free_pages`, where every page id `0..num_pages-1` is usable.
# **[Departure](glossary.md#departure):** SGLang keeps page 0 out of its free list: its `clear()` starts it as
# `free_pages = arange(1, num_pages + 1)` ("the padded slot 0 is used for writing dummy outputs
# from padded tokens", `python/sglang/srt/mem_cache/allocator.py`), so its pool has
# `num_pages + 1` pages and padded requests write into page 0. kvlab pads nothing (as chapter
# 02's unmapped [dummy row](glossary.md#dummy-row)), so page 0 is an ordinary page here. The allocator
# wraps the launch in five steps: (1) check the arguments, (2) count the new pages on the host,
# (3) refuse with `OutOfPages` if there are too few, (4) launch, (5) drop the used pages from the
# front of `free_pages`. With `impl="teaching"` step 4 launches this chapter's kernel (the
# default, `"fast"`, launches chapter 09's kernels, which hand out the same slots). Here it gives
# three requests their prefixes, then extends them (its free list is shuffled first, as it would
# be after a while of serving):

# %%
alloc = kvlab.PagedTokenAllocator(num_pages=12, page_size=4, impl="teaching")
# page 0 too (SGLang: 1..num_pages)
assert sorted(alloc.free_pages.tolist()) == list(range(12)), (
    "a new allocator should hold every page, page 0 included")
alloc.free_pages = torch.tensor([5, 2, 9, 0, 7, 3, 10, 1, 8, 6, 4, 11], device=device)
prefix = alloc.alloc_extend(
    torch.tensor([0, 0, 0], device=device),
    torch.tensor([3, 4, 0], device=device),
    torch.tensor([-1, -1, -1], device=device),
    extend_num_tokens=7,
)
print("prefix slots:", prefix.tolist(), "  free_pages:", alloc.free_pages.tolist())
# r2 has no prefix
last_loc = torch.tensor([int(prefix[2]), int(prefix[6]), -1], device=device)
out = alloc.alloc_extend(
    torch.tensor([3, 4, 0], device=device),
    torch.tensor([9, 12, 2], device=device),
    last_loc,
    extend_num_tokens=16,
)
print("extend slots:", out.tolist())
print(
    "free_pages:",
    alloc.free_pages.tolist(),
    f"  available_size() = {alloc.available_size()} tokens",
)

# %% [markdown]
# ### Into the page table
#
# `out_indices` is only useful once it is recorded: the server writes each request's run of it
# into the request's row of the page table (chapter 02), at the columns of its new positions,
# `pre .. seq - 1`. Before (only the prefixes mapped) and after this batch, with the cells the
# batch wrote outlined; colour is the physical page:

# %% alt="A page table before and after alloc_extend's out_indices are written into it: the prefixes of rows 0 and 1 stay where they were, and the 16 new entries of rows 0, 1 and 2 are outlined in red."
pre_b, seq_b = [3, 4, 0], [9, 12, 2]
table = kvlab.new_page_table(3, 12, 4)  # 3 request rows (+ the spare row), 12 positions
at = 0
for r, n in enumerate(pre_b):  # the prefixes, from the first alloc_extend
    table[r, :n] = prefix[at:at + n]
    at += n
table_before = table.clone()
at = 0
for r, (pre_r, seq_r) in enumerate(zip(pre_b, seq_b)):  # request r's run of out_indices
    table[r, pre_r:seq_r] = out[at:at + seq_r - pre_r]
    at += seq_r - pre_r
assert at == out.numel(), f"{at} slots written of {out.numel()}"
fig = before_after_figure(
    table_before,
    table,
    4,
    title="alloc_extend's out_indices written into the page table (page_size 4)",
)
plt.show()
# every position mapped; each logical page in one physical page
for r, n in enumerate(seq_b):
    row = table[r, :n]
    pos = torch.arange(n, device=row.device)
    assert (row >= 0).all() and (row // 4 == row[(pos // 4) * 4] // 4).all(), (
        f"request {r}: a position unmapped, or a logical page over two physical pages:"
        f" {row.tolist()}"
    )
    assert (row % 4 == pos % 4).all(), (  # position t sits at offset t % P
        f"request {r}: a position not at its offset t % 4: {row.tolist()}")
print(
    "each row maps exactly its seq_len positions; position t sits at offset t % 4 of"
    " its page"
)

# %% [markdown]
# ## Where the slots land
#
# The worked example, coloured by part, in the same two views as the first picture (top:
# column = token position; bottom: column = slot in the pool; no numbers, the pages are 64 wide).
# Page boundaries are the vertical lines. Part 1 continues the old page, parts 2 and 3 start new
# pages at offset 0, anywhere in the pool.

# %% alt="The worked example on pages of 64 slots, request A growing from 70 to 190 tokens and B from 128 to 260, in the logical and the physical view: part 1 continues A's old page, parts 2 and 3 take new pages anywhere in the pool."
pic = worked_example()
fig = two_views_figure(
    pic,
    10,
    ["A: 70 -> 190", "B: 128 -> 260"],
    ["A", "B"],
    logical_title="logical view: row = request, column = token position (page_size 64)",
    pool_title="physical view: row = request, column = slot in the KV pool (10 pages)",
)
plt.show()

# %% [markdown]
# And a random batch on pages of 16 (seeded), in the logical view (column = token position):

# %% alt="A random batch of five requests on pages of 16 slots in the logical view: each row shows the request's cached prefix, then its new tokens coloured by part 1, part 2 and part 3."
rng = random.Random(3)
pre_r = [rng.choice([0, 5, 16, 21]) for _ in range(5)]
seq_r = [p + rng.randint(0, 40) for p in pre_r]
free_r = list(range(24))
rng.shuffle(free_r)
pic_r = prefill_then_extend(pre_r, seq_r, 16, free_r)
fig, ax = plt.subplots(figsize=(8.4, 2.8))
draw_logical(
    pic_r,
    ax,
    names=[f"{p} -> {s}" for p, s in zip(pre_r, seq_r)],
    title=(
        "logical view: row = request (pre -> seq), column = token position"
        " (page_size 16)"
    ),
)
fig.tight_layout()
plt.show()
assert (
    pic_r.plan.out_indices == alloc_extend_ref(
        pre_r,
        seq_r,
        [int(pic_r.table[r, p - 1]) if p else -1 for r, p in enumerate(pre_r)],
        pic_r.free_before,
        16,
    ).out_indices
), "the picture's slots differ from the reference's"

# %% [markdown]
# ## When pages run out
#
# In the source design the host launches the kernel **first**, reads [`ret_values`](glossary.md#ret-values), and only then
# checks `num_new_pages > len(free_pages)` and returns `None` (SGLang still launches first
# today: see the box below). By then every program has already
# loaded its page ids from `free_pages`, and a program whose pages lie past the end of the
# tensor has read memory that is not `free_pages` at all. On a GPU that is undefined behaviour
# (garbage slots, or an illegal-address error); in the Triton interpreter, a raw out-of-bounds
# read can crash the whole process.
#
# Which positions would the programs read? The reference knows without running anything:

# %% alt="The positions of free_pages that each request's program reads when there are too few pages: r2's program reads two positions past the end of the five-entry free_pages, hatched in red."
short_pre, short_seq = [3, 4, 0], [9, 12, 10]
short_free = [7, 3, 10, 1, 8]
reads = kernel_page_reads_extend(short_pre, short_seq, 4)
print("positions of free_pages each program reads:", reads)
print(
    "needed:", pages_needed_extend(short_pre, short_seq, 4), " free:", len(short_free)
)
draw_page_reads(short_pre, short_seq, 4, short_free, names=["r0", "r1", "r2"])
plt.show()

# %% [markdown]
# To *see* the over-read without touching memory we do not own, give the kernel a `free_pages`
# that is padded with a sentinel tail (page id `-99`): the kernel cannot tell the padding from
# real pages, so the "pages" it reads past the real end turn up in `out_indices` as
# `-99 * 4 + k`, slots that do not exist.

# %%
SENTINEL = -99
padded = short_free + [SENTINEL] * 8  # the real list, then a tail we own
short_last = [2 * 4 + 2, 5 * 4 + 3, -1]  # r0's prefix on page 2, r1's on page 5
got, ret = launch_extend(
    alloc_extend_kernel, short_pre, short_seq, short_last, padded, 4
)
print("out_indices:", got.tolist())
print("ret_values says", ret >> 32, "pages were needed; only", len(short_free), "exist")
bogus = [x for x in got.tolist() if x < 0]
print("slots built from the sentinel:", bogus)
assert bogus and all(
    x // 4 == SENTINEL for x in bogus
), f"no slot built from the sentinel: {got.tolist()}"

# %% [markdown]
# **The fix is an ordering.** `PagedTokenAllocator` counts the pages on the host *before* the
# launch: `sum(ceil(seq/P) - ceil(pre/P))` is cheap. Too few, and it raises `kvlab.OutOfPages`
# (a `RuntimeError` whose message says how many were needed and free) without launching
# anything, so `free_pages` is exactly as it was. Broken arguments raise `InvalidArgument` (a
# `ValueError` naming the argument and the rule), also before the launch.

# %%
alloc = kvlab.PagedTokenAllocator(num_pages=11, page_size=4)
# 7 of the 11 pages free
alloc.free_pages = torch.tensor([2, 5, 7, 3, 10, 1, 8], device=device)
# the prefixes take pages 2 and 5, so 5 pages stay free for the extend
alloc.alloc_extend(
    torch.tensor([0, 0], device=device),
    torch.tensor([3, 4], device=device),
    torch.tensor([-1, -1], device=device),
    7,
)
before = alloc.state()
args = (torch.tensor(short_pre, device=device), torch.tensor(short_seq, device=device),
        torch.tensor(short_last, device=device), sum(short_seq) - sum(short_pre))
try:
    alloc.alloc_extend(*args)
    raise AssertionError("should have been refused")
except kvlab.OutOfPages as err:
    print("OutOfPages:", err)
assert alloc.state().equals(before), "a refused alloc_extend changed the allocator"
print("free_pages unchanged:", alloc.free_pages.tolist())

try:
    alloc.alloc_extend(
        torch.tensor([3], device=device),
        torch.tensor([9], device=device),
        # last_loc 5 is offset 1, but pre=3 needs offset 2
        torch.tensor([5], device=device),
        6,
    )
except kvlab.InvalidArgument as err:
    print("InvalidArgument:", err)
assert alloc.state().equals(before), "a refused alloc_extend changed the allocator"

# %% [markdown]
# ## Box: the source's kernel and SGLang's today
#
# This chapter's kernel is SGLang's `alloc_extend_kernel` as the source design (the study notes
# this course is built from) wrote it. SGLang has changed it since. In its
# `python/sglang/srt/mem_cache/allocator.py` (main branch, at the time of writing):
#
# | | the source design (this chapter) | SGLang today |
# |---|---|---|
# | part 2 | one `tl.arange(0, max_num_extend_tokens)`, a constexpr `next_power_of_2(extend_num_tokens)`: a compilation per power of two, and every program touches that many lanes | a loop with a runtime trip count over blocks of 4096 lanes (`BLOCK_EXTEND`): one compilation serves every extend length, and a request with no whole pages does no iterations |
# | `max_num_extend_tokens` | a kernel argument | gone |
# | the page count | the last program packs `(pages << 32) \| tokens` into `ret_values`; the host reads it with `.item()` (a GPU → host sync) | `ret_values` is gone: the host computes the count from CPU copies of the lengths (`get_num_new_pages(seq_lens=seq_lens_cpu, prefix_lens=prefix_lens_cpu, ...)`), no sync |
# | `bs_upper` | `tl.constexpr`, `next_power_of_2(bs)` | the same: a compilation per power of two of the batch size |
# | the masked sums | every program re-sums all requests before it: O(bs²) in all | the same |
# | out of pages | launch, then check, return `None` | the same order: the kernel runs (and reads `free_pages`) before `num_new_pages > len(free_pages)` is checked |
# | masked loads, `min` | no `other=`, built-in `min` | the same |
#
# So two of the source's hazards are gone upstream (the recompile per extend length and the
# sync) and three remain. `kvlab.PagedTokenAllocator` counts pages on the host *before* the
# launch; chapter 09 removes the rest (one prefix sum instead of O(bs²), no constexpr batch size)
# and measures the difference on a GPU.

# %% [markdown]
# ## Your turn: the three parts
#
# Below is the kernel with its bookkeeping given: the masked sums of the skeleton above, plus
# `pre_page_end = ceil(pre/P)*P`, `seq_page_start = floor(seq/P)*P` and
# `offs_page = tl.arange(0, page_size)`. Write the three parts, translating `one_program`'s
# loops into masked stores (the checks `if ... return` between them are given). The kernel writes
# only `out_indices` and `ret_values`; `pre_lens`, `seq_lens`, `last_loc` and `free_pages` are
# read-only. Each part has its own [checker](glossary.md#checker), so you can do them one at a time:
#
# - `kvlab.check.alloc_extend_part1(kernel)`: the rest of the old page, `last_loc + 1, ...`;
# - `kvlab.check.alloc_extend_part2(kernel)`: whole new pages, `free_pages[new_page_start_loc + k // P] * P + k % P`;
# - `kvlab.check.alloc_extend_part3(kernel)`: the new last page from offset 0, **and** `ret_values`
#   (it is written near the top: the [starter](glossary.md#starter) marks both places with `alloc_extend_part3`).
#
# **Do the parts in order: 1, then 2, then 3.** Each part starts where the one before it
# stopped. Part 2 stores from `output_start_loc + num_part1`, and part 3 from
# `output_start_loc + num_part1 + num_part2`; the `if ... return` between them reads those
# counts too. While part 1 is still the starter (`num_part1 = 0`), every part-2 slot of a
# request with an unaligned prefix lands in the wrong place, however right part 2 is; and part 3
# needs both counts before it. For `ret_values`, the last program is the one with
# `pid == tl.num_programs(0) - 1` (chapter 01's first primer). The cell checks the parts in
# that order, and a part that fails ends the cell: the parts after it are checked when you run
# the cell again once it passes (its failure says so, and so does the chapter's last cell).
#
# A checker compares only its own part's slots with the reference (a slot you have not written
# yet shows as `-1`, another part's position as `·`) and on a mistake names the case, the request
# and the part, the first wrong slot, expected vs got. Until a part is written its checker says `not attempted yet`. Hints:
# `kvlab.check.hint("alloc_extend_part1", 1)` (then 2, 3, 4; the same for parts 2 and 3); each
# part's reference: `kvlab.solutions.show("alloc_extend_part1")` shows part 1 only.


# %%
@triton.jit
def my_alloc_extend_kernel(
    pre_lens_ptr,
    seq_lens_ptr,
    last_loc_ptr,
    free_page_ptr,
    out_indices,
    ret_values,
    bs_upper: tl.constexpr,
    page_size: tl.constexpr,
    max_num_extend_tokens: tl.constexpr,
):
    """One program per request: write its new slots into out_indices, in three parts."""
    pid = tl.program_id(0)
    # --- given: where my slots start, and which free pages are mine ---
    offs_bs = tl.arange(0, bs_upper)
    seq_lens = tl.load(seq_lens_ptr + offs_bs, mask=offs_bs <= pid, other=0)
    pre_lens = tl.load(pre_lens_ptr + offs_bs, mask=offs_bs <= pid, other=0)
    seq_len = tl.load(seq_lens_ptr + pid)
    pre_len = tl.load(pre_lens_ptr + pid)
    sum_extend_lens = tl.sum(seq_lens - pre_lens)
    output_start_loc = sum_extend_lens - (seq_len - pre_len)
    num_new_pages = (seq_lens + page_size - 1) // page_size - (
        pre_lens + page_size - 1
    ) // page_size
    num_new_pages_self = (seq_len + page_size - 1) // page_size - (
        pre_len + page_size - 1
    ) // page_size
    sum_num_new_pages = tl.sum(num_new_pages)
    new_page_start_loc = sum_num_new_pages - num_new_pages_self
    pre_page_end = (pre_len + page_size - 1) // page_size * page_size  # ceil(pre/P)*P
    seq_page_start = seq_len // page_size * page_size                   # floor(seq/P)*P
    offs_page = tl.arange(0, page_size)

    # --- part 3, first place: the last program stores the batch's totals in ret_values,
    # (new pages << 32) | new tokens, here, because parts 1 and 2 may return early ---
    ### BEGIN SOLUTION
    if pid == tl.num_programs(0) - 1:
        tl.store(
            ret_values,
            (sum_num_new_pages.to(tl.int64) << 32) | sum_extend_lens.to(tl.int64),
        )
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: alloc_extend_part3 (ret_values)
    ### END STARTER

    # --- part 1: the rest of my old page, right after last_loc ---
    ### BEGIN SOLUTION
    last_loc = tl.load(last_loc_ptr + pid)
    num_part1 = tl.minimum(seq_len, pre_page_end) - pre_len
    tl.store(out_indices + output_start_loc + offs_page, last_loc + 1 + offs_page,
             mask=offs_page < num_part1)
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: alloc_extend_part1
    # replace: how many of my new tokens fit in my old page? Then store their slots.
    num_part1 = 0
    ### END STARTER
    if pre_len + num_part1 == seq_len:  # everything fitted in the old page
        return

    # --- part 2: whole new pages ---
    ### BEGIN SOLUTION
    num_part2 = seq_page_start - pre_page_end
    k = tl.arange(0, max_num_extend_tokens)
    page = tl.load(
        free_page_ptr + new_page_start_loc + k // page_size, mask=k < num_part2, other=0
    )
    tl.store(
        out_indices + output_start_loc + num_part1 + k,
        page * page_size + k % page_size,
        mask=k < num_part2,
    )
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: alloc_extend_part2
    # replace: how many of my new tokens fill whole new pages? Then store their slots.
    num_part2 = 0
    ### END STARTER
    if pre_len + num_part1 + num_part2 == seq_len:  # ended on a page boundary
        return

    # --- part 3: my last new page, from offset 0 ---
    ### BEGIN SOLUTION
    num_part3 = seq_len - seq_page_start
    last_page = tl.load(free_page_ptr + new_page_start_loc + num_new_pages_self - 1)
    tl.store(out_indices + output_start_loc + num_part1 + num_part2 + offs_page,
             last_page * page_size + offs_page, mask=offs_page < num_part3)
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: alloc_extend_part3
    pass
    ### END STARTER


n_random = kvlab.base.runtime.pick(cpu=2, gpu=20)
kvlab.check.alloc_extend_part1(my_alloc_extend_kernel, n_random=n_random)
kvlab.check.alloc_extend_part2(my_alloc_extend_kernel, n_random=n_random)
kvlab.check.alloc_extend_part3(my_alloc_extend_kernel, n_random=n_random);

# %%
_ = kvlab.check.hint("alloc_extend_part1", 1)
# kvlab.solutions.show("alloc_extend_part1")   # uncomment to read part 1 of the
# reference kernel

# %% [markdown]
# ## Lift
#
# The kernel lives in `kvlab.alloc.alloc_kernels.alloc_extend_kernel`, the allocator in
# `kvlab.PagedTokenAllocator.alloc_extend`. This notebook's pieces must agree with them: your
# kernel against the package's, and a host function built the notebook's way (count pages first,
# then launch the kernel, then slice) against the allocator, on random batches. Your kernel is
# used once all three parts have passed their checkers; until then the package's stands in, and
# the cell says so.

# %%
parts = ["alloc_extend_part1", "alloc_extend_part2", "alloc_extend_part3"]
chosen = [
    kvlab.check.choose(part, my_alloc_extend_kernel, alloc_extend_kernel)
    for part in parts
]
extend_kernel = (
    my_alloc_extend_kernel
    if all(c is my_alloc_extend_kernel for c in chosen)
    else alloc_extend_kernel
)


def my_alloc_extend(free_pages, pre, seq, last, P):
    """The notebook's allocator step: check pages on the host, launch, slice. Returns
    (out, free)."""
    needed = pages_needed_extend(pre, seq, P)
    if needed > len(free_pages):
        raise kvlab.OutOfPages(needed, len(free_pages), "extend")
    out, _ = launch_extend(extend_kernel, pre, seq, last, free_pages, P)
    return out, free_pages[needed:]


rng = random.Random(7)
for trial in range(kvlab.base.runtime.pick(cpu=4, gpu=100)):
    P = rng.choice([1, 4, 16, 64])
    pre, seq, last, free = random_batch(rng, P, rng.randint(1, 5))
    got_kernel, _ = launch_extend(extend_kernel, pre, seq, last, free, P)
    want_kernel, _ = launch_extend(alloc_extend_kernel, pre, seq, last, free, P)
    assert torch.equal(got_kernel, want_kernel), (
        f"page_size {P}, pre {pre}, seq {seq}: your kernel {got_kernel.tolist()}, the"
        f" package's {want_kernel.tolist()}"
    )

    alloc = kvlab.PagedTokenAllocator(max(free + [x // P for x in last]) + 1, P)
    alloc.free_pages = torch.tensor(free, dtype=torch.int64, device=device)
    mine, my_free = my_alloc_extend(free, pre, seq, last, P)
    theirs = alloc.alloc_extend(
        torch.tensor(pre, device=device),
        torch.tensor(seq, device=device),
        torch.tensor(last, device=device),
        sum(seq) - sum(pre),
    )
    assert torch.equal(mine, theirs.cpu()) and my_free == alloc.free_pages.tolist(), (
        f"page_size {P}, pre {pre}, seq {seq}: the notebook's step and"
        " PagedTokenAllocator differ"
    )
print(
    "notebook kernel == kvlab.alloc.alloc_kernels.alloc_extend_kernel; notebook"
    " allocator step == PagedTokenAllocator"
)

# %% [markdown]
# What does a mistake look like? This version forgets that part 3 lives on the request's
# **last** new page and uses its first one instead. For B in the worked example that page is
# already part 2's, so B's last 4 slots collide with its first 4:


# %% alt="The checker's picture of the wrong part-3 kernel on the worked example: the expected slots above the slots the kernel returned, with the wrong positions outlined in red."
@triton.jit
def wrong_part3_kernel(
    pre_lens_ptr,
    seq_lens_ptr,
    last_loc_ptr,
    free_page_ptr,
    out_indices,
    ret_values,
    bs_upper: tl.constexpr,
    page_size: tl.constexpr,
    max_num_extend_tokens: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_bs = tl.arange(0, bs_upper)
    seq_lens = tl.load(seq_lens_ptr + offs_bs, mask=offs_bs <= pid, other=0)
    pre_lens = tl.load(pre_lens_ptr + offs_bs, mask=offs_bs <= pid, other=0)
    seq_len = tl.load(seq_lens_ptr + pid)
    pre_len = tl.load(pre_lens_ptr + pid)
    output_start_loc = tl.sum(seq_lens - pre_lens) - (seq_len - pre_len)
    num_new_pages_self = (seq_len + page_size - 1) // page_size - (
        pre_len + page_size - 1
    ) // page_size
    new_page_start_loc = (
        tl.sum(
            (seq_lens + page_size - 1) // page_size
            - (pre_lens + page_size - 1) // page_size
        )
        - num_new_pages_self
    )
    offs_page = tl.arange(0, page_size)
    num_done = seq_len // page_size * page_size - pre_len  # parts 1 and 2 together
    num_part3 = seq_len - seq_len // page_size * page_size
    if num_part3 > 0:
        # BUG: should be + num_new_pages_self - 1
        page = tl.load(free_page_ptr + new_page_start_loc)
        tl.store(
            out_indices + output_start_loc + num_done + offs_page,
            page * page_size + offs_page,
            mask=offs_page < num_part3,
        )


try:
    kvlab.check.alloc_extend_part3(wrong_part3_kernel, n_random=0)
    raise AssertionError("the checker should have caught this")
except kvlab.check.CheckFailed as err:
    print(err)
    assert "request 1, part 3" in str(
        err
    ), f"the checker blamed another request or part:\n{err}"

# %% [markdown]
# ## Summary
#
# - One program per request; each finds its output offset and its first new page by summing the
#   lengths of the requests before it (a masked `tl.sum` with `other=0`: O(bs) per program,
#   O(bs²) for the batch).
# - Three parts: **1** `last_loc + 1 ...` to the end of the old page; **2** whole new pages,
#   `free_pages[start + k // P] * P + k % P`; **3** the last new page from offset 0. Every new
#   page is entered at offset 0, so a token at position `t` sits at offset `t % P`.
# - The last program packs `(pages << 32) | tokens` into `ret_values`; the host unpacks it (one
#   sync). SGLang today computes the count on the host instead and loops over part 2 in blocks.
# - The kernel cannot know how long `free_pages` is: count the pages **before** the launch and
#   refuse with `OutOfPages`. Then nothing is read out of bounds and nothing changes on failure.
# - `out_indices` becomes useful in the page table: request `r`'s run goes to its row, columns
#   `pre .. seq - 1`.
#
# Next: chapter 04 grows every request by one token per step, `alloc_decode`.
#
# ## Questions
#
# 1. SGLang today computes the page count on the host from `seq_lens_cpu` and `prefix_lens_cpu`,
#    yet still checks it only after the launch. Move the check before the launch: what must the
#    host know then, what does it cost, and what does it save?
# 2. A batch of 64 requests: one prefill of 8000 new tokens and 63 requests extending by 3 tokens
#    each. With the source's kernel, how many part-2 lanes does each program run, and how many
#    do useful work? What changes with SGLang's 4096-lane block loop?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# 1. The host needs the batch's `prefix_lens` and `seq_lens`, and SGLang already keeps CPU
#    copies of them (that is what `seq_lens_cpu` is): the count is `sum(ceil(seq/P) - ceil(pre/P))`,
#    O(bs) integer work on the host, with no GPU sync, so moving it before the launch costs
#    nothing extra. It saves the out-of-bounds read when pages are short: the kernel is simply
#    not launched (this is `PagedTokenAllocator`'s order, steps 1-5 above), and the caller can
#    evict or retry with `free_pages` untouched.
# 2. `extend_num_tokens = 8000 + 63 * 3 = 8189`, so `max_num_extend_tokens = 8192`: every
#    program that reaches part 2 builds an 8192-lane `tl.arange` for it, up to 64 × 8192 =
#    524,288 lanes. Useful part-2 lanes: only the long prefill's whole pages (with `P = 64` and
#    an empty prefix, `8000 // 64 * 64 = 7936`); a request extending by 3 tokens fills no whole
#    page, so all 8192 of its lanes are masked off. With a 4096-lane block loop the trip count
#    is `cdiv(num_part2, 4096)` per program: 2 iterations for the long request, 0 for the
#    others, so 8192 lanes are touched instead of up to 524,288, and the kernel compiles once
#    for every length.
