"""One measuring run: its directory, what produced it (run.json), its configs measured and
summarised, an interrupt reported with the command that continues it.

The CLI (profiling_script.py) parses the arguments and makes the plan; this module takes the
plan from there. It imports torch (through the worker processes): the CLI imports it only once
the plan's checks have passed. Under torchrun the ranks' CLI processes form one run: rank 0
names and locks the directory, and speaks for the job.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time

from dp_cost.core import interrupts, rundir
from dp_cost.core.files import write_json
from dp_cost.core.fmt import count
from dp_cost.core.interrupts import say
from dp_cost.core.reading import read_json_or_none
from dp_cost.core.schema import EXIT_BAD_ARGS, EXIT_CONFIG_ERROR, exit_code_of
from dp_cost.core.scratch import scratch_folder
from dp_cost.core.settings import UsageError
from dp_cost.measure import processes, ranks
from dp_cost.measure.config import changed_settings
from dp_cost.report import run_info, summary
from dp_cost.report.result_check import result_problem
from dp_cost.report.run_info import RUN_FILE


def run_plan(args, experiment) -> int:
    """Measure the plan's configs into a run directory and summarise them; the exit code."""
    configs = experiment.configs
    # Several ranks measure under torchrun; --mode=capacity plans its ranks in one process.
    first = configs[0] if configs else None
    if first and first.distributed_mode.is_distributed and (first.validate or not first.capacity):
        return run_distributed(args, experiment)
    run = prepare_run_dir(args, experiment)
    try:
        with scratch_folder(run.path):
            return measure_and_summarise(args, experiment, run.path)
    finally:
        run.close()


def prepare_run_dir(args, experiment) -> rundir.RunDir:
    """The run directory, created and locked, with --resume's and containment's checks done."""
    if experiment.note:
        print(experiment.note)
    run = None
    try:
        with interrupts.held():  # made and locked whole: an interrupt finds it in open_now
            run = rundir.RunDir(*make_run_dir(args, experiment.mode), kept_names=(RUN_FILE,))
        run_dir = run.path
        # A link planted in the run: refused before anything is read through it or measured.
        rundir.check_contained(run_dir, os.path.join(run_dir, RUN_FILE))
        for config in experiment.configs:
            rundir.check_contained(run_dir, os.path.join(run_dir, config.config_dir, "result.json"))
        if args.resume:
            refuse_changed_settings(experiment.configs, run_dir)
            rundir.remove_stale_temporaries(run_dir, lock_held=True)  # a killed run's
        record_run(run_dir, args.command_line)
    except BaseException:
        if run is not None:
            run.close()
        raise
    return run


def make_run_dir(args, mode: str) -> tuple[str, bool]:
    """The run directory, created (or, with --resume, found) inside --output_dir, and whether
    this run created it."""
    run_name = args.run_name or f"{mode}_{time.strftime('%Y%m%d_%H%M%S')}"
    made = True
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        if args.resume:
            run_dir, made = rundir.check_resumable(args.output_dir, args.run_name), False
        else:
            run_dir = rundir.new_run_dir(args.output_dir, run_name, numbered=not args.run_name)
    except OSError as error:
        raise UsageError(f"cannot create the run directory: {error}") from None
    rundir.check_contained(args.output_dir, run_dir)
    return run_dir, made


def refuse_changed_settings(configs: list, run_dir: str) -> None:
    """--resume adds missing configs; a finished one measured with other settings (lr, sigma,
    steps, ...: not all are in the directory name) must not pass as this run's result."""
    for config in configs:
        path = os.path.join(run_dir, config.config_dir, "result.json")
        previous = read_json_or_none(path, root=run_dir)
        if result_problem(previous, config.config_dir) is not None:
            continue  # not a result this run can have written: --resume measures it again
        changed = changed_settings(previous["config"], config.to_dict())
        if changed:
            raise UsageError(
                f"{config.config_dir} in {run_dir} was measured with other settings "
                f"({', '.join(changed)}): use a new --run_name"
            )


def record_run(run_dir: str, command: list[str]) -> None:
    """``<run>/run.json``: what produced the run (the head of report.html). A resumed run keeps
    the first command and adds each resume's."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    path = os.path.join(run_dir, RUN_FILE)
    record = read_json_or_none(path, root=run_dir)  # None for a first run (no file yet)
    if isinstance(record, dict) and "command" in record:
        resumed = record.get("resumed") if isinstance(record.get("resumed"), list) else []
        record["resumed"] = [*resumed, {"command": command, "date": now}]
    else:
        versions = {"python": platform.python_version(), "git_commit": git_commit()}
        for package in ("torch", "opacus"):  # imported by the plan by now
            module = sys.modules.get(package)
            versions[package] = getattr(module, "__version__", None)
        record = {"command": command, "date": now, "versions": versions}
    write_json(path, record)


def git_commit(checkout: str | None = None) -> str | None:
    """The toolkit's commit (``+dirty`` with uncommitted changes), or None outside a checkout.
    Read only: ``--no-optional-locks`` keeps ``git status`` from refreshing the checkout's index
    (it would take ``.git/index.lock`` and rewrite the index: a write outside the run)."""
    here = checkout or os.path.dirname(os.path.abspath(__file__))
    try:
        run = lambda *cmd: subprocess.run(  # noqa: E731
            ["git", "--no-optional-locks", *cmd],
            cwd=here, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        commit = run("rev-parse", "HEAD")
        return commit + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def record_load(run_dir: str, at_start: dict, at_end: dict, own: int | None = None) -> None:
    """The machine's load while the configs ran, into run.json (its latest run or resume), with
    the run's own processes the readings count (``own``): one worker at a time, or one a core
    for a plan that only predicts; one per rank on this node under torchrun (None)."""
    record = read_json_or_none(os.path.join(run_dir, RUN_FILE), root=run_dir)
    if not isinstance(record, dict):
        return
    resumed = record.get("resumed")
    latest = resumed[-1] if isinstance(resumed, list) and resumed else record
    if isinstance(latest, dict):
        own = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if own is None else own
        latest["machine_load"] = {"at_start": at_start, "at_end": at_end, "own_processes": own}
        write_json(os.path.join(run_dir, RUN_FILE), record)


def run_distributed(args, experiment) -> int:
    """One run for the ranks of a torchrun job: rank 0 names and locks the run directory and
    tells the others; every rank runs its workers; rank 0 prints and summarises; every rank
    exits with rank 0's code."""
    from dp_cost.parallel.ranks import from_environment

    group = ranks.RankGroup(from_environment())
    run = None
    if group.is_first:
        try:
            run = prepare_run_dir(args, experiment)
        except UsageError as error:
            group.last_broadcast("run_dir", {"error": str(error)})
            raise
        run_dir = run.path
        group.broadcast("run_dir", {"run_dir": run_dir})
    else:
        answer = group.last_broadcast("run_dir")  # read: rank 0 may leave on an error
        if "error" in answer:  # rank 0 reports it
            return EXIT_BAD_ARGS
        run_dir = answer["run_dir"]
        os.makedirs(run_dir, exist_ok=True)  # another node's disk
    try:
        plans = group.gather("plan", [c.config_dir for c in experiment.configs])
        same = group.broadcast("same_plan", plans is None or all(p == plans[0] for p in plans))
        if not same:
            group.last_broadcast("same_plan")  # read by every rank before rank 0 leaves
            raise UsageError("the ranks planned different configs: give every rank the same flags")
        with scratch_folder(run_dir):  # one a rank
            if group.is_first:
                code = measure_and_summarise(args, experiment, run_dir, group)
            else:
                with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115
                    measure_and_summarise(args, experiment, run_dir, group)
                code = None
        return group.last_broadcast("exit_code", code)
    except ranks.SilentRank:  # said by measure_and_summarise; no rank waits for another now
        return EXIT_CONFIG_ERROR
    finally:
        if run is not None:
            run.close()


def measure_and_summarise(args, experiment, run_dir: str, group=None) -> int:
    configs = experiment.configs
    first = group is None or group.is_first  # rank 0 summarises
    reached = "configs"  # how far the run got: what an interrupt reports
    try:
        where = experiment.device
        if group is not None:
            where = f"{count(group.info.world_size, 'rank')} ({configs[0].distributed}, {where})"
        print(f"{count(len(configs), 'config')} on {where}, results in {run_dir}")
        load_at_start = run_info.machine_load()
        workers = processes.workers_at_once(configs, group)  # the run's, recorded below
        results = processes.run_configs(
            configs,
            run_dir,
            resume=args.resume,
            progress=experiment.mode == "hf_sweep" and first,
            verbose=args.verbose,
            group=group,
            workers=workers,
        )
        if not first:
            return exit_code_of(results)
        reached = "report"
        load_at_end = run_info.machine_load()
        record_load(run_dir, load_at_start, load_at_end, workers if group is None else None)
        print()
        # Summarise every result in the run directory: a --resume run adds to earlier ones.
        loaded = summary.load_results(run_dir)
        text = summary.write_summary(run_dir, loaded)
        reached = "done"
        print(text)
        if not summary.is_capacity(loaded):  # a capacity run names its files
            print(f"Summary: {run_dir}/summary.csv, {run_dir}/summary.md")
        interrupts.ignore()  # done: a signal now has nothing left to stop
        return exit_code_of(results)
    except ranks.SilentRank as silent:  # the job ends: rank 0 says so (another, if it is 0)
        interrupts.ignore()  # torchrun stops the other ranks once one has ended: say it whole
        if first or silent.rank == 0:
            report_ended_job(args, run_dir, silent, summarise=first)
        raise
    except (processes.Interrupted, KeyboardInterrupt) as interrupted:
        interrupts.ignore()  # a second Ctrl-C while the summary is written: no traceback
        if not first:
            return interrupts.exit_code()
        if reached == "configs":
            report_interrupt(args, run_dir, str(interrupted) or "before the first config")
        else:  # every result is complete: the summary is written again, unless it was
            when = "while the report was written" if reached == "report" else "at the end"
            report_interrupt(
                args, run_dir, when, every_config_ran=True, summarise=reached != "done"
            )
        return interrupts.exit_code()


def report_ended_job(args, run_dir, silent, summarise: bool) -> None:
    """A rank fell silent: the line that names it, the summary of what finished (its config's
    error included) and the command that continues the run."""
    say(f"error: {silent}: the job is ended", sys.stderr)
    try:
        if summarise:
            say(summary.write_summary(run_dir, summary.load_results(run_dir)))
    except Exception as error:  # noqa: BLE001 - a full disk, ...: what finished is complete
        say(f"The summary could not be written ({type(error).__name__}: {error}).", sys.stderr)
    interrupts.say_continue(args.command_line, os.path.basename(run_dir))


def report_interrupt(args, run_dir, when: str, every_config_ran=False, summarise=True) -> None:
    """After an interrupt (every signal ignored by now): what was kept, the summary of it, and
    the command that continues the run."""
    finished = None
    try:
        finished = summary.load_results(run_dir)
        kept = count(len(finished), "finished config") + " kept"
        say(
            f"\nInterrupted {when}; "
            + (f"every config had finished: {kept}." if every_config_ran else f"{kept}.")
        )
        if finished and summarise:
            say(summary.write_summary(run_dir, finished))
            say(f"Summary: {run_dir}/summary.csv, {run_dir}/summary.md")
    except Exception as error:  # noqa: BLE001 - a full disk, ...: what finished is complete
        if finished is None:
            say(f"\nInterrupted {when}.")
        report = [*interrupts.launcher_words(), "--mode=report", "--input_dir", run_dir]
        say(f"The summary could not be written ({type(error).__name__}: {error}).", sys.stderr)
        say(f"Write it once the cause is fixed: {shlex.join(report)}", sys.stderr)
    resumable = rundir.kept_after_close(run_dir)
    interrupts.say_continue(args.command_line, os.path.basename(run_dir), resumable)
