"""torch's ``FakeTensorMode`` with a cheaper dispatch cache for the planner's tensors.

Why by hand: a planned step is tens of thousands of fake ops, nearly all of them hits in
FakeTensorMode's dispatch cache, and on a 2-core machine of CI's size a hit cost about 300 µs.
Most of it is torch's cache path being general. Its key flattens a 17-field metadata record
per tensor argument, field by field. Its output is built under the ShapeEnv's guard
suppression, whether or not a size is symbolic. The planner's tensors are dense, with sizes
that are plain integers.

- Key: a tensor's key here is one tuple of what decides torch's record: dtype, sizes, strides,
  device, storage offset and bytes, requires_grad, the conjugate, negative and inference bits.
  The rest follows from these for a dense tensor: its layout, memory format, quantization and
  sparse fields.
- Output: where the cached output's sizes are plain integers, it is built without guard
  suppression, which only symbols need, and without torch's in_kernel_invocation_manager (no
  mode is active inside the fake mode's dispatch); its FakeTensor gets the attributes of one
  that torch's constructor made on the same device, instead of that constructor's checks.
- Dispatch: torch's own, without the compile guard and call counter wrapped around it.

Anything else takes torch's own code: a symbolic size, offset or storage, a sparse tensor,
another mode's tensor, an argument of a kind not listed below, an in-place or constant output.
Each key starts with a marker of its own, so it never equals a key torch made for the cache's
other users. tests/capacity/test_fake_mode.py checks both paths against torch's.

``fake_deepcopies`` makes a fake tensor's deepcopy a new tensor for the plan, without a
TorchFunctionMode.

On a torch whose private methods or metadata record differ from the ones this was written
against, ``FAST`` is False and the mode is torch's own, unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    TensorMetadata,
)

PLANNED_KEY = object()  # heads each container in a key made here: no torch-made key has it
# Argument types whose value is its own key (torch's key: the type, then the value). bool is
# an int's subclass but keyed by its own type, as torch does (True and 1 key apart).
PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
         torch.memory_format)  # fmt: skip
_KEY_PARAMETERS = ["self", "result", "args", "state", "id_hashed_objects"]
_OUTPUT_PARAMETERS = ["self", "state", "entry", "key", "func", "args"]
# torch's metadata record, all of whose fields dense_key's tuple decides
_METADATA_FIELDS = ["dtype", "shape", "stride", "device", "layout", "memory_format",
                    "storage_offset", "storage_bytes", "requires_grad", "is_quantized", "is_conj",
                    "is_neg", "is_inference", "is_sparse", "is_coalesced", "dense_dim",
                    "sparse_dim"]  # fmt: skip


def _parameters(name: str) -> list[str] | None:
    method = getattr(FakeTensorMode, name, None)
    return list(inspect.signature(method).parameters) if method else None


# The two methods this overrides and the record it keys, as torch 2.11 and 2.13 define them
FAST = (
    _parameters("_prep_args_for_hash") == _KEY_PARAMETERS
    and _parameters("_get_output_tensor_from_cache_entry") == _OUTPUT_PARAMETERS
    and [field.name for field in dataclasses.fields(TensorMetadata)] == _METADATA_FIELDS
)


def dense_key(tensor: torch.Tensor) -> tuple | None:
    """What torch's cache key records of a dense fake tensor, or None where a size, its offset
    or its storage's bytes is a symbol (a view of a tensor of data-dependent size)."""
    if tensor.layout is not torch.strided or tensor._has_symbolic_sizes_strides:
        return None
    offset, storage_bytes = tensor.storage_offset(), tensor.untyped_storage().nbytes()
    if type(offset) is not int or type(storage_bytes) is not int:
        return None
    return (
        tensor.dtype, tensor.shape, tensor.stride(), tensor.device, offset, storage_bytes,
        tensor.requires_grad, tensor.is_conj(), tensor.is_neg(), tensor.is_inference(),
    )  # fmt: skip


def _plain_ints(values) -> bool:
    return all(type(value) is int for value in values)


def _plain_entry(entry, func) -> bool:
    """Whether a cache hit's output of ``func`` from ``entry`` is made here: a new dense tensor
    (or a view) of plain-integer sizes, strides and offset; in-place outputs, constants and
    symbolic metadata are left to torch's code."""
    metadata = entry.metadata
    return (
        entry.inplace_idx is None
        and metadata is not None
        and isinstance(func, torch._ops.OpOverload)
        and metadata.layout is torch.strided
        and type(metadata.storage_offset) is int
        and _plain_ints(metadata.shape)
        and _plain_ints(metadata.stride)
    )


# The wrappers torch puts around FakeTensorMode's dispatch: a guard against compiling into it
# and a call counter (each a Python call or more an op; a planned step compiles nothing and
# reads no counts)
TORCH_WRAPPERS = (os.path.join("torch", "_compile.py"), os.path.join("torch", "utils", "_stats.py"))


def _undecorated(function):
    """``function`` without the wrappers of TORCH_WRAPPERS, or None where another wraps it."""
    while hasattr(function, "__wrapped__"):
        code = getattr(function, "__code__", None)
        if code is None or not code.co_filename.endswith(TORCH_WRAPPERS):
            return None
        function = function.__wrapped__
    return function


TORCH_DISPATCH = _undecorated(FakeTensorMode.__dict__["__torch_dispatch__"])
# The global names FakeTensorMode.dispatch reads, as torch 2.13 writes it: ``PlannedFakeMode``'s
# own is that method without its debug log's set-up where the log is off
_DISPATCH_NAMES = ("no_dispatch", "log", "debug", "_DISPATCH_META_HANDLERS", "getEffectiveLevel",
                   "logging", "DEBUG", "RECURSION_COUNT", "IncrementRecursionCount",
                   "_DISPATCH_HANDLE_DIRECTLY", "in_kernel_invocation_manager", "cache_enabled",
                   "_cached_dispatch_impl", "_dispatch_impl")  # fmt: skip
LEAN_DISPATCH = FakeTensorMode.dispatch.__code__.co_names == _DISPATCH_NAMES


class PlannedFakeMode(FakeTensorMode):
    """FakeTensorMode whose cache hits on dense, static tensors cost less (module docstring)."""

    if FAST:

        def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
            if isinstance(args, (list, tuple, dict)):
                result.append((PLANNED_KEY, type(args), len(args)))
            if isinstance(args, dict):
                self._prep_args_for_hash(result, tuple(args.keys()), state, id_hashed_objects)
                self._prep_args_for_hash(result, tuple(args.values()), state, id_hashed_objects)
                return
            torch_key = super()._prep_args_for_hash
            for arg in args:
                if isinstance(arg, FakeTensor):
                    key = dense_key(arg) if arg.fake_mode is self and arg.constant is None else None
                    if key is not None:
                        result.append(key)
                    else:  # torch keys it, or says why it cannot be cached
                        torch_key(result, (arg,), state, id_hashed_objects)
                elif type(arg) in PLAIN:
                    result.append(type(arg))
                    result.append(arg)
                elif type(arg) in (list, tuple):  # a subclass (torch.Size): torch's code
                    self._prep_args_for_hash(result, arg, state, id_hashed_objects)
                else:
                    torch_key(result, (arg,), state, id_hashed_objects)

        if TORCH_DISPATCH is not None:  # torch's dispatch itself, without its wrappers
            __torch_dispatch__ = TORCH_DISPATCH

            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                return False  # TorchDispatchMode would wrap the dispatch above again

        if LEAN_DISPATCH:

            def dispatch(self, func, types, args=(), kwargs=None):
                """torch's, less what its debug log costs each op while the log is off: a
                no_dispatch guard around a log call and a walk up the loggers (about 7% of a
                fake op on a 2-core CPU)."""
                kwargs = kwargs or {}
                if fake_tensor.log.isEnabledFor(logging.DEBUG):
                    return super().dispatch(func, types, args, kwargs)
                handler = fake_tensor._DISPATCH_META_HANDLERS.get(func)
                if handler is not None:
                    return handler(args)
                if func in fake_tensor._DISPATCH_HANDLE_DIRECTLY:
                    with fake_tensor.in_kernel_invocation_manager(self):
                        return func(*args, **kwargs)
                if self.cache_enabled:
                    return self._cached_dispatch_impl(func, types, args, kwargs)
                return self._dispatch_impl(func, types, args, kwargs)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # id(cache entry) -> (the entry, kept so that its id is not reused; _plain_entry)
            self._plain_entries: dict[int, tuple[object, bool]] = {}
            # device -> the attributes a fake tensor made here has (None: torch's constructor)
            self._fake_fields: dict[torch.device, dict] | None = {}

        def _fake_tensor(self, meta: torch.Tensor, device: torch.device) -> FakeTensor:
            """``FakeTensor(self, meta, device)``, its attributes copied from one torch's own
            constructor made on this device: that constructor checks and normalizes each
            argument (14 µs a tensor against 3 to 4 µs here). Where the copy would differ from
            torch's tensor (another torch, a debug trace), torch's constructor makes every one."""
            fields = self._fake_fields.get(device) if self._fake_fields is not None else None
            if fields is None:
                made = FakeTensor(self, meta, device)
                if self._fake_fields is not None:
                    fields = self._fields_copied_from(made, meta)
                    if fields is None:
                        self._fake_fields = None
                    else:
                        self._fake_fields[device] = fields
                return made
            return self._subclassed(meta, device, fields)

        def _subclassed(self, meta, device, fields) -> FakeTensor:
            tensor = torch.Tensor._make_subclass(
                FakeTensor, meta, meta.requires_grad, dispatch_device=True,
                device_for_backend_keys=device,
            )  # fmt: skip
            if self._allow_unsafe_data_ptr_access:
                torch._C._set_warn_deprecated_on_mutable_data_ptr(tensor)
            else:
                torch._C._set_throw_on_mutable_data_ptr(tensor)
            tensor.__dict__.update(fields)
            return tensor

        def _fields_copied_from(self, made: FakeTensor, meta: torch.Tensor) -> dict | None:
            """``made``'s attributes, where a tensor ``_subclassed`` gives them equals it and
            each is this mode, its device or None; else None."""
            fields = dict(vars(made))
            device = made.fake_device
            if not all(
                value is None or value is self or (type(value) is torch.device and value == device)
                for value in fields.values()
            ):
                return None
            try:
                twin = self._subclassed(meta, device, fields)
            except (TypeError, RuntimeError, AttributeError):
                return None
            same = type(twin) is FakeTensor and twin.device == made.device
            return fields if same and vars(twin) == vars(made) else None

        def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
            kept = self._plain_entries.get(id(entry))
            if kept is None:  # decided once an entry: the entry holds one op's output
                kept = self._plain_entries[id(entry)] = (entry, _plain_entry(entry, func))
            # a view shares its input's storage, as torch's does; one of symbolic bytes needs
            # torch's guards
            storage = args[entry.view_idx].untyped_storage() if kept[1] and func.is_view else None
            if not kept[1] or (storage is not None and type(storage.nbytes()) is not int):
                return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
            metadata = entry.metadata
            # Made outside torch's in_kernel_invocation_manager, whose entry and exit cost twice
            # the empty tensor: inside the fake mode's dispatch no dispatch mode is active, and
            # neither op has a fake argument for the meta dispatch it sets up to see
            empty = torch.empty_strided(
                metadata.shape, metadata.stride, dtype=metadata.dtype, device="meta",
                requires_grad=metadata.requires_grad,
            )  # fmt: skip
            if metadata.is_conj:
                torch._C._set_conj(empty, True)
            if metadata.is_neg:
                torch._C._set_neg(empty, True)
            if storage is not None:
                empty.set_(storage, metadata.storage_offset, metadata.shape, metadata.stride)
            return self._fake_tensor(empty, metadata.device)


@contextlib.contextmanager
def fake_deepcopies():
    """While inside, ``copy.deepcopy`` of a fake tensor makes a new one, as a real deepcopy
    allocates: Opacus' ghost clipping deepcopies each chunk's gradient into its running sum,
    which must be counted. torch's own deepcopy gets there only by reading the fake tensor's
    data pointer (deprecated for fake tensors). Set on FakeTensor's class, not by torch's
    FakeCopyMode: a TorchFunctionMode sees every torch call and every tensor attribute read of
    the step, and Opacus' DPOptimizer reads each parameter's ``requires_grad`` once per
    parameter per parameter (325 squared reads a step of the 1b model), a fifth of a dpsgd
    prediction's time through such a mode."""
    before = FakeTensor.__dict__.get("__deepcopy__")

    def deepcopy(tensor, memo):
        if id(tensor) not in memo:
            copied = tensor.detach().clone()
            memo[id(tensor)] = copied.requires_grad_(tensor.requires_grad)
        return memo[id(tensor)]

    FakeTensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        if before is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = before
