"""Where ``python -m kvlab.bench`` writes: checked before it measures, and a finished run is
never lost.

A run takes minutes (``--memory`` tens of them), so what could stop it from being written is
found first: ``--out`` must name a folder this process can write in (made if missing; not a
file, not an empty string), and a part run (``--serve``, ``--attention``, ``--memory``), which
adds its part to the ``bench.json`` already there, must be able to read that file. If writing
still fails at the end (the folder went away, the disk filled up), the results go to a new file
in the temporary folder and the error says where (:class:`NotWritten`).
"""
from __future__ import annotations

import json
import os
import tempfile

__all__ = ["BadOut", "NotWritten", "checked_out", "keep_elsewhere"]


class BadOut(Exception):
    """``--out`` cannot take the results; the message is one line, naming it and the rule."""


class NotWritten(Exception):
    """A finished run could not be written to its folder; its results are in ``kept``."""

    def __init__(self, out: str, why: BaseException, kept: str):
        self.out, self.why, self.kept = out, why, kept
        super().__init__(f"could not write the results to {out} ({type(why).__name__}: {why}); "
                         f"they are kept in {kept}")


def checked_out(out, *, adds_to_existing: bool) -> str:
    """``out`` once it is a folder this process can write in (made now if missing), and, for a
    run that ``adds_to_existing`` ``bench.json``, one whose ``bench.json`` (if any) reads as a
    JSON object. :class:`BadOut` otherwise, before anything is measured."""
    if not isinstance(out, str) or not out.strip():
        raise BadOut("--out: a folder to write the results in (got "
                     + (f"{out!r})" if isinstance(out, str) else f"a {type(out).__name__})"))
    if os.path.exists(out) and not os.path.isdir(out):
        raise BadOut(f"--out {out}: a folder to write the results in, not a file")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):   # writable by this process?
            pass
    except OSError as e:
        raise BadOut(f"--out {out}: cannot write there ({e.strerror or type(e).__name__})") from None
    path = os.path.join(out, "bench.json")
    if adds_to_existing and os.path.exists(path):
        try:
            with open(path) as f:
                held = json.load(f)
            if not isinstance(held, dict):
                raise ValueError(f"a JSON {type(held).__name__}, not an object")
        except (OSError, ValueError) as e:   # (json's errors are ValueErrors)
            raise BadOut(f"--out {out}: this run adds to its bench.json, which cannot be read "
                         f"({type(e).__name__}: {str(e)[:80]}): move it aside or choose another "
                         "--out") from None
    return out


def keep_elsewhere(result: dict) -> str:
    """Write ``result`` to a new file in the temporary folder; its path."""
    fd, path = tempfile.mkstemp(prefix="kvlab-bench-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return path
