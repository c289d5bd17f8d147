"""What the plots say, read from the figures before they are saved: MB everywhere (as the
tables), memory axes from 0, legends of the trainers that ran, labels that tell shapes apart,
markers that do not repeat, heatmap panels only for planned combinations, and the CPU curve's
offset from the table's peak said in the legend."""

import json

import pytest
from figure_checks import check_figures
from test_report_summary import run_result
from test_report_sweep import synthetic_result

from dp_cost.report import figures, plots, sweep_detail_plots, sweep_peak_plots


@pytest.fixture
def drawn(monkeypatch):
    """Every figure a plot function saves, by file name (kept open for inspection)."""
    figs = {}

    def keep(fig, path, dpi=110):
        figs[path.rsplit("/", 1)[-1]] = fig
        return path

    monkeypatch.setattr(figures, "save_figure", keep)
    yield figs
    for fig in figs.values():
        figures.pyplot().close(fig)


def test_tradeoff_units_axes_legend_and_markers(tmp_path, drawn):
    results = [run_result("standard", 2, 1500.0, 10.0), run_result("flash", 2, 1600.0, 11.0)]
    results.append(run_result("standard", 2, 900.0, 6.0, lora=True))
    results.append(run_result("flash", 2, 950.0, 7.0) | {"config": results[1]["config"] | {
        "physical_batch_size": 1}})  # fmt: skip
    plots.plot_tradeoff(str(tmp_path), results)
    ax = drawn["performance_tradeoff.png"].axes[0]
    assert ax.get_ylabel() == "peak allocated memory (MB)" and ax.get_ylim()[0] == 0
    labels = ax.get_legend_handles_labels()[1]
    assert labels[:2] == ["standard", "flash"]  # no dpsgd or ghost: they did not run
    shapes = labels[2:]
    assert len(shapes) == len(set(shapes)) == 3
    # only what tells the shapes apart, in words; what they share is in the title
    assert sorted(shapes) == [
        "physical batch 1, full fine-tuning",
        "physical batch 2, LoRA r8",
        "physical batch 2, full fine-tuning",
    ]
    assert ax.get_title().split("\n", 1)[1].replace("\n", " ") == (
        "model 1b, batch 2, sequence length 16, bf16, SDPA attention, AdamW"
    )
    markers = [c.get_paths()[0].vertices.tobytes() for c in ax.collections[: len(results)]]
    assert len(set(markers)) == 3  # one marker per shape, none repeated
    assert max(y for c in ax.collections for _, y in c.get_offsets()) == 1600.0  # MB, not GiB


def test_cpu_memory_curve_says_why_its_maximum_is_not_the_peak(tmp_path, drawn):
    result = run_result("standard", 2, 30.0, 10.0) | {
        "env": {"memory_source": "cpu-profiler"},
        "trace_file": "t.pt.trace.json",
    }
    events = [
        {"ph": "i", "name": "[memory]", "ts": ts, "args": {"Device Type": 0, "Total Allocated": b}}
        for ts, b in ((0, 2**20), (10, 20 * 2**20), (20, 4 * 2**20))
    ]
    (tmp_path / result["config_dir"]).mkdir()
    (tmp_path / result["config_dir"] / "t.pt.trace.json").write_text(json.dumps(events))
    plots.plot_memory_curves(str(tmp_path), [result])
    ax = drawn["memory_curve.png"].axes[0]
    assert ax.get_ylabel() == "allocated (MB)" and ax.get_ylim()[0] == 0
    legend = ax.get_legend()
    assert "the table's peak adds" in legend.get_title().get_text()
    assert legend.get_texts()[0].get_text() == "standard (curve max 20.0, peak 30.0 MB)"


def test_a_truncated_trace_is_skipped_with_a_warning(tmp_path, drawn, capsys):
    result = run_result("standard", 2, 30.0, 10.0) | {"trace_file": "t.pt.trace.json"}
    (tmp_path / result["config_dir"]).mkdir()
    (tmp_path / result["config_dir"] / "t.pt.trace.json").write_text('{"traceEvents": [{"ph')
    assert plots.plot_memory_curves(str(tmp_path), [result]) is None
    assert "warning: skipped trace" in capsys.readouterr().err


def test_heatmap_has_panels_only_for_planned_combinations(tmp_path, drawn):
    # dpsgd at physical batch 1 and 2, ghost only at 2: three panels, not four
    results = [
        synthetic_result("dpsgd", s, 4, p, 8, peak=100.0 * s) for s in (8, 16) for p in (1, 2)
    ]
    results += [synthetic_result("ghost", s, 4, 2, 8, peak=90.0 * s) for s in (8, 16)]
    sweep_peak_plots.plot_heatmap(str(tmp_path), results)
    fig = drawn["memory_heatmap.png"]
    titles = sorted(ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title())
    assert titles == [
        "dpsgd, LoRA r8\nphysical batch 1",
        "dpsgd, LoRA r8\nphysical batch 2",
        "ghost, LoRA r8\nphysical batch 2",
    ]


def test_sweep_titles_read_as_words(tmp_path, drawn):
    result = synthetic_result("dpsgd", 256, 8, 2, None, peak=100.0)
    result["config"]["dtype"] = "bfloat16"
    sweep_detail_plots.plot_config_timeline(str(tmp_path), result)
    (ax,) = [ax for ax in drawn[f"memory_timeline_config_{result['config_dir']}.png"].axes]
    assert ax.get_title() == (
        "dpsgd, sequence length 256, batch 8, physical batch 2, full fine-tuning, "
        "model meta-llama/Llama-3.1-8B-Instruct, bf16"
    )


def long_run_results(tmp_path) -> list[dict]:
    """A run's results whose shapes take long titles (the tiny LM's words, one shape each), with
    a CPU trace (memory curve), phase snapshots (timeline) and breakdowns."""
    results = []
    for trainer, batch in (("standard", 8), ("dpsgd", 8), ("standard", 4)):
        result = run_result(trainer, batch, 40.0 + batch, 10.0 + batch)
        result["config"] |= {
            "model": "tiny",
            "dtype": "float32",
            "attention": "explicit",
            "optimizer": "sgd",
            "physical_batch_size": batch,
            "seq_len": 256,
        }
        result |= {"env": {"memory_source": "cpu-profiler"}, "trace_file": "t.pt.trace.json"}
        phases = ["forward_done", "backward_done", "step_done"] * 2
        result["snapshots"] = [
            {"name": n, "timestamp": 0.1 * i, "allocated_mb": 20.0 + i, "phase_peak_mb": 30.0 + i}
            for i, n in enumerate(["start", *phases])
        ]
        events = [{"ph": "i", "name": "[memory]", "ts": ts,
                   "args": {"Device Type": 0, "Total Allocated": b * 2**20}}
                  for ts, b in ((0, 1), (10, 20 + batch), (20, 4))]  # fmt: skip
        (tmp_path / result["config_dir"]).mkdir()
        (tmp_path / result["config_dir"] / "t.pt.trace.json").write_text(json.dumps(events))
        results.append(result)
    return results


def test_a_runs_figures_keep_their_texts_inside(tmp_path, kept_figures):
    from dp_cost.report import summary

    summary.write_summary(str(tmp_path), long_run_results(tmp_path))
    assert {"memory_curve.png", "memory_breakdown_comparison.png", "memory_timeline.png",
            "performance_tradeoff.png"} <= set(kept_figures)  # fmt: skip
    check_figures(kept_figures)


def capacity_result(trainer: str, points: list[tuple[int, float]]) -> dict:
    """A --mode=capacity result predicted at the given (physical batch, MB) points."""
    config = {"trainer": trainer, "model": "tiny", "batch_size": 3, "seq_len": 16,
              "physical_batch_size": 3, "dtype": "float32", "attention": "explicit",
              "optimizer": "sgd", "capacity": True, "gpu_memory": [0.9]}  # fmt: skip
    predictions = [
        {"physical_batch_size": b, "peak_memory_mb": mb, "peak_reserved_mb": mb + 2}
        for b, mb in points
    ]
    budget = {"gpu_memory_gib": 0.9, "allocator_room_mb": 400.0, "physical_batch_size": 3}
    return {
        "config_dir": f"{trainer}_bs3_seq16",
        "status": "ok",
        "config": config,
        "prediction": {"predictions": predictions, "largest_physical_batch": [budget],
                       "peak_memory_mb": points[-1][1], "physical_batch_size": 3},
    }  # fmt: skip


def test_the_capacity_figure_ticks_whole_physical_batches(tmp_path, kept_figures):
    from dp_cost.report import capacity

    results = [
        capacity_result("standard", [(1, 10.0), (2, 20.0), (3, 30.0)]),
        capacity_result("flash", [(1, 11.0), (2, 22.0), (3, 33.0)]),
    ]
    planned = capacity_result("flash", [(1, 500.0), (2, 900.0)])  # a panel of a long title
    planned["config"] |= {"model": "meta-llama/Llama-3.1-8B-Instruct", "use_lora": True,
                          "lora_rank": 16, "distributed": "fsdp", "world_size": 8,
                          "dtype": "bfloat16", "attention": "sdpa", "fsdp_sync": "logical",
                          "activation_checkpointing": True, "clipping": "per_layer"}  # fmt: skip
    assert capacity.plot_capacity(str(tmp_path), [*results, planned])
    check_figures(kept_figures)
