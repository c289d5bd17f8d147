"""The ops a step dispatches, each with what the time model needs: its kind (a GEMM, an
attention, a kernel that moves memory, a view that launches nothing, a host sync), its FLOPs,
the bytes it reads and writes, and whether autograd's engine dispatched it (the backward) or
Python did. Recorded by a dispatch mode, on the planned step's fake tensors or on a real step
(the card's calibration counts its host-bound step's ops with it).

FLOPs come from torch's own counter's formulas (``torch.utils.flop_counter``), for the ops it
knows: the planned step's attention is the CUDA kernel's op (``capacity.attention``); a real
CPU step's fused attention is counted with the same formulas.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from dp_cost.core.repeated import repeats

aten = torch.ops.aten
DEVICE_QUERY = torch.ops.prim.device.default

GEMM, ATTENTION, MEMORY, VIEW, SYNC = "gemm", "attention", "memory", "view", "sync"
COLLECTIVE = "collective"

# Ops that launch no kernel though they are not views: storage made or metadata changed only
NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.detach.default,
    aten.lift_fresh.default,
    aten.set_.source_Storage_storage_offset,
    aten.resize_.default,
    aten._unsafe_view.default,
    aten.record_stream.default,
}
# The host reads a value off the device: it waits for every kernel queued before
SYNCS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
# Collectives by what the card's table measures them as (``benchmarks/collective_rates.py``):
# c10d's ops (what torch.distributed and FSDP2 dispatch) and the functional ones (DTensor's)
COLLECTIVES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
RANGE_ENTER = torch.ops.profiler._record_function_enter_new.default
OPTIMIZER_RANGE = "Optimizer.step#"  # the range torch.optim's step opens
# The CPU's fused attention and its backward (a real CPU step's, as the calibration's tests run)
CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One dispatched op. ``gemm``: (batch, M, N, K) of a GEMM (batch 1 for a plain one);
    ``segment``: how many phase marks came before it (``OpRecord.mark``); ``optimizer``:
    dispatched inside ``torch.optim``'s step."""

    name: str
    kind: str
    flops: int
    bytes: int
    dtype: str
    backward: bool
    segment: int
    gemm: tuple[int, int, int, int] | None = None
    seq_len: int | None = None  # an attention's query length
    head_dim: int | None = None  # and its head size
    optimizer: bool = False
    collective: str | None = None  # a collective's kind (COLLECTIVES' values)


def _tensors(values) -> list[torch.Tensor]:
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@functools.cache
def _written_arguments(func) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, keyword-only) of each argument ``func`` writes (``Tensor(a!)``)."""
    return tuple(
        (i, argument.name, argument.kwarg_only)
        for i, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place: what an op that returns nothing (torch.optim's
    foreach steps, FSDP2's copies into its ``out`` buffers) leaves as its output."""
    written = []
    for position, name, _ in _written_arguments(func):
        written += _tensors(args[position] if position < len(args) else kwargs.get(name))
    return written


def _read_kwargs(func, kwargs) -> list[torch.Tensor]:
    """The tensors of ``kwargs`` that ``func`` reads: all but its ``out=`` buffers, which it
    only writes (counted once, as its output)."""
    only_written = {name for _, name, keyword in _written_arguments(func) if keyword}
    return _tensors([value for name, value in kwargs.items() if name not in only_written])


def _first_dtype(tensors: list[torch.Tensor]) -> str:
    for t in tensors:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


def gemm_shape(func, args) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a GEMM op's operands (batch 1 for a plain one)."""
    a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else args[:2]
    if a.dim() == 3:
        return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
    return 1, a.shape[0], b.shape[1], a.shape[1]


def collective_bytes(args, output) -> int:
    """The bytes of a collective's whole tensor: its larger side (a gather's output, a
    reduce-scatter's input, an all-reduce's tensors), what its time is measured by: c10d's ops
    take both sides as arguments, the functional ones return their output."""
    sides = [_bytes(_tensors(value)) for value in (*args[:2], output)]
    return max(sides)


def attention_flops(func, args, kwargs, output) -> tuple[int, int, int] | None:
    """(FLOPs, query length, head size) of a fused attention op, or None for any other op: torch's
    FLOP formulas, grouped key and value heads counted as the query's (what the kernel does;
    torch's counter refuses them)."""
    name = func.overloadpacket.__name__
    fused = func in (CPU_ATTENTION, CPU_ATTENTION_BACKWARD) or (
        "attention" in name and func.overloadpacket in flop_registry
    )
    if not fused:
        return None
    backward = "backward" in name
    q, k, v = args[1:4] if backward else args[:3]

    def as_query_heads(t):
        return (*t.shape[:-3], q.shape[-3], *t.shape[-2:])

    k, v = as_query_heads(k), as_query_heads(v)
    if backward:
        flops = sdpa_backward_flop_count(args[0].shape, q.shape, k, v)
    else:
        flops = sdpa_flop_count(q.shape, k, v)
    return flops, q.shape[-2], q.shape[-1]


def describe(func, args, kwargs, output, segment: int, optimizer: bool = False) -> Op:
    """``func``'s dispatch as an Op."""
    name, inputs = str(func), _tensors(args)
    known = {"segment": segment, "optimizer": optimizer, "dtype": _first_dtype(inputs)}
    known["backward"] = torch._C._current_autograd_node() is not None
    if func in SYNCS:
        return Op(name, SYNC, 0, 0, **known)
    collective = COLLECTIVES.get(func.overloadpacket.__name__)
    if collective and func.namespace in COLLECTIVE_NAMESPACES:
        return Op(
            name, COLLECTIVE, 0, collective_bytes(args, output), collective=collective, **known
        )
    # an op that writes its arguments in place and returns nothing writes them: its output
    outputs = _tensors(output) or _written(func, args, kwargs)
    # a view, a storage made, an op of no tensor (types promoted, sizes read): no kernel; nor
    # torch.optim's count of its steps (scalars on the host, unless the step is capturable)
    step_counts = optimizer and all(t.dim() == 0 for t in outputs)
    if func in NO_KERNEL or func.is_view or not outputs or step_counts:
        return Op(name, VIEW, 0, 0, **known)
    moved = _bytes(inputs) + _bytes(_read_kwargs(func, kwargs) if kwargs else []) + _bytes(outputs)
    if func in GEMMS:
        batch, m, n, k = gemm_shape(func, args)
        return Op(name, GEMM, 2 * batch * m * n * k, moved, gemm=(batch, m, n, k), **known)
    attention = attention_flops(func, args, kwargs, output)
    if attention is not None:
        flops, seq_len, head_dim = attention
        return Op(name, ATTENTION, flops, moved, seq_len=seq_len, head_dim=head_dim, **known)
    return Op(name, MEMORY, 0, moved, **known)


class StepMode(TorchDispatchMode):
    """A dispatch mode that every op of a step passes through. torch wraps a mode's dispatch in
    a guard against compiling into it, one more Python call around each dispatch; a planned or
    counted step compiles nothing, so the guard is left out."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def fake_device(func, args):
    """A fake tensor's device where ``func`` asks for it, else None. Autograd's engine asks each
    tensor it touches (most of a planned step's dispatches); the answer makes no storage and is
    no op, so a mode gives it at once, as the fake mode would."""
    if func is DEVICE_QUERY and type(args[0]) is FakeTensor:
        return args[0].fake_device
    return None


class OpRecord(StepMode):
    """Every op dispatched while it is active, in order (``ops``), split into segments at the
    marks the step's phases leave (``mark``): the time model times each chunk of a step apart."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.marks: list[str] = []
        self._ranges: list[str] = []  # the record_function ranges open, innermost last

    def mark(self, name: str) -> None:
        self.marks.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = fake_device(func, args)
        if device is not None:
            return device
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        self.observe(func, args, kwargs, output)
        return output

    def observe(self, func, args, kwargs, output) -> None:
        """``func``'s call recorded, its ``output`` made below this record (or by a mode that
        records for it: ``capacity.storage_record.RecordingFakeMode``)."""
        namespace = func.namespace
        if namespace == "profiler":  # torch.optim's step is one of these ranges
            if func is RANGE_ENTER:
                self._ranges.append(args[0])
            elif self._ranges:
                self._ranges.pop()
        elif namespace != "prim":  # prim: the fake mode's own queries (a tensor's device)
            optimizer = any(name.startswith(OPTIMIZER_RANGE) for name in self._ranges)
            op = describe(func, args, kwargs, output, len(self.marks), optimizer)
            self.ops.extend([op] * repeats(self._ranges))  # a loop run once for its N times
