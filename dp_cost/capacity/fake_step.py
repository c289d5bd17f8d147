"""A config's training step run on fake tensors, every storage it allocates recorded: the
peak memory of the step, without a GPU.

torch's ``FakeTensorMode`` (``capacity.fake_mode``'s subclass: cheaper cache hits) gives every
tensor its shape, dtype and storage but no data and no memory, so the config's own step (the
same model, trainer and chunking the measuring modes run) runs for a Llama-3.1-8B on a
laptop's CPU. Every storage is recorded as it is allocated and released, inside the fake mode's
own dispatch (``capacity.storage_record``); the peak,
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
import warnings

import torch
import torch.optim.optimizer as optimizer_module
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dp_cost.capacity.allocator import request_bytes
from dp_cost.capacity.attention import CudaAttention, real_masks
from dp_cost.capacity.fake_mode import fake_deepcopies
from dp_cost.capacity.fused_norm import fused_rms_norm
from dp_cost.capacity.op_list import OpRecord
from dp_cost.capacity.planned_ranks import planned_ranks
from dp_cost.capacity.storage_record import (
    DEVICE,
    RecordingFakeMode,
    StorageRecord,
    storage_key,
)
from dp_cost.hf import models as hf_models
from dp_cost.hf.configs import HF_CONFIGS
from dp_cost.lm import model as models
from dp_cost.measure.breakdown import (
    attribute_peak,
    held_tensors,
    peaks_by_phase,
    tensor_identities,
)
from dp_cost.measure.workload import builds_shards_only
from dp_cost.parallel.ranks import share


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
    record = StorageRecord()  # recorded inside the fake mode's dispatch, not as a mode of its own
    fake = RecordingFakeMode(record, shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    model, loss_fn = meta_model(config)  # outside the fake mode: peft cannot build under one
    ranks = planned_ranks(config.world_size, DEVICE)
    cuda = CudaAttention()
    with ranks, fake, fake_deepcopies(), _as_on_cuda(config, cuda), _quiet_fake_warnings():
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
        with runner.observing_phases(on_phase), fake.recording_ops(ops):
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
