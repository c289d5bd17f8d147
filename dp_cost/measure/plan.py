"""Command-line arguments -> the experiment plan: one ``ExperimentConfig`` per combination.

Every value comes from the settings table (``core.settings.SETTINGS``): the command line where
given, else the mode's default. What a mode does without CUDA is its ``Mode`` row. The plan is
checked before any worker starts (``plan_checks``): a bad value is a ``UsageError`` (one line,
exit 2).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from dataclasses import dataclass

from dp_cost.core.hf_architectures import HF_CONFIGS, default_attention
from dp_cost.core.modes import MODES
from dp_cost.core.schema import TRAINER_ORDER, canonical_trainer_name
from dp_cost.core.settings import (
    BY_NAME,
    CONFIG_FIELDS,
    MODEL_OVERRIDES,
    SETTINGS,
    UsageError,
)
from dp_cost.hf.draws import draw_above_probability
from dp_cost.measure.config import ExperimentConfig
from dp_cost.measure.plan_checks import check, check_cpu_model_size
from dp_cost.parallel import ranks
from dp_cost.parallel.mode import distributed_mode, sharded_modes


@dataclass
class Plan:
    mode: str  # the mode that runs: a GPU mode without CUDA may run as another
    device: str  # "cuda" or "cpu"
    configs: list  # list[ExperimentConfig]
    note: str | None = None  # printed before the run: what a graph will replay
    device_note: str | None = None  # what changed without CUDA (printed before the checks)


# What a GPU mode sizes for a GPU: without CUDA its CPU defaults' replace them, given or not.
CPU_SHAPE = ("model", "batch_size", "seq_len", "max_physical_batch_size")


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # "cuda" or "cpu"
    running: str  # the mode that runs
    defaults: str  # the mode whose defaults apply
    note: str | None = None  # what changed without CUDA
    cpu_shape: bool = False  # the CPU defaults' shape replaces the GPU-sized one (CPU_SHAPE)


def resolve_device(args: argparse.Namespace, cuda_available) -> DeviceChoice:
    """Where the plan runs and whose defaults it takes. ``cuda_available()`` is asked only when
    the device is not forced to CPU."""
    mode = MODES[args.mode]
    requested = args.device or BY_NAME["device"].default_for(mode.name)
    if requested == "cpu":
        return DeviceChoice("cpu", mode.name, mode.name)
    if cuda_available():
        return DeviceChoice("cuda", mode.name, mode.name)
    if requested == "cuda":
        raise UsageError("--device cuda was given but no CUDA device is available")
    if mode.cpu_defaults is None:  # its own defaults on the CPU, with the CPU's model
        note = mode.cpu_message.format(model=args.model or mode.cpu_model)
        return DeviceChoice("cpu", mode.name, mode.name, note)
    running = mode.cpu_defaults if mode.cpu_becomes else mode.name
    return DeviceChoice("cpu", running, mode.cpu_defaults, cpu_shape_note(args, mode), True)


def cpu_shape_note(args: argparse.Namespace, mode) -> str:
    """The line a GPU mode without CUDA starts with: the CPU defaults' shape it runs, and the
    shape flags given that it does not use."""
    shape = [f"model {BY_NAME['model'].default_for(mode.cpu_defaults)}"] + [
        f"{words} {' '.join(map(str, BY_NAME[name].default_for(mode.cpu_defaults)))}"
        for name, words in (("batch_size", "batch sizes"), ("seq_len", "sequence lengths"))
    ]
    given = [
        f"{s.flags[0]} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        for s in SETTINGS
        if (s.name in CPU_SHAPE or s.into == "model_overrides")
        and (value := getattr(args, s.dest, None)) is not None
    ]
    unused = f"\nNot used: {' '.join(given)} (--device cpu runs them on the CPU)." if given else ""
    return f"{mode.cpu_message}: {', '.join(shape)}.{unused}"


def make_plan(args: argparse.Namespace, cuda_available) -> Plan:
    """The plan of ``args``: a device note (no CUDA) is printed first, before any check."""
    choice = resolve_device(args, cuda_available)
    if choice.note and os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 speaks
        print(choice.note, flush=True)
    mode = MODES[args.mode]

    def value(setting):
        given = getattr(args, setting.dest, None) if setting.flags else None
        if given is not None and not (choice.cpu_shape and setting.name in CPU_SHAPE):
            return given
        if setting.name == "model" and choice.note and mode.cpu_model:  # no CUDA: its model
            return mode.cpu_model
        return setting.default_for(choice.running if setting.follows_mode else choice.defaults)

    values = {s.name: value(s) for s in CONFIG_FIELDS}
    values["model_overrides"] = {
        name: getattr(args, name)
        for name in MODEL_OVERRIDES
        if getattr(args, name) is not None and not choice.cpu_shape
    }
    values["default_model"] = BY_NAME["model"].default_for(choice.defaults)
    values["device"] = choice.device
    if args.attention is None:
        values["attention"] = default_attention(values["model"])
    if values["ncu"]:  # one replayed step: no trace, no breakdown
        values["trace"] = values["breakdown"] = False
    shardings = planned_shardings(args, mode, values["distributed"])
    names = [args.trainer] if args.trainer else values["trainer"]
    try:
        known = trainer_names()
        names = [canonical_trainer_name(n, known) for n in names or known]
    except ValueError as error:
        raise UsageError(str(error)) from None
    values["trainer"] = names
    axes = {name: _unique(values.pop(name)) for name in ("batch_size", "seq_len", "trainer")}
    axes["max_physical_batch_size"] = _unique(values.pop("max_physical_batch_size") or [None])
    axes["lora_rank"] = _lora_ranks(args, values.pop("lora_rank"))
    configs, notes = [], []
    for sharding in shardings:  # each sharding's values checked, then its configs made
        sharded = {**values, "distributed": sharding}
        sharded["world_size"] = world_size(sharding, args.world_size, mode)
        dataset_size = check(sharded, axes, args)
        # --gpu_memory: a card named twice is searched once
        sharded["gpu_memory"] = _unique(sharded["gpu_memory"] or []) or None
        notes += [poisson_graph_note(sharded, axes, dataset_size), ddp_graph_note(sharded, axes)]
        order = ("batch_size", "max_physical_batch_size", "seq_len", "lora_rank", "trainer")
        configs += [
            ExperimentConfig(**sharded, **dict(zip(order, combination)))
            for combination in itertools.product(*(axes[name] for name in order))
        ]
    forced_cpu = choice.device == "cpu" and args.device != "cpu" and not choice.cpu_shape
    if forced_cpu and args.model and not mode.predicts:
        check_cpu_model_size(args.model, values["model_overrides"], no_cuda=bool(choice.note))
    notes.insert(0, unplanned_shardings_note(args, mode, values))
    note = "\n".join(_unique([n for n in notes if n])) or None
    return Plan(choice.running, choice.device, configs, note, choice.note)


def planned_shardings(args: argparse.Namespace, mode, distributed: str) -> list[str]:
    """The shardings the plan covers: --distributed's one, or, for --mode=capacity planning
    --world_size W > 1 ranks without it, every sharding over ranks (DDP and FSDP2) that can
    run the step (with --cuda_graph, those a graph can capture), so a plan (and --recommend's
    ranking) answers which to run."""
    if not every_sharding(args, mode):
        return [distributed]
    return [name for name in sharded_modes() if not _graph_refused(args, name)]


def every_sharding(args: argparse.Namespace, mode) -> bool:
    return mode.predicts and (args.world_size or 1) > 1 and args.distributed is None


def _graph_refused(args: argparse.Namespace, sharding: str) -> str | None:
    return distributed_mode(sharding).graph_refusal if args.cuda_graph else None


def unplanned_shardings_note(args: argparse.Namespace, mode, values: dict) -> str | None:
    """The line a plan of every sharding starts with when --cuda_graph leaves one out."""
    if not every_sharding(args, mode):
        return None
    left = [f"{name}: {why}" for name in sharded_modes() if (why := _graph_refused(args, name))]
    return f"note: not planned under --distributed {'; '.join(left)}" if left else None


def trainer_names() -> list[str]:
    """The registered trainers' names (``training.registry.TRAINERS``), read without importing
    torch where nothing imported the registry yet: it then holds the built-in trainers alone
    (``TRAINER_ORDER``; a test keeps the two equal), since registering one imports it."""
    registry = sys.modules.get("dp_cost.training.registry")
    return list(registry.TRAINERS) if registry is not None else list(TRAINER_ORDER)


def ddp_graph_note(values: dict, axes: dict) -> str | None:
    """standard under DDP is captured only after DDP's 11th iteration: say so before the run
    when the warm-up steps stop short of it (the timed steps would start eagerly)."""
    graphed = values["cuda_graph"] and distributed_mode(values["distributed"]).replicates
    if not graphed or "standard" not in axes["trainer"]:
        return None
    from dp_cost.parallel import ddp  # torch: imported once the checks that need none have passed

    if values["warmup_steps"] >= ddp.EAGER_ITERATIONS:
        return None
    return (
        f"note: --cuda_graph under DDP captures standard after DDP's {ddp.EAGER_ITERATIONS}th "
        f"iteration: with --warmup_steps {values['warmup_steps']} its first timed steps run "
        f"eagerly (give --warmup_steps {ddp.EAGER_ITERATIONS})"
    )


def poisson_graph_note(values: dict, axes: dict, dataset_size: int) -> str | None:
    """With --cuda_graph and Poisson batches (Hugging Face models) the graph replays chunks of
    P samples, P the expected batch (a rank's share of it) unless a smaller cap is given: say,
    before the run, how often a draw takes a second chunk then, and what a cap does."""
    if not (values["cuda_graph"] and values["poisson"] and values["model"] in HF_CONFIGS):
        return None
    from dp_cost.training import registry as trainers  # torch: after the checks needing none

    if not any(trainers.TRAINERS[name].capturable for name in axes["trainer"]):
        return None  # every config is skipped, with its reason
    ranks = values["world_size"]
    uncapped = [
        batch
        for batch in axes["batch_size"]
        for cap in axes["max_physical_batch_size"]
        if cap is None or cap >= math.ceil(batch / ranks)
    ]
    if not uncapped:
        return None
    # A draw of n takes a second chunk on some rank when its largest share, ceil(n / W), is
    # above P = ceil(B / W): n > W * P. N: the labelled pairs of a dataset file, or
    # --dataset_size.
    shares = ", ".join(
        f"{100 * draw_above_probability(ranks * math.ceil(b / ranks), b, dataset_size):.2g}% "
        f"of steps at batch {b}"
        for b in _unique(uncapped)
    )
    return (
        "note: --cuda_graph replays padded chunks of the expected batch (a rank's share of it) "
        f"when --max_physical_batch_size does not cap it lower; larger Poisson draws replay two "
        f"chunks, the second mostly padding (about {shares}). A smaller "
        "--max_physical_batch_size pads less; every draw replays the graphs either way."
    )


def _unique(values) -> list:
    """Each value once, in order: a repeated value would run one config directory twice."""
    return list(dict.fromkeys(values if isinstance(values, list) else [values]))


def _lora_ranks(args, ranks) -> list[int]:
    """The LoRA ranks to run; without --use_lora one, recorded in the config and not used (a
    rank given without it is refused by its scope)."""
    return _unique(ranks) if args.use_lora else [BY_NAME["lora_rank"].default]


def world_size(distributed: str, planned: int | None, mode) -> int:
    """The ranks of a distributed run: torchrun's WORLD_SIZE, or ``planned`` (--world_size, for
    --mode=capacity without torchrun); UsageError where --distributed, --world_size and the way
    the CLI was started disagree."""
    try:
        info = ranks.from_environment()
    except ValueError as error:
        raise UsageError(str(error)) from None
    over_ranks = distributed_mode(distributed).is_distributed
    if planned is not None:
        if not mode.predicts:
            raise UsageError(
                "--world_size plans ranks without torchrun: it needs --mode=capacity (a "
                "measuring run takes its ranks from torchrun)"
            )
        if not 1 <= planned <= MAX_PLANNED_RANKS:
            raise UsageError(f"--world_size must be in 1..{MAX_PLANNED_RANKS}, got {planned}")
        if info is not None:
            raise UsageError(
                "--world_size plans ranks in one process: run --mode=capacity without "
                "torchrun (under torchrun, --validate measures on the job's own ranks)"
            )
        if planned > 1 and not over_ranks:  # --distributed none given (else both are planned)
            raise UsageError(
                f"--world_size {planned} plans ranks of --distributed ddp or fsdp, not "
                f"{distributed}: give one, or neither to plan both"
            )
        if planned == 1 and over_ranks:
            raise UsageError(
                f"--distributed {distributed} plans 2 or more ranks: give --world_size 2 or more "
                "(one rank is --distributed none)"
            )
    if not over_ranks:
        if info is not None and info.world_size > 1:
            raise UsageError(
                f"started by torchrun with {info.world_size} ranks: add --distributed ddp or "
                "--distributed fsdp (else every rank would run every config alone)"
            )
        return 1
    if info is None:
        if mode.predicts:
            if planned is None:
                raise UsageError(
                    f"--mode=capacity --distributed {distributed} plans ranks in one process: "
                    "give their number, --world_size W"
                )
            return planned
        raise UsageError(
            f"--distributed {distributed} runs under torchrun, one process per GPU: "
            f"torchrun --nproc_per_node <GPUs> profiling_script.py ... --distributed {distributed}"
        )
    return info.world_size


MAX_PLANNED_RANKS = 4096
