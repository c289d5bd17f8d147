"""A config's training step run on fake tensors, every storage it allocates recorded: the
peak memory of the step, without a GPU.

torch's ``FakeTensorMode`` (``capacity.fake_mode``'s subclass: cheaper cache hits) gives every
tensor its shape, dtype and storage but no data and no memory, so the config's own step (the
same model, trainer and chunking the measuring modes run) runs for a Llama-3.1-8B on a
laptop's CPU. A dispatch mode records every storage as it is allocated and released; the peak,
and its split into the breakdown's roles, come from the same attribution the CUDA breakdown
uses (``measure.breakdown.attribute_peak``: the trainer's tensors by identity, the rest by the
functions that allocated them). So each trainer's DP state
(Opacus' per-sample gradients and ghost clipping's second backward, flash's kept A and G and its
route per layer) is what that trainer's code allocates, never a formula beside it.

Several ranks are planned in this one process, without torchrun: rank 0 (the largest share of
a batch) of a fake process group of ``--world_size`` ranks (``capacity.planned_ranks``: every
collective returns at once, as if the others had sent what it receives). FSDP2 shards, gathers
and reduce-scatters as on W GPUs; Opacus' DPDDP hooks and flash's own buckets run their code on
this rank's share; torch's DDP, which fake tensors cannot build, is planned_ranks' stand-in.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it hooks every parameter's
gradient, which fails on parameters that do not require a gradient (flash's managed layers,
LoRA's frozen base weights); a storage-level record is all the peak needs. Each storage is
counted as the allocator rounds it (``capacity.allocator.request_bytes``); its segments and
pools are ``capacity.allocator``'s, the rest of the CUDA side (context, NCCL; the cuBLAS
workspaces' size, requested here at the first GEMM of each thread) ``capacity.card``'s.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref

import torch
import torch.optim.optimizer as optimizer_module
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_leaves

from dp_cost.capacity.allocator import request_bytes
from dp_cost.capacity.attention import CudaAttention, real_masks
from dp_cost.capacity.card import GPU_OVERHEADS
from dp_cost.capacity.fake_mode import PlannedFakeMode, fake_deepcopies
from dp_cost.capacity.fused_norm import fused_rms_norm
from dp_cost.capacity.kernel_scratch import scratch_requests
from dp_cost.capacity.op_list import GEMMS, OpRecord, StepMode, fake_device
from dp_cost.capacity.planned_ranks import planned_ranks
from dp_cost.hf import models as hf_models
from dp_cost.hf.configs import HF_CONFIGS
from dp_cost.lm import model as models
from dp_cost.measure.breakdown import (
    MARKER_FUNCTION,
    attribute_peak,
    held_tensors,
    peaks_by_phase,
    tensor_identities,
)
from dp_cost.measure.workload import builds_shards_only
from dp_cost.parallel.ranks import share

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
        record, resize = self, self._storage_resize

        def resize_(storage, nbytes):
            result = resize(storage, nbytes)
            if storage._cdata in record.live:
                record._resized(storage._cdata, nbytes)
            return result

        self._depth += 1  # entered again inside its own dispatch (AS_COMPOSED): patched once
        if self._depth == 1:
            torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            torch.UntypedStorage.resize_ = self._storage_resize
        return super().__exit__(*exc)

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
        distinct = ALL_DISTINCT.get(func)
        # How many distinct values torch.unique finds depends on the data, which fake tensors
        # lack: plan for every one distinct, the most memory (random tokens come close).
        output = distinct(*args, **kwargs) if distinct else func(*args, **kwargs)
        before, after = scratch_requests(func, args, kwargs)
        scratch = self._take(before)
        for tensor in tree_leaves(output):
            if isinstance(tensor, DTensor):  # FSDP2: its shard, made by ops this mode skips
                tensor = tensor.to_local()
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)
        self._give_back(scratch + self._take(after))
        if func in GEMMS:
            self._cublas_workspace()
        return output

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


def meta_model(config) -> tuple[torch.nn.Module, object]:
    """(model, per-sample loss or None) of ``config`` on the meta device: the model the
    measuring modes build, with no storage at all (``fake_workload`` gives it fake ones)."""
    if config.model in HF_CONFIGS:
        model, _ = hf_models.build_hf_model(
            config.model,
            device="meta",
            use_lora=config.use_lora,
            lora_rank=config.lora_rank,
            attention="explicit" if config.attention == "explicit" else "sdpa",
            activation_checkpointing=config.activation_checkpointing,
        )
        return model, hf_models.sequence_classification_loss
    model = models.build_model(
        config.model,
        device="meta",
        attention=config.attention,
        activation_checkpointing=config.activation_checkpointing,
        **config.model_overrides,
    )
    return model, None


def rank_share(config) -> int:
    """Samples of the logical batch rank 0 takes (all of them in one process): the most."""
    return len(share(config.batch_size, 0, config.world_size))


def fake_batch(config, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch of ``samples`` samples (of this rank), inside a fake mode."""
    inputs = torch.zeros(samples, config.seq_len, dtype=torch.long)
    if config.model in HF_CONFIGS:
        return inputs, torch.zeros(samples, dtype=torch.long)
    return inputs, inputs.clone()


def predict(config, build_trainer, record_ops: bool = False) -> dict:
    """The predicted peak of one timed step of ``config`` (one process) and its split by role.
    ``build_trainer(config, model, loss_fn, on_phase)``: the worker's trainer construction. A
    warm-up step (the same step) runs first, as in the measuring modes. Returns bytes: ``peak``
    (``phase_peaks``: within each phase), ``roles`` (breakdown key -> bytes), ``parameters``,
    ``trainable_parameters``, ``state`` (role -> bytes held after the step), flash's routes, the
    allocator's requests (``requests``: model and trainer built, ``step_requests``: warm-up and
    recorded step; ``allocator.replay``); with ``record_ops`` the recorded step's ``ops`` and
    ``marks`` (``op_list``; else None). Distributed: rank 0's, the largest share of a batch, in
    a fake process group of the config's ranks (planned_ranks)."""
    # shape_env: .item() gives a symbol, not an error; non-fake inputs: the meta model's
    fake = PlannedFakeMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    record = StorageRecord()
    model, loss_fn = meta_model(config)  # outside the fake mode: peft cannot build under one
    ranks = planned_ranks(config.world_size, DEVICE)
    cuda = CudaAttention()
    with ranks, fake, fake_deepcopies(), record, _as_on_cuda(config, cuda), _quiet_fake_warnings():
        runner = _built(config, model, loss_fn, build_trainer)
        mine = rank_share(config)
        physical = min(config.physical_batch_size, mine)
        # Three chunks at most: the first (no gradient yet), the second (the first's summed in)
        # and the third (Opacus' running sum beside the chunk's gradient): every later chunk
        # holds what the third does, so a batch of 3P has the peak of any larger one.
        samples = min(mine, 3 * physical)
        # The warm-up is that step too, as a measuring run's is a whole step (one chunk left the
        # allocator other blocks: the 1b standard step under DDP in chunks of 4 2.5% under)
        warmup_event = len(record.events)
        runner.step(*fake_batch(config, samples))
        inputs, targets, start = *fake_batch(config, samples), record.held()
        identities = [tensor_identities(runner, "cpu", key=storage_key)]
        first_event = len(record.events)
        ops = OpRecord() if record_ops else None  # for the step's time (capacity.step_time)

        def on_phase(name):
            identities.append(tensor_identities(runner, "cpu", key=storage_key))
            record.marker()
            if ops is not None:
                ops.mark(name)

        cuda.backends.clear()  # the recorded step's calls, not the warm-up's
        with runner.observing_phases(on_phase), ops or contextlib.nullcontext():
            runner.step(inputs, targets)
        events = record.events[first_event:]
        attributed = attribute_peak(events, start, identities, runner.trainer.memory().sites)
        state, extras = _state_bytes(runner), runner.trainer.result_extras()
        parameters = sum(p.numel() for p in model.parameters())  # a DTensor's: the whole's
        trainable = sum(p.numel() for p in runner.trainer.parameters)
    return {
        "peak": attributed["peak_bytes"],
        "phase_peaks": peaks_by_phase(events, start),
        "requests": allocator_requests(record.events[:warmup_event]),
        "step_requests": allocator_requests(record.events[warmup_event:]),
        "roles": attributed["breakdown_bytes"],
        "parameters": parameters,
        "trainable_parameters": trainable,
        "state": state,
        "attention_backends": dict(cuda.backends),
        **({"ops": ops.ops, "marks": ops.marks} if ops else {"ops": None, "marks": None}),
        **({"flash_routes": extras["flash_routes"]} if "flash_routes" in extras else {}),
    }


def _built(config, model, loss_fn, build_trainer):
    """The config's runner, as the worker builds it: FSDP2 over a model of random weights shards
    it before any storage exists (Workload.materialize), every other model is made whole first."""
    materialize = _fake_empty
    if not builds_shards_only(config):
        model, materialize = _fake_empty(model), None
    return build_trainer(config, model, loss_fn, lambda name: None, materialize)


def _fake_empty(model: torch.nn.Module) -> torch.nn.Module:
    """``model.to_empty(device=DEVICE)`` under the fake mode, a contiguous meta tensor's twin
    made from its sizes and strides alone: torch's empty_like first converts each meta tensor
    into a fake one of its own (0.34 s against 0.095 s for the 1b model). An FSDP2 shard (a
    DTensor) takes empty_like, as to_empty gives it."""

    def empty(tensor):
        if type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_contiguous():
            return torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=DEVICE
            )
        return torch.empty_like(tensor, device=DEVICE)

    return model._apply(empty)


@contextlib.contextmanager
def _as_on_cuda(config, kernels: CudaAttention):
    """What the planned step does as the card would, not as the CPU would: a Hugging Face
    model's mask as an eager run builds it, attention's kernel as CUDA chooses it (``kernels``
    counts the choices), RMSNorm as CUDA's fused kernel, torch.optim's foreach path. Each is
    undone on the way out, however it ends (they patch torch's and transformers' module
    globals: one prediction at a time)."""
    with (
        real_masks(config.model in HF_CONFIGS, graphed=config.cuda_graph),
        kernels,
        fused_rms_norm(),
        _foreach_as_on_cuda(),
    ):
        yield


def allocator_requests(events) -> list[tuple[int, int, int]]:
    """The record's events as ``capacity.allocator.replay`` reads them: (storage key, bytes,
    stream), bytes <= 0 for a free; phase markers left out."""
    return [(event["addr"], event["size"], event.get("stream", 0)) if event["action"] == "alloc"
            else (event["addr"], -event["size"], 0)
            for event in events if event["size"]]  # fmt: skip


def _state_bytes(runner) -> dict[str, int]:
    """Bytes of what the runner's trainer holds after a step, by role, each storage once."""
    seen: set[int] = set()
    sizes: dict[str, int] = {}
    for role, tensor in held_tensors(runner):
        if storage_key(tensor) in seen:
            continue
        seen.add(storage_key(tensor))
        sizes[role] = sizes.get(role, 0) + request_bytes(tensor.untyped_storage().nbytes())
    return sizes


@contextlib.contextmanager
def _foreach_as_on_cuda():
    """torch.optim's foreach path, which it takes by default for CUDA tensors and not for CPU
    ones: its temporaries span every parameter at once (Adam's square roots of its second
    moments are one more fp32 copy of the parameters at the step; the loop over parameters
    holds one parameter's)."""
    supported = optimizer_module._get_foreach_kernels_supported_devices
    optimizer_module._get_foreach_kernels_supported_devices = lambda: [*supported(), DEVICE]
    optimizer_module._foreach_supported_types.append(FakeTensor)
    try:
        yield
    finally:
        optimizer_module._get_foreach_kernels_supported_devices = supported
        optimizer_module._foreach_supported_types.remove(FakeTensor)


@contextlib.contextmanager
def _quiet_fake_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
        yield
