"""HF sweeps (--mode=hf_sweep, run_single_gpu_analysis.sh) on CPU: the CLI end to end with resume,
and the suite script. The sweep's report from result files alone: tests/report/."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it at import
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("peft")

from cli_helpers import ROOT, SWEEP_FILES, in_process  # noqa: E402

from dp_cost.measure import census as module_memory  # noqa: E402


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
    proc = in_process(*args)
    return proc, time.monotonic() - start


def test_hf_sweep_cli_writes_every_file_and_resume_skips_finished_configs(tmp_path):
    token = "hf_SWEEP_SECRET_456"
    first, first_seconds = sweep_cli(tmp_path, token=token)
    assert first.returncode == 0, first.stderr[-2000:]
    run = tmp_path / "r"
    names = [f"{t}_bs6_seq{s}_pb4_r4_tiny-llama" for t in ("dpsgd", "ghost") for s in (16, 32)]
    for name in SWEEP_FILES + tuple(f"memory_timeline_config_{n}.png" for n in names):
        folder = run / "visualizations" if name.endswith(".png") else run
        assert (folder / name).stat().st_size > 0, name
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
        (["--model", "tiny-llama", "--lora_ranks", "4", "8"], "applies only to LoRA runs"),
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
        "OUTPUT_DIR": str(tmp_path / "out"),
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
    assert (tmp_path / "out" / "suite").is_dir()  # made first: every part resumes it
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
