"""A run's report from its result files alone: summary.csv, summary.md, summary.txt and the plots
(and, for a Hugging Face sweep, the sweep's own files). ``write_summary`` is the entry point."""

from __future__ import annotations

import os

from core.files import write_text
from report import plots, sweep
from report.results import load_results
from report.tables import (
    COLUMNS,
    csv_text,
    format_kernel_table,
    format_table,
    kernel_rows,
    summary_rows,
)
from report.text import summary_text

__all__ = ["load_results", "write_summary"]

NOTES = (
    "\nTimes are the median of the measured steps; memory in MB (2^20 bytes); ratios "
    "against `standard` at the same shape.\n"
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


def write_summary(run_dir: str, results: list[dict]) -> str:
    """Write summary.csv and summary.md into the run directory; return the text table."""
    rows = summary_rows(results)
    write_text(os.path.join(run_dir, "summary.csv"), csv_text(COLUMNS, rows))
    text = format_table(rows)
    markdown = format_table(rows, markdown=True)
    kernel_table = kernel_rows(results)
    if kernel_table:
        text += KERNEL_TITLE + format_kernel_table(kernel_table)
        markdown += KERNEL_TITLE + "\n" + format_kernel_table(kernel_table, markdown=True)
    findings = ""
    if sweep.is_sweep(results):  # the sweep's own files, and what it shows
        findings = "\n" + sweep.write_sweep_report(run_dir, results)
    notes = NOTES + _failures(results)
    write_text(os.path.join(run_dir, "summary.md"), markdown + notes + findings)
    write_text(os.path.join(run_dir, "summary.txt"), summary_text(results) + findings)
    # A large sweep has its own per-config timelines and module view: a bar or panel per config
    # here would be unreadable.
    crowded = bool(findings) and len(results) > 16
    made = [plots.plot_memory_curves(run_dir, results)]
    if not crowded:
        made += [
            plots.plot_breakdown(run_dir, results),
            plots.plot_timeline(run_dir, results),
            plots.plot_tradeoff(run_dir, results),
        ]
    made = [p for p in made if p]
    if made:
        text += "\nPlots: " + ", ".join(made) + "\n"
    if any(r.get("breakdown") for r in results):
        text += "\n" + summary_text(results)
    return text + findings
