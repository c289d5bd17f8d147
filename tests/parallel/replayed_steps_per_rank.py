"""Run by torchrun (NCCL, one GPU per rank) from test_distributed_updates.py: standard and
flash under DDP with --cuda_graph, stepping on Poisson-like draws of a global batch (their sizes
cycle through ``--draws``, each rank its slice) until every draw size was replayed; rank 0
saves each step's gradient and drawn size (lr 0: the parameters stay, so a brute force of the
initial model on the draw is every step's reference)."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from one_step_per_rank import full_gradients, gathering_recorded  # noqa: E402
from test_trainers import SMALL, make_batch  # noqa: E402

import models  # noqa: E402
import trainers  # noqa: E402
from dp_cost.parallel import ranks  # noqa: E402
from tests.torchrun_exit import leave_without_teardown  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", required=True, help="batch,physical each")
    parser.add_argument("--draws", nargs="+", type=int, default=None, help="sizes, cycled")
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--max_grad_norm", type=float, default=0.05)
    parser.add_argument("--noise_multiplier", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = ranks.from_environment()
    device = torch.device("cuda", info.local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    saved = {}

    def draw(samples):  # this rank's slice of a global draw of ``samples``
        inputs, targets = make_batch(samples, args.seq, seed=3)
        mine = ranks.share(samples, info.rank, info.world_size)
        return inputs[mine.start : mine.stop].to(device), targets[mine.start : mine.stop].to(device)

    for case in args.cases:
        samples, physical = map(int, case.split(","))
        draws = args.draws or [samples]
        for name in ("standard", "flash"):
            torch.manual_seed(0)
            model = models.build_model(SMALL).to(device)  # the CPU reference's weights
            trainer = trainers.make_trainer(
                name, model, lr=0.0, batch_size=samples, max_physical_batch_size=physical,
                max_grad_norm=args.max_grad_norm, noise_multiplier=args.noise_multiplier,
                distributed="ddp", cuda_graph=True,
            )  # fmt: skip
            print(f"rank {info.rank}: {case} {name}", flush=True)  # where a hang would be
            gathered = gathering_recorded(trainer)
            grads, losses, sizes, agree = [], [], [], True
            replays = max(2, len(draws))
            while (
                trainer.graphs.counts()["replays"] < replays and trainer.steps_taken < 20 + replays
            ):
                sizes.append(draws[trainer.steps_taken % len(draws)])
                losses.append(trainer.step(*draw(sizes[-1]))["loss"])
                grad = full_gradients(model)
                rank0 = grad.clone()
                dist.broadcast(rank0, 0)
                agree = agree and torch.equal(grad, rank0)  # every step's, noise included
                grads.append(grad.cpu())
            saved[case, name] = {
                "grads": grads,
                "losses": losses,
                "sizes": sizes,
                "replays": trainer.graphs.counts()["replays"],
                "eager_steps": trainer.steps_taken - trainer.graphs.counts()["replays"],
                "error": trainer.graphs.error,
                "replicas_agree": bool(agree),
                "gathered": gathered() if name == "flash" else None,
            }
    if info.rank == 0:
        torch.save(saved, args.out)
    dist.barrier(device_ids=[device.index])
    leave_without_teardown()


if __name__ == "__main__":
    main()
