"""The law of a Poisson-sampled batch's size: each of N records joins independently with
probability q = B / N (``privacy.poisson_batch`` draws it). Torch-free: the plan's notes and the
capacity planner's quantile read it before torch is imported."""

from __future__ import annotations

import math


def draw_probability(count: int, batch_size: int, dataset_size: int) -> float:
    """P(a Poisson-sampled batch has exactly ``count`` samples) at rate B/N: binomial over N
    samples, or its Poisson limit where N >> B (lgamma's differences lose digits there)."""
    k, b, n = count, batch_size, dataset_size
    if k > n:
        return 0.0
    if n > 10**6 * b:
        return math.exp(k * math.log(b) - b - math.lgamma(k + 1))
    if b == n:
        return float(k == n)
    log_choose = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return math.exp(log_choose + k * math.log(b / n) + (n - k) * math.log1p(-b / n))


def draw_above_probability(limit: int, batch_size: int, dataset_size: int) -> float:
    """P(a Poisson-sampled batch has more than ``limit`` samples)."""
    below = math.fsum(draw_probability(k, batch_size, dataset_size) for k in range(limit + 1))
    return max(0.0, 1.0 - below)
