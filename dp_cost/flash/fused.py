"""Where flash's fused Triton kernels come from: the flash.kernels package where Triton imports,
else None (the callers then take their torch paths)."""

from __future__ import annotations

import functools

# The kernels' support checks are asked only about CUDA tensors (they pass nowhere else, and
# asking is a Python call per layer); True asks them about CPU tensors too: tests of the wiring,
# with a check patched to pass and the kernels interpreted (TRITON_INTERPRET=1).
KERNELS_ON_CPU = False


@functools.cache  # a failed import is not cached by Python: try it once, not per layer
def triton_kernels():
    """flash.kernels (fused Triton kernels, for CUDA tensors) where Triton imports, else None."""
    try:
        from dp_cost.flash import kernels as flash_kernels
    except ImportError:  # no triton: the torch path
        return None
    return flash_kernels
