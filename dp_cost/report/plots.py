"""A run's plots, one PNG each in ``<run_dir>/visualizations``: memory over the traced step,
the breakdown at the peak, memory per phase over time, and memory against time."""

from __future__ import annotations

import os
import sys

from dp_cost.core.kernel_names import memory_curve_from_trace
from dp_cost.core.reading import UnreadableFile, is_file_at
from dp_cost.core.schema import BREAKDOWN_LABELS, trainer_title
from dp_cost.report.figures import (
    MB,
    PHASE_SHADES,
    TRAINER_COLORS,
    marker,
    memory_axis_from_zero,
    phase_legend,
    pyplot,
    save_visualization,
    shade_phases,
    wrapped,
)
from dp_cost.report.results import (
    BASELINE,
    allocated_snapshots,
    baselines,
    ordered,
    shape_key,
    shape_label,
    shape_labels,
    trainers_in,
)

# On CPU the curve is the trace's allocations summed from 0 at the traced step's start, while the
# table's peak adds the bytes live then (parameters, optimizer state): the legend says so.
CPU_CURVE_NOTE = "CPU: curve from 0 at the step's start;\nthe table's peak adds what was live then"


def _labels(rows: list[dict], sep: str = "\n") -> tuple[str, list[str]]:
    """What the rows' configs share (for the title), and each row's trainer with the settings
    that tell its shape from the others (tick labels: wrapped under the trainer)."""
    common, differ = shape_labels([r["config"] for r in rows])
    labels = [
        r["config"]["trainer"] + (sep + (wrapped(d) if sep == "\n" else d) if d else "")
        for r, d in zip(rows, differ)
    ]
    return common, labels


def _curve(run_dir: str, result: dict) -> list:
    """The memory curve of a config's trace; [] without one, or (one warning line) when the
    trace file is unreadable."""
    trace = result.get("trace_file")
    path = os.path.join(run_dir, result.get("config_dir") or "", trace) if trace else None
    if not path or not is_file_at(path, run_dir):
        return []
    try:
        return memory_curve_from_trace(path, root=run_dir)
    except UnreadableFile as error:
        print(f"warning: skipped trace {path}: {error}", file=sys.stderr)
        return []


def _curve_label(result: dict, curve: list) -> tuple[str, bool]:
    """The trainer, and on CPU where the curve's maximum is not the table's peak, both numbers;
    whether it differs."""
    trainer, peak = result["config"]["trainer"], result.get("peak_memory_mb")
    top = max(mb for _, mb in curve)
    cpu = (result.get("env") or {}).get("memory_source") == "cpu-profiler"
    if cpu and peak is not None and abs(peak - top) > 0.01 * max(peak, 1e-9):
        return f"{trainer} (curve max {top:.1f}, peak {peak:.1f} MB)", True
    return trainer, False


def plot_memory_curves(run_dir: str, results: list[dict]) -> str | None:
    """visualizations/memory_curve.png: allocated memory over the traced step, one panel per
    shape, one line per trainer, read from each config's trace file."""
    curves: dict[tuple, list] = {}
    for result in ordered(results):
        curve = _curve(run_dir, result)
        if curve:
            curves.setdefault(shape_key(result["config"]), []).append((result, curve))
    if not curves:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(
        len(curves), 1, figsize=(10, 3.2 * len(curves)), squeeze=False, constrained_layout=True
    )
    for ax, lines in zip(axes[:, 0], curves.values()):
        offsets = False
        for result, curve in lines:
            t, mb = zip(*curve)
            trainer = result["config"]["trainer"]
            label, differs = _curve_label(result, curve)
            offsets |= differs
            ax.plot(t, mb, label=label, lw=1.2, color=TRAINER_COLORS.get(trainer))
        # wrapped: a panel's width is the figure's less the legend beside it
        ax.set_title(wrapped(shape_label(lines[0][0]["config"]), 72), fontsize=10)
        ax.set_xlabel("time in the traced step (ms)")
        ax.set_ylabel(f"allocated ({MB})")
        memory_axis_from_zero(ax)
        ax.grid(alpha=0.3)
        ax.legend(
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=8,
            title=CPU_CURVE_NOTE if offsets else None,
            title_fontsize=7,
        )
    return save_visualization(fig, run_dir, "memory_curve.png")


def plot_breakdown(run_dir: str, results: list[dict]) -> str | None:
    """memory_breakdown_comparison.png: stacked components per config (left), and each DP
    trainer's extra memory over standard at the same shape by component (right)."""
    rows = [r for r in ordered(results) if r["status"] == "ok" and r.get("breakdown")]
    if not rows:
        return None
    plt = pyplot()
    common, labels = _labels(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5), constrained_layout=True)
    if common:
        fig.suptitle(wrapped(f"Every config: {common}", 160), fontsize=10)
    colors = plt.get_cmap("tab10").colors
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for i, (key, label) in enumerate(BREAKDOWN_LABELS.items()):
        values = [r["breakdown"][key] for r in rows]
        left.bar(x, values, bottom=bottom, color=colors[i % 10], label=label, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    for xi, r in zip(x, rows):
        left.text(xi, bottom[xi], f"{r['peak_memory_mb']:.1f}", ha="center", va="bottom")
    left.set_xticks(list(x), labels, fontsize=8)
    left.set_ylabel(f"memory at the peak ({MB})")
    left.set_title("Peak memory by component (number: measured peak)")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    standard = baselines(rows)
    dp_rows = [
        r for r in rows if r["config"]["trainer"] != BASELINE and shape_key(r["config"]) in standard
    ]
    width = 0.8 / max(1, len(dp_rows))
    names = _labels(rows, sep=": ")[1]
    for j, r in enumerate(dp_rows):
        label = names[rows.index(r)]
        base = standard[shape_key(r["config"])]["breakdown"]
        extra = [r["breakdown"][k] - base[k] for k in BREAKDOWN_LABELS]
        positions = [i + (j - (len(dp_rows) - 1) / 2) * width for i in range(len(extra))]
        right.bar(positions, extra, width=width, label=label)
    right.axhline(0, color="black", lw=0.8)
    right.set_xticks(
        range(len(BREAKDOWN_LABELS)),
        [v.split(" (")[0] for v in BREAKDOWN_LABELS.values()],
        rotation=30,
        ha="right",
        fontsize=8,
    )
    right.set_ylabel(f"extra over standard at the peak ({MB})")
    right.set_title("What each DP trainer adds, by component")
    if dp_rows:
        right.legend(fontsize=8)
    return save_visualization(fig, run_dir, "memory_breakdown_comparison.png")


def plot_timeline(run_dir: str, results: list[dict]) -> str | None:
    """memory_timeline.png: allocated memory at each phase point of every step, one panel per
    config, with forward / backward / optimizer step shaded and each phase's peak drawn."""
    rows = [r for r in ordered(results) if r["status"] == "ok" and allocated_snapshots(r)]
    if not rows:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(
        len(rows), 1, figsize=(11, 2.6 * len(rows)), squeeze=False, constrained_layout=True
    )
    for ax, r in zip(axes[:, 0], rows):
        snaps = allocated_snapshots(r)
        t = [s["timestamp"] for s in snaps]
        ax.plot(t, [s["allocated_mb"] for s in snaps], "k.-", lw=1, label="allocated")
        shade_phases(ax, snaps)
        for prev, snap in zip(snaps, snaps[1:]):
            if snap["name"] in PHASE_SHADES:
                peak = snap["phase_peak_mb"]
                ax.hlines(peak, prev["timestamp"], snap["timestamp"], colors="tab:red", lw=1.5)
        c = r["config"]
        ax.set_title(f"{trainer_title(c['trainer'])} — {shape_label(c)}", fontsize=9)
        ax.set_ylabel(MB)
        memory_axis_from_zero(ax)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since the worker started (s)")
    handles, labels = phase_legend(plt)
    handles += [plt.Line2D([], [], color="tab:red"), plt.Line2D([], [], color="k", marker=".")]
    labels += ["peak inside the phase", "allocated at phase end"]
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=5)
    return save_visualization(fig, run_dir, "memory_timeline.png")


def plot_tradeoff(run_dir: str, results: list[dict]) -> str | None:
    """performance_tradeoff.png: peak memory against step time, one point per config."""
    rows = [r for r in ordered(results) if r["status"] == "ok" and r.get("median_time_ms")]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5), constrained_layout=True)
    shapes: dict[tuple, dict] = {}  # shape_key -> the first config of that shape
    for r in rows:
        shapes.setdefault(shape_key(r["config"]), r["config"])
    keys = list(shapes)
    for r in rows:
        c = r["config"]
        ax.scatter(
            r["median_time_ms"],
            r["peak_memory_mb"],
            s=60,
            color=TRAINER_COLORS.get(c["trainer"], "gray"),
            marker=marker(keys.index(shape_key(c))),
        )
    for trainer in trainers_in(rows):  # only the trainers that ran
        ax.scatter([], [], color=TRAINER_COLORS.get(trainer, "gray"), label=trainer)
    common, differ = shape_labels(list(shapes.values()))
    for i, label in enumerate(differ if len(shapes) > 1 else []):
        ax.scatter([], [], color="gray", marker=marker(i), label=wrapped(label, 44))
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel(f"peak allocated memory ({MB})")
    memory_axis_from_zero(ax)
    title = "Memory vs time per trainer (lower left is better)"
    ax.set_title(title + (f"\n{wrapped(common, 80)}" if common else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))  # beside, never on a point
    return save_visualization(fig, run_dir, "performance_tradeoff.png")
