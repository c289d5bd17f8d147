"""Padded chunks (stepping/chunks.py), the step a CUDA graph replays for any Poisson draw, run
eagerly on the CPU: a drawn batch of n samples as ceil(n/P) chunks of exactly P rows, stand-ins
weighted 0, the divisor the expected batch. Checked against the brute-force references of
tests/test_trainers.py and tests/hf/test_hf.py on the real samples alone (noise 0), and the
noise's standard deviation (noise on)."""

import copy
import math
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from hf.test_hf import VOCAB, left_padded, offline, tiny_model, trainable  # noqa: F401 (fixture)
from hf.test_hf import reference_update as hf_reference_update
from test_trainers import SMALL, make_batch, reference_update, relative_error

import models
import trainers
from dp_cost.hf import data as hf_data
from dp_cost.hf import models as hf_models
from dp_cost.stepping import chunks

P, EXPECTED = 3, 4  # the padded chunk's rows; the expected batch (the divisor)
DRAWS = [0, 1, P - 1, P, P + 1, 3 * P - 1]  # Poisson draws around the chunk size
DRAWN = 8  # the batch each draw is a prefix of


class LM:
    """The tiny LM of tests/test_trainers.py: every parameter trainable, token losses."""

    loss_fn = None  # the trainer's default: each sample's mean token loss

    @staticmethod
    def model():
        torch.manual_seed(0)
        return models.build_model(SMALL)

    @staticmethod
    def batch():
        return make_batch(batch=DRAWN, seq=7, seed=1)

    @staticmethod
    def params(model):
        return list(model.parameters())

    @staticmethod
    def reference(model, inputs, targets, max_grad_norm):
        """(1/n) sum_b c_b grad_b over the n given samples, and their norms."""
        update, norms = reference_update(model, inputs, targets, max_grad_norm, lr=1.0)
        return -update, norms

    @staticmethod
    def sample_loss(model, inputs, targets):  # one sample's
        return F.cross_entropy(model(inputs)[0], targets[0])


class LoraLlama:
    """The tiny Llama classifier of tests/hf/test_hf.py with LoRA, left-padded inputs."""

    loss_fn = staticmethod(hf_models.sequence_classification_loss)

    @staticmethod
    def model():
        return tiny_model(use_lora=True)[0]

    @staticmethod
    def batch():
        inputs, labels = hf_data.synthetic_snli(DRAWN, 10, VOCAB, seed=1)
        return left_padded(inputs), labels

    @staticmethod
    def params(model):  # before a trainer wraps it: flash turns requires_grad off
        return trainable(model)

    @staticmethod
    def reference(model, inputs, labels, max_grad_norm):
        return hf_reference_update(model, inputs, labels, max_grad_norm)

    @staticmethod
    def sample_loss(model, inputs, labels):
        return hf_models.sequence_classification_loss(model, inputs, labels)[0]


CASES = {"lm": LM, "llama_lora": LoraLlama}


@cache
def ordered_batch(kind):
    """The case's batch of DRAWN samples, reordered so that every prefix of two or more has a
    sample above C and one below: largest norm, smallest, second largest, second smallest...;
    C the median of the brute-force norms (between the two middle ones)."""
    case = CASES[kind]
    inputs, targets = case.batch()
    _, norms = case.reference(case.model(), inputs, targets, 1.0)
    order = norms.argsort(descending=True)
    half = DRAWN // 2
    interleaved = torch.stack([order[:half], order[half:].flip(0)], 1).reshape(-1)
    sorted_norms = norms.sort().values
    clip = ((sorted_norms[half - 1] + sorted_norms[half]) / 2).item()
    return inputs[interleaved], targets[interleaved], clip


def brute_losses(case, model, inputs, targets):
    """Each sample's loss, alone in its forward."""
    with torch.no_grad():
        losses = [case.sample_loss(model, x[None], y[None]) for x, y in zip(inputs, targets)]
        return torch.stack(losses)


def make(name, model, case, clip, sigma=0.0):
    return trainers.make_trainer(
        name, model, batch_size=EXPECTED, max_physical_batch_size=P, lr=1.0,
        max_grad_norm=clip, noise_multiplier=sigma, loss_fn=case.loss_fn,
    )  # fmt: skip


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).double()


def update_of(params, step):
    """Run ``step``; the SGD update it applied (lr 1), -p.grad (0 for a parameter left without
    one), compared as gradients: differencing fp32 parameters would lose its low digits."""
    before = flat(params)
    out = step()
    update = -flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    assert torch.allclose(flat(params) - before, update, atol=1e-6)  # the parameters moved so
    return update, out


@pytest.mark.parametrize("drawn", DRAWS)
@pytest.mark.parametrize("name", ["flash", "standard"])
@pytest.mark.parametrize("kind", list(CASES))
def test_padded_step_is_brute_force_on_the_real_samples(kind, name, drawn):
    """Update, loss = brute force's on the real samples over the expected B: stand-ins inert."""
    # lr 1, noise 0; flash clips, standard does not; a draw of 0 does not move.
    case = CASES[kind]
    model = case.model()
    inputs, targets, clip = ordered_batch(kind)
    inputs, targets = inputs[:drawn], targets[:drawn]
    params = case.params(model)
    if drawn:
        # standard: C = inf makes every factor 1, the plain sum of per-sample gradients
        grad, norms = case.reference(model, inputs, targets, clip if name == "flash" else math.inf)
        ref = -grad * drawn / EXPECTED  # the reference divides by n; the step by the expected B
        losses = brute_losses(case, model, inputs, targets)
        if name == "flash" and drawn > 1:  # clipping is exercised, on some samples only
            assert (norms > clip).any() and (norms < clip).any()
    trainer = make(name, model, case, clip)
    update, out = update_of(params, lambda: trainer.padded_step(inputs, targets, P))
    assert len(out["physical_step_times_ms"]) == math.ceil(drawn / P)
    if drawn == 0:
        assert out["loss"] is None and not update.any()
        return
    assert relative_error(update, ref) < 1e-5
    assert out["loss"] == pytest.approx(losses.mean().item(), rel=1e-5)


@pytest.mark.parametrize("name", ["flash", "standard"])
def test_all_padding_chunks_added_for_a_warm_up_change_nothing(name):
    """min_chunks (a capture's warm-up under DDP runs the chunk that does not sync too): the
    all-padding chunks added are run, and the update and loss are still brute force's."""
    case = CASES["lm"]
    model = case.model()
    inputs, targets, clip = ordered_batch("lm")
    inputs, targets = inputs[: P + 1], targets[: P + 1]  # two chunks; three with min_chunks 3
    grad, _ = case.reference(model, inputs, targets, clip if name == "flash" else math.inf)
    losses = brute_losses(case, model, inputs, targets)
    trainer = make(name, model, case, clip)
    step = lambda: trainer.padded_step(inputs, targets, P, min_chunks=3)  # noqa: E731
    update, out = update_of(case.params(model), step)
    assert len(out["physical_step_times_ms"]) == 3
    assert relative_error(update, -grad * (P + 1) / EXPECTED) < 1e-5
    assert out["loss"] == pytest.approx(losses.mean().item(), rel=1e-5)


@pytest.mark.parametrize("kind", list(CASES))
def test_stand_ins_have_zero_norm_and_loss_in_a_padded_chunk(kind):
    """Flash's chunk norms, clip factors, losses: brute force's on real rows, stand-ins' add 0."""
    # A draw of P+1: the second chunk is 1 real row and P-1 stand-ins.
    case = CASES[kind]
    model = case.model()
    inputs, targets, clip = ordered_batch(kind)
    drawn = P + 1
    inputs, targets = inputs[:drawn], targets[:drawn]
    _, norms = case.reference(model, inputs, targets, clip)
    losses = brute_losses(case, model, inputs, targets)
    trainer = make("flash", model, case, clip)
    seen = {"norms": [], "factors": [], "passed": [], "losses": []}

    flash = trainer.trainer
    clip_factors = flash.clip_factors

    def recorded_clip_factors(per_sample_norms):
        factors = clip_factors(per_sample_norms)
        seen["norms"].append(per_sample_norms.detach().clone())
        seen["factors"].append(factors.detach().clone())
        return factors

    accumulate = flash.engine.accumulate_clipped_grads

    def recorded_accumulate(factors, sink=None):
        seen["passed"].append(factors.detach().clone())
        return accumulate(factors, sink)

    per_sample_losses = flash.per_sample_losses

    def recorded_losses(model, chunk):  # times the chunk's weights
        out = per_sample_losses(model, chunk)
        seen["losses"].append(out.detach().clone())
        return out

    flash.clip_factors = recorded_clip_factors
    flash.engine.accumulate_clipped_grads = recorded_accumulate
    flash.per_sample_losses = recorded_losses
    trainer.padded_step(inputs, targets, P)

    for key, values in seen.items():  # two chunks of exactly P rows each
        assert [v.shape for v in values] == [(P,), (P,)], key
    seen = {key: torch.cat(values).double() for key, values in seen.items()}
    real, pad = slice(0, drawn), slice(drawn, None)
    torch.testing.assert_close(seen["norms"][real], norms, rtol=1e-5, atol=0)
    assert (seen["norms"][pad] == 0).all()
    assert (norms > clip).any() and (norms < clip).any()
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    torch.testing.assert_close(seen["factors"][real], factors, rtol=1e-5, atol=0)
    assert (seen["factors"][pad] == 1).all()  # finite: 1 times a zero gradient
    # what flash hands the engine: the factors with the expected batch's 1/B folded in
    assert torch.equal(seen["passed"], (seen["factors"].float() / EXPECTED).double())
    torch.testing.assert_close(seen["losses"][real], losses.double(), rtol=1e-5, atol=0)
    assert (seen["losses"][pad] == 0).all()


@pytest.mark.parametrize("target_shape", [(5,), ()], ids=["lm_targets", "class_labels"])
def test_fill_chunk_copies_real_rows_then_stand_ins(target_shape):
    """fill_chunk: real rows, then first-sample stand-ins weighted 0 (finite rows for any draw)."""
    # An empty batch keeps the buffers' rows, all weighted 0; it returns the real count.
    inputs = torch.arange(7 * 5).reshape(7, 5)
    targets = torch.arange(7 * math.prod(target_shape)).reshape(7, *target_shape) + 100
    chunk = chunks.new_padded_chunk(inputs, targets, P)
    x, y, weights = chunk
    assert x.shape == (P, 5) and y.shape == (P, *target_shape) and weights.shape == (P,)
    assert not x.any() and not y.any() and not weights.any()
    assert weights.dtype == torch.float32

    def check(real, rows):
        assert torch.equal(x, inputs[rows]) and torch.equal(y, targets[rows])
        assert weights.tolist() == [1.0] * real + [0.0] * (P - real)

    assert chunks.fill_chunk(chunk, inputs, targets, 0) == P
    check(P, [0, 1, 2])
    assert chunks.fill_chunk(chunk, inputs, targets, P) == P
    check(P, [3, 4, 5])
    assert chunks.fill_chunk(chunk, inputs, targets, 2 * P) == 1  # 7 = 2P + 1
    check(1, [6, 0, 0])
    assert chunks.fill_chunk(chunk, inputs[:2], targets[:2], 0) == 2
    check(2, [0, 1, 0])
    assert chunks.fill_chunk(chunk, inputs, targets, 3 * P) == 0  # past the end: all stand-ins
    check(0, [0, 0, 0])
    chunks.fill_chunk(chunk, inputs[4:], targets[4:], 0)
    assert chunks.fill_chunk(chunk, inputs[:0], targets[:0], 0) == 0  # empty: rows kept
    check(0, [4, 5, 6])


def test_padded_noise_is_drawn_once_per_step():
    """A padded step adds N(0, (sigma C/B)^2) once, as the eager step does; alone when empty."""
    # flash, a draw of 5 in chunks of 3 (one padded): noise per chunk would be sqrt(2) larger.
    sigma, clip, drawn = 0.7, 0.05, 5
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    inputs, targets = make_batch(batch=drawn, seq=6, seed=2)
    update, _ = reference_update(model, inputs, targets, clip, lr=1.0)
    ref = update * drawn / EXPECTED
    eager_model, empty_model = copy.deepcopy(model), copy.deepcopy(model)  # before flash hooks
    expected = sigma * clip / EXPECTED

    def check_noise(noise):
        # ~5.6k coordinates: the sample std's relative error is ~1/sqrt(2n) = 0.9%; 5% is 5
        # sigma, and noise per chunk would be 41% off.
        assert noise.numel() > 5_000
        assert abs(noise.std().item() / expected - 1) < 0.05
        assert abs(noise.mean().item()) < 5 * expected / noise.numel() ** 0.5

    padded = make("flash", model, LM, clip, sigma)
    torch.manual_seed(7)
    padded_update, out = update_of(LM.params(model), lambda: padded.padded_step(inputs, targets, P))
    assert len(out["physical_step_times_ms"]) == 2
    check_noise(padded_update - ref)

    eager = make("flash", eager_model, LM, clip, sigma)  # the same chunks of 3 and 2, not padded
    torch.manual_seed(7)
    eager_update, _ = update_of(LM.params(eager_model), lambda: eager.step(inputs, targets))
    check_noise(eager_update - ref)
    # The noise is drawn at the optimizer step from torch's generator and the chunks draw
    # nothing: with its state alike, the padded and the eager step add the same noise.
    assert relative_error(padded_update, eager_update) < 1e-5

    empty = make("flash", empty_model, LM, clip, sigma)
    noise, out = update_of(
        LM.params(empty_model), lambda: empty.padded_step(inputs[:0], targets[:0], P)
    )
    assert out["loss"] is None and out["physical_step_times_ms"] == []
    check_noise(noise)


def test_physical_size_is_the_cap_or_the_expected_batch():
    """physical_size (the chunk a graph captures) is min(cap, ceil(B / world size)), one process."""
    model = models.build_model(SMALL)
    for cap, size in [(None, 16), (4, 4), (32, 16)]:
        trainer = trainers.make_trainer(
            "standard", model, lr=0.1, batch_size=16, max_physical_batch_size=cap
        )
        assert trainer.physical_size() == size
