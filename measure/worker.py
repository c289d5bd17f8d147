"""One config measured in this process: build the workload and trainer, run its measurements,
classify the outcome, write ``result.json``. ``measure.processes`` runs this in a fresh child."""

from __future__ import annotations

import os
import signal
import traceback
import warnings

import opacus
import torch

import trainers
from core.files import write_json
from core.schema import empty_result
from measure import census, phases
from measure.steps import Session, measurements
from measure.workload import Workload


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


def run_experiment(config, out_dir: str) -> dict:
    """Build, warm up and measure one config in this process; returns its result dict.

    The timed steps run first and alone; then, on the last sampled batch, what else the config
    asks for (``measure.steps.measurements``): none of it disturbs the timed steps.
    """
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    result = result_skeleton(config, "ok")
    result["env"] = env = environment(device)
    recorder = phases.PhaseRecorder(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    workload = Workload(config, device, recorder, env)
    trainer = trainers.make_trainer(
        config.trainer,
        workload.model,
        lr=config.lr,
        max_grad_norm=config.max_grad_norm,
        noise_multiplier=config.noise_multiplier,
        batch_size=config.batch_size,
        optimizer=config.optimizer,
        dtype=getattr(torch, config.dtype),
        max_physical_batch_size=config.max_physical_batch_size,
        loss_fn=workload.loss_fn,
        on_phase=recorder,
        **{option: getattr(config, option) for option in trainers.TRAINERS[config.trainer].options},
    )
    session = Session(config, device, trainer, workload, recorder, out_dir, env)
    if config.detailed_memory:
        session.census = census.ModuleCensus(trainer)
    # Only the timed steps record phase snapshots (they observe with the recorder themselves).
    with trainer.observing_phases(lambda name: None):
        for measurement in measurements(config):
            measurement.run(session, result)
    return result


def worker_main(config, config_path: str) -> None:
    """Entry point of the forked child: run, classify the outcome, write result.json."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C stops
    # Opacus' hooks warn on every backward of a model whose inputs need no grad (token ids).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    try:
        result = run_experiment(config, config_path)
    except Exception as error:  # noqa: BLE001 - every failure becomes a recorded status
        status = "oom" if is_oom(error) else "error"
        result = result_skeleton(config, status, f"{type(error).__name__}: {error}")
        if status == "error":
            result["traceback"] = traceback.format_exc()
    write_json(os.path.join(config_path, "result.json"), result)


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)
