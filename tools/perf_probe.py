"""One GPU batch of measurements for the decode-step and public-call work (issue 42).

    python tools/perf_probe.py OUT_DIR [--only=sweep,public,step,generate,static,startup]

Writes ``OUT_DIR/probe.json`` after every section (a run cut short keeps what it measured) and
logs to stdout. Sections, about four minutes in all on an H200:

* ``sweep``    the decode step's attention launch (store + attend, the serving model's heads:
               16 on 8 of 128, bfloat16, pages of 16, contexts 128-576 as ``--attention``'s
               step) at 64 and 256 running, over block sizes, warps, stages and split counts:
               do_bench median of the CUDA-graph replay, against the K/V bytes' floor;
* ``public``   the public fast call vs SDPA, synced wall time (kvlab.bench.decode_call);
* ``step``     the compiled CUDA-graph decode step at 64 and 256 running: replay time, floor,
               and the per-kernel profile by kind (kvlab.bench.step_profile);
* ``generate`` transformers' padded ``generate`` on the serving benchmark's 16 requests, a few
               steps: ms per step on a fresh model and after kvlab served it, attention
               implementation, and a profile of its decode steps;
* ``static``   transformers' static cache + torch.compile on those 16 requests (answers cut to 64):
               compile time, then tokens/s beside plain ``generate``;
* ``startup``  the serving generator built cold and warm in fresh processes (kvlab.bench.startup).
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.getcwd())

from kvlab.base import runtime  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else os.environ.get("OUT", "/tmp")
ONLY = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")), None)
RES: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
             "torch": torch.__version__}
T0 = time.perf_counter()


def save() -> None:
    RES["seconds"] = round(time.perf_counter() - T0, 1)
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def section(name: str):
    def wrap(fn):
        if ONLY and name not in ONLY.split(","):
            return fn
        t = time.perf_counter()
        print(f"=== {name}", flush=True)
        try:
            RES[name] = fn()
        except Exception as e:  # noqa: BLE001 - report and go on
            RES[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            print(RES[name]["trace"], flush=True)
        RES.setdefault("section_s", {})[name] = round(time.perf_counter() - t, 1)
        save()
        return fn
    return wrap


def contexts_for(batches=(64, 256)) -> dict:
    rng = random.Random(1)                      # as kvlab.bench.decode.bench_step draws them
    return {bs: [rng.randint(128, 576) for _ in range(bs)] for bs in batches}


from kvlab.bench.decode_shapes import bench_us, graphed, copy_bandwidth  # noqa: E402

BW = copy_bandwidth(False)["gb_per_s"]
RES["bandwidth_gb_s"] = BW
print("bandwidth", BW, flush=True)


@section("sweep")
def sweep():
    from kvlab.attention.attention_options import FastConfig, default_config
    from kvlab.attention.attention_plan import attend

    heads, kv_heads, head_dim, P, dtype = 16, 8, 128, 16, torch.bfloat16
    dev = runtime.DEVICE
    out = {"default": default_config(head_dim, dtype)._asdict(), "rows": []}
    configs = [FastConfig(b, True, w, s) for b in (32, 64, 128) for w, s in ((4, 2), (4, 3), (8, 2))]
    for bs, ctxs in contexts_for().items():
        pages_per = [-(-n // P) for n in ctxs]
        perm = torch.randperm(sum(pages_per), generator=torch.Generator().manual_seed(bs)).tolist()
        cols = 40960
        table = torch.full((bs + 1, cols), -1, dtype=torch.int32)
        at = 0
        for b, n in enumerate(ctxs):
            mine = torch.tensor(perm[at:at + pages_per[b]])
            at += pages_per[b]
            table[b, :pages_per[b] * P] = (mine[:, None] * P + torch.arange(P)).flatten()
        table = table.to(dev)
        slots = sum(pages_per) * P
        k = torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(bs, heads, head_dim, device=dev, dtype=dtype)
        nk, nv = torch.randn(bs, kv_heads, head_dim, device=dev, dtype=dtype), torch.randn(bs, kv_heads, head_dim, device=dev, dtype=dtype)
        rows = torch.arange(bs, device=dev)
        lens = torch.tensor(ctxs, device=dev)
        floor_us = (sum(ctxs) * (kv_heads * head_dim * 2 * 2 + 4) + 2 * bs * heads * head_dim * 2) / BW / 1e3
        for cfg in configs:
            for ns in (1, 2, 4):
                try:
                    fn = lambda: attend(q, k, v, table, rows, lens, new_k=nk, new_v=nv, config=cfg,  # noqa: E731
                                        num_splits=ns, out_dtype=dtype, check=False)
                    us = bench_us(graphed(fn, False), False)
                except Exception as e:  # noqa: BLE001
                    us = None
                    print("failed", cfg, ns, e, flush=True)
                row = dict(batch=bs, config=cfg._asdict(), splits=ns, us=us, floor_us=floor_us,
                           ratio=None if us is None else us / floor_us)
                out["rows"].append(row)
        best = min((r for r in out["rows"] if r["batch"] == bs and r["us"]), key=lambda r: r["us"])
        default = [r for r in out["rows"] if r["batch"] == bs and r["splits"] == 1
                   and r["config"] == out["default"]]
        print(f"bs {bs}: floor {floor_us:.1f} us; best {best['us']:.1f} ({best['ratio']:.2f}x) {best['config']} "
              f"splits {best['splits']}; default {default[0]['us'] if default else None}", flush=True)
        del k, v
        torch.cuda.empty_cache()
    return out


@section("public")
def public():
    from kvlab.bench.decode import SHAPE
    from kvlab.bench.decode_call import bench_public_attention

    return bench_public_attention(SHAPE, False)


@section("step")
def step():
    from kvlab.bench import step_profile
    from kvlab.bench.decode import _map_rows, step_bytes
    from kvlab.bench.serve import PAGE_SIZE, serve_model
    from kvlab.serving.hf import PagedGenerator
    from kvlab.serving.hf.graphs import dynamo_graphs
    from kvlab.serving.hf.plugin import paged_attention_active

    model = serve_model(runtime.DEVICE, False)
    ctx = contexts_for()
    pages = sum(-(-n // PAGE_SIZE) for n in ctx[256]) + 8
    t0 = time.perf_counter()
    gen = PagedGenerator(model, PAGE_SIZE, pages, max_running=256, graph_sizes=[64, 256], attention="fast",
                         compile_decode=True)
    torch.cuda.synchronize()
    out = {"startup_s": time.perf_counter() - t0, "graphs": dynamo_graphs(), "cache": gen.graphs.compile_cache,
           "rows": []}
    print("step generator built in", out["startup_s"], flush=True)
    with paged_attention_active(model), torch.inference_mode():
        for bs, ctxs in ctx.items():
            _map_rows(gen, ctxs, seed=bs)
            ids, rows_, positions = [1] * bs, list(range(bs)), [n - 1 for n in ctxs]
            gen.graphs.run(ids, rows_, positions)
            g = gen.graphs.graphs[bs]
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                g.replay()
            torch.cuda.synchronize()
            replay = (time.perf_counter() - t) / 50 * 1e6
            by = step_bytes(model, bs, ctxs)
            floor = by["floor"] / BW / 1e3
            kernels = step_profile.profile_replay(g.replay)
            kinds = step_profile.by_kind(kernels, step_profile.kind_bytes(model, bs, ctxs), BW)
            out["rows"].append(dict(batch=bs, replay_us=replay, floor_us=floor, ratio=replay / floor, bytes=by,
                                    by_kind=kinds, kernels=kernels[:60]))
            print(f"bs {bs}: replay {replay:.0f} us, floor {floor:.0f} us, {replay / floor:.2f}x", flush=True)
            for r in kinds:
                print(f"   {r['kind']:<28} {r['kernels']:4d} kernels {r['us']:8.1f} us  floor {r['floor_us']:7.1f} us",
                      flush=True)
    gen.clear_prefix_cache()
    gen.page_table[:256].fill_(-1)
    before = dynamo_graphs()
    got = gen.generate([[1 + i] * (5 + 3 * i) for i in range(6)], max_new_tokens=4)
    out["graphs_built_while_serving"] = dynamo_graphs() - before
    out["tokens_sample"] = got
    del gen
    torch.cuda.empty_cache()
    return out


@section("generate")
def generate():
    from kvlab.bench.serve import BASELINE, serve_model
    from kvlab.bench.serve_workloads import OFFLINE, offline_workload
    from torch.profiler import ProfilerActivity, profile

    model = serve_model(runtime.DEVICE, False)
    prompts, answers = offline_workload(**OFFLINE)
    prompts = prompts[:BASELINE["requests"]]
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = {"attn_implementation": model.config._attn_implementation, "longest_prompt": longest}

    def per_step(n_new: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    per_step(2)
    a, b = per_step(2), per_step(34)
    out["fresh_ms_per_step"] = (b - a) / 32 * 1e3
    out["fresh_prefill_s"] = a
    print("fresh model:", out, flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        per_step(6)
    out["profile_cuda"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    out["profile_cpu"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70)
    print(out["profile_cuda"], flush=True)
    # the same after a kvlab generator served the model (as in --serve)
    from kvlab.serving.hf import PagedGenerator

    gen = PagedGenerator(model, 16, 4096, max_running=32, compile_decode=False)
    gen.generate(prompts[:4], max_new_tokens=4)
    del gen
    torch.cuda.empty_cache()
    out["attn_implementation_after_kvlab"] = model.config._attn_implementation
    a, b = per_step(2), per_step(34)
    out["after_kvlab_ms_per_step"] = (b - a) / 32 * 1e3
    print("after kvlab:", out["after_kvlab_ms_per_step"], out["attn_implementation_after_kvlab"], flush=True)
    return out


@section("static")
def static():
    from kvlab.bench.serve import BASELINE, serve_model
    from kvlab.bench.serve_baselines import padded_generate, static_compiled_generate
    from kvlab.bench.serve_workloads import OFFLINE, offline_workload

    model = serve_model(runtime.DEVICE, False)
    prompts, answers = offline_workload(**OFFLINE)
    prompts, answers = prompts[:BASELINE["requests"]], [min(a, 64) for a in answers[:BASELINE["requests"]]]
    out = {"answers": answers, "generate": padded_generate(model, prompts, answers)}
    out["static_compiled"] = static_compiled_generate(model, prompts, answers)
    print({k: v for k, v in out.items() if k != "answers"}, flush=True)
    return out


@section("startup")
def startup():
    from kvlab.bench.startup import run_cold_and_warm

    res = run_cold_and_warm(False, timeout_s=150)
    print({k: (v.get("seconds"), v.get("error", "")[:300]) for k, v in res.items() if isinstance(v, dict)}, flush=True)
    return res


save()
print("done in", round(time.perf_counter() - T0, 1), "s", flush=True)
