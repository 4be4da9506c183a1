"""The benchmark suite behind ``python -m kvlab.bench`` (chapter 09): :func:`run` measures and
returns the result; :mod:`kvlab.bench.report` writes it.

On CUDA it measures, in one process and on the same batches:

* **the public calls** (:mod:`kvlab.bench.public`): ``PagedTokenAllocator.alloc_extend`` /
  ``alloc_decode``, both impls, with and without host lengths, beside the seed wrapper and
  the launch floor; the syncs each makes; the host time of the length checks;
* **first calls in a fresh process** (:mod:`kvlab.bench.cold`): construction, then batch sizes
  never seen, up to 65,536 requests;
* **the kernels** (:mod:`kvlab.bench.kernel_rows`): teaching vs fast kernels called bare, a
  vectorised-torch version, the page-table writers, the recompile trap, the prefix sums.

Without CUDA it runs a tiny smoke version (the harness only: the interpreter's timings mean
nothing, and the result says so).

Result layout (``bench.json``)::

    {"meta": {...}, "smoke": bool, "config": {...},
     "floor":          {paths: {launch, launch_kept, launch_1_sync, launch_7_syncs}},
     "public_extend":  [{case, bs, tokens, page_size, paths: {name: {loop_us, loop_rounds_us, syncs}}}],
     "public_decode":  [{bs, page_size, paths: {...}}],
     "host_checks":    [{bs, extend_cpu_tensor_us, extend_list_us, decode_...}],
     "page_table_checks": {entries, host_us},
     "cold_process":   {construct: [...], first_calls: [{page_size, bs, <kind>: ms}]},
     "extend", "decode", "page_table", "scaling", "cold", "fast_compiles": the kernels' rows,
     "targets":        [{name, rule, measured, limit, passed}]}
"""
from __future__ import annotations

import os
import platform
import sys
import time

from ..base import runtime
from . import cases as C
from . import cold, kernel_rows, public
from .targets import evaluate_targets
from .timing import loop_us  # noqa: F401  (chapter 09 times a few cases live with it)
from .timing import LOOP_CALLS, LOOP_ROUNDS, SMOKE_LOOP_CALLS, SMOKE_LOOP_ROUNDS, WARMUP_ROUNDS, WARMUP_S


def command_line() -> str:
    """The command that is running, as a shell would have it (the Triton cache dir included)."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    args = " ".join(sys.argv[1:])
    return (f"TRITON_CACHE_DIR={cache} " if cache else "") + f"python -m kvlab.bench {args}".rstrip()


def _meta(smoke: bool) -> dict:
    info = runtime.runtime_info()
    return {
        "mode": info.mode, "device": info.device_name, "torch": info.torch_version,
        "triton": info.triton_version, "python": platform.python_version(),
        "timer": (f"perf_counter; median_us: one call; loop_us: {SMOKE_LOOP_ROUNDS} interleaved rounds of "
                  f"{SMOKE_LOOP_CALLS} call (smoke: no timing claims)") if smoke
        else ("median_us: triton.testing.do_bench median (CUDA events; warmup 25 ms, rep 100 ms, L2 "
              f"flushed between calls); loop_us: time per call of {LOOP_CALLS} back-to-back calls between "
              "two CUDA events on an idle GPU (includes host launch overhead and syncs), the paths of a "
              f"case side by side: {LOOP_ROUNDS} rounds (after at least {WARMUP_ROUNDS} warm-up rounds and "
              f"{WARMUP_S} s, dropped), each timing every path once in a rotating order, "
              "each path's median over its rounds; ratios are quotients of those medians (the targets "
              "use loop_us)"),
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR", "(default)"),
        "command": command_line(),
        "note": ("SMOKE RUN in the Triton interpreter: tiny cases, harness only; the numbers are "
                 "not timings of anything and make no claim") if smoke else
        "medians of many calls on the same batches, one process, one GPU",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def config(smoke: bool) -> dict:
    if smoke:
        return {"extend_cases": [(1, 8), (3, 5)], "page_sizes": [1, 4], "decode_batches": [1, 3],
                "scaling_batches": [1, 4], "scaling_tokens": 16, "public_extend_cases": [(1, 8), (3, 5)],
                "public_page_sizes": [4], "public_decode_batches": [1, 3], "host_check_batches": [4, 64],
                "cold_batches": [1, 3], "cold_page_sizes": [4],
                "teaching_max_lanes": kernel_rows.TEACHING_MAX_LANES}
    return {"extend_cases": C.EXTEND_CASES, "page_sizes": C.PAGE_SIZES, "decode_batches": C.DECODE_BATCHES,
            "scaling_batches": C.SCALING_BATCHES, "scaling_tokens": C.SCALING_TOKENS,
            "public_extend_cases": C.PUBLIC_EXTEND_CASES, "public_page_sizes": C.PUBLIC_PAGE_SIZES,
            "public_decode_batches": C.PUBLIC_DECODE_BATCHES, "host_check_batches": C.HOST_CHECK_BATCHES,
            "cold_batches": cold.COLD_BATCHES, "cold_page_sizes": cold.COLD_PAGE_SIZES,
            "teaching_max_lanes": kernel_rows.TEACHING_MAX_LANES}


def run(*, smoke: bool | None = None, trap: bool = True, public_only: bool = False, log=print) -> dict:
    """Measure everything and return the result (see the module docstring); writes nothing."""
    if smoke is None:
        smoke = runtime.INTERPRET
    cfg = config(smoke)
    res: dict = {"meta": _meta(smoke), "smoke": smoke, "config": cfg}
    log(f"kvlab.bench: {res['meta']['note']}")
    t0 = time.perf_counter()
    # first: a fresh process of its own (its Triton cache is new and empty, whatever this one has)
    res["cold_process"] = cold.run_fresh(cfg["cold_page_sizes"], cfg["cold_batches"])
    log(f"cold process: {res['cold_process'].get('error') or 'done'}")
    if not public_only:  # before anything in this process compiles a fast kernel
        res["cold"], res["fast_compiles"] = kernel_rows.bench_cold(cfg["extend_cases"], cfg["page_sizes"],
                                                                   smoke, trap, log)
    res["floor"] = public.bench_floor(smoke, log)
    res["public_extend"] = public.bench_public_extend(cfg["public_extend_cases"], cfg["public_page_sizes"],
                                                      smoke, log)
    res["public_decode"] = public.bench_public_decode(cfg["public_decode_batches"], cfg["public_page_sizes"],
                                                      smoke, log)
    res["host_checks"] = public.bench_host_checks(cfg["host_check_batches"], 16, smoke, log)
    res["page_table_checks"] = public.bench_page_table_checks(256, 16, smoke, log)
    if not public_only:
        res["extend"] = kernel_rows.bench_extend(cfg["extend_cases"], cfg["page_sizes"], smoke, log)
        res["decode"] = kernel_rows.bench_decode(cfg["decode_batches"], cfg["page_sizes"], smoke, log)
        res["page_table"] = kernel_rows.bench_page_table(cfg["extend_cases"], cfg["page_sizes"], smoke, log)
        res["scaling"] = kernel_rows.bench_scaling(cfg["scaling_batches"], cfg["scaling_tokens"],
                                                   cfg["page_sizes"][-1] if smoke else 16, smoke, log)
    else:
        res["extend"] = res["decode"] = res["page_table"] = res["scaling"] = res["cold"] = []
        res["fast_compiles"] = []
    res["targets"] = evaluate_targets(res)
    res["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    return res
