"""The compiled, autotuned Gram kernel on a GPU: bf16 on tensor cores and IEEE fp32, against
brute force (run on the device; skipped without CUDA)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B, T, d, p", [(3, 257, 48, 48), (8, 512, 256, 1024), (2, 1, 64, 64)])
def test_gram_kernel_on_cuda(dtype, tolerance, B, T, d, p):
    import flash_kernels

    torch.manual_seed(0)
    A = torch.randn(B, T, d, device="cuda").to(dtype)
    G = torch.randn(B, T, p, device="cuda").to(dtype)
    expected = torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2))
    norms = flash_kernels.gram_squared_norms(A, G)
    error = ((norms.double() - expected).abs().max() / expected.abs().max()).item()
    assert error < tolerance
