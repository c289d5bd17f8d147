"""Run by torchrun (2 ranks, gloo, CPU) from test_distributed_updates.py: flash's DP step on a
model with a data-dependent branch that only rank 0's samples take (as routing to experts
would), in small buckets; rank 0 saves the summed gradient (FSDP2's shards gathered)."""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from one_step_per_rank import full_gradients, gathering_recorded  # noqa: E402

import trainers  # noqa: E402
from dp_cost.flash import sinks as buckets  # noqa: E402
from dp_cost.parallel import ranks  # noqa: E402
from tests.torchrun_exit import leave_without_teardown  # noqa: E402

# Rank 0 holds the samples with token 0, which take the branch; rank 1's do not.
INPUTS = torch.tensor([[0, 1, 2, 3], [0, 2, 4, 6], [1, 2, 3, 4], [5, 6, 7, 8]])
TARGETS = (INPUTS + 1) % 11
# One sample per rank, the same split (flash under DDP then gathers per-sample gradients).
ONE_PER_RANK = slice(1, 3)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.first = nn.Embedding(11, 8), nn.Linear(8, 8)
        self.expert = nn.Linear(8, 8)  # called only for a batch holding token 0
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 11)

    def forward(self, ids):
        hidden = self.first(self.embed(ids))
        if (ids == 0).any():
            hidden = hidden + self.expert(hidden)
        return self.head(self.norm(hidden).tanh())


def build() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def run_variant(
    distributed: str, one_per_rank: bool, bf16: bool, info, clipping: str = "flat"
) -> torch.Tensor:
    """flash's step on the branchy model; every rank returns the full summed gradient.
    ``bf16``: every per-sample gradient sent in bf16; ``clipping``: flat or per_layer."""
    defaults = buckets.SMALL_GRADIENT_NUMEL, buckets.BUCKET_BYTES, buckets.ALL_REDUCE_BUCKET_BYTES
    if bf16:
        buckets.SMALL_GRADIENT_NUMEL = 0  # every parameter "large": sent in the step's dtype
    buckets.BUCKET_BYTES = buckets.ALL_REDUCE_BUCKET_BYTES = 600  # several buckets, weights alone
    rows = ONE_PER_RANK if one_per_rank else slice(None)
    inputs, targets = INPUTS[rows], TARGETS[rows]
    mine = ranks.share(len(inputs), info.rank, info.world_size)
    model = build()
    trainer = trainers.make_trainer(
        "flash", model, lr=1.0, batch_size=len(inputs), max_grad_norm=0.05,
        noise_multiplier=0.0, distributed=distributed,
        dtype=torch.bfloat16 if bf16 else torch.float32, clipping=clipping,
    )  # fmt: skip
    gathered = gathering_recorded(trainer)
    trainer.step(inputs[mine.start : mine.stop], targets[mine.start : mine.stop])
    assert gathered() == (distributed == "ddp" and one_per_rank)
    grads = full_gradients(model)  # on every rank: FSDP2 gathers the shards collectively
    buckets.SMALL_GRADIENT_NUMEL, buckets.BUCKET_BYTES, buckets.ALL_REDUCE_BUCKET_BYTES = defaults
    return grads


def main():
    """Each ``--variants`` entry ("ddp|fsdp,one_per_rank 0|1,bf16 0|1[,flat|per_layer]") in one
    process group; rank 0 saves {variant: gradient}."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = ranks.from_environment()
    dist.init_process_group("gloo")
    saved = {}
    for variant in args.variants:
        distributed, one_per_rank, bf16, *clipping = variant.split(",")
        saved[variant] = run_variant(distributed, one_per_rank == "1", bf16 == "1", info, *clipping)
    if info.rank == 0:
        torch.save(saved, args.out)
    dist.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
