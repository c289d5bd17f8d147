"""Summary tables (stdout, summary.csv, summary.md) from result files alone."""

from __future__ import annotations

import csv
import glob
import io
import json
import os

TRAINER_ORDER = ("standard", "dpsgd", "ghost", "flash")
COLUMNS = (
    "trainer",
    "batch",
    "seq",
    "physical",
    "dtype",
    "attention",
    "model",
    "median_ms",
    "peak_alloc_mb",
    "peak_reserved_mb",
    "time_vs_standard",
    "mem_vs_standard",
    "status",
)


def load_results(run_dir: str) -> list[dict]:
    """Every ``<config_dir>/result.json`` under a run directory (unreadable files skipped)."""
    results = []
    for path in sorted(glob.glob(os.path.join(run_dir, "*", "result.json"))):
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, json.JSONDecodeError):
            continue
    return results


def shape_key(config: dict) -> tuple:
    """Everything but the trainer: configs with the same key are compared with each other."""
    return (
        config["model"],
        config["batch_size"],
        config["seq_len"],
        config.get("physical_batch_size"),
        config["dtype"],
        config["attention"],
        config.get("optimizer"),
    )


def _ratio(value, baseline):
    if value is None or not baseline:
        return None
    return value / baseline


def _sorted(results: list[dict]) -> list[dict]:
    def order(r):
        c = r["config"]
        rank = TRAINER_ORDER.index(c["trainer"]) if c["trainer"] in TRAINER_ORDER else 99
        return (c["model"], c["batch_size"], c["seq_len"], str(shape_key(c)), rank)

    return sorted(results, key=order)


def summary_rows(results: list[dict]) -> list[dict]:
    """One row per result, with time and peak-memory ratios against standard at the same shape."""
    baselines = {
        shape_key(r["config"]): r
        for r in results
        if r["config"]["trainer"] == "standard" and r["status"] == "ok"
    }

    rows = []
    for result in _sorted(results):
        config = result["config"]
        base = baselines.get(shape_key(config), {})
        rows.append(
            {
                "trainer": config["trainer"],
                "batch": config["batch_size"],
                "seq": config["seq_len"],
                "physical": config.get("physical_batch_size"),
                "dtype": config["dtype"],
                "attention": config["attention"],
                "model": config["model"],
                "median_ms": result.get("median_time_ms"),
                "peak_alloc_mb": result.get("peak_memory_mb"),
                "peak_reserved_mb": result.get("peak_reserved_mb"),
                "time_vs_standard": _ratio(
                    result.get("median_time_ms"), base.get("median_time_ms")
                ),
                "mem_vs_standard": _ratio(result.get("peak_memory_mb"), base.get("peak_memory_mb")),
                "status": result["status"],
            }
        )
    return rows


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_table(rows: list[dict], markdown: bool = False) -> str:
    header = list(COLUMNS)
    body = [[_cell(row[c]) for c in header] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines) + "\n"
    widths = [max(len(h), *(len(cells[i]) for cells in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in body]
    return "\n".join(lines) + "\n"


CATEGORIES = ("gemm", "attention", "elementwise", "reduction", "norm_clip", "optimizer", "other")


def kernel_rows(results: list[dict]) -> list[dict]:
    """Per config with a kernel summary: ms per category and the extra ms against standard."""
    baselines = {
        shape_key(r["config"]): r["kernels"]
        for r in results
        if r["config"]["trainer"] == "standard" and r.get("kernels")
    }
    rows = []
    for row, result in zip(summary_rows(results), _sorted(results), strict=True):
        if not result.get("kernels"):
            continue
        base = baselines.get(shape_key(result["config"]))
        out = {k: row[k] for k in ("trainer", "batch", "seq")}
        for cat in CATEGORIES:
            ms = result["kernels"].get(cat, {}).get("time_ms", 0.0)
            out[cat] = ms
            out[f"+{cat}"] = ms - base[cat]["time_ms"] if base else None
        rows.append(out)
    return rows


def format_kernel_table(rows: list[dict], markdown: bool = False) -> str:
    """Kernel time per category (ms) and, in brackets, the extra ms over standard."""
    header = ["trainer", "batch", "seq", *CATEGORIES]

    def cell(row, col):
        if col in CATEGORIES:
            extra = row[f"+{col}"]
            return f"{row[col]:.1f}" + (f" ({extra:+.1f})" if extra is not None else "")
        return str(row[col])

    body = [[cell(row, c) for c in header] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body]) + "\n"
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines) + "\n"


def plot_memory_curves(run_dir: str, results: list[dict]) -> str | None:
    """visualizations/memory_curve.png: allocated memory over the traced step, one panel per
    shape, one line per trainer, read from each config's trace file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import kernels

    curves: dict[tuple, list] = {}
    for result in _sorted(results):
        trace = result.get("trace_file")
        path = os.path.join(run_dir, _config_dir_of(result), trace) if trace else None
        if not path or not os.path.exists(path):
            continue
        curve = kernels.memory_curve_from_trace(path)
        if curve:
            curves.setdefault(shape_key(result["config"]), []).append((result, curve))
    if not curves:
        return None
    fig, axes = plt.subplots(
        len(curves), 1, figsize=(10, 3.2 * len(curves)), squeeze=False, constrained_layout=True
    )
    for ax, (key, lines) in zip(axes[:, 0], curves.items()):
        for result, curve in lines:
            t, mb = zip(*curve)
            ax.plot(t, [m / 1024 for m in mb], label=result["config"]["trainer"], lw=1.2)
        model, batch, seq, physical, dtype, attention, _ = key
        ax.set_title(f"{model}  batch {batch}  seq {seq}  {dtype}  {attention}", fontsize=10)
        ax.set_xlabel("time in the traced step (ms)")
        ax.set_ylabel("allocated (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    out_dir = os.path.join(run_dir, "visualizations")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "memory_curve.png")
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
    return path


def _config_dir_of(result: dict) -> str:
    return result.get("config_dir") or ""


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_summary(run_dir: str, results: list[dict]) -> str:
    """Write summary.csv and summary.md into the run directory; return the text table."""
    rows = summary_rows(results)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    _write_atomic(os.path.join(run_dir, "summary.csv"), buffer.getvalue())
    notes = (
        "\nTimes are the median of the measured steps; memory in MB (2^20 bytes); ratios "
        "against `standard` at the same shape.\n"
    )
    errors = [r for r in results if r["status"] in ("error", "oom", "skipped")]
    if errors:
        notes += "\n" + "".join(
            f"- {r['config']['trainer']} bs{r['config']['batch_size']} "
            f"seq{r['config']['seq_len']}: {r['status']}: {r.get('error')}\n"
            for r in errors
        )
    text = format_table(rows)
    markdown = format_table(rows, markdown=True)
    kernel_table = kernel_rows(results)
    if kernel_table:
        text += "\nGPU kernel time per category, ms (extra over standard):\n"
        text += format_kernel_table(kernel_table)
        markdown += "\nGPU kernel time per category, ms (extra over standard):\n\n"
        markdown += format_kernel_table(kernel_table, markdown=True)
    _write_atomic(os.path.join(run_dir, "summary.md"), markdown + notes)
    curve = plot_memory_curves(run_dir, results)
    if curve:
        text += f"\nMemory curve: {curve}\n"
    return text
