# %% [markdown]
# # 01 · Pages → token slots
#
# **Goal.** Build mini-sglang's `_page_to_token`: given the pages a request was just handed,
# list every token slot inside them, in order. First with three tensor operations
# (`unsqueeze`, `arange`, `flatten`), then as a Triton kernel; check both against a
# plain-Python reference, and finish with an exercise.
#
# **Vocabulary.** The KV pool has `num_pages * page_size` *slots* (one token's K and V each).
# Page `k` owns slots `k*P ... k*P + P - 1` (`P` = `page_size`). mini-sglang's free list does
# not store page ids but **page starts** — `free_slots = arange(num_pages) * page_size` — so a
# page is named by its first slot. The allocator hands out page starts; the page table needs
# one slot per token. `page_to_token` bridges the two.

# %%
import random

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

import kvlab
from kvlab.scenes.ch01_page_to_token import pages_to_slots_figure
from kvlab.reference import page_to_token_ref

torch.manual_seed(0)
device = kvlab.DEVICE
print("device:", device)

# %% [markdown]
# ## The picture
#
# Three pages were handed out, in the order the free list gave them: page 4, page 1, page 6.
# Their page starts are `[16, 4, 24]`. The answer lists page 4's slots, then page 1's, then
# page 6's: **order matters**, because the i-th slot of the answer goes to the i-th new token.

# %%
fig = pages_to_slots_figure(page_ids=(4, 1, 6), page_size=4, num_pages=8)
plt.show()

# %% [markdown]
# ## Build it step by step
#
# The worked example from the source: pages `[4, 8]`, `page_size = 4` should give
# `[4, 5, 6, 7, 8, 9, 10, 11]`. Each page start needs the offsets `0, 1, ..., P-1` added to it.
# Broadcasting does all the adds at once if the starts form a **column** and the offsets a **row**.

# %%
page_size = 4
pages = torch.tensor([4, 8], dtype=torch.int32, device=device)  # page starts, as in free_slots
print("pages              ", tuple(pages.shape), pages.tolist())

column = pages.unsqueeze(1)  # [num_pages] -> [num_pages, 1]
print("pages.unsqueeze(1) ", tuple(column.shape), column.tolist())

offsets = torch.arange(page_size, dtype=pages.dtype, device=pages.device)  # [page_size]
print("offsets            ", tuple(offsets.shape), offsets.tolist())

grid = column + offsets  # [num_pages, 1] + [page_size] -> [num_pages, page_size]
print("column + offsets   ", tuple(grid.shape), grid.tolist())

slots = grid.flatten()  # rows one after another: page after page
print("flatten()          ", tuple(slots.shape), slots.tolist())
assert slots.tolist() == list(range(4, 12))

# %% [markdown]
# Two details are worth a second look:
#
# - **dtype.** `free_slots` is `int32`. `torch.arange(page_size)` alone would be `int64`, and
#   `int32 + int64` silently promotes the whole result to `int64`. Building the offsets with
#   `dtype=pages.dtype` keeps the caller's dtype (and `device=` keeps its device).
# - **`page_size == 1`.** Then every page is one slot, the starts already *are* the slots, and
#   the function returns its input unchanged: no copy, no kernel.
#
# Put together (this is the function lifted into `kvlab.paging.page_to_token`):

# %%
def _page_to_token(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    # lifted into kvlab.paging.page_to_token (which also validates its input)
    if page_size == 1:
        return pages
    offsets = torch.arange(page_size, dtype=pages.dtype, device=pages.device)
    return (pages.unsqueeze(1) + offsets).flatten()


print(_page_to_token(torch.tensor([4, 8], dtype=torch.int32, device=device), 4))
one = torch.tensor([7, 2, 9], device=device)
assert _page_to_token(one, 1) is one  # identity: the very same tensor

# %% [markdown]
# ## The same thing as a Triton kernel
#
# On a GPU the torch version launches a few small kernels (arange, add, flatten's copy). A
# Triton kernel does it in one pass, and it is the smallest possible first kernel: each **lane**
# computes one output slot on its own,
#
# ```
# out[i] = page_starts[i // P] + i % P
# ```
#
# A program handles `BLOCK` consecutive outputs (`BLOCK` is a compile-time power of two); the
# grid has `cdiv(num_tokens, BLOCK)` programs. The total length and `page_size` are runtime
# arguments, so one compilation serves every input. Lanes past the end are **masked**: they
# neither load nor store. (In the interpreter an unmasked out-of-bounds access does not raise;
# it corrupts memory or crashes the kernel. Always mask.)

# %%
@triton.jit
def page_to_token_kernel_nb(page_starts_ptr, out_ptr, num_tokens, page_size, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # the output slots this program writes
    mask = i < num_tokens
    start = tl.load(page_starts_ptr + i // page_size, mask=mask, other=0).to(tl.int64)
    tl.store(out_ptr + i, (start + i % page_size).to(out_ptr.dtype.element_ty), mask=mask)


def page_to_token_triton_nb(pages: torch.Tensor, page_size: int, block: int = 128) -> torch.Tensor:
    # lifted into kvlab.paging.page_to_token_triton
    if page_size == 1:
        return pages
    num_tokens = pages.numel() * page_size
    out = torch.empty(num_tokens, dtype=pages.dtype, device=pages.device)
    if num_tokens:
        grid = (triton.cdiv(num_tokens, block),)
        page_to_token_kernel_nb[grid](pages.contiguous(), out, num_tokens, page_size, BLOCK=block)
    return out


starts = torch.tensor([16, 4, 24], dtype=torch.int32, device=device)
print(page_to_token_triton_nb(starts, 4))
print("programs launched for 300 pages of 16:", triton.cdiv(300 * 16, 128))

# %% [markdown]
# ## Validate both against the reference
#
# `kvlab.reference.page_to_token_ref` is the obviously-right version: two Python loops.
# Random page sizes, random numbers of pages in random order, both dtypes; the empty input and
# `page_size = 1` included.

# %%
rng = random.Random(0)
n_trials = kvlab.runtime.pick(cpu=40, gpu=300)
for trial in range(n_trials):
    P = rng.choice([1, 2, 4, 16, 64])
    ids = rng.sample(range(4096), rng.randint(0, 20))
    dtype = rng.choice([torch.int32, torch.int64])
    starts = torch.tensor([p * P for p in ids], dtype=dtype, device=device)
    expected = page_to_token_ref(starts.tolist(), P)
    for fn in (_page_to_token, page_to_token_triton_nb):
        got = fn(starts, P)
        assert got.tolist() == expected, (fn.__name__, P, ids)
        assert got.dtype == dtype and got.device == starts.device
print(f"torch and Triton versions match the reference on {n_trials} random inputs")

# %% [markdown]
# A long input spans many programs; the last one is only partly full, so its mask matters:

# %%
P = 16
n_pages = kvlab.runtime.pick(cpu=100, gpu=100_000)
starts = torch.randperm(4 * n_pages, device=device)[:n_pages].to(torch.int64) * P
out = page_to_token_triton_nb(starts, P, block=128)
assert out.numel() == n_pages * P and torch.equal(out, _page_to_token(starts, P))
print(f"{n_pages} pages -> {out.numel()} slots in {triton.cdiv(out.numel(), 128)} programs; "
      f"the last program fills {out.numel() - 128 * (triton.cdiv(out.numel(), 128) - 1)} of its 128 lanes")

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

# %%
picked = random.Random(1).sample(range(16), 6)
fig = pages_to_slots_figure(page_ids=picked, page_size=4, num_pages=16)
plt.show()
got = kvlab.page_to_token(torch.tensor([p * 4 for p in picked], device=device), 4)
assert got.tolist() == page_to_token_ref([p * 4 for p in picked], 4)

# %% [markdown]
# ## Your turn
#
# Write `my_page_to_token(page_starts, page_size)` yourself, then run the checker. It tries
# named edge cases first (page size 1, a single page, no pages, pages out of order, large page
# ids), then random ones, and it checks the result's dtype and device as well as its values. On a
# mistake it says which case and which page went wrong, expected vs got.
#
# The cell below holds a working answer so that the notebook runs end to end; replace the body
# with your own. Stuck? `kvlab.check.hint("page_to_token", 1)` (then 2, 3, 4) and, as a last
# resort, `kvlab.solutions.show("page_to_token")`.

# %%
def my_page_to_token(page_starts: torch.Tensor, page_size: int) -> torch.Tensor:
    # your code here
    if page_size == 1:
        return page_starts
    offsets = torch.arange(page_size, dtype=page_starts.dtype, device=page_starts.device)
    return (page_starts.unsqueeze(1) + offsets).flatten()


kvlab.check.page_to_token(my_page_to_token);

# %%
kvlab.check.hint("page_to_token", 1);
# kvlab.solutions.show("page_to_token")   # uncomment to read a reference solution

# %% [markdown]
# What does a wrong answer look like? Here the offsets were added along the wrong axis (a row of
# starts plus a column of offsets), which interleaves the pages:

# %%
def transposed(page_starts, page_size):
    offsets = torch.arange(page_size, dtype=page_starts.dtype, device=page_starts.device)
    return (page_starts.unsqueeze(0) + offsets.unsqueeze(1)).flatten()


try:
    kvlab.check.page_to_token(transposed)
    raise AssertionError("the checker should have caught this")
except kvlab.check.CheckFailed as err:
    print(err)

# %% [markdown]
# ## Lift
#
# The finished functions live in the package: `kvlab.page_to_token` and
# `kvlab.paging.page_to_token_triton` (kernel: `kvlab.kernels.page_to_token_kernel`). Later
# chapters import them. Check that they agree with this notebook's versions:

# %%
rng = random.Random(2)
for _ in range(kvlab.runtime.pick(cpu=20, gpu=200)):
    P = rng.choice([1, 2, 4, 16, 64])
    dtype = rng.choice([torch.int32, torch.int64])
    starts = torch.tensor([p * P for p in rng.sample(range(2048), rng.randint(0, 16))], dtype=dtype,
                          device=device)
    assert torch.equal(_page_to_token(starts, P), kvlab.page_to_token(starts, P))
    assert torch.equal(page_to_token_triton_nb(starts, P), kvlab.paging.page_to_token_triton(starts, P))
print("notebook == kvlab.page_to_token == kvlab.paging.page_to_token_triton")

# %% [markdown]
# ## Summary
#
# - The free list names pages by their first slot (`page id * page_size`); `page_to_token` expands
#   each into its `page_size` slots, in order: `(starts.unsqueeze(1) + arange(P)).flatten()`.
# - Keep the input's dtype and device (build `arange` with `dtype=`, `device=`); `page_size == 1`
#   is the identity.
# - As a Triton kernel it is one lane per output slot, `out[i] = starts[i // P] + i % P`, masked
#   at the end, with runtime sizes so one compilation serves every length.
#
# Next: chapter 02 writes these slots into the page table.
