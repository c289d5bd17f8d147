"""A planned step's RMSNorm as CUDA runs it, not as the CPU would.

``torch.rms_norm`` (what ``F.rms_norm``, nn.RMSNorm and Opacus call) decides in C++ by its
input's device: on a card it is one fused kernel
(``_fused_rms_norm``) that keeps, for its one fused backward kernel, the input and a [..., 1]
rstd in fp32 (torch's derivative formula); on the CPU, and so on the fake step's CPU fake
tensors, it is composed of six ops that keep the normalized input as well (one more activation
a norm) and make their own temporaries. An H200's allocation history of a Llama LoRA step showed
the fused kernels. ``FusedRmsNorm`` plans each call as that kernel: the forward as one pass
over the input (the kernel's traffic, for the time model) beside its rstd, the backward as
torch's own ``_fused_rms_norm_backward``, whose meta kernel makes its outputs.
"""

from __future__ import annotations

import contextlib
import functools

import torch


class FusedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        kept = x.dim() - len(normalized_shape)
        rstd = x.new_empty(
            (*x.shape[:kept], *(1,) * len(normalized_shape)),
            dtype=torch.promote_types(x.dtype, torch.float32),
        )
        normed = torch.mul(x, weight) if weight is not None else torch.clone(x)
        ctx.normalized_shape = list(normalized_shape)
        ctx.save_for_backward(x, rstd, weight)
        return normed

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        grad_input, grad_weight = torch.ops.aten._fused_rms_norm_backward(
            grad, x, ctx.normalized_shape, rstd, weight, mask
        )
        return grad_input, grad_weight, None, None


def planned_rms_norm(input, normalized_shape, weight=None, eps=None, *, composed):
    """CUDA's choice: the fused kernel, but for a weight of another dtype than the input's,
    which torch sends to the composed ops on a card too (``composed``: torch's own)."""
    shape = tuple(normalized_shape)
    torch._check(
        tuple(input.shape[input.dim() - len(shape) :]) == shape,
        lambda: f"rms_norm: input {tuple(input.shape)} does not end in {shape}",
    )
    if weight is not None and weight.dtype != input.dtype:
        return composed(input, normalized_shape, weight, eps)
    return FusedRmsNorm.apply(input, weight, shape, eps)


@contextlib.contextmanager
def fused_rms_norm():
    """``torch.rms_norm`` (called by ``F.rms_norm``, so by nn.RMSNorm and Opacus, and by flash's
    norm rule) planned as CUDA's fused kernel while inside; undone on the way out, however it
    ends (a module global: one prediction at a time)."""
    composed = torch.rms_norm
    torch.rms_norm = functools.partial(planned_rms_norm, composed=composed)
    try:
        yield
    finally:
        torch.rms_norm = composed
