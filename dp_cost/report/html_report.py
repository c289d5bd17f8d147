"""report.html: a run's offline view in one self-contained file. No request leaves the page (no
script, stylesheet or font from elsewhere; every plot embedded as a data: URI), so it opens on a
cluster without internet, where TensorBoard's profiler plugin cannot load its chart library.

What it shows: a header (command line, date, device and versions: ``run_info``), the summary
table with the spread of the steps (for --mode=capacity, its table of predictions instead), the
kernel table, the trace analysis (Holistic Trace Analysis: ``trace_analysis``), every plot, and
per config its status or error, breakdown at the peak, flash routes, kernel categories and
relative links to its trace and memory-snapshot timeline.
"""

from __future__ import annotations

import base64
import os
from html import escape

from dp_cost.core.files import open_file, write_text
from dp_cost.core.fmt import count
from dp_cost.core.reading import is_file_at
from dp_cost.core.schema import BREAKDOWN_LABELS, trainer_title
from dp_cost.report import capacity
from dp_cost.report.results import ordered, privacy_notes, shape_label
from dp_cost.report.run_info import run_busy_note, run_info
from dp_cost.report.tables import kernel_cells, kernel_rows, summary_cells, summary_rows

# Nothing runs off the page: long notes wrap, a table wider than the page scrolls in its own box.
STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; }
div.wide { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
th { background: #f0f0f0; }
td.noisy, p.busy { background: #fff0c0; }
.error { color: #b00000; white-space: pre-wrap; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
section.config { border-top: 2px solid #ddd; margin-top: 1em; }
table.run th { text-align: right; }
table.run code { white-space: pre-wrap; word-break: break-all; }
"""
SNAPSHOT_HTML = "memory_timeline.html"  # the CUDA memory snapshot's timeline (--mode=memory)


def table_html(header: list[str], body: list[list[str]]) -> str:
    """An HTML table of already formatted cells, in a box that scrolls when it is wider than the
    page; a cell flagged NOISY is highlighted."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    lines = [f'<div class="wide"><table><tr>{head}</tr>']
    for cells in body:
        tds = "".join(
            f'<td class="noisy">{escape(c)}</td>' if "NOISY" in c else f"<td>{escape(c)}</td>"
            for c in cells
        )
        lines.append(f"<tr>{tds}</tr>")
    return "\n".join(lines) + "</table></div>"


def image_html(path: str, root: str | None = None) -> str:
    """A PNG embedded as a data: URI, under its file name; read as it was written (no link
    followed below ``root``), so a link planted there cannot pull another file into the page."""
    with os.fdopen(open_file(path, os.O_RDONLY, root=root), "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    name = escape(os.path.basename(path))
    return f'<h3>{name}</h3>\n<img alt="{name}" src="data:image/png;base64,{data}">'


def _link(run_dir: str, config_dir: str, name: str | None, what: str) -> str | None:
    """A relative link to a file of the config's directory, when the file is there."""
    if not name or not is_file_at(os.path.join(run_dir, config_dir, name), run_dir):
        return None
    href = escape(f"{config_dir}/{name}", quote=True)
    return f'<li>{escape(what)}: <a href="{href}">{escape(name)}</a></li>'


def _mapping_table(mapping: dict, value_header: str) -> str:
    body = [[str(k), f"{v:.2f}" if isinstance(v, float) else str(v)] for k, v in mapping.items()]
    return table_html(["", value_header], body)


def config_html(run_dir: str, result: dict) -> str:
    """One config: status, error, breakdown, flash routes, kernel categories, links."""
    c = result["config"]
    config_dir = result.get("config_dir") or ""
    title = f"{trainer_title(c['trainer'])}: {shape_label(c)}"
    parts = [
        f'<section class="config"><h3>{escape(title)} ({escape(config_dir)})</h3>',
        f"<p>status: <b>{escape(result['status'])}</b></p>",
    ]
    if result.get("error"):
        parts.append(f'<p class="error">{escape(str(result["error"]))}</p>')
    if result.get("breakdown"):
        labelled = {BREAKDOWN_LABELS.get(k, k): v for k, v in result["breakdown"].items()}
        parts += ["<h4>Breakdown at the peak (MB)</h4>", _mapping_table(labelled, "MB")]
    if result.get("flash_routes"):
        routes = result["flash_routes"]
        header = list(dict.fromkeys(k for route in routes for k in route))
        body = [[str(route.get(k, "")) for k in header] for route in routes]
        parts += ["<h4>Flash routes</h4>", table_html(header, body)]
    if result.get("kernels"):
        body = [
            [category, f"{v.get('time_ms') or 0.0:.3f}", str(v.get("count", ""))]
            for category, v in result["kernels"].items()
        ]
        parts += ["<h4>Kernel time per category</h4>", table_html(["", "ms", "kernels"], body)]
    trace = result.get("trace_file")
    links = [
        _link(
            run_dir,
            config_dir,
            trace,
            "profiler trace (TensorBoard, ui.perfetto.dev, chrome://tracing)",
        ),
        _link(run_dir, config_dir, SNAPSHOT_HTML, "memory snapshot timeline"),
    ]
    links = [link for link in links if link]
    if links:
        parts.append("<ul>" + "".join(links) + "</ul>")
    return "\n".join(parts) + "</section>"


def header_html(run_dir: str, results: list[dict]) -> str:
    """The run's command line, date, device and versions, one row each."""
    rows = []
    for label, value in run_info(run_dir, results):
        cell = f"<code>{escape(value)}</code>" if label == "command line" else escape(value)
        rows.append(f"<tr><th>{escape(label)}</th><td>{cell}</td></tr>")
    return '<table class="run">' + "\n".join(rows) + "</table>"


TRACE_HEADER = [
    "config",
    "rank",
    "GPU span (ms)",
    "idle",
    "compute",
    "non-compute",
    "communication",
    "comm. overlapped by compute",
    "note",
]


def _percent(row: dict, key: str) -> str:
    return "" if row.get(key) in (None, "") else f"{row[key]:.1f}%"


def trace_analysis_html(rows: list[dict], note: str | None) -> str:
    """The trace analysis section: one row per config and rank, or the line saying why not."""
    parts = ["<h2>Trace analysis (Holistic Trace Analysis)</h2>"]
    if note:
        return "\n".join(parts + [f"<p>{escape(note)}</p>"])
    parts.append(
        "<p>From each traced step's GPU kernels (trace_analysis.csv): the GPU span runs from the "
        "first kernel's start to the last one's end; idle: no kernel running; compute: a "
        "computation kernel running; non-compute: only communication or memory kernels; "
        "communication: an NCCL kernel running; overlap: the share of the communication time "
        "with a computation kernel running too. DP kernel categories: the kernel table.</p>"
    )
    body = [
        [
            str(row["config_dir"]),
            str(row["rank"]),
            "" if row.get("gpu_span_us") is None else f"{row['gpu_span_us'] / 1000:.3f}",
            _percent(row, "idle_pct"),
            _percent(row, "compute_pct"),
            _percent(row, "non_compute_pct"),
            _percent(row, "communication_pct"),
            _percent(row, "comm_comp_overlap_pct"),
            str(row.get("note") or ""),
        ]
        for row in rows
    ]
    return "\n".join(parts + [table_html(TRACE_HEADER, body)])


def report_html(
    run_dir: str,
    results: list[dict],
    plots: list[str],
    findings: str = "",
    traces: tuple[list[dict], str | None] = ([], None),
) -> str:
    """The page's text (see the module docstring); ``traces``: ``trace_analysis.trace_rows``."""
    name = os.path.basename(os.path.abspath(run_dir))
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{escape(name)}: report</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(name)}</h1>",
        header_html(run_dir, results),
    ]
    predicted = capacity.is_capacity(results)  # predictions: the capacity table, no step timed
    if predicted:
        parts.append(f"<p>{count(len(results), 'config')}, predicted without a step.</p>")
    else:
        parts.append(
            f"<p>{count(len(results), 'config')}. Times: median of the measured steps; "
            "steps_ms: their range; spread: (max - min) / median, NOISY over 10%. Memory in MB "
            "(2^20 bytes); ratios against standard at the same shape.</p>"
        )
    skipped = getattr(results, "skipped", [])
    if skipped:
        items = "".join(f"<li>{escape(path)}: {escape(why)}</li>" for path, why in skipped)
        parts.append(f"<p>{count(len(skipped), 'result file')} skipped:</p><ul>{items}</ul>")
    if predicted:
        parts += ["<h2>Will it fit? Predicted peak memory</h2>"]
        parts += [table_html(*capacity.table_cells(capacity.entries_of(results)))]
        parts += [f"<p>{escape(capacity.NOTES.strip())}</p>"]
    else:
        parts += ["<h2>Summary</h2>", table_html(*summary_cells(summary_rows(results)))]
        if notes := privacy_notes(results).strip():
            parts += [f"<pre>{escape(notes)}</pre>"]
        if busy := run_busy_note(run_dir):
            parts += [f'<p class="busy">{escape(busy)}</p>']
    kernels = kernel_rows(results)
    if kernels:
        parts += ["<h2>GPU kernel time per category, ms (extra over standard)</h2>"]
        parts.append(table_html(*kernel_cells(kernels)))
    if traces[0] or traces[1]:
        parts.append(trace_analysis_html(*traces))
    if findings:
        parts += ["<h2>Sweep findings</h2>", f"<pre>{escape(findings.strip())}</pre>"]
    if plots:
        parts.append("<h2>Plots</h2>")
        parts += [image_html(path, root=run_dir) for path in plots]
    parts.append("<h2>Configs</h2>")
    parts += [config_html(run_dir, r) for r in ordered(results)]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html_report(
    run_dir: str, results: list[dict], plots: list[str], findings="", traces=([], None)
) -> str:
    """Write ``<run_dir>/report.html``; return its path."""
    path = os.path.join(run_dir, "report.html")
    write_text(path, report_html(run_dir, results, plots, findings, traces))
    return path
