"""torch's DistributedDataParallel for the standard trainer: gradients summed over the ranks
(the trainers' 1/B is already the global batch's), and what a CUDA graph capture of its step
needs (torch's CUDA graphs notes): DDP built on a side stream, and its iterations counted."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

EAGER_ITERATIONS = 11  # DDP times its first 10 iterations: a capture follows the 11th or later


def _all_reduce_sum_hook(state, bucket):
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


class DataParallel(DistributedDataParallel):
    """torch's DDP, counting its iterations (forwards that sync gradients, as DDP counts them):
    DDP times its first 10 with CUDA events, read in the next, so a CUDA graph may capture its
    step only after the 11th (torch's CUDA graphs notes)."""

    iterations = 0

    def forward(self, *args, **kwargs):
        self.iterations += torch.is_grad_enabled() and self.require_backward_grad_sync
        return super().forward(*args, **kwargs)

    def captures_after_this(self) -> bool:
        return self.iterations >= EAGER_ITERATIONS - 1  # this eager step is the 11th or later


# Set, what data_parallel returns instead of torch's DDP: ``data_parallel_stand_in(model)``.
# torch's DDP compares the parameters' values over the ranks when built; a step whose tensors
# hold none (the capacity planner's, on fake tensors) sets its stand-in here for its length.
# None in every run that trains.
data_parallel_stand_in: Callable[[nn.Module], nn.Module] | None = None


def data_parallel(model: nn.Module, for_capture: bool = False) -> DataParallel:
    """torch's DDP (its bucketed all-reduce overlaps the backward), summing instead of
    averaging. ``for_capture`` (by a CUDA graph): built on a side stream, as torch's CUDA graphs
    notes ask (the gradient accumulators DDP keeps are then not the default stream's), and
    never timing an iteration after its first 10 (DDP would time every 100th)."""
    if data_parallel_stand_in is not None:
        return data_parallel_stand_in(model)
    device = next(model.parameters()).device
    side = torch.cuda.Stream(device) if for_capture and device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))  # the parameters DDP broadcasts
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        wrapped = DataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
        wrapped._set_ddp_runtime_logging_sample_rate(2**31 - 1)
    wrapped.register_comm_hook(None, _all_reduce_sum_hook)
    return wrapped
