"""Summary tables (stdout, summary.csv, summary.md) from result files alone."""

from __future__ import annotations

import contextlib
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
        config.get("lora_rank") if config.get("use_lora") else None,
        config.get("activation_checkpointing", False),
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
                "model": config["model"]
                + (f" r{config['lora_rank']}" if config.get("use_lora") else "")
                + (" ckpt" if config.get("activation_checkpointing") else ""),
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
    for result in _sorted(results):
        if not result.get("kernels"):
            continue
        config = result["config"]
        base = baselines.get(shape_key(config))
        out = {
            "trainer": config["trainer"],
            "batch": config["batch_size"],
            "seq": config["seq_len"],
        }
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
    import kernels

    plt = _pyplot()

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
        model, batch, seq, physical, dtype, attention = key[:6]
        ax.set_title(f"{model}  batch {batch}  seq {seq}  {dtype}  {attention}", fontsize=10)
        ax.set_xlabel("time in the traced step (ms)")
        ax.set_ylabel("allocated (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    return _save(fig, run_dir, "memory_curve.png")


BREAKDOWN_LABELS = {
    "model_parameters_mb": "Model Parameters",
    "optimizer_states_mb": "Optimizer States",
    "gradients_mb": "Gradients",
    "per_sample_gradients_mb": "Per-sample Gradients",
    "activation_hooks_mb": "Activation Hooks (DP-saved A, G)",
    "activations_mb": "Activations",
    "norm_samples_mb": "Norm Samples",
    "temp_matrices_mb": "Temp Matrices (ggT/aaT, Gram tiles)",
    "other_mb": "Other",
}
TRAINER_TITLES = {
    "standard": "Standard (no DP)",
    "dpsgd": "DP-SGD, per-sample grads (Opacus hooks)",
    "ghost": "Ghost Clipping (Opacus)",
    "flash": "Flash Clipping (ours)",
}


def _label(result: dict, shapes: int) -> str:
    c = result["config"]
    return c["trainer"] if shapes == 1 else f"{c['trainer']}\nbs{c['batch_size']} T{c['seq_len']}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, run_dir: str, name: str) -> str:
    out_dir = os.path.join(run_dir, "visualizations")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    _pyplot().close(fig)
    return path


def plot_breakdown(run_dir: str, results: list[dict]) -> str | None:
    """memory_breakdown_comparison.png: stacked components per config (left), and each DP
    trainer's extra memory over standard at the same shape by component (right)."""
    rows = [r for r in _sorted(results) if r["status"] == "ok" and r.get("breakdown")]
    if not rows:
        return None
    plt = _pyplot()
    shapes = len({shape_key(r["config"]) for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5), constrained_layout=True)
    colors = plt.get_cmap("tab10").colors
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for i, (key, label) in enumerate(BREAKDOWN_LABELS.items()):
        values = [r["breakdown"][key] / 1024 for r in rows]
        left.bar(x, values, bottom=bottom, color=colors[i % 10], label=label, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    for xi, r in zip(x, rows):
        left.text(xi, bottom[xi], f"{r['peak_memory_mb'] / 1024:.1f}", ha="center", va="bottom")
    left.set_xticks(list(x), [_label(r, shapes) for r in rows], fontsize=8)
    left.set_ylabel("memory at the peak (GiB)")
    left.set_title("Peak memory by component (number: measured peak)")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    baselines = {shape_key(r["config"]): r for r in rows if r["config"]["trainer"] == "standard"}
    dp_rows = [
        r
        for r in rows
        if r["config"]["trainer"] != "standard" and shape_key(r["config"]) in baselines
    ]
    width = 0.8 / max(1, len(dp_rows))
    for j, r in enumerate(dp_rows):
        base = baselines[shape_key(r["config"])]["breakdown"]
        extra = [(r["breakdown"][k] - base[k]) / 1024 for k in BREAKDOWN_LABELS]
        positions = [i + (j - (len(dp_rows) - 1) / 2) * width for i in range(len(extra))]
        right.bar(positions, extra, width=width, label=_label(r, shapes).replace("\n", " "))
    right.axhline(0, color="black", lw=0.8)
    right.set_xticks(
        range(len(BREAKDOWN_LABELS)),
        [v.split(" (")[0] for v in BREAKDOWN_LABELS.values()],
        rotation=30,
        ha="right",
        fontsize=8,
    )
    right.set_ylabel("extra over standard at the peak (GiB)")
    right.set_title("What each DP trainer adds, by component")
    if dp_rows:
        right.legend(fontsize=8)
    return _save(fig, run_dir, "memory_breakdown_comparison.png")


def plot_timeline(run_dir: str, results: list[dict]) -> str | None:
    """memory_timeline.png: allocated memory at each phase point of every step, one panel per
    config, with forward / backward / optimizer step shaded and each phase's peak drawn."""
    rows = [
        r
        for r in _sorted(results)
        if r["status"] == "ok" and any(s.get("allocated_mb") is not None for s in r["snapshots"])
    ]
    if not rows:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(rows), 1, figsize=(11, 2.6 * len(rows)), squeeze=False, constrained_layout=True
    )
    shading = {
        "forward_done": ("#cfe8ff", "forward"),
        "backward_done": ("#ffe0c2", "backward"),
        "step_done": ("#d8f5d0", "optimizer step"),
    }
    for ax, r in zip(axes[:, 0], rows):
        snaps = [s for s in r["snapshots"] if s.get("allocated_mb") is not None]
        t = [s["timestamp"] for s in snaps]
        ax.plot(t, [s["allocated_mb"] / 1024 for s in snaps], "k.-", lw=1, label="allocated")
        for prev, snap in zip(snaps, snaps[1:]):
            if snap["name"] in shading:
                color, _ = shading[snap["name"]]
                ax.axvspan(prev["timestamp"], snap["timestamp"], color=color, lw=0)
                ax.hlines(
                    snap["phase_peak_mb"] / 1024,
                    prev["timestamp"],
                    snap["timestamp"],
                    colors="tab:red",
                    lw=1.5,
                )
        c = r["config"]
        ax.set_title(
            f"{TRAINER_TITLES.get(c['trainer'], c['trainer'])} — bs{c['batch_size']} "
            f"T{c['seq_len']} {c['dtype']} {c['attention']}",
            fontsize=9,
        )
        ax.set_ylabel("GiB")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since the worker started (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c, _ in shading.values()]
    handles += [plt.Line2D([], [], color="tab:red"), plt.Line2D([], [], color="k", marker=".")]
    labels = [n for _, n in shading.values()] + ["peak inside the phase", "allocated at phase end"]
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=5)
    return _save(fig, run_dir, "memory_timeline.png")


def plot_tradeoff(run_dir: str, results: list[dict]) -> str | None:
    """performance_tradeoff.png: peak memory against step time, one point per config."""
    rows = [r for r in _sorted(results) if r["status"] == "ok" and r.get("median_time_ms")]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5), constrained_layout=True)
    markers = "osD^v<>"
    shapes = list(dict.fromkeys(shape_key(r["config"]) for r in rows))
    colors = dict(zip(TRAINER_ORDER, plt.get_cmap("tab10").colors))
    for r in rows:
        c = r["config"]
        ax.scatter(
            r["median_time_ms"],
            r["peak_memory_mb"] / 1024,
            s=60,
            color=colors.get(c["trainer"], "gray"),
            marker=markers[shapes.index(shape_key(c)) % len(markers)],
        )
    for trainer, color in colors.items():
        ax.scatter([], [], color=color, label=trainer)
    for i, key in enumerate(shapes):
        ax.scatter(
            [],
            [],
            color="gray",
            marker=markers[i % len(markers)],
            label=f"bs{key[1]} T{key[2]} {key[4]}",
        )
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("peak allocated memory (GiB)")
    ax.set_title("Memory vs time per trainer (lower left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, run_dir, "performance_tradeoff.png")


def _fixed(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def summary_text(results: list[dict]) -> str:
    """summary.txt: the seed's layout — trainer, peak, average time, memory/time — plus the
    component table of every config with a breakdown."""
    rule = "=" * 100
    lines = [
        rule,
        "SUMMARY",
        rule,
        "",
        f"{'Method':<48}{'Peak Memory (MB)':>18}{'Avg Time (ms)':>16}{'Memory/Time':>14}",
        "-" * 100,
    ]
    for r in _sorted(results):
        c = r["config"]
        name = (
            f"{TRAINER_TITLES.get(c['trainer'], c['trainer'])} bs{c['batch_size']} T{c['seq_len']}"
        )
        if r["status"] != "ok":
            lines.append(f"{name:<48}{r['status'] + ': ' + str(r.get('error'))[:50]:>48}")
            continue
        peak, avg = r["peak_memory_mb"], r["avg_time_ms"]
        ratio = peak / avg if peak is not None and avg else None
        # null under --ncu (a replayed step is no measurement): shown as n/a, never as 0
        lines.append(f"{name:<48}{_fixed(peak):>18}{_fixed(avg):>16}{_fixed(ratio):>14}")
    lines += [
        rule,
        "",
        "COMPONENT-LEVEL BREAKDOWN (at the measured peak of one recorded step):",
        "",
    ]
    any_breakdown = False
    for r in _sorted(results):
        if not r.get("breakdown"):
            continue
        any_breakdown = True
        c = r["config"]
        lines.append(
            f"{TRAINER_TITLES.get(c['trainer'], c['trainer'])} bs{c['batch_size']} "
            f"T{c['seq_len']} {c['dtype']} {c['attention']}:"
        )
        lines.append("-" * 80)
        for key, value in sorted(r["breakdown"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {BREAKDOWN_LABELS.get(key, key):<50}{value:>14.2f} MB")
        check = r.get("breakdown_check") or {}
        if check:
            lines.append(
                f"  {'(sum; torch max_memory_allocated of that step)':<50}"
                f"{sum(r['breakdown'].values()):>14.2f} MB; {check['torch_peak_mb']:.2f} MB"
                f", peak after {check.get('peak_after_phase')}"
            )
        lines.append("")
    if not any_breakdown:
        lines.append("  (no breakdown: it needs --mode=memory on a CUDA device)")
    return "\n".join(lines) + "\n"


def _config_dir_of(result: dict) -> str:
    return result.get("config_dir") or ""


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", opener=open):
    """Open a temporary name beside ``path``; rename it to ``path`` once written, so a reader
    (or an interrupted run) never sees a half-written file. ``opener``: e.g. ``gzip.open``."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with opener(tmp, mode) as f:
            yield f
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def _write_atomic(path: str, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


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
    import hf_sweep  # its plots import torch: only where a summary is written, not for ncu_report

    findings = ""
    if hf_sweep.is_sweep(results):  # the sweep's own files, and what it shows
        findings = "\n" + hf_sweep.write_sweep_report(run_dir, results)
    _write_atomic(os.path.join(run_dir, "summary.md"), markdown + notes + findings)
    _write_atomic(os.path.join(run_dir, "summary.txt"), summary_text(results) + findings)
    # A large sweep has its own per-config timelines and module view: a bar or panel per config
    # here would be unreadable.
    crowded = bool(findings) and len(results) > 16
    plots = [
        plot_memory_curves(run_dir, results),
        None if crowded else plot_breakdown(run_dir, results),
        None if crowded else plot_timeline(run_dir, results),
        None if crowded else plot_tradeoff(run_dir, results),
    ]
    made = [p for p in plots if p]
    if made:
        text += "\nPlots: " + ", ".join(made) + "\n"
    if any(r.get("breakdown") for r in results):
        text += "\n" + summary_text(results)
    return text + findings
