"""Hugging Face sweeps (``--mode=hf_sweep``): the sweep's report.

Rendered from the result files alone (``write_sweep_report``): the seeds' files in the run
directory (JSON, CSV, and the plots of ``hf_sweep_plots``: overview, heatmap, timelines, module
and operation views) and the findings: which configs ran out of memory and how the peak grows
with each swept parameter (exponent of a log-log fit), per trainer. What the worker measures for
a sweep (``module_memory``, ``phase_costs``) is in ``module_memory``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
from collections import Counter

SWEPT = (
    ("seq_len", "sequence length (tokens)"),
    ("batch_size", "logical batch (samples)"),
    ("physical_batch_size", "physical batch (samples)"),
    ("lora_rank", "LoRA rank"),
)
# The fields that name a config in the CSV, in its column order.
_CONFIG_FIELDS = ("trainer", "model", "seq_len", "batch_size", "physical_batch_size", "lora_rank")
# Fields that identify a config apart from the swept one: fits compare configs equal in these.
_IDENTITY = (*_CONFIG_FIELDS, "dtype", "attention", "optimizer")


def is_sweep(results: list[dict]) -> bool:
    return any(r["config"].get("detailed_memory") for r in results)


def swept_value(config: dict, param: str):
    """A config's value of a swept parameter; the LoRA rank is None for full fine-tuning."""
    if param == "lora_rank":
        return config.get("lora_rank") if config.get("use_lora") else None
    if param == "physical_batch_size":
        return config.get("physical_batch_size") or config["batch_size"]
    return config.get(param)


def config_label(config: dict) -> str:
    rank = swept_value(config, "lora_rank")
    return (
        f"{config['trainer']} T{config['seq_len']} bs{config['batch_size']} "
        f"pb{swept_value(config, 'physical_batch_size')} " + (f"r{rank}" if rank else "full")
    )


def _order(result: dict) -> tuple:
    c = result["config"]
    return (
        c["trainer"],
        c["model"],
        *(swept_value(c, p) or 0 for p, _ in SWEPT),
        c.get("dtype", ""),
    )


def _peak(result: dict) -> float | None:
    return result.get("peak_memory_mb") if result["status"] == "ok" else None


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
                c, peak = r["config"], _peak(r)
                x = swept_value(c, param)
                if c["trainer"] != trainer or peak is None or not x or peak <= 0:
                    continue
                key = tuple(swept_value(c, f) for f in _IDENTITY if f != param)
                series.setdefault(key, {})[x] = peak
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
        f"{len(results)} configs: "
        + ", ".join(f"{counts[s]} {s}" for s in ("ok", "oom", "skipped", "error"))
        + f". Peak = peak allocated memory of a step (source: {', '.join(sorted(sources)) or '-'})."
        "",
        "",
    ]
    for status, title in (("oom", "Out of memory"), ("skipped", "Skipped"), ("error", "Errors")):
        rows = sorted((r for r in results if r["status"] == status), key=_order)
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
    *_CONFIG_FIELDS,
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


def write_sweep_report(run_dir: str, results: list[dict]) -> str:
    """Every file of the sweep view in ``run_dir``; returns the findings (Markdown)."""
    import hf_sweep_plots as plots  # here, not at the top: the plots use this module's helpers
    from report import atomic_write

    results = sorted(results, key=_order)
    fits = scaling_fits(results)
    findings = findings_text(results, fits)

    def write_json(name, data):
        with atomic_write(os.path.join(run_dir, name)) as f:
            json.dump(data, f, indent=2)

    write_json("memory_profile_results.json", {"scaling": fits, "configs": results})
    detailed_keys = ("status", "error", "module_memory", "phase_costs", "breakdown")
    write_json(
        "detailed_memory_results.json",
        [
            {"config_dir": r.get("config_dir"), "config": r["config"]}
            | {k: r.get(k) for k in detailed_keys}
            for r in results
        ],
    )
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows(_csv_row(r) for r in results)
    with atomic_write(os.path.join(run_dir, "memory_profile_summary.csv")) as f:
        f.write(buffer.getvalue())
    ok = [r for r in results if r["status"] == "ok"]
    plots.plot_overview(run_dir, results, fits)
    plots.plot_heatmap(run_dir, results)
    plots.plot_peak_comparison(run_dir, results)
    plots.plot_usage_timeline(run_dir, ok)
    for result in ok:
        plots.plot_config_timeline(run_dir, result)
    plots.plot_module_groups(run_dir, ok)
    plots.plot_operations(run_dir, ok)
    return findings
