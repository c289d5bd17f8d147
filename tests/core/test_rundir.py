"""The run directory: contained names, usable output directories, one process per run."""

import os
import shutil
import subprocess
import sys

import pytest

from dp_cost.core import rundir
from dp_cost.core.settings import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "../x", "a/b", "a\\b", "/abs", "a\x00b", "a\nb", "tab\there", "x" * 101],
)
def test_run_name_must_be_one_plain_component(name):
    with pytest.raises(UsageError, match="--run_name"):
        rundir.check_run_name(name)


def test_plain_run_names_pass():
    for name in ("r", "run_1", "my.run", "x" * 100, "ünï"):
        rundir.check_run_name(name)


def test_output_dir_that_is_a_file_or_under_proc_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="not a directory"):
        rundir.check_output_dir(str(tmp_path / "file"))
    with pytest.raises(UsageError, match="not a directory"):
        rundir.check_output_dir(str(tmp_path / "file" / "below"))
    with pytest.raises(UsageError, match="system directory"):
        rundir.check_output_dir("/proc/self/runs")
    rundir.check_output_dir(str(tmp_path / "new" / "deeper"))  # creatable: fine
    assert not (tmp_path / "new").exists()  # ... and the check creates nothing


def test_read_only_output_dir_is_refused_even_for_root(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    # Root ignores permission bits; an immutable directory refuses even root.
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(locked)]).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        with pytest.raises(UsageError, match="not writable"):
            rundir.check_output_dir(str(locked))
        with pytest.raises(UsageError, match="not writable"):
            rundir.check_output_dir(str(locked / "runs"))
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)


def test_resume_needs_an_existing_run_directory_named(tmp_path):
    with pytest.raises(UsageError, match=f"no run directory {tmp_path}/nosuchrun to continue"):
        rundir.check_resumable(str(tmp_path), "nosuchrun")
    with pytest.raises(UsageError, match="name it with --run_name"):
        rundir.check_resumable(str(tmp_path), None)  # a default name is a new one
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UsageError, match="no run directory"):
        rundir.check_resumable(str(tmp_path), "a_file")
    (tmp_path / "r").mkdir()
    assert rundir.check_resumable(str(tmp_path), "r") == str(tmp_path / "r")
    assert sorted(os.listdir(tmp_path)) == ["a_file", "r"]  # nothing created


def test_paths_are_contained_after_resolving_symlinks(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "run" / "config")
    assert rundir.contained(str(tmp_path / "run"), str(tmp_path / "run" / "a" / "b"))
    assert not rundir.contained(str(tmp_path / "run"), str(tmp_path / "run" / "config"))
    assert not rundir.contained(str(tmp_path / "run"), str(tmp_path / "run-other"))
    with pytest.raises(UsageError, match="outside"):
        rundir.check_contained(str(tmp_path / "run"), str(tmp_path / "run" / "config" / "x"))


def test_a_default_name_taken_in_the_same_second_gets_a_suffix(tmp_path):
    first = rundir.new_run_dir(str(tmp_path), "test_20260101_000000", numbered=True)
    second = rundir.new_run_dir(str(tmp_path), "test_20260101_000000", numbered=True)
    third = rundir.new_run_dir(str(tmp_path), "test_20260101_000000", numbered=True)
    assert [os.path.basename(p) for p in (first, second, third)] == [
        "test_20260101_000000",
        "test_20260101_000000_2",
        "test_20260101_000000_3",
    ]
    with pytest.raises(UsageError, match="exists"):
        rundir.new_run_dir(str(tmp_path), "test_20260101_000000", numbered=False)


def test_a_second_process_on_a_locked_run_stops_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from dp_cost.core import rundir; rundir.RunLock(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError, match=f"in use by another run \\(pid {holder.pid}\\)"):
            rundir.RunLock(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    lock = rundir.RunLock(str(tmp_path))  # the kernel dropped the dead holder's lock
    lock.release()


def test_the_command_that_continues_a_run_resumes_only_a_run_directory_that_stays(tmp_path):
    """After an interrupt: --resume where the run directory stays, the same name without it
    where the directory this run made held nothing and goes (--resume refuses a missing run)."""
    from dp_cost.core import interrupts

    os.mkdir(tmp_path / "r")
    run = rundir.RunDir(str(tmp_path / "r"), made=True, kept_names=("run.json",))
    try:
        (tmp_path / "r" / "run.json").write_text("{}")
        assert not rundir.kept_after_close(run.path)  # only bookkeeping: removed on close
        (tmp_path / "r" / "flash_bs2_seq8").mkdir()
        assert rundir.kept_after_close(run.path)
    finally:
        run.close()
    assert rundir.kept_after_close(str(tmp_path / "r"))  # closed, still there
    assert not rundir.kept_after_close(str(tmp_path / "gone"))
    words = ["profiling_script.py", "--mode=test", "--resume", "--run_name", "old", "--steps", "2"]
    resumed = interrupts.continue_command(words, "r", resume=True).split()
    assert resumed[-5:] == ["--steps", "2", "--resume", "--run_name", "r"]
    again = interrupts.continue_command(words, "r", resume=False).split()
    assert again[-4:] == ["--steps", "2", "--run_name", "r"] and "--resume" not in again
