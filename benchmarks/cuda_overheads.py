"""What a CUDA process holds beside a training step's own tensors, measured on this card: the
numbers --mode=capacity adds to a fake-tensor prediction (dp_cost/measure/capacity.py,
GPU_OVERHEADS).

- cuBLAS workspaces: allocated through torch's caching allocator by the first matmul on a
  stream and thread (the forward's, and the backward's on autograd's device thread): the bytes
  torch counts after a forward and a backward matmul beyond their own tensors.
- CUDA context and libraries: the card's used memory (cudaMemGetInfo) beyond what torch's
  allocator has reserved, once CUDA, cuBLAS and a matmul have run.

Prints one JSON object. Usage: python benchmarks/cuda_overheads.py
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if not torch.cuda.is_available():
        print("error: this measures a CUDA card; none is available", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
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
    print(json.dumps({
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "total_memory_bytes": total,
        "cublas_workspace_forward_bytes": after_forward,
        "cublas_workspace_bytes": after_backward,
        "cuda_context_bytes": context,
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
