"""A layer flash manages: its module, norm rule and parameters, and what is kept for it between
its forward and release() (the A and G of each call, per-sample gradients)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

DEFAULT_BLOCK_NUMEL = 64 * 2**20  # largest intermediate of the direct route, in elements


class UnsupportedLayerError(ValueError):
    """A layer owns trainable parameters but no norm rule is registered for its type."""


def only_parameter(layer: Layer) -> nn.Parameter:
    """The one parameter a layer's calls left to A and G (per-layer clipping needs its norm
    alone)."""
    pending = set().union(*(call.pending for call in layer.calls))
    if len(pending) != 1:
        raise UnsupportedLayerError(
            f"layer {layer.name!r}: its rule computes one norm for the parameters "
            f"{sorted(pending)}; per-layer clipping needs one per parameter"
        )
    (name,) = pending
    return layer.params[name]


class Call:
    """One forward call of a managed layer still to be done from A, its input ([B, T, d]), and
    G, its output gradient; ``pending``: the names of the parameters still to be done from them;
    ``after``: those of pending formed per sample right after the backward (the rule's
    formed_after_backward). Made with no arguments and filled in (no Python __init__: one is
    made for every layer call of a step, and a Python call per layer is what the engine avoids)."""

    __slots__ = ("A", "G", "pending", "after")

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.A, self.G) if t is not None]


@dataclass
class Layer:
    """A managed module and what its rule needs; A/G are [B, T, features] (ids: [B, T])."""

    name: str
    module: nn.Module
    # Its layer type's NormRule (flash.rules). Not imported here: the rules read Layer, and a
    # type-only import back would make the two modules a circle.
    rule: Any
    params: dict[str, nn.Parameter]  # managed (trainable) parameters, by attribute name
    route: str = "auto"
    tile_size: int = 512
    block_numel: int = DEFAULT_BLOCK_NUMEL
    # From the rule, once (the taped forward reads them on every call): the layer's op, called
    # as compute(module, x); whether A is the autocast cast the op multiplies (made once, handed
    # to the op); the trailing feature dims of (input, output).
    compute: Any = None
    casts_input: bool = False
    formed_in_backward: bool = False  # the rule's: G by a hook, formed mid-backward
    feature_dims: tuple[int, int] = (1, 1)
    calls: list[Call] = field(default_factory=list)  # one per forward call, in order
    # Per-sample gradients [B, ...] by parameter name, formed in or right after the backward
    # instead of keeping A and G for the rest of the step (summed over calls: a reused module's
    # gradient is the sum).
    per_sample: dict[str, Tensor] = field(default_factory=dict)
    described: list[dict] = field(default_factory=list)  # the route of each call, for routes()
    plans: dict[tuple, tuple] = field(default_factory=dict)  # FlashClipping._plan's, by shapes


class LayerCall(NamedTuple):
    """One call still to be done from its A and G, as the engine hands it to its layer's rule
    (the rules' ``*_many`` methods take lists of them)."""

    layer: Layer
    A: Tensor
    G: Tensor


class GradRequest(NamedTuple):
    """A call whose per-sample gradients of ``names`` the rule forms right after the backward."""

    layer: Layer
    A: Tensor
    G: Tensor
    names: set[str]


def flatten_tokens(x: Tensor, feature_dims: int) -> Tensor:
    """View [B, ..., features] as [B, T, prod(features)] ([B, T] when no feature dims)."""
    if feature_dims == 0:
        return x.reshape(x.shape[0], -1)
    if feature_dims == 1:  # Linear: the common case, without math.prod
        # already [B, T, d] (most calls): no reshape op (flash is host-bound with LoRA)
        return x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
    return x.reshape(x.shape[0], -1, math.prod(x.shape[x.dim() - feature_dims :]))


def join_calls(layer: Layer, calls: list[Call]) -> list[Call]:
    """A layer's calls still to be done from A and G, joined: a reused module's gradient is
    the sum over its calls."""
    pending = set().union(*(call.pending for call in calls))
    if pending & layer.per_sample.keys():  # other calls formed these per sample: join
        for call in calls:
            grads = layer.rule.per_sample_grads(layer, call.A, call.G, call.pending)
            add_per_sample(layer, grads)
        layer.described = [dict(d, route="product") for d in layer.described]
        return []
    if len(calls) == 1:
        return calls
    # Concatenated along T; the route is decided again on the joined T: report that one.
    A = torch.cat([call.A for call in calls], 1)
    G = torch.cat([call.G for call in calls], 1)
    layer.described = [{"layer": layer.name, "T": A.shape[1], **layer.rule.describe(layer, A, G)}]
    kept = layer.rule.kept_per_sample(layer, A, G) & pending
    if kept:
        add_per_sample(layer, layer.rule.per_sample_grads(layer, A, G, kept))
    if not pending - kept:
        return []
    call = Call()
    call.A, call.G, call.pending = A, G, frozenset(pending - kept)
    call.after = frozenset()  # what the rule forms after the backward was formed per call
    return [call]


def add_per_sample(layer: Layer, grads: dict[str, Tensor]) -> None:
    """Sum a further call's per-sample gradients into the layer's."""
    if not layer.per_sample:
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


def tensors_in(obj) -> Iterator[Tensor]:
    """The tensors in a tensor or nested lists and tuples of them (Opacus' grad_sample lists)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
