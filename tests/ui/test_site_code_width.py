"""Code fits the page on a laptop (``make test-ui``): on the website at 1280 px no code block
of any page scrolls sideways, and the narrowest code box holds the ``MAX_CODE_COLUMNS``
characters ``tests/test_code_width.py`` allows every chapter's code (89 measured); in
JupyterLab at 1280 px with its file browser open (an 848 px editor) a line of that many
characters fits too (107 measured), one 20 longer does not. With the static test, this keeps
every chapter's code, the ones to come included, on the page."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lab_driver import NotebookPage
from test_site_reading import _CODE_BOXES, CHAPTERS, LAPTOP, _open_folds, _pages, open_page  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_code_width import MAX_CODE_COLUMNS  # noqa: E402

pytestmark = pytest.mark.ui

# the width of one character of code, measured in the page's first code box
_CHAR_WIDTH = """() => {
  const pre = document.querySelector('article .cell_input div.highlight pre');
  const probe = document.createElement('span');
  probe.textContent = 'x'.repeat(200);
  pre.appendChild(probe);
  const width = probe.getBoundingClientRect().width / 200;
  probe.remove();
  return width;
}"""


def test_no_code_scrolls_sideways_at_1280_px(open_page, site_url):
    page = open_page(**LAPTOP)
    narrowest, wide = None, []
    for name in _pages():
        page.goto(site_url + name)
        page.wait_for_load_state("load")
        _open_folds(page)
        boxes = page.evaluate(_CODE_BOXES)
        wide += [f"{name}: a {b['widest']}-character line scrolls by {b['overflow']} px: "
                 f"{b['line']}" for b in boxes if b["overflow"] > 1]
        if name[:2] in {c[:2] for c in CHAPTERS} and boxes:
            room = min(b["client"] - b["padding"] for b in boxes)
            columns = int(room / page.evaluate(_CHAR_WIDTH))
            narrowest = columns if narrowest is None else min(narrowest, columns)
    assert not wide, f"{len(wide)} code blocks scroll sideways at 1280 px:\n" + "\n".join(wide)
    assert narrowest is not None and narrowest >= MAX_CODE_COLUMNS, (
        f"the narrowest code box holds {narrowest} characters at 1280 px, fewer than the "
        f"{MAX_CODE_COLUMNS} tests/test_code_width.py allows")


def test_a_line_of_max_columns_fits_jupyterlab_at_1280_px(browser, lab_server, ui_output):
    import nbformat

    sys.path.insert(0, str(ROOT / "tools"))
    from notebook_kernel import KERNELSPEC

    fits = "x = '" + "a" * (MAX_CODE_COLUMNS - 6) + "'"
    too_wide = "y = '" + "b" * (MAX_CODE_COLUMNS + 14) + "'"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(fits),
                                         nbformat.v4.new_code_cell(too_wide)])
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nbformat.write(nb, lab_server.root / "code_width.ipynb")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        page = NotebookPage(context.new_page(), lab_server, "code_width.ipynb", ui_output).open()
        boxes = page.page.evaluate("""() => [...document.querySelectorAll(
            '.jp-NotebookPanel .jp-CodeCell')].map(c => {
              const s = c.querySelector('.cm-scroller');
              return [s.scrollWidth - s.clientWidth,
                      c.querySelector('.jp-InputArea-editor').getBoundingClientRect().width];
            })""")
        page.screenshot("code-width")
    finally:
        context.close()
        lab_server.shutdown_sessions()
    (fit, editor), (scrolls, _) = boxes
    assert editor >= 840, f"the editor is {editor} px wide at 1280 px (848 measured)"
    assert fit <= 1, f"a line of {MAX_CODE_COLUMNS} characters scrolls by {fit} px in JupyterLab"
    assert scrolls > 1, "the control line 20 characters longer does not scroll: nothing measured"
