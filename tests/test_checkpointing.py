"""Activation checkpointing (--activation_checkpointing) with Opacus' trainers: each checkpointed
block's forward runs twice (first without keeping its layers' inputs, then recomputed in the
backward), and Opacus' hooks must capture each layer's input once. The update against brute
force on a twin of the model built without checkpointing (fp32, 1e-5): the tiny LM, tiny Llama
full and LoRA with left padding, physical chunks, flat and per-layer clipping."""

import dataclasses

import pytest
import torch
from test_per_layer_clipping import bound_between_norms, per_layer_reference
from test_trainers import SMALL, make_batch, reference_update, relative_error, run_one_step

import models
import trainers
from dp_cost.core import recompute

OPACUS = ["dpsgd", "ghost"]


def twins(seed=0, **overrides):
    """(checkpointed model, the same weights built without checkpointing)."""
    torch.manual_seed(seed)
    checkpointed = models.build_model(
        dataclasses.replace(SMALL, activation_checkpointing=True, **overrides)
    )
    plain = models.build_model(dataclasses.replace(SMALL, **overrides))
    plain.load_state_dict(checkpointed.state_dict())
    return checkpointed, plain


def nothing_left_captured(model) -> bool:
    """No layer keeps a captured input after the step: a layer captured twice (the first
    forward and the recomputation) would keep one, every step."""
    return not any(getattr(m, "activations", None) for m in model.modules())


@pytest.mark.parametrize("physical", [None, 2])
@pytest.mark.parametrize("name", OPACUS)
def test_opacus_trainers_under_checkpointing_match_brute_force(name, physical):
    model, plain = twins(max_seq_len=64)
    assert recompute.recompute_contexts(model) is not None
    assert recompute.recompute_contexts(plain) is None
    inputs, targets = make_batch(5, 40)  # longer sequences than the blocks' width
    _, norms = reference_update(plain, inputs, targets, 1.0, 0.5)
    max_grad_norm = norms.median().item()
    want, _ = reference_update(plain, inputs, targets, max_grad_norm, 0.5)
    got = run_one_step(
        name, model, inputs, targets, lr=0.5, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        max_physical_batch_size=physical,
    )  # fmt: skip
    assert relative_error(got, want) < 1e-5
    assert nothing_left_captured(model)


def test_per_sample_gradients_per_layer_under_checkpointing_match_brute_force():
    model, plain = twins(max_seq_len=64)
    inputs, targets = make_batch(5, 9)
    max_grad_norm = bound_between_norms(plain, inputs, targets)
    want, _, clipped = per_layer_reference(plain, inputs, targets, max_grad_norm, 0.5)
    trainer = trainers.make_trainer(
        "dpsgd", model, lr=0.5, batch_size=5, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        max_physical_batch_size=2, clipping="per_layer",
    )  # fmt: skip
    trainer.step(inputs, targets)
    got = -0.5 * torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    assert relative_error(got, want) < 1e-5
    record = trainer.trainer.privacy.clipping_record()
    assert [p["clipped_samples"] for p in record["parameters"]] == clipped.tolist()
    assert nothing_left_captured(model)


def test_checkpointing_captures_each_layer_once_per_recomputed_forward():
    """The first forward of a checkpointed block captures nothing; its recomputation captures
    each layer's input once (counted by Opacus' own counter of captures not yet used)."""
    model, _ = twins()
    trainer = trainers.make_trainer(
        "dpsgd", model, lr=0.5, batch_size=4, max_grad_norm=1.0, noise_multiplier=0.0
    )
    wrapped = trainer.trainer.wrapped
    inputs, targets = make_batch(4, 8)
    captured_in_forward = []
    for name, module in model.named_modules():
        if name.startswith("blocks.") and list(module.parameters(recurse=False)):
            module.register_forward_hook(
                lambda m, i, o, name=name: captured_in_forward.append(
                    (name, len(getattr(m, "activations", [])), wrapped.hooks_enabled)
                )
            )
    trainer.step(inputs, targets)
    first = [c for c in captured_in_forward if not c[2]]  # the first forward: capture off
    again = [c for c in captured_in_forward if c[2]]  # the recomputation: capture on
    assert first and len(first) == len(again)
    assert all(count == 0 for _, count, _ in first)
    assert all(count == 1 for _, count, _ in again)  # Opacus' hook ran first: one, not two
    assert nothing_left_captured(model)


def test_flash_still_refuses_checkpointing():
    model, _ = twins()
    with pytest.raises(ValueError, match="activation checkpointing"):
        trainers.make_trainer("flash", model, lr=0.1, batch_size=2)
