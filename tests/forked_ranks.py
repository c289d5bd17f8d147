"""A torchrun stand-in for tests: the ranks of a job forked from the test process.

torchrun starts a launcher and one interpreter per rank, and each imports torch and opacus
(about 7 s of CPU a two-rank job on CI's cores, before any work). Here each rank is a child
forked from this process, which has imported them already, given the environment torchrun gives
its ranks (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and the TORCHELASTIC
variables; no agent store, so rank 0 hosts the job's store, as our ranks do when torchrun's agent
does not), its output captured, and the script run as ``python script args`` would run it. As
torchrun does, a rank that fails ends the others (SIGTERM, then SIGKILL) and the job's exit
status is 1. What only a real launcher shows (its agent, a stopped rank left behind, its exit
codes) is tested under torchrun itself (test_distributed_cli.py)."""

import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_S = 10.0  # between SIGTERM and SIGKILL when a rank failed or the job timed out


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def forked_ranks(script, *args, ranks=2, timeout=600, cwd=ROOT) -> subprocess.CompletedProcess:
    """What ``subprocess.run([python, -m, torch.distributed.run, --nproc_per_node, ranks,
    --standalone, script, *args])`` returns (its output: each rank's, in rank order), from ranks
    forked from this process."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("forked ranks would inherit this process's process group")
    script = os.path.join(cwd, script)
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(ranks)]
    pids = []
    try:
        for rank, (out, err) in enumerate(outputs):
            pid = os.fork()
            if pid == 0:  # the rank: never returns
                run_rank(script, args, rank, ranks, port, cwd, out, err)
            pids.append(pid)
        codes = wait_for_ranks(pids, timeout, script)
        texts = []
        for out, err in outputs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
    finally:
        for out, err in outputs:
            out.close()
            err.close()
    # as torchrun's agent does, name each rank that failed and how
    failures = "".join(
        f"forked_ranks: rank {r} exited with {c}\n" for r, c in enumerate(codes) if c
    )
    command = ["forked_ranks", str(ranks), script, *map(str, args)]
    return subprocess.CompletedProcess(
        command, 1 if failures else 0, "".join(t[0] for t in texts),
        "".join(t[1] for t in texts) + failures,
    )  # fmt: skip


def run_rank(script, args, rank, ranks, port, cwd, out, err) -> None:
    """In the forked child: torchrun's environment, output to ``out``/``err``, the script as
    ``__main__``; leaves with the script's exit status, without the parent's exit handlers."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a signal to the test process's group misses it
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # never the test process's stdin (pytest-xdist's channel)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(cwd)
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
        sys.argv = [script, *map(str, args)]
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


def wait_for_ranks(pids, timeout, script) -> list[int]:
    """Each rank's exit status (-N: ended by signal N); once one fails, the others are ended as
    torchrun ends them."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int] = {}
    stopping_since, timed_out = None, False
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(code != 0 for code in codes.values())
        if stopping_since is None and (failed or time.monotonic() > deadline):
            stopping_since, timed_out = time.monotonic(), not failed
            signal_ranks(pids, codes, signal.SIGTERM)
        if stopping_since is not None and time.monotonic() - stopping_since > GRACE_S:
            signal_ranks(pids, codes, signal.SIGKILL)
        time.sleep(0.02)
    if timed_out:
        raise subprocess.TimeoutExpired(script, timeout)
    return [codes[pid] for pid in pids]


def signal_ranks(pids, codes, signum) -> None:
    for pid in pids:
        if pid not in codes:
            try:
                os.killpg(pid, signum)  # the rank and the workers it forked
            except ProcessLookupError:
                pass
