"""A logical batch as physical chunks: run eagerly (a host clock per chunk), or for a CUDA graph
capture (no host sync)."""

from __future__ import annotations

import time

import torch

from parallel import wrap


def eager_step(trainer, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """Zero the gradients, forward and backward each chunk (clipped and accumulated by a DP
    trainer), then the optimizer step (noise included): ``{"loss", "physical_step_times_ms"}``."""
    trainer.optimizer.zero_grad(set_to_none=True)
    batch = inputs.shape[0]
    largest = wrap.largest_batch(batch, inputs.device, trainer.distributed)
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
        x, y, stand_in = wrap.chunk_of(inputs, targets, index.to(inputs.device))
        with wrap.weighted_zero(trainer, stand_in):
            chunk_loss = trainer.chunk_step(x, y, is_last=i == len(chunk_list) - 1)
        loss_sum += chunk_loss.item()  # a device sync: the host clock is valid here
        chunk_times_ms.append((time.perf_counter() - start) * 1e3)
    trainer.optimizer_step()
    trainer.on_phase("step_done")
    loss = wrap.batch_mean(loss_sum, batch, inputs.device, trainer.distributed)
    return {"loss": loss, "physical_step_times_ms": chunk_times_ms}


def device_step(trainer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
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
    return wrap.summed_over_ranks(torch.stack(chunk_losses).sum(), trainer.distributed)
