"""Several ranks planned in one process, without torchrun: this process as rank 0 of a fake
process group (torch's ``FakeProcessGroup``: every collective returns at once, as if the others
had sent what it receives), FSDP2's meshes built outside the fake mode, and the stand-ins the
fake step puts into ``parallel/``'s hook points for what reads values fake tensors lack: torch's
DDP (``PlannedDataParallel``) and the noise seed read on the host (no generator: nothing real is
drawn)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import _disable_current_modes

from dp_cost.parallel import collectives, ddp


@contextlib.contextmanager
def planned_ranks(world_size: int, device: str):
    """This process as rank 0 of a fake process group of ``world_size`` ranks (none for one
    rank): the trainers' collectives run and return at once, moving no data; FSDP2's meshes on
    ``device``, the fake tensors'; parallel/'s stand-ins in place for the block."""
    if world_size == 1:
        yield
        return
    # torch's own fake backend; importing the module registers it with torch.distributed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with _meshes_outside_fake_mode(device), _stand_ins():
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _meshes_outside_fake_mode(device: str):
    """FSDP2's DeviceMesh built on real tensors, on the fake tensors' device: it finds this
    rank's place in its rank map by reading the map's values, which a fake tensor does not have
    (``init_device_mesh`` passes the identity map, ``arange`` over the ranks: a fake one is
    remade as that, for real), and FSDP2 would otherwise put the shards on the machine's GPU."""
    original = DeviceMesh.__init__

    def real(value):
        if isinstance(value, FakeTensor):
            return torch.arange(value.numel(), dtype=value.dtype).view(value.shape)
        return value

    def init(self, device_type, *args, **kwargs):
        with _disable_current_modes(), unset_fake_temporarily():
            args = [real(value) for value in args]
            kwargs = {name: real(value) for name, value in kwargs.items()}
            original(self, device, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def _stand_ins():
    """parallel/'s hook points set to the fake step's stand-ins for the block, then restored."""
    saved = ddp.data_parallel_stand_in, collectives.generator_stand_in
    ddp.data_parallel_stand_in, collectives.generator_stand_in = PlannedDataParallel, _no_generator
    try:
        yield
    finally:
        ddp.data_parallel_stand_in, collectives.generator_stand_in = saved


def _no_generator(seed: torch.Tensor) -> None:
    return None  # a fake seed has no value to seed with; a fake step draws nothing real


class PlannedDataParallel(nn.Module):
    """torch's DDP as the fake step runs it (``parallel.ddp.data_parallel_stand_in``): torch's
    DDP compares the parameters' values over the ranks when built, and fake tensors have none.
    It holds what DDP holds beside the model: a flat buffer per bucket (torch's own assignment
    of the gradients to buckets, 1 MiB first, 25 MiB after), where DDP copies each gradient to
    sum it over the ranks and back; and DDP's one rebuild of its buckets (in gradient order), at
    the first forward after its first synced backward, as torch's ``_pre_forward`` does.
    Measured on H200s, that iteration held both sets on some ranks and runs and not on others:
    the old set is kept here until the next step's first forward, the most any rank took. Never
    used to train (the sums are not taken)."""

    BUCKET_BYTES = (dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20)  # DDP's defaults

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.params = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        self.assignment: list[list[int]] = []
        self.bucket_buffers = self.new_buckets()
        self.pending: dict[int, set[int]] = {}  # bucket -> its parameters not yet accumulated
        for index, parameter in enumerate(self.params):
            parameter.register_post_accumulate_grad_hook(
                lambda _, index=index: self.accumulated(index)
            )
        self.rebuilt_from: list[torch.Tensor] = []  # the old set, during the rebuild's iteration
        self.rebuilt, self.syncing, self.step_done = False, True, False

    def new_buckets(self) -> list[torch.Tensor]:
        self.assignment, _ = dist._compute_bucket_assignment_by_size(self.params, self.BUCKET_BYTES)
        return [
            self.params[bucket[0]].new_empty(sum(self.params[i].numel() for i in bucket))
            for bucket in self.assignment
        ]

    def accumulated(self, index: int) -> None:
        """Parameter ``index``'s gradient is accumulated: in a synced backward, its bucket is
        reduced once its last one is."""
        for bucket, waiting in self.pending.items():  # none in a no_sync chunk
            if index in waiting:
                waiting.discard(index)
                if not waiting:
                    self.reduce(bucket)
                return

    def reduce(self, bucket: int) -> None:
        """Bucket ``bucket``'s gradients summed over the ranks through its flat buffer."""
        buffer, offset, views = self.bucket_buffers[bucket], 0, []
        for index in self.assignment[bucket]:
            gradient = self.params[index].grad
            views.append((gradient, buffer[offset : offset + gradient.numel()]))
            views[-1][1].copy_(gradient.reshape(-1))
            offset += gradient.numel()
        dist.all_reduce(buffer)
        for gradient, view in views:
            gradient.copy_(view.view_as(gradient))

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            if self.step_done:  # a new step's first forward, after a synced (last) chunk
                self.rebuilt_from = []
                if not self.rebuilt:
                    self.rebuilt_from, self.bucket_buffers = self.bucket_buffers, self.new_buckets()
                    self.rebuilt = True
            self.step_done = self.syncing
            # the buckets this chunk's backward reduces: all of them when it syncs, else none
            self.pending = (
                {b: set(bucket) for b, bucket in enumerate(self.assignment)} if self.syncing else {}
            )
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
