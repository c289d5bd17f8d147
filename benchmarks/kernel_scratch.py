"""The memory CUDA kernels take for themselves, measured on this card against the planner's rules
(dp_cost/capacity/kernel_scratch.py): for each op an eager step dispatches, the bytes the
caching allocator handed out during the op beyond the op's new outputs (torch's own
``allocated_bytes.all.allocated`` counter, before and after), beside the bytes the rules give.

Two sources of ops, both on the card:
- ``grid``: reductions (sums over the dimensions a bias gradient, a per-sample bias gradient, a
  norm and a whole-tensor sum take, of permuted and sliced inputs too), the embedding's backward
  and cuDNN's attention backward (grouped and not) at a grid of shapes and dtypes;
- ``--config`` runs: one warm-up and one step of a toolkit config (the model, trainer and
  batch of the measuring modes), every op watched: ops in the rules' registry are checked, and
  any other op that took 1 MiB or more for itself is listed (a kernel the rules lack).

Writes --out (JSON: every checked case with its arguments, so tests/capacity/
test_kernel_scratch.py rebuilds them on meta tensors) and prints a summary.
usage: python benchmarks/kernel_scratch.py --out kernel_scratch.json
           [--config="--model 1b --seq_len 1024 --batch_size 8 --trainer dpsgd ..." ...]
"""

from __future__ import annotations  # noqa: I001

import argparse
import dataclasses
import json
import os
import shlex
import sys

LISTED = 2**20  # an unregistered op's scratch worth naming


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file of cases to write")
    parser.add_argument(
        "--config", action="append", default=[],
        help="a toolkit config, as ExperimentConfig fields in flag form (--model 1b --seq_len "
        "1024 --batch_size 8 --trainer dpsgd --dtype bfloat16 --attention sdpa ...)",
    )  # fmt: skip
    parser.add_argument("--no_grid", action="store_true", help="only the --config runs")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and argument mistakes answer before torch is imported


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_cost.capacity.allocator import request_bytes  # noqa: E402
from dp_cost.capacity.kernel_scratch import SCRATCH, scratch_bytes  # noqa: E402


def describe(value):
    """An argument as JSON: a tensor by its layout (shape, stride, offset, dtype), the rest as
    it is."""
    if isinstance(value, torch.Tensor):
        return {
            "tensor": True, "shape": list(value.shape), "stride": list(value.stride()),
            "offset": value.storage_offset(), "dtype": str(value.dtype).split(".")[-1],
        }  # fmt: skip
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    if isinstance(value, dict):
        return {key: describe(item) for key, item in value.items()}
    if isinstance(value, torch.dtype):
        return {"dtype_value": str(value).split(".")[-1]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class ScratchWatch(TorchDispatchMode):
    """Every op's scratch on the card: the allocator's cumulative allocated bytes across the op,
    less its outputs' new storages (each as the allocator rounds it)."""

    def __init__(self, device):
        super().__init__()
        self.device = device
        self.checked: dict[str, dict] = {}  # ops of the rules' registry, each case once
        self.unlisted: dict[tuple, dict] = {}  # (op, shapes) -> the largest scratch seen

    def _allocated(self) -> int:
        return torch.cuda.memory_stats(self.device)["allocated_bytes.all.allocated"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}  # fmt: skip
        before = self._allocated()
        output = func(*args, **kwargs)
        taken = self._allocated() - before
        new = {}
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes():
                    new[storage.data_ptr()] = request_bytes(storage.nbytes())
        measured = taken - sum(new.values())
        if func in SCRATCH:
            planned = sum(request_bytes(size) for size in scratch_bytes(func, args, kwargs))
            case = {"op": str(func), "args": describe(args), "kwargs": describe(kwargs)}
            # a layer's op again is one case counted again; measured otherwise, another case
            key = json.dumps(case, sort_keys=True) + f" {measured}"
            if key in self.checked:
                self.checked[key]["count"] += 1
                return output
            case.update(measured_bytes=measured, planned_bytes=planned, count=1)
            self.checked[key] = case
        elif measured >= LISTED:
            shapes = tuple(tuple(t.shape) for t in tree_leaves(args) if isinstance(t, torch.Tensor))
            key = (str(func), shapes)
            if measured > self.unlisted.get(key, {}).get("measured_bytes", 0):
                self.unlisted[key] = {"op": str(func), "shapes": [list(s) for s in shapes],
                                      "measured_bytes": measured}  # fmt: skip
        return output


def grid(device, watch: ScratchWatch) -> None:
    """Reductions and cuDNN's attention backward at shapes a step of the toolkit's models makes."""
    for dtype in (torch.float32, torch.bfloat16):
        for batch, tokens, width in ((2, 4096, 8192), (4, 2048, 2048), (8, 1024, 8192),
                                     (16, 256, 3072), (1, 512, 1000), (4, 100, 8192),
                                     (64, 128, 640)):  # fmt: skip
            x = torch.randn(batch, tokens, width, device=device, dtype=dtype)
            with watch:
                x.sum((0, 1))  # a bias gradient
                x.sum(1)  # Opacus' per-sample bias gradient
                x.sum(-1)  # along the fastest dimension
                x.sum()
                x.mean((0, 1))
                x[:, 1:].sum((0, 1))  # not one run of memory
                x.permute(2, 1, 0).sum(2)  # kept dimensions out of the input's order
            del x
        for tokens, width, rows in ((8192, 2048, 32000), (2048, 2048, 32000),
                                    (16384, 3072, 128256)):  # fmt: skip
            table = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
            ids = torch.randint(rows, (tokens,), device=device)
            out = F.embedding(ids, table)
            with watch:
                out.backward(torch.ones_like(out))  # more than 3072 tokens: the sorting backward
            del table, ids, out
    for batch, heads, key_heads, tokens, head_dim in ((4, 16, 16, 2048, 128), (16, 24, 8, 256, 128),
                                                      (2, 32, 8, 1024, 64), (8, 16, 16, 1024, 128),
                                                      (1, 8, 8, 4096, 256)):  # fmt: skip
        shape = (batch, heads, tokens, head_dim)
        q = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.randn(batch, key_heads, tokens, head_dim, device=device, dtype=torch.bfloat16,
                        requires_grad=True)
            for _ in range(2)
        )  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=key_heads != heads)
        with watch:
            out.sum().backward()
        del q, k, v, out


def config_step(flags: str, device, watch: ScratchWatch) -> None:
    """One warm-up and one step of a toolkit config on the card, every op watched."""
    from dp_cost.measure import worker
    from dp_cost.measure.config import ExperimentConfig
    from dp_cost.measure.workload import Workload

    kinds = {field.name: str(field.type) for field in dataclasses.fields(ExperimentConfig)}
    fields = {}
    words = shlex.split(flags)
    for name, value in zip(words[::2], words[1::2]):
        key = name.lstrip("-")
        kind = kinds[key]
        if "bool" in kind:
            fields[key] = value.lower() in ("1", "true", "yes")
        elif "int" in kind:
            fields[key] = int(value)
        elif "float" in kind:
            fields[key] = float(value)
        else:
            fields[key] = value
    config = ExperimentConfig(device="cuda", **fields)
    workload = Workload(config, device, lambda name: None, {})
    trainer = worker.build_trainer(config, workload.model, workload.loss_fn, lambda n: None)
    trainer.step(*workload.batch())
    with watch:
        trainer.step(*workload.batch())
    torch.cuda.synchronize(device)
    del trainer, workload
    torch.cuda.empty_cache()


def main() -> int:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        print("error: this measures a CUDA card's kernels; none is available", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    watch = ScratchWatch(device)
    if not args.no_grid:
        grid(device, watch)
    failed = []
    for flags in args.config:
        try:
            config_step(flags, device, watch)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:  # the others still run
            failed.append(flags)
            print(f"warning: config {flags!r} failed: {error}", file=sys.stderr)
    props = torch.cuda.get_device_properties(device)
    checked = list(watch.checked.values())
    wrong = [case for case in checked if case["measured_bytes"] != case["planned_bytes"]]
    result = {
        "device": torch.cuda.get_device_name(device),
        "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "configs": [flags for flags in args.config if flags not in failed],
        "cases": checked,
        "unlisted": sorted(watch.unlisted.values(), key=lambda row: -row["measured_bytes"]),
    }
    with open(args.out, "w") as file:
        json.dump(result, file, indent=1)
    calls = sum(case["count"] for case in checked)
    print(f"{calls} calls of the rules' ops, {len(checked)} distinct, {len(wrong)} differ")
    for case in wrong[:20]:
        shapes = [a["shape"] for a in case["args"] if isinstance(a, dict) and "shape" in a]
        print(f"  {case['op']} {shapes}: measured {case['measured_bytes']}, "
              f"planned {case['planned_bytes']}")  # fmt: skip
    for row in result["unlisted"][:30]:
        print(f"  not in the rules: {row['op']} {row['shapes']}: "
              f"{row['measured_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
