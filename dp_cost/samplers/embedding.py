"""``nn.Embedding`` samplers that honour ``padding_idx``, as torch's own backward does.

The pad positions' output gradients are zeroed before Opacus' stock samplers see them, so the
pad row gets no per-sample gradient (hooks) and adds nothing to the per-sample norms (ghost).
"""

from __future__ import annotations

import torch
from opacus.grad_sample import embedding as stock
from opacus.grad_sample.utils import register_grad_sampler, register_norm_sampler
from torch import nn


def without_padding(layer: nn.Embedding, activations, backprops: torch.Tensor) -> torch.Tensor:
    """``backprops`` with the rows of pad tokens set to zero (unchanged without padding_idx)."""
    if layer.padding_idx is None:
        return backprops
    ids = activations[0]
    return backprops.masked_fill((ids == layer.padding_idx).unsqueeze(-1), 0)


@register_grad_sampler(nn.Embedding)
def embedding_grad_sample(layer: nn.Embedding, activations, backprops: torch.Tensor) -> dict:
    backprops = without_padding(layer, activations, backprops)
    return stock.compute_embedding_grad_sample(layer, activations, backprops)


@register_norm_sampler(nn.Embedding)
def embedding_norm_sample(layer: nn.Embedding, activations, backprops: torch.Tensor) -> dict:
    backprops = without_padding(layer, activations, backprops)
    return stock.compute_embedding_norm_sample(layer, activations, backprops)
