"""nn.Linear: per-sample norms by the Gram, direct or product route, clipped sums by one GEMM."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dp_cost.core.repeated import range_name
from dp_cost.flash import fused
from dp_cost.flash.clip import stacked
from dp_cost.flash.fused import triton_kernels
from dp_cost.flash.layer import GradRequest, Layer, LayerCall
from dp_cost.flash.precision import accumulation_dtype, gemm_operands, to_accumulation, wider
from dp_cost.flash.rules.base import NormRule, register_norm_rule

if TYPE_CHECKING:
    from dp_cost.flash.clip import ClipFactors


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
    starts = range(0, A.shape[1], tile)
    if is_fake(A):  # a planned step: one off-diagonal pair's ops stand for every pair's
        return _planned_gram(A, G, tile, total, len(starts))
    for s in starts:
        a_s, g_s = A[:, s : s + tile], G[:, s : s + tile]
        for t in range(0, s + 1, tile):
            a_t, g_t = A[:, t : t + tile], G[:, t : t + tile]
            # Products in the input dtype (bf16 stays on tensor cores, as the non-private
            # step's weight-gradient GEMMs do); the reduction accumulates in fp32.
            products = (a_s @ a_t.mT) * (g_s @ g_t.mT)  # no fp32 copies of the tiles
            tile_sum = products.sum((1, 2), dtype=total.dtype)
            total += tile_sum if t == s else 2 * tile_sum  # symmetric off-diagonal pair
    return total


def _planned_gram(A: Tensor, G: Tensor, tile: int, total: Tensor, tiles: int) -> Tensor:
    """``gram_squared_norms``'s loop on a planned step's fake tensors: one diagonal pair standing
    for the ``tiles`` diagonal ones, then one off-diagonal pair for the rest (``core.repeated``),
    as the loop holds them (a pair's products until the next pair's are made). Whole tiles: the
    loop's GEMMs and peak where ``tile`` divides T, an upper bound where it does not."""
    a, g = A[:, :tile], G[:, :tile]
    for count, factor in ((tiles, 1), (tiles * (tiles - 1) // 2, 2)):
        if count:
            with torch.profiler.record_function(range_name(count)):
                products = (a @ a.mT) * (g @ g.mT)
                tile_sum = products.sum((1, 2), dtype=total.dtype)
                total += tile_sum if factor == 1 else factor * tile_sum
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
_FP32 = torch.float32
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
    # Under autocast the layer multiplies x cast to the autocast dtype (a LayerNorm's fp32
    # output becomes bf16): keep that, half the bytes of x and no cast per use later.
    casts_input = True

    def compute_for(self, module):
        if {"weight", "bias"} <= module._parameters.keys():  # not a parametrization's property
            return _linear
        return super().compute_for(module)

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
        """Per-sample gradients of every call, in order: the product route's weights (one
        batched GEMM each, accumulating in fp32, in the operands' dtype: bf16 under autocast, as
        the non-private weight gradient) and biases (G summed over tokens). Biases go one launch
        per (B, T, dtype) on CUDA, the product route's with the others' (flash.kernels.
        token_sums_many: the 1b model has 120 biases, each reduction's host time more than its
        GPU time). The loop calls builtins only: a Python call per layer is host time (LoRA:
        hundreds of layers per chunk)."""
        grads: list = []
        groups: dict[tuple, list[int]] = {}
        kernels = triton_kernels()
        summable = kernels.token_sums_supported_many([G for _, _, G, _ in calls]) if kernels else ()
        for i, (_, A, G, names) in enumerate(calls):
            formed = {}
            if "weight" in names:
                A_op, G_op = (A, G) if A.dtype == G.dtype else gemm_operands(A, G)
                # torch.bmm, not @: A and G are [B, T, features], and matmul's broadcasting
                # dispatch costs host time per call
                formed["weight"] = torch.bmm(G_op.mT, A_op)
            if "bias" in names and summable and summable[i]:  # summed below, with its group
                groups.setdefault((G.shape[0], G.shape[1], G.dtype, G.get_device()), []).append(i)
            elif "bias" in names:
                formed["bias"] = G.sum(1, dtype=wider(G.dtype, torch.float32))
            grads.append(formed)
        for members in groups.values():
            sums = kernels.token_sums_many([calls[i][2] for i in members])
            for i, bias in zip(members, sums, strict=True):
                grads[i]["bias"] = bias
        return grads

    def per_sample_grads(self, layer, A, G, names):
        return self.per_sample_grads_many([GradRequest(layer, A, G, names)])[0]

    def squared_norms(self, layer, A, G):
        # the weight alone: the bias is formed per sample right after the backward
        if linear_route(layer, A.shape[1]) == "gram":
            return gram_squared_norms(A, G, layer.tile_size)
        return direct_squared_norms(A, G, layer.block_numel)

    def squared_norms_many(self, calls):
        """Gram-route layers with 16-bit inputs on CUDA: one fused launch per (B, T, dtype) for
        all of them (flash.kernels.gram_squared_norms_grouped); on the torch path a Gram route
        of one tile is formed here (builtins only: no Python call per layer); the rest one by
        one."""
        return self._squared_norms(calls, each=False)

    def squared_norms_each(self, calls):
        """squared_norms_many's work with a row per call, in order, [len(calls), B]
        (per-layer clipping)."""
        return self._squared_norms(calls, each=True)

    def _squared_norms(self, calls, each: bool):
        """The terms of squared_norms_many (``each``: squared_norms_each's rows)."""
        terms, groups, grouped = [], {}, {}  # grouped: the calls of each group, by index
        kernels = triton_kernels()
        for i, (layer, A, G) in enumerate(calls):
            A_op, G_op = (A, G) if A.dtype == G.dtype else gemm_operands(A, G)
            T, route = A.shape[1], layer.route
            if route == "auto":  # linear_route, inline
                d, p = A.shape[2], G.shape[2]
                route = "product" if d * p <= T * (d + p) else "gram"
            if route != "gram":
                terms.append(self.squared_norms(layer, A, G))
            elif kernels is not None and A_op.is_cuda and A_op.element_size() == 2:
                key = (A_op.shape[0], T, A_op.dtype)
                groups.setdefault(key, []).append((A_op, G_op))
                grouped.setdefault(key, []).append(i)
                terms.append(None)  # the group's launch fills it in (each) or adds it (flat)
            elif T <= layer.tile_size:  # gram_squared_norms of one tile
                products = torch.bmm(A_op, A_op.mT) * torch.bmm(G_op, G_op.mT)
                terms.append(products.sum((1, 2), dtype=wider(A_op.dtype, _FP32)))
            else:
                terms.append(gram_squared_norms(A, G, layer.tile_size))
        if not each:
            terms = [term for term in terms if term is not None]
            return terms + [kernels.gram_squared_norms_grouped(p) for p in groups.values()]
        if len(groups) == 1 and len(next(iter(groups.values()))) == len(calls):
            # every call in one launch, in order (the 1b model's at one B, T): its rows as they are
            return kernels.gram_squared_norms_grouped(next(iter(groups.values())), per_layer=True)
        for key, pairs in groups.items():
            norms = kernels.gram_squared_norms_grouped(pairs, per_layer=True).unbind(0)
            for i, norm in zip(grouped[key], norms, strict=True):
                terms[i] = norm
        return stacked(terms)

    def clipped_grads(self, layer, A, G, c):
        return self._clipped_grads(c, LayerCall(layer, A, G), folded=None)

    def clipped_grads_many(self, calls, c, rows=None):
        """clipped_grads of each call in order; where the fp32 clip factors are folded into a
        16-bit operand by flash.kernels (CUDA), the operands of the next calls, up to
        FOLD_GROUP_BYTES of them, are folded by one launch."""
        ready = deque()  # (LayerCall, its folded operand or None), the next calls
        while calls or ready:
            if not ready:
                ready.extend(self._fold_next(calls, c, rows))
            factors = c if rows is None else c.row(rows[id(ready[0][0].layer)])
            # no local holds a call's tensors or gradients while suspended
            yield self._clipped_grads(factors, *ready.popleft())

    def accumulate_clipped_grads(
        self, calls: deque[LayerCall], c: ClipFactors, rows: dict[int, int] | None = None
    ) -> None:
        """weight.grad += the clipped sum of every call (no sink), in order, each call's A and G
        dropped once its GEMM ran; ``rows``: per-layer clipping (NormRule's). Builtins only per
        call on the torch path and where a shared fold served the call (a Python call per layer
        is host time); a call a kernel serves alone (EXACT_CLIPPED_GEMM) goes through
        _clipped_grads."""
        per_token = c.cached_per_token
        while calls:
            ready = deque(self._fold_next(calls, c, rows))
            while ready:
                (layer, A, G), folded = ready.popleft()
                weight = layer.params["weight"]
                if folded is None and (A.is_cuda or fused.KERNELS_ON_CPU):
                    factors = c if rows is None else c.row(rows[id(layer)])
                    grad = self._clipped_grads(factors, LayerCall(layer, A, G), None)["weight"]
                else:  # _clipped_grads' torch path, inline
                    A_op, G_op = (A, G) if A.dtype == G.dtype else gemm_operands(A, G)
                    into_G = G_op.shape[-1] <= A_op.shape[-1]  # _folds_into_G
                    wide = (A_op if into_G else G_op).flatten(0, 1)
                    if folded is None:
                        narrow = (G_op if into_G else A_op).flatten(0, 1)
                        scale = per_token.get((narrow.dtype, A_op.shape[1]))
                        if scale is None:
                            scale = c.per_token(narrow.dtype, A_op.shape[1])
                        if rows is not None:  # [P, B*T, 1]: this layer's row
                            scale = scale[rows[id(layer)]]
                        folded = narrow * scale
                    G2, A2 = (folded, wide) if into_G else (wide, folded)
                    if A2.is_cuda and A2.element_size() == 2 and weight.dtype == _FP32:
                        grad = torch.mm(G2.T, A2, out_dtype=_FP32)
                    else:
                        grad = G2.T @ A2
                    del A_op, G_op, wide, folded, G2, A2
                del A, G
                if grad.dtype != weight.dtype:
                    grad = grad.to(weight.dtype)
                if weight.grad is None:  # accumulate_into_grad, inline
                    weight.grad = grad
                else:
                    weight.grad.add_(grad)
                del grad

    def _fold_next(self, calls, c, rows=None) -> list[tuple[LayerCall, Tensor | None]]:
        """The next calls off ``calls``, each with its operand folded by one shared launch (None
        where its clipped GEMM takes another path): up to FOLD_GROUP_BYTES of folded operands,
        at least one call."""
        kernels = triton_kernels()
        # the kernels' check asked once for every call left (not once per layer), and only
        # where it can pass; a call whose A and G differ in dtype is cast, and asked, alone
        foldable = (
            kernels.clipped_weight_grad_supported_each([(A, G) for _, A, G in calls])
            if kernels is not None and not EXACT_CLIPPED_GEMM
            else ()
        )
        group, narrows, held = [], [], 0
        # the narrow operands to fold, in order; whether in place; their rows of c (per layer)
        folds, in_place, fold_rows = [], [], []
        i = 0
        while calls and (held < FOLD_GROUP_BYTES or not folds):
            layer, A, G = calls[0]
            if A.dtype == G.dtype:
                (A_op, G_op), supported = (A, G), foldable and foldable[i]
            else:
                A_op, G_op = gemm_operands(A, G)
                supported = foldable and kernels.clipped_weight_grad_supported(A_op, G_op)
            narrow = None
            if (
                supported
                and (A_op.is_cuda or fused.KERNELS_ON_CPU)
                and A_op.element_size() == 2
                and layer.params["weight"].dtype == _FP32
            ):  # fused_clipped_gemm_available, inline
                into_G = G_op.shape[-1] <= A_op.shape[-1]
                narrow = (G_op if into_G else A_op).flatten(0, 1)
                if folds and (narrow.dtype, narrow.device) != (folds[0].dtype, folds[0].device):
                    break  # one dtype and device per launch
                folds.append(narrow)
                # G is this call's alone (flash.capture makes each call's G its own storage)
                # and needed by nothing after its GEMM: folded in place, no memory held. A may
                # be shared (q, k and v read one): folded into a copy.
                in_place.append(into_G)
                if rows is not None:
                    fold_rows.append(rows[id(layer)])
                if not into_G:
                    held += narrow.numel() * narrow.element_size()
            group.append(calls.popleft())
            narrows.append(narrow)
            i += 1
        del A_op, G_op, A, G
        if not folds:
            return list(zip(group, narrows))
        tokens = [call.A.shape[1] for call, n in zip(group, narrows) if n is not None]
        folded = iter(
            kernels.fold_clip_factors_many(
                folds, c.c, tokens, in_place, None if rows is None else fold_rows
            )
        )
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


def _linear(module: nn.Linear, x: Tensor) -> Tensor:
    """nn.Linear's forward with its parameters read from _parameters (Module.__getattr__ is a
    Python call per parameter)."""
    parameters = module._parameters
    return F.linear(x, parameters["weight"], parameters["bias"])


def _folds_into_G(A: Tensor, G: Tensor) -> bool:
    """Are the clip factors folded into G [B, T, p] rather than A [B, T, d]? Into the narrower
    (fewer elements to scale), G where d == p."""
    return G.shape[-1] <= A.shape[-1]
