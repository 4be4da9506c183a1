"""Reference solutions, shown on request: ``kvlab.solutions.show("page_to_token")``.

Solutions are registered with their exercise (see :mod:`kvlab.course.checking.registry`); this module
prints their source so a learner who is stuck can read one (:func:`show`; :func:`source` gives
the text, :func:`get` the function).

Some exercises share one solution and each write a part of it: chapter 03's three
exercises are the three parts of one kernel. Such an exercise is registered with
``exercise(..., solution_regions=(...))``, naming the regions of the solution it covers, and ``show`` then
prints only those regions (with the solution's signature), so that reading the answer to
part 1 does not give away parts 2 and 3. A region starts at a region comment, a line
``# ---- <title> ----``, and ends before the next one::

    def kernel(...):
        # ---- part 1: ... ----      <- show("..._part1") prints from here
        ...
        # ---- part 2: ... ----      <- ... to here (not included)
"""
from __future__ import annotations

import inspect
import textwrap
from typing import Sequence

from .check import _load_all
from .checking.core import EXERCISES

REGION_PREFIX = "# ----"


def get(name: str):
    """The reference solution of exercise ``name`` (a function or kernel)."""
    _load_all()
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; known: {', '.join(sorted(EXERCISES))}")
    sol = EXERCISES[name].solution
    if sol is None:
        raise KeyError(f"exercise {name!r} has no stored solution")
    return sol


def where(name: str) -> str:
    """Where the solution of ``name`` lives, e.g. ``kvlab.alloc.alloc_kernels.alloc_extend_kernel``."""
    target = getattr(get(name), "fn", get(name))
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _signature_end(lines: Sequence[str]) -> int:
    """Index of the line that ends the ``def`` header (the first line ending in ``:`` after it)."""
    for i, line in enumerate(lines):
        if line.lstrip().startswith("def "):
            for j in range(i, len(lines)):
                if lines[j].split("#")[0].rstrip().endswith(":"):
                    return j
    raise ValueError("no function header found")


def regions(src: str, titles: Sequence[str]) -> str:
    """The header of the function in ``src`` and the regions named by ``titles``, in source order.

    Lines left out are replaced by one ``...`` line at the body's indentation.
    """
    lines = textwrap.dedent(src).splitlines()
    header_end = _signature_end(lines)
    starts = [i for i, line in enumerate(lines) if line.strip().startswith(REGION_PREFIX)]
    picked: list[tuple[int, int]] = []
    for title in titles:
        hits = [i for i in starts if title in lines[i]]
        if len(hits) != 1:
            raise ValueError(f"region {title!r}: found {len(hits)} region comments containing it")
        begin = hits[0]
        end = next((i for i in starts if i > begin), len(lines))
        picked.append((begin, end))
    picked.sort()
    indent = " " * (len(lines[picked[0][0]]) - len(lines[picked[0][0]].lstrip())) if picked else "    "
    out = lines[: header_end + 1]
    at = header_end + 1
    for begin, end in picked:
        if begin > at:
            out.append(f"{indent}...")
        while end > begin and not lines[end - 1].strip():
            end -= 1  # no trailing blank lines inside a region
        out.extend(lines[begin:end])
        at = end
    if at < len(lines):
        out.append(f"{indent}...")
    return "\n".join(out) + "\n"


def source(name: str, *, whole: bool = False) -> str:
    """The text :func:`show` prints for exercise ``name``: a header, then the solution's source.

    An exercise that is one part of a shared solution (registered with ``solution_regions``)
    gets only its own part, unless ``whole=True``. The header says where the code lives in
    the package and which exercises share it.
    """
    _load_all()
    sol = get(name)
    target = getattr(sol, "fn", sol)  # a @triton.jit kernel keeps the Python function in .fn
    try:
        src = inspect.getsource(target)
    except (OSError, TypeError):
        src = repr(sol)
    shared = sorted(n for n, ex in EXERCISES.items() if ex.solution is sol and n != name)
    header = f"# Reference solution for {name!r}: {where(name)}"
    titles = EXERCISES[name].solution_regions or None
    if titles and not whole:
        src = regions(src, titles)
        header += (f"\n# (only what {name} asks for: {', '.join(t.rstrip(':') for t in titles)}; "
                   f"kvlab.solutions.show({name!r}, whole=True) prints the whole function)")
    if shared:
        header += f"\n# (the same code is the solution of {', '.join(shared)})"
    return f"{header}\n{src}"


def show(name: str, *, whole: bool = False) -> None:
    """Print the reference solution of ``name`` (see :func:`source`). Returns None, so a
    notebook cell ending with it shows the solution once."""
    print(source(name, whole=whole))
