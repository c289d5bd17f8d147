"""Does a change of code keep every trainer's numbers bit for bit on the CPU? Runs a pinned grid
of steps (every trainer, flat and per-layer clipping, eager and padded chunks, noise on, four
steps with a drawn batch each, one of them empty) through ``trainers.make_trainer`` and writes
each config's losses and a SHA-256 of its parameters after the steps. Run it on two checkouts
and compare the files (``--compare``); under torchrun (gloo) it runs DDP and FSDP2 with both
syncs over the launched ranks.

    python benchmarks/same_updates.py --out new.json
    torchrun --nproc_per_node 3 --standalone benchmarks/same_updates.py --out new3.json
    python benchmarks/same_updates.py --compare old.json new.json

Only the public surface is used (``make_trainer(...).step``), plus the padded step, which each
checkout names its own way.
"""

from __future__ import annotations  # noqa: I001

import argparse
import hashlib
import json
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file for this checkout's numbers")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and argument mistakes answer before torch is imported


import torch  # noqa: E402

sys.path.insert(0, os.getcwd())  # the checkout it runs from, not this file's

import models  # noqa: E402
import trainers  # noqa: E402
from dp_cost.parallel.mode import distributed_mode  # noqa: E402

SMALL = models.ModelConfig(
    vocab_size=37, hidden_dim=16, num_layers=2, num_heads=2, mlp_dim=24, max_seq_len=32
)
SEQ = 12
DRAWS = (7, 0, 2, 5)  # global batch sizes of the steps: one empty, one of one a rank on two
BATCH, PHYSICAL = 6, 2  # expected batch (the divisor) and the chunk cap


def padded_step(runner, inputs, targets, size):
    """The step a CUDA graph replays, run eagerly, however the checkout names it."""
    if hasattr(runner, "padded_step"):
        return runner.padded_step(inputs, targets, size)
    from dp_cost.stepping import chunks  # the layout before the Runner

    return chunks.padded_step(runner, inputs, targets, size)


def physical_size(runner) -> int:
    if hasattr(runner, "physical_size"):
        return runner.physical_size()
    from dp_cost.stepping import chunks

    return chunks.physical_size(runner)


def grid(world_size: int):
    modes = [("none", "chunk")] if world_size == 1 else [
        ("ddp", "chunk"), ("fsdp", "chunk"), ("fsdp", "logical")
    ]  # fmt: skip
    for distributed, fsdp_sync in modes:
        for name in ("standard", "dpsgd", "ghost", "flash"):
            for clipping in ("flat", "per_layer"):
                if name == "standard" and clipping == "per_layer":
                    continue
                for padded in (False, True):
                    if padded and name not in ("standard", "flash"):
                        continue
                    if padded and distributed_mode(distributed).shards:
                        continue  # no graph captures FSDP2's step: it runs no padded chunks
                    why = trainers.refusal(name, distributed, padded, False, fsdp_sync, clipping)
                    if why is None:
                        yield name, distributed, fsdp_sync, clipping, padded


def run(name, distributed, fsdp_sync, clipping, padded, rank, world_size) -> dict:
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    runner = trainers.make_trainer(
        name, model, lr=0.5, batch_size=BATCH, max_physical_batch_size=PHYSICAL,
        max_grad_norm=0.05, noise_multiplier=0.7, distributed=distributed,
        fsdp_sync=fsdp_sync, clipping=clipping,
    )  # fmt: skip
    torch.manual_seed(100 + rank)
    losses = []
    for step, drawn in enumerate(DRAWS):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(SMALL.vocab_size, (drawn, SEQ + 1), generator=generator)
        share = range(rank * drawn // world_size, (rank + 1) * drawn // world_size)
        inputs = tokens[share.start : share.stop, :-1].contiguous()
        targets = tokens[share.start : share.stop, 1:].contiguous()
        if padded:
            out = padded_step(runner, inputs, targets, physical_size(runner))
        else:
            out = runner.step(inputs, targets)
        losses.append(out["loss"])
    digest = hashlib.sha256()
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        digest.update(local.detach().contiguous().numpy().tobytes())
    return {"losses": losses, "parameters_sha256": digest.hexdigest()}


def compare(old_path: str, new_path: str) -> int:
    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    differ = [key for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
    for key in differ:
        print(f"differs: {key}: {old.get(key)} -> {new.get(key)}")
    print(f"{len(old)} configs before, {len(new)} after; {len(differ)} differ")
    return 1 if differ else 0


def main() -> int:
    args = build_parser().parse_args()
    if args.compare:
        return compare(*args.compare)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:
        torch.distributed.init_process_group("gloo")
    results = {}
    for config in grid(world_size):
        key = "/".join(str(part) for part in (*config, f"{world_size}ranks"))
        results[key] = run(*config, rank, world_size)
        # each rank's own parameters (its FSDP2 shards): every rank's digest, rank by rank
        if world_size > 1:
            every = [None] * world_size
            torch.distributed.all_gather_object(every, results[key]["parameters_sha256"])
            results[key]["parameters_sha256"] = every
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
        print(f"{len(results)} configs -> {args.out}")
    if world_size > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
