"""Shared by the end-to-end tests: run the CLI as a user does and read what a run wrote."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile

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
