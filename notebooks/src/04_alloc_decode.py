# %% [markdown]
# # 04 · Decode, one token at a time: `alloc_decode`
#
# **Time:** about 45 minutes. **Assumes:** chapter 03 (the extend kernel, its masked sums and
# page counts).
#
# **Goal.** After the [prefill](glossary.md#prefill) (chapter 03's `alloc_extend`), a request grows by exactly one token
# per [scheduler step](glossary.md#scheduler-step) until it stops: the **[decode](glossary.md#decode)** steps of chapter 00. Every decode step the
# server needs one new KV [slot](glossary.md#token-slot) per running request, and it asks for all of them in one launch:
# SGLang's `alloc_decode_kernel`. You will derive its one rule, watch requests cross [page](glossary.md#page)
# boundaries step by step, validate the kernel against the reference, write a run of steps into
# a [page table](glossary.md#page-table), and write the kernel yourself.
#
# **Lengths after the token.** As in SGLang, `alloc_decode(seq_lens, last_loc)` takes the lengths
# *after* this step's token: `seq = pre + 1`. The new token is token number `seq - 1` (counting
# from 0), and [`last_loc`](glossary.md#last-loc) is the slot of the token before it (`-1` for a request with no tokens
# yet).

# %%
import random

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

import kvlab
from kvlab.course.scenes.ch04_alloc_decode import (
    decode_steps,
    draw_decode_steps,
    example_history,
)
from kvlab.alloc.alloc_kernels import alloc_decode_kernel
from kvlab.course.reference.alloc_ref import alloc_decode_ref
from kvlab.course.viz import page_table_heatmap

torch.manual_seed(0)
device = kvlab.DEVICE
print("device:", device)

# %% [markdown]
# ## The picture
#
# Three requests on pages of 4 slots, five decode steps. Orange: this step's token went right
# after the previous one (`last_loc + 1`, same page). Green: the previous token was the last of
# its page, so this one takes the first slot of a fresh page from the front of `free_pages`.

# %% alt="Five decode steps of three requests on pages of 4 slots, one panel per step: each request gets one new slot, orange where it is last_loc + 1 on the same page and green where it is the first slot of a new page taken from free_pages."
history = example_history()
fig, axes = plt.subplots(
    len(history), 1, figsize=(8.0, 1.5 * len(history) + 0.6), sharex=True
)
draw_decode_steps(history, 4, axes)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The rule
#
# Token number `t` sits at offset `t % P` of its page. It needs a new page exactly when it is the
# first of one: `t % P == 0`. With `t = seq - 1`:
#
# ```
# new page  <=>  (seq - 1) % P == 0   slot = free_pages[k] * P  (k-th new page this step)
# otherwise                           slot = last_loc + 1
# ```
#
# The kernel says the same with chapter 03's page counts: new pages = `ceil(seq/P) - ceil(pre/P)`,
# which is 1 or 0 when `seq = pre + 1`. Check they agree:

# %%
P = 4
print(" seq  token  (seq-1)%P  ceil(seq/P)-ceil(pre/P)")
for seq in range(1, 11):
    pre = seq - 1
    by_count = -(-seq // P) - (-(-pre // P))
    by_rule = int((seq - 1) % P == 0)
    assert (
        by_count == by_rule
    ), f"seq {seq}: the page count says {by_count}, the rule {by_rule}"
    print(
        f"{seq:4d}  {seq - 1:5d}  {(seq - 1) % P:9d}  {by_count:23d}"
        + ("   <- new page" if by_rule else "")
    )
for P_ in (1, 2, 16, 64):  # and for other page sizes, far out
    assert all(
        (-(-s // P_) - (-(-(s - 1) // P_))) == int((s - 1) % P_ == 0)
        for s in range(1, 5000)
    ), f"page_size {P_}: the rule (seq - 1) % P == 0 disagrees with the page count"

# %% [markdown]
# `page_size = 1` is the extreme: every token is the first of its page, so every request takes a
# new page every step.
#
# ## Which free page is mine?
#
# Several requests may cross a boundary in the same step. They take pages from the front of
# `free_pages` in request order, so request `pid` takes `free_pages[k]` where `k` counts the
# requests *before* it that also need one. As in chapter 03, each [program](glossary.md#program) finds `k` alone, with a
# [masked](glossary.md#mask) sum over the requests `0..pid`:

# %%
seq_lens = torch.tensor([5, 7, 9, 1, 6])  # P = 4: tokens 4, 6, 8, 0, 5
P = 4
bs = len(seq_lens)
load_offset = torch.arange(triton.next_power_of_2(bs))
for pid in range(bs):
    mask = load_offset <= pid
    seq_m = torch.zeros(len(load_offset), dtype=torch.int64)
    seq_m[mask] = seq_lens[: pid + 1]
    # masked lanes: pre == seq (== 0), so no new page
    pre_m = torch.where(mask, seq_m - 1, seq_m)
    new_each = (seq_m + P - 1) // P - (pre_m + P - 1) // P
    mine = int(new_each[pid])
    k = int(new_each.sum()) - mine
    print(f"program {pid}: seq={int(seq_lens[pid])}  new page? {bool(mine)!s:5}"
          + (f"  -> free_pages[{k}]" if mine else "  -> last_loc + 1"))

# %% [markdown]
# ## The kernel
#
# `kvlab.alloc.alloc_kernels.alloc_decode_kernel` mirrors the [source design](glossary.md#source-design). It is chapter 03's kernel with
# the [three parts](glossary.md#three-parts) collapsed into one `if`: one program per request, the masked sum above to find
# `k`, then either `last_loc + 1` or the first slot of `free_pages[k]`; the last program reports
# the number of new pages in [`ret_values`](glossary.md#ret-values). Writing it is **your exercise** at the end of the
# chapter; until then the chapter runs the package's kernel. Here it is on the batch above:

# %%
def launch_decode(kernel, seq, last, free_pages, P):
    """Run an alloc_decode kernel on lists; return (out_indices, new pages reported)."""
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    out = torch.full((len(seq),), -1, dtype=torch.int64, device=device)
    ret = torch.zeros(1, dtype=torch.int64, device=device)
    kernel[(len(seq),)](as_t(seq), as_t(last), as_t(free_pages), out, ret,
                        triton.next_power_of_2(len(seq)), P)
    return out.cpu(), int(ret.item())


# the batch above: tokens 4, 6, 8, 0, 5 on pages of 4; previous tokens on pages 2, 5, 9,
# -, 1
seq = [5, 7, 9, 1, 6]
last = [2 * 4 + 3, 5 * 4 + 1, 9 * 4 + 3, -1, 1 * 4 + 0]
free = [6, 0, 8, 3]
out, ret = launch_decode(alloc_decode_kernel, seq, last, free, 4)
print("out_indices:", out.tolist(), " new pages:", ret)
assert out.tolist() == [6 * 4, 5 * 4 + 2, 0 * 4, 8 * 4, 1 * 4 + 1] and ret == 3, (
    f"out_indices {out.tolist()}, {ret} new pages")
assert out.tolist() == alloc_decode_ref(seq, last, free, 4).out_indices, (
    "the kernel's slots differ from the reference's")

# %% [markdown]
# ## Validate against the reference
#
# First the kernel alone on random batches (page sizes 1, 16, 64; some requests at offset 0 of a
# page, some mid-page, some brand new), then the allocator over many steps: every step's slots
# must equal the reference run on a copy of `free_pages`, be distinct, and never land on another
# request's page.

# %%
def random_decode_batch(rng, P, bs):
    """seq_lens after the token, last_loc on pages of each request's own, a shuffled
    free list."""
    seq = [
        rng.choice([1, rng.randint(1, 3 * P + 1), rng.randint(0, 3) * P + 1])
        for _ in range(bs)
    ]
    n_old = sum(-(-(s - 1) // P) for s in seq)
    pages = list(range(n_old + bs + 2))
    rng.shuffle(pages)
    last, at = [], 0
    for s in seq:
        n = -(-(s - 1) // P)
        last.append(pages[at + n - 1] * P + (s - 2) % P if s > 1 else -1)
        at += n
    return seq, last, pages[at:]


rng = random.Random(0)
n_trials = kvlab.base.runtime.pick(cpu=12, gpu=200)
crossings = 0
for trial in range(n_trials):
    P = [1, 16, 64][trial % 3]
    seq, last, free = random_decode_batch(rng, P, rng.randint(1, 8))
    got, ret = launch_decode(alloc_decode_kernel, seq, last, free, P)
    plan = alloc_decode_ref(seq, last, free, P)
    assert got.tolist() == plan.out_indices and ret == plan.num_new_pages, (
        P,
        seq,
        last,
    )
    crossings += plan.num_new_pages
print(f"kernel == reference on {n_trials} random batches ({crossings} page crossings)")

# %%
P = 16
num_pages = kvlab.base.runtime.pick(cpu=24, gpu=1024)
# this chapter's kernel
alloc = kvlab.PagedTokenAllocator(num_pages=num_pages, page_size=P, impl="teaching")
alloc.free_pages = torch.tensor(
    random.Random(2).sample(range(num_pages), num_pages), device=device
)
rng = random.Random(1)
bs = kvlab.base.runtime.pick(cpu=4, gpu=32)
prompt = [rng.randint(1, 40) for _ in range(bs)]
slots = alloc.alloc_extend(
    torch.zeros(bs, dtype=torch.int64, device=device),
    torch.tensor(prompt, device=device),
    torch.full((bs,), -1, device=device),
    sum(prompt),
).tolist()
owned = []  # every request's slots so far
at = 0
for n in prompt:
    owned.append(slots[at:at + n])
    at += n
n_steps = kvlab.base.runtime.pick(cpu=20, gpu=200)
for step in range(n_steps):
    seq = [len(s) + 1 for s in owned]
    last = [s[-1] for s in owned]
    free_before = alloc.free_pages.tolist()
    out = alloc.alloc_decode(
        torch.tensor(seq, device=device), torch.tensor(last, device=device)
    ).tolist()
    plan = alloc_decode_ref(seq, last, free_before, P)
    assert (
        out == plan.out_indices and len(set(out)) == bs
    ), f"step {step}: slots {out} (the reference: {plan.out_indices}), or a slot twice"
    assert alloc.free_pages.tolist() == free_before[plan.num_new_pages :], (
        f"step {step}: the free list is not what is left after {plan.num_new_pages} new"
        " pages"
    )
    for r, x in enumerate(out):
        others = {y // P for q, s in enumerate(owned) if q != r for y in s}
        # never another request's page
        assert x // P not in others, (
            f"step {step}: request {r} got slot {x}, on another request's page")
        # a new page is entered at offset 0
        assert (x % P == 0) == plan.takes_new_page[r], (
            f"step {step}: request {r} got slot {x}: a new page starts at offset 0, an"
            " old one does not"
        )
        owned[r].append(x)
print(
    f"{n_steps} decode steps for {bs} requests: allocator == reference at every step; "
    f"lengths now {[len(s) for s in owned]}, {alloc.num_free_pages} pages free"
)

# %% [markdown]
# ### Into the page table
#
# Each step's `out_indices[r]` goes to request `r`'s row of the page table, at column `seq - 1`.
# After the prefill and all the decode steps above, the table looks like this; the cells the
# decode steps wrote are outlined, colour is the physical page. Each row continues its prompt's
# last page, then moves to a new page (a new colour) exactly at the page boundaries:

# %% alt="A page table heatmap after a prefill and 20 decode steps on pages of 16 slots: the positions written by the decode steps are outlined in red, continuing each request's row after its prompt."
width = kvlab.div_ceil(max(len(s) for s in owned), P) * P
table = kvlab.new_page_table(bs, width, P)
decoded = torch.zeros(table.shape, dtype=torch.bool)
for r, row_slots in enumerate(owned):
    table[r, : len(row_slots)] = torch.tensor(
        row_slots, dtype=table.dtype, device=table.device
    )
    decoded[r, prompt[r]:len(row_slots)] = True  # written by the decode steps
ax = page_table_heatmap(table, P, highlight=decoded, rows=slice(0, bs),
                        title=f"prefill then {n_steps} decode steps, page_size {P} "
                              "(outlined: written by decode steps)")
plt.show()
# position t at offset t % P; one physical page per logical page
for r, row_slots in enumerate(owned):
    row = torch.tensor(row_slots)
    assert (row % P == torch.arange(len(row)) % P).all(), (
        f"request {r}: a position not at its offset t % P: {row.tolist()}")
    assert (row // P == row[(torch.arange(len(row)) // P) * P] // P).all(), (
        f"request {r}: a logical page over two physical pages: {row.tolist()}")

# %% [markdown]
# ## A longer run, as a strip of steps
#
# Four requests on pages of 4, eight steps (seeded). Scan down the strip: a green cell appears in
# a row exactly when that row's previous token filled a page.

# %% alt="Eight decode steps of four requests on pages of 4 slots, one panel per step: each step gives every request one slot, orange on its current page and green when it crosses into a new page."
hist = decode_steps([2, 4, 7, 1], 8, 4, random.Random(5).sample(range(24), 24))
fig, axes = plt.subplots(
    len(hist), 1, figsize=(8.0, 1.3 * len(hist) + 0.6), sharex=True
)
draw_decode_steps(hist, 4, axes)
fig.tight_layout()
plt.show()
for step in hist:
    assert step.takes_new_page == [(s - 1) % 4 == 0 for s in step.seq_lens], (
        f"seq_lens {step.seq_lens}: new pages {step.takes_new_page}")

# %% [markdown]
# Running the notebook live? Scrub through the same steps with a slider (the strip above already shows
# every step; the slider shows one at a time):

# %% alt="One decode step of the four requests on pages of 4 slots, the step the slider picks: each request gets one new slot, orange on its current page and green where it crosses into a new page."
import ipywidgets as widgets


def show_step(step=1):
    fig, ax = plt.subplots(figsize=(8.0, 1.9))
    draw_decode_steps([hist[step - 1]], 4, [ax], first_step=step)
    fig.tight_layout()
    plt.show()


widgets.interact(
    show_step, step=widgets.IntSlider(value=1, min=1, max=len(hist), description="step")
)

# %% [markdown]
# ## When pages run out
#
# The decode kernel reads `free_pages[k]` for every crossing request, just like the [extend](glossary.md#extend)
# kernel, so the same rule applies: the allocator counts the crossings on the host,
# `sum((seq - 1) % P == 0)`, before launching, and raises `OutOfPages` with nothing changed.

# %%
small = kvlab.PagedTokenAllocator(num_pages=3, page_size=4)
first = small.alloc_extend(
    torch.tensor([0, 0], device=device),
    torch.tensor([4, 4], device=device),
    torch.tensor([-1, -1], device=device),
    8,
)
print("after the prefill:", small)
before = small.state()
try:
    small.alloc_decode(
        torch.tensor([5, 5], device=device),
        torch.tensor([int(first[3]), int(first[7])], device=device),
    )
    raise AssertionError("should have been refused")
except kvlab.OutOfPages as err:
    print("OutOfPages:", err)
assert small.state().equals(before), "a refused alloc_decode changed the allocator"
# with one request it fits
print(
    "one request:",
    small.alloc_decode(
        torch.tensor([5], device=device), torch.tensor([int(first[3])], device=device)
    ).tolist(),
)

# %% [markdown]
# ## Your turn
#
# Write the decode kernel, one program per request (`grid = (bs,)`):
#
# - request `pid`'s new token is number `seq - 1`; if `(seq - 1) % page_size != 0` its slot is
#   `last_loc + 1`;
# - otherwise it starts a page and takes the first slot of **`free_pages[k]`, where `k` is the
#   number of requests before it in the batch (`0 .. pid - 1`) that also start a page** (pages go
#   out from the front of `free_pages` in request order, as in chapter 03); count them with a
#   masked load and `tl.sum`, as in "Which free page is mine?" above (a comparison gives a
#   block of booleans: turn it into numbers with `.to(tl.int32)` before you sum it);
# - the last program (`pid == tl.num_programs(0) - 1`) stores the number of requests that took a
#   new page in `ret_values`.
#
# The kernel writes only `out_indices` and `ret_values`; `seq_lens`, `last_loc` and `free_pages`
# are read-only.
#
# `kvlab.check.alloc_decode(kernel)` runs it on named edge cases (page size 1, a request's very
# first token, several crossings at once) and random batches; on a mistake it names the request
# and whether it should have taken a new page. Until you write the body it says
# `not attempted yet`. Hints: `kvlab.check.hint("alloc_decode", 1)` (up to 4); the reference:
# `kvlab.solutions.show("alloc_decode")`.


# %%
@triton.jit
def my_alloc_decode_kernel(
    seq_lens_ptr,
    last_loc_ptr,
    free_page_ptr,
    out_indices,
    ret_values,
    bs_upper: tl.constexpr,
    page_size: tl.constexpr,
):
    """One program per request: out_indices[pid] = the slot of request pid's new token.

    seq_lens are lengths after the token; bs_upper = next_power_of_2(bs). The last
    program
    stores the number of requests that took a new page in ret_values.
    """
    pid = tl.program_id(0)
    ### BEGIN SOLUTION
    offs_bs = tl.arange(0, bs_upper)
    seq_lens = tl.load(seq_lens_ptr + offs_bs, mask=offs_bs <= pid, other=0)
    # a request before me (or me) starts a page when its new token is the first of one
    starts_page = ((seq_lens - 1) % page_size == 0) & (offs_bs <= pid)
    n_before_and_me = tl.sum(starts_page.to(tl.int32))
    seq_len = tl.load(seq_lens_ptr + pid)
    if pid == tl.num_programs(0) - 1:
        tl.store(ret_values, n_before_and_me.to(tl.int64))
    if (seq_len - 1) % page_size == 0:
        # k = n_before_and_me - 1 before me
        page = tl.load(free_page_ptr + n_before_and_me - 1)
        tl.store(out_indices + pid, page * page_size)
    else:
        tl.store(out_indices + pid, tl.load(last_loc_ptr + pid) + 1)
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: alloc_decode
    pass
    ### END STARTER


kvlab.check.alloc_decode(
    my_alloc_decode_kernel, n_random=kvlab.base.runtime.pick(cpu=3, gpu=20)
)

# %%
_ = kvlab.check.hint("alloc_decode", 1)
# kvlab.solutions.show("alloc_decode")   # uncomment to read the reference kernel

# %% [markdown]
# ## Lift
#
# The kernel is `kvlab.alloc.alloc_kernels.alloc_decode_kernel` and the allocator step
# `kvlab.PagedTokenAllocator.alloc_decode`. Your kernel against the package's, and the notebook's
# host step (count crossings, refuse if short, launch, slice) against the allocator, on random
# batches. Your kernel is used once it has passed its [checker](glossary.md#checker); until then the package's stands
# in, and the cell says so.

# %%
decode_kernel = kvlab.check.choose(
    "alloc_decode", my_alloc_decode_kernel, alloc_decode_kernel
)


def my_alloc_decode(free_pages, seq, last, P):
    """The notebook's decode step: check pages on the host, launch, slice. Returns (out,
    free)."""
    needed = sum((s - 1) % P == 0 for s in seq)
    if needed > len(free_pages):
        raise kvlab.OutOfPages(needed, len(free_pages), "decode step")
    out, _ = launch_decode(decode_kernel, seq, last, free_pages, P)
    return out, free_pages[needed:]


rng = random.Random(7)
for trial in range(kvlab.base.runtime.pick(cpu=8, gpu=100)):
    P = rng.choice([1, 4, 16, 64])
    seq, last, free = random_decode_batch(rng, P, rng.randint(1, 8))
    assert torch.equal(launch_decode(decode_kernel, seq, last, free, P)[0],
                       launch_decode(alloc_decode_kernel, seq, last, free, P)[0]), (
        f"page_size {P}, seq {seq}: your kernel's slots differ from the package's")
    alloc = kvlab.PagedTokenAllocator(max(free + [x // P for x in last]) + 1, P)
    alloc.free_pages = torch.tensor(free, dtype=torch.int64, device=device)
    mine, my_free = my_alloc_decode(free, seq, last, P)
    theirs = alloc.alloc_decode(
        torch.tensor(seq, device=device), torch.tensor(last, device=device)
    )
    assert torch.equal(mine, theirs.cpu()) and my_free == alloc.free_pages.tolist(), (
        f"page_size {P}, seq {seq}: the notebook's step and PagedTokenAllocator differ")
print(
    "notebook kernel == kvlab.alloc.alloc_kernels.alloc_decode_kernel; notebook decode"
    " step == PagedTokenAllocator"
)

# %% [markdown]
# What does the checker say about a wrong kernel? A classic slip: testing `seq % page_size == 0`
# (the token *after* this one would start a page) instead of `(seq - 1) % page_size == 0`. The
# checker's edge cases catch it at once:


# %% alt="The checker's picture of the off-by-one kernel on a request crossing into a new page: expected slot 4, got slot 16, outlined in red."
@triton.jit
def off_by_one_kernel(
    seq_lens_ptr,
    last_loc_ptr,
    free_page_ptr,
    out_indices,
    ret_values,
    bs_upper: tl.constexpr,
    page_size: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_bs = tl.arange(0, bs_upper)
    seq_lens = tl.load(seq_lens_ptr + offs_bs, mask=offs_bs <= pid, other=1)
    # BUG: should be (seq_lens - 1)
    starts_page = (seq_lens % page_size == 0) & (offs_bs <= pid)
    n = tl.sum(starts_page.to(tl.int32))
    seq_len = tl.load(seq_lens_ptr + pid)
    if pid == tl.num_programs(0) - 1:
        tl.store(ret_values, n.to(tl.int64))
    if seq_len % page_size == 0:
        tl.store(out_indices + pid, tl.load(free_page_ptr + n - 1) * page_size)
    else:
        tl.store(out_indices + pid, tl.load(last_loc_ptr + pid) + 1)


try:
    kvlab.check.alloc_decode(off_by_one_kernel, n_random=0)
    raise AssertionError("the checker should have caught this")
except kvlab.check.CheckFailed as err:
    print(err)
    assert "request 0" in str(err), f"the checker blamed another request:\n{err}"

# %% [markdown]
# ## Summary
#
# - Decode lengths are lengths **after** the token: `seq = pre + 1`; the new token is number `seq - 1`.
# - A request takes a new page exactly when `(seq - 1) % P == 0`, and enters it at offset 0;
#   otherwise its slot is `last_loc + 1`.
# - Crossing requests take pages from the front of `free_pages` in request order: request `pid`
#   takes `free_pages[k]`, `k` = the crossing requests before it, counted by each program with a
#   masked sum; the last program reports the total.
# - Each step's slot goes to the request's page-table row at column `seq - 1`.
# - As for extend, the host counts the new pages before the launch and refuses with
#   `OutOfPages`, so no kernel reads past `free_pages` and a refused step changes nothing.
#   (SGLang today counts them on the host too, from `seq_lens_cpu`, but still after the launch;
#   chapter 03's box.)
#
# Next: chapter 05 lets requests *share* pages through a radix [prefix cache](glossary.md#prefix-cache).
#
# ## Questions
#
# 1. All requests of a batch were prefilled with 64-token prompts on pages of 64 and decode in
#    lockstep. How many pages does each decode step take? Could a step fail when the step before
#    it succeeded with plenty of pages left, and what could a scheduler do about it?
# 2. With `page_size = 1`, what does `alloc_decode` reduce to, and what does a decode step cost
#    the allocator compared with `page_size = 64`?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# 1. Every request's first decoded token is token 64, the first of a new page, so the first
#    decode step takes `bs` pages at once; the next 63 steps take none; then again `bs`. Demand
#    comes in bursts, one page per request every 64 steps, all at the same step. So yes: a step
#    can need `bs` pages while the 63 before it needed none, and fail even though the pool looked
#    comfortable a step earlier. A scheduler can keep a reserve (admit a request only if pages
#    for its whole expected output exist: mini-sglang reserves each request's output length
#    when it admits it, chapter 07), evict cached prefixes (chapter 05), or preempt a request
#    and recompute it later.
# 2. Every token starts a page, so every request takes `free_pages[pid]` every step (`k = pid`):
#    `alloc_decode` hands out the first `bs` free pages in order and `last_loc` is never used.
#    The allocator then pops `bs` entries from `free_pages` every step, versus `bs / 64` on
#    average with pages of 64, and the page table and the radix cache work with 64 times more
#    entries; in exchange there is no waste in last pages.
