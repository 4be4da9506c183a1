"""Which runtime are we on: compiled Triton on a GPU, or Triton's interpreter on the CPU.

This module is imported first by ``kvlab/__init__.py``. Without CUDA it sets
``TRITON_INTERPRET=1`` *before any kernel is defined*, because ``@triton.jit`` decides
at definition time whether a kernel is compiled or interpreted.

Override with ``KVLAB_INTERPRET=1`` (force the interpreter even on a GPU machine) or
``KVLAB_INTERPRET=0`` (never switch; only useful when CUDA is present).
"""
from __future__ import annotations

import os
import platform
import sys
from typing import NamedTuple


def _want_interpreter() -> bool:
    forced = os.environ.get("KVLAB_INTERPRET")
    if forced is not None and forced.strip() != "":
        return forced.strip() not in ("0", "false", "False", "no")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True  # the learner asked for the interpreter themselves
    import torch

    return not torch.cuda.is_available()


INTERPRET: bool = _want_interpreter()
_TRITON_WAS_IMPORTED_EARLY = "triton" in sys.modules

if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402  (after the environment variable, on purpose)

from . import gpus, triton_compat  # noqa: E402

if INTERPRET:
    # known Triton/NumPy breakages of the interpreter, mended for the versions that need it
    triton_compat.apply_fixes()

#: Where kvlab puts its tensors: ``"cuda"`` when kernels are compiled, else ``"cpu"``
#: (the interpreter runs Triton programs on CPU tensors). With an index (``cuda:0``), so that
#: it compares equal to ``tensor.device``.
DEVICE: torch.device = (
    torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())
)


def default_device(device: "torch.device | str | None" = None) -> torch.device:
    """``device`` if given, else the runtime's device (``cuda`` or ``cpu``)."""
    return torch.device(device) if device is not None else DEVICE


def can_pin_memory() -> bool:
    """Pinned (page-locked) host memory needs a CUDA driver; on a CPU build it raises."""
    return torch.cuda.is_available()


def pick(cpu, gpu):
    """Choose a problem size by runtime: small in the interpreter, larger on a GPU."""
    return cpu if INTERPRET else gpu


def _gpu() -> "gpus.GpuFit | None":
    return None if INTERPRET else gpus.this_gpu()


def half_dtype() -> torch.dtype:
    """The 16-bit float type a chapter keeps K/V in here: bfloat16 on GPUs from sm_80 on and in
    the interpreter, float16 on older GPUs such as Colab's T4 (:mod:`kvlab.base.gpus`)."""
    gpu = _gpu()
    return gpus.half_for_arch(gpu.arch if gpu else None)


def half_note(dtype: torch.dtype) -> str:
    """Why ``dtype`` (:func:`half_dtype`'s choice) here, in a sentence."""
    return gpus.half_note(dtype, _gpu())


class RuntimeInfo(NamedTuple):
    mode: str  # "gpu" or "interpreter"
    device: str
    device_name: str
    torch_version: str
    triton_version: str
    python_version: str
    advice: str
    numpy_version: str = "?"
    fixes: tuple[str, ...] = ()  # known Triton/NumPy issues kvlab mended (kvlab.base.triton_compat)
    warnings: tuple[str, ...] = ()  # version problems, each with its fix
    course_fit: str = ""  # on a GPU: its arch and whether every chapter runs on it (kvlab.base.gpus)

    def __str__(self) -> str:
        where = f"{self.device_name}, {self.course_fit}" if self.course_fit else self.device_name
        text = (
            f"kvlab runtime: {self.mode} ({where})\n"
            f"  torch {self.torch_version}, triton {self.triton_version}, "
            f"numpy {self.numpy_version}, python {self.python_version}\n  {self.advice}"
        )
        for key in self.fixes:
            text += f"\n  (applied kvlab's fix for a known Triton/NumPy issue: {key})"
        for warning in self.warnings:
            text += f"\n  WARNING: {warning}"
        return text


def runtime_info() -> RuntimeInfo:
    triton_version, numpy_version = triton_compat.versions()
    fit = ""
    if INTERPRET:
        mode, name = "interpreter", f"CPU: {platform.processor() or platform.machine()}"
        advice = (
            "Triton kernels run in the interpreter: each program instance executes on the CPU, "
            "one after another (roughly 1-5 ms each), so the chapters use small sizes here. "
            "Integer kernels (allocation, page tables) give exactly the GPU's results; floating-point "
            "attention agrees up to rounding. Timings are not meaningful. A GPU runtime (e.g. Colab) "
            "compiles the kernels."
        )
    else:
        gpu = gpus.this_gpu()
        mode, name, fit = "gpu", gpu.name, gpu.headline()
        advice = (
            f"{gpu.detail()}. Triton kernels are compiled for the "
            "GPU: the first call of each kernel compiles it (about a second), later calls take "
            "microseconds. The chapters use larger sizes here."
        )
    if _TRITON_WAS_IMPORTED_EARLY and INTERPRET:
        advice += (
            " Note: triton was imported before kvlab; kernels defined before that import "
            "may not run in the interpreter. Import kvlab first."
        )
    return RuntimeInfo(
        mode=mode,
        device=str(DEVICE),
        device_name=name,
        torch_version=torch.__version__,
        triton_version=triton_version,
        python_version=platform.python_version(),
        advice=advice,
        numpy_version=numpy_version,
        # (the speed-ups change no result: not a line of the report)
        fixes=tuple(k for k in triton_compat.applied_fixes() if k not in triton_compat.SPEEDUPS),
        warnings=tuple(triton_compat.problems(INTERPRET)),
        course_fit=fit,
    )


def runtime_report() -> RuntimeInfo:
    """Print (and return) which mode kvlab runs in and what that means for speed."""
    info = runtime_info()
    print(info)
    return info
