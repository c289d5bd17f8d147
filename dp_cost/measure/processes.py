"""Each config in its own forked worker process; resume, progress and Ctrl-C.

The CLI process imports torch and opacus once and never touches CUDA; each config runs in a
child forked from it, so the import cost is paid once, the caching allocator starts empty for
every config (no pool pollution between trainers) and an OOM or crash stays inside its child.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import re
import shutil
import signal
import sys

import torch

from dp_cost.capacity.probing import SEARCHES
from dp_cost.core import files, interrupts
from dp_cost.core.files import TEMPORARY_NAME, make_folder, write_json
from dp_cost.core.fmt import count
from dp_cost.core.interrupts import INTERRUPTS
from dp_cost.core.reading import is_file_at, read_json_or_none
from dp_cost.core.schema import FINISHED
from dp_cost.measure import quiet, ranks
from dp_cost.measure.progress import ProgressBar, describe
from dp_cost.measure.ranks import RankGroup
from dp_cost.measure.worker import result_skeleton, worker_main
from dp_cost.report.result_check import result_problem
from dp_cost.training import registry as trainers

# Directories a run makes per config (<trainer>_bs<B>_seq<T>...) and atomic_write's temporary
# names (files.TEMPORARY_NAME): the only things leftover removal may touch.
CONFIG_DIR_NAME = re.compile(r"^\w+?_bs\d+_seq\d+(_[\w.-]+)?$")
# A worker sent SIGTERM (and SIGCONT: a stopped one would hold SIGTERM pending for ever) that has
# not ended after this long is killed: stuck in a driver call, or ignoring SIGTERM.
KILL_GRACE_S = 5


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP during a run: the finished configs are summarised, the running
    one dropped. Its text says when: "during <config>", "between configs" or "before the first
    config"."""


def run_configs(
    configs: list,
    run_dir: str,
    resume: bool = False,
    progress: bool = False,
    verbose=False,
    group: RankGroup | None = None,
):
    """Run every config in its own forked worker; returns the results in config order.
    ``progress``: a progress bar over the configs on stderr (plain lines when it is no tty).
    ``verbose``: the workers show the libraries' known-harmless noise too.
    ``group``: the ranks of a torchrun job: each runs its worker of every config; rank 0
    decides what runs and writes the aggregates (the others return their own results)."""
    started = []  # the configs whose worker has started
    try:
        return _run_configs(configs, run_dir, resume, progress, verbose, group, started)
    except KeyboardInterrupt:  # no worker is running
        raise Interrupted("between configs" if started else "before the first config") from None


def finished_result(result_path: str, run_dir: str, resume: bool) -> dict | None:
    """The earlier result that ``--resume`` keeps, or None when the config must run. A result
    the report would leave out (``result_problem``) is measured again, saying so."""
    previous = read_json_or_none(result_path, root=run_dir) if resume else None
    if not isinstance(previous, dict) or previous.get("status") not in FINISHED:
        return None
    problem = result_problem(previous, os.path.basename(os.path.dirname(result_path)))
    if problem is not None:
        print(f"warning: {result_path}: {problem}: measured again", file=sys.stderr)
        return None
    if previous["config"].get("ncu"):
        # An ncu config is never done: ncu runs the app to profile it now (again in each metric
        # pass of app-range replay); skipping it would leave an empty report in place of one.
        return None
    return previous


def _run_configs(configs, run_dir, resume, progress, verbose, group, started) -> list[dict]:
    # torch.optim's Optimizer imports torch._dynamo at its first construction (about 1 s of
    # CPU): imported here, before the workers fork, it is paid once per run, not once per config.
    import torch._dynamo  # noqa: F401

    if group is not None and not group.is_first:
        return _run_as_other_rank(configs, run_dir, verbose, group, started)
    context = multiprocessing.get_context("fork")
    paths = [os.path.join(run_dir, c.config_dir, "result.json") for c in configs]
    # Read once: a bad earlier result warns once. Resumed and skipped configs take no time:
    # counted as done from the start, they do not shorten the estimate of the rest.
    kept = [finished_result(p, run_dir, resume) for p in paths]
    skips = [skip_reason(c) for c in configs]
    no_worker = sum(bool(result or reason) for result, reason in zip(kept, skips))
    if group is not None:  # the other ranks run the same workers
        group.broadcast("runs", [not (result or reason) for result, reason in zip(kept, skips)])
    if resume:  # what an earlier interrupted or killed run left behind, in config directories
        remove_run_leftovers(run_dir)
    bar = ProgressBar(len(configs), no_worker) if progress else None
    log = bar.write if bar else print
    results = []
    for index, (config, result_path, result, reason) in enumerate(
        zip(configs, paths, kept, skips), 1
    ):
        config_path = os.path.dirname(result_path)
        tag = f"[{index}/{len(configs)}] {config.config_dir}"
        if result:
            log(f"{tag}: {result['status']} (resumed)")
        else:
            make_folder(config_path, root=run_dir)  # a link in its place is refused
            if reason:
                result = result_skeleton(config, "skipped", reason)
                write_json(result_path, result, root=run_dir)
            elif group is None:
                log(f"{tag}: running")
                started.append(config.config_dir)
                result = run_in_child(context, config, config_path, result_path, verbose)
                say = lambda text, tag=tag: log(f"{tag}: {text}")  # noqa: E731
                search_by_runs(context, config, result, result_path, run_dir, verbose, say)
            else:
                log(f"{tag}: running on {count(group.info.world_size, 'rank')}")
                started.append(config.config_dir)
                result = run_over_ranks(
                    context, config, result_path, run_dir, verbose, group, index
                )
            if bar and not reason:
                bar.update()
            log(f"{tag}: {describe(result)}")
        results.append(result)
    if bar:
        bar.close()
    return results


def remove_run_leftovers(run_dir: str) -> None:
    """What an earlier interrupted or killed run left in the run's config directories (a link
    or a file of such a name is left alone by ``remove_leftovers``)."""
    for name in os.listdir(run_dir):
        if CONFIG_DIR_NAME.match(name):
            remove_leftovers(os.path.join(run_dir, name))


def search_by_runs(context, config, result: dict, result_path, run_dir, verbose, say) -> None:
    """--find_max_batch or --find_max_seq_len: the search by runs, each probe its own worker,
    starting from the prediction of a card; its outcome added to ``result`` (and its file)."""
    key = next((key for key in SEARCHES if getattr(config, key)), None)
    if not key or not (result.get("prediction") or {}).get("card"):
        return
    say(f"searching the {SEARCHES[key].goal} by runs")
    config_path = os.path.dirname(result_path)
    probe = lambda probed, name: run_in_child(  # noqa: E731
        context, probed, config_path, os.path.join(config_path, name), verbose
    )
    result[key] = SEARCHES[key].run(config, result["prediction"], probe)
    write_json(result_path, result, root=run_dir)


def run_over_ranks(context, config, result_path, run_dir, verbose, group, index: int) -> dict:
    """Rank 0's run of a config over the ranks: every rank's result beside the aggregate."""
    config_path = os.path.dirname(result_path)
    try:
        per_rank = run_rank_worker(context, config, config_path, verbose, group, index)
    except ranks.SilentRank as silent:
        write_json(result_path, silent.result, root=run_dir)
        remove_leftovers(config_path)
        raise
    for rank, rank_result in enumerate(per_rank[1:], 1):  # other nodes' disks too
        rank_path = os.path.join(config_path, f"result.rank{rank}.json")
        write_json(rank_path, rank_result, root=run_dir)
    result = ranks.aggregate(per_rank)
    write_json(result_path, result, root=run_dir)
    remove_leftovers(config_path)
    return result


def skip_reason(config) -> str | None:
    """Why a combination of the plan cannot run (the others still do), or None."""
    if config.physical_batch_size > config.batch_size:
        return f"physical batch {config.physical_batch_size} > logical batch {config.batch_size}"
    per_rank = config.batch_size // config.world_size  # --max_physical_batch_size is per rank
    if config.physical_batch_size > per_rank:
        return (
            f"physical batch {config.physical_batch_size} > a rank's share of the logical batch "
            f"({config.batch_size} / {config.world_size} ranks = {per_rank})"
        )
    return trainers.refusal(
        config.trainer,
        config.distributed,
        config.cuda_graph,
        config.activation_checkpointing,
        config.fsdp_sync,
        config.clipping,
    )


def _run_as_other_rank(configs, run_dir, verbose, group, started) -> list[dict]:
    """Rank k > 0: run this rank's worker of each config rank 0 says runs."""
    context = multiprocessing.get_context("fork")
    for index, (config, runs) in enumerate(zip(configs, group.broadcast("runs"), strict=True), 1):
        if not runs:
            continue
        config_path = os.path.join(run_dir, config.config_dir)
        make_folder(config_path, root=run_dir)
        started.append(config.config_dir)
        run_rank_worker(context, config, config_path, verbose, group, index)
    return []  # rank 0 holds the results


def run_rank_worker(context, config, config_path, verbose, group, index) -> list[dict] | None:
    """This rank's worker of config ``index`` (result.rank<k>.json), its result handed to rank 0:
    every rank's results in rank order on rank 0, None elsewhere."""
    rank_path = os.path.join(config_path, f"result.rank{group.rank}.json")
    own = run_in_child(context, config, config_path, rank_path, verbose, group, index)
    return group.gather(f"result/{index}", own)


STOP_GRACE_S = 10  # a worker left alone after another rank failed may still end by itself


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
        for interrupt, handler in replaced.items():
            signal.signal(interrupt, handler)
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


def run_in_child(
    context, config, config_path, result_path, verbose=False, group=None, index=0
) -> dict:
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
    try:
        with interrupts_after_fork(), frozen_heap():
            process.start()
        child_errors.close()
        if stderr is not None:
            stderr.started()
        stopped_by = wait_for_worker(process, group, index, config.rank_timeout)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP (the CLI raises them as one)
        # A second signal must not cut the clean-up short (the CLI restores the handlers).
        interrupts.ignore()
        if process.pid is not None:
            stop_worker(process)
        errors.close()
        remove_leftovers(config_path)
        raise Interrupted(f"during {config.config_dir}") from None
    finally:
        if stderr is not None:
            stderr.close()
    reported = last_words(errors)
    errors.close()
    result = result_of_worker(config, result_path, process.exitcode, reported, stopped_by)
    if is_file_at(result_path, os.path.dirname(config_path)):
        with files.folder(config_path, root=os.path.dirname(config_path)) as fd:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(earlier, dir_fd=fd)
    if group is None:  # distributed: rank 0 cleans up once every rank's worker has ended
        remove_leftovers(config_path)
    else:  # the other ranks stop their workers if this one failed
        group.post(f"ended/{index}/{group.rank}", {k: result.get(k) for k in ("status", "error")})
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


def wait_for_worker(process, group, index: int, rank_timeout: float):
    """Wait for the worker to end; distributed, stop it if a rank fell silent (``SilentRank``)
    or another rank's worker failed first, and return why (None otherwise)."""
    process.join(None if group is None else 0.5)
    while process.is_alive():
        stopped_by = group.why_stop(index, rank_timeout)
        if isinstance(stopped_by, ranks.SilentRank):  # stopped, hung or cut off: not waited for
            stop_worker(process)
            return stopped_by
        if stopped_by is not None:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                stop_worker(process)
            return stopped_by
        process.join(0.5)
    return None


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


def probe_device() -> dict:
    """Ask a forked child whether CUDA is usable (and the card's name), so this process never
    initialises CUDA: the workers fork from it."""
    context = multiprocessing.get_context("fork")
    parent_end, child_end = context.Pipe(duplex=False)

    def probe():
        interrupts.ignore()  # the CLI's handlers would raise here: the CLI decides
        available = torch.cuda.is_available()
        child_end.send(
            {"cuda": available, "name": torch.cuda.get_device_name(0) if available else None}
        )

    process = context.Process(target=probe)
    answered = False
    try:
        with interrupts_after_fork(), frozen_heap():
            process.start()
        answered = parent_end.poll(120)
        info = parent_end.recv() if answered else {"cuda": False, "name": None}
    finally:
        if process.pid is not None:
            if not answered:  # hung in the driver, or the CLI was interrupted: not left behind
                process.kill()
            process.join()
    return info


def cuda_available() -> bool:
    return probe_device()["cuda"]
