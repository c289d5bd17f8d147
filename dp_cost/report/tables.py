"""A run's tables: one row per config (time, peak memory, ratios against ``standard`` at the same
shape) and GPU kernel time per category, as text, Markdown and CSV."""

from __future__ import annotations

import csv
import io

from dp_cost.core.fmt import cell, ratio, render_table
from dp_cost.core.schema import KERNEL_CATEGORIES
from dp_cost.report.results import baselines, ordered, privacy_summary, shape_key

COLUMNS = (
    "trainer",
    "batch",
    "seq",
    "physical",
    "dtype",
    "attention",
    "model",
    "median_ms",
    "min_ms",
    "max_ms",
    "spread_pct",
    "noisy",
    "peak_alloc_mb",
    "peak_reserved_mb",
    "time_vs_standard",
    "time_ratio_noisy",
    "mem_vs_standard",
    "epsilon",
    "delta_total",
    "dp_steps",
    "status",
)
# The text and Markdown tables: the steps' range in one cell, the spread and its flag in another;
# a time ratio of a noisy config (or of a noisy baseline) carries the flag in its own cell.
_AFTER_MEDIAN = COLUMNS.index("median_ms") + 1
SHOWN = tuple(
    c
    for c in (*COLUMNS[:_AFTER_MEDIAN], "steps_ms", "spread", *COLUMNS[_AFTER_MEDIAN + 4 :])
    if c != "time_ratio_noisy"
)
NOISY_SPREAD = 0.10  # (max - min) / median of the measured steps above this: a noisy config


def step_spread(result: dict) -> dict:
    """min_ms, max_ms, spread_pct ((max - min) / median, in %) of the measured steps, and noisy
    (spread over NOISY_SPREAD); None where there are no step times."""
    steps = result.get("step_times_ms") or []
    median = result.get("median_time_ms")
    if not steps or not median:
        return {"min_ms": None, "max_ms": None, "spread_pct": None, "noisy": None}
    spread = (max(steps) - min(steps)) / median
    return {
        "min_ms": float(min(steps)),
        "max_ms": float(max(steps)),
        "spread_pct": 100.0 * spread,
        "noisy": spread > NOISY_SPREAD,
    }


def summary_rows(results: list[dict]) -> list[dict]:
    """One row per result, with time and peak-memory ratios against standard at the same shape."""
    standard = baselines(r for r in results if r["status"] == "ok")
    rows = []
    for result in ordered(results):
        config = result["config"]
        base = standard.get(shape_key(config), {})
        spread = step_spread(result)
        privacy = privacy_summary(result)
        rows.append(
            {
                "trainer": config["trainer"],
                "batch": config["batch_size"],
                "seq": config["seq_len"],
                "physical": config.get("physical_batch_size"),
                "dtype": config["dtype"],
                "attention": config["attention"],
                "model": config["model"]
                + (f" r{config['lora_rank']}" if config.get("use_lora") else "")
                + (" ckpt" if config.get("activation_checkpointing") else "")
                + (" graph" if config.get("cuda_graph") else "")
                + (" per-layer" if config.get("clipping") == "per_layer" else ""),
                "median_ms": result.get("median_time_ms"),
                **spread,
                "peak_alloc_mb": result.get("peak_memory_mb"),
                "peak_reserved_mb": result.get("peak_reserved_mb"),
                "time_vs_standard": ratio(result.get("median_time_ms"), base.get("median_time_ms")),
                # a ratio of two timings is as noisy as the noisier of them (the baseline's own
                # ratio is 1 by definition)
                "time_ratio_noisy": bool(base)
                and base is not result
                and bool(spread["noisy"] or step_spread(base)["noisy"]),
                "mem_vs_standard": ratio(result.get("peak_memory_mb"), base.get("peak_memory_mb")),
                "epsilon": privacy["epsilon"],
                "delta_total": privacy["delta_total"],
                "dp_steps": privacy["dp_steps"],
                "status": result["status"],
            }
        )
    return rows


def _summary_cell(row: dict, col: str) -> str:
    if col == "delta_total" and row[col] is not None:
        return f"{row[col]:.4e}"  # 1.0004e-05: delta, and the tails' term in its digits
    if col == "steps_ms":
        return "-" if row["min_ms"] is None else f"{row['min_ms']:.2f}-{row['max_ms']:.2f}"
    if col == "spread":
        if row["spread_pct"] is None:
            return "-"
        return f"{row['spread_pct']:.1f}%" + (" NOISY" if row["noisy"] else "")
    if (
        col == "time_vs_standard"
        and row["time_vs_standard"] is not None
        and row["time_ratio_noisy"]
    ):
        return f"~{cell(row[col])} NOISY"  # not a plain number: one of its timings is noisy
    return cell(row[col])


def summary_cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells of the summary table (text, Markdown and report.html)."""
    header = list(SHOWN)
    return header, [[_summary_cell(row, c) for c in header] for row in rows]


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """The summary table: median step time, the range of the measured steps and their spread
    (flagged NOISY over 10%), peaks, and ratios against standard."""
    return render_table(*summary_cells(rows), markdown)


def kernel_rows(results: list[dict]) -> list[dict]:
    """Per config with a kernel summary: ms per category and the extra ms against standard."""
    standard = baselines(r for r in results if r.get("kernels"))
    rows = []
    for result in ordered(results):
        if not result.get("kernels"):
            continue
        config = result["config"]
        base = standard.get(shape_key(config), {}).get("kernels")
        out = {
            "trainer": config["trainer"],
            "batch": config["batch_size"],
            "seq": config["seq_len"],
        }
        for cat in KERNEL_CATEGORIES:
            ms = result["kernels"].get(cat, {}).get("time_ms", 0.0)
            out[cat] = ms
            out[f"+{cat}"] = ms - base[cat]["time_ms"] if base else None
        rows.append(out)
    return rows


def _kernel_cell(row: dict, col: str) -> str:
    if col in KERNEL_CATEGORIES:
        extra = row[f"+{col}"]
        return f"{row[col]:.1f}" + (f" ({extra:+.1f})" if extra is not None else "")
    return str(row[col])


def kernel_cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells of the kernel table."""
    header = ["trainer", "batch", "seq", *KERNEL_CATEGORIES]
    return header, [[_kernel_cell(row, c) for c in header] for row in rows]


def format_kernel_table(rows: list[dict], markdown: bool = False) -> str:
    """Kernel time per category (ms) and, in brackets, the extra ms over standard."""
    return render_table(*kernel_cells(rows), markdown)


def csv_text(columns, rows) -> str:
    """``rows`` (dicts) as CSV under a header of ``columns``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
