"""Shared by the end-to-end tests: run the CLI as a user does and read what a run wrote."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment torchrun gives rank 0 of two: a plan or CLI run in-process "under torchrun".
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29999"}  # fmt: skip
# What an HF sweep writes into its run directory, beside the config directories.
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
# A one-layer model small enough that a CPU test-mode config takes about a second.
SMALL_MODEL = ["--hidden_dim", "32", "--num_layers", "1", "--num_heads", "2", "--vocab_size", "50"]


def benchmark_script(file_name: str):
    """``benchmarks/<file_name>`` loaded as a module in this process (the folder is not a
    package: a script's functions and main called directly, with the test's imports)."""
    import importlib.util

    folder = os.path.join(ROOT, "benchmarks")
    if folder not in sys.path:  # as running it does: a script finds its siblings
        sys.path.append(folder)
    path = os.path.join(folder, file_name)
    spec = importlib.util.spec_from_file_location(os.path.splitext(file_name)[0], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: a forked pool's tasks find its functions
    spec.loader.exec_module(module)
    return module


def benchmark_main(file_name: str, *argv, capsys) -> tuple[int, str, str]:
    """``benchmarks/<file_name>``'s main run in this process on ``argv`` (made strings):
    (exit status, stdout, stderr), read from pytest's ``capsys``."""
    status = benchmark_script(file_name).main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def free_port() -> int:
    """A TCP port nothing listens on now (the OS's choice), for a store or a server."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cli(*args, timeout=300, **options):
    """``python profiling_script.py *args`` from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, "profiling_script.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        **options,
    )


def in_process(*args):
    """What ``cli`` returns, from ``profiling_script.main(args)`` run in this process (from the
    repository root, the environment restored after): it skips the interpreter's start and the
    imports of torch and opacus, about 4 s of CPU a run. The workers still fork, as they do from
    the CLI, and what they print is captured too: stdout and stderr go to files, at the Python
    and the file-descriptor level, which the forked workers inherit. Tests of what only a
    process shows (signals, exit by the interpreter) use ``cli``."""
    import profiling_script

    cwd, environ = os.getcwd(), dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    # line-buffered: a worker forks with nothing of the parent's pending in its copy
    with (
        tempfile.TemporaryFile("w+", buffering=1) as out,
        tempfile.TemporaryFile("w+", buffering=1) as err,
    ):
        try:
            os.chdir(ROOT)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = profiling_script.main([str(arg) for arg in args])
        finally:
            out.flush()
            err.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(environ)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, code, out.read(), err.read())


def small_run_args(output_dir, *trainers, batch_sizes=(2,), seq_lens=(8,), steps=1, run_name="r"):
    """Arguments of a --mode=test run of the small model (``steps=None``: the mode's default;
    ``run_name=None``: the default timestamped name)."""
    args = ["--mode=test", "--trainers", *trainers]
    args += ["--batch_sizes", *map(str, batch_sizes), "--seq_lens", *map(str, seq_lens)]
    if steps is not None:
        args += ["--steps", str(steps)]
    args += ["--output_dir", str(output_dir)]
    if run_name is not None:
        args += ["--run_name", run_name]
    return [*args, *SMALL_MODEL]


def results_in(run_dir):
    """Config directory name -> its result.json, for every finished config of a run."""
    out = {}
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name, "result.json")
        if os.path.exists(path):
            with open(path) as f:
                out[name] = json.load(f)
    return out


def wait_for(condition, timeout=120.0, cli=None, interval=0.02):
    """Until ``condition()``, asked every ``interval`` seconds; a ``cli`` process (a Popen) that
    ends first fails at once, and so does the ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert cli is None or cli.poll() is None, f"the CLI ended first: {cli.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` has forked and not reaped yet (any of its threads'), from /proc."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(child) for child in f.read().split()]
    return found


def signal_mask(pid: int, kind: str) -> int:
    """Process ``pid``'s mask of signals of ``kind`` (/proc/<pid>/status: SigIgn, the ignored;
    SigCgt, the caught): bit n - 1 is signal n. 0 once the process is gone."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{kind}:"):
                    return int(line.split()[1], 16)
    return 0


def running_worker(cli, config_dir) -> int:
    """The pid of the worker of ``config_dir`` (a Path) of the CLI process ``cli`` (a Popen),
    once it runs: forked (the CLI makes the config's directory just before it forks the worker,
    and has reaped the previous config's worker by then) and past its set-up, which ignores
    Ctrl-C and leaves SIGTERM at its default (a signal before that meets the handlers the fork
    left it, a moment no test means)."""

    def set_up(pid: int) -> bool:
        ignored, caught = signal_mask(pid, "SigIgn"), signal_mask(pid, "SigCgt")
        return bool(ignored >> (signal.SIGINT - 1) & 1) and not caught >> (signal.SIGTERM - 1) & 1

    def worker() -> int | None:
        pids = child_pids(cli.pid) if config_dir.exists() else []
        return pids[0] if pids and set_up(pids[0]) else None

    found = []
    wait_for(lambda: found.append(worker()) or found[-1] is not None, cli=cli)
    return found[-1]
