"""A run's report from its result files alone: summary.csv, summary.md, summary.txt, the plots,
trace_analysis.csv (when the run has traces and Holistic Trace Analysis is installed),
report.html (and, for a Hugging Face sweep, the sweep's own files). ``write_summary`` is the
entry point."""

from __future__ import annotations

import os
import sys

from dp_cost.core.files import UnsafePath, write_text
from dp_cost.core.fmt import count
from dp_cost.report import capacity, html_report, plots, run_info, sweep, trace_analysis
from dp_cost.report.figures import draw_each
from dp_cost.report.results import load_results, privacy_notes
from dp_cost.report.tables import (
    COLUMNS,
    csv_text,
    format_kernel_table,
    format_table,
    kernel_rows,
    summary_rows,
)
from dp_cost.report.text import summary_text

is_capacity = capacity.is_capacity
__all__ = ["is_capacity", "load_results", "write_summary"]

NOTES = (
    "\nTimes are the median of the measured steps; steps_ms is their range and spread "
    "(max - min) / median, NOISY over 10%; memory in MB (2^20 bytes); ratios against "
    "`standard` at the same shape.\n"
)
KERNEL_TITLE = "\nGPU kernel time per category, ms (extra over standard):\n"


def _failures(results: list[dict]) -> str:
    """One line per config that did not finish ok, for summary.md."""
    failed = [r for r in results if r["status"] in ("error", "oom", "skipped")]
    if not failed:
        return ""
    return "\n" + "".join(
        f"- {r['config']['trainer']} bs{r['config']['batch_size']} "
        f"seq{r['config']['seq_len']}: {r['status']}: {r.get('error')}\n"
        for r in failed
    )


def _skipped(results) -> str:
    """The result files load_results could not use, counted, one line each."""
    skipped = getattr(results, "skipped", [])
    if not skipped:
        return ""
    lines = "".join(f"- {path}: {why}\n" for path, why in skipped)
    return f"\n{count(len(skipped), 'result file')} skipped (not usable):\n{lines}"


def _run_plot_jobs(run_dir: str, results: list[dict], crowded: bool) -> list:
    jobs = [("memory curve", lambda: plots.plot_memory_curves(run_dir, results))]
    if not crowded:
        jobs += [
            ("breakdown", lambda: plots.plot_breakdown(run_dir, results)),
            ("timeline", lambda: plots.plot_timeline(run_dir, results)),
            ("tradeoff", lambda: plots.plot_tradeoff(run_dir, results)),
        ]
    return jobs


# Up to this many plots are named one by one; more (a sweep's two dozen) are counted by folder.
PLOTS_NAMED = 4


def plots_line(made: list[str]) -> str:
    """The plots written: their paths when few, else each folder with its count."""
    if not made:
        return ""
    if len(made) <= PLOTS_NAMED:
        return "\nPlots: " + ", ".join(made) + "\n"
    folders: dict[str, int] = {}
    for path in made:
        folders[os.path.dirname(path)] = folders.get(os.path.dirname(path), 0) + 1
    counted = ", ".join(f"{n} in {folder}{os.sep}" for folder, n in folders.items())
    return f"\nPlots: {counted} (report.html shows every one)\n"


def write_summary(run_dir: str, results: list[dict]) -> str:
    """Write the tables (summary.csv, .md, .txt) first, then the plots and report.html; return
    the text of the tables, the plots written and any that failed. A --mode=capacity run's
    report is its own (report.capacity)."""
    if capacity.is_capacity(results):
        text = capacity.write_capacity_files(run_dir, results)
        made, failed = draw_each([("capacity", lambda: capacity.plot_capacity(run_dir, results))])
        page = lambda: html_report.write_html_report(run_dir, results, made)  # noqa: E731
        html, html_failed = draw_each([("report.html", page)])
        text += "".join(f"Plot: {path}\n" for path in made)
        text += "".join(f"{line}\n" for line in failed + html_failed)
        text += "".join(f"Offline report: {path}\n" for path in html)
        return text + f"Capacity: {os.path.join(run_dir, capacity.CAPACITY_JSON)}\n"
    rows = summary_rows(results)
    write_text(os.path.join(run_dir, "summary.csv"), csv_text(COLUMNS, rows))
    # under the table: what its epsilons cover, and whether the machine was busy (run.json)
    busy = run_info.run_busy_note(run_dir)
    notes_below = privacy_notes(results) + (f"\n{busy}\n" if busy else "")
    text = format_table(rows) + notes_below
    markdown = format_table(rows, markdown=True) + notes_below
    kernels = kernel_rows(results)
    if kernels:
        text += KERNEL_TITLE + format_kernel_table(kernels)
        markdown += KERNEL_TITLE + "\n" + format_kernel_table(kernels, markdown=True)
    findings = ""
    if sweep.is_sweep(results):  # the sweep's own files, and what it shows
        findings = "\n" + sweep.write_sweep_files(run_dir, results)
    skipped = _skipped(results)
    notes = NOTES + _failures(results) + skipped
    write_text(os.path.join(run_dir, "summary.md"), markdown + notes + findings)
    write_text(os.path.join(run_dir, "summary.txt"), summary_text(results) + findings)
    text += skipped
    # A large sweep has its own per-config timelines and module view: a bar or panel per config
    # in a run's plots would be unreadable.
    crowded = bool(findings) and len(results) > 16
    jobs = _run_plot_jobs(run_dir, results, crowded)
    if findings:
        jobs += sweep.sweep_plots(run_dir, results)
    made, failed = draw_each(jobs)
    traces = [], None
    try:
        traces = trace_analysis.write_trace_analysis(run_dir, results)
    except UnsafePath:  # a planted link stops the report, as for a plot
        raise
    except Exception as error:  # a disk error writing the CSV: the page and the rest still come
        line = f"{trace_analysis.TRACE_CSV} not written: {type(error).__name__}: {error}"
        failed.append(line)
        print(f"warning: {line}", file=sys.stderr)
    page = lambda: html_report.write_html_report(run_dir, results, made, findings, traces)
    html, html_failed = draw_each([("report.html", page)])
    text += plots_line(made)
    text += "".join(f"{line}\n" for line in failed + html_failed)
    if traces[0]:
        text += f"Trace analysis: {os.path.join(run_dir, trace_analysis.TRACE_CSV)}\n"
    if traces[1]:
        text += traces[1] + "\n"
    text += "".join(f"Offline report: {path}\n" for path in html)
    if any(r.get("breakdown") for r in results):
        text += "\n" + summary_text(results)
    return text + findings
