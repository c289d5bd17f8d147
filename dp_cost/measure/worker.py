"""One config measured in this process: build the workload and trainer, run its measurements,
classify the outcome, write ``result.json``. ``measure.processes`` runs this in a fresh child."""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import signal
import sys
import traceback

import opacus
import torch

from dp_cost.capacity.card import GIB
from dp_cost.capacity.result import capacity_result
from dp_cost.core.files import UnsafePath, non_finite_paths, write_json
from dp_cost.core.schema import empty_result
from dp_cost.measure import census, phases, quiet, ranks
from dp_cost.measure.steps import Session, measurements
from dp_cost.measure.workload import Workload
from dp_cost.parallel import collectives
from dp_cost.training import registry as trainers


def environment(device: torch.device) -> dict:
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "memory_source": phases.memory_source(device),
    }
    if device.type == "cpu":
        env["threads"] = torch.get_num_threads()
        env["reserved_note"] = "no caching allocator on CPU: reserved memory is not measured"
    return env


def result_skeleton(config, status: str, error: str | None = None) -> dict:
    return empty_result(config.to_dict(), config.config_dir, status, error)


def run_experiment(config, out_dir: str, rank_setup=None) -> dict:
    """One config in this process: measured, or predicted (--mode=capacity)."""
    if config.capacity:
        return predict_experiment(config, out_dir, rank_setup)
    return measure_experiment(config, out_dir, rank_setup)


def predict_experiment(config, out_dir: str, rank_setup=None) -> dict:
    """--mode=capacity: the config's peak predicted on fake tensors (``capacity.fake_step``; its
    ranks planned in this process); with --validate, then measured in this process as the
    measuring modes do (a rank of a torchrun job: after the prediction, which needs this
    process outside the job's group), the prediction kept whatever the measurement's outcome
    (an out-of-memory included)."""
    card_gib = None
    if config.find_max_batch or config.find_max_seq_len:  # the whole card, as torch reports it
        card_gib = torch.cuda.mem_get_info(torch.device(config.device))[1] / GIB
    prediction = capacity_result(config, build_trainer, card_gib)
    if not config.validate:
        result = result_skeleton(config, "ok")
        result["env"] = {
            "device": "fake tensors on the CPU (no GPU used)",
            "torch": torch.__version__,
            "opacus": opacus.__version__,
        }
    else:
        result = classified_run(dataclasses.replace(config, capacity=False), out_dir, rank_setup)
        result["config"] = config.to_dict()
    result["prediction"] = prediction
    return result


def measure_experiment(config, out_dir: str, rank_setup=None) -> dict:
    """Build, warm up and measure one config in this process; returns its result dict.

    The timed steps run first and alone; then, on the last sampled batch, what else the config
    asks for (``measure.steps.measurements``): none of it disturbs the timed steps.
    ``rank_setup``: (parallel.ranks.RankInfo, store prefix) of a distributed config: this
    process is one rank's worker and joins the config's process group first.
    """
    device = torch.device(config.device)
    if rank_setup is not None:
        info, prefix = rank_setup
        if device.type == "cuda":
            device = torch.device("cuda", info.local_rank)
            torch.cuda.set_device(device)
        collectives.init_worker_group(info, prefix, device)
    torch.manual_seed(config.seed)  # every rank builds the same model and global batches
    result = result_skeleton(config, "ok")
    result["env"] = env = environment(device)
    if rank_setup is not None:
        env.update(rank=info.rank, world_size=info.world_size)
    recorder = phases.PhaseRecorder(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rank, world_size = (info.rank, info.world_size) if rank_setup else (0, 1)
    workload = Workload(config, device, recorder, env, rank=rank, world_size=world_size)
    runner = build_trainer(config, workload.model, workload.loss_fn, recorder, workload.materialize)
    if rank_setup is not None:  # each rank its own torch stream (flash keeps its ranks' noise
        # apart itself; this keeps whatever else draws from torch's generator apart too)
        torch.manual_seed(config.seed + 1_000_003 * info.rank)
    session = Session(config, device, runner, workload, recorder, out_dir, env)
    if config.detailed_memory:
        session.module_census = census.ModuleCensus(runner)
    # Only the timed steps record phase snapshots (they observe with the recorder themselves).
    with runner.observing_phases(lambda name: None):
        for measurement in measurements(config):
            measurement.run(session, result)
    if rank_setup is not None and result.get("communication_time_ms") is None:
        # measure.steps.Trace sets it from the NCCL kernels of a CUDA trace
        why = (
            "gloo's collectives run on CPU threads"
            if device.type == "cpu"
            else "the trace could not be read"
            if config.trace
            else "no trace ran (--no_trace)"
        )
        env["communication_note"] = (
            f"communication time comes from a CUDA trace's NCCL kernels; {why}"
        )
    return result


def build_trainer(config, model, loss_fn, on_phase, materialize=None):
    """The config's trainer around ``model``, in its Runner (the measuring modes and the
    capacity prediction build it alike); ``materialize``: see make_trainer."""
    return trainers.make_trainer(
        config.trainer,
        model,
        lr=config.lr,
        max_grad_norm=config.max_grad_norm,
        noise_multiplier=config.noise_multiplier,
        batch_size=config.batch_size,
        optimizer=config.optimizer,
        dtype=getattr(torch, config.dtype),
        max_physical_batch_size=config.max_physical_batch_size,
        loss_fn=loss_fn,
        on_phase=on_phase,
        distributed=config.distributed,
        cuda_graph=config.cuda_graph,
        fsdp_sync=config.fsdp_sync,
        clipping=config.clipping,
        materialize=materialize,
        **{option: getattr(config, option) for option in trainers.TRAINERS[config.trainer].options},
    )


def worker_main(
    config, config_path: str, errors=None, stderr=None, rank_setup=None, result_name="result.json"
) -> None:
    """Entry point of the forked child: run, classify the outcome, write ``result_name``.
    ``errors``: a pipe end on which a result that cannot be written (disk full) is reported;
    ``stderr``: a ``quiet.FilteredStderr`` to write through (None: ``--verbose``);
    ``rank_setup``: see run_experiment."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C stops
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler: terminate() stops it
    if stderr is not None:
        stderr.attach()
        quiet.filter_warnings()
    if rank_setup is not None:  # every rank's CLI watches that this worker is alive
        ranks.start_heartbeat(*rank_setup, config.rank_timeout)
    # A distributed worker leaves its process group to the process's end (multiprocessing ends
    # the child with os._exit): tearing gloo down explicitly can abort, losing the result.
    result = classified_run(config, config_path, rank_setup)
    run_dir = os.path.dirname(config_path)  # nothing below it is written through a link
    try:
        write_json(os.path.join(config_path, result_name), result, root=run_dir)
    except (OSError, UnsafePath) as error:  # the parent records it: "worker died" hides why
        message = f"could not write result.json: {type(error).__name__}: {error}"
        if errors is not None:
            errors.send(message)
        else:
            print(f"{config.config_dir}: {message}", file=sys.stderr)
        sys.exit(1)


def classified_run(config, config_path: str, rank_setup=None) -> dict:
    """The result of one config, whatever happens: ok, oom or error."""
    try:
        result = run_experiment(config, config_path, rank_setup)
    except Exception as error:  # noqa: BLE001 - every failure becomes a recorded status
        status = "oom" if is_oom(error) else "error"
        message = f"{type(error).__name__}: {error}"
        if isinstance(error, MemoryError):
            message = f"MemoryError: host out of memory {error}".rstrip()
        result = result_skeleton(config, status, message)
        if status == "error":
            result["traceback"] = traceback.format_exc()
    # Strict JSON has no NaN or infinity: they are written as null, and the result says why.
    paths = non_finite_paths({k: v for k, v in result.items() if k != "config"})
    if paths:
        note = f"non-finite values (NaN or infinity) written as null: {', '.join(paths[:10])}"
        if result["status"] == "ok" and any(p.startswith("losses") for p in paths):
            result["status"], result["error"] = "error", note  # a diverged run is no measurement
        elif isinstance(result["env"], dict):
            result["env"]["non_finite_note"] = note  # e.g. epsilon without noise
    return result


def is_oom(error: BaseException) -> bool:
    """CUDA out of memory, or the host's: MemoryError, or torch's CPU allocator failing."""
    text = str(error)
    return (
        isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError))
        or "out of memory" in text
        or "can't allocate memory" in text
    )


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Linux: the kernel kills this worker when the CLI process dies, so a killed run never
    leaves a worker measuring beside the next one. Elsewhere nothing is done."""
    parent = multiprocessing.parent_process()
    if not sys.platform.startswith("linux") or parent is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent.pid:  # the parent died before prctl took effect
        os._exit(1)
