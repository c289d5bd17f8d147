"""What flash's hooks keep of each managed layer between its forward and release(): its input A
(a forward hook, and a forward pre-hook where the rule hands the layer the cast it keeps) and its
output gradient G (a pre-hook on the output's autograd node), and the per-sample gradients a rule
forms from them in the backward hook or once enough are held (norm layers).

Under autocast a Linear's A is kept in the autocast dtype (the cast the layer multiplies, handed
to it so it makes none of its own). Layers reading one input (q, k, v) share it. Norm layers'
per-sample gradients ([B, d]) are formed after their backward hook, several layers in one launch,
once their held A and G pass DEFERRED_BYTES or right after the backward. Where a Linear's
per-sample gradients are no larger than its A and G (d*p <= T*(d+p)), the hook forms them at once
(one batched GEMM, the FLOPs of the weight gradient it replaces) and drops A and G."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import Tensor

from dp_cost.flash.layer import Call, GradRequest, Layer, flatten_tokens
from dp_cost.flash.precision import device_type
from dp_cost.flash.rules import NormRule

# A and G held in the backward only for per-sample gradients a rule forms after it (norm
# layers: NormRule.formed_after_backward) are formed as soon as they exceed this many bytes,
# several layers' in one launch: fewer launches than one per layer in its hook (the 1b model has
# 41 LayerNorms, a host-bound step at short sequences), for about this much memory more (plus
# the call that crosses it; bytes of the views held, not of storages they keep alive).
DEFERRED_BYTES = 512 * 2**20


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


class LayerCapture:
    """The hooks' half of FlashClipping (dp_cost.flash.engine): registers them on ``layers`` and
    keeps, per layer, each call's A and G (Layer.calls) and the per-sample gradients formed so
    far (Layer.per_sample)."""

    def __init__(self, layers: list[Layer]):
        self.layers = layers
        # Hooks, not a wrapped forward: they run for copies and replicas of a module too
        # (DataParallel, copy.copy), and whatever wraps its forward later.
        self._handles = [handle for layer in layers for handle in self._hook(layer)]
        self._leaves: list[Tensor] = []
        # id(input) -> its SavedInput, this forward's: q, k and v (LoRA: their lora_A) read one
        # input but other managed calls come in between.
        self._saved: dict[int, SavedInput] = {}
        self._after_backward = False
        self._idle = False  # inside FlashClipping.autograd_gradients(): hooks keep nothing
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
        device = device_type(x)
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
                x = _layer_input(args, kwargs)
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
