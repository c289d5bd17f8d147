"""Exact per-sample gradient norms and clipped gradients from ONE backward pass.

"Book-keeping" DP-SGD (Bu et al. 2023): each managed layer's taped forward keeps its input A and
the autograd edge its output gradient G arrives on, one autograd call takes every G
(dp_cost.flash.capture), and autograd never forms a weight gradient (managed parameters are set
to requires_grad=False while wrapped). Per-sample norms and the clipped sum sum_b c_b * grad_b are
then computed from (A, G), or from per-sample gradients formed from them, by per-layer-type rules
(flash.rules), a group of calls at a time. Right after the backward, one per_sample_grads_many
per rule forms what is small per sample (Linear biases, the product route's weights, norm
layers); such a weight's clipped gradient is a weighted sum of them, with no second GEMM.

Per chunk: backward(losses.sum()), per_sample_squared_norms(), accumulate_clipped_grads(c),
release(). Assumes dimension 0 of managed layers' inputs/outputs is the batch, one forward per
backward, gradients reaching managed layers only through their outputs. Activation
checkpointing: given the model's checkpoint contexts, the engine hands them checkpoint_contexts();
each layer's input is then kept from its block's recomputation."""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._utils import _unflatten_dense_tensors

from dp_cost.flash.capture import LayerCapture
from dp_cost.flash.checkpointed import each_block
from dp_cost.flash.clip import (
    ClipFactorsByParameter,
    DeviceIndices,
    accumulate_many,
    accumulate_weighted_sums,
    squared_row_norms,
    squared_row_norms_each,
    squared_row_norms_many,
    sums_in_groups,
    weighted_sum,
)
from dp_cost.flash.layer import (
    DEFAULT_BLOCK_NUMEL,
    Layer,
    LayerCall,
    UnsupportedLayerError,
    join_calls,
    only_parameter,
)
from dp_cost.flash.precision import accumulation_dtype, wider
from dp_cost.flash.rules import NORM_RULES, NormRule

# Kept per-sample gradients with at most this many elements per sample (biases, norm layers, LoRA
# up to r * 8192) are normed and clip-summed as one concatenation [B, sum n] per dtype: one norm
# and one weighted sum per chunk instead of a few ops per parameter (LoRA: hundreds of layers, a
# host-bound step). The 1b model's product-route weights (2048 x 2048 and up) stay one by one.
SMALL_PER_SAMPLE_NUMEL = 2**18


ROUTES = ("auto", "gram", "direct", "product")  # how Linear layers get their per-sample norms


class FlashClipping(LayerCapture):
    """Per-sample gradient norms and clipped gradients with one backward pass (its tape and what
    it keeps: LayerCapture)."""

    def __init__(
        self,
        model: nn.Module,
        route: str = "auto",
        tile_size: int = 512,
        block_numel: int = DEFAULT_BLOCK_NUMEL,
        checkpointed=None,
    ):
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}; got {route!r}")
        layers: list[Layer] = []
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
            layer = Layer(name, module, rule, params, route, tile_size, block_numel)
            layer.compute, layer.casts_input = rule.compute_for(module), rule.casts_input
            layer.formed_in_backward = rule.formed_in_backward
            layer.feature_dims = rule.feature_dims(module)
            layers.append(layer)
        super().__init__(layers)  # may refuse a layer: before anything of the model changes
        self.params = [p for p in model.parameters() if id(p) in owner]
        for p in self.params:
            p.requires_grad_(False)  # autograd then computes no weight gradient at all
        # this chunk's _batch_size, _per_sample_batches and norms (once each), its routes
        self._batch, self._small, self._norms, self._routes = None, None, None, []
        self._indices = DeviceIndices()  # per-layer clipping's index tensors, made once
        self._param_rows = {id(param): i for i, param in enumerate(self.params)}  # rows of [P, B]
        self._call_rows: dict[tuple, int] = {}  # _rows_of_calls' answers
        # ids of the parameters handed to a sink this chunk, of the layers clip_each_block had;
        # the sink path's sums waiting for those before them, the next of self.params reversed
        self._handed, self._drained, self._pending, self._next_hand = set(), set(), {}, 0
        self.checkpointed = checkpointed  # the model's checkpoint contexts (core.recompute's)
        if checkpointed is not None:  # the tape keeps each input from the recomputation
            self.checkpointed.make = self.checkpoint_contexts

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        """One backward of the SUM of per-sample losses; no .grad is written anywhere.
        ``retain_graph``: a second backward may follow, after rearm()."""
        self._handed, self._drained, self._routes = set(), set(), []
        self._pending, self._next_hand = {}, 0
        self._take_gradients(loss, retain_graph)
        self._calls_ready()

    def _calls_ready(self) -> None:
        """After a backward (or a block's): small ones formed per sample, reused modules joined."""
        self._after_backward = True
        self._form_after_backward()
        self._join_reused()
        self._routes += [route for layer in self.layers for route in layer.described]

    def _join_reused(self) -> None:  # builtins only per layer
        for layer in self.layers:
            calls = layer.calls  # a reused module's gradient: the sum over its calls
            if (calls or layer.per_sample) and id(layer) in self._drained:
                raise UnsupportedLayerError(
                    f"{layer.name!r} is called in two checkpointed blocks: clipped each "
                    "block, its gradient would be clipped in parts"
                )
            if len(calls) > 1 or (calls and not calls[0].pending.isdisjoint(layer.per_sample)):
                layer.calls = join_calls(layer, calls)

    def clip_each_block(
        self, clip: Callable[[FlashClipping], None] | None, copy_gradients: bool = True
    ) -> None:
        """Checkpointing: ``clip(self)`` as each block's recomputation starts, with what the
        blocks whose backward ended left (dropped after it; None: off). ``copy_gradients``
        False: clip() reads G and does not write it (norms only)."""
        self.tape.group_done = None if clip is None else each_block(self, clip, copy_gradients)

    def clip_group(self, batch: list, clip) -> None:
        """clip(self) of ``batch`` ([records, Gs]; emptied, each call's tensors go once done)."""
        records, grads = batch
        batch.clear()
        self._add_calls(records, grads)
        del records, grads
        if not any(layer.calls or layer.per_sample for layer in self.layers):
            return
        self._calls_ready()
        self._drained.update(id(layer) for layer in self.layers if layer.calls or layer.per_sample)
        clip(self)
        self._drop_held()

    def _form_after_backward(self) -> None:
        """The per-sample gradients formed right after the backward (kept_per_sample: the product
        route, LoRA; formed_after_backward: biases, norm layers), one per_sample_grads_many per
        rule; a call left with nothing to do drops its A and G."""
        self._form_per_sample(
            [
                (layer, call, call.after)
                for layer in self.layers
                for call in layer.calls
                if call.after
            ]
        )

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
            for layer in self.layers:  # per parameter: builtins only (no Python call)
                for name, grad in layer.per_sample.items():
                    # numel // B, not grad[0].numel(): indexing is an op
                    if grad.numel() <= SMALL_PER_SAMPLE_NUMEL * grad.shape[0]:
                        rows = grad if grad.dim() == 2 else grad.view(grad.shape[0], -1)
                        by_dtype.setdefault(grad.dtype, []).append((layer.params[name], rows))
                    else:
                        large.append((layer.params[name], grad))
            groups = by_dtype.values()
            small = [([p for p, _ in m], torch.cat([g for _, g in m], 1)) for m in groups]
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

    def per_parameter_squared_norms(self) -> Tensor:
        """Squared norm of each sample's gradient of each managed parameter on its own, [P, B],
        rows in self.params' order (per-layer clipping: each parameter clipped to its own C_l).
        Built from blocks of rows ([k, B] each: a concatenation of small parameters split by
        one index_add, the large kept ones, each rule's calls), each copied in by one
        index_copy (no op per parameter); a layer done from A and G has one pending parameter
        (its rule's squared_norms covers what it left pending)."""
        batch = self._batch_size()
        small, large = self._per_sample_batches()
        row = self._param_rows
        blocks: list[tuple[Tensor, list[int]]] = []  # [k, B] norms, the rows of self.params
        rows_of_calls = self._rows_of_calls()
        for params, grads in small:
            local = list(range(len(params)))
            owner = self._indices.columns(params, local, grads.device)  # of each column
            # fp64 on the CPU, as squared_row_norms: fp32 sums drift on long rows there
            wide = torch.float64 if grads.device.type == "cpu" else accumulation_dtype(grads)
            squared = grads.to(wide).square()
            sums = squared.new_zeros((batch, len(params))).index_add_(1, owner, squared)
            blocks.append((sums.T.to(accumulation_dtype(grads)), [row[id(p)] for p in params]))
        if large:
            norms = squared_row_norms_each([grad for _, grad in large])
            blocks.append((norms, [row[id(param)] for param, _ in large]))
        for rule, calls in self._calls_by_rule(self.layers).items():
            calls = list(calls)
            rows = [rows_of_calls[id(call.layer)] for call in calls]
            blocks.append((rule.squared_norms_each(calls), rows))
        dtype = functools.reduce(wider, [block.dtype for block, _ in blocks])
        device = blocks[0][0].device
        norms = torch.zeros((len(self.params), batch), dtype=dtype, device=device)
        for block, rows in blocks:
            index = self._indices.get(("rows", *rows), functools.partial(list, rows), device)
            norms.index_copy_(0, index, block if block.dtype == dtype else block.to(dtype))
        return norms

    def accumulate_clipped_grads(
        self,
        clip_factors: Tensor,
        sink: Callable[[nn.Parameter, Tensor], None] | None = None,
        finish: bool = True,
    ) -> None:
        """p.grad += sum_b c_b * grad_b(p) for every managed parameter. ``clip_factors``: [B]
        (flat clipping), or [P, B], a row per parameter in self.params' order (per-layer).
        Consumes the saved A and G: each layer's are dropped as soon as its clipped gradient
        exists (the peak stays near the non-private step's).

        ``sink(param, clipped_sum)``: instead of writing .grad, each parameter's clipped sum
        (param.shape) is handed to ``sink`` as soon as it exists, every one of them, in
        self.params' reverse order (a sharded model reduce-scatters it into its shard and drops
        it), then ``sink.finish(params)``. ``finish=False`` (clip_each_block's groups): only the
        parameters of the layers held now are handed over, and finish is not called."""
        expected = (self._batch_size(),)
        if clip_factors.shape not in (expected, (len(self.params), *expected)):
            raise ValueError(
                f"clip_factors must have shape [B] or [P, B], got {tuple(clip_factors.shape)}"
            )
        c = ClipFactorsByParameter(clip_factors, self._param_rows, self._indices)
        small, large = self._per_sample_batches()
        self._small = None
        for layer in self.layers:
            layer.per_sample = {}
        if sink is not None:
            self._clipped_grads_to(sink, c, small, large, every=finish)
            if finish:
                sink.finish(self.params)
            return
        # Large kept per-sample grads first (no GEMM over T: a weighted sum of each), so they
        # are freed before the clipped GEMMs below allocate their gradients.
        factors, rows = c.for_rules(self._rows_of_calls)
        if large:
            params, grads = zip(*large, strict=True)
            row = self._param_rows
            param_rows = None if rows is None else [row[id(param)] for param in params]
            accumulate_weighted_sums(params, grads, factors, param_rows)
            del grads
        del large
        # each rule's calls in one go, each dropped once used
        calls_of = self._calls_by_rule(self.layers)
        for layer in self.layers:
            layer.calls = []
        for rule, calls in calls_of.items():
            rule.accumulate_clipped_grads(calls, factors, rows)
        del calls_of
        # The concatenations: one weighted sum per dtype.
        for params, grads in small:
            accumulate_many(params, c.concatenated_sum(params, grads))

    def _clipped_grads_to(
        self, sink, c: ClipFactorsByParameter, small: list, large: list, every: bool = True
    ) -> None:
        """accumulate_clipped_grads' sink path: each managed parameter's clipped sum (zeros where
        no call reached its layer) to ``sink`` in self.params' reverse order whatever the routes,
        dict orders or layers a rank reached, so every rank's collectives pair up: a sum waits
        for those before it (a layer one rank did not reach comes at the chunk's end). ``every``
        False: the parameters with a sum now (a block's group). Each kept per-sample gradient,
        concatenation, A and G is dropped once used."""
        ready: dict[int, Tensor] = {}
        while small:  # the small parameters' sums first, one weighted sum per dtype
            params, grads = small.pop()
            grads = _unflatten_dense_tensors(c.concatenated_sum(params, grads), params)
            ready.update(zip(map(id, params), grads, strict=True))
        ready.update(sums_in_groups(large, c))  # what it sums leaves ``large``
        kept = {id(param): grad for param, grad in large}
        large.clear()
        handed, pending, reverse = self._handed, self._pending, self.params[::-1]
        # Last layer first (autograd's order): kept per-sample gradients are freed before the
        # embeddings' full gradients exist (lower peak than first-first; a small LM, CPU).
        order = self.layers[::-1]
        clipped_of = self._calls_by_rule(order, c)
        for layer in order:
            params = layer.params.values()
            if not (every or layer.calls or any(id(p) in kept or id(p) in ready for p in params)):
                continue
            calls, layer.calls = layer.calls, []
            clipped: dict[str, Tensor] = {}
            for _ in calls:
                for name, grad in next(clipped_of[layer.rule]).items():
                    clipped[name] = grad if name not in clipped else clipped[name] + grad
            del calls
            for name, param in reversed(layer.params.items()):
                if id(param) in handed:
                    continue
                handed.add(id(param))
                if id(param) in kept:
                    grad = weighted_sum(kept.pop(id(param)).flatten(1), c.of(param))
                elif name in clipped:
                    grad = clipped.pop(name)
                elif id(param) in ready:
                    grad = ready.pop(id(param))
                else:  # no call of this chunk reached the layer
                    grad = torch.zeros(param.shape, dtype=param.dtype, device=c.device)
                if grad.shape != param.shape:  # a view is an operator dispatch, even a no-op one
                    grad = grad.view(param.shape)
                pending[id(param)] = (param, grad)
                del grad  # not held through the next layer's clipped GEMM
                while self._next_hand < len(reverse) and id(reverse[self._next_hand]) in pending:
                    sink(*pending.pop(id(reverse[self._next_hand])))
                    self._next_hand += 1

    def _rows_of_calls(self) -> dict[int, int]:
        """Per-layer clipping: id(layer) -> the row of c [P, B] of its call (a layer's one call
        left after the backward, with one parameter), found once per layer and call's pending."""
        rows, known = {}, self._call_rows
        for layer in self.layers:
            if layer.calls:
                key = (id(layer), layer.calls[0].pending)
                row = known.get(key)
                if row is None:
                    row = known[key] = self._param_rows[id(only_parameter(layer))]
                rows[id(layer)] = row
        return rows

    def _calls_by_rule(
        self, order: list[Layer], c: ClipFactorsByParameter | None = None
    ) -> dict[NormRule, Any]:
        """A LayerCall of every call still to be done from A and G, by rule, in ``order``.
        Given c, each rule's clipped_grads_many of them instead: their clipped gradients in that
        order, made as they are asked for (a rule may share launches between its calls: each
        reads its own row of per-layer factors)."""
        by_rule: dict[NormRule, deque] = {}
        for layer in order:
            for call in layer.calls:  # tuple.__new__: no Python __new__ per call
                entry = tuple.__new__(LayerCall, (layer, call.A, call.G))
                by_rule.setdefault(layer.rule, deque()).append(entry)
        if c is None:
            return by_rule
        factors, rows = c.for_rules(self._rows_of_calls)  # rows found while layers list their calls
        return {
            rule: rule.clipped_grads_many(calls, factors, rows) for rule, calls in by_rule.items()
        }

    def routes(self) -> list[dict]:
        """Per layer of the last backward: name, T, route (Linear layers also d, p)."""
        return [dict(r) for r in self._routes]

    def kept_tensors(self) -> Iterator[tuple[nn.Module, str, Tensor]]:
        """(module, role, tensor) for every tensor the engine holds for a managed module between
        its forward and release(): the saved inputs A and output gradients G ("activation_hooks")
        and the per-sample gradients formed from them ("per_sample_gradients")."""
        for module, A in self._recorded_inputs():  # between the forward and the backward
            yield module, "activation_hooks", A
        for layer in self.layers:
            for call in layer.calls:
                for tensor in call.tensors():
                    yield layer.module, "activation_hooks", tensor
            for grad in layer.per_sample.values():
                yield layer.module, "per_sample_gradients", grad

    def release(self) -> None:
        """Drop saved activations, output gradients and leaves (call after each chunk)."""
        self._drop_held()
        self.tape.clear()
        self._replay = None

    def rearm(self) -> None:  # what the first of two backwards left dropped (its norms made)
        self._drop_held()
        super().rearm()

    def _drop_held(self) -> None:
        for layer in self.layers:
            layer.calls, layer.per_sample, layer.described = [], {}, []
        self._norms, self._after_backward, self._small, self._batch = None, False, None, None

    @contextlib.contextmanager
    def autograd_gradients(self):
        """Inside, the tape records nothing and autograd forms .grad, as unwrapped: at one sample,
        the per-sample gradient (DDP at one sample per rank). Every layer's route: "autograd"."""
        self.tape.idle = True
        self._routes = [{"layer": layer.name, "route": "autograd"} for layer in self.layers]
        for p in self.params:
            p.requires_grad_(True)
        try:
            yield
        finally:
            self.tape.idle = False
            for p in self.params:
                p.requires_grad_(False)

    def remove(self) -> None:
        """Take off the taped forwards and make the managed parameters trainable again."""
        if self.checkpointed is not None and self.checkpointed.make == self.checkpoint_contexts:
            self.checkpointed.reset()
        self.tape.group_done = None
        self.release()
        self._remove_forwards()
        for p in self.params:
            p.requires_grad_(True)
