"""The KV hierarchy measured on a real model (chapter 13): ``python -m kvlab.bench --hierarchy``.

Seeded multi-turn chats (:mod:`kvlab.serving.sim.conversations`: histories of 1-16k tokens, each
conversation back after all the others had a turn) served by :class:`kvlab.serving.hf.PagedGenerator`
round after round, a few conversations per ``generate`` call, every answer the model's own (its
length the plan's: ``end_after``). The device pool is a quarter of the working set (every
history at once), so without a lower tier a returning conversation has been evicted. Configurations,
one after another in one process:

    unbounded            GPU only, a pool that holds the whole working set (the ceiling)
    GPU only             the quarter pool
    + host <policy>      the quarter pool over a host tier that holds the working set, for each
                         write policy (write_through, write_through_selective, write_back)
    + host + disk        the quarter pool, a host tier of twice the pool, and a disk store
    second process, warm the last round again in a fresh process on that disk (persisted)
    second process, cold the same in a fresh process on an empty disk

Per configuration: prefix hit rate by tier (device, host, disk: shares of the prompt tokens),
prompt tokens computed, bytes copied each way, the load-back's bandwidth (bytes over the
CUDA-event time of the host-to-device transfers) against the pinned bandwidth measured in the same
run, TTFT and TPOT (p50, p99; every request of a call arrives at its start), tokens/s. And the
write-through's cost to a decode step: the same online workload with and without its copies.

The model: a random Llama shaped like a 0.5B model (:data:`kvlab.bench.memory.MODEL`) in bfloat16
on a GPU; ``smoke``: chapter 10's tiny model, a tiny plan, pages of 4, no claims.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

PAGE_SIZE = 16
PLAN = dict(conversations=12, turns=7, first=(1024, 3072), question=(256, 1536), answer=(32, 64),
            history_cap=16384, vocab=151936, seed=0)
SMOKE_PLAN = dict(conversations=4, turns=3, first=(6, 12), question=(2, 6), answer=(2, 4),
                  history_cap=64, vocab=128, seed=0)
CONCURRENCY = 4          # conversations per generate call
POLICIES = ("write_through", "write_through_selective", "write_back")
BUDGET_S = 360.0      # configurations that would start later are skipped (the run fits 10 minutes)


def _plan(smoke: bool):
    from ..serving.sim.conversations import ChatPlan, chat_turns, working_set

    plan = ChatPlan(**(SMOKE_PLAN if smoke else PLAN))
    turns = chat_turns(plan)
    return plan, turns, working_set(turns)


def pinned_bandwidth(device, nbytes: int = 64 << 20) -> dict:
    """GB/s of one pinned block each way (the best of five), where the load-backs run."""
    if device.type != "cuda":
        return dict(h2d_gbps=None, d2h_gbps=None, bytes=nbytes)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d_gbps", dev, host), ("d2h_gbps", host, dev)):
        best = 0.0
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        out[name] = best
    return dict(out, bytes=nbytes)


def replay(gen, turns, *, concurrency: int = CONCURRENCY, histories=None, vocab: int = 151936) -> dict:
    """Serve ``turns`` round by round, ``concurrency`` conversations per call; the counts and times."""
    from .memory import percentile

    histories = {} if histories is None else histories
    rounds: dict[int, list] = {}
    for t in turns:
        rounds.setdefault(t.index, []).append(t)
    counts = dict(prompt=0, computed=0, cached=0, host=0, disk=0, generated=0)
    ttft, tpot, seconds = [], [], 0.0
    last_prompts = []
    for index in sorted(rounds):
        batch_turns = rounds[index]
        for i in range(0, len(batch_turns), concurrency):
            group = batch_turns[i:i + concurrency]
            prompts = [histories.get(t.conversation, []) + [x % vocab for x in t.message] for t in group]
            ends = [t.answer_len for t in group]
            sync(gen)
            start = time.perf_counter()
            answers = gen.generate(prompts, max_new_tokens=max(ends), end_after=ends)
            sync(gen)
            seconds += time.perf_counter() - start
            st = gen.stats
            counts["prompt"] += sum(map(len, prompts))
            counts["computed"] += st["prefill_computed"]
            counts["cached"] += st["prefill_cached"]
            counts["host"] += st.get("prefill_loaded_host", 0)
            counts["disk"] += st.get("prefill_loaded_disk", 0)
            counts["generated"] += sum(map(len, answers))
            for r in gen.requests:
                ttft.append(r.ttft)
                if len(r.times) > 1:
                    tpot.append((r.times[-1] - r.times[0]) / (len(r.times) - 1))
            for t, p, a in zip(group, prompts, answers):
                histories[t.conversation] = p + a
            if index == max(rounds):
                last_prompts += prompts
    prompt = max(counts["prompt"], 1)
    device_hits = counts["cached"] - counts["host"] - counts["disk"]
    out = dict(prompt_tokens=counts["prompt"], computed=counts["computed"], generated=counts["generated"],
               hit=counts["cached"] / prompt, device_hit=device_hits / prompt, host_hit=counts["host"] / prompt,
               disk_hit=counts["disk"] / prompt, seconds=seconds, tokens_per_s=counts["generated"] / seconds,
               ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
               tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99))
    out.update(_copies(gen))
    return out, histories, last_prompts


def _copies(gen) -> dict:
    tiers = getattr(gen, "hierarchy", None)
    if tiers is None:
        return dict(h2d_bytes=0, d2h_bytes=0, load_gbps=None, save_gbps=None)
    st = tiers.copies.collect()
    gbps = st["h2d_timed_bytes"] / st["h2d_seconds"] / 1e9 if st["h2d_seconds"] else None
    save = st["d2h_timed_bytes"] / st["d2h_seconds"] / 1e9 if st["d2h_seconds"] else None
    out = dict(h2d_bytes=st["h2d_bytes"], d2h_bytes=st["d2h_bytes"], load_gbps=gbps, save_gbps=save)
    if tiers.disk is not None:
        out["disk"] = dict(tiers.disk.stats, rejected_by_reason=dict(tiers.disk.rejected))
    return out


def sync(gen) -> None:
    if gen.page_table.device.type == "cuda":
        torch.cuda.synchronize(gen.page_table.device)


def make_generator(model, pages: int, smoke: bool, **tiers):
    from ..serving.hf import PagedGenerator

    P = 4 if smoke else PAGE_SIZE
    gen = PagedGenerator(model, page_size=P, num_pages=pages, max_running=CONCURRENCY,
                         prefill_budget=64 if smoke else 8192, compile_decode=False,
                         graph_sizes=None if smoke else [1, 2, 4], **tiers)
    gen.generate([[1, 2, 3]], max_new_tokens=2)          # warm up this generator
    gen.clear_prefix_cache()
    return gen


def _positions(plan, smoke: bool) -> int | None:
    """The model's positions: a whole history and its answer (the 0.5B shape has only 4096)."""
    return None if smoke else plan.history_cap + 4096


def run_hierarchy(smoke: bool = False, log=print, budget_s: float | None = None) -> dict:
    """Every configuration; the rows and the claims' verdicts (see the module docstring)."""
    from .. import runtime
    from ..serving.hf import DiskCache, HostCache
    from .hierarchy_claims import claims, decode_slowdown
    from .memory import memory_model

    device = runtime.DEVICE
    t0 = time.perf_counter()
    budget = budget_s if budget_s is not None else (None if smoke else BUDGET_S)
    plan, turns, ws = _plan(smoke)
    # a history plus its answer must fit the model's positions (the 0.5B shape has 4096)
    model = memory_model(device, smoke, max_positions=_positions(plan, smoke))
    P = 4 if smoke else PAGE_SIZE
    ws_pages = -(-ws // P)
    device_pages = max(ws_pages // 4, -(-plan.history_cap // P) + 4)
    res = dict(smoke=smoke, page_size=P, plan=dict(SMOKE_PLAN if smoke else PLAN), turns=len(turns),
               working_set_tokens=ws, device_pages=device_pages, working_set_ratio=ws_pages / device_pages,
               pinned=pinned_bandwidth(device), rows=[], errors=[],
               model=dict({"tiny": True} if smoke else __import__("kvlab.bench.memory", fromlist=["MODEL"]).MODEL,
                          dtype=str(model.dtype).replace("torch.", "")))
    disk_dir = tempfile.mkdtemp(prefix="kvlab-bench-disk-")
    configs = [("unbounded", dict(pages=ws_pages + device_pages)), ("GPU only", dict(pages=device_pages))]
    configs += [(f"+ host {p}", dict(pages=device_pages, host_cache=HostCache(ws_pages + device_pages, p)))
                for p in POLICIES]
    configs.append(("+ host + disk", dict(pages=device_pages, host_cache=HostCache(2 * device_pages, "write_back"),
                                          disk_cache=DiskCache(disk_dir, pages=4 * ws_pages))))
    last_prompts = None
    for name, cfg in configs:
        row = dict(config=name, device_pages=cfg["pages"])
        if budget is not None and time.perf_counter() - t0 > budget:
            row["error"] = f"skipped: the {budget:.0f} s budget was spent"
        else:
            try:
                gen = make_generator(model, cfg.pop("pages"), smoke, **cfg)
                stats, histories, last = replay(gen, turns, vocab=model.config.vocab_size)
                row.update(stats)
                if name == "+ host write_through" and not smoke:
                    res["timeline"] = recorded_timeline(gen, histories, model.config.vocab_size)
                if "disk_cache" in cfg:
                    row["persisted_pages"] = gen.persist_prefix_cache()
                    last_prompts = last
            except Exception as e:  # noqa: BLE001 - a failed configuration is reported, the others go on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                res["errors"].append(row["error"])
            gen = None
            _free(device)
        res["rows"].append(row)
        log(_line(row))
    if last_prompts is not None:
        for name, directory in (("second process, warm disk", disk_dir),
                                ("second process, cold disk", tempfile.mkdtemp(prefix="kvlab-bench-cold-"))):
            row = dict(config=name, device_pages=device_pages, **second_process(directory, last_prompts, smoke,
                                                                                 device_pages))
            res["rows"].append(row)
            log(_line(row))
    res["decode"] = decode_slowdown(model, smoke, make_generator, log=log)
    res["claims"] = claims(res)
    return res


def recorded_timeline(gen, histories: dict, vocab: int, n: int = 4, gap_s: float = 0.03) -> dict:
    """One call recorded on the GPU: ``n`` conversations come back ``gap_s`` apart, each loading
    its history back while the earlier ones decode. The steps (device spans, as
    :class:`~kvlab.serving.hf.StepTimes`) and every transfer of the copies, in seconds since the
    call began."""
    import random

    rng = random.Random(1)
    convs = sorted(histories)[:n]
    prompts = [histories[c] + [rng.randrange(vocab) for _ in range(64)] for c in convs]
    copies = gen.hierarchy.copies
    copies.record = []
    gen.generate(prompts, max_new_tokens=32, arrivals=[i * gap_s for i in range(n)], timeline=True)
    sync(gen)
    queue = gen._queue(gen.overlap)
    to_call = lambda ev: queue._origin_host + queue._origin.elapsed_time(ev) / 1e3 - gen.timeline_origin  # noqa: E731
    transfers = [dict(direction=d, start=to_call(a), end=to_call(b), bytes=nb) for d, a, b, nb in copies.record]
    copies.record = None
    steps = [dict(index=s.index, requests=s.requests, tokens=s.tokens, decode_only=s.decode_only,
                  device=list(s.device)) for s in gen.timeline]
    return dict(steps=steps, transfers=transfers, arrivals=[i * gap_s for i in range(n)],
                loaded=[r.cached for r in gen.requests])


def _free(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def second_process(directory: str, prompts, smoke: bool, device_pages: int) -> dict:
    """Serve ``prompts`` in a fresh Python process on the disk store in ``directory``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(directory=directory, prompts=prompts, smoke=smoke, pages=device_pages), f)
    cmd = [sys.executable, "-m", "kvlab.bench.hierarchy", f.name]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    except subprocess.TimeoutExpired:
        return dict(error="the second process took more than 150 s")
    finally:
        os.remove(f.name)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout or "no output").strip().splitlines()
        return dict(error=f"the second process failed: {lines[-1]}"[:300])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _second_main(path: str) -> None:
    """The second process: a fresh generator (empty device and host) on the given disk."""
    from .. import runtime
    from ..serving.hf import DiskCache, HostCache
    from .memory import memory_model

    with open(path) as f:
        job = json.load(f)
    model = memory_model(runtime.DEVICE, job["smoke"], max_positions=_positions(_plan(job["smoke"])[0],
                                                                               job["smoke"]))
    pages = job["pages"]
    gen = make_generator(model, pages, job["smoke"], host_cache=HostCache(2 * pages, "write_back"),
                         disk_cache=DiskCache(job["directory"], pages=1 << 22))
    prompts = job["prompts"]
    ends = [2] * len(prompts)
    start = time.perf_counter()
    counts = dict(prompt=0, computed=0, disk=0)
    for i in range(0, len(prompts), CONCURRENCY):
        group = prompts[i:i + CONCURRENCY]
        gen.generate(group, max_new_tokens=2, end_after=ends[:len(group)])
        counts["prompt"] += sum(map(len, group))
        counts["computed"] += gen.stats["prefill_computed"]
        counts["disk"] += gen.stats.get("prefill_loaded_disk", 0)
    sync(gen)
    out = dict(prompt_tokens=counts["prompt"], computed=counts["computed"],
               disk_hit=counts["disk"] / max(counts["prompt"], 1), seconds=time.perf_counter() - start)
    out.update(_copies(gen))
    print(json.dumps(out, default=str))


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['config']:26s} {row['error']}"
    hit = f"hit {row['hit']:.3f}" if "hit" in row else f"disk hit {row['disk_hit']:.3f}"
    return f"{row['config']:26s} {hit}  computed {row['computed']:8d}" + (
        f"  TTFT p50 {row['ttft_p50'] * 1e3:8.1f} ms  {row['tokens_per_s']:8.0f} tok/s" if "ttft_p50" in row else "")


if __name__ == "__main__":
    _second_main(sys.argv[1])
