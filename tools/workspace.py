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
  you had beside it as ``NN_name.<date-time>.ipynb``.

The notebooks link the glossary (``glossary.md#term``, ``../glossary.md#term`` from
``solutions/``), so ``prepare`` also puts ``notebooks/glossary.md`` in ``WORK/``: a reference,
not your work, so it is brought up to date every time.

What each copy was made from is recorded in ``WORK/.course-copies.json`` (file name → hash of
the course notebook at copy time). ``prepare`` also writes JupyterLab's settings overrides into
this environment: no news or update pop-up over the notebook.

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


def course_notebooks() -> dict[str, Path]:
    """Workspace-relative name → course notebook, both builds of every chapter."""
    found = {p.name: p for p in sorted(COURSE.glob("[0-9][0-9]_*.ipynb"))}
    found.update({f"solutions/{p.name}": p
                  for p in sorted((COURSE / "solutions").glob("[0-9][0-9]_*.ipynb"))})
    return found


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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


def _copy(src: Path, dest: Path, record: dict[str, str], name: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    # with this environment's kernel metadata: JupyterLab then opens the copy unmodified
    copy_for_this_kernel(src, dest)
    record[name] = _digest(src)


def prepare(work: Path) -> list[str]:
    """Copy what is missing into ``work``; return the names the course changed since copied."""
    work.mkdir(parents=True, exist_ok=True)
    record = _load_record(work)
    copied, changed = [], []
    for name, src in course_notebooks().items():
        dest = work / name
        if not dest.exists():
            _copy(src, dest, record, name)
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


def fresh(work: Path, chapter: str) -> list[Path]:
    """A fresh copy of chapter ``chapter`` (both builds); the old copies are kept, renamed."""
    names = [n for n in course_notebooks() if Path(n).name.startswith(f"{chapter}_")]
    if not names:
        raise SystemExit(f"no chapter {chapter!r} in the course's notebooks/ "
                         "(CHAPTER is its two-digit number, e.g. CHAPTER=03)")
    record, stamp, kept = _load_record(work), time.strftime("%Y%m%d-%H%M%S"), []
    for name in names:
        dest = work / name
        if dest.exists():
            old = _unused(dest, stamp)  # never one that exists: `make fresh` twice a second keeps both
            dest.rename(old)
            kept.append(old)
            print(f"kvlab: kept your {name} as {old.relative_to(work)}")
        _copy(course_notebooks()[name], dest, record, name)
        print(f"kvlab: fresh copy of {name}")
    _save_record(work, record)
    return kept


def write_lab_overrides(prefix: Path = Path(sys.prefix)) -> Path:
    path = prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    try:
        current = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        current = {}
    if not isinstance(current, dict):
        current = {}
    current.update(LAB_OVERRIDES)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(current, indent=2) + "\n")
    except OSError as e:
        _say(f"could not write JupyterLab's settings to {path} ({e.strerror or e}); it may show its "
             "news pop-up")
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
            prepare(work)
            write_lab_overrides()
        else:
            fresh(work, args.chapter)
    except OSError as e:  # (a folder it cannot write, a full disk): one line, not a traceback
        _say(f"could not {args.command} {work}/: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
