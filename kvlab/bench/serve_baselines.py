"""transformers' own ways of serving the benchmark's workloads (chapter 10's baselines).

* ``generate`` -- what it allows for a batch: one left-padded batch, every answer as long as
  the longest (``max_new_tokens`` is one number per call); throughput counts each request's
  own answer, as the engines do, so the padding and the surplus tokens are its cost;
* ``generate_static_compiled`` -- the same batch through transformers' fastest documented path
  (a static cache and ``torch.compile``, :func:`static_compiled_generate`), compiled first;
* ``generate_batch``'s continuous-batching manager (``init_continuous_batching``, then
  ``add_request`` with each request's own ``max_new_tokens``: ``generate_batch`` itself takes
  one number for all) -- offline on the same requests, and online with Poisson arrivals,
  its per-token ``timestamps`` giving TTFT and ITL.

Each path reports an error instead of a number when this transformers version cannot run it.
"""
from __future__ import annotations

import inspect
import time

import torch

from .serve_workloads import arrivals_at, latency_summary, sync


def padded_generate(model, prompts, answers, pad_to: int = 1) -> dict:
    """One left-padded ``generate`` call (``pad_to``: the padded length rounded up to a multiple)."""
    longest = -(-max(map(len, prompts)) // pad_to) * pad_to
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(answers),
                             do_sample=False, pad_token_id=0)
    sync(model.device)
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, tokens=sum(answers), tokens_per_s=sum(answers) / seconds,
                generated=(out.shape[1] - longest) * len(prompts), requests=len(prompts))


def static_compiled_generate(model, prompts, answers) -> dict:
    """transformers' fastest documented path for a batch (``docs/source/en/llm_optims.md``,
    "Static kv-cache and torch.compile", option 1): ``generation_config.cache_implementation =
    "static"`` and ``model.forward = torch.compile(model.forward, mode="reduce-overhead",
    fullgraph=True)``, the batch left-padded to a multiple of 64 tokens (the page's tip against
    shape recompiles). The first call compiles (its seconds are reported as ``compile_s``); the
    second, on the same shapes, is timed. The model is restored afterwards.

    Versions of transformers that compile a static cache's decoding steps themselves
    (``generation_config.compile_config``) would wrap the compiled ``forward`` in a second
    CUDA-graph tree, and the inner one's outputs are overwritten by the outer's replay: there
    the path is taken with ``disable_compile=True`` (one compiled forward, as the page means),
    and if that still fails, with transformers' own compile alone (``path`` says which ran,
    ``earlier_ways_failed`` why the first did not)."""
    ways = [("manual", True)]
    if hasattr(model.generation_config, "disable_compile"):
        ways.append(("automatic", False))
    errors = []
    for way, manual in ways:
        try:
            out = _static_compiled(model, prompts, answers, manual)
            if errors:                              # why the documented way did not run here
                out["earlier_ways_failed"] = errors
            return out
        except Exception as e:  # noqa: BLE001 - the next way, or the error reported
            errors.append(f"{way}: {type(e).__name__}: {e}"[:200])
            torch._dynamo.reset()
    raise RuntimeError("; ".join(errors))


def _static_compiled(model, prompts, answers, manual: bool) -> dict:
    config = model.generation_config
    before = {k: getattr(config, k) for k in ("cache_implementation", "disable_compile") if hasattr(config, k)}
    config.cache_implementation = "static"
    if "disable_compile" in before:
        config.disable_compile = manual            # exactly one compiled forward either way
    if manual:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        first = padded_generate(model, prompts, answers, pad_to=64)
        out = padded_generate(model, prompts, answers, pad_to=64)
    finally:
        for k, v in before.items():
            setattr(config, k, v)
        model.__dict__.pop("forward", None)
        model.__dict__.pop("_compiled_call", None)
    out["compile_s"] = first["seconds"]
    out["path"] = ('cache_implementation="static" + torch.compile(model.forward, mode="reduce-overhead", '
                   'fullgraph=True)' if manual else
                   'cache_implementation="static", compiled by generate itself (compile_config)')
    return out


class BatchManager:
    """``generate_batch``'s continuous-batching manager, started once, fed request by request."""

    def __init__(self, model, max_new: int):
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        self.manager = model.init_continuous_batching(generation_config=config)
        if hasattr(self.manager, "warmup"):
            self.manager.warmup()
        self.manager.start()
        params = inspect.signature(self.manager.add_request).parameters
        self.stamps = "record_timestamps" in params
        self.count = 0

    def add(self, prompt, max_new: int) -> str:
        self.count += 1
        kw = dict(record_timestamps=True) if self.stamps else {}
        return self.manager.add_request(list(prompt), request_id=f"r{self.count}",
                                        max_new_tokens=max_new, **kw)

    def collect(self, ids: list[str], timeout: float = 300.0) -> dict:
        """Wait for every request of ``ids`` to finish; their last outputs, by id."""
        want, out = set(ids), {}
        deadline = time.perf_counter() + timeout
        while want - set(out):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"generate_batch's manager: {len(want - set(out))} requests unfinished "
                                   f"after {timeout:.0f} s")
            r = self.manager.get_result(timeout=1)
            if r is None or r.request_id not in want:
                continue
            if getattr(r, "error", None):
                raise RuntimeError(f"generate_batch's manager: request {r.request_id} failed: {r.error}")
            finished = getattr(r, "is_finished", lambda: True)()
            if finished:
                out[r.request_id] = r
        return out

    def close(self) -> None:
        self.manager.stop(block=True)
        if hasattr(self.manager, "destroy"):
            self.manager.destroy()


def batch_offline(mgr: BatchManager, prompts, answers) -> dict:
    start = time.perf_counter()
    ids = [mgr.add(p, a) for p, a in zip(prompts, answers)]
    out = mgr.collect(ids)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return dict(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, requests=len(prompts))


def batch_online(mgr: BatchManager, prompts, answers, gaps, rate: float) -> dict:
    t0 = time.perf_counter()
    ids, arrivals = [], []
    for p, a, at in zip(prompts, answers, arrivals_at(gaps, rate)):
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        arrivals.append(time.perf_counter() - t0)
        ids.append(mgr.add(p, a))
    out = mgr.collect(ids)
    results = [out[i] for i in ids]
    tokens = sum(len(o.generated_tokens) for o in results)
    if mgr.stamps and all(o.timestamps for o in results):
        times = [[s - t0 for s in o.timestamps] for o in results]
    else:                          # no per-token times here: only the end (TTFT, ITL unknown)
        times = [[o.lifespan[1] - t0] for o in results]
    summary = latency_summary(arrivals, times, tokens)
    if not mgr.stamps:
        summary.update(ttft_ms=None, itl_ms=None)
    return summary


def _attempt(fn, log, name: str) -> dict:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a path this transformers cannot run is reported
        log(f"{name}: failed: {type(e).__name__}: {e}")
        return dict(error=f"{type(e).__name__}: {e}"[:300])


def run_baselines(res: dict, model, prompts, answers, o_prompts, o_answers, gaps, rates,
                  device, smoke: bool, over, log, save) -> None:
    """Fill ``res`` with the baselines: offline ``generate`` and the manager on ``prompts``,
    the manager online at ``rates``. In a smoke run (a CPU) only ``generate``: the manager's
    paged cache takes minutes there."""
    paths = res["offline"]["paths"]
    padded_generate(model, prompts[:2], [2, 2])                    # warm-up
    paths["generate"] = _attempt(lambda: padded_generate(model, prompts, answers), log, "generate")
    log(f"offline generate: {paths['generate']}")
    save(res)
    if device.type == "cuda" and not over():       # (compiling in the interpreter takes minutes)
        paths["generate_static_compiled"] = _attempt(lambda: static_compiled_generate(model, prompts, answers),
                                                     log, "generate_static_compiled")
        log(f"offline generate_static_compiled: {paths['generate_static_compiled']}")
        save(res)
    elif device.type == "cuda":
        res["skipped"].append("generate_static_compiled")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if smoke:
        res["skipped"].append("generate_batch (its paged cache is too slow in the interpreter)")
        return
    if over():
        res["skipped"].append("generate_batch")
        return
    mgr = None
    try:
        mgr = BatchManager(model, max(max(answers), max(o_answers)))
        batch_offline(mgr, prompts[:2], [4, 4])                      # warm-up
        paths["generate_batch"] = _attempt(lambda: batch_offline(mgr, prompts, answers), log,
                                           "generate_batch")
        log(f"offline generate_batch: {paths['generate_batch']}")
        save(res)
        online = res["online"]["paths"].setdefault("generate_batch", {})
        for rate in rates:
            if over():
                res["skipped"].append(f"online generate_batch at {rate}/s")
                continue
            online[str(rate)] = _attempt(lambda: batch_online(mgr, o_prompts, o_answers, gaps, rate),
                                         log, f"online generate_batch {rate}/s")
            log(f"online generate_batch {rate}/s: {online[str(rate)]}")
            save(res)
    except Exception as e:  # noqa: BLE001
        paths.setdefault("generate_batch", dict(error=f"{type(e).__name__}: {e}"[:300]))
        log(f"generate_batch: failed: {type(e).__name__}: {e}")
    finally:
        if mgr is not None:
            mgr.close()
