"""Which GPUs the course runs on, and the 16-bit float type a chapter uses on each.

CI compiles every Triton kernel of the package and every exercise's solution kernel for
:data:`CI_ARCHS` (``tests/test_gpu_targets.py``: Triton's compiler with an explicit target,
which needs no GPU), with the dtypes the chapters use there:

    arch       GPUs (examples)                 16-bit K/V   compiled for in CI
    sm_75      T4 (Colab's free GPU)           float16      yes
    sm_80-89   A100 (80), A10 (86), L4 (89)    bfloat16     sm_80 (Triton compiles for the GPU's own)
    sm_90      H100, H200                      bfloat16     yes (and the GPU check runs there)
    below 75   V100 (70), P100 (60)            float16      no: older than CI's oldest target

bfloat16 arithmetic arrived with sm_80 (Ampere): on a T4, torch calls bfloat16 supported only
by emulation (``torch.cuda.is_bf16_supported(including_emulation=False)`` is False below
compute capability 8), so a chapter that keeps its K/V pool in 16 bits picks float16 there and
says so (``kvlab.base.runtime.half_dtype()`` and ``half_note``). Triton's interpreter on a CPU
takes bfloat16. This module imports only torch; the runtime report (:mod:`kvlab.base.runtime`)
prints the GPU's :meth:`GpuFit.headline`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

#: the compute capabilities CI compiles every kernel for (major * 10 + minor)
CI_ARCHS = (75, 80, 90)
#: the first compute capability with bfloat16 arithmetic (Ampere)
BF16_ARCH = 80
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


class GpuFit(NamedTuple):
    """A GPU and what the course does on it."""
    name: str  # "Tesla T4"
    arch: int  # 75 for sm_75

    @property
    def half(self) -> torch.dtype:
        """The 16-bit float type chapters keep K/V in on this GPU."""
        return half_for_arch(self.arch)

    @property
    def every_chapter_runs(self) -> bool:
        """Not older than CI's oldest target (every kernel is compiled for each of CI_ARCHS)."""
        return self.arch >= min(CI_ARCHS)

    def headline(self) -> str:
        """``sm_75: every chapter runs on it`` (after the GPU's name in the runtime report)."""
        if self.arch in CI_ARCHS:
            verdict = "every chapter runs on it"
        elif self.every_chapter_runs:
            verdict = "every chapter should run on it"
        else:
            verdict = f"chapters may not run on it (older than sm_{min(CI_ARCHS)})"
        return f"sm_{self.arch}: {verdict}"

    def detail(self) -> str:
        """What the headline rests on, and what the chapters do differently here."""
        archs = ", ".join(f"sm_{a}" for a in CI_ARCHS)
        if not self.every_chapter_runs:
            return ("A chapter's kernels may not compile here; KVLAB_INTERPRET=1 runs them in "
                    "Triton's interpreter instead")
        text = (f"CI compiles every kernel for {archs}" + (
            "" if self.arch in CI_ARCHS else f", not sm_{self.arch}: Triton compiles them for this "
                                             "GPU when a chapter first calls them"))
        if self.half != torch.bfloat16:
            text += (f"; chapters keep 16-bit K/V in {_NAMES[self.half]} here (bfloat16 needs "
                     f"sm_{BF16_ARCH})")
        return text


def arch_of(capability: tuple[int, int]) -> int:
    major, minor = capability
    return major * 10 + minor


def half_for_arch(arch: int | None) -> torch.dtype:
    """bfloat16 from sm_80 on (and in the interpreter: ``arch`` None), float16 before."""
    return torch.bfloat16 if arch is None or arch >= BF16_ARCH else torch.float16


def fit(name: str, capability: tuple[int, int]) -> GpuFit:
    return GpuFit(name, arch_of(capability))


def this_gpu() -> GpuFit | None:
    """The GPU torch uses now, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return fit(torch.cuda.get_device_name(), torch.cuda.get_device_capability())


def half_note(dtype: torch.dtype, gpu: GpuFit | None) -> str:
    """Why a chapter keeps K/V in ``dtype`` on ``gpu`` (None: the interpreter), in a sentence."""
    if gpu is None:
        return f"{_NAMES[dtype]} (Triton's interpreter, on the CPU)"
    if dtype == torch.float16 and gpu.arch < BF16_ARCH:
        return (f"float16, not bfloat16: this {gpu.name} (sm_{gpu.arch}) has no bfloat16 "
                f"arithmetic, which arrived with sm_{BF16_ARCH}; float16 is as small")
    return f"{_NAMES[dtype]} (this {gpu.name}, sm_{gpu.arch}, computes in it)"
