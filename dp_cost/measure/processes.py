"""Each config in its own forked worker process; resume, progress and Ctrl-C.

The CLI process imports torch and opacus once and never touches CUDA; each config runs in a
child forked from it, so the import cost is paid once, the caching allocator starts empty for
every config (no pool pollution between trainers) and an OOM or crash stays inside its child.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import re
import sys

import torch

from dp_cost.capacity.probing import SEARCHES
from dp_cost.core import interrupts
from dp_cost.core.files import make_folder, write_json
from dp_cost.core.fmt import count
from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.core.reading import read_json_or_none
from dp_cost.core.schema import FINISHED
from dp_cost.hf import models as hf_models
from dp_cost.measure import children, ranks
from dp_cost.measure.progress import ProgressBar, describe
from dp_cost.measure.ranks import RankGroup
from dp_cost.measure.worker import result_skeleton
from dp_cost.report.result_check import result_problem
from dp_cost.training import registry as trainers

# Directories a run makes per config (<trainer>_bs<B>_seq<T>...) and atomic_write's temporary
# names (files.TEMPORARY_NAME): the only things leftover removal may touch.
CONFIG_DIR_NAME = re.compile(r"^\w+?_bs\d+_seq\d+(_[\w.-]+)?$")


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
    workers: int | None = None,
):
    """Run every config in its own forked worker; returns the results in config order.
    ``progress``: a progress bar over the configs on stderr (plain lines when it is no tty).
    ``verbose``: the workers show the libraries' known-harmless noise too.
    ``group``: the ranks of a torchrun job: each runs its worker of every config; rank 0
    decides what runs and writes the aggregates (the others return their own results).
    ``workers``: how many run at once (None: ``workers_at_once``'s answer)."""
    started = []  # the configs whose worker has started
    if workers is None:
        workers = workers_at_once(configs, group)
    try:
        return _run_configs(configs, run_dir, resume, progress, verbose, group, started, workers)
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


def import_before_forking(configs) -> None:
    """What every worker would import at its first step, imported once here before the workers
    fork: paid once per run, not once per config. torch.optim's Optimizer imports torch._dynamo
    at its first construction (about 1 s of CPU); a Hugging Face config's build imports
    transformers and peft (seconds)."""
    import torch._dynamo  # noqa: F401

    hf_configs = [c for c in configs if c.model in HF_CONFIGS]
    if hf_configs:
        hf_models.import_libraries(any(c.use_lora for c in hf_configs))


def _run_configs(
    configs, run_dir, resume, progress, verbose, group, started, workers
) -> list[dict]:
    import_before_forking(configs)
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
    results, side_by_side = [], []
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
            elif workers > 1:  # run below, with the others
                side_by_side.append((len(results), tag, config, config_path, result_path))
                results.append(None)
                continue
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
    if side_by_side:
        run_side_by_side(context, side_by_side, results, workers, verbose, log, bar, started)
    if bar:
        bar.close()
    return results


def remove_run_leftovers(run_dir: str) -> None:
    """What an earlier interrupted or killed run left in the run's config directories (a link
    or a file of such a name is left alone by ``remove_leftovers``)."""
    for name in os.listdir(run_dir):
        if CONFIG_DIR_NAME.match(name):
            children.remove_leftovers(os.path.join(run_dir, name))


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
        children.remove_leftovers(config_path)
        raise
    for rank, rank_result in enumerate(per_rank[1:], 1):  # other nodes' disks too
        rank_path = os.path.join(config_path, f"result.rank{rank}.json")
        write_json(rank_path, rank_result, root=run_dir)
    result = ranks.aggregate(per_rank)
    write_json(result_path, result, root=run_dir)
    children.remove_leftovers(config_path)
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
WORKER_MEMORY_BYTES = 4 * 2**30  # a predicting worker's share of the host's free memory


def run_in_child(
    context, config, config_path, result_path, verbose=False, group=None, index=0
) -> dict:
    """The config's worker run to its end: its result."""
    child = children.make_child(context, config, config_path, result_path, verbose, group, index)
    try:
        children.launch_child(child)
        stopped_by = wait_for_worker(child.process, group, index, config.rank_timeout)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP (the CLI raises them as one)
        children.abandon_child(child)
        raise Interrupted(f"during {config.config_dir}") from None
    except BaseException:  # the worker's pipes closed (a torchrun store's error, a fork's)
        children.close_pipes(child)
        raise
    return children.end_child(child, stopped_by)


def workers_at_once(configs: list, group) -> int:
    """How many configs' workers run at once: for a plan that only predicts (--mode=capacity
    without --validate or a search by runs, which use the GPU; not a torchrun job) one a core,
    as memory allows (a Llama-3.1-8B plan's worker peaked near 0.8 GB on a 2-core machine,
    sampled every 5 s; WORKER_MEMORY_BYTES leaves it room to spare); else one."""
    predicting = all(
        c.capacity and not (c.validate or c.find_max_batch or c.find_max_seq_len) for c in configs
    )
    if group is not None or not predicting:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    available = available_memory_bytes()
    by_memory = cores if available is None else available // WORKER_MEMORY_BYTES
    return max(1, min(cores or 1, by_memory))


def available_memory_bytes() -> int | None:
    """The memory the kernel can give new processes (/proc/meminfo's MemAvailable: free memory
    and the page cache it can reclaim), or None where it does not say (not Linux)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    return None


def run_side_by_side(context, jobs, results, workers, verbose, log, bar, started) -> None:
    """``jobs``: (position, tag, config, config_path, result_path) of the configs to run, up to
    ``workers`` at once, each forked as another ends; each result put at its position in
    ``results`` and logged as it ends. An interrupt, or any error here, stops and reaps every
    worker still running."""
    waiting, running = list(jobs), {}  # running: sentinel -> (position, tag, child)
    launching = None  # the child being made and forked, not yet running
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                position, tag, config, config_path, result_path = waiting.pop(0)
                log(f"{tag}: running")
                started.append(config.config_dir)
                launching = children.make_child(context, config, config_path, result_path, verbose)
                children.launch_child(launching)
                running[launching.process.sentinel] = (position, tag, launching)
                launching = None
            for sentinel in multiprocessing.connection.wait(list(running)):
                position, tag, child = running[sentinel]
                child.process.join()
                results[position] = children.end_child(child)
                del running[sentinel]
                if bar:
                    bar.update()
                log(f"{tag}: {describe(results[position])}")
    except BaseException as error:
        interrupted = isinstance(error, KeyboardInterrupt)
        stopping = {id(c): c for *_, c in running.values()}
        if launching is not None:
            stopping[id(launching)] = launching
        for child in stopping.values():
            children.abandon_child(child, interrupted)
        if not interrupted:
            raise
        names = ", ".join(child.config.config_dir for child in stopping.values())
        raise Interrupted(f"during {names}" if names else "between configs") from None


def wait_for_worker(process, group, index: int, rank_timeout: float):
    """Wait for the worker to end; distributed, stop it if a rank fell silent (``SilentRank``)
    or another rank's worker failed first, and return why (None otherwise)."""
    process.join(None if group is None else 0.5)
    while process.is_alive():
        stopped_by = group.why_stop(index, rank_timeout)
        if isinstance(stopped_by, ranks.SilentRank):  # stopped, hung or cut off: not waited for
            children.stop_worker(process)
            return stopped_by
        if stopped_by is not None:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                children.stop_worker(process)
            return stopped_by
        process.join(0.5)
    return None


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
        with children.interrupts_after_fork(), children.frozen_heap():
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
