"""Hugging Face sweeps (``--mode=hf_sweep``): the sweep's report.

Rendered from the result files alone (``write_sweep_files``, ``sweep_plots``): the older sweep files
in the run directory (JSON, CSV, and the plots of ``sweep_peak_plots`` and
``sweep_detail_plots``: overview, heatmap, timelines, module and operation views) and the
findings: which configs ran out of memory and how the peak grows with each swept parameter
(exponent of a log-log fit), per trainer. What the worker measures for a sweep
(``module_memory``, ``phase_costs``) is in ``measure/census.py``.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter

from dp_cost.core.files import write_json, write_text
from dp_cost.core.fmt import count
from dp_cost.report import sweep_detail_plots, sweep_peak_plots
from dp_cost.report.results import (
    SWEEP_FIELDS,
    SWEPT,
    config_label,
    ok_peak,
    series_key,
    sweep_order,
    swept_value,
)
from dp_cost.report.tables import csv_text


def is_sweep(results: list[dict]) -> bool:
    return any(r["config"].get("detailed_memory") for r in results)


def scaling_fits(results: list[dict]) -> dict:
    """Per trainer and swept parameter: exponent k of peak ~ value^k from ``numpy.polyfit`` on
    log-log among configs equal in everything else (the median over such series, and their
    range), or the reason there is no fit."""
    import numpy as np

    fits: dict[str, dict] = {}
    for trainer in sorted({r["config"]["trainer"] for r in results}):
        fits[trainer] = {}
        for param, _ in SWEPT:
            series: dict[tuple, dict] = {}
            for r in results:
                c, peak = r["config"], ok_peak(r)
                x = swept_value(c, param)
                if c["trainer"] != trainer or peak is None or not x or peak <= 0:
                    continue
                series.setdefault(series_key(c, param), {})[x] = peak
            slopes = [
                float(np.polyfit(np.log(list(pts)), np.log(list(pts.values())), 1)[0])
                for pts in series.values()
                if len(pts) >= 2
            ]
            if slopes:
                fits[trainer][param] = {
                    "exponent": statistics.median(slopes),
                    "min": min(slopes),
                    "max": max(slopes),
                    "series": len(slopes),
                    "reason": None,
                }
            else:
                values = {swept_value(r["config"], param) for r in results}
                if values == {None}:
                    reason = "no LoRA configs: full fine-tuning only"
                elif len(values) == 1:
                    reason = f"one value swept: {values.pop()}"
                else:
                    reason = "fewer than 2 values with an ok peak at equal other settings"
                fits[trainer][param] = {"exponent": None, "reason": reason}
    return fits


def findings_text(results: list[dict], fits: dict) -> str:
    """What the sweep shows, in words: status counts, OOMs, skips, growth per trainer."""
    counts = Counter(r["status"] for r in results)
    sources = {(r.get("env") or {}).get("memory_source") for r in results if r.get("env")}
    lines = [
        "## HF sweep findings",
        "",
        f"{count(len(results), 'config')}: "
        + ", ".join(f"{counts[s]} {s}" for s in ("ok", "oom", "skipped", "error"))
        + f". Peak = peak allocated memory of a step (source: {', '.join(sorted(sources)) or '-'})."
        "",
        "",
    ]
    for status, title in (("oom", "Out of memory"), ("skipped", "Skipped"), ("error", "Errors")):
        rows = sorted((r for r in results if r["status"] == status), key=sweep_order)
        if rows:
            lines.append(f"{title}:")
            lines += [f"- {config_label(r['config'])}: {r.get('error')}" for r in rows]
            lines.append("")
    if not counts["oom"]:
        lines += ["No config ran out of memory.", ""]
    lines.append("How the peak grows (peak ~ value^k, log-log fit at equal other settings):")
    for trainer, by_param in fits.items():
        lines.append(f"- {trainer}:")
        for param, label in SWEPT:
            fit = by_param[param]
            if fit["exponent"] is None:
                lines.append(f"  - {label}: not fitted ({fit['reason']})")
            else:
                low, high = round(fit["min"], 2) + 0.0, round(fit["max"], 2) + 0.0
                spread = f", range {low:.2f} to {high:.2f}" if fit["series"] > 1 else ""
                k = round(fit["exponent"], 2) + 0.0  # no "-0.00"
                lines.append(f"  - {label}: k = {k:.2f} (median of {fit['series']} series{spread})")
    return "\n".join(lines) + "\n"


CSV_COLUMNS = (
    "config_dir",
    *SWEEP_FIELDS,
    "status",
    "peak_memory_mb",
    "peak_reserved_mb",
    "median_time_ms",
    "avg_time_ms",
    "trainable_params",
    "frozen_params",
    "epsilon",
    "memory_source",
    "error",
)


def _csv_row(result: dict) -> dict:
    c, env = result["config"], result.get("env") or {}
    info = env.get("model_info") or {}
    return {
        "config_dir": result.get("config_dir"),
        "trainer": c["trainer"],
        "model": c["model"],
        "seq_len": c["seq_len"],
        "batch_size": c["batch_size"],
        "physical_batch_size": swept_value(c, "physical_batch_size"),
        "lora_rank": swept_value(c, "lora_rank") or "full",
        "status": result["status"],
        "peak_memory_mb": result.get("peak_memory_mb"),
        "peak_reserved_mb": result.get("peak_reserved_mb"),
        "median_time_ms": result.get("median_time_ms"),
        "avg_time_ms": result.get("avg_time_ms"),
        "trainable_params": info.get("trainable_params"),
        "frozen_params": info.get("frozen_params"),
        "epsilon": (result.get("privacy") or {}).get("epsilon"),
        "memory_source": env.get("memory_source"),
        "error": result.get("error"),
    }


def write_sweep_files(run_dir: str, results: list[dict]) -> str:
    """The sweep's data files in ``run_dir`` (JSON and CSV); returns the findings (Markdown)."""
    results = sorted(results, key=sweep_order)
    fits = scaling_fits(results)
    path = lambda name: os.path.join(run_dir, name)
    write_json(path("memory_profile_results.json"), {"scaling": fits, "configs": results})
    detailed_keys = ("status", "error", "module_memory", "phase_costs", "breakdown")
    write_json(
        path("detailed_memory_results.json"),
        [
            {"config_dir": r.get("config_dir"), "config": r["config"]}
            | {k: r.get(k) for k in detailed_keys}
            for r in results
        ],
    )
    rows = [_csv_row(r) for r in results]
    write_text(path("memory_profile_summary.csv"), csv_text(CSV_COLUMNS, rows))
    return findings_text(results, fits)


def sweep_plots(run_dir: str, results: list[dict]) -> list[tuple[str, object]]:
    """The sweep's plots, not drawn yet: (what, a function that draws it and returns its path),
    so the caller can report a plot that fails and go on with the next."""
    results = sorted(results, key=sweep_order)
    fits = scaling_fits(results)
    ok = [r for r in results if r["status"] == "ok"]
    jobs = [
        ("overview", lambda: sweep_peak_plots.plot_overview(run_dir, results, fits)),
        ("heatmap", lambda: sweep_peak_plots.plot_heatmap(run_dir, results)),
        ("peak comparison", lambda: sweep_peak_plots.plot_peak_comparison(run_dir, results)),
        ("usage timeline", lambda: sweep_detail_plots.plot_usage_timeline(run_dir, ok)),
    ]
    for result in ok:
        jobs.append(
            (
                f"timeline of {result.get('config_dir')}",
                lambda r=result: sweep_detail_plots.plot_config_timeline(run_dir, r),
            )
        )
    jobs.append(("module groups", lambda: sweep_detail_plots.plot_module_groups(run_dir, ok)))
    jobs.append(("operations", lambda: sweep_detail_plots.plot_operations(run_dir, ok)))
    return jobs
