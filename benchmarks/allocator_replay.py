"""The capacity planner's model of torch's CUDA caching allocator (dp_cost/capacity/allocator.py)
checked against the real one, on this card, for one config at a time:

1. the real run: the config's model and trainer built on the GPU, one warm-up step and
   ``--steps`` steps (1, as the fake step), every allocation and free recorded by torch;
2. that recorded sequence replayed through the model: its peak reserved bytes against
   ``torch.cuda.max_memory_reserved`` (the model alone, on the real requests);
3. the fake-tensor step's sequence (``--mode=capacity``'s prediction, on the CPU) replayed: its
   peak reserved against the same (the whole prediction);
4. both sequences' large requests side by side (the first place they differ), so a difference
   in reserved memory can be traced to the requests that cause it;
5. with --frames, the real run's large allocation sizes that the plan never requests (and the
   plan's that the run never made), each with the frames, C++ ones included, of its first
   allocation: the kernel whose memory the fake step misses; with --frames_of FIRST LAST, the
   frames of the real run's allocations numbered FIRST to LAST (1-based, allocations alone, as
   a replay of the --out sequences counts them): what holds a block where the two differ;
6. with --gpu_memory GIB, the fit itself: the real run held to the allocator room a card of GIB
   GiB leaves (torch.cuda.set_per_process_memory_fraction: the card less the CUDA context, and
   NCCL's buffers with several ranks, as the plan's fit takes them off), whether it ran out of
   memory there, and whether each sequence replayed within that room does. With Poisson
   sampling (the default for Hugging Face models) and several --steps, the run's chunks vary
   in size from draw to draw where the plan's are one size.

Several ranks: under torchrun with ``--distributed ddp|fsdp``, each config is planned first (rank
0's fake step, before the process group exists, as a plan of ``--world_size`` ranks makes it),
then run on every rank; rank 0's real sequence is the one compared, and rank 0 prints.

Prints one JSON line per config; with --out, also writes the two request sequences there.
Usage: python benchmarks/allocator_replay.py --model 1b --seq_len 1024 --batch_sizes 4 36 \
    --dtype bfloat16 --attention sdpa --trainers standard flash [--out DIR]
  torchrun --nproc_per_node 2 benchmarks/allocator_replay.py --distributed fsdp ...
"""

from __future__ import annotations  # noqa: I001

import argparse
import dataclasses
import gc
import json
import os
import sys
from collections import Counter


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[4])
    parser.add_argument("--max_physical_batch_size", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--trainers", nargs="+", default=["standard"])
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument(
        "--no_poisson", action="store_true", help="fixed-size batches (Hugging Face models)"
    )
    parser.add_argument("--use_lora", action="store_true")
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument(
        "--steps", type=int, default=1, help="after the warm-up (the fake step has 1)"
    )
    parser.add_argument(
        "--distributed", default="none", choices=("none", "ddp", "fsdp"),
        help="under torchrun: the sharding of the ranks (--batch_sizes global)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu_memory", type=float, default=None, metavar="GIB",
        help="hold the real run to the allocator room of a card of GIB GiB (the fit, checked)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--frames", action="store_true",
        help="record C++ and Python frames in the real run: name what the plan misses (slower)",
    )  # fmt: skip
    parser.add_argument(
        "--frames_of", type=int, nargs=2, metavar=("FIRST", "LAST"), default=None,
        help="with --frames: the frames of the real run's allocations FIRST..LAST (1-based)",
    )  # fmt: skip
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and argument mistakes answer before torch is imported


import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_cost.capacity import allocator, fake_step  # noqa: E402
from dp_cost.capacity.card import (  # noqa: E402
    GPU_OVERHEADS,
    allocator_room_bytes,
    planned_requests,
)
from dp_cost.measure import worker  # noqa: E402
from dp_cost.measure.config import ExperimentConfig  # noqa: E402
from dp_cost.measure.workload import Workload  # noqa: E402
from dp_cost.parallel.mode import distributed_mode  # noqa: E402

LARGE = 100 * 2**20  # requests compared one by one: the ones that move a peak
NAMED = 16 * 2**20  # sizes compared as sets (--frames): the ones a few of which move a peak
FRAMES_KEPT = 16  # the innermost frames of an allocation worth reading, the allocator's left out
ALLOCATOR_FRAMES = ("CapturedTraceback", "gather_with_cpp", "CachingAllocator", "c10::cuda::",
                    "empty_strided", "empty_generic", "empty_cuda", "at::detail::empty",
                    "empty_memory_format", "unwind::")  # fmt: skip
DISPATCH_FRAMES = ("c10::impl::", "at::_ops::", "wrapper_CUDA", "(anonymous namespace)::wrapper")


def frame_names(entry: dict) -> list[str]:
    """An allocation's innermost frames, short, past the allocator's own and without the
    dispatcher's glue between kernels."""
    names = []
    for frame in entry.get("frames", []):
        name = frame.get("name", "?")
        if not names and any(part in name for part in ALLOCATOR_FRAMES):
            continue
        if any(part in name for part in DISPATCH_FRAMES):
            continue
        names.append(f"{name[:140]} ({os.path.basename(frame.get('filename', ''))})")
        if len(names) == FRAMES_KEPT:
            break
    return names


def real_requests(
    config, device, steps: int, frames: bool = False, rank: int = 0, window=None
) -> dict:
    """One warm-up and ``steps`` steps of ``config`` on ``device``, recorded: ``requests``
    ((address, bytes, stream) in order, bytes <= 0 for a free), ``segments`` (the allocator's own
    segment_alloc / segment_free / oom events, with the index of the request they came at),
    torch's ``peak_reserved`` bytes and whether it ran ``out_of_memory``; with ``frames``, the
    innermost frames (C++ and Python) of the first allocation of each size of at least NAMED,
    and (``window``: (first, last)) of every allocation numbered first..last."""
    stacks = "all" if frames else "python"
    torch.cuda.memory._record_memory_history(max_entries=10_000_000, stacks=stacks)
    workload = trainer = None
    out_of_memory = False
    try:
        workload = Workload(config, device, lambda name: None, {}, rank, config.world_size)
        trainer = worker.build_trainer(
            config, workload.model, workload.loss_fn, lambda n: None, workload.materialize
        )
        for _ in range(1 + steps):
            trainer.step(*workload.batch())
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True
    finally:
        snapshot = torch.cuda.memory._snapshot(device)
        peak_reserved = torch.cuda.max_memory_reserved(device)
        torch.cuda.memory._record_memory_history(enabled=None)
    requests, segments, named, framed, allocations = [], [], {}, [], 0
    streams: dict[int, int] = {}  # CUDA stream handle -> 0, 1, ... in order of first use
    for entry in snapshot["device_traces"][device.index or 0]:
        if entry["action"] in ("alloc", "free_completed"):
            size = entry["size"] if entry["action"] == "alloc" else -entry["size"]
            stream = streams.setdefault(entry.get("stream", 0), len(streams))
            requests.append((entry["addr"], size, stream))
            if frames and size >= NAMED and size not in named:
                named[size] = frame_names(entry)
            allocations += size > 0
            if window and size > 0 and window[0] <= allocations <= window[1]:
                framed.append({"allocation": allocations, "mib": size / 2**20,
                               "stream": stream, "frames": frame_names(entry)})  # fmt: skip
        elif entry["action"] in ("segment_alloc", "segment_free", "oom"):
            segments.append((entry["action"], len(requests), entry["size"]))
    del trainer, workload
    gc.collect()
    torch.cuda.empty_cache()
    return {"requests": requests, "segments": segments, "peak_reserved": peak_reserved,
            "out_of_memory": out_of_memory, "frames_by_size": named,
            "frames_of": framed}  # fmt: skip


def predicted_requests(config) -> list[tuple[int, int]]:
    """The planner's requests: the fake step's (one warm-up, one step), with the cuBLAS
    workspaces."""
    prediction = fake_step.predict(dataclasses.replace(config, device="cpu"), worker.build_trainer)
    return planned_requests(prediction)


def first_difference(real, predicted) -> dict | None:
    """The first large request (>= 100 MiB, allocations only) where the two sequences differ,
    with the requests around it in each."""
    real_large = [size / 2**20 for _, size, *_ in real if size >= LARGE]
    predicted_large = [size / 2**20 for _, size, *_ in predicted if size >= LARGE]
    for index, (a, b) in enumerate(zip(real_large, predicted_large)):
        if a != b:
            around = slice(max(0, index - 4), index + 4)
            return {
                "index": index,
                "real_mib": a,
                "predicted_mib": b,
                "real_around": real_large[around],
                "predicted_around": predicted_large[around],
            }
    if len(real_large) != len(predicted_large):
        return {
            "index": min(len(real_large), len(predicted_large)),
            "real_count": len(real_large),
            "predicted_count": len(predicted_large),
        }
    return None


def unmatched_sizes(real, predicted, frames_by_size: dict) -> dict:
    """Allocation sizes of at least NAMED that one sequence requests and the other never does,
    in MiB with their counts (the run's with the frames of its first such allocation): what the
    fake step lacks (``real_only``) or adds (``predicted_only``). Counts differ with the number
    of steps each recorded; a size in both is left out, whatever its counts."""

    def counts(requests) -> Counter:
        return Counter(size for _, size, *_ in requests if size >= NAMED)

    real_counts, predicted_counts = counts(real), counts(predicted)
    return {
        "real_only": [
            {"mib": size / 2**20, "count": count, "frames": frames_by_size.get(size, [])}
            for size, count in sorted(real_counts.items(), reverse=True)
            if size not in predicted_counts
        ],
        "predicted_only": [
            {"mib": size / 2**20, "count": count}
            for size, count in sorted(predicted_counts.items(), reverse=True)
            if size not in real_counts
        ],
    }


def main() -> int:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        print(
            "error: this compares with a CUDA card's allocator; none is available", file=sys.stderr
        )
        return 2
    if args.frames_of and (not args.frames or not 1 <= args.frames_of[0] <= args.frames_of[1]):
        print("error: --frames_of FIRST LAST needs --frames, 1 <= FIRST <= LAST", file=sys.stderr)
        return 2
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if (world_size > 1) != distributed_mode(args.distributed).is_distributed:
        print("error: --distributed ddp|fsdp runs under torchrun of 2 or more ranks, and a "
              "torchrun job of several ranks needs it", file=sys.stderr)  # fmt: skip
        return 2
    configs = [
        ExperimentConfig(
            trainer=trainer, model=args.model, seq_len=args.seq_len, batch_size=batch,
            max_physical_batch_size=args.max_physical_batch_size, dtype=args.dtype,
            attention=args.attention, use_lora=args.use_lora, lora_rank=args.lora_rank,
            optimizer=args.optimizer, poisson=not args.no_poisson, device="cuda",
            steps=args.steps, warmup_steps=1, distributed=args.distributed,
            world_size=world_size,
        )
        for trainer in args.trainers
        for batch in args.batch_sizes
    ]  # fmt: skip
    # Planned before the process group exists: the fake step makes a fake one of its own.
    planned = [predicted_requests(config) for config in configs]
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.cuda.init()
    if world_size > 1:
        torch.distributed.init_process_group("nccl", device_id=device)
    try:
        for config, predicted in zip(configs, planned):
            row = compared(config, predicted, device, args, rank)
            if rank == 0:
                print(json.dumps({k: v for k, v in row.items() if k not in SEQUENCES}), flush=True)
            if rank == 0 and args.out:
                os.makedirs(args.out, exist_ok=True)
                name = f"{config.trainer}_b{config.batch_size}_{args.distributed}.json"
                with open(os.path.join(args.out, name), "w") as file:
                    json.dump(row, file)
    finally:
        if world_size > 1:
            torch.distributed.destroy_process_group()
    return 0


SEQUENCES = ("real", "segments", "predicted")  # written with --out, not printed


def compared(config, predicted, device, args, rank: int) -> dict:
    """One config run on the card and its two sequences replayed (this rank's run)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    total = torch.cuda.mem_get_info(device)[1]
    card = total - GPU_OVERHEADS["cuda_context_bytes"]
    if args.gpu_memory is not None:
        card = allocator_room_bytes(args.gpu_memory, config.world_size)
        torch.cuda.set_per_process_memory_fraction(min(card / total, 1.0), device)
    try:
        run = real_requests(config, device, args.steps, args.frames, rank, args.frames_of)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    real, peak_reserved = run["requests"], run["peak_reserved"]
    released = [event for event in run["segments"] if event[0] == "segment_free"]
    on_card = {
        "real": allocator.replay(real, card),
        "prediction": allocator.replay(predicted, card),
    }
    unlimited = {"real": allocator.replay(real), "prediction": allocator.replay(predicted)}
    row = {
        "trainer": config.trainer, "batch_size": config.batch_size, "seq_len": config.seq_len,
        "distributed": config.distributed, "world_size": config.world_size,
        "device": torch.cuda.get_device_name(device),
        "allocator_room_mib": card / 2**20,
        "measured_peak_reserved_mib": peak_reserved / 2**20,
        "ran_out_of_memory": run["out_of_memory"],
        "segments_released": len(released),
        "replayed_real_out_of_memory": on_card["real"].out_of_memory,
        "replayed_prediction_out_of_memory": on_card["prediction"].out_of_memory,
        "replayed_real_peak_reserved_mib": unlimited["real"].peak_reserved_bytes / 2**20,
        "replayed_prediction_peak_reserved_mib":
            unlimited["prediction"].peak_reserved_bytes / 2**20,
        "real_requests": sum(1 for _, size, *_ in real if size > 0),
        "predicted_requests": sum(1 for _, size, *_ in predicted if size > 0),
        "real_streams": len({stream for _, _, stream in real}),
        "predicted_streams": len({request[2] if len(request) > 2 else 0 for request in predicted}),
        "first_large_difference": first_difference(real, predicted),
    }  # fmt: skip
    if args.frames:
        row["unmatched_sizes"] = unmatched_sizes(real, predicted, run["frames_by_size"])
        row["frames_of"] = run["frames_of"]
    return {**row, "real": real, "segments": run["segments"], "predicted": predicted}


if __name__ == "__main__":
    sys.exit(main())
