"""run_profiling_ncu.sh on CPU (no ncu: a fake one, or none), and the worker under ``--ncu``."""

import os
import shutil
import subprocess
import sys

import pytest
from ncu_testdata import SCRIPT, fake_ncu

from dp_cost.core.files import write_json
from dp_cost.measure import processes, progress
from dp_cost.measure.config import ExperimentConfig
from dp_cost.measure.worker import result_skeleton
from dp_cost.ncu.command import NCU_MISSING_MESSAGE
from dp_cost.report import summary as report

PY_BIN = os.path.dirname(sys.executable)
BASE_PATH = f"{PY_BIN}:/usr/bin:/bin"


def run_script(*args, path, tmp_path, **env):
    environ = {k: v for k, v in os.environ.items() if k != "NCU"}
    environ.update(PATH=path, PYTHON=sys.executable, OUTPUT_DIR=str(tmp_path / "out"), **env)
    return subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, env=environ, timeout=120
    )


def test_script_without_ncu_stops_first(tmp_path):
    if shutil.which("ncu", path=BASE_PATH):
        pytest.skip("ncu is installed in a system directory")
    proc = run_script(path=BASE_PATH, tmp_path=tmp_path)
    assert proc.returncode == 1
    assert NCU_MISSING_MESSAGE in proc.stderr
    assert "==>" not in proc.stdout
    assert not (tmp_path / "out").exists()


def test_script_rejects_nvprof_metric(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "ncu_ran"
    fake_ncu(bin_dir, f"touch {marker}\n")
    proc = run_script(
        "--metrics", "dram_read_throughput", path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 'dram_read_throughput' is an nvprof metric; in ncu use "
        "dram__bytes_read.sum.per_second"
    )
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_script_dry_run_prints_one_command_per_config(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "ncu_ran"
    fake = fake_ncu(bin_dir, f"touch {marker}\n")
    proc = run_script(
        "--dry-run", "--metrics", "dram__bytes_read.sum", "--", "--dtype", "bfloat16",
        path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path, TRAINERS="standard hooks",
        BATCH_SIZES="8", SEQ_LENS="256 1024", RUN_NAME="r",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    commands = [line[4:] for line in proc.stdout.splitlines() if line.startswith("==> ")]
    assert len(commands) == 4
    out = tmp_path / "out"
    assert commands[1].startswith(  # the suite's default: app-range replay
        f"{fake} --replay-mode app-range --clock-control none --metrics dram__bytes_read.sum "
        f"--target-processes all -f -o {out}/report_dpsgd_bs8_seq256 {sys.executable} "
        "profiling_script.py --mode=profile --trainer=dpsgd --batch_size=8 --seq_len=256"
    )
    assert commands[1].endswith(
        "--hidden_dim 1024 --num_layers 1 --num_heads 16 --vocab_size 32000 "
        f"--output_dir {out}/runs --run_name r --resume --dtype bfloat16 --ncu"
    )
    assert "--profile-from-start" not in proc.stdout
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize(
    "option", [["--replay-mode", "kernel"], ["--replay_mode", "kernel"], ["--replay-mode=kernel"]]
)
def test_script_dry_run_kernel_replay(tmp_path, option):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = fake_ncu(bin_dir, "exit 1\n")
    proc = run_script(
        "--dry-run", *option, path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path,
        TRAINERS="flash", BATCH_SIZES="8", SEQ_LENS="256",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    commands = [line[4:] for line in proc.stdout.splitlines() if line.startswith("==> ")]
    assert len(commands) == 1
    assert commands[0].startswith(f"{fake} --profile-from-start off --clock-control none ")
    assert "--replay-mode" not in commands[0]


@pytest.mark.parametrize("option", [["--replay-mode", "bogus"], ["--replay_mode=bogus"]])
def test_script_rejects_unknown_replay_mode(tmp_path, option):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "ncu_ran"
    fake_ncu(bin_dir, f"touch {marker}\n")
    proc = run_script(*option, path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --replay-mode must be app-range, kernel or range (got 'bogus')"
    ]
    assert "==>" not in proc.stdout
    assert not marker.exists() and not (tmp_path / "out").exists()
    missing = run_script("--replay-mode", path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: --replay-mode needs a value"


def test_ncu_step_result_is_reported_without_numbers(tmp_path):
    """Under --ncu the worker's result is ok with null times and peaks (a replayed step is no
    measurement): the progress line and every summary file must say so, not crash on None."""
    config = ExperimentConfig("dpsgd", 8, 256, ncu=True)
    result = result_skeleton(config, "ok")
    result["env"] = {"ncu_note": "one step ran inside cudaProfilerStart/Stop"}
    assert result["median_time_ms"] is None and result["peak_memory_mb"] is None
    assert "cudaProfilerStart" in progress.describe(result)
    run_dir = tmp_path / "run"
    (run_dir / config.config_dir).mkdir(parents=True)
    write_json(str(run_dir / config.config_dir / "result.json"), result)
    report.write_summary(str(run_dir), report.load_results(str(run_dir)))
    text = (run_dir / "summary.txt").read_text()
    assert "n/a" in text and "dpsgd" in (run_dir / "summary.md").read_text()


def test_a_finished_ncu_config_is_profiled_again_on_resume(tmp_path):
    """The suite passes --resume so configs can share one run directory; an ncu config must
    still run each time ncu launches it (again in every metric pass of app-range replay), or
    ncu would overwrite a good report with an empty one. Other finished configs are skipped."""

    def write(ncu_flag):
        config = ExperimentConfig(trainer="standard", batch_size=1, seq_len=4, ncu=ncu_flag)
        path = str(tmp_path / config.config_dir / "result.json")
        write_json(path, result_skeleton(config, "ok"), root=str(tmp_path))
        return path

    def finished(path):
        return processes.finished_result(path, str(tmp_path), resume=True)

    assert finished(write(True)) is None
    assert finished(write(False))["status"] == "ok"
