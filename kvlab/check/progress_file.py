"""Where the learner's progress is kept between sessions: a small JSON file on their machine.

Each check that counts (a pass, an untouched starter, a failure that ended a cell) writes its
exercise's state here, so that ``kvlab.check.progress()`` can list the whole course after a
restart. The file is ``$KVLAB_PROGRESS_FILE``, else ``progress.json`` in kvlab's cache folder
(``$KVLAB_CACHE_DIR``, else ``~/.cache/kvlab``, beside the C helper of
:mod:`kvlab.native_counts`)::

    {"version": 1,
     "exercises": {"page_to_token": {"state": "passed", "chapter": "01",
                                     "at": "2025-01-31 14:05"}, ...}}

A file that cannot be read counts as empty; one that cannot be written is skipped with one
warning: progress is a convenience and never breaks a check.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path

from ..native_counts import cache_dir

ENV = "KVLAB_PROGRESS_FILE"
VERSION = 1
_warned = False


def path() -> Path:
    """The progress file: ``$KVLAB_PROGRESS_FILE``, else ``<kvlab cache>/progress.json``."""
    return Path(os.environ.get(ENV) or os.path.join(cache_dir(), "progress.json"))


def load() -> dict[str, dict]:
    """exercise name -> {"state", "chapter", "at"} as last saved; empty when there is no file."""
    try:
        data = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("exercises") if isinstance(data, dict) else None
    return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}


def save(name: str, chapter: str, state: str) -> None:
    """Record that exercise ``name`` is now ``state`` ("passed", "failed", "not attempted")."""
    global _warned
    entries = load()
    entries[name] = {"state": state, "chapter": chapter, "at": time.strftime("%Y-%m-%d %H:%M")}
    target, tmp = path(), None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".progress-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "exercises": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, target)  # whole or not at all, also with two notebooks open
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if not _warned:
            _warned = True
            warnings.warn(f"kvlab could not save your progress to {target} ({e}); set "
                          f"{ENV} to a writable file to keep it", RuntimeWarning, stacklevel=3)
