"""What executing a chapter must show, beyond "no cell raised" (which nbval checks).

* A learner notebook (``notebooks/NN_*.ipynb``) runs top to bottom before anything is written:
  each exercise whose starter it holds (a ``# YOUR CODE HERE: <exercise>`` line) is reported
  exactly once as ``not attempted yet: <exercise>``, and nothing else is.
* A solutions notebook (``notebooks/solutions/NN_*.ipynb``) never prints ``not attempted yet``:
  every checker in it ran on an answer (and passed, or its cell would have raised).

The check runs when the last cell of a notebook has run, on the outputs nbval collected.

With ``KVLAB_SAVE_EXECUTED=<folder>`` (``make test-notebooks`` sets it), each solutions
notebook that ran without a failing cell is also written there with its outputs, for the
website (``tools/executed_notebooks.py``): ``make site`` then executes nothing twice.
"""
from __future__ import annotations

import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from executed_notebooks import ENV_VAR, record_nbval_cell  # noqa: E402

if os.environ.get(ENV_VAR):
    # The kernels inherit the environment: a runner's MPLBACKEND=Agg would keep every figure
    # out of the outputs the website shows.
    os.environ.pop("MPLBACKEND", None)

_NOT_ATTEMPTED = re.compile(r"^not attempted yet: (\w+)", re.M)
_MARKER = re.compile(r"#\s*YOUR CODE HERE: (\w+)")

_reported: dict[Path, Counter] = defaultdict(Counter)
_failed: set[Path] = set()


def _notebook(item) -> Path | None:
    path = getattr(item.parent, "path", None)
    return Path(path) if path is not None and str(path).endswith(".ipynb") else None


def _text(output) -> str:
    if output.get("output_type") == "stream":
        text = output.get("text", "")
    else:
        text = output.get("data", {}).get("text/plain", "")
    return "".join(text) if isinstance(text, list) else text


def _problem(path: Path) -> str | None:
    """What is wrong with the 'not attempted yet' lines of a finished notebook, if anything."""
    reported = _reported.pop(path, Counter())
    if path.parent.name == "solutions":
        if reported:
            return (f"{path.name} (solutions) printed 'not attempted yet' for {sorted(reported)}: "
                    "an exercise cell there holds a starter instead of the answer")
        return None
    nb = nbformat.read(path, as_version=4)
    starters = {m for c in nb.cells if c.cell_type == "code" for m in _MARKER.findall(c.source)}
    twice = sorted(n for n, k in reported.items() if k > 1)
    if twice:
        return f"{path.name}: 'not attempted yet' printed more than once for {twice}"
    if set(reported) != starters:
        return (f"{path.name}: the exercises reported 'not attempted yet' {sorted(reported)} "
                f"differ from the starters it holds {sorted(starters)}")
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = _notebook(item)
    if path is None or call.when != "call":
        return
    for output in getattr(item, "test_outputs", None) or []:
        _reported[path].update(_NOT_ATTEMPTED.findall(_text(output)))
    if report.failed:
        _failed.add(path)
    n_code = sum(c.cell_type == "code" for c in item.parent.nb.cells)
    if getattr(item, "cell_num", -1) != n_code - 1 or path in _failed:
        return  # not the last cell yet, or nbval already reports a failing cell
    problem = _problem(path)
    if problem:
        report.outcome = "failed"
        report.longrepr = problem


def pytest_runtest_teardown(item):
    record_nbval_cell(item)
