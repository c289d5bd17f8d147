"""Kept per-sample gradients: their per-sample squared norms and their clipped sums, each one
read of every gradient and one launch for all."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dp_cost.flash.kernels.common import (
    TL_DTYPES,
    block_offsets,
    block_table,
    int64_table,
)

# Elements per program. Both kernels are memory-bound: on an H100, blocks of 1024 (weighted
# sums, 4 warps) and 512 (norms, 2 warps) read 1.2-1.4x faster than blocks of 2048 or more
# (more programs, more loads in flight); benchmarks/history/2026-11-26.md.
WEIGHTED_SUM_BLOCK = 1024
ROW_NORM_BLOCK = 512
# Partials summed per step of a source's segmented sum: one tile of [rows, batch] in fp32, so
# each program keeps a few loads of 16 KB in flight.
SEGMENT_TILE = 4096


@triton.jit
def _squared_row_norms_kernel(
    table, tensor_of_block, first_block, sizes, partials, batch,
    BLOCK: tl.constexpr, SOURCE_DTYPE: tl.constexpr,
):  # fmt: skip
    """partials[block, b] = ||source_i[b, this block's columns]||^2 in fp32 for a list of
    sources [B, n_i] in one launch; ``table``: their pointers. The host sums the partials over
    blocks (deterministic: no atomics)."""
    block = tl.program_id(0)
    i = tl.load(tensor_of_block + block)
    n = tl.load(sizes + i)
    source = tl.load(table + i).to(tl.pointer_type(SOURCE_DTYPE))
    offsets = (block - tl.load(first_block + i)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    for b in range(batch):
        x = tl.load(source + b * n + offsets, mask=keep, other=0.0).to(tl.float32)
        tl.store(partials + block.to(tl.int64) * batch + b, tl.sum(x * x, axis=0))


@triton.jit
def _segment_sums_kernel(
    partials, offsets, out, batch, ROWS: tl.constexpr, BATCH: tl.constexpr,
):  # fmt: skip
    """out[i, b] = sum of partials[offsets[i]:offsets[i + 1], b]: one program per segment,
    which reads its rows a tile at a time in a fixed order (deterministic: no atomics)."""
    i = tl.program_id(0)
    start = tl.load(offsets + i)
    end = tl.load(offsets + i + 1)
    columns = tl.arange(0, BATCH)
    total = tl.zeros((ROWS, BATCH), dtype=tl.float32)
    for first in range(start, end, ROWS):
        rows = first + tl.arange(0, ROWS)
        keep = (rows[:, None] < end) & (columns[None, :] < batch)
        total += tl.load(
            partials + rows.to(tl.int64)[:, None] * batch + columns[None, :], mask=keep, other=0.0
        )
    tl.store(out + i.to(tl.int64) * batch + columns, tl.sum(total, axis=0), mask=columns < batch)


def squared_row_norms_many(sources: list[torch.Tensor], each: bool = False) -> torch.Tensor:
    """sum over ``sources`` (contiguous [B, ...], one dtype and CUDA device) of each sample's
    squared norm, [B] in fp32: flash's norms of kept per-sample gradients. torch's multi-tensor
    norm over the B rows of each reads them at about 2 TB/s on an H100 and needs a stack, a
    square and a sum after it; this reads each once, in one launch, then sums its partials.
    ``each``: each source's own, [len(sources), B] (per-layer clipping)."""
    if not sources:
        raise ValueError("squared_row_norms_many needs at least one tensor")
    if len({(x.dtype, x.device) for x in sources}) != 1 or not all(
        [x.is_contiguous() for x in sources]  # a list: a generator's every step is a call
    ):
        raise ValueError("squared_row_norms_many needs contiguous tensors of one dtype and device")
    B, device = sources[0].shape[0], sources[0].device
    if any([x.shape[0] != B for x in sources]):
        raise ValueError("squared_row_norms_many needs one batch size")
    sizes = tuple([x.numel() // B for x in sources]) if B else ()
    if not any(sizes):
        return torch.zeros((len(sources), B) if each else B, device=device, dtype=torch.float32)
    tensor_of_block, first_block, numels = block_table(device, sizes, ROW_NORM_BLOCK)
    partials = torch.empty(len(tensor_of_block), B, device=device, dtype=torch.float32)
    table = int64_table([x.data_ptr() for x in sources], device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _squared_row_norms_kernel[(len(tensor_of_block),)](
            table, tensor_of_block, first_block, numels, partials, B,
            BLOCK=ROW_NORM_BLOCK, SOURCE_DTYPE=TL_DTYPES[sources[0].dtype], num_warps=2,
        )  # fmt: skip
        if each:  # each source's partials are consecutive rows: a segmented sum
            # torch.segment_reduce gives each (source, sample) one thread that walks its rows:
            # 3.2 ms for a 1b block's at (8, 4096) on an H200, against 0.32 ms for the row norms
            # and this together (benchmarks/memory_kernels.py)
            out = torch.empty(len(sources), B, device=device, dtype=torch.float32)
            batch = triton.next_power_of_2(B)
            _segment_sums_kernel[(len(sources),)](
                partials, block_offsets(device, sizes, ROW_NORM_BLOCK), out, B,
                ROWS=max(1, SEGMENT_TILE // batch), BATCH=batch, num_warps=4,
            )  # fmt: skip
            return out
    return partials.sum(0)


@triton.jit
def _weighted_sum_kernel(
    table, tensor_of_block, first_block, sizes, weights, batch,
    BLOCK: tl.constexpr, SOURCE_DTYPE: tl.constexpr, TARGET_DTYPE: tl.constexpr,
):  # fmt: skip
    """target_i (+)= sum_b weights[b] * source_i[b] for a list of (source [B, n_i], target [n_i])
    in one launch. ``table`` rows: source pointer, target pointer, accumulate (0: overwrite),
    the offset of source_i's weights in ``weights`` (per-layer clipping: its row)."""
    block = tl.program_id(0)
    i = tl.load(tensor_of_block + block)
    n = tl.load(sizes + i)
    source = tl.load(table + 4 * i).to(tl.pointer_type(SOURCE_DTYPE))
    target = tl.load(table + 4 * i + 1).to(tl.pointer_type(TARGET_DTYPE))
    weights = weights + tl.load(table + 4 * i + 3)
    offsets = (block - tl.load(first_block + i)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in range(batch):  # weights in fp32: c_b * x_b rounded once, in fp32
        x = tl.load(source + b * n + offsets, mask=keep, other=0.0)
        total += tl.load(weights + b) * x.to(tl.float32)
    if tl.load(table + 4 * i + 2) != 0:
        total += tl.load(target + offsets, mask=keep, other=0.0).to(tl.float32)
    tl.store(target + offsets, total.to(TARGET_DTYPE), mask=keep)


def weighted_sums_supported(target: torch.Tensor, source: torch.Tensor) -> bool:
    """Can weighted_sums_ run on these (CUDA, a kernel dtype, contiguous)?"""
    return weighted_sums_supported_each([(target, source)])[0]


def weighted_sums_supported_each(pairs: list[tuple]) -> list[bool]:
    """weighted_sums_supported of each (target, source), in one call (one per parameter is
    host time: the product route keeps hundreds of per-sample gradients with LoRA)."""
    return [
        target.is_cuda and source.get_device() == target.get_device()
        and target.dtype in TL_DTYPES and source.dtype in TL_DTYPES
        and target.is_contiguous() and source.is_contiguous()
        for target, source in pairs
    ]  # fmt: skip


def weighted_sums_(
    targets: list[torch.Tensor],
    sources: list[torch.Tensor],
    weights: torch.Tensor,
    accumulate: list[bool],
    rows: list[int] | None = None,
) -> None:
    """targets[i] = (targets[i] if accumulate[i] else 0) + sum_b weights[b] * sources[i][b], in
    place, one launch per (source dtype, target dtype), accumulated in fp32. ``rows``: weights
    is [P, B] and sources[i] takes row rows[i] (per-layer clipping); else weights [B] serve all.

    Flash's clipped sum of kept per-sample gradients (sources [B, ...], weights the clip factors
    [B]). torch's ``weights @ sources.flatten(1)`` is a GEMV with K = B, which cuBLAS runs at a
    third of the copy bandwidth (76 us against a 23 us read floor for [8, 2048 x 2048] bf16 on an
    H100), writes its result in the source dtype and leaves the cast and the add to .grad to two
    more passes; here each source is read once and each target written once, in its own dtype.
    """
    if not (len(targets) == len(sources) == len(accumulate)):
        raise ValueError("weighted_sums_ needs one source and one accumulate flag per target")
    if weights.dim() != (1 if rows is None else 2):
        raise ValueError(f"weights must be [B] (or [P, B] with rows), got {tuple(weights.shape)}")
    B = weights.shape[-1]
    offsets = [0] * len(targets) if rows is None else [row * B for row in rows]
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
        sizes = tuple([targets[i].numel() for i in members])
        tensor_of_block, first_block, numels = block_table(device, sizes, WEIGHTED_SUM_BLOCK)
        table = int64_table(
            [
                [sources[i].data_ptr(), targets[i].data_ptr(), int(accumulate[i]), offsets[i]]
                for i in members
            ],
            device,
        )
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _weighted_sum_kernel[(len(tensor_of_block),)](
                table, tensor_of_block, first_block, numels, weights_here, B,
                BLOCK=WEIGHTED_SUM_BLOCK, SOURCE_DTYPE=TL_DTYPES[source_dtype],
                TARGET_DTYPE=TL_DTYPES[target_dtype],
            )  # fmt: skip


# Columns and tokens per program of the token sums: a [32, 128] tile of G per loop step, one
# program per (128 columns of a layer, sample), 8 warps: of the tiles benchmarks/memory_kernels.py
# tries, the least time at both of the 1b model's step shapes on an H200.
TOKEN_SUM_COLUMNS = 128
TOKEN_SUM_TOKENS = 32
TOKEN_SUM_WARPS = 8


@triton.jit
def _token_sums_kernel(
    table, tensor_of_block, first_block, T,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, SOURCE_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr = False,
):  # fmt: skip
    """out_i[b, cols] = sum_t source_i[b, t, cols] in fp32 for a list of sources [B, T, p_i] in
    one launch: program (block, b) -> (source i, this block's columns). ``table`` rows: source
    pointer, its batch and token strides, p_i, out_i's pointer ([B, p_i], contiguous).
    ALIGNED: every source starts 16-byte aligned and its strides and p_i are multiples of 8 (the
    caller checked), so loads are 16 bytes wide; Triton cannot know it of values read from a
    table, and a mask it cannot prove constant over 8 columns narrows each load to one element."""
    block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    i = tl.load(tensor_of_block + block)
    row = table + 5 * i
    source = tl.load(row).to(tl.pointer_type(SOURCE_DTYPE))
    stride_b, stride_t, P = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    if ALIGNED:
        source = tl.multiple_of(source, 16)
        stride_b = tl.multiple_of(stride_b, 8)
        stride_t = tl.multiple_of(stride_t, 8)
        P = tl.multiple_of(P, 8)
    source += b * stride_b
    out = tl.load(row + 4).to(tl.pointer_type(tl.float32)) + b * P
    cols = (block - tl.load(first_block + i)).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    col_ok = cols < P
    # Tiles added elementwise, summed over tokens once at the end: a sum over the tile's rows in
    # every iteration is a reduction across warps (shared memory and a barrier per tile).
    acc = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for start in range(0, T, BLOCK_T):
        tokens = start + tl.arange(0, BLOCK_T)
        keep = (tokens < T)[:, None] & col_ok[None, :]
        tile = tl.load(source + tokens[:, None] * stride_t + cols[None, :], mask=keep, other=0.0)
        acc += tile.to(tl.float32)
    tl.store(out + cols, tl.sum(acc, axis=0), mask=col_ok)


def token_sums_supported(source: torch.Tensor) -> bool:
    """Can token_sums_many take this [B, T, p] (CUDA, a kernel dtype, unit column stride, B
    within the 65535 programs of CUDA's y grid axis, where the kernel puts the samples)?"""
    return token_sums_supported_many([source])[0]


def token_sums_supported_many(sources: list[torch.Tensor]) -> list[bool]:
    """token_sums_supported of each source, in one call (one per layer is host time)."""
    return [
        s.is_cuda and s.dtype in TL_DTYPES and s.dim() == 3 and s.stride(2) == 1
        and s.shape[0] <= 65535
        for s in sources
    ]  # fmt: skip


def token_sums_many(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """[source.sum(1) in fp32 for source in sources], each [B, p_i] in its own storage, for
    sources [B, T, p_i] of one B, T, dtype and device, in one launch: the per-sample gradients of
    the biases of every Gram- and direct-route Linear layer of a step (their output gradients
    G), 120 reductions at the 1b model, each costing more host time than its GPU time."""
    if not sources:
        return []
    first = sources[0]
    B, T = first.shape[:2]
    device = first.get_device()
    if first.dtype not in TL_DTYPES or not all(
        [
            s.dim() == 3
            and s.shape[:2] == (B, T)
            and s.stride(2) == 1
            and s.dtype == first.dtype
            and s.get_device() == device
            for s in sources
        ]
    ):  # fmt: skip  (a list, not a generator: a generator's every step is a Python call)
        raise ValueError(
            "token_sums_many needs [B, T, p] sources of one B, T, kernel dtype and device, "
            "columns contiguous"
        )
    device = first.device
    outs = [torch.empty(B, s.shape[2], device=device, dtype=torch.float32) for s in sources]
    if B == 0 or T == 0:
        return [out.zero_() for out in outs]
    sizes = tuple([s.shape[2] for s in sources])
    tensor_of_block, first_block, _ = block_table(device, sizes, TOKEN_SUM_COLUMNS)
    table_rows = [[s.data_ptr(), s.stride(0), s.stride(1), s.shape[2], out.data_ptr()]
                  for s, out in zip(sources, outs, strict=True)]  # fmt: skip
    table = int64_table(table_rows, device)
    # what the kernel's ALIGNED hints claim, read from the table's own entries
    aligned = all([pointer % 16 == 0 and batch % 8 == 0 and token % 8 == 0 and width % 8 == 0
                   for pointer, batch, token, width, _ in table_rows])  # fmt: skip
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _token_sums_kernel[(len(tensor_of_block), B)](
            table, tensor_of_block, first_block, T,
            BLOCK_T=TOKEN_SUM_TOKENS, BLOCK_P=TOKEN_SUM_COLUMNS,
            SOURCE_DTYPE=TL_DTYPES[sources[0].dtype], num_warps=TOKEN_SUM_WARPS,
            ALIGNED=aligned,
        )  # fmt: skip
    return outs
