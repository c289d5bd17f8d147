"""flash's gathered step (DDP, one sample per rank) on a one-rank gloo group in this process:
what GatheredGradients hands over and lands, that its hooks go with a step that fails, and a
sparse embedding's gradient (the two-rank numbers are test_distributed_updates')."""

import pytest
import torch
from torch import nn

from dp_cost.flash import sinks as buckets
from dp_cost.flash.engine import FlashClipping


class Model(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.embed = nn.Embedding(11, 6, sparse=sparse)
        self.mid, self.norm, self.head = nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 11)

    def forward(self, ids):
        return self.head(self.norm(self.mid(self.embed(ids)).tanh()))


def loss_of(model, ids):
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ((ids + 1) % 11).flatten())


def post_accumulate_hooks(params):
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params)


@pytest.mark.parametrize("sparse", [False, True])
def test_landed_gradients_are_autograds(one_rank, sparse):
    torch.manual_seed(0)
    model, ids = Model(sparse), torch.tensor([[1, 3, 3, 7]])
    loss_of(model, ids).backward()
    expected = [p.grad.to_dense() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    flash = FlashClipping(model)
    with flash.autograd_gradients():
        with buckets.GatheredGradients(flash.params, torch.float32) as gathered:
            loss_of(model, ids).backward()
            assert gathered.tensors()  # sent and received, until they land
    landed = gathered.land()
    assert not gathered.tensors() and post_accumulate_hooks(flash.params) == 0
    assert all(p.grad is None for p in flash.params)  # what was sent replaced .grad
    for got, want in zip(landed, expected, strict=True):
        assert got.shape == (1, *want.shape)
        torch.testing.assert_close(got[0], want, rtol=0, atol=0)
    assert {r["route"] for r in flash.routes()} == {"autograd"}


def test_a_failed_step_leaves_no_hooks(one_rank):
    torch.manual_seed(0)
    model, ids = Model(sparse=False), torch.tensor([[1, 3, 3, 7]])
    flash = FlashClipping(model)
    with pytest.raises(RuntimeError, match="boom"):
        with flash.autograd_gradients():
            with buckets.GatheredGradients(flash.params, torch.float32):
                loss_of(model, ids).backward()
                raise RuntimeError("boom")
    assert post_accumulate_hooks(flash.params) == 0
    assert not any(p.requires_grad for p in flash.params)
