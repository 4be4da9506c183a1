"""What ``python -m kvlab.bench --hierarchy`` claims, judged from its own rows (chapter 13), and
the write-through's cost to a decode step, measured side by side.

Claims (each judged on unrounded numbers; ``None`` in a smoke run or when a row it needs failed):

* the host tier reaches at least 90% of the unbounded cache's prefix hit rate, under
  write-through and under write-back; write-through-selective's share is reported (it copies a
  page only once it is hit twice, and in a chat every turn's newest pages are used once more,
  often after the device has evicted them);
* the host tier (write-through) computes at least 2x fewer prompt tokens than GPU only, and its
  TTFT p50 is at least 1.5x lower;
* the load-back reaches at least 80% of the pinned host-to-device bandwidth measured in the run;
* a second process on the warm disk computes at least 2x fewer prompt tokens than one on a cold
  disk;
* a decode step with write-through copies in flight is at most 5% slower than without them.
"""
from __future__ import annotations

import time

import torch


def _claim(name: str, rule: str, measured, passed, smoke: bool) -> dict:
    if isinstance(measured, float):
        measured = round(measured, 3)
    return dict(name=name, rule=rule, measured=measured, passed=None if smoke or passed is None else bool(passed))


def _row(res: dict, config: str) -> dict | None:
    for r in res["rows"]:
        if r["config"] == config and "error" not in r:
            return r
    return None


def claims(res: dict) -> list[dict]:
    smoke, out = res["smoke"], []
    ceiling = _row(res, "unbounded")
    for policy in ("write_through", "write_back", "write_through_selective"):
        r = _row(res, f"+ host {policy}")
        share = None if r is None or ceiling is None or not ceiling["hit"] else r["hit"] / ceiling["hit"]
        judged = policy != "write_through_selective"
        out.append(_claim(f"+ host ({policy}): prefix hit rate against the unbounded cache's",
                          "hit rate ratio >= 0.9" if judged else "reported (pages hit once are not copied)",
                          share, None if share is None or not judged else share >= 0.9, smoke))
    gpu, host = _row(res, "GPU only"), _row(res, "+ host write_through")
    fewer = None if gpu is None or host is None or not host["computed"] else gpu["computed"] / host["computed"]
    out.append(_claim("+ host: prompt tokens computed, GPU only / host tier", "ratio >= 2", fewer,
                      None if fewer is None else fewer >= 2, smoke))
    faster = (None if gpu is None or host is None or not host["ttft_p50"] else gpu["ttft_p50"] / host["ttft_p50"])
    out.append(_claim("+ host: TTFT p50, GPU only / host tier", "ratio >= 1.5", faster,
                      None if faster is None else faster >= 1.5, smoke))
    pinned = res["pinned"].get("h2d_gbps")
    loads = [r["load_gbps"] for r in res["rows"] if "error" not in r and r.get("load_gbps")
             and r["config"].startswith("+ host")]
    share = None if not loads or not pinned else min(loads) / pinned
    out.append(_claim("load-back bandwidth against pinned host-to-device bandwidth (the slowest host row)",
                      "ratio >= 0.8", share, None if share is None else share >= 0.8, smoke))
    warm, cold = _row(res, "second process, warm disk"), _row(res, "second process, cold disk")
    fewer = None if warm is None or cold is None or not warm["computed"] else cold["computed"] / warm["computed"]
    out.append(_claim("second process: prompt tokens computed, cold disk / warm disk", "ratio >= 2", fewer,
                      None if fewer is None else fewer >= 2, smoke))
    d = res.get("decode") or {}
    slow = d.get("ratio")
    out.append(_claim("decode step with write-through copies in flight / without", "ratio <= 1.05", slow,
                      None if slow is None else slow <= 1.05, smoke))
    return out


def decode_slowdown(model, smoke: bool, make_generator, log=print) -> dict:
    """The same online workload twice -- a host tier under write-through (every prompt's pages
    copied down while later steps run) and under write-back with room to spare (no copy at all) --
    and the mean device time of its decode-only steps, batch size by batch size."""
    import random

    from ..serving.hf import HostCache

    rng = random.Random(7)
    n, length, new = (6, 8, 4) if smoke else (48, 1024, 48)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
    arrivals = [i * (0.001 if smoke else 0.012) for i in range(n)]
    pages = n * (-(-(length + new) // (4 if smoke else 16))) + 8
    times = {}
    for policy in ("write_back", "write_through"):
        gen = make_generator(model, pages, smoke, host_cache=HostCache(2 * pages, policy))
        gen.generate(prompts, max_new_tokens=new, arrivals=arrivals, timeline=True)
        gen.clear_prefix_cache()                       # the same call again, cold and warmed up
        gen.generate(prompts, max_new_tokens=new, arrivals=arrivals, timeline=True)
        by: dict[int, list] = {}
        for s in gen.timeline:
            if s.decode_only and s.device[1] > s.device[0]:
                by.setdefault(s.requests, []).append(s.device[1] - s.device[0])
        times[policy] = by
        if gen.page_table.device.type == "cuda":
            torch.cuda.synchronize()
        log(f"decode steps, {policy}: {sum(map(len, by.values()))} timed")
        time.sleep(0)
    a, b = times["write_through"], times["write_back"]
    common = [k for k in a if k in b]
    if not common:
        return dict(ratio=None, steps=0)
    weight = {k: min(len(a[k]), len(b[k])) for k in common}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    num = sum(weight[k] * mean(a[k]) for k in common)
    den = sum(weight[k] * mean(b[k]) for k in common)
    return dict(ratio=num / den if den else None, steps=sum(weight.values()),
                write_through_ms=1e3 * num / sum(weight.values()), without_ms=1e3 * den / sum(weight.values()))
