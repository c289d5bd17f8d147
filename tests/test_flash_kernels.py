"""Flash's Triton Gram kernel against brute force on CPU, interpreted (TRITON_INTERPRET=1), with
explicit tiles: autotuning needs a GPU driver, so the autotuned path and bf16 (which the
interpreter cannot represent) are checked compiled, in tests/test_flash_kernels_gpu.py."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # set by conftest.py where there is no GPU
    pytest.skip("kernels compile here: tests/test_flash_kernels_gpu.py", allow_module_level=True)
flash_kernels = pytest.importorskip("flash_kernels", reason="needs triton")


def per_sample_squared_norms(A, G):
    """Brute force: form each sample's gradient G_b^T A_b in fp64 and square-sum it."""
    return torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2))


def relative_error(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def test_kernel_is_interpreted_on_cpu():
    assert type(flash_kernels._gram_pair_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize(
    "B, T, d, p, block_t",
    [
        (2, 1, 8, 8, 16),  # one token: a single diagonal pair, mostly masked
        (3, 257, 48, 48, 64),  # T one past a tile, d = p not a multiple of the K block
        (2, 70, 20, 33, 32),  # d != p, both smaller than the K block
        (1, 64, 16, 16, 32),  # B = 1, T an exact multiple of the tile
    ],
)
def test_fp32_matches_brute_force(B, T, d, p, block_t):
    torch.manual_seed(T)
    A, G = torch.randn(B, T, d), torch.randn(B, T, p)
    norms = flash_kernels.gram_squared_norms(A, G, block_t=block_t, block_k=32)
    assert norms.dtype == torch.float32 and norms.shape == (B,)
    assert relative_error(norms, per_sample_squared_norms(A, G)) < 1e-5


def test_strided_inputs_and_fp16():
    torch.manual_seed(1)
    A = torch.randn(2, 48, 70).mT  # [2, 70, 48], not contiguous
    G = torch.randn(2, 70, 40)
    expected = per_sample_squared_norms(A, G)
    assert relative_error(flash_kernels.gram_squared_norms(A, G, 32, 32), expected) < 1e-5
    # fp16 inputs on the low-precision path, fp32 accumulation: rounding of the inputs only
    half = flash_kernels.gram_squared_norms(A.half(), G.half(), 32, 32)
    assert relative_error(half, per_sample_squared_norms(A.half(), G.half())) < 1e-4


def test_shape_errors():
    with pytest.raises(ValueError, match="share a dtype"):
        flash_kernels.gram_squared_norms(torch.randn(1, 2, 3), torch.randn(1, 2, 3).half())
    with pytest.raises(ValueError, match=r"A \[B, T, d\]"):
        flash_kernels.gram_squared_norms(torch.randn(1, 2, 3), torch.randn(1, 3, 3))
