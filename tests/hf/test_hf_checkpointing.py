"""Activation checkpointing on Hugging Face Llama (transformers' non-reentrant checkpointing
of its decoder layers): standard, dpsgd, ghost and flash against brute force on a twin built
without checkpointing, full fine-tuning and LoRA, left padding, physical chunks, flash's
per-layer clipping and an empty draw (tests/test_checkpointing.py has the LM's)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it at import

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_hf import left_padded, reference_update, trainable  # noqa: E402

import trainers  # noqa: E402
from dp_cost.core import recompute  # noqa: E402
from dp_cost.hf import configs as hf_configs  # noqa: E402
from dp_cost.hf import data as hf_data  # noqa: E402
from dp_cost.hf import models as hf_models  # noqa: E402


def hf_twins(use_lora):
    """(checkpointed model, the same weights built without checkpointing)."""
    pair = []
    for checkpointing in (True, False):
        model, _ = hf_models.build_hf_model(
            "tiny-llama", use_lora=use_lora, lora_rank=4, seed=0,
            activation_checkpointing=checkpointing,
        )  # fmt: skip
        if use_lora:  # peft starts lora_B at 0 (lora_A's gradient 0): the same perturbation
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, 0.05, generator=generator)
        pair.append(model)
    return pair


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", ["dpsgd", "ghost", "flash", "standard"])
def test_hugging_face_llama_checkpointed_matches_brute_force(name, use_lora, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, plain = hf_twins(use_lora)
    assert recompute.recompute_contexts(model) is not None
    assert recompute.recompute_contexts(plain) is None
    vocab = hf_configs.HF_CONFIGS["tiny-llama"]["vocab_size"]
    inputs, labels = hf_data.synthetic_snli(5, 10, vocab, seed=1)
    inputs = left_padded(inputs)
    _, norms = reference_update(plain, inputs, labels, 1.0)
    max_grad_norm = norms.median().item() if name != "standard" else 1e9  # standard: no clip
    want, _ = reference_update(plain, inputs, labels, max_grad_norm)
    params = trainable(model)
    contexts = recompute.recompute_contexts(model)
    checkpoints = []  # one call a checkpointed layer's forward: transformers did checkpoint
    real = contexts.__class__.__call__
    contexts.__class__ = type("Counted", (recompute.RecomputeContexts,), {
        "__call__": lambda self: (checkpoints.append(1), real(self))[1]
    })  # fmt: skip
    trainer = trainers.make_trainer(
        name, model, lr=0.1, max_grad_norm=max_grad_norm, noise_multiplier=0.0, batch_size=5,
        max_physical_batch_size=2, loss_fn=hf_models.sequence_classification_loss,
    )  # fmt: skip
    trainer.step(inputs, labels)
    got = torch.cat([p.grad.reshape(-1) for p in params]).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    layers = hf_configs.HF_CONFIGS["tiny-llama"]["num_hidden_layers"]
    assert len(checkpoints) == 3 * layers  # each decoder layer of each of the 3 chunks
    assert not any(getattr(m, "activations", None) for m in model.modules())
    engine = getattr(trainer.trainer, "engine", None)
    if engine is not None:  # flash: every recomputed input taken and dropped
        assert not engine.tape.blocks and not list(engine.kept_tensors())


def per_layer_reference(model, inputs, labels, max_grad_norm):
    """(1/B) sum_b clip_l(grad_b,l) over the trainable parameters, each parameter's per-sample
    gradient clipped to C_l = C / sqrt(P) on its own (one sample at a time, no checkpointing)."""
    model = copy.deepcopy(model)
    params = trainable(model)
    bound = max_grad_norm / len(params) ** 0.5
    rows = []
    for b in range(inputs.shape[0]):
        model.zero_grad(set_to_none=True)
        loss = hf_models.sequence_classification_loss(model, inputs[b : b + 1], labels[b : b + 1])
        loss.sum().backward()
        clipped = []
        for p in params:
            grad = p.grad.reshape(-1).double()
            clipped.append(grad * (bound / (grad.norm() + 1e-6)).clamp(max=1.0))
        rows.append(torch.cat(clipped))
    return torch.stack(rows).sum(0) / inputs.shape[0]


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_flash_per_layer_on_checkpointed_llama_matches_brute_force(use_lora, monkeypatch):
    """Flash with per-layer clipping on checkpointed Llama (each decoder layer clipped as its
    backward ends), left padding, chunks of 2: each parameter clipped on its own against the
    brute-force reference of the twin built without checkpointing; LoRA's first decoder layer
    has q, k and v adapters side by side (their gradients come only if that layer's records are
    asked for)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, plain = hf_twins(use_lora)
    vocab = hf_configs.HF_CONFIGS["tiny-llama"]["vocab_size"]
    inputs, labels = hf_data.synthetic_snli(5, 10, vocab, seed=1)
    inputs = left_padded(inputs)
    _, norms = reference_update(plain, inputs, labels, 1.0)
    max_grad_norm = 0.5 * norms.median().item()
    want = per_layer_reference(plain, inputs, labels, max_grad_norm)
    params = trainable(model)  # before flash freezes them (its engine forms their gradients)
    trainer = trainers.make_trainer(
        "flash", model, lr=0.1, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        batch_size=5, max_physical_batch_size=2, clipping="per_layer",
        loss_fn=hf_models.sequence_classification_loss,
    )  # fmt: skip
    trainer.step(inputs, labels)
    got = torch.cat([p.grad.reshape(-1) for p in params]).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    engine = trainer.trainer.engine
    assert not engine.tape.blocks and not list(engine.kept_tensors())


def test_an_empty_chunk_of_a_checkpointed_model_is_a_noise_only_step(monkeypatch):
    """An empty Poisson draw on checkpointed Llama: flash (both clipping rules) adds its noise
    alone and keeps nothing; the next step still matches brute force."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for clipping in ("flat", "per_layer"):
        model, plain = hf_twins(use_lora=True)
        vocab = hf_configs.HF_CONFIGS["tiny-llama"]["vocab_size"]
        inputs, labels = hf_data.synthetic_snli(4, 10, vocab, seed=2)
        params = trainable(model)  # before flash freezes them
        before = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        trainer = trainers.make_trainer(
            "flash", model, lr=1.0, max_grad_norm=1.0, noise_multiplier=1.0, batch_size=4,
            clipping=clipping, loss_fn=hf_models.sequence_classification_loss,
        )  # fmt: skip
        out = trainer.step(inputs[:0], labels[:0])
        assert out["loss"] is None
        moved = torch.cat([p.detach().reshape(-1) for p in params]) - before
        assert moved.abs().min() > 0  # noise on every coordinate, nothing else
        engine = trainer.trainer.engine
        assert not engine.tape.blocks and not list(engine.kept_tensors())
        trainer.trainer.noise_multiplier = 0.0
        plain.load_state_dict(model.state_dict())
        want, _ = (
            reference_update(plain, inputs, labels, 1.0)
            if clipping == "flat"
            else (per_layer_reference(plain, inputs, labels, 1.0), None)
        )
        trainer.step(inputs, labels)
        got = torch.cat([p.grad.reshape(-1) for p in params]).double()
        assert ((got - want).norm() / want.norm()).item() < 1e-5, clipping
