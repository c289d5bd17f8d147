"""DP-SGD's Gaussian noise drawn (Philox) and added in one pass over every gradient."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dp_cost.flash.kernels.common import TL_DTYPES, block_table, int64_table

# Elements per program of the noise kernel: on an H100 with the 1b model's 325 fp32 gradients
# (1.17G elements), 2048 ran at 3.35 ms, as fast as torch's read-and-write foreach add_ (3.56
# ms); 4096 took 5.24 ms and 8192 6.34 ms (4 warps; fewer programs keep fewer loads in flight).
NOISE_BLOCK = 2048


# Box-Muller's radius sqrt(-2 ln u) is at most Z_MAX for the smallest uniform u the transform
# sees, (0 * 2^32 + 0 + 1/2) / 2^64 from two 32-bit Philox words: |z| <= sqrt(130 ln 2) ~ 9.49.
# Triton's own randn clamps u at 1e-7 (|z| <= 5.68): too short a tail for DP, whose guarantee
# rests on the Gaussian's tail where a neighbour's shifted output lands (docs/privacy.md).
SMALLEST_UNIFORM = 2.0**-65
Z_MAX = math.sqrt(-2 * math.log(SMALLEST_UNIFORM))


@triton.jit
def uniform64_to_normal(high, low, angle):
    """Two N(0, 1) by Box-Muller from three uint32 Philox words: a 64-bit uniform
    u = (high * 2^32 + low + 1/2) / 2^64 for the radius, a 32-bit one for the angle. In fp32,
    ln u = ln x - 32 ln 2 with x = u * 2^32 = high + (low + 1/2) / 2^32: where high is 0, x
    keeps 24 bits of precision down to 2^-33, so no uniform is clamped."""
    x = high.to(tl.float32) + (low.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
    # 22.18070977791825 = 32 ln 2. x rounds up to at most 2^32 (u = 1): radius 0, never the
    # root of a negative number
    radius = tl.sqrt(tl.maximum(2.0 * (22.18070977791825 - tl.log(x)), 0.0))
    theta = angle.to(tl.float32) * 1.4629180792671596e-09  # 2 pi / 2^32
    return radius * tl.cos(theta), radius * tl.sin(theta)


@triton.jit
def _noisy_quarter(base, offsets, size, std, noise, DTYPE: tl.constexpr):
    keep = offsets < size
    x = tl.load(base + offsets, mask=keep, other=0.0).to(tl.float32)
    tl.store(base + offsets, (x + std * noise).to(DTYPE), mask=keep)


@triton.jit
def _add_noise_kernel(
    pointers, tensor_of_block, first_block, sizes, seeds, std,
    BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """x += std * N(0, 1) over a list of tensors in one launch: program -> (tensor, block)."""
    block = tl.program_id(0)
    i = tl.load(tensor_of_block + block)
    size = tl.load(sizes + i)
    base = tl.load(pointers + i).to(tl.pointer_type(DTYPE))
    QUARTER: tl.constexpr = BLOCK // 4
    # Two Philox draws per lane (keyed by the tensor's seed; counter: the lane's unique 64-bit
    # index, and 0 or 1) give eight words, six of them used: two Box-Muller pairs, four normals,
    # one for each quarter of the block.
    block_in_tensor = (block - tl.load(first_block + i)).to(tl.int64)
    counter = block_in_tensor * QUARTER + tl.arange(0, QUARTER)
    counter_low, counter_high = counter.to(tl.uint32), (counter >> 32).to(tl.uint32)
    seed, zero = tl.load(seeds + i), counter_low * 0
    a0, a1, a2, _ = tl.philox(seed, counter_low, counter_high, zero, zero)
    b0, b1, b2, _ = tl.philox(seed, counter_low, counter_high, zero + 1, zero)
    n0, n1 = uniform64_to_normal(a0, a1, a2)
    n2, n3 = uniform64_to_normal(b0, b1, b2)
    start = block_in_tensor * BLOCK + tl.arange(0, QUARTER)
    _noisy_quarter(base, start, size, std, n0, DTYPE)
    _noisy_quarter(base, start + QUARTER, size, std, n1, DTYPE)
    _noisy_quarter(base, start + 2 * QUARTER, size, std, n2, DTYPE)
    _noisy_quarter(base, start + 3 * QUARTER, size, std, n3, DTYPE)


def add_gaussian_noise_(
    tensors: list[torch.Tensor], std: float, generator: torch.Generator | None = None
) -> None:
    """t += N(0, std^2) elementwise for every (contiguous, one-device) tensor, one launch per
    dtype: the noise is drawn in registers and added in the same pass, so each element is read
    and written once (torch draws noise into a buffer, then adds it: three passes, two launches
    per tensor). Seeds (one per tensor) come from ``generator`` (default: torch's generator of
    the device, so torch.manual_seed reproduces the noise); Philox is the generator torch uses
    on CUDA too."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError("add_gaussian_noise_ needs contiguous tensors")
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype, group in by_dtype.items():
        device = group[0].device
        sizes = tuple(t.numel() for t in group)
        tensor_of_block, first_block, numels = block_table(device, sizes, NOISE_BLOCK)
        pointers = int64_table([t.data_ptr() for t in group], device)
        seeds = torch.randint(2**62, (len(group),), device=device, generator=generator)
        _add_noise_kernel[(len(tensor_of_block),)](
            pointers, tensor_of_block, first_block, numels, seeds, std,
            BLOCK=NOISE_BLOCK, DTYPE=TL_DTYPES[dtype],
        )  # fmt: skip
