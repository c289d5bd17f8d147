"""A Hugging Face sweep's report (report/sweep.py and its plots) from CUDA-like result files:
scaling fits against hand-computed values, the findings, and every file of the sweep view."""

import json
import math
import os

import pytest
from cli_helpers import SWEEP_FILES
from figure_checks import check_figures

from dp_cost.core.schema import BREAKDOWN_KEYS, CENSUS_KINDS, GROUPS, OPERATIONS
from dp_cost.report import summary as report
from dp_cost.report import sweep as hf_sweep


def synthetic_result(trainer, seq, batch, physical, rank, status="ok", peak=None):
    """A CUDA-like result.json for report tests; the numbers are made up, not measurements."""
    config = {
        "trainer": trainer,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "batch_size": batch,
        "seq_len": seq,
        "max_physical_batch_size": physical,
        "physical_batch_size": physical,
        "use_lora": rank is not None,
        "lora_rank": rank or 16,
        "dtype": "float32",
        "attention": "sdpa",
        "optimizer": "sgd",
        "detailed_memory": True,
    }
    result = {
        "experiment": trainer,
        "config_dir": f"{trainer}_bs{batch}_seq{seq}_pb{physical}" + (f"_r{rank}" if rank else ""),
        "status": status,
        "error": None if status == "ok" else f"{status} reason",
        "config": config,
        "env": {"memory_source": "cuda", "model_info": {"trainable_params": 1}},
        "avg_time_ms": 100.0,
        "median_time_ms": 100.0,
        "peak_memory_mb": peak,
        "peak_reserved_mb": peak,
        "breakdown": None,
        "snapshots": [],
    }
    if status != "ok":
        result["peak_memory_mb"] = result["peak_reserved_mb"] = None
        return result
    phases = ["0_model_loaded", "dataset_prepared", "optimizer_created", "privacy_wrapped"]
    phases += ["forward_done", "backward_done", "step_done"] * 3
    result["snapshots"] = [
        {"name": n, "timestamp": 0.1 * i, "allocated_mb": peak / 2, "phase_peak_mb": peak}
        for i, n in enumerate(phases)
    ]
    kinds = {f"{kind}_mb": 1.0 for kind in CENSUS_KINDS}
    result["module_memory"] = {"groups": {g: dict(kinds) for g in GROUPS}}
    op = {"time_ms": 30.0, "peak_mb": peak, "allocated_after_mb": peak / 2}
    result["phase_costs"] = {name: dict(op) for name, _ in OPERATIONS}
    result["breakdown"] = {key: peak / len(BREAKDOWN_KEYS) for key in BREAKDOWN_KEYS}
    return result


def test_scaling_fits_recover_exponents_and_say_why_not():
    results = []
    for seq in (128, 256, 512):
        for physical in (1, 2):
            peak = 1000 * (seq / 128) ** 1.5 * physical**0.5
            results.append(synthetic_result("dpsgd", seq, 8, physical, 16, peak=peak))
    results.append(synthetic_result("dpsgd", 1024, 8, 1, 16, status="oom"))
    fits = hf_sweep.scaling_fits(results)["dpsgd"]
    assert fits["seq_len"]["exponent"] == pytest.approx(1.5) and fits["seq_len"]["series"] == 2
    assert fits["physical_batch_size"]["exponent"] == pytest.approx(0.5)
    assert fits["batch_size"]["exponent"] is None and "one value" in fits["batch_size"]["reason"]
    full = [synthetic_result("dpsgd", s, 8, 1, None, peak=float(s)) for s in (64, 128)]
    assert "no LoRA" in hf_sweep.scaling_fits(full)["dpsgd"]["lora_rank"]["reason"]
    text = hf_sweep.findings_text(results, hf_sweep.scaling_fits(results))
    oom = "- dpsgd, sequence length 1024, batch 8, physical batch 1, LoRA r16: oom reason"
    assert f"Out of memory:\n{oom}" in text
    assert "sequence length (tokens): k = 1.50 (median of 2 series, range 1.50 to 1.50)" in text


def test_report_of_a_cuda_like_sweep_with_oom_and_skips(tmp_path, kept_figures):
    results = [
        synthetic_result(t, s, b, p, r, peak=1000.0 + s * p * (2 if t == "ghost" else 1))
        for t in ("dpsgd", "ghost")
        for s in (128, 256)
        for b in (2, 4)
        for p in (1, 2)
        for r in (8,)
    ]
    results[-1] = synthetic_result("ghost", 256, 4, 2, 8, status="oom")
    results.append(synthetic_result("dpsgd", 128, 2, 4, 8, status="skipped"))
    for r in results:
        os.makedirs(tmp_path / r["config_dir"])
        (tmp_path / r["config_dir"] / "result.json").write_text(json.dumps(r))
    text = report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    assert (
        "ghost, sequence length 256, batch 4, physical batch 2, LoRA r8: oom reason" in text
        and "Skipped:" in text
    )
    for name in SWEEP_FILES:  # data files in the run directory, every PNG under visualizations/
        folder = tmp_path / "visualizations" if name.endswith(".png") else tmp_path
        assert (folder / name).stat().st_size > 0, name
    assert not list(tmp_path.glob("*.png"))
    timelines = list((tmp_path / "visualizations").glob("memory_timeline_config_*.png"))
    assert len(timelines) == 15  # every ok config
    # the "Plots:" line counts the PNGs written, by folder: two dozen paths are no line to read
    pngs = list((tmp_path / "visualizations").glob("*.png"))
    plots_line = next(line for line in text.splitlines() if line.startswith("Plots: "))
    assert plots_line == (
        f"Plots: {len(pngs)} in {tmp_path}/visualizations/ (report.html shows every one)"
    )
    check_figures(kept_figures)  # every sweep figure's texts inside it, whole batches ticked
    assert "HF sweep findings" in (tmp_path / "summary.md").read_text()
    saved = json.loads((tmp_path / "memory_profile_results.json").read_text())
    assert len(saved["configs"]) == 17
    assert saved["scaling"]["ghost"]["seq_len"]["exponent"] > 0


def test_exponent_of_a_pure_power_law_is_exact():
    # numpy.polyfit on log-log, as the findings use it: an independent check of the slope.
    results = [synthetic_result("flash", 8, b, 1, 8, peak=3.0 * b**2) for b in (2, 4, 16)]
    fit = hf_sweep.scaling_fits(results)["flash"]["batch_size"]
    assert math.isclose(fit["exponent"], 2.0, rel_tol=1e-9)
