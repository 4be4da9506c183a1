# %% [markdown]
# # 01 · Pages → token slots
#
# **Time:** about 60 minutes. **Assumes:** chapter 00; PyTorch indexing and broadcasting. No
# Triton yet: this chapter introduces it.
#
# **Goal.** Build mini-sglang's `_page_to_token`: given the [pages](glossary.md#page) a request was just handed,
# list every [token slot](glossary.md#token-slot) inside them, in order. First with three tensor operations
# (`unsqueeze`, `arange`, `flatten`); then, after a short Triton primer (four small kernels,
# each with a result to predict), as your first Triton kernel. Both are checked against a
# plain-Python reference, and you finish by putting the torch version together yourself.
#
# **Vocabulary.** The [KV pool](glossary.md#kv-pool) has `num_pages * page_size` *slots* (one token's K and V each).
# Page `k` owns slots `k*P ... k*P + P - 1` (`P` = `page_size`). mini-sglang's [free list](glossary.md#free-list) does
# not store page ids but **[page starts](glossary.md#page-start)** — `free_slots = arange(num_pages) * page_size` — so a
# page is named by its first slot. The allocator hands out page starts; the [page table](glossary.md#page-table) needs
# one slot per token. `page_to_token` bridges the two.

# %%
import random

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

import kvlab
from kvlab.course.scenes.ch01_page_to_token import pages_to_slots_figure
from kvlab.course.reference import page_to_token_ref

torch.manual_seed(0)
device = kvlab.DEVICE
print("device:", device)

# %% [markdown]
# ## The picture
#
# Three pages were handed out, in the order the free list gave them: page 4, page 1, page 6.
# Their page starts are `[16, 4, 24]`. The answer lists page 4's slots, then page 1's, then
# page 6's: **order matters**, because the i-th slot of the answer goes to the i-th new token.

# %% alt="Top: a KV pool of 8 pages of 4 slots with pages 4, 1 and 6 coloured; bottom: page_to_token's output, slots 16-19, then 4-7, then 24-27, in the order the pages were given."
fig = pages_to_slots_figure(page_ids=(4, 1, 6), page_size=4, num_pages=8)
plt.show()

# %% [markdown]
# ## Build it step by step
#
# The worked example of the [source design](glossary.md#source-design) (chapter 00): pages `[4, 8]`, `page_size = 4` should give
# `[4, 5, 6, 7, 8, 9, 10, 11]`. Each page start needs the offsets `0, 1, ..., P-1` added to it.
# Broadcasting does all the adds at once if the starts form a **column** and the offsets a **row**.

# %%
page_size = 4
# page starts, as in free_slots
pages = torch.tensor([4, 8], dtype=torch.int32, device=device)
print("pages              ", tuple(pages.shape), pages.tolist())

column = pages.unsqueeze(1)  # [num_pages] -> [num_pages, 1]
print("pages.unsqueeze(1) ", tuple(column.shape), column.tolist())

offsets = torch.arange(page_size, dtype=pages.dtype, device=pages.device)  # [page_size]
print("offsets            ", tuple(offsets.shape), offsets.tolist())

grid = column + offsets  # [num_pages, 1] + [page_size] -> [num_pages, page_size]
print("column + offsets   ", tuple(grid.shape), grid.tolist())

slots = grid.flatten()  # rows one after another: page after page
print("flatten()          ", tuple(slots.shape), slots.tolist())
assert slots.tolist() == list(range(4, 12)), f"slots {slots.tolist()}, expected 4..11"
# `grid` is a fresh contiguous tensor, so flatten() only reinterprets its shape: a view,
# no copy
print("flatten() is a view of grid (same memory):", slots.data_ptr() == grid.data_ptr())
assert (
    slots.data_ptr() == grid.data_ptr()
), "flatten() copied grid: expected a view of the same memory"

# %% [markdown]
# Two details are worth a second look:
#
# - **dtype.** `free_slots` is `int32`. `torch.arange(page_size)` alone would be `int64`, and
#   `int32 + int64` silently promotes the whole result to `int64`. Building the offsets with
#   `dtype=pages.dtype` keeps the caller's dtype (and `device=` keeps its device).
# - **`page_size == 1`.** Then every page is one slot, the starts already *are* the slots, and
#   the function returns its input unchanged: no copy, no kernel.
#
# You will put the pieces and these two details together yourself at the end of the chapter
# (**your turn**). The package already has the finished function, `kvlab.page_to_token`, and
# the rest of the chapter uses it until yours passes its [checker](glossary.md#checker).

# %% [markdown]
# ## A Triton primer: four small kernels
#
# On a GPU the torch version launches two small kernels (the `arange` and the add; `flatten` is
# a view, as we just saw) and writes the intermediate `grid` to memory in between. A Triton
# kernel can do it in one pass. Before writing it, four small kernels show the pieces every
# kernel in this course is made of. For each one, **predict the printed result first**, then run
# the cell.
#
# ### 1. `tl.program_id`: which program instance am I?
#
# `kernel[grid](args)` launches the function once per entry of the grid: `grid = (4,)` gives four
# **[program instances](glossary.md#program)** (programs), numbered `0..3`. They all run the same code; the only thing
# that tells them apart is `tl.program_id(0)`. Its partner `tl.num_programs(0)` says how many
# programs the grid has (here 4), so `pid == tl.num_programs(0) - 1` picks out the last one: a
# program that can speak for the whole launch (chapter 03's kernel lets it report totals). A
# pointer argument (a torch tensor passed in) points at element 0; `ptr + k` points at element
# `k`, and `tl.store` writes there.

# %%
@triton.jit
def whoami_kernel(out_ptr):
    pid = tl.program_id(0)  # 0, 1, 2, ... : which program instance this is
    tl.store(out_ptr + pid, pid * 10)
    # only the last program: it stores the grid's size
    if pid == tl.num_programs(0) - 1:
        tl.store(out_ptr + 5, tl.num_programs(0))


out = torch.full((6,), -1, dtype=torch.int32, device=device)
whoami_kernel[(4,)](out)
print(out.tolist())  # predict first: four programs, six entries
assert out.tolist() == [
    0,
    10,
    20,
    30,
    -1,
    4,
], f"out = {out.tolist()}, expected [0, 10, 20, 30, -1, 4]"

# %% [markdown]
# ### 2. `tl.arange` and a mask: many lanes per program
#
# A program usually handles a whole block of elements at once. `tl.arange(0, BLOCK)` is a small
# tensor `[0, 1, ..., BLOCK-1]`; each of its entries is a **[lane](glossary.md#lane)**, and one operation on it works
# on every lane. Program `pid` takes elements `pid * BLOCK + [0..BLOCK)`. When `n` is not a
# multiple of `BLOCK`, the last program has lanes past the end: a **[mask](glossary.md#mask)** (one boolean per lane)
# turns their loads and stores off. Below, `n = 10` elements, `BLOCK = 4`, so
# `cdiv(10, 4) = 3` programs; `out` has two spare entries at the end, filled with `-1`.

# %%
@triton.jit
def copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # this program's lanes
    mask = offs < n  # lanes past the end do nothing
    vals = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, vals * 2, mask=mask)


n, BLOCK = 10, 4
x = torch.arange(100, 100 + n, dtype=torch.int32, device=device)
out = torch.full((n + 2,), -1, dtype=torch.int32, device=device)
copy_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, BLOCK=BLOCK)
print("programs:", triton.cdiv(n, BLOCK))
print(out.tolist())  # predict first: what do the last two entries hold?
assert out[:n].tolist() == [2 * v for v in range(100, 110)] and out[n:].tolist() == [
    -1,
    -1,
], f"out = {out.tolist()}: the first {n} doubled, the two spare entries still -1"

# %% [markdown]
# Without the mask, program 2's lanes 10 and 11 would store into `out[10]` and `out[11]` (and
# read `x` past its end). Here they would land in our spare entries; in a real kernel they land
# in someone else's memory. On a GPU that is silent corruption; in the [interpreter](glossary.md#interpreter) it can crash
# the Python process. **Mask every load and store** whose lanes can run past the end.
#
# ### 3. Why `BLOCK` is a compile-time power of two
#
# The `BLOCK: tl.constexpr` annotation makes `BLOCK` a **[compile-time constant](glossary.md#constexpr)**: its value is
# baked into the compiled kernel. It has to be, because `tl.arange(0, BLOCK)` *makes a tensor
# of `BLOCK` lanes*, and Triton fixes every tensor's shape when it compiles the kernel (the GPU
# code for 4 lanes and for 128 lanes is different code). Triton also requires that length to be
# a power of two. So a bound that is only known at run time, or is not a power of two, is
# refused. Predict which of these two kernels Triton accepts:

# %%
@triton.jit
def arange_of_six(out_ptr):
    offs = tl.arange(0, 6)
    tl.store(out_ptr + offs, offs)


@triton.jit
def arange_of_runtime_n(out_ptr, n):
    offs = tl.arange(0, n)  # n is an ordinary (runtime) argument
    tl.store(out_ptr + offs, offs)


def triton_complaint(err):
    """The line of a Triton error (compiled or interpreted) that says what is wrong."""
    texts = []
    while err is not None:
        texts.append(str(err))
        err = err.__cause__
    lines = [
        line for text in texts for line in text.splitlines() if "arange" in line.lower()
    ]
    return lines[-1].strip() if lines else texts[0].strip().splitlines()[-1]


out = torch.zeros(8, dtype=torch.int32, device=device)
for kernel, args in [(arange_of_six, ()), (arange_of_runtime_n, (4,))]:
    try:
        kernel[(1,)](out, *args)
        print(kernel.fn.__name__, "ran")
    except Exception as err:  # noqa: BLE001 - show what Triton says
        print(f"{kernel.fn.__name__}: refused -> {triton_complaint(err)}")

# %% [markdown]
# Both are refused. The fix in a real kernel is the one `copy_kernel` uses: round the block up to
# a power of two (`triton.next_power_of_2(6) == 8`) and mask the extra lanes. The price: each
# *new value* of a `tl.constexpr` argument is a new compilation. On a GPU the first call with a
# new value compiles (a second or so), later calls with the same value reuse it. Chapter 03's
# kernel passes sizes that change with every batch as `tl.constexpr`, and chapter 09 measures
# what that costs.
#
# ### 4. A masked sum, with `other=0`
#
# `tl.sum(v)` adds up the lanes of a tensor. With a mask, the masked-off lanes of `tl.load` must
# still hold *something* before they are summed: `other=` says what. Triton documents that
# without `other` a masked-off lane's value is undefined. Here program `pid` adds up
# `x[0] .. x[pid]`, all the elements up to and including its own: the trick chapter 03's
# kernel uses to find where each request's output starts. Predict `out` for
# `x = [3, 1, 4, 1, 5]`:

# %%
@triton.jit
def sum_upto_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, OTHER: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)  # BLOCK >= len(x): one lane per element
    # lanes past pid read OTHER
    vals = tl.load(x_ptr + offs, mask=offs <= pid, other=OTHER)
    tl.store(out_ptr + pid, tl.sum(vals))


x = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32, device=device)
BLOCK = triton.next_power_of_2(len(x))  # 8 lanes for 5 elements
for other in (0, 100):
    out = torch.zeros(len(x), dtype=torch.int32, device=device)
    sum_upto_kernel[(len(x),)](x, out, BLOCK=BLOCK, OTHER=other)
    print(f"other={other:3d}: {out.tolist()}")
    if other == 0:
        assert out.tolist() == [3, 4, 8, 9, 14], (  # the running sums
            f"other=0 gives {out.tolist()}, expected the running sums [3, 4, 8, 9, 14]")
print("lanes each program sums:", BLOCK, "| masked-off lanes in program 0:", BLOCK - 1)

# %% [markdown]
# With `other=0` each program gets the running sum. With `other=100` every masked-off lane adds
# 100: program 0 has 7 of them (`3 + 700 = 703`), program 4 has 3. The mask does not shrink the
# tensor; it only decides which lanes load real data. That is why a masked sum needs
# `other=0`.
#
# ## The same thing as a Triton kernel
#
# Now `page_to_token`. Each **lane** computes one output slot on its own,
#
# ```
# out[i] = page_starts[i // P] + i % P
# ```
#
# Each program handles `BLOCK` consecutive outputs (primer 2), the grid has
# `cdiv(num_tokens, BLOCK)` programs, and lanes past the end are masked. `num_tokens` and
# `page_size` are ordinary runtime arguments, so different lengths and page sizes reuse the same
# compiled kernel. (Almost: Triton also specialises integer arguments on a few properties of
# their value: an integer equal to 1 is compiled in as a constant, and one divisible by 16
# gets its own version, which can then use wider memory accesses. So a handful of compilations
# can appear. Chapter 09 explains it and turns it off with `do_not_specialize`.) Positions are
# computed in `int64`, so `i * ...` cannot overflow on a very large pool.


# %%
@triton.jit
def page_to_token_kernel_nb(
    page_starts_ptr, out_ptr, num_tokens, page_size, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    # the output slots this program writes
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < num_tokens
    start = tl.load(page_starts_ptr + i // page_size, mask=mask, other=0).to(tl.int64)
    tl.store(
        out_ptr + i, (start + i % page_size).to(out_ptr.dtype.element_ty), mask=mask
    )


def page_to_token_triton_nb(
    pages: torch.Tensor, page_size: int, block: int = 128
) -> torch.Tensor:
    # lifted into kvlab.alloc.paging.page_to_token_triton
    if page_size == 1:
        return pages
    num_tokens = pages.numel() * page_size
    out = torch.empty(num_tokens, dtype=pages.dtype, device=pages.device)
    if num_tokens:
        grid = (triton.cdiv(num_tokens, block),)
        page_to_token_kernel_nb[grid](
            pages.contiguous(), out, num_tokens, page_size, BLOCK=block
        )
    return out


starts = torch.tensor([16, 4, 24], dtype=torch.int32, device=device)
print(page_to_token_triton_nb(starts, 4))
print("programs launched for 300 pages of 16:", triton.cdiv(300 * 16, 128))

# %% [markdown]
# ## Validate against the reference
#
# `kvlab.course.reference.page_to_token_ref` is the obviously-right version: two Python loops.
# Random page sizes, random numbers of pages in random order, both dtypes; the empty input and
# `page_size = 1` included. The package's torch version, `kvlab.page_to_token`, must agree too.

# %%
rng = random.Random(0)
n_trials = kvlab.base.runtime.pick(cpu=40, gpu=300)
for trial in range(n_trials):
    P = rng.choice([1, 2, 4, 16, 64])
    ids = rng.sample(range(4096), rng.randint(0, 20))
    dtype = rng.choice([torch.int32, torch.int64])
    starts = torch.tensor([p * P for p in ids], dtype=dtype, device=device)
    expected = page_to_token_ref(starts.tolist(), P)
    for fn in (kvlab.page_to_token, page_to_token_triton_nb):
        got = fn(starts, P)
        assert got.tolist() == expected, (fn.__name__, P, ids)
        assert got.dtype == dtype and got.device == starts.device, (
            f"{fn.__name__} returned {got.dtype} on {got.device}, given {dtype} on"
            f" {starts.device}"
        )
print(
    f"the Triton kernel and kvlab.page_to_token match the reference on {n_trials}"
    " random inputs"
)

# %% [markdown]
# A long input spans many programs; the last one is only partly full, so its mask matters:

# %%
P = 16
n_pages = kvlab.base.runtime.pick(cpu=100, gpu=100_000)
starts = torch.randperm(4 * n_pages, device=device)[:n_pages].to(torch.int64) * P
out = page_to_token_triton_nb(starts, P, block=128)
assert out.numel() == n_pages * P and torch.equal(
    out, kvlab.page_to_token(starts, P)
), (
    f"{out.numel()} slots, expected {n_pages * P}, or not the same as"
    " kvlab.page_to_token"
)
print(
    f"{n_pages} pages -> {out.numel()} slots in {triton.cdiv(out.numel(), 128)}"
    " programs; the last program fills"
    f" {out.numel() - 128 * (triton.cdiv(out.numel(), 128) - 1)} of its 128 lanes"
)

# %% [markdown]
# ## Bad input
#
# `kvlab.page_to_token` checks what it is given before doing anything: a 1-D integer tensor,
# `page_size >= 1`, and page starts that are multiples of `page_size`. Passing **page ids**
# instead of page starts is the classic slip (mini-sglang's `free_slots` holds starts), and the
# error says so:

# %%
try:
    kvlab.page_to_token(torch.tensor([1, 2, 3], device=device), 4)  # ids, not starts
except ValueError as err:
    print(type(err).__name__, "->", err)

# %% [markdown]
# ## A picture of random pages
#
# Six random pages out of a pool of sixteen, and the slots they become:

# %% alt="Top: a pool of 16 pages of 4 slots with six random pages coloured; bottom: page_to_token's output lists their slots page after page, in the order the pages were picked."
picked = random.Random(1).sample(range(16), 6)
fig = pages_to_slots_figure(page_ids=picked, page_size=4, num_pages=16)
plt.show()
got = kvlab.page_to_token(torch.tensor([p * 4 for p in picked], device=device), 4)
assert got.tolist() == page_to_token_ref(
    [p * 4 for p in picked], 4
), f"slots {got.tolist()} for pages {picked}"

# %% [markdown]
# ## Your turn
#
# First, what does the checker say about a wrong answer? Here the offsets were added along the
# wrong axis (a row of starts plus a column of offsets), which interleaves the pages. The
# checker names the case, the page and the first wrong slot, and draws expected against got:

# %% alt="The checker's picture of the wrong answer: the expected slots 4 to 11 above the slots the transposed version returned, with the 6 wrong positions outlined in red."
def transposed(page_starts, page_size):
    offsets = torch.arange(
        page_size, dtype=page_starts.dtype, device=page_starts.device
    )
    return (page_starts.unsqueeze(0) + offsets.unsqueeze(1)).flatten()


try:
    kvlab.check.page_to_token(transposed)
    raise AssertionError("the checker should have caught this")
except kvlab.check.CheckFailed as err:
    print(err)

# %% [markdown]
# Now yours. Put the torch version together: `my_page_to_token(page_starts, page_size)` returns every slot
# of the given pages, page after page, with the input's dtype and device, and the input itself
# when `page_size == 1`; it never changes `page_starts` (read-only). Everything it needs is in
# the build-up cells above.
#
# The checker tries named edge cases first (page size 1, a single page, no pages, pages out of
# order, large page ids), then random ones, and checks the result's dtype and device as well as
# its values. Until you write the body it only says `not attempted yet`. Stuck?
# `kvlab.check.hint("page_to_token", 1)` (then 2, 3, 4) and, as a last resort,
# `kvlab.solutions.show("page_to_token")`.

# %%
def my_page_to_token(page_starts: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of the pages starting at ``page_starts`` (page id * page_size), page
    after page.

    Keep ``page_starts``' dtype and device; return ``page_starts`` itself when
    ``page_size == 1``.
    """
    ### BEGIN SOLUTION
    if page_size == 1:
        return page_starts
    offsets = torch.arange(
        page_size, dtype=page_starts.dtype, device=page_starts.device
    )
    return (page_starts.unsqueeze(1) + offsets).flatten()
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: page_to_token
    raise NotImplementedError("a column of starts plus a row of offsets, then flatten")
    ### END STARTER


kvlab.check.page_to_token(my_page_to_token);

# %%
kvlab.check.hint("page_to_token", 1);
# kvlab.solutions.show("page_to_token")   # uncomment to read a reference solution

# %% [markdown]
# ## Lift
#
# The finished functions live in the package: `kvlab.page_to_token` and
# `kvlab.alloc.paging.page_to_token_triton` (kernel: `kvlab.alloc.paging_kernels.page_to_token_kernel`). Later
# chapters import them. Check that they agree with this notebook's versions: yours once it has
# passed the checker (until then the package's stands in, and the cell says so), and the
# notebook's Triton kernel.

# %%
my_version = kvlab.check.choose("page_to_token", my_page_to_token, kvlab.page_to_token)
rng = random.Random(2)
for _ in range(kvlab.base.runtime.pick(cpu=20, gpu=200)):
    P = rng.choice([1, 2, 4, 16, 64])
    dtype = rng.choice([torch.int32, torch.int64])
    starts = torch.tensor(
        [p * P for p in rng.sample(range(2048), rng.randint(0, 16))],
        dtype=dtype,
        device=device,
    )
    assert torch.equal(my_version(starts, P), kvlab.page_to_token(starts, P)), (
        f"page_size {P}, starts {starts.tolist()}: yours differs from"
        " kvlab.page_to_token"
    )
    assert torch.equal(
        page_to_token_triton_nb(starts, P),
        kvlab.alloc.paging.page_to_token_triton(starts, P),
    ), (
        f"page_size {P}, starts {starts.tolist()}: the notebook's kernel differs from"
        " kvlab's"
    )
print("notebook == kvlab.page_to_token == kvlab.alloc.paging.page_to_token_triton")

# %% [markdown]
# ## Summary
#
# - The free list names pages by their first slot (`page id * page_size`); `page_to_token` expands
#   each into its `page_size` slots, in order: `(starts.unsqueeze(1) + arange(P)).flatten()`
#   (the `flatten` of the fresh, contiguous sum is a view: no copy).
# - Keep the input's dtype and device (build `arange` with `dtype=`, `device=`); `page_size == 1`
#   is the identity.
# - Triton runs a kernel as a grid of program instances told apart by `tl.program_id`
#   (`tl.num_programs` counts them); each works on a block of lanes, `tl.arange(0, BLOCK)`, whose length is a compile-time power of
#   two; masks switch off the lanes past the end, and a masked `tl.sum` needs `other=0`.
# - As a Triton kernel `page_to_token` is one lane per output slot,
#   `out[i] = starts[i // P] + i % P`, masked at the end. Lengths and page sizes are runtime
#   arguments, so they reuse one compiled kernel (up to Triton's specialisation of integers equal
#   to 1 or divisible by 16).
#
# Next: chapter 02 writes these slots into the page table.
#
# ## Questions
#
# 1. Make `page_size` a `tl.constexpr` in `page_to_token_kernel_nb` (it is always a power of two
#    here). What can the compiler then do with `i // page_size` and `i % page_size`, and what
#    does it cost? Would a server mind?
# 2. For `BLOCK = 128` and `page_size = 16`, how many programs does the kernel launch, and how
#    many of their lanes do nothing, for 3 pages? For 3000 pages? What would one program per
#    page (`BLOCK = page_size`, no division at all) change?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# 1. With a power-of-two constant, `i // page_size` becomes a shift and `i % page_size` a bit
#    mask (integer division is slow on a GPU; shifts are cheap). The cost is one compilation per
#    page size. A server fixes its page size at start-up, so it pays once: that is why SGLang's
#    allocation kernels take `page_size: tl.constexpr`. A library function called with many page
#    sizes (as the checkers do here) would compile each one.
# 2. 3 pages of 16 are 48 slots: `cdiv(48, 128) = 1` program, 80 of its 128 lanes masked off.
#    3000 pages are 48000 slots: 375 programs, none idle (48000 is a multiple of 128). One
#    program per page removes the division and gives every program exactly `page_size` useful
#    lanes, but `page_size` must then be a constexpr (it is the `tl.arange` length), and programs
#    of 16 lanes are small: a GPU schedules threads in groups of 32, so half of each group would
#    idle. Small inputs waste lanes either way; large inputs favour blocks of a few hundred
#    lanes.
