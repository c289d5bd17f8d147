"""Fixtures of the several-rank tests that run in the test's own process."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo process group in this process, for the test's length."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
