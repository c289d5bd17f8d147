"""Opacus' two DP trainers: per-sample gradients (hooks) and ghost clipping, with Opacus'
optimizers and BatchMemoryManager's protocol for physical chunks."""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from opacus import GradSampleModule
from opacus import grad_sample as opacus_grad_sample
from opacus import optimizers as opacus_optimizers
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import (
    DistributedDPOptimizer,
    DPOptimizer,
    DPPerLayerOptimizer,
    SimpleDistributedPerLayerOptimizer,
)
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import set_checkpoint_early_stop

from dp_cost.core import recompute
from dp_cost.core.schema import AllocationSite
from dp_cost.flash import tensors_in
from dp_cost.samplers import state as opacus_state
from dp_cost.training import opacus_noise
from dp_cost.training.base import PrivateTrainer
from dp_cost.training.clipping import ClippedCounts

# How far above C a sample's clipped contribution may reach under Opacus' clipping, relative to
# C, by the dtype of the step: Opacus computes the per-sample norms in the per-sample
# gradients' dtype (bf16 under autocast: 8 bits, rounded), so min(1, C / norm) can scale a
# sample past C. Measured on the stress shapes of tests/test_dp_fidelity.py
# (benchmarks/clip_sensitivity.py): up to 3.5e-3 past C in bf16 (ghost), none in fp32; the
# margins are several times that. The accountant takes the sensitivity as (1 + margin) C, i.e.
# an effective noise multiplier sigma / (1 + margin).
NORM_MARGINS = {torch.float32: 2.0**-12, torch.bfloat16: 2.0**-5}
NORM_BLOCK_COLUMNS = 2**16  # per_sample_norms on the CPU: columns converted to fp64 at a time


class OpacusTrainer(PrivateTrainer):
    """Opacus' optimizers with BatchMemoryManager's protocol for physical chunks."""

    options = ("noise_sampler",)

    def __init__(self, model, settings, phases, *, noise_sampler: str = "opacus"):
        super().__init__(model, settings, phases)
        self.noise_sampler = noise_sampler  # opacus_noise.NOISE_SAMPLERS
        self.make_optimizer([p for p in model.parameters() if p.requires_grad])

    def dp_state_tensors(self):
        owners = {"parameter": self.model.named_parameters, "module": self.model.named_modules}
        return [
            (role, name, tensor)
            for role, kind, attribute in opacus_state.OPACUS_ATTRIBUTES
            for name, owner in owners[kind]()
            for tensor in tensors_in(getattr(owner, attribute, None))
        ]

    def dp_allocation_sites(self):
        # the clipping below replaces Opacus' own (opacus.optimizers' "^clip" site)
        ours = (
            accumulate_clipped,
            FlatClipping.clip_and_accumulate,
            CountedPerLayerClipping.clip_and_accumulate,
        )
        return [AllocationSite.of("per_sample_gradients", *ours), *opacus_state.OPACUS_SITES]

    def wrap_optimizer(self, dp_optimizer_class: type) -> None:
        """Opacus' DP optimizer of class ``dp_optimizer_class`` around the base optimizer, with
        this trainer's settings. Distributed, Opacus divides by the expected batch of ONE rank
        and then averages over the ranks: B / world_size is that batch, a float where B is not
        a multiple of the ranks (so the divisor is B, not (B // W) W). Per-layer clipping:
        Opacus takes a list of bounds, one per parameter."""
        max_grad_norm = self.max_grad_norm
        if self.settings.clipping.per_layer:
            max_grad_norm = [self.layer_max_grad_norm] * len(self.parameters)
        self.optimizer = dp_optimizer_class(
            self.base_optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=self.batch_size / self.settings.mode.world_size,
            loss_reduction="mean",
        )
        law = opacus_noise.draw_with(self.optimizer, self.noise_sampler)
        self.describe_privacy(law, NORM_MARGINS[self.dtype])
        self.phases("privacy_wrapped")

    def capture_once_in_recomputed_blocks(self) -> None:
        """With activation checkpointing, a checkpointed block's forward runs first without
        keeping its layers' inputs, then again in each backward (ghost's two backwards: twice),
        where they are recomputed. Opacus' forward hooks would capture each input in the first
        forward too, and its backward hooks pop one (a stale entry would be left behind every
        step): capture is off in the first forward, so each layer's input is captured once per
        backward whose hooks run, from the recomputation before it (ghost's second backward
        runs with Opacus' hooks off)."""
        contexts = recompute.recompute_contexts(self.model)
        if contexts is not None:  # the model holds the wrapper weakly: not this trainer
            wrapped = weakref.ref(self.wrapped)
            contexts.make = lambda: (capture_off(wrapped()), contextlib.nullcontext())

    def wrapped_forward(self, chunk) -> torch.Tensor:
        """Per-sample losses of a chunk through the Opacus-wrapped model. The recomputation of
        a checkpointed block runs whole (no early stop after its last saved tensor), so that
        every layer's forward hook runs in it."""
        with set_checkpoint_early_stop(False):
            per_sample = self.per_sample_losses(self.wrapped, chunk)
        self.phases("forward_done")
        return per_sample

    def end_chunk(self, per_sample: torch.Tensor, is_last: bool) -> torch.Tensor:
        self.phases("backward_done")
        if not is_last:  # clip and accumulate this chunk; noise and update wait for the last
            self.optimizer.signal_skip_step(do_skip=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return per_sample.detach().sum()


@contextlib.contextmanager
def capture_off(wrapped):
    """Opacus' forward hooks capture nothing in the block (a trainer gone: nothing to switch)."""
    if wrapped is None:
        yield
        return
    enabled, wrapped.hooks_enabled = wrapped.hooks_enabled, False
    try:
        yield
    finally:
        wrapped.hooks_enabled = enabled


def per_sample_norms(grad_sample: torch.Tensor) -> torch.Tensor:
    """Each sample's L2 norm ([B]) of per-sample gradients [B, ...], as Opacus takes it, except
    on the CPU: there torch's fp32 norm of a long row comes out low (by 1e-5 at 1e6 elements,
    4.7e-3 at 6e7), so min(1, C / norm) would scale a sample past C; accumulated in fp64 there.
    On CUDA the reduction's error is far below NORM_MARGINS'."""
    rows = grad_sample.flatten(1)  # [B, everything else], B = 0 included
    if not rows.is_cpu or is_fake(rows):  # a planned step's fake tensors: CUDA's memory
        return rows.norm(2, dim=-1)
    # fp64 a block of columns at a time: an fp64 copy of the whole would add its size again to
    # the step's peak (the measurement)
    squares = torch.zeros(len(rows), dtype=torch.float64)
    for block in rows.split(NORM_BLOCK_COLUMNS, dim=1):
        squares += torch.linalg.vector_norm(block, dim=1, dtype=torch.float64).square()
    return squares.sqrt().to(torch.promote_types(rows.dtype, torch.float32))


def accumulate_clipped(p: torch.Tensor, grad_sample: torch.Tensor, factors: torch.Tensor):
    """Opacus' last part of clip_and_accumulate for one parameter: its per-sample gradients
    (already in the parameter's dtype) weighted by ``factors`` [B] and summed into
    ``p.summed_grad``, marked processed."""
    grad = torch.einsum("i,i...", factors.to(grad_sample.device, p.dtype), grad_sample)
    if p.summed_grad is not None:
        p.summed_grad += grad
    else:
        p.summed_grad = grad
    _mark_as_processed(p.grad_sample)


class FlatClipping:
    """Opacus' flat clip_and_accumulate (DPOptimizer's arithmetic: per-parameter norms, stacked,
    min(1, C / (norm + 1e-6)), the per-sample gradients cast to the parameter's dtype and summed
    with those factors), with per_sample_norms' accurate norms on the CPU."""

    def clip_and_accumulate(self):
        if len(self.grad_samples[0]) == 0:  # an empty batch
            factors = torch.zeros((0,), device=self.grad_samples[0].device)
        else:
            norms = torch.stack([per_sample_norms(g) for g in self.grad_samples], dim=1)
            factors = (self.max_grad_norm / (norms.norm(2, dim=1) + 1e-6)).clamp(max=1.0)
        for p in self.params:
            _check_processed_flag(p.grad_sample)
            accumulate_clipped(p, self._get_flat_grad_sample(p).to(p.dtype), factors)


class FlatOptimizer(FlatClipping, DPOptimizer):
    """One process: Opacus' DPOptimizer."""


class DistributedFlatOptimizer(FlatClipping, DistributedDPOptimizer):
    """DDP: Opacus' DistributedDPOptimizer (clipped sums summed over the ranks, rank 0's noise)."""


class CountedPerLayerClipping:
    """Opacus' per-layer clip_and_accumulate (DPPerLayerOptimizer's arithmetic, with flat
    clipping's cast of the per-sample gradients to the parameter's dtype), also counting the
    samples each parameter's bound clips (ClippedCounts): Opacus forms each parameter's
    per-sample norms inside it and keeps none, and a second pass over every per-sample
    gradient to count them would cost about what the clipping does."""

    clipped_counts: ClippedCounts

    def clip_and_accumulate(self):
        squared, factors = [], []
        for p, max_grad_norm in zip(self.params, self.max_grad_norms, strict=True):
            _check_processed_flag(p.grad_sample)
            # in the parameter's dtype, as Opacus' flat clipping casts it (its per-layer
            # optimizer does not, and fails under bf16 autocast: a bf16 sum for an fp32 .grad)
            grad_sample = self._get_flat_grad_sample(p).to(p.dtype)
            norms = per_sample_norms(grad_sample)
            factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            accumulate_clipped(p, grad_sample, factor)
            squared.append(norms.square())
            factors.append(factor)
        if squared:
            self.clipped_counts.add(torch.stack(squared), torch.stack(factors))


class CountedPerLayerOptimizer(CountedPerLayerClipping, DPPerLayerOptimizer):
    """One process: Opacus' DPPerLayerOptimizer, counting."""


class CountedDistributedPerLayerOptimizer(
    CountedPerLayerClipping, SimpleDistributedPerLayerOptimizer
):
    """DDP: the per-layer optimizer Opacus' make_private picks for hooks mode (clipped sums
    summed over the ranks in step, rank 0's noise, as its flat DistributedDPOptimizer),
    counting."""


class DPSGDTrainer(OpacusTrainer):
    """Opacus per-sample gradients: GradSampleModule hooks + DPOptimizer."""

    name = "dpsgd"
    supports_activation_checkpointing = True
    sharded_refusal = (
        "Opacus 1.6's per-sample gradients (hooks mode) do not run on an FSDP2 model: its grad "
        "samplers expect whole parameters, and FSDP2 shards them (use ghost or flash)"
    )

    def __init__(self, model, settings, phases, **options):
        super().__init__(model, settings, phases, **options)
        replicates = settings.mode.replicates
        self.wrapped = GradSampleModule(
            DPDDP(model) if replicates else model, batch_first=True, loss_reduction="mean"
        )
        self.capture_once_in_recomputed_blocks()
        if settings.clipping.per_layer:
            self.wrap_optimizer(
                CountedDistributedPerLayerOptimizer if replicates else CountedPerLayerOptimizer
            )
            self.optimizer.clipped_counts = self.clipped_counts
            # sqrt(sum C_l^2) as a float: Opacus takes it from a tensor's .item(), a symbolic
            # value on the capacity prediction's fake tensors, which its noise's std compares
            bounds = self.optimizer.max_grad_norms
            self.optimizer.max_grad_norm = math.sqrt(math.fsum(b * b for b in bounds))
        else:
            self.wrap_optimizer(DistributedFlatOptimizer if replicates else FlatOptimizer)

    def empty_batch_gradients(self):
        # Zero rows of per-sample gradients: Opacus' clipping takes this as an empty batch.
        for p in self.optimizer.params:
            p.grad_sample = p.new_zeros((0, *p.shape))

    def chunk_step(self, chunk):
        per_sample = self.wrapped_forward(chunk)
        # Mean over the chunk: Opacus rescales grad_sample by the chunk size ("mean" reduction).
        per_sample.mean().backward()
        return self.end_chunk(per_sample, chunk.is_last)


class ShardedGhostOptimizer(opacus_optimizers.FSDPOptimizerFastGradientClipping):
    """FSDP2: Opacus' ghost optimizer, each noised gradient given its parameter's placement.
    Opacus adds every rank's full-size noise (a plain tensor, taken as replicated) to the
    gradient's shard; where a parameter has fewer rows than ranks (a 3-row classifier head on 4
    ranks: an empty shard) DTensor's sum comes out replicated and the optimizer's in-place
    update of the sharded parameter fails. Back to the shard: each rank keeps its own slice of
    the sum (its own noise's, as where the shards are even), no communication."""

    def add_noise(self):
        super().add_noise()
        for p in self.params:
            if p.grad is not None and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)


class GhostClippingTrainer(OpacusTrainer):
    """Opacus fast gradient / ghost clipping: two backward passes, no per-sample gradients."""

    name = "ghost"
    supports_activation_checkpointing = True
    fsdp_units = "opacus_layers"
    per_layer_refusal = (
        "Opacus' ghost clipping has no per-layer mode: its norms come from one first backward "
        "over all layers, and its optimizers take one max_grad_norm (run dpsgd or flash with "
        "--clipping per_layer)"
    )
    logical_sync_refusal = (
        "Opacus' FSDP2 optimizer for ghost clipping adds each chunk's reduce-scattered gradient "
        "shard (.grad) to its running sum; with FSDP2's sync held to the last chunk there is "
        "none to add (run ghost with --fsdp_sync chunk)"
    )

    def __init__(self, model, settings, phases, **options):
        super().__init__(model, settings, phases, **options)
        mode = settings.mode
        module_class = opacus_grad_sample.GradSampleModuleFastGradientClipping
        optimizer_class = opacus_optimizers.DPOptimizerFastGradientClipping
        if mode.shards:
            module_class = opacus_grad_sample.GradSampleModuleFastGradientClippingFSDP
            optimizer_class = ShardedGhostOptimizer
        elif mode.replicates:
            optimizer_class = opacus_optimizers.DistributedDPOptimizerFastGradientClipping
        self.wrapped = module_class(
            DPDDP(model) if mode.replicates else model,
            batch_first=True,
            loss_reduction="mean",
            max_grad_norm=self.max_grad_norm,
            use_ghost_clipping=True,
        )
        self.capture_once_in_recomputed_blocks()
        self.wrap_optimizer(optimizer_class)

    def empty_batch_gradients(self):
        # The second backward's clipped sum is what this optimizer accumulates: zero here.
        for p in self.optimizer.params:
            p.grad = torch.zeros_like(p)

    def chunk_step(self, chunk):
        per_sample = self.wrapped_forward(chunk)
        # Opacus' DPLossFastGradientClipping's tensor, from our per-sample loss (HF and LM alike)
        loss = DPTensorFastGradientClipping(self.wrapped, self.optimizer, per_sample, "mean")
        loss.backward()  # first backward (norms), then the clipped second backward
        return self.end_chunk(per_sample, chunk.is_last)
