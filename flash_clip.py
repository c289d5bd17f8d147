"""Exact per-sample gradient norms and clipped gradients from ONE backward pass.

"Book-keeping" DP-SGD (Bu et al. 2023): forward hooks keep each managed layer's input A,
tensor hooks keep its output gradient G, and autograd never forms a weight gradient
(managed parameters are set to requires_grad=False while wrapped). Per-sample norms and
the clipped sum sum_b c_b * grad_b are then computed from (A, G) by per-layer-type rules.

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

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DEFAULT_BLOCK_NUMEL = 64 * 2**20  # largest intermediate of the direct route, in elements


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
    calls: list[list] = field(default_factory=list)  # one [A, G] per forward call
    # Per-sample gradients [B, ...] by parameter name, for calls whose rule kept them instead of
    # A and G (summed over calls: a reused module's gradient is the sum over its calls).
    per_sample: dict[str, Tensor] = field(default_factory=dict)
    described: list[dict] = field(default_factory=list)  # the route of each call, for routes()


class NormRule:
    """Per-layer-type rule. Subclass it and register with @register_norm_rule(Type)."""

    def feature_dims(self, module: nn.Module) -> tuple[int, int]:
        """Trailing feature dims of (input, output); the rest is flattened into [B, T]."""
        return 1, 1

    def describe(self, layer: Layer, A: Tensor, G: Tensor) -> dict:
        return {"route": type(self).__name__}

    def keeps_per_sample(self, layer: Layer, A: Tensor, G: Tensor) -> bool:
        """Form per-sample gradients from this call at once (instead of keeping A and G)?"""
        return False

    def per_sample_grads(self, layer: Layer, A: Tensor, G: Tensor) -> dict[str, Tensor]:
        """Per-sample gradients [B, *param.shape] by name (rules that keep them)."""
        raise NotImplementedError

    def squared_norms(self, layer: Layer, A: Tensor, G: Tensor) -> Tensor:
        """Per-sample squared gradient norm [B], summed over the layer's managed params."""
        raise NotImplementedError

    def clipped_grads(self, layer: Layer, A: Tensor, G: Tensor, c: Tensor) -> dict[str, Tensor]:
        """sum_b c_b * grad_b for each managed parameter name."""
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


def gram_squared_norms(A: Tensor, G: Tensor, tile: int) -> Tensor:
    """||G_b^T A_b||^2 = sum_{s,t} (a_s.a_t)(g_s.g_t), over tile pairs t <= s (no B x T x T).

    (flash_kernels.gram_squared_norms is the fused Triton version; it is measured by
    bench_flash.py but not used here until it beats this path: see BENCHMARKS.md.)
    """
    A, G = _gemm_operands(A, G)
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


def direct_squared_norms(A: Tensor, G: Tensor, block_numel: int) -> Tensor:
    """||G_b^T A_b||^2 formed in blocks of m output rows, each block <= block_numel elements."""
    (B, T, d), p = A.shape, G.shape[-1]
    rows = max(1, min(p, block_numel // (B * max(d, T))))
    A, G = _gemm_operands(A, G)
    total = _acc(A.new_zeros(B))
    for j in range(0, p, rows):
        block = G[:, :, j : j + rows].mT @ A
        total += (block * block).sum((1, 2), dtype=total.dtype)
    return total


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
    def describe(self, layer, A, G):
        d, p = layer.module.in_features, layer.module.out_features
        return {"d": d, "p": p, "route": linear_route(layer, A.shape[1])}

    def keeps_per_sample(self, layer, A, G):
        return linear_route(layer, A.shape[1]) == "product"

    def per_sample_grads(self, layer, A, G):
        grads = {}
        if "weight" in layer.params:
            A_op, G_op = _gemm_operands(A, G)
            # [B, p, d], one batched GEMM accumulating in fp32; in the operands' dtype (bf16 under
            # autocast, as the non-private weight gradient), rounded once.
            grads["weight"] = G_op.mT @ A_op
        if "bias" in layer.params:
            grads["bias"] = G.sum(1, dtype=_acc_dtype(G))
        return grads

    def squared_norms(self, layer, A, G):
        norms = _acc(G.new_zeros(G.shape[0]))
        if "weight" in layer.params:
            if linear_route(layer, A.shape[1]) == "gram":
                norms += gram_squared_norms(A, G, layer.tile_size)
            else:
                norms += direct_squared_norms(A, G, layer.block_numel)
        if "bias" in layer.params:
            norms += G.sum(1, dtype=norms.dtype).square().sum(1)  # no fp32 copy of G
        return norms

    def clipped_grads(self, layer, A, G, c):
        grads = {}
        if "weight" in layer.params:
            A_op, G_op = _gemm_operands(A, G)  # the dtype autocast's own weight GEMM uses
            A2, G2 = A_op.flatten(0, 1), G_op.flatten(0, 1)  # [B*T, d], [B*T, p]
            c_tok = _round_down(c, A2.dtype).repeat_interleave(A.shape[1])[:, None]
            if G2.shape[1] <= A2.shape[1]:  # fold c into the narrower operand
                G2 = G2 * c_tok
            else:
                A2 = A2 * c_tok
            grads["weight"] = G2.T @ A2  # one GEMM over all B*T tokens
        if "bias" in layer.params:
            per_sample = G.sum(1, dtype=_acc_dtype(G))  # [B, p]
            grads["bias"] = _acc(c) @ per_sample
        return grads


# ---------------------------------------------------------------- Embedding


@register_norm_rule(nn.Embedding)
class EmbeddingRule(NormRule):
    def feature_dims(self, module):
        return 0, 1  # input: token ids [B, T]; output: [B, T, d]

    def describe(self, layer, A, G):
        return {"route": "embedding"}

    @staticmethod
    def _tokens(layer: Layer, ids: Tensor, G: Tensor):
        """Flat (sample index, token id, g) of tokens that receive gradient."""
        samples = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        if layer.module.padding_idx is None:
            return samples.flatten(), ids.flatten(), G.flatten(0, 1)
        keep = ids != layer.module.padding_idx  # torch gives the padding row no gradient
        return samples[keep], ids[keep], G[keep]

    def squared_norms(self, layer, A, G):
        samples, ids, g = self._tokens(layer, A, G)
        g = _acc(g)
        # Per-sample grad rows are sums of g over equal (sample, id): segment-sum, O(B*T*d).
        keys, inverse = torch.unique(
            samples * layer.module.num_embeddings + ids, return_inverse=True
        )
        rows = g.new_zeros(len(keys), g.shape[-1]).index_add_(0, inverse, g)
        norms = rows.new_zeros(A.shape[0])
        return norms.index_add_(0, keys // layer.module.num_embeddings, rows.square().sum(1))

    def clipped_grads(self, layer, A, G, c):
        samples, ids, g = self._tokens(layer, A, G)
        weight = layer.module.weight
        scaled = (_acc(g) * _acc(c)[samples, None]).to(weight.dtype)
        return {"weight": torch.zeros_like(weight).index_add_(0, ids, scaled)}


# ---------------------------------------------------------------- LayerNorm / RMSNorm


@register_norm_rule(nn.LayerNorm, nn.RMSNorm)
class NormLayerRule(NormRule):
    def feature_dims(self, module):
        k = len(module.normalized_shape)
        return k, k

    def describe(self, layer, A, G):
        return {"route": "norm"}

    def keeps_per_sample(self, layer, A, G):
        return True  # [B, d] per parameter: always smaller than A and G ([B, T, d] each)

    @staticmethod
    def per_sample_grads(layer: Layer, A: Tensor, G: Tensor) -> dict[str, Tensor]:
        """Exact per-sample grads [B, d]: weight = sum_t g_t * xhat_t, bias = sum_t g_t."""
        m, x, g = layer.module, _acc(A), _acc(G)
        grads = {}
        if "weight" in layer.params:
            shape = (x.shape[-1],)  # normalized dims were flattened into one
            if isinstance(m, nn.LayerNorm):
                xhat = F.layer_norm(x, shape, eps=m.eps)
            else:  # eps=None means eps of the compute dtype, as in torch
                xhat = F.rms_norm(x, shape, eps=m.eps)
            grads["weight"] = (g * xhat).sum(1)
        if "bias" in layer.params:
            grads["bias"] = g.sum(1)
        return grads

    def squared_norms(self, layer, A, G):
        return sum(g.square().sum(1) for g in self.per_sample_grads(layer, A, G).values())

    def clipped_grads(self, layer, A, G, c):
        grads = self.per_sample_grads(layer, A, G)
        shape = layer.module.normalized_shape
        return {name: (_acc(c) @ g).view(shape) for name, g in grads.items()}


# ---------------------------------------------------------------- the wrapper


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
        self._norms: Tensor | None = None
        self._routes: list[dict] = []
        self._after_backward = False

    def _make_hook(self, layer: Layer):
        k_in, k_out = layer.rule.feature_dims(layer.module)

        def forward_hook(module, args, kwargs, output):
            if not torch.is_grad_enabled():
                return None
            if self._after_backward:
                raise RuntimeError("FlashClipping: call release() before the next forward")
            x = args[0] if args else next(iter(kwargs.values()))
            call = [_flatten_tokens(x.detach(), k_in), None]
            layer.calls.append(call)

            def save_grad(grad):
                if not call or call[0] is None:  # a second backward through the same graph
                    raise RuntimeError("FlashClipping: one backward per forward (release() first)")
                A, G = call[0], _flatten_tokens(grad.detach(), k_out)
                layer.described.append(
                    {"layer": layer.name, "T": A.shape[1], **layer.rule.describe(layer, A, G)}
                )
                if layer.rule.keeps_per_sample(layer, A, G):
                    self._add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G))
                    call[0] = None  # A and G are not needed any more
                else:
                    call[1] = G

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
        torch.autograd.grad(loss, self._leaves, allow_unused=True)
        self._after_backward = True
        for layer in self.layers:
            hooked = layer.calls
            # Calls whose G never came (unused outputs) add nothing; kept per-sample grads
            # already hold theirs.
            calls = [list(c) for c in hooked if c[0] is not None and c[1] is not None]
            if calls and layer.per_sample:  # some calls kept per-sample grads: fold in the rest
                for A, G in calls:
                    self._add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G))
                calls = []
                layer.described = [dict(d, route="product") for d in layer.described]
            if len(calls) > 1:  # a reused module's grad sums over calls: concatenate along T
                calls = [[torch.cat(t, 1) for t in zip(*calls, strict=True)]]
                A, G = calls[0]  # the route is decided again on the joined T: report that one
                layer.described = [
                    {"layer": layer.name, "T": A.shape[1], **layer.rule.describe(layer, A, G)}
                ]
                if layer.rule.keeps_per_sample(layer, A, G):
                    self._add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G))
                    calls = []
            layer.calls = calls
            # The hook closures hold the original lists and live as long as the autograd graph
            # (the caller's loss keeps it): empty them so layer.calls is the only reference and
            # dropping it frees A and G.
            for call in hooked:
                call.clear()
        self._routes = [route for layer in self.layers for route in layer.described]

    def _batch_size(self) -> int:
        sizes = {layer.name: A.shape[0] for layer in self.layers for A, _ in layer.calls}
        sizes.update(
            {layer.name: g.shape[0] for layer in self.layers for g in layer.per_sample.values()}
        )
        if not self._after_backward or not sizes:
            raise RuntimeError("call backward(loss) first")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"managed layers saw different batch sizes: {sizes}")
        return next(iter(sizes.values()))

    def per_sample_squared_norms(self) -> Tensor:
        """Squared norm of each sample's gradient over all managed parameters, [B]."""
        if self._norms is None:
            B = self._batch_size()
            norms = torch.zeros(B, device=self.params[0].device)
            for layer in self.layers:
                for A, G in layer.calls:
                    norms = norms + layer.rule.squared_norms(layer, A, G)
                for grad in layer.per_sample.values():
                    # fp32 accumulation inside the reduction: no fp32 copy of bf16 grads
                    norms = (
                        norms
                        + torch.linalg.vector_norm(
                            grad.flatten(1), dim=1, dtype=_acc_dtype(grad)
                        ).square()
                    )
            self._norms = norms
        return self._norms

    def accumulate_clipped_grads(self, clip_factors: Tensor) -> None:
        """p.grad += sum_b c_b * grad_b(p) for every managed parameter.

        Consumes the saved A and G: each layer's are dropped as soon as its clipped gradient
        exists, so the weight gradients grow while the saved activations shrink and the peak
        stays near the non-private step's (holding both would add all of A and G on top).
        """
        if clip_factors.shape != (self._batch_size(),):
            raise ValueError(f"clip_factors must have shape [B], got {tuple(clip_factors.shape)}")
        for layer in self.layers:
            clipped = [layer.rule.clipped_grads(layer, A, G, clip_factors) for A, G in layer.calls]
            layer.calls = []
            # Kept per-sample grads: the clipped sum is one [B] x [B, n] product, no GEMM over T.
            clipped.append(
                {
                    name: _round_down(clip_factors, grad.dtype) @ grad.flatten(1)
                    for name, grad in layer.per_sample.items()
                }
            )
            layer.per_sample = {}
            for grads in clipped:
                for name, grad in grads.items():
                    p = layer.params[name]
                    grad = grad.to(p.dtype).view(p.shape)
                    p.grad = grad if p.grad is None else p.grad.add_(grad)

    def routes(self) -> list[dict]:
        """Per layer of the last backward: name, T, route (Linear layers also d, p)."""
        return [dict(r) for r in self._routes]

    def release(self) -> None:
        """Drop saved activations, output gradients and leaves (call after each chunk)."""
        for layer in self.layers:
            layer.calls, layer.per_sample, layer.described = [], {}, []
        self._leaves, self._norms, self._after_backward = [], None, False

    def remove(self) -> None:
        """Remove hooks and make the managed parameters trainable again."""
        self.release()
        for handle in self._handles:
            handle.remove()
        for p in self.params:
            p.requires_grad_(True)
