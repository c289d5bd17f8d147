"""DP-SGD's Gaussian noise drawn (Philox) and added in one pass over every gradient."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dp_cost.flash.kernels.common import TL_DTYPES, block_table, int64_table

# Elements per program of the noise kernel (1024 and 2048 run alike, 4096 slower: fewer
# programs keep fewer loads in flight).
NOISE_BLOCK = 2048


# Box-Muller's radius sqrt(-2 ln u) is at most Z_MAX for the smallest uniform u the transform
# sees, (0 * 2^32 + 0 + 1/2) / 2^64 from two 32-bit Philox words: |z| <= sqrt(130 ln 2) ~ 9.49.
# Triton's own randn clamps u at 1e-7 (|z| <= 5.68): too short a tail for DP, whose guarantee
# rests on the Gaussian's tail where a neighbour's shifted output lands (docs/privacy.md).
SMALLEST_UNIFORM = 2.0**-65
Z_MAX = math.sqrt(-2 * math.log(SMALLEST_UNIFORM))


@triton.jit
def uniform64_to_normal(high, low, angle, HARDWARE_MATH: tl.constexpr):
    """Two N(0, 1) by Box-Muller from three uint32 Philox words: a 64-bit uniform
    u = (high * 2^32 + low + 1/2) / 2^64 for the radius, a 32-bit one for the angle. In fp32,
    ln u = ln x - 32 ln 2 with x = u * 2^32 = high + (low + 1/2) / 2^32: where high is 0, x
    keeps 24 bits of precision down to 2^-33, so no uniform is clamped. The angle word read as
    signed gives an angle in [-pi, pi), the same sine and cosine as in [0, 2 pi).

    HARDWARE_MATH: ln, sin and cos from the GPU's own approximations (lg2.approx, sin.approx,
    cos.approx), where the exact functions made the kernel compute-bound, not memory-bound. A
    tail radius stays within 1e-6 relative of the fp64 transform's (bounded in
    tests/flash/test_flash_kernels_gpu.py), inside the 1e-5 the law's grid allows
    (noise/laws.py). Off under the interpreter, which cannot run them."""
    x = high.to(tl.float32) + (low.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
    theta = angle.to(tl.int32, bitcast=True).to(tl.float32) * 1.4629180792671596e-09  # 2pi/2^32
    if HARDWARE_MATH:
        ln_x = libdevice.fast_logf(x)
        cos, sin = libdevice.fast_cosf(theta), libdevice.fast_sinf(theta)
    else:
        ln_x = tl.log(x)
        cos, sin = tl.cos(theta), tl.sin(theta)
    # 22.18070977791825 = 32 ln 2. x rounds up to at most 2^32 (u = 1): radius 0, never the
    # root of a negative number
    radius = tl.sqrt(tl.maximum(2.0 * (22.18070977791825 - ln_x), 0.0))
    return radius * cos, radius * sin


@triton.jit
def _noisy_part(base, offsets, size, std, noise, DTYPE: tl.constexpr):
    keep = offsets < size
    x = tl.load(base + offsets, mask=keep, other=0.0).to(tl.float32)
    tl.store(base + offsets, (x + std * noise).to(DTYPE), mask=keep)


@triton.jit
def _add_noise_kernel(
    pointers, tensor_of_block, first_block, sizes, seeds, std,
    BLOCK: tl.constexpr, DTYPE: tl.constexpr, HARDWARE_MATH: tl.constexpr,
):  # fmt: skip
    """x += std * N(0, 1) over a list of tensors in one launch: program -> (tensor, block)."""
    block = tl.program_id(0)
    i = tl.load(tensor_of_block + block)
    size = tl.load(sizes + i)
    base = tl.load(pointers + i).to(tl.pointer_type(DTYPE))
    EIGHTH: tl.constexpr = BLOCK // 8
    # Three Philox draws per lane (keyed by the tensor's seed; counter: the lane's unique
    # 64-bit index, and 0, 1 or 2) give twelve words, three a Box-Muller pair: four pairs,
    # eight normals, one for each eighth of the block.
    block_in_tensor = (block - tl.load(first_block + i)).to(tl.int64)
    counter = block_in_tensor * EIGHTH + tl.arange(0, EIGHTH)
    counter_low, counter_high = counter.to(tl.uint32), (counter >> 32).to(tl.uint32)
    seed, zero = tl.load(seeds + i), counter_low * 0
    a0, a1, a2, a3 = tl.philox(seed, counter_low, counter_high, zero, zero)
    b0, b1, b2, b3 = tl.philox(seed, counter_low, counter_high, zero + 1, zero)
    c0, c1, c2, c3 = tl.philox(seed, counter_low, counter_high, zero + 2, zero)
    n0, n1 = uniform64_to_normal(a0, a1, a2, HARDWARE_MATH)
    n2, n3 = uniform64_to_normal(b0, b1, b2, HARDWARE_MATH)
    n4, n5 = uniform64_to_normal(c0, c1, c2, HARDWARE_MATH)
    n6, n7 = uniform64_to_normal(a3, b3, c3, HARDWARE_MATH)
    start = block_in_tensor * BLOCK + tl.arange(0, EIGHTH)
    _noisy_part(base, start, size, std, n0, DTYPE)
    _noisy_part(base, start + EIGHTH, size, std, n1, DTYPE)
    _noisy_part(base, start + 2 * EIGHTH, size, std, n2, DTYPE)
    _noisy_part(base, start + 3 * EIGHTH, size, std, n3, DTYPE)
    _noisy_part(base, start + 4 * EIGHTH, size, std, n4, DTYPE)
    _noisy_part(base, start + 5 * EIGHTH, size, std, n5, DTYPE)
    _noisy_part(base, start + 6 * EIGHTH, size, std, n6, DTYPE)
    _noisy_part(base, start + 7 * EIGHTH, size, std, n7, DTYPE)


def compiled(device: torch.device) -> bool:
    """Whether a kernel launched for ``device`` is compiled for a GPU (not interpreted)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


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
            BLOCK=NOISE_BLOCK, DTYPE=TL_DTYPES[dtype], HARDWARE_MATH=compiled(device),
        )  # fmt: skip
