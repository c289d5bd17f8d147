"""A planned RMSNorm as CUDA runs it (dp_cost/capacity/fused_norm.py): what its forward keeps for
the backward is what torch's derivative formula of the fused kernel (``_fused_rms_norm``) saves,
the input, a [..., 1] rstd in fp32 and the weight, where the CPU's composition keeps the
normalized input too; its backward is the fused backward, with the gradients' shapes and dtypes."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dp_cost.capacity.fused_norm import fused_rms_norm

B, T, D = 2, 64, 256


def saved_by(norm: torch.nn.RMSNorm, dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The tensors autograd keeps for the backward of one call, and its input."""
    saved = []

    def keep(tensor):
        saved.append(tensor)
        return tensor

    with FakeTensorMode():
        x = torch.randn(B, T, D, dtype=dtype, requires_grad=True)
        fake_norm = torch.nn.RMSNorm(D, eps=1e-5, dtype=dtype)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            out = fake_norm(x)
        out.sum().backward()
        assert x.grad.shape == x.shape and x.grad.dtype == dtype
        assert fake_norm.weight.grad.shape == (D,) and fake_norm.weight.grad.dtype == dtype
    return saved, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_planned_rms_norm_keeps_the_fused_kernels_tensors(dtype):
    norm = torch.nn.RMSNorm(D, eps=1e-5)
    with fused_rms_norm():
        saved, x = saved_by(norm, dtype)
    activation = B * T * D * dtype.itemsize
    shapes = sorted((tuple(t.shape), t.dtype) for t in saved)
    assert shapes == sorted([((B, T, D), dtype), ((B, T, 1), torch.float32), ((D,), dtype)])
    assert any(t.untyped_storage()._cdata == x.untyped_storage()._cdata for t in saved)
    composed, _ = saved_by(norm, dtype)  # the CPU's six ops keep more: the normalized input
    full = [t for t in composed if t.numel() == B * T * D]
    assert sum(t.numel() * t.dtype.itemsize for t in full) > activation
    assert torch.rms_norm is torch._C._VariableFunctions.rms_norm  # undone on the way out


def test_a_weight_of_another_dtype_is_planned_as_torch_composes_it():
    """On a card torch refuses the fused kernel when the weight's dtype is not the input's and
    runs the composed ops: planned so too (their output in the input's dtype, as torch's)."""
    with FakeTensorMode(), fused_rms_norm():
        x = torch.randn(B, T, D, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.ones(D, dtype=torch.float32, requires_grad=True)
        out = torch.rms_norm(x, [D], weight, 1e-5)
        assert out.grad_fn.name() != "FusedRmsNormBackward"
        with pytest.raises(RuntimeError, match="does not end in"):
            torch.rms_norm(torch.randn(B, T), [D], None, 1e-5)


def test_the_patch_is_undone_when_the_planned_step_fails():
    composed = torch.rms_norm
    with pytest.raises(RuntimeError), fused_rms_norm():
        assert torch.rms_norm is not composed
        raise RuntimeError("a planned step that failed")
    assert torch.rms_norm is composed
