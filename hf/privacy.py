"""Poisson sampling of logical batches and the privacy accounting of the steps taken."""

from __future__ import annotations

import math

import torch
from opacus.accountants import PRVAccountant, RDPAccountant


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float = 1e-5,
    accountant: str = "prv",
) -> float:
    """The (epsilon, delta) guarantee of ``steps`` Poisson-subsampled Gaussian steps, by
    Opacus' PRV (default) or RDP accountant. ``inf`` without noise; 0 for no steps."""
    accountants = {"prv": PRVAccountant, "rdp": RDPAccountant}
    if accountant not in accountants:
        raise ValueError(f"accountant must be one of {sorted(accountants)}, got {accountant!r}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    acc = accountants[accountant]()
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))


def poisson_batch(
    dataset_size: int, sample_rate: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Indices of one Poisson-sampled batch (int64): each sample independently with
    probability ``sample_rate``, as Opacus' UniformWithReplacementSampler draws them. The batch
    may be empty; its expected size is sample_rate * dataset_size."""
    if not 0 <= sample_rate <= 1:
        raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
    mask = torch.rand(dataset_size, generator=generator) < sample_rate
    return mask.nonzero(as_tuple=False).reshape(-1)
