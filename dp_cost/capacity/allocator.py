"""torch's CUDA caching allocator, replayed on a recorded sequence of allocations and frees:
how much memory it reserves from the card (its segments, ``torch.cuda.max_memory_reserved``)
and whether the sequence runs on a card that leaves it a given number of bytes.

Why by hand: a step fits a card when the allocator can place every request, and that depends on
the order of requests, not only on the largest sum of live tensors: a freed block serves a later
request only if it is large enough, and what a split leaves behind may go unused. At the
largest batch that ran on an H200, the 1b model's standard step held 98.2% of what the CUDA
context leaves of the card, its dpsgd step (per-sample gradients of many sizes) 92.1%. torch
has no model of its allocator that runs without CUDA, so this is one, with the rules of
``c10/cuda/CUDACachingAllocator.cpp`` under the default settings (no ``PYTORCH_CUDA_ALLOC_CONF``):

- every request is rounded up to a multiple of 512 bytes;
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones
  from the large pool, whose segments are 20 MiB for requests under 10 MiB and otherwise the
  request rounded up to 2 MiB;
- a request takes the smallest free block of its pool that holds it (the lowest address among
  equals), split when what is left is at least 512 bytes (small pool) or more than 1 MiB (large);
- a freed block merges with the free blocks beside it in its segment;
- when the card cannot give a new segment, the allocator returns every wholly free segment to
  it and asks again; if that fails too, the request is out of memory;
- a block freed on one stream serves only requests on that stream (FSDP2 gathers and
  reduce-scatters on streams of its own).

Not modelled: a block used on another stream than its own is freed only once that stream's
work is done (``record_stream``: NCCL's inputs and outputs under DDP), and the driver's own
rounding beyond 2 MiB pages.
"""

from __future__ import annotations

import bisect
import dataclasses

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20  # the largest request of the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # for large-pool requests under MIN_LARGE_SEGMENT_REQUEST
MIN_LARGE_SEGMENT_REQUEST = 10 << 20
SEGMENT_ROUNDING = 2 << 20


def request_bytes(nbytes: int) -> int:
    """A request of ``nbytes`` as the allocator rounds it."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_bytes(size: int) -> int:
    """The segment the allocator asks the card for when no free block holds ``size`` bytes."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_SEGMENT_REQUEST:
        return LARGE_SEGMENT
    return -(-size // SEGMENT_ROUNDING) * SEGMENT_ROUNDING


class Block:
    """A piece of one segment: allocated or free, with its neighbours in the segment. ``pool``:
    (stream, small pool or not)."""

    __slots__ = ("address", "size", "pool", "allocated", "before", "after")

    def __init__(self, address: int, size: int, pool: tuple[int, bool]):
        self.address, self.size, self.pool = address, size, pool
        self.allocated = False
        self.before: Block | None = None
        self.after: Block | None = None


class CachingAllocator:
    """The allocator's state: free blocks by pool, (stream, small), each sorted by size, then
    address; and the bytes reserved from a card that leaves it ``card_bytes`` (None: no
    limit)."""

    def __init__(self, card_bytes: int | None = None):
        self.card_bytes = card_bytes
        self.free_blocks: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self.blocks_at: dict[int, Block] = {}  # address -> free block
        self.reserved = 0
        self.peak_reserved = 0
        self.next_address = 0

    def malloc(self, nbytes: int, stream: int = 0) -> Block | None:
        """The block serving a request of ``nbytes`` on ``stream``; None when it is out of
        memory."""
        size = request_bytes(nbytes)
        small = size <= SMALL_REQUEST
        pool = (stream, small)
        block = self._best_fit(pool, size) or self._new_segment(pool, size)
        if block is None:
            return None
        left = block.size - size
        if left >= MIN_BLOCK if small else left > SMALL_REQUEST:
            rest = Block(block.address + size, left, pool)
            rest.before, rest.after = block, block.after
            if block.after is not None:
                block.after.before = rest
            block.after, block.size = rest, size
            self._add_free(rest)
        block.allocated = True
        return block

    def free(self, block: Block) -> None:
        block.allocated = False
        for neighbour in (block.before, block.after):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                block = _merged(block, neighbour)
        self._add_free(block)

    def _best_fit(self, pool: tuple[int, bool], size: int) -> Block | None:
        blocks = self.free_blocks.get(pool, [])
        index = bisect.bisect_left(blocks, (size, -1))
        if index == len(blocks):
            return None
        return self._remove_free(self.blocks_at[blocks[index][1]])

    def _new_segment(self, pool: tuple[int, bool], size: int) -> Block | None:
        wanted = segment_bytes(size)
        if not self._card_holds(wanted):
            self._release_free_segments()
            if not self._card_holds(wanted):
                return None
        block = Block(self.next_address, wanted, pool)
        self.next_address += wanted
        self.reserved += wanted
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _card_holds(self, segment: int) -> bool:
        return self.card_bytes is None or self.reserved + segment <= self.card_bytes

    def _release_free_segments(self) -> None:
        for blocks in self.free_blocks.values():
            for _, address in list(blocks):
                block = self.blocks_at[address]
                if block.before is None and block.after is None:
                    self._remove_free(block)
                    self.reserved -= block.size

    def _add_free(self, block: Block) -> None:
        bisect.insort(self.free_blocks.setdefault(block.pool, []), (block.size, block.address))
        self.blocks_at[block.address] = block

    def _remove_free(self, block: Block) -> Block:
        blocks = self.free_blocks[block.pool]
        del blocks[bisect.bisect_left(blocks, (block.size, block.address))]
        del self.blocks_at[block.address]
        return block


def _merged(block: Block, neighbour: Block) -> Block:
    """``block`` and its free ``neighbour`` as one block (the lower address keeps it)."""
    first, second = (neighbour, block) if neighbour is block.before else (block, neighbour)
    first.size += second.size
    first.after = second.after
    if second.after is not None:
        second.after.before = first
    return first


@dataclasses.dataclass
class Replay:
    peak_reserved_bytes: int  # the most the allocator held from the card at once
    out_of_memory: bool  # a request the card could not serve (the replay stops there)


def replay(requests, card_bytes: int | None = None) -> Replay:
    """Replay ``requests``, (key, bytes[, stream]) in order: bytes > 0 allocates a block for key
    on the stream (0 when not given), bytes <= 0 frees key's block (an unknown key is ignored:
    made before the record began)."""
    allocator = CachingAllocator(card_bytes)
    live: dict[int, Block] = {}
    for key, nbytes, *stream in requests:
        if nbytes > 0:
            block = allocator.malloc(nbytes, *stream)
            if block is None:
                return Replay(allocator.peak_reserved, True)
            live[key] = block
        elif key in live:
            allocator.free(live.pop(key))
    return Replay(allocator.peak_reserved, False)
