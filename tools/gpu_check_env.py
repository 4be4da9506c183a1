"""Pre-flight for ``make gpu-check``: can this Python run the tests and every notebook?

    python tools/gpu_check_env.py [--require-gpu]

Checks, before anything slow starts, that every module the run needs imports (and says which
wheels folder to pass as ``GPU_WHEELS`` when Jupyter's packages are missing), that ``kvlab``
comes from this checkout, and with ``--require-gpu`` that kvlab compiles Triton for CUDA rather
than falling back to the interpreter (the notebooks run in a kernel that inherits this
environment, so they would silently run in the interpreter too).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> what needs it
NEEDED = {
    "torch": "kvlab", "triton": "kvlab's kernels", "matplotlib": "figures",
    "pytest": "the test runner", "hypothesis": "the unit tests",
    "nbformat": "nbval", "nbval.plugin": "executing notebooks",
    "jupyter_client": "nbval's kernel", "ipykernel.kernelapp": "nbval's kernel",
    "IPython": "the kernel", "ipywidgets": "chapter 07's explorer",
    "matplotlib_inline.backend_inline": "inline figures",
    "transformers": "chapter 10 and kvlab.serving.hf", "jupytext": "the notebook build tests",
}


def main(argv: list[str]) -> int:
    require_gpu = "--require-gpu" in argv
    missing = []
    for module, why in NEEDED.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - report every broken import, not just the first
            missing.append(f"  {module} (for {why}): {type(exc).__name__}: {exc}")
    if missing:
        print("gpu-check: this Python cannot run the check; missing or broken:", file=sys.stderr)
        print("\n".join(missing), file=sys.stderr)
        print("  Offline? Bring the wheels along and pass their folder(s): "
              "make gpu-check GPU_WHEELS=<dir>", file=sys.stderr)
        return 1
    import kvlab

    where = Path(kvlab.__file__).resolve().parent
    if where != ROOT / "kvlab":
        print(f"gpu-check: kvlab is imported from {where}, not from this checkout "
              f"({ROOT / 'kvlab'}); run from the repository root", file=sys.stderr)
        return 1
    info = kvlab.base.runtime.runtime_info()
    print(f"gpu-check: python {info.python_version}, torch {info.torch_version}, "
          f"triton {info.triton_version}, kvlab from {where}, mode {info.mode} "
          f"({info.device_name})")
    if require_gpu and kvlab.INTERPRET:
        print("gpu-check: kvlab is in interpreter mode (no CUDA, or KVLAB_INTERPRET=1); "
              "this target checks compiled Triton. Use GPU_REQUIRE=0 for a dry run.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
