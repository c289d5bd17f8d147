"""One config's worker process: made, forked (its stderr filtered through this process), and
either ended (its result read, or written for it when it died without one) or abandoned (an
interrupted run's: stopped, reaped, what it left removed). ``measure.processes`` runs them, one
at a time or side by side."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import os
import shutil
import signal
import sys

from dp_cost.core import files, interrupts
from dp_cost.core.files import TEMPORARY_NAME, write_json
from dp_cost.core.interrupts import INTERRUPTS
from dp_cost.core.reading import is_file_at, read_json_or_none
from dp_cost.measure import quiet, ranks
from dp_cost.measure.ranks import RankGroup
from dp_cost.measure.worker import result_skeleton, worker_main

# A worker sent SIGTERM (and SIGCONT: a stopped one would hold SIGTERM pending for ever) that has
# not ended after this long is killed: stuck in a driver call, or ignoring SIGTERM.
KILL_GRACE_S = 5


def worker_process(*args, **kwargs) -> None:
    """The forked worker: ``worker_main``, a hangup ignored first. Ctrl-C and a hangup reach the
    workers too (the terminal's whole process group): the CLI decides what they stop."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    worker_main(*args, **kwargs)


@contextlib.contextmanager
def frozen_heap():
    """Around a fork: every object that exists now is out of the collector's reach
    (gc.freeze) while the child is made, so the child never collects what it inherited; the
    parent takes them back after. An unreachable cycle left for the parent's collector (e.g. a
    DDP reducer holding a gloo process group) would otherwise be destroyed in the child, whose
    destructor waits for threads the fork did not copy: a worker that never ends."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def interrupts_after_fork():
    """Around a fork: an interrupt that arrives inside is raised once the fork is done (raised
    in the fork's own callbacks, logging's and threading's, Python would print it and drop it).
    The child starts with the recording handler, not the CLI's: it sets its own."""
    arrived = []
    replaced = {}
    for interrupt in (*INTERRUPTS, signal.SIGALRM):  # SIGALRM: an interrupt held over an import
        if callable(signal.getsignal(interrupt)):  # the CLI's handler, or Python's Ctrl-C
            replaced[interrupt] = signal.signal(interrupt, lambda signum, _: arrived.append(signum))
    try:
        yield
    finally:
        interrupts.restore_handlers(list(replaced.items()))
        if arrived:
            signal.raise_signal(arrived[0])


def stop_worker(process) -> None:
    """End a started worker for sure, and reap it: SIGTERM, SIGCONT, then SIGKILL after
    KILL_GRACE_S."""
    if process.exitcode is not None:  # ended (and reaped) already: its pid may be another's
        return
    process.terminate()
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGCONT)
    process.join(KILL_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join()


@dataclasses.dataclass
class Child:
    """A config's worker: what launching, ending or abandoning it needs."""

    config: object
    config_path: str
    result_path: str
    process: multiprocessing.Process
    errors: object  # the read end of the worker's last words
    child_errors: object  # their write end, the worker's
    stderr: object  # quiet.FilteredStderr, or None (verbose)
    earlier: str  # the earlier attempt's result, set aside
    group: RankGroup | None
    index: int  # the config's number, in a distributed run


def make_child(context, config, config_path, result_path, verbose, group=None, index=0):
    """The config's worker, made but not forked (``launch_child`` forks it): its earlier
    attempt's result set aside, its pipes open."""
    earlier = set_aside_earlier_result(config_path, result_path)
    errors, child_errors = context.Pipe(duplex=False)
    stderr = None if verbose else quiet.FilteredStderr()
    rank_setup = None if group is None else (group.info, group.worker_prefix(index))
    process = context.Process(
        target=worker_process,
        args=(config, config_path, child_errors),
        kwargs={
            "stderr": stderr,
            "rank_setup": rank_setup,
            "result_name": os.path.basename(result_path),
        },
    )
    return Child(
        config, config_path, result_path, process, errors, child_errors, stderr, earlier,
        group, index,
    )  # fmt: skip


def launch_child(child: Child) -> None:
    """The worker forked and running, its stderr read by this process."""
    with interrupts_after_fork(), frozen_heap():
        child.process.start()
    child.child_errors.close()
    if child.stderr is not None:
        child.stderr.started()


def abandon_child(child: Child, interrupted: bool = True) -> None:
    """A worker of a run that stops (an interrupt, or an error in the run) stopped and reaped,
    its pipes closed and what it left removed."""
    if interrupted:  # a second signal must not cut the clean-up short (the CLI restores them)
        interrupts.ignore()
    if child.process.pid is not None:
        stop_worker(child.process)
    close_pipes(child)
    remove_leftovers(child.config_path)


def close_pipes(child: Child) -> None:
    """The worker's last-words pipe (both ends: the fork may not have happened) and its stderr
    filter closed; closing twice is harmless."""
    child.child_errors.close()
    child.errors.close()
    if child.stderr is not None:
        child.stderr.close()


def end_child(child: Child, stopped_by=None) -> dict:
    """The result of a worker that has ended: its file, or the one written for it."""
    if child.stderr is not None:
        child.stderr.close()
    reported = last_words(child.errors)
    child.errors.close()
    config, config_path, result_path = child.config, child.config_path, child.result_path
    result = result_of_worker(config, result_path, child.process.exitcode, reported, stopped_by)
    if is_file_at(result_path, os.path.dirname(config_path)):
        with files.folder(config_path, root=os.path.dirname(config_path)) as fd:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(child.earlier, dir_fd=fd)
    group = child.group
    if group is None:  # distributed: rank 0 cleans up once every rank's worker has ended
        remove_leftovers(config_path)
    else:  # the other ranks stop their workers if this one failed
        status = {key: result.get(key) for key in ("status", "error")}
        group.post(f"ended/{child.index}/{group.rank}", status)
    if isinstance(stopped_by, ranks.SilentRank):  # no rank waits for it: the job ends
        stopped_by.result = result
        raise stopped_by
    return result


def set_aside_earlier_result(config_path: str, result_path: str) -> str:
    """An unfinished earlier attempt's result (--resume reruns it), renamed to the name returned
    and kept beside until this attempt's result is written (in the config directory, entered
    without following a link)."""
    earlier = os.path.basename(result_path) + ".previous"
    with files.folder(config_path, root=os.path.dirname(config_path)) as fd:
        with contextlib.suppress(FileNotFoundError):
            os.replace(os.path.basename(result_path), earlier, src_dir_fd=fd, dst_dir_fd=fd)
    return earlier


def result_of_worker(config, result_path: str, exitcode, reported, stopped_by) -> dict:
    """The worker's result file, or the result written for it: stopped because another rank
    failed, or killed or crashed before writing one."""
    root = os.path.dirname(os.path.dirname(result_path))
    result = read_json_or_none(result_path, root=root)
    ended = isinstance(stopped_by, ranks.SilentRank)  # the job ends: this config is an error
    if stopped_by is not None and (ended or result is None or result.get("status") != "ok"):
        result = ranks.stopped_result(result_skeleton(config, "error"), stopped_by)
        write_json(result_path, result, root=root)
    elif result is None:  # killed or crashed before writing (segfault, OOM killer's SIGKILL)
        result = died_result(config, exitcode, reported)
        try:
            write_json(result_path, result, root=root)
        except OSError as error:  # the disk is full for this one too: the summary still has it
            print(f"{config.config_dir}: could not write result.json: {error}", file=sys.stderr)
    return result


def last_words(errors) -> str | None:
    """What a worker reported before dying, if anything (a killed one closed the pipe)."""
    try:
        return errors.recv() if errors.poll() else None
    except EOFError:
        return None


def died_result(config, exitcode: int | None, reported: str | None) -> dict:
    """The result of a worker that wrote none: ``reported`` is what it said before dying."""
    if exitcode == -signal.SIGKILL:  # the kernel's OOM killer sends SIGKILL
        return result_skeleton(
            config,
            "oom",
            "worker killed by SIGKILL: most likely the kernel's OOM killer (host out of memory)",
        )
    reason = (
        f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
    )
    return result_skeleton(config, "error", reported or f"worker died without a result ({reason})")


def remove_leftovers(config_path: str) -> None:
    """What an interrupted or killed worker leaves: a trace's staging folder, temporary files,
    and the config directory itself when nothing else is in it. Through the config directory's
    descriptor (entered without following a link), as every write is."""
    run_dir, config_dir = os.path.split(config_path)
    try:
        with files.folder(run_dir) as run_fd, files.folder(config_path, root=run_dir) as fd:
            for name in os.listdir(fd):
                if name.startswith(".trace-"):  # by descriptor: a link swapped in is not followed
                    shutil.rmtree(f"/proc/self/fd/{fd}/{name}", ignore_errors=True)
                elif TEMPORARY_NAME.fullmatch(name):  # atomic_write's names only
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=fd)
            with contextlib.suppress(OSError):  # not empty: it holds results or earlier files
                os.rmdir(config_dir, dir_fd=run_fd)
    except (FileNotFoundError, files.UnsafePath):  # gone already, or a link: nothing of ours
        return
