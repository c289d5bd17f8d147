"""What a CUDA process holds beside a training step's own tensors, measured on this card: the
numbers --mode=capacity adds to a fake-tensor prediction (dp_cost/capacity/card.py,
GPU_OVERHEADS).

- cuBLAS workspaces: allocated through torch's caching allocator by the first matmul on a
  stream and thread (the forward's, and the backward's on autograd's device thread): the bytes
  torch counts after a forward and a backward matmul beyond their own tensors.
- CUDA context and libraries: the card's used memory (cudaMemGetInfo) beyond what torch's
  allocator has reserved, once CUDA, cuBLAS and a matmul have run.
- NCCL's buffers (under torchrun, several ranks): what the card's used memory beyond torch's
  reserved grew by once the process group is up and has run the collectives DDP and FSDP2 use
  (all-reduce, all-gather, reduce-scatter), on rank 0.

Prints one JSON object (rank 0). Usage: python benchmarks/cuda_overheads.py, or
torchrun --nproc_per_node N benchmarks/cuda_overheads.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__":  # --help answers before torch is imported
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()

import torch
import torch.distributed as dist


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if not torch.cuda.is_available():
        print("error: this measures a CUDA card; none is available", file=sys.stderr)
        return 2
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.cuda.init()
    weight = torch.randn(1024, 1024, device=device, requires_grad=True)
    inputs = torch.randn(64, 1024, device=device, requires_grad=True)
    own = torch.cuda.memory_allocated(device)
    output = inputs @ weight
    after_forward = torch.cuda.memory_allocated(device) - own - output.nbytes
    output.sum().backward()
    torch.cuda.synchronize(device)
    tensors = output.nbytes + weight.grad.nbytes + inputs.grad.nbytes
    after_backward = torch.cuda.memory_allocated(device) - own - tensors
    free, total = torch.cuda.mem_get_info(device)
    context = total - free - torch.cuda.memory_reserved(device)
    nccl = nccl_buffers(device, context) if ranks > 1 else None
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(json.dumps({
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "total_memory_bytes": total,
        "cublas_workspace_forward_bytes": after_forward,
        "cublas_workspace_bytes": after_backward,
        "cuda_context_bytes": context,
        "ranks": ranks,
        "nccl_buffers_bytes": nccl,
    }, indent=1))  # fmt: skip
    return 0


def nccl_buffers(device: torch.device, context: int) -> int:
    """The card's memory outside torch's allocator beyond ``context``, once NCCL has run an
    all-reduce, an all-gather and a reduce-scatter of 64 MiB over the job's ranks."""
    dist.init_process_group("nccl", device_id=device)
    ranks = dist.get_world_size()
    chunk = torch.ones(2**24 // ranks * ranks, device=device)  # 64 MiB of fp32
    dist.all_reduce(chunk)
    gathered = torch.empty(chunk.numel() * ranks, device=device)
    dist.all_gather_into_tensor(gathered, chunk)
    dist.reduce_scatter_tensor(chunk, gathered)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    nccl = total - free - torch.cuda.memory_reserved(device) - context
    dist.barrier()
    dist.destroy_process_group()
    return nccl


if __name__ == "__main__":
    sys.exit(main())
