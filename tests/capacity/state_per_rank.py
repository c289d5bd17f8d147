"""Run by torchrun (gloo, CPU) from test_capacity.py: each config of a JSON list built, stepped
twice on this rank's share of the global batch, and what its trainer holds by role saved from
every rank (``held_state.held_state_bytes``)."""

import argparse
import json
import os
import sys

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from dp_cost.measure.config import ExperimentConfig  # noqa: E402
from dp_cost.parallel import ranks  # noqa: E402
from tests.capacity.held_state import held_state_bytes  # noqa: E402
from tests.torchrun_exit import leave_without_teardown  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", required=True, help="JSON file: a list of config fields")
    parser.add_argument("--out", required=True, help="JSON file: per config, each rank's bytes")
    args = parser.parse_args()
    with open(args.configs) as f:
        fields = json.load(f)
    info = ranks.from_environment()
    dist.init_process_group("gloo")
    mine = [
        held_state_bytes(ExperimentConfig(**f, world_size=info.world_size), info.rank,
                         info.world_size)
        for f in fields
    ]  # fmt: skip
    every = [None] * info.world_size
    dist.all_gather_object(every, mine)
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump([[rank[i] for rank in every] for i in range(len(fields))], f)
    dist.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
