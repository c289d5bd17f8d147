"""What the stepping code and the measurements ask of a trainer, as a typed Protocol: the
trainers (``dp_cost.training``) provide it, and nothing outside them reads more of a trainer."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dp_cost.core.schema import AllocationSite
    from dp_cost.parallel.mode import SingleProcess


class GraphReplayer(Protocol):
    """A trainer's CUDA graph state, as the measurements read it (stepping.graph.Replayer)."""

    enabled: bool
    capture_peak_bytes: int | None

    def counts(self) -> dict: ...

    def step(
        self, trainer: SteppingTrainer, inputs: torch.Tensor, targets: torch.Tensor
    ) -> dict: ...

    def eager(self) -> AbstractContextManager: ...

    def result(self) -> dict: ...


class SteppingTrainer(Protocol):
    """A trainer as ``stepping/`` runs its step and ``measure/`` observes it."""

    name: str
    is_private: bool
    model: nn.Module
    batch_size: int  # the expected (global) logical batch: the averaging divisor
    max_physical_batch_size: int  # the chunk cap (the logical batch when not given)
    world_size: int
    distributed_mode: SingleProcess
    optimizer: torch.optim.Optimizer
    graphs: GraphReplayer  # its CUDA graph, when --cuda_graph (stepping.graph.Replayer)
    noise_generator: torch.Generator | None  # a noise generator of its own (a graph tracks it)
    steps_taken: int
    # Per-sample losses of a chunk, [n] (a padded or stand-in chunk swaps in a weighted one).
    per_sample_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    on_phase: Callable[[str], None]

    # ---- the step, as stepping/ runs it
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict: ...

    def chunks(self, batch: int, largest: int | None = None) -> list[torch.Tensor]: ...

    def prepare_padded_chunks(self) -> None: ...

    def chunk_step(self, inputs: torch.Tensor, targets: torch.Tensor, is_last: bool) -> Any: ...

    def empty_batch_gradients(self) -> None: ...

    def optimizer_step(self) -> None: ...

    def captures_after_this(self) -> bool: ...

    def discard_step_state(self) -> None: ...

    # ---- what the measurements read
    def observing_phases(self, callback: Callable[[str], None]) -> AbstractContextManager: ...

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]: ...

    def state_tensors(self) -> list[tuple[str, str, torch.Tensor]]: ...

    def allocation_sites(self) -> list[AllocationSite]: ...

    def result_extras(self) -> dict: ...
