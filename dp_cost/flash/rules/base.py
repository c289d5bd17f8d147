"""The NormRule interface and its registry (one rule per module type, as Opacus' grad_sample/
has one function per layer type), with the accumulation helpers the rules share."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import Tensor, nn

from dp_cost.flash.clip import accumulate_into_grad, stacked

if TYPE_CHECKING:
    from dp_cost.flash.clip import ClipFactors
    from dp_cost.flash.layer import GradRequest, Layer, LayerCall


class NormRule:
    """Per-layer-type rule. Subclass it and register with @register_norm_rule(Type).

    Each call of a managed layer gives A (its input) and G (its output gradient).
    ``kept_per_sample`` names the parameters whose per-sample gradients are formed right after
    the backward (where they are small); ``formed_after_backward`` others formed then too, many
    calls' in one go (per_sample_grads_many; ``formed_in_backward``: during it, as the calls'
    G arrive); the rest are done from A and G by ``squared_norms`` and ``clipped_grads``, which
    handle exactly those parameters. ``compute_for`` gives the layer's op for its taped forward;
    the ``*_many`` methods take every call of a step (a rule's loop over them should call no
    Python function per call: flash's host work should not grow with the layers).
    ``describe`` and ``kept_per_sample`` may depend only on the layer and the shapes of A and G:
    the engine asks once per layer and shapes, not per call. In a checkpointed block the
    recomputation stops after the last tensor the block's first forward saved: the op
    ``compute_for`` gives must save a tensor for autograd whenever its output is not a leaf
    (a matmul or a norm with an input that needs a gradient does), or a recomputation could
    stop before the layer and its input never arrive (an error, not a wrong update).
    """

    def feature_dims(self, module: nn.Module) -> tuple[int, int]:
        """Trailing feature dims of (input, output); the rest is flattened into [B, T]."""
        return 1, 1

    # True: every parameter's per-sample gradient is formed from A and G alone, small beside
    # them ([B, features]): flash takes G by a hook in the backward and forms them there, a few
    # layers' at once, instead of holding A and G to the backward's end.
    formed_in_backward = False

    # True: A is the input cast to the autocast dtype where autocast is on (what the layer's op
    # multiplies; the engine makes the cast and hands it to the op, which then makes none).
    casts_input = False

    def compute_for(self, module: nn.Module):
        """The function ``compute(module, x)`` that gives the module's output for input x in its
        taped forward (flash.capture): by default the module's own class forward. A rule may
        give torch's op called directly (no Python call in it: the taped forward of every
        managed layer runs it)."""
        return type(module).forward

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

    def formed_after_backward(self, layer: Layer, A: Tensor, G: Tensor) -> set[str]:
        """Parameters, not kept per sample, whose per-sample gradients are formed from the kept
        A and G right after the backward too, many calls of the rule at once
        (per_sample_grads_many); the rest are done by squared_norms and clipped_grads."""
        return set()

    def per_sample_grads_many(self, calls: list[GradRequest]) -> list[dict[str, Tensor]]:
        """per_sample_grads of each call, in order (a rule may share launches between its
        calls)."""
        return [self.per_sample_grads(layer, A, G, names) for layer, A, G, names in calls]

    def squared_norms(self, layer: Layer, A: Tensor, G: Tensor) -> Tensor:
        """Per-sample squared gradient norm [B] over the parameters not kept per sample."""
        raise NotImplementedError

    def squared_norms_many(self, calls: list[LayerCall]) -> list[Tensor]:
        """squared_norms of every call of this rule's layers in a step, as terms to be summed
        (a rule may compute several layers at once)."""
        return [self.squared_norms(layer, A, G) for layer, A, G in calls]

    def squared_norms_each(self, calls: list[LayerCall]) -> Tensor:
        """squared_norms of each call, a row each in order, [len(calls), B] (per-layer
        clipping: each layer's norm on its own; a rule may compute several layers at once)."""
        return stacked([self.squared_norms(layer, A, G) for layer, A, G in calls])

    def clipped_grads(self, layer: Layer, A: Tensor, G: Tensor, c: ClipFactors) -> dict:
        """sum_b c_b * grad_b for each parameter not kept per sample, by name."""
        raise NotImplementedError

    def accumulate_clipped_grads(
        self, calls: deque[LayerCall], c: ClipFactors, rows: dict[int, int] | None = None
    ) -> None:
        """param.grad += clipped_grads of each call (no sink): by default each of
        clipped_grads_many's in turn (a rule may do it with no Python call per layer). ``rows``
        (per-layer clipping): c is [P, B] and a call of layer L takes row rows[id(L)]."""
        layers = [call.layer for call in calls]
        for layer, grads in zip(layers, self.clipped_grads_many(calls, c, rows)):
            for name, grad in grads.items():
                accumulate_into_grad(layer.params[name], grad)

    def clipped_grads_many(
        self, calls: deque[LayerCall], c: ClipFactors, rows: dict[int, int] | None = None
    ) -> Iterator[dict]:
        """clipped_grads of each call of ``calls`` in order, one at a time (a rule may do some
        work of several calls at once); ``rows`` as in accumulate_clipped_grads. The deque is
        the rule's: each call leaves it as its gradients are made, so its A and G are freed once
        the caller drops them too."""
        while calls:  # no local holds a call's tensors or gradients while suspended
            factors = c if rows is None else c.row(rows[id(calls[0].layer)])
            yield self.clipped_grads(*calls.popleft(), factors)


NORM_RULES: dict[type, NormRule] = {}


def register_norm_rule(*layer_types: type):
    """Class decorator: register an instance of the rule for exactly these module types."""

    def register(rule_cls: type[NormRule]) -> type[NormRule]:
        for layer_type in layer_types:
            NORM_RULES[layer_type] = rule_cls()
        return rule_cls

    return register
