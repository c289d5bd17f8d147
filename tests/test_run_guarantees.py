"""What a run promises under faults: signals, one process per run directory, unique default
names, secrets kept off the screen, and the messages a user sees (--help, fallbacks)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import ROOT, cli, results_in, running_worker, small_run_args

import profiling_script
from dp_cost.core import rundir
from dp_cost.core.schema import TRAINER_ALIASES, TRAINER_ORDER
from dp_cost.core.settings import LM_MODELS
from dp_cost.hf.configs import HF_CONFIGS
from dp_cost.measure import plan


def start_long_run(tmp_path):
    """A run of a short config, then a long one; returns once the long one's worker runs. (30
    steps of this model take about 0.05 s at batch 1 and 0.75 s at batch 256 on the development
    machine: the signal sent next reaches the CLI while the second config is measured.)"""
    args = small_run_args(tmp_path, "standard", batch_sizes=(1, 256), steps=30)
    proc = subprocess.Popen(
        [sys.executable, "profiling_script.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    running_worker(proc, tmp_path / "r" / "standard_bs256_seq8")  # the first config is done
    return proc


def assert_only_complete_results(run_dir):
    results = results_in(run_dir)
    assert list(results) == ["standard_bs1_seq8"] and results["standard_bs1_seq8"]["status"] == "ok"
    assert not (run_dir / "standard_bs256_seq8").exists()  # no empty directory left behind
    assert not list(run_dir.rglob(".trace-*")) and not list(run_dir.rglob("*.tmp*"))
    assert (run_dir / "summary.csv").exists()


def test_sigterm_is_handled_like_ctrl_c_with_exit_143(tmp_path):
    proc = start_long_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert "Interrupted" in stdout and "Traceback" not in stderr
    assert_only_complete_results(tmp_path / "r")


def test_a_second_ctrl_c_while_the_first_is_handled_prints_no_traceback(tmp_path):
    proc = start_long_run(tmp_path)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "Traceback" not in stderr + stdout
    assert_only_complete_results(tmp_path / "r")


@pytest.mark.parametrize(
    ("signals", "code"),
    [((signal.SIGINT,), 130), ((signal.SIGINT, signal.SIGINT), 130), ((signal.SIGTERM,), 143)],
)
def test_an_interrupt_during_a_start_up_import_waits_for_its_end(
    tmp_path, monkeypatch, capsys, signals, code
):
    """Signals that arrive while a module is being imported (torch, opacus, scipy, numpy: the
    seconds of start-up) interrupt once that import is over: no module is left half imported
    (numpy's "cannot load module more than once", a RecursionError), one line and the command
    that continues, the code of the signal."""
    module = tmp_path / "interrupted_while_imported.py"
    kills = "".join(f"os.kill(os.getpid(), {int(s)})\n" for s in signals)
    module.write_text(f"import os\n{kills}import json\nWHOLE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "interrupted_while_imported", raising=False)
    real_plan = plan.make_plan

    def importing_plan(args, cuda_available):
        import interrupted_while_imported  # noqa: F401 - the start-up's imports, in small

        return real_plan(args, cuda_available)

    monkeypatch.setattr(plan, "make_plan", importing_plan)
    assert profiling_script.main(small_run_args(tmp_path, "standard")) == code
    assert sys.modules["interrupted_while_imported"].WHOLE
    err = capsys.readouterr().err
    assert err.startswith("\nInterrupted before any config ran.\nContinue this run with: ")
    assert err.count("\n") == 3 and "Traceback" not in err


def test_ctrl_c_during_start_up_exits_130_without_traceback(tmp_path):
    """The start-up for real: two SIGINTs from inside numpy's import (numpy.linalg, imported by
    numpy's own __init__, while opacus and torch load), which a half-done import turned into a
    RecursionError."""
    hook = (
        "import importlib.abc, os, runpy, signal, sys\n"
        "class Interrupt(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'numpy.linalg':\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['profiling_script.py', *sys.argv[1:]]\n"
        "runpy.run_path('profiling_script.py', run_name='__main__')\n"
    )
    args = small_run_args(tmp_path, "standard")
    proc = subprocess.run([sys.executable, "-c", hook, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Interrupted before any config ran." in proc.stderr and not (tmp_path / "r").exists()


def test_a_run_whose_stdout_and_stderr_are_lost_goes_on_to_its_end(tmp_path, monkeypatch):
    """stdout a pipe whose reader ended (`| head -1`), stderr a full disk: lost from the first
    line on, and the run measures its config, writes its summary and exits 0, silently."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write: a broken pipe
    full = os.open("/dev/full", os.O_WRONLY)  # every write: no space left on device
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(write_end, 1)
        os.dup2(full, 2)
        monkeypatch.setattr(sys, "stdout", open(1, "w", buffering=1, closefd=False))  # noqa: SIM115
        monkeypatch.setattr(sys, "stderr", open(2, "w", buffering=1, closefd=False))  # noqa: SIM115
        code = profiling_script.main(small_run_args(tmp_path, "standard"))
    finally:
        for fd, saved_fd in zip((1, 2), saved, strict=True):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        os.close(write_end)
        os.close(full)
    assert code == 0
    assert results_in(tmp_path / "r")["standard_bs2_seq8"]["status"] == "ok"
    assert (tmp_path / "r" / "summary.csv").read_text().count("\nstandard,") == 1


def test_a_second_process_on_a_locked_run_directory_stops(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    lock = rundir.RunLock(str(tmp_path / "r"))  # another run holds it (an open description)
    try:
        code = profiling_script.main([*small_run_args(tmp_path, "standard"), "--resume"])
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert code == 2 and f"in use by another run (pid {os.getpid()})" in err
    assert len(err.strip().splitlines()) == 1
    assert not results_in(tmp_path / "r")


def test_two_runs_in_the_same_second_with_the_default_name_both_run(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101_000000")
    args = small_run_args(tmp_path, "standard", run_name=None)
    assert profiling_script.main(args) == 0
    assert profiling_script.main(args) == 0
    assert sorted(os.listdir(tmp_path)) == ["test_20260101_000000", "test_20260101_000000_2"]
    assert results_in(tmp_path / "test_20260101_000000_2")["standard_bs2_seq8"]["status"] == "ok"


def test_a_run_directory_that_is_a_symlink_out_of_output_dir_is_refused(tmp_path, capsys):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "out" / "r")
    args = small_run_args(tmp_path / "out", "standard")
    assert profiling_script.main([*args, "--resume"]) == 2
    assert "outside" in capsys.readouterr().err
    assert not any((tmp_path / "elsewhere").iterdir())


def test_token_on_the_command_line_warns_and_token_file_is_read(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    secret = "hf_ThisIsNotARealToken0123456789"
    args = small_run_args(tmp_path, "standard", run_name="a")
    assert profiling_script.main([*args, "--token", secret]) == 0
    err = capsys.readouterr().err
    assert "visible to other users" in err and "HF_TOKEN" in err and "--token_file" in err
    assert secret not in err
    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "token").write_text(secret + "\n")
    args = small_run_args(tmp_path, "standard", run_name="b")
    assert profiling_script.main([*args, "--token_file", str(tmp_path / "token")]) == 0
    assert os.environ["HF_TOKEN"] == secret
    assert "visible to other users" not in capsys.readouterr().err


def test_report_of_a_parent_of_runs_lists_the_run_folders(tmp_path, capsys):
    for run in ("first", "second"):
        (tmp_path / run / "standard_bs2_seq8").mkdir(parents=True)
        (tmp_path / run / "standard_bs2_seq8" / "result.json").write_text("{}")
    assert profiling_script.main(["--mode=report", "--input_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "first") in err and str(tmp_path / "second") in err


def test_help_explains_every_flag_once_with_names_and_defaults():
    proc = cli("--help", timeout=60)
    assert proc.returncode == 0
    parser = profiling_script.build_parser()
    for action in parser._actions:
        assert action.help and "()" not in action.help, action.option_strings
        assert action.help.count("default") <= 1, action.option_strings
    for name in (*TRAINER_ORDER, *TRAINER_ALIASES, *LM_MODELS, *HF_CONFIGS):
        assert name in " ".join(proc.stdout.split()).replace("- ", "-"), name
    assert "(default: test)" in " ".join(proc.stdout.split())


def test_lm_model_names_in_help_are_the_models_configs():
    import models

    assert LM_MODELS == tuple(models.CONFIGS)


def test_one_config_is_one_config_and_the_system_temporary_folder_stays_as_it_was(tmp_path):
    """A run of the program (a fresh process: torch's inductor cache is made when torch._dynamo
    is first imported, by default in the system's temporary folder) leaves TMPDIR as it was."""
    system_temporaries = tmp_path / "tmp"
    system_temporaries.mkdir()
    env = {**os.environ, "TMPDIR": str(system_temporaries)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = cli(*small_run_args(tmp_path / "out", "standard"), env=env)
    assert proc.returncode == 0 and "1 config on cpu" in proc.stdout
    assert not os.listdir(system_temporaries)


def test_readme_lists_the_signal_exit_codes():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "130" in readme and "143" in readme and "## Guarantees" in readme
    # Exactly two set-up commands at the top, the CPU-only torch said BEFORE them (a literal
    # reader would otherwise download the multi-GB CUDA build first), and how long they take.
    before, block = readme.split("```bash\n", 1)
    block, after = block.split("```", 1)
    assert len(block.strip().splitlines()) == 2
    assert "download.pytorch.org/whl/cpu" in before
    assert "minutes" in after.split("##", 1)[0]


def test_ncu_script_dry_run_needs_no_ncu(tmp_path):
    bin_dir = tmp_path / "bin"  # python alone on PATH: no ncu anywhere
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python3")
    proc = subprocess.run(
        ["bash", "run_profiling_ncu.sh", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUTPUT_DIR": str(tmp_path / "reports")},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("==> ncu ") == 16  # 4 trainers x 2 batches x 2 sequence lengths
    assert not (tmp_path / "reports").exists()
