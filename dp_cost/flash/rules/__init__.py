"""Per-layer-type norm rules: one NormRule per module type, registered with
@register_norm_rule(Type) (as Opacus' grad_sample/ has one function per layer type).

A rule turns each call of a managed layer, its input A and output gradient G, into per-sample
gradients, per-sample squared norms and clipped gradient sums. The interface and the registry
are in ``base``; the rules for Linear, Embedding and LayerNorm/RMSNorm register themselves when
their modules are imported here.
"""

from dp_cost.flash.rules import embedding, linear, norm  # noqa: F401 - importing registers the rules
from dp_cost.flash.rules.base import NORM_RULES, NormRule, register_norm_rule

__all__ = ["NORM_RULES", "NormRule", "register_norm_rule"]
