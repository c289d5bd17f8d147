"""A torchrun stand-in for tests: the ranks of a job forked from a process that has imported
what a rank imports.

torchrun starts a launcher and one interpreter per rank, and each imports torch and opacus
(about 7 s of CPU a two-rank job on CI's cores, before any work). Here each rank is a child of
multiprocessing's fork server, started once per test process with torch, opacus, transformers,
peft and the CLI imported (none of the tests' Python state: a child of the test process itself
would inherit what earlier tests left, e.g. a device mesh made for another rank). Each rank gets the
environment torchrun gives its ranks (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
the TORCHELASTIC variables; no agent store, so rank 0 hosts the job's store, as our ranks do when
torchrun's agent does not) over the test's own environment, its output captured, and the script
run as ``python script args`` would run it. As torchrun does, a rank that fails ends the others
(SIGTERM, then SIGKILL) and the job's exit status is 1. What only a real launcher shows (its
agent, a stopped rank left behind) is tested under torchrun itself (test_distributed_cli.py)."""

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from cli_helpers import ROOT, free_port

GRACE_S = 10.0  # between SIGTERM and SIGKILL when a rank failed or the job timed out
# Also what ranks import later, once here rather than in each rank: pytest (the scripts that take
# test_trainers' model) and pyplot (the summary rank 0 of a CLI job draws)
PRELOAD = ["torch", "opacus", "transformers", "peft", "profiling_script", "dp_cost.measure.run",
           "pytest", "matplotlib.pyplot"]  # fmt: skip
_context = None


def fork_server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def forked_ranks(script, *args, ranks=2, timeout=600, cwd=ROOT) -> subprocess.CompletedProcess:
    """What ``subprocess.run([python, -m, torch.distributed.run, --nproc_per_node, ranks,
    --standalone, script, *args])`` returns (its output: each rank's, in rank order, then a
    line for each rank that failed), from ranks forked by the fork server."""
    script = os.path.join(cwd, script)
    port = free_port()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as folder:
        paths = [
            (os.path.join(folder, f"{rank}.out"), os.path.join(folder, f"{rank}.err"))
            for rank in range(ranks)
        ]
        processes = []
        try:
            for rank, (out, err) in enumerate(paths):
                process = fork_server().Process(
                    target=run_rank,
                    args=(script, [str(a) for a in args], rank, ranks, port, cwd, out, err,
                          environ),
                )  # fmt: skip
                process.start()
                processes.append(process)
            codes = wait_for_ranks(processes, timeout, script)
        finally:  # a rank's group (its workers too) ends with the job, however the job ended
            for process in processes:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.join(GRACE_S)
        texts = [(read(out), read(err)) for out, err in paths]
    # as torchrun's agent does, name each rank that failed and how
    failures = "".join(
        f"forked_ranks: rank {r} exited with {c}\n" for r, c in enumerate(codes) if c
    )
    command = ["forked_ranks", str(ranks), script, *map(str, args)]
    return subprocess.CompletedProcess(
        command, 1 if failures else 0, "".join(t[0] for t in texts),
        "".join(t[1] for t in texts) + failures,
    )  # fmt: skip


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:  # the rank died before it opened it
        return ""


def run_rank(script, args, rank, ranks, port, cwd, out, err, environ) -> None:
    """In the forked child: the test's environment and torchrun's variables, output to the
    files ``out`` and ``err``, the script as ``__main__``; leaves with the script's exit
    status, without exit handlers."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: the rank and the workers it forks are ended as one
        for fd, path in ((1, out), (2, err)):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID="forked", TORCHELASTIC_USE_AGENT_STORE="False",
            OMP_NUM_THREADS="1",
        )  # fmt: skip
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as done:
            if done.code is None or isinstance(done.code, int):
                code = done.code or 0
            else:
                print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def wait_for_ranks(processes, timeout, script) -> list[int]:
    """Each rank's exit status (-N: ended by signal N); once one fails, the others are ended as
    torchrun ends them."""
    deadline = time.monotonic() + timeout
    stopping_since, timed_out = None, False
    while any(p.exitcode is None for p in processes):
        failed = any(p.exitcode not in (None, 0) for p in processes)
        if stopping_since is None and (failed or time.monotonic() > deadline):
            stopping_since, timed_out = time.monotonic(), not failed
            signal_ranks(processes, signal.SIGTERM)
        if stopping_since is not None and time.monotonic() - stopping_since > GRACE_S:
            signal_ranks(processes, signal.SIGKILL)
        time.sleep(0.02)
    if timed_out:
        raise subprocess.TimeoutExpired(script, timeout)
    return [p.exitcode for p in processes]


def signal_ranks(processes, signum) -> None:
    for process in processes:
        if process.exitcode is None:
            try:
                os.killpg(process.pid, signum)  # the rank and the workers it forked
            except ProcessLookupError:  # not yet in a group of its own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)
