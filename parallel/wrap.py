"""How a trainer's model and gradients are spread over the ranks: torch's DDP and FSDP2, and
the collectives flash's clipped gradients take (torch.distributed's, no other communication).

Gradients are SUMMED over ranks everywhere: every trainer scales its loss (or clip factors) by
1/B of the global batch, so the sum over ranks is the single-process mean over that batch.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from parallel.ranks import RankInfo

# A collective that waits this long is a failure (a rank died or ran out of memory): recorded as
# an error for the config rather than a hang. The CLI stops the other ranks' workers much sooner
# when one rank's worker ends badly; this is the backstop.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def init_worker_group(info: RankInfo, prefix: str, device: torch.device) -> None:
    """The default process group of one config's workers (one per rank), on the job's store
    under ``prefix``: each config gets a fresh group, as each gets fresh processes."""
    store = dist.TCPStore(
        info.master_addr, info.master_port, is_master=False, timeout=GROUP_TIMEOUT
    )
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(prefix, store),
        rank=info.rank,
        world_size=info.world_size,
        timeout=GROUP_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (the members of the outermost nn.ModuleLists): FSDP's units."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        for block in module:
            blocks.append(block)
            inside.update(id(m) for m in block.modules())
    return blocks


def shard(model: nn.Module, units: str) -> nn.Module:
    """FSDP2 over ``model`` in place, in FSDP_UNITS[units]."""
    return FSDP_UNITS[units](model)


def shard_blocks(model: nn.Module) -> nn.Module:
    """Each transformer block one FSDP2 unit (all-gathered for its forward and backward, then
    resharded), the rest in the root unit; gradients summed over ranks (FSDP2 averages by
    default; the trainers' 1/B is already the global batch's)."""
    for block in transformer_blocks(model):
        fully_shard(block)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (NCCL would otherwise use PreMulSum by 1.0, which gloo lacks).
            module.set_force_sum_reduction_for_comms(True)
    return model


FSDP_UNITS = {
    "blocks": shard_blocks,
    # Opacus' FSDP2 path (ghost clipping): every layer it has a norm sampler for is its own
    # unit (its hooks need that layer's parameters whole); gradients averaged over ranks, as
    # Opacus' FSDP optimizer expects.
    "opacus_layers": FSDP2Wrapper,
}


def _all_reduce_sum_hook(state, bucket):
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def data_parallel(model: nn.Module) -> DistributedDataParallel:
    """torch's DDP (its bucketed all-reduce overlaps the backward), summing instead of
    averaging."""
    device = next(model.parameters()).device
    wrapped = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    wrapped.register_comm_hook(None, _all_reduce_sum_hook)
    return wrapped


def broadcast_parameters(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters (as DDP does on wrapping)."""
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param.data, 0)


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sum each tensor over the ranks, in place: tensors of one dtype packed into buckets of
    about BUCKET_BYTES (one collective per bucket, not per tensor: hundreds of LoRA tensors)."""
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    for tensor in tensors:
        groups = buckets.setdefault((tensor.dtype, tensor.device), [[]])
        size = sum(t.numel() for t in groups[-1]) * tensor.element_size()
        if groups[-1] and size + tensor.numel() * tensor.element_size() > BUCKET_BYTES:
            groups.append([])
        groups[-1].append(tensor)
    for groups in buckets.values():
        for group in groups:
            if len(group) == 1:
                dist.all_reduce(group[0])
                continue
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat)
            torch._foreach_copy_(
                group,
                [
                    p.view_as(t)
                    for p, t in zip(flat.split([t.numel() for t in group]), group, strict=True)
                ],
            )


class ShardedGradients:
    """flash's sink under FSDP2: each parameter's full clipped sum is reduce-scattered over the
    ranks straight into that parameter's shard (.grad, a DTensor like the parameter), then
    dropped, so at most one layer's unsharded gradient exists at a time.

    FSDP2 shards dimension 0 as torch.chunk does (ceil(n / W) rows per rank, the last ranks
    shorter or empty); the reduce-scatter input is padded to W equal pieces to match."""

    def __init__(self):
        self.world_size = dist.get_world_size()

    def __call__(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if not isinstance(param, DTensor):  # a parameter FSDP left unsharded (none today)
            raise TypeError(f"expected an FSDP2-sharded parameter, got {type(param).__name__}")
        rows = -(-full.shape[0] // self.world_size)
        padding = rows * self.world_size - full.shape[0]
        if padding:
            full = torch.cat([full, full.new_zeros((padding, *full.shape[1:]))])
        piece = full.new_empty((rows, *full.shape[1:]))
        dist.reduce_scatter_tensor(piece, full.contiguous())
        local = piece[: param.to_local().shape[0]].to(param.dtype)
        if param.grad is None:
            param.grad = DTensor.from_local(
                local,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        else:
            param.grad.to_local().add_(local)


def local_gradients(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The tensors a rank holds of each parameter's .grad (a DTensor's local shard)."""
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]


def batch_mean(total: float, count: int, device: torch.device, distributed: str) -> float:
    """total / count, summed over the ranks when distributed (the loss of the global batch)."""
    if distributed == "none":
        return total / count
    both = torch.tensor([total, count], dtype=torch.float64, device=device)
    dist.all_reduce(both)
    return (both[0] / both[1]).item()


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
def weighted_zero(trainer, stand_in: bool):
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


def largest_batch(batch: int, device: torch.device, distributed: str) -> int:
    """The largest of the ranks' batches (a Poisson draw's slices differ by one at most)."""
    if distributed == "none":
        return batch
    largest = torch.tensor([batch], dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item())
