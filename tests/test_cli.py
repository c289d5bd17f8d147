"""The CLI end to end on CPU: plan, isolated workers, result files, summaries, exit codes."""

import csv
import os
import signal
import subprocess
import sys

import pytest
from cli_helpers import (
    ROOT,
    SMALL_MODEL,
    in_process,
    results_in,
    running_worker,
    small_run_args,
)

import profiling_script
from dp_cost.measure import worker


def test_test_mode_runs_every_trainer_and_writes_summaries(tmp_path):
    trainers = ("vanilla", "hooks", "dpsgd_ghost", "flash_clip")
    proc = in_process(*small_run_args(tmp_path, *trainers, seq_lens=(16,), steps=2))
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = tmp_path / "r"
    results = results_in(run_dir)
    # Canonical names only, in directories named as README says.
    assert sorted(results) == sorted(
        f"{t}_bs2_seq16" for t in ("standard", "dpsgd", "ghost", "flash")
    )
    for name, result in results.items():
        assert result["status"] == "ok", result["error"]
        assert result["experiment"] == result["config"]["trainer"] == name.split("_")[0]
        assert len(result["step_times_ms"]) == 2
        assert result["avg_time_ms"] > 0 and result["median_time_ms"] > 0
        assert result["peak_memory_mb"] > 0
        assert result["env"]["memory_source"] == "cpu-profiler"
        assert result["peak_reserved_mb"] is None
        names = [s["name"] for s in result["snapshots"]]
        assert names[:2] == ["0_model_loaded", "optimizer_created"]
        assert names[-3:] == ["forward_done", "backward_done", "step_done"]
    assert results["flash_bs2_seq16"]["flash_routes"]
    with open(run_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["trainer"] for r in rows} == {"standard", "dpsgd", "ghost", "flash"}
    assert float(next(r for r in rows if r["trainer"] == "standard")["time_vs_standard"]) == 1.0
    assert "| trainer |" in (run_dir / "summary.md").read_text()
    assert "time_vs_standard" in proc.stdout


def test_peak_memory_on_cpu_grows_with_the_batch(tmp_path):
    proc = in_process(*small_run_args(tmp_path, "standard", batch_sizes=(1, 8), seq_lens=(64,)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = results_in(tmp_path / "r")
    small = results["standard_bs1_seq64"]["peak_memory_mb"]
    large = results["standard_bs8_seq64"]["peak_memory_mb"]
    assert large > small * 1.5


def test_resume_skips_finished_configs_and_existing_run_is_refused(tmp_path):
    args = small_run_args(tmp_path, "standard")
    assert in_process(*args).returncode == 0
    stamp = os.path.getmtime(tmp_path / "r" / "standard_bs2_seq8" / "result.json")
    refused = in_process(*args)
    assert refused.returncode == 2 and "exists" in refused.stderr
    resumed = in_process(*args, "--resume", "--batch_sizes", "2", "3")
    assert resumed.returncode == 0
    assert "(resumed)" in resumed.stdout
    assert os.path.getmtime(tmp_path / "r" / "standard_bs2_seq8" / "result.json") == stamp
    assert (tmp_path / "r" / "standard_bs3_seq8" / "result.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "nope"], "invalid choice"),
        (["--trainers", "nope"], "unknown trainer"),
        (["--model", "nope"], "unknown model"),
        (["--dtype", "float16"], "invalid choice"),
        (["--batch_size", "0"], "batch size must be positive"),
        (["--seq_len", "0"], "seq_len 0"),
        (["--seq_len", "5000"], "seq_len 5000"),
        (["--batch_size", "2", "--max_physical_batch_size", "4"], "physical batch 4"),
        (["--trainer", "dpsgd", "--trainers", "ghost"], "not both"),
        (["--noise_multiplier", "-1"], "--noise_multiplier must be >= 0"),
        (["--max_grad_norm", "0"], "--max_grad_norm and --lr > 0"),
        (["--ncu", "--device", "cpu"], "--ncu profiles CUDA kernels"),
        (["--model", "tiny-llama", "--seq_len", "2"], "seq_len >= 3"),
        (["--model", "tiny-llama", "--batch_size", "20", "--dataset_size", "10"], "--dataset_size"),
        (["--mode", "report", "--input_dir", "/nonexistent"], "--input_dir"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args, message, tmp_path, capsys):
    """In this process (profiling_script.main, what the command runs): tests/test_bad_inputs.py
    runs a sample of bad command lines as real processes."""
    code = profiling_script.main([*args, "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing was started


def test_profile_mode_with_device_cuda_and_no_cuda_refuses(tmp_path):
    """Without --device cuda it falls back to the CPU defaults: tests/test_readme_commands.py
    and test_settings.py's plans."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    refused = in_process("--mode=profile", "--device", "cuda", "--output_dir", str(tmp_path))
    assert refused.returncode == 2 and "no CUDA device" in refused.stderr


def test_failed_config_is_recorded_others_finish_and_exit_1(tmp_path, monkeypatch, capsys):
    real = worker.run_experiment

    def crash_for_ghost(config, out_dir, rank_setup=None):
        if config.trainer == "ghost":
            raise RuntimeError("boom")
        return real(config, out_dir)

    # The workers are forked from this process, so they see the patched function.
    monkeypatch.setattr(worker, "run_experiment", crash_for_ghost)
    code = profiling_script.main(small_run_args(tmp_path, "ghost", "standard"))
    assert code == 1
    results = results_in(tmp_path / "r")
    assert results["ghost_bs2_seq8"]["status"] == "error"
    assert "boom" in results["ghost_bs2_seq8"]["error"]
    assert results["standard_bs2_seq8"]["status"] == "ok"
    assert "boom" in (tmp_path / "r" / "summary.md").read_text()


def test_oom_is_a_measurement_not_an_error(tmp_path, monkeypatch):
    import torch

    def oom(config, out_dir, rank_setup=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(worker, "run_experiment", oom)
    code = profiling_script.main(small_run_args(tmp_path, "standard", steps=None))
    assert code == 0
    assert results_in(tmp_path / "r")["standard_bs2_seq8"]["status"] == "oom"


def test_physical_larger_than_some_logical_batches_is_skipped(tmp_path):
    args = small_run_args(tmp_path, "dpsgd", batch_sizes=(2, 4))
    proc = in_process(*args, "--max_physical_batch_sizes", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = results_in(tmp_path / "r")
    assert results["dpsgd_bs2_seq8_pb3"]["status"] == "skipped"
    ok = results["dpsgd_bs4_seq8_pb3"]
    assert ok["status"] == "ok" and len(ok["physical_step_times_ms"]) == 2  # chunks 2 + 2


def test_ctrl_c_keeps_only_complete_results(tmp_path):
    """Ctrl-C while the second of four configs is measured (batch 1 takes a moment, batch 256
    far longer than the signal takes to come)."""
    args = small_run_args(tmp_path, "standard", batch_sizes=(1, 256, 257, 258), steps=30)
    proc = subprocess.Popen(
        [sys.executable, "profiling_script.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    running_worker(proc, tmp_path / "r" / "standard_bs256_seq8")  # the first has its result
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "Interrupted" in stdout
    results = results_in(tmp_path / "r")
    assert results and all(r["status"] == "ok" for r in results.values())
    assert len(results) < 4
    assert not list((tmp_path / "r").rglob("*.tmp*"))
    assert (tmp_path / "r" / "summary.csv").exists()


def test_report_mode_rerenders_from_result_files(tmp_path):
    assert in_process(*small_run_args(tmp_path, "standard", "dpsgd")).returncode == 0
    (tmp_path / "r" / "summary.csv").unlink()
    proc = in_process("--mode=report", "--input_dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    assert "dpsgd" in (tmp_path / "r" / "summary.csv").read_text()


def test_hf_mode_tiny_llama_with_lora_and_physical_batches(tmp_path, monkeypatch):
    env_token = "hf_SECRET_TOKEN_123"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = in_process(
        "--mode=hf", "--model_name", "tiny-llama", "--seq_length", "16", "--batch_size", "6",
        "--max_physical_batch_size", "4", "--use_lora", "--lora_rank", "4", "--steps", "2",
        "--trainers", "standard", "dpsgd", "ghost", "flash", "--token", env_token, "--no_trace",
        "--dataset_size", "60", "--output_dir", tmp_path, "--run_name", "r",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = results_in(tmp_path / "r")
    assert sorted(results) == sorted(
        f"{t}_bs6_seq16_pb4_r4_tiny-llama" for t in ("standard", "dpsgd", "ghost", "flash")
    )
    for name, result in results.items():
        assert result["status"] == "ok", result["error"]
        names = [s["name"] for s in result["snapshots"]]
        assert names[:2] == ["0_model_loaded", "dataset_prepared"]
        info = result["env"]["model_info"]
        assert 0 < info["trainable_params"] < info["frozen_params"]
        if not name.startswith("standard"):
            privacy = result["privacy"]
            assert privacy["sample_rate"] == 6 / 60 and privacy["epsilon"] > 0
            # 1 warm-up + 2 measured + the CPU memory-measurement step: every DP update counts.
            assert privacy["steps"] == 4
    # The token reaches no file and no output.
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert env_token not in path.read_text(errors="ignore")
    assert env_token not in proc.stdout + proc.stderr


def test_memory_mode_on_cpu_and_activation_checkpointing(tmp_path):
    proc = in_process(
        "--mode=memory",
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--trainers",
        "standard",
        "dpsgd",
        "flash",
        "--batch_sizes",
        "2",
        "--seq_lens",
        "16",
        "--steps",
        "1",
        "--activation_checkpointing",
        "--output_dir",
        str(tmp_path),
        "--run_name",
        "r",
        *SMALL_MODEL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = results_in(tmp_path / "r")
    standard = results["standard_bs2_seq16_ckpt_tiny"]
    assert standard["status"] == "ok"
    assert standard["breakdown"] is None and "CUDA" in standard["env"]["breakdown_note"]
    assert results["dpsgd_bs2_seq16_ckpt_tiny"]["status"] == "ok"
    flash = results["flash_bs2_seq16_ckpt_tiny"]
    assert flash["status"] == "ok" and "two backwards" in flash["flash_checkpointing"]
    assert "SUMMARY" in (tmp_path / "r" / "summary.txt").read_text()


def test_resume_refuses_changed_settings_and_duplicates_run_once(tmp_path):
    args = [*small_run_args(tmp_path, "standard", batch_sizes=(2, 2)), "--no_trace"]
    first = in_process(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.count("standard_bs2_seq8: running") == 1
    changed = in_process(*args, "--resume", "--lr", "0.5")
    assert changed.returncode == 2 and "other settings (lr)" in changed.stderr
    assert results_in(tmp_path / "r")["standard_bs2_seq8"]["config"]["lr"] == 1e-4


def test_ncu_report_mode_from_exported_csvs(tmp_path):
    fixture = os.path.join(ROOT, "tests", "fixtures", "ncu_raw_h100_standard.csv")
    for trainer in ("standard", "dpsgd"):
        with open(fixture) as src, open(tmp_path / f"report_{trainer}_bs8_seq256.csv", "w") as dst:
            dst.write(src.read())
    proc = in_process("--mode=ncu_report", "--input_dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ncu_summary.md").exists() and (tmp_path / "ncu_comparison.png").exists()
    missing = in_process("--mode=ncu_report", "--input_dir", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_per_layer_clipping_from_the_cli(tmp_path):
    """--clipping per_layer: dpsgd and flash record each parameter's C_l (sum of squares C^2)
    and clipped fraction, in directories of their own; ghost is skipped with its reason;
    standard runs as the baseline; the summary names the rule."""
    args = small_run_args(tmp_path, "standard", "dpsgd", "ghost", "flash")
    done = in_process(*args, "--clipping", "per_layer", "--max_grad_norm", "0.1", "--no_trace")
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["config"]["trainer"]: r for r in results_in(tmp_path / "r").values()}
    assert all(r["config_dir"].endswith("_perlayer") for r in results.values())
    assert results["ghost"]["status"] == "skipped"
    assert "no per-layer mode" in results["ghost"]["error"]
    assert results["standard"]["status"] == "ok" and results["standard"]["clipping"] is None
    for name in ("dpsgd", "flash"):
        record = results[name]["clipping"]
        assert results[name]["status"] == "ok" and record["rule"] == "per_layer"
        bounds = [p["max_grad_norm"] for p in record["parameters"]]
        assert sum(b * b for b in bounds) == pytest.approx(0.1**2, rel=1e-12)
        assert sum(b * b for b in bounds) <= 0.1**2
        assert all(0 <= p["clipped_fraction"] <= 1 for p in record["parameters"])
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert summary.count(" per-layer |") == 4  # every row, the baseline's too
