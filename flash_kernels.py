"""Triton kernels for Flash Clipping's norm routes (CUDA; CPU tests use TRITON_INTERPRET=1).

Gram route: ||G_b^T A_b||_F^2 = sum_{s,t} (a_s . a_t)(g_s . g_t) over token pairs. One program
per (sample, token tile s, token tile t <= s) forms the BLOCK_T x BLOCK_T tiles of A A^T and
G G^T on chip, multiplies them elementwise, reduces the product to one number in registers and
adds it (twice for an off-diagonal pair: the matrices are symmetric) to the sample's total.
Nothing of size T x T reaches HBM, and each sample's A_b and G_b are read by consecutive programs
(the sample is the slowest grid axis), so they stay in L2. The torch path in flash_clip.py forms
512 x 512 tiles in HBM with separate GEMMs, products and reductions; this replaces those for CUDA.

Inputs in bf16/fp16 use tensor cores; fp32 inputs use IEEE-precision dots by default (exact to
fp32 rounding, as the torch path), or TF32 when asked. Accumulation is fp32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gram_tile(
    base, rows_s, rows_t, T, K, stride_t, stride_k,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The (s, t) tile of X X^T for one sample's X [T, K] at ``base``, accumulated in fp32."""
    gram = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + k
        keep = cols[None, :] < K
        x_s = tl.load(
            base + rows_s[:, None] * stride_t + cols[None, :] * stride_k,
            mask=(rows_s[:, None] < T) & keep, other=0.0,
        )  # fmt: skip
        x_t = tl.load(
            base + rows_t[:, None] * stride_t + cols[None, :] * stride_k,
            mask=(rows_t[:, None] < T) & keep, other=0.0,
        )  # fmt: skip
        gram += tl.dot(x_s, tl.trans(x_t), input_precision=INPUT_PRECISION)
    return gram


@triton.jit
def _gram_pair_kernel(
    A, G, out,
    T, D, P,
    stride_ab, stride_at, stride_ad,
    stride_gb, stride_gt, stride_gp,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    t = tl.program_id(1)
    b = tl.program_id(2)
    if t > s:  # symmetric: only pairs t <= s, the off-diagonal ones counted twice
        return
    rows_s = s * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_t = t * BLOCK_T + tl.arange(0, BLOCK_T)
    gram_a = _gram_tile(
        A + b * stride_ab, rows_s, rows_t, T, D, stride_at, stride_ad,
        BLOCK_T, BLOCK_K, INPUT_PRECISION,
    )  # fmt: skip
    gram_g = _gram_tile(
        G + b * stride_gb, rows_s, rows_t, T, P, stride_gt, stride_gp,
        BLOCK_T, BLOCK_K, INPUT_PRECISION,
    )  # fmt: skip
    pair_sum = tl.sum(tl.sum(gram_a * gram_g, axis=1), axis=0)
    pair_sum = tl.where(s == t, pair_sum, 2.0 * pair_sum)
    tl.atomic_add(out + b, pair_sum)


# Tiles tried once per (T, d, p) on the card; the pair sums are atomically added, so the output
# is zeroed before each trial.
_gram_pair_autotuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_T": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_T": 64, "BLOCK_K": 32}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_T": 128, "BLOCK_K": 32}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_T": 32, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    ],
    key=["T", "D", "P"],
    reset_to_zero=["out"],
)(_gram_pair_kernel)


def gram_squared_norms(
    A: torch.Tensor,
    G: torch.Tensor,
    block_t: int | None = None,
    block_k: int | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """Per-sample ||G_b^T A_b||_F^2 [B] in fp32, for A [B, T, d] and G [B, T, p] of one dtype.

    Tiles are autotuned unless ``block_t`` and ``block_k`` are given (tests give small ones).
    Masked loads handle any T, d, p (tiles past the end read zeros, which add nothing).
    """
    if A.dim() != 3 or G.dim() != 3 or A.shape[:2] != G.shape[:2]:
        raise ValueError(
            f"need A [B, T, d] and G [B, T, p]; got {tuple(A.shape)}, {tuple(G.shape)}"
        )
    if A.dtype != G.dtype:
        raise ValueError(f"A and G must share a dtype, got {A.dtype} and {G.dtype}")
    B, T, D = A.shape
    P = G.shape[2]
    out = torch.zeros(B, device=A.device, dtype=torch.float32)
    if B == 0 or T == 0:
        return out
    precision = "tf32" if (tf32 and A.dtype == torch.float32) else "ieee"
    args = (
        A, G, out, T, D, P,
        A.stride(0), A.stride(1), A.stride(2), G.stride(0), G.stride(1), G.stride(2),
    )  # fmt: skip
    if block_t is None or block_k is None:

        def grid(meta):
            n_tiles = triton.cdiv(T, meta["BLOCK_T"])
            return (n_tiles, n_tiles, B)

        _gram_pair_autotuned[grid](*args, INPUT_PRECISION=precision)
    else:
        n_tiles = triton.cdiv(T, block_t)
        _gram_pair_kernel[(n_tiles, n_tiles, B)](
            *args, BLOCK_T=block_t, BLOCK_K=block_k, INPUT_PRECISION=precision
        )
    return out
