"""Shared test set-up: hypothesis profiles sized for the runtime, GPU markers, and which tests
depend on Triton's version (marker ``triton``: ``make test-oldest`` runs those again on the
oldest supported Triton)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Checks record the learner's progress (kvlab.course.checking.progress_file): tests, and the notebooks and
# JupyterLab they start, write it to a folder of their own, never into the real home.
_PROGRESS_DIR = tempfile.mkdtemp(prefix="kvlab-progress-")
atexit.register(shutil.rmtree, _PROGRESS_DIR, True)
os.environ["KVLAB_PROGRESS_FILE"] = os.path.join(_PROGRESS_DIR, "progress.json")

import kvlab  # noqa: E402,F401  (decides the runtime before any kernel module is imported)
from kvlab.base import runtime  # noqa: E402

# The interpreter runs each Triton program on the CPU (~ms each): fewer examples there.
settings.register_profile(
    "interpreter", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu", max_examples=200, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("KVLAB_HYPOTHESIS_PROFILE",
                                     "interpreter" if runtime.INTERPRET else "gpu"))


def pytest_configure(config):
    if os.environ.get("KVLAB_REQUIRE_GPU") == "1" and runtime.INTERPRET:
        raise pytest.UsageError("KVLAB_REQUIRE_GPU=1 but kvlab is in interpreter mode (no CUDA?)")


#: The test files whose subject depends on Triton's version: kernels against their references
#: (and the state machines that drive them), the checkers that interpret or compile a learner's
#: kernel, the compiler's GPU targets, the version fixes. Each test here gets the marker
#: ``triton``; ``make test-oldest`` runs them (``-m triton``) on the oldest supported Triton. The
#: rest (the prefix caches, the cache manager, the serving loop, transformers, the website...)
#: runs once, on the newest. A test file that imports Triton itself must be here
#: (tests/test_oldest_triton.py checks).
TRITON_VERSION_TESTS = frozenset({
    "test_paging", "test_alloc_kernel_edges", "test_alloc_host_path", "test_token_allocator",
    "test_alloc_reliability", "test_allocator_machine", "test_fast_alloc",
    "test_attention", "test_fast_attention", "test_hf_attention",
    "test_attention_kernel_exercise", "test_hf_check", "test_compiled", "test_sandbox",
    "test_mutations", "test_check_core", "test_not_attempted", "test_lifts",
    "test_gpu_targets", "test_triton_compat",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in TRITON_VERSION_TESTS:
            item.add_marker(pytest.mark.triton)
    if runtime.INTERPRET:
        skip = pytest.mark.skip(reason="needs CUDA (compiled Triton): make gpu-check runs it on a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def kernel_run(monkeypatch):
    """``kernel_run(kernel, fn)``: ``kernel.run`` is ``fn`` for this test only.

    Not ``monkeypatch.setattr(kernel, "run", fn)``: on an instance its undo leaves the bound
    class method behind as an instance attribute, which hides the class's ``run`` from every
    later patch of it (tests/gpu_targets.py records launches by patching the class)."""
    def patch(kernel, fn):
        monkeypatch.setitem(vars(kernel), "run", fn)
    return patch


@pytest.fixture
def device():
    """The runtime's device: cuda with compiled Triton, cpu in the interpreter."""
    return runtime.DEVICE
