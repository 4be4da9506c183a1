"""The website's pages, made from the course's notebooks (``tools/build_site.py`` uses these).

A chapter's page is its executed solutions build, changed in four ways:

* under the title: an "Open in Colab" badge for the *learner's* notebook (the one to work in)
  and download links for both builds;
* the setup cell is folded (its output, the runtime report, stays visible);
* every exercise cell shows the starter the learner's notebook holds, and below it the
  solution, folded behind **Show the solution** (its output, the checker's verdict, visible);
* the cells only the solutions build has (the discussion of the chapter's questions) are
  folded, each behind its own toggle.

Links in Markdown cells are rewritten for the site's flat layout: a link to a course notebook
or to the glossary points at its page, an image in the repository is copied beside the pages,
and any other repository file is linked on GitHub.

Every figure a chapter shows gets the alt text its source declares on the cell's ``# %%``
line (``tools/site_figures.py``): the page records it by the picture's SHA-256, and the site's
Sphinx extension (``website/kvlab_site.py``) puts it on the ``<img>``. A cell whose count of
figures differs from its count of alt texts stops the build. The home page is
``tools/site_home.py``.
"""
from __future__ import annotations

import copy
import difflib
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import build_notebooks  # noqa: E402
from site_figures import FigureError, declared_alt, figure_key, figure_outputs  # noqa: E402

from kvlab.course.colab import REPO_URL, SETUP_CELL, colab_url  # noqa: E402

NOTEBOOKS = ROOT / "notebooks"
GLOSSARY = NOTEBOOKS / "glossary.md"
BADGE_IMAGE = "images/colab-badge.svg"  # a local copy: the pages load nothing from elsewhere
IMAGE_SUFFIXES = {".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

SOLUTION_PROMPTS = {"code_prompt_show": "Show the solution", "code_prompt_hide": "Hide the solution"}
SETUP_PROMPTS = {"code_prompt_show": "Show the setup cell", "code_prompt_hide": "Hide the setup cell"}
EXTRA_PROMPTS = {"code_prompt_show": "Show the code and its output",
                 "code_prompt_hide": "Hide the code and its output"}
STARTER_NOTE = ("*Your turn: the exercise as your notebook has it. The solution is folded "
                "below, with the checker's verdict.*")


class SiteError(RuntimeError):
    """A notebook that does not fit its source (stale build) or a page that cannot be made."""


@dataclass(frozen=True)
class Chapter:
    source: Path  # notebooks/src/NN_name.py

    @property
    def name(self) -> str:
        return self.source.stem

    @property
    def learner(self) -> Path:
        return build_notebooks.target(self.source, "learner")

    @property
    def solutions(self) -> Path:
        return build_notebooks.target(self.source, "solutions")

    @property
    def colab(self) -> str:
        """Where Colab opens the learner's notebook (the one to work in) from GitHub."""
        folder = build_notebooks.LEARNER_DIR.relative_to(build_notebooks.ROOT).as_posix()
        return colab_url(f"{folder}/{self.name}.ipynb")


def chapters() -> list[Chapter]:
    """Every chapter, found by globbing ``notebooks/src/NN_*.py`` (a new one needs no edit)."""
    return [Chapter(p) for p in build_notebooks.sources()]


# -- which cell is what ------------------------------------------------------------------
@dataclass(frozen=True)
class CellRole:
    kind: str  # "plain" | "exercise" | "solution-only"
    starter: str = ""
    alt: tuple[str, ...] = ()  # the alt text of each figure the cell shows, in order
    where: str = ""  # "NN_name.py cell 7", for messages


@dataclass(frozen=True)
class SourceCell:
    cell_type: str
    source: str  # as the solutions build has it
    role: CellRole


def source_cells(source: Path) -> list[SourceCell]:
    """The cells the chapter's source gives the solutions build, in order, with their roles."""
    found = []
    for i, cell in enumerate(jupytext.reads(source.read_text(), fmt="py:percent").cells):
        tags = set(cell.metadata.get("tags", []))
        if "learner" in tags:
            continue
        where = f"{source.name} cell {i + 1}"
        answer = build_notebooks.split_regions(cell.source, "solutions", where)
        try:
            alt = declared_alt(cell.metadata.get("alt"), where)
        except FigureError as e:
            raise SiteError(str(e)) from None
        if "solution" in tags:
            role = CellRole("solution-only", alt=alt, where=where)
        elif build_notebooks.has_markers(cell.source):
            role = CellRole("exercise", build_notebooks.split_regions(cell.source, "learner", where),
                            alt=alt, where=where)
        else:
            role = CellRole("plain", alt=alt, where=where)
        found.append(SourceCell(cell.cell_type, answer, role))
    return found


def _same_text(built: str, source: str) -> bool:
    """A Markdown cell as built vs as written: the build may rewrite link targets."""
    strip = lambda text: re.sub(r"\]\([^)]*\)", "]()", text)  # noqa: E731
    a, b = strip(built), strip(source)
    return a == b or difflib.SequenceMatcher(None, a, b).ratio() > 0.8


def cell_roles(source: Path, cells: list) -> list[CellRole]:
    """The role of each of ``cells`` (a solutions build after its badge and setup cell),
    matched in order against the chapter's source: code cells must be identical, Markdown cells
    alike. A cell the build adds of its own (e.g. a closing cell) is plain."""
    expected, roles, j = source_cells(source), [], 0
    for cell in cells:
        want = expected[j] if j < len(expected) else None
        if want and cell.cell_type == want.cell_type and (
                cell.source == want.source if cell.cell_type == "code"
                else _same_text(cell.source, want.source)):
            roles.append(want.role)
            j += 1
        else:
            roles.append(CellRole("plain"))
    if j != len(expected):
        missing = expected[j].source.strip().splitlines()[:1]
        raise SiteError(f"{source.name}: its notebook does not match its source (from the cell "
                        f"starting {missing}): run `make notebooks`")
    return roles


# -- links -------------------------------------------------------------------------------
_MD_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_HTML_LINK = re.compile(r"""((?:src|href)=")([^"]+)(")""")
_FENCE = re.compile(r"^\s*(```|~~~)")


def slug(fragment: str) -> str:
    """A heading anchor as MyST writes it (GitHub's rule); JupyterLab's ``#Page-table`` and
    GitHub's ``#page-table`` name the same heading."""
    text = re.sub(r"[^\w\- ]", "", fragment.strip().lower())
    return text.replace(" ", "-")


@dataclass
class LinkRebaser:
    """Rewrites the relative links of text that lives in ``from_dir`` of the repository for
    a page at the root of the site source ``site_src``."""
    site_src: Path
    page_names: set[str]  # the chapters' notebook names, e.g. "00_tour.ipynb"

    def target(self, url: str, from_dir: Path) -> str:
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or url.startswith(("/", "mailto:")):
            return url
        if not parts.path:  # "#anchor" on this page
            return "#" + slug(parts.fragment) if parts.fragment else url
        path = (from_dir / parts.path).resolve()
        fragment = f"#{slug(parts.fragment)}" if parts.fragment else ""
        if path.name in self.page_names and path.parent in (NOTEBOOKS, NOTEBOOKS / "solutions"):
            return path.name + fragment
        if path == GLOSSARY:
            return "glossary.md" + fragment
        try:
            rel = path.relative_to(ROOT).as_posix()
        except ValueError:
            return url  # outside the repository: left for the link check to judge
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            dest = self.site_src / "repo" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            return f"repo/{rel}"
        if path.exists():
            kind = "tree" if path.is_dir() else "blob"
            return f"{REPO_URL}/{kind}/main/{rel}" + (f"#{parts.fragment}" if parts.fragment else "")
        return url

    def rewrite(self, text: str, from_dir: Path) -> str:
        """``text`` with its links rewritten, outside fenced code; a link's text may wrap
        over lines (``[CUDA\\ngraphs](glossary.md#cuda-graph)``)."""
        def links(prose: list[str]) -> list[str]:
            chunk = "\n".join(prose)
            chunk = _MD_LINK.sub(lambda m: m[1] + self.target(m[2], from_dir) + m[3], chunk)
            chunk = _HTML_LINK.sub(lambda m: m[1] + self.target(m[2], from_dir) + m[3], chunk)
            return chunk.split("\n") if prose else []

        out, prose, fenced = [], [], False
        for line in text.split("\n"):
            if _FENCE.match(line) or fenced:
                out += links(prose)
                prose = []
                fenced ^= bool(_FENCE.match(line))
                out.append(line)
            else:
                prose.append(line)
        return "\n".join(out + links(prose))


# -- a chapter's page --------------------------------------------------------------------
def _headings_to_bold(text: str) -> str:
    """Headings inside a fold would break the page's sections: make them bold lines."""
    out, fenced = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        out.append(f"**{m[1]}**" if m else line)
    return "\n".join(out)


def fold_markdown(text: str, title: str) -> str:
    """``text`` inside a closed dropdown titled ``title`` (sphinx-design)."""
    m = re.match(r"^\s*#{1,6}\s+(.*?)\s*\n", text + "\n")
    if m:  # the cell's own heading names the fold
        title, text = m[1], text[m.end():]
    return f":::::{{dropdown}} {title}\n\n{_headings_to_bold(text.strip())}\n:::::"


def _fold_code(cell: nbformat.NotebookNode, tag: str, prompts: dict) -> None:
    cell.metadata["tags"] = sorted(set(cell.metadata.get("tags", [])) | {tag})
    cell.metadata["mystnb"] = dict(prompts)


def _static_outputs(cell: nbformat.NotebookNode) -> None:
    """A static page cannot run a widget: keep what else the output carries (a PNG)."""
    for out in cell.get("outputs", []):
        data = out.get("data")
        if data and WIDGET_VIEW in data and len(data) > 1:
            del data[WIDGET_VIEW]


def chapter_links(chapter: Chapter, downloads: dict[str, str]) -> str:
    """The line under a chapter's title: Colab badge (the learner's notebook) and downloads."""
    links = [f"[![Open in Colab]({BADGE_IMAGE})]({chapter.colab})"]
    links += [f"{{download}}`{label} <{path}>`" for label, path in downloads.items()]
    return " · ".join(links)


def chapter_page(chapter: Chapter, executed: nbformat.NotebookNode, downloads: dict[str, str],
                 rebaser: LinkRebaser) -> nbformat.NotebookNode:
    """The page of ``chapter`` from its executed solutions notebook ``executed``."""
    cells = executed.cells
    if len(cells) < 2 or cells[1].cell_type != "code" or cells[1].source != SETUP_CELL:
        raise SiteError(f"{chapter.source.name}: its notebook does not open with the badge and "
                        "the setup cell: run `make notebooks`")
    roles = cell_roles(chapter.source, cells[2:])
    nb = copy.deepcopy(executed)
    nb.metadata.pop("widgets", None)
    setup = nb.cells[1]
    _fold_code(setup, "hide-input", SETUP_PROMPTS)
    page, titled, previous = [], False, "plain"
    figure_alt: dict[str, str] = {}
    for cell, role in zip(nb.cells[2:], roles):
        _static_outputs(cell)
        if cell.cell_type == "code":
            figure_alt.update(_figure_alt(chapter, cell, role))
        if cell.cell_type == "markdown":
            cell.source = rebaser.rewrite(cell.source, chapter.solutions.parent)
        if cell.cell_type == "markdown" and not titled:
            title, _, rest = cell.source.partition("\n")
            if not title.startswith("# "):
                raise SiteError(f"{chapter.source.name}: the first Markdown cell must open with "
                                "the chapter's '# ' title")
            cell.source = f"{title}\n\n{chapter_links(chapter, downloads)}\n{rest}"
            page += [cell, setup]
            titled = True
            continue
        if role.kind == "exercise":
            if cell.cell_type != "code":
                raise SiteError(f"{chapter.source.name}: an answer region outside a code cell")
            page.append(nbformat.v4.new_markdown_cell(STARTER_NOTE))
            page.append(nbformat.v4.new_code_cell(role.starter,
                                                  metadata={"tags": ["kvlab-starter"]}))
            _fold_code(cell, "hide-input", SOLUTION_PROMPTS)
        elif role.kind == "solution-only":
            if cell.cell_type == "markdown":
                title = "Discussion, continued" if previous == "solution-only" else "Discussion"
                cell.source = fold_markdown(cell.source, title)
            else:
                _fold_code(cell, "hide-cell", EXTRA_PROMPTS)
        page.append(cell)
        previous = role.kind
    if not titled:
        raise SiteError(f"{chapter.source.name}: no Markdown cell with the chapter's title")
    for i, cell in enumerate(page):
        cell["id"] = f"site-{i:03d}"
    nb.cells = page
    nb.metadata["kvlab"] = {"figure_alt": figure_alt}
    return nb


def _figure_alt(chapter: Chapter, cell: nbformat.NotebookNode, role: CellRole) -> dict[str, str]:
    """The alt text of each figure ``cell`` shows, by the figure's key (:func:`figure_key`)."""
    figures = figure_outputs(cell)
    # at least one alt text per figure: a widget's first picture is an output under nbval and
    # none under nbclient, so a cell may declare one its executed copy does not show
    if len(figures) > len(role.alt):
        where = role.where or f"{chapter.source.name}, the cell starting " \
                              f"{cell.source.strip().splitlines()[:1]}"
        raise SiteError(
            f"{where} shows {len(figures)} figure(s) but declares {len(role.alt)} alt text(s): "
            "on its `# %%` line, write alt=\"<what the picture shows, in a sentence>\" "
            "(alt=[\"...\", \"...\"] for several, in order)")
    return {figure_key(kind, raw): text for (kind, raw), text in zip(figures, role.alt)}


def chapter_title(nb: nbformat.NotebookNode) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("# "):
            return cell.source.partition("\n")[0][2:].strip()
    raise SiteError("a chapter without a '# ' title")
