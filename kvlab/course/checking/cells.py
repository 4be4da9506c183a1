"""What a failed check does at the end of a notebook cell: it does not stop Run All.

A checker raises :class:`CheckFailed` everywhere: plain Python and pytest see an exception
with its whole traceback, and code that catches it (a chapter showing what the checker says
about a wrong answer) gets it. In IPython the failure is shown as its message alone
(:meth:`CheckFailed._render_traceback_`). What this module adds is the moment the failure
reaches the top of a cell, seen by IPython's ``post_run_cell`` event::

    cell raises a check's failure ──> IPython shows it (message, no kvlab frames)
                                  ──> post_run_cell: the failure is recorded (the check counts)
                                      and, in a Jupyter kernel, the cell is reported as done,
                                      so Run All goes on; later cells use the package's version
                                      (kvlab.check.choose) until the learner's passes

Only failures of a registered check (``checked_by`` set) are treated so; any other error
stops Run All as usual. A failure caught inside the cell never reaches the event, so it is not
recorded. A test that must fail on a wrong answer still does: nbval fails a cell on its error
output whatever the reply says, and the solutions build runs under nbval.
"""
from __future__ import annotations

import sys
from typing import Callable

from .failures import CheckFailed

_WATCHED: set[int] = set()  # ids of the shells whose post_run_cell event calls _after_cell
_record: Callable[[tuple], None] | None = None  # records a failure's pending call (the registry's)


def shell():
    """The running IPython shell, or None (IPython is not imported for this)."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    return get() if get is not None else None


def in_kernel() -> bool:
    """True inside a Jupyter kernel (a notebook), False in plain Python or a terminal IPython."""
    return getattr(shell(), "kernel", None) is not None


def watch(record: Callable[[tuple], None]) -> bool:
    """Have the running IPython shell hand failures that end a cell to ``record``.

    Returns False where there is no IPython shell: the caller then records at once.
    """
    global _record
    ip = shell()
    events = getattr(ip, "events", None)
    if events is None:
        return False
    _record = record
    if id(ip) not in _WATCHED:
        events.register("post_run_cell", _after_cell)
        _WATCHED.add(id(ip))
    return True


def _after_cell(result) -> None:
    err = getattr(result, "error_in_exec", None)
    if not isinstance(err, CheckFailed) or not err.checked_by:
        return
    if err.pending is not None and _record is not None:
        pending, err.pending = err.pending, None
        _record(pending)
    if in_kernel():
        result.error_in_exec = None  # shown already; the cell counts as run, Run All goes on
