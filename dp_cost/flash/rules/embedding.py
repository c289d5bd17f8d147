"""nn.Embedding: a sample's gradient rows are the sums of its tokens' output gradients by id."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dp_cost.flash.precision import to_accumulation
from dp_cost.flash.rules.base import NormRule, register_norm_rule

if TYPE_CHECKING:
    from dp_cost.flash.layer import Layer


# Per-sample norms by the Gram route (_gram_squared_norms) where its [B, T, T] products hold at
# most GRAM_ROUTE_ELEMENTS (64 MB in fp32) and it makes at most GRAM_ROUTE_MULTIPLY_ADDS
# (B * T^2 * d). Its bmm is exact fp32, so it runs on CUDA cores, not tensor cores: at d = 2048
# on an H200 it took 0.19 ms per embedding at (8, 512) (2^32 multiply-adds), and 0.76 ms at
# (8, 1024), where the step is bound by the GPU (there the sort route's launches are hidden).
GRAM_ROUTE_ELEMENTS = 2**24
GRAM_ROUTE_MULTIPLY_ADDS = 2**32


def takes_gram_route(G: Tensor) -> bool:
    """Whether an embedding's per-sample norms for output gradients G [B, T, d] go by the Gram
    route (within both bounds above, where fp32 matmuls are exact) rather than by sorting."""
    B, T, d = G.shape
    return (
        B * T * T <= GRAM_ROUTE_ELEMENTS
        and B * T * T * d <= GRAM_ROUTE_MULTIPLY_ADDS
        and _exact_fp32_matmul(G)
    )


def _exact_fp32_matmul(G: Tensor) -> bool:
    """Does an fp32 bmm on G's device multiply in full fp32? Not where the user allowed TF32
    (about 1e-3 relative): the sort route's sums are exact there."""
    return not G.is_cuda or not torch.backends.cuda.matmul.allow_tf32


def _embedding(module: nn.Embedding, ids: Tensor) -> Tensor:
    """nn.Embedding's forward (without max_norm) with torch's op called directly (F.embedding
    and Module.__getattr__ are Python calls); nn.Embedding keeps padding_idx non-negative."""
    padding_idx = -1 if module.padding_idx is None else module.padding_idx
    weight = module._parameters["weight"]
    return torch.embedding(weight, ids, padding_idx, module.scale_grad_by_freq, module.sparse)


@register_norm_rule(nn.Embedding)
class EmbeddingRule(NormRule):
    def feature_dims(self, module):
        return 0, 1  # input: token ids [B, T]; output: [B, T, d]

    def describe(self, layer, A, G):
        return {"route": "embedding"}

    def compute_for(self, module):
        if module.max_norm is not None or "weight" not in module._parameters:
            return super().compute_for(module)  # F.embedding renormalises rows in place
        return _embedding

    @staticmethod
    def _unpadded(layer: Layer, ids: Tensor, G: Tensor) -> Tensor:
        """G [B, T, d] with g = 0 at padding tokens (torch gives the padding row no gradient).
        Masking by multiplication (exact: by 0 or 1), not boolean indexing: indexing by a mask
        waits for the GPU to count it (a host sync mid-step)."""
        if layer.module.padding_idx is None:
            return G
        return G * (ids != layer.module.padding_idx)[:, :, None].to(G.dtype)

    @classmethod
    def _tokens(cls, layer: Layer, ids: Tensor, G: Tensor):
        """Flat (sample index, token id, g) of every token, padding tokens' g = 0."""
        samples = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        return samples.flatten(), ids.flatten(), cls._unpadded(layer, ids, G).flatten(0, 1)

    def squared_norms(self, layer, A, G):
        if takes_gram_route(G):
            return self._gram_squared_norms(layer, A, G)
        samples, ids, g = self._tokens(layer, A, G)
        g = to_accumulation(g)
        # A sample's gradient row for token id v is the sum of g over its tokens with id v:
        # sort the (sample, id) keys, number the runs of equal keys, segment-sum g into one row
        # per run. Sorting has a fixed output size (torch.unique would sync with the host).
        keys, order = (samples * layer.module.num_embeddings + ids).sort()
        run = torch.ones_like(keys, dtype=torch.bool)
        run[1:] = keys[1:] != keys[:-1]
        run_index = run.cumsum(0) - 1  # of each sorted token; runs <= n
        run_of_token = torch.empty_like(run_index).scatter_(0, order, run_index)  # unsorted
        rows = g.new_zeros(g.shape).index_add_(0, run_of_token, g)  # no sorted copy of g
        run_sample = torch.zeros_like(keys).scatter_(
            0, run_index, keys // layer.module.num_embeddings
        )  # a run's tokens share their sample; rows past the last run are zero
        norms = rows.new_zeros(A.shape[0])
        return norms.index_add_(0, run_sample, rows.square().sum(1))

    @classmethod
    def _gram_squared_norms(cls, layer: Layer, ids: Tensor, G: Tensor) -> Tensor:
        """||sum_t onehot(id_t) g_t^T||^2 = sum_{s,t} [id_s = id_t] g_s . g_t per sample: one
        batched Gram of the tokens' g masked by equal ids, five launches where the sort route
        takes about fifteen (each a few tens of microseconds of host time, on a step bound by
        it at short sequences)."""
        g = to_accumulation(cls._unpadded(layer, ids, G))
        same_id = ids[:, :, None] == ids[:, None, :]
        return (torch.bmm(g, g.mT) * same_id).sum((1, 2))

    def clipped_grads(self, layer, A, G, c):
        samples, ids, g = self._tokens(layer, A, G)
        weight = layer.module.weight
        scaled = (to_accumulation(g) * to_accumulation(c.c)[samples, None]).to(weight.dtype)
        # new_zeros of the full shape: under FSDP2 the weight is a shard (a DTensor) here
        return {"weight": scaled.new_zeros(weight.shape).index_add_(0, ids, scaled)}
