"""Rewrap the chapters' code lines that are wider than the page (``tests/test_code_width.py``).

    python tools/wrap_code.py notebooks/src/*.py       # rewrite them in place, then list the rest
    python tools/wrap_code.py --check notebooks/src/*.py

Only lines of code cells wider than :data:`LIMIT` are touched, each the least way that fits:

* a comment line is rewrapped into comment lines of the same indent;
* a trailing comment that makes a line too wide goes on its own line above the code;
* a statement is rewrapped by black (``--line-ranges``: that statement alone, its strings'
  quotes as they are; a long string split into adjacent ones), which this script runs when it
  is installed (``pip install black``; a tool for the course's authors, not something kvlab
  needs); black checks that the code means the same before it writes;
* a docstring's line is cut at a space.

What none of these can wrap (a long string literal, a URL) is listed with its file and line:
split it by hand (adjacent string literals join), and read black's work over as a teacher
would (a message assert reads better as ``assert cond, (f"...")`` than black's
``assert (cond), f"..."``). Then ``python tools/build_notebooks.py``. Measured on the chapters
as they were (700 lines over 88 in code cells): all rewrapped, none left.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

LIMIT = 88  # tests/test_code_width.py: MAX_CODE_COLUMNS
_TRAILING = re.compile(r"^(?P<code>.*?\S)\s{2,}#\s(?P<comment>.*)$")


def code_lines(text: str) -> list[int]:
    """Indices (from 0) of the lines of a percent-format source that belong to code cells."""
    found, kind = [], None
    for n, line in enumerate(text.splitlines()):
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
        elif kind == "code":
            found.append(n)
    return found


def _in_string(code: str) -> bool:
    """Whether ``code`` leaves a string open (a ``  #`` inside it is no comment)."""
    return code.count('"') % 2 == 1 or code.count("'") % 2 == 1


def wrap_comments(lines: list[str], wide: list[int]) -> list[str]:
    """Comment lines rewrapped, trailing comments moved above their code (bottom up)."""
    for n in sorted(wide, reverse=True):
        line = lines[n]
        indent = line[:len(line) - len(line.lstrip())]
        if line.lstrip().startswith("#"):
            body = line.lstrip()[1:].strip()
            lines[n:n + 1] = textwrap.wrap(body, LIMIT, initial_indent=indent + "# ",
                                           subsequent_indent=indent + "# ",
                                           break_long_words=False, break_on_hyphens=False)
            continue
        m = _TRAILING.match(line)
        if m and not _in_string(m["code"]) and len(m["code"]) <= LIMIT:
            above = textwrap.wrap(m["comment"], LIMIT, initial_indent=indent + "# ",
                                  subsequent_indent=indent + "# ", break_long_words=False)
            lines[n:n + 1] = above + [m["code"]]
    return lines


_ONE_LINE_DOC = re.compile(r'^(?P<indent>\s*)"""(?P<text>.*)"""$')


def wrap_docstrings(lines: list[str], wide: list[int]) -> list[str]:
    """A one-line docstring too wide becomes a docstring of lines; a line of a docstring's text
    too wide is cut in two at a space (bottom up; lines that are neither stay)."""
    for n in sorted(wide, reverse=True):
        line = lines[n]
        m = _ONE_LINE_DOC.match(line)
        indent = line[:len(line) - len(line.lstrip())]
        if m:
            parts = textwrap.wrap(m["text"], LIMIT - len(indent) - 3, break_long_words=False,
                                  break_on_hyphens=False)
            parts = [f'{indent}"""{parts[0]}'] + [indent + p for p in parts[1:]]
            if len(parts[-1]) + 3 <= LIMIT:
                parts[-1] += '"""'
            else:
                parts.append(f'{indent}"""')
            lines[n:n + 1] = parts
        elif line.lstrip().startswith('"""') and line.count('"""') == 1:  # a docstring opens
            parts = textwrap.wrap(line.strip()[3:], LIMIT - len(indent) - 3,
                                  break_long_words=False, break_on_hyphens=False)
            lines[n:n + 1] = [f'{indent}"""{parts[0]}'] + [indent + p for p in parts[1:]]
        elif not line.lstrip().startswith(("#", "f\"", "\"", "'", "f'")) and '"' not in line:
            parts = textwrap.wrap(line.strip(), LIMIT - len(indent), break_long_words=False,
                                  break_on_hyphens=False)
            if len(parts) > 1:
                lines[n:n + 1] = [indent + p for p in parts]
    return lines


def _wide(text: str) -> list[int]:
    lines = text.splitlines()
    return [n for n in code_lines(text) if len(lines[n]) > LIMIT]


def wrap(path: Path, black: str | None) -> list[str]:
    """Rewrap ``path`` in place; the lines still too wide, ``file:line: text`` each."""
    text = path.read_text()
    lines = wrap_comments(text.splitlines(), _wide(text))
    path.write_text("\n".join(lines) + "\n")
    wide = _wide(path.read_text())
    if wide and black:
        ranges = [f"--line-ranges={n + 1}-{n + 1}" for n in wide]
        # black's string processing splits a long string literal into adjacent ones
        subprocess.run([black, "-q", "--preview", "--enable-unstable-feature", "string_processing",
                        "--line-length", str(LIMIT), "--skip-string-normalization",
                        "--skip-magic-trailing-comma", *ranges, str(path)], check=True)
    text = path.read_text()
    lines = wrap_docstrings(text.splitlines(), _wide(text))
    path.write_text("\n".join(lines) + "\n")
    lines = path.read_text().splitlines()
    return [f"{path}:{n + 1}: {lines[n].strip()[:70]}" for n in _wide(path.read_text())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="only list the lines too wide")
    args = ap.parse_args(argv)
    if args.check:
        left = [f"{p}:{n + 1}" for p in args.sources for n in _wide(p.read_text())]
    else:
        black = shutil.which("black")
        if black is None:
            print("wrap_code: black is not installed: only comments are rewrapped "
                  "(pip install black)", file=sys.stderr)
        left = [line for p in args.sources for line in wrap(p, black)]
    for line in left:
        print(line)
    print(f"{len(left)} code lines wider than {LIMIT} characters", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
