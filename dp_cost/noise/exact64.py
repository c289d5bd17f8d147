"""The 64-bit Box-Muller transform in torch operations: the law of flash's Triton noise kernel
(flash/kernels/noise.py) wherever that kernel does not run (the CPU, a non-contiguous tensor).

torch's own samplers form each radius from a 24-bit (CPU) or 32-bit (CUDA) uniform, so their
radius has an atom at its top whose exit probability grows with the noised coordinates
(noise/laws.py); from a 64-bit uniform the atom is 2^-64."""

from __future__ import annotations

import math

import torch

TWO_POW_MINUS_32 = 2.0**-32
PAIRS_PER_DRAW = 2**20  # the words and fp64 temporaries of at most this many pairs at a time


def exact64_normal(
    count: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``count`` N(0, 1) draws (fp64, flat), in Box-Muller pairs from three uniform 32-bit words
    a pair: u = (high 2^32 + low + 1/2) / 2^64 for the radius (u >= 2^-65, |z| <= sqrt(130
    ln 2)), angle 2 pi w / 2^32. In fp64, ln u = ln x - 32 ln 2 with x = high + (low + 1/2) /
    2^32, exact where high is small (the tail)."""
    pairs = (count + 1) // 2
    # randint over [0, 2^32) takes a 64-bit draw modulo 2^32: uniform 32-bit words
    words = torch.randint(0, 2**32, (3, pairs), generator=generator, device=device)
    return torch.stack(box_muller64(*words), dim=1).flatten()[:count]


def box_muller64(high: torch.Tensor, low: torch.Tensor, angle: torch.Tensor):
    """The pair of normals (fp64) from three 32-bit words (integer tensors), as the Triton
    kernel forms them (flash/kernels/noise.py's uniform64_to_normal)."""
    high, low, angle = (word.to(torch.float64) for word in (high, low, angle))
    x = high + (low + 0.5) * TWO_POW_MINUS_32
    radius = (2 * (32 * math.log(2) - x.log())).clamp(min=0).sqrt()
    theta = angle * (2 * math.pi * TWO_POW_MINUS_32)
    return radius * theta.cos(), radius * theta.sin()


def add_exact64_noise_(
    tensor: torch.Tensor, std: float, generator: torch.Generator | None = None
) -> None:
    """tensor += std * N(0, 1) elementwise, drawn by exact64_normal a bounded piece at a time
    (a contiguous tensor) so the draw's temporaries stay small beside the model."""
    if not tensor.is_contiguous():
        noise = exact64_normal(tensor.numel(), generator, tensor.device)
        tensor.add_(noise.view(tensor.shape).to(tensor.dtype), alpha=std)
        return
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), 2 * PAIRS_PER_DRAW):
        piece = flat[start : start + 2 * PAIRS_PER_DRAW]
        noise = exact64_normal(piece.numel(), generator, tensor.device)
        piece.add_(noise.to(piece.dtype), alpha=std)
