"""Per-layer clipping (--clipping per_layer) against a brute-force reference written here: each
sample's gradient of each parameter tensor by a loop in fp64, clipped to its own C_l = C/sqrt(P),
summed, averaged (noise 0); the clipped counts the result records; the refusals."""

import copy
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

import models
import trainers
from dp_cost.flash import engine
from dp_cost.training.clipping import layer_max_grad_norm

SMALL = models.ModelConfig(
    vocab_size=37, hidden_dim=16, num_layers=2, num_heads=2, mlp_dim=24, max_seq_len=64
)


def make_batch(batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(SMALL.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def per_parameter_grads(model, inputs, targets):
    """Per parameter tensor, [B, numel] of each sample's gradient of its mean token loss, fp64
    (zeros where the sample did not reach it)."""
    model = copy.deepcopy(model).double()
    rows = [[] for _ in model.parameters()]
    for b in range(inputs.shape[0]):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs[b : b + 1])[0], targets[b]).backward()
        for i, p in enumerate(model.parameters()):
            rows[i].append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1))
    return [torch.stack(r) for r in rows]


def per_layer_reference(model, inputs, targets, max_grad_norm, lr):
    """The SGD update of per-layer DP-SGD with noise 0, each parameter's norms [P, B] and the
    count of samples each parameter's bound clips."""
    grads = per_parameter_grads(model, inputs, targets)
    bound = max_grad_norm / math.sqrt(len(grads))
    norms = torch.stack([g.norm(dim=1) for g in grads])
    factors = (bound / (norms + 1e-6)).clamp(max=1.0)
    update = torch.cat([(f[:, None] * g).sum(0) for f, g in zip(factors, grads, strict=True)])
    return -lr * update / inputs.shape[0], norms, (factors < 1).sum(1)


def applied_update(trainer, model, inputs, targets, lr):
    trainer.step(inputs, targets)
    return -lr * torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()


def relative_error(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


def bound_between_norms(model, inputs, targets):
    """A C whose C_l clips some parameters' samples and not others': C_l halfway between two
    neighbouring norms near the median (no norm within rounding of the bound)."""
    _, norms, _ = per_layer_reference(model, inputs, targets, 1.0, 1.0)
    ordered = norms.flatten().sort().values
    middle = len(ordered) // 2
    return (ordered[middle] + ordered[middle + 1]).item() / 2 * math.sqrt(norms.shape[0])


@pytest.mark.parametrize(
    "name, options",
    [
        ("dpsgd", {}),
        ("flash", {"flash_route": "auto"}),
        ("flash", {"flash_route": "gram"}),
        ("flash", {"flash_route": "direct"}),
        ("flash", {"flash_route": "product"}),
    ],
)
@pytest.mark.parametrize("physical", [None, 2])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_per_layer_update_matches_brute_force(name, options, physical, attention):
    torch.manual_seed(0)
    model = models.build_model(SMALL, attention=attention)
    inputs, targets = make_batch(batch=5, seq=9)
    lr = 0.5
    max_grad_norm = bound_between_norms(model, inputs, targets)
    ref, norms, clipped = per_layer_reference(model, inputs, targets, max_grad_norm, lr)
    bound = max_grad_norm / math.sqrt(norms.shape[0])
    assert (norms > bound).any() and (norms < bound).any()
    trainer = trainers.make_trainer(
        name,
        model,
        lr=lr,
        batch_size=5,
        max_grad_norm=max_grad_norm,
        noise_multiplier=0.0,
        max_physical_batch_size=physical,
        clipping="per_layer",
        **options,
    )
    update = applied_update(trainer, model, inputs, targets, lr)
    assert relative_error(update, ref) < 1e-5
    # flat clipping at the same C is a different update: the test tells the rules apart
    assert relative_error(update, reference_flat(model, inputs, targets, max_grad_norm, lr)) > 1e-2
    record = trainer.trainer.privacy.clipping_record()
    assert record["rule"] == "per_layer" and record["samples"] == 5
    assert [p["clipped_samples"] for p in record["parameters"]] == clipped.tolist()
    names = [n for n, _ in model.named_parameters()]
    assert [p["name"] for p in record["parameters"]] == names
    assert {p["max_grad_norm"] for p in record["parameters"]} == {
        layer_max_grad_norm(max_grad_norm, len(names))
    }


def reference_flat(model, inputs, targets, max_grad_norm, lr):
    # the pre-step model: the trainer has moved `model`, so rebuild from the same seed
    torch.manual_seed(0)
    fresh = models.build_model(SMALL, attention=model.config.attention)
    grads = torch.cat(per_parameter_grads(fresh, inputs, targets), dim=1)
    factors = (max_grad_norm / (grads.norm(dim=1) + 1e-6)).clamp(max=1.0)
    return -lr * (factors[:, None] * grads).sum(0) / inputs.shape[0]


@pytest.mark.parametrize("name", ["dpsgd", "flash"])
def test_per_layer_batch_of_one_and_long_padded_sequences(name):
    """One sample; then a batch whose sequences end in padding (token 0 as the pad of the
    embedding), at a longer sequence than the layers' widths (the Gram and direct routes
    differ there)."""
    torch.manual_seed(2)
    config = models.ModelConfig(
        vocab_size=37, hidden_dim=16, num_layers=1, num_heads=2, mlp_dim=24, max_seq_len=64
    )
    for batch, seq in ((1, 5), (3, 48)):
        model = models.build_model(config)
        inputs, targets = make_batch(batch, seq, seed=batch)
        inputs[:, seq // 2 :] = 0  # a run of one token id: the embedding's rows add up
        max_grad_norm = bound_between_norms(model, inputs, targets)
        ref, _, _ = per_layer_reference(model, inputs, targets, max_grad_norm, 1.0)
        trainer = trainers.make_trainer(
            name, model, lr=1.0, batch_size=batch, max_grad_norm=max_grad_norm,
            noise_multiplier=0.0, clipping="per_layer",
        )  # fmt: skip
        assert relative_error(applied_update(trainer, model, inputs, targets, 1.0), ref) < 1e-5


@pytest.mark.parametrize("name", ["dpsgd", "flash"])
def test_per_layer_empty_batch_gets_noise_of_c(name):
    """An empty logical batch: no clipped sum, noise std sigma*C/B on every parameter (the
    sensitivity of per-layer clipping is C, as flat clipping's), nothing counted."""
    torch.manual_seed(3)
    model = models.build_model(SMALL)
    trainer = trainers.make_trainer(
        name, model, lr=1.0, batch_size=4, max_grad_norm=2.0, noise_multiplier=1.0,
        clipping="per_layer",
    )  # fmt: skip
    inputs, targets = make_batch(0, 7)
    trainer.step(inputs, targets)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert grads.std().item() == pytest.approx(1.0 * 2.0 / 4, rel=0.05)
    record = trainer.trainer.privacy.clipping_record()
    assert record["samples"] == 0
    assert all(p["clipped_fraction"] is None for p in record["parameters"])


def test_layer_bounds_split_c_without_exceeding_it():
    """sum_l C_l^2 <= C^2 exactly, and C_l is within a few ulps of C / sqrt(P)."""
    for max_grad_norm in (1.0, 0.1, 3.7, 1e-3):
        for count in (1, 3, 7, 10, 49, 164, 1000):
            bound = layer_max_grad_norm(max_grad_norm, count)
            assert Fraction(bound) ** 2 * count <= Fraction(max_grad_norm) ** 2
            assert bound == pytest.approx(max_grad_norm / math.sqrt(count), rel=1e-15)


def test_who_clips_per_layer():
    """dpsgd and flash clip per layer; ghost is refused (Opacus has no per-layer ghost mode);
    standard ignores the rule; an unknown rule is refused."""
    assert trainers.refusal("dpsgd", clipping="per_layer") is None
    assert trainers.refusal("flash", "fsdp", clipping="per_layer") is None
    assert trainers.refusal("standard", "ddp", clipping="per_layer") is None
    assert "no per-layer mode" in trainers.refusal("ghost", clipping="per_layer")
    assert "clipping must be one of flat, per_layer" in trainers.refusal("flash", clipping="x")
    with pytest.raises(ValueError, match="no per-layer mode"):
        trainers.make_trainer("ghost", models.build_model(SMALL), lr=0.1, batch_size=2,
                              clipping="per_layer")  # fmt: skip
    standard = trainers.make_trainer(
        "standard", models.build_model(SMALL), lr=0.1, batch_size=2, clipping="per_layer"
    )
    assert standard.trainer.privacy is None


@pytest.mark.parametrize("route", ["product", "auto"])
def test_per_layer_with_kept_per_sample_gradients_one_by_one(monkeypatch, route):
    """Kept per-sample gradients over the engine's small-parameter size are normed and clipped
    one by one, not in the concatenation: forced here for every parameter."""
    monkeypatch.setattr(engine, "SMALL_PER_SAMPLE_NUMEL", 8)
    torch.manual_seed(4)
    model = models.build_model(SMALL)
    inputs, targets = make_batch(batch=4, seq=6, seed=4)
    max_grad_norm = bound_between_norms(model, inputs, targets)
    ref, _, clipped = per_layer_reference(model, inputs, targets, max_grad_norm, 1.0)
    trainer = trainers.make_trainer(
        "flash", model, lr=1.0, batch_size=4, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        clipping="per_layer", flash_route=route,
    )  # fmt: skip
    assert relative_error(applied_update(trainer, model, inputs, targets, 1.0), ref) < 1e-5
    record = trainer.trainer.privacy.clipping_record()
    assert [p["clipped_samples"] for p in record["parameters"]] == clipped.tolist()


def test_per_layer_on_large_layers():
    """Layers of 512 x 1024 (per-sample gradients of half a million elements, past the
    concatenation's size) at a sequence longer than a few tokens."""
    torch.manual_seed(5)
    config = models.ModelConfig(
        vocab_size=37, hidden_dim=512, num_layers=1, num_heads=4, mlp_dim=1024, max_seq_len=64
    )
    model = models.build_model(config)
    inputs, targets = make_batch(batch=3, seq=40, seed=5)
    max_grad_norm = bound_between_norms(model, inputs, targets)
    for name in ("flash", "dpsgd"):
        fresh = copy.deepcopy(model)
        ref, _, _ = per_layer_reference(fresh, inputs, targets, max_grad_norm, 1.0)
        trainer = trainers.make_trainer(
            name, fresh, lr=1.0, batch_size=3, max_grad_norm=max_grad_norm,
            noise_multiplier=0.0, clipping="per_layer", max_physical_batch_size=2,
        )  # fmt: skip
        update = applied_update(trainer, fresh, inputs, targets, 1.0)
        assert relative_error(update, ref) < 1e-5, name


@pytest.mark.parametrize("name", ["dpsgd", "flash"])
def test_per_layer_steps_in_bf16_with_adam(name):
    torch.manual_seed(6)
    model = models.build_model(SMALL)
    inputs, targets = make_batch(batch=4, seq=8, seed=6)
    trainer = trainers.make_trainer(
        name, model, lr=1e-3, batch_size=4, optimizer="adam", dtype=torch.bfloat16,
        clipping="per_layer", max_physical_batch_size=3,
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    trainer.step(inputs, targets)
    moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)]
    assert all(moved) and all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.trainer.privacy.clipping_record()["samples"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("route", ["auto", "gram", "direct", "product"])
@pytest.mark.parametrize("name", ["flash", "dpsgd"])
def test_per_layer_on_cuda_matches_brute_force(name, route):
    """flash's CUDA kernels (fused norms, clipped GEMMs with each parameter's own factors,
    weighted sums) and Opacus' per-layer clipping on the GPU, fp32 (TF32 off), against the
    fp64 brute force on the CPU; bf16 autocast within bf16's rounding of it."""
    if name == "dpsgd" and route != "auto":
        pytest.skip("routes are flash's")
    config = models.ModelConfig(
        vocab_size=37, hidden_dim=64, num_layers=2, num_heads=4, mlp_dim=128, max_seq_len=128
    )
    torch.manual_seed(7)
    model = models.build_model(config, attention="sdpa")
    inputs, targets = make_batch(batch=6, seq=96, seed=7)
    max_grad_norm = bound_between_norms(model, inputs, targets)
    ref, _, clipped = per_layer_reference(model, inputs, targets, max_grad_norm, 1.0)
    options = {"flash_route": route} if name == "flash" else {}
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        fresh = copy.deepcopy(model).cuda()
        trainer = trainers.make_trainer(
            name, fresh, lr=1.0, batch_size=6, max_grad_norm=max_grad_norm,
            noise_multiplier=0.0, clipping="per_layer", max_physical_batch_size=4, dtype=dtype,
            **options,
        )  # fmt: skip
        update = applied_update(trainer, fresh, inputs.cuda(), targets.cuda(), 1.0).cpu()
        assert relative_error(update, ref) < tolerance, (name, route, dtype)
        if dtype == torch.float32:
            counts = [
                p["clipped_samples"]
                for p in trainer.trainer.privacy.clipping_record()["parameters"]
            ]
            assert counts == clipped.tolist(), (name, route)
