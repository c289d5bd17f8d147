"""Peak memory of a config's training step, predicted without a GPU, and the largest physical
batch that fits a card.

The prediction runs the config's own trainer step (the same model, trainer and chunking the
measuring modes run) on fake tensors: torch's ``FakeTensorMode`` gives every tensor its shape,
dtype and storage but no data and no memory, so a Llama-3.1-8B step runs on a laptop's CPU (in
under a minute). A dispatch mode records every storage as it is allocated and released; the
peak, and its split into the breakdown's roles, come from the same attribution the CUDA
breakdown uses (``measure.breakdown.attribute_peak``: the trainer's tensors by identity, the
rest by the functions that allocated them). So each trainer's DP state (Opacus' per-sample
gradients and ghost clipping's second backward, flash's kept A and G and its route per layer)
is what that trainer's code allocates, never a formula beside it.

Several ranks are planned in this one process, without torchrun: rank 0 (the largest share of
a batch) of a fake process group of ``--world_size`` ranks (torch's ``FakeProcessGroup``: every
collective returns at once, as if the others had sent what it receives). FSDP2 shards, gathers
and reduce-scatters as on W GPUs; DDP's buckets, Opacus' DPDDP hooks and flash's own buckets
run their code on this rank's share.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it hooks every parameter's
gradient, which fails on parameters that do not require a gradient (flash's managed layers,
LoRA's frozen base weights); a storage-level record is all the peak needs.

What the fake step does not see is the CUDA side: the allocator rounds each block up to 512
bytes (applied here), the cuBLAS workspaces, the CUDA context and the share of the card the
caching allocator's fragmentation leaves unused (``GPU_OVERHEADS``: measured, with the card and
the scripts that measured them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings
import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    FakeCopyMode,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

import models
from dp_cost.core.schema import MB
from dp_cost.hf import models as hf_models
from dp_cost.hf.configs import HF_CONFIGS
from dp_cost.measure.breakdown import MARKER_FUNCTION, attribute_peak, tensor_identities
from dp_cost.measure.plan import draw_above_probability
from dp_cost.parallel.ranks import share

BLOCK_BYTES = 512  # the CUDA caching allocator's block size: every allocation is a multiple
GIB = 2**30
DEVICE = "cpu"  # the fake tensors' device: CPU code paths (torch's, no Triton), CUDA's memory


def allocator_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for a request of ``nbytes`` (>= one block)."""
    return max(BLOCK_BYTES, -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES)


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


class FakeCopies(FakeCopyMode):
    """torch's FakeCopyMode (copy.deepcopy under a fake mode makes fake tensors), except that a
    fake tensor's deepcopy is a new fake tensor, as a real deepcopy allocates: torch's returns
    the tensor itself, and Opacus' ghost clipping deepcopies each chunk's gradient into its
    running sum, which would then go uncounted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__deepcopy__ and isinstance(args[0], FakeTensor):
            tensor, memo = args
            if id(tensor) not in memo:
                copied = tensor.detach().clone()
                memo[id(tensor)] = copied.requires_grad_(tensor.requires_grad)
            return memo[id(tensor)]
        return super().__torch_function__(func, types, args, kwargs)


class StorageRecord(TorchDispatchMode):
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

    def __enter__(self):
        record, resize = self, self._storage_resize

        def resize_(storage, nbytes):
            result = resize(storage, nbytes)
            if storage._cdata in record.live:
                record._resized(storage._cdata, nbytes)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._storage_resize
        return super().__exit__(*exc)

    def held(self) -> dict[int, int]:
        """key -> bytes of the storages that hold memory now."""
        return {key: size for key, size in self.live.items() if size}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        distinct = ALL_DISTINCT.get(func)
        # How many distinct values torch.unique finds depends on the data, which fake tensors
        # lack: plan for every one distinct, the most memory (random tokens come close).
        output = distinct(*args, **kwargs) if distinct else func(*args, **kwargs)
        for tensor in tree_leaves(output):
            if isinstance(tensor, DTensor):  # FSDP2: its shard, made by ops this mode skips
                tensor = tensor.to_local()
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)
        return output

    def add_existing(self, tensors) -> None:
        """Storages made before the record began (parameters built under another mode)."""
        for tensor in tensors:
            self._add(tensor, frames=[])

    def _add(self, tensor: torch.Tensor, frames: list[dict] | None = None) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        size = allocator_bytes(storage.nbytes())
        self.live[key] = size
        event = {"action": "alloc", "addr": key, "size": size}
        event["frames"] = _python_frames() if frames is None else frames
        self.events.append(event)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        size = self.live.pop(key, None)
        if size:
            self.events.append({"action": "free_completed", "addr": key, "size": size})

    def _resized(self, key: int, nbytes: int) -> None:
        if self.live[key]:
            self.events.append({"action": "free_completed", "addr": key, "size": self.live[key]})
        self.live[key] = allocator_bytes(nbytes) if nbytes else 0
        if nbytes:
            self.events.append(
                {"action": "alloc", "addr": key, "size": self.live[key], "frames": _python_frames()}
            )

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
        frames.append({"filename": frame.f_code.co_filename, "name": frame.f_code.co_name})
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


def predict(config, build_trainer) -> dict:
    """The predicted peak of one timed step of ``config`` (one process) and its split by role.

    ``build_trainer(config, model, loss_fn, on_phase)``: the worker's trainer construction. A
    warm-up step runs first, as in the measuring modes: gradients and optimizer states exist
    when the recorded step begins. Returns bytes: ``peak``, ``roles`` (breakdown key -> bytes),
    ``parameters``, ``trainable_parameters``, ``state`` (role -> bytes the trainer holds after
    the step) and the flash routes, if any. Distributed: rank 0's, the rank with the largest
    share of a batch, in a fake process group of the config's ranks (``planned_ranks``)."""
    # shape_env: .item() gives a symbol, not an error; non-fake inputs: the meta model's
    fake = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    record = StorageRecord()
    model, loss_fn = meta_model(config)  # outside the fake mode: peft cannot build under one
    with planned_ranks(config.world_size), fake, FakeCopies(fake), record, _quiet_fake_warnings():
        model = model.to_empty(device=DEVICE)
        trainer = build_trainer(config, model, loss_fn, lambda name: None)
        mine = rank_share(config)
        physical = min(config.physical_batch_size, mine)
        trainer.step(*fake_batch(config, physical))
        # Three chunks at most: the first (no gradient yet), the second (the first's summed in)
        # and the third (Opacus' running sum beside the chunk's gradient): every later chunk
        # holds what the third does, so a batch of 3P has the peak of any larger one.
        inputs, targets = fake_batch(config, min(mine, 3 * physical))
        start = record.held()
        identities = [tensor_identities(trainer, "cpu", key=storage_key)]
        first_event = len(record.events)

        def on_phase(name):
            identities.append(tensor_identities(trainer, "cpu", key=storage_key))
            record.marker()

        with trainer.observing_phases(on_phase):
            trainer.step(inputs, targets)
        events = record.events[first_event:]
        attributed = attribute_peak(events, start, identities, trainer.allocation_sites())
        state = _state_bytes(trainer)
        extras = trainer.result_extras()
        parameters = sum(p.numel() for p in model.parameters())  # a DTensor's: the whole's
        groups = trainer.optimizer.param_groups
        trainable = sum(p.numel() for group in groups for p in group["params"])
    return {
        "peak": attributed["peak_bytes"],
        "roles": attributed["breakdown_bytes"],
        "parameters": parameters,
        "trainable_parameters": trainable,
        "state": state,
        **({"flash_routes": extras["flash_routes"]} if "flash_routes" in extras else {}),
    }


def _state_bytes(trainer) -> dict[str, int]:
    """Bytes of what the trainer holds after a step, by role, each storage once."""
    seen: set[int] = set()
    sizes: dict[str, int] = {}
    for role, _, tensor in trainer.state_tensors():
        if isinstance(tensor, DTensor):  # FSDP2: the shard this rank holds
            tensor = tensor.to_local()
        if not isinstance(tensor, torch.Tensor) or storage_key(tensor) in seen:
            continue
        seen.add(storage_key(tensor))
        sizes[role] = sizes.get(role, 0) + allocator_bytes(tensor.untyped_storage().nbytes())
    return sizes


@contextlib.contextmanager
def planned_ranks(world_size: int):
    """This process as rank 0 of a fake process group of ``world_size`` ranks (none for one
    rank): the trainers' collectives run and return at once, moving no data."""
    if world_size == 1:
        yield
        return
    # torch's own fake backend; importing the module registers it with torch.distributed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with _meshes_outside_fake_mode():
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _meshes_outside_fake_mode():
    """FSDP2's DeviceMesh built on real tensors, on the fake tensors' device: it finds this
    rank's place in its rank map by reading the map's values, which a fake tensor does not have
    (``init_device_mesh`` passes the identity map, ``arange`` over the ranks: a fake one is
    remade as that, for real), and FSDP2 would otherwise put the shards on the machine's GPU."""
    original = DeviceMesh.__init__

    def real(value):
        if isinstance(value, FakeTensor):
            return torch.arange(value.numel(), dtype=value.dtype).view(value.shape)
        return value

    def init(self, device_type, *args, **kwargs):
        with _disable_current_modes(), unset_fake_temporarily():
            args = [real(value) for value in args]
            kwargs = {name: real(value) for name, value in kwargs.items()}
            original(self, DEVICE, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def _quiet_fake_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
        yield


# What a CUDA process holds beside the step's own tensors, measured on an H200 with torch 2.11
# (benchmarks/README.md, "Will it fit?"): the cuBLAS workspaces a forward and a backward matmul
# allocate through the caching allocator (part of torch's peak; benchmarks/cuda_overheads.py),
# the CUDA context and libraries (outside torch's counters; the same script), and the share of
# the rest of the card a step's allocated peak reached at the largest physical batch that ran
# (--find_max_batch, 1b bf16 T=1024: 92.1% for dpsgd, the least of the four trainers, up to
# 98.2% for standard; the caching allocator's fragmentation takes the rest).
GPU_OVERHEADS = {
    "cublas_workspace_bytes": 64 * MB,  # two of 32 MiB (Hopper): forward and backward thread
    "cuda_context_bytes": 785_186_816,  # about 749 MiB
    "usable_share": 0.921,
    "measured_on": "NVIDIA H200, torch 2.11.0+cu130, 2026-11-27",
}
POISSON_QUANTILE = 1e-6  # an uncapped Poisson batch is planned at its 1 - 1e-6 quantile
MAX_PROBES = 64  # a guard: galloping and bisecting take about 2 log2(|guess - answer|)


def planned_physical_batch(config) -> tuple[int, str | None]:
    """The physical batch (per rank) a config's peak is planned at, and why when it is not the
    asked one: a Poisson-sampled batch without a physical cap runs whole, as large as it is
    drawn (each rank its share of the draw; rank 0 the largest)."""
    physical = config.physical_batch_size
    if config.model not in HF_CONFIGS or not config.poisson or config.max_physical_batch_size:
        return physical, None
    drawn = config.batch_size
    while draw_above_probability(drawn, config.batch_size, config.dataset_size) > POISSON_QUANTILE:
        drawn += 1
    mine = len(share(drawn, 0, config.world_size))
    note = (
        f"Poisson sampling without --max_physical_batch_size: planned at {drawn} samples"
        f"{f' ({mine} on rank 0)' if mine != drawn else ''}, the draw exceeded with probability "
        f"{POISSON_QUANTILE:g} at batch {config.batch_size} of {config.dataset_size}"
    )
    return mine, note


def with_physical_batch(config, physical: int):
    """``config`` at physical batch ``physical`` (per rank): one chunk of ``physical`` samples
    on each rank when that is at least a rank's share of the logical batch (which is raised to
    it), else chunks of it."""
    batch = max(config.batch_size, physical * config.world_size)
    return dataclasses.replace(config, batch_size=batch, max_physical_batch_size=physical)


def usable_peak_bytes(budget_gib: float) -> float:
    """The largest predicted peak (torch's count of the step's own tensors) that fits a card of
    ``budget_gib`` GiB: the CUDA context off the card, the share of the rest a step's peak
    reached, the cuBLAS workspaces off that."""
    room = budget_gib * GIB - GPU_OVERHEADS["cuda_context_bytes"]
    return room * GPU_OVERHEADS["usable_share"] - GPU_OVERHEADS["cublas_workspace_bytes"]


def fits(peak_bytes: int, budget_gib: float) -> bool:
    return peak_bytes <= usable_peak_bytes(budget_gib)


def largest_passing(passes, first_guess: int) -> tuple[int, list[int]]:
    """(the largest physical batch P >= 1 with ``passes(P)``, 0 if not even 1 passes; the
    batches judged, in order). ``passes`` is monotone: true up to some P, false above. From
    ``first_guess`` it gallops up or down until it brackets the answer, then bisects: about
    2 log2(|guess - answer|) + 2 judgements, 2 when the guess is right."""
    judged: list[int] = []

    def judge(physical):
        judged.append(physical)
        return passes(physical)

    guess, step = max(1, first_guess), 1
    low, high = 0, None  # low passes (0: none known to); high does not
    if judge(guess):
        low = guess
        while high is None and len(judged) < MAX_PROBES:
            if judge(low + step):
                low, step = low + step, step * 2
            else:
                high = low + step
    else:
        high = guess
        while low == 0 and high > 1 and len(judged) < MAX_PROBES:
            candidate = max(1, high - step)
            if judge(candidate):
                low = candidate
            else:
                high, step = candidate, step * 2
    while high is not None and high - low > 1 and len(judged) < MAX_PROBES:
        middle = (low + high) // 2
        low, high = (middle, high) if judge(middle) else (low, middle)
    return low, judged


def largest_physical(passes, first_guess: int, batch: int) -> tuple[int, list[int]]:
    """``largest_passing`` over a config's physical batches, in two monotone pieces: at or above
    the logical batch ``batch`` the step is one chunk; below it, chunks whose gradients add up
    (a peak above the one-chunk step's at ``batch``). A guess at or above ``batch`` searches the
    upper piece first (no extra judgement when the answer is there)."""
    judged: list[int] = []

    def judge(physical):
        judged.append(physical)
        return passes(physical)

    if first_guess >= batch or judge(batch):
        start = max(first_guess, batch) - batch + 1
        found, _ = largest_passing(lambda p: judge(batch - 1 + p), start)
        if found:
            return batch - 1 + found, judged
    found, _ = largest_passing(lambda p: p < batch and judge(p), min(first_guess, batch - 1))
    return found, judged


def probe_config(config, physical: int):
    """A --find_max_batch probe: ``config`` measured at physical batch ``physical`` (two
    steps after one warm-up, no trace, no breakdown)."""
    return dataclasses.replace(
        with_physical_batch(config, physical),
        capacity=False, validate=False, find_max_batch=False, trace=False, breakdown=False,
        steps=2, warmup_steps=1,
    )  # fmt: skip


def find_max_batch(config, prediction: dict, run_probe) -> dict:
    """--find_max_batch: the largest physical batch that runs on this card, found by runs.
    ``run_probe(probe_config, name)`` runs one probe in its own worker (an out-of-memory stays
    there) and returns its result. The search starts at the predicted largest batch for the
    card's whole memory, and records every probe."""
    card = prediction["card"]
    probes: list[dict] = []

    def runs(physical: int) -> bool:
        probed = run_probe(probe_config(config, physical), f"probe_pb{physical}.json")
        probes.append(
            {
                "physical_batch_size": physical,
                "status": probed["status"],
                "peak_memory_mb": probed.get("peak_memory_mb"),
                "error": probed.get("error"),
            }
        )
        if probed["status"] not in ("ok", "oom"):  # not a question of memory: stop here
            raise ProbeFailed(f"probe at physical batch {physical}: {probed.get('error')}")
        return probed["status"] == "ok"

    outcome = {"predicted_largest": card["physical_batch_size"], "probes": probes}
    try:
        largest, _ = largest_physical(runs, card["physical_batch_size"], rank_share(config))
    except ProbeFailed as error:
        return {**outcome, "largest_physical_batch": None, "error": str(error)}
    measured = next(
        (p["peak_memory_mb"] for p in probes if p["physical_batch_size"] == largest), None
    )
    predicted = next(
        (
            p["peak_memory_mb"]
            for p in prediction["predictions"]
            if p["physical_batch_size"] == largest
        ),
        None,
    )
    return {
        **outcome,
        "largest_physical_batch": largest,
        "measured_peak_mb": measured,
        "predicted_peak_mb": predicted,
    }


class ProbeFailed(RuntimeError):
    """A --find_max_batch probe ended in an error that is not an out-of-memory."""


def capacity_result(config, build_trainer, card_gib: float | None = None) -> dict:
    """``result["prediction"]`` of one config: its predicted peak (what torch would count for
    the step's own tensors) and roles at the planned physical batch, and for each
    ``--gpu_memory`` budget the largest physical batch that fits, with every prediction made.
    ``card_gib``: this process's card (--find_max_batch), searched as one more budget."""
    started = time.perf_counter()
    planned, note = planned_physical_batch(config)
    peaks: dict[int, dict] = {}

    def predicted(physical: int) -> dict:
        if physical not in peaks:
            peaks[physical] = predict(with_physical_batch(config, physical), build_trainer)
        return peaks[physical]

    def peak_at(physical: int) -> int:
        return predicted(physical)["peak"]

    def largest_for(budget: float) -> dict:
        # The first guess: where a straight line through two peaks of the same kind of step
        # crosses the budget. One chunk of a rank's share or more if that share fits (the
        # peak then grows by the same bytes a sample), else chunks of 1 and 2 samples.
        share = rank_share(config)
        low = share if fits(peak_at(share), budget) else 1
        slope = peak_at(low + 1) - peak_at(low)
        room = usable_peak_bytes(budget) - peak_at(low)
        guess = low + int(room // slope) if slope > 0 else planned
        batch, judged = largest_physical(lambda p: fits(peak_at(p), budget), guess, share)
        return {
            "gpu_memory_gib": budget,
            "physical_batch_size": batch,
            "predicted_peak_mb": peak_at(batch) / MB if batch else None,
            "usable_peak_mb": usable_peak_bytes(budget) / MB,
            "batch_sizes_judged": len(judged),
        }

    main = predicted(planned)
    largest = [largest_for(budget) for budget in config.gpu_memory or []]
    card = largest_for(card_gib) if card_gib else None
    return {
        "method": "the trainer's step on fake tensors (CPU code paths), storages recorded",
        "physical_batch_size": planned,
        "physical_batch_note": note,
        "peak_memory_mb": main["peak"] / MB,
        "breakdown": {key: value / MB for key, value in main["roles"].items()},
        "held_after_step_mb": {role: size / MB for role, size in main["state"].items()},
        "parameters": main["parameters"],
        "trainable_parameters": main["trainable_parameters"],
        "flash_routes": main.get("flash_routes"),
        "largest_physical_batch": largest,
        "card": card,
        "predictions": [
            {"physical_batch_size": p, "peak_memory_mb": peaks[p]["peak"] / MB}
            for p in sorted(peaks)
        ],
        "overheads": dict(GPU_OVERHEADS),
        "seconds": time.perf_counter() - started,
    }
