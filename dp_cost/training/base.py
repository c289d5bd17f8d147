"""What every trainer shares: its settings, optimizer, autocast, the per-sample loss of a chunk
(weighted where the Runner pads), where its state lives, and a DP trainer's clip factors and
privacy description. A trainer is a DP algorithm (``stepping.protocol.Trainer``); the Runner
(``stepping.runner``) runs its steps; ``registry.py`` is their registry."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dp_cost.core.schema import AllocationSite
from dp_cost.parallel.mode import SingleProcess
from dp_cost.stepping.protocol import (
    CaptureSupport,
    Chunk,
    MemoryRoles,
    PhaseEvents,
    PrivacyDescription,
    StepPlan,
)
from dp_cost.training.clipping import ClippedCounts, ClippingRule, layer_max_grad_norm

OPTIMIZERS = ("sgd", "adam")
DTYPES = (torch.float32, torch.bfloat16)

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy, [B, T] (targets already aligned with the logits)."""
    batch, seq, vocab = logits.shape
    return F.cross_entropy(
        logits.reshape(batch * seq, vocab).float(), targets.reshape(-1), reduction="none"
    ).view(batch, seq)


def mean_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
    """The default per-sample loss: the mean of each sample's token losses, [n]."""
    return token_losses(model(inputs), targets).mean(dim=1)


@dataclass(frozen=True)
class TrainerSettings:
    """A trainer's settings, each resolved once (by ``make_trainer``) to a value or object."""

    batch_size: int  # the expected (global) logical batch: the averaging divisor
    lr: float
    optimizer: str = "sgd"
    dtype: torch.dtype = torch.float32
    max_grad_norm: float = 1.0
    noise_multiplier: float = 1.0
    clipping: ClippingRule = ClippingRule.FLAT
    mode: SingleProcess = SingleProcess()
    sync_every_chunk: bool = True  # FSDP2: reduce-scatter after every chunk, else the last only
    cuda_graph: bool = False
    loss_fn: LossFn = mean_token_loss

    def __post_init__(self):
        if self.noise_multiplier < 0 or self.max_grad_norm <= 0:
            raise ValueError("noise_multiplier must be >= 0 and max_grad_norm > 0")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype}")


class Trainer:
    """The machinery a trainer's class builds on; the class's ``__init__`` makes its parameters'
    optimizer with ``make_optimizer`` once it knows them (nothing here calls an overridden
    method while the object is being built)."""

    name = "base"  # its registry name
    options: tuple[str, ...] = ()  # experiment settings it takes as keyword arguments
    supports_activation_checkpointing = False  # a trainer says so once its capture takes it
    sharded_refusal: str | None = None  # why it cannot run under FSDP2 (recorded "skipped")
    fsdp_units = "blocks"  # FSDP2 units: parallel.fsdp.FSDP_UNITS
    logical_sync_refusal: str | None = None  # why it cannot hold FSDP2's sync to the last chunk
    per_layer_refusal: str | None = None  # why it cannot clip per layer (--clipping per_layer)
    capturable = False  # its chunk steps and finish make no host sync: a graph captures them
    capture: CaptureSupport | None = None
    privacy: PrivacyDescription | None = None
    parameters: list[nn.Parameter]

    def __init__(self, model: nn.Module, settings: TrainerSettings, phases: PhaseEvents):
        self.model, self.settings, self.phases = model, settings, phases
        self.dtype = settings.dtype
        self.batch_size = settings.batch_size
        if settings.mode.is_distributed:
            phases("distributed_wrapped")

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The base optimizer over ``params`` (the trainer's ``parameters``)."""
        self.parameters = params
        if self.settings.optimizer == "sgd":  # plain: no momentum, no weight decay
            self.base_optimizer = torch.optim.SGD(params, lr=self.settings.lr)
        else:  # torch defaults; a captured step keeps Adam's step count on the device
            self.base_optimizer = torch.optim.Adam(
                params, lr=self.settings.lr, capturable=self.settings.cuda_graph
            )
        self.phases("optimizer_created")
        return self.base_optimizer

    def autocast(self, device_type: str):
        if self.dtype == torch.bfloat16:
            return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def per_sample_losses(self, model: nn.Module, chunk: Chunk) -> torch.Tensor:
        """The chunk's per-sample losses [n] through ``model`` (under autocast), each times its
        weight where the chunk is padded."""
        with self.autocast(chunk.inputs.device.type):
            losses = self.settings.loss_fn(model, chunk.inputs, chunk.targets)
        return losses if chunk.weights is None else losses * chunk.weights

    # ------------------------------------------------------------ the step, by default
    def start_step(self, plan: StepPlan) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish_step(self, plan: StepPlan) -> None:
        if plan.is_empty:
            self.empty_batch_gradients()
        self.optimizer_step()

    def empty_batch_gradients(self) -> None:
        """Gradients of a batch with no samples, as ``optimizer_step`` expects them: none here
        (the optimizer skips parameters without a gradient)."""

    def optimizer_step(self) -> None:
        self.optimizer.step()

    # ------------------------------------------------------------ where the state lives
    def memory(self) -> MemoryRoles:
        named = list(self.model.named_parameters())
        states = self.base_optimizer.state
        tensors = [
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
        model_code = {type(m).forward for m in self.model.modules()}
        sites = [
            *self.dp_allocation_sites(),
            AllocationSite.of("gradients", Trainer.optimizer_step),
            AllocationSite("optimizer_states", package="torch.optim"),
            # Allocated by a module's forward (or the loss): activations kept for backward.
            AllocationSite("activations", package="torch.nn"),
            AllocationSite("activations", package="transformers"),
            AllocationSite("activations", package="peft"),
            AllocationSite.of("activations", *model_code),
        ]
        return MemoryRoles(tensors, sites)

    def dp_state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """What the DP machinery adds (per-sample gradients, norms, saved inputs): none here."""
        return []

    def dp_allocation_sites(self) -> list[AllocationSite]:
        return []

    def result_extras(self) -> dict:
        return {}


class PrivateTrainer(Trainer):
    """A DP trainer: clip factors under its clipping rule, the count of samples each per-layer
    bound clipped, its privacy description."""

    def __init__(self, model: nn.Module, settings: TrainerSettings, phases: PhaseEvents):
        super().__init__(model, settings, phases)
        self.max_grad_norm = settings.max_grad_norm
        self.noise_multiplier = settings.noise_multiplier

    def make_optimizer(self, params):
        optimizer = super().make_optimizer(params)
        # Per-layer clipping: each parameter tensor's bound (an equal split of C) and the count
        # of the samples each bound clips
        self.layer_max_grad_norm = layer_max_grad_norm(self.max_grad_norm, max(len(params), 1))
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.clipped_counts = ClippedCounts(
            [names.get(id(p), "") for p in params], self.max_grad_norm, self.layer_max_grad_norm
        )
        return optimizer

    def describe_privacy(self, noise_sampler: str, sensitivity_margin: float) -> None:
        """Set ``privacy`` once the parameters are known: every trainable parameter's
        coordinates (whole, not a shard) get noise."""
        self.privacy = PrivacyDescription(
            noise_sampler=noise_sampler,
            sensitivity_margin=sensitivity_margin,
            noised_dimension=sum(p.numel() for p in self.parameters),
            clipping_record=self.clipping_record,
        )

    def clip_factors(self, per_sample_norms: torch.Tensor) -> torch.Tensor:
        """min(1, C / (norm + 1e-6)) of each sample ([B], flat), or of each parameter's norm
        against its C_l ([P, B], per-layer: Opacus' formula with C_l)."""
        bound = self.max_grad_norm if per_sample_norms.dim() == 1 else self.layer_max_grad_norm
        return (bound / (per_sample_norms + 1e-6)).clamp(max=1.0)

    def clipping_record(self) -> dict:
        """The result's ``clipping``: the rule and its bounds, and per-layer how often each
        parameter's bound clipped."""
        if self.settings.clipping.per_layer:
            return self.clipped_counts.record()
        return {"rule": self.settings.clipping.value, "max_grad_norm": self.max_grad_norm}
