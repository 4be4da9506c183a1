"""What the safety net saw: memory accesses outside a tensor, and how to tell them.

Three witnesses report an :class:`Access`, from the most to the least precise:

* the **audit** (Triton's interpreter only, :mod:`kvlab.course.checking.audit`) checks every load and
  store of a kernel as it happens: read or write, which argument, how far out, which program
  (request), which line of the kernel and which part of it;
* the **guard bands** (:mod:`kvlab.course.checking.guards`) notice afterwards that a value was written
  just outside a tensor (every runtime, also on a GPU);
* a **sentinel** value of a guard band turning up in an output shows that something read just
  outside a tensor and used the value.

:func:`describe` turns them into lines in the checker's words (:class:`Layout`).
"""
from __future__ import annotations

import linecache
import re
from typing import NamedTuple, Sequence

from .failures import Layout, label_at


class Access(NamedTuple):
    """One kind of out-of-bounds access (several lanes of one load or store count once)."""

    kind: str  # "read" or "write"
    argument: str  # the argument whose memory it missed (the nearest one when "far")
    side: str  # "after" (past the end), "before" (before the start) or "far" (outside every band)
    distance: int  # elements outside the argument: 1 = right next to it
    count: int = 1  # accesses like it (lanes, or guard-band elements changed)
    program: tuple[int, ...] | None = None  # the grid index of the program that made it
    filename: str | None = None  # where in the kernel (the audit knows)
    line: int | None = None
    function: str | None = None
    next_store: tuple[str, int] | None = None  # (argument, element) the program stored next
    landed: str | None = None  # a read seen by its value: where the value turned up
    reaches_band_end: bool = False  # a guard band changed up to its far end (may go further)
    others: int = 0  # other programs that made the same access

    def key(self) -> tuple:
        """Accesses with the same key are one mistake (e.g. one load, in several programs)."""
        return (self.kind, self.argument, self.side, self.filename, self.line)


_PART = re.compile(r"^#[\s\-=#*:]*(?:your code[:,]?\s*)?(part\s*\d+)\b", re.IGNORECASE)


def region_of(filename: str | None, line: int | None, function: str | None = None) -> str | None:
    """The kernel's own section comment above ``line`` ("# ---- part 2: ..." -> "part 2").

    Only comment lines that start with "part N" (after dashes, or "your code:") count, and the
    search stops at the ``def`` of the kernel.
    """
    if not filename or not line:
        return None
    for n in range(line - 1, max(0, line - 400), -1):
        text = linecache.getline(filename, n).strip()
        if text.startswith("def ") or text.startswith("@triton.jit"):
            return None
        m = _PART.match(text)
        if m:
            return "part " + re.search(r"\d+", m.group(1)).group(0)
    return None


def _where(access: Access, layout: Layout) -> str:
    """"by request 1, part 2" from the program, the kernel's section comment or the next store."""
    if access.program is None:
        return ""
    who = layout.program_label(access.program)
    part = region_of(access.filename, access.line, access.function)
    if part is None and access.next_store is not None:
        arg, index = access.next_store
        part = label_at(index, layout.segments.get(arg))
    more = (f" (and {access.others} more {layout.programs}{'s' if access.others > 1 else ''})"
            if access.others else "")
    if part and part.startswith(who):
        return f" by {part}{more}"
    if part and _nothing_from(who, part, layout):  # e.g. a missing early return
        more += f" ({who} has no {part} or later part in this case: should it have returned?)"
    return f" by {who}" + (f", {part}" if part else "") + more


def statement_at(filename: str, line: int, limit: int = 110) -> str:
    """The source statement starting at ``line``, joined onto one line (brackets balanced)."""
    parts, depth = [], 0
    for n in range(line, line + 8):
        src = linecache.getline(filename, n)
        if not src:
            break
        code = src.split("#")[0]
        parts.append(src.strip() if n == line else code.strip())
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0:
            break
    text = " ".join(" ".join(parts).split()).replace("( ", "(").replace(" )", ")")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _nothing_from(who: str, part: str, layout: Layout) -> bool:
    """Whether the layout labels parts of ``who``'s output and none is ``part`` or later: the
    code of ``part`` should not have run for it (a part's code may run with nothing to write
    only on the way to a later part)."""
    labels = [seg.label for segs in layout.segments.values() for seg in segs]
    numbered = [m for lab in labels if (m := re.fullmatch(r"(.+), part (\d+)", lab))]
    if not numbered:
        return False
    k = int(part.split()[-1])
    return not any(m.group(1) == who and int(m.group(2)) >= k for m in numbered)


def _code(access: Access) -> str:
    if not access.line:
        return ""
    src = statement_at(access.filename or "", access.line)
    fn = f"in {access.function}, " if access.function else ""
    return f" ({fn}line {access.line}" + (f": {src}" if src else "") + ")"


def describe(access: Access, layout: Layout = Layout()) -> str:
    """One line, e.g. "a read past the end of `free_pages` (1 element out) by request 2, part 2
    (in my_kernel, line 57: page = tl.load(...))"."""
    arg = f"`{access.argument}`"
    far = f"{access.distance} element{'s' if access.distance != 1 else ''}"
    what = "write" if access.kind == "write" else "read"
    many = f"{access.count} {what}s, " if access.count > 1 else ""
    if access.side == "far":
        place = "far outside every tensor"
        how_far = (f"{many}{far} from the nearest, {arg}" if access.distance <= FAR_NAMED else
                   f"{many}about {access.distance:.1e} elements from the nearest tensor")
    else:
        place = f"{'past the end' if access.side == 'after' else 'before the start'} of {arg}"
        how_far = f"{many}up to {far} out"
    if access.reaches_band_end:
        how_far += ", the whole guard band: it may have gone further"
    text = f"a {what} {place} ({how_far}){_where(access, layout)}{_code(access)}"
    if access.landed:
        text = f"`{access.landed}` holds a guard value: {text}"
    return text


FAR_NAMED = 4096  # elements: a far access is told with the nearest argument's name up to this
MAX_LINES = 4  # accesses listed in one report; the first ones are the likely cause

ADVICE = ("Mask every tl.load / tl.store whose offsets can reach past the data (mask=offs < n), "
          "and check the index you compute for each program.")


def message(accesses: Sequence[Access], layout: Layout = Layout()) -> str:
    """The safety net's whole report: one line per access, the inputs, the advice."""
    lines = [describe(a, layout) for a in accesses[:MAX_LINES]]
    if len(accesses) > MAX_LINES:
        lines.append(f"... and {len(accesses) - MAX_LINES} more")
    text = "the safety net caught memory accesses outside the tensors:\n  " + "\n  ".join(lines)
    if layout.inputs:
        text += f"\n  inputs: {layout.inputs}"
    return text + "\n  " + ADVICE


def merge(accesses: Sequence[Access]) -> list[Access]:
    """One access per kind of mistake, in the order first seen; counts and distances combined.

    The audit sees a read when it happens; the guard bands and sentinels may see the same
    mistake afterwards: an access the audit already reported (same kind, argument and side) is
    not repeated.
    """
    out: dict[tuple, Access] = {}
    exact = {(a.kind, a.argument, a.side) for a in accesses if a.program is not None}
    for a in accesses:
        if a.program is None and (a.kind, a.argument, a.side) in exact:
            continue
        k = a.key()
        if k in out:
            old = out[k]
            out[k] = old._replace(count=old.count + a.count, distance=max(old.distance, a.distance),
                                  reaches_band_end=old.reaches_band_end or a.reaches_band_end,
                                  others=old.others + a.others + (a.program != old.program))
        else:
            out[k] = a
    return list(out.values())
