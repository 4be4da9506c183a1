"""The kernel a course notebook names, so that JupyterLab opening it finds nothing to rewrite.

When JupyterLab starts a notebook's kernel it writes the kernel's ``kernelspec`` (name, display
name, language) and ``language_info`` (ipykernel's, with this Python's version) into the
notebook's metadata, and a notebook whose metadata differs shows as modified the moment it
opens, before the learner has touched anything. So:

* every built notebook names the kernel ``make lab`` installs (:data:`KERNELSPEC`: the
  Makefile's ``ipykernel install --name python3 --display-name "Python 3 (kvlab)"``);
* the learner's copies in ``work/`` (``tools/workspace.py``) also carry the ``language_info``
  of the environment's own Python (:func:`kernel_metadata`), which no file in the repository
  can know in advance (``3.11.7`` here, ``3.12.3`` on another machine).

Standard library only, besides ipykernel where it is installed (it is, beside JupyterLab).
"""
from __future__ import annotations

import json
from pathlib import Path

#: the kernel ``make lab`` installs into the course's environment (see the Makefile)
KERNELSPEC = {"display_name": "Python 3 (kvlab)", "language": "python", "name": "python3"}


def kernel_metadata() -> dict:
    """The metadata JupyterLab writes for this Python's kernel: the kernelspec, and ipykernel's
    ``language_info`` when ipykernel is installed."""
    found = {"kernelspec": dict(KERNELSPEC)}
    try:
        from ipykernel.ipkernel import IPythonKernel
    except ImportError:
        return found
    found["language_info"] = json.loads(json.dumps(IPythonKernel.language_info))
    return found


def copy_for_this_kernel(src: Path, dest: Path) -> None:
    """Copy the notebook ``src`` to ``dest`` with this Python's kernel metadata in it (cells
    and everything else as they are); a file that is not a notebook is copied as it is."""
    raw = Path(src).read_bytes()
    try:
        nb = json.loads(raw)
    except ValueError:
        nb = None
    if not isinstance(nb, dict) or not isinstance(nb.get("metadata", {}), dict):
        Path(dest).write_bytes(raw)
        return
    nb.setdefault("metadata", {}).update(kernel_metadata())
    # nbformat's own layout (indent 1, keys sorted), so a copy reads like the course's notebook
    Path(dest).write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
