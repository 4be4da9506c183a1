"""The website's pieces, without executing a chapter: a chapter's page (starter shown, solution
folded, discussion folded, widget outputs made static, each figure's alt text from its cell's
``# %%`` line), link rewriting, the home page (README's course table with its pictures), the
chapters found by globbing, the executed-notebook record, the link check, and one small
Sphinx build with a glossary (alt texts on the images, link-preview tags, a favicon, copy
buttons, the theme's icon script gone and its icon fonts cut to the icons used). Without the
``site`` extra (Sphinx and friends) the build test skips; the rest needs only jupytext and
nbformat. ``tests/ui/test_site.py`` browses the real site."""
from __future__ import annotations

import base64
import hashlib
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_notebooks  # noqa: E402
import build_site  # noqa: E402
import check_site_links  # noqa: E402
import executed_notebooks  # noqa: E402
import site_figures  # noqa: E402
import site_home  # noqa: E402
import site_pages  # noqa: E402

from kvlab.course.checking.progress_file import ENV as PROGRESS_ENV  # noqa: E402
from kvlab.course.check.review import closing_cells  # noqa: E402
from kvlab.course.colab import REPO_URL, colab_url  # noqa: E402

PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360f8cfc0f01f0005000201a9e2d4"
    "2a0000000049454e44ae426082")).decode()

SOURCE = '''\
# %% [markdown]
# # 99 · A demo chapter
#
# See the [glossary](glossary.md#Page-table).

# %% alt="The demo explorer's picture: a single pixel standing in for a figure."
import kvlab

# %% [markdown] tags=["learner"]
# Only the learner sees this.

# %%
def double(x):
    """Twice x."""
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION
    ### BEGIN STARTER
    # YOUR CODE HERE: double
    raise NotImplementedError
    ### END STARTER


double(2);

# %% [markdown]
# ## Questions
#
# 1. Why?

# %% [markdown] tags=["solution"]
# ### Discussion
#
# Because.
#
# ## A heading inside

# %% tags=["solution"]
print("shown in the discussion")

# %% [markdown] tags=["solution"]
# More discussion.
'''


@pytest.fixture
def demo(tmp_path):
    src = tmp_path / "99_demo.py"
    src.write_text(SOURCE)
    chapter = site_pages.Chapter(src)
    nb = build_notebooks.build(src, "solutions")
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "m"},
              "image/png": PNG, "text/plain": "Explorer"}
    code = [c for c in nb.cells if c.cell_type == "code"]
    code[1].outputs = [nbformat.v4.new_output("display_data", data=widget)]
    code[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ double\n")]
    return chapter, nb


def _rebaser(tmp_path, pages=("03_alloc_extend.ipynb",)):
    return site_pages.LinkRebaser(tmp_path / "site-src", set(pages))


def test_a_chapter_page_shows_the_starter_and_folds_the_solution(demo, tmp_path):
    chapter, executed = demo
    downloads = {"the notebook (.ipynb)": "downloads/99_demo.ipynb"}
    page = site_pages.chapter_page(chapter, executed, downloads, _rebaser(tmp_path))
    kinds = [(c.cell_type, c.metadata.get("tags", [])) for c in page.cells]
    title, setup = page.cells[0], page.cells[1]
    # the title, then the Colab badge of the learner's notebook and the downloads under it
    assert title.source.startswith("# 99 · A demo chapter\n")
    assert f"]({colab_url('notebooks/99_demo.ipynb')})" in title.source
    assert "{download}`the notebook (.ipynb) <downloads/99_demo.ipynb>`" in title.source
    assert "colab-badge.svg" in title.source and "https://colab.research.google.com/assets" \
        not in title.source
    assert setup.cell_type == "code" and setup.metadata["tags"] == ["hide-input"]
    # the learner-only cell is not on the page; the exercise shows the starter, then the fold
    assert all("Only the learner" not in c.source for c in page.cells)
    starter_at = next(i for i, (t, tags) in enumerate(kinds) if "kvlab-starter" in tags)
    starter, solution = page.cells[starter_at], page.cells[starter_at + 1]
    assert "YOUR CODE HERE: double" in starter.source and starter.outputs == []
    assert page.cells[starter_at - 1].source == site_pages.STARTER_NOTE
    assert "return 2 * x" in solution.source and "YOUR CODE HERE" not in solution.source
    assert solution.metadata["tags"] == ["hide-input"]
    assert solution.metadata["mystnb"]["code_prompt_show"] == "Show the solution"
    assert solution.outputs[0]["text"] == "✓ double\n"  # the verdict stays in view
    # the discussion: each solutions-only cell folded, headings inside made bold
    folds = [c.source for c in page.cells if c.source.startswith(":::::{dropdown}")]
    assert folds[0].startswith(":::::{dropdown} Discussion\n") and "**A heading inside**" in folds[0]
    assert folds[1].startswith(":::::{dropdown} Discussion, continued\n")
    hidden_code = [c for c in page.cells if "hide-cell" in c.metadata.get("tags", [])]
    assert len(hidden_code) == 1 and "shown in the discussion" in hidden_code[0].source
    # a widget cannot run on a static page: its PNG is what is shown
    widget_out = [o for c in page.cells for o in c.get("outputs", [])
                  if o.get("output_type") == "display_data"]
    assert list(widget_out[0]["data"]) == ["image/png", "text/plain"]
    assert len({c["id"] for c in page.cells}) == len(page.cells)


def test_a_stale_notebook_is_refused(demo, tmp_path):
    chapter, executed = demo
    executed.cells.pop()
    with pytest.raises(site_pages.SiteError, match="run `make notebooks`"):
        site_pages.chapter_page(chapter, executed, {}, _rebaser(tmp_path))


def test_cells_the_build_adds_are_shown_as_they_are(demo, tmp_path):
    """A build may append cells of its own (a closing recheck) and rewrite links in Markdown:
    the page keeps them, and the exercise and discussion are still found."""
    chapter, executed = demo
    executed.cells[2].source = executed.cells[2].source.replace("](glossary.md", "](../glossary.md")
    text, code = closing_cells("99")
    executed.cells += [nbformat.v4.new_markdown_cell(text), nbformat.v4.new_code_cell(code)]
    page = site_pages.chapter_page(chapter, executed, {}, _rebaser(tmp_path))
    assert page.cells[-1].source == code and not page.cells[-1].metadata.get("tags")
    assert page.cells[-2].source == text
    assert sum("kvlab-starter" in c.metadata.get("tags", []) for c in page.cells) == 1
    assert sum(c.source.startswith(":::::{dropdown}") for c in page.cells) == 2


# -- figures' alt text ------------------------------------------------------------------
def _png_output(pixel: bytes = b"") -> nbformat.NotebookNode:
    data = base64.b64decode(PNG) + pixel  # a distinct picture (its bytes), same PNG start
    return nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(data).decode(),
                                                        "text/plain": "<Figure>"})


def test_each_figure_gets_the_alt_text_its_cell_declares(demo, tmp_path):
    chapter, executed = demo
    page = site_pages.chapter_page(chapter, executed, {}, _rebaser(tmp_path))
    (key, alt), = page.metadata["kvlab"]["figure_alt"].items()
    assert key == hashlib.sha256(base64.b64decode(PNG)).hexdigest()  # MyST-NB's file name
    assert alt == "The demo explorer's picture: a single pixel standing in for a figure."


def test_a_cell_with_two_figures_declares_two_alt_texts_in_order(tmp_path):
    src = tmp_path / "98_two.py"
    src.write_text('# %% [markdown]\n# # 98 · Two\n\n'
                   '# %% alt=["First: the pool before the step, all pages free.", '
                   '"Second: the pool after the step, two pages taken."]\nshow_both()\n')
    nb = build_notebooks.build(src, "solutions")
    code = [c for c in nb.cells if c.cell_type == "code"]
    code[1].outputs = [_png_output(b"1"), _png_output(b"2")]
    page = site_pages.chapter_page(site_pages.Chapter(src), nb, {}, _rebaser(tmp_path))
    alts = page.metadata["kvlab"]["figure_alt"]
    first = hashlib.sha256(base64.b64decode(PNG) + b"1").hexdigest()
    assert list(alts.values()) == ["First: the pool before the step, all pages free.",
                                   "Second: the pool after the step, two pages taken."]
    assert next(iter(alts)) == first


def test_a_figure_without_alt_text_stops_the_build(demo, tmp_path):
    chapter, executed = demo
    code = [c for c in executed.cells if c.cell_type == "code"]
    code[2].outputs.append(_png_output(b"x"))  # the exercise cell draws a figure, declares none
    with pytest.raises(site_pages.SiteError, match=r"99_demo\.py cell \d+ shows 1 figure\(s\) but "
                                                   r"declares 0 alt text\(s\): on its `# %%` line"):
        site_pages.chapter_page(chapter, executed, {}, _rebaser(tmp_path))


@pytest.mark.parametrize("text, problem", [
    ("The page table after two batches, one row per request.", None),
    ("a heatmap", "has 2 words"),
    ("02_page_table.png shows the page table after a write", "looks like a file name"),
    ("3f9a0c1d2e4b5a6978c0d1e2f3a4b5c6.png", "looks like a file name"),
])
def test_an_alt_text_says_in_a_sentence_what_the_picture_shows(text, problem):
    found = site_figures.alt_problem(text)
    assert (found is None) if problem is None else (problem in found)


def test_a_bad_alt_declaration_is_named_with_its_cell():
    with pytest.raises(site_figures.FigureError, match=r"x\.py cell 3: alt text 'a plot' has 2 words"):
        site_figures.declared_alt("a plot", "x.py cell 3")
    with pytest.raises(site_figures.FigureError, match="alt must be a string or a list of strings"):
        site_figures.declared_alt({"text": "no"}, "x.py cell 3")


def test_every_chapter_declares_sentences_and_an_alt_text_where_it_shows_a_figure():
    """The exact count is checked when the site is built (each figure of the executed
    chapter against its cell's alt texts); here, without executing: each alt text is a
    sentence, and a cell that calls plt.show() outside a function (a widget's function may
    never run under nbval) -- at its top level or in an if block -- declares at least as many."""
    for chapter in site_pages.chapters():
        for cell in site_pages.source_cells(chapter.source):  # raises on a bad alt text
            in_function, shows = False, 0
            for line in cell.source.splitlines():
                if re.match(r"(async )?def |class ", line):
                    in_function = True
                elif line and not line[0].isspace():
                    in_function = False
                shows += bool(re.match(r"\s*plt\.show\(\)", line)) and not in_function
            assert len(cell.role.alt) >= shows, (
                f"{cell.role.where} calls plt.show() {shows} time(s) but declares "
                f"{len(cell.role.alt)} alt text(s)")
            # a figure made at the top level and shown in a later cell shows here, at the
            # end of this cell (the inline backend), where no alt text is declared
            makes = any(re.match(r"[^\s#].*\bplt\.(subplots|figure)\(", line)
                        for line in cell.source.splitlines())
            assert not makes or shows, f"{cell.role.where} makes a figure but shows it in another cell"


def test_links_are_rewritten_for_the_flat_site(tmp_path):
    rebaser = _rebaser(tmp_path)
    solutions = ROOT / "notebooks" / "solutions"
    text = ("[g](../glossary.md#Which-runtime-am-I-on?) [c](../03_alloc_extend.ipynb) "
            "[s](03_alloc_extend.ipynb#The-kernel) ![f](../../figures/00_fragmentation.png) "
            "[p](../../kvlab/alloc/paging.py) [w](https://triton-lang.org) [a](#Your-turn)\n"
            '<img src="../../figures/00_fragmentation.png" width="3">\n'
            "```\n[kept](../glossary.md)\n```\n"
            "after the code, [CUDA\ngraphs](../glossary.md#cuda-graph) wrap")
    out = rebaser.rewrite(text, solutions)
    assert "[g](glossary.md#which-runtime-am-i-on)" in out
    assert "[c](03_alloc_extend.ipynb)" in out and "[s](03_alloc_extend.ipynb#the-kernel)" in out
    assert "![f](repo/figures/00_fragmentation.png)" in out
    assert '<img src="repo/figures/00_fragmentation.png"' in out
    assert (tmp_path / "site-src" / "repo" / "figures" / "00_fragmentation.png").is_file()
    assert f"[p]({REPO_URL}/blob/main/kvlab/alloc/paging.py)" in out
    assert "[w](https://triton-lang.org)" in out and "[a](#your-turn)" in out
    assert "[kept](../glossary.md)" in out  # code is code
    assert "[CUDA\ngraphs](glossary.md#cuda-graph) wrap" in out  # a link over two lines
    assert out.count("\n") == text.count("\n")


def test_the_chapters_are_found_by_globbing(tmp_path, monkeypatch):
    for name in ["00_tour.py", "10_serve.py", "11_hash_cache.py", "notes.py"]:
        (tmp_path / name).write_text("")
    monkeypatch.setattr(build_notebooks, "SRC", tmp_path)
    assert [c.name for c in site_pages.chapters()] == ["00_tour", "10_serve", "11_hash_cache"]


def test_the_home_page_lists_the_chapters_and_the_glossary(tmp_path):
    rows = [(site_pages.Chapter(tmp_path / "00_tour.py"), "00 · A tour"),
            (site_pages.Chapter(tmp_path / "11_hash_cache.py"), "11 · Hashed pages")]
    text = site_home.index_page("# kvlab\n", rows, has_glossary=True)
    assert "| 11 | [Hashed pages](11_hash_cache.ipynb) |" in text
    assert colab_url("notebooks/11_hash_cache.ipynb") in text
    assert ":glob:" in text and "[0-9][0-9]_*" in text and "\nglossary\n" in text
    assert "glossary" not in site_home.index_page("# kvlab\n", rows, has_glossary=False)


def test_readmes_course_table_gives_every_chapter_what_it_builds_and_a_picture():
    course = site_home.course_table(site_home.README.read_text())
    for chapter in site_pages.chapters():
        row = course.get(chapter.name[:2])
        assert row, f"README's course table has no row for chapter {chapter.name}"
        assert len(row.what.split()) >= 2, f"{chapter.name}: README says too little it builds"
        assert row.picture.startswith("figures/") and (ROOT / row.picture).is_file(), row
        assert site_figures.alt_problem(row.alt, min_words=3) is None, row


def test_the_home_page_shows_the_course_table_with_its_pictures(tmp_path):
    readme = ('| # | chapter | what you build | a picture from it | run it |\n|---|---|---|---|---|\n'
              '| 00 | [A tour](https://x/00_tour.html) | why pages; which runtime | <img src="'
              'https://raw.githubusercontent.com/kvlab-course/kvlab/main/figures/00_fragmentation.png"'
              ' width="300" alt="contiguous vs paged KV memory"> | [badge](https://colab) |\n')
    course = site_home.course_table(readme)
    assert course["00"] == site_home.CourseRow("00", "why pages; which runtime",
                                                "figures/00_fragmentation.png",
                                                "contiguous vs paged KV memory")
    rows = [(site_pages.Chapter(tmp_path / "00_tour.py"), "00 · A tour")]
    text = site_home.index_page("# kvlab\n", rows, False, course, _rebaser(tmp_path))
    assert ":::{container} kvlab-course" in text
    assert ('| 00 | [A tour](00_tour.ipynb) | why pages; which runtime | <img src="repo/figures/'
            '00_fragmentation.png" alt="contiguous vs paged KV memory" class="kvlab-course-picture"'
            in text)
    assert (tmp_path / "site-src" / "repo" / "figures" / "00_fragmentation.png").is_file()


# -- executed notebooks ----------------------------------------------------------------
def test_the_fingerprint_follows_the_cells_and_the_package(demo):
    _, nb = demo
    base = executed_notebooks.fingerprint(nb, "pkg")
    assert executed_notebooks.fingerprint(nb, "pkg") == base
    assert executed_notebooks.fingerprint(nb, "pkg2") != base
    nb.cells[-1].source += " "
    assert executed_notebooks.fingerprint(nb, "pkg") != base


def _nbval_items(path: Path, nb, outputs):
    parent = SimpleNamespace(path=path, nb=nb)
    return [SimpleNamespace(parent=parent, cell_num=i, test_outputs=outs)
            for i, outs in enumerate(outputs)]


def test_nbval_outputs_become_an_executed_notebook(demo, tmp_path, monkeypatch):
    _, nb = demo
    folder = tmp_path / "solutions"
    folder.mkdir()
    path = folder / "99_demo.ipynb"
    nbformat.write(nb, path)
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    value = nbformat.v4.new_output("execute_result", data={"text/plain": "4"}, execution_count=3)
    outputs = [[] for _ in range(n_code)]
    outputs[2] = [nbformat.v4.new_output("stream", name="stdout", text="✓\n"), value]
    monkeypatch.setenv(executed_notebooks.ENV_VAR, str(tmp_path / "executed"))
    written = [executed_notebooks.record_nbval_cell(item)
               for item in _nbval_items(path, nb, outputs)]
    assert written[:-1] == [None] * (n_code - 1) and written[-1] == tmp_path / "executed" / path.name
    saved = nbformat.read(written[-1], as_version=4)
    exercise = [c for c in saved.cells if c.cell_type == "code"][2]
    # "double(2);" ends with a semicolon: a notebook shows no value (nbval's kernel would)
    assert [o["output_type"] for o in exercise.outputs] == ["stream"]
    assert executed_notebooks.is_current(written[-1], path)
    nb.cells[-1].source += "\nchanged"
    nbformat.write(nb, path)
    assert not executed_notebooks.is_current(written[-1], path)


def test_a_notebook_with_a_failing_cell_is_not_recorded(demo, tmp_path, monkeypatch):
    _, nb = demo
    (tmp_path / "solutions").mkdir()
    path = tmp_path / "solutions" / "99_demo.ipynb"
    nbformat.write(nb, path)
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    outputs = [[] for _ in range(n_code)]
    outputs[1] = [nbformat.v4.new_output("error", ename="ValueError", evalue="x", traceback=[])]
    monkeypatch.setenv(executed_notebooks.ENV_VAR, str(tmp_path / "executed"))
    assert [executed_notebooks.record_nbval_cell(i) for i in _nbval_items(path, nb, outputs)] \
        == [None] * n_code
    assert not (tmp_path / "executed").exists()


def test_a_notebook_the_test_failed_is_not_recorded(demo, tmp_path, monkeypatch):
    """No cell raised, but the notebook test failed it (an illegible figure, say)."""
    _, nb = demo
    (tmp_path / "solutions").mkdir()
    path = tmp_path / "solutions" / "99_demo.ipynb"
    nbformat.write(nb, path)
    outputs = [[] for c in nb.cells if c.cell_type == "code"]
    monkeypatch.setenv(executed_notebooks.ENV_VAR, str(tmp_path / "executed"))
    items = _nbval_items(path, nb, outputs)
    assert [executed_notebooks.record_nbval_cell(i, failed=i is items[-1]) for i in items] \
        == [None] * len(items)
    assert not (tmp_path / "executed").exists()


def test_a_chapter_executed_for_the_site_keeps_its_progress_apart(tmp_path, monkeypatch, capfd):
    """make site's kernels record their checks in a fresh file of their own (never the
    learner's progress) and draw figures inline (no MPLBACKEND); they print no warning (over
    TCP each kernel would warn about unencrypted traffic)."""
    assert executed_notebooks.PROGRESS_ENV == PROGRESS_ENV
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    monkeypatch.setenv(PROGRESS_ENV, str(mine))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\n"
        f"path = os.environ['{PROGRESS_ENV}']\n"
        "open(path, 'w').write('written')\n"
        "print(path, os.environ.get('MPLBACKEND'), os.getpid())")])
    (tmp_path / "solutions").mkdir()
    nbformat.write(nb, tmp_path / "solutions" / "99_demo.ipynb")
    out = executed_notebooks.execute(tmp_path / "solutions" / "99_demo.ipynb", tmp_path / "executed")
    (printed,) = nbformat.read(out, as_version=4).cells[0].outputs
    used, backend, kernel = printed["text"].split()
    assert backend != "Agg" and used != str(mine) and mine.read_text() == "{}"
    assert not Path(used).exists()  # removed with its folder
    # the kernel is gone when execute returns (a kernel left running outlives its chapter and
    # warns "Parent appears to have exited" when the worker that started it ends)
    with pytest.raises(ProcessLookupError):
        os.kill(int(kernel), 0)
    printed = capfd.readouterr()
    assert "WARNING" not in printed.out + printed.err, printed.err


def _sleeping_execute(notebook, out):
    time.sleep(2.2 if notebook.name.startswith("01") else 0.1)


def test_make_site_says_each_chapters_own_time(tmp_path, monkeypatch, capsys):
    chapters = [SimpleNamespace(name=n, solutions=tmp_path / f"{n}.ipynb") for n in ("01_a", "02_b")]
    for chapter in chapters:
        nbformat.write(nbformat.v4.new_notebook(), chapter.solutions)
    monkeypatch.setattr(build_site, "EXECUTED", tmp_path / "executed")
    monkeypatch.setattr(executed_notebooks, "execute", _sleeping_execute)  # the workers fork
    build_site.ensure_executed(chapters, jobs=2)
    out = capsys.readouterr().out
    assert re.search(r"^site: executed 02_b in 0 s \(1 of 2, \d+ s so far\)$", out, re.M), out
    assert re.search(r"^site: executed 01_a in 2 s \(2 of 2, \d+ s so far\)$", out, re.M), out


def test_the_search_page_learns_which_chapter_introduces_each_term():
    sys.path.insert(0, str(ROOT / "website"))
    import search_terms

    glossary = ("### kv pool\n**KV pool** (chapters 00 and 08). One buffer.\n\n"
                "### new token ratio\n**New token ratio** (chapter 12). SGLang's estimate.\n\n"
                "### token slot\n**Slot** (chapter 00). A place.\n\n### odd\nno chapter named\n")
    docs = ["00_tour", "08_capstone", "12_when_memory_runs_out", "index", "glossary"]
    terms = search_terms.teaching_chapters(glossary, docs)
    assert terms == {"kv pool": ["00_tour", "08_capstone"], "new token ratio": ["12_when_memory_runs_out"],
                     "token slot": ["00_tour"], "slot": ["00_tour"]}
    assert search_terms.term_key("new_token_ratio") == search_terms.term_key(" New-token  ratio") == \
        "new token ratio"
    # the real glossary: every entry names the chapter that introduces it
    real = (ROOT / "notebooks" / "glossary.md").read_text()
    chapters = [p.stem for p in (ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")]
    found = search_terms.teaching_chapters(real, chapters)
    assert len(found) >= real.count("\n### ") and found["new token ratio"][0].startswith("12_")


# -- the link check ----------------------------------------------------------------------
def test_the_link_check_finds_missing_files_and_anchors(tmp_path):
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "macros.html").write_text('<a href="{{ pathto(x) }}">')  # a template
    (tmp_path / "img.png").write_bytes(b"")
    (tmp_path / "a.html").write_text('<h1 id="top">A</h1><a href="b.html#there">ok</a>'
                                     '<img src="img.png"><a href="https://x.org/none">out</a>')
    (tmp_path / "b.html").write_text('<p id="there"></p><a href="a.html#nowhere">x</a>'
                                     '<a href="gone.html">y</a><a href="#top">z</a><a href="#">w</a>')
    assert sorted(check_site_links.check(tmp_path)) == [
        "b.html: #top (no anchor #top)", "b.html: a.html#nowhere (no anchor #nowhere)",
        "b.html: gone.html (no such file)"]


# -- one small build, with a glossary ----------------------------------------------------
SITE_EXTRA = ["sphinx", "myst_nb", "sphinx_book_theme", "sphinx_design", "sphinx_copybutton"]


@pytest.mark.slow
def test_a_small_site_builds_with_its_glossary(demo, tmp_path, monkeypatch):
    for module in SITE_EXTRA:  # the `site` extra (pip install -e '.[site]')
        pytest.importorskip(module, reason="needs the site extra (make test installs it)")
    chapter, executed = demo
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    glossary = notebooks / "glossary.md"
    glossary.write_text("# Glossary\n\n## Page table\n\nRows of slots; see [the demo](99_demo.ipynb#questions).\n")
    monkeypatch.setattr(site_pages, "GLOSSARY", glossary)
    monkeypatch.setattr(site_pages, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(site_pages.Chapter, "learner", property(lambda c: notebooks / "99_demo.ipynb"))
    monkeypatch.setattr(site_pages.Chapter, "solutions",
                        property(lambda c: notebooks / "solutions" / "99_demo.ipynb"))
    (notebooks / "solutions").mkdir()
    for path in (chapter.learner, chapter.solutions):
        nbformat.write(build_notebooks.build(chapter.source, "solutions"), path)
    # the chapter links "glossary.md#Page-table" from notebooks/: rewrite from there
    executed.cells[2].source = executed.cells[2].source.replace("](glossary.md", "](../glossary.md")
    saved = tmp_path / "executed.ipynb"
    nbformat.write(executed, saved)
    monkeypatch.setattr(site_pages, "colab_url", lambda p: f"https://colab.example/{p}")
    src, html = tmp_path / "site" / "src", tmp_path / "site" / "html"
    build_site.write_sources([chapter], {chapter.name: saved}, src)
    build_site.run_sphinx(src, html)
    assert (html / "glossary.html").is_file() and (html / "99_demo.html").is_file()
    assert 'href="glossary.html#page-table"' in (html / "99_demo.html").read_text()
    assert 'href="99_demo.html#questions"' in (html / "glossary.html").read_text()
    assert "glossary.html" in (html / "index.html").read_text()
    assert check_site_links.check(html) == []
    page = (html / "99_demo.html").read_text()
    # the figure's alt text from its cell; a copy button on code; a favicon; link previews
    alt = "The demo explorer's picture: a single pixel standing in for a figure."
    assert re.search(rf'<img alt="{re.escape(alt)}" src="_images/[0-9a-f]{{64}}\.png"', page)
    assert "copybutton.js" in page and 'rel="icon" href="_static/favicon.svg"' in page
    assert '<meta property="og:title" content="99 · A demo chapter" />' in page
    assert re.search(r'<meta name="description" content="[^"]{20,}" />', page)
    assert '<meta property="og:url" content="https://kvlab-course.github.io/kvlab/99_demo.html"' \
        in page
    # the theme's 1.5 MB icon script is gone, its icon fonts keep only the icons used
    assert not list(html.rglob("fontawesome.js*")) and not list(html.rglob("*.map"))
    assert not any("fontawesome.js" in p.read_text() for p in html.glob("*.html"))
    fonts = {p.name: p.stat().st_size for p in html.rglob("fa-*.woff2")}
    if fonts and _has("brotli"):
        assert max(fonts.values()) < 8_000, fonts  # ~110 KB each, whole
        from fontTools.ttLib import TTFont

        glyphs = set(TTFont(next(html.rglob("fa-solid-900.woff2"))).getBestCmap())
        glyphs |= set(TTFont(next(html.rglob("fa-brands-400.woff2"))).getBestCmap())
        assert 0xF0C9 in glyphs  # fa-bars, the menu button every page shows (an <i> class)
        assert 0xF019 in glyphs  # the download links' arrow, which the stylesheet draws
        assert 0xF09B in glyphs  # the repository button's GitHub mark (the brands font)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_github_pages_publishes_what_make_site_builds():
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "pages.yml").read_text())
    steps = workflow["jobs"]["build"]["steps"]
    runs = [s["run"] for s in steps if "run" in s]
    assert any(r.split()[:2] == ["make", "site"] for r in runs), runs
    (upload,) = [s for s in steps if s.get("uses", "").startswith("actions/upload-pages-artifact")]
    assert upload["with"]["path"] == build_site.DEFAULT_OUT.relative_to(ROOT).as_posix() + "/html"
    deploy = workflow["jobs"]["deploy"]
    assert deploy["needs"] == "build"
    assert any(s.get("uses", "").startswith("actions/deploy-pages") for s in deploy["steps"])
    assert workflow["permissions"]["pages"] == "write"
