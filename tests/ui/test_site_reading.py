"""How the website reads at 1280 px (a laptop) and at 390 px (a phone) (``make test-ui``).

* **Code on a phone.** Where a box holds about 40 characters, code is not wrapped (wrapping
  would break the indentation Python reads): every line stays whole and a wide block scrolls
  sideways inside its own box, never the page. (At 1280 px no code scrolls at all:
  ``test_site_code_width.py``.)
* **Search.** A result's snippet is the page's own text (not the header's buttons or the
  colour-mode labels); for a term of the glossary, the chapter that introduces it ranks first;
  the magnifier on the search page sits beside the query, not over its first letter. The home
  page says where the search field is, and at each width it is there.
* **Colour mode.** One click on the colour-mode button switches between light and dark (no
  dropdown), and the choice holds on the next page.
* No empty index page (``genindex.html``) and no link to one.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ui

HTML = ROOT / "build" / "site" / "html"
CHAPTERS = sorted(p.stem for p in (ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))
LAPTOP = dict(viewport=dict(width=1280, height=900))
PHONE = dict(viewport=dict(width=390, height=844), is_mobile=True, has_touch=True)
#: the theme's colour-mode labels, which once opened every search snippet
MODE_LABELS = re.compile(r"System Settings|Light\s+Dark")


@pytest.fixture
def open_page(browser):
    contexts = []

    def _open(**options):
        context = browser.new_context(**options)
        context.set_default_timeout(30_000)
        contexts.append(context)
        return context.new_page()

    yield _open
    for context in contexts:
        context.close()


def _pages() -> list[str]:
    return sorted(p.name for p in HTML.glob("*.html")) if HTML.is_dir() else []


# what each code box of a page does: its width, what it would need, how its lines are set
_CODE_BOXES = """() => [...document.querySelectorAll('article div.highlight pre')]
  .filter(pre => !pre.closest('.cell_output'))  /* outputs wrap (test_site.py) */
  .map(pre => {
    const style = getComputedStyle(pre);
    const lines = pre.textContent.split('\\n');
    return {overflow: pre.scrollWidth - pre.clientWidth, client: pre.clientWidth,
            padding: parseFloat(style.paddingLeft) + parseFloat(style.paddingRight),
            whiteSpace: style.whiteSpace, overflowX: style.overflowX,
            widest: Math.max(...lines.map(l => l.length)),
            line: lines.reduce((a, b) => b.length > a.length ? b : a, '').trim().slice(0, 60)};
  })"""
def _open_folds(page) -> None:
    """Open every folded solution, so that its code is laid out (and measured) too."""
    page.evaluate("() => document.querySelectorAll('article details').forEach(d => d.open = true)")


def test_on_a_phone_code_keeps_its_lines_and_scrolls_inside_its_box(open_page, site_url):
    page = open_page(**PHONE)
    scrolled = 0
    for name in [f"{c}.html" for c in CHAPTERS]:
        page.goto(site_url + name)
        page.wait_for_load_state("load")
        _open_folds(page)
        for box in page.evaluate(_CODE_BOXES):
            assert box["whiteSpace"] == "pre", f"{name}: code wraps on a phone ({box['line']})"
            if box["overflow"] > 1:
                assert box["overflowX"] in ("auto", "scroll"), f"{name}: a wide block is clipped"
                scrolled += 1
        # a sideways swipe moves the code inside its box, never the page
        moved = page.evaluate("""() => {
          const pre = [...document.querySelectorAll('article div.highlight pre')]
            .find(p => !p.closest('.cell_output') && p.scrollWidth > p.clientWidth + 1);
          if (!pre) return null;
          pre.scrollLeft = 60;
          return [pre.scrollLeft, document.documentElement.scrollWidth - innerWidth];
        }""")
        if moved is not None:
            assert moved[0] > 0 and moved[1] <= 1, f"{name}: {moved}"
    assert scrolled > 0, "no code block is wider than a phone: the phone case was not exercised"


def _search(page, site_url, query: str) -> list[tuple[str, str]]:
    page.goto(f"{site_url}search.html?q={query}")
    page.wait_for_function("() => /Search finished/.test(document.querySelector("
                           "'#search-results .search-summary')?.textContent || '')")
    # each result fetches its page for the snippet: wait for all of them
    page.wait_for_function("""() => {
      const items = document.querySelectorAll('#search-results ul.search li');
      return items.length > 0 && [...items].every(li => li.querySelector('p.context'));
    }""")
    results = page.locator("#search-results ul.search li")
    return results.evaluate_all("""els => els.map(e => [e.querySelector('a').getAttribute('href'),
        (e.querySelector('p.context') || {textContent: ''}).textContent])""")


@pytest.mark.parametrize("query", ["radix", "page table", "new_token_ratio"])
def test_search_snippets_are_the_pages_own_words(open_page, site_url, query):
    page = open_page(**LAPTOP)
    found = _search(page, site_url, query)
    snippets = [text for _, text in found if text]
    assert len(snippets) >= 3, found
    for text in snippets[:5]:
        assert not MODE_LABELS.search(text), f"a snippet shows the header's labels: {text[:120]!r}"
        assert "\n" not in text and "  " not in text, f"a snippet keeps the page's layout: {text!r}"
    top = snippets[0].lower()
    assert any(word in top for word in query.lower().replace("_", " ").split() + [query]), top


def test_the_chapter_that_introduces_a_term_ranks_first(open_page, site_url):
    """new_token_ratio is taught in chapter 12 (the glossary says so); chapter 10 names it too."""
    glossary = (ROOT / "notebooks" / "glossary.md").read_text()
    assert re.search(r"^### new token ratio\n\*\*New token ratio\*\* \(chapter 12\)", glossary, re.M)
    page = open_page(**LAPTOP)
    hrefs = [href for href, _ in _search(page, site_url, "new_token_ratio")]
    chapters = [h for h in hrefs if re.match(r"\d\d_", h)]
    assert chapters[0].startswith("12_"), hrefs
    assert any(h.startswith("10_") for h in chapters), "chapter 10 names it too: it should be found"


def test_the_magnifier_sits_beside_the_query(open_page, site_url):
    for options in (LAPTOP, PHONE):
        page = open_page(**options)
        page.goto(f"{site_url}search.html?q=radix")
        form = page.locator("article form.bd-search, .bd-search-container form.bd-search").first
        icon = form.locator(".fa-magnifying-glass").bounding_box()
        text_starts = form.locator("input[name='q']").evaluate(
            "e => e.getBoundingClientRect().left + parseFloat(getComputedStyle(e).paddingLeft)")
        assert icon["x"] + icon["width"] <= text_starts, (icon, text_starts)


def test_the_home_page_says_where_the_search_field_is_and_it_is_there(open_page, site_url):
    words = " ".join((ROOT / "website" / "intro.md").read_text().split())
    assert "top of the menu on the left" in words and "on a phone, the magnifier at the top right" in words
    laptop = open_page(**LAPTOP)
    laptop.goto(site_url)
    field = laptop.locator(".bd-sidebar-primary .search-button-field").first
    box = field.bounding_box()
    assert field.is_visible() and box["x"] < 1280 / 4 and box["y"] < 300, box
    phone = open_page(**PHONE)
    phone.goto(site_url)
    icon = phone.locator(".bd-header-article button.search-button__button").first
    box = icon.bounding_box()
    assert icon.is_visible() and box["x"] > 390 / 2 and box["y"] < 100, box
    icon.tap()
    query = phone.locator("#pst-search-dialog input[name='q']")
    query.wait_for(state="visible")
    query.fill("radix")
    query.press("Enter")
    phone.wait_for_url(re.compile(r"search\.html\?q=radix"))


def test_the_colour_mode_button_switches_in_one_click(open_page, site_url):
    page = open_page(**LAPTOP, color_scheme="light")
    page.goto(site_url + f"{CHAPTERS[0]}.html")
    theme = "() => document.documentElement.dataset.theme"
    toggle = page.locator(".bd-header-article .kvlab-mode-toggle").first
    assert page.evaluate(theme) == "light" and toggle.get_attribute("title") == "Dark mode"
    assert page.locator(".theme-switch-container .dropdown-menu").count() == 0, "a dropdown"
    toggle.click()
    assert page.evaluate(theme) == "dark" and toggle.get_attribute("title") == "Light mode"
    page.goto(site_url + f"{CHAPTERS[1]}.html")  # the choice holds on the next page
    assert page.evaluate(theme) == "dark"
    page.locator(".bd-header-article .kvlab-mode-toggle").first.click()
    assert page.evaluate(theme) == "light"


def test_there_is_no_empty_index_page():
    assert not (HTML / "genindex.html").exists()
    assert not [p.name for p in HTML.glob("*.html") if 'href="genindex.html"' in p.read_text()]
