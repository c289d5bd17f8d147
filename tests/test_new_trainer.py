"""Adding a trainer is one new class: this file defines one (and only this file knows it) and
runs it through the CLI to a result, a summary row, and the memory breakdown's attribution;
and registers a DP algorithm written in one file (tests/textbook_dpsgd.py) and checks its steps
against brute force."""

import csv

import pytest
import torch
from cli_helpers import results_in, small_run_args
from test_trainers import SMALL, flat_params, make_batch, reference_update
from textbook_dpsgd import TextbookDPSGD

import models
import profiling_script
import trainers
from dp_cost.core.schema import AllocationSite
from dp_cost.measure import breakdown


class ScaledSGDTrainer(trainers.StandardTrainer):
    """The example of ARCHITECTURE.md: standard SGD that also keeps, per step, the squared
    gradient norm of every parameter (its own state) in a buffer it allocates itself."""

    def chunk_step(self, chunk):
        loss = super().chunk_step(chunk)
        self.norms = self.squared_grad_norms()
        return loss

    def squared_grad_norms(self) -> torch.Tensor:
        return torch.stack([p.grad.pow(2).sum() for p in self.model.parameters()])

    # Where its state lives, and which of its functions allocate what: the breakdown and the
    # module census ask these two methods, nothing else.
    def dp_state_tensors(self):
        return [("norm_samples", "", self.norms)] if hasattr(self, "norms") else []

    def dp_allocation_sites(self):
        return [AllocationSite.of("norm_samples", ScaledSGDTrainer.squared_grad_norms)]


@pytest.fixture
def registered():
    trainers.register_trainer("scaled_sgd")(ScaledSGDTrainer)
    yield "scaled_sgd"
    del trainers.TRAINERS["scaled_sgd"]


def test_a_new_trainer_runs_through_the_cli_to_a_result_and_a_summary_row(tmp_path, registered):
    # In-process: the forked workers inherit the registration.
    argv = small_run_args(tmp_path, "standard", registered, steps=2)
    assert profiling_script.main(argv) == 0
    results = results_in(tmp_path / "r")
    result = results[f"{registered}_bs2_seq8"]
    assert result["status"] == "ok", result["error"]
    assert len(result["step_times_ms"]) == 2 and result["peak_memory_mb"] > 0
    with open(tmp_path / "r" / "summary.csv") as f:
        rows = {row["trainer"]: row for row in csv.DictReader(f)}
    assert rows[registered]["status"] == "ok" and rows[registered]["time_vs_standard"]


def test_a_new_trainer_state_and_allocations_reach_the_breakdown(registered):
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    trainer = trainers.make_trainer(registered, model, lr=0.1, batch_size=2)
    trainer.step(torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5)))
    identities = breakdown.tensor_identities(trainer, device_type="cpu")
    assert identities[trainer.trainer.norms.untyped_storage().data_ptr()] == "norm_samples"
    assert identities[model[1].weight.untyped_storage().data_ptr()] == "model_parameters"
    # A block no identity names: classified by the function on its allocating stack, wherever
    # that function's file is.
    frames = [{"filename": "/anywhere/else.py", "name": "squared_grad_norms"}]
    trace = [{"action": "alloc", "addr": 1, "size": 64, "frames": frames}]
    out = breakdown.attribute_peak(trace, {}, [{}], trainer.trainer.memory().sites)
    assert out["breakdown_bytes"]["norm_samples_mb"] == 64


# ---------------------------------------------------------------- a DP algorithm, one file
@pytest.fixture
def textbook():
    trainers.register_trainer("textbook_dpsgd")(TextbookDPSGD)  # the one registry line
    yield "textbook_dpsgd"
    del trainers.TRAINERS["textbook_dpsgd"]


C = 0.05  # below every sample's norm on these batches: each one clipped


def test_the_textbook_trainer_steps_as_brute_force_in_chunks_and_padded(textbook):
    """tests/textbook_dpsgd.py (DP-SGD by microbatches of one) through the Runner: near-equal
    chunks (5 by 2: 2, 2, 1), padded chunks of 2 (the last one a stand-in weighted 0) and an
    empty draw (noise 0: no update), each the brute-force update of the same batch. Under DDP
    on 2 and 3 gloo ranks: tests/parallel/test_distributed_updates.py's textbook jobs."""
    inputs, targets = make_batch(5, 8, seed=3)
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    reference, norms = reference_update(model, inputs, targets, C, lr=1.0)
    assert (norms > C).all()
    for padded in (False, True):
        runner = trainers.make_trainer(
            textbook, model, lr=1.0, batch_size=5, max_physical_batch_size=2,
            max_grad_norm=C, noise_multiplier=0.0,
        )  # fmt: skip
        before = flat_params(model)
        out = runner.padded_step(inputs, targets, 2) if padded else runner.step(inputs, targets)
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        assert torch.allclose(-grads, reference, rtol=1e-5, atol=1e-9), padded
        with torch.no_grad():  # back to where the reference was taken, for the next round
            torch.nn.utils.vector_to_parameters(before.float(), model.parameters())
        assert out["loss"] > 0
    runner.step(inputs[:0], targets[:0])  # nothing drawn: zeros, no noise, a step all the same
    assert runner.steps_taken == 1 and all((p.grad == 0).all() for p in model.parameters())
