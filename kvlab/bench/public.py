"""The public calls, timed as users make them (chapter 09).

A serving engine calls ``PagedTokenAllocator.alloc_extend`` / ``alloc_decode``, host code,
checks and all, not a bare kernel. This module times those calls beside:

* the **seed wrapper**: the source design's own host code around its kernels (``out_indices``
  allocated, one launch, ``ret_values.item()``, the free-list slice), as the study notes write it;
* the **launch floor**, in the same run: an empty Triton kernel launched the ordinary way
  (``kernel[grid]()``) and the way the allocator launches (the compiled kernel kept), and an
  empty launch followed by one ``.item()`` (what one device->host sync adds), and by seven.

Each public path runs on an allocator whose pool holds enough free pages for a whole timed
block of calls; before each block the free list is put back (untimed), so every block starts
from the same state.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ..base import runtime
from ..alloc.host_checks import decode_counts, extend_counts
from ..base.args import next_pow2
from ..alloc.alloc_kernels import alloc_decode_kernel, alloc_extend_kernel
from ..base.launch import Launcher
from ..alloc.token_allocator import PagedTokenAllocator
from . import cases as C
from .timing import LOOP_CALLS, count_syncs, host_us, interleaved_loop_us

#: The seed wrapper is skipped where its kernel would compile for more lanes than this
#: (a compile of tens of seconds, and a kernel that touches that many lanes per request).
SEED_MAX_LANES = 65536


class SeedAllocator:
    """The source design's host code around the teaching kernels, as the study notes give it
    (SGLang's ``PagedTokenToKVPoolAllocator`` of that time, debug mode off): allocate
    ``out_indices``, launch with ``next_power_of_2`` sizes, read ``ret_values.item()``, return
    None when pages are short, slice the free list. ``alloc_decode`` is written the same way."""

    def __init__(self, free_pages: torch.Tensor, page_size: int):
        self.free_pages = free_pages
        self.page_size = page_size
        self.device = free_pages.device
        self.ret_values = torch.empty((), dtype=torch.int64, device=self.device)

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int):
        bs = len(prefix_lens)
        out_indices = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        alloc_extend_kernel[(bs,)](prefix_lens, seq_lens, last_loc, self.free_pages, out_indices,
                                   self.ret_values, next_pow2(bs), self.page_size,
                                   next_pow2(extend_num_tokens))
        merged_value = self.ret_values.item()
        num_new_pages = merged_value >> 32
        if num_new_pages > len(self.free_pages):
            return None
        self.free_pages = self.free_pages[num_new_pages:]
        return out_indices

    def alloc_decode(self, seq_lens, last_loc):
        bs = len(seq_lens)
        out_indices = torch.empty((bs,), dtype=torch.int64, device=self.device)
        alloc_decode_kernel[(bs,)](seq_lens, last_loc, self.free_pages, out_indices, self.ret_values,
                                   next_pow2(bs), self.page_size)
        num_new_pages = self.ret_values.item()
        if num_new_pages > len(self.free_pages):
            return None
        self.free_pages = self.free_pages[num_new_pages:]
        return out_indices


# --- the launch floor -------------------------------------------------------------------------


@triton.jit
def empty_kernel(x_ptr, BLOCK: tl.constexpr):
    pass


def bench_floor(smoke: bool, log=print) -> dict:
    """Per-call time of launches that do nothing: what any public call costs at least."""
    x = torch.zeros(1, dtype=torch.int64, device=runtime.DEVICE)
    kept = Launcher(empty_kernel)

    def ordinary():
        empty_kernel[(1,)](x, 1)

    def cached():
        kept((1,), (x, 1))

    def with_syncs(n: int) -> Callable[[], None]:
        def fn():
            kept((1,), (x, 1))
            for _ in range(n):
                x.item()
        return fn

    fns = {"launch": ordinary, "launch_kept": cached, "launch_1_sync": with_syncs(1),
           "launch_7_syncs": with_syncs(7)}
    row = {"paths": {name: entry for name, entry in interleaved_loop_us(fns, smoke).items()}}
    log("floor  " + "  ".join(f"{k}={v['loop_us']:.1f}us" for k, v in row["paths"].items()))
    return row


# --- the public calls -------------------------------------------------------------------------


def _pool(free_pages: torch.Tensor, pages_per_call: int, P: int, impl: str):
    """An allocator whose free list starts with ``free_pages`` (the batch's), with room for a
    block of calls, and a function that puts that free list back."""
    first = int(free_pages.max()) + 1 if free_pages.numel() else 0
    extra = pages_per_call * (LOOP_CALLS + 2) + 64
    full = torch.cat([free_pages, torch.arange(first, first + extra, dtype=torch.int64,
                                               device=free_pages.device)])
    alloc = PagedTokenAllocator(first + extra, P, device=free_pages.device, impl=impl)

    def reset():
        alloc.free_pages = full

    reset()
    return alloc, full, reset


def bench_public_extend(case_list, page_sizes, smoke: bool, log=print) -> list[dict]:
    rows = []
    for P in page_sizes:
        for bs, mean in case_list:
            b = C.make_extend_batch(bs, mean, P)
            pre_cpu, seq_cpu = torch.tensor(b.prefix_cpu), torch.tensor(b.seq_cpu)
            row = {"case": f"{bs}x{mean}", "bs": bs, "tokens": b.extend_num_tokens, "page_size": P,
                   "new_pages": b.num_new_pages, "paths": {}, "agree": True}
            fns, resets = {}, {}
            lanes = next_pow2(b.extend_num_tokens)
            full = None
            for impl in ("fast", "teaching"):
                if impl == "teaching" and lanes > SEED_MAX_LANES:
                    row["paths"]["teaching"] = row["paths"]["teaching_host_lens"] = {
                        "skipped": f"its kernel would compile for {lanes} lanes"}
                    continue
                alloc, full, reset = _pool(b.free_pages, b.num_new_pages, P, impl)
                fns[impl] = lambda a=alloc: a.alloc_extend(b.prefix_lens, b.seq_lens, b.last_loc,
                                                           b.extend_num_tokens)
                fns[f"{impl}_host_lens"] = lambda a=alloc: a.alloc_extend(
                    b.prefix_lens, b.seq_lens, b.last_loc, b.extend_num_tokens, prefix_lens_cpu=pre_cpu,
                    seq_lens_cpu=seq_cpu)
                resets[impl] = resets[f"{impl}_host_lens"] = reset
            if lanes <= SEED_MAX_LANES:
                seed = SeedAllocator(full, P)  # the same free list as the allocators: room for a block

                def seed_reset(s=seed, f=full):
                    s.free_pages = f

                fns["seed_wrapper"] = lambda s=seed: s.alloc_extend(b.prefix_lens, b.seq_lens, b.last_loc,
                                                                    b.extend_num_tokens)
                resets["seed_wrapper"] = seed_reset
            else:
                row["paths"]["seed_wrapper"] = {"skipped": f"its kernel would compile for {lanes} lanes"}
            _measure_paths(row, fns, resets, smoke)
            log(f"public extend {row['case']:>9} P={P:<3} " + _summary(row))
            rows.append(row)
    return rows


def bench_public_decode(batches, page_sizes, smoke: bool, log=print) -> list[dict]:
    rows = []
    for P in page_sizes:
        for bs in batches:
            d = C.make_decode_batch(bs, P)
            seq_cpu = torch.tensor(d.seq_cpu)
            row = {"bs": bs, "page_size": P, "new_pages": d.num_new_pages, "paths": {}, "agree": True}
            fns, resets = {}, {}
            for impl in ("fast", "teaching"):
                alloc, full, reset = _pool(d.free_pages, d.num_new_pages, P, impl)
                fns[impl] = lambda a=alloc: a.alloc_decode(d.seq_lens, d.last_loc)
                fns[f"{impl}_host_lens"] = lambda a=alloc: a.alloc_decode(d.seq_lens, d.last_loc,
                                                                          seq_lens_cpu=seq_cpu)
                resets[impl] = resets[f"{impl}_host_lens"] = reset
            seed = SeedAllocator(full, P)

            def seed_reset(s=seed, f=full):
                s.free_pages = f

            fns["seed_wrapper"] = lambda s=seed: s.alloc_decode(d.seq_lens, d.last_loc)
            resets["seed_wrapper"] = seed_reset
            _measure_paths(row, fns, resets, smoke)
            log(f"public decode bs={bs:<5} P={P:<3} " + _summary(row))
            rows.append(row)
    return rows


def _measure_paths(row: dict, fns: dict, resets: dict, smoke: bool) -> None:
    """Each path of a case: its output and syncs per call (from a fresh state), then the
    interleaved loop timings, and whether every output agrees with the fast path's."""
    outs = {}
    for name, fn in fns.items():
        resets[name]()
        outs[name] = fn()
        resets[name]()
        row["paths"][name] = {"syncs": count_syncs(fn)}
    for name, entry in interleaved_loop_us(fns, smoke, resets=resets).items():
        row["paths"][name].update(entry)
    ref = outs["fast"]
    for name, out in outs.items():
        if out is None or not torch.equal(out, ref):
            row["agree"] = False
            row["paths"][name]["disagrees_with_fast"] = True


def _summary(row: dict) -> str:
    return "  ".join(f"{k}={v['loop_us']:.1f}us" for k, v in row["paths"].items() if "loop_us" in v)


# --- host time of the checks ------------------------------------------------------------------


def bench_host_checks(batches, page_size: int, smoke: bool, log=print) -> list[dict]:
    """Host time of the length handling alone (no device involved), per form of the copies."""
    rows = []
    for bs in batches:
        b = C.make_extend_batch(bs, 16, page_size, device="cpu")
        forms = {"cpu_tensor": (torch.tensor(b.prefix_cpu), torch.tensor(b.seq_cpu)),
                 "list": (b.prefix_cpu, b.seq_cpu)}
        row = {"bs": bs, "page_size": page_size}
        for form, (pre, seq) in forms.items():
            row[f"extend_{form}_us"] = host_us(lambda p=pre, s=seq: extend_counts(p, s, page_size),
                                               calls=20 if smoke else 200)
            row[f"decode_{form}_us"] = host_us(lambda s=seq: decode_counts(s, page_size),
                                               calls=20 if smoke else 200)
        log(f"host checks bs={bs}: " + "  ".join(f"{k}={v:.1f}" for k, v in row.items() if k.endswith("_us")))
        rows.append(row)
    return rows


def bench_page_table_checks(num_requests: int, page_size: int, smoke: bool, log=print) -> dict:
    """Host time of the page-table write's validation (``CacheManager.allocate_paged`` with the
    Triton writer runs it once per batch): ``num_requests`` entries, one row each."""
    from ..alloc.paging import _validated_entries

    pages = 4
    info = [(r, 1, 1 + pages) for r in range(num_requests)]
    table = torch.full((num_requests + 1, (pages + 1) * page_size), -1, dtype=torch.int32)
    allocated = torch.arange(num_requests * pages * page_size, dtype=torch.int64)
    us = host_us(lambda: _validated_entries(table, allocated, info, page_size), calls=20 if smoke else 500)
    log(f"page-table checks, {num_requests} entries: {us:.1f} us")
    return {"entries": num_requests, "page_size": page_size, "host_us": us}
