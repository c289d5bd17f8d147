"""Exact per-sample gradient norms and clipped gradients from ONE backward pass.

"Book-keeping" DP-SGD (Bu et al. 2023): forward hooks keep each managed layer's input A,
tensor hooks keep its output gradient G, and autograd never forms a weight gradient
(managed parameters are set to requires_grad=False while wrapped). Per-sample norms and
the clipped sum sum_b c_b * grad_b are then computed from (A, G) by per-layer-type rules.

Under autocast a Linear's A is kept in the autocast dtype (what the layer multiplied). The bias
and norm layers' per-sample gradients ([B, p], [B, d]) are always formed in the backward hook.
Where a layer's per-sample gradients are no larger than its own A and G (Linear with
d*p <= T*(d+p), i.e. long sequences; LayerNorm/RMSNorm always), the output-gradient hook forms
them at once (one batched GEMM, the FLOPs of the weight gradient it replaces) and drops A and G:
the clipped gradient is then a weighted sum of them, with no second GEMM. The comparison counts
each layer's A whole; layers that read one input (q, k and v) share it, so at the threshold
such a group holds up to ~1.5x what the Gram route would (measured peaks stay <= 1.01x standard's
at the benchmark shapes: the peak is in forward, before any of this is held).

Usage, per physical chunk::

    flash = FlashClipping(model)
    loss = per_sample_losses(model(x), y).sum()  # SUM over samples
    flash.backward(loss)
    norms = flash.per_sample_squared_norms().sqrt()
    flash.accumulate_clipped_grads((C / (norms + 1e-6)).clamp(max=1.0))
    flash.release()

Assumptions: dimension 0 of every managed layer's input/output is the batch; one forward
per backward; gradients reach managed layers only through their outputs (model inputs
that require grad are not supported); no activation checkpointing.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DEFAULT_BLOCK_NUMEL = 64 * 2**20  # largest intermediate of the direct route, in elements
# Kept per-sample gradients with at most this many elements per sample (biases, norm layers)
# are normed and clip-summed together, one concatenation per dtype: a few launches per step
# instead of a few per parameter (flash is launch-bound at short sequences).
SMALL_PER_SAMPLE_NUMEL = 2**16


class UnsupportedLayerError(ValueError):
    """A layer owns trainable parameters but no norm rule is registered for its type."""


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _acc(x: Tensor) -> Tensor:
    """Cast to the accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _round_down(c: Tensor, dtype: torch.dtype) -> Tensor:
    """Clip factors in ``dtype``, rounded toward zero: a factor rounded up (bf16 keeps 8 bits)
    would let a sample's clipped gradient exceed C, the bound DP's noise is calibrated to."""
    low = c.to(dtype)
    if dtype == c.dtype:
        return low
    return torch.where(low.to(c.dtype) > c, torch.nextafter(low, torch.zeros_like(low)), low)


def _gemm_operands(A: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """A and G in one dtype for the norm GEMMs: under autocast a Linear's input can be fp32
    (a LayerNorm output) while its output gradient is bf16; the layer itself multiplied in
    the narrower dtype, and so do we (tensor cores), accumulating the squares in fp32."""
    if A.dtype == G.dtype:
        return A, G
    dtype = min((A.dtype, G.dtype), key=lambda t: torch.finfo(t).bits)
    return A.to(dtype), G.to(dtype)


@dataclass
class Layer:
    """A managed module and what its rule needs; A/G are [B, T, features] (ids: [B, T])."""

    name: str
    module: nn.Module
    rule: NormRule
    params: dict[str, nn.Parameter]  # managed (trainable) parameters, by attribute name
    route: str = "auto"
    tile_size: int = 512
    block_numel: int = DEFAULT_BLOCK_NUMEL
    # One [A, G, names] per forward call: the names of the parameters still to be done from A and
    # G (the others were formed per sample in the backward hook).
    calls: list[list] = field(default_factory=list)
    # Per-sample gradients [B, ...] by parameter name, formed in the backward hook instead of
    # keeping A and G for them (summed over calls: a reused module's gradient is the sum).
    per_sample: dict[str, Tensor] = field(default_factory=dict)
    described: list[dict] = field(default_factory=list)  # the route of each call, for routes()


class ClipFactors:
    """One chunk's clip factors c [B], with the casts the layers need made once per chunk (not
    once per layer: flash is launch-bound at short sequences)."""

    def __init__(self, c: Tensor):
        self.c = c
        self._cast: dict[torch.dtype, Tensor] = {}
        self._per_token: dict[tuple, Tensor] = {}

    def to(self, dtype: torch.dtype) -> Tensor:
        """c in ``dtype``, rounded toward zero (see _round_down). In 16-bit dtypes also shrunk by
        one ulp at 1 (2u; bf16: 2^-7): the operand the clipped GEMM reads is c * g rounded to
        nearest, up to u larger than c * g in each element, so a sample's clipped contribution
        could exceed C by that much (0.4% measured with g and c at a rounding tie). Costs 0.8%
        of a GEMM-route Linear's clipped gradient in bf16; fp32 stays exact (and so do the
        large kept per-sample gradients' sums on CUDA: accumulate_weighted_sums takes fp32 c)."""
        if dtype not in self._cast:
            c = self.c
            if torch.finfo(dtype).bits == 16:
                c = c * (1 - torch.finfo(dtype).eps)
            self._cast[dtype] = _round_down(c, dtype)
        return self._cast[dtype]

    def per_token(self, dtype: torch.dtype, tokens: int) -> Tensor:
        """c repeated for each of a sample's ``tokens`` rows of a flattened [B*T, n], [B*T, 1]."""
        key = (dtype, tokens)
        if key not in self._per_token:
            self._per_token[key] = self.to(dtype).repeat_interleave(tokens)[:, None]
        return self._per_token[key]


class NormRule:
    """Per-layer-type rule. Subclass it and register with @register_norm_rule(Type).

    Each call of a managed layer gives A (its input) and G (its output gradient). In the
    backward hook, ``kept_per_sample`` names the parameters whose per-sample gradients are formed
    at once (where they are small); the rest are done after backward from A and G by
    ``squared_norms`` and ``clipped_grads``, which handle exactly those parameters.
    """

    def feature_dims(self, module: nn.Module) -> tuple[int, int]:
        """Trailing feature dims of (input, output); the rest is flattened into [B, T]."""
        return 1, 1

    def saved_input(self, module: nn.Module, x: Tensor) -> Tensor:
        """What to keep as A, from the (detached) input the forward hook sees."""
        return x

    def describe(self, layer: Layer, A: Tensor, G: Tensor) -> dict:
        return {"route": type(self).__name__}

    def kept_per_sample(self, layer: Layer, A: Tensor, G: Tensor) -> set[str]:
        """Parameters (of layer.params) whose per-sample gradients this call forms at once."""
        return set()

    def per_sample_grads(
        self, layer: Layer, A: Tensor, G: Tensor, names: set[str]
    ) -> dict[str, Tensor]:
        """Per-sample gradients [B, *param.shape] of the named parameters."""
        raise NotImplementedError

    def squared_norms(self, layer: Layer, A: Tensor, G: Tensor) -> Tensor:
        """Per-sample squared gradient norm [B] over the parameters not kept per sample."""
        raise NotImplementedError

    def squared_norms_many(self, calls: list[tuple[Layer, Tensor, Tensor]]) -> list[Tensor]:
        """squared_norms of every call of this rule's layers in a step, as terms to be summed
        (a rule may compute several layers at once)."""
        return [self.squared_norms(layer, A, G) for layer, A, G in calls]

    def clipped_grads(self, layer: Layer, A: Tensor, G: Tensor, c: ClipFactors) -> dict:
        """sum_b c_b * grad_b for each parameter not kept per sample, by name."""
        raise NotImplementedError


NORM_RULES: dict[type, NormRule] = {}


def register_norm_rule(*layer_types: type):
    """Class decorator: register an instance of the rule for exactly these module types."""

    def register(rule_cls: type[NormRule]) -> type[NormRule]:
        for layer_type in layer_types:
            NORM_RULES[layer_type] = rule_cls()
        return rule_cls

    return register


# ---------------------------------------------------------------- Linear


@functools.cache  # a failed import is not cached by Python: try it once, not per layer
def triton_kernels():
    """flash_kernels (fused Triton kernels, for CUDA tensors) where Triton imports, else None."""
    try:
        import flash_kernels
    except ImportError:  # no triton: the torch path
        return None
    return flash_kernels


def gram_squared_norms(A: Tensor, G: Tensor, tile: int, fused: bool | None = None) -> Tensor:
    """||G_b^T A_b||^2 = sum_{s,t} (a_s.a_t)(g_s.g_t), over tile pairs t <= s (no B x T x T).

    bf16/fp16 on CUDA (unless fused=False): one fused Triton kernel does it all on chip
    (flash_kernels.gram_squared_norms; on an H100 at the 1b shapes, T 512 and 1024, from 1.6x
    faster to 3% slower than this torch path per layer, and a step runs all layers in one launch:
    LinearRule.squared_norms_many). fp32 keeps the torch path: there cuBLAS' IEEE fp32 GEMMs beat
    the kernel's IEEE dots (1.2-1.4x, same card). See BENCHMARKS.md.
    """
    A, G = _gemm_operands(A, G)
    if fused is not False and fused_norms_available(A):
        return triton_kernels().gram_squared_norms(A, G).to(_acc_dtype(A))
    total = _acc(A.new_zeros(A.shape[0]))
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

    bf16/fp16 on CUDA (unless fused=False): flash_kernels.direct_squared_norms forms each tile
    of G_b^T A_b on chip and square-sums it there (no block reaches HBM). fp32 keeps this path,
    as the Gram route does (cuBLAS' IEEE fp32 GEMMs)."""
    (B, T, d), p = A.shape, G.shape[-1]
    rows = max(1, min(p, block_numel // (B * max(d, T))))
    A, G = _gemm_operands(A, G)
    if fused is not False and fused_norms_available(A):
        return triton_kernels().direct_squared_norms(A, G).to(_acc_dtype(A))
    total = _acc(A.new_zeros(B))
    for j in range(0, p, rows):
        block = G[:, :, j : j + rows].mT @ A
        total += (block * block).sum((1, 2), dtype=total.dtype)
    return total


def fused_norms_available(A: Tensor) -> bool:
    """Do the Gram and direct routes of a layer with saved input A run on flash_kernels
    (16-bit on CUDA)?"""
    return A.is_cuda and A.element_size() == 2 and triton_kernels() is not None


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
    def saved_input(self, module, x):
        # Under autocast the layer multiplied x cast to the autocast dtype (a LayerNorm's fp32
        # output becomes bf16): keep that, half the bytes of x and no cast per use later.
        device = x.device.type
        if x.is_floating_point() and torch.is_autocast_enabled(device):
            return x.to(torch.get_autocast_dtype(device))
        return x

    def describe(self, layer, A, G):
        d, p = layer.module.in_features, layer.module.out_features
        return {"d": d, "p": p, "route": linear_route(layer, A.shape[1])}

    def kept_per_sample(self, layer, A, G):
        # The bias's per-sample gradient is [B, p], smaller than G: always formed at once.
        kept = {"bias"} if linear_route(layer, A.shape[1]) != "product" else {"weight", "bias"}
        return kept & layer.params.keys()

    def per_sample_grads(self, layer, A, G, names):
        grads = {}
        if "weight" in names:
            A_op, G_op = _gemm_operands(A, G)
            # [B, p, d], one batched GEMM accumulating in fp32; in the operands' dtype (bf16 under
            # autocast, as the non-private weight gradient), rounded once.
            grads["weight"] = G_op.mT @ A_op
        if "bias" in names:
            grads["bias"] = G.sum(1, dtype=_acc_dtype(G))
        return grads

    def squared_norms(self, layer, A, G):  # the weight: the bias is always kept per sample
        if linear_route(layer, A.shape[1]) == "gram":
            return gram_squared_norms(A, G, layer.tile_size)
        return direct_squared_norms(A, G, layer.block_numel)

    def squared_norms_many(self, calls):
        """Gram-route layers with 16-bit inputs on CUDA: one fused launch per (B, T, dtype) for
        all of them (flash_kernels.gram_squared_norms_grouped); the rest one by one."""
        terms, groups = [], {}
        for layer, A, G in calls:
            A_op, G_op = _gemm_operands(A, G)
            if fused_norms_available(A_op) and linear_route(layer, A.shape[1]) == "gram":
                groups.setdefault((A_op.shape[:2], A_op.dtype), []).append((A_op, G_op))
            else:
                terms.append(self.squared_norms(layer, A, G))
        terms += [triton_kernels().gram_squared_norms_grouped(pairs) for pairs in groups.values()]
        return terms

    def clipped_grads(self, layer, A, G, c):
        A_op, G_op = _gemm_operands(A, G)  # the dtype autocast's own weight GEMM uses
        A2, G2 = A_op.flatten(0, 1), G_op.flatten(0, 1)  # [B*T, d], [B*T, p]
        c_tok = c.per_token(A2.dtype, A.shape[1])
        if G2.shape[1] <= A2.shape[1]:  # fold c into the narrower operand
            G2 = G2 * c_tok
        else:
            A2 = A2 * c_tok
        # One GEMM over all B*T tokens. bf16/fp16 operands on CUDA: fp32 straight out of the
        # GEMM's fp32 accumulator (cuBLAS has it, the CPU backend not), so the fp32 parameter's
        # gradient is neither rounded to bf16 nor cast in a second pass.
        if A2.is_cuda and A2.element_size() == 2 and layer.params["weight"].dtype == torch.float32:
            return {"weight": torch.mm(G2.T, A2, out_dtype=torch.float32)}
        return {"weight": G2.T @ A2}


# ---------------------------------------------------------------- Embedding


@register_norm_rule(nn.Embedding)
class EmbeddingRule(NormRule):
    def feature_dims(self, module):
        return 0, 1  # input: token ids [B, T]; output: [B, T, d]

    def describe(self, layer, A, G):
        return {"route": "embedding"}

    @staticmethod
    def _tokens(layer: Layer, ids: Tensor, G: Tensor):
        """Flat (sample index, token id, g) of every token; padding tokens get g = 0 (torch gives
        the padding row no gradient). Masking by multiplication, not boolean indexing: indexing
        by a mask waits for the GPU to count it (a host sync mid-step)."""
        samples = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        g = G.flatten(0, 1)
        if layer.module.padding_idx is not None:
            g = g * (ids != layer.module.padding_idx).flatten()[:, None].to(g.dtype)
        return samples.flatten(), ids.flatten(), g

    def squared_norms(self, layer, A, G):
        samples, ids, g = self._tokens(layer, A, G)
        g = _acc(g)
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

    def clipped_grads(self, layer, A, G, c):
        samples, ids, g = self._tokens(layer, A, G)
        weight = layer.module.weight
        scaled = (_acc(g) * _acc(c.c)[samples, None]).to(weight.dtype)
        return {"weight": torch.zeros_like(weight).index_add_(0, ids, scaled)}


# ---------------------------------------------------------------- LayerNorm / RMSNorm


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
            # One fused pass over A and G (flash_kernels.norm_layer_per_sample_grads); eps=None
            # means eps of the compute dtype, as in torch.
            eps = m.eps if m.eps is not None else torch.finfo(_acc_dtype(A)).eps
            weight, bias = kernels.norm_layer_per_sample_grads(A, G, eps, rms)
            fused = {"weight": weight, "bias": bias}
            return {name: fused[name] for name in names}
        x, g = _acc(A), _acc(G)
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


# ---------------------------------------------------------------- the wrapper


def _squared_row_norms(x: Tensor) -> Tensor:
    """||x_b||^2 of each row of [B, n], accumulated in fp32 (no fp32 copy of bf16 rows)."""
    return torch.linalg.vector_norm(x, dim=1, dtype=_acc_dtype(x)).square()


def _is_small(per_sample_grad: Tensor) -> bool:
    # numel // B, not grad[0].numel(): indexing is an op (and flash is launch/CPU-bound here)
    return per_sample_grad.numel() <= SMALL_PER_SAMPLE_NUMEL * per_sample_grad.shape[0]


def _accumulate(param: nn.Parameter, grad: Tensor) -> None:
    """param.grad += grad (param.grad = grad when there is none yet)."""
    grad = grad.to(param.dtype).view(param.shape)
    param.grad = grad if param.grad is None else param.grad.add_(grad)


def _accumulate_many(params: list[nn.Parameter], grads: list[Tensor]) -> None:
    """_accumulate for many parameters with multi-tensor kernels; each .grad gets its own
    storage (not a view of ``grads``' buffer), as autograd would give it."""
    grads = [grad.view(param.shape) for param, grad in zip(params, grads, strict=True)]
    fresh = [i for i, param in enumerate(params) if param.grad is None]
    held = [i for i, param in enumerate(params) if param.grad is not None]
    if fresh:
        new = [torch.empty_like(params[i]) for i in fresh]
        torch._foreach_copy_(new, [grads[i] for i in fresh])
        for i, grad in zip(fresh, new, strict=True):
            params[i].grad = grad
    if held:
        torch._foreach_add_([params[i].grad for i in held], [grads[i] for i in held])


def accumulate_weighted_sums(params, grads, c: ClipFactors) -> None:
    """param.grad += sum_b c_b * grad[b] for each per-sample gradient grad [B, ...].

    On CUDA: flash_kernels.weighted_sums_, one launch per dtype pair for all of them, fp32 clip
    factors (no 16-bit rounding of c: each c_b * g_b is formed in fp32) and fp32 accumulation
    straight into .grad. Elsewhere (or for a tensor the kernel cannot take) one [B] x [B, n]
    product per parameter."""
    kernels = triton_kernels()
    fused, targets, sources, accumulate = [], [], [], []
    for param, grad in zip(params, grads, strict=True):
        target = param.grad if param.grad is not None else param
        source = grad.flatten(1)
        if kernels is not None and kernels.weighted_sums_supported(target, source):
            fused.append(param)
            accumulate.append(param.grad is not None)
            targets.append(target if param.grad is not None else torch.empty_like(param))
            sources.append(source)
        else:
            _accumulate(param, c.to(grad.dtype) @ source)
    if fused:
        kernels.weighted_sums_(targets, sources, c.to(torch.float32), accumulate)
        for param, target in zip(fused, targets, strict=True):
            param.grad = target


def _flatten_tokens(x: Tensor, feature_dims: int) -> Tensor:
    """View [B, ..., features] as [B, T, prod(features)] ([B, T] when no feature dims)."""
    if feature_dims == 0:
        return x.reshape(x.shape[0], -1)
    return x.reshape(x.shape[0], -1, math.prod(x.shape[x.dim() - feature_dims :]))


ROUTES = ("auto", "gram", "direct", "product")  # how Linear layers get their per-sample norms


class FlashClipping:
    """Per-sample gradient norms and clipped gradients with one backward pass."""

    def __init__(
        self,
        model: nn.Module,
        route: str = "auto",
        tile_size: int = 512,
        block_numel: int = DEFAULT_BLOCK_NUMEL,
    ):
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}; got {route!r}")
        self.layers: list[Layer] = []
        owner: dict[int, str] = {}
        for name, module in model.named_modules():
            params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
            if not params:
                continue
            for n, p in params.items():
                if id(p) in owner:
                    raise ValueError(f"parameter shared by {owner[id(p)]} and {name}.{n} (tied)")
                owner[id(p)] = f"{name}.{n}"
            rule = NORM_RULES.get(type(module))
            if rule is None:
                raise UnsupportedLayerError(
                    f"no norm rule for layer {name!r} of type {type(module).__qualname__}"
                )
            if getattr(module, "scale_grad_by_freq", False):  # grad depends on the whole batch
                raise UnsupportedLayerError(f"{name!r}: Embedding(scale_grad_by_freq=True)")
            self.layers.append(Layer(name, module, rule, params, route, tile_size, block_numel))
        self.params = [p for p in model.parameters() if id(p) in owner]
        for p in self.params:
            p.requires_grad_(False)  # autograd then computes no weight gradient at all
        self._handles = [
            layer.module.register_forward_hook(self._make_hook(layer), with_kwargs=True)
            for layer in self.layers
        ]
        self._leaves: list[Tensor] = []
        self._last_saved: tuple | None = None  # (rule, weakref to input, its state, saved A)
        self._small: list | None = None  # _small_per_sample's batches of this chunk
        self._norms: Tensor | None = None
        self._routes: list[dict] = []
        self._after_backward = False

    def _saved_input(self, layer: Layer, x: Tensor) -> Tensor:
        """The rule's A for input x; layers reading one input (q, k and v) share one cast, as
        long as x was not modified in place and autocast is in the same state in between."""
        device = x.device.type
        state = (x._version, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        last = self._last_saved
        if last is not None and last[0] is layer.rule and last[1]() is x and last[2] == state:
            return last[3]
        saved = layer.rule.saved_input(layer.module, x.detach())
        self._last_saved = (layer.rule, weakref.ref(x), state, saved)
        return saved

    def _make_hook(self, layer: Layer):
        k_in, k_out = layer.rule.feature_dims(layer.module)

        def forward_hook(module, args, kwargs, output):
            if not torch.is_grad_enabled():
                return None
            if self._after_backward:
                raise RuntimeError("FlashClipping: call release() before the next forward")
            x = args[0] if args else next(iter(kwargs.values()))
            call = [_flatten_tokens(self._saved_input(layer, x), k_in), None, None]
            layer.calls.append(call)
            version = call[0]._version

            def save_grad(grad):
                if not call or call[0] is None:  # a second backward through the same graph
                    raise RuntimeError("FlashClipping: one backward per forward (release() first)")
                if call[0]._version != version:  # autograd would refuse a saved input changed so
                    raise RuntimeError(
                        f"FlashClipping: the input of {layer.name!r} was modified in place "
                        "after its forward; its per-sample gradients need it unchanged"
                    )
                A, G = call[0], _flatten_tokens(grad.detach(), k_out)
                layer.described.append(
                    {"layer": layer.name, "T": A.shape[1], **layer.rule.describe(layer, A, G)}
                )
                kept = layer.rule.kept_per_sample(layer, A, G)
                if kept:
                    self._add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G, kept))
                rest = layer.params.keys() - kept
                if rest:
                    call[1], call[2] = G, rest
                else:
                    call[0] = None  # A and G are not needed any more

            if not output.requires_grad:  # e.g. first layer: make a leaf so G still flows
                output = output.detach().requires_grad_(True)
                self._leaves.append(output)
                output.register_hook(save_grad)
                return output
            output.register_hook(save_grad)
            return None

        return forward_hook

    @staticmethod
    def _add_per_sample(layer: Layer, grads: dict[str, Tensor]) -> None:
        for name, grad in grads.items():
            held = layer.per_sample.get(name)
            if held is None:
                layer.per_sample[name] = grad
            elif held.shape != grad.shape:  # e.g. a call on x and one on x[:1]: no broadcasting
                raise ValueError(
                    f"{layer.name!r} was called with different batch sizes in one forward "
                    f"({held.shape[0]} and {grad.shape[0]}); per-sample gradients need one"
                )
            else:
                held.add_(grad.to(held.dtype))  # in place: no third B x d x p buffer

    def backward(self, loss: Tensor) -> None:
        """One backward of the SUM of per-sample losses; no .grad is written anywhere."""
        if not self._leaves:
            raise RuntimeError("no managed layer was called with grad enabled since release()")
        self._last_saved = None
        torch.autograd.grad(loss, self._leaves, allow_unused=True)
        self._after_backward = True
        for layer in self.layers:
            hooked = layer.calls
            # Calls whose G never came (unused outputs) add nothing; parameters kept per sample
            # already hold theirs.
            calls = [list(c) for c in hooked if c[0] is not None and c[1] is not None]
            pending = set().union(*(rest for _, _, rest in calls))
            if pending & layer.per_sample.keys():  # other calls formed these per sample: join
                for A, G, rest in calls:
                    self._add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G, rest))
                calls = []
                layer.described = [dict(d, route="product") for d in layer.described]
            if len(calls) > 1:  # a reused module's grad sums over calls: concatenate along T
                A, G = (torch.cat(t, 1) for t in zip(*(c[:2] for c in calls), strict=True))
                # The route is decided again on the joined T: report that one.
                layer.described = [
                    {"layer": layer.name, "T": A.shape[1], **layer.rule.describe(layer, A, G)}
                ]
                kept = layer.rule.kept_per_sample(layer, A, G) & pending
                if kept:
                    self._add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G, kept))
                calls = [[A, G, pending - kept]] if pending - kept else []
            layer.calls = calls
            # The hook closures hold the original lists and live as long as the autograd graph
            # (the caller's loss keeps it): empty them so layer.calls is the only reference and
            # dropping it frees A and G.
            for call in hooked:
                call.clear()
        self._routes = [route for layer in self.layers for route in layer.described]

    def _batch_size(self) -> int:
        sizes = {layer.name: call[0].shape[0] for layer in self.layers for call in layer.calls}
        sizes.update(
            {layer.name: g.shape[0] for layer in self.layers for g in layer.per_sample.values()}
        )
        if not self._after_backward or not sizes:
            raise RuntimeError("call backward(loss) first")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"managed layers saw different batch sizes: {sizes}")
        return next(iter(sizes.values()))

    def _small_per_sample(self) -> list[tuple[list[nn.Parameter], Tensor]]:
        """The kept per-sample gradients with few elements per sample, per dtype: (their
        parameters, the gradients concatenated [B, sum n]). Made once per chunk, used by both
        the norms and the clipped sums."""
        if self._small is None:
            by_dtype: dict[torch.dtype, list] = {}
            for layer in self.layers:
                for name, grad in layer.per_sample.items():
                    if _is_small(grad):
                        by_dtype.setdefault(grad.dtype, []).append((layer.params[name], grad))
            self._small = [
                ([param for param, _ in members], torch.cat([g.flatten(1) for _, g in members], 1))
                for members in by_dtype.values()
            ]
        return self._small

    def per_sample_squared_norms(self) -> Tensor:
        """Squared norm of each sample's gradient over all managed parameters, [B]."""
        if self._norms is None:
            self._batch_size()  # checks that backward ran and that the batch sizes agree
            terms, calls_by_rule = [], {}
            for layer in self.layers:
                for A, G, _ in layer.calls:
                    calls_by_rule.setdefault(layer.rule, []).append((layer, A, G))
                for grad in layer.per_sample.values():
                    if not _is_small(grad):
                        terms.append(_squared_row_norms(grad.flatten(1)))
            terms += [_squared_row_norms(grads) for _, grads in self._small_per_sample()]
            for rule, calls in calls_by_rule.items():
                terms += rule.squared_norms_many(calls)
            self._norms = torch.stack(terms).sum(0)
        return self._norms

    def accumulate_clipped_grads(self, clip_factors: Tensor) -> None:
        """p.grad += sum_b c_b * grad_b(p) for every managed parameter.

        Consumes the saved A and G: each layer's are dropped as soon as its clipped gradient
        exists, so the weight gradients grow while the saved activations shrink and the peak
        stays near the non-private step's (holding both would add all of A and G on top).
        """
        if clip_factors.shape != (self._batch_size(),):
            raise ValueError(f"clip_factors must have shape [B], got {tuple(clip_factors.shape)}")
        c = ClipFactors(clip_factors)
        small = self._small_per_sample()  # biases, norm layers: batched per dtype
        large = [
            (layer.params[name], grad)
            for layer in self.layers
            for name, grad in layer.per_sample.items()
            if not _is_small(grad)
        ]
        self._small = None
        for layer in self.layers:
            layer.per_sample = {}
        # Large kept per-sample grads first (no GEMM over T: a weighted sum of each), so they
        # are freed before the clipped GEMMs below allocate their gradients.
        if large:
            accumulate_weighted_sums(*zip(*large, strict=True), c)
        del large
        for layer in self.layers:
            clipped = [layer.rule.clipped_grads(layer, A, G, c) for A, G, _ in layer.calls]
            layer.calls = []
            for grads in clipped:
                for name, grad in grads.items():
                    _accumulate(layer.params[name], grad)
        # Small ones: one [B] x [B, sum n] product per dtype.
        for params, grads in small:
            sums = c.to(grads.dtype) @ grads
            _accumulate_many(params, sums.split([p.numel() for p in params]))

    def routes(self) -> list[dict]:
        """Per layer of the last backward: name, T, route (Linear layers also d, p)."""
        return [dict(r) for r in self._routes]

    def release(self) -> None:
        """Drop saved activations, output gradients and leaves (call after each chunk)."""
        for layer in self.layers:
            layer.calls, layer.per_sample, layer.described = [], {}, []
        self._leaves, self._norms, self._after_backward = [], None, False
        self._last_saved = self._small = None

    def remove(self) -> None:
        """Remove hooks and make the managed parameters trainable again."""
        self.release()
        for handle in self._handles:
            handle.remove()
        for p in self.params:
            p.requires_grad_(True)
