# %% [markdown]
# # 08 · Capstone: attention through the page table
#
# **Time:** about 90 minutes. **Assumes:** chapters 01 (Triton), 02 and 05-07; attention and
# softmax as in a transformer layer (queries, keys, values, heads).
#
# **Goal.** Close the loop. Chapters 01-07 hand out KV *[slots](glossary.md#token-slot)*; here a model finally writes
# its keys and values into those slots and reads them back through the [page table](glossary.md#page-table). You will
# build a [KV pool](glossary.md#kv-pool), [paged attention](glossary.md#paged-attention) in plain torch (a warm-up exercise), a paged
# decode-attention kernel in Triton (one [program](glossary.md#program) per request and head, an [online softmax](glossary.md#online-softmax) over
# the request's tokens in blocks: its update is the main exercise), and then serve a tiny
# transformer through kvlab's `CacheManager`. The proof that the whole memory manager is
# right: the tokens it generates are **identical** to those of a plain contiguous [KV cache](glossary.md#kv-cache),
# the logits agree to `1e-4`, and a batch that shares a cached prefix computes **fewer**
# [prefill](glossary.md#prefill) tokens for the same answers.

# %%
import math
import random

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

import kvlab
from kvlab import CacheManager, InvalidArgument, Req
from kvlab.attention.paged_attention import (
    causal_attention,
    check_paged_attention_inputs,
    paged_decode_attention,
)
from kvlab.serving.tiny_engine import (
    PagedEngine,
    TinyConfig,
    TinyTransformer,
    generate_contiguous,
)
from kvlab.attention.kv_pool import KVPool, random_paged_layout
from kvlab.course.reference import paged_decode_attention_reference
from kvlab.course.scenes.ch08_attention import (
    gather_figure,
    prefill_bars,
    shared_prompt_batches,
)
from kvlab.alloc.paging import new_page_table
from kvlab.course.viz import page_table_heatmap

torch.manual_seed(0)
random.seed(0)
DEVICE = kvlab.DEVICE
# sizes: small in the interpreter (each Triton program runs on the CPU), larger on a GPU
N_REQ = kvlab.base.runtime.pick(cpu=3, gpu=8)
NEW_TOKENS = kvlab.base.runtime.pick(cpu=4, gpu=24)
N_RANDOM = kvlab.base.runtime.pick(cpu=4, gpu=40)

# %% [markdown]
# ## Intuition: a request's K/V are scattered over the pool in pages
#
# The attention of one new token needs the keys and values of *every earlier token* of its
# request. In a contiguous cache those sit side by side. In a paged cache they sit wherever
# the allocator found free [pages](glossary.md#page), and the request's **page-table row** says where: position
# `t` lives at slot `page_table[row, t]`. Attention "gathers" K and V through the row.

# %% alt="Top: a page table of requests A and B on pages of 4 slots; bottom: one layer's K pool of 8 pages, where A's and B's K vectors lie scattered in whole pages that attention gathers through each request's row."
gather_figure()
plt.show()

# %% [markdown]
# ## Build-up 1: a KV pool, written at the allocator's slots
#
# A `KVPool` holds, per layer, a K and a V tensor of shape `[num_slots, heads, head_dim]` —
# one row per token slot, `num_slots = num_pages * page_size`. The allocator hands out slots,
# and `store_kv(k, v, out_loc, layer)` writes row `i` of `k`/`v` at slot `out_loc[i]`.
# Two requests go through the real `CacheManager` here; their prompts' K/V are random.

# %%
P, HEADS, HEAD_DIM = 4, 2, 16
table = new_page_table(max_running_req=2, max_seq_len=32, page_size=P)
manager = CacheManager(num_pages=12, page_size=P, page_table=table)
pool = KVPool(num_slots=12 * P, num_layers=1, num_heads=HEADS, head_dim=HEAD_DIM)
print("pool.k:", tuple(pool.k.shape), "= [layers, slots, heads, head_dim]")

reqs = [Req(list(range(10)), table_idx=0), Req(list(range(50, 56)), table_idx=1)]
for req in reqs:
    manager.admit(req)
manager.allocate_paged(reqs)
g = torch.Generator().manual_seed(0)
contiguous_kv = []  # the same K/V kept side by side, to compare against
for req in reqs:
    n = req.device_len
    k = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(DEVICE)
    v = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(DEVICE)
    out_loc = table[req.table_idx, :n]                 # slot of every position
    pool.store_kv(k, v, out_loc, layer=0)
    contiguous_kv.append((k, v))
    print(f"request in row {req.table_idx}: {n} tokens at slots {out_loc.tolist()}")
    assert torch.equal(pool.k[0][out_loc.long()], k), (  # written where the row says
        f"row {req.table_idx}: the pool does not hold its K where the row says")

# %% [markdown]
# ## Build-up 2: gather through the row, then plain attention
#
# For one new query `q` (`[heads, head_dim]`) of a request with `n` tokens: take the row's
# first `n` slots, gather `K = k_pool[slots]` (`[n, heads, head_dim]`), and do ordinary
# attention. It must equal attention over the contiguous copy.

# %%
def gathered_attention(q, k_pool, v_pool, row_slots):
    k, v = k_pool[row_slots.long()], v_pool[row_slots.long()]
    scores = torch.einsum("hd,nhd->hn", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)


q = torch.randn(HEADS, HEAD_DIM, generator=g).to(DEVICE)
for req, (k, v) in zip(reqs, contiguous_kv):
    n = req.device_len
    paged = gathered_attention(q, pool.k[0], pool.v[0], table[req.table_idx, :n])
    # the query sits at the last position
    plain = causal_attention(q[None], k, v, q_offset=n - 1)[0]
    torch.testing.assert_close(paged, plain)
print("attention through the page table == attention over the contiguous K/V")

# %% [markdown]
# ## Warm-up exercise: paged attention in plain torch
#
# Now for a whole batch. Write `my_paged_attention_torch(q, k_pool, v_pool, page_table,
# table_idx, seq_lens)` that returns `[batch, heads, head_dim]`: request `b` attends to
# positions `[0, seq_lens[b])` of row `table_idx[b]` (rows need not be in request order); every
# argument is read-only.
# `kvlab.check.paged_attention` compares it with the reference on edge cases and random
# layouts and, when it recognises a mistake (reading the pool without the row, using row `b`
# instead of `table_idx[b]`, forgetting the scale), says so. Hints:
# `kvlab.check.hint("paged_attention", 1)` (up to 3); the reference:
# `kvlab.solutions.show("paged_attention")`.

# %%
def my_paged_attention_torch(q, k_pool, v_pool, page_table, table_idx, seq_lens):
    """Decode attention for a batch: request b attends to positions [0, seq_lens[b]) of
    row table_idx[b]."""
    ### BEGIN SOLUTION
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        slots = page_table[int(table_idx[b]), :int(seq_lens[b])].long()
        k, v = k_pool[slots], v_pool[slots]
        weights = torch.softmax(
            torch.einsum("hd,nhd->hn", q[b], k) / math.sqrt(q.shape[-1]), dim=-1
        )
        out[b] = torch.einsum("hn,nhd->hd", weights, v)
    return out
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: paged_attention
    raise NotImplementedError(
        "one request at a time: its row, its length, gather, attend"
    )
    ### END STARTER


kvlab.check.paged_attention(my_paged_attention_torch);

# %% [markdown]
# ## Build-up 3: the same softmax, one block at a time
#
# A GPU program cannot hold the scores of an arbitrarily long request at once. It walks the
# request's tokens in blocks of `BLOCK_N` and keeps three running values: the largest score
# so far `m`, the sum of `exp(score - m)` so far `l`, and the `exp`-weighted sum of V rows so
# far `acc`. When a block brings a larger maximum `m_new`, everything summed so far is scaled
# by `alpha = exp(m - m_new)` — the **online softmax**. At the end, `out = acc / l`.
#
# Why keep a maximum at all? `exp` of a float32 overflows past about 88: a score of 100 would
# turn into `inf` and the result into `NaN`. Softmax does not change when every score is
# shifted by the same number, so subtracting the largest score keeps every `exp` in `(0, 1]`.
# The running max is that trick for scores that arrive a block at a time. Below, the blocked
# version agrees with the all-at-once one, and a block of small scores followed by a block of
# large ones shows the rescale at work:

# %%
def online_softmax_attention(q, k_pool, v_pool, row_slots, block_n=4):
    m, l, acc = -float("inf"), 0.0, torch.zeros(q.shape[-1], device=q.device)
    for start in range(0, len(row_slots), block_n):
        slots = row_slots[start:start + block_n].long()
        scores = (k_pool[slots] @ q) / math.sqrt(q.shape[-1])       # [block]
        m_new = max(m, float(scores.max()))
        # rescale what came before
        alpha = math.exp(m - m_new)
        p = torch.exp(scores - m_new)
        acc = acc * alpha + p @ v_pool[slots]
        l = l * alpha + float(p.sum())
        m = m_new
    return acc / l


head = 1
row = table[0, :reqs[0].device_len]
blocked = online_softmax_attention(
    q[head], pool.k[0][:, head], pool.v[0][:, head], row, block_n=4
)
whole = gathered_attention(q, pool.k[0], pool.v[0], row)[head]
print("block by block:", blocked[:4].tolist())
print("all at once:   ", whole[:4].tolist())
torch.testing.assert_close(blocked, whole)

k_toy = torch.zeros(8, HEAD_DIM)
# block 2's scores are huge
k_toy[:, 0] = torch.tensor([1.0, 2.0, 0.0, 1.0, 90.0, 91.0, 89.0, 92.0])
q_toy = torch.zeros(HEAD_DIM)
q_toy[0] = math.sqrt(HEAD_DIM)  # so that score = k[:, 0]
v_toy = torch.randn(8, HEAD_DIM, generator=g)
slots_toy = torch.arange(8)
print("naive exp of the scores:", torch.exp(k_toy[:, 0]).tolist()[4:], "(overflow)")
torch.testing.assert_close(
    online_softmax_attention(q_toy, k_toy, v_toy, slots_toy, block_n=4),
    torch.softmax(k_toy[:, 0], 0) @ v_toy,
)
print("online softmax with a rescale between the blocks: no overflow, same answer")

# %% [markdown]
# ## The kernel, and your turn
#
# One program per `(request, head)`. It reads its row index and length, loads its query,
# and loops over the request's tokens in blocks — `range(0, seq_len, BLOCK_N)` with a
# **runtime** bound, so a new length never recompiles. Every load is [masked](glossary.md#mask) (`mask_n`
# beyond the request's length, `mask_d` beyond `head_dim` when it is not a power of two), and
# the host checks before launch that every slot the row names for `[0, seq_len)` is inside the
# pool (`check_paged_attention_inputs`): an unmapped `-1` would otherwise be read as a slot.
#
# In one block, with `BLOCK_N = 4` and a request of 9 tokens, the third block looks like this:
#
# ```
# offs_n   = [ 8     9     10    11   ]      start + tl.arange(0, BLOCK_N)
# mask_n   = [ T     F     F     F    ]      offs_n < seq_len
# slots    = [ 41    0     0     0    ]      page_table[row, offs_n] (0 where masked)
# scores   = [ 0.7  -inf  -inf  -inf  ]      q . k * scale, -inf where masked
# v        = [ v41   0     0     0    ]      one row of head_dim per lane
# ```
#
# **Exercise `paged_attention_kernel`.** The kernel below is complete except for the online
# softmax update inside the loop: from `scores` and `v`, compute `m_new`, `alpha` and `p`,
# then the new `acc`, `l_i` and `m_i`, as build-up 3 did in torch. In Triton: `tl.max(x, 0)`
# and `tl.sum(x, 0)` reduce a block to a scalar, `tl.maximum` and `tl.exp` work [lane](glossary.md#lane) by lane,
# and `p[:, None] * v` weighs each row of `v` by its lane's `p`. The masked lanes need no
# care if you get the order right: their score is `-inf`, so their `p` is `exp(-inf) = 0`.
# The kernel writes only `out`; its other tensors are read-only.
# `kvlab.check.paged_attention_kernel` launches your kernel on blocks smaller than most
# requests (`BLOCK_N` 4 to 16, with the default `scale` and others), with scores that rise from
# block to block, fall, and are large enough that a plain `exp` overflows, and names the
# mistake when it recognises it. Hints:
# `kvlab.check.hint("paged_attention_kernel", 1)` (up to 3); the reference:
# `kvlab.solutions.show("paged_attention_kernel")`.


# %%
@triton.jit
def my_paged_attention_kernel(
    q_ptr,
    k_pool_ptr,
    v_pool_ptr,
    page_table_ptr,
    table_idx_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    stride_q_b,
    stride_q_h,
    stride_kv_s,
    stride_kv_h,
    stride_pt_row,
    stride_o_b,
    stride_o_h,
    head_dim,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_q_b + h * stride_q_h + offs_d,
        mask=mask_d,
        other=0.0,
    )
    m_i = -float("inf")  # running max of the scores so far
    l_i = 0.0  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running sum of exp(score - m_i) * v
    for start in range(0, seq_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        slots = tl.load(
            page_table_ptr + row * stride_pt_row + offs_n, mask=mask_n, other=0
        ).to(tl.int64)
        kv_offs = slots[:, None] * stride_kv_s + h * stride_kv_h + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_pool_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.where(mask_n, tl.sum(q[None, :] * k, 1) * scale, -float("inf"))
        v = tl.load(v_pool_ptr + kv_offs, mask=kv_mask, other=0.0)
        ### BEGIN SOLUTION
        m_new = tl.maximum(tl.max(scores, 0), m_i)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        ### END SOLUTION
        ### BEGIN STARTER
        # YOUR CODE HERE: paged_attention_kernel
        # the online-softmax update: m_new, alpha and p from scores; then acc, l_i and
        # m_i
        ### END STARTER
    tl.store(
        out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h + offs_d,
        acc / l_i,
        mask=mask_d,
    )


def my_paged_attention(q, k_pool, v_pool, page_table, table_idx, seq_lens, block_n=16):
    # before launch
    check_paged_attention_inputs(q, k_pool, v_pool, page_table, table_idx, seq_lens)
    batch, heads, head_dim = q.shape
    dev = q.device
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=dev)
    table_idx = torch.as_tensor(table_idx).to(dev, torch.int64)
    seq_lens = torch.as_tensor(seq_lens).to(dev, torch.int64)
    my_paged_attention_kernel[(batch, heads)](
        q,
        k_pool,
        v_pool,
        page_table,
        table_idx,
        seq_lens,
        out,
        1.0 / math.sqrt(head_dim),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        head_dim,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out


kvlab.check.paged_attention_kernel(my_paged_attention_kernel);

# %%
kvlab.check.hint("paged_attention_kernel", 1);
# kvlab.solutions.show("paged_attention_kernel")   # uncomment to read the reference
# solution

# %% [markdown]
# ## Validate against `kvlab.course.reference`
#
# The reference (`paged_decode_attention_reference`) loops over requests in plain torch. We
# compare on the named edge cases — page size 1, page-aligned and unaligned lengths, a single
# one-token request, many requests with rows out of order, a `head_dim` that is not a power
# of two, blocks smaller than a page and larger than a request — and on seeded random layouts.
# From here on the chapter uses your kernel once it has passed its [checker](glossary.md#checker); until then,
# kvlab's `paged_decode_attention` stands in (the next cell says which one runs).

# %%
attend = kvlab.check.choose(
    "paged_attention_kernel", my_paged_attention, paged_decode_attention
)


def random_layout(seed, page_size, seq_lens, heads=2, head_dim=16):
    """Random K/V; each request's tokens on shuffled, disjoint pages; rows in shuffled
    order."""
    return random_paged_layout(
        seed, page_size, seq_lens, heads=heads, head_dim=head_dim, device=DEVICE
    )


edge_cases = {
    "page_size 1": (1, [5, 3], 16, 4),
    "page-aligned lengths": (4, [8, 4], 16, 4),
    "unaligned lengths": (4, [7, 2, 13], 16, 4),
    "one request, one token": (16, [1], 16, 16),
    "many requests, rows shuffled": (2, [3, 9, 1, 6, 4, 11], 16, 4),
    "head_dim 12 (masked lanes)": (4, [9, 5], 12, 4),
    "block larger than every request": (4, [6, 3], 16, 64),
}
for name, (page_size, seq_lens, head_dim, block_n) in edge_cases.items():
    args = random_layout(0, page_size, seq_lens, head_dim=head_dim)
    torch.testing.assert_close(
        attend(*args, block_n=block_n),
        paged_decode_attention_reference(*args),
        atol=1e-5,
        rtol=1e-5,
    )
    print(f"✓ {name}")
rng = random.Random(1)
for i in range(N_RANDOM):
    page_size = rng.choice([1, 2, 4, 16])
    seq_lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
    args = random_layout(100 + i, page_size, seq_lens)
    torch.testing.assert_close(
        attend(*args, block_n=rng.choice([4, 16])),
        paged_decode_attention_reference(*args),
        atol=1e-5,
        rtol=1e-5,
    )
print(f"✓ {N_RANDOM} random layouts")

# %% [markdown]
# Bad input never reaches the kernel. A length that runs past what the row maps (here,
# position 7 of a 7-token request is still unmapped, `-1`) is refused on the host, with the
# argument and the rule in the message:

# %%
q_, k_, v_, table_, rows_, lens_ = random_layout(0, 4, [7, 2])
try:
    my_paged_attention(q_, k_, v_, table_, rows_, torch.tensor([8, 2]))
    raise AssertionError("should have been refused")
except InvalidArgument as err:
    print("InvalidArgument:", err)

# %% [markdown]
# ## A tiny model, served through the page table
#
# `kvlab.serving.tiny_engine.TinyTransformer` has seeded random weights (no download): 2 layers, 2
# heads of 16 dims, a vocabulary of 96, learned absolute positions. Its `forward` takes an
# `attend(layer, q, k, v)` callback, so the same weights run two ways:
#
# * `generate_contiguous`: each request keeps its own K/V tensors, side by side — the baseline;
# * `PagedEngine.generate`: the memory manager of this course. `admit` (match + [lock](glossary.md#lock) the hit),
#   one `allocate_paged` for the batch, prefill of only the *uncached* positions with
#   `store_kv` at the row's slots (prefill attention gathers through the row in torch), then
#   `cache_req(finished=False)`; each [decode](glossary.md#decode) step `allocate_paged` + `store_kv` + **the Triton
#   paged decode attention**; finally `cache_req(finished=True)`, so the prompt and answer
#   stay in the [prefix cache](glossary.md#prefix-cache) for the next batch.
#
# Two batches share a 14-token system prompt. We serve both through one engine and compare
# with the baseline. The page table is photographed after the second batch's prefill.

# %%
model = TinyTransformer(
    TinyConfig(vocab_size=96, num_layers=2, num_heads=2, head_dim=16, seed=0)
)
first, second = shared_prompt_batches(n=N_REQ)
engine = PagedEngine(model, page_size=4, num_pages=16 * N_REQ, max_running=N_REQ,
                     max_seq_len=64)
photos = {}
paged = [
    engine.generate(first, NEW_TOKENS),
    engine.generate(
        second,
        NEW_TOKENS,
        on_step=lambda phase, reqs: photos.setdefault(phase, engine.page_table.clone()),
    ),
]
contiguous = [
    generate_contiguous(model, first, NEW_TOKENS),
    generate_contiguous(model, second, NEW_TOKENS),
]

for i, (c, p) in enumerate(zip(contiguous, paged)):
    print(f"batch {i + 1}: tokens contiguous {c.tokens}")
    print(f"         tokens paged      {p.tokens}")
    print(
        f"         prompt tokens computed: contiguous {c.prefill_tokens}, paged"
        f" {p.prefill_tokens} (cache hits per request: {p.hit_tokens})"
    )

# %% [markdown]
# ## Validate: the whole memory manager, end to end
#
# Same tokens; logits within `atol = 1e-4` (float32: the two paths add the same numbers in a
# different order, so they differ in the last bits, ~1e-6); and the second batch computed
# fewer prompt tokens because the system prompt's whole pages (12 of its 14 tokens, P=4) came
# from the cache. After both batches the manager's integrity check passes: every page is free
# or cached, none lost.

# %%
worst = 0.0
for c, p in zip(contiguous, paged):
    assert (
        p.tokens == c.tokens
    ), f"the paged engine's tokens {p.tokens}, the contiguous one's {c.tokens}"
    for a, b in zip(p.logits, c.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        worst = max(worst, float((a - b).abs().max()))
print(f"tokens identical; largest logit difference {worst:.2e} (tolerance 1e-4)")
assert paged[0].hit_tokens == [0] * N_REQ, (
    f"the first batch hit {paged[0].hit_tokens} tokens: nothing was cached yet")
assert all(h == 12 for h in paged[1].hit_tokens), (
    f"the second batch hit {paged[1].hit_tokens}: the system prompt's 12 tokens each")
assert paged[1].prefill_tokens < contiguous[1].prefill_tokens, (
    "the second batch computed no fewer prompt tokens with the cache")
assert paged[1].prefill_tokens == contiguous[1].prefill_tokens - 12 * N_REQ, (
    f"computed {paged[1].prefill_tokens}, expected"
    f" {contiguous[1].prefill_tokens - 12 * N_REQ}"
)
engine.manager.check_integrity()
assert engine.manager.running == [], f"still running: {engine.manager.running}"

# %% [markdown]
# ## Picture: shared pages in the page table
#
# The second batch's page table right after its prefill: the first three pages of every row
# are the **same physical pages** (same colour, same slot numbers) — the system prompt the
# first batch left in the cache — and each request's own question and answer follow on pages
# of its own.

# %% alt="Left: batch 2's page table after prefill, three rows sharing their first three pages before pages of their own; right: bars of the prompt tokens computed in each batch, equal in batch 1 and far fewer with the prefix cache in batch 2, with the same generated tokens."
fig, (ax1, ax2) = plt.subplots(
    1, 2, figsize=(8.4, 3.0), gridspec_kw=dict(width_ratios=[1.6, 1])
)
cols = max(len(p) for p in second) + NEW_TOKENS
cols = -(-cols // 4) * 4
page_table_heatmap(
    photos["prefill"][:N_REQ].cpu(),
    4,
    cols=slice(0, cols),
    ax=ax1,
    colorbar=False,
    title="batch 2 after prefill: three shared pages,\nthen each request's own",
)
prefill_bars(contiguous, paged, ax2)
fig.tight_layout()
plt.show()
shared = photos["prefill"][:N_REQ, :12]
assert (shared == shared[0]).all(), (   # every row maps the same 12 cached slots
    "every row should map the same 12 cached slots first")

# %% [markdown]
# ## Lift: the notebook's kernel vs `kvlab.attention.paged_attention.paged_decode_attention`
#
# The kernel above lives on as `kvlab.attention.decode_kernels.paged_decode_attention_kernel`, with
# its checked wrapper `kvlab.attention.paged_attention.paged_decode_attention` (which picks `BLOCK_N` by
# runtime). On random layouts your kernel must agree with it, and your torch warm-up with the
# reference (each one stands in for yours until yours has passed its checker).

# %%
attention_torch = kvlab.check.choose(
    "paged_attention", my_paged_attention_torch, paged_decode_attention_reference
)
rng = random.Random(2)
for i in range(N_RANDOM):
    page_size = rng.choice([1, 4, 16])
    args = random_layout(
        500 + i, page_size, [rng.randint(1, 48) for _ in range(rng.randint(1, 3))]
    )
    ours = attend(*args, block_n=16)
    lifted = paged_decode_attention(*args)
    torch.testing.assert_close(
        ours, lifted, atol=1e-5, rtol=1e-5, msg=lambda m: f"layout {i}, kernels: {m}"
    )
    # the checker takes any float dtype from the torch version: compare in float32
    torch.testing.assert_close(
        attention_torch(*args).float(),
        paged_decode_attention_reference(*args),
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: f"layout {i}, torch versions: {m}",
    )
print(
    "✓ the notebook's kernel == kvlab's kernel, the torch version == kvlab's"
    f" reference, on {N_RANDOM} random layouts"
)

# %% [markdown]
# ## K/V in 16 bits, as servers keep them
#
# A float32 pool spends 4 bytes on every number. Servers keep K and V in 16 bits, half the
# memory, so twice the tokens fit in the same pool. The kernel needs no change: it converts
# each K/V row to float32 as it loads it (`.to(tl.float32)`) and does the dot products and the
# softmax in float32, so the pool's rounding is the only difference.
#
# Which 16-bit type depends on the GPU. [bfloat16](glossary.md#bfloat16) keeps float32's
# range and is what servers use, but GPUs compute in it only from
# [compute capability](glossary.md#compute-capability) 8.0 (sm_80, Ampere) on: Colab's free
# T4 is sm_75, where torch supports bfloat16 only by emulation
# (`torch.cuda.is_bf16_supported(including_emulation=False)` is False below 8.0). There the
# chapter keeps its pool in float16, as small and with more mantissa bits but a narrower range
# (K and V stay far inside it). `kvlab.base.runtime.half_dtype()` makes the choice (bfloat16 in the
# interpreter and from sm_80 on, float16 before), and the cell says which it took:

# %%
HALF = kvlab.base.runtime.half_dtype()
print("16-bit K/V here:", kvlab.base.runtime.half_note(HALF))
q_f, k_f, v_f, table_f, rows_f, lens_f = random_layout(7, 4, [9, 14, 3])
k_h, v_h = k_f.to(HALF), v_f.to(HALF)
out_h = paged_decode_attention(q_f, k_h, v_h, table_f, rows_f, lens_f)
# the kernel read the 16-bit numbers exactly: the reference on the same numbers agrees
# closely
torch.testing.assert_close(out_h, paged_decode_attention_reference(
    q_f, k_h.float(), v_h.float(), table_f, rows_f, lens_f), atol=1e-5, rtol=1e-5)
# and the pool's rounding moves the output a little from the float32 pool's
gap = (
    (out_h - paged_decode_attention_reference(q_f, k_f, v_f, table_f, rows_f, lens_f))
    .abs()
    .max()
    .item()
)
assert (
    out_h.dtype == torch.float32 and gap < 5e-2
), f"the 16-bit pool moved the output by {gap}"
print(f"✓ {k_h.element_size()} bytes per number instead of {k_f.element_size()}: "
      f"{k_h.nbytes + v_h.nbytes} bytes of K/V instead of {k_f.nbytes + v_f.nbytes}; "
      f"the output moves by at most {gap:.1e}")

# %% [markdown]
# ## Summary
#
# * A KV pool is one tensor per layer indexed by **token slot**; the allocator's `out_loc` says
#   where a step's new K/V go, and the page-table row says where every earlier token's went.
# * Paged decode attention = gather through the row + softmax + weighted sum. The Triton
#   kernel does it per `(request, head)` with an online softmax over blocks of the row (a
#   running max, and a rescale of what came before whenever it grows), a runtime loop bound,
#   masked loads, and host-side checks that every slot it will read exists.
# * Served through `CacheManager` — prefix matching, locking, page allocation at boundaries,
#   `cache_req` with the duplicate-row fix — a tiny model produces exactly the tokens of a
#   contiguous cache, while a shared prefix is computed once.
#
# Chapter 09 makes the allocation kernels fast.
#
# ## Questions
#
# 1. Many models use *[grouped-query attention](glossary.md#grouped-query-attention)*: `H` query heads share `H / G` K/V heads (each
#    group of `G` query heads reads the same K and V). What changes in the pool's shape, in
#    the kernel's grid and in its loads? What does the kernel then read less of?
# 2. `PagedEngine` runs decode attention in Triton but prefill attention in torch, by
#    gathering the row. What would a paged *prefill* ([extend](glossary.md#extend)) attention kernel have to do
#    that this decode kernel does not?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# **1. Grouped-query attention.** The pools shrink to `[num_slots, H / G, head_dim]`: `G`
# times less KV memory per token, so `G` times more tokens fit in the same pages, which is
# the point of GQA for a server. In the kernel, program `(b, h)` reads K/V head `h // G`
# (`h // G * stride_kv_h` instead of `h * stride_kv_h`); everything else stays. Better still,
# one program can serve a whole group: load the block's K and V rows once and compute the
# `G` query heads' scores against them (a `[G, head_dim]` query tile), which divides the
# memory traffic of the loads, the kernel's main cost, by `G`. The grid becomes
# `(batch, H / G)`, and `m_i`, `l_i`, `acc` become vectors of `G` running values.
#
# **2. Paged prefill.** A prefill (extend) has many queries per request: positions
# `[cached_len, seq_len)`, each attending causally to positions up to its own. A kernel for
# it tiles the queries too (a block of query positions per program, like FlashAttention),
# reads K/V through the row for the whole prefix (cached pages and the new ones the step
# has just written with `store_kv`), applies the causal mask per (query, key) pair, and has
# to handle requests whose number of new tokens differs widely in one batch (an offset
# table of where each request's queries start, as chapter 09's scan computes for slots).
# The decode kernel is the special case of one query at the last position.
