"""The non-private baseline."""

from __future__ import annotations

import contextlib

from dp_cost.parallel import ddp
from dp_cost.training.base import Trainer


class StandardTrainer(Trainer):
    """Non-private baseline: the same loss, no clipping, no noise."""

    name = "standard"
    supports_activation_checkpointing = True
    capturable = True

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        replicated = self.distributed_mode.replicates
        self.forward_model = ddp.data_parallel(model, self.graphs.enabled) if replicated else model

    def captures_after_this(self):  # DDP's 11th iteration or later
        return not self.distributed_mode.replicates or self.forward_model.captures_after_this()

    def chunk_step(self, inputs, targets, is_last):
        # DDP sums the gradients over the ranks once per logical batch, after its last chunk;
        # FSDP2 reduce-scatters after every chunk, or (fsdp_sync "logical") after the last.
        if self.distributed_mode.shards:
            self.model.set_requires_gradient_sync(is_last or self.fsdp_sync == "chunk")
        no_sync = self.distributed_mode.replicates and not is_last
        with self.forward_model.no_sync() if no_sync else contextlib.nullcontext():
            with self.autocast(inputs.device.type):
                per_sample = self.per_sample_loss(self.forward_model, inputs, targets)
            self.on_phase("forward_done")
            # Scale so the accumulated gradient is the mean over the whole logical batch.
            (per_sample.sum() / self.batch_size).backward()
        self.on_phase("backward_done")
        return per_sample.detach().sum()
