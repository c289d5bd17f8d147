"""Activation checkpointing's hook point: what ``torch.utils.checkpoint`` enters around a
checkpointed block's first forward and around its recomputation in the backward.

A model built with activation checkpointing (the LM's blocks, a Hugging Face model's decoder
layers) carries one ``RecomputeContexts`` and hands it to every ``checkpoint`` call as its
``context_fn``. Nothing happens in those contexts until a trainer says what does: Opacus'
trainers switch their hooks' capture off in the first forward, so that each layer's input is
captured once, from the recomputation, the one whose backward follows."""

from __future__ import annotations

import contextlib

ATTRIBUTE = "recompute_contexts"  # the model's attribute that holds them


def _nothing() -> tuple:
    return contextlib.nullcontext(), contextlib.nullcontext()


class RecomputeContexts:
    """``context_fn`` of torch.utils.checkpoint: ``make()`` returns (the context of the first
    forward, the context of the recomputation)."""

    def __init__(self):
        self.make = _nothing

    def __call__(self) -> tuple:
        return self.make()

    def reset(self) -> None:
        """Nothing done in the contexts again (the trainer that set them is gone)."""
        self.make = _nothing


def attach(model) -> RecomputeContexts:
    """A model's contexts, made and attached (once)."""
    contexts = recompute_contexts(model)
    if contexts is None:
        contexts = RecomputeContexts()
        setattr(model, ATTRIBUTE, contexts)
    return contexts


def recompute_contexts(model) -> RecomputeContexts | None:
    """The contexts of a checkpointed model (found through peft's and DDP's wrappers), or None
    where the model is not checkpointed."""
    for candidate in (model, getattr(model, "module", None)):
        contexts = getattr(candidate, ATTRIBUTE, None) if candidate is not None else None
        if isinstance(contexts, RecomputeContexts):
            return contexts
    return None
