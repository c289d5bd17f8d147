"""A sweep's peaks across configs (matplotlib, Agg; one PNG each in the run directory): peak
against each swept setting, a heatmap over sequence length x batch, and every config's peak."""

from __future__ import annotations

from dp_cost.report.figures import (
    MB,
    SWEEP_DPI,
    TRAINER_COLORS,
    log2_axis,
    memory_axis_from_zero,
    pyplot,
    save_visualization,
    say,
)
from dp_cost.report.results import (
    SWEPT,
    config_label,
    longest_series,
    lora_words,
    ok_peak,
    swept_value,
    trainers_in,
)


def plot_overview(run_dir: str, results: list[dict], fits: dict) -> str:
    """memory_analysis_overview.png: peak against each swept parameter, one panel each."""
    plt = pyplot()
    from matplotlib.transforms import blended_transform_factory

    fig, axes = plt.subplots(2, 2, figsize=(12, 9), constrained_layout=True)
    for ax, (param, label) in zip(axes.flat, SWEPT):
        values = sorted({v for r in results if (v := swept_value(r["config"], param))})
        if not values:
            say(ax, f"No {label} swept (full fine-tuning only)")
            ax.set_title(f"Peak vs {label}")
            continue
        top = blended_transform_factory(ax.transData, ax.transAxes)
        for trainer in trainers_in(results):
            color = TRAINER_COLORS.get(trainer, "gray")
            mine = [r for r in results if r["config"]["trainer"] == trainer]
            points = [(swept_value(r["config"], param), ok_peak(r)) for r in mine if ok_peak(r)]
            points = [(x, p) for x, p in points if x]
            line = longest_series(mine, param) if len(values) > 1 else []
            if points:
                ax.scatter(*zip(*points), s=16, color=color, alpha=0.35 if line else 1.0)
            if points and not line:
                ax.scatter([], [], color=color, s=16, label=trainer)
            fit = fits.get(trainer, {}).get(param, {})
            exponent = f" (k = {fit['exponent']:.2f})" if fit.get("exponent") is not None else ""
            if line:
                xs = [swept_value(r["config"], param) for r in line]
                ys = [ok_peak(r) for r in line]
                ax.plot(xs, ys, "-o", color=color, lw=2, label=f"{trainer}{exponent}")
            ooms = [swept_value(r["config"], param) for r in mine if r["status"] == "oom"]
            if ooms:
                ax.scatter(ooms, [0.96] * len(ooms), transform=top, marker="x", color=color, s=60)
        ax.scatter([], [], color="gray", alpha=0.35, s=16, label="every ok config")
        if any(r["status"] == "oom" for r in results):
            ax.scatter([], [], marker="x", color="gray", s=60, label="out of memory (top edge)")
        log2_axis(ax, values)
        ax.set_xlabel(label)
        ax.set_ylabel(f"peak allocated memory ({MB})")
        how = "line: longest series at equal other settings" if len(values) > 1 else "one value"
        ax.set_title(f"Peak vs {label} ({how})", fontsize=10)
        ax.margins(y=0.12)  # room at the top edge for the out-of-memory marks
        memory_axis_from_zero(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "Hugging Face sweep: peak memory against each swept parameter (k: exponent of the fit)"
    )
    return save_visualization(fig, run_dir, "memory_analysis_overview.png", dpi=SWEEP_DPI)


def plot_heatmap(run_dir: str, results: list[dict]) -> str:
    """memory_heatmap.png: peak over sequence length x logical batch, one panel per trainer,
    LoRA rank and physical batch; cells say OOM / skip / error where there is no peak."""
    plt = pyplot()
    seqs = sorted({r["config"]["seq_len"] for r in results})
    batches = sorted({r["config"]["batch_size"] for r in results})
    physicals = sorted({swept_value(r["config"], "physical_batch_size") for r in results})
    # One panel per planned (trainer, LoRA rank, physical batch): combinations no config has are
    # not drawn as empty panels.
    panels = sorted({_heatmap_panel_of(r["config"]) for r in results})
    ncols = min(len(panels), len(physicals))
    nrows = -(-len(panels) // ncols)
    peaks = [p for r in results if (p := ok_peak(r))]
    limits = (min(peaks), max(peaks)) if peaks else (0.0, 1.0)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(
            max(6.5, 1.5 + (1.0 + 0.9 * len(batches)) * ncols),
            max(3.5, 0.6 + (0.9 + 0.55 * len(seqs)) * nrows),
        ),
        squeeze=False,
        constrained_layout=True,
    )
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    cells = {
        (*_heatmap_panel_of(r["config"]), r["config"]["seq_len"], r["config"]["batch_size"]): r
        for r in results
    }
    # Grey: no peak (out of memory, skipped, failed or not in the plan).
    image, cmap = None, plt.get_cmap("YlOrRd").with_extremes(bad="#e6e6e6")
    for ax, panel in zip(axes.flat, panels):
        image = _draw_heatmap_panel(ax, panel, cells, seqs, batches, limits, cmap)
    fig.colorbar(image, ax=axes, label=f"peak allocated memory ({MB})", shrink=0.8)
    return save_visualization(fig, run_dir, "memory_heatmap.png", dpi=SWEEP_DPI)


def _heatmap_panel_of(config: dict) -> tuple:
    """The heatmap panel a config is drawn in: (trainer, LoRA rank or 0, physical batch)."""
    return (
        config["trainer"],
        swept_value(config, "lora_rank") or 0,
        swept_value(config, "physical_batch_size"),
    )


def _draw_heatmap_panel(ax, panel: tuple, cells: dict, seqs, batches, limits, cmap):
    """One panel: the peaks over sequence length x logical batch, each cell's peak or status
    written in it (``limits``: the colour scale's (min, max)); the image, for the colour bar."""
    import numpy as np

    trainer, rank, physical = panel
    vmin, vmax = limits
    grid = np.full((len(seqs), len(batches)), np.nan)
    for a, seq in enumerate(seqs):
        for b, batch in enumerate(batches):
            r = cells.get((trainer, rank, physical, seq, batch))
            if r is None:
                text = "-"
            elif ok_peak(r):
                grid[a, b] = ok_peak(r)
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
        f"{trainer}, {lora_words(rank)}\nphysical batch {physical}",
        fontsize=9,
    )
    return image


def plot_peak_comparison(run_dir: str, results: list[dict]) -> str:
    """peak_memory_comparison.png: every config's peak, one bar each, OOM and skips named."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.3 * len(results)), constrained_layout=True)
    for i, r in enumerate(results):
        trainer = r["config"]["trainer"]
        if ok_peak(r):
            value = ok_peak(r)
            ax.barh(i, value, color=TRAINER_COLORS.get(trainer, "gray"), height=0.7)
            ax.text(value, i, f" {value:.3g}", va="center", fontsize=8)
        else:
            ax.text(0, i, f" {r['status'].upper()}", va="center", fontsize=8, color="tab:red")
    ax.set_yticks(range(len(results)), [config_label(r["config"]) for r in results], fontsize=8)
    ax.set_ylim(len(results) - 0.5, -0.5)  # top to bottom in sweep order, no empty rows
    ax.set_xlabel(f"peak allocated memory ({MB})")
    ax.set_title("Peak memory per config")
    ax.margins(x=0.12)
    trainers = trainers_in(results)
    handles = [plt.Rectangle((0, 0), 1, 1, color=TRAINER_COLORS.get(t, "gray")) for t in trainers]
    ax.legend(handles, trainers, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return save_visualization(fig, run_dir, "peak_memory_comparison.png", dpi=SWEEP_DPI)
