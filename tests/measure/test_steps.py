"""The measurement steps' bookkeeping: which batch the extra steps use, and what privacy says."""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from opacus.accountants import PRVAccountant

import models
import trainers
from dp_cost.measure import phases
from dp_cost.measure.steps import Privacy, Session, TimedSteps
from dp_cost.measure.workload import Workload
from dp_cost.noise import laws as noise_laws

SMALL = models.ModelConfig(vocab_size=11, hidden_dim=8, num_layers=1, num_heads=2, mlp_dim=8)


class Batches:
    """A workload whose batches are given in order (a Poisson sampler may draw an empty one)."""

    def __init__(self, sizes, sample_rate=None):
        self.sizes, self.sample_rate, self.draws = list(sizes), sample_rate, []

    def batch(self):
        size = self.sizes.pop(0)
        self.draws.append(size)
        tokens = torch.randint(0, SMALL.vocab_size, (size, 7))
        return tokens, tokens


def session(sizes, steps, sample_rate=None, trainer="flash", **config):
    trainer = trainers.make_trainer(trainer, models.build_model(SMALL), lr=0.1, batch_size=2)
    config = SimpleNamespace(warmup_steps=0, steps=steps, poisson=True, noise_multiplier=1.0,
                             delta=1e-5, **config)  # fmt: skip
    return Session(config, torch.device("cpu"), trainer, Batches(sizes, sample_rate),
                   phases.PhaseRecorder(torch.device("cpu")), "", {})  # fmt: skip


def test_extra_steps_reuse_the_last_timed_draw_even_empty():
    """Chosen by position, never by content: the last timed draw, empty or not (an empty one is
    said)."""
    s, result = session([3, 2, 1], steps=3), {}
    TimedSteps().run(s, result)
    assert result["measurement_batch_size"] == 1 and len(s.inputs) == 1
    assert "measurement_batch_note" not in s.env
    s, result = session([3, 2, 0], steps=3), {}
    TimedSteps().run(s, result)
    assert result["losses"][-1] is None  # the empty batch was a step too
    assert result["measurement_batch_size"] == 0 and len(s.inputs) == 0
    assert "empty" in s.env["measurement_batch_note"]


class RecordingTrainer:
    """Takes steps and does nothing else: what TimedSteps asks of a runner and its trainer."""

    graphs = SimpleNamespace(counts=lambda: {"replays": 0}, enabled=False)
    steps_taken = 0
    privacy = None

    @property
    def trainer(self):
        return self

    def observing_phases(self, callback):
        return contextlib.nullcontext()

    def step(self, inputs, targets):
        self.steps_taken += 1
        return {"physical_step_times_ms": [], "loss": None}

    def result_extras(self):
        return {}


def poisson_workload(dataset_size, sample_rate, seed, rank=0, world_size=1):
    """The Hugging Face workload's own batch drawing (Workload.batch: a global Poisson draw,
    then this rank's share) over a dataset whose inputs are the sample indices, no model."""
    workload = Workload.__new__(Workload)
    workload.config = SimpleNamespace(poisson=True)
    workload.device, workload.rank, workload.world_size = torch.device("cpu"), rank, world_size
    workload.inputs = workload.labels = torch.arange(dataset_size)
    workload.sample_rate, workload.draws = sample_rate, []
    workload.generator = torch.Generator().manual_seed(seed)
    return workload


def measured_share(workload, steps=3):
    """The batch the extra steps after ``steps`` timed ones reuse (this rank's share)."""
    config = SimpleNamespace(warmup_steps=1, steps=steps)
    s = Session(config, torch.device("cpu"), RecordingTrainer(), workload,
                phases.PhaseRecorder(torch.device("cpu")), "", {})  # fmt: skip
    TimedSteps().run(s, {})
    return s.inputs


@pytest.mark.parametrize("expected_batch", [1, 2])
def test_reused_batch_includes_a_sample_at_the_sampling_rate(expected_batch):
    """Over many seeds, sample 0 is in the reused batch with probability q, as in any draw: a
    choice of "the last batch with samples" raises it (to ~1.5 q at an expected batch of 1 on
    10 samples, ~1.1 q at 2)."""
    dataset_size, trials = 10, 6000
    q = expected_batch / dataset_size
    hits = sum(
        bool((measured_share(poisson_workload(dataset_size, q, seed)) == 0).any())
        for seed in range(trials)
    )
    spread = math.sqrt(q * (1 - q) / trials)
    assert abs(hits / trials - q) < 4 * spread, (hits / trials, q)


def test_every_rank_reuses_its_share_of_one_draw():
    """DDP over 3 ranks, a last timed global batch of 1 sample: every rank reuses its share of
    that draw (two of them empty), none an older draw of its own."""
    world_size, dataset_size, q = 3, 10, 0.3
    for seed in range(200):  # a seed whose 4th draw (warm-up and 3 timed) holds 1 or 2 samples
        whole = poisson_workload(dataset_size, q, seed)
        for _ in range(4):
            last_draw, _ = whole.batch()
        if 0 < len(last_draw) < world_size:
            break
    shares = [
        measured_share(poisson_workload(dataset_size, q, seed, rank, world_size))
        for rank in range(world_size)
    ]
    assert torch.equal(torch.cat(shares), last_draw) and 0 < len(last_draw) < world_size
    assert sum(len(share) == 0 for share in shares) == world_size - len(last_draw)


def test_privacy_counts_reused_steps_and_refuses_fixed_size_batches():
    s, result = session([2, 0], steps=2, sample_rate=0.1), {}
    TimedSteps().run(s, result)
    s.extra_step()
    s.extra_step()
    Privacy().run(s, result)
    record = result["privacy"]
    assert record["steps"] == 4 and record["last_batch_uses"] == 3
    assert record["draw_sizes"] == [2, 0] and record["steps_per_draw"] == [1, 3]
    # epsilon from the draws recorded, by Opacus' accountant directly: one step at sigma,
    # then three on one draw, a Gaussian mechanism of sigma / sqrt(3)
    accountant = PRVAccountant()
    accountant.history = [(1.0, 0.1, 1), (1.0 / math.sqrt(3), 0.1, 1)]
    assert record["epsilon"] == pytest.approx(accountant.get_epsilon(delta=1e-5), rel=1e-6)
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


def test_the_kept_light_trace_is_the_median_steps():
    """The light trace kept beside the full one is that of the step whose host time is reported
    (median_index picks it for both)."""
    from dp_cost.measure.steps import median_index

    assert median_index([182.5, 74.2, 90.1]) == 2
    assert median_index([90.1, 74.2, 182.5, 80.0]) == 3  # even count: the lower middle
    assert median_index([74.2, 74.2, 74.2]) == 1  # ties: the middle one of the three
    assert median_index([None, 74.2]) == 0  # as median_host_step: the first


@pytest.mark.parametrize("name", ["dpsgd", "ghost", "flash"])
def test_delta_total_adds_the_tail_of_each_trainers_sampler(name):
    """delta_total = delta + sum over the steps of q * (the bound on a neighbour's output leaving
    the sampler's support), for the sampler each trainer uses: on the CPU Opacus' torch.normal,
    whose radius uniform is 24-bit (z_max 5.77), and flash's 64-bit transform (z_max 9.49);
    d counts every noised coordinate (d / 2 Box-Muller pairs); the shift is 1 / sigma, sigma
    the accounted one (Opacus' norm margin)."""
    s, result = session([2, 1], steps=2, sample_rate=0.1, trainer=name), {}
    TimedSteps().run(s, result)
    s.extra_step()
    Privacy().run(s, result)
    record = result["privacy"]
    law = noise_laws.NOISE_LAWS["exact64" if name == "flash" else "torch_cpu"]
    coordinates = sum(p.numel() for p in s.runner.model.parameters())  # all trained
    sigma = 1.0 / (1 + (0.0 if name == "flash" else 2.0**-12))  # fp32
    per_step = noise_laws.exit_bound(law, math.ceil(coordinates / 2), 1 / sigma)
    assert record["noise_sampler"] == ("exact64" if name == "flash" else "torch_cpu")
    assert record["z_max"] == pytest.approx(law.z_max)
    assert record["noised_coordinates"] == coordinates
    assert record["effective_noise_multiplier"] == pytest.approx(sigma, rel=1e-12)
    assert record["delta_total"] == pytest.approx(1e-5 + 3 * 0.1 * per_step, rel=1e-9)
    # torch's CPU atom: each pair leaves with probability 2^-24 (here ~1e-3 a step)
    tail_over_delta = record["tail_delta"] > record["delta"]
    assert tail_over_delta == (name != "flash")


def test_every_trainers_sampler_is_named_and_flash_draws_exact64_everywhere():
    """Opacus' trainers name torch's sampler of their device (or exact64 when asked); flash
    draws with the 64-bit transform on every device (its Triton kernel where it runs, whose
    bound is the law's)."""
    for name, options, law in [
        ("dpsgd", {}, "torch_cpu"),
        ("ghost", {}, "torch_cpu"),
        ("dpsgd", {"noise_sampler": "exact64"}, "exact64"),
        ("ghost", {"noise_sampler": "exact64"}, "exact64"),
        ("flash", {}, "exact64"),
    ]:
        runner = trainers.make_trainer(
            name, models.build_model(SMALL), lr=0.1, batch_size=2, **options
        )
        assert runner.trainer.privacy.noise_sampler == law
    kernels = pytest.importorskip("dp_cost.flash.kernels.noise", reason="needs triton")
    assert kernels.Z_MAX == pytest.approx(noise_laws.NOISE_LAWS["exact64"].z_max, rel=1e-12)
