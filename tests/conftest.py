"""Shared test set-up: hypothesis profiles sized for the runtime, GPU markers."""
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


def pytest_collection_modifyitems(config, items):
    if runtime.INTERPRET:
        skip = pytest.mark.skip(reason="needs CUDA (compiled Triton)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def device():
    """The runtime's device: cuda with compiled Triton, cpu in the interpreter."""
    return runtime.DEVICE
