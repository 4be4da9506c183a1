"""`make gpu-check` runs the unit tests on a GPU machine that has no `site` extra (no Sphinx,
MyST-NB or the book theme): the website's tests must skip what needs it, never fail. Here the
site's own test module runs in a Python where those packages cannot be imported."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: what the `site` extra brings (pyproject.toml), as import names
SITE_MODULES = ("sphinx", "myst_nb", "myst_parser", "sphinx_book_theme", "pydata_sphinx_theme",
                "sphinx_design", "sphinx_copybutton", "docutils")

BLOCKER = f'''\
"""A pytest plugin that makes the site extra's packages unimportable, as where it is absent."""
import sys

BLOCKED = {SITE_MODULES!r}


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Absent())
'''


def test_the_site_tests_skip_without_the_site_extra(tmp_path):
    (tmp_path / "kvlab_no_site_extra.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]), MPLBACKEND="Agg")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "kvlab_no_site_extra", "tests/test_site_pages.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert re.search(r"\d+ passed, 1 skipped", out), out[-1500:]
    assert "SKIPPED" in out and "needs the site extra" in out, out[-1500:]
