"""The setup cell's install step, as Colab runs it, offline: it adds kvlab and nothing else.

Colab already has torch, triton, numpy, matplotlib and ipywidgets, and manages its own
Jupyter stack. The test builds a clean virtual environment that sees exactly those packages
(and what they need) from this environment, fakes ``google.colab``, points
``KVLAB_REPO_URL`` at a local clone of this repository, runs the setup cell there with pip
kept off the network, and compares ``pip list`` before and after: only kvlab may appear,
nothing may be installed or upgraded beside it (no jupyterlab, no nbval, no test tools).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLAB_HAS = ["torch", "triton", "numpy", "matplotlib", "ipywidgets", "pip", "setuptools"]
# what the package must not pull into Colab (a second Jupyter stack, the test tools)
JUPYTER_OR_TEST = {"jupyterlab", "jupyter-server", "notebook", "nbclient", "nbformat", "nbval",
                   "ipykernel", "jupytext", "pytest", "hypothesis", "pytest-xdist", "playwright"}

FAKE_COLAB = '''
import sys, types
google = types.ModuleType("google"); colab = types.ModuleType("google.colab")
output = types.ModuleType("google.colab.output")
output.calls = []
output.enable_custom_widget_manager = lambda: output.calls.append("widgets")
colab.output = output; google.colab = colab
sys.modules.update({"google": google, "google.colab": colab, "google.colab.output": output})
exec(compile(open(sys.argv[1]).read(), "<setup cell>", "exec"), {})
print("widget manager enabled:", output.calls == ["widgets"])
'''


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions ``names`` need (their requirements, with the extras they ask
    for, recursively)."""
    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [(name, "") for name in names]
    while todo:
        name, extra = todo.pop()
        if (_key(name), extra) in done:
            continue
        done.add((_key(name), extra))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[_key(name)] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not req.marker.evaluate({"extra": extra}):
                continue
            todo += [(req.name, e) for e in ("", *sorted(req.extras))]
    return seen


def _colab_site(folder: Path, dists: dict[str, md.Distribution]) -> None:
    """A folder of links to the top-level files of ``dists``: what Colab has preinstalled."""
    folder.mkdir()
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = base / top
            if src.exists() and not (folder / top).exists():
                (folder / top).symlink_to(src)


def _pip_list(python: Path, env: dict) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return {_key(p["name"]): p["version"] for p in json.loads(out)}


@pytest.mark.slow
def test_the_setup_cell_installs_kvlab_alone_offline(tmp_path):
    if any(_key(d) == "kvlab" for d in _closure(COLAB_HAS)):
        pytest.skip("kvlab is a dependency of the preinstalled set here")
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: the setup cell clones the course with git")
    clone = tmp_path / "origin"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    # what this checkout's working tree declares (it may not be committed yet)
    shutil.copy(ROOT / "pyproject.toml", clone / "pyproject.toml")
    subprocess.run(["git", "-C", str(clone), "-c", "user.name=kvlab", "-c", "user.email=kvlab@localhost",
                    "commit", "-q", "--allow-empty", "-am", "working tree's pyproject"], check=True)
    venv = tmp_path / "colab"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    _colab_site(tmp_path / "colab_site", _closure(COLAB_HAS))
    (site / "colab_preinstalled.pth").write_text(str(tmp_path / "colab_site") + "\n")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_BUILD_ISOLATION="0",  # pip's spelling of --no-build-isolation: no download
               KVLAB_REPO_URL=f"file://{clone}", KVLAB_COLAB_DIR=str(tmp_path / "content" / "kvlab"),
               MPLBACKEND="Agg", HOME=str(tmp_path))
    before = _pip_list(python, env)
    assert "torch" in before and "kvlab" not in before
    # none of them is preinstalled here, so a requirement on one would make the offline install fail
    assert not JUPYTER_OR_TEST & set(before), JUPYTER_OR_TEST & set(before)

    from kvlab.course.colab import SETUP_CELL

    cell = tmp_path / "setup_cell.py"
    cell.write_text(SETUP_CELL)
    run = subprocess.run([str(python), "-c", FAKE_COLAB, str(cell)], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, f"the setup cell failed in a Colab-like venv:\n{run.stdout}\n{run.stderr}"
    assert "kvlab runtime:" in run.stdout and "widget manager enabled: True" in run.stdout

    after = _pip_list(python, env)
    added = {k: v for k, v in after.items() if k not in before}
    changed = {k: (before[k], after[k]) for k in before if k in after and before[k] != after[k]}
    assert list(added) == ["kvlab"], f"installing kvlab also installed {sorted(set(added) - {'kvlab'})}"
    assert not changed, f"installing kvlab upgraded or downgraded {changed}"
