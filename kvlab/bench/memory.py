"""When KV memory runs out, measured on a real model (chapter 12): ``python -m kvlab.bench --memory``.

The four policies of :mod:`kvlab.serving.pressure` serve the same seeded workloads with the same model
through :class:`kvlab.serving.hf.PagedGenerator`, in pools from ample to tight, one after another in
one process. The workloads are the simulator's (:mod:`kvlab.serving.sim.workloads`, the chapter runs
them too), served offline (every request arrives at once):

    eos_long_tail        answers that mostly end early, a few run to max_new_tokens
    long_prompt_burst    short requests and a burst of long prompts
    shared_system_prompt one system prompt, many questions
    long_answers         answers that run nearly to max_new_tokens: longer than SGLang's
                         estimate (new_token_ratio x what is left) expects, so retract retracts

A random-weight model never produces its end-of-text token, so each answer ends where the
workload's does (``generate(..., end_after=...)``); the scheduler knows only
``max_new_tokens``, as a server does. Pools, in pages, per workload: ``ample`` holds every
request's whole answer at once; ``medium`` and ``tight`` are 40% and 15% of that (never less
than the longest request alone). Decode steps replay CUDA graphs, without ``torch.compile``
(``compile_decode=False``), the same for every policy. Per run: tokens/s (new tokens over the wall time of the call,
synchronised), requests running at once (mean and most), pages promised but unmapped (mean per
step), positions recomputed, bytes copied to host memory, stops (preemptions, retractions,
swaps), and time to first token / per output token (p50, p99; every request arrives at 0).

The model: a random Llama shaped like a 0.5B model (24 layers, hidden 896, 14 query heads on 2
K/V heads, vocabulary 151936) in bfloat16 on a GPU; ``smoke``: chapter 10's tiny model and
tiny workloads in float32 with pages of 4, the same code path, no claims. Runs that would
start after :data:`BUDGET_S` seconds are skipped, so the whole run stays within about four
minutes; a claim whose rows are missing is undecided. ``long_answers`` runs only in the pools of
:data:`WORKLOAD_POOLS` (the tightest one in a smoke run).
"""
from __future__ import annotations

import gc
import time

import torch

#: a Llama of Qwen2.5-0.5B's shape (random weights: the benchmark measures memory, not text)
MODEL = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096)
PAGE_SIZE = 16
POLICY_NAMES = ("reserve", "recompute", "retract", "swap")
#: pool sizes as a share of "every whole answer at once" (never below the longest request):
#: kvlab.serving.sim.compare.MEMORY_POOLS, which the chapter's simulator runs use too
POOLS = {"ample": 1.0, "medium": 0.4, "tight": 0.15}
#: the workloads (arguments of kvlab.serving.sim.make_workload) and max_new_tokens of each
WORKLOADS = {
    "eos_long_tail": dict(n_requests=64, prompt_len=(32, 128), max_new_tokens=256, tail=1.5, typical=16),
    "long_prompt_burst": dict(n_short=16, n_long=16, prompt_len=(384, 768), output_len=(32, 96)),
    "shared_system_prompt": dict(n_requests=48, system_len=512, user_len=(16, 64), output_len=(32, 96)),
    "long_answers": dict(n_requests=64, prompt_len=(16, 64), max_new_tokens=96, at_least=0.9),
}
SMOKE_WORKLOADS = {
    "eos_long_tail": dict(n_requests=5, prompt_len=(4, 10), max_new_tokens=8, tail=1.5, typical=2),
    "long_prompt_burst": dict(n_short=2, n_long=2, prompt_len=(16, 24), output_len=(2, 5)),
    "shared_system_prompt": dict(n_requests=4, system_len=12, user_len=(2, 4), output_len=(2, 5)),
    "long_answers": dict(n_requests=16, prompt_len=(2, 4), max_new_tokens=12, at_least=0.9),
}
SMOKE_POOLS = {"ample": 1.0, "tight": 0.3}
#: the pools a workload runs in, where not all: with ample memory long answers stop nobody
WORKLOAD_POOLS = {"long_answers": ("medium", "tight")}
#: seconds after which the remaining runs are skipped (and say so): the run stays within 4 minutes
BUDGET_S = 210.0
SMOKE_PAGE_SIZE = 4


def memory_model(device, smoke: bool, max_positions: int | None = None):
    """The model (seeded random weights, no end-of-text token); ``max_positions`` widens its
    position range (chapter 13's chats run to 16k tokens)."""
    from ..serving.hf.models import tiny_model
    from ..serving.hf.plugin import require_transformers
    from .serve import random_bf16_model, without_end_of_text

    if smoke:
        return without_end_of_text(tiny_model("llama", seed=0, device=device, max_positions=4096))
    transformers = require_transformers()
    shape = dict(MODEL, **({"max_position_embeddings": max_positions} if max_positions else {}))
    config = transformers.LlamaConfig(**shape, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None, tie_word_embeddings=False)
    return without_end_of_text(random_bf16_model(transformers.LlamaForCausalLM, config, device))


def memory_workload(name: str, smoke: bool, vocab: int, seed: int = 0):
    """``(workload, prompts, end_after, max_new_tokens)`` of the simulator's workload ``name``
    (its token ids spread over the model's vocabulary; its answer lengths become ``end_after``)."""
    from ..serving.sim import make_workload

    w = make_workload(name, seed=seed, **(SMOKE_WORKLOADS if smoke else WORKLOADS)[name])
    spread = lambda ids: [(t * 7919 + 13) % vocab for t in ids]  # noqa: E731 - the same ids, anywhere
    prompts = [spread(r.prompt) for r in w.requests]
    ends = [len(r.output) for r in w.requests]
    max_new = max(r.max_new_tokens or len(r.output) for r in w.requests)
    return w, prompts, ends, max_new


def percentile(values, q: float) -> float | None:
    from ..serving.sim.timeline import percentile as nearest_rank

    return nearest_rank(values, q) if values else None


def _timed_run(gen, prompts, ends, max_new, device) -> dict:
    """One generate call: wall time, step end times (for TTFT/TPOT), the generator's counts."""
    marks: list[float] = []

    def on_step(info):
        marks.append(time.perf_counter())

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    gen.clear_prefix_cache()                     # every run starts cold
    start = time.perf_counter()
    out = gen.generate(prompts, max_new_tokens=max_new, end_after=ends, on_step=on_step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    st, reqs = gen.stats, gen.requests
    ttft = [marks[r.token_steps[0]] - start for r in reqs if r.token_steps]
    tpot = [(marks[r.token_steps[-1]] - marks[r.token_steps[0]]) / (len(r.token_steps) - 1)
            for r in reqs if len(r.token_steps) > 1]
    tokens = sum(map(len, out))
    steps = max(st["steps"], 1)
    return dict(
        seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, steps=st["steps"],
        mean_running=st["running_sum"] / steps, most_running=st["most_running"],
        unused_pages=st["reserved_unused"] / steps, recomputed_tokens=st["recomputed_tokens"],
        swapped_out_bytes=st["swapped_out_bytes"], swapped_in_bytes=st["swapped_in_bytes"],
        preemptions=st["preemptions"], retractions=st["retractions"], swaps=st["swaps_out"],
        stops=st["preemptions"] + st["retractions"] + st["swaps_out"],
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99),
        outputs=[o[:4] for o in out])


def run_memory(smoke: bool = False, log=print, budget_s: float | None = None) -> dict:
    """Every policy on every workload and pool; returns the rows and the claims' verdicts.
    Runs that would start after ``budget_s`` (default :data:`BUDGET_S` on a GPU, none in a
    smoke run) are skipped, each row saying so."""
    from ..base import runtime
    from ..serving.hf import PagedGenerator
    from ..serving.sim.compare import memory_pools

    device = runtime.DEVICE
    start = time.perf_counter()
    budget = budget_s if budget_s is not None else (None if smoke else BUDGET_S)
    model = memory_model(device, smoke)
    vocab = model.config.vocab_size
    pools = SMOKE_POOLS if smoke else POOLS
    P = SMOKE_PAGE_SIZE if smoke else PAGE_SIZE
    res = dict(smoke=smoke, page_size=P, pools=dict(pools), workload_pools=dict(WORKLOAD_POOLS), rows=[], errors=[],
               model=dict({"tiny": True} if smoke else MODEL, dtype=str(model.dtype).replace("torch.", "")),
               workloads={})
    graph_sizes = [1, 2, 4, 8, 16, 32, 48]
    for name in (SMOKE_WORKLOADS if smoke else WORKLOADS):
        workload, prompts, ends, max_new = memory_workload(name, smoke, vocab)
        # the generator is told one max_new_tokens: every request's cap is the workload's largest
        workload = type(workload)(workload.name, "", tuple(
            type(r)(r.rid, r.prompt, r.output, 0, max_new_tokens=max_new) for r in workload.requests))
        only = WORKLOAD_POOLS.get(name)
        pool_pages = {pool: pages for pool, pages in memory_pools(workload, P, pools).items()
                      if only is None or pool in only or (smoke and pool == list(pools)[-1])}
        res["workloads"][name] = dict(requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                                      new_tokens=sum(ends), max_new_tokens=max_new,
                                      args=(SMOKE_WORKLOADS if smoke else WORKLOADS)[name])
        for pool, pages in pool_pages.items():
            for policy in POLICY_NAMES:
                row = dict(workload=name, pool=pool, pages=pages, policy=policy)
                if budget is not None and time.perf_counter() - start > budget:
                    row["error"] = f"skipped: the {budget:.0f} s budget was spent"
                    res["rows"].append(row)
                    log(_line(row))
                    continue
                try:
                    gen = PagedGenerator(model, page_size=P, num_pages=pages, max_running=48,
                                         prefill_budget=2048, policy=policy, compile_decode=False,
                                         graph_sizes=None if smoke else graph_sizes)
                    gen.generate(prompts[:2], max_new_tokens=2)          # warm up this generator
                    row.update(_timed_run(gen, prompts, ends, max_new, device))
                except Exception as e:  # noqa: BLE001 - a failed run is reported, the others go on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    res["errors"].append(row["error"])
                gen = None                                   # its pool, graphs and host pool go now
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                res["rows"].append(row)
                log(_line(row))
    res["claims"] = claims(res)
    return res


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['workload']:20s} {row['pool']:6s} {row['policy']:9s} {row['error']}"
    return (f"{row['workload']:20s} {row['pool']:6s} {row['pages']:5d}p {row['policy']:9s} "
            f"{row['tokens_per_s']:8.0f} tok/s  running {row['mean_running']:5.1f}  unused "
            f"{row['unused_pages']:6.1f}p  stops {row['stops']:3d}  recomputed {row['recomputed_tokens']:6d}"
            f"  swapped {row['swapped_out_bytes'] / 2**20:7.1f} MiB")


def _row(res, workload, pool, policy) -> dict | None:
    for r in res["rows"]:
        if (r["workload"], r["pool"], r["policy"]) == (workload, pool, policy) and "error" not in r:
            return r
    return None


def _claim(name: str, rule: str, measured, passed, smoke: bool) -> dict:
    """``passed`` is judged by the caller on the unrounded numbers; ``measured`` is shown to 3
    decimals (rounding first would let 0.8996 pass a >= 0.9 rule)."""
    if isinstance(measured, float):
        measured = round(measured, 3)
    return dict(name=name, rule=rule, measured=measured,
                passed=None if smoke or passed is None else bool(passed))


def claims(res: dict) -> list[dict]:
    """Where each policy wins, judged from the measured rows (``passed=None`` in a smoke run or
    when a run it needs failed)."""
    smoke, tight, out = res["smoke"], "tight", []

    def ratio(workload, pool, a, b, key):
        x, y = _row(res, workload, pool, a), _row(res, workload, pool, b)
        if x is None or y is None or not y[key]:
            return None
        return x[key] / y[key]

    r = ratio("eos_long_tail", tight, "recompute", "reserve", "mean_running")
    out.append(_claim("EOS-heavy answers, tight memory: recompute runs more requests at once than reserve",
                      "mean running ratio recompute / reserve > 1", r, None if r is None else r > 1, smoke))
    r = ratio("eos_long_tail", tight, "recompute", "reserve", "tokens_per_s")
    out.append(_claim("EOS-heavy answers, tight memory: recompute serves more tokens/s than reserve",
                      "tokens/s ratio recompute / reserve > 1", r, None if r is None else r > 1, smoke))
    rec = _row(res, "eos_long_tail", tight, "recompute")
    out.append(_claim("... at a recompute cost: positions recomputed by recompute (eos_long_tail, tight)",
                      "reported (> 0 means preemptions happened)", None if rec is None else rec["recomputed_tokens"],
                      None if rec is None else rec["recomputed_tokens"] > 0, smoke))
    r = ratio("eos_long_tail", tight, "retract", "reserve", "unused_pages")
    out.append(_claim("EOS-heavy answers, tight memory: retract leaves fewer promised pages unused than reserve",
                      "unused pages ratio retract / reserve < 1", r, None if r is None else r < 1, smoke))
    sw, rc = _row(res, "long_prompt_burst", tight, "swap"), _row(res, "long_prompt_burst", tight, "recompute")
    ok = None if sw is None or rc is None else sw["recomputed_tokens"] < rc["recomputed_tokens"]
    out.append(_claim("Long-prompt burst, tight memory: swap recomputes fewer positions than recompute",
                      "recomputed positions swap < recompute",
                      None if ok is None else [sw["recomputed_tokens"], rc["recomputed_tokens"]], ok, smoke))
    r = ratio("long_prompt_burst", tight, "swap", "recompute", "tokens_per_s")
    out.append(_claim("Long-prompt burst, tight memory: swap serves more tokens/s than recompute",
                      "tokens/s ratio swap / recompute > 1", r, None if r is None else r > 1, smoke))
    stops = [x["stops"] for x in res["rows"] if x["policy"] == "reserve" and "error" not in x]
    ret, res_, rec_ = (_row(res, "long_answers", tight, p) for p in ("retract", "reserve", "recompute"))
    out.append(_claim("Answers longer than SGLang's estimate, tight memory: retract runs short and retracts",
                      "retractions > 0 (long_answers, tight, retract)", None if ret is None else ret["retractions"],
                      None if ret is None else ret["retractions"] > 0, smoke))
    cost = None
    if ret is not None and res_ is not None and rec_ is not None:
        cost = [ret["recomputed_tokens"], round(ret["tokens_per_s"] / res_["tokens_per_s"], 3),
                round(ret["tokens_per_s"] / rec_["tokens_per_s"], 3)]
    out.append(_claim("... at a cost: positions retract recomputes, and its tokens/s against reserve and recompute "
                      "(long_answers, tight)", "reported: [recomputed positions, tokens/s ratio retract / reserve, "
                      "retract / recompute]", cost, None if cost is None else cost[0] > 0, smoke))
    out.append(_claim("reserve never stops a request, in any pool", "stops == 0 in every reserve run",
                      sum(stops) if stops else None, sum(stops) == 0 if stops else None, smoke))
    ample = [x for x in res["rows"] if x["pool"] == "ample" and "error" not in x]
    spread = None
    if ample:
        worst = {}
        for x in ample:
            base = _row(res, x["workload"], "ample", "reserve")
            if base is not None:
                worst[x["workload"]] = min(worst.get(x["workload"], 9), x["tokens_per_s"] / base["tokens_per_s"])
        spread = min(worst.values()) if worst else None
    out.append(_claim("Ample memory: no policy stops a request, and none is more than 10% slower than reserve",
                      "no stops; lowest tokens/s ratio to reserve >= 0.9", spread,
                      None if spread is None else spread >= 0.9 and all(x["stops"] == 0 for x in ample), smoke))
    return out
