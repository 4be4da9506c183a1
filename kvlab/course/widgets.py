"""An ipywidgets explorer for a simulator timeline (chapter 07): scrub through the steps.

    [▶ play] [step ━━━━━━●━━━━━━ 12]                 <- slider (class kvlab-timeline-slider)
    view: [page table] [free list] [cache tree] [regions]
    step 12: admitted 5; hit 32 tok; ...               <- one line of events (kvlab-step-info)
    ┌────────────────────────────────────────────┐
    │  the chosen view of the chosen step (PNG)  │  <- Image widget (class kvlab-view)
    └────────────────────────────────────────────┘

Why an ``Image`` widget with PNG bytes and not a live matplotlib canvas: it renders the
same in JupyterLab and in Colab (with ``output.enable_custom_widget_manager()``, which the
setup cell calls), needs no matplotlib widget backend, and a browser test can read the
image's ``src`` to see that it changed when the slider moved.

Without a widget front end (nbval, nbconvert, a notebook viewer on the web) the widget
cannot render. The rule kvlab uses: displaying an explorer always sends the widget *and*
a PNG of its current view in the same output (``_repr_mimebundle_``); a front end that
knows widgets shows the widget, any other shows the picture. ``KVLAB_STATIC_WIDGETS=1``
in the environment additionally draws a static strip of several steps with matplotlib
(useful when exporting a chapter to HTML).
"""
from __future__ import annotations

import base64
import io
import os
from typing import Sequence

from .viz.dashboard import VIEWS, describe_step, step_figure, step_grid

__all__ = ["TimelineExplorer", "explore", "static_widgets_wanted"]


def static_widgets_wanted() -> bool:
    """True when ``KVLAB_STATIC_WIDGETS`` is set to 1 (draw static figures as well)."""
    return os.environ.get("KVLAB_STATIC_WIDGETS", "0").strip() not in ("", "0", "false", "no")


class TimelineExplorer:
    """Slider (+ play button) over the steps of a :class:`~kvlab.serving.sim.Timeline`, a choice of
    view, and the picture. ``explorer.widget`` is the ipywidgets box; displaying the explorer
    itself also carries a PNG fallback (see the module docstring)."""

    def __init__(self, timeline, view: str = "page table", *, step: int = 0, dpi: int = 100,
                 interval_ms: int = 700):
        import ipywidgets as widgets

        if len(timeline) == 0:
            raise ValueError("timeline: has no steps to explore")
        if view not in VIEWS:
            raise ValueError(f"view: one of {VIEWS} (got {view!r})")
        self.timeline = timeline
        self.dpi = dpi
        self._png_cache: dict[tuple[int, str], bytes] = {}
        last = len(timeline) - 1
        step = max(0, min(step, last))
        self.slider = widgets.IntSlider(value=step, min=0, max=last, step=1, description="step",
                                        continuous_update=False,
                                        layout=widgets.Layout(width="480px"))
        self.slider.add_class("kvlab-timeline-slider")
        self.play = widgets.Play(value=step, min=0, max=last, step=1, interval=interval_ms,
                                 description="play", repeat=False)
        self.play.add_class("kvlab-timeline-play")
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.view = widgets.ToggleButtons(options=list(VIEWS), value=view, description="view")
        self.view.add_class("kvlab-view-choice")
        self.info = widgets.HTML()
        self.info.add_class("kvlab-step-info")
        self.image = widgets.Image(format="png")
        self.image.add_class("kvlab-view")
        self.widget = widgets.VBox([widgets.HBox([self.play, self.slider]), self.view, self.info,
                                    self.image])
        self.widget.add_class("kvlab-timeline-explorer")
        self.slider.observe(self._refresh, names="value")
        self.view.observe(self._refresh, names="value")
        self._refresh()

    # --- pictures ---------------------------------------------------------------------

    def png(self, step: int | None = None, view: str | None = None) -> bytes:
        """PNG bytes of ``view`` at ``step`` (default: what the widgets show now)."""
        import matplotlib.pyplot as plt

        step = self.slider.value if step is None else step
        view = self.view.value if view is None else view
        key = (step, view)
        if key not in self._png_cache:
            # Drawn with interactive mode off: a figure made inside a widget callback must go
            # only into the PNG, never to the front end's log as a displayed output.
            with plt.ioff():
                fig = step_figure(self.timeline, step, view)
                buf = io.BytesIO()
                fig.savefig(buf, format="png", dpi=self.dpi, metadata={"Software": None})
                plt.close(fig)
            self._png_cache[key] = buf.getvalue()
        return self._png_cache[key]

    def _refresh(self, _change=None) -> None:
        step = self.slider.value
        self.image.value = self.png(step, self.view.value)
        self.info.value = f"<code>{describe_step(self.timeline[step])}</code>"

    def show_step(self, step: int, view: str | None = None) -> None:
        """Move the slider (and optionally the view) from code, as a learner would by hand."""
        if view is not None:
            self.view.value = view
        self.slider.value = step

    # --- display ----------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs) or {}
        data = dict(bundle[0] if isinstance(bundle, tuple) else bundle)
        data["image/png"] = base64.b64encode(self.png()).decode("ascii")
        data["text/plain"] = (f"TimelineExplorer({self.timeline.workload}, {len(self.timeline)} steps, "
                              f"step {self.slider.value}, view {self.view.value!r})")
        return data


def explore(timeline, view: str = "page table", *, step: int = 0,
            static_steps: Sequence[int] | None = None) -> TimelineExplorer:
    """Display a :class:`TimelineExplorer` for ``timeline`` and return it.

    With ``KVLAB_STATIC_WIDGETS=1`` it also draws ``static_steps`` (default: four steps
    spread over the run) of the chosen view as one static figure.
    """
    from IPython.display import display

    explorer = TimelineExplorer(timeline, view, step=step)
    display(explorer)
    if static_widgets_wanted():
        import matplotlib.pyplot as plt

        n = len(timeline)
        steps = static_steps if static_steps is not None else sorted({0, n // 3, 2 * n // 3, n - 1})
        step_grid(timeline, steps, view)
        plt.show()
    return explorer
