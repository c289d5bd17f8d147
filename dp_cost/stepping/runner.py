"""The Runner owns a training step: a logical batch as physical chunks (near-equal, or padded to
one size with per-sample weights), stand-ins for a rank with fewer samples, the decisions every
rank takes alike, CUDA graphs (capture, replay, fallback to eager), the phase events' observer
and the count of steps. A trainer (``stepping.protocol.Trainer``) is the algorithm inside: the
forward and backward of one chunk, and the finish of a logical batch."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dp_cost.stepping import chunks, graph
from dp_cost.stepping.protocol import Chunk, PhaseEvents, StepPlan

if TYPE_CHECKING:
    from dp_cost.parallel.mode import SingleProcess
    from dp_cost.stepping.protocol import Trainer


class Runner:
    """Runs one logical batch per ``step`` through ``trainer``, which updates ``model``:
    ``{"loss", "physical_step_times_ms"}``. ``batch_size``: the expected (global) logical batch;
    ``max_physical_batch_size``: the chunk cap (None: the logical batch)."""

    def __init__(
        self,
        trainer: Trainer,
        model,
        *,
        batch_size: int,
        max_physical_batch_size: int | None,
        mode: SingleProcess,
        phases: PhaseEvents,
        cuda_graph: bool = False,
        name: str = "",
    ):
        self.trainer, self.mode, self.phases, self.name = trainer, mode, phases, name
        self.model = model  # as the trainer trains it (FSDP2: sharded), for the census
        self.batch_size = batch_size
        self.max_physical_batch_size = max_physical_batch_size or batch_size
        self.is_private = trainer.privacy is not None
        if cuda_graph and trainer.capture is None:
            raise ValueError(f"trainer {name!r} has no CaptureSupport: its step cannot be captured")
        self.steps_taken = 0
        self.graphs = graph.Replayer(cuda_graph)  # the step as CUDA graphs, if asked

    # ------------------------------------------------------------ what the measurements use
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """One logical batch: replayed once captured, else eager (and captured after, when it
        is the first step that may be)."""
        self.steps_taken += 1
        return self.graphs.step(self, inputs, targets)

    def observing_phases(self, callback: Callable[[str], None], *, also_current: bool = False):
        """Phase events to ``callback`` for one measurement, then back to the regular one
        (``also_current``: the current observer still sees them, after ``callback``)."""
        return self.phases.observing(callback, also_current=also_current)

    # ------------------------------------------------------------ the step's shapes
    def physical_size(self) -> int:
        """P, the size of a padded chunk: the physical cap, or a rank's expected share of the
        logical batch when that is smaller (without a cap, draws above it take two chunks)."""
        share = math.ceil(self.batch_size / self.mode.world_size)
        return min(self.max_physical_batch_size, share)

    def padded_chunk_count(self, busiest_batch: int, size: int) -> int:
        """How many padded chunks of ``size`` every rank runs: enough for the busiest rank. A DP
        trainer under DDP runs one even for an empty batch: its noise enters the sum over ranks
        in the last chunk, and an all-padding chunk is the noise-only step."""
        count = math.ceil(busiest_batch / size)
        if self.is_private and self.mode.replicates:
            return max(count, 1)
        return count

    # ------------------------------------------------------------ the steps
    def eager_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """Near-equal chunks, a host clock per chunk, then the trainer's finish."""
        batch = inputs.shape[0]
        busiest = self.mode.largest_batch(batch, inputs.device)
        index_sets = (
            chunks.near_equal_chunks(batch, busiest, self.max_physical_batch_size)
            if busiest
            else []
        )
        plan = StepPlan(busiest, len(index_sets))
        self.trainer.start_step(plan)
        loss_sum, chunk_times_ms = 0.0, []
        for i, index in enumerate(index_sets):
            start = time.perf_counter()
            is_last = i == len(index_sets) - 1
            # The chunk's rows are built in the call: they are freed once it returns, not held
            # through the finish (the optimizer step's peak).
            if len(index):
                index = index.to(inputs.device)
                chunk_loss = self.trainer.chunk_step(
                    Chunk(inputs[index], targets[index], None, is_last, plan)
                )
            else:  # this rank has no sample for this chunk: a stand-in weighted 0
                stand_in = chunks.stand_in_chunk(inputs, targets)
                chunk_loss = self.trainer.chunk_step(Chunk(*stand_in, is_last, plan))
            loss_sum += chunk_loss.item()  # a device sync: the host clock is valid here
            chunk_times_ms.append((time.perf_counter() - start) * 1e3)
        # An empty Poisson sample is still a step: no forward or backward, the clipped sum is
        # zero, and a DP trainer still adds its noise (Opacus does the same).
        self.trainer.finish_step(plan)
        self.phases("step_done")
        loss = self.mode.batch_mean(loss_sum, batch, inputs.device) if busiest else None
        return {"loss": loss, "physical_step_times_ms": chunk_times_ms}

    def padded_step(
        self, inputs: torch.Tensor, targets: torch.Tensor, size: int, min_chunks: int = 1
    ) -> dict:
        """The step a CUDA graph replays, run eagerly: padded chunks of exactly ``size``, then
        the finish; as eager_step, the divisor is the expected batch whatever was drawn. A
        capture warms up with it (every kernel at the chunk's shape; ``min_chunks``: all-padding
        chunks added up to that many, which change nothing); the CPU tests check padding."""
        busiest = self.mode.largest_batch(len(inputs), inputs.device)
        count = self.padded_chunk_count(busiest, size)
        if count == 0:  # nothing drawn on any rank: as eager_step's empty batch
            return self.eager_step(inputs, targets)
        plan = StepPlan(busiest, max(count, min_chunks), padded=True)
        self.trainer.start_step(plan)
        buffers = chunks.new_padded_chunk(inputs, targets, size)
        totals, chunk_times_ms = torch.zeros(2, device=inputs.device), []
        for k in range(plan.chunk_count):
            start = time.perf_counter()
            chunks.fill_chunk(buffers, inputs, targets, k * size)
            totals += self.padded_chunk_step(buffers, k == plan.chunk_count - 1, plan)
            totals[0].item()  # a device sync: the host clock is valid here
            chunk_times_ms.append((time.perf_counter() - start) * 1e3)
        self.trainer.finish_step(plan)
        self.phases("step_done")
        loss_sum, real = self.mode.sum_over_ranks(totals).tolist()
        return {"loss": loss_sum / real if real else None, "physical_step_times_ms": chunk_times_ms}

    def padded_chunk_step(self, buffers, is_last: bool, plan: StepPlan) -> torch.Tensor:
        """One padded chunk (what a CUDA graph captures): [real samples' loss sum, count]."""
        chunk_inputs, chunk_targets, weights = buffers
        loss_sum = self.trainer.chunk_step(
            Chunk(chunk_inputs, chunk_targets, weights, is_last, plan)
        )
        return torch.stack([loss_sum.float(), weights.sum()])

    @contextlib.contextmanager
    def eager(self):
        """Steps run eagerly inside (a measurement that reads the allocator's events: a replay
        allocates nothing); the graphs are kept for the steps after."""
        with self.graphs.eager():
            yield
