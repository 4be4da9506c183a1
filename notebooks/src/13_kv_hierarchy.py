# %% [markdown]
# # 13 · A KV hierarchy: device, host memory, disk
#
# **Time:** about 90 minutes. **Assumes:** chapters 05-06 (the radix
# [prefix cache](glossary.md#prefix-cache), `CacheManager`, `cache_req`), chapter 10
# (`kvlab.serving.hf.PagedGenerator`), chapter 11 (the
# [chained hash](glossary.md#chained-hash) of a page) and chapter 12 (a request's KV
# copied to host memory and back).
#
# **Goal.** Twelve chapters kept KV in one place: the [pages](glossary.md#page) on the
# GPU. When they run out, the prefix cache [evicts](glossary.md#eviction) and the next
# request with that prefix computes it again. Multi-turn chats and agents make that
# expensive: every turn re-sends the whole history, and the histories of all the
# conversations in flight -- the **[working set](glossary.md#working-set)** -- soon
# outgrow the device. A 16k-token history of a model with 32 layers and 8 K/V heads of
# 128 in bfloat16 is 2 GiB of KV; an 80 GB GPU that holds the weights too keeps a few
# dozen such conversations, a server sees thousands.
#
# So engines put tiers under the GPU, as a CPU puts caches over its memory. SGLang's
# **HiCache** keeps the radix tree's nodes on the GPU (L1), in a pinned
# [host pool](glossary.md#host-tier) (L2, twice the device pool by default) and in a
# storage backend (L3: files, Mooncake, 3FS, NIXL), keyed by page hashes. vLLM offloads
# KV blocks to CPU memory through its KV-connector interface, keyed by the block hashes of
# chapter 11, and LMCache adds a disk. You will build the same: a prefix cache whose nodes
# know where their KV lives, a [write policy](glossary.md#write-policy) that decides when
# a device page gets its host copy, a [load-back](glossary.md#load-back) that brings a hit
# from host memory into new device pages before the prefill, a disk store that a second
# process can trust, and a simulator that shows a hierarchy larger than any laptop.
#
# Sources, read at these commits: SGLang `python/sglang/srt/mem_cache/hiradix_cache.py`
# (`263bc85d`), `managers/cache_controller.py` (`350cb879`), `mem_cache/memory_pool_host.py`
# (`b0396145`), `mem_cache/hicache_storage.py` (`bb424de2`); vLLM
# `vllm/v1/kv_offload/abstract.py` (`70c98942`), `lru_manager.py` (`3a04cf8f`),
# `vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py` (`73689081`);
# LMCache `lmcache/utils.py` (`f26a4591`).

# %%
import os
import random
import tempfile

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab.alloc.paging import new_page_table
from kvlab.attention.kv_pool import KVPool
from kvlab.course.scenes.ch13_hierarchy import (bench_rows, copy_timeline_figure,
                                                hit_rate_figure, hit_rate_rows,
                                                tier_tree_figure)
from kvlab.course.viz.tiers import draw_tier_tree
from kvlab.manager.cache_manager import CacheManager, Req
from kvlab.prefix.disk_store import DiskStore, KVIdentity, disk_key, trust_reason
from kvlab.prefix.hash_chain import chain_hash
from kvlab.prefix.host_tier import HostTier, KVLayout
from kvlab.prefix.tier_plans import eviction_plan, load_back_plan
from kvlab.prefix.tiered_cache import TieredRadixCache
from kvlab.serving.hf import DiskCache, HostCache, PagedGenerator, tiny_model
from kvlab.serving.kv_copies import KVCopies, runs
from kvlab.serving.load_back import admit_with_load_back

torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Intuition: a tree whose nodes live in tiers
#
# Three chats, three turns each, served one after the other by a cache manager of 9
# device pages over 14 host pages. Each node of chapter 05's tree now says where its KV
# lives. Blue nodes are on the device **and** have a host copy
# (*[clean](glossary.md#clean-and-dirty)*: evicting them from the device costs nothing,
# the host copy stays). Orange ones are on the device only (*dirty*: evicting them loses
# their KV unless it is copied first). Green ones are in host memory only: the device
# evicted them, and a request that reaches them loads them back.

# %% alt="A radix tree of three chats' histories: the first two chats' first nodes are on the device with host copies, the second chat's newest nodes on the device only, and the third chat's whole history in host memory only."
tier_tree_figure()
plt.show()

# %% [markdown]
# Two rules hold the picture together. The device part is **closed under parents**: a
# node on the device has its parent there too (a request maps its prefix from the root,
# so evicting a parent before its children would leave them unreachable), and eviction
# takes device *leaves*. And every node is somewhere: a node whose KV is in no tier leaves
# the tree. The rest of the chapter is what moves a node from one colour to another.
#
# ## Build-up 1: where a node's KV lives
#
# `kvlab.prefix.tiered_cache.TieredRadixCache` is chapter 05's tree with three fields per
# node: `value` (its device slots, as before; empty when it is not on the device), `host`
# (one host page per page, or `None`) and `hashes` (its pages' chained hashes, for the
# disk). It speaks the radix cache's words, so the `CacheManager` of chapter 06 runs on it
# unchanged. A host page holds all layers of `page_size` positions in one block
# (`kvlab.prefix.host_tier.HostTier`; SGLang calls this layout `page_first`, and
# `layer_first` keeps each layer's pages together instead):

# %%
P = 4
layout = KVLayout(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float32)
pool = KVPool(13 * P, 2, 2, 4, device="cpu")
host = HostTier(16, P, layout)
print("one host page:", tuple(host.kv.shape[1:]),
      "= [layers, K/V, positions, heads, dim]")
print(f"{host.page_bytes} bytes a page, {host.num_pages} pages")


def make_cache(policy, host_pages=16):
    """A manager of 12 device pages over a tiered cache with a host tier of its own."""
    host = HostTier(host_pages, P, layout)
    cache = TieredRadixCache(P, "cpu", host=host, policy=policy,
                             copies=KVCopies(pool, host))
    table = new_page_table(2, 64, P, device="cpu")
    return CacheManager(12, P, table, prefix_cache=cache, page_table_writer="host")


def compute(manager, req):
    """Stand in for the forward pass: the K/V of each new position (seeded)."""
    row = manager.page_table[req.table_idx]
    for pos in range(req.cached_len, req.device_len):
        g = torch.Generator().manual_seed(hash(tuple(req.input_ids[:pos + 1])) % 2**31)
        pool.k[:, int(row[pos])] = torch.randn(2, 2, 4, generator=g)
        pool.v[:, int(row[pos])] = -pool.k[:, int(row[pos])]


def serve(manager, ids, answer=7):
    """One request: admission with a load-back, the prefill, one decode step."""
    req = Req(list(ids), table_idx=0)
    loaded = admit_with_load_back(manager, req)
    req.device_len = req.input_len
    batch = manager.mixed_step([req], [])
    compute(manager, req)
    manager.complete_step(batch, [answer])
    manager.complete_step(manager.decode_step([req]), [answer + 1], [True])
    return loaded

# %% [markdown]
# ## Build-up 2: when a page gets its host copy
#
# The write policy decides. SGLang's `HiCacheController` accepts three, and
# `HiRadixCache` counts a node's *hits* (each request that caches through it, in
# `insert`) against a threshold:
#
# | policy | the host copy is written ... | SGLang |
# |---|---|---|
# | `write_through` | when the node is cached | `write_through_threshold = 1` |
# | `write_through_selective` | once the node is hit twice | `write_through_threshold = 2` |
# | `write_back` | only when the device evicts it (dirty) | `write_backup(x, write_back=True)` in `evict` |
#
# Write-through pays a copy for every new node, used again or not; write-back pays only
# for what eviction would otherwise lose, but makes the eviction itself wait for the
# copy. Here are the three on the same three requests, the second a longer turn of the
# first:

# %%
rng = random.Random(1)
chat = [rng.randrange(100) for _ in range(10)]
turns = [chat, chat + [rng.randrange(100) for _ in range(6)], [5] * 9]
for policy in ("write_through", "write_through_selective", "write_back"):
    manager = make_cache(policy)
    for ids in turns:
        serve(manager, ids)
    nodes = manager.prefix_cache.tier_snapshot()
    dirty = sum(1 for n in nodes if n.device_pages and not n.host_pages)
    print(f"{policy:24s} host pages written: "
          f"{manager.prefix_cache.stats['copied_to_host']:2d}, dirty nodes: {dirty}")
    manager.check_integrity()

# %% [markdown]
# ## Build-up 3: eviction frees the device, not the cache
#
# When the manager needs device pages, `evict_leaves` asks
# `kvlab.prefix.tier_plans.eviction_plan`, which follows `HiRadixCache.evict`: pop device
# leaves least recently used first; a clean one is dropped from the device (its host copy
# stays: `_evict_backuped`), a dirty one is written back first under `write_back` and
# forgotten otherwise (`_evict_regular`). The copies need host pages: host memory makes
# room by [spilling](glossary.md#spill) its oldest host-only leaves (to disk, when there is
# one), as
# `evict_host` does -- never one whose host pages a load-back is still reading (SGLang
# skips nodes with `host_ref_counter > 0`; vLLM's `LRUOffloadingManager` skips blocks
# with `ref_cnt > 0`, set by `prepare_load` until `complete_load`).

# %% alt="The tiered tree of the write-back cache before an eviction of four device pages: its clean and dirty nodes on the device and the host-only ones below them."
nodes = manager.prefix_cache.tier_snapshot()
free = manager.prefix_cache.host.num_free
plan = eviction_plan(nodes, need_pages=4, host_free=free, policy="write_back")
print("victims:", plan.victims)
print("spills: ", plan.spills)
fig, ax = plt.subplots(figsize=(6.6, 2.6))
draw_tier_tree(nodes, ax, title="before the eviction above", page_size=P)
plt.show()

# %% [markdown]
# ## Build-up 4: a hit that reaches host memory is loaded back
#
# A match walks every tier, but only the device part can be used at once.
# `TieredRadixCache.match_prefix` returns the deepest node **on the device** (SGLang's
# `last_device_node`), and `host_chain` the host-only nodes after it (its
# `last_host_node`). `kvlab.serving.load_back.admit_with_load_back` then does, in the
# manager's words, what `restore_request` did in chapter 12: admit (map the device hit),
# take device pages for the host part with `allocate_paged`, copy, and move `cached_len`
# past what was copied -- so the prefill computes only what no tier holds:

# %%
manager = make_cache("write_through")
first = serve(manager, chat)
for ids in ([1] * 17, [2] * 17, [3] * 17):     # three others push it off the device
    serve(manager, ids)
again = serve(manager, chat + [42, 43])
print("first time: ", first)
print("coming back:", again, "-> computed",
      len(chat) + 2 - again.cached, "of", len(chat) + 2, "prompt tokens")
assert again.host > 0 and again.device < again.host, "it came back from host memory"
manager.check_integrity()

# %% [markdown]
# The load-back's copy crosses the link between host and device, which is fast only for
# large contiguous blocks: on an H200 one pinned 1 GB block moves at 52.7 GB/s, while
# gathering scattered pages straight out of host memory reached 4-12 GB/s. So
# `kvlab.serving.kv_copies.KVCopies` copies each **run of neighbouring host pages** as one
# block into a staging buffer on the device, then scatters it into the pool's slots with
# one indexing kernel -- and the host tier hands out runs of neighbours when it can:

# %%
print("host pages [3, 4, 5, 9, 10, 2] travel as runs (index, first page, count):",
      runs([3, 4, 5, 9, 10, 2]))
print("four pages of a fresh host tier:", host.take(4), "(neighbours)")

# %% [markdown]
# On a GPU the transfers run on their own CUDA streams, so they overlap the forward
# passes; the gather (before a copy down) and the scatter (after a copy up) run on the
# compute stream, in order with the steps, so no step reads a page before it has arrived
# and no page handed out again is overwritten before its KV was gathered. SGLang loads
# layer by layer with an event per layer so that the forward pass can start early; kvlab
# loads a whole range and the step waits for it. Modelled with an H200's measured link and
# decode step, a returning chat's 8k-token history crosses while the others decode:

# %% alt="Three lanes over about nine milliseconds: the compute stream runs decode steps, the host-to-device copy stream carries an 8k-token load-back during the first step, and the device-to-host stream a write-through copy after the returning request's prefill."
copy_timeline_figure()
plt.show()

# %% [markdown]
# ## Build-up 5: the disk, and when a stored page may be trusted
#
# Host memory ends with the process. The disk tier keeps pages across processes: one file
# per page, named by its [disk key](glossary.md#disk-key) (`kvlab.prefix.disk_store.disk_key`)
# -- the page's chained hash (every
# token from the start of the prompt to the end of the page) and the **model's identity**
# hashed together, because the same tokens give other KV in another model. SGLang's file
# backend names a page `<sha256 chain hash>_<model>_<tp_rank>_<tp_size>.bin`; LMCache keys a
# chunk by `fmt@model_name@world_size@worker_id@chunk_hash`.

# %%
identity = KVIdentity.of("tiny-llama-0", layout, P)
page_hash = chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])
print("the second page of [1..8]:", disk_key(identity.model, page_hash))
other = KVIdentity.of("another-model", layout, P)
print("the same tokens, another model:", disk_key(other.model, page_hash))

# %% [markdown]
# Reading from disk is slow next to host memory. SGLang *prefetches* a request's storage hits
# into host memory on a background thread while the request waits, and its
# `hicache_storage_prefetch_policy` says when the request may go (`can_terminate_prefetch` in
# `hiradix_cache.py`): `best_effort` (with whatever has arrived), `wait_complete` (when all
# has), or `timeout` (all, or a deadline that grows with the pages). kvlab reads the pages at
# admission, on the scheduler's thread, before the load-back: `wait_complete`, without the
# thread.
#
# A file on disk can be cut short by a crash, changed by a bad disk or a careless hand,
# or written by another model. SGLang's file backend stores the raw tensor without a
# header and raises only on a short read. kvlab's file starts with a header (model, dtype,
# shape, page size, the page's hash, the payload's length and checksum), is written to a
# temporary name and renamed into place (another process sees all of it or none), and is
# loaded only when every field is what this model would have written for this page and
# the checksum, computed from the bytes as read now, matches:

# %%
store_dir = tempfile.mkdtemp(prefix="kvlab-13-")
store = DiskStore(store_dir, identity, capacity_pages=64)
page = torch.randn(identity.shape)
store.write(page_hash, page)
out = torch.empty(identity.shape)
print("read back:", store.read(page_hash, out) or "trusted", torch.equal(out, page))
path = store.path(page_hash)
data = bytearray(open(path, "rb").read())
data[-1] ^= 0x10                                 # one bit of the payload flips
open(path, "wb").write(bytes(data))
print("after one flipped bit:", store.read(page_hash, out),
      "-> ignored, the file removed:", not os.path.exists(path))

# %% [markdown]
# ## Validate: a real model, every tier, the tokens of `generate`
#
# `PagedGenerator(..., host_cache=..., disk_cache=...)` serves through the hierarchy:
# admission loads back, eviction writes back or spills, and
# `gen.persist_prefix_cache()` writes every cached page the disk lacks. Chapter 10's small
# random Llama, multi-turn chats in a pool of 8 pages of 4 -- too small for their
# histories -- over 24 host pages and a disk. Every answer must be exactly
# `model.generate`'s. Then a second generator, as a restarted kernel would be, with empty
# device and host tiers and the same disk:

# %%
model = tiny_model("llama", seed=0, device=kvlab.DEVICE)
rng = random.Random(13)
chats = [[rng.randrange(128) for _ in range(rng.randint(6, 12))] for _ in range(4)]


def run_chats(gen, chats, rounds=2):
    """Each round, every chat gets a turn: its history plus a new question."""
    for _ in range(rounds):
        for c in range(len(chats)):
            chats[c] = chats[c] + [rng.randrange(128) for _ in range(3)]
        answers = gen.generate([list(h) for h in chats], max_new_tokens=4)
        for c, (h, a) in enumerate(zip(list(chats), answers)):
            ids = torch.tensor([h], device=model.device)
            out = model.generate(ids, max_new_tokens=4, do_sample=False)
            want = out[0, len(h):].tolist()
            assert a == want, f"chat {c}: {a} != generate's {want}"
            chats[c] = h + a
    return gen.stats


disk_dir = tempfile.mkdtemp(prefix="kvlab-13-disk-")
tiers = dict(host_cache=HostCache(pages=24, write_policy="write_back"),
             disk_cache=DiskCache(disk_dir, pages=1000))
gen = PagedGenerator(model, page_size=4, num_pages=8, max_running=4, **tiers)
st = run_chats(gen, chats)
print(f"identical to generate; loaded from host: {st['prefill_loaded_host']} tokens, "
      f"written back: {gen.manager.prefix_cache.stats['written_back']} nodes")
print("pages written to disk for the next process:", gen.persist_prefix_cache())
warm = PagedGenerator(model, page_size=4, num_pages=8, max_running=4, **tiers)
st = run_chats(warm, [list(h) for h in chats], rounds=1)
print(f"a fresh generator on the same disk: {st['prefill_loaded_disk']} prompt tokens "
      f"read from disk, {st['prefill_computed']} computed")
assert st["prefill_loaded_disk"] > 0, "the first generator's pages were on disk"

# %% [markdown]
# ## Hit rate against the size of the cache
#
# The tier simulator (`kvlab.serving.sim.tier_sim`) runs the same cache code on page
# numbers only, so a host tier of a million pages costs a few megabytes: it can show a
# hierarchy larger than any laptop. Sixteen chats of up to 3,000 tokens, six turns each,
# every chat coming back after the fifteen others; pools from an eighth of the working set
# to all of it; a host tier twice the device pool (SGLang's default `--hicache-ratio 2`),
# write-through; a disk without limit:

# %% alt="Prompt tokens found cached against the device pool's size: GPU only finds almost nothing until the pool holds the working set; a host tier twice the pool reaches the ceiling at half the working set; host and disk stay at the ceiling at every size."
rows = hit_rate_rows()
hit_rate_figure(rows)
plt.show()
by = {(r["config"], r["share"]): r for r in rows}
names = ("GPU only", "+ host", "+ host + disk")
small = {name: by[(name, 0.25)]["hit"] for name in names}
print({k: f"{v:.0%}" for k, v in small.items()}, "at a quarter of the working set")
assert small["GPU only"] < small["+ host"] <= small["+ host + disk"], (
    "each tier below finds more")

# %% [markdown]
# Without a lower tier, a pool smaller than the working set finds almost nothing: least
# recently used eviction always throws out the conversation that comes back next. Twice
# the pool in host memory holds the working set at half its size; a disk holds it at any
# size. The ceiling is not 100%: every turn's question is new, and a prompt's last token is
# always computed.
#
# ## Your turn
#
# Three exercises, the decisions a hierarchy is made of. The checkers compare with
# `kvlab.course.reference.hierarchy_ref` on named edge cases and seeded random ones. A
# typical slip, a write-back eviction that drops a dirty node as if it had a host copy:

# %%
def drop_everything(nodes, need_pages, host_free, policy):
    sol = kvlab.solutions.get("write_back_eviction")
    victims, spills = sol(nodes, need_pages, host_free, policy)
    return [(uid, "drop") for uid, _ in victims], spills


try:
    kvlab.check.write_back_eviction(drop_everything)
except kvlab.check.CheckFailed as e:
    print("CheckFailed:", str(e).splitlines()[0])
else:
    raise AssertionError("dropping a dirty node must be rejected")

# %% [markdown]
# **Exercise `write_back_eviction`: which nodes to copy, which to drop.** Write
# `my_eviction(nodes, need_pages, host_free, policy) -> (victims, spills)`. `nodes`: a
# list of `TierNode` (read-only) with `uid`, `parent`, `num_pages`, `device_pages`,
# `host_pages`, `ref_count`, `last_access`, `pinned`. Victims: nodes with device pages,
# `ref_count == 0`, none of whose children is still on the device (children chosen
# before count as gone), smallest `(last_access, uid)` first, until their pages reach
# `need_pages`. Then host room: under `"write_back"` the dirty victims (no host pages) need
# their pages; while `host_free` plus what you spilled is short, spill the oldest
# host-only leaf (no device pages, no child left, not `pinned`). Last, in eviction order:
# `(uid, "drop")` for a clean victim, `(uid, "copy")` for a dirty one under `"write_back"`
# while room is left (it takes the room), else `(uid, "forget")`. Hints:
# `kvlab.check.hint("write_back_eviction", 1)`.

# %%
def my_eviction(nodes, need_pages, host_free, policy):
    """(victims, spills) of an eviction that frees need_pages device pages."""
    # lifted into kvlab.prefix.tier_plans.eviction_plan
    ### BEGIN SOLUTION
    kids = {}
    for n in nodes:
        kids.setdefault(n.parent, []).append(n)
    dev = {n.uid for n in nodes if n.device_pages}
    victims, chosen, freed = [], set(), 0
    while freed < need_pages:
        cands = [n for n in nodes if n.uid in dev and n.uid not in chosen
                 and n.ref_count == 0
                 and all(c.uid not in dev or c.uid in chosen
                         for c in kids.get(n.uid, []))]
        if not cands:
            break
        v = min(cands, key=lambda n: (n.last_access, n.uid))
        victims.append(v)
        chosen.add(v.uid)
        freed += v.num_pages
    want = sum(v.num_pages for v in victims if not v.host_pages)
    want = want if policy == "write_back" else 0
    spills, gone, room = [], set(), host_free
    while room < want:
        leaves = [n for n in nodes if n.uid not in dev and n.host_pages and not n.pinned
                  and n.uid not in gone
                  and all(c.uid in gone for c in kids.get(n.uid, []))]
        if not leaves:
            break
        leaf = min(leaves, key=lambda n: (n.last_access, n.uid))
        gone.add(leaf.uid)
        spills.append(leaf.uid)
        room += leaf.num_pages
    out = []
    for v in victims:
        if v.host_pages:
            out.append((v.uid, "drop"))
        elif policy == "write_back" and v.num_pages <= room:
            room -= v.num_pages
            out.append((v.uid, "copy"))
        else:
            out.append((v.uid, "forget"))
    return out, spills
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: write_back_eviction
    raise NotImplementedError("victims LRU first; host room; then drop / copy / forget")
    ### END STARTER


kvlab.check.write_back_eviction(my_eviction);

# %% [markdown]
# **Exercise `load_back_plan`: device pages and copies for a hit in host memory.** Write
# `my_load_plan(path, free_slots, page_size) -> (device_pages, copies, slots)`. `path`:
# the matched nodes (read-only), root first: those with `device_pages` first, then
# host-only ones. Each page of the host-only nodes, in order, is copied into a device page
# taken from the **front** of `free_slots` -- the manager's free list, which holds each free
# page's *first slot* (`page * page_size`), not the page. `device_pages`: the pages taken;
# `copies`: `(host page, device page)` pairs in position order; `slots`: every slot of those
# device pages, in order (the request's row for the loaded positions). Hints:
# `kvlab.check.hint("load_back_plan", 1)`.

# %%
def my_load_plan(path, free_slots, page_size):
    """(device_pages, copies, slots) of a load-back along path."""
    # lifted into kvlab.prefix.tier_plans.load_back_plan
    ### BEGIN SOLUTION
    host_pages = []
    for node in path:
        if node.device_pages:
            continue
        if not node.host_pages:
            break
        host_pages.extend(node.host_pages)
    taken = [s // page_size for s in free_slots[:len(host_pages)]]
    slots = [p * page_size + i for p in taken for i in range(page_size)]
    return taken, list(zip(host_pages, taken)), slots
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: load_back_plan
    raise NotImplementedError("host pages of host-only nodes -> pages from free_slots")
    ### END STARTER


kvlab.check.load_back_plan(my_load_plan);

# %% [markdown]
# **Exercise `trusted_page`: may this file be loaded?** Write
# `my_trusted(identity, parent, tokens, header, payload) -> bool`. The page wanted holds
# `tokens` after the page whose chained hash is `parent` (`None` for a first page), for the
# model and layout `identity` (`model`, `dtype`, `shape`, `page_size`, `payload_bytes`).
# `header` (a dict) and `payload` (bytes) are what the file holds. True only when
# `model`, `dtype`, `shape` and `page_size` are the identity's, `page_hash` is
# `chain_hash(parent, tokens).hex()`, the payload is exactly `identity.payload_bytes`
# long and `header["payload_bytes"]` says so, and
# `hashlib.blake2b(payload, digest_size=16).hexdigest()` is `header["checksum"]`. Hints:
# `kvlab.check.hint("trusted_page", 1)`.

# %%
import hashlib  # noqa: E402


def my_trusted(identity, parent, tokens, header, payload):
    """True when the stored page may be loaded: this model's, this page, intact."""
    # lifted into kvlab.prefix.disk_store.trust_reason
    ### BEGIN SOLUTION
    fields = ("model", "dtype", "shape", "page_size", "page_hash", "payload_bytes",
              "checksum")
    if any(f not in header for f in fields):
        return False
    stored = (header["model"], header["dtype"], list(header["shape"]),
              header["page_size"])
    wanted = (identity.model, identity.dtype, list(identity.shape), identity.page_size)
    if stored != wanted:
        return False
    if header["page_hash"] != chain_hash(parent, tokens).hex():
        return False
    if not len(payload) == header["payload_bytes"] == identity.payload_bytes:
        return False
    return hashlib.blake2b(payload, digest_size=16).hexdigest() == header["checksum"]
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: trusted_page
    raise NotImplementedError("compare every field; recompute the checksum")
    ### END STARTER


kvlab.check.trusted_page(my_trusted);

# %% [markdown]
# ## Measured, side by side
#
# `python -m kvlab.bench --hierarchy` serves seeded multi-turn chats (histories of 1-16k
# tokens, every conversation coming back after the others pushed it out, a working set
# at least four times the device pool) with a 0.5B-shaped model on a GPU: GPU only; a
# host tier with each write policy; host and disk; and a second **process** on the disk
# the first one left. Per configuration: prefix hit rate by tier, prompt tokens computed,
# bytes copied each way, the load-back's bandwidth against the pinned bandwidth measured
# in the same run, TTFT and TPOT (p50, p99) and tokens/s ([TTFT and
# TPOT](glossary.md#ttft-and-tpot)):

# %%
bench = bench_rows()
if bench is None:
    print("figures/bench.json holds no GPU run of"
          " `python -m kvlab.bench --hierarchy` yet.")
else:
    print(f"{bench['meta']['device']}, {bench['meta']['date']}")
    for c in bench["claims"]:
        verdict = "n/a" if c["passed"] is None else ("PASS" if c["passed"] else "FAIL")
        print(f"[{verdict}] {c['name']}: {c['measured']}")
    for r in bench["rows"]:
        if "error" not in r:
            print(f"{r['config']:22s} hit {r['hit']:.1%}  computed {r['computed']:7d}"
                  f"  TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms")

# %% [markdown]
# The same run recorded one call on the GPU: four conversations coming back 30 ms apart, each
# loading its history while the ones before it decode (the first 60 ms; a dark bar is a step
# with a prefill in it, a green one a load-back crossing the link, a red one a write-through):

# %% alt="A recorded GPU timeline of about 60 ms: decode steps on the compute stream, load-backs of returning conversations on the host-to-device copy stream overlapping them, write-through copies on the device-to-host stream after each prefill; or a line saying no GPU run is recorded yet."
from kvlab.course.scenes.ch13_hierarchy import recorded_spans  # noqa: E402
from kvlab.course.viz.tiers import draw_copy_timeline  # noqa: E402

if bench is None or not bench.get("timeline"):
    print("no recorded GPU timeline in figures/bench.json yet")
else:
    draw_copy_timeline(recorded_spans(bench["timeline"]),
                       title=f"recorded on {bench['meta']['device']}")
    plt.show()

# %% [markdown]
# ## Lift: your functions vs kvlab
#
# Your three answers against the ones [lifted](glossary.md#lift) into `kvlab.prefix`
# on random inputs (until an exercise passes, this cell uses the reference solution and
# says so):

# %%
from kvlab.course.exercises.ch13_eviction import _tree  # noqa: E402  (its trees)

evict_fn = kvlab.check.choose("write_back_eviction", my_eviction,
                              kvlab.solutions.get("write_back_eviction"))
plan_fn = kvlab.check.choose("load_back_plan", my_load_plan,
                             kvlab.solutions.get("load_back_plan"))
trust_fn = kvlab.check.choose("trusted_page", my_trusted,
                              kvlab.solutions.get("trusted_page"))

rng = random.Random(13)
for _ in range(100):
    nodes = _tree(rng, rng.randint(2, 9))
    need, free = rng.randint(1, 6), rng.randint(0, 4)
    for policy in ("write_back", "write_through"):
        victims, spills = evict_fn(nodes, need, free, policy)
        want = eviction_plan(nodes, need, free, policy)
        got = (tuple(map(tuple, victims)), tuple(spills))
        assert got == (want.victims, want.spills), f"{policy}: {got} vs kvlab's {want}"
    by = {n.uid: n for n in nodes}
    path, at = [], rng.choice(nodes)                 # a match: a node and its ancestors
    while at is not None:
        path.insert(0, at)
        at = by.get(at.parent)
    free_slots = [p * P for p in rng.sample(range(1, 80), 30)]
    got = [[tuple(c) if isinstance(c, (list, tuple)) else c for c in part]
           for part in plan_fn(path, free_slots, P)]
    want = load_back_plan(path, free_slots, P)
    want = [list(want.device_pages), list(want.copies), list(want.slots)]
    assert got == want, f"yours {got}, kvlab's {want}"
    ident = KVIdentity.of(rng.choice(["a", "b"]), layout, P)
    parent, toks = chain_hash(None, [1, 2, 3, 4]), [rng.randrange(9) for _ in range(P)]
    stored = KVIdentity.of(rng.choice(["a", "b"]), layout, P)
    file = kvlab.prefix.disk_store.encode_page(stored, chain_hash(parent, toks),
                                               torch.randn(stored.shape))
    header, payload = kvlab.prefix.disk_store.decode_page(file)
    if rng.random() < 0.3:
        payload = payload[:-1] + bytes([payload[-1] ^ 1])
    assert trust_fn(ident, parent, toks, header, payload) == (
        trust_reason(ident, parent, toks, header, payload) == ""), stored.model
print("write_back_eviction, load_back_plan and trusted_page agree with kvlab.prefix")

# %% [markdown]
# ## Summary
#
# * A prefix cache can outgrow the GPU: each node of the radix tree knows whether its KV
#   is on the device, in host memory, or both; its pages' chained hashes name it on disk.
# * The write policy says when a device page gets its host copy: at once
#   (`write_through`), once hit twice (`write_through_selective`), or only when the device
#   evicts it (`write_back`). A clean node leaves the device for free; a dirty one is copied
#   first or forgotten.
# * A match that reaches host-only nodes is loaded back before the prefill: device pages
#   from the front of the free list, one copy per run of host pages, the scatter in order
#   with the forward passes. Host pages a load-back reads stay pinned until it is done.
# * The disk keys a page by its chained hash and the model's identity; a file is trusted
#   only when its header is this model's and this page's and its checksum, computed now,
#   matches -- a cut, a flipped bit or another model's file is ignored, never loaded.
# * Measured on the simulator: without a lower tier, a pool smaller than the working set
#   of returning chats finds almost nothing; host memory and a disk bring the hit rate to
#   the ceiling. On a GPU, `python -m kvlab.bench --hierarchy` measures what that buys.
# * In `kvlab.prefix` (`tiered_cache`, `host_tier`, `disk_store`, `tier_plans`,
#   `write_policy`), `kvlab.serving` (`kv_copies`, `load_back`, `hf.PagedGenerator`'s
#   `host_cache` and `disk_cache`, `sim.tier_sim`) and `python -m kvlab.bench --hierarchy`.
#
# ## Questions
#
# 1. Write-through copies every new node, write-back only what eviction would lose. When
#    does write-back copy *more* bytes than write-through, and which one makes a request's
#    first token wait?
# 2. SGLang requires the host pool to be larger than the device pool. Run the hit-rate
#    sweep with a host tier of the device pool's size under `write_through`: what goes
#    wrong, and why?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# **1.** Write-back copies a node each time the device evicts it dirty; a node that is
# loaded back, extended and evicted again is copied again (its new part), while
# write-through copied it once. With a working set that fits the device, write-back copies
# nothing at all. The wait is the other way round: write-through's copies run beside the
# steps on their own stream, write-back's happen inside an eviction, in the admission of
# the request that needed the pages.
#
# **2.** Under write-through every node on the device also holds host pages, and host
# memory can spill only host-only leaves. With a host pool the size of the device pool,
# the device's own copies fill it: nothing is left for the nodes the device evicts, so
# they are forgotten, and the hit rate falls back towards GPU only.

# %% tags=["solution"]
from kvlab.course.scenes.ch13_hierarchy import SWEEP_PAGE, SWEEP_PLAN  # noqa: E402
from kvlab.serving.sim.conversations import chat_turns, working_set  # noqa: E402
from kvlab.serving.sim.tier_sim import (H200_HOST, HierarchyConfig,  # noqa: E402
                                         simulate_hierarchy, summary)

turns = chat_turns(SWEEP_PLAN)
pages = working_set(turns) // SWEEP_PAGE // 4
for ratio in (1, 2, 4):
    config = HierarchyConfig(pages, H200_HOST._replace(pages=ratio * pages),
                             write_policy="write_through", page_size=SWEEP_PAGE)
    hit = summary(simulate_hierarchy(turns, config))["hit"]
    print(f"host = {ratio} x device: hit {hit:.0%}")
