"""Build the course's website into ``build/site/html`` (``make site``), offline.

    python tools/build_site.py [--jobs N] [--out build/site]

1. **Executed chapters.** Every chapter's solutions build, executed in this Python (Triton's
   interpreter without a GPU, as CI runs it): reused from ``build/executed/`` when current
   (``make test-notebooks`` leaves them there), otherwise executed here with nbclient, ``N``
   kernels at a time (``tools/executed_notebooks.py``).
2. **Pages.** Each chapter's page (``tools/site_pages.py``), the glossary
   (``notebooks/glossary.md``, when there is one), the home page (``website/intro.md`` and a
   table of the chapters), and both notebooks of each chapter to download, in
   ``build/site/src``. Chapters are found by globbing ``notebooks/src/NN_*.py``.
3. **Sphinx** (MyST-NB, sphinx-book-theme; ``website/conf.py``) renders ``build/site/html``:
   static pages with a search box, nothing fetched from the network.
4. **Link check** (``tools/check_site_links.py``): no broken internal link or anchor.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import check_site_links  # noqa: E402
import executed_notebooks as ex  # noqa: E402
import site_home  # noqa: E402
import site_pages  # noqa: E402

WEBSITE = ROOT / "website"
EXECUTED = ROOT / "build" / "executed"
DEFAULT_OUT = ROOT / "build" / "site"


def _say(text: str) -> None:
    print(f"site: {text}", flush=True)


def ensure_executed(chapters: list[site_pages.Chapter], jobs: int) -> dict[str, Path]:
    """Chapter name → its executed solutions notebook, executing only the ones not current."""
    digest = ex._package_digest()
    paths = {c.name: ex.executed_path(EXECUTED, c.solutions) for c in chapters}
    stale = [c for c in chapters if not ex.is_current(paths[c.name], c.solutions, digest)]
    reused = len(chapters) - len(stale)
    _say(f"{reused} of {len(chapters)} chapters already executed (build/executed), "
         f"executing {len(stale)} with {min(jobs, max(len(stale), 1))} kernel(s)")
    if not stale:
        return paths
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(_execute_timed, c.solutions): c for c in stale}
        for done, future in enumerate(as_completed(futures), 1):
            chapter = futures[future]
            try:
                seconds = future.result()
            except Exception as exc:  # name the chapter; nbclient's error shows the cell
                raise site_pages.SiteError(f"executing {chapter.solutions.relative_to(ROOT)} "
                                           f"failed:\n{exc}") from exc
            _say(f"executed {chapter.name} in {seconds:.0f} s "
                 f"({done} of {len(stale)}, {time.monotonic() - started:.0f} s so far)")
    return paths


def _execute_timed(notebook: Path) -> float:
    """Execute one chapter (in a worker process); its own time in seconds, kernel start included."""
    started = time.monotonic()
    ex.execute(notebook, EXECUTED)
    return time.monotonic() - started


def write_sources(chapters: list[site_pages.Chapter], executed: dict[str, Path],
                  src: Path) -> None:
    """Everything Sphinx reads, in ``src`` (made afresh)."""
    if src.exists():
        shutil.rmtree(src)
    (src / "images").mkdir(parents=True)
    (src / "downloads").mkdir()
    shutil.copyfile(WEBSITE / "_static" / "colab-badge.svg", src / "images" / "colab-badge.svg")
    rebaser = site_pages.LinkRebaser(src, {c.learner.name for c in chapters})
    course = site_home.course_table(site_home.README.read_text())
    rows, figure_alt, previews = [], {}, {}
    for chapter in chapters:
        downloads = {}
        for label, path, name in [("the notebook (.ipynb)", chapter.learner, chapter.learner.name),
                                  ("with solutions", chapter.solutions,
                                   f"{chapter.name}_solutions.ipynb")]:
            shutil.copyfile(path, src / "downloads" / name)
            downloads[label] = f"downloads/{name}"
        page = site_pages.chapter_page(chapter, nbformat.read(executed[chapter.name], as_version=4),
                                       downloads, rebaser)
        figure_alt.update(page.metadata.pop("kvlab")["figure_alt"])
        nbformat.write(page, src / f"{chapter.name}.ipynb")
        title = site_pages.chapter_title(page)
        rows.append((chapter, title))
        row = course.get(chapter.name[:2])
        if row:
            what = _plain(row.what)
            previews[chapter.name] = _preview(
                src, chapter.name, f"kvlab, a hands-on course on paged KV-cache management, "
                f"chapter {row.number}: {what[:1].upper() + what[1:]}.", row)
    has_glossary = site_pages.GLOSSARY.exists()
    if has_glossary:
        text = rebaser.rewrite(site_pages.GLOSSARY.read_text(), site_pages.GLOSSARY.parent)
        (src / "glossary.md").write_text(text)
    intro = (WEBSITE / "intro.md").read_text()
    (src / "index.md").write_text(site_home.index_page(intro, rows, has_glossary, course, rebaser))
    first = next((course[n] for n in sorted(course) if course[n].picture), None)
    previews["index"] = _preview(src, "index", _plain(_first_paragraph(intro)), first)
    data = {"figure_alt": figure_alt, "pages": previews}
    (src / "_kvlab_site.json").write_text(json.dumps(data, indent=1, sort_keys=True))


def _plain(markdown: str) -> str:
    """Markdown as one line of plain text (for a page's description)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    return " ".join(re.sub(r"[`*_]", "", text).split())


def _first_paragraph(markdown: str) -> str:
    paragraphs = [p for p in markdown.split("\n\n") if p.strip() and not p.lstrip().startswith("#")]
    return paragraphs[0] if paragraphs else ""


def _preview(src: Path, name: str, description: str, row) -> dict:
    """A page's description and preview picture (copied into ``src/_previews``)."""
    page = {"description": description}
    if row is not None and row.picture and (ROOT / row.picture).is_file():
        dest = src / "_previews" / f"{name}{Path(row.picture).suffix}"
        dest.parent.mkdir(exist_ok=True)
        shutil.copyfile(ROOT / row.picture, dest)
        page.update(image=dest.relative_to(src).as_posix(), image_alt=row.alt)
    return page


def run_sphinx(src: Path, html: Path) -> None:
    from sphinx.cmd.build import build_main

    if html.exists():
        shutil.rmtree(html)
    # -W: a warning (an unresolved link, a bad directive) fails the build; -q: only those
    args = ["-b", "html", "-q", "-W", "--keep-going", "-c", str(WEBSITE),
            "-d", str(src.parent / "doctrees"), str(src), str(html)]
    if build_main(args) != 0:
        raise site_pages.SiteError("sphinx-build reported the warnings above")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("SITE_JOBS", 2)),
                    help="kernels executing chapters at once (default 2, or $SITE_JOBS)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    started = time.monotonic()
    chapters = site_pages.chapters()
    if not chapters:
        raise SystemExit("no chapters in notebooks/src/")
    executed = ensure_executed(chapters, args.jobs)
    src, html = args.out / "src", args.out / "html"
    write_sources(chapters, executed, src)
    _say(f"rendering {len(chapters)} chapters with Sphinx")
    rendering = time.monotonic()
    run_sphinx(src, html)
    broken = check_site_links.check(html)
    _say(f"rendered in {time.monotonic() - rendering:.0f} s")
    if broken:
        for line in broken:
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(f"site: {len(broken)} broken internal links (above)")
    _say(f"{html.relative_to(ROOT) if html.is_relative_to(ROOT) else html}/index.html "
         f"({time.monotonic() - started:.0f} s, no broken internal link)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
