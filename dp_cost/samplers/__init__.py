"""Opacus per-layer samplers registered over stock Opacus 1.6 where it computes the wrong thing.

Opacus keeps one grad sampler (hooks mode) and one norm sampler (ghost mode) per layer type in a
registry; a module here registers a replacement for one layer type, importing registers it.
- ``embedding``: ``nn.Embedding`` with ``padding_idx``. torch gives the pad row no gradient;
  stock Opacus gives it each sample's pad-position gradients (hooks moves the pad row, ghost
  counts a gradient that does not exist in the norms).
"""

from dp_cost.samplers import embedding  # noqa: F401 - importing registers the samplers
