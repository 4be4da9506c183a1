"""Chapter 07's pictures: a serving loop's memory over time, page sizes side by side, and one
step seen four ways. Every run is seeded and takes well under a second on a CPU."""
from __future__ import annotations

from ...alloc.paging import div_ceil
from ...serving.sim import make_workload, shared_system_prompt, simulate
from .figure_registry import figure

#: the chapter's pressured run: a mixed workload in 24 pages of 4 slots
PRESSURE = dict(page_size=4, num_pages=24, max_running=4)


def pressured_run(seed: int = 0):
    """A mixed workload (system prompt, chat, few-shot, unrelated, aborts) short of memory."""
    return simulate(make_workload("mixed", seed=seed), **PRESSURE)


def page_size_runs(seed: int = 0, slots: int = 512, page_sizes=(1, 16, 64)):
    """The same shared-system-prompt workload at several page sizes, with equal memory in slots."""
    w = shared_system_prompt(seed=seed, n_requests=12, system_len=40)
    return {P: simulate(w, page_size=P, num_pages=max(slots // P, div_ceil(w.max_total_len, P)))
            for P in page_sizes}


@figure("07_memory_over_time.png")
def memory_dashboard():
    from ..viz.dashboard import timeline_dashboard

    return timeline_dashboard(pressured_run())


@figure("07_page_sizes.png")
def page_sizes_figure():
    from ..viz.dashboard import compare_page_sizes

    return compare_page_sizes(page_size_runs())


@figure("07_step_views.png")
def step_views_figure(step: int | None = None):
    """The explorer's four views of one busy step of the pressured run, one under the other."""
    import matplotlib.pyplot as plt

    from ..viz.legibility import MAX_WIDTH_IN
    from ..viz.dashboard import VIEWS, describe_step, draw_step

    tl = pressured_run()
    if step is None:  # the step with the most mapped cells and a cache_req so far
        step = max(range(len(tl)), key=lambda i: (tl[i].last_regions is not None,
                                                  int((tl[i].page_table >= 0).sum())))
    fig, axes = plt.subplots(4, 1, figsize=(MAX_WIDTH_IN, 12.5),
                             gridspec_kw=dict(height_ratios=[1, 1.1, 1.5, 0.8]))
    for ax, view in zip(axes.flat, VIEWS):
        draw_step(tl, step, view, ax)
    fig.suptitle(describe_step(tl[step]), fontsize=9)
    fig.tight_layout()
    return fig
