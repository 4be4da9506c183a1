"""The course as a learner meets it: JupyterLab in headless Chromium (``make test-ui``).

Each test opens a notebook in a real JupyterLab, runs all cells from the Run menu, fails on
any cell error shown in the page, and then looks at what a learner would look at: the
simulator's timeline slider must change the picture (chapter 07), the allocator chapter's
heatmap must render (chapter 03), and a wrong answer typed into chapter 01's exercise shows its
message and picture without the checker's frames while Run All still reaches the last cell.
The first two tests check the harness itself on small notebooks. Screenshots:
``test-output/ui/``.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from fixture_notebooks import ERROR_DEMO, SLIDER_DEMO
from lab_driver import CellError, image_colours, move_slider

pytestmark = pytest.mark.ui

ROOT = Path(__file__).resolve().parents[2]
VIEW = "img.kvlab-view, .kvlab-view img"
SLIDER = ".kvlab-timeline-slider"


def chapter(prefix: str) -> str:
    found = sorted((ROOT / "notebooks").glob(f"{prefix}_*.ipynb"))
    assert len(found) == 1, f"expected one notebooks/{prefix}_*.ipynb, found {found}"
    return found[0].name


def check_slider_redraws_view(nb, steps: int = 3) -> tuple[float, float]:
    """Move the timeline slider; the picture in the view must change. Returns (before, after)."""
    page = nb.page
    slider = page.locator(SLIDER).first
    view = page.locator(VIEW).first
    slider.wait_for(state="visible", timeout=60_000)
    view.wait_for(state="visible", timeout=60_000)
    view.scroll_into_view_if_needed()
    old_png, old_src = view.screenshot(), view.get_attribute("src") or ""
    assert image_colours(old_png) >= 4, "the view shows a blank image"
    slider.scroll_into_view_if_needed()
    nb.screenshot("slider-before")
    before, after = move_slider(slider, steps=steps)
    assert after > before, f"the slider did not move ({before} -> {after})"
    nb.wait_kernel_settled()  # every redraw the slider asked for has finished
    time.sleep(1.0)  # and the browser has shown the last image
    new_png, new_src = view.screenshot(), view.get_attribute("src") or ""
    assert new_src != old_src, "the view's image source did not change after moving the slider"
    assert new_png != old_png, "the view looks the same after moving the slider"
    assert image_colours(new_png) >= 4, "the view shows a blank image after moving the slider"
    nb.screenshot("slider-after")
    nb.raise_on_cell_error()
    nb.raise_on_logged_error()
    return before, after


# -- the harness on its own small notebooks -------------------------------------------------
def test_harness_moves_a_slider_and_sees_the_view_change(open_notebook):
    nb = open_notebook(SLIDER_DEMO)
    result = nb.run_all(timeout_s=120)
    assert result.code_cells == 4
    # the inline matplotlib figure of the last cell is in the page
    assert any(img["w"] >= 200 and img["h"] >= 100 and "kvlab-view" not in img["cls"]
               for img in nb.output_images())
    check_slider_redraws_view(nb)


def test_harness_fails_on_a_cell_error_but_not_on_a_warning(open_notebook):
    nb = open_notebook(ERROR_DEMO)
    with pytest.raises(CellError, match="ZeroDivisionError") as caught:
        nb.run_all(timeout_s=120)
    assert "only a warning" not in str(caught.value)
    assert nb.prompts()[:2] == ["[1]:", "[2]:"]  # the warning cell ran and is not reported
    # the second line of defence reads the saved notebook back from the server
    saved = nb.saved_errors()
    assert len(saved) == 1 and "ZeroDivisionError" in saved[0], saved
    # a widget callback that raises shows nothing in the notebook, only in the Log Console
    move_slider(nb.page.locator(SLIDER).first, steps=2)
    nb.wait_kernel_settled()
    with pytest.raises(CellError, match="ValueError: callback failed at"):
        nb.raise_on_logged_error()


# -- the course --------------------------------------------------------------------------
def test_ch07_timeline_slider_changes_the_heatmap(open_notebook):
    nb = open_notebook(chapter("07"))
    result = nb.run_all(timeout_s=400)
    nb.screenshot("ran")
    print(f"{nb.name}: {result.code_cells} code cells in {result.seconds:.0f} s")
    before, after = check_slider_redraws_view(nb)
    # the line of events under the slider follows it too
    info = nb.page.locator(".kvlab-step-info").first.inner_text()
    assert info.strip().startswith(f"step {int(after)}"), info
    explorer = nb.page.locator(".kvlab-timeline-explorer").first
    explorer.screenshot(path=str(nb.shots / f"{Path(nb.name).stem}-explorer.png"))


def test_ch03_page_table_heatmap_renders(open_notebook):
    nb = open_notebook(chapter("03"))
    result = nb.run_all(timeout_s=400)
    print(f"{nb.name}: {result.code_cells} code cells in {result.seconds:.0f} s")
    images = nb.output_images()
    broken = [img for img in images if img["w"] == 0]
    assert not broken, f"{nb.name}: {len(broken)} output image(s) failed to load"
    figures = [i for i, img in enumerate(images) if img["w"] >= 200 and img["h"] >= 100]
    assert figures, f"{nb.name}: no rendered figure in the outputs"
    # Look at the pictures as a learner would: the largest one (the page-table heatmap
    # coloured by part) must be colourful, not blank.
    largest = max(figures, key=lambda i: images[i]["w"] * images[i]["h"])
    img = nb.page.locator(".jp-NotebookPanel .jp-OutputArea-output img").nth(largest)
    img.scroll_into_view_if_needed()
    png = img.screenshot(path=str(nb.shots / f"{Path(nb.name).stem}-heatmap-element.png"))
    assert image_colours(png) >= 8, f"{nb.name}: the largest figure looks blank"
    nb.screenshot("heatmap")


#: typed into chapter 01's exercise: the right number of slots, the wrong values
WRONG_ANSWER = """def my_page_to_token(page_starts, page_size):
    return page_starts.repeat_interleave(page_size)  # every slot of a page is its start


kvlab.check.page_to_token(my_page_to_token);"""


def test_ch01_a_wrong_answer_reads_at_a_glance_and_run_all_goes_on(open_notebook):
    nb = open_notebook(chapter("01"))
    exercise = nb.code_cell("# YOUR CODE HERE: page_to_token")
    nb.type_into(exercise, WRONG_ANSWER)
    # the check's failure and the chapter's recheck are the only errors; Run All must reach the
    # last cell (run_all fails when the kernel goes idle with cells left unrun)
    result = nb.run_all(timeout_s=400, expected_errors=re.compile(
        r"✗ kvlab\.check\.(page_to_token|recheck\('01'\)):|CheckFailed: \[the example|"
        r"CheckFailed: 1 of 1 exercise of chapter 01 fails"))
    print(f"{nb.name}: {result.code_cells} code cells in {result.seconds:.0f} s")
    exercise = nb.code_cell("kvlab.check.page_to_token(my_page_to_token)")
    shown = exercise.locator(".jp-OutputArea").first.inner_text()
    assert "kvlab/course" not in shown and "Traceback" not in shown and "File " not in shown, shown
    assert "✗ kvlab.check.page_to_token: [the example: pages [4, 8] with page_size 4]" in shown
    assert "got[0:6]      = [4, 4, 4, 4, 8, 8]" in shown  # the typed answer ran
    assert "Run All goes on" in shown
    picture = exercise.locator(".jp-OutputArea-output img").first
    assert picture.evaluate("img => img.naturalWidth") >= 200, "no failure picture"
    assert image_colours(picture.screenshot()) >= 8, "the failure picture looks blank"
    exercise.scroll_into_view_if_needed()
    exercise.screenshot(path=str(nb.shots / f"{Path(nb.name).stem}-wrong-answer.png"))
    # the cells after it went on with the package's version, and said so
    lift = nb.code_cell('kvlab.check.choose("page_to_token"')
    assert "using kvlab.page_to_token (your my_page_to_token has not passed" in \
        lift.locator(".jp-OutputArea").first.inner_text()
    last = nb.page.locator(".jp-NotebookPanel .jp-CodeCell").last
    assert "kvlab.check.recheck" in last.locator(".jp-InputArea-editor").inner_text()
    assert "1 failing (page_to_token)" in last.locator(".jp-OutputArea").first.inner_text()
    last.scroll_into_view_if_needed()
    last.screenshot(path=str(nb.shots / f"{Path(nb.name).stem}-wrong-answer-recheck.png"))


#: typed into chapter 11's first exercise: the right hashes, in a tuple (the statement asks for a list)
TUPLE_ANSWER = """def my_page_hashes(input_ids, page_size):
    return tuple(kvlab.page_hashes(input_ids, page_size))


kvlab.check.page_hashes(my_page_hashes);"""


def test_ch11_on_a_laptop_offline_a_wrong_type_reads_in_one_line_and_no_figure_is_scaled(
        browser, lab_server, ui_output):
    """JupyterLab at 1280 px with the file browser open (848 px of output), no internet: the
    first cell's Colab link is text (no broken picture), a tuple where the statement asks for a
    list is told in one line before the lift cell could trip over it, and no figure is wider
    than the output area (so none is scaled down)."""
    from lab_driver import NotebookPage

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(60_000)
    try:
        nb = NotebookPage(context.new_page(), lab_server, chapter("11"), ui_output).open()
        assert nb.page.locator(".jp-FileBrowser").first.is_visible(), "the file browser is open"
        first = nb.page.locator(".jp-NotebookPanel .jp-MarkdownCell").first
        assert first.locator("a", has_text="Open in Colab").count() == 1
        assert first.locator("img").count() == 0, "the first cell shows a picture from another site"
        nb.type_into(nb.code_cell("# YOUR CODE HERE: page_hashes"), TUPLE_ANSWER)
        nb.run_all(timeout_s=400, expected_errors=re.compile(
            r"✗ kvlab\.check\.(page_hashes|recheck\('11'\)):|CheckFailed: "))
        cell = nb.code_cell("kvlab.check.page_hashes(my_page_hashes)")
        shown = cell.locator(".jp-OutputArea").first.inner_text()
        assert shown.startswith("✗ kvlab.check.page_hashes: [two full pages] return a list of hashes "
                                "(the bytes kvlab.chain_hash returns), got tuple"), shown
        assert "kvlab/course" not in shown and "Traceback" not in shown
        cell.scroll_into_view_if_needed()
        cell.screenshot(path=str(nb.shots / "11_hash_prefix_cache-tuple-answer.png"))
        lift = nb.code_cell('kvlab.check.choose("page_hashes"')
        assert "using kvlab.page_hashes (your my_page_hashes has not passed" in \
            lift.locator(".jp-OutputArea").first.inner_text()
        area = nb.page.locator(".jp-NotebookPanel .jp-OutputArea-output").first.evaluate(
            "e => e.getBoundingClientRect().width")
        assert 820 <= area <= 870, f"the output area is {area:.0f} px wide, not about 848"
        figures = [img for img in nb.output_images() if img["w"] >= 200]
        assert figures and all(0 < img["w"] <= area for img in figures), (
            f"figures wider than the {area:.0f} px output area: "
            f"{[img['w'] for img in figures if img['w'] > area]}")
        nb.screenshot("laptop")
    finally:
        context.close()
        lab_server.shutdown_sessions()
