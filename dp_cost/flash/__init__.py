"""Flash Clipping: exact per-sample gradient norms and clipped gradients for DP-SGD from one
backward pass (engine.FlashClipping), by per-layer-type norm rules (rules/) and, on CUDA, fused
Triton kernels (kernels/).

Its public surface, what the trainers and the measurements use, is imported here."""

from dp_cost.flash.clip import add_gaussian_noise, clip_per_sample
from dp_cost.flash.engine import FlashClipping, UnsupportedLayerError
from dp_cost.flash.layer import tensors_in
from dp_cost.flash.sites import ALLOCATION_SITES

__all__ = [
    "ALLOCATION_SITES",
    "FlashClipping",
    "UnsupportedLayerError",
    "add_gaussian_noise",
    "clip_per_sample",
    "tensors_in",
]
