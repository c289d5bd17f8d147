"""A logical batch as physical chunks: run eagerly (near-equal chunks, a host clock per chunk),
or as padded chunks of one fixed size P, each sample's loss weighted (1 real, 0 padding), which
is the step a CUDA graph captures once and replays for any drawn batch size."""

from __future__ import annotations

import contextlib
import math
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
        is_last = i == len(chunk_list) - 1
        if len(index):
            index = index.to(inputs.device)
            chunk_loss = trainer.chunk_step(inputs[index], targets[index], is_last=is_last)
        else:
            # Every rank runs as many chunks as the rank with the most samples (FSDP2
            # all-gathers in each chunk's forward): a rank with none for this chunk runs a
            # padded chunk of one stand-in, weighted 0 (its gradient, norm and share are 0).
            stand_in = new_padded_chunk(inputs, targets, 1)
            fill_chunk(stand_in, inputs, targets, len(inputs))
            chunk_loss = padded_chunk_step(trainer, stand_in, is_last)[0]
        loss_sum += chunk_loss.item()  # a device sync: the host clock is valid here
        chunk_times_ms.append((time.perf_counter() - start) * 1e3)
    trainer.optimizer_step()
    trainer.on_phase("step_done")
    loss = trainer.distributed_mode.batch_mean(loss_sum, batch, inputs.device)
    return {"loss": loss, "physical_step_times_ms": chunk_times_ms}


def physical_size(trainer: SteppingTrainer) -> int:
    """P, the fixed size of a padded chunk: the physical cap, or a rank's expected share of the
    logical batch when that is smaller (without a cap, draws above it take two chunks)."""
    return min(trainer.max_physical_batch_size, math.ceil(trainer.batch_size / trainer.world_size))


def padded_chunk_count(trainer: SteppingTrainer, batch: int, size: int, device) -> int:
    """How many padded chunks of ``size`` every rank runs for this step: enough for the rank with
    the most samples. A DP trainer under DDP runs one even for an empty batch: its noise enters
    the sum over ranks in the last chunk, and an all-padding chunk is the noise-only step."""
    count = math.ceil(trainer.distributed_mode.largest_batch(batch, device) / size)
    if trainer.is_private and trainer.distributed_mode.replicates:
        return max(count, 1)
    return count


def fill_chunk(chunk, inputs: torch.Tensor, targets: torch.Tensor, start: int) -> int:
    """Write padded chunk ``chunk`` = (inputs, targets, weights), each of P rows, in place: the
    batch's samples from ``start`` (weight 1), then stand-ins weighted 0. A stand-in copies the
    batch's first sample, so its loss is finite (0 * NaN would be NaN); with no sample at all
    the chunk keeps the rows it had (finite: zeros or an earlier batch's). Returns how many
    samples are real."""
    chunk_inputs, chunk_targets, weights = chunk
    size = len(weights)
    real = max(0, min(size, len(inputs) - start))
    if real:
        chunk_inputs[:real].copy_(inputs[start : start + real])
        chunk_targets[:real].copy_(targets[start : start + real])
    if real < size and len(inputs):
        chunk_inputs[real:].copy_(inputs[:1].expand(size - real, *inputs.shape[1:]))
        chunk_targets[real:].copy_(targets[:1].expand(size - real, *targets.shape[1:]))
    torch.lt(torch.arange(size, device=weights.device), real, out=weights)
    return real


def new_padded_chunk(inputs: torch.Tensor, targets: torch.Tensor, size: int):
    """(inputs, targets, weights) buffers of one padded chunk of ``size`` rows, zeros."""
    return (
        inputs.new_zeros((size, *inputs.shape[1:])),
        targets.new_zeros((size, *targets.shape[1:])),
        torch.zeros(size, device=inputs.device),
    )


def padded_chunk_step(trainer: SteppingTrainer, chunk, is_last: bool) -> torch.Tensor:
    """One padded chunk's step (what a CUDA graph captures): forward and backward with each
    sample's loss times its weight, so a stand-in has no gradient, no norm and no share of the
    clipped sum. Returns [sum of the real samples' losses, their count], on the device."""
    chunk_inputs, chunk_targets, weights = chunk
    with weighted(trainer, weights):
        loss_sum = trainer.chunk_step(chunk_inputs, chunk_targets, is_last=is_last)
    return torch.stack([loss_sum.float(), weights.sum()])


def padded_step(
    trainer: SteppingTrainer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    size: int,
    min_chunks: int = 1,
) -> dict:
    """The step a CUDA graph replays, run eagerly: the batch as padded chunks of exactly
    ``size`` samples, then the optimizer step; as eager_step, the divisor is the expected batch
    whatever was drawn or padded. A capture warms up with it (every kernel at the chunk's
    shape; ``min_chunks``: all-padding chunks added up to that many, which change nothing), and
    the CPU tests check the padding with it."""
    trainer.optimizer.zero_grad(set_to_none=True)
    count = padded_chunk_count(trainer, len(inputs), size, inputs.device)
    if count == 0:  # nothing drawn on any rank: as eager_step's empty batch
        return eager_step(trainer, inputs, targets)
    count = max(count, min_chunks)
    trainer.prepare_padded_chunks()
    chunk = new_padded_chunk(inputs, targets, size)
    totals, chunk_times_ms = torch.zeros(2, device=inputs.device), []
    for k in range(count):
        start = time.perf_counter()
        fill_chunk(chunk, inputs, targets, k * size)
        totals += padded_chunk_step(trainer, chunk, is_last=k == count - 1)
        totals[0].item()  # a device sync: the host clock is valid here
        chunk_times_ms.append((time.perf_counter() - start) * 1e3)
    trainer.optimizer_step()
    trainer.on_phase("step_done")
    loss_sum, real = trainer.distributed_mode.sum_over_ranks(totals).tolist()
    return {"loss": loss_sum / real if real else None, "physical_step_times_ms": chunk_times_ms}


@contextlib.contextmanager
def weighted(trainer: SteppingTrainer, weights: torch.Tensor):
    """While a chunk runs, the trainer's per-sample losses are multiplied by ``weights`` [n]:
    a tensor, so a captured graph reads each replay's weights (no Python switch)."""
    loss = trainer.per_sample_loss
    trainer.per_sample_loss = lambda model, x, y: loss(model, x, y) * weights
    try:
        yield
    finally:
        trainer.per_sample_loss = loss
