"""Command-line arguments -> the experiment plan: one ``ExperimentConfig`` per combination.

Every value comes from the settings table (``core.settings.SETTINGS``): the command line where
given, else the mode's default. What a mode does without CUDA is its ``Mode`` row. The plan is
checked here, before any worker starts: a bad value is a ``UsageError`` (one line, exit 2).
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import dataclass

import models
import trainers
from core.settings import (
    BY_NAME,
    CONFIG_FIELDS,
    MODEL_OVERRIDES,
    MODES,
    ExperimentConfig,
    UsageError,
    default_attention,
)
from hf.configs import HF_CONFIGS


@dataclass
class Plan:
    mode: str  # the mode that runs: a GPU mode without CUDA may run as another
    device: str  # "cuda" or "cpu"
    configs: list  # list[ExperimentConfig]
    note: str | None = None  # what changed because no CUDA device was found


def resolve_device(args: argparse.Namespace, cuda_available) -> tuple[str, str, str, str | None]:
    """(device, mode that runs, mode whose defaults apply, note). ``cuda_available()`` is asked
    only when the device is not forced to CPU."""
    mode = MODES[args.mode]
    requested = args.device or BY_NAME["device"].default_for(mode.name)
    if requested == "cpu":
        return "cpu", mode.name, mode.name, None
    if cuda_available():
        return "cuda", mode.name, mode.name, None
    if requested == "cuda":
        raise UsageError("--device cuda was given but no CUDA device is available")
    running = mode.cpu_defaults if mode.cpu_becomes else mode.name
    defaults = mode.cpu_defaults or mode.name
    model = args.model or mode.cpu_model
    return "cpu", running, defaults, mode.cpu_message.format(model=model)


def make_plan(args: argparse.Namespace, cuda_available) -> Plan:
    device, running, defaults, note = resolve_device(args, cuda_available)
    mode = MODES[args.mode]

    def value(setting):
        given = getattr(args, setting.dest, None) if setting.flags else None
        if given is not None:
            return given
        if setting.name == "model" and note and mode.cpu_model:  # no CUDA: the CPU model
            return mode.cpu_model
        return setting.default_for(running if setting.follows_mode else defaults)

    values = {s.name: value(s) for s in CONFIG_FIELDS}
    values["model_overrides"] = {
        name: getattr(args, name) for name in MODEL_OVERRIDES if getattr(args, name) is not None
    }
    values["default_model"] = BY_NAME["model"].default_for(defaults)
    values["device"] = device
    if args.attention is None:
        values["attention"] = default_attention(values["model"])
    if values["ncu"]:  # one replayed step: no trace, no breakdown
        values["trace"] = values["breakdown"] = False
    names = [args.trainer] if args.trainer else values["trainer"]
    try:
        names = [trainers.canonical_trainer_name(n) for n in names or trainers.TRAINERS]
    except ValueError as error:
        raise UsageError(str(error)) from None
    values["trainer"] = names
    axes = {name: _unique(values.pop(name)) for name in ("batch_size", "seq_len", "trainer")}
    axes["max_physical_batch_size"] = _unique(values.pop("max_physical_batch_size") or [None])
    axes["lora_rank"] = _lora_ranks(args, values.pop("lora_rank"))
    check(values, axes, args)
    order = ("batch_size", "max_physical_batch_size", "seq_len", "lora_rank", "trainer")
    configs = [
        ExperimentConfig(**values, **dict(zip(order, combination)))
        for combination in itertools.product(*(axes[name] for name in order))
    ]
    return Plan(running, device, configs, note)


def _unique(values) -> list:
    """Each value once, in order: a repeated value would run one config directory twice."""
    return list(dict.fromkeys(values if isinstance(values, list) else [values]))


def _lora_ranks(args, ranks) -> list[int]:
    ranks = _unique(ranks)
    if args.lora_ranks and len(ranks) > 1 and not args.use_lora:
        raise UsageError("several --lora_ranks need --use_lora (without it there is no LoRA)")
    if not args.use_lora:  # one rank, recorded in the config and not used
        ranks = [args.lora_ranks[0] if args.lora_ranks else BY_NAME["lora_rank"].default]
    return ranks


def check(values: dict, axes: dict, args) -> None:
    """UsageError for a plan that cannot run as asked."""
    model = values["model"]
    max_seq_len = model_max_seq_len(model, values["attention"], values["model_overrides"])
    if values["dataset_path"] and not os.path.exists(values["dataset_path"]):
        raise UsageError(f"--dataset_path {values['dataset_path']} does not exist")
    if args.mode == "hf_sweep" and model not in HF_CONFIGS:
        known = ", ".join(HF_CONFIGS)
        raise UsageError(f"--mode=hf_sweep needs a Hugging Face model ({known}), got {model!r}")
    if min(axes["lora_rank"]) <= 0 or values["dataset_size"] <= 0:
        raise UsageError("--lora_ranks and --dataset_size must be positive")
    if values["noise_multiplier"] < 0 or values["max_grad_norm"] <= 0 or values["lr"] <= 0:
        raise UsageError("--noise_multiplier must be >= 0, --max_grad_norm and --lr > 0")
    if not 0 < values["delta"] < 1:
        raise UsageError(f"--delta must be in (0, 1), got {values['delta']}")
    batch_sizes, seq_lens = axes["batch_size"], axes["seq_len"]
    if model in HF_CONFIGS:
        if min(seq_lens) < 3:
            raise UsageError("a sentence pair needs seq_len >= 3 (premise, separator, hypothesis)")
        if not values["dataset_path"] and max(batch_sizes) > values["dataset_size"]:
            raise UsageError(
                f"batch size {max(batch_sizes)} > --dataset_size {values['dataset_size']}: the "
                "sampling rate B/N must be at most 1"
            )
    for b in batch_sizes:
        if b <= 0:
            raise UsageError(f"batch size must be positive, got {b}")
    for t in seq_lens:
        if not 0 < t <= max_seq_len:
            raise UsageError(
                f"seq_len {t} must be in 1..{max_seq_len} (the max_seq_len of model "
                f"{model!r}; raise it with --max_seq_len)"
            )
    for pb in axes["max_physical_batch_size"]:
        if pb is not None and pb <= 0:
            raise UsageError(f"physical batch size must be positive, got {pb}")
        if pb is not None and pb > max(batch_sizes):
            raise UsageError(f"physical batch {pb} > every logical batch size {batch_sizes}")
    if values["steps"] <= 0 or values["warmup_steps"] < 0:
        raise UsageError("--steps must be positive and --warmup_steps non-negative")
    if values["ncu"] and values["device"] != "cuda":
        raise UsageError("--ncu profiles CUDA kernels: it needs a CUDA device")


def model_max_seq_len(model: str, attention: str, overrides: dict) -> int:
    """The longest sequence the named model takes (UsageError for an unknown name)."""
    if model in HF_CONFIGS:
        return HF_CONFIGS[model]["max_position_embeddings"]
    try:
        return models.get_config(model, attention=attention, **overrides).max_seq_len
    except (ValueError, TypeError) as error:
        known = ", ".join([*models.CONFIGS, *HF_CONFIGS])
        raise UsageError(
            f"{error}"
            if "unknown" not in str(error)
            else f"unknown model {model!r}; known: {known}"
        ) from None
