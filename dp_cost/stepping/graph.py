"""A trainer's whole step (forward, backward, clipping, noise, optimizer) captured as one CUDA
graph after an eager step of the same shape, and replayed for every later one.

Why: a short step's host work (Python, autograd, one launch per kernel) can take as long as its
GPU work, most for flash's per-layer hooks, and then any jitter of the host lands on the step.
A replay is one launch. What it needs from a trainer: chunk steps and an optimizer step with
no host sync (``Trainer.capturable``) and ``discard_step_state``.

Under DDP every rank captures and replays the same step, its collectives (DDP's all-reduce,
flash's gathers, the loss's sum) inside the graph: NCCL's captured collectives run at each
replay, so every rank must replay when the others do. Each such decision (capture, replay) is
taken by all the ranks together, on every rank's batch.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from dp_cost.parallel import ddp
from dp_cost.stepping import chunks

if TYPE_CHECKING:
    from dp_cost.stepping.protocol import SteppingTrainer

MB = 2**20


class StepGraph:
    """One captured step. Replays run the captured kernels on the captured addresses: the
    parameters (updated in place) and the graph's own input tensors, which each replay fills
    with the batch. torch's CUDA generator is replay-aware: every replay draws fresh noise.

    The capture goes through the allocator like an eager step, in the graph's private pool, so
    the allocator's peak during the capture is the step's; a replay allocates nothing."""

    def __init__(self, trainer: SteppingTrainer, inputs: torch.Tensor, targets: torch.Tensor):
        device = inputs.device
        self.inputs, self.targets = inputs.clone(), targets.clone()
        self.graph = torch.cuda.CUDAGraph()
        if trainer.shared_noise is not None:  # each replay advances it, as the default one
            self.graph.register_generator_state(trainer.shared_noise)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        with trainer.observing_phases(lambda name: None), torch.cuda.graph(self.graph):
            self.loss_sum = chunks.device_step(trainer, self.inputs, self.targets)
        torch.cuda.synchronize(device)
        # The gradients the graph writes: an eager step between replays rebinds .grad, so each
        # replay binds these again (the optimizer inside the graph reads them either way).
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        self.grads = [(p, p.grad) for p in params]
        self.peak_bytes = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()  # the eager steps' cached blocks: replays use the graph's pool
        self.replays = 0

    def fits(self, inputs: torch.Tensor, targets: torch.Tensor) -> bool:
        def spec(t):
            return t.shape, t.dtype, t.device

        return (spec(inputs), spec(targets)) == (spec(self.inputs), spec(self.targets))

    def replay(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.inputs.copy_(inputs)
        self.targets.copy_(targets)
        self.graph.replay()
        self.replays += 1
        for p, grad in self.grads:
            p.grad = grad
        return self.loss_sum


class Replayer:
    """A trainer's CUDA-graph state: off, waiting for its first full-sized batch, captured (then
    replaying every batch of that shape), or failed (every step eager, the error kept)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.graph: StepGraph | None = None
        self.error: str | None = None  # why the capture failed: the steps run eagerly
        self.eager_only = False  # set by eager()
        self.waited = False  # a full batch came before the trainer could be captured

    @property
    def replays(self) -> int:
        return self.graph.replays if self.graph else 0

    def step(self, trainer: SteppingTrainer, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """One step of ``trainer``: replayed if a graph fits the batch, else eager (and captured
        after, if it is the first full-sized one)."""
        graph = self.graph
        if graph is not None and not self.eager_only:
            if trainer.distributed_mode.on_every_rank(graph.fits(inputs, targets), inputs.device):
                loss_sum = graph.replay(inputs, targets)  # the global batch's (summed over ranks)
                trainer.on_phase("step_done")  # the chunks ran inside the graph: no host clock
                loss = loss_sum.item() / (len(inputs) * trainer.world_size)
                return {"loss": loss, "physical_step_times_ms": []}
        if self.captures_after(inputs, trainer):
            return self.capture_after(trainer, inputs, targets)
        return chunks.eager_step(trainer, inputs, targets)

    def captures_after(self, inputs: torch.Tensor, trainer: SteppingTrainer) -> bool:
        """Is this step the eager one a capture follows? The first full-sized batch on CUDA (on
        every rank: its share of the global batch) once the trainer's eager steps before a
        capture are taken; other sizes (Poisson draws) always run eagerly."""
        waiting = self.enabled and self.graph is None and self.error is None
        if not (waiting and not self.eager_only and inputs.is_cuda):
            return False
        full = len(inputs) == trainer.batch_size // trainer.world_size
        if not trainer.distributed_mode.on_every_rank(full, inputs.device):
            return False
        self.waited = not trainer.captures_after_this()  # alike on every rank
        return not self.waited

    def capture_after(
        self, trainer: SteppingTrainer, inputs: torch.Tensor, targets: torch.Tensor
    ) -> dict:
        """Run this step eagerly on a side stream, as capture needs (autograd, cuBLAS and Triton
        set up their state and tune there, not inside the capture), then capture the next ones.
        Returns the eager step's output."""
        current = torch.cuda.current_stream(inputs.device)
        side = torch.cuda.Stream(inputs.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = chunks.eager_step(trainer, inputs, targets)
        current.wait_stream(side)
        try:
            self.graph = StepGraph(trainer, inputs, targets)
        except RuntimeError as error:  # e.g. a host sync inside a model's forward
            # torch.cuda.graph's exit raises again for an invalidated capture before it restores
            # the stream, and the first error (the cause) is then the context of the second.
            torch.cuda.set_stream(current)
            trainer.discard_step_state()
            torch.cuda.synchronize(inputs.device)
            cause = error.__context__ or error
            self.error = (str(cause).strip().splitlines() or ["?"])[0][:300]
        # A failed capture leaves DDP's reducer and the noise generators mid-step, and a rank
        # replaying collectives another rank does not would wait for it: under DDP, every
        # rank's config ends with an error.
        captured = self.graph is not None
        mode = trainer.distributed_mode
        if mode.is_distributed and not mode.on_every_rank(captured, inputs.device):
            raise RuntimeError(
                f"the CUDA graph capture failed on a rank ({self.error or 'another rank'}): "
                "run --distributed without --cuda_graph"
            )
        return out

    @contextlib.contextmanager
    def eager(self):
        """Steps run eagerly inside (a measurement that reads the allocator's events: a replay
        allocates nothing); the graph is kept for the steps after."""
        saved, self.eager_only = self.eager_only, True
        try:
            yield
        finally:
            self.eager_only = saved

    def result(self, batch_size: int) -> dict:
        """The ``cuda_graph`` result key: captured or not (and why not), replays, its peak."""
        graph = self.graph
        out = {
            "captured": graph is not None,
            "replays": graph.replays if graph else 0,
            "capture_peak_mb": graph.peak_bytes / MB if graph else None,
            "error": self.error,
        }
        if graph is None and self.error is None and self.waited:
            out["error"] = (
                f"standard under DDP is captured after DDP's {ddp.EAGER_ITERATIONS}th iteration "
                f"(DDP times the first ones with CUDA events): give --warmup_steps "
                f"{ddp.EAGER_ITERATIONS} or more; every step ran eagerly"
            )
        elif graph is None and self.error is None:
            out["error"] = (
                f"no step had a batch of {batch_size} samples to capture after (Poisson batches "
                "vary in size; --no_poisson makes every batch full-sized): every step ran eagerly"
            )
        return out
