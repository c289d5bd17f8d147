"""Clipped weight gradient of a Linear layer: out[p, d] (+)= sum_b c_b * (G_b^T A_b), in fp32.

Each sample's product G_b^T A_b is accumulated over its tokens in fp32 registers and only then
weighted by its fp32 clip factor: neither c nor c * G is rounded to 16 bits (the torch path folds
c into a bf16 operand and must shrink c by one bf16 ulp to keep each sample's norm <= C; this
path needs no shrink, see clip_schedule).

One program per output tile (and per token range where there are few tiles: split_count),
walking the samples in the order of clip_schedule with one fp32 accumulator, rescaled between
samples (RESCALE, as flash attention rescales its output), or with a per-sample accumulator added
to a running total (two accumulators: at most 128 x 128 tiles fit the register file).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch._utils import _unflatten_dense_tensors

from dp_cost.flash.kernels.common import TL_DTYPES, int64_table


@triton.jit
def _clipped_gemm_kernel(
    A, G, out, c, order, scale, ratio,
    B, T, D, P, splits,
    stride_ab, stride_at, stride_ad,
    stride_gb, stride_gt, stride_gp,
    stride_op, stride_od,
    ACCUMULATE: tl.constexpr, RESCALE: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_P: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # Output tiles in groups of GROUP_P rows of tiles, so that programs running together share
    # the G and A blocks they read (L2).
    tile = tl.program_id(0)
    n_tiles_p, n_tiles_d = tl.cdiv(P, BLOCK_P), tl.cdiv(D, BLOCK_D)
    per_group = GROUP_P * n_tiles_d
    first_p = (tile // per_group) * GROUP_P
    group_rows = tl.minimum(n_tiles_p - first_p, GROUP_P)
    rows_p = (first_p + (tile % per_group) % group_rows) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols_d = ((tile % per_group) // group_rows) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_T)
    rows_p64, cols_d64, t64 = rows_p.to(tl.int64), cols_d.to(tl.int64), t.to(tl.int64)
    # This program's range of the (sample, token block) iterations, samples in schedule order.
    # A range past the end is empty: its loop does not run and it adds zeros.
    n_blocks = tl.cdiv(T, BLOCK_T)
    per_split = tl.cdiv(B * n_blocks, splits)
    i_start = tl.program_id(1) * per_split
    i_end = tl.minimum(i_start + per_split, B * n_blocks)
    k_first, k_last = i_start // n_blocks, (i_end - 1) // n_blocks
    # G_b^T read as [BLOCK_T, BLOCK_P] (p contiguous) and transposed on chip
    tile_g = t64[:, None] * stride_gt + rows_p64[None, :] * stride_gp
    tile_a = t64[:, None] * stride_at + cols_d64[None, :] * stride_ad
    in_p, in_d = rows_p[None, :] < P, cols_d[None, :] < D
    acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    total = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    if FLATTEN:  # one loop over (sample, token block): the load pipeline runs across samples
        for i in range(i_start, i_end):
            k = i // n_blocks
            j = i - k * n_blocks
            if RESCALE:
                if j == 0:  # acc: sum over earlier k' of (c_k' / c_k) P_k', ratio <= 1
                    acc = acc * tl.load(ratio + k)
            if RESCALE:
                b = tl.load(order + k).to(tl.int64)
            else:  # samples in their own order: no load feeds the addresses (pipelining)
                b = tl.cast(k, tl.int64)
            row = (j * BLOCK_T).to(tl.int64)
            in_t = (j * BLOCK_T + t < T)[:, None]
            g = tl.load(G + b * stride_gb + row * stride_gt + tile_g, mask=in_t & in_p, other=0.0)
            a = tl.load(A + b * stride_ab + row * stride_at + tile_a, mask=in_t & in_d, other=0.0)
            acc = tl.dot(tl.trans(g), a, acc, input_precision=INPUT_PRECISION)
            if not RESCALE:
                if (j == n_blocks - 1) | (i == i_end - 1):  # the sample's last block here
                    total += tl.load(c + k) * acc
                    acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    else:  # a loop over samples, each pipelining its own token blocks
        for k in range(k_first, k_last + 1):
            if RESCALE:
                b = tl.load(order + k).to(tl.int64)
            else:
                b = tl.cast(k, tl.int64)
            j_first = tl.maximum(i_start - k * n_blocks, 0)
            j_end = tl.minimum(i_end - k * n_blocks, n_blocks)
            if RESCALE:
                acc = acc * tl.load(ratio + k)
            else:
                acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
            ptr_g = G + b * stride_gb + j_first.to(tl.int64) * BLOCK_T * stride_gt + tile_g
            ptr_a = A + b * stride_ab + j_first.to(tl.int64) * BLOCK_T * stride_at + tile_a
            for j in range(j_first, j_end):
                in_t = (j * BLOCK_T + t < T)[:, None]
                g = tl.load(ptr_g, mask=in_t & in_p, other=0.0)
                a = tl.load(ptr_a, mask=in_t & in_d, other=0.0)
                acc = tl.dot(tl.trans(g), a, acc, input_precision=INPUT_PRECISION)
                ptr_g += BLOCK_T * stride_gt
                ptr_a += BLOCK_T * stride_at
            if not RESCALE:
                total += tl.load(c + k) * acc
    if RESCALE:
        total = acc * tl.load(scale + k_last)
    ptr_out = out + rows_p64[:, None] * stride_op + cols_d64[None, :] * stride_od
    in_out = (rows_p[:, None] < P) & (cols_d[None, :] < D)
    if splits > 1:  # token ranges of one tile: out was zeroed or holds .grad
        tl.atomic_add(ptr_out, total, mask=in_out)
    else:
        if ACCUMULATE:
            total += tl.load(ptr_out, mask=in_out, other=0.0)
        tl.store(ptr_out, total, mask=in_out)


def _config(rescale, flatten, block_p, block_d, block_t, warps, stages):
    meta = {"RESCALE": rescale, "FLATTEN": flatten, "BLOCK_P": block_p, "BLOCK_D": block_d}
    meta |= {"BLOCK_T": block_t, "GROUP_P": 8}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


CONFIGS = [  # the best of nine on an H200 at the 1b shapes (two-accumulator: 128 x 128 at most)
    _config(True, False, 128, 256, 64, 8, 4),
    _config(True, False, 256, 128, 64, 8, 3),
    _config(False, False, 128, 128, 64, 8, 4),
    _config(False, True, 128, 128, 128, 8, 3),
]

# Tried once per (B, T, d, p, split, dtype) on the card. The trials run the kernel on the real
# out: restore_value puts back what it held (the .grad being accumulated into, or zeros).
_clipped_gemm_autotuned = triton.autotune(
    configs=CONFIGS, key=["B", "T", "D", "P", "splits"], restore_value=["out"]
)(_clipped_gemm_kernel)


def clip_schedule(c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(c, order, scale, ratio) for c [B]: c in fp32, samples by ascending c, their c, c_{k-1} / c_k
    (0 after a zero c, whose sample must not count). The rescaling kernel multiplies its
    accumulator by ratio[k] before sample k and by scale[last] at the end, so sample k is weighted
    by c_k times a product of at most 2B fp32 roundings (relative B * 2^-23 at most); ascending,
    no ratio exceeds 1 and nothing overflows. Built on the device, no host sync."""
    c = c.to(torch.float32)
    order = torch.argsort(c, stable=True)
    scale = c[order].contiguous()
    previous = torch.cat([scale.new_zeros(1), scale[:-1]])
    ratio = torch.where(previous > 0, previous / torch.where(previous > 0, scale, 1.0), 0.0)
    return c.contiguous(), order.to(torch.int32), scale, ratio


# Splitting a tile's tokens over programs pays where there are fewer tiles than SMs; each
# program keeps at least this many token blocks (of 64) so its pipeline runs full.
MIN_BLOCKS_PER_SPLIT = 16
_SPLIT_TILE = 128 * 128  # the smallest output tile of CONFIGS


def split_count(B: int, T: int, D: int, P: int, device: torch.device) -> int:
    """Programs per output tile: 1 unless the (smallest) tiles leave most SMs idle."""
    if device.type != "cuda":
        return 1
    tiles = triton.cdiv(P * D, _SPLIT_TILE)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if 2 * tiles > sms:
        return 1
    return max(1, min(sms // tiles, B * triton.cdiv(T, 64) // MIN_BLOCKS_PER_SPLIT))


@triton.jit
def _folded(x, scale, DTYPE: tl.constexpr):
    """x * scale formed in fp32 and rounded toward zero to DTYPE."""
    x = x.to(tl.float32) * scale
    y = x.to(DTYPE)  # to nearest; one step toward zero (sign-magnitude) where it rounded up
    up = tl.abs(y.to(tl.float32)) > tl.abs(x)
    return tl.where(up, (y.to(tl.int16, bitcast=True) - 1).to(DTYPE, bitcast=True), y)


@triton.jit
def _fold_kernel(table, c, BLOCK: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """out_i = X_i * c[sample] for a list of contiguous X_i [B*T_i, n_i] in one launch (program
    (j, i): block j of X_i), each product formed in fp32 and rounded toward zero to 16 bits:
    never above c * x in magnitude. ``table`` rows: X_i's pointer, out_i's (X_i's own, in place:
    each element is read before it is written, by the same program), elements per sample
    (T_i n_i), elements, the offset of X_i's factors in ``c`` (per-layer clipping: its row).
    ALIGNED: every X_i and out_i starts 16-byte aligned (the caller checked), so a whole block's
    loads and stores are 16 bytes wide; Triton cannot know it of a pointer read from a table."""
    i = tl.program_id(1)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    left = tl.load(table + 5 * i + 3) - first
    if left > 0:  # the programs past a smaller X_i do nothing
        source = tl.load(table + 5 * i).to(tl.pointer_type(DTYPE))
        out = tl.load(table + 5 * i + 1).to(tl.pointer_type(DTYPE))
        if ALIGNED:
            source = tl.multiple_of(source, 16)
            out = tl.multiple_of(out, 16)
        # The block's base as a scalar, its lanes as 32-bit offsets: no 64-bit math per element.
        source += first
        out += first
        per_sample = tl.load(table + 5 * i + 2)
        c = c + tl.load(table + 5 * i + 4)
        lanes = tl.arange(0, BLOCK)
        keep = lanes < left
        first_sample = first // per_sample  # one 64-bit division a program, not one an element
        within = first - first_sample * per_sample
        if per_sample >= BLOCK:
            # At most one sample boundary in the block: two scalar loads of c, not a gather of
            # it per element.
            boundary = per_sample - within  # the first lane of the next sample
            here = tl.load(c + first_sample)
            after = tl.load(c + first_sample + 1, mask=boundary < left, other=0.0)
            scale = tl.where(lanes >= boundary, after, here)
        else:
            later = (within.to(tl.int32) + lanes) // per_sample.to(tl.int32)
            scale = tl.load(c + first_sample + later, mask=keep, other=0.0)
        if left >= BLOCK:  # a whole block: no mask, which would narrow the loads to one element
            tl.store(out + lanes, _folded(tl.load(source + lanes), scale, DTYPE))
        else:
            x = tl.load(source + lanes, mask=keep, other=0.0)
            tl.store(out + lanes, _folded(x, scale, DTYPE), mask=keep)


FOLD_BLOCK = 1024  # elements per program: memory-bound, as the weighted sums (same block)
FOLD_WARPS = 4


def fold_clip_factors(X: torch.Tensor, c: torch.Tensor, tokens: int) -> torch.Tensor:
    """X [B*T, n] (bf16/fp16) with each sample's T rows times its fp32 clip factor c_b, rounded
    toward zero: the operand of a one-GEMM clipped sum that keeps each sample within C with no
    shrinking of c (ClipFactors.to shrinks c by an ulp because it rounds c * x to nearest)."""
    return fold_clip_factors_many([X], c, [tokens])[0]


def fold_clip_factors_many(
    Xs: list[torch.Tensor],
    c: torch.Tensor,
    tokens: list[int],
    in_place: list[bool] | None = None,
    rows: list[int] | None = None,
) -> list[torch.Tensor]:
    """fold_clip_factors of several 2-D operands of one dtype and device, ``tokens`` rows per
    sample each, in one launch: a Python launch of Triton costs tens of microseconds of host
    time, and a step folds c into every Gram- and direct-route Linear's operand. Where
    ``in_place[i]`` (and X_i is contiguous) X_i itself is overwritten and returned; the other
    results are views into one new buffer (it is freed with the last of them). ``rows``: c is
    [P, B], and X_i takes row rows[i] (per-layer clipping); else c [B] serves every X_i."""
    if len({(X.dtype, X.device) for X in Xs}) != 1 or Xs[0].element_size() != 2:
        raise ValueError("fold_clip_factors_many needs operands of one 16-bit dtype and device")
    if c.dim() != (1 if rows is None else 2):
        raise ValueError(f"c must be [B] (or [P, B] with rows), got {tuple(c.shape)}")
    in_place = in_place or [False] * len(Xs)
    # a non-contiguous X is copied first: that copy is folded in place (it is the caller's)
    overwrite = [own or not X.is_contiguous() for X, own in zip(Xs, in_place, strict=True)]
    Xs = [X.contiguous() for X in Xs]
    fresh = [X for X, own in zip(Xs, overwrite) if not own]
    outs = iter(_unflatten_dense_tensors(Xs[0].new_empty(sum([X.numel() for X in fresh])), fresh))
    folded = [X if own else next(outs) for X, own in zip(Xs, overwrite)]
    sizes = [X.numel() for X in Xs]
    if max(sizes, default=0):
        # A table of this launch's operands only (their sizes change with B and T: a cached
        # per-block table, as the weighted sums keep for parameters, would grow with them).
        B = c.shape[-1]
        offsets = [0] * len(Xs) if rows is None else [row * B for row in rows]
        entries = zip(Xs, folded, tokens, offsets, strict=True)
        table_rows = [[X.data_ptr(), out.data_ptr(), max(1, T * X.shape[1]), X.numel(), at]
                      for X, out, T, at in entries]  # fmt: skip
        device = Xs[0].device
        table = int64_table(table_rows, device)
        # every X_i and out_i 16-byte aligned: read from the table's own pointers
        aligned = all([row[0] % 16 == 0 and row[1] % 16 == 0 for row in table_rows])
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _fold_kernel[(triton.cdiv(max(sizes), FOLD_BLOCK), len(Xs))](
                table, c.to(device, torch.float32).contiguous(),
                BLOCK=FOLD_BLOCK, DTYPE=TL_DTYPES[Xs[0].dtype], num_warps=FOLD_WARPS,
                ALIGNED=aligned,
            )  # fmt: skip
    return folded


def clipped_weight_grad_supported(A: torch.Tensor, G: torch.Tensor) -> bool:
    """Can clipped_weight_grad run on these (CUDA, one kernel dtype, [B, T, d] and [B, T, p])?"""
    return clipped_weight_grad_supported_each([(A, G)])[0]


def clipped_weight_grad_supported_each(pairs: list[tuple]) -> list[bool]:
    """clipped_weight_grad_supported of each (A, G), in one call (the folds of a step's Linear
    layers ask it of every one: a Python call per layer is host time)."""
    return [
        A.is_cuda and G.get_device() == A.get_device() and A.dtype in TL_DTYPES
        and A.dtype == G.dtype and A.dim() == G.dim() == 3 and A.shape[:2] == G.shape[:2]
        for A, G in pairs
    ]  # fmt: skip


def clipped_weight_grad(
    A: torch.Tensor,
    G: torch.Tensor,
    c: torch.Tensor,
    out: torch.Tensor | None = None,
    schedule: tuple | None = None,
    splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """sum_b c_b * G_b^T A_b [p, d] in fp32 for A [B, T, d], G [B, T, p] of one dtype and c [B];
    added into ``out`` (an fp32 [p, d], e.g. a .grad) when given. ``schedule``: clip_schedule(c),
    made once per chunk by the caller. ``splits`` (programs per output tile) and ``config``
    (meta-parameters of one of CONFIGS, and num_warps / num_stages) fix what is otherwise chosen
    (tests)."""
    if A.dim() != 3 or G.dim() != 3 or A.shape[:2] != G.shape[:2] or A.dtype != G.dtype:
        raise ValueError(
            f"need A [B, T, d] and G [B, T, p] of one dtype; got {tuple(A.shape)} {A.dtype}, "
            f"{tuple(G.shape)} {G.dtype}"
        )
    (B, T, D), P = A.shape, G.shape[2]
    if c.shape != (B,):
        raise ValueError(f"c must have shape [{B}], got {tuple(c.shape)}")
    if out is not None and (out.shape != (P, D) or out.dtype != torch.float32):
        raise ValueError(f"out must be fp32 [{P}, {D}], got {out.dtype} {tuple(out.shape)}")
    if splits is None:
        splits = split_count(B, T, D, P, A.device)
    accumulate = out is not None
    if out is None:  # atomic adds from several programs need zeros underneath
        out = (torch.zeros if splits > 1 else torch.empty)(P, D, device=A.device)
    if B == 0 or T == 0 or P == 0 or D == 0:
        return out if accumulate else out.zero_()
    c, order, scale, ratio = clip_schedule(c) if schedule is None else schedule

    def grid(meta):
        return (triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(D, meta["BLOCK_D"]), splits)

    args = (
        A, G, out, c, order, scale, ratio, B, T, D, P, splits,
        A.stride(0), A.stride(1), A.stride(2), G.stride(0), G.stride(1), G.stride(2),
        out.stride(0), out.stride(1),
    )  # fmt: skip
    precision = "ieee" if A.dtype == torch.float32 else "tf32"  # 16-bit: tensor cores anyway
    fixed = {"ACCUMULATE": accumulate, "INPUT_PRECISION": precision}
    if config is None and not A.is_cuda:  # interpreted (tests): no card to autotune on
        config = {"RESCALE": True, "FLATTEN": False, "BLOCK_P": 32, "BLOCK_D": 32}
        config |= {"BLOCK_T": 32, "GROUP_P": 4}
    if config is None:
        _clipped_gemm_autotuned[grid](*args, **fixed)
    else:
        _clipped_gemm_kernel[grid(config)](*args, **config, **fixed)
    return out
