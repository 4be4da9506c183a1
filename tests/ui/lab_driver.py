"""Drive a real JupyterLab in headless Chromium, the way a learner meets the course.

Two pieces, both used by ``tests/ui/``:

* :class:`LabServer` starts ``jupyter lab`` from the current Python on 127.0.0.1 (a free
  port, a random token, an isolated config/settings/workspace folder, a temp root folder
  holding *copies* of the notebooks, so autosave never touches the repository) and always
  stops it, kernels included.
* :class:`NotebookPage` opens one notebook in a Playwright page, runs all cells through the
  Run menu, waits until every code cell has executed and the kernel is idle, and fails on the
  first cell error shown in the page.

The browser is Debian's Chromium at ``/usr/bin/chromium`` (``tools/install_chromium.sh``);
Playwright only drives it and never downloads one.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

# What an executed cell error looks like in JupyterLab 4 (stderr warnings use another mime type).
ERROR_OUTPUT = '.jp-RenderedText[data-mime-type="application/vnd.jupyter.error"]'
STDERR_OUTPUT = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)"
                        r"|^(\w+\.)*\w*(Error|Exception|Interrupt|Exit)\b", re.M)


def looks_like_an_error(text: str) -> bool:
    """A traceback or an exception line; ``x.py:3: UserWarning: ...`` is not one."""
    return bool(_TRACEBACK.search(text))

# User settings for the test's JupyterLab: render every cell (no virtual scrolling, so all
# outputs are in the DOM), no news/update toasts over the notebook, no autosave.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False,
    },
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


class CellError(AssertionError):
    """A cell raised: the page shows an error output."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """``jupyter lab`` on 127.0.0.1 in a throwaway folder; use as a context manager."""

    def __init__(self, home: Path, notebooks: list[Path], log_path: Path,
                 pythonpath: list[Path] = (), start_timeout_s: float = 120.0):
        self.home = Path(home)
        self.root = self.home / "root"
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.log_path = Path(log_path)
        self._notebooks = [Path(p) for p in notebooks]
        self._pythonpath = [str(p) for p in pythonpath]
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}/{path.lstrip('/')}{sep}token={self.token}"

    # -- lifecycle ---------------------------------------------------------------------
    def _prepare(self) -> dict[str, str]:
        self.root.mkdir(parents=True, exist_ok=True)
        for nb in self._notebooks:
            shutil.copy2(nb, self.root / nb.name)
        settings_dir = self.home / "lab-settings"
        for rel, values in LAB_SETTINGS.items():
            path = settings_dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        # the server settings `make lab` runs with (tools/workspace.py writes them there)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
        import workspace

        config = self.home / "config" / "jupyter_server_config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(workspace.server_config()))
        env = dict(os.environ)
        # The kernel must draw inline figures: a test runner's MPLBACKEND=Agg would hide them.
        env.pop("MPLBACKEND", None)
        env.update({
            "JUPYTER_CONFIG_DIR": str(self.home / "config"),
            "JUPYTER_RUNTIME_DIR": str(self.home / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(settings_dir),
            "JUPYTERLAB_WORKSPACES_DIR": str(self.home / "workspaces"),
            "IPYTHONDIR": str(self.home / "ipython"),
            "PYTHONPATH": os.pathsep.join(
                self._pythonpath + [p for p in [env.get("PYTHONPATH", "")] if p]),
        })
        return env

    def start(self) -> "LabServer":
        env = self._prepare()
        cmd = [
            sys.executable, "-m", "jupyterlab",
            "--no-browser", "--ServerApp.open_browser=False",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}", "--ServerApp.terminals_enabled=False",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # CI containers run as root
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        # A session of its own, so stop() can end the server and every kernel it started.
        self._proc = subprocess.Popen(cmd, env=env, cwd=self.root, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self._proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                self.api("GET", "api/status")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"jupyter lab did not answer within {self._start_timeout_s} s:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # the server shuts its kernels down
                proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the session
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LabServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-n_chars:]
        except OSError:
            return "(no log)"

    # -- REST ---------------------------------------------------------------------------
    def api(self, method: str, path: str):
        req = urllib.request.Request(f"{self.base_url}/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def kernel_states(self) -> list[str]:
        return [k["execution_state"] for k in self.api("GET", "api/kernels")]

    def shutdown_sessions(self) -> None:
        """Stop every kernel (best effort: a failure here must not hide the test's result)."""
        try:
            for session in self.api("GET", "api/sessions"):
                self.api("DELETE", f"api/sessions/{session['id']}")
        except (urllib.error.URLError, OSError) as exc:
            print(f"shutting down kernels: {exc}")


@dataclass
class RunResult:
    code_cells: int
    seconds: float


class NotebookPage:
    """One notebook open in JupyterLab inside a Playwright page."""

    def __init__(self, page, server: LabServer, name: str, shots: Path):
        self.page = page
        self.server = server
        self.name = name
        self.shots = Path(shots)

    def open(self, timeout_s: float = 120.0) -> "NotebookPage":
        # ?reset: start from an empty workspace, so no other notebook is restored beside it.
        self.page.goto(self.server.url(f"lab/tree/{self.name}?reset"),
                       timeout=timeout_s * 1000)
        self.page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell",
                                    timeout=timeout_s * 1000)
        self._wait_kernel_idle(timeout_s)
        return self

    def screenshot(self, label: str) -> Path:
        self.shots.mkdir(parents=True, exist_ok=True)
        path = self.shots / f"{Path(self.name).stem}-{label}.png"
        self.page.screenshot(path=str(path), full_page=False)
        return path

    # -- editing ------------------------------------------------------------------------
    def code_cell(self, containing: str):
        """The code cell whose source contains ``containing`` (exactly one must), by position:
        the locator still finds it after its source is edited."""
        cells = self.page.locator(".jp-NotebookPanel .jp-CodeCell")
        sources = cells.evaluate_all(
            "els => els.map(e => e.querySelector('.jp-InputArea-editor').innerText)")
        hits = [i for i, text in enumerate(sources) if containing in text.replace("\u00a0", " ")]
        assert len(hits) == 1, f"{self.name}: code cells {hits} contain {containing!r}"
        return cells.nth(hits[0])

    def type_into(self, cell, source: str) -> None:
        """Replace ``cell``'s source by ``source``, typed into its editor as a learner would
        (select all, then the text as one input: no auto-indent on top of the given one)."""
        editor = cell.locator(".cm-content").first
        editor.scroll_into_view_if_needed()
        editor.click()
        self.page.keyboard.press("Control+A")
        self.page.keyboard.press("Delete")
        self.page.keyboard.insert_text(source)
        typed = editor.evaluate("el => [...el.querySelectorAll('.cm-line')]"
                                ".map(line => line.textContent).join('\\n')")
        typed = typed.replace("\u00a0", " ").rstrip()
        assert typed == source.rstrip(), f"{self.name}: the editor holds {typed!r}"

    # -- running ------------------------------------------------------------------------
    def run_all(self, timeout_s: float = 300.0, expected_errors: re.Pattern | None = None
                ) -> RunResult:
        """Run → Run All Cells, then wait until all code cells ran and the kernel is idle.

        ``expected_errors``: error outputs matching it are what the test wants to see (a failed
        check), not a reason to stop; any other error still fails.
        """
        self.page.locator(".jp-NotebookPanel .jp-Notebook").first.click(position={"x": 5, "y": 5})
        self.menu("Run", "Run All Cells")
        start = time.monotonic()
        n_code = self.wait_until_executed(timeout_s, expected_errors)
        return RunResult(code_cells=n_code, seconds=time.monotonic() - start)

    def menu(self, menu: str, item: str) -> None:
        """Click ``menu`` in JupyterLab's menu bar, then its entry ``item``."""
        page = self.page
        page.locator(".lm-MenuBar-item").filter(
            has_text=re.compile(rf"^\s*{re.escape(menu)}\s*$")).first.click()
        page.locator(".lm-Menu .lm-Menu-item").filter(
            has=page.locator(".lm-Menu-itemLabel",
                             has_text=re.compile(rf"^\s*{re.escape(item)}\s*$"))
        ).first.click()

    def prompts(self) -> list[str]:
        return self.page.eval_on_selector_all(
            ".jp-NotebookPanel .jp-CodeCell .jp-InputPrompt",
            "els => els.map(e => e.textContent.trim())")

    def cell_errors(self) -> list[str]:
        """Error outputs shown in the page.

        JupyterLab 4 renders a raised exception as a text output with the *stderr* mime type
        (older versions use ``application/vnd.jupyter.error``), so a stderr output counts as
        an error only when it looks like one: a traceback, or a line that starts with an
        exception name (IPython's SyntaxError report has no "Traceback" line). Warnings
        (``file.py:3: UserWarning: ...``) do not.
        """
        texts = self.page.eval_on_selector_all(
            f".jp-NotebookPanel {ERROR_OUTPUT}, .jp-NotebookPanel {STDERR_OUTPUT}",
            "els => els.map(e => [e.getAttribute('data-mime-type'), e.innerText])")
        return [text for mime, text in texts
                if mime.endswith("error") or looks_like_an_error(text)]

    def raise_on_cell_error(self, expected: re.Pattern | None = None) -> None:
        errors = [e for e in self.cell_errors() if expected is None or not expected.search(e)]
        if errors:
            self.screenshot("cell-error")
            raise CellError(f"{self.name}: a cell raised:\n{errors[0][-3000:]}")

    def saved_errors(self) -> list[str]:
        """Save the notebook (Ctrl+S) and read its error outputs back from the server.

        The authoritative check: whatever the page shows, an ``"output_type": "error"`` in
        the saved notebook means a cell raised.
        """
        self.page.locator(".jp-NotebookPanel .jp-Notebook").first.click(position={"x": 5, "y": 5})
        before = self.server.api("GET", f"api/contents/{self.name}?content=0")["last_modified"]
        self.page.keyboard.press("Control+s")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            model = self.server.api("GET", f"api/contents/{self.name}?content=0")
            if model["last_modified"] != before:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"{self.name}: saving with Ctrl+S did not reach the server")
        nb = self.server.api("GET", f"api/contents/{self.name}?content=1")["content"]
        return [f"cell {i}: {out.get('ename')}: {out.get('evalue')}\n"
                + _ANSI.sub("", "\n".join(out.get("traceback", [])))
                for i, cell in enumerate(nb["cells"]) for out in cell.get("outputs", [])
                if out.get("output_type") == "error"]

    def wait_until_executed(self, timeout_s: float, expected: re.Pattern | None = None) -> int:
        """Poll until every code cell shows an execution count and the kernel stays idle.

        Fails at once on an error shown in the page (other than ``expected`` ones); fails too
        when the kernel has gone idle with cells left unrun (Run All stops at a cell that raised).
        """
        deadline = time.monotonic() + timeout_s
        idle_in_a_row = 0
        while time.monotonic() < deadline:
            self.raise_on_cell_error(expected)
            prompts = self.prompts()
            running = any("*" in p for p in prompts)
            states = self.server.kernel_states()
            idle = bool(states) and all(s == "idle" for s in states) and not running
            idle_in_a_row = idle_in_a_row + 1 if idle else 0
            if idle_in_a_row >= 3:  # idle for three polls: not just a gap between cells
                self.raise_on_cell_error(expected)
                errors = [e for e in self.saved_errors()
                          if expected is None or not expected.search(e)]
                if errors:
                    self.screenshot("cell-error")
                    raise CellError(f"{self.name}: a cell raised: {errors[0]}")
                unrun = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", p)]
                if unrun:
                    self.screenshot("not-run")
                    raise AssertionError(f"{self.name}: kernel idle but code cells {unrun} "
                                         f"did not run; prompts={prompts}")
                return len(prompts)
            time.sleep(1.0)
        self.screenshot("timeout")
        raise AssertionError(f"{self.name}: cells still running after {timeout_s:.0f} s; "
                             f"prompts={self.prompts()} kernels={self.server.kernel_states()}")

    def _wait_kernel_idle(self, timeout_s: float, polls: int = 1) -> None:
        deadline = time.monotonic() + timeout_s
        in_a_row = 0
        while time.monotonic() < deadline:
            try:
                states = self.server.kernel_states()
            except urllib.error.HTTPError as exc:  # jupyter_server answers 500 while a kernel
                if exc.code < 500:                 # starts (its last_activity still None)
                    raise
                states = []
            in_a_row = in_a_row + 1 if states and all(s == "idle" for s in states) else 0
            if in_a_row >= polls:
                return
            time.sleep(0.5)
        raise AssertionError(f"{self.name}: kernel not idle after {timeout_s:.0f} s: {states}")

    def wait_kernel_settled(self, timeout_s: float = 120.0) -> None:
        """Wait until the kernel has been idle for a few polls (widget callbacks finished)."""
        self._wait_kernel_idle(timeout_s, polls=4)

    def log_console_texts(self) -> list[str]:
        """Open JupyterLab's Log Console and return the text of every entry.

        Output from widget callbacks (which run outside any cell) lands there, so a callback
        that raises shows its traceback in the log, not in the notebook.
        """
        page = self.page
        if page.locator(".jp-LogConsole").count() == 0:
            self.menu("View", "Show Log Console")
            page.locator(".jp-LogConsole").first.wait_for(state="attached", timeout=30_000)
            time.sleep(1.0)
        return page.eval_on_selector_all(".jp-LogConsole .jp-OutputArea-output",
                                         "els => els.map(e => e.innerText)")

    def raise_on_logged_error(self) -> None:
        errors = [t for t in self.log_console_texts() if looks_like_an_error(t)]
        if errors:
            self.screenshot("logged-error")
            raise CellError(f"{self.name}: a widget callback raised (Log Console):\n"
                            f"{errors[0][-3000:]}")

    # -- looking at outputs -----------------------------------------------------------
    def output_images(self) -> list[dict]:
        """Rendered output images (inline figures and image widgets) with their sizes."""
        return self.page.eval_on_selector_all(
            ".jp-NotebookPanel .jp-OutputArea-output img",
            "els => els.map(e => ({src: e.currentSrc || e.src, w: e.naturalWidth, "
            "h: e.naturalHeight, cls: e.className}))")


# -- widgets and pictures ------------------------------------------------------------------
def slider_value(slider) -> float:
    """The value an ipywidgets 8 slider shows (noUiSlider handle's aria-valuenow)."""
    return float(slider.locator(".noUi-handle").first.get_attribute("aria-valuenow"))


def move_slider(slider, steps: int = 3) -> tuple[float, float]:
    """Move an ipywidgets slider right by ``steps`` with the keyboard, as a learner can.

    Falls back to typing into the slider's editable readout. Returns (before, after).
    """
    slider.scroll_into_view_if_needed()
    before = slider_value(slider)
    handle = slider.locator(".noUi-handle").first
    handle.focus()
    for _ in range(steps):
        handle.press("ArrowRight")
    after = slider_value(slider)
    if after == before:  # keyboard not honoured: type the value into the readout
        readout = slider.locator(".widget-readout").first
        readout.click()
        readout.press("Control+A")
        readout.type(str(int(before) + steps))
        readout.press("Enter")
        after = slider_value(slider)
    return before, after


def image_colours(png: bytes) -> int:
    """How many distinct colours a screenshot holds (a blank or failed image has few)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    return len(colours) if colours is not None else 1 << 20
