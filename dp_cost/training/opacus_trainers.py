"""Opacus' two DP trainers: per-sample gradients (hooks) and ghost clipping, with Opacus'
optimizers and BatchMemoryManager's protocol for physical chunks."""

from __future__ import annotations

import math

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

from dp_cost.flash import tensors_in
from dp_cost.samplers import state as opacus_state
from dp_cost.training.base import Trainer
from dp_cost.training.clipping import ClippedCounts


class OpacusTrainer(Trainer):
    """Opacus' optimizers with BatchMemoryManager's protocol for physical chunks."""

    is_private = True

    def dp_state_tensors(self):
        owners = {"parameter": self.model.named_parameters, "module": self.model.named_modules}
        return [
            (role, name, tensor)
            for role, kind, attribute in opacus_state.OPACUS_ATTRIBUTES
            for name, owner in owners[kind]()
            for tensor in tensors_in(getattr(owner, attribute, None))
        ]

    def dp_allocation_sites(self):
        return list(opacus_state.OPACUS_SITES)

    def wrap_optimizer(self, dp_optimizer_classes: dict) -> None:
        """Opacus' DP optimizer (``dp_optimizer_classes`` by distributed mode) around the base
        optimizer, with this trainer's settings. Distributed, Opacus divides by the expected
        batch of ONE rank and then averages over the ranks: B / world_size is that batch.
        Per-layer clipping: Opacus takes a list of bounds, one per parameter."""
        max_grad_norm = self.max_grad_norm
        if self.clipping == "per_layer":
            max_grad_norm = [self.layer_max_grad_norm] * len(
                self.base_optimizer.param_groups[0]["params"]
            )
        self.optimizer = dp_optimizer_classes[self.distributed_mode.name](
            self.base_optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=max_grad_norm,
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
            per_sample_norms = grad_sample.norm(2, dim=tuple(range(1, grad_sample.ndim)))
            factor = (max_grad_norm / (per_sample_norms + 1e-6)).clamp(max=1.0)
            grad = torch.einsum("i,i...", factor, grad_sample)
            if p.summed_grad is not None:
                p.summed_grad += grad
            else:
                p.summed_grad = grad
            _mark_as_processed(p.grad_sample)
            squared.append(per_sample_norms.square())
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
    distributed_refusals = {
        "fsdp": "Opacus 1.6's per-sample gradients (hooks mode) do not run on an FSDP2 model: "
        "its grad samplers expect whole parameters, and FSDP2 shards them (use ghost or flash)"
    }

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        module = DPDDP(model) if self.distributed_mode.replicates else model
        self.wrapped = GradSampleModule(module, batch_first=True, loss_reduction="mean")
        if self.clipping == "per_layer":
            self.wrap_optimizer(
                {"none": CountedPerLayerOptimizer, "ddp": CountedDistributedPerLayerOptimizer}
            )
            self.optimizer.clipped_counts = self.clipped_counts
            # sqrt(sum C_l^2) as a float: Opacus takes it from a tensor's .item(), a symbolic
            # value on the capacity prediction's fake tensors, which its noise's std compares
            bounds = self.optimizer.max_grad_norms
            self.optimizer.max_grad_norm = math.sqrt(math.fsum(b * b for b in bounds))
        else:
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


class GhostClippingTrainer(OpacusTrainer):
    """Opacus fast gradient / ghost clipping: two backward passes, no per-sample gradients."""

    name = "ghost"
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

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        module_class = opacus_grad_sample.GradSampleModuleFastGradientClipping
        if self.distributed_mode.shards:
            module_class = opacus_grad_sample.GradSampleModuleFastGradientClippingFSDP
        self.wrapped = module_class(
            DPDDP(model) if self.distributed_mode.replicates else model,
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
