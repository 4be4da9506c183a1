"""Your own copies of the course's notebooks, which a `git pull` of course updates never touches.

    python tools/workspace.py prepare [WORK]          # what `make lab` runs first
    python tools/workspace.py fresh NN [WORK]         # `make fresh CHAPTER=NN`

The notebooks under ``notebooks/`` belong to the course: a ``git pull`` updates them, and
would stop on (or overwrite) a learner's edits. So ``make lab`` opens JupyterLab on a
workspace folder, ``work/`` by default and ignored by git, that holds copies:

* ``prepare`` copies every chapter's learner notebook to ``WORK/NN_name.ipynb`` and its
  solutions build to ``WORK/solutions/NN_name.ipynb``, *only when the copy does not exist
  yet* (so a new chapter arrives with the next ``make lab``, and nothing of yours is ever
  overwritten), and says which of your copies the course has changed since they were made;
* ``fresh NN`` puts a fresh copy of chapter ``NN`` (both builds) in place, keeping the one
  you had beside it as ``NN_name.<date-time>.ipynb`` when you changed it: a copy whose cells
  are still those it was made with (you never edited it; running its cells does not count) is
  simply replaced, with nothing to clean up afterwards.

The notebooks link the glossary (``glossary.md#term``, ``../glossary.md#term`` from
``solutions/``), so ``prepare`` also puts ``notebooks/glossary.md`` in ``WORK/``: a reference,
not your work, so it is brought up to date every time.

``make lab`` (``main``) also signs each copy it makes as trusted, as ``jupyter trust`` would (the
course's notebooks carry no outputs, so trust changes nothing a learner sees), so that
JupyterLab opening one logs no "is not trusted" warning.

What each copy was made from is recorded in ``WORK/.course-copies.json`` (file name → hash of
the course notebook at copy time; ``name#cells`` → hash of the copy's cells as made). ``prepare`` also writes JupyterLab's settings overrides into
this environment: no news or update pop-up over the notebook; and Jupyter server's settings
(:data:`SERVER_CONFIG`), so that ``make lab`` prints no warning a learner can do nothing about.

Nothing here stops ``make lab`` with a traceback or loses a learner's file: a kept copy gets a
name no file has yet (``make fresh`` twice in one second keeps both); a record that cannot be
read (not JSON, not an object of names, nested too deep) or written (read-only) is said in one
line, and the run carries on without it (the course's updates to the copies it does not know
are then not reported).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from notebook_kernel import copy_for_this_kernel  # noqa: E402

COURSE = ROOT / "notebooks"
RECORD = ".course-copies.json"
FIRST_CHAPTER = "00_tour.ipynb"
#: files beside the notebooks that they link: refreshed in the workspace by every ``prepare``
REFERENCES = ("glossary.md",)

# JupyterLab reads <sys.prefix>/share/jupyter/lab/settings/overrides.json as the defaults of
# its settings: no "receive Jupyter news?" pop-up, no update check.
LAB_OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
}


def server_config() -> dict:
    """Jupyter server's settings for the course's JupyterLab (``make lab``, the browser tests):

    * kernels talk to the server over CurveZMQ-encrypted sockets where pyzmq can (the kernel
      spec ``make setup`` installs declares it supports them): over plain TCP, ipykernel logs
      a warning about unencrypted traffic for every kernel started;
    * the websocket ping timeout no longer than its interval: jupyter_server's default is
      three times the interval, which tornado refuses with a warning (and then uses the
      interval, as this setting does)."""
    config = {"ServerApp": {"tornado_settings": {"ws_ping_timeout": 30_000}}}
    try:
        import zmq
    except ImportError:
        return config
    if zmq.has("curve"):
        config["KernelManager"] = {"transport_encryption": "auto"}
    return config


def course_notebooks() -> dict[str, Path]:
    """Workspace-relative name → course notebook, both builds of every chapter."""
    found = {p.name: p for p in sorted(COURSE.glob("[0-9][0-9]_*.ipynb"))}
    found.update({f"solutions/{p.name}": p
                  for p in sorted((COURSE / "solutions").glob("[0-9][0-9]_*.ipynb"))})
    return found


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cells_digest(path: Path) -> str | None:
    """A hash of what a learner writes in a notebook: its cells' kinds and sources (not their
    outputs, not the metadata JupyterLab rewrites); of the whole file for anything else."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        cells = json.loads(raw)["cells"]
        content = json.dumps([[c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list)
                               else c["source"]] for c in cells])
    except (ValueError, KeyError, TypeError, RecursionError):
        return hashlib.sha256(raw).hexdigest()
    return hashlib.sha256(content.encode()).hexdigest()


def _untouched(dest: Path, src: Path, record: dict[str, str], name: str) -> bool:
    """Whether the copy ``dest`` still has the cells it was made with (or the course's own)."""
    found = _cells_digest(dest)
    return found is not None and found in {record.get(f"{name}#cells"), _cells_digest(src)}


def _say(line: str) -> None:
    print(f"kvlab: {line}")


def _load_record(work: Path) -> dict[str, str]:
    """The record of what each copy was made from; empty (said in one line) when it is damaged."""
    path = work / RECORD
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        _say(f"{path} could not be read ({type(e).__name__}); carrying on without it: the course's "
             "updates to your existing copies are not reported until `make fresh`")
        return {}
    if not isinstance(data, dict):
        _say(f"{path} holds {type(data).__name__}, not a record of your copies; carrying on without "
             "it: the course's updates to your existing copies are not reported until `make fresh`")
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _save_record(work: Path, record: dict[str, str]) -> None:
    """Write the record whole (a new file replaces the old in one step); one line if it cannot."""
    path, tmp = work / RECORD, None
    try:
        fd, tmp = tempfile.mkstemp(dir=work, prefix=".course-copies-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        _say(f"could not update {path} ({e.strerror or e}); your notebooks are untouched, but the "
             "course's updates to them may go unreported")


def _unused(path: Path, stamp: str) -> Path:
    """``NAME.<stamp>.ipynb`` beside ``path``, or ``NAME.<stamp>-2.ipynb``, ...: a name no file has."""
    n = 1
    while True:
        candidate = path.with_name(f"{path.stem}.{stamp}{f'-{n}' if n > 1 else ''}{path.suffix}")
        if not os.path.lexists(candidate):
            return candidate
        n += 1


def _trust(path: Path) -> None:
    """Sign the notebook at ``path`` as trusted (``jupyter trust``), in Jupyter's data folder."""
    try:
        import nbformat
        from nbformat.sign import NotebookNotary

        NotebookNotary().sign(nbformat.read(path, as_version=4))
    except Exception:  # noqa: BLE001  (not a notebook, no Jupyter, a read-only home: it only
        pass           # costs JupyterLab's "not trusted" line; nothing here may stop make lab)


def _copy(src: Path, dest: Path, record: dict[str, str], name: str, trust: bool = False) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    # with this environment's kernel metadata: JupyterLab then opens the copy unmodified
    copy_for_this_kernel(src, dest)
    if trust:
        _trust(dest)
    record[name] = _digest(src)
    cells = _cells_digest(dest)
    if cells is not None:
        record[f"{name}#cells"] = cells


def prepare(work: Path, trust: bool = False) -> list[str]:
    """Copy what is missing into ``work`` (signed as trusted with ``trust``); return the names
    the course changed since copied."""
    work.mkdir(parents=True, exist_ok=True)
    record = _load_record(work)
    copied, changed = [], []
    for name, src in course_notebooks().items():
        dest = work / name
        if not dest.exists():
            _copy(src, dest, record, name, trust)
            copied.append(name)
        elif record.get(name) not in (None, _digest(src)):
            changed.append(name)
    _save_record(work, record)
    for name in REFERENCES:
        if (COURSE / name).is_file():
            shutil.copyfile(COURSE / name, work / name)
    if copied:
        print(f"kvlab: copied {len(copied)} course notebooks into {work}/ (your own copies; "
              "`git pull` never touches them)")
    for name in changed:
        print(f"kvlab: the course updated {name} since your copy was made: "
              f"`make fresh CHAPTER={Path(name).name[:2]}` gets the new one "
              "(yours is kept beside it)")
    return changed


def fresh(work: Path, chapter: str, trust: bool = False) -> list[Path]:
    """A fresh copy of chapter ``chapter`` (both builds); the old copies you changed are kept,
    renamed (returned), the ones you never edited replaced."""
    names = [n for n in course_notebooks() if Path(n).name.startswith(f"{chapter}_")]
    if not names:
        raise SystemExit(f"no chapter {chapter!r} in the course's notebooks/ "
                         "(CHAPTER is its two-digit number, e.g. CHAPTER=03)")
    record, stamp, kept = _load_record(work), time.strftime("%Y%m%d-%H%M%S"), []
    for name in names:
        dest, src, note = work / name, course_notebooks()[name], ""
        if dest.exists() and _untouched(dest, src, record, name):
            note = " (yours had no edits: nothing to keep)"
        elif dest.exists():
            old = _unused(dest, stamp)  # never one that exists: `make fresh` twice a second keeps both
            dest.rename(old)
            kept.append(old)
            print(f"kvlab: kept your {name} as {old.relative_to(work)}")
        _copy(src, dest, record, name, trust)
        print(f"kvlab: fresh copy of {name}{note}")
    _save_record(work, record)
    return kept


def write_server_config(prefix: Path = Path(sys.prefix)) -> Path:
    """:func:`server_config` into this environment's Jupyter server configuration
    (``etc/jupyter/jupyter_server_config.json``; other settings in it are kept)."""
    path = prefix / "etc" / "jupyter" / "jupyter_server_config.json"
    current = _json_object(path)
    for section, values in server_config().items():
        if not isinstance(current.get(section), dict):
            current[section] = {}
        current[section].update(values)
    _write_settings(path, current, "Jupyter's", "JupyterLab may print warnings about its kernels' "
                    "connections")
    return path


def _write_settings(path: Path, settings: dict, whose: str, otherwise: str) -> None:
    """Write ``settings`` as JSON; a folder that cannot be written is said in one line (what
    the learner will see ``otherwise``), never a traceback: the course works without it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=2) + "\n")
    except OSError as e:
        _say(f"could not write {whose} settings to {path} ({e.strerror or e}); {otherwise}")


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``; empty when it is missing or is not one."""
    try:
        current = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return current if isinstance(current, dict) else {}


def write_lab_overrides(prefix: Path = Path(sys.prefix)) -> Path:
    path = prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    current = _json_object(path)
    current.update(LAB_OVERRIDES)
    _write_settings(path, current, "JupyterLab's", "it may show its news pop-up")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="copy missing notebooks into the workspace")
    p.add_argument("work", nargs="?", default="work")
    f = sub.add_parser("fresh", help="a fresh copy of one chapter (yours is kept, renamed)")
    f.add_argument("chapter", help="the chapter's two-digit number, e.g. 03")
    f.add_argument("work", nargs="?", default="work")
    args = ap.parse_args(argv)
    work = Path(args.work)
    try:
        if args.command == "prepare":
            prepare(work, trust=True)
            write_lab_overrides()
            write_server_config()
        else:
            fresh(work, args.chapter, trust=True)
    except OSError as e:  # (a folder it cannot write, a full disk): one line, not a traceback
        _say(f"could not {args.command} {work}/: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
