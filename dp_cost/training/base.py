"""The machinery every trainer shares: its optimizer, autocast, physical chunks, phase events,
where its state lives, and its step (eager chunks or a replayed CUDA graph). The trainers
themselves are the other modules of this package; ``trainers.py`` at the top level is their
registry."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dp_cost.core.schema import AllocationSite
from dp_cost.parallel.mode import SingleProcess
from dp_cost.stepping import graph
from dp_cost.training.clipping import ClippedCounts, clipping_refusal, layer_max_grad_norm

OPTIMIZERS = ("sgd", "adam")


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy, [B, T] (targets already aligned with the logits)."""
    batch, seq, vocab = logits.shape
    return F.cross_entropy(
        logits.reshape(batch * seq, vocab).float(), targets.reshape(-1), reduction="none"
    ).view(batch, seq)


class Trainer:
    """Runs one logical batch per ``step``: forward, backward, (clip, noise,) optimizer step.

    ``on_phase(name)`` is called at the phase points (``optimizer_created``, ``privacy_wrapped``,
    per chunk ``forward_done``/``backward_done``, per step ``step_done``), where the measurement
    snapshots memory; ``_`` names are markers: state the breakdown sees by identity (A, G)."""

    name = "base"  # its registry name
    is_private = False
    options: tuple[str, ...] = ()  # experiment settings this trainer takes as keyword arguments
    supports_activation_checkpointing = False  # trainers.REHOOKED says why not, for most
    distributed_refusals: dict[str, str] = {}  # modes it cannot run, why (recorded "skipped")
    fsdp_units = "blocks"  # FSDP2 units: parallel.fsdp.FSDP_UNITS
    logical_sync_refusal: str | None = None  # why it cannot hold FSDP2's sync to the last chunk
    per_layer_refusal: str | None = None  # why it cannot clip per layer (--clipping per_layer)
    capturable = False  # its chunk and optimizer steps make no host sync: a graph captures them
    noise_generator: torch.Generator | None = None  # its own noise generator (a capture tracks it)

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        max_physical_batch_size: int | None = None,
        lr: float,
        optimizer: str = "sgd",
        dtype: torch.dtype = torch.float32,
        max_grad_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        on_phase: Callable[[str], None] | None = None,
        distributed_mode: SingleProcess | None = None,
        cuda_graph: bool = False,
        fsdp_sync: str = "chunk",
        clipping: str = "flat",
    ):
        if batch_size <= 0 or (max_physical_batch_size or 1) <= 0:
            raise ValueError(f"batch sizes must be > 0 ({batch_size}, {max_physical_batch_size})")
        if noise_multiplier < 0 or max_grad_norm <= 0:
            raise ValueError("noise_multiplier must be >= 0 and max_grad_norm > 0")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if reason := clipping_refusal(clipping):
            raise ValueError(reason)
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.model, self.lr, self.batch_size = model, lr, batch_size
        self.max_grad_norm, self.noise_multiplier = max_grad_norm, noise_multiplier
        self.max_physical_batch_size, self.dtype = max_physical_batch_size or batch_size, dtype
        # Per-sample loss of a chunk, [n]: the mean of each sample's token losses by default.
        self.per_sample_loss = loss_fn or (lambda m, x, y: token_losses(m(x), y).mean(dim=1))
        self.on_phase = on_phase or (lambda name: None)
        self.steps_taken = 0
        # One process, DDP or FSDP2: what differs between them is the mode object's.
        self.distributed_mode = distributed_mode or SingleProcess()
        self.world_size = self.distributed_mode.world_size
        # FSDP2: whether the gradients are reduce-scattered after every chunk or once per
        # logical batch (mode.FSDP_SYNCS; make_trainer refuses what a trainer cannot do)
        self.fsdp_sync = fsdp_sync
        self.clipping = clipping  # a DP trainer's rule (training.clipping); standard ignores it
        if self.distributed_mode.is_distributed:
            self.on_phase("distributed_wrapped")
        params = self.trainable_parameters(model)
        # Per-layer clipping: each parameter tensor's bound (an equal split of C) and the count
        # of the samples each bound clips
        self.layer_max_grad_norm = layer_max_grad_norm(max_grad_norm, max(len(params), 1))
        names = {id(p): n for n, p in model.named_parameters()}
        self.clipped_counts = ClippedCounts(
            [names.get(id(p), "") for p in params], max_grad_norm, self.layer_max_grad_norm
        )
        if optimizer == "sgd":  # plain: no momentum, no weight decay
            self.optimizer = torch.optim.SGD(params, lr=lr)
        else:  # torch defaults; a captured step keeps Adam's step count on the device
            self.optimizer = torch.optim.Adam(params, lr=lr, capturable=cuda_graph)
        self.base_optimizer = self.optimizer  # holds the optimizer states
        self.on_phase("optimizer_created")
        self.graphs = graph.Replayer(cuda_graph)  # the step as CUDA graphs, if asked

    @contextlib.contextmanager
    def observing_phases(self, callback: Callable[[str], None]):
        """Phase events to ``callback`` for one measurement, then back to the regular observer."""
        saved, self.on_phase = self.on_phase, callback
        try:
            yield
        finally:
            self.on_phase = saved

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    # ------------------------------------------------------------ where the state lives
    def state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """Every tensor this trainer holds now, as (role, owner, tensor): ``role`` one of
        ``core.schema.ROLES``, ``owner`` its parameter's or module's qualified name. Most specific
        role first (a storage reachable several ways takes the first). Memory attribution and
        the module census read this, nothing else."""
        named = list(self.model.named_parameters())
        states = self.base_optimizer.state
        return [
            *self.dp_state_tensors(),
            *(("gradients", n, p.grad) for n, p in named if p.grad is not None),
            *(
                ("optimizer_states", n, t)
                for n, p in named
                for t in states.get(p, {}).values()
                if isinstance(t, torch.Tensor)
            ),
            *(("model_parameters", n, p) for n, p in named),
        ]

    def dp_state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """What the DP machinery adds (per-sample gradients, norms, saved inputs): none here."""
        return []

    def allocation_sites(self) -> list[AllocationSite]:
        """Which functions' allocations have which role, most specific first; a block that no
        identity names is classified by the first site on its allocating stack."""
        model_code = {type(m).forward for m in self.model.modules()}
        return [
            *self.dp_allocation_sites(),
            AllocationSite.of("gradients", Trainer.optimizer_step),
            AllocationSite("optimizer_states", package="torch.optim"),
            # Allocated by a module's forward (or the loss): activations kept for backward.
            AllocationSite("activations", package="torch.nn"),
            AllocationSite("activations", package="transformers"),
            AllocationSite("activations", package="peft"),
            AllocationSite.of("activations", *model_code),
        ]

    def dp_allocation_sites(self) -> list[AllocationSite]:
        return []

    def result_extras(self) -> dict:
        """Result keys of this trainer's own (e.g. flash's route per layer)."""
        return {}

    def autocast(self, device_type: str):
        if self.dtype == torch.bfloat16:
            return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def chunks(self, batch: int, largest: int | None = None) -> list[torch.Tensor]:
        """Index sets of the physical chunks, near-equal as BatchMemoryManager makes them.
        ``largest``: the largest batch of any rank: every rank runs as many chunks (FSDP
        all-gathers in each chunk's forward; a rank with fewer samples may get an empty one)."""
        num_chunks = math.ceil((largest or batch) / self.max_physical_batch_size)
        return list(torch.arange(batch).tensor_split(num_chunks))

    def prepare_padded_chunks(self) -> None:
        """The per-step decisions ``chunks`` takes, for a step of padded chunks of a fixed size
        (stepping.chunks.padded_step, CUDA graphs): any number of them, so none that needs one."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """One logical batch (stepping.chunks), or its CUDA graph replayed (stepping.graph)."""
        self.steps_taken += 1
        return self.graphs.step(self, inputs, targets)

    def captures_after_this(self) -> bool:  # may a capture follow this (eager) step?
        return True

    def discard_step_state(self) -> None:
        """Forget what a step that did not finish left behind (a failed capture)."""
        self.optimizer.zero_grad(set_to_none=True)

    def chunk_step(self, inputs, targets, is_last: bool) -> torch.Tensor:
        """Forward and backward of one physical chunk; returns the sum of its per-sample losses
        (a 0-dim tensor on the device: no host sync)."""
        raise NotImplementedError

    def empty_batch_gradients(self) -> None:
        """Gradients of a batch with no samples, as ``optimizer_step`` expects them: none here
        (the optimizer skips parameters without a gradient)."""

    def optimizer_step(self):
        self.optimizer.step()

    def clip_factors(self, per_sample_norms: torch.Tensor) -> torch.Tensor:
        """min(1, C / (norm + 1e-6)) of each sample ([B], flat), or of each parameter's norm
        against its C_l ([P, B], per-layer: Opacus' formula with C_l)."""
        bound = self.max_grad_norm if per_sample_norms.dim() == 1 else self.layer_max_grad_norm
        return (bound / (per_sample_norms + 1e-6)).clamp(max=1.0)

    def noise_sampler(self) -> str | None:
        """The sampler of its Gaussian noise (hf.privacy.NOISE_SAMPLERS; None: no noise)."""
        return None

    def sensitivity_margin(self) -> float:
        """How far above C, relative to C, one sample's clipped contribution may reach (its
        norms' rounding): the accountant takes the sensitivity as (1 + margin) C. 0: exact."""
        return 0.0

    def noised_dimension(self) -> int:
        """How many coordinates get noise: every trainable parameter's (whole, not a shard)."""
        return sum(p.numel() for group in self.base_optimizer.param_groups for p in group["params"])

    def clipping_record(self) -> dict | None:
        """The result's ``clipping``: the rule and its bounds, and per-layer how often each
        parameter's bound clipped (None: this trainer does not clip)."""
        if not self.is_private:
            return None
        if self.clipping == "per_layer":
            return self.clipped_counts.record()
        return {"rule": "flat", "max_grad_norm": self.max_grad_norm}
