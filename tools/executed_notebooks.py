"""Executed chapters (outputs and figures in), shared by the notebook test and the website.

The website shows every chapter as CI runs it: the solutions build, executed in Triton's
interpreter on the CPU. Executing the eleven-odd chapters takes minutes, and ``make test``
already executes each of them under nbval, so it is done once:

* **from nbval**: with ``KVLAB_SAVE_EXECUTED=<folder>`` in the environment, the notebook
  test (``notebooks/conftest.py`` calls :func:`record_nbval_cell` after every cell) writes
  each solutions notebook it ran without a failing cell to ``<folder>/NN_name.ipynb``, with
  the outputs nbval collected. ``make test-notebooks`` sets it to ``build/executed``.
* **or with nbclient**: ``make site`` (``tools/build_site.py``) executes the chapters that have
  no current executed copy there, in parallel kernels (:func:`execute`).

An executed copy is current when its :func:`fingerprint` matches: a hash of the notebook's
cells and of every file of the ``kvlab`` package (the code its outputs come from).
"""
from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "notebooks" / "solutions"
ENV_VAR = "KVLAB_SAVE_EXECUTED"
META_KEY = "kvlab_executed"
PROGRESS_ENV = "KVLAB_PROGRESS_FILE"  # kvlab.course.checking.progress_file.ENV


def _package_digest() -> str:
    h = hashlib.sha256()
    for path in sorted((ROOT / "kvlab").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint(notebook: nbformat.NotebookNode, package_digest: str | None = None) -> str:
    """What an executed copy of ``notebook`` depends on: its cells and the kvlab package."""
    h = hashlib.sha256((package_digest or _package_digest()).encode())
    for cell in notebook.cells:
        h.update(f"\0{cell.cell_type}\0{cell.source}".encode())
    return h.hexdigest()


def executed_path(folder: Path, notebook_path: Path) -> Path:
    return Path(folder) / Path(notebook_path).name


def is_current(executed: Path, notebook_path: Path, package_digest: str | None = None) -> bool:
    """Whether ``executed`` holds the outputs of the notebook now at ``notebook_path``."""
    if not executed.exists():
        return False
    try:
        stored = nbformat.read(executed, as_version=4).metadata.get(META_KEY, {})
    except (OSError, ValueError):
        return False
    return stored.get("fingerprint") == fingerprint(
        nbformat.read(notebook_path, as_version=4), package_digest)


def _stamp(nb: nbformat.NotebookNode, source_nb: nbformat.NotebookNode, how: str) -> None:
    nb.metadata[META_KEY] = {"fingerprint": fingerprint(source_nb), "executed_by": how}


# -- from nbval --------------------------------------------------------------------------
_collected: dict[Path, dict[int, list]] = {}


def _quiet(source: str) -> bool:
    """Whether a notebook front end hides the cell's value (a trailing ``;``). nbval runs
    cells without history, where IPython does not apply that rule, so it is applied here."""
    from IPython.core.displayhook import DisplayHook

    return DisplayHook.semicolon_at_end_of_expression(source)


def record_nbval_cell(item, failed: bool = False) -> Path | None:
    """Called after each nbval cell: keep its outputs; after a solutions notebook's last code
    cell, write the executed notebook, unless a cell raised or the test found the notebook
    ``failed`` otherwise (an illegible figure, say). Returns the path written."""
    folder = os.environ.get(ENV_VAR)
    path = Path(str(getattr(item.parent, "path", "")))
    if not folder or path.suffix != ".ipynb" or path.parent.name != "solutions":
        return None
    outputs = getattr(item, "test_outputs", None)
    cells = _collected.setdefault(path, {})
    cells[item.cell_num] = None if outputs is None else copy.deepcopy(outputs)
    code = [c for c in item.parent.nb.cells if c.cell_type == "code"]
    if item.cell_num != len(code) - 1:
        return None
    _collected.pop(path)
    failed = failed or any(outs is None or any(o.get("output_type") == "error" for o in outs)
                           for outs in cells.values())
    if failed or len(cells) != len(code):
        return None
    source = nbformat.read(path, as_version=4)
    nb = copy.deepcopy(source)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    for n, cell in enumerate(code_cells):
        cell.outputs = [nbformat.from_dict(o) for o in cells[n]
                        if not (o.get("output_type") == "execute_result" and _quiet(cell.source))]
        cell.execution_count = n + 1
        for o in cell.outputs:
            if o.get("output_type") == "execute_result":
                o["execution_count"] = n + 1
    _stamp(nb, source, "nbval")
    out = executed_path(Path(folder), path)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return out


# -- with nbclient -----------------------------------------------------------------------
def _local_kernel_manager(folder: str):
    """A python3 kernel that talks to its client over Unix sockets in ``folder`` (IPC): over
    TCP, each kernel would print ipykernel's warning about unencrypted traffic, which a reader
    of ``make site`` can do nothing about (the kernel only ever serves this process)."""
    from jupyter_client.manager import KernelManager

    return KernelManager(kernel_name="python3", transport="ipc",
                         ip=os.path.join(folder, "kernel"))


def execute(notebook_path: Path, out_folder: Path, timeout_s: int = 1200) -> Path:
    """Execute one notebook in a fresh kernel (figures inline) and write the executed copy."""
    from nbclient import NotebookClient

    notebook_path = Path(notebook_path)
    source = nbformat.read(notebook_path, as_version=4)
    nb = copy.deepcopy(source)
    # The kernel's environment: no MPLBACKEND (a runner's Agg would hide every figure), and a
    # progress file of its own, empty as a newcomer's (the checks never write the real one).
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    with tempfile.TemporaryDirectory(prefix="kvlab-kernel-") as scratch:
        env[PROGRESS_ENV] = os.path.join(scratch, "progress.json")
        km = _local_kernel_manager(scratch)
        try:
            NotebookClient(nb, km=km, timeout=timeout_s,
                           resources={"metadata": {"path": str(notebook_path.parent)}}).execute(env=env)
        finally:
            # nbclient leaves a kernel manager it was handed running: without this each
            # chapter's kernel lived on until its worker exited, then printed ipykernel's
            # "Parent appears to have exited" (14 lines at the end of make site)
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    _stamp(nb, source, "nbclient")
    out = executed_path(Path(out_folder), notebook_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return out
