"""The measurement steps' bookkeeping: which batch the extra steps use, and what privacy says."""

from types import SimpleNamespace

import torch

import models
import trainers
from dp_cost.measure import phases
from dp_cost.measure.steps import Privacy, Session, TimedSteps

SMALL = models.ModelConfig(vocab_size=11, hidden_dim=8, num_layers=1, num_heads=2, mlp_dim=8)


class Batches:
    """A workload whose batches are given in order (a Poisson sampler may draw an empty one)."""

    def __init__(self, sizes, sample_rate=None):
        self.sizes, self.sample_rate = list(sizes), sample_rate

    def batch(self):
        size = self.sizes.pop(0)
        tokens = torch.randint(0, SMALL.vocab_size, (size, 7))
        return tokens, tokens


def session(sizes, steps, sample_rate=None, **config):
    trainer = trainers.make_trainer("flash", models.build_model(SMALL), lr=0.1, batch_size=2)
    config = SimpleNamespace(warmup_steps=0, steps=steps, poisson=True, noise_multiplier=1.0,
                             delta=1e-5, **config)  # fmt: skip
    return Session(config, torch.device("cpu"), trainer, Batches(sizes, sample_rate),
                   phases.PhaseRecorder(torch.device("cpu")), "", {})  # fmt: skip


def test_extra_steps_reuse_the_last_batch_with_samples():
    s, result = session([3, 2, 0], steps=3), {}
    TimedSteps().run(s, result)
    assert result["measurement_batch_size"] == 2 and len(s.inputs) == 2
    assert result["losses"][-1] is None  # the empty batch was a step too
    assert "measurement_batch_note" not in s.env


def test_every_batch_empty_is_said():
    s, result = session([0, 0], steps=2), {}
    TimedSteps().run(s, result)
    assert result["measurement_batch_size"] == 0 and "empty" in s.env["measurement_batch_note"]


def test_privacy_counts_reused_steps_and_refuses_fixed_size_batches():
    s, result = session([2], steps=1, sample_rate=0.1), {}
    TimedSteps().run(s, result)
    s.extra_step()
    s.extra_step()
    Privacy().run(s, result)
    assert result["privacy"]["steps"] == 3 and result["privacy"]["last_batch_uses"] == 3
    assert result["privacy"]["epsilon"] > 0
    s.config.poisson = False
    Privacy().run(s, result)
    assert result["privacy"]["epsilon"] is None and "Poisson" in s.env["privacy_note"]


def test_host_time_is_the_traced_step_of_median_host_time():
    """One traced step's host time swings by tens of percent on a shared host (2.2x its
    neighbours once on an H100): the reported step is the median of several, and all are kept."""
    from dp_cost.measure.steps import median_host_step

    steps = [{"host_time_ms": ms, "gpu_busy_fraction": busy}
             for ms, busy in ((182.5, 0.39), (74.2, 0.92), (90.1, 0.76))]  # fmt: skip
    chosen = median_host_step(steps)
    assert (chosen["host_time_ms"], chosen["gpu_busy_fraction"]) == (90.1, 0.76)
    assert chosen["host_time_ms_of_traced_steps"] == [182.5, 74.2, 90.1]
    assert median_host_step(steps[:2])["host_time_ms"] == 74.2  # even count: the lower middle
    missing = [{"host_time_ms": None, "gpu_busy_fraction": 0.5}, steps[0]]
    assert median_host_step(missing)["host_time_ms"] is None  # not a guess
