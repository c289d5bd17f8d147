"""The caching allocator's replay against the rules of torch's CUDA caching allocator, worked out
by hand for each case (segment sizes, best fit, splits, merges, returning free segments when
the card is full). On a GPU, benchmarks/allocator_replay.py checks it against torch's own
``max_memory_reserved``."""

import pytest

from dp_cost.capacity import allocator
from tests.cli_helpers import benchmark_script

KIB, MIB = 2**10, 2**20


def reserved(requests, card=None):
    return allocator.replay(requests, card).peak_reserved_bytes


def test_small_requests_share_two_mib_segments():
    # 1 byte is one 512-byte block; 4096 blocks of 512 fill one 2 MiB segment, the next opens one
    assert reserved([(0, 1)]) == 2 * MIB
    assert reserved([(key, 512) for key in range(4096)]) == 2 * MIB
    assert reserved([(key, 512) for key in range(4097)]) == 4 * MIB
    # up to 1 MiB is small: two of them fill a segment
    assert reserved([(0, MIB), (1, MIB)]) == 2 * MIB


@pytest.mark.parametrize(
    "request_bytes, segment",
    [(MIB + 1, 20 * MIB), (9 * MIB, 20 * MIB), (10 * MIB, 10 * MIB), (11 * MIB, 12 * MIB),
     (100 * MIB + 1, 102 * MIB)],
)  # fmt: skip
def test_large_segments_are_20_mib_under_10_mib_else_rounded_to_2_mib(request_bytes, segment):
    assert reserved([(0, request_bytes)]) == segment


def test_a_20_mib_segment_serves_four_5_mib_requests():
    # each split leaves more than 1 MiB until the fourth takes the last 5 MiB whole
    assert reserved([(key, 5 * MIB) for key in range(4)]) == 20 * MIB
    assert reserved([(key, 5 * MIB) for key in range(5)]) == 40 * MIB


def test_a_split_that_would_leave_1_mib_or_less_hands_out_the_whole_block():
    # a 20 MiB segment for 9 MiB leaves 11 MiB free; 10 MiB in it would leave exactly 1 MiB,
    # which is not split off, so a 1.5 MiB request opens a second segment
    half = 512 * KIB
    assert reserved([(0, 9 * MIB), (1, 10 * MIB), (2, 3 * half)]) == 40 * MIB
    # 9.5 MiB leaves 1.5 MiB, split off: the 1.5 MiB request takes it
    assert reserved([(0, 9 * MIB), (1, 19 * half), (2, 3 * half)]) == 20 * MIB


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request():
    # free blocks of 30 and 50 MiB; 25 MiB goes into the 30 (5 left), so 45 MiB fits the 50
    requests = [(0, 30 * MIB), (1, 50 * MIB), (0, -30 * MIB), (1, -50 * MIB), (2, 25 * MIB),
                (3, 45 * MIB)]  # fmt: skip
    assert reserved(requests) == 80 * MIB
    # worst fit would have put 25 into the 50 and needed a new 46 MiB segment for 45


def test_freed_neighbours_merge_back_into_one_block():
    requests = [(0, 40 * MIB), (0, -40 * MIB), (1, 10 * MIB), (2, 10 * MIB), (1, -10 * MIB),
                (2, -10 * MIB), (3, 40 * MIB)]  # fmt: skip
    assert reserved(requests) == 40 * MIB
    # without the merge the 40 MiB request would not fit in the free pieces (10 + 10 + 20)


def test_a_full_card_returns_wholly_free_segments_and_retries():
    requests = [(0, 40 * MIB), (0, -40 * MIB), (1, 50 * MIB)]
    # unlimited: the free 40 MiB segment stays cached beside the new 50
    assert reserved(requests) == 90 * MIB
    # a card leaving 60 MiB: the 40 is returned, then the 50 fits
    replay = allocator.replay(requests, 60 * MIB)
    assert not replay.out_of_memory and replay.peak_reserved_bytes == 50 * MIB
    # but a segment with a live block in it stays: 40 MiB split into 30 live + 10 free
    pinned = [(0, 40 * MIB), (0, -40 * MIB), (2, 30 * MIB), (1, 25 * MIB)]
    assert allocator.replay(pinned, 60 * MIB).out_of_memory
    assert not allocator.replay(pinned, 66 * MIB).out_of_memory


def test_small_and_large_pools_do_not_share_blocks():
    # a free 20 MiB large block cannot serve a 512 KiB request: it opens a 2 MiB small segment
    requests = [(0, 5 * MIB), (0, -5 * MIB), (1, 512 * KIB)]
    assert reserved(requests) == 22 * MIB


def test_frees_of_blocks_made_before_the_record_are_ignored():
    assert reserved([(7, -MIB), (0, 12 * MIB)]) == 12 * MIB


def test_a_block_freed_on_one_stream_serves_only_that_stream():
    # a 40 MiB block freed on stream 1 (as FSDP2's gathers are) cannot serve stream 0
    assert reserved([(0, 40 * MIB, 1), (0, -40 * MIB), (1, 40 * MIB, 0)]) == 80 * MIB
    assert reserved([(0, 40 * MIB, 1), (0, -40 * MIB), (1, 40 * MIB, 1)]) == 40 * MIB
    # a full card returns the other stream's wholly free segment and fits
    replay = allocator.replay([(0, 40 * MIB, 1), (0, -40 * MIB), (1, 40 * MIB, 0)], 50 * MIB)
    assert not replay.out_of_memory and replay.peak_reserved_bytes == 40 * MIB


def test_the_fake_step_records_the_stream_an_allocation_is_made_on():
    """FSDP2 enters its own streams around its gathers and reduce-scatters; on the fake tensors'
    device (the CPU) those are torch.cpu streams, which the record tells apart."""
    import torch

    from dp_cost.capacity import fake_step, storage_record

    side = torch.cpu.Stream()
    with storage_record.StorageRecord() as record:
        first = torch.empty(1000)
        with torch.cpu.stream(side):
            second = torch.empty(1000)
        third = torch.empty(1000)
    requests = fake_step.allocator_requests(record.events)
    streams = [stream for _, size, stream in requests if size > 0]
    assert streams == [0, 1, 0]
    del first, second, third


def test_the_replay_check_names_the_sizes_one_sequence_lacks_and_the_kernel_behind_them():
    """benchmarks/allocator_replay.py --frames: a size the run allocated and the plan never
    requested is listed with its first allocation's frames, past the allocator's own; sizes
    under 16 MiB and sizes both requested (whatever their counts) are left out."""
    allocator_replay = benchmark_script("allocator_replay.py")
    real = [(1, 64 * MIB), (1, -64 * MIB), (2, 132 * MIB), (3, 132 * MIB), (4, 8 * MIB)]
    predicted = [(-1, 64 * MIB), (-2, 40 * MIB)]
    entry = {
        "frames": [
            {"name": "c10::cuda::CUDACachingAllocator::Native::malloc", "filename": "a.cpp"},
            {"name": "at::native::empty_cuda", "filename": "b.cpp"},
            {"name": "at::native::_efficient_attention_backward", "filename": "c.cu"},
            {"name": "forward", "filename": "/x/model.py"},
        ]
    }
    frames = {132 * MIB: allocator_replay.frame_names(entry)}
    unmatched = allocator_replay.unmatched_sizes(real, predicted, frames)
    assert unmatched["real_only"] == [
        {"mib": 132.0, "count": 2,
         "frames": ["at::native::_efficient_attention_backward (c.cu)", "forward (model.py)"]},
    ]  # fmt: skip
    assert unmatched["predicted_only"] == [{"mib": 40.0, "count": 1}]
