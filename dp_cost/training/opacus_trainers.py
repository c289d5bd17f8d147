"""Opacus' two DP trainers: per-sample gradients (hooks) and ghost clipping, with Opacus'
optimizers and BatchMemoryManager's protocol for physical chunks."""

from __future__ import annotations

import torch
from opacus import GradSampleModule
from opacus import grad_sample as opacus_grad_sample
from opacus import optimizers as opacus_optimizers
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DistributedDPOptimizer, DPOptimizer
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

from dp_cost.flash import tensors_in
from dp_cost.samplers import state as opacus_state
from dp_cost.training.base import Trainer


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
        batch of ONE rank and then averages over the ranks: B / world_size is that batch."""
        self.optimizer = dp_optimizer_classes[self.distributed_mode.name](
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
