"""One ``Trainer`` interface and a registry: ``standard``, ``dpsgd``, ``ghost``, ``flash``.

DP semantics shared by every DP trainer (README.md says the same): per-sample loss is the mean
over that sample's tokens; clip factor min(1, C / (||grad_b|| + 1e-6)); update direction
(1/B)(sum_b c_b grad_b + N(0, sigma^2 C^2 I)). A logical batch over the physical maximum is
split into near-equal chunks (as Opacus' BatchMemoryManager does: 14 by 4 -> 4,4,3,3); clipped
sums accumulate over the chunks and noise is added once per logical batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus import grad_sample as opacus_grad_sample
from opacus import optimizers as opacus_optimizers
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DistributedDPOptimizer, DPOptimizer
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

import flash.engine
import flash.sites
import samplers.state
from core import schema
from core.schema import AllocationSite
from flash.clip import add_gaussian_noise, clip_per_sample
from flash.layer import tensors_in
from parallel import ddp, wrap
from stepping import graph

TRAINERS: dict[str, type[Trainer]] = {}
OPTIMIZERS = ("sgd", "adam")
# Opacus' hooks and flash's book-keeping save each layer's input in forward (and per-sample
# gradients computed from it): recomputing a checkpointed block in backward saves it again.
REHOOKED = "its per-layer hooks would save every recomputed layer input a second time"


def register_trainer(name: str):
    def register(cls):
        cls.name = name
        TRAINERS[name] = cls
        return cls

    return register


def canonical_trainer_name(name: str) -> str:
    """Map a user-typed name or alias to its canonical registry name (ValueError if unknown)."""
    return schema.canonical_trainer_name(name, TRAINERS)


def make_trainer(
    name: str,
    model: nn.Module,
    *,
    lr: float,
    max_grad_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    batch_size: int,
    optimizer: str = "sgd",
    dtype: torch.dtype = torch.float32,
    distributed: str = "none",
    **trainer_options,
) -> Trainer:
    """Build the named trainer around ``model`` (its parameters updated in place). ``distributed``
    ("ddp" or "fsdp", in an initialised default process group): replicated or sharded, each rank
    steps on its slice of the global batch; ``batch_size`` stays the GLOBAL batch (the divisor)."""
    cls = TRAINERS[canonical_trainer_name(name)]
    checkpointing = getattr(getattr(model, "config", None), "activation_checkpointing", False)
    if reason := refusal(cls.name, distributed, trainer_options.get("cuda_graph"), checkpointing):
        raise ValueError(reason)
    if distributed == "fsdp":  # before the trainer: its optimizer (and flash) see the shards
        model = wrap.shard(model, cls.fsdp_units)
    privacy = dict(max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier)
    options = dict(lr=lr, batch_size=batch_size, optimizer=optimizer, dtype=dtype)
    return cls(model, **options, **privacy, distributed=distributed, **trainer_options)


def refusal(name: str, distributed="none", cuda_graph=False, checkpointing=False) -> str | None:
    """Why trainer ``name`` cannot run so (None: it can): the plan records the config skipped."""
    cls = TRAINERS[canonical_trainer_name(name)]
    if checkpointing and not cls.supports_activation_checkpointing:
        return f"trainer {cls.name!r} does not support activation checkpointing: {REHOOKED}"
    graphed = graph.refusal(cls.capturable, cls.name, distributed) if cuda_graph else None
    return cls.distributed_refusals.get(distributed) or graphed


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

    name = "base"
    is_private = False
    options: tuple[str, ...] = ()  # experiment settings this trainer takes as keyword arguments
    supports_activation_checkpointing = False  # REHOOKED says why not, for most
    distributed_refusals: dict[str, str] = {}  # modes it cannot run, why (recorded "skipped")
    fsdp_units = "blocks"  # FSDP2 units: parallel.wrap.FSDP_UNITS
    capturable = False  # its chunk and optimizer steps make no host sync: a graph captures them
    shared_noise: torch.Generator | None = None  # its own noise generator (a capture tracks it)

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
        distributed: str = "none",
        cuda_graph: bool = False,
    ):
        if batch_size <= 0 or (max_physical_batch_size or 1) <= 0:
            raise ValueError(f"batch sizes must be > 0 ({batch_size}, {max_physical_batch_size})")
        if noise_multiplier < 0 or max_grad_norm <= 0:
            raise ValueError("noise_multiplier must be >= 0 and max_grad_norm > 0")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.model, self.lr, self.batch_size = model, lr, batch_size
        self.max_grad_norm, self.noise_multiplier = max_grad_norm, noise_multiplier
        self.max_physical_batch_size, self.dtype = max_physical_batch_size or batch_size, dtype
        # Per-sample loss of a chunk, [n]: the mean of each sample's token losses by default.
        self.per_sample_loss = loss_fn or (lambda m, x, y: token_losses(m(x), y).mean(dim=1))
        self.on_phase = on_phase or (lambda name: None)
        self.steps_taken, self.distributed = 0, distributed
        self.world_size = torch.distributed.get_world_size() if distributed != "none" else 1
        if distributed != "none":
            self.on_phase("distributed_wrapped")
        params = self.trainable_parameters(model)
        if optimizer == "sgd":  # plain: no momentum, no weight decay
            self.optimizer = torch.optim.SGD(params, lr=lr)
        else:  # torch defaults; a captured step keeps Adam's step count on the device
            self.optimizer = torch.optim.Adam(params, lr=lr, capturable=cuda_graph)
        self.base_optimizer = self.optimizer  # holds the optimizer states
        self.on_phase("optimizer_created")
        self.graphs = graph.Replayer(cuda_graph)  # the step as one CUDA graph, if asked

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
        return (self.max_grad_norm / (per_sample_norms + 1e-6)).clamp(max=1.0)


@register_trainer("standard")
class StandardTrainer(Trainer):
    """Non-private baseline: the same loss, no clipping, no noise."""

    supports_activation_checkpointing = True
    capturable = True

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        replicated = self.distributed == "ddp"
        self.forward_model = ddp.data_parallel(model, self.graphs.enabled) if replicated else model

    def captures_after_this(self):  # DDP's 11th iteration or later
        return self.distributed != "ddp" or self.forward_model.captures_after_this()

    def chunk_step(self, inputs, targets, is_last):
        # Gradients are summed over ranks once per logical batch, after its last chunk.
        if self.distributed == "fsdp":
            self.model.set_requires_gradient_sync(is_last)
        no_sync = self.distributed == "ddp" and not is_last
        with self.forward_model.no_sync() if no_sync else contextlib.nullcontext():
            with self.autocast(inputs.device.type):
                per_sample = self.per_sample_loss(self.forward_model, inputs, targets)
            self.on_phase("forward_done")
            # Scale so the accumulated gradient is the mean over the whole logical batch.
            (per_sample.sum() / self.batch_size).backward()
        self.on_phase("backward_done")
        return per_sample.detach().sum()


class OpacusTrainer(Trainer):
    """Opacus' optimizers with BatchMemoryManager's protocol for physical chunks."""

    is_private = True

    def dp_state_tensors(self):
        owners = {"parameter": self.model.named_parameters, "module": self.model.named_modules}
        return [
            (role, name, tensor)
            for role, kind, attribute in samplers.state.OPACUS_ATTRIBUTES
            for name, owner in owners[kind]()
            for tensor in tensors_in(getattr(owner, attribute, None))
        ]

    def dp_allocation_sites(self):
        return list(samplers.state.OPACUS_SITES)

    def wrap_optimizer(self, dp_optimizer_classes: dict) -> None:
        """Opacus' DP optimizer (``dp_optimizer_classes`` by distributed mode) around the base
        optimizer, with this trainer's settings. Distributed, Opacus divides by the expected
        batch of ONE rank and then averages over the ranks: B / world_size is that batch."""
        self.optimizer = dp_optimizer_classes[self.distributed](
            self.base_optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=self.batch_size // self.world_size,
            loss_reduction="mean",
        )
        self.on_phase("privacy_wrapped")

    def wrapped_forward(self, inputs, targets) -> torch.Tensor:
        """Per-sample losses of a chunk through the Opacus-wrapped model."""
        with self.autocast(inputs.device.type):
            per_sample = self.per_sample_loss(self.wrapped, inputs, targets)
        self.on_phase("forward_done")
        return per_sample

    def end_chunk(self, per_sample: torch.Tensor, is_last: bool) -> torch.Tensor:
        self.on_phase("backward_done")
        if not is_last:  # clip and accumulate this chunk; noise and update wait for the last
            self.optimizer.signal_skip_step(do_skip=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return per_sample.detach().sum()


@register_trainer("dpsgd")
class DPSGDTrainer(OpacusTrainer):
    """Opacus per-sample gradients: GradSampleModule hooks + DPOptimizer."""

    distributed_refusals = {
        "fsdp": "Opacus 1.6's per-sample gradients (hooks mode) do not run on an FSDP2 model: "
        "its grad samplers expect whole parameters, and FSDP2 shards them (use ghost or flash)"
    }

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        module = DPDDP(model) if self.distributed == "ddp" else model
        self.wrapped = GradSampleModule(module, batch_first=True, loss_reduction="mean")
        self.wrap_optimizer({"none": DPOptimizer, "ddp": DistributedDPOptimizer})

    def empty_batch_gradients(self):
        # Zero rows of per-sample gradients: Opacus' clipping takes this as an empty batch.
        for p in self.optimizer.params:
            p.grad_sample = p.new_zeros((0, *p.shape))

    def chunk_step(self, inputs, targets, is_last):
        per_sample = self.wrapped_forward(inputs, targets)
        # Mean over the chunk: Opacus rescales grad_sample by the chunk size ("mean" reduction).
        per_sample.mean().backward()
        return self.end_chunk(per_sample, is_last)


@register_trainer("ghost")
class GhostClippingTrainer(OpacusTrainer):
    """Opacus fast gradient / ghost clipping: two backward passes, no per-sample gradients."""

    fsdp_units = "opacus_layers"

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        module_class = opacus_grad_sample.GradSampleModuleFastGradientClipping
        if self.distributed == "fsdp":
            module_class = opacus_grad_sample.GradSampleModuleFastGradientClippingFSDP
        self.wrapped = module_class(
            DPDDP(model) if self.distributed == "ddp" else model,
            batch_first=True,
            loss_reduction="mean",
            max_grad_norm=self.max_grad_norm,
            use_ghost_clipping=True,
        )
        self.wrap_optimizer(
            {
                "none": opacus_optimizers.DPOptimizerFastGradientClipping,
                "ddp": opacus_optimizers.DistributedDPOptimizerFastGradientClipping,
                "fsdp": opacus_optimizers.FSDPOptimizerFastGradientClipping,
            }
        )

    def empty_batch_gradients(self):
        # The second backward's clipped sum is what this optimizer accumulates: zero here.
        for p in self.optimizer.params:
            p.grad = torch.zeros_like(p)

    def chunk_step(self, inputs, targets, is_last):
        per_sample = self.wrapped_forward(inputs, targets)
        # Opacus' DPLossFastGradientClipping's tensor, from our per-sample loss (HF and LM alike)
        loss = DPTensorFastGradientClipping(self.wrapped, self.optimizer, per_sample, "mean")
        loss.backward()  # first backward (norms), then the clipped second backward
        return self.end_chunk(per_sample, is_last)


@register_trainer("flash")
class FlashClippingTrainer(Trainer):
    """Ours: one forward, one backward, exact per-sample norms by the cheaper route per layer
    (book-keeping, Bu et al. 2023: each layer's input A and output gradient G, or its per-sample
    gradients where smaller; then each layer's clipped gradient as one GEMM or weighted sum)."""

    is_private = True
    gathering = False  # this step's (chunks decides): per-sample gradients gathered over 2 ranks
    gathered: wrap.GatheredGradients | None = None  # its gathers, while they hold memory
    options = ("flash_route",)
    capturable = True  # its hooks, kernels and tables make no host sync (tests check it)

    def __init__(self, model, *, flash_route: str = "auto", **kwargs):
        self.engine = flash.engine.FlashClipping(model, route=flash_route)
        try:
            super().__init__(model, **kwargs)
        except Exception:
            self.engine.remove()  # leave the model as it was given: no hooks, trainable
            raise
        if self.distributed == "ddp":  # no DDP wrapper: flash sums its clipped gradients
            wrap.broadcast_parameters(model)
        self.on_phase("privacy_wrapped")

    def trainable_parameters(self, model):
        return list(self.engine.params)

    def chunks(self, batch, largest=None):  # largest: every rank's, so all ranks decide alike
        self.gathering = wrap.gathers_per_sample(self.distributed, self.world_size, largest)
        return super().chunks(batch, largest)

    def chunk_step(self, inputs, targets, is_last):
        if self.gathering:  # one sample per rank: its gradient is its per-sample gradient
            return self.gathered_chunk_step(inputs, targets)
        with self.autocast(inputs.device.type):
            per_sample = self.per_sample_loss(self.model, inputs, targets)
        self.on_phase("forward_done")
        # Sum over samples: each sample's G is then exactly the gradient of its own loss.
        self.engine.backward(per_sample.sum())
        self.on_phase("_clip_inputs_saved")  # A, G and per-sample grads all held: name them
        # Each sample's norm from its own gradient, on its own rank: never reduced.
        norms = self.engine.per_sample_squared_norms().sqrt()
        # 1/B folded into the clip factors (and the noise's std): no division pass afterwards.
        # Several ranks: each collective starts once its clipped sum exists (the sink).
        sink = wrap.gradient_sink(self.distributed, is_last, self.noise_std(), add_gaussian_noise)
        self.engine.accumulate_clipped_grads(self.clip_factors(norms) / self.batch_size, sink)
        self.engine.release()
        self.on_phase("backward_done")
        return per_sample.detach().sum()

    def gathered_chunk_step(self, inputs, targets):
        """DDP, one per rank: autograd's gradients, gathered; each rank clips the global batch."""
        with self.engine.autograd_gradients():  # its hooks go with the step, also if it fails
            with wrap.GatheredGradients(self.engine.params, self.dtype) as self.gathered:
                with self.autocast(inputs.device.type):
                    per_sample = self.per_sample_loss(self.model, inputs, targets)
                self.on_phase("forward_done")
                per_sample.sum().backward()
        self.on_phase("_clip_inputs_saved")  # the rank's gradients, sent and received: name them
        grads, self.gathered = self.gathered.land(), None
        clip_per_sample(self.engine.params, grads, self.clip_factors, self.batch_size)
        self.on_phase("backward_done")
        return per_sample.detach().sum()

    def discard_step_state(self):
        super().discard_step_state()
        self.engine.release()

    def noise_std(self) -> float:  # the gradients hold sum_b c_b g_b / B: N(0, (sigma C)^2) / B
        return self.noise_multiplier * self.max_grad_norm / self.batch_size

    def empty_batch_gradients(self):  # DDP: zeros, rank 0's noise, summed over the ranks
        self.gathering = False  # no chunks this step
        if sink := wrap.gradient_sink(self.distributed, True, self.noise_std(), add_gaussian_noise):
            sink.finish(self.engine.params)

    def optimizer_step(self):
        params = self.engine.params
        for p in params:
            if p.grad is None:  # a layer the batch never reached still gets noise
                p.grad = torch.zeros_like(p)
        # Noise once per coordinate. DDP: rank 0's, in the sum over ranks (the sink), or, gathering,
        # one draw on every replica (a generator seeded alike, once); FSDP2: each rank's shard's.
        if self.noise_std() > 0 and (self.distributed != "ddp" or self.gathering):
            if self.gathering and self.shared_noise is None:
                self.shared_noise = wrap.shared_generator(params[0].device)
            add_gaussian_noise(wrap.local_gradients(params), self.noise_std(), self.shared_noise)
        self.optimizer.step()

    def result_extras(self) -> dict:  # the route each Linear layer's norms took, its sizes
        return {"flash_routes": self.engine.routes()}

    def dp_state_tensors(self):
        names = {id(m): n for n, m in self.model.named_modules()}
        held = [(role, names.get(id(m), ""), t) for m, role, t in self.engine.kept_tensors()]
        gathered = self.gathered.tensors() if self.gathered else []
        return held + [("per_sample_gradients", "", t) for t in gathered]

    def dp_allocation_sites(self):  # ALLOCATION_SITES lists its roles in order of precedence
        sites, gathered = {**flash.sites.ALLOCATION_SITES}, wrap.GatheredGradients
        sites["per_sample_gradients"] += (gathered.start_gather, gathered.land)  # its gathers
        return [AllocationSite.of(role, *fns) for role, fns in sites.items()]
