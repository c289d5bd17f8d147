"""The 64-bit Box-Muller transform in torch operations: the law of flash's Triton noise kernel
(flash/kernels/noise.py) wherever that kernel does not run (the CPU, a non-contiguous tensor).

torch's own samplers form each radius from a 24-bit (CPU) or 32-bit (CUDA) uniform, so their
radius has an atom at its top whose exit probability grows with the noised coordinates
(noise/laws.py); from a 64-bit uniform the atom is 2^-64."""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

TWO_POW_MINUS_32 = 2.0**-32
PAIRS_PER_DRAW = 2**14  # a draw's words and fp64 temporaries stay near 1 MB beside the model


def exact64_normal(
    count: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``count`` N(0, 1) draws (fp32, flat), in Box-Muller pairs from three uniform 32-bit words
    a pair: u = (high 2^32 + low + 1/2) / 2^64 for the radius (u >= 2^-65, |z| <= sqrt(130
    ln 2)), angle 2 pi w / 2^32."""
    pairs = (count + 1) // 2
    # randint over [0, 2^32) takes a 64-bit draw modulo 2^32: uniform 32-bit words
    words = torch.randint(0, 2**32, (3, pairs), generator=generator, device=device)
    # each pair's two normals go to the two halves (any layout keeps the pairs independent)
    return torch.cat(box_muller64(*words))[:count]


def box_muller64(high: torch.Tensor, low: torch.Tensor, angle: torch.Tensor):
    """The pair of normals (fp32) from three 32-bit words (integer tensors), as the Triton
    kernel forms them (flash/kernels/noise.py's uniform64_to_normal): the radius from fp64
    x = high + (low + 1/2) / 2^32 (exact where high is small, the tail), ln u = ln x - 32 ln 2;
    the angle, whose precision no tail depends on, in fp32 (a third of fp64's time)."""
    x = high.to(torch.float64) + (low.to(torch.float64) + 0.5) * TWO_POW_MINUS_32
    radius = (2 * (32 * math.log(2) - x.log())).clamp(min=0).sqrt().to(torch.float32)
    theta = angle.to(torch.float32) * (2 * math.pi * TWO_POW_MINUS_32)
    return radius * theta.cos(), radius * theta.sin()


def add_exact64_noise_(
    tensors: list[torch.Tensor], std: float, generator: torch.Generator | None = None
) -> None:
    """t += std * N(0, 1) elementwise for every tensor (one device), drawn by exact64_normal
    for several tensors at once, at most 2 PAIRS_PER_DRAW elements a draw (a larger tensor in
    pieces), so few operations a step and small temporaries beside the model."""
    if tensors and is_fake(tensors[0]):
        # A planned step (--mode=capacity's fake tensors): no values to noise, and nothing to
        # count: on CUDA the noise of contiguous tensors is one fused in-place kernel
        # (flash/kernels/noise.py; flash.clip.fused_noise), here a piece's temporaries at a
        # time (about 1 MB). Drawn piece by piece, a 1b model's noise was 36,000 draws of fake
        # ops, 280 s of each flash prediction on a CPU.
        return
    piece = 2 * PAIRS_PER_DRAW
    group: list[torch.Tensor] = []  # flat views whose noise is drawn together
    sizes: list[int] = []
    drawn = 0  # sum(sizes)
    for tensor in tensors:
        if not tensor.is_contiguous():  # its own draw, added through the view
            noise = exact64_normal(tensor.numel(), generator, tensor.device)
            tensor.add_(noise.view(tensor.shape).to(tensor.dtype), alpha=std)
            continue
        flat = tensor.view(-1)
        for start in range(0, flat.numel(), piece):
            view = flat[start : start + piece]
            if sizes and drawn + view.numel() > piece:
                _add_drawn(group, sizes, std, generator)
                group, sizes, drawn = [], [], 0
            group.append(view)
            sizes.append(view.numel())
            drawn += view.numel()
    if group:
        _add_drawn(group, sizes, std, generator)


def _add_drawn(views: list[torch.Tensor], sizes: list[int], std: float, generator) -> None:
    noise = exact64_normal(sum(sizes), generator, views[0].device).split(sizes)
    torch._foreach_add_(views, [n.to(v.dtype) for n, v in zip(noise, views)], alpha=std)
