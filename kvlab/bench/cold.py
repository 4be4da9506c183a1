"""First calls in a fresh process (chapter 09): ``python -m kvlab.bench.cold [json]``.

:func:`run_fresh` starts this module in a new Python process with a new, empty
``TRITON_CACHE_DIR``: nothing compiled, nothing cached, nothing warmed but what the allocator's
constructor does. There it builds a ``PagedTokenAllocator`` per page size (timed: that is
where every compile happens) and then times the first call of each kind on batch sizes it
has not seen, up to 65,536 requests. A compile inside a call would show as hundreds of ms.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

#: batch sizes of the first calls: both sides of every launch-shape boundary, up to 2^16
COLD_BATCHES = [1, 3, 100, 1000, 1025, 3000, 4096, 4097, 10000, 65536]
COLD_PAGE_SIZES = [16, 64]
_KINDS = ("extend_host_lens", "decode_host_lens", "extend", "decode")


def measure(page_sizes: list[int], batches: list[int]) -> dict:
    """In this process: construction, then first calls (ms, synchronised before and after)."""
    import torch

    from ..alloc.token_allocator import PagedTokenAllocator
    from .timing import first_call_ms

    out: dict = {"construct": [], "first_calls": []}
    for P in page_sizes:
        t0 = time.perf_counter()
        alloc = PagedTokenAllocator(4 * max(batches) + 64, P)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out["construct"].append({"page_size": P, "ms": (time.perf_counter() - t0) * 1e3,
                                 "compile_seconds": alloc.compile_seconds})
        dev = alloc.device
        for bs in batches:
            def t(values):
                return torch.tensor(values, dtype=torch.int64, device=dev)

            seq = [1 + r % 3 for r in range(bs)]            # 1-3 tokens: one new page each
            zero, seq_d, none = t([0] * bs), t(seq), t([-1] * bs)
            seq_cpu, zero_cpu = torch.tensor(seq), torch.zeros(bs, dtype=torch.int64)
            ends = torch.cumsum(seq_d, 0) - 1
            dec = [s + 1 for s in seq]
            dec_d, dec_cpu = t(dec), torch.tensor(dec)
            row = {"page_size": P, "bs": bs}
            slots = {}

            def extend(host: bool):
                kw = dict(prefix_lens_cpu=zero_cpu, seq_lens_cpu=seq_cpu) if host else {}
                slots["extend"] = alloc.alloc_extend(zero, seq_d, none, sum(seq), **kw)

            def decode(host: bool):
                kw = dict(seq_lens_cpu=dec_cpu) if host else {}
                slots["decode"] = alloc.alloc_decode(dec_d, slots["last"], **kw)

            for kind in _KINDS:
                host = kind.endswith("host_lens")
                if kind.startswith("decode"):  # each request's last slot, gathered outside the clock
                    slots["last"] = slots["extend"][ends]
                row[kind] = first_call_ms(lambda: (extend if kind.startswith("extend") else decode)(host))
                if kind.startswith("decode"):  # a request's pages, all of them, go back
                    alloc.free(torch.cat([slots["extend"], slots["decode"]]))
            alloc.check_device_errors()
            out["first_calls"].append(row)
    return out


def run_fresh(page_sizes: list[int] | None = None, batches: list[int] | None = None,
              timeout_s: int = 600) -> dict:
    """:func:`measure` in a new process with an empty Triton cache; its result."""
    import kvlab

    page_sizes = page_sizes or COLD_PAGE_SIZES
    batches = batches or COLD_BATCHES
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvlab.__file__)))
    with tempfile.TemporaryDirectory(prefix="kvlab-triton-cache-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        proc = subprocess.run([sys.executable, "-m", "kvlab.bench.cold",
                               json.dumps({"page_sizes": page_sizes, "batches": batches})],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["command"] = "TRITON_CACHE_DIR=<new empty dir> python -m kvlab.bench.cold"
    return result


if __name__ == "__main__":
    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    res = measure(args.get("page_sizes", COLD_PAGE_SIZES), args.get("batches", COLD_BATCHES))
    print(json.dumps(res))
