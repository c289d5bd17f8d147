"""The clipping rule of the DP trainers (--clipping): flat, one bound C on each sample's
gradient over every trainable parameter, or per-layer, Opacus' ``per_layer`` rule: each
parameter tensor's per-sample gradient clipped to its own C_l, with sum_l C_l^2 <= C^2, so a
sample moves the clipped sum by at most C and the noise and the accountant stay those of C.
The budget is split equally, C_l = C / sqrt(P) over the P trainable parameter tensors.

Per-layer results record each C_l and how many samples each parameter's bound clipped
(``ClippedCounts``), counted on the device without a host sync."""

from __future__ import annotations

import enum
import math
from fractions import Fraction

import torch

from dp_cost.core.schema import CLIPPINGS

__all__ = [
    "CLIPPINGS",
    "ClippedCounts",
    "ClippingRule",
    "clipping_refusal",
    "layer_max_grad_norm",
    "merged_record",
]


def clipping_refusal(clipping: str) -> str | None:
    """Why ``clipping`` is no rule (None: it is one): make_trainer's refusal and a trainer built
    directly alike."""
    if clipping not in CLIPPINGS:
        return f"clipping must be one of {', '.join(CLIPPINGS)}, got {clipping!r}"
    return None


class ClippingRule(enum.Enum):
    """The clipping rule, parsed once from its name (``parse``): the one place it is read."""

    FLAT = "flat"
    PER_LAYER = "per_layer"

    @property
    def per_layer(self) -> bool:
        return self is ClippingRule.PER_LAYER

    @classmethod
    def parse(cls, name: str | None) -> ClippingRule:
        """The rule named ``name`` (None: flat); ValueError with clipping_refusal's reason."""
        if reason := clipping_refusal(name or cls.FLAT.value):
            raise ValueError(reason)
        return cls(name or cls.FLAT.value)


def layer_max_grad_norm(max_grad_norm: float, parameter_count: int) -> float:
    """C_l = C / sqrt(P), rounded toward zero until P * C_l^2 <= C^2 holds exactly (a float
    rounded up would let the P bounds together exceed the sensitivity the noise is for)."""
    if parameter_count <= 0:
        raise ValueError("per-layer clipping needs at least one trainable parameter")
    bound = max_grad_norm / math.sqrt(parameter_count)
    while Fraction(bound) ** 2 * parameter_count > Fraction(max_grad_norm) ** 2:
        bound = math.nextafter(bound, 0.0)
    return bound


class ClippedCounts:
    """Per parameter, how many samples its bound clipped (clip factor < 1), and how many samples
    were counted, over every chunk a trainer clipped: device counters, read once by
    ``record``. A sample without any gradient (a stand-in of an empty chunk, weighted 0) is not
    counted."""

    def __init__(self, names: list[str], max_grad_norm: float, layer_bound: float):
        self.names, self.max_grad_norm, self.layer_bound = names, max_grad_norm, layer_bound
        self.clipped: torch.Tensor | None = None  # [P], int64
        self.samples: torch.Tensor | None = None  # [], int64

    def add(self, squared_norms: torch.Tensor, factors: torch.Tensor) -> None:
        """One chunk's per-parameter squared norms and clip factors, both [P, B]."""
        if self.clipped is None:  # made in an eager step, before any capture reads them
            self.clipped = torch.zeros(len(self.names), dtype=torch.int64, device=factors.device)
            self.samples = torch.zeros((), dtype=torch.int64, device=factors.device)
        counted = squared_norms.sum(0) > 0
        self.clipped += ((factors < 1) & counted).sum(1)
        self.samples += counted.sum()

    def record(self) -> dict:
        """The result's ``clipping`` entry: the rule, C, and per parameter its C_l, the samples
        its bound clipped and their fraction of the counted samples."""
        samples = int(self.samples) if self.samples is not None else 0
        clipped = self.clipped.tolist() if self.clipped is not None else [0] * len(self.names)
        return {
            "rule": "per_layer",
            "max_grad_norm": self.max_grad_norm,
            "samples": samples,
            "parameters": [
                {
                    "name": name,
                    "max_grad_norm": self.layer_bound,
                    "clipped_samples": count,
                    "clipped_fraction": count / samples if samples else None,
                }
                for name, count in zip(self.names, clipped, strict=True)
            ],
        }


def merged_record(records: list[dict]) -> dict:
    """One ``clipping`` entry from every rank's (each counted its own samples): the counts
    summed, the fractions of the sum."""
    merged = dict(records[0])
    if merged.get("rule") != "per_layer":
        return merged
    samples = sum(r["samples"] for r in records)
    parameters = []
    for entries in zip(*(r["parameters"] for r in records), strict=True):
        count = sum(e["clipped_samples"] for e in entries)
        fraction = count / samples if samples else None
        parameters.append(dict(entries[0], clipped_samples=count, clipped_fraction=fraction))
    return dict(merged, samples=samples, parameters=parameters)
