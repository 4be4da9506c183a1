"""Where the learner stands: ``kvlab.check.progress()`` and ``kvlab.check.recheck("NN")``.

* :func:`progress` lists every exercise of the course (every chapter's checker module is
  loaded, so a new chapter's exercises appear by being registered) with its state as last
  saved on this machine (:mod:`kvlab.course.checking.progress_file`): passed, failing or not attempted.
  The setup cell of every chapter prints its one-line summary.
* :func:`recheck` ends every chapter: it runs each exercise of the chapter again on the
  function the learner last checked in this kernel, so a chapter's last cell says what holds
  now (after an answer was changed further up, say). ``tools/build_notebooks.py`` appends that
  cell (:func:`closing_cells`) to every chapter with a registered exercise.
"""
from __future__ import annotations

from ..checking import progress_file
from .catalog import exercises
from ..checking.failures import CheckFailed
from ..checking.registry import EXERCISES, LAST_CALL, STATUS, record, verdict

#: the words progress() uses for the states a check records
WORDS = {"passed": "passed", "failed": "failing", "not attempted": "not attempted"}


def states() -> dict[str, str]:
    """exercise name -> "passed", "failing" or "not attempted", for every exercise of the course,
    in chapter order (saved progress, with this session's checks over it)."""
    saved = progress_file.load()
    out = {}
    for name in exercises():
        state = STATUS.get(name) or saved.get(name, {}).get("state", "not attempted")
        out[name] = WORDS.get(state, "not attempted")
    return out


def summary(found: dict[str, str] | None = None) -> str:
    """One line: how many exercises are passed and which are failing."""
    found = states() if found is None else found
    passed = sum(s == "passed" for s in found.values())
    failing = [n for n, s in found.items() if s == "failing"]
    line = f"Your progress: {passed} of {len(found)} exercises passed"
    if failing:
        line += f", {len(failing)} failing ({', '.join(failing)})"
    return line + "; kvlab.check.progress() lists them all."


def progress(*, brief: bool = False) -> None:
    """Print every exercise of the course with its state; ``brief``: only the summary line.

    The states are kept between sessions in :func:`kvlab.course.checking.progress_file.path`
    (``KVLAB_PROGRESS_FILE`` moves it). Returns None, so a notebook does not echo it.
    """
    found = states()
    print(summary(found))
    if brief:
        return
    saved = progress_file.load()
    width = max(map(len, found), default=0)
    for name, state in found.items():
        when = saved.get(name, {}).get("at", "") if state != "not attempted" else ""
        print(f"  {EXERCISES[name].chapter}  {name:<{width}}  {state:<13}  {when}".rstrip())
    print(f"  (kept in {progress_file.path()})")


def chapters() -> list[str]:
    """The chapters ("00", "01", ...) that have at least one registered exercise."""
    return sorted({EXERCISES[name].chapter for name in exercises()})


def closing_cells(chapter) -> tuple[str, str]:
    """(markdown, code) of the cells that end ``chapter``'s notebooks: the recheck."""
    return (CLOSING_TEXT, f'kvlab.check.recheck("{_chapter(chapter)}")')


CLOSING_TEXT = """## Where you stand

The last cell checks this chapter's exercises again, each on the function you last checked
(run it after changing an answer further up). Its last line counts your exercises in the whole
course, kept between sessions on this machine; `kvlab.check.progress()` lists them all."""


def _chapter(chapter) -> str:
    text = str(chapter).strip()
    return f"{int(text):02d}" if text.isdigit() else text


def _why_unchecked(name: str) -> str:
    """What happened to an exercise never checked in this session, in a recheck's words."""
    before = EXERCISES[name].after
    if before is not None and STATUS.get(before) == "failed":
        return (f"not checked in this session: kvlab.check.{before} failed before it in the same "
                "cell, and a failed check ends its cell, so this check did not run (once "
                f"{before} passes, run that cell again, then this one)")
    if before is not None and before not in LAST_CALL:
        return (f"not checked in this session (nor is {before}, checked before it in the same "
                "cell: run that cell, then this one)")
    return "not checked in this session (run its cell above, then this one)"


def recheck(chapter) -> None:
    """Check every exercise of ``chapter`` ("01") again, on the function you last checked.

    Prints one line per exercise (``not checked in this session`` for one never run in this
    kernel) and the summary of :func:`progress`. A failing exercise raises :class:`CheckFailed`
    naming each one that fails; in a notebook it is shown like any check's failure.
    """
    chapter = _chapter(chapter)
    names = [n for n in exercises() if EXERCISES[n].chapter == chapter]
    if not names:
        known = sorted({ex.chapter for ex in EXERCISES.values()})
        raise KeyError(f"chapter {chapter!r} has no exercises; chapters with exercises: "
                       f"{', '.join(known)}")
    print(f"Chapter {chapter}, each exercise checked again on the function you last checked:")
    failing: list[tuple[str, CheckFailed]] = []
    for name in names:
        call = LAST_CALL.get(name)
        if call is None:
            print(f"· {name}: {_why_unchecked(name)}")
            continue
        fn, args, kwargs = call
        found = verdict(name, fn, args, kwargs)
        record(name, found.state, call)
        if found.state == "not attempted":
            print(f"· {name}: not attempted yet ({found.why})")
        elif found.error is not None:
            failing.append((name, found.error))
    print(summary())
    if failing:
        verb = "fails" if len(failing) == 1 else "fail"
        err = CheckFailed(f"{len(failing)} of {len(names)} exercise{'s' * (len(names) > 1)} of "
                          f"chapter {chapter} {verb}:\n"
                          + "\n".join(f"{name}: {e.message}" for name, e in failing))
        err.checked_by = f"kvlab.check.recheck({chapter!r})"
        raise err
