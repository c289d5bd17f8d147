"""nn.LayerNorm / nn.RMSNorm: per-sample weight and bias gradients [B, d], formed in the backward as
the layers' G arrive (several layers in one launch on CUDA)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dp_cost.flash import fused
from dp_cost.flash.fused import triton_kernels
from dp_cost.flash.layer import GradRequest
from dp_cost.flash.precision import accumulation_dtype, wider
from dp_cost.flash.rules.base import NormRule, register_norm_rule

if TYPE_CHECKING:
    from dp_cost.flash.layer import Layer


@register_norm_rule(nn.LayerNorm, nn.RMSNorm)
class NormLayerRule(NormRule):
    formed_in_backward = True  # [B, d] per parameter, from A and G [B, T, d]

    def feature_dims(self, module):
        k = len(module.normalized_shape)
        return k, k

    def describe(self, layer, A, G):
        return {"route": "norm"}

    def compute_for(self, module):
        if isinstance(module, nn.RMSNorm):
            return _rms_norm
        return _layer_norm

    def formed_after_backward(self, layer, A, G):
        # [B, d] per parameter: always smaller than A and G ([B, T, d]). Formed in the
        # backward (formed_in_backward), or right after it for a norm layer first in the
        # forward, several layers' in one launch (per_sample_grads_many).
        return set(layer.params)

    def per_sample_grads_many(self, calls):
        """Per-sample gradients [B, d] of each call: weight = sum_t g_t * xhat_t, bias =
        sum_t g_t. On CUDA the calls of one shape, dtypes, eps and kind (LayerNorm or RMSNorm)
        in one launch (flash.kernels.norm_layer_per_sample_grads_many), a call the grouped
        kernel cannot read by the one-layer kernel; else the torch path, formed here: builtins
        only in the loop (a Python call per layer is host time)."""
        grads: list = []
        groups: dict[tuple, list[int]] = {}
        kernels = triton_kernels()
        pairs = [(A, G) for _, A, G, _ in calls]
        grouped = kernels.norm_layer_grads_many_supported_each(pairs) if kernels else ()
        for i, (layer, A, G, names) in enumerate(calls):
            m = layer.module
            rms = type(m) is nn.RMSNorm
            if grouped and grouped[i]:
                key = (A.shape, A.dtype, G.dtype, A.get_device(), m.eps, rms)
                groups.setdefault(key, []).append(i)
                grads.append(None)
                continue
            if (
                kernels is not None
                and (A.is_cuda or fused.KERNELS_ON_CPU)
                and kernels.norm_layer_grads_supported(A, G)
            ):
                grads.append(self.per_sample_grads(layer, A, G, names))  # the one-layer kernel
                continue
            wide = wider(A.dtype, torch.float32)
            x, g = A.to(wide), G.to(wider(G.dtype, torch.float32))
            formed = {}
            if "weight" in names:
                shape = (x.shape[-1],)  # normalized dims were flattened into one
                if rms:  # eps=None means eps of the compute dtype, as in torch
                    xhat = torch.rms_norm(x, shape, None, m.eps)
                else:
                    xhat = torch.layer_norm(x, shape, None, None, m.eps, True)
                formed["weight"] = (g * xhat).sum(1)
            if "bias" in names:
                formed["bias"] = g.sum(1)
            grads.append(formed)
        for (*_, rms), members in groups.items():
            first = calls[members[0]]
            eps, _ = _eps_and_kind(first.layer.module, first.A)
            formed = kernels.norm_layer_per_sample_grads_many([pairs[i] for i in members], eps, rms)
            for i, (weight, bias) in zip(members, formed, strict=True):
                grads[i] = _named(weight, bias, calls[i].names)
        return grads

    def per_sample_grads(self, layer: Layer, A: Tensor, G: Tensor, names) -> dict[str, Tensor]:
        """Exact per-sample grads [B, d] of one call: one fused pass over A and G on CUDA
        (flash.kernels.norm_layer_per_sample_grads), else the torch path."""
        kernels = triton_kernels()
        if kernels is not None and kernels.norm_layer_grads_supported(A, G):
            weight, bias = kernels.norm_layer_per_sample_grads(
                A, G, *_eps_and_kind(layer.module, A)
            )
            return _named(weight, bias, names)
        return self.per_sample_grads_many([GradRequest(layer, A, G, names)])[0]


def _eps_and_kind(module: nn.Module, A: Tensor) -> tuple[float, bool]:
    """(eps, is RMSNorm) of a norm layer as its kernel takes them: eps=None means eps of the
    compute dtype, as in torch."""
    eps = module.eps if module.eps is not None else torch.finfo(accumulation_dtype(A)).eps
    return eps, isinstance(module, nn.RMSNorm)


# The layers' forwards with torch's ops called directly (F.layer_norm and F.rms_norm are Python
# functions around them; so is Module.__getattr__ per parameter).
def _layer_norm(module: nn.LayerNorm, x: Tensor) -> Tensor:
    parameters = module._parameters
    weight, bias = parameters.get("weight"), parameters.get("bias")
    return torch.layer_norm(x, module.normalized_shape, weight, bias, module.eps, True)


def _rms_norm(module: nn.RMSNorm, x: Tensor) -> Tensor:
    weight = module._parameters.get("weight")
    return torch.rms_norm(x, module.normalized_shape, weight, module.eps)


def _named(weight: Tensor, bias: Tensor, names) -> dict[str, Tensor]:
    """The fused kernels' (weight, bias) by name, those of ``names`` alone (no bias: weight)."""
    return {name: grad for name, grad in (("weight", weight), ("bias", bias)) if name in names}
