"""The memory role of what flash allocates, by the Python functions that allocate it: the memory
attribution (measure.breakdown) matches the function names on an allocation's stack against
these (fn.__code__.co_name)."""

from __future__ import annotations

from dp_cost.flash.engine import FlashClipping
from dp_cost.flash.layer import add_per_sample
from dp_cost.flash.rules import NORM_RULES, NormRule
from dp_cost.flash.rules.linear import direct_squared_norms, gram_squared_norms


def _rule_methods(name: str) -> tuple:
    """NormRule's method ``name`` and each registered rule's own override of it."""
    rule_types = dict.fromkeys([NormRule, *(type(rule) for rule in NORM_RULES.values())])
    return tuple(dict.fromkeys(getattr(rule_type, name) for rule_type in rule_types))


# Roles are in order of precedence: a stack holding functions of several roles gets the first
# (Gram tiles are made below per_sample_squared_norms). Overrides are listed beside their base
# method.
ALLOCATION_SITES: dict[str, tuple] = {
    # The Gram route's T x T tiles and the direct route's blocks of G_b^T A_b.
    "temp_matrices": (gram_squared_norms, direct_squared_norms),
    "norm_samples": (
        FlashClipping.per_sample_squared_norms,
        *_rule_methods("squared_norms"),
        *_rule_methods("squared_norms_many"),
    ),
    # Per-sample gradients of the layers that keep them, formed in or right after the
    # backward (per_sample_grads_many). (trainers adds those gathered under DDP.)
    "per_sample_gradients": (
        *_rule_methods("per_sample_grads"),
        *_rule_methods("per_sample_grads_many"),
        add_per_sample,
    ),
    "gradients": (*_rule_methods("clipped_grads"), FlashClipping.accumulate_clipped_grads),
}
