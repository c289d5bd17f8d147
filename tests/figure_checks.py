"""What every figure of a report must hold, read from the figure after it is drawn: each text
inside the figure (a title wider than its panel is cut at the figure's edge in the PNG), and
integer ticks on a batch axis (a batch of 1.5 samples does not exist). A test takes the figures
a report saves with the ``kept_figures`` fixture (conftest.py offers it to every test) and hands
them to ``check_figures``."""

import math
import re

import pytest

from dp_cost.ncu import summary as ncu_summary
from dp_cost.report import figures


def texts_outside(fig) -> list[str]:
    """Each visible, non-empty text whose drawn extent leaves the figure (1 px of slack)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)  # a saved figure is closed: drawn again on a canvas of its own
    canvas.draw()  # as savefig draws it: the legends' places are computed as it draws
    renderer = canvas.get_renderer()
    box = fig.bbox
    undrawn = {id(label) for label in _labels_of_undrawn_ticks(fig)}
    outside = []
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or id(text) in undrawn:
            continue
        extent = text.get_window_extent(renderer)
        if (
            extent.x0 < box.x0 - 1
            or extent.y0 < box.y0 - 1
            or extent.x1 > box.x1 + 1
            or extent.y1 > box.y1 + 1
        ):
            words = text.get_text().replace("\n", " ")
            outside.append(f"{words[:60]!r} drawn at {extent.bounds}, the figure {box.bounds}")
    return outside


def _labels_of_undrawn_ticks(fig):
    """The labels of ticks outside their axis's view: matplotlib keeps them, but draws none."""
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                if (
                    not low - 1e-9 * abs(high - low)
                    <= tick.get_loc()
                    <= high + 1e-9 * abs(high - low)
                ):
                    yield from (tick.label1, tick.label2)


def fractional_batch_ticks(fig) -> list[str]:
    """Ticks of an axis labelled a batch (in the axis's view) that are not whole numbers (read
    after ``texts_outside`` has drawn the figure)."""
    found = []
    for ax in fig.axes:
        for axis, label, limits in (
            (ax.xaxis, ax.get_xlabel(), ax.get_xlim()),
            (ax.yaxis, ax.get_ylabel(), ax.get_ylim()),
        ):
            if "batch" not in label.lower():
                continue
            low, high = sorted(limits)
            ticks = [t for t in axis.get_ticklocs() if low - 1e-9 <= t <= high + 1e-9]
            found += [f"{label}: {t:g}" for t in ticks if not math.isclose(t, round(t))]
    return found


def check_figures(figs: dict) -> None:
    """Every kept figure: its texts inside it, its batch axes ticked at whole numbers. Figures
    of one kind (a sweep's per-config timelines, ``<kind>_config_<config>.png``) are checked
    once: drawing each again costs a fraction of a second."""
    assert figs
    kinds = {re.sub(r"_config_.*", "", name): name for name in sorted(figs, reverse=True)}
    figs = {name: figs[name] for name in kinds.values()}
    problems = [f"{name}: {p}" for name, fig in figs.items() for p in texts_outside(fig)]
    problems += [f"{name}: {p}" for name, fig in figs.items() for p in fractional_batch_ticks(fig)]
    assert problems == [], "\n".join(problems)


@pytest.fixture
def kept_figures(monkeypatch):
    """Every figure the report saves (and still saves, closed), by file name, for the checks."""
    figs = {}
    save = figures.save_figure

    def keep(fig, path, dpi=110, root=None):
        figs[path.rsplit("/", 1)[-1]] = fig
        return save(fig, path, dpi=dpi, root=root)

    monkeypatch.setattr(figures, "save_figure", keep)
    monkeypatch.setattr(ncu_summary, "save_figure", keep)
    return figs
