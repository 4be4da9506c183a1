"""The course's website as a reader meets it (``make test-ui`` builds it first: ``make site``).

The built site (``build/site/html``) is served on 127.0.0.1 and opened in headless Chromium:
the home page lists every chapter; two chapters show their figures (every image loads), their
Colab badge and download links, and a folded solution that opens on a click; a glossary link
of the newest chapter opens its term; the search box finds a chapter. Every term a chapter
links is a link on its page to a heading of the glossary page. At 1280 px (a laptop) and at
390 px (a phone): no heading is clipped and no page scrolls sideways, code cells have copy
buttons, every ``<img>`` has a meaningful alt text, the home page's table shows every chapter
with its picture, and a tap on a figure opens it at full size (how code, search and the
colour mode read: ``test_site_reading.py``). Every page loads without a console error, a
failed request or the theme's icon script, and weighs under :data:`MAX_PAGE_BYTES`. Without a
browser: no internal link is broken, and no page loads anything from another site (it builds
and reads offline).
"""
from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import check_site_links  # noqa: E402
import site_figures  # noqa: E402

from kvlab.course.colab import colab_url  # noqa: E402

pytestmark = pytest.mark.ui

HTML = ROOT / "build" / "site" / "html"
CHAPTERS = sorted(p.stem for p in (ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))
WIDTHS = {"1280px": dict(width=1280, height=900),
          "390px": dict(width=390, height=844, is_mobile=True, has_touch=True)}
#: what one page may load (its HTML, scripts, styles, fonts and figures); measured: the
#: heaviest chapter 1.3 MB after the theme was trimmed (3.1 MB before)
MAX_PAGE_BYTES = 2_000_000
# two chapters with figures and exercises: the allocator's heatmaps, the explorer's picture
BROWSED = [c for c in CHAPTERS if c[:2] in ("03", "07")]


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    try:
        yield context.new_page()
    finally:
        context.close()


def _broken_images(page) -> list[str]:
    return page.eval_on_selector_all(
        "article img",
        "els => els.filter(e => !(e.complete && e.naturalWidth > 0)).map(e => e.src)")


def test_the_home_page_lists_every_chapter(page, site_url, ui_output):
    assert len(BROWSED) == 2, "chapters 03 and 07 are the ones browsed"
    page.goto(site_url)
    page.screenshot(path=str(ui_output / "site-index.png"))
    nav = page.eval_on_selector_all(".bd-sidebar-primary a.reference.internal",
                                    "els => els.map(e => e.getAttribute('href'))")
    for chapter in CHAPTERS:
        assert f"{chapter}.html" in nav, f"the site's navigation lacks chapter {chapter}"
    table = page.eval_on_selector_all("article table a", "els => els.map(e => e.href)")
    for chapter in CHAPTERS:
        learner = f"notebooks/{chapter}.ipynb"
        assert colab_url(learner) in table, f"the chapter table has no Colab badge for {chapter}"
    assert not _broken_images(page)


@pytest.mark.parametrize("chapter", BROWSED)
def test_a_chapter_shows_its_figures_links_and_a_folded_solution(page, site_url, ui_output,
                                                                 chapter):
    page.goto(f"{site_url}{chapter}.html")
    page.wait_for_load_state("load")
    figures = page.locator("article .cell_output img")
    assert figures.count() >= 1, f"{chapter}: no figure among the outputs"
    for i in range(figures.count()):
        figures.nth(i).scroll_into_view_if_needed()  # lazy images load when seen
    page.wait_for_function(
        "() => [...document.querySelectorAll('article img')].every(e => e.complete)")
    assert not _broken_images(page), f"{chapter}: images that did not load"

    # under the title: the Colab badge opens the learner's notebook; the downloads are notebooks
    badge = page.locator("article a:has(img[alt='Open in Colab'])").first
    assert badge.get_attribute("href") == colab_url(f"notebooks/{chapter}.ipynb")
    downloads = page.locator("article a.download")
    assert downloads.count() == 2
    for i in range(2):
        href = downloads.nth(i).get_attribute("href")
        with urllib.request.urlopen(site_url + href, timeout=10) as resp:
            nb = json.loads(resp.read())
        assert nb["nbformat"] == 4 and nb["cells"], f"{chapter}: {href} is not a notebook"

    # an exercise: the starter is shown, the solution folded until clicked
    starter = page.locator("article .tag_kvlab-starter").first
    assert "YOUR CODE HERE" in starter.inner_text()
    fold = page.locator("article .tag_hide-input details",
                        has=page.locator("summary", has_text="Show the solution")).first
    solution_code = fold.locator(".cell_input")
    assert not solution_code.is_visible(), "the solution is not folded"
    fold.locator("summary").click()
    solution_code.wait_for(state="visible")
    assert "YOUR CODE HERE" not in solution_code.inner_text()
    fold.scroll_into_view_if_needed()
    page.screenshot(path=str(ui_output / f"site-{chapter}-solution.png"))


def _glossary_anchors(links) -> set[str]:
    """The terms (anchors) of the glossary that ``links`` name; a link to the whole page: none."""
    return {u.partition("#")[2] for u in links if u.partition("#")[2] and (
        u.partition("#")[0].endswith("glossary.md") or u.partition("#")[0] == "glossary.html")}


def test_every_chapter_links_its_glossary_terms_to_their_headings():
    """Each term a chapter links (``glossary.md#term`` in its notebook) is a link on its page to
    a heading of the glossary page."""
    import nbformat

    headings = check_site_links._parse(HTML / "glossary.html").ids
    for chapter in CHAPTERS:
        nb = nbformat.read(ROOT / "notebooks" / "solutions" / f"{chapter}.ipynb", as_version=4)
        linked = _glossary_anchors(re.findall(r"\]\(([^)\s]+)\)", "\n".join(
            c.source for c in nb.cells if c.cell_type == "markdown")))
        on_page = _glossary_anchors(check_site_links._parse(HTML / f"{chapter}.html").links)
        assert linked, f"{chapter} links no glossary term"
        assert linked <= on_page, f"{chapter}'s page lacks glossary links {sorted(linked - on_page)}"
        assert on_page <= headings, f"{chapter} links missing terms {sorted(on_page - headings)}"


def test_a_glossary_link_opens_its_term(page, site_url, ui_output):
    chapter = CHAPTERS[-1]  # the newest chapter
    page.goto(f"{site_url}{chapter}.html")
    link = page.locator("article a[href^='glossary.html#']").first
    anchor = link.get_attribute("href").partition("#")[2]
    link.click()
    page.wait_for_url(re.compile(rf"glossary\.html#{re.escape(anchor)}$"))
    heading = page.locator(f"section[id='{anchor}'] > h3").first
    heading.wait_for()
    box = heading.bounding_box()
    assert box and 0 <= box["y"] < 900, f"the term {anchor} is not in view: {box}"
    page.screenshot(path=str(ui_output / "site-glossary-term.png"))


def test_the_search_box_finds_a_chapter(page, site_url):
    page.goto(site_url)
    page.locator("button.search-button-field, .search-button-field").first.click()
    box = page.locator("form.bd-search input[name='q']:visible").first
    box.fill("radix")
    box.press("Enter")
    page.wait_for_url(re.compile(r"search\.html\?q=radix"))
    results = page.locator("#search-results ul.search li a")
    results.first.wait_for(timeout=30_000)
    hrefs = results.evaluate_all("els => els.map(e => e.getAttribute('href'))")
    assert any(h.startswith(next(c for c in CHAPTERS if c.startswith("05_"))) for h in hrefs), hrefs


def test_no_internal_link_is_broken():
    if not (HTML / "index.html").is_file():
        pytest.fail("build the site first: make site", pytrace=False)
    pages = check_site_links.pages(HTML)
    assert {f"{c}.html" for c in CHAPTERS} <= {p.name for p in pages}
    assert check_site_links.check(HTML) == []


def test_no_page_loads_anything_from_another_site():
    """Scripts, styles, images and fonts all come with the site (links out are fine)."""
    loads = re.compile(r"<(?:script|img|iframe|source)\b[^>]*\bsrc=\"(?:https?:)?//"
                       r"|<link\b[^>]*\bhref=\"(?:https?:)?//[^\"]*\"[^>]*rel=\"(?:stylesheet|preload|icon)\""
                       r"|<link\b[^>]*rel=\"(?:stylesheet|preload|icon)\"[^>]*\bhref=\"(?:https?:)?//")
    offenders = {}
    for path in check_site_links.pages(HTML):
        found = loads.findall(path.read_text())
        if found:
            offenders[path.name] = found[:3]
    assert not offenders, offenders


# -- every page, on a wide screen and on a phone ----------------------------------------------
def _pages() -> list[str]:
    return sorted(p.name for p in HTML.glob("*.html")) if HTML.is_dir() else []


@pytest.fixture(params=list(WIDTHS), ids=list(WIDTHS))
def screen(request, browser):
    size = dict(WIDTHS[request.param])
    mobile = dict(is_mobile=size.pop("is_mobile", False), has_touch=size.pop("has_touch", False))
    context = browser.new_context(viewport=size, **mobile)
    context.set_default_timeout(30_000)
    try:
        yield request.param, context.new_page()
    finally:
        context.close()


_CLIPPED = """() => [...document.querySelectorAll('article :is(h1, h2, h3, h4)')]
    .filter(h => h.offsetParent !== null)
    .filter(h => h.scrollWidth > h.clientWidth + 1 || h.getBoundingClientRect().right > innerWidth + 1)
    .map(h => h.textContent.trim().slice(0, 80))"""


def test_no_heading_is_clipped_and_no_page_scrolls_sideways(screen, site_url, ui_output):
    width, page = screen
    for name in _pages():
        page.goto(site_url + name)
        page.wait_for_load_state("load")
        assert page.evaluate(_CLIPPED) == [], f"{name} at {width}: clipped headings"
        wide = page.evaluate("() => document.documentElement.scrollWidth - innerWidth")
        assert wide <= 1, f"{name} at {width} scrolls sideways by {wide} px"
    page.goto(site_url + next(c for c in CHAPTERS if c.startswith("03_")) + ".html")
    page.screenshot(path=str(ui_output / f"site-03-{width}.png"))


def test_code_cells_have_copy_buttons_and_outputs_wrap(screen, site_url):
    width, page = screen
    page.goto(f"{site_url}{BROWSED[0]}.html")
    page.wait_for_load_state("load")
    inputs = page.locator("article .cell_input div.highlight pre")
    buttons = page.locator("article .cell_input button.copybtn")
    assert inputs.count() >= 5 and buttons.count() == inputs.count(), \
        f"{inputs.count()} code cells, {buttons.count()} copy buttons"
    assert page.locator("article .cell_output button.copybtn").count() == 0, "outputs: no copy button"
    scrolled = page.eval_on_selector_all(
        "article .cell_output pre", "els => els.filter(e => e.scrollWidth > e.clientWidth + 1).length")
    assert scrolled == 0, f"{scrolled} outputs scroll sideways at {width}"


def test_every_image_has_a_meaningful_alt_text(screen, site_url):
    width, page = screen
    for name in _pages():
        page.goto(site_url + name)
        page.wait_for_load_state("load")
        images = page.eval_on_selector_all(
            "img", "els => els.map(e => [e.getAttribute('alt') || '', e.closest('.cell_output') !== null,"
                   " e.getAttribute('src')])")
        for alt, is_figure, src in images:
            problem = site_figures.alt_problem(alt, min_words=6 if is_figure else 3)
            assert problem is None, f"{name}: <img src={src!r} alt={alt!r}>: the alt text {problem}"
        if name[:2].isdigit() and name.startswith(tuple(c[:2] for c in BROWSED)):
            assert sum(fig for _, fig, _ in images) >= 1, f"{name}: no figure"


def test_the_home_page_shows_every_chapter_with_its_picture(screen, site_url, ui_output):
    width, page = screen
    page.goto(site_url)
    page.wait_for_load_state("load")
    rows = page.locator(".kvlab-course table tbody tr")
    assert rows.count() == len(CHAPTERS)
    for i, chapter in enumerate(CHAPTERS):
        row = rows.nth(i)
        assert row.locator(f"a[href='{chapter}.html']").count() == 1, f"row {i}: no link to {chapter}"
        picture = row.locator("img.kvlab-course-picture")
        picture.scroll_into_view_if_needed()
        picture.wait_for(state="visible")
        page.wait_for_function("e => e.complete && e.naturalWidth > 0", arg=picture.element_handle())
        box = picture.bounding_box()
        assert box["width"] >= 150 and box["x"] + box["width"] <= WIDTHS[width]["width"] + 1, \
            f"{chapter}'s picture at {width}: {box}"
        assert len(row.locator("td").nth(2).inner_text().split()) >= 2, f"{chapter}: what you build?"
    page.screenshot(path=str(ui_output / f"site-index-{width}.png"), full_page=True)


def test_a_tap_opens_a_figure_at_full_size(browser, site_url):
    size = dict(WIDTHS["390px"])
    context = browser.new_context(viewport=dict(width=size["width"], height=size["height"]),
                                  is_mobile=True, has_touch=True)
    try:
        page = context.new_page()
        page.goto(f"{site_url}{BROWSED[0]}.html")
        figure = page.locator("article .cell_output a.kvlab-figure-link img").first
        figure.scroll_into_view_if_needed()
        shown = figure.bounding_box()["width"]
        natural = figure.evaluate("e => e.naturalWidth")
        assert shown < natural, "the figure is not shrunk on a phone: nothing to open"
        figure.tap()
        page.wait_for_url(re.compile(r"_images/[0-9a-f]{64}\.png$"))
        assert page.evaluate("() => document.images[0].naturalWidth") == natural
    finally:
        context.close()


def test_every_page_loads_without_an_error_and_light(browser, site_url):
    """No console error, no failed request, none of the theme's icon script; every page under
    MAX_PAGE_BYTES (all it loads, figures included)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    problems, weights = [], {}
    try:
        for name in _pages():
            page = context.new_page()
            loaded: dict[str, int] = {}
            page.on("console", lambda m, n=name: m.type == "error" and problems.append(f"{n}: {m.text}"))
            page.on("pageerror", lambda e, n=name: problems.append(f"{n}: {e}"))
            page.on("requestfailed", lambda r, n=name: problems.append(f"{n}: failed {r.url}"))

            def on_response(resp, n=name, loaded=loaded):
                if resp.status >= 400:
                    problems.append(f"{n}: {resp.status} {resp.url}")
                loaded[resp.url] = len(resp.body())

            page.on("response", on_response)
            page.goto(site_url + name)
            page.evaluate("() => window.scrollTo(0, document.body.scrollHeight)")  # lazy images
            page.wait_for_load_state("networkidle")
            weights[name] = sum(loaded.values())
            assert not [u for u in loaded if "fontawesome.js" in u], f"{name} loads the icon script"
            page.close()
    finally:
        context.close()
    assert not problems, "\n".join(problems)
    heaviest = max(weights, key=weights.get)
    assert weights[heaviest] < MAX_PAGE_BYTES, f"{heaviest} loads {weights[heaviest]:,} bytes"
