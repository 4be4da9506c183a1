"""An untouched notebook stays unmodified when JupyterLab opens it: the notebooks name the
kernel `make lab` installs, and the learner's copies in ``work/`` carry this Python's
``language_info`` as ipykernel reports it (what JupyterLab writes when the kernel starts;
``tests/ui/test_make_lab.py`` opens chapter 00 in JupyterLab and sees no modified mark)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import notebook_kernel  # noqa: E402
import workspace  # noqa: E402


def _installed_kernels() -> list[tuple[str, str]]:
    """(name, display name) of every `ipykernel install` line of the Makefile."""
    lines = [ln for ln in (ROOT / "Makefile").read_text().splitlines() if "ipykernel install" in ln]
    return [(re.search(r"--name (\S+)", ln)[1], re.search(r'--display-name "([^"]+)"', ln)[1])
            for ln in lines]


def test_every_notebook_names_the_kernel_make_lab_installs():
    spec = notebook_kernel.KERNELSPEC
    assert _installed_kernels() and set(_installed_kernels()) == {(spec["name"], spec["display_name"])}
    for path in sorted((ROOT / "notebooks").rglob("[0-9][0-9]_*.ipynb")):
        assert json.loads(path.read_text())["metadata"]["kernelspec"] == spec, path.name


def test_a_learners_copy_carries_this_pythons_kernel_metadata(tmp_path, monkeypatch):
    ipkernel = pytest.importorskip("ipykernel.ipkernel")
    course = tmp_path / "notebooks"
    (course / "solutions").mkdir(parents=True)
    for path in [ROOT / "notebooks" / "00_tour.ipynb", ROOT / "notebooks" / "solutions" / "00_tour.ipynb"]:
        (course / path.relative_to(ROOT / "notebooks")).write_bytes(path.read_bytes())
    monkeypatch.setattr(workspace, "COURSE", course)
    workspace.prepare(tmp_path / "work")
    for name in ["00_tour.ipynb", "solutions/00_tour.ipynb"]:
        copy = json.loads((tmp_path / "work" / name).read_text())
        original = json.loads((course / name).read_text())
        assert copy["metadata"]["kernelspec"] == notebook_kernel.KERNELSPEC
        assert copy["metadata"]["language_info"] == ipkernel.IPythonKernel.language_info
        assert copy["metadata"]["language_info"]["version"] == sys.version.split()[0]
        assert copy["cells"] == original["cells"]  # only the kernel's metadata differs
    # the record still holds the course notebook's digest: a later prepare reports no change
    assert workspace.prepare(tmp_path / "work") == []


def test_a_file_that_is_not_a_notebook_is_copied_as_it_is(tmp_path):
    src, dest = tmp_path / "a.ipynb", tmp_path / "b.ipynb"
    src.write_bytes(b"\x00 not json")
    notebook_kernel.copy_for_this_kernel(src, dest)
    assert dest.read_bytes() == b"\x00 not json"
