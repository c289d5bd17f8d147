"""Each noise sampler's law, read from its source, and the chance that a neighbour's output
leaves that law's support: the delta the accountant does not see.

Every sampler here is Box-Muller: a pair of normals from a radius sqrt(-2 ln u) and an angle,
where u is not a real number but one of finitely many values, u_k = (k + offset) / 2^bits for
k = 0, 1, ..., each with probability 2^-bits. So a pair's radius takes the values r_k, the
largest r_0 = z_max with probability 2^-bits: an atom at the edge of the support. A pair moved
by a leaves its disk only if its radius exceeded z_max - a, and a pair at the atom leaves for
any a > 0 in the outward half of its angles: a shift spread over every pair leaves the support
with probability about pairs * 2^-bits / 2, far above what a continuous law cut at z_max gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Radii are computed in fp32 by the samplers (a few operations, each within half an ulp of a
# value below 10, ulp 1e-6): a radius this close to the edge is counted as on it.
RADIUS_SLACK = 1e-5
EXACT_TERMS = 2**20  # grid values summed one by one; beyond, geometric blocks, each at its first


@dataclass(frozen=True)
class NoiseLaw:
    """A Box-Muller sampler whose radius uniform takes the values (k + offset) / 2^bits, each
    with probability 2^-bits (k = 0, 1, ...)."""

    description: str
    bits: int
    offset: float

    @property
    def smallest_uniform(self) -> float:
        return self.offset * 2.0**-self.bits

    @property
    def z_max(self) -> float:
        return math.sqrt(-2 * math.log(self.smallest_uniform))

    def gaps(self, ks: np.ndarray) -> np.ndarray:
        """z_max - r_k, in the form that does not cancel: (z_max^2 - r_k^2) / (z_max + r_k)."""
        log_ratio = np.log((ks + self.offset) / self.offset)
        radii = np.sqrt(np.maximum(self.z_max**2 - 2 * log_ratio, 0.0))
        return 2 * log_ratio / (self.z_max + radii)

    def grid_values_within(self, shift: float) -> float:
        """How many k >= 1 have r_k > z_max - shift - RADIUS_SLACK (as a float; 2^bits - 1 at
        most): the radii a pair moved by at most ``shift`` can leave from."""
        inner = self.z_max - shift - RADIUS_SLACK
        if inner <= 0:
            return 2.0**self.bits - 1
        below = 2.0**self.bits * math.exp(-(inner**2) / 2) - self.offset  # k < below
        return min(max(math.ceil(below) - 1, 0), 2.0**self.bits - 1)


# The samplers the trainers use, read from their sources.
NOISE_LAWS = {
    # flash's Triton kernel (flash/kernels/noise.py) and its torch twin (noise/exact64.py): the
    # radius from two 32-bit Philox words, u = (high 2^32 + low + 1/2) / 2^64
    "exact64": NoiseLaw("64-bit Box-Muller (flash, --noise_sampler exact64)", 64, 0.5),
    # torch.normal on CUDA: curand_normal4, u = (x + 1/2) / 2^32 from one 32-bit word per radius
    "torch_cuda": NoiseLaw("torch.normal on CUDA (curand: a 32-bit uniform per radius)", 32, 0.5),
    # torch.normal on the CPU (normal_fill): u = 1 - x / 2^24 with x a 24-bit integer, so
    # u = m / 2^24 for m = 1 .. 2^24
    "torch_cpu": NoiseLaw("torch.normal on the CPU (a 24-bit uniform per radius)", 24, 1.0),
}


def exit_bound(law: NoiseLaw, pairs: int, shift: float) -> float:
    """At most the probability that a neighbour's output leaves the support of ``pairs``
    Box-Muller pairs of ``law`` when the mean moves by ``shift`` noise stds in all, split any
    way over the pairs (sum a_p^2 <= shift^2).

    Union over pairs: sum_p P(r > z_max - a_p) = 2^-bits sum_k #{p : a_p > g_k}, g_k = z_max -
    r_k. For k = 0 (g = 0) the count is at most ``pairs``; for k >= 1 at most
    min(pairs, shift^2 / g_k^2) (Chebyshev on the a_p^2), and 0 once g_k >= shift."""
    if shift <= 0 or pairs <= 0:
        return 0.0
    total = float(pairs)  # the atom at z_max: every moved pair
    count = law.grid_values_within(shift)
    exact_end = min(count, EXACT_TERMS) + 1
    ks = np.arange(1, exact_end, dtype=np.float64)
    total += _moved_pairs(law, ks, pairs, shift).sum()
    if count >= exact_end:  # k in [start, end) counted at k = start (the terms fall with k)
        starts = np.unique(np.floor(np.geomspace(exact_end, count + 1, num=20_000)))
        ends = np.append(starts[1:], count + 1)
        total += (_moved_pairs(law, starts, pairs, shift) * (ends - starts)).sum()
    return min(1.0, total * 2.0**-law.bits)


def _moved_pairs(law: NoiseLaw, ks: np.ndarray, pairs: int, shift: float) -> np.ndarray:
    """For each k, at most how many pairs can be moved past g_k - RADIUS_SLACK."""
    gaps = np.maximum(law.gaps(ks) - RADIUS_SLACK, 0.0)
    with np.errstate(divide="ignore"):
        return np.minimum(float(pairs), shift**2 / gaps**2)


def tail_delta(
    sampler: str, dimension: int, noise_multiplier: float, sample_rate: float, steps: int
) -> float:
    """The delta the noise's bounded support adds over ``steps``: per step, the bound on a
    neighbour's output (its mean moved by at most C, i.e. 1 / sigma noise stds) leaving the
    support of ``dimension`` coordinates (ceil(d / 2) Box-Muller pairs), paid when the record
    is sampled (probability q); at most 1."""
    if noise_multiplier <= 0:
        return min(1.0, steps * sample_rate)
    pairs = math.ceil(dimension / 2)
    per_step = exit_bound(NOISE_LAWS[sampler], pairs, 1 / noise_multiplier)
    return min(1.0, steps * sample_rate * per_step)
