"""DP-SGD as the textbook defines it (Abadi et al. 2016), by microbatches of one: each sample's
gradient from a backward of its own loss alone, clipped to C, summed; at the logical batch's
end the sum over the ranks, Gaussian noise N(0, sigma^2 C^2) once per coordinate (rank 0's),
divided by the expected batch. The example of ARCHITECTURE.md's "Adding a trainer": one file,
one registry line, and the Runner runs it in one process, under DDP and in padded chunks.

Slow by design (a backward per sample): a reference, not a trainer to measure."""

from __future__ import annotations

import torch

from dp_cost.core.schema import AllocationSite
from dp_cost.training.base import PrivateTrainer


class TextbookDPSGD(PrivateTrainer):
    per_layer_refusal = "the textbook trainer clips each sample's whole gradient (flat) only"
    sharded_refusal = "the textbook trainer keeps whole parameters (one process or DDP)"

    def __init__(self, model, settings, phases):
        super().__init__(model, settings, phases)
        self.optimizer = self.make_optimizer([p for p in model.parameters() if p.requires_grad])
        self.describe_privacy(f"torch_{self.parameters[0].device.type}", 0.0)  # torch.normal
        self.clipped_sums: list[torch.Tensor] = []

    def start_step(self, plan):
        super().start_step(plan)
        self.clipped_sums = [torch.zeros_like(p) for p in self.parameters]

    def chunk_step(self, chunk):
        losses = self.per_sample_losses(self.model, chunk)  # a stand-in's is 0: no gradient
        self.phases("forward_done")
        for i in range(len(losses)):
            grads = torch.autograd.grad(
                losses[i], self.parameters, retain_graph=i < len(losses) - 1, allow_unused=True
            )
            grads = [
                torch.zeros_like(p) if g is None else g for p, g in zip(self.parameters, grads)
            ]
            self.add_clipped(grads)
        self.phases("backward_done")
        return losses.detach().sum()

    def add_clipped(self, grads: list[torch.Tensor]) -> None:
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        factor = self.clip_factors(norm.reshape(1)).to(grads[0].dtype)
        for total, grad in zip(self.clipped_sums, grads, strict=True):
            total.add_(grad, alpha=float(factor))

    def finish_step(self, plan):
        mode = self.settings.mode
        noise_std = self.noise_multiplier * self.max_grad_norm
        adds_noise = not mode.is_distributed or torch.distributed.get_rank() == 0
        for p, total in zip(self.parameters, self.clipped_sums, strict=True):
            if adds_noise and noise_std > 0:
                total.add_(torch.normal(0.0, noise_std, total.shape, device=total.device))
            p.grad = mode.sum_over_ranks(total) / self.batch_size
        self.optimizer.step()

    def dp_state_tensors(self):
        return [("per_sample_gradients", "", total) for total in self.clipped_sums]

    def dp_allocation_sites(self):
        return [AllocationSite.of("per_sample_gradients", TextbookDPSGD.add_clipped)]
