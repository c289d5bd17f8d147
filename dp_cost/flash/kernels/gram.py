"""Gram route: ||G_b^T A_b||_F^2 = sum_{s,t} (a_s . a_t)(g_s . g_t) over token pairs.

One program per (sample, token-tile pair s >= t) forms the BLOCK_T x BLOCK_T tiles of A A^T and
G G^T on chip, multiplies them elementwise, reduces the product to one number in registers and
adds it (twice for an off-diagonal pair: the matrices are symmetric) to the sample's total.
Nothing of size T x T reaches HBM, only the n(n+1)/2 live pairs are launched, and each sample's
A_b and G_b are read by consecutive programs (the sample is the slower grid axis), so they stay
in L2. gram_squared_norms_grouped runs every Gram-route layer of a step in one launch (a third
grid axis over layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dp_cost.flash.kernels.common import autotuned_norm_kernel, int64_table, norm_kernel_args


@triton.jit
def _gram_tile(
    base, rows_s, rows_t, T, K, stride_t, stride_k,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The (s, t) tile of X X^T for one sample's X [T, K] at ``base``, accumulated in fp32.

    The t rows are loaded as [BLOCK_K, BLOCK_T] (X_t^T by addressing, not by a transpose), and
    the pointers advance by one K block per iteration.
    """
    k = tl.arange(0, BLOCK_K)
    # int64 row offsets: T * stride_t can pass 2^31 elements (long sequences, wide layers)
    k64 = k.to(tl.int64)
    ptr_s = base + rows_s.to(tl.int64)[:, None] * stride_t + k64[None, :] * stride_k
    ptr_t = base + rows_t.to(tl.int64)[None, :] * stride_t + k64[:, None] * stride_k
    gram = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_s = tl.load(ptr_s, mask=(rows_s[:, None] < T) & (k0 + k[None, :] < K), other=0.0)
        x_t = tl.load(ptr_t, mask=(rows_t[None, :] < T) & (k0 + k[:, None] < K), other=0.0)
        gram = tl.dot(x_s, x_t, gram, input_precision=INPUT_PRECISION)
        ptr_s += BLOCK_K * stride_k
        ptr_t += BLOCK_K * stride_k
    return gram


@triton.jit
def _pair_sum(
    A_b, G_b, T, D, P, stride_at, stride_ad, stride_gt, stride_gp,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """sum over this program's token-tile pair (grid axis 0) of (A A^T) * (G G^T) for one
    sample's A_b [T, D] and G_b [T, P], doubled off the diagonal (the matrices are symmetric)."""
    pair = tl.program_id(0)
    # pair = s(s+1)/2 + t with t <= s: s from the float root, then corrected by one either way
    # where rounding missed (exact integer checks).
    s = ((tl.sqrt((8 * pair + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    s = tl.where((s + 1) * (s + 2) // 2 <= pair, s + 1, s)
    s = tl.where(s * (s + 1) // 2 > pair, s - 1, s)
    t = pair - s * (s + 1) // 2
    rows_s = s * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_t = t * BLOCK_T + tl.arange(0, BLOCK_T)
    gram_a = _gram_tile(
        A_b, rows_s, rows_t, T, D, stride_at, stride_ad, BLOCK_T, BLOCK_K, INPUT_PRECISION
    )
    gram_g = _gram_tile(
        G_b, rows_s, rows_t, T, P, stride_gt, stride_gp, BLOCK_T, BLOCK_K, INPUT_PRECISION
    )
    pair_sum = tl.sum(tl.sum(gram_a * gram_g, axis=1), axis=0)
    return tl.where(s == t, pair_sum, 2.0 * pair_sum)


@triton.jit
def _gram_pair_kernel(
    A, G, out,
    T, D, P,
    stride_ab, stride_at, stride_ad,
    stride_gb, stride_gt, stride_gp,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(1).to(tl.int64)  # b * stride_b can pass 2^31 elements
    pair_sum = _pair_sum(
        A + b * stride_ab, G + b * stride_gb, T, D, P, stride_at, stride_ad, stride_gt, stride_gp,
        BLOCK_T, BLOCK_K, INPUT_PRECISION,
    )  # fmt: skip
    tl.atomic_add(out + b, pair_sum)


# Tiles tried once per (T, d, p, dtype) on the card (measured on an H200, bf16, T 512-1024:
# 128 x 64/128 with 8 warps fastest for d + p >= 4096, 64 x 64 with 4 warps close behind; 256-row
# tiles spill). Configs that do not fit the card's shared memory (fp32 at 128 x 128) are skipped
# by the autotuner. The pair sums are atomically added, so the output is zeroed before each trial.
_gram_pair_autotuned = autotuned_norm_kernel(
    _gram_pair_kernel,
    [
        triton.Config({"BLOCK_T": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_T": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_T": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_T": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_T": 128, "BLOCK_K": 32}, num_warps=8, num_stages=4),
    ],
)


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
    out, args, precision = norm_kernel_args(A, G, tf32)
    B, T = A.shape[:2]
    if B == 0 or T == 0:
        return out

    def grid(meta):
        n_tiles = triton.cdiv(T, meta["BLOCK_T"])
        return (n_tiles * (n_tiles + 1) // 2, B)  # the pairs t <= s only

    if block_t is None or block_k is None:
        _gram_pair_autotuned[grid](*args, INPUT_PRECISION=precision)
    else:
        _gram_pair_kernel[grid({"BLOCK_T": block_t})](
            *args, BLOCK_T=block_t, BLOCK_K=block_k, INPUT_PRECISION=precision
        )
    return out


# ---------------------------------------------------------------- many layers, one launch


@triton.jit
def _gram_group_kernel(
    base, meta, out, T,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """_gram_pair_kernel for many layers (grid axis 2) that share B and T: a layer's A and G
    are at element offsets from ``base`` (one aligned kernel argument) read from its row of
    ``meta``, with its strides and widths. The host guarantees 16-byte aligned tensors, strides
    in multiples of 8 elements and widths in multiples of 16; the hints say so, so the loads
    stay vectorised and the K masks uniform although nothing is a compile-time constant."""
    b = tl.program_id(1)
    # A and G offsets, A's batch and token strides, G's, d, p, the layer's offset in ``out``
    row = meta + tl.program_id(2) * 9
    offset_a = tl.multiple_of(tl.load(row), 8)
    offset_g = tl.multiple_of(tl.load(row + 1), 8)
    stride_ab = tl.multiple_of(tl.load(row + 2), 8)
    stride_at = tl.multiple_of(tl.load(row + 3), 8)
    stride_gb = tl.multiple_of(tl.load(row + 4), 8)
    stride_gt = tl.multiple_of(tl.load(row + 5), 8)
    D = tl.multiple_of(tl.load(row + 6), 16)
    P = tl.multiple_of(tl.load(row + 7), 16)
    pair_sum = _pair_sum(
        base + offset_a + b * stride_ab, base + offset_g + b * stride_gb, T, D, P,
        stride_at, 1, stride_gt, 1, BLOCK_T, BLOCK_K, "ieee",
    )  # fmt: skip
    tl.atomic_add(out + tl.load(row + 8) + b, pair_sum)


def _groupable(A: torch.Tensor, G: torch.Tensor) -> bool:
    """What _gram_group_kernel's hints promise (else the one-layer kernel runs)."""
    return _groupable_each([(A, G)])[0]


def _groupable_each(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """_groupable of each pair, in one call: builtins only in its loop (a Python call per
    layer is host time, and a step has 120 Gram-route layers at the 1b model)."""
    return [
        A.stride(2) == 1 and A.data_ptr() % 16 == 0 and A.stride(0) % 8 == 0
        and A.stride(1) % 8 == 0 and A.shape[2] % 16 == 0
        and G.stride(2) == 1 and G.data_ptr() % 16 == 0 and G.stride(0) % 8 == 0
        and G.stride(1) % 8 == 0 and G.shape[2] % 16 == 0
        for A, G in pairs
    ]  # fmt: skip


def gram_squared_norms_grouped(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], per_layer: bool = False
) -> torch.Tensor:
    """sum over layers of per-sample ||G_b^T A_b||_F^2 [B] in fp32, every layer in one launch;
    ``per_layer``: each layer's own [L, B] instead (per-layer clipping), in the pairs' order.

    ``pairs``: (A [B, T, d_l], G [B, T, p_l]) per layer, all of one B, T and 16-bit dtype on one
    CUDA device. Flash is launch-bound at short sequences: a 1b step has 121 Linear layers, and
    one Triton launch costs ~0.1 ms of host time (its Python launcher), more than many of these
    kernels take on the GPU. Tiles are fixed at 128 x 64 with 8 warps (within 20% of the
    autotuned best at every 1b shape for T 512-1024 on an H200; 64-token tiles for T <= 64).
    """
    A0 = pairs[0][0]
    B, T = A0.shape[:2]
    for A, G in pairs:
        if A.shape[:2] != (B, T) or G.shape[:2] != (B, T) or {A.dtype, G.dtype} != {A0.dtype}:
            raise ValueError("grouped Gram norms need one B, T and dtype for every layer")
    if A0.element_size() != 2:
        raise ValueError(f"grouped Gram norms are for 16-bit inputs, got {A0.dtype}")
    out = torch.zeros((len(pairs), B) if per_layer else B, device=A0.device, dtype=torch.float32)
    block_t = 64 if T <= 64 else 128
    grouped = []  # (A, G, the element offset of its norms in out)
    for i, ((A, G), groupable) in enumerate(zip(pairs, _groupable_each(pairs), strict=True)):
        if groupable:
            grouped.append((A, G, i * B if per_layer else 0))
        else:  # the one-layer kernel, same tiles
            (out[i] if per_layer else out).add_(gram_squared_norms(A, G, block_t, 64))
    if not grouped or B == 0 or T == 0:
        return out
    base = grouped[0][0]
    size = base.element_size()
    meta = int64_table(
        [
            [(A.data_ptr() - base.data_ptr()) // size, (G.data_ptr() - base.data_ptr()) // size]
            + [A.stride(0), A.stride(1), G.stride(0), G.stride(1), A.shape[2], G.shape[2], at]
            for A, G, at in grouped
        ],
        A0.device,
    )
    n_tiles = triton.cdiv(T, block_t)
    _gram_group_kernel[(n_tiles * (n_tiles + 1) // 2, B, len(grouped))](
        base, meta, out, T, BLOCK_T=block_t, BLOCK_K=64,
        num_warps=8 if block_t == 128 else 4, num_stages=3,
    )  # fmt: skip
    return out
