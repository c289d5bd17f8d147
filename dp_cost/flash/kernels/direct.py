"""Direct route: each tile of G_b^T A_b formed over all tokens on chip and square-summed there
(no B x p x d tensor reaches HBM)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dp_cost.flash.kernels.common import autotuned_norm_kernel, norm_kernel_args


@triton.jit
def _direct_kernel(
    A, G, out,
    T, D, P,
    stride_ab, stride_at, stride_ad,
    stride_gb, stride_gt, stride_gp,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (output tile, sample): the [BLOCK_P, BLOCK_D] tile of G_b^T A_b
    accumulated over all T tokens on chip, square-summed in registers and added to the
    sample's total. No B x p x d tensor is written."""
    n_tiles_d = tl.cdiv(D, BLOCK_D)
    tile = tl.program_id(0)
    rows_p = (tile // n_tiles_d) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols_d = (tile % n_tiles_d) * BLOCK_D + tl.arange(0, BLOCK_D)
    b = tl.program_id(1).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    # G_b^T is read as [BLOCK_P, BLOCK_T] by addressing; pointers advance one token block a step
    rows_p64, cols_d64, t64 = rows_p.to(tl.int64), cols_d.to(tl.int64), t.to(tl.int64)
    ptr_g = G + b * stride_gb + rows_p64[:, None] * stride_gp + t64[None, :] * stride_gt
    ptr_a = A + b * stride_ab + t64[:, None] * stride_at + cols_d64[None, :] * stride_ad
    tile_sum = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        g = tl.load(ptr_g, mask=(rows_p[:, None] < P) & (t0 + t[None, :] < T), other=0.0)
        a = tl.load(ptr_a, mask=(t0 + t[:, None] < T) & (cols_d[None, :] < D), other=0.0)
        tile_sum = tl.dot(g, a, tile_sum, input_precision=INPUT_PRECISION)
        ptr_g += BLOCK_T * stride_gt
        ptr_a += BLOCK_T * stride_at
    tl.atomic_add(out + b, tl.sum(tl.sum(tile_sum * tile_sum, axis=1), axis=0))


# Output tiles of a GEMM with fp32 accumulators; sizes tried once per (T, d, p, dtype) on the card.
_direct_autotuned = autotuned_norm_kernel(
    _direct_kernel,
    [
        triton.Config({"BLOCK_P": 128, "BLOCK_D": 128, "BLOCK_T": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_P": 128, "BLOCK_D": 256, "BLOCK_T": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_P": 64, "BLOCK_D": 128, "BLOCK_T": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_P": 128, "BLOCK_D": 128, "BLOCK_T": 32}, num_warps=4, num_stages=4),
    ],
)


def direct_squared_norms(
    A: torch.Tensor,
    G: torch.Tensor,
    blocks: tuple[int, int, int] | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """Per-sample ||G_b^T A_b||_F^2 [B] in fp32 for A [B, T, d] and G [B, T, p] of one dtype,
    the per-sample gradient formed tile by tile on chip (2BTdp FLOPs, no B x p x d output).
    ``blocks`` (BLOCK_P, BLOCK_D, BLOCK_T) fixes the tiles (tests); else autotuned."""
    out, args, precision = norm_kernel_args(A, G, tf32)
    (B, T, D), P = A.shape, G.shape[2]
    if B == 0 or T == 0:
        return out

    def grid(meta):
        return (triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(D, meta["BLOCK_D"]), B)

    if blocks is None:
        _direct_autotuned[grid](*args, INPUT_PRECISION=precision)
    else:
        block_p, block_d, block_t = blocks
        meta = {"BLOCK_P": block_p, "BLOCK_D": block_d, "BLOCK_T": block_t}
        _direct_kernel[grid(meta)](*args, **meta, INPUT_PRECISION=precision)
    return out
