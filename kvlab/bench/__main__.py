"""``python -m kvlab.bench [--out DIR] [--smoke] [--no-trap] [--public-only] [--serve] [--attention]
[--memory]`` (chapters 09, 10, 12).

On CUDA: the full suite, written to ``--out`` (default ``figures/``): ``bench.json``,
``bench.md`` (with the command that produced it) and the ``09_*.png`` plots. For honest
first-call numbers in this process, start it with an empty Triton cache, e.g.
``TRITON_CACHE_DIR=$(mktemp -d)``; the fresh-process first calls make their own.
Without CUDA: a smoke run of the harness (no timing claims), written to a temporary folder
unless ``--out`` is given, so it never overwrites the GPU results in ``figures/``.

``--serve``: only the serving benchmark of chapter 10 (:mod:`kvlab.bench.serve`: offline and
online workloads, the GPU's busy share of a decode step), added to the ``bench.json`` already
in the output folder (under ``"serve"``), ``bench.md`` written again from it, and
``10_bench_serve.png``. Without CUDA, a smoke run of it (a tiny model).

``--attention``: only the decode-attention benchmark of chapter 09 (:mod:`kvlab.bench.decode`:
the attention kernels and the whole decode step against the HBM floor), added to ``bench.json``
the same way (under ``"attention"``), with ``09_bench_attention.png``.

``--memory``: only the memory-policy benchmark of chapter 12 (:mod:`kvlab.bench.memory`), added
the same way (under ``"memory"``), with ``12_bench_memory.png``; a ``PASS``/``FAIL`` line per
claim of where each policy wins.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("MPLBACKEND", "Agg")

from ..base import runtime  # noqa: E402
from .report import write_outputs  # noqa: E402
from .suite import run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench",
                                 description=__doc__.replace("``", ""),  # plain in a terminal
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: figures/ on a GPU)")
    ap.add_argument("--smoke", action="store_true", help="tiny harness run, no timing claims")
    ap.add_argument("--no-trap", action="store_true", help="skip the one slow recompile demonstration")
    ap.add_argument("--public-only", action="store_true", help="only the public calls, floor and first calls")
    ap.add_argument("--serve", action="store_true", help="only the serving benchmark (chapter 10)")
    ap.add_argument("--attention", action="store_true",
                    help="only the decode-attention benchmark (chapter 09: kernels and decode step vs the HBM floor)")
    ap.add_argument("--memory", action="store_true", help="only the memory-policy benchmark (chapter 12)")
    args = ap.parse_args(argv)
    smoke = args.smoke or runtime.INTERPRET
    out = args.out
    if out is None:
        out = os.path.join(tempfile.gettempdir(), "kvlab-bench-smoke") if smoke else "figures"
    if args.memory:
        res = memory_main(out, smoke)
        targets = res["memory"]["claims"]
    elif args.serve:
        res = serve_main(out, smoke)
        targets = res["serve"]["targets"]
    elif args.attention:
        res = attention_main(out, smoke)
        targets = res["attention"]["targets"]
    else:
        res = run(smoke=smoke, trap=not args.no_trap, public_only=args.public_only)
        write_outputs(res, out)
        targets = res["targets"]
    print()
    for t in targets:
        verdict = "n/a (smoke)" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        print(f"[{verdict}] {t['name']}: {t['measured']}  (rule: {t['rule']})")
    if smoke:
        print("smoke run: the harness works; these are not timings.")
    return 0


def serve_main(out: str, smoke: bool) -> dict:
    """Run the serving benchmark; keep whatever else ``out/bench.json`` holds (and, while it
    runs, what it has measured so far in ``out/bench.serve-partial.json``)."""
    import json
    import time

    from .serve import run_serve

    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    partial = os.path.join(out, "bench.serve-partial.json")

    def checkpoint(serve: dict) -> None:   # what a run cut short has measured so far
        with open(partial, "w") as f:
            json.dump(serve, f, indent=1, default=str)

    serve = run_serve(smoke=smoke, checkpoint=checkpoint)
    res = _add_part(out, "serve", serve, smoke, "10_bench_serve.png", started=t0)
    os.remove(partial)
    return res


def memory_main(out: str, smoke: bool) -> dict:
    """Run the memory-policy benchmark; keep whatever else ``out/bench.json`` holds."""
    import time

    from .memory import run_memory

    t0 = time.perf_counter()
    return _add_part(out, "memory", run_memory(smoke=smoke), smoke, "12_bench_memory.png", started=t0)


def attention_main(out: str, smoke: bool) -> dict:
    """Run the decode-attention benchmark; keep whatever else ``out/bench.json`` holds."""
    from .decode import run_attention

    return _add_part(out, "attention", run_attention(smoke=smoke), smoke, "09_bench_attention.png")


def _add_part(out: str, key: str, part: dict, smoke: bool, plot: str, started: float | None = None) -> dict:
    """Stamp ``part`` with where and how it ran (and its seconds since ``started``), store it
    under ``key`` of ``out/bench.json`` beside whatever else that file holds, and write the
    outputs again with its ``plot``."""
    import time

    from .report import load
    from .suite import _meta

    meta = _meta(smoke)
    try:
        import transformers
        version = transformers.__version__
    except ImportError:
        version = None
    part["meta"] = dict(device=meta["device"], torch=meta["torch"], triton=meta["triton"],
                        transformers=version, date=meta["date"], command=meta["command"])
    if started is not None:
        part["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    path = os.path.join(out, "bench.json")
    res = load(path) if os.path.exists(path) else {}
    res[key] = part
    write_outputs(res, out, plots=[plot])
    return res


if __name__ == "__main__":
    sys.exit(main())
