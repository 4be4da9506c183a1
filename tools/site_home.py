"""The website's home page: the intro, then README's course table with what each chapter
builds and a picture from it, then the navigation (``tools/build_site.py`` writes it).

The chapters are found by globbing (a new one appears with no edit); README is where a
chapter's row is written (:func:`course_table`), and the site shows the same.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from site_pages import BADGE_IMAGE, NOTEBOOKS, ROOT, Chapter, LinkRebaser

README = ROOT / "README.md"


@dataclass(frozen=True)
class CourseRow:
    """One row of README's course table."""
    number: str       # "03"
    what: str         # what you build (Markdown)
    picture: str      # the picture's path in the repository ("figures/03_x.png"), or ""
    alt: str          # its alt text


_RAW_FIGURE = re.compile(r'<img\s[^>]*src="[^"]*/(?:main|master)/(figures/[^"]+)"[^>]*>')


def course_table(readme: str) -> dict[str, CourseRow]:
    """README's course table (``| NN | chapter | what you build | picture | run it |``), by
    chapter number. README is where a chapter's row is written; the site shows the same."""
    rows = {}
    for line in readme.splitlines():
        m = re.match(r"^\|\s*(\d\d)\s*\|", line)
        if not m:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5:
            continue
        picture = _RAW_FIGURE.search(cells[3])
        alt = re.search(r'\balt="([^"]*)"', cells[3])
        rows[m[1]] = CourseRow(m[1], cells[2], picture[1] if picture else "",
                               alt[1] if alt else "")
    return rows


def index_page(intro: str, rows: list[tuple[Chapter, str]], has_glossary: bool,
               course: dict[str, CourseRow] | None = None,
               rebaser: LinkRebaser | None = None) -> str:
    """The home page: the intro, the table of the chapters (found by globbing; what each
    builds and a picture from it, from README's table ``course``), the toctree."""
    course = course or {}
    lines = [intro.rstrip(), "", "## The chapters", "", ":::{container} kvlab-course", "",
             "| | chapter | what you build | a picture from it | run it |",
             "|---|---|---|---|---|"]
    for chapter, title in rows:
        number, _, name = title.partition(" · ")
        badge = f"[![Open in Colab]({BADGE_IMAGE})]({chapter.colab})"
        row = course.get(number)
        what = row.what if row else ""
        picture = ""
        if row and row.picture and rebaser is not None:
            src = rebaser.target(f"../{row.picture}", NOTEBOOKS)
            picture = (f'<img src="{src}" alt="{row.alt}" class="kvlab-course-picture" '
                       'width="300">')
        lines.append(f"| {number} | [{name or title}]({chapter.name}.ipynb) | {what} | {picture} "
                     f"| {badge} |")
    lines += ["", ":::"]
    if has_glossary:
        lines += ["", "The [glossary](glossary.md) explains every term the course uses."]
    toc = ["[0-9][0-9]_*"] + (["glossary"] if has_glossary else [])
    lines += ["", "```{toctree}", ":hidden:", ":glob:", ":caption: The course", "",
              *toc, "```", ""]
    return "\n".join(lines)
