"""The kernels' rows of ``python -m kvlab.bench`` (chapter 09): the teaching kernels against the
fast ones (called bare, as chapter 09 builds them), a vectorised-torch version, the page-table
writers, the recompile trap and the O(bs^2) prefix sums.

The public calls, as users make them, are in :mod:`kvlab.bench.public`.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import cases as C
from . import paths as X
from .timing import first_call_ms, interleaved_loop_us, median_us

#: The teaching kernel is compiled for next_power_of_2(T) lanes; past this it is skipped
#: (it would recompile for seconds to minutes, and past about 2^20 it does not compile).
TEACHING_MAX_LANES = 32768
#: one extra shape that shows the recompile trap on its own (timed once, first call only)
TRAP_CASE = (256, 256, 64)  # bs, mean extend, P -> 65536 tokens: next_power_of_2 = 65536
#: shapes only the fast path can run (about 1.5 million tokens), and one large batch
EXTRA_COLD_CASES = [(1024, 1536), (2000, 100)]
#: one shape per fast-kernel launch shape, compiled first (one launch; scan + fill)
WARMUP_CASES = [(2, 8), (5000, 2)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def _mark_disagreements(row: dict, outs: dict) -> None:
    """Compare every path's (out, pages) with the fast path's; flag the row and each mismatch."""
    ref_out, ref_pages = outs["fast"]
    for name, (o, n) in outs.items():
        if not (_same(o, ref_out) and n == ref_pages):
            row["agree"] = False
            row["paths"][name]["disagrees_with_fast"] = True


def _record_loops(row: dict, timed: dict[str, Callable[[], object]], smoke: bool) -> None:
    """Per-call-in-a-loop times of all of a case's paths, side by side, into ``row["paths"]``."""
    for name, entry in interleaved_loop_us(timed, smoke).items():
        row["paths"][name].update(entry)


def bench_extend(case_list, page_sizes, smoke: bool, log=print) -> list[dict]:
    rows = []
    for P in page_sizes:
        for bs, mean in case_list:
            b = C.make_extend_batch(bs, mean, P)
            row = {"case": f"{bs}x{mean}", "bs": bs, "mean_extend": mean,
                   "tokens": b.extend_num_tokens, "page_size": P, "paths": {}, "agree": True}
            outs = {}
            for name, path in X.EXTEND_PATHS.items():
                lanes = X.next_pow2(b.extend_num_tokens)
                if name == "teaching" and lanes > TEACHING_MAX_LANES:
                    row["paths"][name] = {"skipped": f"would recompile for {lanes} lanes "
                                                     f"(next_power_of_2 of {b.extend_num_tokens} tokens)"}
                    continue
                outs[name] = path(b)  # also the first call: timed separately below
                row["paths"][name] = {}
            # first calls were made above, untimed, in path order; time steady state now
            timed = {name: (lambda path=path: path(b)) for name, path in X.EXTEND_PATHS.items()
                     if name in outs}
            for name, fn in timed.items():
                row["paths"][name]["median_us"] = median_us(fn, smoke)
            _record_loops(row, timed, smoke)
            _mark_disagreements(row, outs)
            log(f"extend {row['case']:>10} P={P:<3} T={b.extend_num_tokens:<8} " + "  ".join(
                f"{k}={v.get('median_us', float('nan')):.1f}us" for k, v in row["paths"].items()))
            rows.append(row)
    return rows


def bench_cold(case_list, page_sizes, smoke: bool, trap: bool, log=print) -> tuple[list[dict], list[dict]]:
    """First calls, in order, of the teaching and the fast path on shapes they have not seen.

    Run this before anything else in a fresh process (with an empty Triton cache): the first
    case of each page size includes the fast kernels' one compilation; every later case is a
    shape they have not seen. The teaching kernel recompiles whenever next_power_of_2(bs) or
    next_power_of_2(T) is new.
    """
    rows = []
    seen_fast: set[int] = set()
    compiles = []
    for P in page_sizes:
        # The fast path has two kernels variants (one launch for bs <= FUSED_MAX_BATCH, scan +
        # fill above it); each compiles once per page size, on a shape of its own.
        for bs, mean in WARMUP_CASES:
            w = C.make_extend_batch(bs, mean, P, seed=7)
            compiles.append({"page_size": P, "bs": bs, "tokens": w.extend_num_tokens,
                             "fast_first_call_ms": first_call_ms(lambda: X.fast_extend(w))})
        seen_fast.add(P)
        extra = [] if smoke else EXTRA_COLD_CASES
        for bs, mean in list(case_list) + extra:
            b = C.make_extend_batch(bs, mean, P)
            lanes = X.next_pow2(b.extend_num_tokens)
            row = {"case": f"{bs}x{mean}", "bs": bs, "tokens": b.extend_num_tokens, "page_size": P,
                   "teaching_lanes": lanes, "fast_compiled_before": P in seen_fast}
            row["fast_first_call_ms"] = first_call_ms(lambda: X.fast_extend(b))
            if lanes > TEACHING_MAX_LANES:
                row["teaching_first_call_ms"] = None
                row["teaching_skipped"] = f"would recompile for {lanes} lanes"
            else:
                row["teaching_first_call_ms"] = first_call_ms(lambda: X.teaching_extend(b))
            log(f"cold   {row['case']:>10} P={P:<3} T={b.extend_num_tokens:<8} "
                f"fast={row['fast_first_call_ms']:.1f}ms teaching={row['teaching_first_call_ms']}")
            rows.append(row)
    if trap and not smoke:
        bs, mean, P = TRAP_CASE
        b = C.make_extend_batch(bs, mean, P)
        lanes = X.next_pow2(b.extend_num_tokens)
        row = {"case": f"{bs}x{mean}", "bs": bs, "tokens": b.extend_num_tokens, "page_size": P,
               "teaching_lanes": lanes, "fast_compiled_before": P in seen_fast, "trap": True,
               "fast_first_call_ms": first_call_ms(lambda: X.fast_extend(b)),
               "teaching_first_call_ms": first_call_ms(lambda: X.teaching_extend(b))}
        log(f"trap   {row['case']:>10} P={P:<3} lanes={lanes} teaching={row['teaching_first_call_ms']:.0f}ms "
            f"fast={row['fast_first_call_ms']:.1f}ms")
        rows.append(row)
    for c in compiles:
        log(f"compile fast P={c['page_size']} bs={c['bs']}: {c['fast_first_call_ms']:.0f} ms")
    return rows, compiles


def bench_decode(batches, page_sizes, smoke: bool, log=print) -> list[dict]:
    rows = []
    for P in page_sizes:
        for bs in batches:
            b = C.make_decode_batch(bs, P)
            row = {"bs": bs, "page_size": P, "new_pages": b.num_new_pages, "paths": {}, "agree": True}
            outs = {}
            timed = {name: (lambda path=path: path(b)) for name, path in X.DECODE_PATHS.items()}
            for name, fn in timed.items():
                row["paths"][name] = {"first_call_ms": first_call_ms(fn)}
                outs[name] = fn()
                row["paths"][name]["median_us"] = median_us(fn, smoke)
            _record_loops(row, timed, smoke)
            _mark_disagreements(row, outs)
            log(f"decode bs={bs:<5} P={P:<3} " + "  ".join(
                f"{k}={v['median_us']:.1f}us" for k, v in row["paths"].items()))
            rows.append(row)
    return rows


def bench_page_table(case_list, page_sizes, smoke: bool, log=print) -> list[dict]:
    rows = []
    try:
        from ..alloc.paging import write_page_table, write_page_table_triton
    except Exception as e:  # noqa: BLE001 - report, do not hide, a broken module
        return [{"error": f"kvlab.alloc.paging unavailable: {type(e).__name__}: {e}"}]
    writers = {"host_loop": write_page_table, "triton": write_page_table_triton}
    for P in page_sizes:
        for bs, mean in case_list:
            b = C.make_extend_batch(bs, mean, P)
            table, allocated, info = C.page_table_job(b)
            row = {"case": f"{bs}x{mean}", "bs": bs, "page_size": P, "slots": allocated.numel(),
                   "paths": {}, "agree": True}
            results = {name: table.clone() for name in writers}  # each writer fills its own copy
            timed = {name: (lambda write=write, t=results[name]: write(t, allocated, info, P))
                     for name, write in writers.items()}
            for name, fn in timed.items():
                row["paths"][name] = {"first_call_ms": first_call_ms(fn)}
                row["paths"][name]["median_us"] = median_us(fn, smoke)
            _record_loops(row, timed, smoke)
            row["agree"] = _same(results["host_loop"], results["triton"])
            log(f"ptable {row['case']:>10} P={P:<3} " + "  ".join(
                f"{k}={v['median_us']:.1f}us" for k, v in row["paths"].items()))
            rows.append(row)
    return rows


def bench_scaling(batches, tokens: int, page_size: int, smoke: bool, log=print) -> list[dict]:
    """Fixed total tokens, growing batch: the teaching kernel's prefix sums grow as bs^2."""
    rows = []
    for bs in batches:
        b = C.make_extend_batch(bs, tokens // bs, page_size, extend_lens=[tokens // bs] * bs)
        row = {"bs": bs, "tokens": b.extend_num_tokens, "page_size": page_size, "paths": {}}
        timed = {name: (lambda path=X.EXTEND_PATHS[name]: path(b)) for name in ("teaching", "fast")}
        for name, fn in timed.items():
            fn()
            row["paths"][name] = {"median_us": median_us(fn, smoke)}
        _record_loops(row, timed, smoke)
        log(f"scale  bs={bs:<5} T={b.extend_num_tokens} " + "  ".join(
            f"{k}={v['median_us']:.1f}us" for k, v in row["paths"].items()))
        rows.append(row)
    return rows
