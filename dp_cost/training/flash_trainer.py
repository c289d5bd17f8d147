"""Flash Clipping's trainer: one backward, exact per-sample norms, clipped gradients by one GEMM
per layer (the engine in ``dp_cost.flash``), and its collectives when there are several ranks."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from dp_cost.core import recompute
from dp_cost.core.schema import AllocationSite
from dp_cost.flash import (
    ALLOCATION_SITES,
    FlashClipping,
    add_gaussian_noise,
    clip_per_sample,
    cuda_graphs,
)
from dp_cost.flash import sinks as flash_sinks
from dp_cost.parallel import collectives, fsdp
from dp_cost.stepping.protocol import CaptureSupport
from dp_cost.training.base import PrivateTrainer
from dp_cost.training.clipping import ClippingRule

# flash under DDP gathers per-sample gradients instead of summing clipped ones
# (flash_sinks.GatheredGradients) at this many ranks: the one count where an all-gather moves
# no more bytes than an all-reduce.
GATHER_RANKS = 2

# What flash does with a checkpointed block (result.json's flash_checkpointing), by clipping
CHECKPOINTED_DESIGN = {
    ClippingRule.PER_LAYER: (
        "one backward: each layer's input (from its block's recomputation) and output "
        "gradient held to the end of that block's backward, where its clipped sums are made"
    ),
    ClippingRule.FLAT: (
        "two backwards: the first makes each block's per-sample norms as its backward ends; "
        "the second (each block recomputed again) its clipped sums; a block's inputs and "
        "output gradients are held to the end of its own backward only"
    ),
}


def gathers_per_sample(mode, plan) -> bool:
    """Whether flash's step gathers per-sample gradients: DDP over two ranks with one sample
    each, where each rank's gradient is its per-sample gradient. Taken from the plan (the
    busiest rank's batch, alike on every rank); a padded step (any number of chunks, a graph's
    own .grad) sums clipped gradients."""
    return (
        mode.replicates
        and not plan.padded
        and mode.world_size == GATHER_RANKS
        and plan.busiest_batch == 1
    )


class FlashClippingTrainer(PrivateTrainer):
    """Ours: one forward, one backward, exact per-sample norms by the cheaper route per layer
    (book-keeping, Bu et al. 2023: each layer's input A and output gradient G, or its per-sample
    gradients where smaller; then each layer's clipped gradient as one GEMM or weighted sum)."""

    name = "flash"
    gathered: flash_sinks.GatheredGradients | None = None  # its gathers, while they hold memory
    landing: flash_sinks.GradientBuckets | None = None  # the step's last sink, pending
    # FSDP2 reducing every chunk: the chunk before's last reduce-scatters, pending into this
    # chunk's forward (``chunk_forward``)
    carried: flash_sinks.ShardedGradients | None = None
    options = ("flash_route",)
    capturable = True  # its tape, hooks, kernels and tables make no host sync (tests check it)
    supports_activation_checkpointing = True  # each input kept from its block's recomputation
    noise_generator: torch.Generator | None = None  # its own, where it needs one (made once)

    def __init__(self, model, settings, phases, *, flash_route: str = "auto"):
        super().__init__(model, settings, phases)
        contexts = recompute.recompute_contexts(model)  # None: not checkpointed
        self.engine = FlashClipping(model, route=flash_route, checkpointed=contexts)
        self.held_sums: dict = {}  # FSDP2, fsdp_sync "logical": flash_sinks.HeldSums' sums
        # FSDP2: its units in forward order; those of the next chunk's forward this chunk
        # gathers after its backward (prefetch_next_forward), if any
        self.forward_units = fsdp.forward_units(model) if settings.mode.shards else []
        self.next_forward_units: list[FSDPModule] = []
        try:
            self.optimizer = self.make_optimizer(list(self.engine.params))
        except Exception:
            self.engine.remove()  # leave the model as it was given: its forwards, trainable
            raise
        self.checkpointed = self.engine.checkpointed  # the model's checkpoint contexts, or None
        if self.checkpointed is not None:  # each block as its backward ends (set before the
            self.engine.clip_each_block(self.clip_block)  # forward: its records take G by hook)
        # This chunk: where the clipped sums go; the squared norms and clip factors of the
        # groups done so far ([P, B] per-layer, each parameter's row from one group, the other
        # groups' factors 1; [B] flat); flat clipping of a checkpointed model, in its second
        # backward: the clip factors (chunk_factors)
        self.chunk_sink, self.chunk_squared, self.chunk_factors = None, None, None
        if settings.mode.replicates:  # no DDP wrapper: flash sums its clipped gradients
            collectives.broadcast_parameters(model)
        self.describe_privacy("exact64", 0.0)  # add_gaussian_noise's law on every device
        self.capture = CaptureSupport(generators=self.generators)
        self.phases("privacy_wrapped")

    def generators(self) -> list[torch.Generator]:
        return [] if self.noise_generator is None else [self.noise_generator]

    def start_step(self, plan):
        super().start_step(plan)
        self.engine.release()
        self.held_sums.clear()
        self.gathered = None  # a gathered step that failed: its buffers go with it
        self.landing = self.carried = None  # and the collectives a failed step left pending

    def chunk_step(self, chunk):
        if gathers_per_sample(self.settings.mode, chunk.plan):
            return self.gathered_chunk_step(chunk)
        per_sample = self.chunk_forward(chunk)
        self.phases("forward_done")
        # Several ranks: each collective starts once its clipped sum exists (the sink); FSDP2
        # with fsdp_sync "logical": held unsharded until the last chunk, sent once then.
        self.chunk_sink = self.gradient_sink(chunk.is_last)
        # Reducing every chunk only (with "logical" it was slower: fsdp.FORWARD_PREFETCH_UNITS);
        # never while captured (FSDP2 refuses --cuda_graph; a graph's gathers stay in it).
        prefetch = self.settings.sync_every_chunk and not chunk.is_last
        prefetch = prefetch and not cuda_graphs.capturing()
        units = self.forward_units[: fsdp.FORWARD_PREFETCH_UNITS] if prefetch else []
        self.next_forward_units = units
        try:
            self.clip_chunk(per_sample.sum())
        finally:  # also when it fails: a later step starts from nothing
            self.chunk_sink, self.chunk_squared, self.chunk_factors = None, None, None
            self.next_forward_units = []
        self.engine.release()
        self.phases("backward_done")
        return per_sample.detach().sum()

    def clip_chunk(self, loss: torch.Tensor) -> None:
        """The chunk's backward and clipped sums. ``loss``: the sum over samples, so each
        sample's G is exactly the gradient of its own loss. Each sample's norm comes from its
        own gradient, on its own rank: never reduced. Per-layer clipping: each parameter's
        norm on its own ([P, B]), against its own C_l. Checkpointed: block by block, and with
        flat clipping in two backwards (norms, then clipped sums)."""
        two_backwards = self.checkpointed is not None and not self.settings.clipping.per_layer
        if two_backwards:  # the first makes norms only: no G written, none copied
            self.engine.clip_each_block(self.clip_block, copy_gradients=False)
        self.engine.backward(loss, retain_graph=two_backwards)
        if not two_backwards:
            self.prefetch_next_forward()
        self.phases("_clip_inputs_saved")  # A, G and per-sample grads all held: name them
        if self.settings.clipping.per_layer:
            self.clip_block(self.engine, finish=True)
            self.clipped_counts.add(self.chunk_squared, self.chunk_factors)
            return
        self.clip_block(self.engine)  # flat: the norms of what the engine holds
        # 1/B folded into the clip factors (and the noise's std): no division pass after
        factors = self.clip_factors(self.chunk_squared.sqrt()) / self.batch_size
        if two_backwards:  # the clipped sums, each block's as its backward ends again
            self.engine.rearm()
            self.chunk_factors = factors
            self.engine.clip_each_block(self.clip_block, copy_gradients=True)
            self.engine.backward(loss)
            self.prefetch_next_forward()
        self.engine.accumulate_clipped_grads(factors, self.chunk_sink)

    def prefetch_next_forward(self) -> None:
        """FSDP2 reducing every chunk, a chunk before the step's last, its backwards done: the
        next chunk's first units (``next_forward_units``) all-gathered now. Their gathers run beside
        this chunk's norms and clipped sums, where the link carries only the clipped sums'
        reduce-scatters and the GEMMs that make them leave it idle at times; else each gather
        starts in the next forward, which at a few samples a rank waits on its gathers."""
        units, self.next_forward_units = self.next_forward_units, []
        fsdp.prefetch_forward(units)

    def clip_block(self, engine: FlashClipping, finish: bool = False) -> None:
        """What the engine holds, done (after the backward; with checkpointing also each block
        as its backward ends: FlashClipping.clip_each_block). Per-layer: each parameter's
        norms, clip factors and clipped sums into this chunk's sink. Flat: the per-sample norms
        (summed over the groups), or in a checkpointed model's second backward, the clipped
        sums by the factors the first one's norms gave."""
        if not self.settings.clipping.per_layer:
            if self.chunk_factors is not None:  # the second backward
                engine.accumulate_clipped_grads(self.chunk_factors, self.chunk_sink, finish)
                return
            squared, held = engine.per_sample_squared_norms(), self.chunk_squared
            self.chunk_squared = squared if held is None else held + squared
            return
        squared = engine.per_parameter_squared_norms()
        factors = self.clip_factors(squared.sqrt())
        if self.chunk_squared is None:
            self.chunk_squared, self.chunk_factors = squared, factors
        else:  # a parameter's row is its group's; 0 and 1 in the others
            self.chunk_squared = self.chunk_squared + squared
            self.chunk_factors = torch.minimum(self.chunk_factors, factors)
        engine.accumulate_clipped_grads(factors / self.batch_size, self.chunk_sink, finish)

    def gradient_sink(self, is_last: bool):
        """Where a chunk's clipped sums go instead of .grad (None: into .grad). The step's last
        collectives land in optimizer_step, group by group (``landing``)."""
        mode = self.settings.mode
        if not is_last:
            if not mode.shards:
                return None  # DDP: summed over the ranks in the last chunk only
            if not self.settings.sync_every_chunk:
                return flash_sinks.HeldSums(self.held_sums)
            # Captured, chunks are graphs of their own: its collectives land at its finish.
            lands = cuda_graphs.capturing()
            sink = flash_sinks.ShardedGradients(lands_at_finish=lands)
            self.carried = None if lands else sink
            return sink
        return self.landing_sink()

    def chunk_forward(self, chunk):
        """The chunk's per-sample losses. Where the chunk before left reduce-scatters pending
        (``carried``: what its sink's finish left, Llama's embedding's sum among them), they
        run beside this forward instead of alone at that chunk's end, and land once a quarter
        of the managed layers have run: what they hold is freed well before the forward's end,
        where the step's peak is."""
        carried, self.carried = self.carried, None
        if carried is None:
            return self.per_sample_losses(self.model, chunk)
        layers = self.engine.layers
        hook = layers[len(layers) // 4].module.register_forward_pre_hook(
            lambda module, args: carried.land_pending()
        )
        try:
            per_sample = self.per_sample_losses(self.model, chunk)
        finally:
            hook.remove()
        carried.land_pending()  # where that layer did not run (else nothing is left)
        return per_sample

    def landing_sink(self):
        """The sink of a step's last chunk (or of an empty batch) when there are several ranks:
        its collectives left pending for optimizer_step to land (``landing``), or landed at its
        finish where the step is being captured (None in one process)."""
        mode = self.settings.mode
        # Captured (--cuda_graph), the last chunk and the finish are graphs of their own, and a
        # collective started in one graph cannot be waited for in another: it lands at finish.
        lands = cuda_graphs.capturing()
        if mode.replicates:
            sink = flash_sinks.SummedGradients(lands_at_finish=lands)
        elif mode.shards:
            sink = flash_sinks.ShardedGradients(self.held_sums, lands_at_finish=lands)
        else:
            sink = None
        self.landing = None if lands else sink
        return sink

    def gathered_chunk_step(self, chunk):
        """DDP, one per rank: autograd's gradients, gathered; each rank clips the global batch."""
        with self.engine.autograd_gradients():  # its tape idle for the step, also if it fails
            with flash_sinks.GatheredGradients(self.engine.params, self.dtype) as self.gathered:
                per_sample = self.per_sample_losses(self.model, chunk)
                self.phases("forward_done")
                per_sample.sum().backward()
        self.phases("_clip_inputs_saved")  # the rank's gradients, sent and received: name them
        grads, self.gathered = self.gathered.land(), None
        per_layer = self.settings.clipping.per_layer
        # every rank clips the same global batch: its clipped samples are counted once
        counts = self.clipped_counts if torch.distributed.get_rank() == 0 else None
        params = self.engine.params
        clip_per_sample(params, grads, self.clip_factors, self.batch_size, per_layer, counts)
        self.phases("backward_done")
        return per_sample.detach().sum()

    def noise_std(self) -> float:  # the gradients hold sum_b c_b g_b / B: N(0, (sigma C)^2) / B
        return self.noise_multiplier * self.max_grad_norm / self.batch_size

    def finish_step(self, plan):
        if plan.is_empty and (sink := self.landing_sink()):
            # DDP: zeros summed over the ranks; FSDP2: the held sums' collectives, if any
            # (optimizer_step gives each replica or shard its zeros and noise)
            sink.finish(self.engine.params)
        self.optimizer_step()

    def optimizer_step(self):
        """Noise once per coordinate, after the sum, then the optimizer's step. Several ranks:
        group by group as the last collectives land (flash_sinks.LANDING_GROUPS), so each
        group's noise and step run beside the later groups' collectives."""
        params, landing, self.landing = self.engine.params, self.landing, None
        mode = self.settings.mode
        # DDP: one draw on every replica, from a generator the ranks seed alike; FSDP2: each
        # rank's shard's, from a generator of its own. Made here, once, not left to the caller
        # to seed each rank.
        if self.noise_std() > 0 and mode.is_distributed and self.noise_generator is None:
            self.noise_generator = collectives.seeded_generator(
                params[0].device, per_rank=mode.shards
            )
        # What has landed first (FSDP2 waits for its older reduce-scatters within the chunk),
        # beside every collective still pending; then the pending ones, group by group.
        pending = landing.pending_parameters() if landing is not None else set()
        landed = [p for p in params if id(p) not in pending]
        for p in landed:
            if p.grad is None:  # a layer the batch never reached still gets noise
                p.grad = torch.zeros_like(p)
        if landed:
            self.noise_and_step(landed)
        if landing is not None:
            for group in landing.landed_groups(flash_sinks.LANDING_GROUPS):
                self.noise_and_step(group)

    def noise_and_step(self, params: list) -> None:
        """``params``' noise and optimizer step (their gradients summed over the ranks)."""
        if self.noise_std() > 0:
            add_gaussian_noise(
                flash_sinks.local_gradients(params), self.noise_std(), self.noise_generator
            )
        if len(params) == len(self.parameters):
            self.optimizer.step()
            return
        chosen = {id(p) for p in params}
        groups = self.optimizer.param_groups
        # torch.optim steps every group it holds: hold only these parameters for one step
        # (hyperparameters and per-parameter state as they are)
        self.optimizer.param_groups = [
            {**group, "params": [p for p in group["params"] if id(p) in chosen]} for group in groups
        ]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups

    def result_extras(self) -> dict:  # the route each Linear layer's norms took, its sizes
        extras = {"flash_routes": self.engine.routes()}
        if self.checkpointed is not None:
            extras["flash_checkpointing"] = CHECKPOINTED_DESIGN[self.settings.clipping]
        return extras

    def dp_state_tensors(self):
        names = {id(m): n for n, m in self.model.named_modules()}
        held = [(role, names.get(id(m), ""), t) for m, role, t in self.engine.kept_tensors()]
        gathered = self.gathered.tensors() if self.gathered else []
        sums = [("gradients", "", t) for _, t in self.held_sums.values()]  # FSDP2, "logical"
        return held + [("per_sample_gradients", "", t) for t in gathered] + sums

    def dp_allocation_sites(self):  # ALLOCATION_SITES lists its roles in order of precedence
        sites, gathered = {**ALLOCATION_SITES}, flash_sinks.GatheredGradients
        sites["per_sample_gradients"] += (gathered.start_gather, gathered.land)  # its gathers
        return [AllocationSite.of(role, *fns) for role, fns in sites.items()]
