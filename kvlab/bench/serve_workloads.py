"""The serving benchmark's workloads and the statistics of its runs (chapter 10).

The offline workload is nano-vllm's ``bench.py`` (mini-sglang's ``benchmark/offline/bench.py``
adapts it): ``random.seed(0)``; 256 prompts, each ``randint(100, 1024)`` tokens of
``randint(0, 10000)``; then 256 answer lengths ``randint(100, 1024)``; 142,827 prompt and
133,966 output tokens. The online one draws prompts the same way, shorter answers, and the
gaps of a Poisson process. Latencies are reported as engines report them: p50 and p99 of the
time to first token (TTFT), the inter-token latency (ITL) and the end-to-end latency.
"""
from __future__ import annotations

import math
import random
import statistics

import torch

#: nano-vllm's bench.py: num_seqs, max_input_len, max_ouput_len, seed, token ids randint(0, 10000)
OFFLINE = dict(requests=256, shortest=100, longest=1024, seed=0, max_token=10000)
SMOKE_OFFLINE = dict(requests=6, shortest=2, longest=12, seed=0, max_token=100)
#: the online workload: prompts as offline, shorter answers (each rate's run stays short)
ONLINE = dict(requests=48, shortest=100, longest=1024, answer_shortest=32, answer_longest=128,
              seed=1, max_token=10000, rates=(8, 16, 32, 64, 128), baseline_rates=(4, 32))
SMOKE_ONLINE = dict(requests=4, shortest=4, longest=16, answer_shortest=2, answer_longest=4,
                    seed=1, max_token=100, rates=(20, 200), baseline_rates=())
#: GPU busy: this many requests decoding together (prompts of ``prompt`` tokens)
BUSY = dict(running=(64, 256), prompt=256, answer=96, seed=2)
SMOKE_BUSY = dict(running=(2, 4), prompt=8, answer=4, seed=2)


def offline_workload(requests: int, shortest: int, longest: int, seed: int, max_token: int,
                     **_) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's ``bench.py``: prompts first (each its length, then its tokens), then the
    answer lengths, all from one ``random.seed(seed)`` stream."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token) for _ in range(rng.randint(shortest, longest))]
               for _ in range(requests)]
    answers = [rng.randint(shortest, longest) for _ in range(requests)]
    return prompts, answers


def online_workload(requests: int, shortest: int, longest: int, answer_shortest: int,
                    answer_longest: int, seed: int, max_token: int, **_):
    """Prompts like the offline ones, answers of ``answer_shortest..answer_longest`` tokens,
    and the gaps of a Poisson process of rate 1 (scaled by each rate)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token) for _ in range(rng.randint(shortest, longest))]
               for _ in range(requests)]
    answers = [rng.randint(answer_shortest, answer_longest) for _ in range(requests)]
    gaps = [rng.expovariate(1.0) for _ in range(requests)]
    return prompts, answers, gaps


def arrivals_at(gaps: list[float], rate: float) -> list[float]:
    """Arrival times (s) of a Poisson process of ``rate`` requests/s: the first at 0."""
    out, t = [], 0.0
    for g in gaps:
        out.append(t)
        t += g / rate
    return out


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentiles(values: list[float]) -> dict:
    """p50 and p99 (nearest rank, as a latency table reads), in milliseconds."""
    if not values:
        return {"p50": None, "p99": None}
    v = sorted(values)
    return {f"p{q}": v[max(0, math.ceil(q / 100 * len(v)) - 1)] * 1e3 for q in (50, 99)}


def latency_summary(arrivals: list[float], times: list[list[float]], tokens: int) -> dict:
    """TTFT, ITL, end-to-end latency (p50/p99, ms) and requests/s of one online run:
    ``times[i]``: when each token of request ``i`` reached its caller, ``arrivals[i]``: when
    it arrived (same clock, s)."""
    ttft = [t[0] - a for a, t in zip(arrivals, times) if t]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    e2e = [t[-1] - a for a, t in zip(arrivals, times) if t]
    span = max(t[-1] for t in times if t) - min(arrivals)
    return dict(ttft_ms=percentiles(ttft), itl_ms=percentiles(itl), e2e_ms=percentiles(e2e),
                requests_per_s=len(times) / span, tokens_per_s=tokens / span, seconds=span)


def busy_fraction(timeline, requests: int) -> dict:
    """GPU busy share of the decode steps with ``requests`` requests: step k's device time over
    the device time between the ends of steps k-1 and k (both such steps); medians."""
    shares, periods, device = [], [], []
    for a, b in zip(timeline, timeline[1:]):
        if a.decode_only and b.decode_only and a.requests == requests == b.requests:
            period = b.device[1] - a.device[1]
            busy = b.device[1] - b.device[0]
            if period > 0:
                shares.append(min(1.0, busy / period))
                periods.append(period * 1e3)
                device.append(busy * 1e3)
    if not shares:
        return dict(busy=None, steps=0)
    return dict(busy=statistics.median(shares), steps=len(shares),
                step_ms=statistics.median(periods), device_ms=statistics.median(device))


