"""The non-private baseline."""

from __future__ import annotations

import contextlib

from dp_cost.parallel import ddp
from dp_cost.stepping.protocol import CaptureSupport
from dp_cost.training.base import Trainer


class StandardTrainer(Trainer):
    """Non-private baseline: the same loss, no clipping, no noise."""

    name = "standard"
    supports_activation_checkpointing = True
    capturable = True

    def __init__(self, model, settings, phases):
        super().__init__(model, settings, phases)
        self.optimizer = self.make_optimizer([p for p in model.parameters() if p.requires_grad])
        replicated = settings.mode.replicates
        self.forward_model = ddp.data_parallel(model, settings.cuda_graph) if replicated else model
        self.capture = CaptureSupport(ready=self.captures_after_this)

    def captures_after_this(self) -> bool:  # DDP's 11th iteration or later
        return not self.settings.mode.replicates or self.forward_model.captures_after_this()

    def chunk_step(self, chunk):
        # DDP sums the gradients over the ranks once per logical batch, after its last chunk;
        # FSDP2 reduce-scatters after every chunk, or (fsdp_sync "logical") after the last.
        mode = self.settings.mode
        if mode.shards:
            self.model.set_requires_gradient_sync(chunk.is_last or self.settings.sync_every_chunk)
        no_sync = mode.replicates and not chunk.is_last
        with self.forward_model.no_sync() if no_sync else contextlib.nullcontext():
            per_sample = self.per_sample_losses(self.forward_model, chunk)
            self.phases("forward_done")
            # Scale so the accumulated gradient is the mean over the whole logical batch.
            (per_sample.sum() / self.batch_size).backward()
        self.phases("backward_done")
        return per_sample.detach().sum()
