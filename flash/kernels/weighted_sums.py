"""The clipped sums of kept per-sample gradients: one read of each, one launch for all."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from flash.kernels._common import (
    _TL_DTYPES,
    _block_table,
    _on_cuda_in_kernel_dtypes,
    _table_to,
)

WEIGHTED_SUM_BLOCK = 2048  # elements per program; memory-bound like the noise kernel


@triton.jit
def _weighted_sum_kernel(
    table, tensor_of_block, first_block, sizes, weights, batch,
    BLOCK: tl.constexpr, SOURCE_DTYPE: tl.constexpr, TARGET_DTYPE: tl.constexpr,
):  # fmt: skip
    """target_i (+)= sum_b weights[b] * source_i[b] for a list of (source [B, n_i], target [n_i])
    in one launch. ``table`` rows: source pointer, target pointer, accumulate (0: overwrite)."""
    block = tl.program_id(0)
    i = tl.load(tensor_of_block + block)
    n = tl.load(sizes + i)
    source = tl.load(table + 3 * i).to(tl.pointer_type(SOURCE_DTYPE))
    target = tl.load(table + 3 * i + 1).to(tl.pointer_type(TARGET_DTYPE))
    offsets = (block - tl.load(first_block + i)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in range(batch):  # weights in fp32: c_b * x_b rounded once, in fp32
        x = tl.load(source + b * n + offsets, mask=keep, other=0.0)
        total += tl.load(weights + b) * x.to(tl.float32)
    if tl.load(table + 3 * i + 2) != 0:
        total += tl.load(target + offsets, mask=keep, other=0.0).to(tl.float32)
    tl.store(target + offsets, total.to(TARGET_DTYPE), mask=keep)


def weighted_sums_supported(target: torch.Tensor, source: torch.Tensor) -> bool:
    """Can weighted_sums_ run on these (CUDA, a kernel dtype, contiguous)?"""
    return (
        _on_cuda_in_kernel_dtypes(target, source)
        and target.is_contiguous()
        and source.is_contiguous()
    )


def weighted_sums_(
    targets: list[torch.Tensor],
    sources: list[torch.Tensor],
    weights: torch.Tensor,
    accumulate: list[bool],
) -> None:
    """targets[i] = (targets[i] if accumulate[i] else 0) + sum_b weights[b] * sources[i][b], in
    place, one launch per (source dtype, target dtype), accumulated in fp32.

    Flash's clipped sum of kept per-sample gradients (sources [B, ...], weights the clip factors
    [B]). torch's ``weights @ sources.flatten(1)`` is a GEMV with K = B, which cuBLAS runs at a
    third of the copy bandwidth (76 us against a 23 us read floor for [8, 2048 x 2048] bf16 on an
    H100), writes its result in the source dtype and leaves the cast and the add to .grad to two
    more passes; here each source is read once and each target written once, in its own dtype.
    """
    if not (len(targets) == len(sources) == len(accumulate)):
        raise ValueError("weighted_sums_ needs one source and one accumulate flag per target")
    B = weights.shape[0]
    for target, source in zip(targets, sources, strict=True):
        if source.shape[0] != B or source[0].numel() != target.numel():
            raise ValueError(
                f"source {tuple(source.shape)} does not match weights [{B}] and a target of "
                f"{target.numel()} elements"
            )
        if not (target.is_contiguous() and source.is_contiguous()):
            raise ValueError("weighted_sums_ needs contiguous tensors")
    groups: dict[tuple, list[int]] = {}
    for i, (target, source) in enumerate(zip(targets, sources, strict=True)):
        if source.device != target.device:
            raise ValueError(f"source on {source.device}, target on {target.device}")
        groups.setdefault((target.device, source.dtype, target.dtype), []).append(i)
    for (device, source_dtype, target_dtype), members in groups.items():
        weights_here = weights.to(device, torch.float32).contiguous()
        sizes = tuple(targets[i].numel() for i in members)
        tensor_of_block, first_block, numels = _block_table(device, sizes, WEIGHTED_SUM_BLOCK)
        table = torch.tensor(
            [[sources[i].data_ptr(), targets[i].data_ptr(), int(accumulate[i])] for i in members],
            dtype=torch.int64,
        )
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _weighted_sum_kernel[(len(tensor_of_block),)](
                _table_to(table, device), tensor_of_block, first_block, numels, weights_here, B,
                BLOCK=WEIGHTED_SUM_BLOCK, SOURCE_DTYPE=_TL_DTYPES[source_dtype],
                TARGET_DTYPE=_TL_DTYPES[target_dtype],
            )  # fmt: skip
