"""What executing a chapter must show, beyond "no cell raised" (which nbval checks).

* A learner notebook (``notebooks/NN_*.ipynb``) runs top to bottom before anything is written:
  each exercise whose starter it holds (a ``# YOUR CODE HERE: <exercise>`` line) is reported
  exactly once as ``not attempted yet: <exercise>``, and nothing else is.
* A solutions notebook (``notebooks/solutions/NN_*.ipynb``) never prints ``not attempted yet``:
  every checker in it ran on an answer (and passed: a failed check shows an error output, which
  nbval reports, although in a notebook it does not stop Run All).
* No cell echoes what a call of ``kvlab.check`` or ``kvlab.solutions`` returned (an ``Out[..]``
  under a checker, a hint or a solution that was printed already): :func:`stray_echo`.
* Every figure a notebook shows is legible in JupyterLab: at most 8.4 in wide, and its smallest
  text at least 9 px tall in an 848 px output area (:mod:`kvlab.course.viz.legibility`). The kernels inherit
  ``KVLAB_FIGURE_AUDIT``, set here to a file of this worker's, so ``import kvlab`` measures
  each figure as it is rendered; the file is emptied when a notebook starts.

The stray-echo check runs after each cell; the others when the last cell of a notebook has run,
on the outputs nbval collected. The notebooks' kernels record the learner's progress in a folder
of their own (``KVLAB_PROGRESS_FILE``), never in the real home.

With ``KVLAB_SAVE_EXECUTED=<folder>`` (``make test-notebooks`` sets it), each solutions
notebook that ran without a failing cell is also written there with its outputs, for the
website (``tools/executed_notebooks.py``): ``make site`` then executes nothing twice.
"""
from __future__ import annotations

import ast
import atexit
import json
import os
import re
import shutil
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import nbformat
import pytest

_PROGRESS_DIR = tempfile.mkdtemp(prefix="kvlab-progress-")
atexit.register(shutil.rmtree, _PROGRESS_DIR, True)
_PROGRESS = os.environ["KVLAB_PROGRESS_FILE"] = os.path.join(_PROGRESS_DIR, "progress.json")

if os.environ.get("KVLAB_SAVE_EXECUTED"):  # tools/ is beside notebooks/ only in the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from executed_notebooks import record_nbval_cell  # noqa: E402
else:
    record_nbval_cell = None

_NOT_ATTEMPTED = re.compile(r"^not attempted yet: (\w+)", re.M)
_MARKER = re.compile(r"#\s*YOUR CODE HERE: (\w+)")

_reported: dict[Path, Counter] = defaultdict(Counter)
_failed: set[Path] = set()
_images: Counter = Counter()

# one audit file per pytest process (each xdist worker runs its notebooks one at a time)
_AUDIT = os.environ["KVLAB_FIGURE_AUDIT"] = os.path.join(
    tempfile.mkdtemp(prefix="kvlab-figures-"), "audit.jsonl")
# the kernels draw with the inline backend, as in JupyterLab (MPLBACKEND=Agg would show nothing)
os.environ.pop("MPLBACKEND", None)


def _notebook(item) -> Path | None:
    path = getattr(item.parent, "path", None)
    return Path(path) if path is not None and str(path).endswith(".ipynb") else None


def _text(output) -> str:
    if output.get("output_type") == "stream":
        text = output.get("text", "")
    else:
        text = output.get("data", {}).get("text/plain", "")
    return "".join(text) if isinstance(text, list) else text


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def stray_echo(source: str, outputs) -> str | None:
    """What a cell echoed from a call of kvlab.check / kvlab.solutions ending it, if anything.

    Such a call prints what it has to say and returns None; an ``Out[..]`` under it (a 0, a
    hint or a solution printed a second time) is noise a learner has to read past.
    """
    try:
        body = ast.parse(source).body
    except SyntaxError:  # IPython syntax (magics): not a kvlab call
        return None
    last = body[-1] if body else None
    if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)):
        return None
    name = _dotted(last.value.func)
    if not name.startswith(("kvlab.check.", "kvlab.solutions.")):
        return None
    echoed = [_text(o) for o in outputs if o.get("output_type") == "execute_result"]
    if echoed:
        return f"the cell ending with {name}(...) echoed what it returned: {echoed[0][:200]!r}"
    return None


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


def _illegible(path: Path) -> str | None:
    """What is wrong with the figures a finished notebook rendered, if anything."""
    try:
        with open(_AUDIT) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        records = []
    shown = _images.pop(path, 0)
    if shown and not records:
        return (f"{path.name} showed {shown} image(s) but the figure audit measured none: "
                "is KVLAB_FIGURE_AUDIT reaching the kernel (kvlab.course.viz.legibility.install_audit)?")
    bad = [r for r in records if not r["legible"]]
    if not bad:
        return None
    from kvlab.course.viz.legibility import MAX_WIDTH_IN, MIN_TEXT_PX, OUTPUT_WIDTH_PX

    lines = [f"  {r['width_px']} px wide at {r['dpi']:g} dpi, smallest text {r['smallest_pt']:g} pt "
             f"= {r['smallest_px']} px ('{r['smallest_text']}' in the figure titled '{r['title']}')"
             + (f": wider than {MAX_WIDTH_IN:g} in" if r.get("too_wide") else "") for r in bad]
    return (f"{path.name}: {len(bad)} of {len(records)} figures are wider than {MAX_WIDTH_IN:g} in or "
            f"have text under {MIN_TEXT_PX:g} px in a {OUTPUT_WIDTH_PX} px wide output area "
            "(kvlab.course.viz.legibility):\n" + "\n".join(lines))


def pytest_runtest_setup(item):
    path = _notebook(item)
    if path is not None and getattr(item, "cell_num", -1) == 0:
        open(_AUDIT, "w").close()  # a new notebook: forget the last one's figures
        # and start from no progress, as a newcomer does: what its setup cell and closing
        # recheck print must not depend on the notebooks this worker ran before
        Path(_PROGRESS).unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = _notebook(item)
    if path is None or call.when != "call":
        return
    for output in getattr(item, "test_outputs", None) or []:
        _reported[path].update(_NOT_ATTEMPTED.findall(_text(output)))
        _images[path] += "image/png" in output.get("data", {})
    cell = getattr(item, "cell", None)
    echo = stray_echo(cell.source, getattr(item, "test_outputs", None) or []) if cell else None
    if echo and not report.failed:
        report.outcome, report.longrepr = "failed", f"{path.name}: {echo}"
    if report.failed:
        _failed.add(path)
    n_code = sum(c.cell_type == "code" for c in item.parent.nb.cells)
    if getattr(item, "cell_num", -1) != n_code - 1 or path in _failed:
        return  # not the last cell yet, or nbval already reports a failing cell
    problem = _problem(path) or _illegible(path)
    if problem:
        report.outcome = "failed"
        report.longrepr = problem
        _failed.add(path)


def pytest_runtest_teardown(item):
    path = _notebook(item)
    if record_nbval_cell is not None and path is not None:
        record_nbval_cell(item, failed=path in _failed)  # a failed notebook is not saved


def pytest_collection_modifyitems(items):
    """The later chapters first (they run the serving model and take longest: chapter 10 a
    third of a minute, chapter 01 a few seconds), each chapter's answers before its starters,
    and every notebook's cells in order: pytest-xdist hands whole notebooks to its workers
    in this order (--dist loadfile), so the short ones fill the end instead of one worker
    waiting on a long one."""
    def heaviest_first(item):
        path = _notebook(item)
        if path is None:
            return (1, 0, 0)
        chapter = int(path.name[:2]) if path.name[:2].isdigit() else -1
        return (0, -chapter, 0 if path.parent.name == "solutions" else 1)
    items.sort(key=heaviest_first)     # stable: a notebook's cells keep their order
