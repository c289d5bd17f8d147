"""Adding a trainer is one new class: this file defines one (and only this file knows it) and
runs it through the CLI to a result, a summary row, and the memory breakdown's attribution."""

import csv

import pytest
import torch
from cli_helpers import results_in, small_run_args

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
