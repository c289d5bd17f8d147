"""torch's DistributedDataParallel for the standard trainer: gradients summed over the ranks
(the trainers' 1/B is already the global batch's), and what a CUDA graph capture of its step
needs (torch's CUDA graphs notes): DDP built on a side stream, and its iterations counted."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
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


class PlannedDataParallel(nn.Module):
    """DDP as the capacity prediction runs it, on fake tensors: torch's DDP compares the
    parameters' values over the ranks when built, and fake tensors have none. It holds what
    DDP holds beside the model: a flat buffer per bucket (torch's own assignment of the
    gradients to buckets, 1 MiB first, 25 MiB after), where DDP copies each gradient to sum it
    over the ranks and back; and DDP's one rebuild of its buckets (in gradient order), at the
    first forward after its first synced backward, as torch's ``_pre_forward`` does. Measured
    on H200s, that iteration held both sets on some ranks and runs and not on others: the old
    set is kept here until the next step's first forward, the most any rank took. Never used
    to train (the sums are not taken)."""

    BUCKET_BYTES = (dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20)  # DDP's defaults

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.params = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        self.bucket_buffers = self.new_buckets()
        self.rebuilt_from: list[torch.Tensor] = []  # the old set, during the rebuild's iteration
        self.rebuilt, self.syncing, self.step_done = False, True, False

    def new_buckets(self) -> list[torch.Tensor]:
        assignment, _ = dist._compute_bucket_assignment_by_size(self.params, self.BUCKET_BYTES)
        return [
            self.params[bucket[0]].new_empty(sum(self.params[i].numel() for i in bucket))
            for bucket in assignment
        ]

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            if self.step_done:  # a new step's first forward, after a synced (last) chunk
                self.rebuilt_from = []
                if not self.rebuilt:
                    self.rebuilt_from, self.bucket_buffers = self.bucket_buffers, self.new_buckets()
                    self.rebuilt = True
            self.step_done = self.syncing
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def captures_after_this(self) -> bool:
        return False


def data_parallel(model: nn.Module, for_capture: bool = False) -> DataParallel:
    """torch's DDP (its bucketed all-reduce overlaps the backward), summing instead of
    averaging. ``for_capture`` (by a CUDA graph): built on a side stream, as torch's CUDA graphs
    notes ask (the gradient accumulators DDP keeps are then not the default stream's), and
    never timing an iteration after its first 10 (DDP would time every 100th)."""
    if isinstance(next(model.parameters()), FakeTensor):
        return PlannedDataParallel(model)
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
