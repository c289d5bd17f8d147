"""Configs' steps timed in turn, draw by draw: a comparison of host-bound steps that the host's
drift decides less.

A host-bound eager step (a Llama LoRA classifier at short sequences, chunks of 2) takes as long
as the host's Python and launches do, and a cloud host's speed drifts by tens of percent over
minutes. The CLI runs one config after another, each in its own worker, so two trainers'
medians can differ by that drift. Here each config of the plan gets its own worker as the CLI
builds it (same model, seed and draws). The workers stay alive and take turns: the draw's step
of the first, then of the second, and the order swaps every draw. Each draw's ratio then
compares steps seconds apart, on the same batch.

    python benchmarks/paired_steps.py --draws 24 -- --mode=hf \\
        --model_name meta-llama/Llama-3.2-3B-Instruct --use_lora --lora_rank 32 \\
        --batch_size 16 --seq_length 256 --max_physical_batch_size 2 --dtype bfloat16 \\
        --warmup_steps 2 --trainers standard flash

Prints each config's median step, Python's garbage collections inside its steps (by generation,
and their ms) and, against the first config, the ratio of the summed steps
and the median and quartiles of the draws' ratios; ``--out`` writes them with every draw's
times. Every config's model is in memory at once: they must fit on the card together. Each
step is synchronised before and after; nothing else is measured (no phase events, trace or
memory): the CLI's timed steps also queue a CUDA event and read the allocator at each phase, so
these steps are a little shorter than the CLI's. The arguments' mode must run training steps
(test, profile, hf), not plan them (capacity) or profile kernels (ncu).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
clock = time.perf_counter  # what a step is timed by (seconds)
GENS = (0, 1, 2)  # Python's collector's generations


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="benchmarks/paired_steps.py [--draws N] [--cpus CPU ...] [--out JSON] -- "
        "PROFILING_SCRIPT_ARGUMENTS",
    )
    parser.add_argument("--draws", type=int, default=24, help="timed draws (steps) per config")
    parser.add_argument("--out", help="also write the draws and the ratios here (JSON)")
    parser.add_argument(
        "--cpus",
        type=int,
        nargs="+",
        help="run every worker on these CPUs alone (Linux): the workers take turns, so on one "
        "CPU they run on the same core, whatever that core's speed",
    )
    return parser


def worker(config, connection, cpus) -> None:
    """One config's process: built as the CLI's worker builds it, warmed up, then one timed
    step per message, on the workload's next draw. ``cpus``: the CPUs it runs on (None: any)."""
    from dp_cost.measure import quiet
    from dp_cost.measure import worker as cli_worker

    cli_worker.die_with_parent()
    for interrupt in (signal.SIGINT, signal.SIGHUP):  # the parent decides what Ctrl-C stops
        signal.signal(interrupt, signal.SIG_IGN)
    quiet.filter_warnings()  # the CLI's workers' known-harmless library warnings
    try:
        if cpus:  # before torch starts a thread: every thread the worker makes inherits it
            os.sched_setaffinity(0, cpus)
        import torch

        from dp_cost.measure.python_gc import GarbageCollections
        from dp_cost.measure.steps import synchronize
        from dp_cost.measure.workload import Workload

        device = torch.device(config.device)
        torch.manual_seed(config.seed)
        workload = Workload(config, device, lambda name: None, {})
        runner = cli_worker.build_trainer(config, workload.model, workload.loss_fn, None)
        for _ in range(config.warmup_steps):
            runner.step(*workload.batch())
        synchronize(device)
        connection.send(("ready", None))
        while connection.recv() == "step":
            inputs, targets = workload.batch()
            synchronize(device)
            with GarbageCollections() as collections:
                start = clock()
                runner.step(inputs, targets)
                synchronize(device)
                ms = (clock() - start) * 1e3
            connection.send(("step", (ms, len(inputs), collections.result())))
    except Exception as error:  # noqa: BLE001 - reported by the parent in one line
        connection.send(("error", f"{type(error).__name__}: {error}".splitlines()[0][:300]))


def ratio_summary(times: list[float], baseline: list[float]) -> dict:
    """One config's draws against the baseline's: their summed steps' ratio and the draws'
    ratios' median and quartiles."""
    ratios = sorted(t / b for t, b in zip(times, baseline))
    quartiles = (
        statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    )
    return {
        "sum_ratio": sum(times) / sum(baseline),
        "draw_ratio_median": statistics.median(ratios),
        "draw_ratio_quartiles": [quartiles[0], quartiles[2]],
    }


class StepError(RuntimeError):
    pass


def receive(connection, process, expected: str, name: str):
    """The worker's next message, of kind ``expected``; StepError for its error or its death
    (``name``: its config's)."""
    while not connection.poll(1.0):
        if not process.is_alive():
            raise StepError(f"{name}: its worker exited with code {process.exitcode}")
    try:
        kind, value = connection.recv()
    except EOFError:  # it died between the poll and the message
        raise StepError(f"{name}: its worker exited with code {process.exitcode}") from None
    if kind != expected:
        raise StepError(f"{name}: {value}")
    return value


def run_paired(configs: list, draws: int, cpus: list[int] | None = None) -> dict:
    """Every config in its worker, stepping in turn; the order of a draw is the previous
    draw's reversed. The workers fork as the CLI's do: from a parent that has imported what
    they build with, its heap out of their collector's reach (a full collection of a worker
    then scans only what the worker made, as in the CLI's). A Ctrl-C during a fork is raised
    here once the fork is done, never in the child's fork callbacks."""
    from dp_cost.measure import children, processes

    processes.import_before_forking(configs)
    context = multiprocessing.get_context("fork")  # the parent never touches CUDA
    workers, finished = [], False
    try:
        for config in configs:
            parent_end, child_end = context.Pipe()
            process = context.Process(target=worker, args=(config, child_end, cpus), daemon=True)
            # listed before it starts: a Ctrl-C raised as the fork ends still finds it below
            workers.append((config, parent_end, process))
            with children.interrupts_after_fork(), children.frozen_heap():
                process.start()
            receive(parent_end, process, "ready", config.config_dir)  # built one at a time
        times = [[] for _ in configs]
        sizes = [[] for _ in configs]
        collected = [[] for _ in configs]  # Python's collections inside each step
        orders = []
        for draw in range(draws):
            order = list(range(len(configs)))
            if draw % 2:
                order.reverse()
            orders.append(order)
            for index in order:
                config, connection, process = workers[index]
                connection.send("step")
                ms, size, collections = receive(connection, process, "step", config.config_dir)
                times[index].append(ms)
                sizes[index].append(size)
                collected[index].append(collections)
        finished = True
    finally:
        stop_workers(workers, graceful=finished)
    if any(s != sizes[0] for s in sizes):
        raise StepError(f"the configs drew different batches: {sizes}")
    rows = [config_row(config, times[i], collected[i], times[0] if i else None)
            for i, config in enumerate(configs)]  # fmt: skip
    return {"draw_sizes": sizes[0], "orders": orders, "cpus": cpus, "configs": rows}


def stop_workers(workers: list, graceful: bool) -> None:
    """Every started worker ended and reaped: told to stop after a finished run (it is idle,
    waiting for its next message), killed otherwise (it may be mid-step). Ctrl-C is ignored
    meanwhile, as in the CLI's clean-up, so a second one cannot leave a worker behind."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for _, connection, process in workers:
            if process.is_alive() and graceful:
                with contextlib.suppress(OSError):
                    connection.send("stop")
                process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    finally:
        if previous is not None:  # None: a handler set outside Python, which stays
            signal.signal(signal.SIGINT, previous)


def config_row(config, times: list[float], collected: list[dict], baseline) -> dict:
    """One config's steps, its collections and (``baseline``: the first config's steps) its
    ratios against the first."""
    return {
        "config": config.config_dir,
        "trainer": config.trainer,
        "step_ms": times,
        "median_ms": statistics.median(times),
        # by generation, over the timed steps; and each step's ms in them
        "gc_collections": [sum(c["collections"][g] for c in collected) for g in GENS],
        "gc_ms": [c["ms"] for c in collected],
        **(ratio_summary(times, baseline) if baseline else {}),
    }


def plan_configs(words: list[str]) -> list:
    import profiling_script
    from dp_cost.core.settings import UsageError
    from dp_cost.measure import plan, processes
    from dp_cost.parallel.mode import distributed_mode

    try:
        args = profiling_script.parse_args(words)
        configs = plan.make_plan(args, profiling_script.cuda_available).configs
    except UsageError as error:
        raise StepError(str(error)) from None
    if len(configs) < 2:
        raise StepError(f"the arguments plan {len(configs)} config(s): paired steps need 2 or more")
    for config in configs:
        if distributed_mode(config.distributed).is_distributed:
            raise StepError("paired steps run one process per config: no --distributed")
        if config.capacity or config.ncu:  # a plan or a profile, not timed steps
            raise StepError(f"--mode={args.mode}: paired steps time training steps (not a plan)")
        reason = processes.skip_reason(config)  # what the CLI would skip
        if reason:
            raise StepError(f"{config.config_dir}: {reason}")
    return configs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    if not argv[split + 1 :]:
        print("paired_steps.py: give the configs' arguments after --", file=sys.stderr)
        return 2
    if args.draws < 1:
        print("paired_steps.py: --draws must be at least 1", file=sys.stderr)
        return 2
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if args.cpus and not set(args.cpus) <= usable:
        print(
            f"paired_steps.py: --cpus {' '.join(map(str, args.cpus))}: this process may run "
            f"only on CPUs {sorted(usable)}",
            file=sys.stderr,
        )
        return 2
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        print(f"paired_steps.py: --out {args.out}: its folder does not exist", file=sys.stderr)
        return 2
    if args.out and os.path.isdir(args.out):
        print(f"paired_steps.py: --out {args.out} is a folder: give a file", file=sys.stderr)
        return 2
    try:
        configs = plan_configs(argv[split + 1 :])
        result = run_paired(configs, args.draws, args.cpus)
    except SystemExit as stop:  # profiling_script's parser printed its one line
        return stop.code if isinstance(stop.code, int) else 2
    except StepError as error:
        print(f"paired_steps.py: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the workers were stopped on the way out (run_paired)
        print("paired_steps.py: interrupted", file=sys.stderr)
        return 130
    where = f", every worker on CPUs {args.cpus}" if args.cpus else ""
    print(f"{args.draws} draws, sizes {result['draw_sizes']}; each config's step in turn{where}")
    for row in result["configs"]:
        line = (
            f"{row['config']}: median {row['median_ms']:.1f} ms, Python's collections "
            f"{'/'.join(map(str, row['gc_collections']))} ({sum(row['gc_ms']):.0f} ms)"
        )
        if "sum_ratio" in row:
            low, high = row["draw_ratio_quartiles"]
            line += (
                f"; against {result['configs'][0]['trainer']}: summed steps "
                f"{row['sum_ratio']:.3f}, draws' ratios median {row['draw_ratio_median']:.3f} "
                f"(quartiles {low:.3f}-{high:.3f})"
            )
        print(line)
    if args.out:
        try:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        except OSError as error:
            print(f"paired_steps.py: --out {args.out}: {error.strerror}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    # A job a shell script puts in the background starts with SIGINT ignored: kill -INT still
    # stops this script, as it stops the CLI.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # outside the run (its arguments, its output): no worker to stop
        print("paired_steps.py: interrupted", file=sys.stderr)
        sys.exit(130)
