"""The CPU peak of a step counts what the CUDA peak counts: not the host-side dataset."""

import pytest
import torch

pytest.importorskip("transformers")

import trainers  # noqa: E402
from dp_cost.measure import phases  # noqa: E402
from dp_cost.measure.config import ExperimentConfig  # noqa: E402
from dp_cost.measure.workload import Workload  # noqa: E402


def cpu_peak_with_dataset_of(size: int) -> float:
    config = ExperimentConfig("dpsgd", 4, 16, model="tiny-llama", dataset_size=size,
                              poisson=False)  # fmt: skip
    torch.manual_seed(0)
    workload = Workload(config, torch.device("cpu"), lambda name: None, {})
    trainer = trainers.make_trainer(
        "dpsgd", workload.model, lr=0.1, batch_size=4, loss_fn=workload.loss_fn
    )
    inputs, targets = workload.batch()
    trainer.step(inputs, targets)  # warm: optimizer state and Opacus buffers exist
    return phases.cpu_step_peak_bytes(
        lambda: trainer.step(inputs, targets), workload.host_dataset()
    )


def test_cpu_peak_does_not_grow_with_the_dataset():
    small, large = cpu_peak_with_dataset_of(100), cpu_peak_with_dataset_of(20_000)
    dataset_bytes = 20_000 * 16 * 8  # the larger table alone: 2.4 MB of int64 token ids
    assert abs(large - small) < 0.05 * dataset_bytes
