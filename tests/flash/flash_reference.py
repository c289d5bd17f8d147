"""Brute-force references for the flash tests: a tiny LM with every layer type flash has a rule
for, per-sample gradients by autograd one sample at a time (its loss or any function of a
model), and one flash step to compare."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, PAD = 11, 0


class TinyLM(nn.Module):
    """Token + positional embeddings, LayerNorm, GELU MLP, RMSNorm, per-token logits."""

    def __init__(self, d=8, hidden=12, max_len=300):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d)
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d, bias=False)
        self.rms = nn.RMSNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device).expand(B, T))
        x = x + self.down(F.gelu(self.up(self.ln(x))))
        return self.head(self.rms(x))


def make_batch(B, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=gen)
    if T >= 3:
        ids[:, 1] = ids[:, 0]  # repeated token id within a sample
        ids[:, 2] = PAD
    targets = torch.randint(0, VOCAB, (B, T), generator=gen)
    return ids, targets


def sample_losses(logits, targets):
    """Mean cross-entropy over each sample's tokens, shape [B]."""
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return losses.view(targets.shape).mean(1)


def make_model(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = TinyLM().to(dtype)
    with torch.no_grad():  # non-trivial norm affine params
        for m in (model.ln, model.rms):
            m.weight.add_(0.3 * torch.randn_like(m.weight))
        model.ln.bias.add_(0.3 * torch.randn_like(model.ln.bias))
    return model


def _per_sample_rows(model, ids, targets):
    """[B, P]: each sample's gradient of its loss over all parameters, by autograd."""
    params = list(model.parameters())
    rows = []
    for b in range(len(ids)):
        loss = sample_losses(model(ids[b : b + 1]), targets[b : b + 1]).sum()
        grads = torch.autograd.grad(loss, params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def _clipped_sum(per_sample, norms, max_norm):
    clip = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return clip, (clip[:, None] * per_sample).sum(0)


def brute_force(model, ids, targets, max_norm=None):
    """Per-sample gradients one sample at a time on an untouched copy of the model."""
    per_sample = _per_sample_rows(model, ids, targets)
    norms = per_sample.norm(dim=1)
    if max_norm is None:
        return norms, None, None
    return norms, *_clipped_sum(per_sample, norms, max_norm)


def brute_force_at_median(model, ids, targets):
    """brute_force on a copy of ``model`` with max_norm the median per-sample norm (some samples
    clipped, some not), the per-sample gradients formed once: (norms, max_norm, clip, sum)."""
    per_sample = _per_sample_rows(copy.deepcopy(model), ids, targets)
    norms = per_sample.norm(dim=1)
    max_norm = norms.median()
    return norms, max_norm, *_clipped_sum(per_sample, norms, max_norm)


def flash_step(flash, model, ids, targets, max_norm):
    """One chunk: forward, one backward, norms, clip factors, accumulate, release."""
    flash.backward(sample_losses(model(ids), targets).sum())
    norms = flash.per_sample_squared_norms().sqrt()
    flash.accumulate_clipped_grads((max_norm / (norms + 1e-6)).clamp(max=1.0))
    routes = flash.routes()
    flash.release()
    return norms, routes


def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def assert_close(actual, expected, rtol):
    err = (actual - expected).abs().max() / expected.abs().max()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def per_sample_grads_of(run, model, x: torch.Tensor) -> torch.Tensor:
    """[B, P]: each sample's gradient over all of model's parameters, flattened, from
    run(model, x[b : b + 1]).sum(), one sample at a time with autograd."""
    params = list(model.parameters())
    rows = []
    for b in range(x.shape[0]):
        grads = torch.autograd.grad(run(model, x[b : b + 1]).sum(), params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


class RecordingSink:
    """A sink that keeps a copy of every clipped sum it is handed, and its finish calls."""

    def __init__(self):
        self.got, self.order, self.finished = {}, [], []

    def __call__(self, param, grad):
        assert not self.finished, "a sum handed over after finish"
        self.got.setdefault(id(param), []).append(grad.clone())
        self.order.append(param)

    def finish(self, params):
        self.finished.append(list(params))
