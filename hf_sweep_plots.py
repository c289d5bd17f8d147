"""The plots of a Hugging Face sweep's report (matplotlib, Agg): one PNG each in the run
directory, drawn from the result files alone by ``hf_sweep.write_sweep_report``."""

from __future__ import annotations

import os

from hf_sweep import _IDENTITY, SWEPT, _peak, config_label, swept_value
from module_memory import GROUPS, OPERATIONS

TRAINER_COLORS = {"standard": "tab:blue", "dpsgd": "tab:orange", "ghost": "tab:green"}
TRAINER_COLORS["flash"] = "tab:red"
KIND_COLORS = {
    "frozen parameters": "#c7c7c7",
    "trainable parameters": "#1f77b4",
    "gradients": "#2ca02c",
    "optimizer states": "#9467bd",
    "per-sample state": "#d62728",
    "activations (saved for backward)": "#ff7f0e",
}
SHADES = {"forward_done": "#cfe8ff", "backward_done": "#ffe0c2", "step_done": "#d8f5d0"}
SETUP_PHASES = {
    "0_model_loaded": "model loaded",
    "dataset_prepared": "dataset prepared",
    "optimizer_created": "optimizer created",
    "privacy_wrapped": "privacy wrapped",
}
NOT_ON_CPU = "not measured on CPU\n(no caching allocator there; memory_source cpu-profiler)"


def _pyplot():
    from report import _pyplot

    return _pyplot()


def _save(fig, run_dir: str, name: str) -> str:
    from report import atomic_write

    path = os.path.join(run_dir, name)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    _pyplot().close(fig)
    return path


def _scale(values_mb) -> tuple[float, str]:
    """Divisor and unit for a set of MB values: GiB from 1 GiB up, else MB (2^20 bytes)."""
    values = [v for v in values_mb if v is not None]
    return (1024.0, "GiB") if values and max(values) >= 1024 else (1.0, "MB")


def _say(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _trainers(results) -> list[str]:
    from report import TRAINER_ORDER

    names = {r["config"]["trainer"] for r in results}
    return [t for t in TRAINER_ORDER if t in names] + sorted(names - set(TRAINER_ORDER))


def _longest_series(results: list[dict], param: str) -> list[dict]:
    """The ok configs of the longest series along ``param`` with every other setting equal."""
    series: dict[tuple, dict] = {}
    for r in results:
        x = swept_value(r["config"], param)
        if r["status"] == "ok" and x:
            key = tuple(swept_value(r["config"], f) for f in _IDENTITY if f != param)
            series.setdefault(key, {})[x] = r
    if not series:
        return []
    ordered = sorted(series, key=lambda k: [(v is None, v) for v in k])  # None: full FT
    key = max(ordered, key=lambda k: len(series[k]))  # ties: the first in that order
    return [series[key][x] for x in sorted(series[key])]


def _log2_axis(ax, values) -> None:
    """Swept values doubling: a log2 axis ticked at exactly the values swept."""
    if len(values) >= 2:
        ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()


def plot_overview(run_dir: str, results: list[dict], fits: dict) -> str:
    """memory_analysis_overview.png: peak against each swept parameter, one panel each."""
    plt = _pyplot()
    from matplotlib.transforms import blended_transform_factory

    div, unit = _scale(_peak(r) for r in results)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), constrained_layout=True)
    for ax, (param, label) in zip(axes.flat, SWEPT):
        values = sorted({v for r in results if (v := swept_value(r["config"], param))})
        if not values:
            _say(ax, f"No {label} swept (full fine-tuning only)")
            ax.set_title(f"Peak vs {label}")
            continue
        top = blended_transform_factory(ax.transData, ax.transAxes)
        for trainer in _trainers(results):
            color = TRAINER_COLORS.get(trainer, "gray")
            mine = [r for r in results if r["config"]["trainer"] == trainer]
            points = [(swept_value(r["config"], param), _peak(r)) for r in mine if _peak(r)]
            points = [(x, p / div) for x, p in points if x]
            line = _longest_series(mine, param) if len(values) > 1 else []
            if points:
                ax.scatter(*zip(*points), s=16, color=color, alpha=0.35 if line else 1.0)
            if points and not line:
                ax.scatter([], [], color=color, s=16, label=trainer)
            fit = fits.get(trainer, {}).get(param, {})
            exponent = f" (k = {fit['exponent']:.2f})" if fit.get("exponent") is not None else ""
            if line:
                xs = [swept_value(r["config"], param) for r in line]
                ys = [_peak(r) / div for r in line]
                ax.plot(xs, ys, "-o", color=color, lw=2, label=f"{trainer}{exponent}")
            ooms = [swept_value(r["config"], param) for r in mine if r["status"] == "oom"]
            if ooms:
                ax.scatter(ooms, [0.96] * len(ooms), transform=top, marker="x", color=color, s=60)
        ax.scatter([], [], color="gray", alpha=0.35, s=16, label="every ok config")
        if any(r["status"] == "oom" for r in results):
            ax.scatter([], [], marker="x", color="gray", s=60, label="out of memory (top edge)")
        _log2_axis(ax, values)
        ax.set_xlabel(label)
        ax.set_ylabel(f"peak allocated memory ({unit})")
        how = "line: longest series at equal other settings" if len(values) > 1 else "one value"
        ax.set_title(f"Peak vs {label} ({how})", fontsize=10)
        ax.margins(y=0.12)  # room at the top edge for the out-of-memory marks
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("HF sweep: peak memory against each swept parameter (k: exponent of the fit)")
    return _save(fig, run_dir, "memory_analysis_overview.png")


def plot_heatmap(run_dir: str, results: list[dict]) -> str:
    """memory_heatmap.png: peak over sequence length x logical batch, one panel per trainer,
    LoRA rank and physical batch; cells say OOM / skip / error where there is no peak."""
    plt = _pyplot()
    import numpy as np

    seqs = sorted({r["config"]["seq_len"] for r in results})
    batches = sorted({r["config"]["batch_size"] for r in results})
    physicals = sorted({swept_value(r["config"], "physical_batch_size") for r in results})
    rows = sorted(
        {(r["config"]["trainer"], swept_value(r["config"], "lora_rank") or 0) for r in results}
    )
    div, unit = _scale(_peak(r) for r in results)
    peaks = [p / div for r in results if (p := _peak(r))]
    vmin, vmax = (min(peaks), max(peaks)) if peaks else (0.0, 1.0)
    fig, axes = plt.subplots(
        len(rows),
        len(physicals),
        figsize=(
            max(6.5, 1.5 + (1.0 + 0.9 * len(batches)) * len(physicals)),
            max(3.5, 0.6 + (0.9 + 0.55 * len(seqs)) * len(rows)),
        ),
        squeeze=False,
        constrained_layout=True,
    )
    cells = {
        (
            r["config"]["trainer"],
            swept_value(r["config"], "lora_rank") or 0,
            swept_value(r["config"], "physical_batch_size"),
            r["config"]["seq_len"],
            r["config"]["batch_size"],
        ): r
        for r in results
    }
    # Grey: no peak (out of memory, skipped, failed or not in the plan).
    image, cmap = None, plt.get_cmap("YlOrRd").with_extremes(bad="#e6e6e6")
    for i, (trainer, rank) in enumerate(rows):
        for j, physical in enumerate(physicals):
            ax = axes[i, j]
            grid = np.full((len(seqs), len(batches)), np.nan)
            for a, seq in enumerate(seqs):
                for b, batch in enumerate(batches):
                    r = cells.get((trainer, rank, physical, seq, batch))
                    if r is None:
                        text = "-"
                    elif _peak(r):
                        grid[a, b] = _peak(r) / div
                        text = f"{grid[a, b]:.3g}"
                    else:
                        text = {"oom": "OOM", "skipped": "skip"}.get(r["status"], r["status"])
                    dark = grid[a, b] > vmin + 0.6 * (vmax - vmin)  # NaN compares False
                    color = "white" if dark else "black"
                    ax.text(b, a, text, ha="center", va="center", fontsize=8, color=color)
            image = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, origin="lower")
            ax.set_xticks(range(len(batches)), [str(b) for b in batches])
            ax.set_yticks(range(len(seqs)), [str(s) for s in seqs])
            ax.set_xlabel("logical batch")
            ax.set_ylabel("sequence length")
            ax.set_title(
                f"{trainer} {'r' + str(rank) if rank else 'full'} · physical {physical}",
                fontsize=9,
            )
    fig.colorbar(image, ax=axes, label=f"peak allocated memory ({unit})", shrink=0.8)
    return _save(fig, run_dir, "memory_heatmap.png")


def plot_peak_comparison(run_dir: str, results: list[dict]) -> str:
    """peak_memory_comparison.png: every config's peak, one bar each, OOM and skips named."""
    plt = _pyplot()
    div, unit = _scale(_peak(r) for r in results)
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.3 * len(results)), constrained_layout=True)
    for i, r in enumerate(results):
        trainer = r["config"]["trainer"]
        if _peak(r):
            value = _peak(r) / div
            ax.barh(i, value, color=TRAINER_COLORS.get(trainer, "gray"), height=0.7)
            ax.text(value, i, f" {value:.3g}", va="center", fontsize=8)
        else:
            ax.text(0, i, f" {r['status'].upper()}", va="center", fontsize=8, color="tab:red")
    ax.set_yticks(range(len(results)), [config_label(r["config"]) for r in results], fontsize=8)
    ax.set_ylim(len(results) - 0.5, -0.5)  # top to bottom in sweep order, no empty rows
    ax.set_xlabel(f"peak allocated memory ({unit})")
    ax.set_title("Peak memory per config")
    ax.margins(x=0.12)
    trainers = _trainers(results)
    handles = [plt.Rectangle((0, 0), 1, 1, color=TRAINER_COLORS.get(t, "gray")) for t in trainers]
    ax.legend(handles, trainers, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, run_dir, "peak_memory_comparison.png")


def _allocated(result: dict) -> list[dict]:
    return [s for s in result.get("snapshots") or [] if s.get("allocated_mb") is not None]


def plot_usage_timeline(run_dir: str, ok: list[dict]) -> str:
    """memory_usage_timeline.png: allocated memory over each worker's life, one panel per
    trainer, one line per config."""
    plt = _pyplot()
    measured = [r for r in ok if _allocated(r)]
    trainers = _trainers(measured) or ["-"]
    fig, axes = plt.subplots(
        len(trainers), 1, figsize=(11, 3.6 * len(trainers)), squeeze=False, constrained_layout=True
    )
    if not measured:
        _say(
            axes[0, 0],
            f"Allocated memory over time: {NOT_ON_CPU}.\n"
            "Peaks per config: peak_memory_comparison.png",
        )
        return _save(fig, run_dir, "memory_usage_timeline.png")
    div, unit = _scale(s["allocated_mb"] for r in measured for s in _allocated(r))
    # Colour: the config's peak, so the lines that matter stand out among many.
    peaks = [_peak(r) / div for r in measured]
    norm = plt.Normalize(min(peaks), max(peaks) if max(peaks) > min(peaks) else min(peaks) + 1)
    cmap = plt.get_cmap("viridis")
    for ax, trainer in zip(axes[:, 0], trainers):
        mine = [r for r in measured if r["config"]["trainer"] == trainer]
        for r in mine:
            snaps = _allocated(r)
            ax.plot(
                [s["timestamp"] for s in snaps],
                [s["allocated_mb"] / div for s in snaps],
                lw=1,
                color=cmap(norm(_peak(r) / div)),
                label=config_label(r["config"]),
            )
        ax.set_title(f"{trainer}: allocated memory at every phase event", fontsize=10)
        ax.set_xlabel("time since the worker started (s)")
        ax.set_ylabel(f"allocated ({unit})")
        ax.grid(alpha=0.3)
        if len(mine) <= 12:
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.25, 1.0))
    mappable = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(mappable, ax=axes, label=f"the config's peak ({unit})")
    return _save(fig, run_dir, "memory_usage_timeline.png")


def plot_config_timeline(run_dir: str, result: dict) -> str:
    """memory_timeline_config_<config_dir>.png: one config's phases over time (forward,
    backward and optimizer step shaded) with allocated memory and each phase's peak (CUDA)."""
    plt = _pyplot()
    snaps = result.get("snapshots") or []
    fig, ax = plt.subplots(figsize=(11, 4), constrained_layout=True)
    for previous, snap in zip(snaps, snaps[1:]):
        if snap["name"] in SHADES:
            ax.axvspan(previous["timestamp"], snap["timestamp"], color=SHADES[snap["name"]], lw=0)
    setup_colors = dict(zip(SETUP_PHASES, ("black", "tab:brown", "tab:purple", "tab:gray")))
    for snap in snaps:
        if snap["name"] in SETUP_PHASES:
            ax.axvline(snap["timestamp"], color=setup_colors[snap["name"]], ls="--", lw=1)
    allocated = _allocated(result)
    if allocated:
        div, unit = _scale([s.get("phase_peak_mb") for s in allocated])
        ax.plot(
            [s["timestamp"] for s in allocated],
            [s["allocated_mb"] / div for s in allocated],
            "k.-",
            lw=1,
            ms=3,
        )
        for previous, snap in zip(allocated, allocated[1:]):
            ax.hlines(
                snap["phase_peak_mb"] / div,
                previous["timestamp"],
                snap["timestamp"],
                colors="tab:red",
                lw=1.2,
            )
        ax.set_ylabel(f"allocated ({unit})")
    else:
        ax.text(
            0.5,
            0.5,
            f"Allocated memory per phase: {NOT_ON_CPU}.\nPeak of one step (CPU profiler): "
            f"{result['peak_memory_mb']:.1f} MB",
            ha="center",
            va="center",
            transform=ax.transAxes,
            bbox={"facecolor": "white", "alpha": 0.85, "lw": 0},
        )
        ax.set_yticks([])
        ax.set_ylabel("allocated: not measured")
    ax.set_xlabel("time since the worker started (s)")
    c = result["config"]
    ax.set_title(f"{config_label(c)}  {c['model']}  {c['dtype']}", fontsize=10)
    ax.grid(alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color in SHADES.values()]
    labels = ["forward", "backward", "optimizer step"]
    present = [n for n in SETUP_PHASES if any(s["name"] == n for s in snaps)]
    handles += [plt.Line2D([], [], color=setup_colors[n], ls="--") for n in present]
    labels += [SETUP_PHASES[n] for n in present]
    if allocated:
        handles += [plt.Line2D([], [], color="k", marker="."), plt.Line2D([], [], color="tab:red")]
        labels += ["allocated at the phase end", "peak inside the phase"]
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    name = f"memory_timeline_config_{result.get('config_dir') or 'unknown'}.png"
    return _save(fig, run_dir, name)


def _group_kinds(groups: dict) -> dict[str, dict[str, float]]:
    """MB per plotted kind for each group of a ``module_memory`` record."""
    out = {}
    for group, mb in groups.items():
        out[group] = {
            "frozen parameters": mb["parameters_mb"] - mb["trainable_parameters_mb"],
            "trainable parameters": mb["trainable_parameters_mb"],
            "gradients": mb["gradients_mb"],
            "optimizer states": mb["optimizer_states_mb"],
            "per-sample state": mb["per_sample_gradients_mb"]
            + mb["norm_samples_mb"]
            + mb["dp_saved_tensors_mb"],
            "activations (saved for backward)": mb["activations_mb"],
        }
    return out


def _by_group_series(ax, ok, param, value_of, title, div, unit) -> None:
    """Lines per module group (colour) and trainer (style) of ``value_of(groups)[group]`` along
    the longest series of ``param``."""
    styles = ("-", "--", ":", "-.")
    drawn = False
    for t, trainer in enumerate(_trainers(ok)):
        line = [
            r
            for r in _longest_series([r for r in ok if r["config"]["trainer"] == trainer], param)
            if r.get("module_memory")
        ]
        for g, group in enumerate(GROUPS):
            ys = [value_of(r["module_memory"]["groups"])[group] / div for r in line]
            if line and any(ys):
                xs = [swept_value(r["config"], param) for r in line]
                ax.plot(
                    xs, ys, styles[t % 4], marker="o", color=f"C{g}", label=f"{group} ({trainer})"
                )
                drawn = True
    if not drawn:
        _say(ax, f"{title}: no ok config with a module census")
        return
    values = sorted(
        {swept_value(r["config"], param) for r in ok if swept_value(r["config"], param)}
    )
    _log2_axis(ax, values)
    ax.set_xlabel(dict(SWEPT)[param])
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def plot_module_groups(run_dir: str, ok: list[dict]) -> str:
    """detailed_memory_analysis.png: memory by module group of each trainer's largest config,
    how activations and per-sample state grow by group, and the allocator's peak breakdown."""
    plt = _pyplot()
    from report import BREAKDOWN_LABELS

    fig, axes = plt.subplots(2, 2, figsize=(15, 11), constrained_layout=True)
    census = [r for r in ok if r.get("module_memory")]
    trainers = _trainers(census)
    largest = {
        t: max((r for r in census if r["config"]["trainer"] == t), key=_peak) for t in trainers
    }
    ax = axes[0, 0]
    if largest:
        kinds = {t: _group_kinds(r["module_memory"]["groups"]) for t, r in largest.items()}
        totals = [sum(v.values()) for k in kinds.values() for v in k.values()]
        div, unit = _scale(totals)
        width, hatches = 0.8 / len(trainers), ("", "//", "..", "xx")
        for t, trainer in enumerate(trainers):
            bottom = [0.0] * len(GROUPS)
            xs = [g + (t - (len(trainers) - 1) / 2) * width for g in range(len(GROUPS))]
            for kind, color in KIND_COLORS.items():
                values = [kinds[trainer][group][kind] / div for group in GROUPS]
                ax.bar(
                    xs,
                    values,
                    width,
                    bottom=bottom,
                    color=color,
                    hatch=hatches[t % 4],
                    edgecolor="white",
                    lw=0.5,
                )
                bottom = [b + v for b, v in zip(bottom, values)]
        # rotated: "classifier head" next to "embedding" overlapped when set horizontally
        ax.set_xticks(
            range(len(GROUPS)), [g.replace("_", " ") for g in GROUPS], rotation=30, ha="right"
        )
        ax.set_ylabel(unit)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
        labels = list(KIND_COLORS)
        handles += [
            plt.Rectangle((0, 0), 1, 1, fc="white", ec="gray", hatch=hatches[t % 4])
            for t in range(len(trainers))
        ]
        labels += [f"{t}: {config_label(largest[t]['config'])}" for t in trainers]
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title(
            "Memory by module group, each trainer's largest ok config\n(each kind at "
            "the phase where it is largest)",
            fontsize=10,
        )
        ax.grid(axis="y", alpha=0.3)
    else:
        _say(ax, "No ok config with a module census")
    all_groups = [r["module_memory"]["groups"] for r in census]
    div, unit = _scale(v["activations_mb"] for g in all_groups for v in g.values())
    _by_group_series(
        axes[0, 1],
        census,
        "seq_len",
        lambda g: {k: v["activations_mb"] for k, v in g.items()},
        "Saved for backward in one physical chunk, by group",
        div,
        unit,
    )
    per_sample = lambda g: {
        k: v["per_sample_gradients_mb"] + v["norm_samples_mb"] + v["dp_saved_tensors_mb"]
        for k, v in g.items()
    }
    div, unit = _scale(v for g in all_groups for v in per_sample(g).values())
    _by_group_series(
        axes[1, 0],
        census,
        "physical_batch_size",
        per_sample,
        "Per-sample state (grad_sample, norm samples, hook-kept tensors) by group",
        div,
        unit,
    )
    ax = axes[1, 1]
    attributed = {t: r for t, r in largest.items() if r.get("breakdown")}
    if attributed:
        div, unit = _scale(r["peak_memory_mb"] for r in attributed.values())
        bottom = [0.0] * len(attributed)
        for k, (key, label) in enumerate(BREAKDOWN_LABELS.items()):
            values = [r["breakdown"][key] / div for r in attributed.values()]
            ax.bar(range(len(attributed)), values, bottom=bottom, color=f"C{k}", label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(attributed)), list(attributed))
        ax.set_ylabel(unit)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title("Where the peak goes (allocator history), same configs", fontsize=10)
    else:
        _say(ax, f"Allocator attribution of the peak: {NOT_ON_CPU}")
    return _save(fig, run_dir, "detailed_memory_analysis.png")


def plot_operations(run_dir: str, ok: list[dict]) -> str:
    """operation_level_breakdown.png: time (median over the measured steps) and peak memory of
    forward, backward and optimizer step, per config."""
    plt = _pyplot()
    rows = [r for r in ok if r.get("phase_costs")]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(14, 2.0 + 0.32 * max(1, len(rows))), constrained_layout=True
    )
    colors = dict(zip((op for op, _ in OPERATIONS), ("#7fb3e0", "#f3a15b", "#7fc97f")))
    labels = [config_label(r["config"]) for r in rows]
    left_edge = [0.0] * len(rows)
    for op, color in colors.items():
        values = [r["phase_costs"][op]["time_ms"] or 0.0 for r in rows]
        left.barh(range(len(rows)), values, left=left_edge, color=color, label=op.replace("_", " "))
        left_edge = [a + b for a, b in zip(left_edge, values)]
    left.set_yticks(range(len(rows)), labels, fontsize=8)
    left.set_ylim(len(rows) - 0.5, -0.5)
    left.set_xlabel("time per step (ms, median over the measured steps)")
    left.set_title("Time per operation (physical chunks summed)")
    fig.legend(*left.get_legend_handles_labels(), fontsize=8, loc="outside upper center", ncol=3)
    left.grid(axis="x", alpha=0.3)
    peaks = [r["phase_costs"][op]["peak_mb"] for r in rows for op in colors]
    if any(p is not None for p in peaks):
        div, unit = _scale(peaks)
        height = 0.8 / len(colors)
        for k, (op, color) in enumerate(colors.items()):
            ys = [i + (k - 1) * height for i in range(len(rows))]
            values = [(r["phase_costs"][op]["peak_mb"] or 0.0) / div for r in rows]
            right.barh(ys, values, height=height, color=color, label=op.replace("_", " "))
        right.set_yticks(range(len(rows)), labels, fontsize=8)
        right.set_ylim(len(rows) - 0.5, -0.5)
        right.set_xlabel(f"peak allocated inside the phase ({unit})")
        right.grid(axis="x", alpha=0.3)
    else:
        _say(right, f"Memory per operation: {NOT_ON_CPU}")
    right.set_title("Peak memory per operation")
    return _save(fig, run_dir, "operation_level_breakdown.png")
