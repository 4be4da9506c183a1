# %% [markdown]
# # 02 · The page table
#
# **Time:** about 45 minutes. **Assumes:** chapters 00 and 01 (pages, page starts,
# `page_to_token`, the Triton primer).
#
# **Goal.** Build mini-sglang's `_write_page_table`: after a batch of requests has been handed
# new [pages](glossary.md#page), record in the **[page table](glossary.md#page-table)** which physical [slot](glossary.md#token-slot) holds each new token. We build the
# table itself (and why it has one [row](glossary.md#row) too many), the `first_page`/`last_page` arithmetic of
# `allocate_paged`, the host path ([pinned](glossary.md#pinned-memory) index tensors and a single scatter), then a Triton
# kernel that does the same write with no per-token work on the host.
#
# The table, row by row:
#
#                  logical position (column) ->
#                  0    1    2    3  | 4    5    6    7  | 8 ...      (page_size P = 4)
#     row 0      [ 12   13   14   15 |  4    5    6    7 | -1 ... ]   one row per request slot
#     row 1      [ 40   41   42   -1 | -1   -1   -1   -1 | -1 ... ]   -1 = unmapped
#     ...
#     row R      [ -1 ... ]                                   spare row: the dummy request

# %%
import random

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

import kvlab
from kvlab import div_ceil
from kvlab.course.scenes.ch02_page_table import DEMO_REQUESTS, before_after_figure
from kvlab.course.reference import write_page_table_ref
from kvlab.course.viz import page_table_heatmap

torch.manual_seed(0)
device = kvlab.DEVICE
print(
    "device:",
    device,
    "| pinned host memory available:",
    kvlab.base.runtime.can_pin_memory(),
)

# %% [markdown]
# ## The table's shape
#
# `kvlab.new_page_table(max_running_req, max_seq_len, page_size)` makes an `int32` table of shape
# `(max_running_req + 1, aligned_max_seq_len)`. Each choice has a reason, and kvlab departs from
# mini-sglang in three of them (marked **[departure](glossary.md#departure)**).
#
# **One row per request slot, plus one.** On a GPU, mini-sglang runs [decode](glossary.md#decode) steps from **[CUDA
# graphs](glossary.md#cuda-graph)**. A CUDA graph is a recording of a whole sequence of GPU kernel launches (here: one
# decode forward pass of the model, hundreds of kernels) that the host can later replay with a
# single call, instead of launching each kernel again; what it cannot do is change the shapes it
# recorded, so each batch size needs its own graph. mini-sglang records graphs for the batch
# sizes `[1, 2, 4] + list(range(8, cuda_graph_max_bs + 1, 8))` (1, 2, 4, 8, 16, 24, ...; by
# default up to 256 on a GPU with more than 80 GB free, else 160) and pads a decode batch up to
# the next recorded size with copies of a **[dummy request](glossary.md#dummy-row)**. The dummy's attention reads and KV
# writes must land somewhere harmless, so it gets a row of its own, the last one
# (`table_idx = max_running_req`). mini-sglang also gives its [KV pool](glossary.md#kv-pool) one extra **dummy page**
# (`num_pages + 1` pages) and fills the dummy row with that page's first slot, so every padded
# request reads and writes only the dummy page.
#
# **Departure:** kvlab's page table keeps the spare row but leaves it at `-1`: nothing before
# chapter 10 replays CUDA graphs, and an unmapped row makes any use of it visible. Chapter 10's
# `PagedGenerator`, which does replay them, adds the dummy page and maps the row to it.

# %%
cuda_graph_max_bs = 160
# mini-sglang's list
graph_batch_sizes = [1, 2, 4] + list(range(8, cuda_graph_max_bs + 1, 8))
print(
    "CUDA graphs recorded for batch sizes:",
    graph_batch_sizes[:8],
    "...",
    graph_batch_sizes[-2:],
)


def padded_size(bs):
    """The recorded batch size a decode batch of ``bs`` requests runs as (the first one
    >= bs)."""
    return next(size for size in graph_batch_sizes if size >= bs)


for bs in [1, 3, 5, 9, 100]:
    print(f"a decode batch of {bs:3d} runs as {padded_size(bs):3d}: "
          f"{padded_size(bs) - bs:2d} dummy request(s) added, all on the dummy row")
assert [padded_size(b) for b in (3, 9, 100)] == [4, 16, 104], (
    f"padded sizes {[padded_size(b) for b in (3, 9, 100)]}, expected [4, 16, 104]")

# %% [markdown]
# **Columns.** A request's row needs one column per token it can reach, `max_seq_len`, rounded
# up. mini-sglang rounds up to a multiple of **32 entries** (`_align_up_32`: 32 `int32` entries
# are 128 bytes, so every row starts on a 128-byte boundary).
#
# **Departure:** kvlab rounds up to **whole pages** instead, `div_ceil(max_seq_len, P) * P`,
# because a request's last page is always written whole (`last_page * P` columns), so a width
# of whole pages always has room for it. Page sizes are powers of two, so when `P` divides 32
# (`P` = 1, 2, 4, 8, 16 or 32) a multiple of 32 is also a multiple of `P` and both roundings leave
# room; for `P = 64` a 32-rounded width can end in the middle of a page (a question at the end of
# the chapter asks what then happens).
#
# **Filled with `-1`.** **Departure:** mini-sglang zero-initialises its table (`torch.zeros`), but
# slot 0 is a real slot (the first token of page 0): a bug that reads an entry nobody wrote would
# silently read another request's KV. `-1` is visibly wrong: the heatmap leaves it blank, and an
# assert can find it.

# %%
max_running_req, max_seq_len, P = 4, 14, 4
table = kvlab.new_page_table(max_running_req, max_seq_len, P)
print("shape:", tuple(table.shape), "dtype:", table.dtype)
print("rows    =", max_running_req, "+ 1 (dummy)")
print(
    "columns = div_ceil(14, 4) * 4 =",
    div_ceil(max_seq_len, P) * P,
    "(mini-sglang: 14 rounded up to a multiple of 32 entries ="
    f" {(max_seq_len + 31) // 32 * 32})",
)
assert table.shape == (max_running_req + 1, 16) and (table == kvlab.UNMAPPED).all(), (
    f"table {tuple(table.shape)}: expected ({max_running_req + 1}, 16), every entry"
    " unmapped"
)

# %% [markdown]
# ## Which pages does each request need? (`allocate_paged`)
#
# A running request knows two lengths:
#
# - `cached_len`: tokens whose KV slots are already mapped in its row (from earlier steps, or
#   from a [prefix-cache hit](glossary.md#cache-hit));
# - `device_len`: tokens that need slots after this step.
#
# Pages `[0, first_page)` of its row are already mapped, with `first_page = div_ceil(cached_len, P)`
# — *ceil*, because a partly used last page is already the request's: new tokens continue in
# it. It needs mapped pages up to `last_page = div_ceil(device_len, P)`. If `last_page > first_page`
# it gets `last_page - first_page` new pages, recorded as `(table_idx, first_page, last_page)`.
#
# Four requests make the cases: a [prefill](glossary.md#prefill) from scratch, a prefill after a prefix-cache hit of
# two pages, a decode step that still fits in its page, and one that needs a new page.

# %%
for req in DEMO_REQUESTS:
    print(req)

# %%
allocation_info = []
needed_pages = 0
print(
    f"{'row':>3} {'cached':>6} {'device':>6} {'first_page':>10} {'last_page':>9}  new"
    " pages"
)
for req in DEMO_REQUESTS:
    first_page = div_ceil(req.cached_len, P)
    last_page = div_ceil(req.device_len, P)
    print(
        f"{req.table_idx:>3} {req.cached_len:>6} {req.device_len:>6} {first_page:>10}"
        f" {last_page:>9}  {last_page - first_page}"
    )
    if last_page > first_page:
        needed_pages += last_page - first_page
        allocation_info.append((req.table_idx, first_page, last_page))
print("allocation_info =", allocation_info, "| needed_pages =", needed_pages)
assert allocation_info == [(0, 0, 3), (1, 2, 4), (3, 2, 3)] and needed_pages == 6, (
    f"allocation_info {allocation_info} with {needed_pages} pages")

# %% [markdown]
# Row 2 (`cached_len = 6`, `device_len = 7`) needs nothing: position 6 lies in page 1, which it
# already has. Row 3 (`cached_len = 8`, `device_len = 9`) filled its second page exactly, so
# token 8 opens page 2.
#
# Now set the table up as earlier steps left it (rows 1-3 have their old pages), take six pages
# from a shuffled [free list](glossary.md#free-list) and expand them into slots with chapter 01's `page_to_token`:

# %%
rng = random.Random(0)
free_pages = list(range(20))
rng.shuffle(free_pages)
for req in DEMO_REQUESTS:  # the pages earlier steps mapped
    old = div_ceil(req.cached_len, P)
    if old:
        starts = torch.tensor(
            [free_pages.pop() * P for _ in range(old)], dtype=torch.int32, device=device
        )
        table[req.table_idx, : old * P] = kvlab.page_to_token(starts, P)
before = table.clone()

page_starts = torch.tensor(
    [free_pages.pop() * P for _ in range(needed_pages)],
    dtype=torch.int32,
    device=device,
)
allocated = kvlab.page_to_token(page_starts, P)
print("new page starts:", page_starts.tolist())
print("allocated slots:", allocated.tolist())
assert allocated.numel() == sum(
    (last - first) * P for _, first, last in allocation_info
), f"{allocated.numel()} slots allocated for {allocation_info}"

# %% [markdown]
# ## The host path: two index tensors and one scatter
#
# `allocated` lists the new slots, request after request. Position `k` of it belongs to some row
# and some column of the table. mini-sglang fills two host tensors as long as `allocated`,
#
# ```
# rows: | 0 0 0 0 0 0 0 0 0 0 0 0 | 1 1 1 1 1 1 1 1 | 3 3 3 3 |
# cols: | 0 1 2 3 ...         11  | 8 9 ...     15  | 8 9 10 11 |
# ```
#
# then copies them to the device and writes everything with one indexed assignment
# `page_table[rows, cols] = allocated`. One scatter instead of a Python loop of slice writes
# means one kernel launch instead of one per request.
#
# The host tensors are **pinned** (page-locked) when a CUDA driver is present. From pinned
# memory, `tensor.to(device, non_blocking=True)` queues the copy and returns at once: the host
# goes on with its next work while the copy runs. From ordinary (pageable) memory the same call
# is accepted too, but it runs synchronously: CUDA first copies pageable data into a pinned
# staging buffer of its own, and the call returns only when that is done. So `non_blocking=True`
# pays off only together with pinning. (Pinning needs CUDA; in the [interpreter](glossary.md#interpreter) everything is on
# the CPU and these copies do nothing.)

# %%
def _write_page_table(page_table, allocated, allocation_info, page_size):
    # lifted into kvlab.alloc.paging.write_page_table (which also validates every
    # argument first)
    needed_tokens = len(allocated)
    pin = kvlab.base.runtime.can_pin_memory()
    rows_host = torch.empty(needed_tokens, dtype=torch.int64, pin_memory=pin)
    cols_host = torch.empty(needed_tokens, dtype=torch.int64, pin_memory=pin)
    offset = 0
    for table_idx, first_page, last_page in allocation_info:
        first_pos, last_pos = first_page * page_size, last_page * page_size
        length = last_pos - first_pos
        rows_host[offset: offset + length].fill_(table_idx)
        torch.arange(first_pos, last_pos, out=cols_host[offset: offset + length])
        offset += length
    assert offset == needed_tokens, "allocation_info and allocated disagree"
    rows = rows_host.to(page_table.device, non_blocking=True)
    cols = cols_host.to(page_table.device, non_blocking=True)
    page_table[rows, cols] = allocated.to(page_table.dtype)
    return rows_host, cols_host  # returned only so this notebook can print them


after_host = before.clone()
rows_host, cols_host = _write_page_table(after_host, allocated, allocation_info, P)
print("rows:", rows_host.tolist())
print("cols:", cols_host.tolist())

# %% [markdown]
# Before and after, with the cells this batch wrote outlined. The old entries are untouched;
# row 2 did not change; the dummy row stays empty.

# %% alt="A page table before and after one write_page_table call: the 24 entries written into rows 0, 1 and 3 are outlined in red, while row 2 and the spare last row stay as they were."
fig = before_after_figure(
    before, after_host, P, title=f"allocation_info = {allocation_info}"
)
plt.show()
expected = write_page_table_ref(before.tolist(), allocated.tolist(), allocation_info, P)
assert (
    after_host.tolist() == expected
), "the host path wrote another table than the reference"
assert (
    torch.equal(after_host[2], before[2]) and (after_host[-1] == kvlab.UNMAPPED).all()
), "row 2 changed, or the dummy row is mapped"

# %% [markdown]
# ## The Triton path: per-request metadata, one launch
#
# The host path does work **per token** on the host: it fills two index tensors as long as the
# batch's new tokens (thousands in a big prefill) and copies both to the GPU. But each request's
# new slots form one contiguous run of `allocated` that goes to one contiguous run of its row. So
# four numbers per request say everything:
#
# ```
# meta[:, r] = (row, first_page, last_page, offset)  # offset: r's start in allocated
# program r:
#     n = (last_page - first_page) * P
#     page_table[row, first_page*P : last_page*P] = allocated[offset : offset + n]
# ```
#
# One [program](glossary.md#program) per request copies its run in blocks of `BLOCK` columns with a **runtime loop**
# (`range(0, length, BLOCK)`): the trip count depends on the request's length, not on anything
# compiled in, so one compilation serves every batch.


# %%
@triton.jit
def write_page_table_kernel_nb(
    page_table_ptr,
    row_stride,
    allocated_ptr,
    meta_ptr,
    num_requests,
    page_size,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(meta_ptr + r)
    first_page = tl.load(meta_ptr + num_requests + r)
    last_page = tl.load(meta_ptr + 2 * num_requests + r)
    offset = tl.load(meta_ptr + 3 * num_requests + r)
    length = (last_page - first_page) * page_size
    dst = page_table_ptr + row * row_stride + first_page * page_size
    for start in range(0, length, BLOCK):
        k = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = k < length
        slots = tl.load(allocated_ptr + offset + k, mask=mask, other=0)
        tl.store(dst + k, slots.to(page_table_ptr.dtype.element_ty), mask=mask)


def write_page_table_triton_nb(
    page_table, allocated, allocation_info, page_size, block=64
):
    # lifted into kvlab.alloc.paging.write_page_table_triton
    meta_rows, offset = [], 0
    for table_idx, first_page, last_page in allocation_info:
        meta_rows.append((table_idx, first_page, last_page, offset))
        offset += (last_page - first_page) * page_size
    if offset == 0:
        return None
    # [4, num_requests]
    meta = torch.tensor(meta_rows, dtype=torch.int64).T.contiguous()
    if kvlab.base.runtime.can_pin_memory():
        meta = meta.pin_memory()
    meta = meta.to(page_table.device, non_blocking=True)  # the only host->device copy
    grid = (len(meta_rows),)
    write_page_table_kernel_nb[grid](page_table, page_table.stride(0), allocated, meta,
                                     len(meta_rows), page_size, BLOCK=block)
    return meta


after_triton = before.clone()
meta = write_page_table_triton_nb(after_triton, allocated, allocation_info, P)
print(
    "meta, one column per request (rows: row, first_page, last_page, offset):\n", meta
)
assert torch.equal(
    after_triton, after_host
), "the Triton path wrote another table than the host path"
print("the Triton path wrote exactly the same table as the host path")

# %% [markdown]
# ## Validate on random batches
#
# Random page sizes, random requests (some with pages already mapped, some with none to add),
# tables whose width is not a multiple of the page size: both paths must equal the reference and
# each other.

# %%
def random_batch(rng, page_size, n_rows, pages_per_row):
    # sometimes not page-aligned
    width = pages_per_row * page_size + rng.randrange(page_size)
    info = []
    for row in rng.sample(range(n_rows), rng.randint(0, n_rows)):
        first = rng.randint(0, pages_per_row)
        info.append((row, first, rng.randint(first, pages_per_row)))
    n_pages = sum(last - first for _, first, last in info)
    starts = (
        torch.tensor(rng.sample(range(4 * n_pages + 4), n_pages), dtype=torch.int64)
        * page_size
    )
    allocated = kvlab.page_to_token(starts, page_size).to(torch.int32).to(device)
    start_table = torch.randint(-1, 100, (n_rows, width), dtype=torch.int32).to(device)
    return start_table, allocated, info


rng = random.Random(0)
n_trials = kvlab.base.runtime.pick(cpu=30, gpu=300)
for _ in range(n_trials):
    page_size = rng.choice([1, 2, 4, 16, 64])
    start_table, allocated_r, info = random_batch(
        rng, page_size, rng.randint(1, 6), rng.randint(1, 4)
    )
    expected = write_page_table_ref(
        start_table.tolist(), allocated_r.tolist(), info, page_size
    )
    host, tri = start_table.clone(), start_table.clone()
    _write_page_table(host, allocated_r, info, page_size)
    write_page_table_triton_nb(tri, allocated_r, info, page_size)
    assert host.tolist() == expected and torch.equal(host, tri), (page_size, info)
print(f"host path == Triton path == reference on {n_trials} random batches")

# %% [markdown]
# ## Bad input
#
# A wrong `allocation_info` would make the scatter (or the kernel) write into another request's
# row, past the end of the table, or twice into the same cells. `kvlab.write_page_table` and
# `kvlab.write_page_table_triton` share one validation that runs **before anything is written**
# and names the argument and the rule it broke. Two entries for the same row whose pages overlap:

# %%
table = before.clone()
snapshot = table.clone()
bad_info = [(0, 0, 3), (1, 2, 4), (0, 2, 3)]  # row 0 twice, page 2 in both
bad_allocated = torch.arange(24, dtype=torch.int32, device=device)
try:
    kvlab.write_page_table(table, bad_allocated, bad_info, P)
except ValueError as err:
    print(type(err).__name__, "->", err)
assert torch.equal(table, snapshot), "a refused write changed the page table"
print("page table unchanged")

# %% [markdown]
# A length that does not match the pages asked for, and a page range past the table's width:

# %%
for info, n in [([(0, 0, 3), (1, 2, 4)], 19), ([(3, 2, 5)], 12)]:
    try:
        kvlab.write_page_table_triton(
            table, torch.arange(n, dtype=torch.int32, device=device), info, P
        )
    except ValueError as err:
        print(type(err).__name__, "->", err)
assert torch.equal(table, snapshot), "a refused write changed the page table"

# %% [markdown]
# ## Your turn
#
# Write `my_write_page_table(page_table, allocated, allocation_info, page_size)`: it writes into
# `page_table` in place and returns nothing (`allocated` and `allocation_info` are read-only).
# Any correct method passes. It does not have to build
# per-token indices like the host path: one slice assignment per `allocation_info` entry is
# enough, if you keep track of where each entry's slots start in `allocated`.
#
# The [checker](glossary.md#checker) compares the whole table with the reference on edge cases (page size 1, entries
# with no new pages, the dummy row, requests that already have pages) and random batches; on a
# mistake it names the request row, the logical column and the page of the first wrong cell.
# Until you write the body it only says `not attempted yet`. Hints:
# `kvlab.check.hint("write_page_table", 1)` (up to 4); a solution:
# `kvlab.solutions.show("write_page_table")`.


# %%
def my_write_page_table(
    page_table: torch.Tensor,
    allocated: torch.Tensor,
    allocation_info: list[tuple[int, int, int]],
    page_size: int,
) -> None:
    """Write ``allocated`` into ``page_table`` in place.

    Entry ``(table_idx, first_page, last_page)`` of ``allocation_info`` takes the next
    ``(last_page - first_page) * page_size`` slots of ``allocated`` and puts them at
    ``page_table[table_idx, first_page * page_size : last_page * page_size]``.
    """
    ### BEGIN SOLUTION
    offset = 0
    for table_idx, first_page, last_page in allocation_info:
        length = (last_page - first_page) * page_size
        page_table[table_idx, first_page * page_size : last_page * page_size] = (
            allocated[offset : offset + length]
        )
        offset += length
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: write_page_table
    raise NotImplementedError("one slice write per allocation_info entry")
    ### END STARTER


kvlab.check.write_page_table(my_write_page_table);

# %%
kvlab.check.hint("write_page_table", 1);
# kvlab.solutions.show("write_page_table")   # uncomment to read a reference solution

# %% [markdown]
# ## Lift
#
# The finished functions are `kvlab.write_page_table` (host indices + one scatter) and
# `kvlab.write_page_table_triton` (kernel: `kvlab.alloc.paging_kernels.write_page_table_kernel`); both validate
# their input first. The cache manager of chapter 06 uses the Triton one. Compare them with this
# notebook's versions on random batches: the host path, the Triton path, and yours once it has
# passed the checker (until then the package's stands in, and the cell says so).

# %%
my_version = kvlab.check.choose(
    "write_page_table", my_write_page_table, kvlab.write_page_table
)
rng = random.Random(1)
for _ in range(kvlab.base.runtime.pick(cpu=15, gpu=200)):
    page_size = rng.choice([1, 2, 4, 16, 64])
    start_table, allocated_r, info = random_batch(
        rng, page_size, rng.randint(1, 6), rng.randint(1, 4)
    )
    mine, mine_host, mine_tri = (
        start_table.clone(),
        start_table.clone(),
        start_table.clone(),
    )
    lib_host, lib_tri = start_table.clone(), start_table.clone()
    my_version(mine, allocated_r, info, page_size)
    _write_page_table(mine_host, allocated_r, info, page_size)
    write_page_table_triton_nb(mine_tri, allocated_r, info, page_size)
    kvlab.write_page_table(lib_host, allocated_r, info, page_size)
    kvlab.write_page_table_triton(lib_tri, allocated_r, info, page_size)
    assert torch.equal(mine, lib_host) and torch.equal(mine_host, lib_host), (
        f"page_size {page_size}, allocation_info {info}: yours or the notebook's host"
        " path differs from kvlab's"
    )
    assert torch.equal(mine_tri, lib_tri) and torch.equal(lib_host, lib_tri), (
        f"page_size {page_size}, allocation_info {info}: the Triton paths differ from"
        " kvlab's host path"
    )
print("yours == notebook's == kvlab.write_page_table == kvlab.write_page_table_triton")

# %% [markdown]
# What does the checker say about a wrong answer? The classic slip is to forget to advance
# through `allocated`, so that every request gets the first request's slots:

# %% alt="The checker's picture of the wrong answer: the expected and the returned page tables side by side, with the one wrong cell (row 0, column 0) outlined in red."
def no_offset(page_table, allocated, allocation_info, page_size):
    for table_idx, first_page, last_page in allocation_info:
        length = (last_page - first_page) * page_size
        page_table[table_idx, first_page * page_size : last_page * page_size] = (
            allocated[:length]
        )


try:
    kvlab.check.write_page_table(no_offset)
    raise AssertionError("the checker should have caught this")
except kvlab.check.CheckFailed as err:
    print(err)

# %% [markdown]
# The whole table at once, after many batches, to end with (one cell per page when it is wide):

# %% alt="A heatmap of a page table after four batches of growth: each request's row is filled from column 0 up to its length with pages scattered through the pool, and the rest of the row is white."
rows, width, P = kvlab.base.runtime.pick(cpu=(16, 512, 16), gpu=(64, 4096, 16))
big = kvlab.new_page_table(rows - 1, width, P)
rng = random.Random(3)
free = list(range(rows * width // P))
rng.shuffle(free)
lengths = [0] * rows
for step in range(4):  # four batches, each growing some requests by some pages
    info = []
    for row in rng.sample(range(rows - 1), rows // 2):
        first = div_ceil(lengths[row], P)
        last = min(width // P, first + rng.randint(1, width // P // 4))
        if last > first:
            info.append((row, first, last))
            lengths[row] = last * P
    n_pages = sum(last - first for _, first, last in info)
    starts = torch.tensor(
        [free.pop() * P for _ in range(n_pages)], dtype=torch.int32, device=device
    )
    kvlab.write_page_table_triton(big, kvlab.page_to_token(starts, P), info, P)
ax = page_table_heatmap(
    big, P, title=f"after four batches: {rows} request slots x {width} positions"
)
plt.show()
assert all(
    (big[r] != kvlab.UNMAPPED).sum().item() == lengths[r] for r in range(rows)
), "a row maps other than its length's positions"

# %% [markdown]
# ## Summary
#
# - The page table is `(max_running_req + 1) x aligned_max_seq_len`. The spare row belongs to
#   the dummy request that pads decode batches up to a size with a recorded CUDA graph
#   (mini-sglang: `[1, 2, 4] + list(range(8, max_bs + 1, 8))`). mini-sglang points that row at
#   a dummy page, rounds the width to 32 entries and zero-fills; kvlab leaves the row unmapped,
#   rounds the width to whole pages and fills with `-1`.
# - `allocate_paged` gives each request pages `[div_ceil(cached_len, P), div_ceil(device_len, P))`;
#   one allocation for the batch, expanded to slots by `page_to_token`.
# - The host path builds row and column indices per token in pinned memory, copies them with
#   `non_blocking=True` (asynchronous only because they are pinned) and writes with one
#   scatter. The Triton path needs only four numbers per request and one launch; both write
#   identical tables.
# - Validation runs before any write and leaves the table untouched on bad input.
#
# Next: chapter 03 hands out slots token by token instead of page by page, with SGLang's
# three-part `alloc_extend_kernel`.
#
# ## Questions
#
# 1. With `page_size = 64`, find a `max_seq_len` for which mini-sglang's 32-entry rounding leaves
#    no room for a request's last page. What would the scatter `page_table[rows, cols] = ...` do
#    with such a request, and what does `kvlab.write_page_table` do?
# 2. A batch of 64 prefills of 2000 tokens each, `page_size = 16`. How many bytes of indices does
#    the host path copy to the GPU, and how many does the Triton path? Where else does the host
#    path spend time per token?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# 1. The width is `ceil(max_seq_len / 32) * 32`; a request of `max_seq_len` tokens writes columns
#    up to `ceil(max_seq_len / 64) * 64`. They differ when `max_seq_len` lies in the first half
#    of a 64-block: `max_seq_len = 130` gives 160 columns, but a 130-token request's last page
#    covers columns 128..191. The scatter's column index then runs past the row: PyTorch raises
#    an `IndexError` on the CPU and a device-side assertion on a GPU (after the batch has been
#    allocated). `kvlab.write_page_table` checks `last_page * page_size <= columns` for every
#    entry before writing anything and names the entry; and kvlab's width, rounded to whole
#    pages, never has this gap. In practice `max_seq_len` is a model's context length, usually a
#    multiple of 64, so mini-sglang's two roundings coincide there.
# 2. The host path copies two `int64` indices per token: 64 × 2000 × 2 × 8 bytes = 2,048,000
#    bytes (about 2 MB), and before that fills both tensors on the host, token by token (in
#    mini-sglang with `fill_` and `torch.arange(out=...)` per request, 256,000 entries). The
#    Triton path copies four `int64` numbers per request: 64 × 4 × 8 = 2048 bytes, a thousand
#    times less, and the GPU expands them. The allocated slots themselves are already on the
#    GPU in both.
