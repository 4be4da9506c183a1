"""The decode-attention benchmark (chapter 09): ``python -m kvlab.bench --attention``.

Decode attention reads every K/V byte of the batch's contexts and does two dot products per
row it reads, so its time is bounded below by bytes / memory bandwidth: the **HBM floor**.
This benchmark measures, in one process:

* **the bandwidth**: a large ``torch`` device-to-device copy (it reads and writes each byte:
  bandwidth = 2 x bytes / time), recorded beside the results;
* **the attention kernels** at batch 1, 64 and 256 with contexts of 512, 4096 and 32768 tokens
  (the serving model's heads: 32 query heads on 8 K/V heads of 64, bfloat16, pages of 16):
  chapter 08's kernel (``teaching``), chapter 09's (``fast``) and transformers' own SDPA
  decode on contiguous K/V of the same shapes (``sdpa``), each captured in a CUDA graph and
  timed by ``triton.testing.do_bench`` (median, L2 flushed before every call), against the
  floor of the bytes the step must read (K/V once, the page-table entries, ``q``, ``out``);
* **the whole decode step** of the serving model (:mod:`kvlab.bench.serve`'s) at 64 and 256
  running requests, contexts of 128-576 tokens: the CUDA-graph replay of
  :class:`kvlab.serving.hf.PagedGenerator`'s padded step with the fast kernels, compiled with
  ``torch.compile`` or not, and with the teaching kernel, against the floor of weights + K/V
  + logits bytes; the compiled generator's start-up, and the graphs ``torch.compile`` built
  after it (must be none).

Bounded in time (``TIME_BUDGET_S``: what is left is reported as skipped). ``smoke=True``: tiny
shapes in the interpreter, the harness only.
"""
from __future__ import annotations

import math
import random
import time
from types import SimpleNamespace

import torch

from ..base import runtime

#: the serving model's attention shape (Llama 3.2 1B: 32 query heads on 8 K/V heads of 64)
SHAPE = dict(heads=32, kv_heads=8, head_dim=64, page_size=16, dtype="bfloat16")
SMOKE_SHAPE = dict(heads=4, kv_heads=2, head_dim=16, page_size=4, dtype="float32")
BATCHES, CONTEXTS = (1, 64, 256), (512, 4096, 32768)
SMOKE_BATCHES, SMOKE_CONTEXTS = (1, 3), (8, 40)
STEP_BATCHES, SMOKE_STEP_BATCHES = (64, 256), (2, 4)
#: the decode step's contexts: like the serving workload's (prompts of 128-512, 64 new tokens)
STEP_CONTEXTS, SMOKE_STEP_CONTEXTS = (128, 576), (4, 20)
#: the issue's targets: kernel time / floor and step time / floor
KERNEL_LIMIT, STEP_LIMIT = 2.0, 3.0
KERNEL_TARGETS = [(64, 512), (64, 4096), (64, 32768), (256, 4096), (256, 32768)]
TIME_BUDGET_S = 150.0
COPY_BYTES, SMOKE_COPY_BYTES = 1 << 31, 1 << 20


def _sync() -> None:
    if runtime.DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _bench_us(fn, smoke: bool) -> float:
    """Median time of one call, µs: ``do_bench`` (CUDA events, L2 flushed first) on a GPU; one
    timed call in the interpreter (no claim)."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def _graphed(fn, smoke: bool):
    """``fn`` captured in a CUDA graph (its replay), after one eager call that compiles what it
    uses; in the interpreter ``fn`` itself."""
    fn()
    if smoke:
        return fn
    _sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    _sync()
    return graph.replay


def copy_bandwidth(smoke: bool) -> dict:
    """Device-to-device copy: ``dst.copy_(src)`` reads and writes ``nbytes`` each."""
    n = SMOKE_COPY_BYTES if smoke else COPY_BYTES
    src = torch.empty(n, dtype=torch.uint8, device=runtime.DEVICE)
    dst = torch.empty_like(src)
    us = _bench_us(lambda: dst.copy_(src), smoke)
    return dict(bytes_copied=n, us=us, gb_per_s=2 * n / us / 1e3)


def paged_case(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, page_size: int,
               dtype: torch.dtype, seed: int = 0):
    """A pool with every request's ``ctx`` tokens on shuffled pages (seeded): ``(q, k_pool,
    v_pool, page_table, rows, seq_lens)`` on the runtime's device."""
    device = runtime.DEVICE
    pages_per = -(-ctx // page_size)
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(batch * pages_per, generator=gen).view(batch, pages_per)
    table = (pages[:, :, None] * page_size + torch.arange(page_size)).view(batch, -1)[:, :ctx]
    table = table.to(device, torch.int32).contiguous()
    torch.manual_seed(seed)
    slots = batch * pages_per * page_size
    k = torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    rows = torch.arange(batch, device=device)
    return q, k, v, table, rows, torch.full((batch,), ctx, device=device)


def kernel_bytes(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, elem: int) -> dict:
    """What one decode attention call must move (the floor), and what each kernel's design
    reads: the teaching kernel runs one program per query head, so each K/V head's rows are
    read ``heads / kv_heads`` times (the L2 may serve some of them); the fast one reads them
    once per K/V head."""
    kv = batch * ctx * kv_heads * head_dim * 2 * elem
    table = batch * ctx * 4
    qo = 2 * batch * heads * head_dim * elem
    return dict(kv=kv, page_table=table, q_out=qo, floor=kv + table + qo,
                teaching_design=kv * heads // kv_heads + table * heads + qo,
                fast_design=kv + table * kv_heads + qo)


def _sdpa_call(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, dtype, scale):
    """transformers' SDPA attention on one decode query per request, K/V contiguous
    ``[batch, kv_heads, ctx, head_dim]`` as its cache keeps them (values random: timing only)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device = runtime.DEVICE
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=dtype)
    return lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale, is_causal=False)


def bench_kernels(batches, contexts, shape: dict, bw: float, smoke: bool, deadline: float, log) -> list[dict]:
    from ..attention.paged_attention import (choose_num_splits, fast_paged_decode_attention, paged_decode_attention,
                                 streaming_multiprocessors)

    dtype = getattr(torch, shape["dtype"])
    heads, kv_heads, head_dim, page_size = (shape[k] for k in ("heads", "kv_heads", "head_dim", "page_size"))
    scale = 1.0 / math.sqrt(head_dim)
    rows = []
    for batch in batches:
        for ctx in contexts:
            row = dict(batch=batch, ctx=ctx, paths={})
            row["bytes"] = kernel_bytes(batch, ctx, heads, kv_heads, head_dim, dtype.itemsize)
            row["floor_us"] = row["bytes"]["floor"] / bw / 1e3
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget"
                rows.append(row)
                continue
            args = paged_case(batch, ctx, heads, kv_heads, head_dim, page_size, dtype, seed=batch + ctx)
            row["num_splits"] = choose_num_splits(batch, kv_heads, ctx, streaming_multiprocessors(runtime.DEVICE))
            calls = {
                "teaching": lambda: paged_decode_attention(*args, scale, check=False),
                "fast": lambda: fast_paged_decode_attention(*args, scale, out_dtype=dtype, check=False,
                                                            max_context=ctx),
                "sdpa": _sdpa_call(batch, ctx, heads, kv_heads, head_dim, dtype, scale),
            }
            got = {name: calls[name]().float() for name in ("teaching", "fast")}
            row["agree_max_abs"] = float((got["teaching"] - got["fast"]).abs().max())
            for name, fn in calls.items():
                us = _bench_us(_graphed(fn, smoke), smoke)
                row["paths"][name] = dict(us=us, ratio_to_floor=us / row["floor_us"])
            del args, calls, got
            if not smoke:
                torch.cuda.empty_cache()
            p = row["paths"]
            log(f"attention batch {batch} ctx {ctx}: floor {row['floor_us']:.1f} us; teaching "
                f"{p['teaching']['us']:.1f}, fast {p['fast']['us']:.1f} ({row['num_splits']} splits), "
                f"sdpa {p['sdpa']['us']:.1f}")
            rows.append(row)
    return rows


# --- the whole decode step --------------------------------------------------------------------


def step_bytes(model, batch: int, contexts: list[int]) -> dict:
    """What one decode step must move: every weight but the embedding table (of which it reads
    ``batch`` rows), every K/V row of the contexts, the new K/V, the logits it writes."""
    c = model.config
    elem = model.dtype.itemsize
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    weights += batch * c.hidden_size * elem
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * kv_heads * head_dim * 2 * elem
    kv = sum(contexts) * per_token
    logits = batch * c.vocab_size * elem
    return dict(weights=weights, kv=kv, new_kv=batch * per_token, logits=logits,
                floor=weights + kv + batch * per_token + logits)


def _map_rows(gen, contexts: list[int], seed: int) -> None:
    """Give request ``b`` (row ``b``) ``contexts[b]`` positions on shuffled pages of the pool."""
    P = gen.page_size
    need = [-(-n // P) for n in contexts]
    pages = list(range(gen.num_pages))
    random.Random(seed).shuffle(pages)
    at = 0
    for b, n in enumerate(contexts):
        mine = torch.tensor(pages[at:at + need[b]], device=gen.page_table.device)
        at += need[b]
        gen.page_table[b, :need[b] * P] = (mine[:, None] * P + torch.arange(P, device=mine.device)).flatten()


def bench_step(batches, ctx_range, smoke: bool, bw: float, deadline: float, log) -> dict:
    """The padded decode step of the serving model at each batch size, three ways."""
    from ..serving.hf import PagedGenerator
    from ..serving.hf.graphs import dynamo_graphs
    from ..serving.hf.plugin import paged_attention_active
    from .serve import PAGE_SIZE, serve_model
    from .timing import interleaved_loop_us

    model = serve_model(runtime.DEVICE, smoke)
    rng = random.Random(1)
    contexts = {bs: [rng.randint(*ctx_range) for _ in range(bs)] for bs in batches}
    page = PAGE_SIZE if not smoke else 4
    pages = sum(-(-n // page) for n in contexts[max(batches)]) + 8
    max_bs = max(batches)
    variants = {"fast_compiled": dict(attention="fast", compile_decode=True),
                "fast": dict(attention="fast", compile_decode=False),
                "teaching": dict(attention="teaching", compile_decode=False)}
    if smoke:   # no graphs to capture here, and compiling the tiny model's step costs a minute
        del variants["fast_compiled"]
    out: dict = dict(batches=list(batches), context_range=list(ctx_range), startup_s={}, rows=[])
    gens = {}
    for name, kw in variants.items():
        if time.perf_counter() > deadline:
            out.setdefault("skipped", []).append(name)
            continue
        before = dynamo_graphs() if kw["compile_decode"] else None
        t0 = time.perf_counter()
        gens[name] = PagedGenerator(model, page, pages, max_running=max_bs, graph_sizes=list(batches),
                                    **kw)
        _sync()
        out["startup_s"][name] = time.perf_counter() - t0
        if before is not None:
            out["graphs_built_at_startup"] = dynamo_graphs() - before
        log(f"step: {name} generator built in {out['startup_s'][name]:.1f} s")
    with paged_attention_active(model), torch.inference_mode():
        for bs in batches:
            ctxs = contexts[bs]
            row = dict(batch=bs, mean_context=sum(ctxs) / bs, bytes=step_bytes(model, bs, ctxs), paths={})
            row["floor_us"] = row["bytes"]["floor"] / bw / 1e3
            fns = {}
            for name, gen in gens.items():
                _map_rows(gen, ctxs, seed=bs)
                ids, rows_, positions = [1] * bs, list(range(bs)), [n - 1 for n in ctxs]
                gen.graphs.run(ids, rows_, positions)
                fns[f"{name}:run"] = (lambda g=gen: g.graphs.run(ids, rows_, positions))
                fns[f"{name}:replay"] = (gen.graphs.graphs[bs].replay if gen.graphs.capture
                                         else (lambda g=gen: g.graphs._forward(bs)))
            _sync()
            timed = interleaved_loop_us(fns, smoke, calls=1 if smoke else 10, rounds=3 if smoke else 7)
            for name in gens:
                replay, run = timed[f"{name}:replay"]["loop_us"], timed[f"{name}:run"]["loop_us"]
                row["paths"][name] = dict(replay_us=replay, run_us=run, ratio_to_floor=replay / row["floor_us"])
            log(f"step batch {bs}: floor {row['floor_us']:.0f} us; " + ", ".join(
                f"{n} {e['replay_us']:.0f} us ({e['ratio_to_floor']:.1f}x)" for n, e in row["paths"].items()))
            out["rows"].append(row)
    if "fast_compiled" in gens:
        gen = gens["fast_compiled"]
        gen.clear_prefix_cache()
        gen.page_table[:max_bs].fill_(-1)
        start = dynamo_graphs()
        gen.generate([[1 + i] * (5 + 3 * i) for i in range(6)], max_new_tokens=4)
        out["graphs_built_while_serving"] = dynamo_graphs() - start
    return out


def targets(res: dict) -> list[dict]:
    smoke = res["smoke"]
    found = []
    by_shape = {(r["batch"], r["ctx"]): r for r in res["kernel"]}
    for batch, ctx in KERNEL_TARGETS:
        r = by_shape.get((batch, ctx), {})
        ratio = r.get("paths", {}).get("fast", {}).get("ratio_to_floor")
        found.append(dict(name=f"fast decode attention, batch {batch}, context {ctx}",
                          rule=f"time / HBM floor <= {KERNEL_LIMIT}", limit=KERNEL_LIMIT,
                          measured=None if ratio is None else round(ratio, 2),
                          passed=None if smoke else ratio is not None and ratio <= KERNEL_LIMIT))
    for r in res["step"].get("rows", []):
        best = min((e["ratio_to_floor"], n) for n, e in r["paths"].items() if n.startswith("fast"))
        found.append(dict(name=f"CUDA-graph decode step ({best[1]}), {r['batch']} running requests",
                          rule=f"replay time / HBM floor <= {STEP_LIMIT}", limit=STEP_LIMIT,
                          measured=round(best[0], 2), passed=None if smoke else best[0] <= STEP_LIMIT))
    if "graphs_built_while_serving" in res["step"]:
        n = res["step"]["graphs_built_while_serving"]
        found.append(dict(name="torch.compile recompiles after start-up", rule="== 0", limit=0,
                          measured=n, passed=None if smoke else n == 0))
    return found


def run_attention(smoke: bool = False, log=print) -> dict:
    """Measure everything above; returns the result (``res["attention"]`` of ``bench.json``)."""
    t0 = time.perf_counter()
    deadline = t0 + TIME_BUDGET_S
    shape = dict(SMOKE_SHAPE if smoke else SHAPE)
    res: dict = dict(smoke=smoke, shape=shape, time_budget_s=TIME_BUDGET_S)
    res["bandwidth"] = copy_bandwidth(smoke)
    bw = res["bandwidth"]["gb_per_s"]
    log(f"copy bandwidth: {bw:.0f} GB/s")
    res["kernel"] = bench_kernels(SMOKE_BATCHES if smoke else BATCHES, SMOKE_CONTEXTS if smoke else CONTEXTS,
                                  shape, bw, smoke, deadline, log)
    res["step"] = bench_step(SMOKE_STEP_BATCHES if smoke else STEP_BATCHES,
                             SMOKE_STEP_CONTEXTS if smoke else STEP_CONTEXTS, smoke, bw, deadline, log)
    res["targets"] = targets(res)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res
