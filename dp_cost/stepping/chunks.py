"""A logical batch as physical chunks: near-equal index sets (as Opacus' BatchMemoryManager
makes them), or padded chunks of one fixed size P whose rows past the drawn samples are
stand-ins weighted 0, the chunk a CUDA graph captures once and replays for any drawn size."""

from __future__ import annotations

import math

import torch


def near_equal_chunks(batch: int, busiest_batch: int, cap: int) -> list[torch.Tensor]:
    """Index sets of a rank's physical chunks: as many as the busiest rank needs under the cap
    (FSDP2 all-gathers in each chunk's forward, so every rank runs as many; a rank with fewer
    samples may get an empty one), near-equal (14 by 4 -> 4, 4, 3, 3)."""
    return list(torch.arange(batch).tensor_split(math.ceil(busiest_batch / cap)))


def fill_chunk(chunk, inputs: torch.Tensor, targets: torch.Tensor, start: int) -> int:
    """Write padded chunk ``chunk`` = (inputs, targets, weights), each of P rows, in place: the
    batch's samples from ``start`` (weight 1), then stand-ins weighted 0. A stand-in copies the
    batch's first sample, so its loss is finite (0 * NaN would be NaN); with no sample at all
    the chunk keeps the rows it had (finite: zeros or an earlier batch's). Returns how many
    samples are real."""
    chunk_inputs, chunk_targets, weights = chunk
    size = len(weights)
    real = max(0, min(size, len(inputs) - start))
    if real:
        chunk_inputs[:real].copy_(inputs[start : start + real])
        chunk_targets[:real].copy_(targets[start : start + real])
    if real < size and len(inputs):
        chunk_inputs[real:].copy_(inputs[:1].expand(size - real, *inputs.shape[1:]))
        chunk_targets[real:].copy_(targets[:1].expand(size - real, *targets.shape[1:]))
    torch.lt(torch.arange(size, device=weights.device), real, out=weights)
    return real


def new_padded_chunk(inputs: torch.Tensor, targets: torch.Tensor, size: int):
    """(inputs, targets, weights) buffers of one padded chunk of ``size`` rows, zeros."""
    return (
        inputs.new_zeros((size, *inputs.shape[1:])),
        targets.new_zeros((size, *targets.shape[1:])),
        torch.zeros(size, device=inputs.device),
    )


def stand_in_chunk(inputs: torch.Tensor, targets: torch.Tensor):
    """A padded chunk of one stand-in row, weighted 0: what a rank with no sample for a chunk
    runs while the other ranks run theirs."""
    chunk = new_padded_chunk(inputs, targets, 1)
    fill_chunk(chunk, inputs, targets, len(inputs))
    return chunk
