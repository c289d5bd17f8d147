"""nn.LayerNorm / nn.RMSNorm: per-sample weight and bias gradients [B, d], formed after the backward
(several layers in one launch on CUDA)."""

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

    def formed_after_backward(self, layer, A, G):
        # [B, d] per parameter: always smaller than A and G ([B, T, d]). Formed after the
        # backward, several layers' in one launch (per_sample_grads_many), not in the backward
        # hook one launch each: flash.capture bounds the A and G held for it (DEFERRED_BYTES).
        return set(layer.params)

    def per_sample_grads_many(self, calls):
        """per_sample_grads of each call; on CUDA the calls of one shape, dtypes, eps and kind
        (LayerNorm or RMSNorm) in one launch (flash.kernels.norm_layer_per_sample_grads_many)."""
        grads: list = [None] * len(calls)
        groups: dict[tuple, list[int]] = {}
        kernels = triton_kernels()
        for i, (layer, A, G, names) in enumerate(calls):
            if kernels is not None and kernels.norm_layer_grads_many_supported(A, G):
                eps, rms = _eps_and_kind(layer.module, A)
                groups.setdefault((A.shape, A.dtype, G.dtype, A.device, eps, rms), []).append(i)
            else:
                grads[i] = self.per_sample_grads(layer, A, G, names)
        for (*_, eps, rms), members in groups.items():
            pairs = [(calls[i].A, calls[i].G) for i in members]
            formed = kernels.norm_layer_per_sample_grads_many(pairs, eps, rms)
            for i, (weight, bias) in zip(members, formed, strict=True):
                grads[i] = _named(weight, bias, calls[i].names)
        return grads

    @staticmethod
    def per_sample_grads(layer: Layer, A: Tensor, G: Tensor, names) -> dict[str, Tensor]:
        """Exact per-sample grads [B, d]: weight = sum_t g_t * xhat_t, bias = sum_t g_t."""
        m = layer.module
        rms = isinstance(m, nn.RMSNorm)
        kernels = triton_kernels()
        if kernels is not None and kernels.norm_layer_grads_supported(A, G):
            # One fused pass over A and G (flash.kernels.norm_layer_per_sample_grads)
            weight, bias = kernels.norm_layer_per_sample_grads(A, G, *_eps_and_kind(m, A))
            return _named(weight, bias, names)
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


def _eps_and_kind(module: nn.Module, A: Tensor) -> tuple[float, bool]:
    """(eps, is RMSNorm) of a norm layer as its kernel takes them: eps=None means eps of the
    compute dtype, as in torch."""
    eps = module.eps if module.eps is not None else torch.finfo(accumulation_dtype(A)).eps
    return eps, isinstance(module, nn.RMSNorm)


def _named(weight: Tensor, bias: Tensor, names) -> dict[str, Tensor]:
    """The fused kernels' (weight, bias) by name, those of ``names`` alone (no bias: weight)."""
    return {name: grad for name, grad in (("weight", weight), ("bias", bias)) if name in names}
