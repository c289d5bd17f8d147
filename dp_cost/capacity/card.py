"""What a card holds beside the step's own tensors, and whether a step fits it. The fake step
does not see the CUDA side: the CUDA context and NCCL's buffers (``GPU_OVERHEADS``: measured,
with the card and the scripts that measured them; the cuBLAS workspaces' size, which the fake
step requests where a run does), and the caching allocator, whose rules ``capacity.allocator``
replays over the step's requests: a step fits when every request finds a place on the card."""

from __future__ import annotations

from dp_cost.capacity import allocator
from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.core.schema import MB

GIB = 2**30
# Rooms this close place a step's requests alike: the allocator's smallest segment (2 MiB)
ROOM_STEP = 2 * MB

# What a CUDA process holds beside the step's own tensors, measured on an H200 with torch 2.11
# (benchmarks/README.md, "Will it fit?"): the cuBLAS workspaces a forward and a backward matmul
# allocate through the caching allocator (benchmarks/cuda_overheads.py) and the CUDA context and
# libraries (outside torch's counters; the same script), and with several ranks NCCL's buffers
# (outside torch's counters too: the same script under torchrun, 2 ranks over NVLink with
# NCCL_NVLS_ENABLE=0, after an all-reduce, an all-gather and a reduce-scatter; NVLink SHARP,
# NCCL's default on NVSwitch hosts, and more ranks can take more). What the allocator's
# fragmentation takes is not a margin: ``capacity.allocator`` replays the step's requests.
GPU_OVERHEADS = {
    "cublas_workspace_bytes": 64 * MB,  # two of 32 MiB (Hopper): forward and backward thread
    "cuda_context_bytes": 785_186_816,  # about 749 MiB
    "nccl_buffers_bytes": 878_706_688,  # about 838 MiB a rank, 2 x H200 over NVLink
    "measured_on": "NVIDIA H200, torch 2.11.0+cu130, NCCL 2.28.3, 2026-11-27",
}


def allocator_room_bytes(budget_gib: float, world_size: int = 1) -> int:
    """What torch's caching allocator can reserve on a card of ``budget_gib`` GiB: the card
    less the CUDA context, and NCCL's buffers when there are several ranks."""
    nccl = GPU_OVERHEADS["nccl_buffers_bytes"] if world_size > 1 else 0
    return int(budget_gib * GIB) - GPU_OVERHEADS["cuda_context_bytes"] - nccl


def planned_requests(prediction: dict) -> list[tuple[int, int]]:
    """The requests the caching allocator gets: the fake step's (the model and trainer built,
    a warm-up step, the recorded step), the cuBLAS workspaces among them where the warm-up's
    first forward and backward GEMM allocate them."""
    return [*prediction["requests"], *prediction["step_requests"]]


def reserved_peak(prediction: dict) -> int:
    """The most the caching allocator would reserve for the step on an unlimited card."""
    return allocator.replay(planned_requests(prediction)).peak_reserved_bytes


def releases_cache(config) -> bool:
    """Whether a plan of ``config`` may fit by the allocator releasing its cached segments, as
    torch's does when a request finds no room. Not under Poisson sampling: a draw's chunks come
    in other sizes from step to step and fragment the cache the plan's chunks of one size do
    not. Measured on 2 x H200 (Llama-3.1-8B, FSDP2, seq 2048): standard and flash held 11.6%
    and 27.6% more reserved memory with Poisson draws than one fixed-size step, and held to an
    80 GiB card's room (benchmarks/allocator_replay.py --gpu_memory), flash at 4 a rank, which
    fitted only by releasing cached segments, ran out of memory with draws and ran with
    fixed-size batches. So such a plan fits only where its reserved peak on a card without
    limit is within the room: the cache it would release is the draws' margin (FIT_RULES).
    (The causal LM trains on one fixed batch, whatever ``--poisson`` says.)"""
    return config.model not in HF_CONFIGS or not config.poisson


FIT_RULES = {
    True: "fits where the caching allocator, releasing its wholly free cached segments as "
    "torch's does, places every request of the step in the room",
    False: "Poisson sampling: fits where the step's reserved peak on a card without limit is "
    "within the room (the cache a draw's chunks of other sizes fragment is kept as margin, "
    "never released in the plan)",
}


def fits(prediction: dict, budget_gib: float, world_size: int = 1, release: bool = True) -> bool:
    """The step runs on the card: the allocator places every request within its room (returning
    its wholly free segments to the card first where it must, as torch's does; ``release``
    False: without returning any, ``releases_cache``)."""
    room = allocator_room_bytes(budget_gib, world_size)
    if not release:
        return reserved_peak(prediction) <= room
    return not allocator.replay(planned_requests(prediction), room).out_of_memory


def needed_room(prediction: dict, release: bool = True) -> int:
    """The least room, to ROOM_STEP, in which the allocator places every request of the step:
    what ``fits`` decides, as a number (bisected between the allocated peak and the reserved
    peak on an unlimited card, a dozen replays of tens of ms: a fake step takes seconds);
    without ``release``, the reserved peak itself."""
    requests = planned_requests(prediction)
    low, high = prediction["peak"], allocator.replay(requests).peak_reserved_bytes
    while release and high - low > ROOM_STEP:
        middle = (low + high) // 2
        if allocator.replay(requests, middle).out_of_memory:
            low = middle
        else:
            high = middle
    return high


# A CUDA graph's private memory pool keeps what the eager step frees and reuses; the fake step
# runs eagerly. Measured on an H200 (1b bf16, (8, 512) and (8, 1024)): 17-25% above the plan.
GRAPH_PEAK_NOTE = (
    "--cuda_graph: a lower bound, not a prediction: a CUDA graph's private memory pool keeps "
    "what the eager step frees and reuses (measured 17-25% above this plan for the 1b model)"
)
