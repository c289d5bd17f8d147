"""The trainers' registry: ``standard``, ``dpsgd``, ``ghost``, ``flash``, and ``make_trainer``.

DP semantics shared by every DP trainer (README.md says the same): per-sample loss is the mean
over that sample's tokens; clip factor min(1, C / (||grad_b|| + 1e-6)); update direction
(1/B)(sum_b c_b grad_b + N(0, sigma^2 C^2 I)). A logical batch over the physical maximum is
split into near-equal chunks (as Opacus' BatchMemoryManager does: 14 by 4 -> 4,4,3,3); clipped
sums accumulate over the chunks and noise is added once per logical batch.

A trainer is one class (one file of this package) and one entry here (or
``@register_trainer``); the Runner (``stepping.runner``) runs its steps. Every reason a trainer
cannot run a config is given by ``refusal`` alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dp_cost.core import recompute, schema
from dp_cost.parallel import fsdp
from dp_cost.parallel.mode import distributed_mode, fsdp_sync_refusal, holds_sync_to_last_chunk
from dp_cost.stepping.protocol import PhaseEvents
from dp_cost.stepping.runner import Runner
from dp_cost.training.base import Trainer, TrainerSettings, mean_token_loss
from dp_cost.training.clipping import ClippingRule, clipping_refusal
from dp_cost.training.flash_trainer import FlashClippingTrainer
from dp_cost.training.opacus_trainers import DPSGDTrainer, GhostClippingTrainer
from dp_cost.training.standard import StandardTrainer

TRAINERS: dict[str, type[Trainer]] = {
    "standard": StandardTrainer,  # non-private: same loss, no clipping, no noise
    "dpsgd": DPSGDTrainer,  # Opacus per-sample gradients (hooks)
    "ghost": GhostClippingTrainer,  # Opacus ghost clipping: two backward passes
    "flash": FlashClippingTrainer,  # ours: one backward, exact norms, clipped GEMMs
}


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
    max_physical_batch_size: int | None = None,
    loss_fn=None,
    on_phase=None,
    cuda_graph: bool = False,
    fsdp_sync: str | None = None,
    clipping: str | None = None,
    materialize=None,
    **trainer_options,
) -> Runner:
    """The named trainer around ``model`` (its parameters updated in place), in the Runner that
    steps it: ``runner.step(inputs, targets) -> {"loss", ...}``. ``distributed`` ("ddp" or
    "fsdp", in an initialised default process group): replicated or sharded, each rank steps on
    its slice of the global batch; ``batch_size`` stays the GLOBAL batch (the divisor).
    ``materialize(model)``: for a model built with its parameters on the meta device, called
    once FSDP2 has sharded it (each rank allocates and initializes its shards only). Every
    string setting is parsed here, once."""
    cls = TRAINERS[canonical_trainer_name(name)]
    checkpointing = recompute.recompute_contexts(model) is not None
    fsdp_sync = fsdp_sync or "chunk"  # absent or None: FSDP2's own, per chunk
    clipping = clipping or ClippingRule.FLAT.value
    if reason := refusal(cls.name, distributed, cuda_graph, checkpointing, fsdp_sync, clipping):
        raise ValueError(reason)
    if batch_size <= 0 or (max_physical_batch_size or 1) <= 0:
        raise ValueError(f"batch sizes must be > 0 ({batch_size}, {max_physical_batch_size})")
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    mode = distributed_mode(distributed, world_size)
    settings = TrainerSettings(
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        dtype=dtype,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        clipping=ClippingRule.parse(clipping),
        mode=mode,
        sync_every_chunk=not holds_sync_to_last_chunk(fsdp_sync),
        cuda_graph=bool(cuda_graph),
        loss_fn=loss_fn or mean_token_loss,
    )
    if mode.shards:  # before the trainer: its optimizer (and flash) see the shards
        model = fsdp.shard(model, cls.fsdp_units)
    if materialize is not None:
        materialize(model)
    phases = PhaseEvents(on_phase)
    trainer = cls(model, settings, phases, **trainer_options)
    return Runner(
        trainer,
        model,
        batch_size=batch_size,
        max_physical_batch_size=max_physical_batch_size,
        mode=mode,
        phases=phases,
        cuda_graph=bool(cuda_graph),
        name=cls.name,
    )


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
    if ClippingRule(clipping).per_layer and (reason := cls.per_layer_refusal):
        return reason
    if holds_sync_to_last_chunk(fsdp_sync) and (reason := cls.logical_sync_refusal):
        return reason
    if checkpointing and not cls.supports_activation_checkpointing:
        return (
            f"trainer {cls.name!r} does not support activation checkpointing (its per-layer "
            "capture does not know a checkpointed block's recomputation)"
        )
    if distributed_mode(distributed).shards and (reason := cls.sharded_refusal):
        return reason
    if cuda_graph and not cls.capturable:
        return (
            f"--cuda_graph captures the standard and flash steps only: {cls.name} runs Opacus' "
            "step, which this toolkit does not capture (run it without --cuda_graph)"
        )
    if cuda_graph:
        return distributed_mode(distributed).graph_refusal
    return None
