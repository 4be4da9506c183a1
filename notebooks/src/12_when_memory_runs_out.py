# %% [markdown]
# # 12 · When KV memory runs out: reserve, retract, preempt, swap
#
# **Time:** about 90 minutes. **Assumes:** chapters 06 and 07 (`CacheManager`, the simulator
# and its [timelines](glossary.md#timeline)), chapter 10 (`kvlab.serving.hf.PagedGenerator`), chapter
# 11 (vLLM's free queue keeps freed pages findable).
#
# **Goal.** A server admits a request without knowing how long its answer will be: it ends at an
# end-of-text token, or at `max_new_tokens`. Every running request takes one more
# [token slot](glossary.md#token-slot) per [decode](glossary.md#decode) step, so memory that
# looked ample at admission can run out in the middle of a step. Each engine answers that
# differently, and no answer is free:
#
# * **reserve** every answer's whole length at admission (mini-sglang; chapter 10's generator):
#   nothing ever runs short, and an answer that ends early leaves its reservation unused;
# * admit on what the coming step needs and, when a step does not fit,
#   **[preempt](glossary.md#preemption) by recompute** (vLLM v1): the victim gives its pages back
#   and is prefilled again later;
# * reserve an **estimate** and **[retract](glossary.md#retraction)** when it was too low (SGLang's
#   [`new_token_ratio`](glossary.md#new-token-ratio));
# * **[swap](glossary.md#swap)** the victim's KV to host memory and copy it back later (vLLM's
#   earlier design).
#
# You will build the four as one small vocabulary, `kvlab.serving.pressure`, every rule and constant
# traced to the engine's code; watch them on the simulator of chapter 07, which now takes a
# [memory policy](glossary.md#memory-policy); write the pieces a policy is made of (who is
# stopped first, how SGLang's estimate moves, what a returning request copies back and to which
# slot, and a swap-out that frees each page once); check on a real model that no policy changes
# a single token; and measure, side by side on the same seeded workloads, where each one wins.

# %%
import random

import matplotlib.pyplot as plt
import torch

import kvlab
from kvlab.serving.pressure import (
    POLICIES,
    RequestView,
    RetractDecode,
    make_policy,
    next_token_ratio,
    resume_plan,
    victim_order,
)
from kvlab.serving.hf import PagedGenerator, tiny_model
from kvlab.course.scenes.ch12_memory import (
    CHAPTER_WORKLOADS,
    P,
    bench_rows,
    chapter_workload,
    compared_rows,
    host_full_stops,
    leave_and_return_figure,
    policy_compare_figure,
    policy_run,
    promised_pages_figure,
    retraction_cost,
    where_retract_sits,
)
from kvlab.serving.sim import simulate
from kvlab.serving.sim.compare import memory_pools, policy_table
from kvlab.course.viz.policies import ratio_over_time

torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Intuition: promises that answers do not keep
#
# Thirty-two requests whose answers are long-tailed: most end after a few tokens at an
# end-of-text token ([EOS](glossary.md#eos)), a few run to their cap of 64 tokens. The scheduler
# knows only the cap. Below, the same traffic in the same tight memory ([pages](glossary.md#page) of
# 4 slots, 15% of what every answer at its cap would take at once) twice. Top: every admitted request is **promised** its whole answer (hatched: pages
# set aside that no row maps yet). Bottom: admission counts only what the coming step needs.

# %% alt="Pages over time for the same EOS-heavy traffic in tight memory, twice: top, reserving whole answers, with a wide hatched band of promised but unmapped pages above the pages in use; bottom, admitting on the coming step, with more pages in use, no promises, and a few requests stopped."
promised_pages_figure()
plt.show()

# %% [markdown]
# The hatched band is memory nobody uses: most of those answers end long before their cap. With
# it, fewer requests run at once and the same work takes more steps. Without it, more run at
# once, and the price is the risk the top picture never takes: a step that does not fit, with a
# request that has to be stopped. The rest of the chapter is about that trade.
#
# ## Build-up 1: one vocabulary for every policy
#
# A policy reads a request as plain numbers, a `RequestView`: its prompt, the tokens it has
# generated, its cap (`max_new`), the positions its row maps once the coming step is mapped,
# the pages its row maps now, and its admission and arrival order. From those each policy says
# how many more pages admission must leave free for it (`promised_pages`). Here is one request
# of a 10-token prompt that has generated 3 of at most 20 tokens, in pages of 4:

# %%
view = RequestView(
    key="r", prompt_len=10, generated=3, max_new=20, positions=13, mapped_pages=3
)
print(
    f"it may map {view.max_positions} positions in all (prompt + max_new - 1: the last"
    " token's KV is never computed)"
)
for name in ("reserve", "recompute", "retract", "swap"):
    run = make_policy(name).start()
    print(f"{name:9s} promises {run.promised_pages(view, 4)} more page(s)"
          + (f" (new_token_ratio {run.ratio})" if run.ratio is not None else ""))
assert [make_policy(n).start().promised_pages(view, 4) for n in POLICIES] == [
    5,
    1,
    4,
    1,
], "the promises above"

# %% [markdown]
# * **reserve** promises every position it may still map: `div_ceil(29, 4) - 3 = 5` pages.
#   mini-sglang's `PrefillAdder` (`python/minisgl/scheduler/prefill.py`, sgl-project/mini-sglang
#   `20fcd7f` on main) keeps a request waiting while `estimated_len + reserved_size > available_size`,
#   where `estimated_len` is its uncached prompt plus its whole `output_len` and `reserved_size`
#   starts from the running requests' `decode_manager.inflight_tokens`.
# * **recompute** and **swap** promise the coming step only: one page for position 13.
# * **retract** promises `positions + ceil(ratio x what it may still generate)`: `13 + ceil(0.7 x 17)
#   = 25` positions, 4 pages. SGLang's `PrefillAdder` (`python/sglang/srt/managers/schedule_policy.py`)
#   counts a running request as `min(max_new_tokens - len(output_ids), CLIP_MAX_NEW_TOKENS) *
#   new_token_ratio` and a newcomer as its uncached prompt plus its whole (clipped) answer.
#
# Both serving loops ask these same objects: `kvlab.serving.sim.SimConfig(policy=...)` and
# `kvlab.serving.hf.PagedGenerator(..., policy=...)`.
#
# ## Build-up 2: reserve the whole answer (mini-sglang)
#
# The simulator of chapter 07 takes the policy; each step's record now also holds the pages
# promised but not mapped (`promised_pages`), who was stopped (`preempted`) and came back
# (`resumed`, `swapped_in`), and each request its first token (`first_token_step`). Reserving
# never stops anyone:

# %%
pools = memory_pools(chapter_workload("eos_long_tail"), P)
print("pools, in pages of 4:", pools)
reserve = policy_run("reserve")
s = reserve.summary()
print(
    f"reserve, tight: {s.steps} steps, {s.mean_running:.1f} requests running at once,"
    f" {s.preemptions} stopped, {s.mean_promised_pages:.1f} pages promised but unmapped"
    " per step"
)
assert (
    s.preemptions == 0 and s.recomputed_tokens == 0
), "reserving whole answers never stops a request"
in_use = sum(r.memory.in_use for r in reserve.steps) / len(reserve)
print(
    f"in use: {in_use:.1f} pages per step; promised on top: {s.mean_promised_pages:.1f}"
)

# %% [markdown]
# Pools are a share of every request's whole answer at once (`kvlab.serving.sim.compare.MEMORY_POOLS`):
# `ample` holds them all, `medium` 40%, `tight` 15% (never less than the longest request alone).
# In the tight pool the promises are larger than what is really in use, and the requests they
# were made for mostly end early: that is the waste.
#
# ## Build-up 3: admit on the coming step, preempt by recompute (vLLM)
#
# vLLM's scheduler (`vllm/v1/core/sched/scheduler.py`, vllm-project/vllm `00024d31`) gives every
# running request its next tokens first. When `allocate_slots` fails for one, it preempts
# `self.running.pop()`, the request appended last (the latest admitted, or resumed), until the
# step fits or the request preempts itself. `_preempt_request` frees its blocks, sets
# `num_computed_tokens = 0` and puts it at the **front** of the waiting queue; no waiting request
# is scheduled in a step that preempted (`if not preempted_reqs`). Its full blocks were hashed as
# they were computed, so they stay findable in the free queue (chapter 11): its re-prefill is a
# [cache hit](glossary.md#cache-hit) for whatever was not handed out meanwhile. kvlab does the
# same with `cache_req(finished=True)` on the victim (`RecomputeOnPreempt(keep_computed=True)`).
#
# Chapter 07's simulator preempted the same victim, but released it without caching what it had
# decoded and let waiting requests in during the same step: `kvlab.serving.pressure.CHAPTER_07`, the
# simulator's default, kept so that chapters 07 and 11 run exactly as before.

# %%
recompute = policy_run("recompute", "shared_system_prompt")
chapter_07 = policy_run(kvlab.serving.pressure.CHAPTER_07, "shared_system_prompt")
for label, tl in (("recompute (vLLM)", recompute), ("chapter 07's loop", chapter_07)):
    s = tl.summary()
    print(
        f"{label:18s}: {s.preemptions:2d} preemptions, {s.recomputed_tokens:3d}"
        f" positions computed again, {s.steps} steps"
    )
assert recompute.summary().recomputed_tokens < chapter_07.summary().recomputed_tokens, \
    "kept pages make comebacks cheaper"
assert all(not set(st.admitted) & set(st.preempted) for st in recompute.steps), \
    "vLLM admits nobody in a step that preempted"

# %% [markdown]
# Keeping the victim's whole pages makes its comeback cheaper: it recomputes only what was
# evicted meanwhile and its last, partial page. Who runs when, for the first ten requests of
# that run (top), and the same traffic with the swap policy of build-up 5 (bottom): a `v` is a
# request stopped, a `^` its comeback; purple is running, grey a first wait, salmon a stopped
# request's wait in the queue, light green its wait in host memory.
#
# One request of the bottom panel waits in the queue (salmon) although the policy swaps: when it
# was stopped, host memory was full. The simulator's host pool holds as many pages as the device
# (`SwapToHost(host_pages=None)`), and the requests swapped out before it filled it, so kvlab's swap
# policy preempted this one by recompute instead. (vLLM v0 had no such fallback: its `_swap_out`
# stops the engine with "Aborted due to the lack of CPU swap space".) The cell under the picture
# names it.

# %% alt="One lane per request over the steps of a tight run with a shared system prompt: top with recompute, where stopped requests wait in the queue again before they come back; bottom with swap, where most stopped requests wait in host memory instead."
leave_and_return_figure()
plt.show()
swap_run = policy_run("swap", "shared_system_prompt")
for step, rid, used in host_full_stops(swap_run):
    print(
        f"swap run, step {step}: request {rid} went back to the queue;\n  host memory"
        f" held {used} of {swap_run.num_pages} pages, too few left for its row"
    )
assert host_full_stops(swap_run), "the picture's recomputed request"

# %% [markdown]
# ## Build-up 4: reserve an estimate, retract when it was wrong (SGLang)
#
# SGLang reserves neither everything nor nothing. Each running request counts
# `new_token_ratio` x what it may still generate, and the ratio moves
# (`python/sglang/srt/managers/scheduler.py` `update_running_batch`,
# `schedule_batch.py` `retract_decode`, sgl-project/sglang `000eaffa`; constants in
# `python/sglang/global_config.py`, `025ea29a`):
#
# | | value | what |
# |---|---|---|
# | `init_new_token_ratio` | 0.7 | `SGLANG_INIT_NEW_TOKEN_RATIO` (x `schedule_conservativeness`, 1 by default) |
# | `min_new_token_ratio` | 0.7 x 0.14 = 0.098 | `SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR` |
# | decay per decode step | (0.7 - 0.098) / 600 | `SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS` |
# | after a retraction | min(1, (decoded + 20 n) / sum of max_new) | over the n requests still running; `retract_decode_steps = 20` |
# | when the server idles | back to 0.7 | `self_check_during_idle` |
#
# When a decode step does not fit, `retract_decode` sorts the batch by `(len(output_ids),
# -len(origin_input_ids))` in reverse and pops from the end, at least once and until the step
# fits: the requests that generated least go first, among them the longest prompt.
# `release_req` frees their KV past the cached prefix without inserting anything, and they rejoin
# the waiting queue. Then the ratio jumps to what the remaining requests really generated.
# 600 decode steps is long next to our runs of a few dozen steps, so below the burst of long
# prompts also runs with a ratio that decays in 20 steps. The third line is a workload whose
# answers run nearly to their cap (`long_answers`: each at least 90% of its 32 tokens), which
# the estimate of 0.7 x what is left undercounts from the start:

# %% alt="SGLang's new_token_ratio per step of three runs: on the burst workload with 600 decay steps it barely falls from 0.7, with 20 it falls to its minimum of 0.098 and jumps back up after a retraction; on long answers it falls slowly until the running requests outgrow their estimate, and each retraction, marked, makes it jump."
ratios = {
    "burst, 600 decay steps": policy_run("retract", "long_prompt_burst", "medium"),
    "burst, 20 decay steps": policy_run(
        RetractDecode(decay_steps=20), "long_prompt_burst", "medium"
    ),
    "long answers, 600 steps": policy_run("retract", "long_answers", "medium"),
}
ratio_over_time(ratios)
plt.show()
for label, tl in ratios.items():
    s = tl.summary()
    print(
        f"{label:24s}: {s.steps:3d} steps, {s.mean_running:4.1f} running,"
        f" {s.preemptions} retractions, lowest ratio"
        f" {min(st.ratio for st in tl.steps):.3f}"
    )

# %% [markdown]
# A lower ratio admits more, until the estimate is too low and a retraction resets it. On long
# answers the estimate is too low from the start. Admission counts a newcomer's whole answer,
# which leaves some slack, but once several requests decode together they outgrow what was left
# for them: the step that does not fit retracts the one that generated least, which gives its
# pages back and computes all it had again when it is readmitted. The same traffic with reserve
# and recompute beside it:

# %%
for pool in ("medium", "tight"):
    for name in ("reserve", "retract", "recompute"):
        s = policy_run(name, "long_answers", pool).summary()
        print(
            f"long answers, {pool:6s} {name:9s}: {s.steps:3d} steps, {s.preemptions:2d}"
            f" stopped, {s.recomputed_tokens:3d} positions computed again"
        )
    assert (
        policy_run("retract", "long_answers", pool).summary().preemptions > 0
    ), "the estimate ran short"

# %% [markdown]
# Each retraction is work thrown away: the positions computed again above. Whether the memory an
# estimate frees is worth that work is what the last section measures. Departure:
# kvlab lets a prompt still being computed in chunks be a victim too (SGLang keeps its one chunked
# request outside the running batch), and moves the ratio once per step that decodes (SGLang's
# steps are either prefill or decode).
#
# ## Build-up 5: swap to host memory (vLLM v0)
#
# Before v1, vLLM could also **swap**: `PreemptionMode.SWAP` in `vllm/core/scheduler.py`
# (`0054e1fa`) copies a sequence's blocks to CPU memory and back when it resumes; the victim is
# `running_queue.pop()` after an FCFS sort (the latest arrival), swapped requests come back before
# any waiting one is prefilled, and nothing is swapped in during a step that preempted. Its
# default was still recomputation, "since it incurs lower overhead than swapping"; swapping was
# for groups of several sequences. SGLang's host KV pools
# (`python/sglang/srt/mem_cache/memory_pool_host.py`) sit in [pinned memory](glossary.md#pinned-memory),
# as kvlab's do (`kvlab.serving.hf.swap.HostKV`; on a CPU a second tensor stands in).
#
# kvlab copies the victim's whole row, positions `[0, cached_len)`, into host pages. When it comes
# back it gets a fresh row; the prefix cache may still hold its first pages, so only the rest is
# copied back, into new pages, and its last token is computed. `kvlab.serving.pressure.resume_plan` says
# which positions are copied and which computed:

# %%
for how in ("swap", "recompute"):
    plan = resume_plan(how, saved=15, hit=8, input_len=16)
    print(
        f"{how:9s}: positions [0, {plan.hit}) from the cache, copy {list(plan.copy)},"
        f" compute {list(plan.compute)} -> {plan.recomputed} position(s) computed again"
    )

# %% [markdown]
# ## Validate: no page lost, no token changed
#
# Every step of every run below passes the simulator's own checks (`check_integrity()` and no row
# reads a free page) while it runs. We check the recordings once more: the pages add up at every
# step, every request ends once with its whole answer, and nothing is left running or in host
# memory at the end. The cell runs the chapter's workloads with every policy in medium and tight
# memory, 32 runs, most of them for the first time: **about 10 seconds** on a laptop's CPU
# (the comparison at the end reuses them).

# %%
def check_run(tl, workload):
    for st in tl.steps:
        assert st.memory.total == tl.num_pages and st.promised_pages >= 0, st.step
    last = tl.steps[-1]
    assert (
        last.memory.in_use == 0 and last.host_pages == 0 and not last.swapped
    ), "something left at the end"
    assert sorted(r for st in tl.steps for r in st.finished) == list(
        range(len(workload))
    ), "a request ended twice or never"
    assert all(
        tl.requests[r.rid].generated == len(r.output) for r in workload.requests
    ), "a token was lost"


runs = 0
for name in CHAPTER_WORKLOADS:
    for policy in POLICIES:
        for pool in ("medium", "tight"):
            check_run(policy_run(policy, name, pool), chapter_workload(name))
            runs += 1
print(f"{runs} runs: every page and every token accounted for")

# %% [markdown]
# The real check is on a real model: whatever the policy, and however often a request is
# stopped, its tokens must be exactly `generate`'s. Chapter 10's small random Llama, six prompts,
# pages of 4 and only 8 of them, so the swap policy has to make room (the tests run every policy
# this way, at page sizes 1 and 16 too). On a CPU the attention kernels run in Triton's
# interpreter: **about 10 seconds**.

# %%
model = tiny_model("llama", seed=0, device=kvlab.DEVICE)
rng = random.Random(5)
prompts = [[rng.randrange(128) for _ in range(n)] for n in (9, 17, 4, 12, 3, 6)]
gen = PagedGenerator(
    model, page_size=4, num_pages=8, max_running=6, prefill_budget=7, policy="swap"
)
got = gen.generate(prompts, max_new_tokens=10)
for i, prompt in enumerate(prompts):
    want = model.generate(
        torch.tensor([prompt], device=model.device), max_new_tokens=10, do_sample=False
    )[0, len(prompt) :].tolist()
    assert got[i] == want, f"prompt {i}: {got[i]} != generate's {want}"
print(
    f"identical to generate; swapped out {gen.stats['swaps_out']} times,"
    f" {gen.stats['swapped_out_bytes']} bytes to host and"
    f" {gen.stats['swapped_in_bytes']} back"
)
assert gen.stats["swaps_out"] > 0, "the pool was meant to force swaps"

# %% [markdown]
# ## Your turn
#
# Four exercises, the pieces a policy is made of. The [checkers](glossary.md#checker) compare
# with `kvlab.serving.pressure` on named edge cases and seeded random ones. A typical slip, retracting
# the requests that generated *most* first, is caught like this:

# %%
# the slip: SGLang's sort without the pop from the end
def retract_most_first(policy, running):
    return [
        r.key
        for r in sorted(
            running, key=lambda r: (r.generated, -r.prompt_len), reverse=True
        )
    ]


try:
    kvlab.check.victim_order(retract_most_first)
except kvlab.check.CheckFailed as e:
    print("CheckFailed:", str(e).splitlines()[0])
else:
    raise AssertionError("the wrong order must be rejected")

# %% [markdown]
# **Exercise `victim_order`: choose the victim.** Write `my_victim_order(policy, running)`:
# the keys of `running` (a list of `RequestView`, read-only) in the order `policy` stops them.
# `"recompute"`: the latest admitted first (highest `admitted`); `"swap"`: the latest arrival
# first (highest `arrived`); `"retract"`: the fewest `generated` first, among equals the longest
# `prompt_len`, and of two that tie exactly the later one in `running`. `running` is not in
# admission order. Hints: `kvlab.check.hint("victim_order", 1)`; `kvlab.solutions.show("victim_order")`.

# %%
def my_victim_order(policy, running):
    """The keys of the running requests, in the order `policy` stops them."""
    # lifted into kvlab.serving.pressure.victim_order
    ### BEGIN SOLUTION
    if policy == "recompute":
        order = sorted(running, key=lambda r: r.admitted, reverse=True)
    elif policy == "swap":
        order = sorted(running, key=lambda r: r.arrived, reverse=True)
    else:
        order = sorted(
            running, key=lambda r: (r.generated, -r.prompt_len), reverse=True
        )[::-1]
    return [r.key for r in order]
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: victim_order
    raise NotImplementedError("rank by admitted, arrived, or (generated, prompt_len)")
    ### END STARTER


kvlab.check.victim_order(my_victim_order);

# %% [markdown]
# **Exercise `next_token_ratio`: the retraction ratio.** Write `my_next_ratio(policy, ratio,
# retracted, remaining)`: SGLang's ratio after one decode step. Not `retracted`: `ratio -
# policy.decay`, never below `policy.min_ratio`. Retracted: `min(1, (sum of r.generated +
# policy.retract_decode_steps * len(remaining)) / sum of r.max_new)` over `remaining` (read-only),
# or `policy.init_ratio` if nobody is left. Read every constant from `policy`: the checker also
# uses others. Hints: `kvlab.check.hint("next_token_ratio", 1)`.

# %%
def my_next_ratio(policy, ratio, retracted, remaining):
    """new_token_ratio after one decode step."""
    # lifted into kvlab.serving.pressure.next_token_ratio
    ### BEGIN SOLUTION
    if not retracted:
        return max(ratio - policy.decay, policy.min_ratio)
    total = sum(r.max_new for r in remaining)
    if not total:
        return policy.init_ratio
    return min(
        1.0,
        (
            sum(r.generated for r in remaining)
            + policy.retract_decode_steps * len(remaining)
        )
        / total,
    )
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: next_token_ratio
    raise NotImplementedError(
        "decay to the minimum; after a retraction, a fresh estimate"
    )
    ### END STARTER


kvlab.check.next_token_ratio(my_next_ratio);

# %% [markdown]
# **Exercise `resume_plan`: what comes back, by pages and slots.** Write `my_resume(how, saved,
# hit, input_len, host_pages, row, page_size) -> (copies, compute)` for a request coming back. It
# had positions `[0, saved)` computed; its input (prompt and answer so far) is `input_len` tokens;
# the prefix cache holds its first `hit`, already in `row` (its new page-table row, one device
# slot per position); `host_pages[i]` holds its positions `[i*P, (i+1)*P)`. `copies`: a
# `(host slot, device slot)` pair per position copied back, in order (a swap copies `[hit, saved)`;
# nothing else copies); `compute`: `(start, end)` for the prefill, from `max(saved, hit)` after a
# swap, from `hit` otherwise, to `input_len`. Host memory is paged like the device: host page `h`
# is host slots `h*P .. h*P + P - 1`, so host page `host_pages[i]` keeps position `i*P + j` in its
# slot `j`. `host_pages` and `row` are read-only; the checker calls your function again with the
# same numbers and other pages, so compute from this call's arguments. Hints:
# `kvlab.check.hint("resume_plan", 1)`.

# %%
def my_resume(how, saved, hit, input_len, host_pages, row, page_size):
    """(copies, compute): what a returning request copies back and what it computes."""
    # lifted into kvlab.serving.pressure.resume_plan (ranges) and
    # kvlab.serving.hf.swap.HostKV.load (slots)
    ### BEGIN SOLUTION
    P = page_size
    if how != "swap":
        return [], (hit, input_len)
    copies = [(host_pages[p // P] * P + p % P, row[p]) for p in range(hit, saved)]
    return copies, (max(saved, hit), input_len)
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: resume_plan
    raise NotImplementedError(
        "copy [hit, saved) host -> row for a swap; compute the rest"
    )
    ### END STARTER


kvlab.check.resume_plan(my_resume);

# %% [markdown]
# **Exercise `swap_out`: a swap-out that frees each page once.** Write `my_swap_out(manager, req,
# pool, host) -> pages`: copy the K/V of `req`'s row, positions `[0, req.cached_len)`
# (`manager.page_table[req.table_idx, :n]` gives their slots), into host pages from
# `host.take(n_pages)`: host page `i` holds positions `[i*P, (i+1)*P)`, so `host.k[page, :, j]`
# is `pool.k[:, slot]` for all layers at once (likewise `v`). Then give the device pages back,
# with `manager.release_req(req)`: it frees the request's own pages and unlocks its cached
# prefix, so nothing else must free them. The device pool is only read: another running request
# may share the cached prefix. The checker hands freed pages to someone else at once, and its
# host pages hold what an earlier swap-out left there, as reused host pages do.
# Hints: `kvlab.check.hint("swap_out", 1)`.

# %%
def my_swap_out(manager, req, pool, host):
    """Copy req's row to host pages, then give its device pages back; return the host
    pages."""
    # lifted into kvlab.serving.hf.swap.HostKV.save and
    # kvlab.serving.pressure.stop_request
    ### BEGIN SOLUTION
    P, n = host.page_size, req.cached_len
    slots = manager.page_table[req.table_idx, :n].long()
    pages = host.take(-(-n // P))
    for i, page in enumerate(pages):
        part = slots[i * P:(i + 1) * P]
        host.k[page, :, :len(part)] = pool.k[:, part]
        host.v[page, :, :len(part)] = pool.v[:, part]
    manager.release_req(req)
    return pages
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: swap_out
    raise NotImplementedError("copy first, then release_req once")
    ### END STARTER


kvlab.check.swap_out(my_swap_out);

# %% [markdown]
# ## Measured, side by side
#
# Four workloads from the simulator's generators (seeded): long-tailed answers ended by EOS, a
# burst of long prompts behind short requests, a shared system prompt, and answers that run
# nearly to their cap; three pools from ample to tight; the four policies. Columns: steps to
# serve everything, new tokens per step, requests running at once, pages promised but unmapped,
# requests stopped (preempted, retracted or swapped), positions computed again, positions copied
# to host memory, and time to first token and per output token, in steps
# ([TTFT and TPOT](glossary.md#ttft-and-tpot); p50 / p99 over the requests). The medium and tight
# runs are those of the check above; the ample ones take a few seconds more.

# %% alt="Bars of new tokens per step (top) and requests running at once (bottom) for the four policies on four workloads in ample, medium and tight pools: equal with ample memory, recompute and swap ahead of reserve and retract in tight memory."
rows = compared_rows()
print(policy_table(rows))
policy_compare_figure(rows)
plt.show()

# %% [markdown]
# What the numbers say (the cell below computes each claim from the rows):

# %%
by = {(r["workload"], r["pool"], r["policy"]): r for r in rows}
eos = {p: by[("eos_long_tail", "tight", p)] for p in POLICIES}
gain = eos["recompute"]["tokens_per_step"] / eos["reserve"]["tokens_per_step"]
print(
    f"EOS-heavy answers, tight memory: recompute serves {gain:.2f}x the tokens per step"
    " of reserve\n  and runs"
    f" {eos['recompute']['mean_running'] / eos['reserve']['mean_running']:.2f}x the"
    f" requests at once, for {eos['recompute']['recomputed_tokens']} positions"
    f" recomputed;\n  retract promises {eos['retract']['unused_pages']:.1f} unused"
    f" pages per step, reserve {eos['reserve']['unused_pages']:.1f}"
)
burst_tight = {p: by[("long_prompt_burst", "tight", p)] for p in POLICIES}
print(
    "burst of long prompts, tight memory: recompute computes"
    f" {burst_tight['recompute']['recomputed_tokens']} positions again,\n  swap copies"
    f" {burst_tight['swap']['swapped_tokens']} and computes"
    f" {burst_tight['swap']['recomputed_tokens']}"
)
long = {p: by[("long_answers", "tight", p)] for p in POLICIES}
print(
    f"long answers, tight memory: retract stops {long['retract']['stops']} request(s)"
    f" and computes {long['retract']['recomputed_tokens']} positions again;\n  "
    + ", ".join(f"{p} {long[p]['tokens_per_step']:.2f}" for p in POLICIES)
    + " tokens per step"
)
assert (
    gain > 1 and eos["recompute"]["mean_running"] > eos["reserve"]["mean_running"]
), "recompute wins here"
assert (
    eos["reserve"]["unused_pages"]
    > eos["retract"]["unused_pages"]
    > 0
    == eos["recompute"]["unused_pages"]
), "promises: whole answers > estimates > none"
assert (
    eos["reserve"]["tokens_per_step"]
    < eos["retract"]["tokens_per_step"]
    < eos["recompute"]["tokens_per_step"]
), "on the simulator, retract sits between reserve and recompute here"
assert all(
    r["stops"] == 0 for r in rows if r["policy"] == "reserve"
), "reserve stopped a request"
assert (
    burst_tight["swap"]["recomputed_tokens"]
    < burst_tight["recompute"]["recomputed_tokens"]
), "swap copies what recompute computes again"
assert all(
    r["stops"] == 0 and r["steps"] == by[(r["workload"], "ample", "reserve")]["steps"]
    for r in rows
    if r["pool"] == "ample"
), "with ample memory the policies differ"
assert (
    long["retract"]["stops"] > 0 and long["retract"]["recomputed_tokens"] > 0
), "long answers retract"
assert all(
    long[p]["stops"] > long["retract"]["stops"]
    and long[p]["tokens_per_step"] > long["retract"]["tokens_per_step"]
    for p in ("recompute", "swap")
), "recompute and swap stop more, and serve more per step"
assert all(
    r["stops"] == 0
    for r in rows
    if r["policy"] == "retract" and r["workload"] != "long_answers"
), "retract stops nobody where its estimate holds"

# %% [markdown]
# On the simulator:
#
# * **Ample memory**: the policies are the same run. None stops a request, and the promises cost
#   nothing, since nobody waits for the memory they hold.
# * **EOS-heavy answers in tight memory**: reserving whole answers holds back most of the memory
#   for tokens that are never generated; admitting on the coming step runs more requests at once
#   and finishes in fewer steps, at the price of the recomputed positions above. SGLang's estimate
#   sits in between here: it promises less than whole answers, and it never had to retract.
# * **A burst of long prompts**: a preempted long prompt is expensive to compute again, and there
#   the swap policy copies instead. Which is faster in time depends on the machine: a copy over
#   PCIe against a prefill on the GPU. The simulator counts steps, not seconds.
# * **Long answers**: the only workload where retract stops anyone. Its estimate was too low, and
#   every retraction computes positions again; recompute and swap stop far more requests here, and
#   still serve more tokens per step, because they never hold memory back for a promise.
#
# The same policies on a real model, timed on a GPU (`python -m kvlab.bench --memory`, the same
# workload generators at a larger size, written to `figures/bench.json` and `figures/bench.md`).
# Where retract lands against reserve and recompute there is read from the recorded rows by
# `where_retract_sits`, not written here: in time, a step of many short prefills and a retraction's
# recomputation cost what they cost on that machine.

# %%
import textwrap

bench = bench_rows()
if bench is None:
    print(
        "figures/bench.json holds no GPU run of `python -m kvlab.bench --memory` yet:"
        " these rows are absent."
    )
else:
    print(f"{bench['meta']['device']}, {bench['meta']['date']}")
    for c in bench["claims"]:
        verdict = "n/a" if c["passed"] is None else ("PASS" if c["passed"] else "FAIL")
        print(
            textwrap.fill(
                f"[{verdict}] {c['name']}: {c['measured']}",
                88,
                subsequent_indent="    ",
            )
        )
    print(
        f"\n{'tight memory':20s} {'policy':9s} {'tok/s':>6s} {'running':>7s}"
        f" {'stops':>5s} {'recomputed':>10s} {'swapped':>9s}"
    )
    for r in bench["rows"]:
        if r["pool"] == "tight" and "error" not in r:
            print(
                f"{r['workload']:20s} {r['policy']:9s} {r['tokens_per_s']:6.0f}"
                f" {r['mean_running']:7.1f} {r['stops']:5d}"
                f" {r['recomputed_tokens']:10d}"
                f" {r['swapped_out_bytes'] / 2**20:5.1f} MiB"
            )
    print()
    for name in CHAPTER_WORKLOADS:
        print(
            textwrap.fill(where_retract_sits(bench, name), 88, subsequent_indent="    ")
        )
    print(textwrap.fill(retraction_cost(bench), 88, subsequent_indent="    "))

# %% [markdown]
# ## Lift: your functions vs kvlab
#
# Your four answers against the ones [lifted](glossary.md#lift) into `kvlab.serving.pressure` on random
# inputs (until an exercise passes, this cell uses the reference solution and says so):

# %%
order_fn = kvlab.check.choose(
    "victim_order", my_victim_order, kvlab.solutions.get("victim_order")
)
ratio_fn = kvlab.check.choose(
    "next_token_ratio", my_next_ratio, kvlab.solutions.get("next_token_ratio")
)
resume_fn = kvlab.check.choose(
    "resume_plan", my_resume, kvlab.solutions.get("resume_plan")
)

rng = random.Random(12)
policy = RetractDecode()
ratio = policy.init_ratio
for _ in range(200):
    n_running = rng.randint(1, 6)
    admitted, arrived = rng.sample(range(100), n_running), rng.sample(
        range(100), n_running
    )  # each once
    views = [
        RequestView(
            k,
            rng.randint(1, 30),
            rng.randint(0, 9),
            rng.choice([16, 64]),
            0,
            0,
            admitted[k],
            arrived[k],
        )
        for k in range(n_running)
    ]
    for name in ("recompute", "retract", "swap"):
        assert list(order_fn(name, views)) == victim_order(name, views), (
            f"{name}: yours {list(order_fn(name, views))}, kvlab's"
            f" {victim_order(name, views)}"
        )
    retracted = rng.random() < 0.1
    mine = ratio_fn(policy, ratio, retracted, views)
    ratio = next_token_ratio(policy, ratio, retracted=retracted, remaining=views)
    assert (
        abs(float(mine) - ratio) < 1e-12
    ), f"ratio: yours {float(mine)}, kvlab's {ratio}"
    n, Pg = rng.randint(2, 40), rng.choice([1, 4, 16])
    saved, hit = rng.randint(1, n - 1), rng.randint(0, (n - 1) // Pg) * Pg
    plan = resume_plan("swap", saved=saved, hit=hit, input_len=n)
    row, host = list(range(100, 100 + n)), list(range(-(-saved // Pg)))
    # any pairs the checker takes
    copies, compute = resume_fn("swap", saved, hit, n, host, row, Pg)
    assert (
        tuple(compute) == plan.compute
        and [p for _, p in copies] == row[plan.copy[0] : plan.copy[1]]
    ), (
        f"saved {saved}, hit {hit}, page size {Pg}: compute {tuple(compute)} vs"
        f" {plan.compute}, copies {list(copies)}"
    )
print(
    "victim_order, next_token_ratio and resume_plan agree with kvlab.serving.pressure"
)

# %% [markdown]
# ## Summary
#
# * Memory runs out in the middle of decoding because an answer's length is unknown until it
#   ends. A policy decides what admission promises and whom to stop when a step does not fit.
# * **reserve** (mini-sglang) promises every whole answer: never stops anyone, wastes what EOS
#   leaves unused, runs fewer requests at once.
# * **recompute** (vLLM v1) promises the coming step: stops the latest admitted, keeps its whole
#   pages findable, re-prefills it first, admits nobody in that step.
# * **retract** (SGLang) promises `new_token_ratio` x the rest: 0.7 at first, down by
#   (0.7 - 0.098) / 600 each decode step, reset after a retraction of the fewest-outputs requests.
# * **swap** (vLLM v0) copies the latest arrival's row to pinned host memory and back into new
#   pages, copying only what the cache no longer holds.
# * Measured on the same workloads: with ample memory they are one policy; with long-tailed EOS
#   answers and tight memory, promising less runs more at once; recompute pays in computation,
#   swap in copies; where answers outrun SGLang's estimate, retract retracts and pays in
#   computation too. On a GPU the order in tokens/s is the recorded run's, read from
#   `figures/bench.json`.
# * In `kvlab.serving.pressure` (the policies, `victim_order`, `next_token_ratio`, `resume_plan`,
#   `stop_request`, `restore_request`), `kvlab.serving.sim` (`SimConfig(policy=...)`, `kvlab.serving.sim.compare`),
#   `kvlab.serving.hf` (`PagedGenerator(policy=...)`, `kvlab.serving.hf.room`, `kvlab.serving.hf.swap`) and
#   `python -m kvlab.bench --memory`.
#
# ## Questions
#
# 1. SGLang's ratio decays over 600 decode steps. What goes wrong with a much faster decay, and
#    with a much slower one? Try both on the burst workload.
# 2. When is swapping cheaper than recomputing? Estimate the bytes a request of `n` tokens moves
#    for a model of `L` layers and `H` K/V heads of dimension `d` in bfloat16, against the
#    prefill work it saves.

# %% [markdown] tags=["solution"]
# ### Discussion
#
# **1. The decay.** Fast decay lowers the estimate quickly: more requests are admitted, memory
# runs short more often, and each retraction throws away work (the ratio then jumps back). Slow
# decay stays near 0.7 and behaves more like reserving: few retractions, more memory idle. The
# cell below counts retractions and steps for several decay lengths.

# %% tags=["solution"]
for steps in (5, 20, 100, 600):
    tl = policy_run(RetractDecode(decay_steps=steps), "long_prompt_burst", "tight")
    s = tl.summary()
    print(
        f"decay over {steps:3d} steps: {s.steps} steps, {s.preemptions} retractions,"
        f" {s.recomputed_tokens} recomputed"
    )

# %% [markdown] tags=["solution"]
# **2. Swap or recompute.** Swapping `n` tokens moves `2 * L * H * d * 2` bytes per token each way
# (K and V, bfloat16): for a 0.5B-shaped model (24 layers, 2 K/V heads of 64) that is 12 KiB per
# token, 12 MiB for a 1000-token row, at the speed of the link between host and GPU (from pinned
# memory the copy need not stop the GPU). Recomputing is a prefill of `n` tokens, whose work grows
# with the row (attention with its square) and with the model's size, while the bytes grow only
# with the row. So the longer the row and the larger the model per K/V byte, the better swapping
# looks; a prefix cache hit beats both. Which wins on a given machine is measured, not guessed:
# `python -m kvlab.bench --memory` times both on the same burst of long prompts.
