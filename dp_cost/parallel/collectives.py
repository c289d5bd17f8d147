"""The process group of one config's workers, and the few collectives every trainer's step
takes outside the gradients: the start from rank 0's parameters, a noise generator seeded alike
on every rank (or per rank, from one seed), and sums over the ranks of a loss or a flag.
torch.distributed's collectives, no other communication."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from dp_cost.parallel.ranks import RankInfo

# A collective that waits this long is a failure (a rank died or ran out of memory): recorded as
# an error for the config rather than a hang. The CLI stops the other ranks' workers much sooner
# when one rank's worker ends badly; this is the backstop.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


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


def broadcast_parameters(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters (as DDP does on wrapping)."""
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param.data, 0)


# Mixed into rank 0's seed by each rank (an odd 64-bit constant, the golden ratio's): Philox
# keyed by distinct seeds gives independent streams.
RANK_SEED_STRIDE = 0x9E3779B97F4A7C15


# Set, what seeded_generator returns instead of a generator seeded on the host:
# ``generator_stand_in(seed)``, the seed tensor broadcast from rank 0. A step whose tensors hold
# no values (the capacity planner's, on fake tensors) has no seed to read and sets its stand-in
# here for its length. None in every run that trains.
generator_stand_in: Callable[[torch.Tensor], torch.Generator | None] | None = None


def seeded_generator(device: torch.device, per_rank: bool = False) -> torch.Generator | None:
    """A noise generator from rank 0's seed: alike on every rank (the same noise on every
    replica), or, ``per_rank``, that seed mixed with the rank's number (independent noise on
    each FSDP2 shard, whatever each rank's torch seed). Reads the seed on the host: made once,
    in an eager step (never while a graph captures)."""
    seed = torch.randint(2**62, (1,), device=device)
    dist.broadcast(seed, 0)
    if generator_stand_in is not None:
        return generator_stand_in(seed)
    mixed = int(seed.item()) + (RANK_SEED_STRIDE * dist.get_rank() if per_rank else 0)
    return torch.Generator(device).manual_seed(mixed % 2**63)


def batch_mean(total: float, count: int, device: torch.device) -> float:
    """total / count summed over the ranks (the loss of the global batch)."""
    # torch.full, not torch.tensor: a step on fake tensors (the capacity prediction) sums
    # symbolic losses, which torch.full takes and torch.tensor refuses.
    both = torch.stack(
        [torch.full((), value, dtype=torch.float64, device=device) for value in (total, count)]
    )
    dist.all_reduce(both)
    return (both[0] / both[1]).item()


def summed_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the ranks in place, on the device (no host sync: a graph
    captures it)."""
    dist.all_reduce(tensor)
    return tensor


def reduced_over_ranks(value: int, op: dist.ReduceOp, device: torch.device) -> int:
    """``value`` reduced over the ranks by ``op`` (read on the host)."""
    reduced = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(reduced, op=op)
    return int(reduced.item())


def on_every_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank: a decision the ranks must take alike."""
    return bool(reduced_over_ranks(int(flag), dist.ReduceOp.MIN, device))


def largest_batch(batch: int, device: torch.device) -> int:
    """The largest of the ranks' batches (a Poisson draw's slices differ by one at most)."""
    return reduced_over_ranks(batch, dist.ReduceOp.MAX, device)
