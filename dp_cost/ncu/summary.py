"""The comparison of a directory of ncu reports: one row per config with ratios against
standard, text and Markdown tables, a stacked-bar plot, and the files write_ncu_summary writes
(ncu_summary.csv, ncu_summary.md, ncu_comparison.png)."""

from __future__ import annotations

import csv
import io
import os

from dp_cost.core.files import write_text
from dp_cost.core.fmt import cell, count, ratio, render_table
from dp_cost.core.schema import KERNEL_CATEGORIES
from dp_cost.ncu.export import GB, TOTALS, dram_bytes, load_reports
from dp_cost.report.figures import draw_each, pyplot, save_figure


def _step_time_ms(entry: dict) -> float | None:
    """Kernel time (sum of kernel durations) of a kernel replay, range time of a range replay."""
    key = "range_time_ms" if entry.get("replay") == "range" else "kernel_time_ms"
    return entry.get(key)


def summary_rows(entries: list[dict]) -> list[dict]:
    """One flat row per config (the ncu_summary.csv columns), with ratios against standard.

    A ratio needs the standard report at the same shape to use the same replay mode (else None):
    kernel replay sums every kernel's traffic from a flushed L2 and its kernel durations, range
    replay measures the real step with warm caches and its elapsed time, so their DRAM, L2 and
    time figures are not comparable.
    """
    base = {(e["batch"], e["seq"]): e for e in entries if e["trainer"] == "standard"}
    rows = []
    for e in entries:
        b = base.get((e["batch"], e["seq"]), {})
        if not (e.get("replay") and b.get("replay") == e.get("replay")):
            b = {}  # no standard report of the same replay mode at this shape: no ratios
        row = {k: e[k] for k in ("trainer", "batch", "seq", "report")}
        row["replay"] = e.get("replay")
        row["kernels"] = e.get("kernel_count")
        row["kernel_time_ms"] = e.get("kernel_time_ms")
        row["range_time_ms"] = e.get("range_time_ms")
        for key in TOTALS:
            row[key] = e.get(key)
        row["dram_bytes"] = dram_bytes(e)
        row["achieved_dram_gbps"] = e.get("achieved_dram_gbps")
        row["dram_vs_standard"] = ratio(row["dram_bytes"], dram_bytes(b) if b else None)
        row["l2_vs_standard"] = ratio(e.get("l2_bytes"), b.get("l2_bytes"))
        row["time_vs_standard"] = ratio(_step_time_ms(e), _step_time_ms(b) if b else None)
        for category in KERNEL_CATEGORIES:
            c = (e.get("categories") or {}).get(category, {})
            for key in ("dram_read_bytes", "dram_write_bytes", "l2_bytes", "time_ms", "count"):
                row[f"{category}_{key}"] = c.get(key)
        row["error"] = e.get("error")
        rows.append(row)
    return rows


MAIN_HEADER = [
    "trainer", "batch", "seq", "replay", "kernels", "kernel_ms", "range_ms", "dram_read_GB",
    "dram_write_GB", "l2_GB", "dram_GB/s", "dram_x", "l2_x", "time_x",
]  # fmt: skip
CATEGORIES_NEED_KERNEL_REPLAY = (
    "per-category numbers need per-kernel replay: ./run_profiling_ncu.sh --replay-mode kernel"
)


def format_main_table(rows: list[dict], markdown: bool = False) -> str:
    body = [
        [
            row["trainer"],
            str(row["batch"]),
            str(row["seq"]),
            cell(row["replay"]),
            cell(row["kernels"]),  # "-" for a range replay: no per-kernel results
            cell(row["kernel_time_ms"], digits=1),
            cell(row["range_time_ms"], digits=1),
            cell(row["dram_read_bytes"], GB, 3),
            cell(row["dram_write_bytes"], GB, 3),
            cell(row["l2_bytes"], GB, 3),
            cell(row["achieved_dram_gbps"], digits=0),
            cell(row["dram_vs_standard"]),
            cell(row["l2_vs_standard"]),
            cell(row["time_vs_standard"]),
        ]
        for row in rows
    ]
    return render_table(MAIN_HEADER, body, markdown)


def format_category_table(rows: list[dict], markdown: bool = False) -> str:
    """DRAM GB (read + write) per category and, in brackets, the extra GB over standard.

    Kernel replay rows only (and unmeasured ones, as "-"): a range replay has no per-kernel
    numbers. With range replays and no kernel replay, one line that says how to get them.
    """
    measured = {r["replay"] for r in rows}
    rows = [r for r in rows if r["replay"] != "range"]
    if "range" in measured and "kernel" not in measured:
        return CATEGORIES_NEED_KERNEL_REPLAY + "\n"
    base = {(r["batch"], r["seq"]): r for r in rows if r["trainer"] == "standard"}

    def gb(row, category):
        read, write = row[f"{category}_dram_read_bytes"], row[f"{category}_dram_write_bytes"]
        return None if read is None or write is None else read + write

    body = []
    for row in rows:
        b = base.get((row["batch"], row["seq"]))
        cells = [row["trainer"], str(row["batch"]), str(row["seq"])]
        for category in (*KERNEL_CATEGORIES, "total"):
            value = row["dram_bytes"] if category == "total" else gb(row, category)
            if value is None:
                cells.append("-")
                continue
            text = f"{value / GB:.3f}"
            if b is not None and b is not row:
                ref = b["dram_bytes"] if category == "total" else gb(b, category)
                text += f" ({(value - ref) / GB:+.3f})" if ref is not None else ""
            cells.append(text)
        body.append(cells)
    return render_table(["trainer", "batch", "seq", *KERNEL_CATEGORIES, "total"], body, markdown)


def _csv_text(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def plot_comparison(rows: list[dict], path: str) -> str | None:
    """Stacked DRAM GB per step, one bar per trainer, one panel per (batch, seq): stacked by
    kernel category when every bar is a kernel replay, else DRAM read and DRAM write stacked
    (whole-step totals of range replays; a mixed set names each bar's replay mode)."""
    shapes: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["dram_bytes"] is not None:
            shapes.setdefault((row["batch"], row["seq"]), []).append(row)
    if not shapes:
        return None
    plt = pyplot()
    plotted = [r for group in shapes.values() for r in group]
    modes = {r["replay"] for r in plotted}
    fig, axes = plt.subplots(
        1,
        len(shapes),
        figsize=(max(5.0, 0.6 + 3.4 * len(shapes)), 5.0),
        squeeze=False,
        constrained_layout=True,
    )
    segments, legend_title, title = traffic_segments(plotted, plt.get_cmap("tab10").colors)
    for ax, ((batch, seq), group) in zip(axes[0], sorted(shapes.items())):
        draw_traffic_bars(ax, group, segments, modes)
        ax.set_title(f"batch {batch}, seq {seq}", fontsize=10)
        if ax is axes[0][0]:
            ax.set_ylabel("DRAM read + write per step (GB = 10⁹ bytes)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = max(1, min(len(segments), 3 * len(shapes)))
    fig.legend(
        handles, labels, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False,
        title=legend_title, title_fontsize=8,
    )  # fmt: skip
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path, dpi=110, root=os.path.dirname(path))


def category_gb(row: dict, category: str) -> float:
    """GB read and written by a kernel category's kernels in the row's step."""
    read, write = row[f"{category}_dram_read_bytes"], row[f"{category}_dram_write_bytes"]
    return ((read or 0) + (write or 0)) / GB


def traffic_segments(plotted: list[dict], colors) -> tuple[list[tuple], str, str]:
    """(segments of each bar as (label, colour, GB of a row), legend title, figure title): by
    kernel category when every bar is a kernel replay, else DRAM read and write."""
    title = "DRAM traffic of one training step (Nsight Compute)"
    if all(r["replay"] == "kernel" for r in plotted):
        by_category = dict(zip(KERNEL_CATEGORIES, colors))
        shown = [c for c in KERNEL_CATEGORIES if any(category_gb(r, c) for r in plotted)]
        segments = [(c, by_category[c], lambda r, c=c: category_gb(r, c)) for c in shown]
        return segments, "kernel category", title
    read, write = colors[:2]
    segments = [
        ("DRAM read", read, lambda r: r["dram_read_bytes"] / GB),
        ("DRAM write", write, lambda r: r["dram_write_bytes"] / GB),
    ]
    modes = {r["replay"] for r in plotted}
    title += "\nwhole-step totals, " + (
        "range replay" if modes == {"range"} else "replay mode under each bar"
    )
    return segments, "whole step", title


def draw_traffic_bars(ax, group: list[dict], segments: list[tuple], modes: set) -> None:
    """One panel: a stacked bar per trainer, its total (and its ratio to standard's) above it,
    the replay mode under each name when the bars mix modes."""
    x = range(len(group))
    bottom = [0.0] * len(group)
    for label, color, height in segments:
        heights = [height(r) for r in group]
        ax.bar(x, heights, 0.65, bottom=bottom, color=color, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    top = max(bottom) or 1.0
    for i, r in enumerate(group):
        label = f"{bottom[i]:.2f}"
        if r["dram_vs_standard"] is not None and r["trainer"] != "standard":
            label += f"\n×{r['dram_vs_standard']:.2f}"
        ax.text(i, bottom[i] + 0.02 * top, label, ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.22)
    names = [r["trainer"] if len(modes) == 1 else f"{r['trainer']}\n{r['replay']}" for r in group]
    ax.set_xticks(list(x), names)
    ax.set_xlabel("trainer")
    ax.grid(axis="y", alpha=0.3)


NOTES = """
GB = 10^9 bytes. One training step per report (warm-up steps excluded). replay `kernel`
(`--replay-mode kernel`): every kernel replayed by ncu with its caches flushed first, so each
kernel's DRAM bytes are a cold-L2 figure, and kernel_ms is the sum of kernel durations
(serialised; not the step's wall time). replay `range` (`--replay-mode app-range` or `range`): one
result for the whole step with warm caches between kernels (re-reads that hit L2 are not DRAM
traffic; dirty lines written back during the step count as writes), and range_ms is the step's
elapsed GPU time, idle gaps included. Ratios (`_x`, time_x on kernel_ms or range_ms) are against
`standard` at the same batch and sequence length and the same replay mode only, since the two
modes count DRAM differently; `-` means not measured or not comparable.
"""


def write_ncu_summary(input_dir: str) -> str:
    """Write ncu_summary.csv, ncu_summary.md and ncu_comparison.png into input_dir from its
    report_*.ncu-rep / report_*.csv files; return the text tables.

    Raises ValueError (a usage problem: one line) when the directory is missing, holds no
    reports, or a report needs exporting and ncu is not installed.
    """
    entries = load_reports(input_dir)
    rows = summary_rows(entries)
    errors = "".join(f"- {r['report']}: {r['error']}\n" for r in rows if r["error"])
    text = format_main_table(rows)
    text += "\nDRAM GB per kernel category (extra over standard):\n"
    text += format_category_table(rows)
    markdown = "# Nsight Compute: memory traffic of one training step\n\n"
    markdown += format_main_table(rows, markdown=True)
    markdown += "\n## DRAM GB per kernel category (extra over standard)\n\n"
    markdown += format_category_table(rows, markdown=True) + NOTES
    if errors:
        failed = count(sum(1 for r in rows if r["error"]), "report")
        markdown += f"\nNot measured ({failed}):\n" + errors
        text += f"\nNot measured ({failed}):\n" + errors
    write_text(os.path.join(input_dir, "ncu_summary.csv"), _csv_text(rows))
    write_text(os.path.join(input_dir, "ncu_summary.md"), markdown)
    png = os.path.join(input_dir, "ncu_comparison.png")
    plot, failed_plot = draw_each([("ncu comparison", lambda: plot_comparison(rows, png))])
    text += f"\nWritten: {os.path.join(input_dir, 'ncu_summary.csv')}, ncu_summary.md"
    if failed_plot:
        return text + "\n" + failed_plot[0] + "\n"
    text += ", ncu_comparison.png\n" if plot else " (no DRAM data to plot)\n"
    return text
