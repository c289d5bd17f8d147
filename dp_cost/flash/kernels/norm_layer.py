"""LayerNorm / RMSNorm per-sample gradients of weight and bias in one pass over x and g."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dp_cost.flash.kernels.common import TL_DTYPES, int64_table, on_cuda_in_kernel_dtypes


@triton.jit
def _norm_layer_grads_kernel(
    X, G, out, T, D, eps,
    stride_xb, stride_xt, stride_gb, stride_gt,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, RMS: tl.constexpr,
):  # fmt: skip
    """One program per (token tile, sample): sum over the tile's tokens of g_t * xhat_t (the
    weight's gradient) and of g_t (the bias's), written to out[0 / 1, b, tile, :]; one torch
    reduction then sums the tiles (deterministic, no atomics). xhat is recomputed from x in
    fp32 as the layer did: (x - mean) / sqrt(var + eps), or x / sqrt(mean(x^2) + eps) for
    RMSNorm. A tile's rows are read three times (mean, variance, sums), the second and third
    from L2."""
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    x_rows = X + b * stride_xb + rows.to(tl.int64)[:, None] * stride_xt
    g_rows = G + b * stride_gb + rows.to(tl.int64)[:, None] * stride_gt
    row_ok = rows[:, None] < T
    mean = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if not RMS:
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            keep = row_ok & (d0 + cols[None, :] < D)
            x = tl.load(x_rows + d0 + cols[None, :], mask=keep, other=0.0).to(tl.float32)
            total += tl.sum(x, axis=1)
        mean = total / D
    squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        keep = row_ok & (d0 + cols[None, :] < D)
        x = tl.load(x_rows + d0 + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        centred = tl.where(keep, x - mean[:, None], 0.0)
        squares += tl.sum(centred * centred, axis=1)
    # rows past T have zero variance: 1/sqrt(eps) is inf for eps = 0, and inf * 0 a NaN that
    # tl.sum would spread over the tile; give them any finite scale (their x and g are 0)
    rstd = 1.0 / tl.sqrt(tl.where(rows < T, squares / D + eps, 1.0))
    # out [2, B, tiles, D]: the weight's partials, then the bias's (each a contiguous [B, D] sum)
    out_weight = out + (b * tl.num_programs(0) + tile) * D
    out_bias = out_weight + tl.num_programs(1).to(tl.int64) * tl.num_programs(0) * D
    for d0 in range(0, D, BLOCK_D):
        keep = row_ok & (d0 + cols[None, :] < D)
        x = tl.load(x_rows + d0 + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        g = tl.load(g_rows + d0 + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        xhat = (x - mean[:, None]) * rstd[:, None]
        in_row = d0 + cols < D
        tl.store(out_weight + d0 + cols, tl.sum(g * xhat, axis=0), mask=in_row)
        tl.store(out_bias + d0 + cols, tl.sum(g, axis=0), mask=in_row)


@triton.jit
def _norm_layer_rows_kernel(
    X, G, out, T, D, eps,
    stride_xb, stride_xt, stride_gb, stride_gt, TILES_PER_PROGRAM,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, RMS: tl.constexpr,
    TABLE: tl.constexpr = False, X_DTYPE: tl.constexpr = None, G_DTYPE: tl.constexpr = None,
):  # fmt: skip
    """_norm_layer_grads_kernel for rows that fit on chip (BLOCK_D >= D): each BLOCK_T-row tile
    of x and g is loaded once, both loads issued together, its mean, variance and xhat formed in
    registers (the same two-pass fp32 arithmetic), and the column sums of TILES_PER_PROGRAM
    consecutive tiles kept in registers before one partial row is written per program. The
    blocked kernel reads each x row three times, serially; this one reads HBM once.

    TABLE: several layers of one B, T and D in one launch (program axis 2: the layer), X a table
    of one row per layer (x's pointer, its batch and token strides, then g's) and G unused; out
    [layers, 2, B, programs, D]."""
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if TABLE:  # alignment hints: what norm_layer_per_sample_grads_many checks (wide loads)
        layer = tl.program_id(2).to(tl.int64)
        row = X + 6 * layer
        X = tl.multiple_of(tl.load(row).to(tl.pointer_type(X_DTYPE)), 16)
        stride_xb = tl.multiple_of(tl.load(row + 1), 8)
        stride_xt = tl.multiple_of(tl.load(row + 2), 8)
        G = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(G_DTYPE)), 16)
        stride_gb = tl.multiple_of(tl.load(row + 4), 8)
        stride_gt = tl.multiple_of(tl.load(row + 5), 8)
        out += layer * 2 * tl.num_programs(1) * tl.num_programs(0) * D
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    sum_weight = tl.zeros((BLOCK_D,), dtype=tl.float32)
    sum_bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first = chunk * TILES_PER_PROGRAM * BLOCK_T
    for i in range(TILES_PER_PROGRAM):
        rows = first + i * BLOCK_T + tl.arange(0, BLOCK_T)
        keep = (rows[:, None] < T) & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + b * stride_xb + rows64 * stride_xt + cols[None, :], mask=keep, other=0.0)
        g = tl.load(G + b * stride_gb + rows64 * stride_gt + cols[None, :], mask=keep, other=0.0)
        x = x.to(tl.float32)
        if RMS:
            centred = x
        else:
            centred = tl.where(keep, x - (tl.sum(x, axis=1) / D)[:, None], 0.0)
        squares = tl.sum(centred * centred, axis=1)
        # rows past T: any finite scale (see _norm_layer_grads_kernel)
        rstd = 1.0 / tl.sqrt(tl.where(rows < T, squares / D + eps, 1.0))
        g = g.to(tl.float32)
        sum_weight += tl.sum(g * (centred * rstd[:, None]), axis=0)
        sum_bias += tl.sum(g, axis=0)
    out_weight = out + (b * tl.num_programs(0) + chunk) * D
    out_bias = out_weight + tl.num_programs(1).to(tl.int64) * tl.num_programs(0) * D
    tl.store(out_weight + cols, sum_weight, mask=col_ok)
    tl.store(out_bias + cols, sum_bias, mask=col_ok)


MAX_LAYERS_PER_LAUNCH = 65535  # CUDA's grid z axis: norm_layer_per_sample_grads_many's layers

# Rows up to this many features (padded to a power of two) go through _norm_layer_rows_kernel,
# BLOCK_T x BLOCK_D = 8192 elements per tile (8 warps: 32 fp32 registers per thread per tile).
ROW_KERNEL_ELEMENTS = 8192


def norm_layer_grads_supported(x: torch.Tensor, g: torch.Tensor) -> bool:
    """Can norm_layer_per_sample_grads run on x and g (CUDA, kernel dtypes, unit feature stride)?"""
    return on_cuda_in_kernel_dtypes(x, g) and x.stride(-1) == 1 and g.stride(-1) == 1


def norm_layer_grads_many_supported(x: torch.Tensor, g: torch.Tensor) -> bool:
    """Can norm_layer_per_sample_grads_many take x and g ([B, T, d] of one shape, rows held on
    chip whole, B within the 65535 programs of CUDA's y grid axis)?"""
    return norm_layer_grads_many_supported_each([(x, g)])[0]


def norm_layer_grads_many_supported_each(pairs: list[tuple]) -> list[bool]:
    """norm_layer_grads_many_supported of each (x, g), in one call (a Python call per layer is
    host time; the 1b model has 41 LayerNorms)."""
    return [x.is_cuda and ok for (x, _), ok in zip(pairs, _groupable_each(pairs), strict=True)]


def _groupable_each(pairs: list[tuple]) -> list[bool]:
    """Can the grouped kernel read each (x, g): on one device, kernel dtypes, [B, T, d] of one
    shape, features contiguous, its alignment hints (16-byte aligned starts, strides multiples
    of 8 elements), rows held on chip whole and B within CUDA's y grid axis? Builtins only in the
    loop: _fits_one_launch's test inline."""
    return [
        x.get_device() == g.get_device() and x.dtype in TL_DTYPES and g.dtype in TL_DTYPES
        and x.dim() == 3 and x.shape == g.shape and x.stride(2) == 1 and g.stride(2) == 1
        and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0
        and g.data_ptr() % 16 == 0 and g.stride(0) % 8 == 0 and g.stride(1) % 8 == 0
        and (1 << (x.shape[2] - 1).bit_length()) <= ROW_KERNEL_ELEMENTS and x.shape[0] <= 65535
        for x, g in pairs
    ]  # fmt: skip


def _fits_one_launch(x: torch.Tensor) -> bool:
    """Rows held on chip whole, and B within the 65535 programs of CUDA's y grid axis."""
    return triton.next_power_of_2(x.shape[2]) <= ROW_KERNEL_ELEMENTS and x.shape[0] <= 65535


def _whole_row_tiles(B: int, T: int, D: int) -> tuple[int, int, int]:
    """_norm_layer_rows_kernel's (BLOCK_T, tiles per program, programs per sample): a few tiles
    per program (fewer partial rows to write and sum), while B x programs still fills the card
    several times over (>= 1024 programs where T allows)."""
    block_t = ROW_KERNEL_ELEMENTS // triton.next_power_of_2(D)
    tiles = triton.cdiv(T, block_t)
    per_program = max(1, min(8, tiles * B // 1024))
    return block_t, per_program, triton.cdiv(tiles, per_program)


def norm_layer_per_sample_grads_many(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], eps: float, rms: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """norm_layer_per_sample_grads of several layers' (x, g), all [B, T, d] of one shape, x
    dtype, g dtype and device (norm_layer_grads_many_supported), with one eps, in one launch: a
    Triton launch costs tens of microseconds of host time, more than one layer's kernel at short
    sequences (the 1b model has 41 LayerNorms). Each (weight, bias) [B, d] is a view into one
    buffer of them all."""
    x0, g0 = pairs[0]
    if x0.dim() == 3 and not _fits_one_launch(x0):
        raise ValueError(f"rows of {x0.shape[2]} features or {x0.shape[0]} samples: one by one")
    kinds = (x0.shape, x0.dtype, g0.dtype, x0.get_device(), x0.get_device())
    if not all(_groupable_each(pairs)) or not all([
        (x.shape, x.dtype, g.dtype, x.get_device(), g.get_device()) == kinds for x, g in pairs
    ]):  # fmt: skip
        raise ValueError(
            "norm_layer_per_sample_grads_many needs (x, g) [B, T, d] of one shape, kernel dtypes "
            "and device, features contiguous, rows 16-byte aligned"
        )
    if len(pairs) > MAX_LAYERS_PER_LAUNCH:  # the grid's z axis (layers) holds 65535 programs
        first, rest = pairs[:MAX_LAYERS_PER_LAUNCH], pairs[MAX_LAYERS_PER_LAUNCH:]
        return [
            *norm_layer_per_sample_grads_many(first, eps, rms),
            *norm_layer_per_sample_grads_many(rest, eps, rms),
        ]
    B, T, D = x0.shape
    if B == 0 or T == 0 or D == 0:
        zeros = x0.new_zeros(len(pairs), 2, B, D, dtype=torch.float32)
        return [(weight, bias) for weight, bias in zeros.unbind(0)]
    block_t, per_program, programs = _whole_row_tiles(B, T, D)
    partials = torch.empty(len(pairs), 2, B, programs, D, device=x0.device, dtype=torch.float32)
    table = int64_table(
        [[x.data_ptr(), x.stride(0), x.stride(1), g.data_ptr(), g.stride(0), g.stride(1)]
         for x, g in pairs],
        x0.device,
    )  # fmt: skip
    with torch.cuda.device(x0.device) if x0.is_cuda else contextlib.nullcontext():
        _norm_layer_rows_kernel[(programs, B, len(pairs))](
            table, table, partials, T, D, eps, 0, 0, 0, 0, per_program,
            BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(D), RMS=rms, num_warps=8,
            TABLE=True, X_DTYPE=TL_DTYPES[x0.dtype], G_DTYPE=TL_DTYPES[g0.dtype],
        )  # fmt: skip
    return [(weight, bias) for weight, bias in partials.sum(3).unbind(0)]


def norm_layer_per_sample_grads(
    x: torch.Tensor,
    g: torch.Tensor,
    eps: float,
    rms: bool,
    block_t: int | None = None,
    block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of a LayerNorm's (rms: RMSNorm's) weight and bias, [B, d] each in
    fp32, from its input x [B, T, d] and output gradient g [B, T, d]: sum_t g_t * xhat_t and
    sum_t g_t.

    The torch path recomputes xhat with F.layer_norm, then multiplies and reduces: about seven
    passes over [B, T, d] in fp32. Here x and g are read once from HBM and only per-program
    partial sums are written. Rows of d <= ROW_KERNEL_ELEMENTS (padded to a power of two) are
    held on chip whole (_norm_layer_rows_kernel); wider rows, or given ``block_t`` and
    ``block_d`` (tests), go through the blocked kernel, which rereads each row from L2. Times on
    an H100: benchmarks/history/2026-11-26.md.
    """
    if x.dim() != 3 or x.shape != g.shape:
        raise ValueError(
            f"need x and g [B, T, d] of one shape; got {tuple(x.shape)}, {tuple(g.shape)}"
        )
    B, T, D = x.shape
    if B == 0 or T == 0 or D == 0:
        zeros = x.new_zeros(2, B, D, dtype=torch.float32)
        return zeros[0], zeros[1]
    strides = (x.stride(0), x.stride(1), g.stride(0), g.stride(1))
    whole_row = triton.next_power_of_2(D)
    if block_t is None and block_d is None and whole_row <= ROW_KERNEL_ELEMENTS:
        block_t, per_program, programs = _whole_row_tiles(B, T, D)
        partials = torch.empty(2, B, programs, D, device=x.device, dtype=torch.float32)
        _norm_layer_rows_kernel[(programs, B)](
            x, g, partials, T, D, eps, *strides, per_program,
            BLOCK_T=block_t, BLOCK_D=whole_row, RMS=rms, num_warps=8,
        )  # fmt: skip
    else:
        block_t, block_d = block_t or 16, block_d or 256
        programs = triton.cdiv(T, block_t)
        partials = torch.empty(2, B, programs, D, device=x.device, dtype=torch.float32)
        _norm_layer_grads_kernel[(programs, B)](
            x, g, partials, T, D, eps, *strides, BLOCK_T=block_t, BLOCK_D=block_d, RMS=rms,
        )  # fmt: skip
    weight, bias = partials.sum(2).unbind(0)  # one reduction launch for both
    return weight, bias
