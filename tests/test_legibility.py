"""Every picture is legible where it is shown: at most 8.4 in wide, no text under 9 px in an
848 px output area (JupyterLab at 1280 px with the file browser open).

The notebooks' figures are measured while nbval runs them (``notebooks/conftest.py`` turns on
``kvlab.course.viz.legibility``'s audit); here: every figure of ``kvlab.course.scenes`` (what ``figures/``
holds), the explorer's four views, the failure pictures of the checkers, and the measuring
itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvlab.course.viz.legibility import (MIN_TEXT_PX, OUTPUT_WIDTH_PX, IllegibleFigure,  # noqa: E402
                                  check_legible, inline_dpi, measure, text_px)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


# --- the measuring --------------------------------------------------------------------


def test_inline_dpi_is_what_jupyterlab_draws_at():
    from matplotlib_inline.config import InlineBackend

    rc = InlineBackend.class_traits()["rc"].default()
    assert inline_dpi() == float(rc.get("figure.dpi", matplotlib.rcParamsDefault["figure.dpi"]))


def test_a_wide_figure_shrinks_its_text():
    wide, ax = plt.subplots(figsize=(23, 2))
    ax.set_title("page 4 (start 16)", fontsize=7)
    m = measure(wide, dpi=100)
    assert m.width_px > 1500 and m.smallest_pt <= 7  # tight bbox: the margins are cropped
    assert m.smallest_px == pytest.approx(text_px(m.smallest_pt, 100, m.width_px))
    assert m.smallest_px < 6 and not m.legible
    with pytest.raises(IllegibleFigure, match="smallest text"):
        check_legible(wide, "wide", dpi=100)

    narrow, ax = plt.subplots(figsize=(8, 2))
    ax.set_title("page 4 (start 16)", fontsize=7)
    ax.tick_params(labelsize=7)
    m = check_legible(narrow, "narrow", dpi=100)
    assert m.width_px <= OUTPUT_WIDTH_PX and m.scale == 1.0
    assert m.smallest_px == pytest.approx(7 * 100 / 72)


def test_the_output_area_is_what_a_laptop_shows_and_wider_figures_fail_whatever_their_text():
    from kvlab.course.viz.legibility import MAX_WIDTH_IN

    assert OUTPUT_WIDTH_PX == 848 and MAX_WIDTH_IN == 8.4 and MAX_WIDTH_IN * 100 <= OUTPUT_WIDTH_PX
    # 9 in with 9 pt text: scaled to 0.94, its text still 11.8 px tall, but wider than the rule
    wide, ax = plt.subplots(figsize=(9.0, 2))
    ax.set_title("a title", fontsize=9)
    ax.tick_params(labelsize=9)
    m = measure(wide, dpi=100, bbox_inches=None)
    assert m.smallest_px > MIN_TEXT_PX and m.too_wide and not m.legible
    with pytest.raises(IllegibleFigure, match="too wide: a figure of 9.00 in, at most 8.4 in and 848 px"):
        check_legible(wide, "9 in", dpi=100, bbox_inches=None)
    small_dpi = measure(wide, dpi=80, bbox_inches=None)  # 720 px, not scaled: still wider than the rule
    assert small_dpi.width_px < OUTPUT_WIDTH_PX and small_dpi.too_wide
    fits, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 2))
    ax.tick_params(labelsize=7)
    fits.tight_layout()
    m = check_legible(fits, "8.4 in", dpi=100)  # the tight crop's margins: a PNG up to 848 px
    assert m.width_px <= OUTPUT_WIDTH_PX and m.scale == 1.0
    edge, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 2))  # 8.4 in, but its labels spill past its edges:
    ax.tick_params(labelsize=7)                           # the PNG is scaled, so it is too wide
    edge.subplots_adjust(left=0.0, right=1.0)
    assert measure(edge, dpi=100).too_wide
    # a legend drawn outside the axes widens the PNG past the figure: measured as drawn
    spill, ax = plt.subplots(figsize=(8.0, 2))
    ax.plot([0, 1], label="a label long enough to run far past the right edge of the figure")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    assert measure(spill, dpi=100).too_wide


def test_only_drawn_text_counts():
    fig, ax = plt.subplots(figsize=(6, 2))
    ax.tick_params(labelsize=8)
    ax.set_title("shown", fontsize=9)
    ax.text(0.5, 0.5, "hidden", fontsize=3, visible=False)
    ax.text(0.5, 0.5, "", fontsize=3)
    assert measure(fig, dpi=100).smallest_pt == 8


def test_the_audit_records_every_png_a_process_renders(tmp_path):
    log = tmp_path / "audit.jsonl"
    script = ("import kvlab, matplotlib.pyplot as plt, io\n"
              "fig, ax = plt.subplots(figsize=(20, 2)); ax.set_title('wide', fontsize=7)\n"
              "fig.savefig(io.BytesIO(), format='png', dpi=100)\n"
              "fig, ax = plt.subplots(figsize=(6, 2)); ax.set_title('fine', fontsize=9)\n"
              "ax.tick_params(labelsize=8); fig.savefig(io.BytesIO(), format='png')\n"
              "fig.savefig(io.BytesIO(), format='svg')\n")
    env = dict(os.environ, KVLAB_FIGURE_AUDIT=str(log), MPLBACKEND="Agg")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["legible"] for r in records] == [False, True]  # the svg is not measured
    assert records[0]["width_px"] == 2000 and records[0]["smallest_px"] < MIN_TEXT_PX
    assert records[0]["too_wide"] and records[0]["figure_width_in"] == 20.0 and not records[1]["too_wide"]


# --- every figure the package draws ------------------------------------------------------


def _scene_names():
    from kvlab.course.scenes.render import load_all

    return sorted(load_all())


@pytest.mark.parametrize("name", _scene_names())
def test_every_scene_figure_is_legible(name):
    from kvlab.course.scenes.figure_registry import FIGURES

    check_legible(FIGURES[name](), name)


def test_the_explorer_views_are_legible_at_every_kind_of_step():
    from kvlab.course.scenes.ch07_serving_loop import page_size_runs, pressured_run
    from kvlab.course.viz.dashboard import VIEWS, step_figure, step_grid
    from kvlab.course.widgets import TimelineExplorer

    dpi = TimelineExplorer.__init__.__kwdefaults__["dpi"]
    runs = [pressured_run(), page_size_runs(page_sizes=(16,))[16]]  # pages of 4 and of 16
    for tl, everywhere in zip(runs, (True, False)):
        busiest = max(range(len(tl)), key=lambda i: len(tl[i].tree.nodes))  # the widest tree
        for step in sorted({0, busiest, len(tl) - 1} if everywhere else {busiest}):
            for view in VIEWS:
                fig = step_figure(tl, step, view)
                check_legible(fig, f"{tl.workload} step {step}, {view}", dpi=dpi, bbox_inches=None)
                plt.close(fig)
    for view in VIEWS:  # the static stand-in for the slider (KVLAB_STATIC_WIDGETS=1)
        check_legible(step_grid(runs[0], [0, 10, 20, 30], view), f"step grid, {view}")
        plt.close("all")


def _failed(expected, got, **kw):
    from kvlab.course.checking.failures import CheckFailed

    return CheckFailed("case 'random 3': request 1, part 2: slot 5 is wrong (expected 12, got 40)",
                       expected=expected, got=got, **kw)


def _failure_pictures():
    from kvlab.course.checking.failures import CheckFailed, Segment
    from kvlab.course.checking.guards import BandWrite

    long = torch.arange(500) * 37
    wrong = long.clone()
    wrong[300:340] = -1
    big = torch.arange(40) + 123_456
    segments = [Segment(f"request {r}, part {1 + r % 3}", 8 * r, 8 * r + 8) for r in range(6)]
    table = torch.arange(17 * 64).reshape(17, 64)
    bad_table = table.clone()
    bad_table[3, 10:20] = -1
    band = CheckFailed("the safety net caught writes outside the arguments")
    band.band_writes = [BandWrite("out_indices", "after", [1, 2, 5, 30], 8),
                        BandWrite("free_pages", "before", [3], 4)]
    yield "long strip", _failed(long, wrong, what="out_indices")
    yield "big values", _failed(big, big + 1, what="slots")
    yield "segments", _failed(torch.arange(48), torch.arange(48) + 1, segments=segments)
    yield "small table", _failed(torch.arange(24).reshape(4, 6), torch.zeros(4, 6, dtype=torch.long),
                                 shape=(4, 6), what="table")
    yield "page table", _failed(table, bad_table, shape=(17, 64), what="page table", page_size=4)
    yield "wide table", _failed(table, bad_table, shape=(17, 64), what="table")
    yield "guard bands", band


@pytest.mark.parametrize("name, err", list(_failure_pictures()), ids=lambda v: v if isinstance(v, str) else "")
def test_failure_pictures_are_legible(name, err):
    from kvlab.course.checking.picture import failure_figure

    fig = failure_figure(err)
    assert fig is not None
    check_legible(fig, name)
