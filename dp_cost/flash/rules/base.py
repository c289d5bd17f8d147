"""The NormRule interface and its registry (one rule per module type, as Opacus' grad_sample/
has one function per layer type), with the accumulation helpers the rules share."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import Tensor, nn

if TYPE_CHECKING:
    from dp_cost.flash.clip import ClipFactors
    from dp_cost.flash.layer import GradRequest, Layer, LayerCall


class NormRule:
    """Per-layer-type rule. Subclass it and register with @register_norm_rule(Type).

    Each call of a managed layer gives A (its input) and G (its output gradient). In the
    backward hook, ``kept_per_sample`` names the parameters whose per-sample gradients are formed
    at once (where they are small); ``formed_after_backward`` those formed after the hook, many
    calls' in one go (right after the backward, or earlier where only they hold A and G and the
    capture's DEFERRED_BYTES is passed); the rest are done after backward from A and G by
    ``squared_norms`` and ``clipped_grads``, which handle exactly those parameters.
    ``describe`` and ``kept_per_sample`` may depend only on the layer and the shapes of A and G:
    the engine asks once per layer and shapes, not per call.
    """

    def feature_dims(self, module: nn.Module) -> tuple[int, int]:
        """Trailing feature dims of (input, output); the rest is flattened into [B, T]."""
        return 1, 1

    # saved_input returns the very tensor the layer would compute on (a cast it would make
    # itself): the engine then makes it with its gradient and hands it to the layer in x's place.
    feeds_saved_input = False

    def saved_input(self, module: nn.Module, x: Tensor) -> Tensor:
        """What to keep as A, from the layer's input x (detached unless feeds_saved_input)."""
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

    def formed_after_backward(self, layer: Layer, A: Tensor, G: Tensor) -> set[str]:
        """Parameters, not kept per sample in the hook, whose per-sample gradients are formed
        after it from the kept A and G, many calls of the rule at once (per_sample_grads_many:
        right after the backward, or mid-backward once the calls held only for these pass the
        capture's DEFERRED_BYTES); the rest are done by squared_norms and clipped_grads."""
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

    def clipped_grads(self, layer: Layer, A: Tensor, G: Tensor, c: ClipFactors) -> dict:
        """sum_b c_b * grad_b for each parameter not kept per sample, by name."""
        raise NotImplementedError

    def clipped_grads_many(self, calls: deque[LayerCall], c: ClipFactors) -> Iterator[dict]:
        """clipped_grads of each call of ``calls`` in order, one at a time (a rule may do some
        work of several calls at once). The deque is the rule's: each call leaves it as its
        gradients are made, so its A and G are freed once the caller drops them too."""
        while calls:  # no local holds a call's tensors or gradients while suspended
            yield self.clipped_grads(*calls.popleft(), c)


NORM_RULES: dict[type, NormRule] = {}


def register_norm_rule(*layer_types: type):
    """Class decorator: register an instance of the rule for exactly these module types."""

    def register(rule_cls: type[NormRule]) -> type[NormRule]:
        for layer_type in layer_types:
            NORM_RULES[layer_type] = rule_cls()
        return rule_cls

    return register
