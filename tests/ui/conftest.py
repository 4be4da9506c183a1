"""Fixtures for the browser tests: one JupyterLab server and one headless Chromium per session.

Run with ``make test-ui`` (it installs Debian's chromium first when /usr/bin/chromium is
missing). Screenshots and the server log go to ``test-output/ui/``.
"""
from __future__ import annotations

import functools
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixture_notebooks import write_fixture_notebooks  # noqa: E402
from lab_driver import CHROMIUM, CHROMIUM_ARGS, LabServer, NotebookPage  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import workspace  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "test-output" / "ui"
SITE_HTML = ROOT / "build" / "site" / "html"


@pytest.fixture(scope="session")
def ui_output() -> Path:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    return OUTPUT


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory, ui_output):
    home = tmp_path_factory.mktemp("jupyterlab")
    # Copies of the course notebooks (autosave must never write into the repository), as
    # `make lab` lays them out in work/ (tools/workspace.py: with the glossary they link),
    # plus the harness's own small notebooks.
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    notebooks += [ROOT / "notebooks" / name for name in workspace.REFERENCES]
    notebooks += write_fixture_notebooks(home / "fixtures")
    server = LabServer(home, notebooks, ui_output / "jupyter-server.log", pythonpath=[ROOT])
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `sh tools/install_chromium.sh` "
                    "(make test-ui does it for you)", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # Playwright gives every launch a fresh, temporary user-data dir; it downloads nothing
        # because the executable is Debian's chromium.
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                      headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def open_notebook(browser, lab_server, ui_output):
    """``open_notebook("07_x.ipynb")`` -> a :class:`NotebookPage` in a fresh browser context."""
    contexts = []

    def _open(name: str, timeout_s: float = 120.0) -> NotebookPage:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(60_000)
        contexts.append(context)
        return NotebookPage(context.new_page(), lab_server, name, ui_output).open(timeout_s)

    yield _open
    for context in contexts:
        context.close()
    lab_server.shutdown_sessions()  # stop the kernels this test started


@pytest.fixture(scope="session")
def site_url():
    """The built website (``make site``) served on 127.0.0.1."""
    if not (SITE_HTML / "index.html").is_file():
        pytest.fail(f"{SITE_HTML.relative_to(ROOT)}/index.html is missing: run `make site` "
                    "(make test-ui builds it first)", pytrace=False)

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(Quiet, directory=str(SITE_HTML)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
