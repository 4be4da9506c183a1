# %% [markdown]
# # 10 · Serve a real model
#
# **Time:** about 45 minutes. **Assumes:** chapter 08 (a model served through `CacheManager`,
# paged decode attention); Hugging Face `transformers` basics (a model, `generate`).
#
# **Goal.** Chapter 08 proved kvlab's memory manager right on a model the course wrote itself.
# Here the model is a **real one**: a Llama-family model (or Qwen2, or Qwen3) loaded by Hugging Face
# `transformers`, running its own code for embeddings, norms, rotary position embeddings (RoPE)
# and MLPs. kvlab takes over one thing, the thing a serving engine owns: **where the keys and
# values live and how attention reads them back**. You will
#
# * plug into the model through transformers' own extension point for attention,
# * meet [grouped-query attention](glossary.md#grouped-query-attention) (GQA: several query heads share one K/V head),
# * serve a batch through `kvlab.serving.hf.PagedGenerator` -- `CacheManager`, the radix [prefix cache](glossary.md#prefix-cache),
#   the [page table](glossary.md#page-table), the [KV pool](glossary.md#kv-pool) and chapter 08's Triton kernel -- and get **exactly** the
#   tokens of `model.generate`,
# * watch a multi-turn conversation compute only what is new, turn after turn,
# * make it fast the way serving engines do -- admission by memory,
#   [chunked prefill](glossary.md#chunked-prefill), decode steps replayed from
#   [CUDA graphs](glossary.md#cuda-graph) padded with the page table's
#   [dummy row](glossary.md#dummy-row), [overlap scheduling](glossary.md#overlap-scheduling)
#   (the host prepares the next step while the GPU runs this one) -- and measure it on the
#   workload serving engines publish, beside transformers' own `generate`.
#
# By default the chapter builds a small random Llama (2 layers, 4 query heads on 2 K/V heads)
# and saves it to disk first, so it loads through `from_pretrained` like any checkpoint; no
# download, about a minute in the [interpreter](glossary.md#interpreter). With a GPU and internet (Colab), set
# `USE_SMOLLM2 = True` below to serve `HuggingFaceTB/SmolLM2-135M` on real text instead.

# %%
import time

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab.serving.hf import (
    PagedGenerator,
    paged_attention_reference,
    paged_decode_attention,
    tiny_model,
)
from kvlab.course.scenes.ch10_serve import (
    conversation_bars,
    conversation_rows,
    conversation_turns,
    plug_in_figure,
)

try:
    import transformers
# the course's dev install has it; elsewhere: pip install 'transformers>=4.56'
except ImportError as e:
    raise ImportError(
        "chapter 10 needs transformers: pip install 'transformers>=4.56'"
    ) from e

# True: HuggingFaceTB/SmolLM2-135M and real text (GPU + internet)
USE_SMOLLM2 = False
DEVICE = kvlab.DEVICE
torch.manual_seed(0)
NEW_TOKENS = kvlab.base.runtime.pick(cpu=6, gpu=32)
print(
    "transformers",
    transformers.__version__,
    "| kvlab runtime:",
    "interpreter" if kvlab.INTERPRET else "GPU",
)

# %% [markdown]
# ## The model
#
# `tiny_model("llama", path)` builds a `LlamaConfig` of the size above, initialises it with
# seeded random weights, writes it with `save_pretrained(path)` and loads it back with
# `AutoModelForCausalLM.from_pretrained(path)` -- the same path a downloaded checkpoint takes.
# A random model speaks no language, so its "text" is token ids; with `USE_SMOLLM2` the
# tokenizer turns real text into ids and back. `tiny_model("qwen2")` and `tiny_model("qwen3")`
# build the two Qwen families the same way: kvlab serves all three (`kvlab.serving.hf.SUPPORTED`).

# %%
if USE_SMOLLM2:
    name = "HuggingFaceTB/SmolLM2-135M"
    tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    # float32, so that kvlab's logits can be compared with generate()'s closely
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
        .to(DEVICE)
        .eval()
    )
    encode = tokenizer.encode
    decode = tokenizer.decode
else:
    import tempfile

    tokenizer = None
    model = tiny_model(
        "llama", tempfile.mkdtemp(prefix="kvlab-ch10-"), seed=0, device=DEVICE
    )
    encode = None
    decode = str                       # no tokenizer: show the ids themselves
c = model.config
print(
    f"{type(model).__name__} from {model.name_or_path}: {c.num_hidden_layers} layers,"
    f" {c.num_attention_heads} query heads, {c.num_key_value_heads} K/V heads, head_dim"
    f" {getattr(c, 'head_dim', None) or c.hidden_size // c.num_attention_heads},"
    f" vocabulary {c.vocab_size}, attention: {c._attn_implementation}"
)

# %% [markdown]
# ## Intuition: one box of the layer is kvlab's
#
# A decoder layer is a fixed recipe: norm, the q/k/v projections, RoPE on q and k, attention,
# the output projection, norm, MLP. transformers looks the attention function up **by name**
# in a registry (`AttentionInterface`) each time a layer runs, and `attn_implementation`
# picks the name. So a serving engine can register its own function and leave every other box
# as the model's authors wrote it. Ours stores this step's `k`, `v` in the pool at the [slots](glossary.md#token-slot)
# the page table names, then reads every earlier token of the request back through its row.

# %% alt="The layers of a transformers model (embed, RMSNorm, projections, RoPE, attention, MLP, lm_head) with the attention box replaced by kvlab's, which stores each step's K and V through the page table into the K/V pool and attends over them."
plug_in_figure()
plt.show()

# %% [markdown]
# ## Build-up 1: what the attention function receives
#
# Register a function that only looks and then calls the stock `sdpa` attention, switch the
# model to it with `set_attn_implementation`, run one forward. It is handed the layer module
# (`module.layer_idx` says which layer), queries `[batch, heads, tokens, head_dim]` and keys and
# values `[batch, kv_heads, tokens, head_dim]` -- after RoPE, and **before** the K/V heads are
# repeated for grouped-query attention. Keyword arguments given to `model(...)` travel down to
# it: that is how kvlab hands each step's page-table rows to its attention function.

# %%
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

seen = []


def spy_attention(module, query, key, value, attention_mask, **kwargs):
    seen.append(
        (module.layer_idx, tuple(query.shape), tuple(key.shape), kwargs.get("note"))
    )
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


transformers.AttentionInterface.register("spy", spy_attention)
transformers.AttentionMaskInterface.register("spy", sdpa_mask)   # keep the causal mask
ids = torch.tensor([[1, 2, 3, 4, 5]], device=DEVICE)
before = model.config._attn_implementation
with torch.no_grad():
    plain = model(ids).logits
    model.set_attn_implementation("spy")
    spied = model(ids, note="a keyword for the attention function").logits
    model.set_attn_implementation(before)
for layer, q_shape, k_shape, note in seen:
    print(f"layer {layer}: query {q_shape}, key {k_shape}, note={note!r}")
torch.testing.assert_close(spied, plain)       # only looked: the same logits
heads, kv_heads = seen[0][1][1], seen[0][2][1]
print(
    f"{heads} query heads share {kv_heads} K/V heads: {heads // kv_heads} query heads"
    " per K/V head"
)

# %% [markdown]
# ## Build-up 2: grouped-query attention through the page table
#
# With GQA the pool stores only `kv_heads` heads per token -- here half the memory of one K/V
# head per query head (SmolLM2: a third; Llama 3 70B: an eighth). Query head `h` reads K/V head
# `h // group`, `group = heads // kv_heads`. Chapter 08's Triton kernel takes that as one more
# compile-time number, `KV_GROUP`: each [program](glossary.md#program) (one request, one query head) loads the rows of
# K/V head `h // KV_GROUP`. The plain-torch reference repeats each K/V head `group` times and
# does ordinary attention. They must agree on edge cases and random layouts.
#
# Both take their arguments in one order, which your first exercise below uses too:
#
#     paged_decode_attention(q, k_pool, v_pool, page_table, rows, seq_lens, scale=None)
#
# `q` is `[batch, heads, head_dim]` (one new query per request), the pools
# `[num_slots, kv_heads, head_dim]`; request `b` reads positions `0 .. seq_lens[b] - 1` of
# page-table row `rows[b]` (a *length*, not the last position), and `scale` defaults to
# `1/sqrt(head_dim)`.

# %%
import random

from kvlab.attention.kv_pool import random_paged_layout


def random_layout(seed, page_size, seq_lens, heads=4, kv_heads=2, head_dim=16):
    """Random K/V; each request on shuffled, disjoint pages; rows in shuffled order."""
    return random_paged_layout(
        seed,
        page_size,
        seq_lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        device=DEVICE,
    )


edge_cases = {                       # page size, lengths, query heads, K/V heads
    "page_size 1": (1, [5, 3], 4, 2),
    "one request, one token": (16, [1], 4, 2),
    "unaligned lengths, one K/V head for all": (4, [7, 2, 13], 4, 1),
    "multi-head (group 1)": (4, [9, 6], 2, 2),
    "many requests, rows shuffled, group 3": (2, [3, 9, 1, 6, 4, 11], 6, 2),
}
for name, (page_size, lengths, h, kvh) in edge_cases.items():
    q, k_pool, v_pool, page_table, rows, seq_lens = random_layout(
        0, page_size, lengths, h, kvh
    )
    torch.testing.assert_close(
        paged_decode_attention(q, k_pool, v_pool, page_table, rows, seq_lens),
        paged_attention_reference(q, k_pool, v_pool, page_table, rows, seq_lens),
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: f"{name}: {m}",
    )
    print(f"✓ {name}")

# %% [markdown]
# ## Build-up 3: a step of the serving loop
#
# `PagedGenerator` runs **continuous batching**: every step is one forward pass over the new
# tokens of every request in the batch, packed into one row with their own position ids (RoPE
# needs each token's position *within its request*):
#
#     tokens     [ A's prompt: positions 0..20 | B's prompt: 20..25 | C: 31 | D: 7 ]
#                  admitted this step (prefill)                       running (decode)
#
# Per step: `admit` new requests (radix-cache match + [lock](glossary.md#lock); a request whose prompt shares whole
# [pages](glossary.md#page) with one admitted in the same step waits one step, then reads them from the cache);
# `allocate_paged` for the batch; one forward -- in every layer kvlab stores the step's K/V
# at `page_table[row, position]`, then a prompt's tokens attend causally through the row
# (torch) and each decoding token goes through the Triton kernel; greedy next tokens;
# `cache_req(finished=False)` for the new requests (their prompt pages join the cache at once)
# and `cache_req(finished=True)` for requests that ended (EOS or `max_new_tokens`).
# A request is admitted only when the pages it may still need fit, so no step runs out of
# pages half-way. `on_step` shows the steps of a small run. Each `StepInfo` names the prompts
# the step prefilled and the requests that decoded (by prompt index), the tokens of its forward
# pass, the prompts it continued in chunks (`chunks`; chunked prefill, step 2 of the fast part
# below), and `padded_to`: 0 for a step that packs prompts, else the batch size a decode-only
# step ran at. A decode-only step is run the way a CUDA graph replays it, at one of a few
# captured batch sizes, padded up with entries of a dummy request (step 3 below builds that);
# `gen.stats` counts those steps as `graph_steps`, beside the tokens computed and taken from
# the cache:

# %%
rng = random.Random(1)
if USE_SMOLLM2:
    system = encode("You are a helpful assistant. Answer briefly and precisely.\n")
    prompts = [
        system + encode(t)
        for t in [
            "Q: What is a page table?\nA:",
            "Q: Name a prime number.\nA:",
            "Q: What is the capital of France?\nA:",
        ]
    ] + [encode("Hello")]
else:
    system = [rng.randrange(c.vocab_size) for _ in range(21)]
    prompts = [
        system + [rng.randrange(c.vocab_size) for _ in range(n)] for n in (3, 8, 5)
    ] + [[7]]
PAGE_SIZE = 4
# overlap=False: each step is finished before the next one is planned (the last part of
# the
# chapter overlaps them)
gen = PagedGenerator(
    model, page_size=PAGE_SIZE, num_pages=256, max_running=8, overlap=False
)
new_tokens = gen.generate(prompts, max_new_tokens=NEW_TOKENS, output_logits=True,
                          on_step=lambda step: print(step) if step.index < 3 else None)
print("...")
print("stats:", gen.stats)
for i, r in enumerate(gen.requests):
    print(
        f"prompt {i}: {r.prompt_len} tokens, {r.cached} from the cache, {r.computed}"
        f" computed, {r.generated} new ({r.finished_by}): {decode(new_tokens[i])!r}"
    )

# %% [markdown]
# Prompt 0 computed the shared system prompt; prompts 1 and 2 waited one step and found its
# whole pages (`21 // 4 * 4 = 20` tokens) in the cache. The one-token prompt has nothing to
# share: at least one token of every prompt is always computed, since its last position is
# where the first new token's logits come from.

# %% [markdown]
# ## Validate: token for token against `model.generate`
#
# For each prompt alone, transformers' own greedy `generate` (its own [KV cache](glossary.md#kv-cache), its own
# attention) must produce **the same new tokens**, and the logits behind each of them must
# agree within `1e-4` (float32: the two paths add the same numbers in a different order, so
# they differ in the last bits). With SmolLM2 (30 layers, real text) rounding has more room
# to grow, so that run allows `1e-3`, and a greedy choice between two tokens whose logits are
# closer than that (a near tie) may go either way: the comparison then stops there and says so.

# %%
LOGIT_ATOL = 1e-3 if USE_SMOLLM2 else 1e-4
# the small random model: no ties allowed
NEAR_TIE = 1e-3 if USE_SMOLLM2 else 0.0


def generate_alone(prompt, max_new_tokens):
    out = model.generate(
        torch.tensor([prompt], device=DEVICE),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().cpu()


def compare_with_generate(i, prompt, tokens, logits=None):
    """Assert kvlab's tokens are generate's; return the largest logit difference."""
    want, want_logits = generate_alone(prompt, NEW_TOKENS)
    differ = next((j for j, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    if differ is None:
        assert tokens == want, f"prompt {i}: kvlab {tokens} != generate {want}"
        upto = len(want)
    else:
        top2 = want_logits[differ].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE, (
            f"prompt {i}: token {differ} differs (kvlab {tokens[differ]}, "
            f"generate {want[differ]}) and is no near tie (gap {gap:.1e})"
        )
        print(
            f"prompt {i}: token {differ} is a near tie (top two logits {gap:.1e}"
            " apart); compared up to there"
        )
        upto = differ + 1
    if logits is None:
        return 0.0
    return float((logits[:upto] - want_logits[:upto]).abs().max())


worst = max(
    compare_with_generate(i, p, new_tokens[i], gen.logits[i])
    for i, p in enumerate(prompts)
)
assert worst <= LOGIT_ATOL, worst
assert gen.stats["prefill_cached"] >= 2 * (len(system) // PAGE_SIZE * PAGE_SIZE), (
    f"{gen.stats['prefill_cached']} prompt tokens from the cache: prompts 1 and 2"
    " should find the system prompt"
)
print(
    f"✓ {len(prompts)} prompts: the same tokens as generate(); largest logit difference"
    f" {worst:.1e}"
)

# %% [markdown]
# **Qwen3** differs from Llama in one place that matters here: inside its attention layer it
# normalises each head's query and key (`q_norm`, `k_norm`: RMSNorm over `head_dim`) before
# RoPE. That is the model's own code, and it runs before kvlab's attention function is
# called, so kvlab needs nothing new. Its heads need not split the hidden size either
# (Qwen3-0.6B has 16 heads of 128 on a hidden size of 1024). A tiny Qwen3 with heads of 32 on
# a hidden size of 64, served the same way:

# %%
# saved to a temporary folder
qwen3 = tiny_model("qwen3", seed=0, device=DEVICE, head_dim=32)
q3_rng = random.Random(2)
q3_prompts = [
    [q3_rng.randrange(qwen3.config.vocab_size) for _ in range(n)] for n in (5, 13, 1)
]
q3_tokens = PagedGenerator(
    qwen3, page_size=PAGE_SIZE, num_pages=64, overlap=False
).generate(q3_prompts, max_new_tokens=NEW_TOKENS)
for p, got in zip(q3_prompts, q3_tokens):
    want = qwen3.generate(
        torch.tensor([p], device=DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert (
        got == want[0, len(p) :].tolist()
    ), f"Qwen3, prompt {p}: kvlab {got}, generate {want[0, len(p):].tolist()}"
print(
    f"✓ {type(qwen3).__name__}: the same tokens as generate() for {len(q3_prompts)}"
    " prompts"
)

# %% [markdown]
# ## A conversation that re-sends its history
#
# A chat server receives, each turn, the **whole** conversation so far: system prompt, every
# earlier message and answer, and the new message. Without a prefix cache each turn recomputes
# all of it; with one, only the new message (and the tail of a page) is computed. One
# `PagedGenerator` serves four turns; its prefix cache outlives each `generate` call. After
# each turn's [prefill](glossary.md#prefill) we photograph the conversation's page-table row.

# %%
conv = PagedGenerator(
    model, page_size=PAGE_SIZE, num_pages=256, max_running=4, overlap=False
)
if USE_SMOLLM2:
    system_c = encode("The following is a conversation with a helpful assistant.\n")
    users = [
        encode(f"User: {t}\nAssistant:")
        for t in [
            "Hi! What is a KV cache?",
            "Why does it use pages?",
            "And what does a prefix cache add?",
            "Thanks. Summarise in one line.",
        ]
    ]
else:
    system_c, users = conversation_turns(seed=0, turns=4, vocab=c.vocab_size)
photos = []                      # the conversation's row after each turn's prefill


def photograph(step):
    if step.prefill:
        photos.append(conv.page_table[0].clone().cpu())


turn_prompts, turn_answers, turn_stats = [], [], []
history = list(system_c)
for turn, user in enumerate(users):
    prompt = history + list(user)
    (answer,) = conv.generate([prompt], max_new_tokens=NEW_TOKENS, on_step=photograph)
    turn_prompts.append(prompt)
    turn_answers.append(answer)
    turn_stats.append(dict(conv.stats))
    print(
        f"turn {turn + 1}: sent {len(prompt)} tokens, computed"
        f" {conv.stats['prefill_computed']}, from the cache"
        f" {conv.stats['prefill_cached']}; answer {decode(answer)!r}"
    )
    history = prompt + answer

computed_without_cache = sum(len(p) for p in turn_prompts)
computed_with_cache = sum(s["prefill_computed"] for s in turn_stats)
print(
    f"prompt tokens computed over {len(users)} turns: {computed_with_cache} with the"
    f" prefix cache, {computed_without_cache} without"
)
assert computed_with_cache < computed_without_cache, (
    f"computed {computed_with_cache} tokens with the cache, {computed_without_cache}"
    " without"
)
for s, p, a in zip(turn_stats[1:], turn_prompts, turn_answers):
    # the previous turn's prompt and answer, whole pages (the answer's last token has no
    # K/V yet)
    assert s["prefill_cached"] >= (len(p) + len(a) - 1) // PAGE_SIZE * PAGE_SIZE, (
        f"a turn took {s['prefill_cached']} tokens from the cache: the previous turn's"
        " whole pages are more"
    )

# %% [markdown]
# ## Picture: per turn, computed vs cached; and the page table
#
# Left: every turn after the first finds the previous turn's prompt **and answer** in the
# cache (their whole pages: the last generated token's K/V is never computed, and a partly
# filled last page is not cached, so a few tokens are computed again). Right: the
# conversation's page-table row after each turn's prefill, one turn per line, each position
# coloured by the turn that computed its K/V: each turn maps the very slots earlier turns wrote
# (the assert below compares the rows slot by slot) and adds pages of its own at the end.

# %% alt="Top: bars of the prompt tokens of each turn of a conversation, most of them served from the prefix cache and only the new ones computed; bottom: the conversation's page-table row after each turn, coloured by the turn that computed each position."
fig, (ax1, ax2) = plt.subplots(
    2, 1, figsize=(8.4, 6.6), gridspec_kw=dict(height_ratios=[1, 1])
)
conversation_bars(turn_stats, ax1)
conversation_rows(
    photos,
    [len(p) for p in turn_prompts],
    [s["prefill_cached"] for s in turn_stats],
    PAGE_SIZE,
    ax=ax2,
)
ax2.set_title("the conversation's row after each turn's prefill", fontsize=9)
fig.tight_layout()
plt.show()
# what an earlier turn mapped, a later turn maps to the same slots
for t in range(1, len(photos)):
    n = min(turn_stats[t]["prefill_cached"], len(turn_prompts[t - 1]))
    assert torch.equal(photos[t][:n], photos[t - 1][:n]), (
        f"turn {t + 1} maps the first {n} positions to other slots than turn {t}")

# %% [markdown]
# ## Side by side with transformers' `generate`
#
# The same prompts through `model.generate` (a padded batch, the usual way to batch it) and
# through kvlab's loop: the tokens agree (checked above, prompt by prompt). On a GPU we also
# time both and report tokens per second -- a measurement of this run on a tiny model and
# sixteen short prompts, where both are bound by launching kernels from Python. The last part
# of the chapter builds what makes the loop fast and shows it measured on a real-sized model.
# In the interpreter the Triton kernel runs on the CPU, so timings mean nothing and we skip them.

# %%
EOS = set(kvlab.serving.hf.plugin.eos_token_ids(model))


def tokens_until_eos(row):
    """New tokens a request really produced: up to and including its first EOS."""
    for i, t in enumerate(row):
        if t in EOS:
            return i + 1
    return len(row)


def padded_batch_generate(prompts, max_new_tokens, pad):
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=DEVICE)
    mask = torch.tensor(
        [[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=DEVICE
    )
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    return sum(tokens_until_eos(row) for row in out[:, longest:].tolist())


def kvlab_generate(server, prompts, max_new_tokens):
    # every run starts from a cold cache
    server.clear_prefix_cache()
    return sum(map(len, server.generate(prompts, max_new_tokens=max_new_tokens)))


if not kvlab.INTERPRET:
    # 16 distinct prompts: the four above, each with four different last tokens
    bench_prompts = [p + [100 + k] for k in range(4) for p in prompts]
    pad = (
        tokenizer.pad_token_id
        if tokenizer is not None and tokenizer.pad_token_id is not None
        else 0
    )
    # start-up: captures its graphs
    server = PagedGenerator(model, page_size=16, num_pages=1024, overlap=False)
    for name, run in {
        "transformers generate (padded batch)": lambda: padded_batch_generate(
            bench_prompts, NEW_TOKENS, pad
        ),
        "kvlab PagedGenerator": lambda: kvlab_generate(
            server, bench_prompts, NEW_TOKENS
        ),
    }.items():
        run()                                          # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        produced = run()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(
            f"{name:38s} {produced / seconds:8.0f} tokens/s  ({produced} new tokens for"
            f" {len(bench_prompts)} prompts in {seconds * 1e3:.0f} ms)"
        )
else:
    print(
        "interpreter: no timings (the kernels run on the CPU); the token-for-token"
        " check above holds"
    )

# %% [markdown]
# ## Your turn: one layer's decode step
#
# Write the function every layer runs for the decoding requests of a step:
# `my_paged_attention_step(q, k, v, k_pool, v_pool, page_table, rows, positions, scale)`.
# Request `b` owns page-table row `rows[b]`; its new token sits at position `positions[b]`.
# `q` is `[batch, heads, head_dim]`, `k` and `v` are `[batch, kv_heads, head_dim]` (already
# rotated by the model), the pools `[num_slots, kv_heads, head_dim]`. Only the pools are
# written; `q`, `k`, `v`, `page_table`, `rows` and `positions` are read-only, and `scale` is the
# model's own (not always `1/sqrt(head_dim)`).
#
# 1. store `k[b]`, `v[b]` at slot `page_table[rows[b], positions[b]]` of the pools;
# 2. return [paged attention](glossary.md#paged-attention) of `q[b]` over positions `0 .. positions[b]` -- the new token sees
#    itself -- with `kvlab.serving.hf.paged_decode_attention` (it does the GQA head mapping; its
#    arguments are in build-up 2): a floating-point tensor `[batch, heads, head_dim]` on `q`'s
#    device (the model casts it to its own dtype).
#
# `q`, `k` and `v` arrive as the model hands them over: views of its own tensors, whose memory
# is not in row order (index or `reshape` them; a `.view` that needs row order fails).
#
# `kvlab.check.paged_attention_step` checks the pools (exactly the new slots written) and the
# output, on edge cases (a request's first token, page size 1, new tokens opening new pages,
# group sizes 1 to 4) and random layouts. Hints: `kvlab.check.hint("paged_attention_step", 1)`
# (up to 3); the reference: `kvlab.solutions.show("paged_attention_step")`.


# %%
def my_paged_attention_step(
    q, k, v, k_pool, v_pool, page_table, rows, positions, scale
):
    """Store each request's new K/V at its slot, then paged attention over [0,
    positions[b]]."""
    ### BEGIN SOLUTION
    # request b's new token -> its slot
    slots = page_table[rows, positions].long()
    k_pool[slots] = k
    v_pool[slots] = v
    return paged_decode_attention(
        q, k_pool, v_pool, page_table, rows, positions + 1, scale
    )
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: paged_attention_step
    raise NotImplementedError(
        "store k and v at the new tokens' slots, then paged attention"
    )
    ### END STARTER


kvlab.check.paged_attention_step(my_paged_attention_step)

# %%
kvlab.check.hint("paged_attention_step", 1)
# kvlab.solutions.show("paged_attention_step")   # uncomment to read the reference
# solution

# %% [markdown]
# ## Lift: your step serves the real model
#
# `kvlab.serving.hf.paged_attention_step` is the package's version of this step (with host checks
# first); `PagedGenerator` calls it for every decoding request of every layer. Hand it yours
# with `decode_step=` (once it passes the [checker](glossary.md#checker); until then the package's runs): the model
# must still produce exactly `generate`'s tokens.

# %%
impl = kvlab.check.choose(
    "paged_attention_step",
    my_paged_attention_step,
    kvlab.serving.hf.paged_attention_step,
)
yours = PagedGenerator(
    model, page_size=PAGE_SIZE, num_pages=256, decode_step=impl, overlap=False
)
got = yours.generate(prompts, max_new_tokens=NEW_TOKENS)
for i, prompt in enumerate(prompts):
    compare_with_generate(i, prompt, got[i])
print(
    f"✓ served through {getattr(impl, '__name__', impl)}: the same tokens as generate()"
    f" for all {len(prompts)} prompts"
)

# %% [markdown]
# ## Serving fast: admission by memory, chunked prefill, CUDA graphs
#
# The loop above gives exactly `generate`'s tokens. Run on a model of a useful size, three
# things decide how fast it is, and real engines handle all three. mini-sglang's scheduler
# (`python/minisgl/scheduler/`) and engine (`python/minisgl/engine/`) are the [source design](glossary.md#source-design);
# kvlab's `PagedGenerator` does each of them, and each can be turned off to see what it buys:
#
# | what | decides | in kvlab | turn it off |
# |---|---|---|---|
# | admission by memory | how many requests run at once | `kvlab.serving.hf.prefill.PrefillAdder` | `max_running=` fewer rows |
# | chunked prefill | how long one step may take | the same, `prefill_budget=` | `chunked_prefill=False` |
# | CUDA-graph decode | what a decode step costs the host | `kvlab.serving.hf.graphs.DecodeGraphs` | `decode_graphs="off"` |
# | overlap scheduling | whether the GPU waits for the host between steps | `kvlab.serving.hf.loop.ServingLoop` | `overlap=False` |
#
# ### Step 1: admission by memory
#
# A fixed cap ("at most 16 requests") leaves memory idle when prompts are short and runs out
# when they are long. mini-sglang's `PrefillAdder` (`scheduler/prefill.py`) admits a waiting
# request when a page-table row is free and `extend_len + output_len` -- what it may still need
# -- fits in the available memory (free plus evictable cached tokens) beside `reserved_size`,
# what the requests already admitted may still need. kvlab counts the same in pages: a request
# may still take
#
#     div_ceil(len(prompt) + max_new_tokens - 1, P)  -  pages its row maps now
#
# pages, so no step can run out of pages half-way. The page table has 256 rows by default
# (mini-sglang's `max_running_req`); the pool decides how many of them run. Six prompts of
# 6-9 tokens and 4 new tokens each need 3 pages of 4 apiece (9-12 positions); a pool of 10
# pages holds three of them at once, one of 256 all six:

# %%
six = [
    [rng.randrange(c.vocab_size) for _ in range(rng.randint(6, 9))] for _ in range(6)
]
for pages in (10, 256):
    g = PagedGenerator(model, page_size=PAGE_SIZE, num_pages=pages, overlap=False)
    g.generate(six, max_new_tokens=4)
    print(
        f"{pages:3d} pages of {PAGE_SIZE}: at most {g.stats['most_running']} requests"
        f" ran at once, {g.stats['steps']} steps"
    )
    assert g.stats["most_running"] == min(6, pages // 3), (
        f"{pages} pages: {g.stats['most_running']} requests at once, expected"
        f" {min(6, pages // 3)}"
    )

# %% [markdown]
# ### Step 2: chunked prefill
#
# A running request gets its next token only when the step it is in ends, and a step that
# computes a long prompt is a long step. mini-sglang gives each step a
# [token budget](glossary.md#token-budget) (`max_extend_tokens`, 8192 by default) and cuts a prompt that does not fit into
# chunks: `PrefillAdder._add_one_req` computes `chunk_size = min(token_budget, remain_len)`,
# and a request cut short becomes a `ChunkedReq` that keeps its page-table row and its locked
# cache handle and goes first in the next step. It produces no token until its last chunk, and
# only then does the scheduler call `cache_req(finished=False)` for it (`scheduler.py`,
# `_process_last_data`, skips a `ChunkedReq`). kvlab's manager says the same in one rule:
# `complete_step` takes `None` as the token of a request whose pass stopped before the end of
# its prompt, and caches it only after its last chunk.
#
# The simulator of chapter 07 has the same option (`chunked_prefill=True`). Three short
# requests decode; at step 3 a 60-token prompt arrives; the budget is 16 tokens:

# %% alt="Bars of the prompt tokens computed at each step with whole prompts and with chunks of a 16-token budget: the whole-prompt run spikes far above the budget line, the chunked run never crosses it, and ticks mark the requests decoded in each step."
from kvlab.course.scenes.ch10_serve import long_prompt_workload, prefill_per_step
from kvlab.serving.sim import simulate

workload = long_prompt_workload(seed=0)
runs = {
    name: simulate(
        workload,
        page_size=4,
        num_pages=64,
        max_running=4,
        prefill_budget=16,
        chunked_prefill=chunked,
    )
    for name, chunked in (("whole prompts", False), ("chunks of the budget", True))
}
ax = prefill_per_step(runs, budget=16)
ax.figure.tight_layout()
plt.show()
for name, tl in runs.items():
    print(
        f"{name:21s} largest step: {max(s.prefill_tokens for s in tl.steps)} prompt"
        f" tokens; chunks: {[s.chunked for s in tl.steps if s.chunked]}"
    )
assert max(s.prefill_tokens for s in runs["chunks of the budget"].steps) <= 16, (
    "a chunked step computed more prompt tokens than the budget of 16")
assert max(s.prefill_tokens for s in runs["whole prompts"].steps) == 60, (
    "whole prompts: the long prompt should take one step of 60 tokens")

# %% [markdown]
# Whole prompts: the long prompt takes one step of 60 tokens, and the three running requests
# wait for all of it. Chunks: no step computes more than 16 prompt tokens, and the running
# requests get a token every step while the long prompt goes in. The real model, with a
# budget of 8 tokens (`StepInfo.chunks` lists the prompts a step continued):

# %%
chunky = PagedGenerator(
    model, page_size=PAGE_SIZE, num_pages=256, prefill_budget=8, overlap=False
)
got = chunky.generate(prompts, max_new_tokens=NEW_TOKENS,
                      on_step=lambda s: print(s) if s.chunks or s.index == 0 else None)
for i, prompt in enumerate(prompts):
    compare_with_generate(i, prompt, got[i])
print(f"✓ {chunky.stats['chunks']} chunks; the same tokens as generate()")

# %% [markdown]
# ### Step 3: decode steps from CUDA graphs, padded with the dummy row
#
# A decode step of a 1-billion-parameter model is a few hundred small kernels, and launching
# each from Python costs more than running it: the GPU waits for the host. A **CUDA graph**
# records the launches of one step once and replays them with a single call. Its shapes and
# memory addresses are frozen, so mini-sglang's `GraphRunner` (`engine/graph.py`) captures the
# decode step at a few batch sizes -- `[1, 2, 4]` and every multiple of 8 up to a maximum
# (`_determine_cuda_graph_bs`) -- reading its inputs from fixed buffers, and pads a batch up
# to the next captured size (`pad_batch`). The padding is a **dummy request**: its engine
# (`engine/engine.py`) makes the page table one row longer than `max_running_req` and the KV
# pool one page larger than the allocator hands out (`num_pages + 1  # +1 for dummy page`),
# and fills that last row with the dummy page's slot. Each entry of the padded batch (one per
# request, as in every decode step) names a row and a position; a padded entry is the dummy
# request at position 0: it writes its K/V into the dummy page and reads only that. Nothing of
# any real request is touched, whatever the padded entries compute.
#
# kvlab does the same: `PagedGenerator` captures its graphs when it is built (`decode_graphs=
# "capture"`, the default on a GPU; nothing is captured or compiled while it serves), and in
# the interpreter runs the very same padded step without a graph (`"eager"`), so the tokens
# are the same everywhere. A step of 5 running requests, padded to the captured size 8:

# %% alt="A page table on pages of 4 slots with the cell each batch entry of a decode step writes outlined, and the dummy row that maps page 40 only; below, five running requests padded to the captured batch size of 8, the three padding entries pointing at the dummy row's slot."
from kvlab.serving.hf import graph_batch_sizes
from kvlab.course.scenes.ch10_serve import padded_step, padded_step_figure

print("mini-sglang's capture sizes up to 64:", graph_batch_sizes(64))
step = padded_step(seed=0, page_size=4, running=5)
padded_step_figure(step)
plt.show()

# %% [markdown]
# ## Your turn: pad a decode step
#
# Write `my_pad_decode_batch(rows, positions, page_table, sizes, dummy_row)`. `rows[b]` and
# `positions[b]` (int64 tensors) are request `b`'s page-table row and the position of its new
# token; `sizes` are the captured batch sizes (in any order). Return `(rows, positions, slots)`,
# each as long as the smallest size that holds the batch:
#
# 1. the real entries unchanged, then padded entries of the dummy request: row `dummy_row`,
#    position 0;
# 2. every entry's slot, `page_table[row, position]` -- for a padded entry, the dummy page's;
# 3. a batch larger than every size is returned as it is (it runs without a graph).
#
# All three are 1-D tensors on the inputs' device: rows and positions int64, slots of the page
# table's dtype (what `page_table[rows, positions]` gives) or int64. `rows`, `positions`,
# `page_table` and `sizes` are read-only. The dummy row is whichever row `dummy_row` names
# (`PagedGenerator`'s is the table's last; the checker puts it elsewhere too).
#
# `kvlab.check.pad_decode_batch` checks the types, the size, then rows, positions and slots entry by entry,
# on edge cases (nothing to pad, one request with or without size 1 captured, page sizes 1 and 64, sizes out of order or not
# powers of two, a batch too large for any graph) and random steps. Hints:
# `kvlab.check.hint("pad_decode_batch", 1)` (up to 3); the reference:
# `kvlab.solutions.show("pad_decode_batch")`.

# %%
def my_pad_decode_batch(rows, positions, page_table, sizes, dummy_row):
    """Pad the step's entries to the next captured size with the dummy request; look up
    every slot."""
    ### BEGIN SOLUTION
    n = len(rows)
    # none holds it: no padding
    size = next((s for s in sorted(sizes) if s >= n), n)
    rows = torch.cat([rows, rows.new_full((size - n,), dummy_row)])
    positions = torch.cat([positions, positions.new_zeros(size - n)])
    return rows, positions, page_table[rows, positions]
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: pad_decode_batch
    raise NotImplementedError(
        "pad rows and positions with the dummy request, then look up the slots"
    )
    ### END STARTER


kvlab.check.pad_decode_batch(my_pad_decode_batch)

# %%
kvlab.check.hint("pad_decode_batch", 1)
# kvlab.solutions.show("pad_decode_batch")   # uncomment to read the reference solution

# %% [markdown]
# ## Lift: your padding against the generator's
#
# `kvlab.serving.hf.pad_decode_batch` is the padding `PagedGenerator`'s graphs do before every replay
# (they pad on the host, in the one copy of a step's inputs, and leave the slot lookup to the
# attention kernel, which finds each slot in the page table itself; chapter 09). On
# random steps (once yours passes the checker; until then the package's stands in) both must
# give the same entries. `kvlab.attention.kv_pool.random_decode_step` draws such a step: requests on
# shuffled pages in shuffled rows, and a dummy row that maps only the dummy page.

# %%
from kvlab.attention.kv_pool import random_decode_step

pad = kvlab.check.choose(
    "pad_decode_batch", my_pad_decode_batch, kvlab.serving.hf.pad_decode_batch
)
for seed in range(5):
    case_rng = random.Random(seed)
    lengths = [case_rng.randint(1, 12) for _ in range(case_rng.randint(1, 9))]
    sizes = sorted(case_rng.sample([1, 2, 4, 8, 16], 3))
    decode = random_decode_step(seed, 4, lengths)
    args = (decode.rows, decode.positions, decode.page_table, sizes, decode.dummy_row)
    for what, mine, theirs in zip(
        ("rows", "positions", "slots"),
        pad(*args),
        kvlab.serving.hf.pad_decode_batch(*args),
    ):
        # slots may be int32 or int64
        mine, theirs = mine.cpu().long(), theirs.cpu().long()
        assert torch.equal(mine, theirs), (
            f"step {seed}, {what}: yours {mine.tolist()}, the package's"
            f" {theirs.tolist()}"
        )
print("✓ the same padded entries on 5 random steps")

# %% [markdown]
# Then a generator whose padded steps write only the dummy page: its pool starts as NaN
# everywhere, and after serving only the slots of computed tokens and the dummy page's first
# slot hold numbers.

# %%
# pads every decode step to 8
watched = PagedGenerator(model, page_size=PAGE_SIZE, num_pages=64, graph_sizes=[8],
                         overlap=False)
watched.pool.k.fill_(float("nan"))
got = watched.generate(prompts, max_new_tokens=NEW_TOKENS)
for i, prompt in enumerate(prompts):
    compare_with_generate(i, prompt, got[i])
written = ~watched.pool.k[0].isnan().flatten(1).all(1)
dummy = watched.num_pages * PAGE_SIZE
computed = watched.stats["prefill_computed"] + watched.stats["decode_tokens"]
assert (
    int(written[:dummy].sum()) == computed
), f"{int(written[:dummy].sum())} real slots written, {computed} tokens computed"
assert bool(written[dummy]) and not bool(
    written[dummy + 1 :].any()
), "the dummy page's first slot only"
print(
    f"✓ {watched.stats['graph_steps']} padded decode steps"
    f" ({'CUDA graphs' if watched.graphs.capture else 'run eagerly'}); slots written:"
    " the computed tokens' and the dummy page's first"
)

# %% [markdown]
# ### Step 4: overlap scheduling
#
# Even replayed from a graph, every step of the loop so far ends the same way: the GPU finishes
# step n, and then the host reads its tokens back, records them (EOS? `max_new_tokens`?),
# caches what finished, plans step n+1 (admission, pages), builds its inputs -- and only then
# does the GPU get work again. Meanwhile it is idle. mini-sglang's scheduler
# (`python/minisgl/scheduler/scheduler.py`) has two loops: `normal_loop`, which is ours, and
# `overlap_loop`, its default (`MINISGL_DISABLE_OVERLAP_SCHEDULING=1` picks the other,
# `python/minisgl/env.py`). `overlap_loop` changes only the **order**: schedule step n+1 and
# launch it, *then* process step n's results -- the GPU runs step n+1 while the host records
# step n, and finds step n+2 queued when it is done:
#
#     without overlap:
#       host | plan n+1 | launch n+1 | wait ......... | record n+1 | plan n+2 | ...
#       GPU  |          |            | forward n+1    |            |          | ...
#     with overlap:
#       host | plan n+2 | launch n+2 | wait | record n+1 | plan n+3 | launch n+3 |
#       GPU  | forward n+1 ................ | forward n+2 ....................... |
#
# `PagedGenerator(overlap=True)` (the default on a GPU; this chapter turned it off until now)
# runs the same order (`kvlab.serving.hf.loop.ServingLoop.run`). A step's tokens now reach the host
# one step late, and four things follow:
#
# 1. **The next step's input tokens are read on the GPU.** Step n+1 is built before the host
#    knows what step n sampled. Each step writes its tokens into `last_tokens[row]` (one
#    entry per page-table row) and the next step's decoding entries read theirs from there; the
#    host keeps a placeholder (`kvlab.serving.hf.loop.PENDING`) in `req.input_ids` until it reads the
#    token. mini-sglang keeps a whole `token_pool` (row × position) for the same purpose
#    (`_forward`: `batch.input_ids = self.token_pool[input_mapping]`).
# 2. **Lengths move at launch.** So that step n+1 maps the right positions, `complete_step`
#    runs right after step n is launched, with its tokens pending (mini-sglang's engine calls
#    `req.complete_one()` in `forward_batch`, before anyone has looked at the tokens).
# 3. **Finished requests.** One that reaches `max_new_tokens` at step n is known in advance
#    and never scheduled at n+1. One whose token at step n is EOS was already scheduled at
#    n+1 when the host reads it: its entry there is wasted, its token dropped, and it is never
#    scheduled at n+2. mini-sglang releases such a request as soon as it reads the EOS
#    (`_process_last_data`, which skips a second free: "overlap scheduling may make the
#    request freed twice"), while step n+1, which reads its pages, may still be on the GPU --
#    it relies on the GPU's order: the next write to those pages, by a later step's forward
#    pass, is queued on the engine's stream behind step n+1.
#    **kvlab departs from it**: it releases a request exactly once, when the last step it is in
#    has completed, so no step ever reads a page that was given back -- whatever runs the
#    steps (`tests/test_hf_overlap.py` checks it with a device that runs each step as late as
#    possible). kvlab also caches a finished prompt only once the step that computed it has
#    completed, so the prefix cache never holds K/V that is still being written.
# 4. **Admission waits one step longer.** A request that arrives while step n runs is
#    admitted in step n+2 rather than n+1: overlap trades a step of time to first token for
#    throughput (the online table below shows both).
#
# kvlab's other departures: one CUDA stream (mini-sglang prepares metadata on a second one);
# without CUDA a worker thread plays the GPU stream; and with chapter 12's memory policies, a
# step that must stop requests first waits for the step in flight.
#
# The same prompts, served without and with overlap, must give the same tokens. The
# timestamps of both runs (`generate(..., timeline=True)` fills `gen.timeline`) draw the
# two tracks of a timeline, the host's and the device's. Here the decode step is a plain-torch one (`reference_decode_step`): in the
# interpreter a Triton kernel takes so long that the host's share would not show.

# %% alt="Two timelines of this run's steps, without and with overlap scheduling, each with a host track (scheduling, launching, waiting for tokens, recording) and a device track (the forward passes): with overlap the host plans the next step while the device still runs the current one."
from kvlab.course.scenes.ch10_serve import (
    overlap_runs,
    overlap_timeline_figure,
    recorded_timelines,
)

runs = overlap_runs(model, max_new_tokens=NEW_TOKENS)
assert runs.tokens["with overlap"] == runs.tokens["without overlap"], (
    f"with overlap {runs.tokens['with overlap']}, without"
    f" {runs.tokens['without overlap']}"
)
print("✓ the same tokens with and without overlap;",
      {name: len(steps) for name, steps in runs.timelines.items()}, "steps")
where = "GPU" if DEVICE.type == "cuda" else "CPU (a worker thread plays the GPU)"
overlap_timeline_figure(runs.timelines, where)
plt.show()

# %% [markdown]
# On a CPU both tracks are Python sharing one interpreter lock, so they can only partly run
# at once, and the device's track is long. On a GPU the device track is the GPU's and the
# host's work fits inside it. The serving benchmark recorded a few decode steps at 64
# running requests on an H200 (`figures/bench.json`), and the same figure draws them: without
# overlap a gap after every step (the host recording and planning while the GPU waits), with
# overlap none.

# %% alt="The same two-track timeline for decode steps at 64 running requests recorded on the GPU the title names: without overlap the device waits after every step while the host records and plans; with overlap the device's steps follow each other without a gap."
from kvlab.bench.serve_report import plot_serve
from kvlab.course.scenes.ch09_making_it_fast import load_bench

bench = load_bench()
recorded = recorded_timelines(bench)
if recorded:
    overlap_timeline_figure(recorded, bench["serve"]["meta"]["device"])
    plt.show()
else:
    print(
        "figures/bench.json holds no recorded GPU timeline: run `python -m kvlab.bench"
        " --serve` on a GPU"
    )

# %% [markdown]
# ## Measured: the workload serving engines publish
#
# `python -m kvlab.bench --serve` measures, side by side in one run, what nano-vllm and
# mini-sglang publish, on a random-weight model with **Qwen3-0.6B's configuration** in bfloat16
# (28 layers, hidden 1024, 16 query heads of 128 on 8 K/V heads; Qwen3 normalises each head's
# query and key inside its attention layer, which kvlab leaves to the model's own code):
#
# * **offline** -- nano-vllm's `bench.py` (mini-sglang's `benchmark/offline/bench.py` adapts
#   it): 256 requests, seed 0, prompts and answers each 100-1024 tokens, no end of text;
#   output tokens per second over the whole call. kvlab with and without overlap, each
#   against **the floor of the steps it took** (`kvlab.bench.serve_floor`): every step must
#   read every weight once and the K/V of every position its decoding requests attend to, and
#   do its prompt tokens' arithmetic, so its time is at least the larger of its bytes over the
#   measured bandwidth and its FLOPs over the GPU's dense bfloat16 peak; the run's floor is the
#   sum. transformers' `generate`, its fastest documented path (a static cache and
#   `torch.compile`, as its optimisation guide recommends, compiled before the timed call) and
#   `generate_batch` only on a few of the requests, answers cut short (their loops would take
#   minutes), with kvlab on the same requests beside them;
# * **online** -- requests arriving as a Poisson process at several rates: time to first token
#   (TTFT), the time between two tokens of a request (ITL) and end-to-end latency, p50 / p99;
# * **GPU busy** -- the share of each decode step's time the GPU works (CUDA events around
#   each step's device work), at 64 and 256 running requests.
#
# The saved result (`figures/bench.json`; `figures/bench.md` has every number and says which
# parts did not fit the run's time):

# %% alt="Four panels of the saved serving benchmark: offline output tokens per second of kvlab with and without overlap and of transformers' generate and generate_batch; the GPU's busy share of a decode step at 64 and 256 running requests with and without overlap; online time to first token and requests served per second against the arrival rate."
saved = bench["serve"]
if "offline" in saved:
    plot_serve({"serve": saved})
    plt.show()
    for t in saved["targets"]:
        verdict = (
            "PASS" if t["passed"] else "FAIL" if t["passed"] is not None else "n/a"
        )
        print(f"[{verdict}] {t['name']}: {t['measured']} ({t['rule']})")
    off = saved["offline"]["paths"]
    for name, e in off.items():
        if "tokens_per_s" in e:
            floor = ""
            if e.get("ratio_to_floor"):
                floor = f", {e['ratio_to_floor']:.2f}x the floor of its steps"
            print(
                f"{name:24s} {e['requests']:3d} requests: {e['tokens_per_s']:7.0f}"
                f" output tokens/s{floor}"
            )
    for name in ("64", "256"):
        on, no = saved["busy"]["paths"].get(f"overlap_{name}", {}), saved["busy"][
            "paths"
        ].get(f"no_overlap_{name}", {})
        if on.get("busy") is not None and no.get("busy") is not None:
            print(
                f"{name} running: GPU busy {no['busy']:.2f} of a {no['step_ms']:.1f} ms"
                f" step without overlap, {on['busy']:.2f} of {on['step_ms']:.1f} ms"
                " with it"
            )
else:
    print(
        "figures/bench.json holds an older serving benchmark: run `python -m"
        " kvlab.bench --serve` on a GPU"
    )

# %% [markdown]
# What the numbers say (read them off your copy of the tables above):
#
# * **overlap** keeps the GPU busy through the decode steps: without it, the host's
#   bookkeeping between two steps is GPU idle time, and the more requests run the longer it
#   is. How much throughput that buys depends on how long the GPU's own step is: when the
#   attention kernel dominates the step, hiding the host's share gains little. Time to first
#   token pays a step (point 4 above), while the time between tokens gets shorter;
# * **where it saturates**: past some arrival rate, the requests served per second stop
#   following the rate and latencies climb -- the server is full;
# * **the floor**: the whole-workload runs' ratio says how much of the time the GPU's bytes and
#   arithmetic explain; the rest is what the loop adds (steps with few requests, whose weights
#   are read for little work; the prompts' chunks, computed request by request; the host);
# * **transformers' paths**: `generate` pads every prompt of its batch to the longest and runs
#   every answer to the longest, launching every kernel from Python; with a static cache and
#   `torch.compile` the same batch replays a compiled, captured step instead; `generate_batch`
#   schedules requests itself but, in the transformers version the table names, is slower still.

# %% [markdown]
# ## Summary
#
# * transformers finds attention **by name** (`AttentionInterface`, `attn_implementation`);
#   keyword arguments of `model(...)` reach it. kvlab registers one function and the model
#   keeps computing norms, RoPE and MLPs itself: no copy of its code (one exception, in the
#   captured decode step only: `kvlab.serving.hf.fuse` restates an attention layer's few lines to get
#   q, k and v from one matrix product, chapter 09).
# * Grouped-query attention stores `kv_heads` heads per token; query head `h` reads K/V head
#   `h // group`. The Triton kernel of chapter 08 needed one more constant, `KV_GROUP`.
# * `PagedGenerator` is continuous batching on kvlab's memory manager: admit while pages
#   last (prefix hits locked, in-batch sharing deferred one step), `allocate_paged`, one packed
#   forward, `cache_req`. A real model then produces exactly `generate`'s tokens, and a
#   conversation that re-sends its history computes only what is new.
# * Fast the way mini-sglang is: rows and pages decide how many requests run (with page
#   reservations), a token budget cuts long prompts into chunks that keep their row and handle,
#   decode steps replay CUDA graphs captured at start-up, padded with the dummy row whose
#   every entry is the dummy page, and overlap scheduling plans step n+1 while the GPU runs
#   step n -- the tokens read one step late, a finished request released once its last step
#   is done. Llama, Qwen2 and Qwen3 are served the same way, with the same tokens as
#   `generate` in float32; measured on the engines' own workload, `figures/bench.md`.
#
# **Open questions.**
# 1. A conversation's turns arrive one at a time. Between turns the cache may [evict](glossary.md#eviction) the
#    previous turn's pages to serve other users. Which eviction order (LRU, by prefix length,
#    by how many conversations share a node) would you choose for a chat server, and why?
# 2. The admission rule reserves pages for `max_new_tokens` that a request may never use
#    (it can stop at EOS much earlier). What would you need to admit more aggressively --
#    and what must happen when a running request then finds no page for its next token?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# 1. A conversation's next turn arrives seconds later and re-sends everything, so its deepest
#    node is worth more than its age says. Plain LRU (what kvlab's radix cache does) evicts the
#    leaves touched longest ago -- often a paused conversation's latest answer, forcing the
#    whole tail to be recomputed. Protecting nodes many conversations share (a system prompt)
#    by reference count or hit count, and evicting from the leaves of idle conversations
#    first, keeps the expensive long prefixes; a deployment can also give a conversation a
#    short grace period after each turn. Whatever the order, only whole leaves can go (an
#    inner node is a prefix of its children), which is why eviction walks up from the leaves.
# 2. Admitting against expected rather than maximal length (for example, counting
#    `min(max_new_tokens, a typical answer length)`) lets more requests run at once, but then a
#    decode step can find no free page. A server then needs a way out: evict more of the cache
#    first, and when that is not enough, **preempt** a running request -- free its pages (or
#    keep its computed prefix in the cache), put it back in the waiting queue, and recompute
#    or reload it later. SGLang retracts decode requests this way when memory runs out, and
#    steers how aggressive admission may be with one number, `new_token_ratio` (the share of
#    `max_new_tokens` it reserves): raised after a retraction, lowered a little at every step
#    without one.
