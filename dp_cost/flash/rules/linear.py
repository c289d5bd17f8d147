"""nn.Linear: per-sample norms by the Gram, direct or product route, clipped sums by one GEMM."""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor, nn

from dp_cost.flash.fused import triton_kernels
from dp_cost.flash.layer import Layer, LayerCall
from dp_cost.flash.precision import accumulation_dtype, device_type, gemm_operands, to_accumulation
from dp_cost.flash.rules.base import NormRule, register_norm_rule


def gram_squared_norms(A: Tensor, G: Tensor, tile: int, fused: bool | None = None) -> Tensor:
    """||G_b^T A_b||^2 = sum_{s,t} (a_s.a_t)(g_s.g_t), over tile pairs t <= s (no B x T x T).

    bf16/fp16 on CUDA (unless fused=False): one fused Triton kernel does it all on chip
    (flash.kernels.gram_squared_norms; on an H100 at the 1b shapes, T 512 and 1024, from 1.6x
    faster to 3% slower than this torch path per layer, and a step runs all layers in one launch:
    LinearRule.squared_norms_many). fp32 keeps the torch path: there cuBLAS' IEEE fp32 GEMMs beat
    the kernel's IEEE dots (1.2-1.4x, same card). See benchmarks/history/2026-11-26.md.
    """
    A, G = gemm_operands(A, G)
    if fused is not False and fused_norms_available(A):
        return triton_kernels().gram_squared_norms(A, G).to(accumulation_dtype(A))
    total = to_accumulation(A.new_zeros(A.shape[0]))
    for s in range(0, A.shape[1], tile):
        a_s, g_s = A[:, s : s + tile], G[:, s : s + tile]
        for t in range(0, s + 1, tile):
            a_t, g_t = A[:, t : t + tile], G[:, t : t + tile]
            # Products in the input dtype (bf16 stays on tensor cores, as the non-private
            # step's weight-gradient GEMMs do); the reduction accumulates in fp32.
            products = (a_s @ a_t.mT) * (g_s @ g_t.mT)  # no fp32 copies of the tiles
            tile_sum = products.sum((1, 2), dtype=total.dtype)
            total += tile_sum if t == s else 2 * tile_sum  # symmetric off-diagonal pair
    return total


def direct_squared_norms(
    A: Tensor, G: Tensor, block_numel: int, fused: bool | None = None
) -> Tensor:
    """||G_b^T A_b||^2 formed in blocks of m output rows, each block <= block_numel elements.

    bf16/fp16 on CUDA (unless fused=False): flash.kernels.direct_squared_norms forms each tile
    of G_b^T A_b on chip and square-sums it there (no block reaches HBM). fp32 keeps this path,
    as the Gram route does (cuBLAS' IEEE fp32 GEMMs)."""
    (B, T, d), p = A.shape, G.shape[-1]
    rows = max(1, min(p, block_numel // (B * max(d, T))))
    A, G = gemm_operands(A, G)
    if fused is not False and fused_norms_available(A):
        return triton_kernels().direct_squared_norms(A, G).to(accumulation_dtype(A))
    total = to_accumulation(A.new_zeros(B))
    for j in range(0, p, rows):
        block = G[:, :, j : j + rows].mT @ A
        total += (block * block).sum((1, 2), dtype=total.dtype)
    return total


def fused_norms_available(A: Tensor) -> bool:
    """Do the Gram and direct routes of a layer with saved input A run on flash.kernels
    (16-bit on CUDA)?"""
    return A.is_cuda and A.element_size() == 2 and triton_kernels() is not None


# The Linear's clipped weight gradient on CUDA in 16 bits: False, one cuBLAS GEMM over all
# tokens with fp32 c folded into a 16-bit operand rounded toward zero (2.8e-3 relative from
# fp64 on average, the truncation's bias); True, flash.kernels.clipped_weight_grad (each sample's
# product in fp32, weighted by fp32 c: 1e-6 from fp64), 1.4-2.1x the GEMM's time at the 1b
# shapes on an H200 (Triton at 300-600 TFLOP/s against cuBLAS' 570-680), so not the default.
EXACT_CLIPPED_GEMM = False
# Folded operands made by one launch of flash.kernels.fold_clip_factors_many, held until their
# layers' GEMMs ran (the 1b model at (8, 512): 16 MB each, 16 per launch instead of one each).
FOLD_GROUP_BYTES = 256 * 2**20


def fused_clipped_gemm_available(A: Tensor, G: Tensor, weight: Tensor) -> bool:
    """Does a Linear's clipped weight gradient take fp32 clip factors through flash.kernels
    (16-bit A and G on CUDA, an fp32 weight; EXACT_CLIPPED_GEMM says which way)? The CPU and
    fp32 keep the torch path."""
    kernels = triton_kernels()
    return (
        A.element_size() == 2
        and weight.dtype == torch.float32
        and kernels is not None
        and kernels.clipped_weight_grad_supported(A, G)
    )


def linear_route(layer: Layer, T: int) -> str:
    """auto: "product" where per-sample weight gradients take no more memory than the layer's A
    and G (and no extra FLOPs: they replace the clipped-gradient GEMM), else "gram": below that
    T, T(d+p) < dp, so Gram's T^2(d+p)(1 + 1/n) FLOPs are always fewer than direct's 2Tdp.
    "direct" (least memory: no T x T, no B x d x p) is there to be forced."""
    if layer.route != "auto":
        return layer.route
    d, p = layer.module.in_features, layer.module.out_features
    return "product" if d * p <= T * (d + p) else "gram"


@register_norm_rule(nn.Linear)
class LinearRule(NormRule):
    feeds_saved_input = True  # the cast below is autocast's own for F.linear

    def saved_input(self, module, x):
        # Under autocast the layer multiplies x cast to the autocast dtype (a LayerNorm's fp32
        # output becomes bf16): keep that, half the bytes of x and no cast per use later.
        # Autocast casts floating-point tensors other than fp64, as here.
        device = device_type(x)
        if x.is_floating_point() and x.dtype != torch.float64 and torch.is_autocast_enabled(device):
            return x.to(torch.get_autocast_dtype(device))
        return x

    def describe(self, layer, A, G):
        d, p = layer.module.in_features, layer.module.out_features
        return {"d": d, "p": p, "route": linear_route(layer, A.shape[1])}

    def kept_per_sample(self, layer, A, G):
        # The product route forms both at once. The others keep A and G for the weight, and the
        # bias's per-sample gradient ([B, p], smaller than G) comes right after the backward from
        # the kept G (formed_after_backward); without a trainable weight nothing else needs A
        # and G, so the bias is formed here and they are dropped at once.
        if linear_route(layer, A.shape[1]) == "product" or "weight" not in layer.params:
            return {"weight", "bias"} & layer.params.keys()
        return set()

    def formed_after_backward(self, layer, A, G):
        return {"bias"} & layer.params.keys()

    def per_sample_grads_many(self, calls):
        """The biases' per-sample gradients (G summed over tokens) of every call that asks for
        them alone, one launch per (B, T, dtype) on CUDA (flash.kernels.token_sums_many: the 1b
        model has 120 biases, each reduction's host time more than its GPU time); the rest one
        by one."""
        grads: list = [None] * len(calls)
        groups: dict[tuple, list[int]] = {}
        kernels = triton_kernels()
        for i, (layer, A, G, names) in enumerate(calls):
            if names == {"bias"} and kernels is not None and kernels.token_sums_supported(G):
                groups.setdefault((G.shape[:2], G.dtype, G.device), []).append(i)
            else:
                grads[i] = self.per_sample_grads(layer, A, G, names)
        for members in groups.values():
            sums = kernels.token_sums_many([calls[i].G for i in members])
            for i, bias in zip(members, sums, strict=True):
                grads[i] = {"bias": bias}
        return grads

    def per_sample_grads(self, layer, A, G, names):
        grads = {}
        if "weight" in names:
            A_op, G_op = gemm_operands(A, G)
            # [B, p, d], one batched GEMM accumulating in fp32; in the operands' dtype (bf16 under
            # autocast, as the non-private weight gradient), rounded once. torch.bmm, not @: the
            # engine flattened A and G to [B, T, features], and matmul's broadcasting dispatch
            # costs host time per call (LoRA: hundreds of layers per chunk, a host-bound step).
            grads["weight"] = torch.bmm(G_op.mT, A_op)
        if "bias" in names:
            grads["bias"] = G.sum(1, dtype=accumulation_dtype(G))
        return grads

    def squared_norms(self, layer, A, G):
        # the weight alone: the bias is formed per sample (in the hook or right after backward)
        if linear_route(layer, A.shape[1]) == "gram":
            return gram_squared_norms(A, G, layer.tile_size)
        return direct_squared_norms(A, G, layer.block_numel)

    def squared_norms_many(self, calls):
        """Gram-route layers with 16-bit inputs on CUDA: one fused launch per (B, T, dtype) for
        all of them (flash.kernels.gram_squared_norms_grouped); the rest one by one."""
        terms, groups = [], {}
        for layer, A, G in calls:
            A_op, G_op = gemm_operands(A, G)
            if fused_norms_available(A_op) and linear_route(layer, A.shape[1]) == "gram":
                groups.setdefault((A_op.shape[:2], A_op.dtype), []).append((A_op, G_op))
            else:
                terms.append(self.squared_norms(layer, A, G))
        terms += [triton_kernels().gram_squared_norms_grouped(pairs) for pairs in groups.values()]
        return terms

    def clipped_grads(self, layer, A, G, c):
        return self._clipped_grads(c, LayerCall(layer, A, G), folded=None)

    def clipped_grads_many(self, calls, c):
        """clipped_grads of each call in order; where the fp32 clip factors are folded into a
        16-bit operand by flash.kernels (CUDA), the operands of the next calls, up to
        FOLD_GROUP_BYTES of them, are folded by one launch."""
        ready = deque()  # (LayerCall, its folded operand or None), the next calls
        while calls or ready:
            if not ready:
                ready.extend(self._fold_next(calls, c))
            # no local holds a call's tensors or gradients while suspended
            yield self._clipped_grads(c, *ready.popleft())

    def _fold_next(self, calls, c) -> list[tuple[LayerCall, Tensor | None]]:
        """The next calls off ``calls``, each with its operand folded by one shared launch (None
        where its clipped GEMM takes another path): up to FOLD_GROUP_BYTES of folded operands,
        at least one call."""
        group, narrows, held = [], [], 0
        folds = []  # the narrow operands to fold, in order
        while calls and (held < FOLD_GROUP_BYTES or not folds):
            layer, A, G = calls[0]
            A_op, G_op = gemm_operands(A, G)
            narrow = None
            if not EXACT_CLIPPED_GEMM and fused_clipped_gemm_available(
                A_op, G_op, layer.params["weight"]
            ):
                narrow = (G_op if _folds_into_G(A_op, G_op) else A_op).flatten(0, 1)
                if folds and (narrow.dtype, narrow.device) != (folds[0].dtype, folds[0].device):
                    break  # one dtype and device per launch
                folds.append(narrow)
                held += narrow.numel() * narrow.element_size()
            group.append(calls.popleft())
            narrows.append(narrow)
        if not folds:
            return list(zip(group, narrows))
        tokens = [call.A.shape[1] for call, n in zip(group, narrows) if n is not None]
        folded = iter(triton_kernels().fold_clip_factors_many(folds, c.c, tokens))
        return [(call, None if n is None else next(folded)) for call, n in zip(group, narrows)]

    def _clipped_grads(self, c, call: LayerCall, folded):
        """The weight's clipped sum; ``folded``: the narrower of A and G, flattened to [B*T, n],
        with c already folded in by flash.kernels, or None."""
        layer, A, G = call
        A_op, G_op = gemm_operands(A, G)  # the dtype autocast's own weight GEMM uses
        weight = layer.params["weight"]
        fold_into_G = _folds_into_G(A_op, G_op)
        # [B*T, d] and [B*T, p]; the folded operand replaces one of them (no view op for it)
        wide = (A_op if fold_into_G else G_op).flatten(0, 1)
        if folded is None:
            narrow = (G_op if fold_into_G else A_op).flatten(0, 1)
            T = A_op.shape[1]
            if not fused_clipped_gemm_available(A_op, G_op, weight):
                # c rounded to the operands' dtype (shrunk by an ulp in 16 bits: ClipFactors.to)
                folded = narrow * c.per_token(narrow.dtype, T)
            elif EXACT_CLIPPED_GEMM:
                kernels, schedule = triton_kernels(), c.gemm_schedule()
                return {"weight": kernels.clipped_weight_grad(A_op, G_op, c.c, schedule=schedule)}
            else:  # fp32 c, each c * x rounded toward zero: none above its exact value
                folded = triton_kernels().fold_clip_factors(narrow, c.c, T)
        G2, A2 = (folded, wide) if fold_into_G else (wide, folded)
        # One GEMM over all B*T tokens. bf16/fp16 operands on CUDA: fp32 straight out of the
        # GEMM's fp32 accumulator (cuBLAS has it, the CPU backend not), so the fp32 parameter's
        # gradient is neither rounded to bf16 nor cast in a second pass.
        if A2.is_cuda and A2.element_size() == 2 and weight.dtype == torch.float32:
            return {"weight": torch.mm(G2.T, A2, out_dtype=torch.float32)}
        return {"weight": G2.T @ A2}


def _folds_into_G(A: Tensor, G: Tensor) -> bool:
    """Are the clip factors folded into G [B, T, p] rather than A [B, T, d]? Into the narrower
    (fewer elements to scale), G where d == p."""
    return G.shape[-1] <= A.shape[-1]
