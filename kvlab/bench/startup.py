"""Start-up of the serving generator, cold and warm (chapter 09): ``python -m kvlab.bench.startup``.

The serving benchmark's generator (:func:`kvlab.bench.serve.kvlab_generator`: the decode step
compiled, CUDA graphs captured at every size up to 256) is built in a fresh Python process
twice, with the same new, empty cache folders (``KVLAB_CACHE_DIR``, ``TRITON_CACHE_DIR``):

* **cold** -- nothing compiled: torch.compile traces, generates and compiles every kernel, and
  Triton compiles kvlab's own kernels;
* **warm** -- the second process finds what the first one left in the folders
  (:mod:`kvlab.serving.hf.compile_cache`): the compiled artefacts are loaded, not built.

Each process reports the seconds its generator took to build (the model is built before the
clock starts), the graphs torch.compile built, and the cache folder it used.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

#: the issue's target for the warm start, seconds
WARM_LIMIT_S = 10.0
#: what "reused" means here: the warm start at most this share of the cold one
REUSE_LIMIT = 0.5


def measure(smoke: bool) -> dict:
    """In this process: the serving model, then its generator, timed."""
    import torch

    from ..base import runtime
    from ..serving.hf.graphs import dynamo_graphs
    from .serve import kvlab_generator, serve_model

    model = serve_model(runtime.DEVICE, smoke)
    if runtime.DEVICE.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen = kvlab_generator(model, smoke)
    if runtime.DEVICE.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    graphs = gen.graphs
    return dict(seconds=seconds, compiled=bool(graphs is not None and graphs.compiled),
                sizes=len(graphs.sizes) if graphs is not None else 0, dynamo_graphs=dynamo_graphs(),
                cache=getattr(graphs, "compile_cache", None))


def run_cold_and_warm(smoke: bool, timeout_s: int = 300) -> dict:
    """:func:`measure` in two fresh processes sharing new, empty cache folders."""
    import kvlab

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvlab.__file__)))
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvlab-startup-") as cache:
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR",)}
        env.update(KVLAB_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        for name in ("cold", "warm"):
            t0 = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, "-m", "kvlab.bench.startup", json.dumps({"smoke": smoke})],
                                      env=env, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                out[name] = dict(error=f"timed out after {timeout_s} s")
                break
            if proc.returncode != 0:
                out[name] = dict(error=f"exit {proc.returncode}: {proc.stderr[-1500:]}")
                break
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            out[name]["process_s"] = time.perf_counter() - t0
    out["command"] = ("KVLAB_CACHE_DIR=<new empty dir> TRITON_CACHE_DIR=<new empty dir>/triton "
                      "python -m kvlab.bench.startup, twice")
    return out


def targets(startup: dict, smoke: bool) -> list[dict]:
    """The issue's rule for start-up: at most ten seconds, or the compile artefacts reused across
    runs (a warm start well under the cold one): one target each."""
    cold, warm = startup.get("cold", {}), startup.get("warm", {})
    cs, ws = cold.get("seconds"), warm.get("seconds")
    share = ws / cs if cs and ws is not None else None
    return [dict(name="start-up of the compiled serving generator, warm (compile artefacts reused)",
                 rule=f"seconds <= {WARM_LIMIT_S} (cold: {_s(cs)})", limit=WARM_LIMIT_S,
                 measured=None if ws is None else round(ws, 1),
                 passed=None if smoke else ws is not None and ws <= WARM_LIMIT_S),
            dict(name="start-up: compile artefacts reused across runs (warm / cold)",
                 rule=f"warm / cold <= {REUSE_LIMIT}", limit=REUSE_LIMIT,
                 measured=None if share is None else round(share, 2),
                 passed=None if smoke else share is not None and share <= REUSE_LIMIT)]


def _s(x) -> str:
    return "not measured" if x is None else f"{x:.1f} s"


if __name__ == "__main__":
    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    print(json.dumps(measure(bool(args.get("smoke", False)))))
