"""The distributed mode of a run as one object: what differs between one process, DDP and FSDP2
(each rank's share of a batch, sums over the ranks, the config directory's suffix, what a CUDA
graph cannot capture).

Built from the mode's name and the number of ranks alone, without a process group, so the plan
and any planning code use the same object as the trainers. Importing it costs no torch (the
settings table and the reports read it); the collectives are imported by the methods that run
them, on ranks that already have torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dp_cost.core.schema import FSDP_SYNCS
from dp_cost.parallel.ranks import share

if TYPE_CHECKING:
    import torch


def fsdp_sync_refusal(distributed: str, fsdp_sync: str) -> str | None:
    """Why ``fsdp_sync`` cannot go with ``--distributed distributed`` (None: it can), whatever
    the trainer: the plan's usage error and make_trainer's refusal alike."""
    if fsdp_sync not in FSDP_SYNCS:
        return f"fsdp_sync must be one of {', '.join(FSDP_SYNCS)}, got {fsdp_sync!r}"
    if holds_sync_to_last_chunk(fsdp_sync) and not distributed_mode(distributed).shards:
        return "--fsdp_sync applies to --distributed fsdp (FSDP2's reduce-scatters)"
    return None


def holds_sync_to_last_chunk(fsdp_sync: str) -> bool:
    """Whether FSDP2's gradient sync waits for a logical batch's last chunk (``fsdp_sync``
    "logical") rather than following every chunk: the one place its value is read."""
    return fsdp_sync == "logical"


@dataclass(frozen=True)
class SingleProcess:
    """One process, no process group: sums over ranks are the identity."""

    world_size: int = 1
    name: ClassVar[str] = "none"
    is_distributed: ClassVar[bool] = False
    replicates: ClassVar[bool] = False  # every rank holds the whole model (DDP)
    shards: ClassVar[bool] = False  # every rank holds a shard of each parameter (FSDP2)
    graph_refusal: ClassVar[str | None] = None  # why --cuda_graph cannot capture its step

    def batch_share(self, total: int, rank: int) -> range:
        """Indices of rank ``rank``'s share of a global batch of ``total`` samples."""
        return share(total, rank, self.world_size)

    def dir_part(self) -> str | None:
        """The config directory's suffix (none for one process)."""
        return None

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, on the device (no host sync)."""
        return tensor

    def batch_mean(self, total: float, count: int, device: torch.device) -> float:
        """total / count over the global batch (the loss of a step)."""
        return total / count

    def on_every_rank(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on every rank: a decision the ranks take alike."""
        return flag

    def largest_batch(self, batch: int, device: torch.device) -> int:
        """The largest of the ranks' batches."""
        return batch


@dataclass(frozen=True)
class OverRanks(SingleProcess):
    """Several ranks of one torchrun job, in an initialised default process group (for the
    methods that communicate)."""

    is_distributed: ClassVar[bool] = True

    def dir_part(self) -> str | None:
        return f"_{self.name}{self.world_size}x"

    def sum_over_ranks(self, tensor):
        from dp_cost.parallel import collectives

        return collectives.summed_over_ranks(tensor)

    def batch_mean(self, total, count, device):
        from dp_cost.parallel import collectives

        return collectives.batch_mean(total, count, device)

    def on_every_rank(self, flag, device):
        from dp_cost.parallel import collectives

        return collectives.on_every_rank(flag, device)

    def largest_batch(self, batch, device):
        from dp_cost.parallel import collectives

        return collectives.largest_batch(batch, device)


@dataclass(frozen=True)
class DataParallel(OverRanks):
    """torch's DDP for standard (Opacus' DPDDP for its trainers); flash keeps no wrapper and
    sums its clipped gradients itself."""

    name: ClassVar[str] = "ddp"
    replicates: ClassVar[bool] = True


@dataclass(frozen=True)
class FullyShardedDataParallel(OverRanks):
    """FSDP2: each rank holds a shard of every parameter; gradients reduce-scattered into the
    shards after every chunk, or (fsdp_sync "logical") after the last."""

    name: ClassVar[str] = "fsdp"
    shards: ClassVar[bool] = True
    graph_refusal: ClassVar[str | None] = (
        "--cuda_graph captures the step of one process or of DDP: FSDP2 decides on the host when "
        "to gather and free each unit's parameters (run --distributed fsdp without --cuda_graph)"
    )


# By name, in the order of core.schema.DISTRIBUTED_MODES (the --distributed choices; a test
# keeps the two equal).
MODES: dict[str, type[SingleProcess]] = {
    mode.name: mode for mode in (SingleProcess, DataParallel, FullyShardedDataParallel)
}


def distributed_mode(name: str, world_size: int = 1) -> SingleProcess:
    """The mode object of ``--distributed name`` over ``world_size`` ranks (ValueError if
    unknown): the one place the mode's name is read."""
    if name not in MODES:
        raise ValueError(f"--distributed must be one of {', '.join(MODES)}, got {name!r}")
    mode = MODES[name]
    return mode(world_size if mode.is_distributed else 1)  # one process is one rank


def sharded_modes() -> tuple[str, ...]:
    """The names of the modes over several ranks (DDP, FSDP2), in --distributed's order."""
    return tuple(name for name, mode in MODES.items() if mode.is_distributed)
