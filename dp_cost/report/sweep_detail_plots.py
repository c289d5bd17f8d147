"""A sweep's configs in detail (matplotlib, Agg; one PNG each in the run directory): memory
over each worker's life, one timeline per config, memory by module group, and time and memory per
operation (forward, backward, optimizer step)."""

from __future__ import annotations

from dp_cost.core.schema import BREAKDOWN_LABELS, GROUPS, OPERATIONS
from dp_cost.report.figures import (
    MB,
    SWEEP_DPI,
    log2_axis,
    marker,
    memory_axis_from_zero,
    phase_legend,
    pyplot,
    save_visualization,
    say,
    shade_phases,
    wrapped,
)
from dp_cost.report.results import (
    SWEPT,
    allocated_snapshots,
    config_label,
    dtype_words,
    longest_series,
    ok_peak,
    swept_value,
    trainers_in,
)

KIND_COLORS = {
    "frozen parameters": "#c7c7c7",
    "trainable parameters": "#1f77b4",
    "gradients": "#2ca02c",
    "optimizer states": "#9467bd",
    "per-sample state": "#d62728",
    "activations (saved for backward)": "#ff7f0e",
}
SETUP_PHASES = {
    "0_model_loaded": "model loaded",
    "dataset_prepared": "dataset prepared",
    "optimizer_created": "optimizer created",
    "privacy_wrapped": "privacy wrapped",
}
NOT_ON_CPU = "not measured on CPU\n(no caching allocator there; memory_source cpu-profiler)"


def plot_usage_timeline(run_dir: str, ok: list[dict]) -> str:
    """memory_usage_timeline.png: allocated memory over each worker's life, one panel per
    trainer, one line per config."""
    plt = pyplot()
    measured = [r for r in ok if allocated_snapshots(r)]
    trainers = trainers_in(measured) or ["-"]
    fig, axes = plt.subplots(
        len(trainers), 1, figsize=(11, 3.6 * len(trainers)), squeeze=False, constrained_layout=True
    )
    if not measured:
        say(
            axes[0, 0],
            f"Allocated memory over time: {NOT_ON_CPU}.\n"
            "Peaks per config: peak_memory_comparison.png",
        )
        return save_visualization(fig, run_dir, "memory_usage_timeline.png", dpi=SWEEP_DPI)
    # Colour: the config's peak, so the lines that matter stand out among many.
    peaks = [ok_peak(r) for r in measured]
    norm = plt.Normalize(min(peaks), max(peaks) if max(peaks) > min(peaks) else min(peaks) + 1)
    cmap = plt.get_cmap("viridis")
    for ax, trainer in zip(axes[:, 0], trainers):
        mine = [r for r in measured if r["config"]["trainer"] == trainer]
        for r in mine:
            snaps = allocated_snapshots(r)
            ax.plot(
                [s["timestamp"] for s in snaps],
                [s["allocated_mb"] for s in snaps],
                lw=1,
                color=cmap(norm(ok_peak(r))),
                label=config_label(r["config"]),
            )
        ax.set_title(f"{trainer}: allocated memory at every phase event", fontsize=10)
        ax.set_xlabel("time since the worker started (s)")
        ax.set_ylabel(f"allocated ({MB})")
        memory_axis_from_zero(ax)
        ax.grid(alpha=0.3)
        if len(mine) <= 12:
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.25, 1.0))
    mappable = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(mappable, ax=axes, label=f"the config's peak ({MB})")
    return save_visualization(fig, run_dir, "memory_usage_timeline.png", dpi=SWEEP_DPI)


def plot_config_timeline(run_dir: str, result: dict) -> str:
    """memory_timeline_config_<config_dir>.png: one config's phases over time (forward,
    backward and optimizer step shaded) with allocated memory and each phase's peak (CUDA)."""
    plt = pyplot()
    snaps = result.get("snapshots") or []
    fig, ax = plt.subplots(figsize=(11, 4), constrained_layout=True)
    shade_phases(ax, snaps)
    setup_colors = dict(zip(SETUP_PHASES, ("black", "tab:brown", "tab:purple", "tab:gray")))
    for snap in snaps:
        if snap["name"] in SETUP_PHASES:
            ax.axvline(snap["timestamp"], color=setup_colors[snap["name"]], ls="--", lw=1)
    allocated = allocated_snapshots(result)
    if allocated:
        ax.plot(
            [s["timestamp"] for s in allocated],
            [s["allocated_mb"] for s in allocated],
            "k.-",
            lw=1,
            ms=3,
        )
        for previous, snap in zip(allocated, allocated[1:]):
            peak = snap["phase_peak_mb"]
            ax.hlines(peak, previous["timestamp"], snap["timestamp"], colors="tab:red", lw=1.2)
        ax.set_ylabel(f"allocated ({MB})")
        memory_axis_from_zero(ax)
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
    ax.set_title(f"{config_label(c)}, model {c['model']}, {dtype_words(c['dtype'])}", fontsize=10)
    ax.grid(alpha=0.3)
    handles, labels = phase_legend(plt)
    present = [n for n in SETUP_PHASES if any(s["name"] == n for s in snaps)]
    handles += [plt.Line2D([], [], color=setup_colors[n], ls="--") for n in present]
    labels += [SETUP_PHASES[n] for n in present]
    if allocated:
        handles += [plt.Line2D([], [], color="k", marker="."), plt.Line2D([], [], color="tab:red")]
        labels += ["allocated at the phase end", "peak inside the phase"]
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    name = f"memory_timeline_config_{result.get('config_dir') or 'unknown'}.png"
    return save_visualization(fig, run_dir, name, dpi=SWEEP_DPI)


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


def _by_group_series(ax, ok, param, value_of, title) -> None:
    """Lines per module group (colour) and trainer (style) of ``value_of(groups)[group]`` along
    the longest series of ``param``."""
    styles = ("-", "--", ":", "-.")
    drawn = False
    for t, trainer in enumerate(trainers_in(ok)):
        line = [
            r
            for r in longest_series([r for r in ok if r["config"]["trainer"] == trainer], param)
            if r.get("module_memory")
        ]
        for g, group in enumerate(GROUPS):
            ys = [value_of(r["module_memory"]["groups"])[group] for r in line]
            if line and any(ys):
                xs = [swept_value(r["config"], param) for r in line]
                ax.plot(
                    xs,
                    ys,
                    styles[t % 4],
                    marker=marker(t),
                    color=f"C{g}",
                    label=f"{group} ({trainer})",
                )
                drawn = True
    if not drawn:
        say(ax, f"{title}: no ok config with a module census")
        return
    values = sorted(
        {swept_value(r["config"], param) for r in ok if swept_value(r["config"], param)}
    )
    log2_axis(ax, values)
    ax.set_xlabel(dict(SWEPT)[param])
    ax.set_ylabel(MB)
    memory_axis_from_zero(ax)
    ax.set_title(wrapped(title, 48), fontsize=10)  # a quarter of the figure
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def plot_module_groups(run_dir: str, ok: list[dict]) -> str:
    """detailed_memory_analysis.png: memory by module group of each trainer's largest config,
    how activations and per-sample state grow by group, and the allocator's peak breakdown."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(15, 11), constrained_layout=True)
    census = [r for r in ok if r.get("module_memory")]
    trainers = trainers_in(census)
    largest = {
        t: max((r for r in census if r["config"]["trainer"] == t), key=ok_peak) for t in trainers
    }
    if largest:
        _module_groups_panel(axes[0, 0], plt, largest, trainers)
    else:
        say(axes[0, 0], "No ok config with a module census")
    _by_group_series(
        axes[0, 1],
        census,
        "seq_len",
        lambda g: {k: v["activations_mb"] for k, v in g.items()},
        "Saved for backward in one physical chunk, by group",
    )
    per_sample = lambda g: {
        k: v["per_sample_gradients_mb"] + v["norm_samples_mb"] + v["dp_saved_tensors_mb"]
        for k, v in g.items()
    }
    _by_group_series(
        axes[1, 0],
        census,
        "physical_batch_size",
        per_sample,
        "Per-sample state (grad_sample, norm samples, hook-kept tensors) by group",
    )
    attributed = {t: r for t, r in largest.items() if r.get("breakdown")}
    if attributed:
        _peak_roles_panel(axes[1, 1], attributed)
    else:
        say(axes[1, 1], f"Allocator attribution of the peak: {NOT_ON_CPU}")
    return save_visualization(fig, run_dir, "detailed_memory_analysis.png", dpi=SWEEP_DPI)


def _module_groups_panel(ax, plt, largest: dict, trainers: list[str]) -> None:
    """Bytes by module group and kind, a bar per trainer (hatched by trainer) in each group."""
    kinds = {t: _group_kinds(r["module_memory"]["groups"]) for t, r in largest.items()}
    width, hatches = 0.8 / len(trainers), ("", "//", "..", "xx")
    for t, trainer in enumerate(trainers):
        bottom = [0.0] * len(GROUPS)
        xs = [g + (t - (len(trainers) - 1) / 2) * width for g in range(len(GROUPS))]
        for kind, color in KIND_COLORS.items():
            values = [kinds[trainer][group][kind] for group in GROUPS]
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
    ax.set_ylabel(MB)
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


def _peak_roles_panel(ax, attributed: dict) -> None:
    """The allocator's peak by role, a stacked bar per trainer."""
    bottom = [0.0] * len(attributed)
    for k, (key, label) in enumerate(BREAKDOWN_LABELS.items()):
        values = [r["breakdown"][key] for r in attributed.values()]
        ax.bar(range(len(attributed)), values, bottom=bottom, color=f"C{k}", label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(attributed)), list(attributed))
    ax.set_ylabel(MB)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Where the peak goes (allocator history), same configs", fontsize=10)


def plot_operations(run_dir: str, ok: list[dict]) -> str:
    """operation_level_breakdown.png: time (median over the measured steps) and peak memory of
    forward, backward and optimizer step, per config."""
    plt = pyplot()
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
        height = 0.8 / len(colors)
        for k, (op, color) in enumerate(colors.items()):
            ys = [i + (k - 1) * height for i in range(len(rows))]
            values = [(r["phase_costs"][op]["peak_mb"] or 0.0) for r in rows]
            right.barh(ys, values, height=height, color=color, label=op.replace("_", " "))
        right.set_yticks(range(len(rows)), labels, fontsize=8)
        right.set_ylim(len(rows) - 0.5, -0.5)
        right.set_xlabel(f"peak allocated inside the phase ({MB})")
        right.grid(axis="x", alpha=0.3)
    else:
        say(right, f"Memory per operation: {NOT_ON_CPU}")
    right.set_title("Peak memory per operation")
    return save_visualization(fig, run_dir, "operation_level_breakdown.png", dpi=SWEEP_DPI)
