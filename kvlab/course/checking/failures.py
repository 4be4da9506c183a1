"""What a check reports, and the vocabulary its messages use.

* :class:`CheckFailed` - the learner's answer is wrong; the message says where and how. In
  IPython (a notebook) it is shown as its message alone (:meth:`CheckFailed._render_traceback_`):
  the frames of the checker are machinery, not news. :class:`LearnerRaised` - the learner's
  code raised (possibly in a child process); its message holds the learner's own lines.
* :class:`Case` - one named input of a checker; :class:`Segment` - a labelled range of a flat
  output ("request 1, part 3"); :class:`Layout` - what a checker tells the safety net about a
  call, so that a memory finding is told in the same words ("by request 1, part 2").

This is the bottom floor of :mod:`kvlab.check`: it imports nothing from the package.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence


#: labels of a failure whose message names its cause: it comes before the safety net's findings
#: (a checker that recognised the slip behind an access outside a tensor says "named cause")
CAUSE_NAMED = ("part region", "named cause")


class CheckFailed(AssertionError):
    """The learner's answer differs from the reference. The message says where and how."""

    #: the call that gave this verdict ("kvlab.check.page_to_token"), set by the registry; a
    #: failure with one does not stop a notebook's Run All (:mod:`kvlab.course.checking.cells`)
    checked_by: str | None = None
    #: one line shown under the message in a notebook (what happens next)
    footer: str = ""
    #: (exercise, call) still to be recorded as failing once this failure reaches the top of a
    #: notebook cell: a failure caught inside the cell (a demonstration) does not count
    pending: tuple | None = None

    def __init__(self, message: str, *, case: str | None = None, expected: Any = None,
                 got: Any = None, wrong: Sequence[int] | None = None, label: str | None = None,
                 shape: Sequence[int] | None = None,
                 segments: Sequence["Segment"] | None = None, what: str | None = None,
                 page_size: int | None = None):
        self.case = case
        self.expected = expected
        self.got = got
        self.wrong = list(wrong) if wrong is not None else []
        self.label = label  # e.g. "request 1, part 3" or "region: duplicate"
        # for the failure picture (kvlab.course.checking.picture): the output's shape before flattening,
        # the labelled ranges of the flat output, and what the output is called
        self.shape = tuple(shape) if shape is not None else None
        self.segments = list(segments) if segments is not None else []
        self.what = what
        self.page_size = page_size  # a page table is drawn with page boundaries when given
        self.band_writes: list = []  # guard-band writes of the safety net, drawn as bands
        self.accesses: list = []  # the safety net's findings (kvlab.course.checking.findings.Access)
        super().__init__(message)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def add_case(self, case: str) -> "CheckFailed":
        """Prefix the message with ``[case]`` (once) and remember the case; returns self."""
        if self.case is None:
            self.case = case
        if not self.message.startswith(f"[{case}]"):
            self.args = (f"[{case}] {self.message}",) + tuple(self.args[1:])
        return self

    def extend(self, text: str) -> "CheckFailed":
        """Append ``text`` to the message (a line of advice, the inputs); returns self."""
        self.args = (self.message + text,) + tuple(self.args[1:])
        return self

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a traceback: the message, headed by what failed.

        None of kvlab's frames: a crash in the learner's code is told in the message, with the
        learner's own lines. Plain Python and pytest ignore this and print the whole traceback.
        """
        first, *rest = self.message.splitlines() or [""]
        head = self.checked_by or type(self).__name__
        lines = [f"{_RED}✗ {head}:{_PLAIN} {first}", *rest]
        return lines + ([self.footer] if self.footer else [])


_RED, _PLAIN = "\x1b[1;31m", "\x1b[0m"  # bold red in a notebook's error output


class LearnerRaised(CheckFailed):
    """The learner's code raised. ``original`` is the exception (when it could be sent back)."""

    def __init__(self, message: str, *, original: BaseException | None = None,
                 traceback_text: str = ""):
        self.original = original
        self.traceback_text = traceback_text
        super().__init__(message)


@dataclass(frozen=True)
class Case:
    """One named input for a checker. ``kind`` is "edge" or "random"."""

    name: str
    args: dict
    kind: str = "edge"


@dataclass(frozen=True)
class Segment:
    """A labelled range ``[start, end)`` of a flat output, e.g. one request's part 2."""

    label: str
    start: int
    end: int


@dataclass(frozen=True)
class Layout:
    """How a checker's call is described when the safety net finds something.

    ``programs`` names what one program of a kernel's grid serves ("request": program 3 is
    "request 3"); ``segments`` labels the elements of output arguments (``{"out_indices":
    [Segment("request 1, part 2", 4, 12), ...]}``), so that a stray access can be placed in a
    part; ``inputs`` is the case's inputs on one line, printed under the finding.
    """

    programs: str = "program"
    segments: Mapping[str, Sequence[Segment]] = field(default_factory=dict)
    inputs: str = ""

    def program_label(self, program: Sequence[int]) -> str:
        """"request 3" for a grid of one dimension, "program (1, 0)" for more."""
        return f"{self.programs} {program[0] if len(program) == 1 else tuple(program)}"


def label_at(index: int, segments: Iterable[Segment] | None) -> str | None:
    """The label of the first segment holding ``index``, else None."""
    for seg in segments or ():
        if seg.start <= index < seg.end:
            return seg.label
    return None


def fmt_values(values, limit: int = 12) -> str:
    """``[1, 2, 3]``, or the first ``limit`` values and how many there are in all."""
    vals = [int(v) for v in values]
    if len(vals) > limit:
        return "[" + ", ".join(map(str, vals[:limit])) + f", ... ({len(vals)} in all)]"
    return "[" + ", ".join(map(str, vals)) + "]"
