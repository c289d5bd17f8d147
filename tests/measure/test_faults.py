"""Faults inside a worker: host OOM, a full disk, a dead parent, NaNs, leftovers, noise."""

import contextlib
import errno
import json
import math
import multiprocessing
import os
import resource
import signal
import tempfile
import threading
import time

import pytest
import torch
from cli_helpers import in_process, results_in, small_run_args

import profiling_script
from dp_cost.core import interrupts, reading, rundir
from dp_cost.measure import children, plan, quiet, worker
from dp_cost.measure.config import ExperimentConfig


def test_host_oom_is_recorded_as_oom_rlimit_and_sigkill(tmp_path, monkeypatch):
    def out_of_host_memory(config, out_dir, rank_setup=None):
        if config.batch_size == 1:  # the OOM killer: a SIGKILL, simulated
            os.kill(os.getpid(), signal.SIGKILL)
        # A memory limit on this worker alone: the allocation fails as on a full host.
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (size + 2**28, resource.RLIM_INFINITY))
        torch.empty(2**34, dtype=torch.uint8)  # 16 GiB, past the limit

    monkeypatch.setattr(worker, "run_experiment", out_of_host_memory)
    code = profiling_script.main(small_run_args(tmp_path, "standard", batch_sizes=(1, 2)))
    assert code == 0  # an OOM is a measurement, not an error
    results = results_in(tmp_path / "r")
    killed, limited = results["standard_bs1_seq8"], results["standard_bs2_seq8"]
    assert killed["status"] == "oom" and "OOM killer" in killed["error"]
    assert limited["status"] == "oom" and "can't allocate memory" in limited["error"]


def test_a_worker_killed_mid_measurement_leaves_nothing_outside_the_run(tmp_path, monkeypatch):
    """The CPU peak's profiler export is a temporary file (tempfile): a worker killed while it
    lies there leaves it in the run's scratch folder, which the run removes, never in TMPDIR."""
    system_temporaries = tmp_path / "tmp"
    system_temporaries.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_temporaries))
    monkeypatch.setattr(tempfile, "tempdir", None)  # asked again: TMPDIR

    def killed_while_exporting(config, out_dir, rank_setup=None):
        with open(os.path.join(tempfile.mkdtemp(), "trace.json"), "w") as trace:
            trace.write("[")
            os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(worker, "run_experiment", killed_while_exporting)
    assert profiling_script.main(small_run_args(tmp_path / "out", "standard")) == 0
    assert results_in(tmp_path / "out" / "r")["standard_bs2_seq8"]["status"] == "oom"
    assert not os.listdir(system_temporaries)
    assert not [p for p in (tmp_path / "out" / "r").iterdir() if p.name.startswith(".scratch")]


def test_python_memory_error_is_oom():
    assert worker.is_oom(MemoryError())
    assert not worker.is_oom(RuntimeError("shape mismatch"))


def test_disk_full_names_no_space_left(tmp_path, monkeypatch, capsys):
    def disk_full(path, data, root=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(worker, "write_json", disk_full)  # the worker's writes only
    code = profiling_script.main(small_run_args(tmp_path, "standard"))
    assert code == 1
    result = results_in(tmp_path / "r")["standard_bs2_seq8"]
    assert result["status"] == "error"
    assert "No space left on device" in result["error"]
    assert "Traceback" not in capsys.readouterr().err


def test_a_worker_dies_with_its_parent(tmp_path, monkeypatch):
    """A killed CLI never leaves a worker measuring beside the next run. The CLI is a child of
    this process (torch and the measuring code imported, as the CLI has them when it forks), which
    forks a worker that measures for two minutes, as the CLI does; it is killed, and its worker
    must end with it."""
    measuring = lambda config, out_dir, rank_setup=None: time.sleep(120)  # noqa: E731
    monkeypatch.setattr(worker, "run_experiment", measuring)
    config = ExperimentConfig(trainer="standard", batch_size=1, seq_len=4)
    read_end, write_end = os.pipe()
    parent = os.fork()
    if parent == 0:  # the CLI: its worker forked, its pid said, then waited for
        try:
            os.close(read_end)
            context = multiprocessing.get_context("fork")
            process = context.Process(target=worker.worker_main, args=(config, str(tmp_path)))
            process.start()
            os.write(write_end, f"{process.pid}\n".encode())
            process.join()
        finally:
            os._exit(1)
    os.close(write_end)
    child = None
    try:
        with os.fdopen(read_end) as said:
            child = int(said.readline())
        assert alive(child)
        os.kill(parent, signal.SIGKILL)
        os.waitpid(parent, 0)
        deadline = time.time() + 10
        while alive(child) and time.time() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:  # whatever failed, no process is left behind
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(parent, signal.SIGKILL)
            os.waitpid(parent, 0)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_non_finite_measurements_are_null_with_a_reason(monkeypatch):
    config = ExperimentConfig(trainer="standard", batch_size=1, seq_len=4)

    def diverged(config, out_dir, rank_setup=None):
        result = worker.result_skeleton(config, "ok")
        result.update(env={}, losses=[1.0, math.nan], median_time_ms=2.0)
        return result

    monkeypatch.setattr(worker, "run_experiment", diverged)
    result = worker.classified_run(config, "unused")
    assert result["status"] == "error" and "losses[1]" in result["error"]

    def no_noise(config, out_dir, rank_setup=None):
        result = worker.result_skeleton(config, "ok")
        result.update(env={}, losses=[1.0], privacy={"epsilon": math.inf})
        return result

    monkeypatch.setattr(worker, "run_experiment", no_noise)
    result = worker.classified_run(config, "unused")
    assert result["status"] == "ok" and "privacy.epsilon" in result["env"]["non_finite_note"]


def test_leftovers_of_an_interrupted_worker_are_removed(tmp_path):
    config_dir = tmp_path / "standard_bs1_seq8"
    (config_dir / ".trace-abc").mkdir(parents=True)
    (config_dir / ".trace-abc" / "trace.pt.trace.json").write_text("{")
    (config_dir / "result.json.tmp12345678901234567890").write_text("{")
    children.remove_leftovers(str(config_dir))
    assert not config_dir.exists()  # nothing complete was in it
    kept = tmp_path / "kept"
    (kept / ".trace-x").mkdir(parents=True)
    (kept / "result.json").write_text("{}")
    children.remove_leftovers(str(kept))
    assert sorted(os.listdir(kept)) == ["result.json"]


def killed_runs_temporaries(run_dir) -> list:
    """Plant what a run killed while writing leaves: atomic writes' temporaries, and its scratch
    folder with a profiler export in it."""
    digits = "12345678901234567890"
    planted = [run_dir / f"summary.csv.tmp{digits}", run_dir / f"run.json.tmp{digits}",
               run_dir / "visualizations" / f"memory_curve.png.tmp{digits}",
               run_dir / ".scratch-0123456789abcdef" / "tmpq1w2e3" / "trace.json"]  # fmt: skip
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("half")
    return [*planted, run_dir / ".scratch-0123456789abcdef"]


def test_resume_and_the_report_remove_what_a_killed_run_left(tmp_path):
    """--resume and --mode=report remove a killed run's leftovers (only the toolkit's own
    names); the report leaves them while a live run holds the run's lock."""
    assert profiling_script.main(small_run_args(tmp_path, "standard")) == 0
    run_dir = tmp_path / "r"
    stale = run_dir / "standard_bs2_seq8" / ".trace-old"
    stale.mkdir()
    (run_dir / "standard_bs3_seq8").mkdir()  # an interrupted config's empty directory
    temporaries = killed_runs_temporaries(run_dir)
    (run_dir / "notes.tmp1").write_text("the user's")
    args = small_run_args(tmp_path, "standard", batch_sizes=(2,))
    assert profiling_script.main([*args, "--resume"]) == 0
    assert not stale.exists() and not (run_dir / "standard_bs3_seq8").exists()
    assert not any(path.exists() for path in temporaries)
    temporaries = killed_runs_temporaries(run_dir)
    live = rundir.RunLock(str(run_dir))  # a run measuring there now: its files are in flight
    try:
        assert not rundir.remove_stale_temporaries(str(run_dir))  # what the report calls
        assert all(path.exists() for path in temporaries)
    finally:
        live.release()
    assert profiling_script.main(["--mode=report", "--input_dir", str(run_dir)]) == 0
    assert not any(path.exists() for path in temporaries)
    assert (run_dir / "notes.tmp1").read_text() == "the user's"


def test_resume_measures_again_a_result_the_report_would_leave_out(tmp_path, capsys):
    """A finished result whose time is a string, or 1e999 (infinity once parsed): resume warns
    once, measures it again, and the summary has its row."""
    args = small_run_args(tmp_path, "standard", batch_sizes=(1, 2))
    for config, median in zip(plan.make_plan(profiling_script.parse_args(args), None).configs,
                              ('"fast"', "1e999"), strict=True):  # fmt: skip
        result = worker.result_skeleton(config, "ok") | {"median_time_ms": 1234.5}
        path = tmp_path / "r" / config.config_dir / "result.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(result).replace("1234.5", median))
    assert profiling_script.main([*args, "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "(resumed)" not in out and err.count("measured again") == 2, err
    assert "'median_time_ms' has the wrong type: measured again" in err
    assert all(isinstance(r["median_time_ms"], float) for r in results_in(tmp_path / "r").values())
    assert (tmp_path / "r" / "summary.csv").read_text().count("\nstandard,") == 2


def test_a_run_whose_files_lie_deeper_than_path_max_is_kept_summarised_and_resumed(
    tmp_path, capsys
):
    """Run directory under PATH_MAX, its result.json over it (4096 bytes): the worker writes it
    through folder descriptors, and the run, the summary, --resume and the report read it so."""
    output_dir = str(tmp_path)
    while len(output_dir) < 4070:  # folder names of at most 255 bytes
        output_dir = os.path.join(output_dir, "d" * min(200, 4070 - len(output_dir)))
    os.makedirs(output_dir)
    run_dir = os.path.join(output_dir, "r")
    result_path = os.path.join(run_dir, "standard_bs2_seq8", "result.json")
    assert len(run_dir) < 4096 < len(result_path)
    args = small_run_args(output_dir, "standard")
    assert profiling_script.main(args) == 0, capsys.readouterr().err
    assert reading.read_result(result_path, root=run_dir)["status"] == "ok"
    assert reading.read_text(os.path.join(run_dir, "summary.csv")).count("\nstandard,") == 1
    assert profiling_script.main([*args, "--resume"]) == 0
    assert "standard_bs2_seq8: ok (resumed)" in capsys.readouterr().out
    assert profiling_script.main(["--mode=report", "--input_dir", run_dir]) == 0
    assert reading.read_text(os.path.join(run_dir, "summary.csv")).count("\nstandard,") == 1


def test_a_worker_pipe_closed_between_its_two_halves_of_start_raises_nothing():
    """An interrupt can land inside ``started()``, after the write end is closed and before the
    reader starts: ``close()`` then closes the read end and returns (joining a thread never
    started raised, a traceback in place of exit 143)."""
    stderr = quiet.FilteredStderr()
    os.close(stderr.write_end)  # started()'s first half
    stderr.write_end = None
    stderr.close()
    with pytest.raises(OSError):  # closed: not left open
        os.fstat(stderr.read_end)


def test_an_interrupt_inside_the_readers_start_is_raised_once_it_has_started(monkeypatch):
    """An interrupt can land inside ``Thread.start``, after the reader's thread exists and
    before it has said it started: joining it then raised "cannot join thread before it is
    started", a traceback in place of exit 130. ``started()`` runs whole: the interrupt is
    raised once the reader runs, and ``close()`` joins it."""
    launch = threading._start_new_thread

    def launch_then_interrupt(function, args, *more):
        def late(*late_args):
            time.sleep(0.2)  # the thread says it started only after the interrupt arrived
            function(*late_args)

        ident = launch(late, args, *more)
        os.kill(os.getpid(), signal.SIGINT)
        return ident

    stderr = quiet.FilteredStderr()
    previous = interrupts.install()
    try:
        monkeypatch.setattr(threading, "_start_new_thread", launch_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            stderr.started()
        monkeypatch.undo()
        assert stderr.reader.ident is not None
    finally:
        interrupts.restore(previous)
    stderr.close()  # the write end is closed: the reader sees the end of the pipe
    assert not stderr.reader.is_alive()


def test_known_noise_is_dropped_and_a_crashing_worker_loses_nothing(capfd):
    """The worker writes through the pipe and dies hard (os._exit after an abort-like fatal
    line): the parent still forwards every line but the known noise."""
    stderr = quiet.FilteredStderr()
    pid = os.fork()
    if pid == 0:  # the worker
        stderr.attach()
        os.write(
            2, b"USDT:2026-11-26 08:44:38 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
        )
        os.write(2, b"[W1126 CPUAllocator.cpp:245] Memory block of unknown size was allocated ")
        os.write(2, b"before the profiling started, profiler results will not include it\n")
        os.write(2, b"[rank0]:W1129 06:47:06.410000 6057 torch/_logging/_internal.py:1345] CPU ")
        os.write(2, b"process group does not support alltoall yet, falling back with allgather ")
        os.write(2, b"+ chunk!\n")
        os.write(2, b"RuntimeError: something real\n" + b"x" * 100_000 + b"\n")
        os._exit(134)
    stderr.started()
    os.waitpid(pid, 0)
    stderr.close()
    err = capfd.readouterr().err
    assert err == "RuntimeError: something real\n" + "x" * 100_000 + "\n"


@pytest.mark.parametrize("verbose", [False, True])
def test_worker_output_is_quiet_unless_verbose(tmp_path, verbose):
    """The libraries' known noise, which the workers write below Python (file descriptor 2),
    only with --verbose (in this process: the workers' output is captured at that level)."""
    args = small_run_args(tmp_path, "standard", run_name=f"v{verbose}")
    proc = in_process(*args, *(["--verbose"] if verbose else []))
    assert proc.returncode == 0, proc.stderr[-2000:]
    noisy = "profiler_start" in proc.stderr or "Memory block of unknown size" in proc.stderr
    assert noisy == verbose
