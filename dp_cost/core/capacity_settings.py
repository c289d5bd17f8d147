"""The settings of --mode=capacity: a section of the settings table (``core.settings``), in its
place there."""

from __future__ import annotations

from dp_cost.core import scopes
from dp_cost.core.setting import Setting

CAPACITY_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "capacity",
        False,
        "predict the peak on fake tensors instead of measuring it",
        modes={"capacity": True},
        follows_mode=True,
    ),
    Setting(
        "gpu_memory",
        None,
        "capacity: GiB of each card to plan for, its total as torch reports it (H100 80GB: "
        "about 79, H200: about 140); the largest physical batch that fits each is searched",
        flags=("--gpu_memory",),
        type=float,
        many=True,
        scope=scopes.CAPACITY,
    ),
    Setting(
        "find_max_batch",
        False,
        "capacity, CUDA: find the largest physical batch that runs on this card by runs (each "
        "probe its own worker; an out-of-memory stays there), starting from the prediction",
        flags=("--find_max_batch",),
        switch=True,
        scope=scopes.CAPACITY,
    ),
    Setting(
        "find_max_seq_len",
        False,
        "capacity, CUDA: find the longest sequence (a multiple of 64 tokens) that runs on this "
        "card at the config's physical batch by runs, starting from the prediction",
        flags=("--find_max_seq_len",),
        switch=True,
        scope=scopes.CAPACITY,
    ),
    Setting(
        "validate",
        False,
        "capacity, CUDA: also run each config (its --steps after --warmup_steps, no trace, "
        "the memory breakdown) and record the measured peak beside the prediction",
        flags=("--validate",),
        switch=True,
        scope=scopes.CAPACITY,
    ),
    Setting(
        "card",
        "NVIDIA H200",
        "capacity: the card whose measured rates (a table the toolkit ships per card kind) "
        "predict each config's step time",
        flags=("--card",),
        scope=scopes.CAPACITY,
    ),
    Setting(
        "epochs",
        None,
        "capacity: with --dataset_size, the predicted wall time and GPU-hours of this many "
        "epochs of the dataset",
        flags=("--epochs",),
        type=int,
        scope=scopes.CAPACITY,
    ),
    Setting(
        "recommend",
        False,
        "capacity: also predict each config's time at its rank's share and at halves of it, "
        "on the largest --gpu_memory, and rank the trainers (over --world_size ranks without "
        "--distributed: each under DDP and FSDP2) by the fastest that fits",
        flags=("--recommend",),
        switch=True,
        scope=scopes.CAPACITY,
    ),
)
