"""``make lab`` as a newcomer runs it, as root too (``make test-ui``).

The test runs the real target (its set-up step, the workspace copies, JupyterLab) with a
throwaway workspace and Jupyter folders, a free port, and a "browser" that only records the
page JupyterLab asks it to open. It then opens that page in headless Chromium: chapter 00 must
be the notebook on screen, unmodified once its kernel has started, and no news or update
pop-up may cover it; the terminal shows no warning (the kernel's connection, websocket settings,
trust) a learner could do nothing about. CI runs as root, where
JupyterLab refuses to start without ``--allow-root``: the target must pass it.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab_driver import free_port  # noqa: E402

pytestmark = pytest.mark.ui

ROOT = Path(__file__).resolve().parents[2]
NEWS_OR_UPDATE = re.compile(r"Jupyter news|newer version|is available", re.I)


def _recording_browser(folder: Path) -> Path:
    """A "browser" for JupyterLab's ``ServerApp.browser``: it writes down what it was asked to
    open (JupyterLab hands it a small redirect page, or the URL itself)."""
    script = folder / "record-url.sh"
    script.write_text(f'#!/bin/sh\necho "$1" > "{folder}/opened"\n')
    script.chmod(0o755)
    return script


def _opened_url(folder: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (folder / "opened").exists() and (folder / "opened").read_text().strip():
            target = (folder / "opened").read_text().strip()
            if target.startswith("file://"):  # the redirect page names the real URL
                page = Path(target[len("file://"):]).read_text()
                target = re.search(r'<meta http-equiv="refresh" content="1;url=([^"]+)"', page)[1]
            return target
        time.sleep(0.5)
    raise AssertionError("JupyterLab never asked a browser to open a page")


@pytest.fixture
def make_lab(tmp_path):
    """``make lab`` running in the background; yields (url, work folder, log path)."""
    work, home, log_path = tmp_path / "work", tmp_path / "home", tmp_path / "make-lab.log"
    home.mkdir()
    browser = _recording_browser(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "lab-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), IPYTHONDIR=str(home / "ipython"))
    lab_args = (f"--ServerApp.ip=127.0.0.1 --ServerApp.port={port} --ServerApp.port_retries=0 "
                f"--ServerApp.browser='{browser} %s'")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["make", "-C", str(ROOT), "lab", f"WORK={work}",
                                 f"LAB_ARGS={lab_args}"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            url = _opened_url(tmp_path, timeout_s=120)
        except AssertionError:
            raise AssertionError(f"`make lab` did not start JupyterLab:\n{log_path.read_text()[-3000:]}")
        yield url, work, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # make, JupyterLab and its kernels
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def test_make_lab_starts_jupyterlab_on_chapter_00_without_a_popup(make_lab, browser, ui_output):
    url, work, log_path = make_lab
    log = log_path.read_text()
    if os.geteuid() == 0:
        assert "--allow-root" in log, "run as root, `make lab` must pass --allow-root"
    assert "/lab/tree/00_tour.ipynb" in url, f"JupyterLab opens {url}, not chapter 00"
    # the learner works in copies: every notebook of both builds is there
    course = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(p.name for p in work.glob("[0-9][0-9]_*.ipynb")) == course
    assert sorted(p.name for p in (work / "solutions").glob("[0-9][0-9]_*.ipynb")) == course
    assert (work / "glossary.md").is_file(), "the notebooks link the glossary beside them"
    with urllib.request.urlopen(url.replace("/lab/tree/00_tour.ipynb", "/api/status"),
                                timeout=10) as resp:
        assert resp.status == 200

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = context.new_page()
        page.goto(url, timeout=120_000)
        tab = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell").first
        tab.wait_for(timeout=120_000)
        title = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current").first
        assert "00_tour.ipynb" in title.inner_text()
        page.wait_for_timeout(6000)  # JupyterLab asks about news a few seconds after start
        page.screenshot(path=str(ui_output / "make-lab-chapter-00.png"))
        toasts = page.locator(".Toastify__toast").all_inner_texts()
        assert not [t for t in toasts if NEWS_OR_UPDATE.search(t)], f"a pop-up covers it: {toasts}"
        # by now the kernel has started and JupyterLab has written its kernelspec and
        # language_info: an untouched notebook whose metadata differed would show as modified
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                               timeout=120_000)
        page.wait_for_timeout(2000)
        assert "jp-mod-dirty" not in (title.get_attribute("class") or ""), \
            "chapter 00 shows as modified the moment JupyterLab opens it"
        # the chapter open, its kernel started: nothing in the terminal a learner cannot act on
        # (from JupyterLab's start on: the set-up's own lines are another test's)
        lines = log_path.read_text().splitlines()
        started = next(i for i, line in enumerate(lines) if "jupyter lab --ServerApp" in line)
        warnings = [line for line in lines[started:]
                    if re.match(r"\[W |\[IPKernelApp\] WARNING|WARNING", line)]
        assert not warnings, "`make lab` printed warnings:\n" + "\n".join(warnings)
    finally:
        context.close()
