"""Activation checkpointing on Hugging Face Llama (transformers' non-reentrant checkpointing
of its decoder layers): standard, dpsgd, ghost and flash against brute force on a twin built without
checkpointing, full fine-tuning and LoRA, left padding, physical chunks (tests/test_checkpointing.py
has the LM's)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it at import

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
