"""FSDP2's units over a model (dp_cost.parallel.fsdp) on a one-rank gloo group in this process:
which blocks a block's backward all-gathers ahead, and that the setting leaves the gradients as
they are."""

import copy

import pytest
import torch
from torch import nn

from dp_cost.parallel import fsdp


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).sum()


def prefetched(block) -> list[int]:
    """The ids of the FSDP2 states a block's backward prefetches by its own list."""
    return [id(state) for state in block._get_fsdp_state()._states_to_backward_prefetch]


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_each_block_all_gathers_the_blocks_before_it(one_rank, monkeypatch, ahead):
    monkeypatch.setattr(fsdp, "BACKWARD_PREFETCH_BLOCKS", ahead)
    torch.manual_seed(0)
    whole = Blocks()
    model = fsdp.shard(copy.deepcopy(whole), "blocks")
    states = [id(block._get_fsdp_state()) for block in model.blocks]
    for i, block in enumerate(model.blocks):
        # 1: FSDP2's own default (the next block, by the forward's order), no list of its own
        want = [] if ahead == 1 else [states[j] for j in range(i - 1, max(-1, i - ahead - 1), -1)]
        assert prefetched(block) == want, i
    x = torch.randn(3, 6)
    model(x).backward()
    whole(x).backward()
    for sharded, plain in zip(model.parameters(), whole.parameters(), strict=True):
        assert torch.allclose(sharded.grad.full_tensor(), plain.grad, atol=1e-6)
