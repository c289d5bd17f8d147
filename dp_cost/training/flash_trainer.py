"""Flash Clipping's trainer: one backward, exact per-sample norms, clipped gradients by one GEMM
per layer (the engine in ``dp_cost.flash``), and its collectives when there are several ranks."""

from __future__ import annotations

import torch

from dp_cost.core.schema import AllocationSite
from dp_cost.flash import (
    ALLOCATION_SITES,
    FlashClipping,
    add_gaussian_noise,
    clip_per_sample,
    noise_sampler,
)
from dp_cost.parallel import buckets, collectives
from dp_cost.training.base import Trainer


class FlashClippingTrainer(Trainer):
    """Ours: one forward, one backward, exact per-sample norms by the cheaper route per layer
    (book-keeping, Bu et al. 2023: each layer's input A and output gradient G, or its per-sample
    gradients where smaller; then each layer's clipped gradient as one GEMM or weighted sum)."""

    name = "flash"
    is_private = True
    gathering = False  # this step's (chunks decides): per-sample gradients gathered over 2 ranks
    gathered: buckets.GatheredGradients | None = None  # its gathers, while they hold memory
    options = ("flash_route",)
    capturable = True  # its hooks, kernels and tables make no host sync (tests check it)

    def __init__(self, model, *, flash_route: str = "auto", **kwargs):
        self.engine = FlashClipping(model, route=flash_route)
        self.held_sums: dict = {}  # FSDP2, fsdp_sync "logical": buckets.HeldSums' sums
        try:
            super().__init__(model, **kwargs)
        except Exception:
            self.engine.remove()  # leave the model as it was given: no hooks, trainable
            raise
        if self.distributed_mode.replicates:  # no DDP wrapper: flash sums its clipped gradients
            collectives.broadcast_parameters(model)
        self.on_phase("privacy_wrapped")

    def trainable_parameters(self, model):
        return list(self.engine.params)

    def chunks(self, batch, largest=None):  # largest: every rank's, so all ranks decide alike
        self.gathering = self.distributed_mode.gathers_per_sample(largest)
        return super().chunks(batch, largest)

    def prepare_padded_chunks(self):
        # Gathering takes the step's one chunk and hands .grad over to the gathers: padded
        # steps (any number of chunks, a graph's own .grad) sum clipped gradients instead.
        self.gathering = False

    def chunk_step(self, inputs, targets, is_last):
        if self.gathering:  # one sample per rank: its gradient is its per-sample gradient
            return self.gathered_chunk_step(inputs, targets)
        with self.autocast(inputs.device.type):
            per_sample = self.per_sample_loss(self.model, inputs, targets)
        self.on_phase("forward_done")
        # Sum over samples: each sample's G is then exactly the gradient of its own loss.
        self.engine.backward(per_sample.sum())
        self.on_phase("_clip_inputs_saved")  # A, G and per-sample grads all held: name them
        # Each sample's norm from its own gradient, on its own rank: never reduced. Per-layer
        # clipping: each parameter's norm on its own ([P, B]), against its own C_l.
        if self.clipping == "per_layer":
            squared = self.engine.per_parameter_squared_norms()
            factors = self.clip_factors(squared.sqrt())
            self.clipped_counts.add(squared, factors)
        else:
            factors = self.clip_factors(self.engine.per_sample_squared_norms().sqrt())
        # 1/B folded into the clip factors (and the noise's std): no division pass afterwards.
        # Several ranks: each collective starts once its clipped sum exists (the sink); FSDP2
        # with fsdp_sync "logical": held unsharded until the last chunk, sent once then.
        held = self.held_sums if self.fsdp_sync == "logical" else None
        sink = self.distributed_mode.gradient_sink(
            is_last, self.noise_std(), add_gaussian_noise, held
        )
        self.engine.accumulate_clipped_grads(factors / self.batch_size, sink)
        self.engine.release()
        self.on_phase("backward_done")
        return per_sample.detach().sum()

    def gathered_chunk_step(self, inputs, targets):
        """DDP, one per rank: autograd's gradients, gathered; each rank clips the global batch."""
        with self.engine.autograd_gradients():  # its hooks go with the step, also if it fails
            with buckets.GatheredGradients(self.engine.params, self.dtype) as self.gathered:
                with self.autocast(inputs.device.type):
                    per_sample = self.per_sample_loss(self.model, inputs, targets)
                self.on_phase("forward_done")
                per_sample.sum().backward()
        self.on_phase("_clip_inputs_saved")  # the rank's gradients, sent and received: name them
        grads, self.gathered = self.gathered.land(), None
        per_layer = self.clipping == "per_layer"
        # every rank clips the same global batch: its clipped samples are counted once
        counts = self.clipped_counts if torch.distributed.get_rank() == 0 else None
        params = self.engine.params
        clip_per_sample(params, grads, self.clip_factors, self.batch_size, per_layer, counts)
        self.on_phase("backward_done")
        return per_sample.detach().sum()

    def discard_step_state(self):
        super().discard_step_state()
        self.engine.release()
        self.held_sums.clear()

    def noise_std(self) -> float:  # the gradients hold sum_b c_b g_b / B: N(0, (sigma C)^2) / B
        return self.noise_multiplier * self.max_grad_norm / self.batch_size

    def empty_batch_gradients(self):  # DDP: zeros, rank 0's noise, summed over the ranks
        self.gathering = False  # no chunks this step
        sink = self.distributed_mode.gradient_sink(True, self.noise_std(), add_gaussian_noise)
        if sink:
            sink.finish(self.engine.params)

    def optimizer_step(self):
        params = self.engine.params
        for p in params:
            if p.grad is None:  # a layer the batch never reached still gets noise
                p.grad = torch.zeros_like(p)
        # Noise once per coordinate. DDP: rank 0's, in the sum over ranks (the sink), or, gathering,
        # one draw on every replica (a generator seeded alike, once); FSDP2: each rank's shard's,
        # from a generator of its own (made here, not left to the caller to seed each rank).
        if self.noise_std() > 0 and (not self.distributed_mode.replicates or self.gathering):
            shards = self.distributed_mode.shards
            if (self.gathering or shards) and self.noise_generator is None:
                self.noise_generator = collectives.seeded_generator(
                    params[0].device, per_rank=shards
                )
            add_gaussian_noise(
                buckets.local_gradients(params), self.noise_std(), self.noise_generator
            )
        self.optimizer.step()

    def noise_sampler(self):  # what add_gaussian_noise uses for tensors laid out as these
        return noise_sampler(self.engine.params)

    def result_extras(self) -> dict:  # the route each Linear layer's norms took, its sizes
        return {"flash_routes": self.engine.routes()}

    def dp_state_tensors(self):
        names = {id(m): n for n, m in self.model.named_modules()}
        held = [(role, names.get(id(m), ""), t) for m, role, t in self.engine.kept_tensors()]
        gathered = self.gathered.tensors() if self.gathered else []
        sums = [("gradients", "", t) for _, t in self.held_sums.values()]  # FSDP2, "logical"
        return held + [("per_sample_gradients", "", t) for t in gathered] + sums

    def dp_allocation_sites(self):  # ALLOCATION_SITES lists its roles in order of precedence
        sites, gathered = {**ALLOCATION_SITES}, buckets.GatheredGradients
        sites["per_sample_gradients"] += (gathered.start_gather, gathered.land)  # its gathers
        return [AllocationSite.of(role, *fns) for role, fns in sites.items()]
