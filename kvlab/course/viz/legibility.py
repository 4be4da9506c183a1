"""Is a figure legible where a learner sees it? Width and smallest text, as a notebook shows it.

JupyterLab shows a figure as a PNG drawn at the inline backend's dpi (matplotlib_inline sets
none of its own since 0.1.4, so matplotlib's ``figure.dpi``, 100) and cropped to its drawn
content (``bbox_inches="tight"``). An output area is :data:`OUTPUT_WIDTH_PX` pixels wide (a
1280 px window with the file browser open); a wider PNG is scaled down to fit, and its text
with it. A text of ``s`` points is then ``s * dpi / 72 * min(1, OUTPUT_WIDTH_PX / width)``
pixels tall on screen. The course wants every text at least :data:`MIN_TEXT_PX`, and every
figure at most :data:`MAX_WIDTH_IN` wide (CONTRIBUTING's rule) and never scaled: its PNG, the
tight crop's margins included, at most :data:`OUTPUT_WIDTH_PX`::

    figure 23 in wide, 7 pt labels:  2297 px at 100 dpi -> scaled by 0.37 -> text 3.6 px  (illegible)
    figure  9 in wide, 9 pt labels:   900 px             -> scaled by 0.94 -> too wide     (illegible)
    figure  8 in, a legend outside:   900 px             -> scaled by 0.94 -> too wide     (illegible)
    figure 8.4 in wide, 7 pt labels:  846 px             -> not scaled     -> text 9.7 px  (fine)

:func:`measure` renders a figure the way the inline backend does and reports both numbers.
:func:`install_audit` (what ``KVLAB_FIGURE_AUDIT`` turns on at ``import kvlab``) measures
every figure a process renders to PNG (a notebook's inline figures, the explorer's pictures)
and writes one JSON line per figure to a file, or warns about the illegible ones; the
notebook tests read that file.
"""
from __future__ import annotations

import io
import json
import os
import struct
import warnings
from typing import NamedTuple

#: The width of a JupyterLab output area, in CSS pixels, in a 1280 px wide window with the file
#: browser open (what a learner on a laptop has; the default layout without it gives 970).
OUTPUT_WIDTH_PX = 848
#: The smallest text height the course allows, in pixels on screen.
MIN_TEXT_PX = 9.0
#: The widest figure the course draws, in inches: 840 px at the inline backend's 100 dpi, so an
#: output area shows it unscaled and 7 pt text is 9.7 px tall (the smallest size the course uses).
MAX_WIDTH_IN = 8.4
#: The environment variable that turns the audit on: a file path (JSON lines) or ``warn``.
AUDIT_ENV = "KVLAB_FIGURE_AUDIT"

__all__ = ["AUDIT_ENV", "FigureLegibility", "MAX_WIDTH_IN", "MIN_TEXT_PX",
           "OUTPUT_WIDTH_PX", "IllegibleFigure",
           "check_legible", "inline_dpi", "install_audit", "measure", "text_px"]


class IllegibleFigure(AssertionError):
    """A figure wider than :data:`MAX_WIDTH_IN`, or whose smallest text would be under
    :data:`MIN_TEXT_PX` on screen."""


class FigureLegibility(NamedTuple):
    """How a figure looks in an output area ``OUTPUT_WIDTH_PX`` wide."""

    width_px: int  # of the PNG, as rendered
    height_px: int
    dpi: float
    smallest_pt: float  # the smallest font size drawn (inf when the figure has no text)
    smallest_text: str  # one text of that size, to find it
    n_texts: int
    figure_width_in: float = 0.0  # the figure's own width (figsize), before the tight crop

    @property
    def scale(self) -> float:
        """How much the output area shrinks the PNG (1.0 when it fits)."""
        return min(1.0, OUTPUT_WIDTH_PX / self.width_px) if self.width_px else 1.0

    @property
    def smallest_px(self) -> float:
        """Height on screen of the smallest text, in pixels."""
        return text_px(self.smallest_pt, self.dpi, self.width_px)

    @property
    def width_in(self) -> float:
        """The width as drawn, in inches (the PNG's pixels at its dpi)."""
        return self.width_px / self.dpi if self.dpi else 0.0

    @property
    def too_wide(self) -> bool:
        """Drawn wider than :data:`MAX_WIDTH_IN`, or a PNG an output area must scale down."""
        return self.figure_width_in > MAX_WIDTH_IN + 0.005 or self.width_px > OUTPUT_WIDTH_PX

    @property
    def legible(self) -> bool:
        return self.smallest_px >= MIN_TEXT_PX and not self.too_wide

    def describe(self) -> str:
        what = f"'{self.smallest_text[:40]}'" if self.n_texts else "no text"
        wide = (f"; too wide: a figure of {self.figure_width_in:.2f} in, at most {MAX_WIDTH_IN:g} in and "
                f"{OUTPUT_WIDTH_PX} px" if self.too_wide else "")
        return (f"{self.width_px} px wide at {self.dpi:g} dpi (shown at {self.scale:.2f}{wide}), smallest "
                f"text {self.smallest_pt:g} pt = {self.smallest_px:.1f} px on screen ({what})")


def text_px(points: float, dpi: float, width_px: int) -> float:
    """Screen height of ``points`` of text in a PNG ``width_px`` wide drawn at ``dpi``."""
    scale = min(1.0, OUTPUT_WIDTH_PX / width_px) if width_px else 1.0
    return points * dpi / 72.0 * scale


def inline_dpi() -> float:
    """The dpi JupyterLab's inline backend draws at: its own ``rc`` if it sets one, else
    matplotlib's default ``figure.dpi``."""
    import matplotlib

    try:
        from matplotlib_inline.config import InlineBackend

        rc = dict(InlineBackend.class_traits()["rc"].default() or {})
    except Exception:  # noqa: BLE001 - matplotlib_inline missing or its API changed
        rc = {}
    return float(rc.get("figure.dpi", matplotlib.rcParamsDefault["figure.dpi"]))


def _png_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return struct.unpack(">II", data[16:24])


class _TextRecorder:
    """Collects the texts matplotlib actually draws (visible, non-empty), while active."""

    def __init__(self):
        self.active: list | None = None
        self._original = None

    def install(self) -> None:
        from matplotlib.text import Text

        if self._original is not None:
            return
        original = Text.draw
        recorder = self

        def draw(text, renderer, *args, **kwargs):
            if recorder.active is not None and text.get_visible() and text.get_text().strip():
                recorder.active.append((float(text.get_fontsize()), text.get_text()))
            return original(text, renderer, *args, **kwargs)

        Text.draw = draw
        self._original = original


_RECORDER = _TextRecorder()


def _summary(texts: list, size: tuple[int, int], dpi: float, figure_width_in: float) -> FigureLegibility:
    if texts:
        pt, text = min(texts, key=lambda t: t[0])
    else:
        pt, text = float("inf"), ""
    return FigureLegibility(size[0], size[1], float(dpi), pt, text, len(texts), float(figure_width_in))


def measure(fig, dpi: float | None = None, *, bbox_inches: str | None = "tight") -> FigureLegibility:
    """Render ``fig`` as the inline backend does (``dpi``: :func:`inline_dpi`) and measure it."""
    dpi = inline_dpi() if dpi is None else dpi
    _RECORDER.install()
    buf = io.BytesIO()
    outer, _RECORDER.active = _RECORDER.active, []
    try:
        fig.canvas.print_figure(buf, format="png", dpi=dpi, bbox_inches=bbox_inches)
        texts = _RECORDER.active
    finally:
        _RECORDER.active = outer
    return _summary(texts, _png_size(buf.getvalue()), dpi, fig.get_figwidth())


def check_legible(fig, name: str = "figure", dpi: float | None = None, **kwargs) -> FigureLegibility:
    """:func:`measure`, raising :class:`IllegibleFigure` when the smallest text is too small."""
    m = measure(fig, dpi, **kwargs)
    if not m.legible:
        raise IllegibleFigure(f"{name}: {m.describe()}; needs a figure at most {MAX_WIDTH_IN:g} in wide "
                              f"and text >= {MIN_TEXT_PX:g} px at {OUTPUT_WIDTH_PX} px of output width")
    return m


def install_audit(target: str | None = None) -> bool:
    """Measure every figure this process renders to PNG from now on.

    ``target``: a file to append one JSON line per figure to (``{"width_px", "smallest_px",
    ...}``), or ``"warn"`` to warn about illegible figures only; default: ``$KVLAB_FIGURE_AUDIT``.
    Returns whether an audit was installed.
    """
    target = os.environ.get(AUDIT_ENV, "") if target is None else target
    if not target or target == "0":
        return False
    from matplotlib.backend_bases import FigureCanvasBase

    if getattr(FigureCanvasBase.print_figure, "_kvlab_audit", False):
        return True
    _RECORDER.install()
    original = FigureCanvasBase.print_figure

    def print_figure(canvas, filename, *args, **kwargs):
        if _RECORDER.active is not None:  # inside measure(): it records for itself
            return original(canvas, filename, *args, **kwargs)
        _RECORDER.active = []
        try:
            result = original(canvas, filename, *args, **kwargs)
            texts = _RECORDER.active
        finally:
            _RECORDER.active = None
        _report(canvas.figure, filename, args, kwargs, texts, target)
        return result

    print_figure._kvlab_audit = True
    FigureCanvasBase.print_figure = print_figure
    return True


def _report(fig, filename, args, kwargs, texts, target: str) -> None:
    import matplotlib

    data = filename.getvalue() if hasattr(filename, "getvalue") else None
    if data is None and isinstance(filename, (str, os.PathLike)) and os.path.exists(filename):
        with open(filename, "rb") as f:
            data = f.read(24)
    size = _png_size(data or b"")
    if size is None:  # not a PNG (svg, pdf): nothing a notebook shows
        return
    dpi = kwargs.get("dpi", args[0] if args else None) or matplotlib.rcParams["savefig.dpi"]
    dpi = fig.dpi if dpi == "figure" else float(dpi)
    m = _summary(texts, size, dpi, fig.get_figwidth())
    title = max(texts, key=lambda t: (t[0], len(t[1])))[1] if texts else ""  # the largest text
    if target == "warn":
        if not m.legible:
            warnings.warn(f"illegible figure: {m.describe()}", stacklevel=3)
        return
    record = dict(width_px=m.width_px, height_px=m.height_px, dpi=m.dpi, smallest_pt=m.smallest_pt,
                  smallest_px=round(m.smallest_px, 2), smallest_text=m.smallest_text[:60],
                  figure_width_in=round(m.figure_width_in, 2), too_wide=m.too_wide,
                  legible=m.legible, title=title[:60], n_texts=m.n_texts)
    with open(target, "a") as f:
        f.write(json.dumps(record) + "\n")
