"""The dtypes flash's norms and GEMMs compute in: sums of squares accumulate in fp32 (fp64 for
fp64 inputs); a Linear's norm GEMMs take its operands in the narrower of their dtypes; the
device type autocast is asked about."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def device_type(x: Tensor) -> str:
    """x's device type, as autocast's queries take it: x.device would make a torch.device
    object, host time on every managed layer's call."""
    return "cuda" if x.is_cuda else x.device.type


@functools.cache
def wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """torch.promote_types(a, b), found once per pair: torch's is an operator dispatch at every
    call (hundreds a step where a sink takes each parameter's sum)."""
    return torch.promote_types(a, b)


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in ``dtype``: x itself where it is in it already, with no call to x.to (a no-op cast is
    still an operator dispatch, and the sinks cast each parameter's sum: hundreds a step)."""
    return x if x.dtype == dtype else x.to(dtype)


def accumulation_dtype(x: Tensor) -> torch.dtype:
    return wider(x.dtype, torch.float32)


def to_accumulation(x: Tensor) -> Tensor:
    """Cast to the accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return x.to(wider(x.dtype, torch.float32))


def gemm_operands(A: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """A and G in one dtype for the norm GEMMs: under autocast a Linear's input can be fp32
    (a LayerNorm output) while its output gradient is bf16; the layer itself multiplied in
    the narrower dtype, and so do we (tensor cores), accumulating the squares in fp32."""
    if A.dtype == G.dtype:
        return A, G
    dtype = min((A.dtype, G.dtype), key=lambda t: torch.finfo(t).bits)
    return A.to(dtype), G.to(dtype)
