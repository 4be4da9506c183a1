"""The public decode-attention call as a caller meets it (chapter 09), in ``--attention``.

A kernel's time (CUDA events, L2 flushed) says nothing of what a call costs its caller: the
checks, the allocations, the launches through Python, the wait. Here each path is one call
followed by ``torch.cuda.synchronize()``, timed on the host's clock: the **synced wall time
per call, host included**, which is what a caller that needs the answer pays. The paths, side
by side in rounds (:func:`kvlab.bench.timing.interleaved_loop_us`):

* ``fast`` -- :func:`kvlab.attention.fast_paged_decode_attention` as a user calls it, checks on,
  defaults (the split count from the page table's columns);
* ``fast_unchecked`` -- the same with ``check=False``;
* ``teaching`` -- chapter 08's :func:`kvlab.attention.paged_decode_attention`, checks on (its
  host checks read the device: several syncs);
* ``sdpa`` -- transformers' SDPA attention on contiguous K/V of the same shapes (the decode
  call of its own cache), no paging and no checks: what the fast call is held against.

Each row records the syncs one call makes (torch's sync debug mode) and the host time of a
call without the wait.
"""
from __future__ import annotations

import math
import time

import torch

from ..base import runtime

CASES, SMOKE_CASES = [(1, 512), (64, 512)], [(1, 8), (3, 8)]
#: the issue's target: the checked call's synced wall time / SDPA's
LIMIT = 1.5
CALLS, ROUNDS = 50, 9


def synced_block_us(fn, calls: int, smoke: bool) -> float:
    """Host wall time per call of ``calls`` calls, each followed by a device sync."""
    sync = torch.cuda.synchronize if not smoke else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
        sync()
    return (time.perf_counter() - t0) * 1e6 / calls


def host_block_us(fn, calls: int) -> float:
    """Host time per call without waiting (the queue absorbs the launches), then one sync."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    if torch.cuda.is_available() and not runtime.INTERPRET:
        torch.cuda.synchronize()
    return us


def bench_public_attention(shape: dict, smoke: bool, log=print) -> list[dict]:
    from ..attention.paged_attention import fast_paged_decode_attention, paged_decode_attention
    from .decode_shapes import paged_case, sdpa_call
    from .timing import count_syncs, interleaved_loop_us

    dtype = getattr(torch, shape["dtype"])
    heads, kv_heads, head_dim, page_size = (shape[k] for k in ("heads", "kv_heads", "head_dim", "page_size"))
    scale = 1.0 / math.sqrt(head_dim)
    rows = []
    for batch, ctx in SMOKE_CASES if smoke else CASES:
        q, k, v, table, idx, lens = paged_case(batch, ctx, heads, kv_heads, head_dim, page_size, dtype, seed=batch)
        fns = {"fast": lambda: fast_paged_decode_attention(q, k, v, table, idx, lens),
               "fast_unchecked": lambda: fast_paged_decode_attention(q, k, v, table, idx, lens, check=False),
               "teaching": lambda: paged_decode_attention(q, k, v, table, idx, lens),
               "sdpa": sdpa_call(batch, ctx, heads, kv_heads, head_dim, dtype, scale)}
        want = paged_decode_attention(q, k, v, table, idx, lens).float()
        agree = float((fast_paged_decode_attention(q, k, v, table, idx, lens).float() - want).abs().max())
        timed = interleaved_loop_us(fns, smoke, calls=1 if smoke else CALLS, rounds=3 if smoke else ROUNDS,
                                    time_block=synced_block_us)
        row = dict(batch=batch, ctx=ctx, agree_max_abs=agree, paths={})
        for name, fn in fns.items():
            row["paths"][name] = dict(wall_us=timed[name]["loop_us"], wall_rounds_us=timed[name]["loop_rounds_us"],
                                      host_us=host_block_us(fn, 1 if smoke else CALLS), syncs=count_syncs(fn))
        sdpa = row["paths"]["sdpa"]["wall_us"]
        for entry in row["paths"].values():
            entry["vs_sdpa"] = entry["wall_us"] / sdpa if sdpa else None
        rows.append(row)
        p = row["paths"]
        log(f"public attention call batch {batch} x {ctx}: " + ", ".join(
            f"{n} {e['wall_us']:.1f} us ({e['vs_sdpa']:.2f}x sdpa, {e['syncs']} syncs)" for n, e in p.items()))
    return rows


def targets(rows: list[dict], smoke: bool) -> list[dict]:
    found = []
    for r in rows:
        ratio = r["paths"]["fast"]["vs_sdpa"]
        found.append(dict(name=f"public fast_paged_decode_attention call, checks on, batch {r['batch']} x {r['ctx']}",
                          rule=f"synced wall time / SDPA's <= {LIMIT}", limit=LIMIT,
                          measured=None if ratio is None else round(ratio, 2),
                          passed=None if smoke else ratio is not None and ratio <= LIMIT))
        syncs = r["paths"]["fast"]["syncs"]
        found.append(dict(name=f"device->host syncs in the checked fast call, batch {r['batch']}",
                          rule="== 0", limit=0, measured=syncs, passed=None if smoke else syncs == 0))
    return found
