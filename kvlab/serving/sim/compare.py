"""The radix tree and the hash-chained cache side by side, measured (chapter 11).

:func:`compare_caches` runs the simulator of chapter 07 on the same seeded workloads with each
prefix cache of :mod:`kvlab.serving.sim.caches` and each pool size, and returns one :class:`CacheRun`
per run: prefix-hit tokens, evicted tokens (and how many of them no allocation asked for: the
radix tree evicts whole leaves), pages in use, preemptions, and the median host time
of a ``match_prefix`` / ``insert_prefix``. :func:`first_divergence` names the first step at
which two runs differ (hits or where the pages are), :func:`lookup_cost` times one lookup of
each cache on the same prompts, interleaved, and :func:`comparison_table` prints the rows.

Pool sizes are set per workload from its requests (``P`` = page size)::

    tight   the longest request's pages: one long request fills memory (preemptions)
    half    twice that
    ample   every request's pages at once: nothing ever has to be evicted
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import NamedTuple, Sequence

import torch

from ...base.args import check_int, check_page_size, div_ceil
from ...base.errors import InvalidArgument
from ...prefix.hash_cache import HashPrefixCache
from ...prefix.radix_cache import RadixPrefixCache
from .caches import PREFIX_CACHES
from .checks import check_config
from .scheduler import SimConfig, simulate
from .timeline import Timeline
from .workloads import Workload

__all__ = ["CacheRun", "POOLS", "pool_sizes", "MEMORY_POOLS", "memory_pools", "compare_policies", "policy_row",
           "policy_table", "compare_caches", "first_divergence", "comparison_table", "LookupCost", "lookup_cost"]


class CacheRun(NamedTuple):
    workload: str
    pool: str                # "tight", "half" or "ample"
    num_pages: int
    cache: str               # one of kvlab.serving.sim.caches.PREFIX_CACHES
    prompt_tokens: int
    hit_tokens: int
    evicted_tokens: int
    over_evicted: int        # evicted tokens beyond what the allocations asked for (whole radix leaves)
    peak_in_use: int         # pages (locked cached + private) at the fullest step
    mean_in_use: float
    preemptions: int
    steps: int
    match_us: float          # median host time of one match_prefix
    insert_us: float         # ... of one insert_prefix
    diverged_at: int | None  # first step that differs from the radix run of the same pool (None: never)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


POOLS = ("tight", "half", "ample")


def _check_workloads(workloads) -> None:
    """A list of :class:`Workload` (not one workload by itself)."""
    if isinstance(workloads, Workload) or not isinstance(workloads, Sequence) or not all(
            isinstance(w, Workload) for w in workloads):
        raise InvalidArgument("workloads", "a list of kvlab.serving.sim.Workload", f"got {workloads!r}"[:120])


def _names(argument: str, values, allowed: Sequence[str]) -> tuple[str, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise InvalidArgument(argument, f"a non-empty list of names from {tuple(allowed)}", f"got {values!r}")
    bad = [v for v in values if v not in allowed]
    if bad:
        raise InvalidArgument(argument, f"names from {tuple(allowed)}", f"got {bad[0]!r}")
    return tuple(values)


def pool_sizes(workload: Workload, page_size: int) -> dict[str, int]:
    """``tight`` / ``half`` / ``ample`` page counts for ``workload`` (see the module docstring)."""
    page_size = check_page_size(page_size)
    if not isinstance(workload, Workload) or not workload.requests:
        raise InvalidArgument("workload", "a kvlab.serving.sim.Workload with at least one request",
                              f"got {workload!r}"[:120])
    need = [div_ceil(r.max_len, page_size) for r in workload.requests]
    tight = max(need)
    return {"tight": tight, "half": 2 * tight, "ample": max(sum(need), 2 * tight)}


def first_divergence(a: Timeline, b: Timeline) -> int | None:
    """The first step whose prefix hits, evictions or page split differ between two runs (or
    where one run ends before the other); ``None`` when they agree at every step."""
    for i, (x, y) in enumerate(zip(a.steps, b.steps)):
        if (x.hit_tokens, x.evicted_tokens, x.memory, x.admitted) != (
                y.hit_tokens, y.evicted_tokens, y.memory, y.admitted):
            return i
    return None if len(a.steps) == len(b.steps) else min(len(a.steps), len(b.steps))


def compare_caches(workloads: Sequence[Workload], config: SimConfig = SimConfig(),
                   caches: Sequence[str] = PREFIX_CACHES,
                   pools: Sequence[str] = ("tight", "half", "ample")) -> list[CacheRun]:
    """Run every workload with every cache and pool size (``config`` sets the rest)."""
    check_config(config)
    caches, pools = _names("caches", caches, PREFIX_CACHES), _names("pools", pools, POOLS)
    _check_workloads(workloads)
    rows = []
    for workload in workloads:
        sizes = pool_sizes(workload, config.page_size)
        for pool in pools:
            runs = {cache: simulate(workload, replace(config, num_pages=sizes[pool], prefix_cache=cache))
                    for cache in caches}
            for cache, timeline in runs.items():
                s, ops = timeline.summary(), timeline.cache_ops
                in_use = [r.memory.in_use for r in timeline.steps]
                base = runs.get("radix")
                rows.append(CacheRun(
                    workload.name, pool, sizes[pool], cache, s.prompt_tokens, s.hit_tokens,
                    s.evicted_tokens, max(0, s.evicted_tokens - ops.asked_tokens), s.peak_in_use_pages, sum(in_use) / max(len(in_use), 1),
                    s.preemptions, s.steps, ops.match_us, ops.insert_us,
                    None if base is None else first_divergence(base, timeline)))
    return rows


def comparison_table(rows: Sequence[CacheRun]) -> str:
    """The rows as a fixed-width table (one line per run)."""
    head = (f"{'workload':22s} {'pool':>10s} {'cache':>20s} {'hit rate':>8s} {'hit tok':>7s} "
            f"{'evicted':>7s} {'over':>5s} {'peak':>4s} {'mean':>5s} {'pre':>3s} {'steps':>5s} "
            f"{'match us':>8s} {'insert us':>9s} {'differs':>7s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        diverged = "-" if r.cache == "radix" else ("never" if r.diverged_at is None else f"step {r.diverged_at}")
        lines.append(f"{r.workload:22s} {r.pool + ' ' + str(r.num_pages):>10s} {r.cache:>20s} "
                     f"{r.hit_rate:8.1%} {r.hit_tokens:7d} {r.evicted_tokens:7d} {r.over_evicted:5d} {r.peak_in_use:4d} "
                     f"{r.mean_in_use:5.1f} {r.preemptions:3d} {r.steps:5d} {r.match_us:8.1f} "
                     f"{r.insert_us:9.1f} {diverged:>7s}")
    return "\n".join(lines)


class LookupCost(NamedTuple):
    prompt_len: int
    radix_us: float
    hash_us: float

    @property
    def ratio(self) -> float:
        """hash / radix: how many times longer one hash lookup takes."""
        return self.hash_us / self.radix_us


def lookup_cost(prompt_lens: Sequence[int], page_size: int = 16, repeats: int = 200,
                seed: int = 0) -> list[LookupCost]:
    """Time ``match_prefix`` of a fully cached prompt of each length on both caches, in turns
    (radix, hash, radix, ...), and return the median host microseconds of each. The radix
    walk compares tokens page by page; the hash walk hashes every page (BLAKE2b in C) and looks
    it up in a dict, then compares the page's tokens."""
    page_size = check_page_size(page_size)
    repeats = check_int("repeats", repeats, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    if isinstance(prompt_lens, (str, bytes)) or not isinstance(prompt_lens, Sequence):
        raise InvalidArgument("prompt_lens", "a list of prompt lengths", f"got {prompt_lens!r}")
    prompt_lens = [check_int(f"prompt_lens[{i}]", n, minimum=1) for i, n in enumerate(prompt_lens)]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in prompt_lens:
        ids = torch.randint(0, 30000, (n,), generator=gen).tolist()
        pages = div_ceil(n, page_size)
        radix = RadixPrefixCache(page_size, device="cpu")
        radix.insert_prefix(ids, torch.arange(n, dtype=torch.int32))
        hashed = HashPrefixCache(pages, page_size, device="cpu")
        hashed.free(hashed.allocate(ids).pages)
        times: dict[str, list[int]] = {"radix": [], "hash": []}
        for _ in range(repeats):
            for name, cache in (("radix", radix), ("hash", hashed)):
                start = time.perf_counter_ns()
                cache.match_prefix(ids)
                times[name].append(time.perf_counter_ns() - start)
        assert radix.match_prefix(ids).cached_len == hashed.match_prefix(ids).cached_len
        out.append(LookupCost(n, statistics.median(times["radix"]) / 1e3,
                              statistics.median(times["hash"]) / 1e3))
    return out


# ==== chapter 12: the memory policies side by side =========================================

#: pools for the memory policies, as a share of every request's whole answer at once (never
#: below the longest request alone); python -m kvlab.bench --memory uses the same
MEMORY_POOLS = {"ample": 1.0, "medium": 0.4, "tight": 0.15}


def memory_pools(workload: Workload, page_size: int, shares=None) -> dict[str, int]:
    """Pages per pool name for ``workload`` (see :data:`MEMORY_POOLS`)."""
    import math

    page_size = check_page_size(page_size)
    if not isinstance(workload, Workload) or not workload.requests:
        raise InvalidArgument("workload", "a kvlab.serving.sim.Workload with at least one request",
                              f"got {workload!r}"[:120])
    need = [div_ceil(r.max_len, page_size) for r in workload.requests]
    return {name: max(max(need), math.ceil(share * sum(need) - 1e-9))
            for name, share in (shares or MEMORY_POOLS).items()}


def compare_policies(workloads: Sequence[Workload], config: SimConfig = SimConfig(),
                     policies: Sequence = ("reserve", "recompute", "retract", "swap"),
                     pools: Sequence[str] = tuple(MEMORY_POOLS)) -> list[dict]:
    """Run every workload with every policy in every pool of :data:`MEMORY_POOLS` (``config``
    sets the rest); one row (a dict) per run, the numbers the chapter's table shows."""
    from ..pressure import make_policy

    check_config(config)
    pools = _names("pools", pools, tuple(MEMORY_POOLS))
    policies = [make_policy(p, "policies") for p in policies]
    _check_workloads(workloads)
    rows = []
    for workload in workloads:
        sizes = memory_pools(workload, config.page_size)
        for pool in pools:
            for policy in policies:
                tl = simulate(workload, replace(config, num_pages=sizes[pool], policy=policy))
                rows.append(policy_row(workload, pool, tl))
    return rows


def policy_row(workload: Workload, pool: str, timeline: Timeline) -> dict:
    """One row of :func:`compare_policies`: ``timeline``, a run of ``workload`` in ``pool``."""
    s = timeline.summary()
    new_tokens = sum(len(r.output) for r in workload.requests)
    return dict(workload=workload.name, pool=pool, pages=timeline.num_pages, policy=timeline.policy,
                steps=s.steps, tokens_per_step=new_tokens / s.steps, mean_running=s.mean_running,
                unused_pages=s.mean_promised_pages, stops=s.preemptions, recomputed_tokens=s.recomputed_tokens,
                swapped_tokens=s.swapped_tokens, ttft_p50=s.ttft_p50, ttft_p99=s.ttft_p99,
                tpot_p50=s.tpot_p50, tpot_p99=s.tpot_p99)


def policy_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`compare_policies` as a fixed-width table, one block per workload, at
    most 88 characters a line (a notebook's output width)."""
    head = (f"{'pool':>10s} {'policy':>9s} {'steps':>5s} {'tok/step':>8s} {'running':>7s} {'unused':>6s} "
            f"{'stops':>5s} {'recomp':>6s} {'swapped':>7s} {'TTFT':>7s} {'TPOT':>7s}")
    lines = [head, f"{'':>10s} {'':>9s} {'':>5s} {'':>8s} {'':>7s} {'pages':>6s} {'':>5s} {'':>6s} {'':>7s} "
                   f"{'p50/p99':>7s} {'p50/p99':>7s}"]
    workload = None
    for r in rows:
        if r["workload"] != workload:
            workload = r["workload"]
            lines.append(f"-- {workload} " + "-" * (len(head) - len(workload) - 4))
        lines.append(f"{r['pool'] + ' ' + str(r['pages']):>10s} {r['policy']:>9s} {r['steps']:5d} "
                     f"{r['tokens_per_step']:8.2f} {r['mean_running']:7.1f} {r['unused_pages']:6.1f} "
                     f"{r['stops']:5d} {r['recomputed_tokens']:6d} {r['swapped_tokens']:7d} "
                     f"{_pair(r['ttft_p50'], r['ttft_p99'], '{:.0f}'):>7s} "
                     f"{_pair(r['tpot_p50'], r['tpot_p99'], '{:.1f}'):>7s}")
    return "\n".join(lines)


def _pair(a, b, fmt: str) -> str:
    return "/".join("-" if x is None else fmt.format(x) for x in (a, b))
