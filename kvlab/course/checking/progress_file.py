"""Where the learner's progress is kept between sessions: a small JSON file on their machine.

Each check that counts (a pass, an untouched starter, a failure that ended a cell) writes its
exercise's state here, so that ``kvlab.check.progress()`` can list the whole course after a
restart. The file is ``$KVLAB_PROGRESS_FILE``, else ``progress.json`` in kvlab's cache folder
(``$KVLAB_CACHE_DIR``, else ``~/.cache/kvlab``, beside the C helper of
:mod:`kvlab.alloc.native_counts`)::

    {"version": 1,
     "exercises": {"page_to_token": {"state": "passed", "chapter": "01",
                                     "at": "2025-01-31 14:05"}, ...}}

Nothing a learner earned is lost, whatever happens around it:

* **Several notebooks at once.** A save merges its entry into the file as it is *now*, under a
  lock (``.progress.json.lock`` beside it, ``fcntl.flock``, released by the system if a kernel
  dies), and the new file replaces the old in one step (``os.replace``): a reader never sees
  half a file, and two notebooks saving at once both keep their records.
* **A file it cannot read is never overwritten.** One that is not UTF-8 JSON (a UTF-8 BOM is
  fine), is nested too deep, is not an object with an ``"exercises"`` object, or holds an entry
  that is not ``{"state": "passed" | "failed" | "not attempted", "chapter": str, "at": str}``
  is moved aside as ``progress.unreadable-<date-time>.json`` (a new name, never an existing
  one), with one line saying so, and a new file starts from the entries that could be read.
* **Nothing here breaks a check.** A file that cannot be written is skipped with one warning;
  the entries not saved yet stay in this session and go with the next save that succeeds.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from ...alloc.native_counts import cache_dir

try:
    import fcntl
except ImportError:  # (Windows, which `make lab` refuses: saves there are not locked)
    fcntl = None

ENV = "KVLAB_PROGRESS_FILE"
VERSION = 1
STATES = ("passed", "failed", "not attempted")
LOCK_WAIT_S = 10.0  # a save waits this long for another notebook's save, then gives up (warned)
_warned = False
_pending: dict[Path, dict[str, dict]] = {}  # file -> this session's entries not saved there yet


def path() -> Path:
    """The progress file: ``$KVLAB_PROGRESS_FILE``, else ``<kvlab cache>/progress.json``."""
    return Path(os.environ.get(ENV) or os.path.join(cache_dir(), "progress.json"))


def _parse(raw: bytes) -> tuple[dict, dict[str, dict], str | None]:
    """(the file's object, its entries that can be read, what is wrong with it or None)."""
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return {}, {}, f"{type(e).__name__}: {e}"[:120]
    if not isinstance(data, dict) or not isinstance(data.get("exercises", {}), dict):
        return {}, {}, 'not a JSON object with an "exercises" object'
    good, bad = {}, []
    for name, entry in data.get("exercises", {}).items():
        if (isinstance(entry, dict) and entry.get("state") in STATES
                and all(isinstance(entry.get(k, ""), str) for k in ("chapter", "at"))):
            good[name] = entry
        else:
            bad.append(name)
    why = f"{len(bad)} entr{'y' if len(bad) == 1 else 'ies'} it cannot read ({bad[0]!r}...)" if bad else None
    return data, good, why


def _read(target: Path) -> tuple[dict, dict[str, dict], str | None]:
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        return {}, {}, None
    return _parse(raw)


def load() -> dict[str, dict]:
    """exercise name -> {"state", "chapter", "at"} as last saved (with this session's entries not
    saved yet over them); empty when there is no file. A file it cannot read is moved aside (see
    the module docstring). Never raises."""
    target, entries = path(), {}
    try:
        _, entries, why = _read(target)
        if why is not None:
            entries = _sync()
    except Exception as e:  # noqa: BLE001 - progress is a convenience: never break a check
        _warn(f"kvlab could not read your progress from {target} ({e})")
    return {**entries, **_pending.get(target, {})}


def save(name: str, chapter: str, state: str) -> None:
    """Record that exercise ``name`` is now ``state`` ("passed", "failed", "not attempted")."""
    entry = {"state": state, "chapter": chapter, "at": time.strftime("%Y-%m-%d %H:%M")}
    _pending.setdefault(path(), {})[name] = entry
    try:
        _sync()
    except Exception as e:  # noqa: BLE001 - never break a check (the entry stays pending)
        _warn(f"kvlab could not save your progress to {path()} ({e}); set {ENV} to a writable "
              "file to keep it")


def _sync() -> dict[str, dict]:
    """Under the lock: read the file as it is now, set it aside if it cannot be read, merge this
    session's pending entries in and write it whole. Returns the entries now saved."""
    target = path()
    pending = _pending.get(target, {})
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        data, entries, why = _read(target)
        if why is not None:
            _set_aside(target, why)
            data = {}
        if not pending and why is None:
            return entries
        data = dict(data, version=data.get("version", VERSION), exercises={**entries, **pending})
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".progress-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, target)  # whole or not at all
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _pending.pop(target, None)
        return data["exercises"]


@contextmanager
def _locked(target: Path):
    """Hold the progress file's lock (another process's save waits, at most ``LOCK_WAIT_S``)."""
    fd = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError("another kvlab process held its lock for "
                                       f"{LOCK_WAIT_S:.0f} s") from None
                time.sleep(0.002)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _set_aside(target: Path, why: str) -> Path:
    """Move an unreadable progress file to a name nobody uses yet; say so in one line."""
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
    while True:
        aside = target.with_name(f"{target.stem}.unreadable-{stamp}{f'-{n}' if n else ''}{target.suffix}")
        if not os.path.lexists(aside):
            break
        n += 1
    os.rename(target, aside)  # (under the lock: no kvlab process takes that name meanwhile)
    print(f"kvlab: your progress file {target} could not be read ({why}); it is kept as "
          f"{aside.name} beside it, and a new one starts from what could be read.", file=sys.stderr)
    return aside


def _warn(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=4)
