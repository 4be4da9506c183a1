"""The serving benchmark (chapter 10): ``python -m kvlab.bench --serve``.

One workload, three ways of serving it with the same model, timed side by side in one run:

* transformers ``generate`` on one left-padded batch (every prompt padded to the longest);
* transformers ``generate_batch`` (its continuous batching over a paged cache);
* :class:`kvlab.hf.PagedGenerator` (admission by memory, chunked prefill, CUDA-graph decode),
  its prefix cache emptied before every run (a cold cache: the shared prefix is computed once
  per run, then read by the prompts that share it);

and, for the chapter, the generator with chunking and then graphs turned off. The workload:
a random-weight Llama (16 layers, hidden 2048, 32 query heads on 8 K/V heads: the shape of
Llama 3.2 1B) in bfloat16; 64 prompts of 128-512 tokens, half of them behind one shared
256-token prefix; 64 new tokens each, greedy, no end of text. Each path runs once to warm up,
then ``rounds`` times in a rotating order; tokens/s is new tokens over the wall time of a
whole call (synchronised). Beside that: the generator's steps, requests running at once,
prompt tokens computed and cached, and the decode step time at 64 running requests next to
``generate``'s at batch 64 (its time for 65 new tokens minus its time for 1, over 64).
"""
from __future__ import annotations

import random
import statistics
import time

import torch

#: the workload of the benchmark (``smoke``: a tiny model and workload, for the interpreter)
WORKLOAD = dict(requests=64, shortest=128, longest=512, shared_len=256, new_tokens=64, seed=0)
SMOKE_WORKLOAD = dict(requests=6, shortest=8, longest=40, shared_len=20, new_tokens=3, seed=0)
MODEL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096)
#: the generator's pool and page size in the benchmark
PAGE_SIZE, NUM_PAGES = 16, 4096


def serve_prompts(requests: int, shortest: int, longest: int, shared_len: int, seed: int,
                  vocab: int, **_) -> list[list[int]]:
    """``requests`` prompts of ``shortest..longest`` tokens; every other one starts with the
    same ``shared_len`` tokens (then at least ``shortest // 4`` tokens of its own)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(shared_len)]
    prompts = []
    for i in range(requests):
        if i % 2:
            own = rng.randint(max(1, shortest // 4), longest - shared_len)
            prompts.append(shared + [rng.randrange(vocab) for _ in range(own)])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(rng.randint(shortest, longest))])
    return prompts


def serve_model(device, smoke: bool):
    """The random-weight model (seeded), with no end-of-text token: every request runs its
    whole answer on every path."""
    from ..hf.models import tiny_model
    from ..hf.plugin import require_transformers

    if smoke:
        model = tiny_model("llama", seed=0, device=device)
    else:
        transformers = require_transformers()
        config = transformers.LlamaConfig(**MODEL, bos_token_id=None, eos_token_id=None,
                                          pad_token_id=None, tie_word_embeddings=False)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _timed(fn, device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def padded_generate(model, prompts, new_tokens: int) -> int:
    """transformers ``generate`` on one left-padded batch; returns the new tokens made."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return (out.shape[1] - longest) * len(prompts)


def batch_generate(model, prompts, new_tokens: int) -> int:
    """transformers ``generate_batch`` (continuous batching, paged cache)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    # no inference_mode here: its loop runs in a thread of its own, outside the mode
    out = model.generate_batch(inputs=prompts, generation_config=config)
    failed = [o.error for o in out.values() if getattr(o, "error", None)]
    if failed or len(out) != len(prompts):
        raise RuntimeError(f"generate_batch: {len(failed)} of {len(prompts)} requests failed: "
                           f"{(failed or ['missing outputs'])[0]}")
    return sum(len(o.generated_tokens) for o in out.values())


class _StepClock:
    """``on_step``: the wall time of each step (a step ends with reading its tokens back), and
    on CUDA the GPU time of its forward pass (events around ``_forward``, read at the end)."""

    def __init__(self, gen):
        self.steps, self.events, self.last = [], [], time.perf_counter()
        self.forward = gen._forward

    def timed_forward(self, step, last):
        if not torch.cuda.is_available():
            return self.forward(step, last)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.forward(step, last)
        end.record()
        self.events.append((start, end))
        return out

    def __call__(self, info) -> None:
        now = time.perf_counter()
        self.steps.append(dict(kind="decode" if not info.prefill and not info.chunks else "prefill",
                               running=len(info.prefill) + len(info.chunks) + len(info.decode),
                               tokens=info.tokens, padded_to=info.padded_to,
                               ms=(now - self.last) * 1e3))
        self.last = now

    def finish(self) -> None:
        for step, (start, end) in zip(self.steps, self.events):
            step["forward_gpu_ms"] = start.elapsed_time(end)


def _kvlab_run(gen, prompts, new_tokens):
    gen.clear_prefix_cache()          # a cold cache for every run
    clock = _StepClock(gen)

    def run():
        gen._forward = clock.timed_forward
        try:
            clock.last = time.perf_counter()
            return sum(map(len, gen.generate(prompts, max_new_tokens=new_tokens, on_step=clock)))
        finally:
            del gen._forward          # the class's own again
    return run, clock


def run_serve(smoke: bool = False, rounds: int = 3, log=print) -> dict:
    """Measure the three paths (and the generator without chunking / graphs) on the workload."""
    from ..hf import PagedGenerator
    from .. import runtime

    device = runtime.DEVICE
    w = dict(SMOKE_WORKLOAD if smoke else WORKLOAD)
    model = serve_model(device, smoke)
    prompts = serve_prompts(**w, vocab=model.config.vocab_size)
    new = w["new_tokens"]
    res = dict(workload=dict(w, prompt_tokens=sum(map(len, prompts)), model=dict(
        MODEL if not smoke else {"tiny": True}, dtype=str(model.dtype).replace("torch.", ""))),
        rounds=rounds, paths={}, smoke=smoke)
    pages = NUM_PAGES if not smoke else 64
    variants = {"kvlab": {}, "kvlab_no_chunks": dict(chunked_prefill=False),
                "kvlab_no_graphs": dict(decode_graphs="off")}
    gens, startup = {}, {}
    for name, kw in variants.items():
        seconds, gens[name] = _timed(lambda: PagedGenerator(model, PAGE_SIZE, pages, **kw), device)
        startup[name] = seconds
        log(f"{name}: start-up {seconds:.2f} s")
    paths = {"generate": lambda: padded_generate(model, prompts, new),
             "generate_batch": lambda: batch_generate(model, prompts, new)}
    if smoke:   # its paged cache on a CPU takes minutes even for the smoke workload
        paths.pop("generate_batch")
        rounds = res["rounds"] = 1
    results: dict[str, dict] = {name: dict(seconds=[], tokens=None) for name in list(paths) + list(gens)}
    clocks: dict[str, object] = {}
    order = list(results)
    for r in range(rounds + 1):                  # round 0 warms every path up
        for name in order[r % len(order):] + order[:r % len(order)]:
            if name in gens:
                fn, clocks[name] = _kvlab_run(gens[name], prompts, new)
            else:
                fn = paths[name]
            try:
                seconds, produced = _timed(fn, device)
            except Exception as e:  # noqa: BLE001 - a path transformers cannot run here is reported
                results[name]["error"] = f"{type(e).__name__}: {e}"[:300]
                continue
            if r:
                results[name]["seconds"].append(seconds)
            results[name]["tokens"] = produced
            log(f"round {r} {name}: {seconds:.3f} s, {produced} tokens")
    for name, entry in results.items():
        if entry["seconds"]:
            entry["tokens_per_s"] = entry["tokens"] / statistics.median(entry["seconds"])
            entry["tokens_per_s_range"] = [entry["tokens"] / max(entry["seconds"]),
                                           entry["tokens"] / min(entry["seconds"])]
        if name in gens:
            gen = gens[name]
            if name in clocks:
                clocks[name].finish()
            entry.update(startup_s=startup[name], stats=dict(gen.stats),
                         graph_sizes=list(gen.graphs.sizes) if gen.graphs is not None else [],
                         steps=clocks[name].steps if name in clocks else [])
        res["paths"][name] = entry
    res["decode_step_ms"] = _decode_steps(res, model, prompts, device)
    res["targets"] = _targets(res)
    return res


def _decode_steps(res: dict, model, prompts, device) -> dict:
    """The decode step at 64 running requests: the generator's (median wall time of its
    decode-only steps with 64 running, last timed run) beside ``generate``'s at batch 64."""
    out = {}
    n = len(prompts)
    for name in ("kvlab", "kvlab_no_graphs"):
        steps = [s["ms"] for s in res["paths"][name].get("steps", [])
                 if s["kind"] == "decode" and s["running"] == n]
        out[name] = statistics.median(steps) if steps else None
        gpu = [s["forward_gpu_ms"] for s in res["paths"][name].get("steps", [])
               if s["kind"] == "decode" and s["running"] == n and "forward_gpu_ms" in s]
        out[f"{name}_forward_gpu"] = statistics.median(gpu) if gpu else None
    try:
        padded_generate(model, prompts, 2)     # warm
        one = min(_timed(lambda: padded_generate(model, prompts, 1), device)[0] for _ in range(3))
        full = min(_timed(lambda: padded_generate(model, prompts, 65), device)[0] for _ in range(2))
        out["generate"] = (full - one) / 64 * 1e3
    except Exception as e:  # noqa: BLE001
        out["generate_error"] = f"{type(e).__name__}: {e}"[:300]
    out["batch"] = n
    return out


def _targets(res: dict) -> list[dict]:
    p = res["paths"]

    def tps(name):
        return p.get(name, {}).get("tokens_per_s")

    targets = []
    for den, limit in (("generate", 1.0), ("generate_batch", 3.0)):
        a, b = tps("kvlab"), tps(den)
        ratio = a / b if a and b else None
        targets.append(dict(name=f"kvlab PagedGenerator vs transformers {den}", rule=f"tokens/s ratio >= {limit}",
                            limit=limit, measured=None if ratio is None else round(ratio, 2),
                            passed=None if res["smoke"] else ratio is not None and ratio >= limit))
    return targets
