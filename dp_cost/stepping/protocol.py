"""What a trainer is to the Runner (``stepping.runner``) and to the measurements: a DP algorithm,
or the non-private baseline, with eight members. The Runner owns everything around it (chunks,
padding and stand-ins, per-sample weights, CUDA graphs, the decisions the ranks take alike, the
phase events' observer); a trainer does the forward and backward of one chunk, the finish of a
logical batch (clip, noise, optimizer), and says what it holds and what it promises.

Both sides import these types; nothing here runs a step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dp_cost.core.schema import AllocationSite


@dataclass(frozen=True)
class StepPlan:
    """One logical batch's decisions, taken by the Runner alike on every rank.

    ``busiest_batch``: the largest rank's share of the batch; ``chunk_count``: the chunks every
    rank runs (0: nothing drawn on any rank, the finish alone, a DP trainer's noise);
    ``padded``: chunks of one fixed size with per-sample weights, the step a CUDA graph
    replays for any drawn size."""

    busiest_batch: int
    chunk_count: int
    padded: bool = False

    @property
    def is_empty(self) -> bool:
        return self.chunk_count == 0


@dataclass(frozen=True)
class Chunk:
    """One physical chunk of a logical batch. ``weights`` [n]: each sample's loss is multiplied
    by its weight (1 real, 0 a padding or stand-in row: no gradient, no norm, no share of the
    clipped sum), a tensor so a captured graph reads each replay's; None: every row is real."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor | None
    is_last: bool
    plan: StepPlan


@dataclass(frozen=True)
class PrivacyDescription:
    """What a DP trainer promises, as the accountant reads it: the sampler of its Gaussian noise
    (``noise.laws.NOISE_LAWS``), how far above C one sample's clipped contribution may reach
    relative to C (its norms' rounding; the sensitivity is (1 + margin) C), the number of noised
    coordinates, and the result's ``clipping`` record (read after the steps: device counters)."""

    noise_sampler: str
    sensitivity_margin: float
    noised_dimension: int
    clipping_record: Callable[[], dict]


@dataclass(frozen=True)
class MemoryRoles:
    """Where a trainer's state lives now: ``tensors`` as (role, owner, tensor), most specific
    role first (``core.schema.ROLES``; a storage reachable several ways takes the first), and
    ``sites``: which functions' allocations have which role, for blocks no identity names."""

    tensors: list[tuple[str, str, torch.Tensor]]
    sites: list[AllocationSite]


@dataclass(frozen=True)
class CaptureSupport:
    """What a CUDA graph capture of a trainer's step needs from it: the generators each replay
    must advance (read at capture: a trainer may make one in its first eager step) and whether
    the next eager step may be followed by a capture (torch's DDP times its first iterations)."""

    generators: Callable[[], list[torch.Generator]] = list
    ready: Callable[[], bool] = lambda: True


class Trainer(Protocol):
    """A trainer as the Runner steps it and the measurements observe it: eight members."""

    parameters: list[nn.Parameter]  # what the optimizer updates (and a DP trainer noises)
    capture: CaptureSupport | None  # None: its step makes host syncs, no graph captures it
    privacy: PrivacyDescription | None  # None: not private

    def start_step(self, plan: StepPlan) -> None:
        """Forget the last step's gradients and anything a step that did not finish left."""

    def chunk_step(self, chunk: Chunk) -> torch.Tensor:
        """Forward and backward of one chunk (clipped and accumulated by a DP trainer); returns
        the sum of its samples' weighted losses, a 0-dim tensor on the device (no host sync)."""

    def finish_step(self, plan: StepPlan) -> None:
        """The logical batch's end: what clips after the chunks, the noise, the optimizer."""

    def memory(self) -> MemoryRoles: ...

    def result_extras(self) -> dict:
        """Result keys of its own (flash: the route of each layer)."""


class PhaseEvents:
    """The phase points of a step (``optimizer_created``, ``privacy_wrapped``, per chunk
    ``forward_done``/``backward_done``, per step ``step_done``; ``_`` names mark state the
    memory breakdown sees by identity), sent to one observer at a time. A trainer calls it;
    the Runner lends the observer to one measurement at a time."""

    def __init__(self, observer: Callable[[str], None] | None = None):
        self._observer = observer or _ignore

    def __call__(self, name: str) -> None:
        self._observer(name)

    @contextlib.contextmanager
    def observing(self, callback: Callable[[str], None], *, also_current: bool = False):
        """``callback`` observes inside (``also_current``: before the current observer, which
        still sees every event)."""
        saved = self._observer
        if also_current:
            self._observer = lambda name: (callback(name), saved(name))
        else:
            self._observer = callback
        try:
            yield
        finally:
            self._observer = saved


def _ignore(name: str) -> None:
    return None


__all__ = [
    "CaptureSupport",
    "Chunk",
    "MemoryRoles",
    "PhaseEvents",
    "PrivacyDescription",
    "StepPlan",
    "Trainer",
]
