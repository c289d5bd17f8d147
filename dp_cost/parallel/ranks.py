"""Which rank of a torchrun job this process is (torch-free: the CLI checks it before import).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every process it
starts; a key-value store (torch's TCPStore) listens at MASTER_ADDR:MASTER_PORT for the whole job
(torchrun's agent holds it when TORCHELASTIC_USE_AGENT_STORE=True, else rank 0 must host it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def agent_hosts_store(self) -> bool:
        """torchrun's agent hosts the store (rank 0 need not)."""
        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def from_environment(environ=None) -> RankInfo | None:
    """This process's rank under torchrun, or None when not started by torchrun (or a launcher
    that sets the same variables). A partial or malformed set is a ValueError."""
    environ = os.environ if environ is None else environ
    present = [name for name in TORCHRUN_VARIABLES if name in environ]
    if not present:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    if missing:
        raise ValueError(
            f"{', '.join(present)} set but {', '.join(missing)} not: start the job with torchrun"
        )
    try:
        info = RankInfo(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
        )
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers") from None
    if not 0 <= info.rank < info.world_size or info.local_rank < 0:
        raise ValueError(f"RANK {info.rank} is not in 0..WORLD_SIZE-1 ({info.world_size})")
    return info


def share(total: int, rank: int, world_size: int) -> range:
    """Indices of rank ``rank``'s share of ``total`` items: near-equal contiguous slices, the
    first ``total % world_size`` ranks one longer (torch.tensor_split's split)."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))
