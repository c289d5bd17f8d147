"""What an interrupted run promises: Ctrl-C, SIGTERM and SIGHUP (a dropped ssh session) before,
during or after the configs keep every finished result and its summary, print the command
that continues the run, and leave no process, no half-written file and no run directory with
nothing in it behind; and what the workers' stderr filter drops of the libraries' noise."""

import contextlib
import errno
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from cli_helpers import ROOT, in_process, results_in, running_worker, small_run_args, wait_for

from dp_cost.core import interrupts
from dp_cost.measure import children, processes, quiet, run
from dp_cost.report import summary

TOKEN = "hf_NotARealTokenButLooksLikeOne123"


@pytest.fixture
def hangup_handled():
    """SIGHUP at its default, as in a login session (a test run under nohup ignores it, and an
    ignored hangup stays ignored by design)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


def continue_args(stderr: str) -> list[str]:
    """The arguments of the command an interrupted run printed to continue it."""
    lines = [line for line in stderr.splitlines() if line.startswith(interrupts.CONTINUE)]
    assert len(lines) == 1, stderr[-2000:]
    words = shlex.split(lines[0][len(interrupts.CONTINUE) :])
    assert words[1].endswith("profiling_script.py"), words
    return words[2:]


def assert_only_complete_results(run_dir):
    results = results_in(run_dir)
    assert results and all(r["status"] == "ok" for r in results.values())
    config_dirs = [p for p in run_dir.iterdir() if p.is_dir() and p.name != "visualizations"]
    assert sorted(p.name for p in config_dirs) == sorted(results)  # no empty one left
    assert not list(run_dir.rglob(".trace-*")) and not list(run_dir.rglob("*.tmp*"))
    assert (run_dir / "summary.csv").exists()


def start_cli(args, **options):
    return subprocess.Popen(
        [sys.executable, "profiling_script.py", *map(str, args)], cwd=ROOT, **options
    )


def gone(pid: int) -> bool:
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=5)
    return not os.path.exists(f"/proc/{pid}")


def test_a_hangup_with_the_terminal_gone_exits_143_and_keeps_what_finished(tmp_path):
    """A dropped ssh session: the terminal is gone (every write to it fails) and SIGHUP comes."""
    master, terminal = os.openpty()
    args = small_run_args(tmp_path, "standard", batch_sizes=(1, 2), steps=60)
    proc = start_cli(
        args,
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # not under nohup
    )
    os.close(terminal)
    try:
        wait_for((tmp_path / "r" / "standard_bs1_seq8" / "result.json").exists, cli=proc)
    finally:
        os.close(master)  # the terminal is gone
    try:
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=120) == 143
    finally:
        proc.kill()
    assert_only_complete_results(tmp_path / "r")


def test_sigterm_ends_a_stopped_worker_and_leaves_no_process(tmp_path):
    args = small_run_args(tmp_path, "standard", steps=10_000)
    proc = start_cli(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = running_worker(proc, tmp_path / "r" / "standard_bs2_seq8")
        os.kill(worker, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=children.KILL_GRACE_S + 30)
    finally:
        proc.kill()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-2000:]
    assert gone(worker)
    assert not (tmp_path / "r").exists()  # nothing was written: the directory it made is gone
    rest = continue_args(stderr)  # ... so the same name starts again: --resume needs a run
    assert rest[-2:] == ["--run_name", "r"] and "--resume" not in rest


def test_ctrl_c_stops_a_run_started_with_sigint_ignored(tmp_path):
    """A job a shell script puts in the background starts with SIGINT ignored: kill -INT (or
    Ctrl-C once in the foreground) still stops it as Ctrl-C does."""
    args = small_run_args(tmp_path, "standard", steps=10_000)
    proc = start_cli(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        worker = running_worker(proc, tmp_path / "r" / "standard_bs2_seq8")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert gone(worker) and "Traceback" not in stderr
    rest = continue_args(stderr)  # nothing finished, the run directory removed: no --resume
    assert rest[-2:] == ["--run_name", "r"] and "--resume" not in rest


def interrupting_summary(monkeypatch, *then):
    """summary.write_summary whose first call is interrupted by SIGTERM (the report was being
    drawn); later calls do what ``then`` says in turn (None: the real one)."""
    real, calls = summary.write_summary, []

    def write_summary(run_dir, results):
        calls.append(run_dir)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGTERM)
        step = then[len(calls) - 2] if len(calls) - 2 < len(then) else None
        if step is not None:
            step()
        return real(run_dir, results)

    monkeypatch.setattr(summary, "write_summary", write_summary)
    return calls


def test_sigterm_while_the_report_is_drawn_keeps_every_result_and_writes_the_summary(
    tmp_path, monkeypatch
):
    calls = interrupting_summary(monkeypatch)
    proc = in_process(*small_run_args(tmp_path, "standard"), "--token", TOKEN)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "before any config ran" not in proc.stdout + proc.stderr
    assert "every config had finished: 1 finished config kept" in proc.stdout
    assert len(calls) == 2  # the summary, written again once the signal was handled
    assert_only_complete_results(tmp_path / "r")
    assert (tmp_path / "r" / "report.html").exists()
    rest = continue_args(proc.stderr)
    assert TOKEN not in proc.stderr and rest[rest.index("--token") + 1] == "<hidden>"
    assert rest[-3:] == ["--resume", "--run_name", "r"]
    monkeypatch.undo()
    again = in_process(*rest)  # the continued run has nothing left to measure
    assert again.returncode == 0, again.stderr[-2000:]
    assert "ok (resumed)" in again.stdout


def test_a_summary_that_cannot_be_written_after_an_interrupt_names_the_report_command(
    tmp_path, monkeypatch
):
    def disk_full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    interrupting_summary(monkeypatch, disk_full)
    proc = in_process(*small_run_args(tmp_path, "standard"))
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "No space left on device" in proc.stderr
    report = [line for line in proc.stderr.splitlines() if "--mode=report" in line]
    words = shlex.split(report[0].split(": ", 1)[1])
    assert words[2:] == ["--mode=report", "--input_dir", str(tmp_path / "r")]
    monkeypatch.undo()
    assert in_process(*words[2:]).returncode == 0
    assert (tmp_path / "r" / "summary.csv").exists()


def signalling_worker(signum):
    """A worker that interrupts the CLI (its parent) as it starts, then runs until stopped."""

    def worker_main(*args, **kwargs):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as the real one: terminate() ends it
        os.kill(os.getppid(), signum)
        time.sleep(60)

    return worker_main


@pytest.mark.parametrize(
    ("signum", "code"),
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 143)],
)
def test_an_interrupt_during_a_config_prints_the_command_that_continues_the_run(
    tmp_path, monkeypatch, hangup_handled, signum, code
):
    monkeypatch.setattr(children, "worker_main", signalling_worker(signum))
    args = small_run_args(tmp_path, "standard", run_name=None)  # the default, timestamped name
    proc = in_process(*args)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Interrupted during standard_bs2_seq8; 0 finished configs kept." in proc.stdout
    assert os.listdir(tmp_path) == []  # the run directory held nothing: removed
    rest = continue_args(proc.stderr)  # the same name again, not --resume of a missing run
    assert rest[-2] == "--run_name" and rest[-1].startswith("test_") and "--resume" not in rest
    monkeypatch.undo()
    again = in_process(*rest)
    assert again.returncode == 0, again.stderr[-2000:]
    assert list(results_in(tmp_path / rest[-1])) == ["standard_bs2_seq8"]


def test_an_interrupt_never_removes_a_run_directory_it_did_not_create(tmp_path, monkeypatch):
    monkeypatch.setattr(children, "worker_main", signalling_worker(signal.SIGINT))
    (tmp_path / "r").mkdir()
    proc = in_process(*small_run_args(tmp_path, "standard"), "--resume")
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert (tmp_path / "r").is_dir()
    assert continue_args(proc.stderr)[-3:] == ["--resume", "--run_name", "r"]


def test_an_interrupt_before_any_config_removes_the_run_directory_and_says_how_to_go_on(
    tmp_path, monkeypatch, hangup_handled
):
    def interrupted_record(run_dir, command):
        signal.raise_signal(signal.SIGHUP)

    monkeypatch.setattr(run, "record_run", interrupted_record)
    proc = in_process(*small_run_args(tmp_path, "standard"))
    assert proc.returncode == 143
    assert "Interrupted before any config ran." in proc.stderr
    assert os.listdir(tmp_path) == []
    assert "--resume" not in continue_args(proc.stderr)  # no run to resume: the same name again
    monkeypatch.undo()
    assert in_process(*continue_args(proc.stderr)).returncode == 0
    assert list(results_in(tmp_path / "r")) == ["standard_bs2_seq8"]


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, monkeypatch):
    def stubborn(*args, **kwargs):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(60)

    monkeypatch.setattr(children, "worker_main", stubborn)
    monkeypatch.setattr(children, "KILL_GRACE_S", 0.5)
    started = time.monotonic()
    proc = in_process(*small_run_args(tmp_path, "standard"))
    assert proc.returncode == 143 and time.monotonic() - started < 30


fork_signal = []  # what the parent's side of the next fork raises (a hook registered once)
fork_hook = []


def raise_in_fork():
    if fork_signal:
        signal.raise_signal(fork_signal.pop())


def test_a_signal_that_arrives_while_a_worker_is_forked_is_not_lost(tmp_path, monkeypatch):
    """Raised inside fork's own callbacks, Python would print the interrupt and drop it."""
    if not fork_hook:  # it stays for the test process's life: idle unless fork_signal is set
        os.register_at_fork(after_in_parent=raise_in_fork)
        fork_hook.append(raise_in_fork)
    run_in_child = processes.run_in_child

    def run_in_child_signalled_in_fork(*args, **kwargs):
        fork_signal.append(signal.SIGTERM)
        return run_in_child(*args, **kwargs)

    monkeypatch.setattr(processes, "run_in_child", run_in_child_signalled_in_fork)
    try:
        proc = in_process(*small_run_args(tmp_path, "standard"))
    finally:
        fork_signal.clear()
    assert proc.returncode == 143, proc.stdout[-2000:]
    assert "Interrupted during standard_bs2_seq8" in proc.stdout
    assert "Exception ignored" not in proc.stderr


def test_the_libraries_known_noise_goes_through_the_workers_filter():
    """What reached stderr around it: torch's all_gather_into_tensor deprecation (flash under
    DDP), the profiler's warnings (Python ones, and its C++ event collection's), and Kineto's
    line per trace event it cannot write to a full disk."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.filter_warnings()
        with pytest.raises(ValueError):  # no process group: it warns first
            torch.distributed.all_gather_into_tensor(torch.zeros(2), torch.zeros(1))
        warnings.warn_explicit(
            "Warning: Profiler clears events at the end of each cycle.",
            UserWarning,
            "torch/profiler/profiler.py",
            300,
            module="torch.profiler.profiler",
        )
        warnings.warn_explicit(
            "Profiler observed an unexpected step (Triggered internally at "
            "/__w/pytorch/pytorch/torch/csrc/profiler/collection.cpp:1234.)",
            UserWarning,
            "dp_cost/measure/tracing.py",
            45,
            module="dp_cost.measure.tracing",
        )
        warnings.warn("a warning of our own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning of our own"]
    assert quiet.is_noise(
        "[W1127 12:00:00.000000000 4242 torch/csrc/profiler/collection.cpp:1234] Warning: x\n"
    )
    assert quiet.is_noise("ERROR:2026-11-27 12:00:00 1:1 output_json.cpp:641] "
                          "Failed to write to log file!\n")  # fmt: skip
    assert not quiet.is_noise("OSError: [Errno 28] No space left on device\n")


def test_a_workers_output_never_fails_when_the_terminal_is_gone():
    """The parent drains the worker's stderr even when its own stderr fails (EIO, EPIPE): the
    worker's writes neither fail nor block."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # writes to it fail from now on
    stderr = quiet.FilteredStderr(target_fd=write_end)
    pid = os.fork()
    if pid == 0:  # the worker: far more than a pipe holds; exit 0 if every write went through
        code = 1
        try:
            stderr.attach()
            for _ in range(64):
                os.write(2, b"x" * 8191 + b"\n")
            code = 0
        finally:
            os._exit(code)
    stderr.started()
    ended = []
    try:
        wait_for(lambda: ended.append(os.waitpid(pid, os.WNOHANG)) or ended[-1][0] == pid, 10)
    finally:
        if not ended or ended[-1][0] != pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        stderr.close()
        os.close(write_end)
    assert os.waitstatus_to_exitcode(ended[-1][1]) == 0


def interrupt_in_a_long_finalizer():
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 0.3  # longer than RETRY_S: the alarm comes while it runs
    while time.monotonic() < deadline:
        pass


@pytest.mark.parametrize("where", ["__del__", "collection", "weakref callback"])
def test_an_interrupt_that_arrives_in_a_finalizer_is_raised_after_it(where):
    """Python drops what a finalizer raises ("Exception ignored in ..."): an interrupt raised
    in a ``__del__``, or in a weakref callback the garbage collector runs, would be lost and the
    run would go on. It is raised once the finalizer is over."""
    import gc
    import weakref

    class Dying:
        def __del__(self):
            interrupt_in_a_long_finalizer()

    class Cycle:
        def __init__(self):
            self.me = self  # freed only by the garbage collector

    previous = interrupts.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            if where == "__del__":
                Dying()  # no reference kept: __del__ at once
            elif where == "weakref callback":  # run where the last reference goes: dropped
                dying = Cycle()
                weakref.finalize(dying, interrupt_in_a_long_finalizer)
                dying.me = None
                del dying
            else:
                weakref.finalize(Cycle(), interrupt_in_a_long_finalizer)
                gc.collect()
            time.sleep(2)  # the interrupt arrives here, not later, and not never
    finally:
        interrupts.restore(previous)
