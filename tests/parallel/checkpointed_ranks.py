"""Run on 2 ranks (gloo, CPU) by test_distributed_updates.py: flash under DDP on a model of two
checkpointed blocks, the second with a branch (an "expert") that only rank 0's samples take.
Prints one JSON line on rank 0: for each clipping rule, the largest difference between the
checkpointed model's gradients and the same model's without checkpointing (the several-rank
sinks must send every parameter in one order on every rank, whichever layers a rank reached);
and the largest difference between the two replicas after a step of 2 samples a rank
and then a step of 1 a rank, each replica adding the same noise after the sum."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import trainers  # noqa: E402
from dp_cost.core import recompute  # noqa: E402
from dp_cost.flash import sinks  # noqa: E402
from dp_cost.parallel import ranks  # noqa: E402
from tests.torchrun_exit import leave_without_teardown  # noqa: E402

INPUTS = torch.tensor([[0, 1, 2, 3], [0, 2, 4, 6], [1, 2, 3, 4], [5, 6, 7, 8]])
TARGETS = (INPUTS + 1) % 11


class Branchy(nn.Module):
    """Embedding, two blocks (the second's expert taken where a sample holds token 0), a head."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.embed, self.first = nn.Embedding(11, 8), nn.Linear(8, 8)
        self.second, self.expert = nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 11)
        self.contexts = recompute.attach(self) if checkpointed else None

    def block0(self, h):
        return h + self.first(h).tanh()

    def block1(self, h, ids):
        h = h + self.second(h).tanh()
        return h + self.expert(h) if (ids == 0).any() else h

    def forward(self, ids):
        h = self.embed(ids)
        if self.contexts is not None:
            h = checkpoint(self.block0, h, use_reentrant=False, context_fn=self.contexts)
            h = checkpoint(self.block1, h, ids, use_reentrant=False, context_fn=self.contexts)
        else:
            h = self.block1(self.block0(h), ids)
        return self.head(self.norm(h).tanh())


def gradients(rank: int, clipping: str, checkpointed: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = Branchy(checkpointed)
    trainer = trainers.make_trainer(
        "flash", model, lr=1.0, batch_size=4, max_grad_norm=0.05, noise_multiplier=0.0,
        distributed="ddp", clipping=clipping,
    )  # fmt: skip
    mine = slice(2 * rank, 2 * rank + 2)  # rank 0's samples hold token 0, rank 1's do not
    trainer.step(INPUTS[mine], TARGETS[mine])
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def replicas_apart(rank: int) -> float:
    torch.manual_seed(0)
    model = Branchy(checkpointed=True)
    trainer = trainers.make_trainer(
        "flash", model, lr=1.0, batch_size=4, max_grad_norm=0.05, noise_multiplier=1.0,
        distributed="ddp",
    )  # fmt: skip
    torch.manual_seed(123 + rank)  # the ranks' torch seeds differ, as in a run
    trainer.step(INPUTS[2 * rank : 2 * rank + 2], TARGETS[2 * rank : 2 * rank + 2])  # summed
    trainer.step(INPUTS[rank : rank + 1], TARGETS[rank : rank + 1])  # gathered: 1 a rank
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    return float((both[0] - both[1]).abs().max())


def main():
    info = ranks.from_environment()
    dist.init_process_group("gloo")
    sinks.BUCKET_BYTES = sinks.ALL_REDUCE_BUCKET_BYTES = 600  # the blocks' weights sent alone
    found = {}
    for clipping in ("per_layer", "flat"):
        plain, checkpointed = (gradients(info.rank, clipping, c) for c in (False, True))
        found[clipping] = float((plain - checkpointed).abs().max())
    found["replicas_apart"] = replicas_apart(info.rank)
    if info.rank == 0:
        print(json.dumps(found))
    dist.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
