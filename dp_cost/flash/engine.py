"""Exact per-sample gradient norms and clipped gradients from ONE backward pass.

"Book-keeping" DP-SGD (Bu et al. 2023): forward hooks keep each managed layer's input A,
pre-hooks on its output's autograd node keep its output gradient G, and autograd never forms a
weight gradient (managed parameters are set to requires_grad=False while wrapped). Per-sample
norms and the clipped sum sum_b c_b * grad_b are then computed from (A, G) by per-layer-type
rules (flash.rules).

Under autocast a Linear's A is kept in the autocast dtype (the cast the layer multiplies, handed
to it so it makes none of its own). Norm layers' per-sample gradients ([B, d]) are formed after
their backward hook, several layers in one launch, once their held A and G pass DEFERRED_BYTES
or right after the backward; a Linear's bias's in the hook where the layer forms its weight's,
else right after the backward from the kept G, every layer's in one launch. Where a Linear's
per-sample gradients are no larger than its A and G (d*p <= T*(d+p)), the hook forms them at
once (one batched GEMM, the FLOPs of the weight gradient it replaces) and drops A and G: the
clipped gradient is then a weighted sum of them, with no second GEMM. Layers
reading one input (q, k, v) share it, so at the threshold such a group holds up to ~1.5x what
the Gram route would (peaks stay <= 1.01x standard's: the peak is in forward).

Per chunk: backward(losses.sum()), per_sample_squared_norms(), accumulate_clipped_grads(c),
release(). Assumes dimension 0 of managed layers' inputs/outputs is the batch, one forward per
backward, gradients reaching managed layers only through their outputs, no checkpointing."""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch._utils import _unflatten_dense_tensors

from dp_cost.flash.clip import (
    ClipFactors,
    accumulate_into_grad,
    accumulate_many,
    accumulate_weighted_sums,
    squared_row_norms,
    squared_row_norms_many,
    weighted_sum,
)
from dp_cost.flash.layer import (
    DEFAULT_BLOCK_NUMEL,
    Call,
    GradRequest,
    Layer,
    LayerCall,
    flatten_tokens,
)
from dp_cost.flash.rules import NORM_RULES, NormRule

# Kept per-sample gradients with at most this many elements per sample (biases, norm layers, LoRA
# up to r * 8192) are normed and clip-summed as one concatenation [B, sum n] per dtype: one norm
# and one weighted sum per chunk instead of a few ops per parameter (LoRA: hundreds of layers, a
# host-bound step). The 1b model's product-route weights (2048 x 2048 and up) stay one by one.
SMALL_PER_SAMPLE_NUMEL = 2**18
# A and G held in the backward only for per-sample gradients a rule forms after it (norm
# layers: NormRule.formed_after_backward) are formed as soon as they exceed this many bytes,
# several layers' in one launch: fewer launches than one per layer in its hook (the 1b model has
# 41 LayerNorms, a host-bound step at short sequences), for about this much memory more (plus
# the call that crosses it; bytes of the views held, not of storages they keep alive).
DEFERRED_BYTES = 512 * 2**20


class UnsupportedLayerError(ValueError):
    """A layer owns trainable parameters but no norm rule is registered for its type."""


def _rows(grad: Tensor) -> Tensor:  # [B, n]; biases and norm layers' are: no view op
    return grad if grad.dim() == 2 else grad.view(grad.shape[0], -1)


def _is_small(per_sample_grad: Tensor) -> bool:
    # numel // B, not grad[0].numel(): indexing is an op (and flash is launch/CPU-bound here)
    return per_sample_grad.numel() <= SMALL_PER_SAMPLE_NUMEL * per_sample_grad.shape[0]


def _layer_input(args: tuple, kwargs: dict) -> Tensor:
    """A managed layer's input: its first argument, positional or by keyword."""
    return args[0] if args else next(iter(kwargs.values()))


class SavedInput(NamedTuple):
    """A layer input's A, as the first layer reading it made it: the next layer reading the
    same input (q after k) takes it while the input and autocast are unchanged."""

    rule: NormRule  # the rule that made it (another rule's A is not this one's)
    input: weakref.ref  # the input it was made from
    state: tuple  # (the input's version, autocast on, autocast dtype) then
    saved: Tensor


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
        # Hooks, not a wrapped forward: they run for copies and replicas of a module too
        # (DataParallel, copy.copy), and whatever wraps its forward later.
        self._handles = [handle for layer in self.layers for handle in self._hook(layer)]
        self._leaves: list[Tensor] = []
        # id(input) -> its SavedInput, this forward's: q, k and v (LoRA: their lora_A) read one
        # input but other managed calls come in between.
        self._saved: dict[int, SavedInput] = {}
        self._batch: int | None = None  # _batch_size's answer for this chunk
        self._small: tuple | None = None  # _per_sample_batches' answer for this chunk
        self._norms: Tensor | None = None
        self._routes: list[dict] = []
        self._after_backward = False
        self._idle = False  # inside autograd_gradients(): hooks keep nothing
        # (layer, call) whose A and G are held only for per-sample gradients formed after the
        # backward (NormRule.formed_after_backward), and their bytes: formed once over
        # DEFERRED_BYTES
        self._deferred: list[tuple[Layer, Call]] = []
        self._deferred_bytes = 0

    def _saved_input(self, layer: Layer, x: Tensor) -> tuple[Tensor, Tensor]:
        """(the rule's A for input x, what the layer computes on): layers reading one input (q, k
        and v) share one cast, as long as x was not modified in place and autocast is in the same
        state in between. A new cast the layer would make itself (rule.feeds_saved_input: a
        Linear under autocast) is made with its gradient and handed to the layer, which then
        casts nothing (one cast per call, as the non-private step: none of flash's own)."""
        device = "cuda" if x.is_cuda else x.device.type  # x.device makes an object: host time
        state = (x._version, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        last = self._saved.get(id(x))
        if (
            last is not None
            and last.rule is layer.rule
            and last.input() is x
            and last.state == state
        ):
            return last.saved, x
        feeds = layer.rule.feeds_saved_input
        fed = layer.rule.saved_input(layer.module, x if feeds else x.detach())
        saved = fed.detach() if feeds else fed
        self._saved[id(x)] = SavedInput(layer.rule, weakref.ref(x), state, saved)
        return saved, (fed if feeds else x)

    def _hook(self, layer: Layer) -> tuple:
        """A forward pre-hook that keeps A (and hands the layer the cast flash keeps, where
        _saved_input made one) and a forward hook that hooks the output's node for G. A rule
        that keeps the input as given (norm layers, embeddings) needs no pre-hook: A is taken
        in the forward hook (each hook costs host time on every call: 43 layers of a 1b step)."""
        keep = self._make_hook(layer)
        module = layer.module
        if not layer.rule.feeds_saved_input:

            def after_only(module, args, kwargs, output):
                if self._idle or not torch.is_grad_enabled():
                    return None
                if self._after_backward:
                    raise RuntimeError("FlashClipping: call release() before the next forward")
                x = args[0] if args else next(iter(kwargs.values()))
                return keep(layer.rule.saved_input(module, x.detach()), output)

            return (module.register_forward_hook(after_only, with_kwargs=True),)
        pending = None  # (A, the input the layer was given) from the pre-hook of this call

        def before(module, args, kwargs):
            nonlocal pending
            pending = None
            if self._idle or not torch.is_grad_enabled():
                return None
            if self._after_backward:
                raise RuntimeError("FlashClipping: call release() before the next forward")
            x = _layer_input(args, kwargs)
            saved, fed = self._saved_input(layer, x)
            pending = saved, fed
            if fed is x:
                return None
            if args:
                return (fed, *args[1:]), kwargs
            return args, {**kwargs, next(iter(kwargs)): fed}

        def after(module, args, kwargs, output):
            nonlocal pending
            if pending is None:
                return None
            (saved, fed), pending = pending, None
            x = _layer_input(args, kwargs)
            if x is not fed:  # a pre-hook registered after flash's replaced the input
                saved = layer.rule.saved_input(module, x.detach())
            return keep(saved, output)

        return (
            module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, with_kwargs=True),
        )

    def _make_hook(self, layer: Layer):
        k_in, k_out = layer.rule.feature_dims(layer.module)

        def keep(saved: Tensor, output: Tensor) -> Tensor | None:
            """After the layer's forward: keep A, hook the output's node for G; returns a leaf
            to use as the output instead, or None."""
            call = Call(flatten_tokens(saved, k_in))
            layer.calls.append(call)
            version = call.A._version

            # A pre-hook of the output's autograd node (or its base's, below): the gradient
            # Tensor.register_hook would see, for less host time per call (LoRA: hundreds of
            # layers per chunk, a host-bound step).
            def save_grad(grads):
                grad = grads[output_nr]
                if grad is None:  # the node ran for its other outputs only
                    return
                if shape is not None:  # the gradient of the view's base
                    grad = grad.reshape(shape)
                A = call.A
                # A second backward through the same graph: A dropped, or G already kept (a
                # layer whose A and G wait for after the backward)
                if A is None or call.G is not None:
                    raise RuntimeError("FlashClipping: one backward per forward (release() first)")
                if A._version != version:  # autograd would refuse a saved input changed so
                    raise RuntimeError(
                        f"FlashClipping: the input of {layer.name!r} was modified in place "
                        "after its forward; its per-sample gradients need it unchanged"
                    )
                if grad.requires_grad:  # only under create_graph: no detach op per hook else
                    grad = grad.detach()
                G = flatten_tokens(grad, k_out)
                description, kept, rest, deferred = self._plan(layer, A, G)
                layer.described.append(description)
                if kept:
                    self._add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G, kept))
                if not rest:
                    call.A = None  # A and G are not needed any more
                    return
                call.G, call.pending = G, rest  # never changed in place: the plan's set
                if deferred:
                    self._deferred.append((layer, call))
                    self._deferred_bytes += A.nbytes + G.nbytes
                    if self._deferred_bytes > DEFERRED_BYTES:
                        self._form_deferred()

            if not output.requires_grad:  # e.g. first layer: make a leaf so G still flows
                output = output.detach().requires_grad_(True)
                self._leaves.append(output)
                output_nr, shape = 0, None
                output.register_hook(lambda grad: save_grad((grad,)))
                return output
            node, output_nr, shape = output.grad_fn, output.output_nr, None
            base = output._base
            if base is not None and base.grad_fn is not None and base.numel() == output.numel():
                # A Linear on [B, T, d] returns a view of its 2-D product; an op in place on the
                # view (ReLU(inplace=True), y += x) takes the view's node out of the graph, the
                # product's stays: hook that one.
                if output.is_contiguous() and base.is_contiguous():
                    node, output_nr, shape = base.grad_fn, base.output_nr, output.shape
            node.register_prehook(save_grad)
            return None

        return keep

    @staticmethod
    def _plan(layer: Layer, A: Tensor, G: Tensor) -> tuple[dict, set[str], set[str], bool]:
        """(route description, parameters kept per sample, the rest, whether the rest are all
        formed after the backward) of a call, decided once per layer and shapes, not per chunk
        (LoRA: hundreds of layers, each hook's Python counts)."""
        key = (A.shape, G.shape)
        plan = layer.plans.get(key)
        if plan is None:
            rule = layer.rule
            description = {"layer": layer.name, "T": A.shape[1], **rule.describe(layer, A, G)}
            kept = rule.kept_per_sample(layer, A, G)
            rest = layer.params.keys() - kept
            deferred = bool(rest) and rest <= rule.formed_after_backward(layer, A, G)
            plan = layer.plans[key] = (description, kept, rest, deferred)
        return plan

    def _form_deferred(self) -> None:
        """The per-sample gradients of the calls held for after the backward (_deferred), now,
        several in one launch per rule; their A and G are dropped."""
        deferred, self._deferred, self._deferred_bytes = self._deferred, [], 0
        self._form_per_sample((layer, call, call.pending) for layer, call in deferred)
        for _, call in deferred:  # nothing pending any more
            call.A = call.G = None

    def _form_per_sample(self, asked) -> None:
        """The per-sample gradients of ``asked`` (layer, call, names) from each call's A and G,
        one per_sample_grads_many per rule (a rule may share launches between its calls); the
        names leave each call's pending."""
        by_rule: dict[NormRule, list] = {}
        for entry in asked:
            by_rule.setdefault(entry[0].rule, []).append(entry)
        for rule, entries in by_rule.items():
            requests = [GradRequest(layer, c.A, c.G, names) for layer, c, names in entries]
            grads = rule.per_sample_grads_many(requests)
            for (layer, call, names), formed in zip(entries, grads, strict=True):
                self._add_per_sample(layer, formed)
                call.pending = call.pending - names

    @staticmethod
    def _add_per_sample(layer: Layer, grads: dict[str, Tensor]) -> None:
        if not layer.per_sample:  # a layer's first call (most layers have one): the dict itself
            layer.per_sample = grads
            return
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
        self._saved = {}
        torch.autograd.grad(loss, self._leaves, allow_unused=True)
        self._after_backward = True
        # calls still held for after the backward are among layer.calls: formed below, at once
        self._deferred, self._deferred_bytes = [], 0
        for layer in self.layers:
            hooked = layer.calls
            # Calls whose G never came (unused outputs) add nothing; parameters kept per sample
            # already hold theirs.
            calls = [
                Call(c.A, c.G, c.pending) for c in hooked if c.A is not None and c.G is not None
            ]
            if calls:  # most layers (all of LoRA's) kept per-sample grads: nothing to join
                calls = self._join_calls(layer, calls)
            layer.calls = calls
            # The hook closures hold the original records and live as long as the autograd graph
            # (the caller's loss keeps it): release them so layer.calls is the only reference
            # and dropping it frees A and G.
            for call in hooked:
                call.release()
        self._form_after_backward()
        self._routes = [route for layer in self.layers for route in layer.described]

    def _form_after_backward(self) -> None:
        """The per-sample gradients the rules form right after the backward from the kept A and
        G (Linear biases: one launch for all, not one reduction per layer in its hook); a call
        left with nothing to do drops its A and G."""
        self._form_per_sample(
            (layer, call, names)
            for layer in self.layers
            for call in layer.calls
            if (names := layer.rule.formed_after_backward(layer, call.A, call.G) & call.pending)
        )
        for layer in self.layers:
            if any(not call.pending for call in layer.calls):
                layer.calls = [call for call in layer.calls if call.pending]

    def _join_calls(self, layer: Layer, calls: list[Call]) -> list[Call]:
        """A layer's calls still to be done from A and G, joined: a reused module's gradient is
        the sum over its calls."""
        pending = set().union(*(call.pending for call in calls))
        if pending <= layer.rule.formed_after_backward(layer, calls[0].A, calls[0].G):
            return calls  # each formed after the backward, summed into layer.per_sample
        if pending & layer.per_sample.keys():  # other calls formed these per sample: join
            for call in calls:
                grads = layer.rule.per_sample_grads(layer, call.A, call.G, call.pending)
                self._add_per_sample(layer, grads)
            layer.described = [dict(d, route="product") for d in layer.described]
            return []
        if len(calls) == 1:
            return calls
        # Concatenated along T; the route is decided again on the joined T: report that one.
        A = torch.cat([call.A for call in calls], 1)
        G = torch.cat([call.G for call in calls], 1)
        layer.described = [
            {"layer": layer.name, "T": A.shape[1], **layer.rule.describe(layer, A, G)}
        ]
        kept = layer.rule.kept_per_sample(layer, A, G) & pending
        if kept:
            self._add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G, kept))
        return [Call(A, G, pending - kept)] if pending - kept else []

    def _batch_size(self) -> int:
        if self._batch is not None:  # asked by the norms and the clipped sums of each chunk
            return self._batch
        sizes = {layer.name: call.A.shape[0] for layer in self.layers for call in layer.calls}
        sizes.update({ly.name: g.shape[0] for ly in self.layers for g in ly.per_sample.values()})
        if not self._after_backward or not sizes:
            raise RuntimeError("call backward(loss) first")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"managed layers saw different batch sizes: {sizes}")
        self._batch = next(iter(sizes.values()))
        return self._batch

    def _per_sample_batches(self) -> tuple[list, list]:
        """(small, large) kept per-sample gradients, made once per chunk for the norms and the
        clipped sums. small: per dtype, (its parameters, their gradients concatenated
        [B, sum n]); large: (parameter, gradient) of the rest."""
        if self._small is None:
            by_dtype: dict[torch.dtype, list] = {}
            large = []
            for layer in self.layers:
                for name, grad in layer.per_sample.items():
                    if _is_small(grad):
                        by_dtype.setdefault(grad.dtype, []).append((layer.params[name], grad))
                    else:
                        large.append((layer.params[name], grad))
            groups = by_dtype.values()
            small = [([p for p, _ in m], torch.cat([_rows(g) for _, g in m], 1)) for m in groups]
            self._small = small, large
        return self._small

    def per_sample_squared_norms(self) -> Tensor:
        """Squared norm of each sample's gradient over all managed parameters, [B]."""
        if self._norms is None:
            self._batch_size()  # checks that backward ran and that the batch sizes agree
            small, large = self._per_sample_batches()
            terms = squared_row_norms_many([grad for _, grad in large])
            terms += [squared_row_norms(grads) for _, grads in small]
            for rule, calls in self._calls_by_rule(self.layers).items():
                terms += rule.squared_norms_many(list(calls))
            self._norms = torch.stack(terms).sum(0)
        return self._norms

    def accumulate_clipped_grads(
        self, clip_factors: Tensor, sink: Callable[[nn.Parameter, Tensor], None] | None = None
    ) -> None:
        """p.grad += sum_b c_b * grad_b(p) for every managed parameter.

        Consumes the saved A and G: each layer's are dropped as soon as its clipped gradient
        exists, so the weight gradients grow while the saved activations shrink and the peak
        stays near the non-private step's (holding both would add all of A and G on top).

        ``sink(param, clipped_sum)``: instead of writing .grad, hand each parameter's clipped sum
        (full shape, param.shape) to ``sink`` as soon as it exists, one parameter at a time and
        every one of them, in self.params' reverse order (a sharded model reduce-scatters it
        into its shard and drops it: a few parameters' unsharded gradients are held at most),
        then call ``sink.finish(params)`` with every managed parameter. The batched writes into
        .grad are not used then.
        """
        if clip_factors.shape != (self._batch_size(),):
            raise ValueError(f"clip_factors must have shape [B], got {tuple(clip_factors.shape)}")
        c = ClipFactors(clip_factors)
        small, large = self._per_sample_batches()
        self._small = None
        for layer in self.layers:
            layer.per_sample = {}
        if sink is not None:
            self._clipped_grads_to(sink, c, small, large)
            sink.finish(self.params)
            return
        # Large kept per-sample grads first (no GEMM over T: a weighted sum of each), so they
        # are freed before the clipped GEMMs below allocate their gradients.
        if large:
            accumulate_weighted_sums(*zip(*large, strict=True), c)
        del large
        clipped_of = self._calls_by_rule(self.layers, c)
        for layer in self.layers:
            clipped = [next(clipped_of[layer.rule]) for _ in layer.calls]
            layer.calls = []
            for grads in clipped:
                for name, grad in grads.items():
                    accumulate_into_grad(layer.params[name], grad)
        # The concatenations: one weighted sum per dtype.
        for params, grads in small:
            accumulate_many(params, weighted_sum(grads, c))

    def _clipped_grads_to(self, sink, c: ClipFactors, small: list, large: list) -> None:
        """accumulate_clipped_grads' sink path: every managed parameter's clipped sum, in
        self.params' reverse order whatever the routes, dict and set orders (hash-seeded) or
        layers reached (zeros where none was), so every rank's collectives pair up. Each kept
        per-sample gradient, concatenation, A and G is dropped once used."""
        ready: dict[int, Tensor] = {}
        while small:  # the small parameters' sums first, one weighted sum per dtype
            params, grads = small.pop()
            grads = _unflatten_dense_tensors(weighted_sum(grads, c), params)
            ready.update(zip(map(id, params), grads, strict=True))
        kept = {id(param): grad for param, grad in large}
        large.clear()
        # Last layer first (autograd's order): kept per-sample gradients are freed before the
        # embeddings' full gradients exist (lower peak than first-first; a small LM, CPU).
        order = self.layers[::-1]
        clipped_of = self._calls_by_rule(order, c)
        for layer in order:
            calls, layer.calls = layer.calls, []
            clipped: dict[str, Tensor] = {}
            for _ in calls:
                for name, grad in next(clipped_of[layer.rule]).items():
                    clipped[name] = grad if name not in clipped else clipped[name] + grad
            del calls
            for name, param in reversed(layer.params.items()):
                if id(param) in kept:
                    grad = weighted_sum(kept.pop(id(param)).flatten(1), c)
                elif name in clipped:
                    grad = clipped.pop(name)
                elif id(param) in ready:
                    grad = ready.pop(id(param))
                else:  # no call of this chunk reached the layer
                    grad = torch.zeros(param.shape, dtype=param.dtype, device=c.c.device)
                sink(param, grad.view(param.shape))
                del grad  # not held through the next layer's clipped GEMM

    @staticmethod
    def _calls_by_rule(order: list[Layer], c: ClipFactors | None = None) -> dict[NormRule, Any]:
        """A LayerCall of every call still to be done from A and G, by rule, in ``order``.
        Given c, each rule's clipped_grads_many of them instead: their clipped gradients in that
        order, made as they are asked for (a rule may share launches between its calls)."""
        by_rule: dict[NormRule, deque] = {}
        for layer in order:
            for call in layer.calls:
                by_rule.setdefault(layer.rule, deque()).append(LayerCall(layer, call.A, call.G))
        if c is None:
            return by_rule
        return {rule: rule.clipped_grads_many(calls, c) for rule, calls in by_rule.items()}

    def routes(self) -> list[dict]:
        """Per layer of the last backward: name, T, route (Linear layers also d, p)."""
        return [dict(r) for r in self._routes]

    def kept_tensors(self) -> Iterator[tuple[nn.Module, str, Tensor]]:
        """(module, role, tensor) for every tensor the engine holds for a managed module between
        its forward and release(): the saved inputs A and output gradients G ("activation_hooks")
        and the per-sample gradients formed in the backward hook or after it
        ("per_sample_gradients")."""
        for layer in self.layers:
            for call in layer.calls:
                for tensor in call.tensors():
                    yield layer.module, "activation_hooks", tensor
            for grad in layer.per_sample.values():
                yield layer.module, "per_sample_gradients", grad

    def release(self) -> None:
        """Drop saved activations, output gradients and leaves (call after each chunk)."""
        for layer in self.layers:
            layer.calls, layer.per_sample, layer.described = [], {}, []
        self._leaves, self._norms, self._after_backward = [], None, False
        self._saved, self._small, self._batch = {}, None, None
        self._deferred, self._deferred_bytes = [], 0

    @contextlib.contextmanager
    def autograd_gradients(self):
        """Inside, the hooks keep nothing and autograd forms .grad, as unwrapped: at one sample,
        the per-sample gradient (DDP at one sample per rank). Every layer's route: "autograd"."""
        self._idle = True
        self._routes = [{"layer": layer.name, "route": "autograd"} for layer in self.layers]
        for p in self.params:
            p.requires_grad_(True)
        try:
            yield
        finally:
            self._idle = False
            for p in self.params:
                p.requires_grad_(False)

    def remove(self) -> None:
        """Remove hooks and make the managed parameters trainable again."""
        self.release()
        for handle in self._handles:
            handle.remove()
        for p in self.params:
            p.requires_grad_(True)
