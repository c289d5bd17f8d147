"""Where flash's fused Triton kernels come from: the flash.kernels package where Triton imports,
else None (the callers then take their torch paths)."""

from __future__ import annotations

import functools


@functools.cache  # a failed import is not cached by Python: try it once, not per layer
def triton_kernels():
    """flash.kernels (fused Triton kernels, for CUDA tensors) where Triton imports, else None."""
    try:
        from dp_cost.flash import kernels as flash_kernels
    except ImportError:  # no triton: the torch path
        return None
    return flash_kernels
