"""What ``make test-oldest`` runs again on the oldest supported Triton: every test file that
imports Triton itself is among those marked ``triton`` (``tests/conftest.py``), and every name
there is a test file."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import TRITON_VERSION_TESTS

TESTS = Path(__file__).resolve().parent
_USES_TRITON = re.compile(r"^\s*(?:import triton|from triton\b)|@triton\.jit", re.M)


def test_every_test_file_that_imports_triton_runs_on_the_oldest_triton_too():
    using = {p.stem for p in TESTS.glob("test_*.py") if _USES_TRITON.search(p.read_text())}
    assert using, "no test file imports Triton: the pattern is wrong"
    missing = sorted(using - TRITON_VERSION_TESTS)
    assert not missing, (f"{missing} import Triton: add them to TRITON_VERSION_TESTS in "
                         "tests/conftest.py (or keep Triton out of them)")


def test_every_file_named_for_the_oldest_triton_exists():
    assert TRITON_VERSION_TESTS <= {p.stem for p in TESTS.glob("test_*.py")}
