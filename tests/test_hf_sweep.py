"""HF sweeps (hf_sweep.py, hf_sweep_plots.py, --mode=hf_sweep, run_single_gpu_analysis.sh) on
CPU: fits against hand-computed values, the report from CUDA-like result files, the CLI end to end
with resume, and the suite script."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it at import
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
import math  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("peft")

from cli_helpers import ROOT, cli  # noqa: E402

import hf_sweep  # noqa: E402
import module_memory  # noqa: E402
import report  # noqa: E402

SWEEP_FILES = (
    "memory_profile_results.json",
    "memory_profile_summary.csv",
    "memory_analysis_overview.png",
    "memory_heatmap.png",
    "peak_memory_comparison.png",
    "memory_usage_timeline.png",
    "detailed_memory_results.json",
    "detailed_memory_analysis.png",
    "operation_level_breakdown.png",
)


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
    kinds = {f"{kind}_mb": 1.0 for kind in module_memory.KINDS}
    result["module_memory"] = {"groups": {g: dict(kinds) for g in module_memory.GROUPS}}
    op = {"time_ms": 30.0, "peak_mb": peak, "allocated_after_mb": peak / 2}
    result["phase_costs"] = {name: dict(op) for name, _ in module_memory.OPERATIONS}
    result["breakdown"] = {
        key: peak / len(report.BREAKDOWN_LABELS) for key in report.BREAKDOWN_LABELS
    }
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
    assert "Out of memory:\n- dpsgd T1024 bs8 pb1 r16: oom reason" in text
    assert "sequence length (tokens): k = 1.50 (median of 2 series, range 1.50 to 1.50)" in text


def test_report_of_a_cuda_like_sweep_with_oom_and_skips(tmp_path):
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
    assert "ghost T256 bs4 pb2 r8: oom reason" in text and "Skipped:" in text
    for name in SWEEP_FILES:
        assert (tmp_path / name).stat().st_size > 0, name
    timelines = list(tmp_path.glob("memory_timeline_config_*.png"))
    assert len(timelines) == 15  # every ok config
    assert "HF sweep findings" in (tmp_path / "summary.md").read_text()
    saved = json.loads((tmp_path / "memory_profile_results.json").read_text())
    assert len(saved["configs"]) == 17
    assert saved["scaling"]["ghost"]["seq_len"]["exponent"] > 0


def sweep_cli(tmp_path, *extra, token=None):
    args = [
        "--mode=hf_sweep",
        "--model_name",
        "tiny-llama",
        "--seq_lengths",
        "16",
        "32",
        "--batch_sizes",
        "6",
        "--max_physical_batch_sizes",
        "4",
        "--lora_ranks",
        "4",
        "--use_lora",
        "--trainers",
        "hooks",
        "ghost",
        "--steps",
        "2",
        "--dataset_size",
        "60",
        "--output_dir",
        str(tmp_path),
        "--run_name",
        "r",
        *extra,
    ]
    if token:
        args += ["--token", token]
    start = time.monotonic()
    proc = cli(*args)
    return proc, time.monotonic() - start


def test_hf_sweep_cli_writes_every_file_and_resume_skips_finished_configs(tmp_path):
    token = "hf_SWEEP_SECRET_456"
    first, first_seconds = sweep_cli(tmp_path, token=token)
    assert first.returncode == 0, first.stderr[-2000:]
    run = tmp_path / "r"
    names = [f"{t}_bs6_seq{s}_pb4_r4_tiny-llama" for t in ("dpsgd", "ghost") for s in (16, 32)]
    for name in SWEEP_FILES + tuple(f"memory_timeline_config_{n}.png" for n in names):
        assert (run / name).stat().st_size > 0, name
    for name in names:
        result = json.loads((run / name / "result.json").read_text())
        assert result["status"] == "ok", result["error"]
        assert result["config"]["detailed_memory"] and not result.get("trace_file")
        assert len(result["physical_step_times_ms"]) >= 2  # physical 4 < logical ~6
        groups = result["module_memory"]["groups"]
        assert set(groups) == set(module_memory.GROUPS)
        assert groups["lora"]["trainable_parameters_mb"] > 0
        assert result["phase_costs"]["backward"]["time_ms"] > 0
        assert result["phase_costs"]["backward"]["peak_mb"] is None  # CPU: not measured
    summary = (run / "summary.md").read_text()
    assert "HF sweep findings" in summary and "sequence length (tokens): k = " in summary
    csv_text = (run / "memory_profile_summary.csv").read_text()
    assert csv_text.count("\n") == 5 and "cpu-profiler" in csv_text
    # The progress bar: plain lines on a pipe, no carriage returns.
    progress = [line for line in first.stderr.splitlines() if "configs done" in line]
    assert progress[-1].startswith("[") and "4/4 configs done, 0 left, elapsed" in progress[-1]
    assert "\r" not in first.stderr
    stamps = {n: os.path.getmtime(run / n / "result.json") for n in names}
    resumed, resumed_seconds = sweep_cli(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.count("(resumed)") == 4 and ": running" not in resumed.stdout
    assert {n: os.path.getmtime(run / n / "result.json") for n in names} == stamps
    assert resumed_seconds < first_seconds
    for path in tmp_path.rglob("*"):  # the token reaches no file and no output
        if path.is_file():
            assert token not in path.read_text(errors="ignore"), path
    assert token not in first.stdout + first.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "tiny"], "--mode=hf_sweep needs a Hugging Face model"),
        (["--model", "tiny-llama", "--lora_ranks", "4", "8"], "need --use_lora"),
        (["--model", "tiny-llama", "--use_lora", "--lora_ranks", "0"], "must be positive"),
    ],
)
def test_hf_sweep_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    import profiling_script

    argv = ["--mode=hf_sweep", "--device", "cpu", *args, "--output_dir", str(tmp_path)]
    assert profiling_script.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_progress_bar_estimate():
    import io

    import runner

    stream = io.StringIO()
    bar = runner.ProgressBar(total=5, to_run=3, stream=stream)
    bar.advance(None)  # resumed: takes no time
    assert "1/5 configs done, 4 left" in stream.getvalue() and "estimating" in stream.getvalue()
    bar.advance(10.0)
    line = stream.getvalue().splitlines()[-1]
    assert "2/5 configs done, 3 left" in line and "estimate 20s left" in line  # 2 more x 10 s


FAKE_PYTHON = """#!/bin/sh
# Stands in for python: logs the arguments and whether the token arrived, then exits.
echo "$*" >> "$LOG"
if [ "$HF_TOKEN" = "$EXPECTED" ]; then echo token-in-env >> "$LOG"; fi
case "$*" in *"$FAIL_ON"*) exit "$FAIL_CODE";; esac
exit 0
"""


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "python"
    path.write_text(FAKE_PYTHON)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def run_suite(tmp_path, fake_python, *args, fail_on="never", fail_code=1):
    secret = "hf_SUITE_SECRET_789"
    env = {
        **os.environ,
        "PYTHON": str(fake_python),
        "LOG": str(tmp_path / "log"),
        "EXPECTED": secret,
        "FAIL_ON": fail_on,
        "FAIL_CODE": str(fail_code),
        "DEVICE": "cpu",
        "RUN_NAME": "suite",
    }
    env.pop("HF_TOKEN", None)
    proc = subprocess.run(
        [os.path.join(ROOT, "run_single_gpu_analysis.sh"), "--token", secret, *args],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    log = (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""
    assert secret not in proc.stdout + proc.stderr + log
    return proc, log


def test_single_gpu_suite_commands_and_token_through_the_environment_only(tmp_path, fake_python):
    proc, log = run_suite(tmp_path, fake_python, "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    calls = [line for line in log.splitlines() if line.startswith("profiling_script.py")]
    assert len(calls) == 5 and log.count("token-in-env") == 5
    for call in calls:
        assert "--mode=hf_sweep --device cpu --model_name meta-llama/Llama-3.2-3B-Instruct" in call
        assert "--run_name suite --resume" in call and call.endswith("--dtype bfloat16")
    assert "--seq_length 128 --batch_size 8 --max_physical_batch_size 1" in calls[0]
    assert "--seq_lengths 64 128 256 --batch_size 8" in calls[1]
    assert "--batch_sizes 8 16 32" in calls[2]
    assert "--use_lora --lora_ranks 16 32" in calls[3] and "--use_lora" not in calls[4]
    assert "--max_physical_batch_sizes 1 2 4" in calls[4]
    assert "memory_profile_summary.csv" in proc.stdout


def test_single_gpu_suite_exit_codes(tmp_path, fake_python):
    failed, log = run_suite(tmp_path, fake_python, fail_on="--seq_lengths 64")
    assert failed.returncode == 1 and log.count("profiling_script.py") == 5  # the rest still ran
    (tmp_path / "log").unlink()
    stopped, log = run_suite(tmp_path, fake_python, fail_on="--seq_lengths 64", fail_code=2)
    assert stopped.returncode == 2 and log.count("profiling_script.py") == 2


def test_exponent_of_a_pure_power_law_is_exact():
    # numpy.polyfit on log-log, as the findings use it: an independent check of the slope.
    results = [synthetic_result("flash", 8, b, 1, 8, peak=3.0 * b**2) for b in (2, 4, 16)]
    fit = hf_sweep.scaling_fits(results)["flash"]["batch_size"]
    assert math.isclose(fit["exponent"], 2.0, rel_tol=1e-9)
