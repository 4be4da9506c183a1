"""``python -m kvlab.bench [--out DIR] [--smoke] [--no-trap] [--public-only]`` (chapter 09).

On CUDA: the full suite, written to ``--out`` (default ``figures/``): ``bench.json``,
``bench.md`` (with the command that produced it) and the ``09_*.png`` plots. For honest
first-call numbers in this process, start it with an empty Triton cache, e.g.
``TRITON_CACHE_DIR=$(mktemp -d)``; the fresh-process first calls make their own.
Without CUDA: a smoke run of the harness (no timing claims), written to a temporary folder
unless ``--out`` is given, so it never overwrites the GPU results in ``figures/``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("MPLBACKEND", "Agg")

from .. import runtime  # noqa: E402
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
    args = ap.parse_args(argv)
    smoke = args.smoke or runtime.INTERPRET
    out = args.out
    if out is None:
        out = os.path.join(tempfile.gettempdir(), "kvlab-bench-smoke") if smoke else "figures"
    res = run(smoke=smoke, trap=not args.no_trap, public_only=args.public_only)
    write_outputs(res, out)
    print()
    for t in res["targets"]:
        verdict = "n/a (smoke)" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        print(f"[{verdict}] {t['name']}: {t['measured']}  (rule: {t['rule']})")
    if smoke:
        print("smoke run: the harness works; these are not timings.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
