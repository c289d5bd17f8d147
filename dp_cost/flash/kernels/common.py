"""What the kernel families share: the dtype table, the one-layer norm kernels' launch
arguments, and host-built tables (pointers, offsets, per-program block tables) on the device."""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from dp_cost.flash.cuda_graphs import capturing

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def on_cuda_in_kernel_dtypes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Are x and y on one CUDA device, both in a dtype the kernels take?"""
    return x.is_cuda and y.device == x.device and x.dtype in TL_DTYPES and y.dtype in TL_DTYPES


def autotuned_norm_kernel(kernel, configs: list[triton.Config]):
    """A one-layer norm kernel (Gram or direct) autotuned over ``configs``, tried once per (T, d,
    p, dtype) on the card. Its per-sample sums are atomically added, so ``out`` is zeroed before
    each trial."""
    return triton.autotune(configs=configs, key=["T", "D", "P"], reset_to_zero=["out"])(kernel)


def norm_kernel_args(A: torch.Tensor, G: torch.Tensor, tf32: bool) -> tuple:
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


# Both sides of every table made while a CUDA graph was being captured: the graph's copy node
# reads the pinned host side again at each replay, and its kernels read the device side; both
# must outlive every replay (a few KB a capture).
_CAPTURED_TABLES: list[torch.Tensor] = []


def _table_to(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built table of a step (pointers, offsets) on ``device``: through pinned memory on
    CUDA, so the copy is queued on the stream instead of waiting for the GPU."""
    if device.type == "cuda":
        pinned = table.pin_memory()
        on_device = pinned.to(device, non_blocking=True)
        if capturing():
            _CAPTURED_TABLES.extend((pinned, on_device))
        return on_device
    return table.to(device)


# (device, rows) -> that int64 table on the device, the most recently used last
_DEVICE_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
DEVICE_TABLES_KEPT = 64


def int64_table(rows: list, device: torch.device) -> torch.Tensor:
    """``rows`` (ints, or lists of ints: pointers, offsets, sizes) as an int64 tensor on
    ``device``. A step's tables repeat from step to step (the caching allocator hands out the
    same addresses for the same sequence of allocations), and building and copying one costs
    more host time than its launch: the last DEVICE_TABLES_KEPT are kept, by content. A kept
    table is only ever read, so equal rows give an equal table.

    A CUDA graph capture bypasses the kept tables both ways: a kept table may be evicted (and
    its memory reused) while the graph still reads it, and a table made in the capture holds its
    rows only once the graph has replayed."""
    if capturing():
        return _table_to(torch.tensor(rows, dtype=torch.int64), device)
    nested = bool(rows) and isinstance(rows[0], list)
    key = (device, tuple(map(tuple, rows)) if nested else tuple(rows))
    table = _DEVICE_TABLES.get(key)
    if table is None:
        table = _table_to(torch.tensor(rows, dtype=torch.int64), device)
        _DEVICE_TABLES[key] = table
        if len(_DEVICE_TABLES) > DEVICE_TABLES_KEPT:
            _DEVICE_TABLES.popitem(last=False)
    else:
        _DEVICE_TABLES.move_to_end(key)
    return table


# (device, sizes, block) -> (tensor_of_block, first_block, sizes, block_offsets')
_BLOCK_TABLES: dict[tuple, tuple] = {}


def block_table(device: torch.device, sizes: tuple[int, ...], block: int) -> tuple:
    """For a launch over a list of tensors, one program per ``block`` elements of each:
    (tensor of each program, first program of each tensor, sizes) on ``device``. A model's
    parameter sizes are fixed, so each table is built once and reused every step."""
    key = (device, sizes, block)
    if key not in _BLOCK_TABLES:
        blocks = torch.tensor([triton.cdiv(n, block) for n in sizes])
        first = torch.cumsum(blocks, 0) - blocks
        owner = torch.repeat_interleave(torch.arange(len(sizes)), blocks)
        table = (owner.int(), first.int(), torch.tensor(sizes, dtype=torch.int64))
        offsets = torch.cat([first, blocks.sum().view(1)])  # of each tensor's blocks, and the end
        table = (*table, offsets)
        _BLOCK_TABLES[key] = tuple(_table_to(t, device) for t in table)  # no host sync
    return _BLOCK_TABLES[key][:3]


def block_offsets(device: torch.device, sizes: tuple[int, ...], block: int) -> torch.Tensor:
    """block_table's launch: the first program of each tensor and one past the last, on
    ``device`` (each tensor's programs are consecutive: a segmented sum over them)."""
    block_table(device, sizes, block)
    return _BLOCK_TABLES[(device, sizes, block)][3]
