"""Poisson sampling of logical batches and the privacy accounting of the steps taken (the
noise's tail term, delta_total's other part: noise/laws.py)."""

from __future__ import annotations

import math
from collections import Counter

import torch
from opacus.accountants import PRVAccountant, RDPAccountant


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps_per_draw: list[int],
    delta: float = 1e-5,
    accountant: str = "prv",
) -> float:
    """The (epsilon, delta) guarantee of Poisson-subsampled Gaussian steps, by Opacus' PRV
    (default) or RDP accountant: ``steps_per_draw[i]`` steps ran on the i-th Poisson draw
    (steps after the timed ones, for measurements, reuse the last draw). ``inf`` without
    noise; 0 for no steps.

    k steps on one Poisson draw are one subsampled mechanism whose inner part is k adaptively
    composed Gaussian mechanisms of noise multiplier sigma on the same data: exactly a Gaussian
    mechanism of sigma / sqrt(k) (Gaussian DP composes as sqrt(k) mu), so each such draw enters
    the accountant as one step at sigma / sqrt(k).
    """
    accountants = {"prv": PRVAccountant, "rdp": RDPAccountant}
    if accountant not in accountants:
        raise ValueError(f"accountant must be one of {sorted(accountants)}, got {accountant!r}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if any(uses < 1 for uses in steps_per_draw):
        raise ValueError(f"every draw takes at least one step, got {steps_per_draw}")
    if not steps_per_draw:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    draws_by_uses = Counter(steps_per_draw)
    acc = accountants[accountant]()
    acc.history = [
        (noise_multiplier / math.sqrt(uses), sample_rate, draws)
        for uses, draws in sorted(draws_by_uses.items())
    ]
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
