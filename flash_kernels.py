"""Triton kernels for Flash Clipping's norm routes (CUDA; CPU tests use TRITON_INTERPRET=1).

Gram route: ||G_b^T A_b||_F^2 = sum_{s,t} (a_s . a_t)(g_s . g_t) over token pairs. One program
per (sample, token-tile pair s >= t) forms the BLOCK_T x BLOCK_T tiles of A A^T and G G^T on chip,
multiplies them elementwise, reduces the product to one number in registers and adds it (twice
for an off-diagonal pair: the matrices are symmetric) to the sample's total. Nothing of size
T x T reaches HBM, only the n(n+1)/2 live pairs are launched, and each sample's A_b and G_b are
read by consecutive programs (the sample is the slower grid axis), so they stay in L2.
gram_squared_norms_grouped runs every Gram-route layer of a step in one launch (a third grid
axis over layers); flash uses it for bf16/fp16 on CUDA in place of the torch path
(flash_clip.gram_squared_norms: two batched GEMMs written to HBM, a product and a reduction
per 512-token tile pair, per layer).

Inputs in bf16/fp16 use tensor cores; fp32 inputs use IEEE-precision dots by default (exact to
fp32 rounding, as the torch path), or TF32 when asked. Accumulation is fp32 throughout.

add_gaussian_noise_: DP-SGD's noise drawn (Philox) and added in one pass over every gradient.
weighted_sums_: the clipped sums of kept per-sample gradients, one read of each, one launch.
direct_squared_norms: the direct route, each tile of G_b^T A_b square-summed on chip.
norm_layer_per_sample_grads: LayerNorm / RMSNorm per-sample gradients in one pass over x and g.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
_gram_pair_autotuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_T": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_T": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_T": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_T": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_T": 128, "BLOCK_K": 32}, num_warps=8, num_stages=4),
    ],
    key=["T", "D", "P"],
    reset_to_zero=["out"],
)(_gram_pair_kernel)


def _norm_kernel_args(A: torch.Tensor, G: torch.Tensor, tf32: bool) -> tuple:
    """The checks and launch arguments the one-layer Gram and direct kernels share: (out [B]
    zeroed in fp32, the kernel's positional arguments, its dot precision)."""
    if A.dim() != 3 or G.dim() != 3 or A.shape[:2] != G.shape[:2]:
        raise ValueError(
            f"need A [B, T, d] and G [B, T, p]; got {tuple(A.shape)}, {tuple(G.shape)}"
        )
    if A.dtype != G.dtype:
        raise ValueError(f"A and G must share a dtype, got {A.dtype} and {G.dtype}")
    (B, T, D), P = A.shape, G.shape[2]
    out = torch.zeros(B, device=A.device, dtype=torch.float32)
    precision = "tf32" if (tf32 and A.dtype == torch.float32) else "ieee"
    args = (
        A, G, out, T, D, P,
        A.stride(0), A.stride(1), A.stride(2), G.stride(0), G.stride(1), G.stride(2),
    )  # fmt: skip
    return out, args, precision


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
    out, args, precision = _norm_kernel_args(A, G, tf32)
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
    row = meta + tl.program_id(2) * 8  # A and G offsets, A's batch and token strides, G's, d, p
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
    tl.atomic_add(out + b, pair_sum)


def _table_to(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built table of a step (pointers, offsets) on ``device``: through pinned memory on
    CUDA, so the copy is queued on the stream instead of waiting for the GPU."""
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def _groupable(A: torch.Tensor, G: torch.Tensor) -> bool:
    """What _gram_group_kernel's hints promise (else the one-layer kernel runs)."""
    return all(
        x.stride(2) == 1
        and x.data_ptr() % 16 == 0
        and x.stride(0) % 8 == 0
        and x.stride(1) % 8 == 0
        and x.shape[2] % 16 == 0
        for x in (A, G)
    )


def gram_squared_norms_grouped(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """sum over layers of per-sample ||G_b^T A_b||_F^2 [B] in fp32, every layer in one launch.

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
    out = torch.zeros(B, device=A0.device, dtype=torch.float32)
    block_t = 64 if T <= 64 else 128
    grouped = []
    for A, G in pairs:
        if _groupable(A, G):
            grouped.append((A, G))
        else:  # the one-layer kernel, same tiles
            out += gram_squared_norms(A, G, block_t, 64)
    if not grouped or B == 0 or T == 0:
        return out
    base = grouped[0][0]
    size = base.element_size()
    meta = torch.tensor(
        [
            [(A.data_ptr() - base.data_ptr()) // size, (G.data_ptr() - base.data_ptr()) // size]
            + [A.stride(0), A.stride(1), G.stride(0), G.stride(1), A.shape[2], G.shape[2]]
            for A, G in grouped
        ],
        dtype=torch.int64,
    )
    meta = _table_to(meta, A0.device)
    n_tiles = triton.cdiv(T, block_t)
    _gram_group_kernel[(n_tiles * (n_tiles + 1) // 2, B, len(grouped))](
        base, meta, out, T, BLOCK_T=block_t, BLOCK_K=64,
        num_warps=8 if block_t == 128 else 4, num_stages=3,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- direct route


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
_direct_autotuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_P": 128, "BLOCK_D": 128, "BLOCK_T": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_P": 128, "BLOCK_D": 256, "BLOCK_T": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_P": 64, "BLOCK_D": 128, "BLOCK_T": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_P": 128, "BLOCK_D": 128, "BLOCK_T": 32}, num_warps=4, num_stages=4),
    ],
    key=["T", "D", "P"],
    reset_to_zero=["out"],
)(_direct_kernel)


def direct_squared_norms(
    A: torch.Tensor,
    G: torch.Tensor,
    blocks: tuple[int, int, int] | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """Per-sample ||G_b^T A_b||_F^2 [B] in fp32 for A [B, T, d] and G [B, T, p] of one dtype,
    the per-sample gradient formed tile by tile on chip (2BTdp FLOPs, no B x p x d output).
    ``blocks`` (BLOCK_P, BLOCK_D, BLOCK_T) fixes the tiles (tests); else autotuned."""
    out, args, precision = _norm_kernel_args(A, G, tf32)
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


# ---------------------------------------------------------------- many tensors, one launch

# (device, sizes, block) -> (tensor_of_block, first_block, sizes)
_BLOCK_TABLES: dict[tuple, tuple] = {}


def _block_table(device: torch.device, sizes: tuple[int, ...], block: int) -> tuple:
    """For a launch over a list of tensors, one program per ``block`` elements of each:
    (tensor of each program, first program of each tensor, sizes) on ``device``. A model's
    parameter sizes are fixed, so each table is built once and reused every step."""
    key = (device, sizes, block)
    if key not in _BLOCK_TABLES:
        blocks = torch.tensor([triton.cdiv(n, block) for n in sizes])
        first = torch.cumsum(blocks, 0) - blocks
        owner = torch.repeat_interleave(torch.arange(len(sizes)), blocks)
        table = (owner.int(), first.int(), torch.tensor(sizes, dtype=torch.int64))
        _BLOCK_TABLES[key] = tuple(_table_to(t, device) for t in table)  # no host sync
    return _BLOCK_TABLES[key]


# ---------------------------------------------------------------- Gaussian noise

# Elements per program of the noise kernel: on an H100 with the 1b model's 325 fp32 gradients
# (1.17G elements), 2048 ran at 3.35 ms, as fast as torch's read-and-write foreach add_ (3.56
# ms); 4096 took 5.24 ms and 8192 6.34 ms (4 warps; fewer programs keep fewer loads in flight).
NOISE_BLOCK = 2048


@triton.jit
def _noisy_quarter(base, offsets, size, std, noise, DTYPE: tl.constexpr):
    keep = offsets < size
    x = tl.load(base + offsets, mask=keep, other=0.0).to(tl.float32)
    tl.store(base + offsets, (x + std * noise).to(DTYPE), mask=keep)


@triton.jit
def _add_noise_kernel(
    pointers, tensor_of_block, first_block, sizes, seeds, std,
    BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """x += std * N(0, 1) over a list of tensors in one launch: program -> (tensor, block)."""
    block = tl.program_id(0)
    i = tl.load(tensor_of_block + block)
    size = tl.load(sizes + i)
    base = tl.load(pointers + i).to(tl.pointer_type(DTYPE))
    QUARTER: tl.constexpr = BLOCK // 4
    # One Philox draw (keyed by the tensor's seed, counter unique per block and lane) gives four
    # normals, one for each quarter of the block: a quarter of the Philox rounds and half the
    # Box-Muller transcendentals of one randn per element (the kernel is ALU-bound otherwise).
    block_in_tensor = (block - tl.load(first_block + i)).to(tl.int64)
    counter = block_in_tensor * QUARTER + tl.arange(0, QUARTER)
    n0, n1, n2, n3 = tl.randn4x(tl.load(seeds + i), counter)
    start = block_in_tensor * BLOCK + tl.arange(0, QUARTER)
    _noisy_quarter(base, start, size, std, n0, DTYPE)
    _noisy_quarter(base, start + QUARTER, size, std, n1, DTYPE)
    _noisy_quarter(base, start + 2 * QUARTER, size, std, n2, DTYPE)
    _noisy_quarter(base, start + 3 * QUARTER, size, std, n3, DTYPE)


def add_gaussian_noise_(tensors: list[torch.Tensor], std: float) -> None:
    """t += N(0, std^2) elementwise for every (contiguous, one-device) tensor, one launch per
    dtype: the noise is drawn in registers and added in the same pass, so each element is read
    and written once (torch draws noise into a buffer, then adds it: three passes, two launches
    per tensor). Seeds (one per tensor) come from torch's generator of the device, so
    torch.manual_seed reproduces the noise; Philox is the generator torch uses on CUDA too."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError("add_gaussian_noise_ needs contiguous tensors")
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype, group in by_dtype.items():
        device = group[0].device
        sizes = tuple(t.numel() for t in group)
        tensor_of_block, first_block, numels = _block_table(device, sizes, NOISE_BLOCK)
        pointers = _table_to(torch.tensor([t.data_ptr() for t in group]), device)
        seeds = torch.randint(2**62, (len(group),), device=device)
        _add_noise_kernel[(len(tensor_of_block),)](
            pointers, tensor_of_block, first_block, numels, seeds, std,
            BLOCK=NOISE_BLOCK, DTYPE=_TL_DTYPES[dtype],
        )  # fmt: skip


# ---------------------------------------------------------------- clipped sums of kept grads

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
        target.is_cuda
        and source.device == target.device
        and target.dtype in _TL_DTYPES
        and source.dtype in _TL_DTYPES
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


# ---------------------------------------------------------------- norm layers' per-sample grads


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
    out_bias = out_weight + tl.num_programs(1) * tl.num_programs(0) * D
    for d0 in range(0, D, BLOCK_D):
        keep = row_ok & (d0 + cols[None, :] < D)
        x = tl.load(x_rows + d0 + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        g = tl.load(g_rows + d0 + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        xhat = (x - mean[:, None]) * rstd[:, None]
        in_row = d0 + cols < D
        tl.store(out_weight + d0 + cols, tl.sum(g * xhat, axis=0), mask=in_row)
        tl.store(out_bias + d0 + cols, tl.sum(g, axis=0), mask=in_row)


def norm_layer_grads_supported(x: torch.Tensor, g: torch.Tensor) -> bool:
    """Can norm_layer_per_sample_grads run on x and g (CUDA, kernel dtypes, unit feature stride)?"""
    return (
        x.is_cuda
        and g.device == x.device
        and x.dtype in _TL_DTYPES
        and g.dtype in _TL_DTYPES
        and x.stride(-1) == 1
        and g.stride(-1) == 1
    )


def norm_layer_per_sample_grads(
    x: torch.Tensor,
    g: torch.Tensor,
    eps: float,
    rms: bool,
    block_t: int = 16,
    block_d: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of a LayerNorm's (rms: RMSNorm's) weight and bias, [B, d] each in
    fp32, from its input x [B, T, d] and output gradient g [B, T, d]: sum_t g_t * xhat_t and
    sum_t g_t.

    The torch path recomputes xhat with F.layer_norm, then multiplies and reduces: about seven
    passes over [B, T, d] in fp32. Here x and g are read once from HBM and only
    [2, B, T / block_t, d] partials are written: on an H100 at (8, 1024, 2048) fp32, 0.114 ms
    against the torch path's 0.193 (BENCHMARKS.md).
    """
    if x.dim() != 3 or x.shape != g.shape:
        raise ValueError(
            f"need x and g [B, T, d] of one shape; got {tuple(x.shape)}, {tuple(g.shape)}"
        )
    B, T, D = x.shape
    n_tiles = triton.cdiv(T, block_t)
    partials = torch.empty(2, B, n_tiles, D, device=x.device, dtype=torch.float32)
    if B == 0 or T == 0 or D == 0:
        partials = x.new_zeros(2, B, 1, D, dtype=torch.float32)
    else:
        _norm_layer_grads_kernel[(n_tiles, B)](
            x, g, partials, T, D, eps,
            x.stride(0), x.stride(1), g.stride(0), g.stride(1),
            BLOCK_T=block_t, BLOCK_D=block_d, RMS=rms,
        )  # fmt: skip
    sums = partials.sum(2)  # one reduction launch for both
    return sums[0], sums[1]
