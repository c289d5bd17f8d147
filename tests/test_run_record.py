"""What produced a run is recorded beside it (run.json) and opens report.html: the command
line (a token on it hidden), the date, the versions; a resume adds its own command."""

import datetime
import json
import os
import platform

import opacus
import torch
from cli_helpers import in_process, small_run_args

from dp_cost.report import run_info


def test_run_json_records_the_command_date_and_versions(tmp_path):
    args = small_run_args(tmp_path, "standard")
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    proc = in_process(*args, "--token", "hf_abcdefghijklmnopqrstuvwxyz123456")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "r" / "run.json").read_text())
    assert record["command"][0] == "profiling_script.py"
    assert record["command"][1:-2] == args and record["command"][-2:] == ["--token", "<hidden>"]
    assert before <= datetime.datetime.fromisoformat(record["date"])
    versions = record["versions"]
    assert versions["torch"] == torch.__version__ and versions["opacus"] == opacus.__version__
    assert versions["python"] == platform.python_version()
    page = (tmp_path / "r" / "report.html").read_text()
    assert "profiling_script.py --mode=test" in page and "hf_abcdef" not in page

    proc = in_process(*args, "--resume")
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads((tmp_path / "r" / "run.json").read_text())
    assert resumed["command"] == record["command"] and resumed["date"] == record["date"]
    assert resumed["resumed"][0]["command"][-1] == "--resume"
    # the machine's load while each measured: the OS's own numbers, at the start and the end
    for load in (record["machine_load"], resumed["resumed"][0]["machine_load"]):
        for moment in ("at_start", "at_end"):
            assert load[moment]["cpus"] == os.cpu_count()
            assert 0 <= load[moment]["load"] <= 100 * os.cpu_count()
        assert load["own_processes"] == 1  # one worker at a time


def test_a_busy_machine_is_named_beside_the_table():
    quiet, busy = {"cpus": 2, "load": 0.3}, {"cpus": 2, "load": 3.5}
    assert run_info.busy_note(quiet, {"cpus": 2, "load": 1.9}) is None  # the run's own worker
    assert "load average 3.5 at the start, 1.9 at the end, on 2 CPUs" in run_info.busy_note(
        busy, {"cpus": 2, "load": 1.9}
    )
    assert run_info.busy_note(quiet, {"cpus": 2, "load": 2.2}) is not None
    assert run_info.busy_note({"cpus": 2, "load": None}, busy) is None  # not measured: no claim
    # the load beyond the run's own processes must exceed half the CPUs
    assert run_info.busy_note({"cpus": 2, "load": 1.19}, {"cpus": 2, "load": 1.19}) is None
    assert run_info.busy_note({"cpus": 2, "load": 2.01}, {"cpus": 2, "load": 1.0}) is not None
    assert run_info.busy_note({"cpus": 8, "load": 5.5}, {"cpus": 8, "load": 5.5}, own=2) is None


def test_the_busy_note_of_a_run_is_its_latest_measuring(tmp_path):
    """run.json's machine_load: the run's, or its last resume's; a file without one (or a
    broken one) makes no claim."""
    busy = {"at_start": {"cpus": 2, "load": 3.5}, "at_end": {"cpus": 2, "load": 3.0}}
    quiet = {"at_start": {"cpus": 2, "load": 0.2}, "at_end": {"cpus": 2, "load": 1.1}}
    record = {"command": ["x"], "machine_load": busy}
    (tmp_path / "run.json").write_text(json.dumps(record))
    assert "on 2 CPUs, about 1 of it this run's own" in run_info.run_busy_note(str(tmp_path))
    record["resumed"] = [{"command": ["x"], "machine_load": quiet}]
    (tmp_path / "run.json").write_text(json.dumps(record))
    assert run_info.run_busy_note(str(tmp_path)) is None
    record["resumed"][0]["machine_load"] = {**busy, "own_processes": 4}  # 4 ranks' workers
    (tmp_path / "run.json").write_text(json.dumps(record))
    assert run_info.run_busy_note(str(tmp_path)) is None
    (tmp_path / "run.json").write_text(json.dumps({"machine_load": {"at_start": "high"}}))
    assert run_info.run_busy_note(str(tmp_path)) is None


def test_the_commit_is_read_without_writing_the_checkout(tmp_path):
    """run.json's commit comes from git without a write to the user's checkout: a plain
    ``git status`` after a file's timestamp changed refreshes the index (taking
    .git/index.lock and rewriting .git/index)."""
    import subprocess

    from dp_cost.measure.run import git_commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("one\n")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    stamp = os.stat(tmp_path / "f.txt").st_mtime_ns + 5 * 10**9  # the same content, newer
    os.utime(tmp_path / "f.txt", ns=(stamp, stamp))
    index = tmp_path / ".git" / "index"
    before = (index.read_bytes(), os.stat(index).st_mtime_ns)
    commit = git_commit(str(tmp_path))
    assert commit is not None and not commit.endswith("+dirty")
    assert (index.read_bytes(), os.stat(index).st_mtime_ns) == before
