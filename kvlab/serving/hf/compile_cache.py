"""Compile once, reuse across runs: where the compiled decode step is kept (chapter 09).

``torch.compile`` of the decode step costs tens of seconds at start-up, almost all of it the
same work every time: the same model code, the same symbolic batch size, the same versions.
Its inductor stage caches what it builds on disk (the FX graph cache and the AOTAutograd
cache, with the Triton kernels it generated) under ``TORCHINDUCTOR_CACHE_DIR``, by default a
folder of the system's temporary directory that a reboot or a cleaner may empty. kvlab points
it at a folder of its own (:func:`compile_cache_dir`), one per torch / Triton / GPU
combination, so a second start on the same machine loads the compiled kernels instead of
generating and compiling them again. Only what cannot be cached stays: tracing the Python code
(dynamo) and capturing the CUDA graphs.

The folder is ``$KVLAB_CACHE_DIR/compile/<versions>`` (default ``~/.cache/kvlab``). A
``TORCHINDUCTOR_CACHE_DIR`` set by the user, or by an earlier compile in the process, wins:
kvlab never moves a cache that is already in use. SGLang documents the same practice for its
``--enable-torch-compile`` (set ``TORCHINDUCTOR_CACHE_DIR``, run once, reuse or copy the folder).
"""
from __future__ import annotations

import os
import re

import torch

__all__ = ["compile_cache_dir", "use_compile_cache"]


def _versions() -> str:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    text = f"torch-{torch.__version__}_triton-{triton.__version__}_{gpu}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", text)


def compile_cache_dir() -> str:
    """kvlab's folder for compiled artefacts of this torch, Triton and GPU."""
    root = os.environ.get("KVLAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvlab")
    return os.path.join(root, "compile", _versions())


def use_compile_cache() -> str:
    """Point inductor's caches at :func:`compile_cache_dir` unless a cache folder is set already
    (by the user, or by a compile earlier in this process); returns the folder in use."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current:
        return current
    folder = compile_cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:           # not writable here: inductor's own default stays
        return ""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder
