"""Triton kernels for Flash Clipping (CUDA; CPU tests use TRITON_INTERPRET=1), one family per
module:

- gram: the Gram route, ||G_b^T A_b||_F^2 from tiles of A A^T and G G^T formed and reduced on
  chip (nothing of size T x T reaches HBM); gram_squared_norms_grouped runs every Gram-route
  layer of a step in one launch. Flash uses it for bf16/fp16 on CUDA in place of the torch path
  (flash.rules.linear.gram_squared_norms: two batched GEMMs written to HBM, a product and a
  reduction per 512-token tile pair, per layer).
- direct: direct_squared_norms, the direct route, each tile of G_b^T A_b square-summed on chip.
- noise: add_gaussian_noise_, DP-SGD's noise drawn (Philox) and added in one pass over every
  gradient.
- weighted_sums: kept per-sample gradients: squared_row_norms_many, their per-sample squared
  norms, and weighted_sums_, their clipped sums; token_sums_many, Linear biases' per-sample
  gradients (sums of G over tokens); one read of each, one launch.
- clipped_gemm: clipped_weight_grad, a Linear's clipped weight gradient sum_b c_b G_b^T A_b in fp32,
  each sample's product accumulated in fp32 before its fp32 clip factor weights it (the torch
  path folds c into a 16-bit operand and shrinks it by an ulp to stay within C).
- norm_layer: norm_layer_per_sample_grads, LayerNorm / RMSNorm per-sample gradients in one pass
  over x and g; norm_layer_per_sample_grads_many, several layers' in one launch.

Inputs in bf16/fp16 use tensor cores; fp32 inputs use IEEE-precision dots by default (exact to
fp32 rounding, as the torch path), or TF32 when asked. Accumulation is fp32 throughout.

The engine looks the kernels up on this package at call time (flash.fused.triton_kernels), so
replacing an attribute here (a test's monkeypatch) reaches every caller.
"""

from dp_cost.flash.kernels.clipped_gemm import (
    clip_schedule,
    clipped_weight_grad,
    clipped_weight_grad_supported,
    clipped_weight_grad_supported_each,
    fold_clip_factors,
    fold_clip_factors_many,
)
from dp_cost.flash.kernels.direct import direct_squared_norms
from dp_cost.flash.kernels.gram import gram_squared_norms, gram_squared_norms_grouped
from dp_cost.flash.kernels.noise import NOISE_BLOCK, add_gaussian_noise_
from dp_cost.flash.kernels.norm_layer import (
    norm_layer_grads_many_supported,
    norm_layer_grads_many_supported_each,
    norm_layer_grads_supported,
    norm_layer_per_sample_grads,
    norm_layer_per_sample_grads_many,
)
from dp_cost.flash.kernels.weighted_sums import (
    ROW_NORM_BLOCK,
    WEIGHTED_SUM_BLOCK,
    squared_row_norms_many,
    token_sums_many,
    token_sums_supported,
    token_sums_supported_many,
    weighted_sums_,
    weighted_sums_supported,
    weighted_sums_supported_each,
)

__all__ = [
    "NOISE_BLOCK",
    "ROW_NORM_BLOCK",
    "WEIGHTED_SUM_BLOCK",
    "add_gaussian_noise_",
    "clip_schedule",
    "clipped_weight_grad",
    "clipped_weight_grad_supported",
    "clipped_weight_grad_supported_each",
    "direct_squared_norms",
    "fold_clip_factors",
    "fold_clip_factors_many",
    "gram_squared_norms",
    "gram_squared_norms_grouped",
    "norm_layer_grads_many_supported",
    "norm_layer_grads_many_supported_each",
    "norm_layer_grads_supported",
    "norm_layer_per_sample_grads",
    "norm_layer_per_sample_grads_many",
    "squared_row_norms_many",
    "token_sums_many",
    "token_sums_supported",
    "token_sums_supported_many",
    "weighted_sums_",
    "weighted_sums_supported",
    "weighted_sums_supported_each",
]
