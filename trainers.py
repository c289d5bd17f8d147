"""The trainers' registry: ``standard``, ``dpsgd``, ``ghost``, ``flash``, and ``make_trainer``.

DP semantics shared by every DP trainer (README.md says the same): per-sample loss is the mean
over that sample's tokens; clip factor min(1, C / (||grad_b|| + 1e-6)); update direction
(1/B)(sum_b c_b grad_b + N(0, sigma^2 C^2 I)). A logical batch over the physical maximum is
split into near-equal chunks (as Opacus' BatchMemoryManager does: 14 by 4 -> 4,4,3,3); clipped
sums accumulate over the chunks and noise is added once per logical batch.

The classes live in ``dp_cost/training/`` (one file per kind: base.py holds the ``Trainer``
machinery they share); a new trainer is one class and one entry here (or ``@register_trainer``).
Every reason a trainer cannot run a config is given by ``refusal`` alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dp_cost.core import schema
from dp_cost.parallel import fsdp
from dp_cost.parallel.mode import distributed_mode, fsdp_sync_refusal
from dp_cost.training.base import OPTIMIZERS, Trainer, token_losses
from dp_cost.training.clipping import clipping_refusal
from dp_cost.training.flash_trainer import FlashClippingTrainer
from dp_cost.training.opacus_trainers import DPSGDTrainer, GhostClippingTrainer, OpacusTrainer
from dp_cost.training.standard import StandardTrainer

TRAINERS: dict[str, type[Trainer]] = {
    "standard": StandardTrainer,  # non-private: same loss, no clipping, no noise
    "dpsgd": DPSGDTrainer,  # Opacus per-sample gradients (hooks)
    "ghost": GhostClippingTrainer,  # Opacus ghost clipping: two backward passes
    "flash": FlashClippingTrainer,  # ours: one backward, exact norms, clipped GEMMs
}
# Opacus' hooks and flash's book-keeping save each layer's input in forward (and per-sample
# gradients computed from it): recomputing a checkpointed block in backward saves it again.
REHOOKED = "its per-layer hooks would save every recomputed layer input a second time"

__all__ = [
    "OPTIMIZERS",
    "REHOOKED",
    "TRAINERS",
    "DPSGDTrainer",
    "FlashClippingTrainer",
    "GhostClippingTrainer",
    "OpacusTrainer",
    "StandardTrainer",
    "Trainer",
    "canonical_trainer_name",
    "make_trainer",
    "refusal",
    "register_trainer",
    "token_losses",
]


def register_trainer(name: str):
    """A class decorator: the trainer joins the registry under ``name`` (its ``name`` too)."""

    def register(cls):
        cls.name = name
        TRAINERS[name] = cls
        return cls

    return register


def canonical_trainer_name(name: str) -> str:
    """Map a user-typed name or alias to its canonical registry name (ValueError if unknown)."""
    return schema.canonical_trainer_name(name, TRAINERS)


def make_trainer(
    name: str,
    model: nn.Module,
    *,
    lr: float,
    max_grad_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    batch_size: int,
    optimizer: str = "sgd",
    dtype: torch.dtype = torch.float32,
    distributed: str = "none",
    materialize=None,
    **trainer_options,
) -> Trainer:
    """Build the named trainer around ``model`` (its parameters updated in place). ``distributed``
    ("ddp" or "fsdp", in an initialised default process group): replicated or sharded, each rank
    steps on its slice of the global batch; ``batch_size`` stays the GLOBAL batch (the divisor).
    ``materialize(model)``: for a model built with its parameters on the meta device, called
    once FSDP2 has sharded it (each rank allocates and initializes its shards only)."""
    cls = TRAINERS[canonical_trainer_name(name)]
    checkpointing = getattr(getattr(model, "config", None), "activation_checkpointing", False)
    if trainer_options.get("fsdp_sync") is None:  # absent or None: FSDP2's own, per chunk
        trainer_options["fsdp_sync"] = "chunk"
    cuda_graph, fsdp_sync = trainer_options.get("cuda_graph"), trainer_options["fsdp_sync"]
    clipping = trainer_options.get("clipping") or "flat"
    if reason := refusal(cls.name, distributed, cuda_graph, checkpointing, fsdp_sync, clipping):
        raise ValueError(reason)
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    mode = distributed_mode(distributed, world_size)
    if mode.shards:  # before the trainer: its optimizer (and flash) see the shards
        model = fsdp.shard(model, cls.fsdp_units)
    if materialize is not None:
        materialize(model)
    privacy = dict(max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier)
    options = dict(lr=lr, batch_size=batch_size, optimizer=optimizer, dtype=dtype)
    return cls(model, **options, **privacy, distributed_mode=mode, **trainer_options)


def refusal(
    name: str,
    distributed="none",
    cuda_graph=False,
    checkpointing=False,
    fsdp_sync="chunk",
    clipping="flat",
) -> str | None:
    """Why trainer ``name`` cannot run so (None: it can): the plan records the config skipped,
    ``make_trainer`` raises it. The one place every such reason is given."""
    cls = TRAINERS[canonical_trainer_name(name)]
    if reason := fsdp_sync_refusal(distributed, fsdp_sync):
        return reason
    if reason := clipping_refusal(clipping):
        return reason
    if clipping == "per_layer" and (reason := cls.per_layer_refusal):
        return reason
    if fsdp_sync != "chunk" and (reason := cls.logical_sync_refusal):
        return reason
    if checkpointing and not cls.supports_activation_checkpointing:
        return f"trainer {cls.name!r} does not support activation checkpointing: {REHOOKED}"
    if reason := cls.distributed_refusals.get(distributed):
        return reason
    if cuda_graph and not cls.capturable:
        return (
            f"--cuda_graph captures the standard and flash steps only: {cls.name} runs Opacus' "
            "step, which this toolkit does not capture (run it without --cuda_graph)"
        )
    if cuda_graph:
        return distributed_mode(distributed).graph_refusal
    return None
