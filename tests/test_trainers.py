"""DP trainers against a brute-force reference written here: per-sample gradients by a loop,
clip, sum, average (noise 0), and the noise's standard deviation (noise on)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import models
import trainers

SMALL = models.ModelConfig(
    vocab_size=37, hidden_dim=16, num_layers=2, num_heads=2, mlp_dim=24, max_seq_len=32
)
DP_TRAINERS = ["dpsgd", "ghost", "flash"]


def make_batch(batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(SMALL.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def per_sample_grads(model, inputs, targets):
    """[B, P] matrix of flattened per-sample gradients of each sample's mean token loss (zeros
    for a parameter the sample did not reach)."""
    rows = []
    for b in range(inputs.shape[0]):
        model.zero_grad(set_to_none=True)
        logits = model(inputs[b : b + 1])
        F.cross_entropy(logits[0], targets[b]).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows).double()


def reference_update(model, inputs, targets, max_grad_norm, lr):
    """SGD update direction of DP-SGD with noise 0: -(lr/B) sum_b c_b grad_b."""
    grads = per_sample_grads(copy.deepcopy(model), inputs, targets)
    norms = grads.norm(dim=1)
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return -lr * (factors[:, None] * grads).sum(0) / inputs.shape[0], norms


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def run_one_step(name, model, inputs, targets, **options):
    """The SGD update the trainer applied, -lr * p.grad (compared as gradients: differencing
    fp32 parameters would lose the small update's low digits)."""
    trainer = trainers.make_trainer(name, model, batch_size=inputs.shape[0], **options)
    before = flat_params(model)
    trainer.step(inputs, targets)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    # The parameters did move by -lr * grad (checked loosely: fp32 differencing).
    assert torch.allclose(flat_params(model) - before, -options["lr"] * grads, atol=1e-6)
    return -options["lr"] * grads


def relative_error(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
@pytest.mark.parametrize("physical", [None, 2])
@pytest.mark.parametrize("name", DP_TRAINERS)
def test_noise_free_update_matches_brute_force(name, physical, attention):
    torch.manual_seed(0)
    model = models.build_model(SMALL, attention=attention)
    inputs, targets = make_batch(batch=5, seq=7)
    lr = 0.5
    _, norms = reference_update(model, inputs, targets, 1.0, lr)
    # Clip some samples and not others: C between the smallest and the largest norm.
    max_grad_norm = norms.median().item()
    ref, norms = reference_update(model, inputs, targets, max_grad_norm, lr)
    assert (norms > max_grad_norm).any() and (norms < max_grad_norm).any()
    update = run_one_step(
        name,
        model,
        inputs,
        targets,
        lr=lr,
        max_grad_norm=max_grad_norm,
        noise_multiplier=0.0,
        max_physical_batch_size=physical,
    )
    assert relative_error(update, ref) < 1e-5


@pytest.mark.parametrize("name", DP_TRAINERS)
def test_batch_of_one(name):
    torch.manual_seed(1)
    model = models.build_model(SMALL)
    inputs, targets = make_batch(batch=1, seq=5, seed=3)
    ref, _ = reference_update(model, inputs, targets, 1e-2, 1.0)
    update = run_one_step(
        name, model, inputs, targets, lr=1.0, max_grad_norm=1e-2, noise_multiplier=0.0
    )
    assert relative_error(update, ref) < 1e-5


def test_standard_update_is_plain_mean_gradient():
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    inputs, targets = make_batch(batch=4, seq=6)
    grads = per_sample_grads(copy.deepcopy(model), inputs, targets)
    update = run_one_step("standard", model, inputs, targets, lr=1.0, max_physical_batch_size=3)
    assert relative_error(update, -grads.mean(0)) < 1e-5


@pytest.mark.parametrize(
    "name, device",
    [(name, "cpu") for name in DP_TRAINERS]
    + [  # flash's fused Triton noise kernel on CUDA
        pytest.param(
            "flash",
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        )
    ],
)
def test_noise_std_is_sigma_c_over_b(name, device):
    torch.manual_seed(123)
    model = models.build_model(SMALL, device=torch.device(device))
    inputs, targets = (t.to(device) for t in make_batch(batch=4, seq=6))
    sigma, clip, batch = 0.7, 0.05, inputs.shape[0]
    ref, _ = reference_update(model, inputs, targets, clip, 1.0)
    update = run_one_step(
        name, model, inputs, targets, lr=1.0, max_grad_norm=clip, noise_multiplier=sigma
    )
    noise = -(update - ref)
    expected = sigma * clip / batch
    # ~5.6k parameters: the sample std's relative error is ~1/sqrt(2n) = 0.9%; 5% is 5 sigma.
    assert noise.numel() > 5_000
    assert abs(noise.std().item() / expected - 1) < 0.05
    assert abs(noise.mean().item()) < 5 * expected / noise.numel() ** 0.5


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("name", ["dpsgd", "ghost"])
def test_noise_sampler_exact64_replaces_opacus_draw(name, clipping, monkeypatch):
    """--noise_sampler exact64: Opacus' draw (torch.normal) is never called, the noise still has
    std sigma C / B, and the default draws with Opacus' own function again."""
    if name == "ghost" and clipping == "per_layer":
        pytest.skip("ghost has no per-layer mode")
    from dp_cost.training import opacus_noise

    opacus_calls = []
    opacus_draw = opacus_noise.OPACUS_GENERATE_NOISE
    monkeypatch.setattr(
        opacus_noise,
        "OPACUS_GENERATE_NOISE",
        lambda *args: opacus_calls.append(args) or opacus_draw(*args),
    )
    torch.manual_seed(123)
    model = models.build_model(SMALL)
    inputs, targets = make_batch(batch=4, seq=6)
    sigma, clip, batch = 0.7, 0.05, inputs.shape[0]
    ref, _ = reference_update(model, inputs, targets, clip, 1.0)
    options = dict(lr=1.0, max_grad_norm=clip, noise_multiplier=sigma, clipping=clipping)
    with monkeypatch.context() as patched:
        patched.setattr(torch, "normal", lambda *a, **k: pytest.fail("torch.normal drew"))
        update = run_one_step(
            name, copy.deepcopy(model), inputs, targets, noise_sampler="exact64", **options
        )
    noise = -(update - ref)
    assert abs(noise.std().item() / (sigma * clip / batch) - 1) < 0.05
    assert opacus_calls == []
    run_one_step(name, model, inputs, targets, **options)  # Opacus' own draw, as before
    assert opacus_calls


@pytest.mark.parametrize("name", ["standard", *DP_TRAINERS])
def test_an_empty_batch_is_a_noise_only_step(name):
    """An empty Poisson sample: no samples, so the clipped sum is 0 and a DP trainer's update is
    its noise alone, N(0, (sigma C / B)^2) per coordinate with B the expected batch; standard
    does not move. The step is counted (the accountant counts it too)."""
    torch.manual_seed(5)
    model = models.build_model(SMALL)
    before = flat_params(model)
    sigma, clip, expected_batch = 0.7, 0.05, 4
    trainer = trainers.make_trainer(
        name, model, lr=1.0, batch_size=expected_batch, max_grad_norm=clip, noise_multiplier=sigma
    )
    inputs, targets = make_batch(batch=4, seq=6)
    out = trainer.step(inputs[:0], targets[:0])
    assert out["loss"] is None and out["physical_step_times_ms"] == []
    assert trainer.steps_taken == 1
    moved = flat_params(model) - before
    if name == "standard":
        assert not moved.any()
        return
    expected = sigma * clip / expected_batch
    assert abs(moved.std().item() / expected - 1) < 0.05
    assert abs(moved.mean().item()) < 5 * expected / moved.numel() ** 0.5
    trainer.step(inputs, targets)  # and the next, non-empty step runs as usual


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name", ["standard", *DP_TRAINERS])
def test_every_trainer_steps_with_both_optimizers_and_bf16(name, optimizer):
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    inputs, targets = make_batch(batch=3, seq=8)
    trainer = trainers.make_trainer(
        name, model, lr=1e-3, batch_size=3, optimizer=optimizer, dtype=torch.bfloat16
    )
    before = flat_params(model)
    out = trainer.step(inputs, targets)
    assert torch.isfinite(torch.tensor(out["loss"]))
    assert not torch.equal(before, flat_params(model))


def test_aliases_map_to_canonical_names():
    assert trainers.canonical_trainer_name("vanilla") == "standard"
    assert trainers.canonical_trainer_name("hooks") == "dpsgd"
    assert trainers.canonical_trainer_name("dpsgd_ghost") == "ghost"
    assert trainers.canonical_trainer_name("flash_clip") == "flash"
    with pytest.raises(ValueError, match="unknown trainer"):
        trainers.canonical_trainer_name("nope")


def test_chunks_match_batch_memory_manager():
    model = models.build_model(SMALL)
    sizes = []

    def loss_fn(model, inputs, targets):  # each chunk's size, as the trainer sees it
        sizes.append(len(inputs))
        return trainers.token_losses(model(inputs), targets).mean(dim=1)

    trainer = trainers.make_trainer(
        "standard", model, lr=0.1, batch_size=14, max_physical_batch_size=4, loss_fn=loss_fn
    )
    trainer.step(*make_batch(14, 8))
    assert sizes == [4, 4, 3, 3]


def test_the_built_in_trainers_are_the_schema_s():
    """The plan knows the trainers' names before the registry (and torch) is imported: then the
    registry holds the built-in trainers alone, schema.TRAINER_ORDER."""
    from dp_cost.core.schema import TRAINER_ORDER

    built_in = [n for n, c in trainers.TRAINERS.items() if c.__module__.startswith("dp_cost.")]
    assert built_in == list(TRAINER_ORDER)


def test_who_can_hold_fsdp2s_sync_to_the_last_chunk():
    """--fsdp_sync logical: standard (FSDP2's own switch) and flash (its held sums) can; ghost
    cannot (Opacus' FSDP2 optimizer adds each chunk's gradient shard); it means nothing
    without FSDP2; the default, chunk, is every trainer's."""
    assert trainers.refusal("standard", "fsdp", fsdp_sync="logical") is None
    assert trainers.refusal("flash", "fsdp", fsdp_sync="logical") is None
    assert "Opacus' FSDP2 optimizer" in trainers.refusal("ghost", "fsdp", fsdp_sync="logical")
    assert trainers.refusal("ghost", "fsdp", fsdp_sync="chunk") is None
    for distributed in ("none", "ddp"):
        reason = trainers.refusal("flash", distributed, fsdp_sync="logical")
        assert "applies to --distributed fsdp" in reason
    assert "fsdp_sync must be one of chunk, logical" in trainers.refusal(
        "standard", "fsdp", fsdp_sync="never"
    )
    with pytest.raises(ValueError, match="applies to --distributed fsdp"):
        trainers.make_trainer("flash", models.build_model(SMALL), lr=0.1, batch_size=2,
                              fsdp_sync="logical")  # fmt: skip


def test_flash_gathers_per_sample_gradients_at_one_sample_a_rank_on_two_ddp_ranks():
    from dp_cost.parallel.mode import distributed_mode
    from dp_cost.stepping.protocol import StepPlan
    from dp_cost.training.flash_trainer import gathers_per_sample

    one_each = StepPlan(busiest_batch=1, chunk_count=1)
    assert gathers_per_sample(distributed_mode("ddp", 2), one_each)
    assert not gathers_per_sample(distributed_mode("ddp", 4), one_each)
    assert not gathers_per_sample(distributed_mode("fsdp", 2), one_each)
    assert not gathers_per_sample(distributed_mode("ddp", 2), StepPlan(2, 1))
    assert not gathers_per_sample(distributed_mode("ddp", 2), StepPlan(1, 1, padded=True))
