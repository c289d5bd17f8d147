"""Poisson sampling of logical batches and the privacy accounting of the steps taken."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from opacus.accountants import PRVAccountant, RDPAccountant


@dataclass(frozen=True)
class NoiseSampler:
    """How a trainer draws its Gaussian noise: Box-Muller from uniforms no smaller than
    ``smallest_uniform``, so every draw has |z| <= z_max = sqrt(-2 ln smallest_uniform)."""

    description: str
    smallest_uniform: float

    @property
    def z_max(self) -> float:
        return math.sqrt(-2 * math.log(self.smallest_uniform))


# The samplers the trainers use (read from their sources: the radius of Box-Muller at the
# smallest uniform each can produce).
NOISE_SAMPLERS = {
    "flash_triton": NoiseSampler(
        "Flash Clipping's Triton kernel: Philox, a 64-bit uniform (two words) per radius", 2.0**-65
    ),
    "torch_cuda": NoiseSampler(
        "torch.normal on CUDA (curand_normal4: Philox, (x + 1/2) / 2^32 per radius)", 2.0**-33
    ),
    "torch_cpu": NoiseSampler(
        "torch.normal on the CPU (24-bit uniforms; 1 - u per radius, at least 2^-24)", 2.0**-24
    ),
}


def pair_exit(z_max: float, shift: float) -> float:
    """At most the probability that one Box-Muller pair (a 2-D Gaussian whose radius is cut at
    z_max, the law conditioned on R <= z_max) moved by ``shift`` (in units of its std) lands
    outside the disk of radius z_max: it must have had R > z_max - shift."""
    if shift >= z_max:
        return 1.0
    edge = math.exp(-(z_max**2) / 2)
    return (math.exp(-((z_max - shift) ** 2) / 2) - edge) / (1 - edge)


def exit_bound(z_max: float, pairs: int, shift: float) -> float:
    """An upper bound on min(1, sum_p pair_exit(z_max, a_p)) over every split of a shift of
    norm ``shift`` over ``pairs`` pairs (sum a_p^2 <= shift^2): on the probability that a
    neighbour's output leaves the sampler's support. For a threshold t <= min(shift, z_max - 1),
    pair_exit is convex on [0, t] (so at most a pair_exit(t) / t there) and increasing: the
    pairs moved by less than t add at most sqrt(pairs) shift pair_exit(t) / t (Cauchy-Schwarz),
    the at most (shift / t)^2 others pair_exit(shift) each. The least over a grid of t."""
    top = min(shift, z_max - 1)
    if top <= 0:
        return 1.0 if shift > 0 else 0.0
    concentrated = pair_exit(z_max, shift)
    best = 1.0
    for step in range(400):  # t from top down to 1e-8 top
        t = top * 10 ** (-8 * step / 399)
        spread = math.sqrt(pairs) * shift * pair_exit(z_max, t) / t
        best = min(best, spread + min(pairs, (shift / t) ** 2) * concentrated)
    return best


def tail_delta(
    sampler: str, dimension: int, noise_multiplier: float, sample_rate: float, steps: int
) -> float:
    """The delta the noise's cut tails add over ``steps``: per step, the probability that a
    neighbour's output (its mean moved by at most C, i.e. 1 / sigma noise stds) leaves the
    support of the sampler's ``dimension`` coordinates (Box-Muller pairs, radius <= z_max),
    bounded by exit_bound, paid when the record is sampled (probability q)."""
    if noise_multiplier <= 0:
        return steps * sample_rate
    z_max = NOISE_SAMPLERS[sampler].z_max
    per_step = exit_bound(z_max, math.ceil(dimension / 2), 1 / noise_multiplier)
    return steps * sample_rate * per_step


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
