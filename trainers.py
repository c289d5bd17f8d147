"""The trainers' registry, as the contract names it: ``trainers.make_trainer``,
``trainers.TRAINERS``, ``register_trainer``. It lives in ``dp_cost.training.registry``; this
module re-exports it for the scripts and notebooks that import ``trainers``."""

from dp_cost.training.base import OPTIMIZERS, Trainer, TrainerSettings, token_losses
from dp_cost.training.flash_trainer import FlashClippingTrainer
from dp_cost.training.opacus_trainers import DPSGDTrainer, GhostClippingTrainer, OpacusTrainer
from dp_cost.training.registry import (
    TRAINERS,
    canonical_trainer_name,
    make_trainer,
    refusal,
    register_trainer,
)
from dp_cost.training.standard import StandardTrainer

__all__ = [
    "OPTIMIZERS",
    "TRAINERS",
    "DPSGDTrainer",
    "FlashClippingTrainer",
    "GhostClippingTrainer",
    "OpacusTrainer",
    "StandardTrainer",
    "Trainer",
    "TrainerSettings",
    "canonical_trainer_name",
    "make_trainer",
    "refusal",
    "register_trainer",
    "token_losses",
]
