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
    last_batch_uses: int = 1,
) -> float:
    """The (epsilon, delta) guarantee of ``steps`` Poisson-subsampled Gaussian steps, by
    Opacus' PRV (default) or RDP accountant. ``inf`` without noise; 0 for no steps.

    ``last_batch_uses``: how many of the ``steps`` ran on one sampled batch (steps after the
    timed ones, for measurements, reuse one). Those k steps on one Poisson sample are one
    subsampled mechanism whose inner part is k adaptively composed Gaussian mechanisms of noise
    multiplier sigma on the same data: exactly a Gaussian mechanism of sigma / sqrt(k) (Gaussian
    DP composes as sqrt(k) mu), so they enter the accountant as one step at sigma / sqrt(k).
    """
    accountants = {"prv": PRVAccountant, "rdp": RDPAccountant}
    if accountant not in accountants:
        raise ValueError(f"accountant must be one of {sorted(accountants)}, got {accountant!r}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if not 1 <= last_batch_uses <= max(steps, 1):
        raise ValueError(f"last_batch_uses must be in 1..steps, got {last_batch_uses}")
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    fresh_batches = steps - last_batch_uses + 1
    history = [(noise_multiplier / math.sqrt(last_batch_uses), sample_rate, 1)]
    if fresh_batches > 1:
        history.insert(0, (noise_multiplier, sample_rate, fresh_batches - 1))
    acc = accountants[accountant]()
    acc.history = history
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
