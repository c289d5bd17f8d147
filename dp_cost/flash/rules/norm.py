"""nn.LayerNorm / nn.RMSNorm: per-sample weight and bias gradients [B, d], formed at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dp_cost.flash.fused import triton_kernels
from dp_cost.flash.precision import accumulation_dtype, to_accumulation
from dp_cost.flash.rules.base import NormRule, register_norm_rule

if TYPE_CHECKING:
    from dp_cost.flash.layer import Layer


@register_norm_rule(nn.LayerNorm, nn.RMSNorm)
class NormLayerRule(NormRule):
    def feature_dims(self, module):
        k = len(module.normalized_shape)
        return k, k

    def describe(self, layer, A, G):
        return {"route": "norm"}

    def kept_per_sample(self, layer, A, G):
        return set(layer.params)  # [B, d] per parameter: always smaller than A and G ([B, T, d])

    @staticmethod
    def per_sample_grads(layer: Layer, A: Tensor, G: Tensor, names) -> dict[str, Tensor]:
        """Exact per-sample grads [B, d]: weight = sum_t g_t * xhat_t, bias = sum_t g_t."""
        m = layer.module
        rms = isinstance(m, nn.RMSNorm)
        kernels = triton_kernels()
        if kernels is not None and kernels.norm_layer_grads_supported(A, G):
            # One fused pass over A and G (flash.kernels.norm_layer_per_sample_grads); eps=None
            # means eps of the compute dtype, as in torch.
            eps = m.eps if m.eps is not None else torch.finfo(accumulation_dtype(A)).eps
            weight, bias = kernels.norm_layer_per_sample_grads(A, G, eps, rms)
            fused = {"weight": weight, "bias": bias}
            return {name: fused[name] for name in ("weight", "bias") if name in names}
        x, g = to_accumulation(A), to_accumulation(G)
        grads = {}
        if "weight" in names:
            shape = (x.shape[-1],)  # normalized dims were flattened into one
            if rms:  # eps=None means eps of the compute dtype, as in torch
                xhat = F.rms_norm(x, shape, eps=m.eps)
            else:
                xhat = F.layer_norm(x, shape, eps=m.eps)
            grads["weight"] = (g * xhat).sum(1)
        if "bias" in names:
            grads["bias"] = g.sum(1)
        return grads
