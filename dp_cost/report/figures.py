"""matplotlib, set up once for files (no display), the one way a figure is saved, and the
pieces the figures share (trainer colours, phase shades, the unit, axes, markers)."""

from __future__ import annotations

import os
import sys
import textwrap

from dp_cost.core.files import UnsafePath, atomic_write


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported here: matplotlib is heavy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 110, root: str | None = None) -> str:
    """Write ``fig`` as a PNG at ``path`` (atomically) and close it. Its folder is created and
    entered from ``root`` without following a link: by default from the folder above it (a
    run's visualizations/ from the run directory)."""
    if root is None:
        root = os.path.dirname(os.path.dirname(path))
    try:
        with atomic_write(path, "wb", root=root) as f:
            fig.savefig(f, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    return path


def save_visualization(fig, run_dir: str, name: str, dpi: int = 110) -> str:
    """Save ``fig`` as ``<run_dir>/visualizations/<name>``: every plot of a run lives there."""
    return save_figure(fig, os.path.join(run_dir, "visualizations", name), dpi=dpi)


def draw_each(jobs, warn=None) -> tuple[list[str], list[str]]:
    """Run each (what, draw) job: the paths drawn, and one line per plot that failed (also
    printed on ``warn``, default stderr) -- a plot never takes the tables or the others with it.
    A link planted where a plot goes stops the report (UnsafePath): the tables are written."""
    made, failed = [], []
    for what, job in jobs:
        try:
            path = job()
        except UnsafePath:
            raise
        except Exception as error:  # any failure of one plot (disk, matplotlib, odd data)
            line = f"plot {what} not written: {type(error).__name__}: {error}"
            failed.append(line)
            print(f"warning: {line}", file=warn or sys.stderr)
        else:
            if path:
                made.append(path)
    return made, failed


# ---------------------------------------------------------------- what the figures share
SWEEP_DPI = 100  # a sweep's plots (a run's: save_figure's default)
TRAINER_COLORS = {
    "standard": "tab:blue",
    "dpsgd": "tab:orange",
    "ghost": "tab:green",
    "flash": "tab:red",
}
# The phase a snapshot ends: its shade, and its name in a legend.
PHASE_SHADES = {
    "forward_done": ("#cfe8ff", "forward"),
    "backward_done": ("#ffe0c2", "backward"),
    "step_done": ("#d8f5d0", "optimizer step"),
}


def shade_phases(ax, snapshots: list[dict]) -> None:
    """Shade forward, backward and optimizer step: each from the snapshot before its end."""
    for previous, snap in zip(snapshots, snapshots[1:]):
        if snap["name"] in PHASE_SHADES:
            color, _ = PHASE_SHADES[snap["name"]]
            ax.axvspan(previous["timestamp"], snap["timestamp"], color=color, lw=0)


def phase_legend(plt) -> tuple[list, list[str]]:
    """Legend handles and labels of the phase shades."""
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color, _ in PHASE_SHADES.values()]
    return handles, [name for _, name in PHASE_SHADES.values()]


MB = "MB"  # every plot's memory unit, as in the tables: 2^20 bytes


# Shapes drawn by marker: as many distinct ones as matplotlib offers, so none repeats.
MARKERS = "osD^v<>pPhH*Xd8"


def marker(i: int) -> str:
    """The i-th distinct marker; past the list, repeats are told apart by the label alone."""
    return MARKERS[i % len(MARKERS)]


def say(ax, text: str) -> None:
    """A panel that holds a sentence instead of a plot."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def log2_axis(ax, values) -> None:
    """Swept values doubling: a log2 axis ticked at exactly the values swept."""
    if len(values) >= 2:
        ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()


def wrapped(text: str, width: int = 32) -> str:
    """A long label in lines of at most ``width`` characters (tick labels, legends, titles)."""
    return "\n".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False))


def whole_number_ticks(axis) -> None:
    """An axis of counts (a batch, in samples) ticked at whole numbers only: no batch of 1.5."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def memory_axis_from_zero(ax) -> None:
    """A memory axis starts at 0, with headroom above the largest value so that no marker or
    bar sits cut in half on the frame."""
    top = ax.dataLim.y1
    ax.set_ylim(0, top * 1.08 if top > 0 else 1.0)
