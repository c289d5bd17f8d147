"""Every storage a planned step allocates and releases, recorded as the CUDA caching
allocator's history records them: ``alloc`` and ``free_completed`` events with an address (the
storage's key), a size in allocator blocks and the Python functions on the stack that allocated
it. ``capacity.fake_step`` runs the step; ``capacity.allocator`` and ``measure.breakdown`` read
the events.

The record is a dispatch mode of its own (``StorageRecord``, over any fake mode), or it rides
in the planner's fake mode (``RecordingFakeMode``): each mode on torch's stack is one more
Python dispatch of every op, about a third of a fake op's cost on a 2-core CPU, and a planned
step is tens of thousands of ops.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from dp_cost.capacity.allocator import request_bytes
from dp_cost.capacity.card import GPU_OVERHEADS
from dp_cost.capacity.fake_mode import TORCH_DISPATCH, PlannedFakeMode
from dp_cost.capacity.kernel_scratch import scratch_requests
from dp_cost.capacity.op_list import GEMMS, StepMode, fake_device
from dp_cost.measure.breakdown import MARKER_FUNCTION

DEVICE = "cpu"  # the fake tensors' device: CPU code paths (torch's, no Triton), CUDA's memory
SCRATCH_KEYS = -(2**50)  # a kernel's own buffers' keys count down from here (markers' from -1)
WORKSPACE_KEYS = -(2**51)  # the cuBLAS workspaces' keys (never freed)
_FRAMES: dict = {}  # (file, function) -> its frames' one dict, shared by their records (read only)


def storage_key(tensor: torch.Tensor) -> int:
    """One number per storage, equal for every view of it (a fake tensor has no data pointer)."""
    return tensor.untyped_storage()._cdata


def _unique_rows(values, dim, sorted=True, return_inverse=False, return_counts=False):
    count = values.shape[dim]
    return values.clone(), _indices(count if return_inverse else 0), _indices(count * return_counts)


def _unique_values(values, sorted=True, return_inverse=False, return_counts=False):
    inverse = torch.empty(values.shape if return_inverse else (0,), dtype=torch.long, device=DEVICE)
    return values.flatten().clone(), inverse, _indices(values.numel() * return_counts)


def _indices(count: int) -> torch.Tensor:
    return torch.empty(count, dtype=torch.long, device=DEVICE)


# How many distinct values torch.unique finds depends on the data, which fake tensors lack: plan
# for every one distinct, the most memory (random tokens come close).
ALL_DISTINCT = {
    torch.ops.aten.unique_dim.default: _unique_rows,
    torch.ops.aten._unique2.default: _unique_values,
}


def _safe_softmax(values, dim, dtype=None):
    """torch's ``_safe_softmax`` (the math attention's softmax) as its kernel computes it, each
    intermediate through the allocator: the softmax, a full-size mask of the -inf entries
    (held to the end, a C++ local) and the result; a fake tensor's meta kernel makes only the
    result (1 GB less at the peak of a Llama-3.2-1B fp32 layer at (2, 2048))."""
    out = torch.softmax(values, dim, dtype=dtype)
    blocked = values.eq(float("-inf"))
    rows = blocked.all(dim, keepdim=True)
    return torch.where(rows, torch.zeros((), dtype=out.dtype, device=out.device), out)


# Ops whose CUDA kernel allocates intermediates through the caching allocator: run as their
# kernel composes them, under the record, so each intermediate is recorded
AS_COMPOSED = {torch.ops.aten._safe_softmax.default: _safe_softmax}


class StorageRecord(StepMode):
    """Every storage an op creates, as the allocator history ``attribute_peak`` reads: ``alloc``
    and ``free_completed`` events with an address (the storage's key), its size in allocator
    blocks and the Python functions on the stack that allocated it. A storage resized in
    place (FSDP2 frees and re-allocates its unsharded parameters so, ``resize_(0)`` and back;
    no op is dispatched for it) is a free and an allocation too."""

    def __init__(self):
        super().__init__()
        self.events: list[dict] = []
        self.live: dict[int, int] = {}  # key -> bytes (0: resized to nothing)
        self._storage_resize = torch.UntypedStorage.resize_
        self._depth = 0
        # The fake tensors' device is the CPU, whose streams FSDP2 enters as it would CUDA's:
        # each allocation's stream (0: the default one) for the allocator's per-stream pools.
        # Keyed by the stream itself (held here): an id could be reused by a later stream.
        self._streams: dict[object, int] = {torch.cpu.current_stream(): 0}
        # cuBLAS keeps a workspace per thread's handle, allocated by its first GEMM through the
        # caching allocator: the Python thread's and autograd's backward thread's. Where a run
        # allocates them places them among the step's blocks (the backward's in the blocks the
        # forward freed), so they are made where that GEMM runs.
        self._workspaces: set[bool] = set()  # in a backward: whether that thread has one

    def _stream(self) -> int:
        return self._streams.setdefault(torch.cpu.current_stream(), len(self._streams))

    def __enter__(self):
        mode = super().__enter__()
        self.patch_resizes()
        return mode

    def __exit__(self, *exc):
        self.unpatch_resizes()
        return super().__exit__(*exc)

    def patch_resizes(self) -> None:
        """Watch ``UntypedStorage.resize_`` (no op is dispatched for it). Counted: entered
        again inside its own dispatch (AS_COMPOSED), it is patched once."""
        self._depth += 1
        if self._depth > 1:
            return
        record, resize = self, self._storage_resize

        def resize_(storage, nbytes):
            result = resize(storage, nbytes)
            if storage._cdata in record.live:
                record._resized(storage._cdata, nbytes)
            return result

        torch.UntypedStorage.resize_ = resize_

    def unpatch_resizes(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            torch.UntypedStorage.resize_ = self._storage_resize

    def held(self) -> dict[int, int]:
        """key -> bytes of the storages that hold memory now."""
        return {key: size for key, size in self.live.items() if size}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = fake_device(func, args)
        if device is not None:
            return device
        kwargs = kwargs or {}
        composed = AS_COMPOSED.get(func)
        if composed is not None:
            with self:  # its ops come through this record again
                return composed(*args, **kwargs)
        output = ALL_DISTINCT.get(func, func)(*args, **kwargs)
        self.made(func, args, kwargs, output)
        return output

    def made(self, func, args, kwargs, output) -> None:
        """``func``'s outputs recorded, with its CUDA kernel's own buffers and, at a thread's
        first GEMM, its cuBLAS workspace (the op itself was dispatched below the record)."""
        before, after = scratch_requests(func, args, kwargs)
        scratch = self._take(before)
        for tensor in (output,) if type(output) is FakeTensor else tree_leaves(output):
            if isinstance(tensor, DTensor):  # FSDP2: its shard, made by ops this mode skips
                tensor = tensor.to_local()
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)
        self._give_back(scratch + self._take(after))
        if func in GEMMS:
            self._cublas_workspace()

    def _cublas_workspace(self) -> None:
        """The workspace of the thread this GEMM runs on, at its first GEMM (the backward's
        thread: autograd's, running a node)."""
        backward = torch._C._current_autograd_node() is not None
        if backward in self._workspaces:
            return
        self._workspaces.add(backward)
        key = WORKSPACE_KEYS - len(self._workspaces)
        self.live[key] = request_bytes(GPU_OVERHEADS["cublas_workspace_bytes"] // 2)
        self.events.append({"action": "alloc", "addr": key, "size": self.live[key],
                            "stream": self._stream(), "frames": _python_frames()})  # fmt: skip

    def add_existing(self, tensors) -> None:
        """Storages made before the record began (parameters built under another mode)."""
        for tensor in tensors:
            self._add(tensor, frames=[])

    def _add(self, tensor: torch.Tensor, frames: list[dict] | None = None) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        # An empty storage takes no block (torch's allocator hands out nothing for 0 bytes); it
        # is watched still, as FSDP2 resizes its empty unsharded storages to full and back.
        size = request_bytes(storage.nbytes()) if storage.nbytes() else 0
        self.live[key] = size
        if size:
            event = {"action": "alloc", "addr": key, "size": size, "stream": self._stream()}
            event["frames"] = _python_frames() if frames is None else frames
            self.events.append(event)
        weakref.finalize(storage, self._free, key)

    def _take(self, sizes: list[int]) -> list[tuple[int, int]]:
        """A CUDA kernel's own buffers (``capacity.kernel_scratch``) allocated: (key, bytes)
        each, under keys no storage has."""
        taken = [(SCRATCH_KEYS - len(self.events) - i, request_bytes(size))
                 for i, size in enumerate(sizes)]  # fmt: skip
        frames = _python_frames() if sizes else []
        for key, size in taken:
            self.events.append({"action": "alloc", "addr": key, "size": size,
                                "stream": self._stream(), "frames": frames})  # fmt: skip
        return taken

    def _give_back(self, taken: list[tuple[int, int]]) -> None:
        """The kernel's buffers freed as its C++ scope ends: the latest first."""
        for key, size in reversed(taken):
            self.events.append({"action": "free_completed", "addr": key, "size": size})

    def _free(self, key: int) -> None:
        size = self.live.pop(key, None)
        if size:
            self.events.append({"action": "free_completed", "addr": key, "size": size})

    def _resized(self, key: int, nbytes: int) -> None:
        if self.live[key]:
            self.events.append({"action": "free_completed", "addr": key, "size": self.live[key]})
        self.live[key] = request_bytes(nbytes) if nbytes else 0
        if nbytes:
            self.events.append(
                {"action": "alloc", "addr": key, "size": self.live[key], "stream": self._stream(),
                 "frames": _python_frames()}
            )  # fmt: skip

    def marker(self) -> None:
        """A phase boundary, as ``breakdown._phase_marker`` leaves one in the CUDA history."""
        self.events.append(
            {"action": "alloc", "addr": -len(self.events) - 1, "size": 0,
             "frames": [{"filename": __file__, "name": MARKER_FUNCTION}]}
        )  # fmt: skip


def _python_frames() -> list[dict]:
    """The allocating stack's Python frames, innermost first (what the allocator records)."""
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        where = code.co_filename, code.co_name  # equal code objects may come from two files
        if where not in _FRAMES:
            _FRAMES[where] = {"filename": where[0], "name": where[1]}
        frames.append(_FRAMES[where])
        frame = frame.f_back
    return frames


# torch's dispatch of a fake op (without its wrappers where ``fake_mode`` could take them off)
_FAKE_DISPATCH = TORCH_DISPATCH or PlannedFakeMode.__torch_dispatch__


class RecordingFakeMode(PlannedFakeMode):
    """The planner's fake mode with the step's records inside its own dispatch: the storages
    (``record``, a ``StorageRecord`` not entered as a mode of its own) and, inside
    ``recording_ops``, the ops (a ``capacity.op_list.OpRecord``, likewise). Each sees what it
    sees as a mode above the fake mode: the ops the step dispatches, not those that the fake
    mode or a record dispatches to carry one out; of an op run as its kernel composes it, the
    storage record sees its ops, the op record the op alone."""

    def __init__(self, record: StorageRecord, **kwargs):
        super().__init__(**kwargs)
        self.record = record
        self.ops = None
        self._seen_by: tuple = (record,)  # the records that see the next op dispatched

    def __enter__(self):
        mode = super().__enter__()
        self.record.patch_resizes()
        return mode

    def __exit__(self, *exc):
        self.record.unpatch_resizes()
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def recording_ops(self, ops):
        """While inside, ``ops`` (None: nothing) records the step's ops too."""
        if ops is None:
            yield None
            return
        self.ops, self._seen_by = ops, (self.record, ops)
        try:
            yield ops
        finally:
            self.ops, self._seen_by = None, (self.record,)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen_by = self._seen_by
        if not seen_by:
            return _FAKE_DISPATCH(self, func, types, args, kwargs)
        device = fake_device(func, args)
        if device is not None:
            return device
        kwargs = kwargs or {}
        composed = AS_COMPOSED.get(func)
        if composed is not None:
            with self._seen((self.record,)):  # its ops come back, the storage record's alone
                output = composed(*args, **kwargs)
            if self.ops is not None and self.ops in seen_by:
                self.ops.observe(func, args, kwargs, output)
            return output
        distinct = ALL_DISTINCT.get(func)
        self._seen_by = ()  # what carries the op out is no op of the step's
        try:
            if distinct is not None:
                with self:
                    output = distinct(*args, **kwargs)
            else:
                output = _FAKE_DISPATCH(self, func, types, args, kwargs)
                if output is NotImplemented:  # a subclass's op (DTensor's): its own ops unseen
                    with self:
                        output = func(*args, **kwargs)
            self.record.made(func, args, kwargs, output)  # (a DTensor's to_local: unseen)
            if self.ops is not None and self.ops in seen_by:
                self.ops.observe(func, args, kwargs, output)
        finally:
            self._seen_by = seen_by
        return output

    @contextlib.contextmanager
    def _seen(self, records: tuple):
        before, self._seen_by = self._seen_by, records
        try:
            with self:
                yield
        finally:
            self._seen_by = before
