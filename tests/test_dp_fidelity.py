"""What the accountant assumes of each DP trainer, checked on what the trainer releases: one
sample's clipped contribution stays within (1 + the trainer's sensitivity margin) C, in fp32 and
bf16, on shapes that stress the norms (long sequences, wide layers, a large vocabulary).

The contribution is read where the update is formed: with one sample, noise 0 and SGD, the
gradient the base optimizer steps on is that sample's clipped gradient (divided by B = 1).
"""

import ctypes
import gc

import pytest
import torch

import models
import trainers

C = 1e-3  # far below every sample's norm: every sample is clipped, so its contribution is C

STRESS = {
    "long sequence": (models.ModelConfig(vocab_size=500, hidden_dim=64, num_layers=2,
                                         num_heads=4, mlp_dim=256), 512),
    "wide layers": (models.ModelConfig(vocab_size=500, hidden_dim=384, num_layers=1,
                                       num_heads=6, mlp_dim=1536), 64),
    # an 8M-element embedding: torch's fp32 norm of such a row on the CPU is low by ~3e-4
    "large vocabulary": (models.ModelConfig(vocab_size=64000, hidden_dim=128, num_layers=1,
                                            num_heads=4, mlp_dim=256), 32),
}  # fmt: skip


@pytest.fixture(autouse=True)
def memory_given_back():
    """After each test, what its stress shapes allocated (1-2 GB) given back to the system:
    glibc keeps freed memory, and each later fork of this test process (the CLI's workers) then
    copies and tears down the page tables of it (0.13 s a fork at 2.5 GB against 0.03 s)."""
    yield
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's
    if trim is not None:
        trim(0)


def contribution_over_bound(name, config, seq, dtype, seed, device="cpu") -> tuple[float, float]:
    """(norm of one sample's released gradient / C, the trainer's sensitivity margin)."""
    torch.manual_seed(seed)
    model = models.build_model(config, device=device)
    trainer = trainers.make_trainer(
        name, model, lr=1.0, max_grad_norm=C, noise_multiplier=0.0, batch_size=1, dtype=dtype
    )
    released = {}

    def read_gradient(optimizer, args, kwargs):
        grads = [p.grad.double().reshape(-1) for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]  # fmt: skip
        released["norm"] = torch.cat(grads).norm().item()

    trainer.trainer.base_optimizer.register_step_pre_hook(read_gradient)
    tokens = torch.randint(config.vocab_size, (1, seq + 1), device=device)
    trainer.step(tokens[:, :-1], tokens[:, 1:])
    return released["norm"] / C, trainer.trainer.privacy.sensitivity_margin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["dpsgd", "ghost", "flash"])
def test_one_sample_moves_the_update_by_at_most_the_accounted_sensitivity(name, dtype):
    check_sensitivity(name, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["dpsgd", "ghost", "flash"])
def test_sensitivity_on_cuda(name, dtype):
    """The same on a GPU (its kernels: TF32 off by default for fp32 matmuls, Triton for flash)."""
    check_sensitivity(name, dtype, "cuda")


def check_sensitivity(name, dtype, device):
    worst = 0.0
    for shape, (config, seq) in STRESS.items():
        for seed in range(2):
            ratio, margin = contribution_over_bound(name, config, seq, dtype, seed, device)
            assert ratio <= 1 + margin, (shape, seed, ratio, margin)
            worst = max(worst, ratio)
    # every sample was clipped: the contribution is C up to the norms' rounding
    assert worst > 0.99


def test_opacus_trainers_norms_on_the_cpu_are_accurate_on_long_rows():
    """torch's fp32 norm of a 3e7-element row on the CPU came out low by ~3e-3 (torch 2.13:
    Opacus' clipping would then scale the sample to 1.003 C); the Opacus trainers' norms equal
    fp64's there, accumulated a block of columns at a time."""
    from dp_cost.training.opacus_trainers import per_sample_norms

    torch.manual_seed(0)
    grad_sample = torch.randn(2, 3000, 10_000)
    exact = grad_sample.double().flatten(1).norm(dim=1)
    assert torch.allclose(per_sample_norms(grad_sample).double(), exact, rtol=1e-6, atol=0)
    assert per_sample_norms(grad_sample[:0]).shape == (0,)  # an empty batch
