"""A logical batch as physical chunks: run eagerly (a host clock per chunk), or for a CUDA graph
capture (no host sync)."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dp_cost.stepping.protocol import SteppingTrainer


def eager_step(trainer: SteppingTrainer, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """Zero the gradients, forward and backward each chunk (clipped and accumulated by a DP
    trainer), then the optimizer step (noise included): ``{"loss", "physical_step_times_ms"}``."""
    trainer.optimizer.zero_grad(set_to_none=True)
    batch = inputs.shape[0]
    largest = trainer.distributed_mode.largest_batch(batch, inputs.device)
    if largest == 0:
        # An empty Poisson sample is still a step: no forward or backward, the clipped sum
        # is zero, and a DP trainer still adds its noise (Opacus does the same).
        trainer.empty_batch_gradients()
        trainer.optimizer_step()
        trainer.on_phase("step_done")
        return {"loss": None, "physical_step_times_ms": []}
    chunk_list = trainer.chunks(batch, largest)
    loss_sum, chunk_times_ms = 0.0, []
    for i, index in enumerate(chunk_list):
        start = time.perf_counter()
        x, y, stand_in = chunk_of(inputs, targets, index.to(inputs.device))
        with weighted_zero(trainer, stand_in):
            chunk_loss = trainer.chunk_step(x, y, is_last=i == len(chunk_list) - 1)
        loss_sum += chunk_loss.item()  # a device sync: the host clock is valid here
        chunk_times_ms.append((time.perf_counter() - start) * 1e3)
    trainer.optimizer_step()
    trainer.on_phase("step_done")
    loss = trainer.distributed_mode.batch_mean(loss_sum, batch, inputs.device)
    return {"loss": loss, "physical_step_times_ms": chunk_times_ms}


def device_step(
    trainer: SteppingTrainer, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The step as the graph captures it: the chunks, chunk steps and optimizer step of the
    trainer's eager step (a non-empty batch; under DDP every rank's share of a full one, so
    each rank's is the largest) with no host sync; the sum of the per-sample losses stays on
    the device, summed over the ranks. The chunks are contiguous (tensor_split of a range), so
    each is a slice: indexing would copy its index to the device."""
    trainer.optimizer.zero_grad(set_to_none=True)
    chunk_list = trainer.chunks(inputs.shape[0], inputs.shape[0])
    chunk_losses = []
    for i, index in enumerate(chunk_list):
        chunk = slice(int(index[0]), int(index[-1]) + 1)
        last = i == len(chunk_list) - 1
        chunk_losses.append(trainer.chunk_step(inputs[chunk], targets[chunk], is_last=last))
    trainer.optimizer_step()
    return trainer.distributed_mode.sum_over_ranks(torch.stack(chunk_losses).sum())


def chunk_of(inputs: torch.Tensor, targets: torch.Tensor, index: torch.Tensor):
    """(inputs, targets, stand_in) of one physical chunk. Every rank runs as many chunks as the
    rank with the most samples (FSDP2 all-gathers in each chunk's forward); a rank with fewer
    samples gets an empty chunk, which runs one stand-in sample instead (a copy of its first, or
    zeros when it has none) whose loss weighs 0: its gradient, norm and clipped sum are 0."""
    if len(index):
        return inputs[index], targets[index], False
    if len(inputs):
        return inputs[:1], targets[:1], True
    return (
        inputs.new_zeros((1, *inputs.shape[1:])),
        targets.new_zeros((1, *targets.shape[1:])),
        True,
    )


@contextlib.contextmanager
def weighted_zero(trainer: SteppingTrainer, stand_in: bool):
    """While a stand-in chunk runs, the trainer's per-sample loss is multiplied by 0."""
    if not stand_in:
        yield
        return
    loss = trainer.per_sample_loss
    trainer.per_sample_loss = lambda model, x, y: loss(model, x, y) * 0
    try:
        yield
    finally:
        trainer.per_sample_loss = loss
