"""A trainer's step (forward, backward, clipping, noise, optimizer) captured as CUDA graphs of
one padded physical chunk and of the finishing step, after an eager step at the chunk's shape,
and replayed for every later batch, whatever size Poisson sampling draws.

Why: a short step's host work (Python, autograd, one launch per kernel) can take as long as its
GPU work, most for flash's per-layer hooks, and then any jitter of the host lands on the step.
A replayed chunk is one launch. What it needs from a trainer: chunk steps and a finish with
no host sync (``Trainer.capture``), and a ``start_step`` that forgets a failed capture.

Under DDP every rank captures and replays the same step, its collectives (DDP's all-reduce,
flash's sum over the ranks, the loss's sum) inside the graphs: NCCL's captured collectives run
at each replay, so every rank must replay when the others do, as many chunks as the busiest
rank (a rank with fewer samples pads with stand-ins). Each such decision (capture, how many
chunks) is taken by all the ranks together, on every rank's batch.
"""

from __future__ import annotations

import contextlib

import torch

from dp_cost.parallel import ddp
from dp_cost.stepping import chunks
from dp_cost.stepping.protocol import StepPlan

MB = 2**20


class ChunkGraphs:
    """The captured step of one trainer: its start (gradients zeroed), the padded chunk step of
    P samples (under DDP two, a chunk that does not sync and the last one, which does) and the
    finishing step (optimizer, noise where the trainer adds it there, the step's loss summed
    over the ranks). A logical batch of n samples replays the start, ceil(n / P) chunks, the
    last one padded, then the finishing step; the chunk inputs, targets and sample weights are
    the graphs' own tensors, filled before each replay. torch's CUDA generators are
    replay-aware: every replay draws fresh noise.

    The gradients accumulate over the replayed chunks into tensors that exist before the
    capture (the parameters' .grad), which hold the step's gradient after it, as an eager
    step's do. The graphs share one memory pool (they replay one after another), so their peak
    is one padded chunk step's, the peak users get; the capture goes through the allocator as
    an eager step does, so the allocator's peak during it is the step's, and a replay
    allocates nothing."""

    def __init__(self, runner, inputs: torch.Tensor, targets: torch.Tensor):
        device = inputs.device
        self.size = runner.physical_size()
        # the plan every captured chunk and finish runs under: padded, at least one chunk
        self.plan = StepPlan(busiest_batch=self.size, chunk_count=1, padded=True)
        self.chunk = chunks.new_padded_chunk(inputs, targets, self.size)
        # Real rows: a rank with no sample replays on what the chunk holds, finite then too.
        chunks.fill_chunk(self.chunk, inputs, targets, 0)
        self.totals = torch.zeros(2, device=device)  # [real samples' loss sum, their count]
        # The step's totals over every rank: outside the graphs' pool, so no graph's
        # temporaries share its memory between the finishing replay and the read after it.
        self.step_totals = torch.zeros(2, device=device)
        params = runner.trainer.parameters
        for p in params:  # the gradients the chunks accumulate into
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grads = [(p, p.grad) for p in params]
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        self.chunk_graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        pool = None
        # One process: every chunk is alike. DDP: the last chunk syncs (standard's reducer,
        # flash's sum over the ranks), the others do not.
        self.start_graph, pool = self._capture(runner, pool, self._start)
        for is_last in (False, True) if runner.mode.is_distributed else (True,):
            self.chunk_graphs[is_last], pool = self._capture(runner, pool, self._chunk, is_last)
        self.finish_graph, _ = self._capture(runner, pool, self._finish)
        torch.cuda.synchronize(device)
        self.peak_bytes = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()  # the eager steps' cached blocks: replays use the graphs' pool
        self.replays = self.chunk_replays = self.padding_samples = 0

    def _capture(self, runner, pool, body, *args):
        graph = torch.cuda.CUDAGraph()
        for generator in runner.trainer.capture.generators():  # each replay advances them
            graph.register_generator_state(generator)
        with runner.observing_phases(lambda name: None), torch.cuda.graph(graph, pool=pool):
            body(runner, *args)
        return graph, graph.pool()

    def _start(self, runner) -> None:
        torch._foreach_zero_([grad for _, grad in self.grads])
        self.totals.zero_()

    def _chunk(self, runner, is_last: bool) -> None:
        self.totals += runner.padded_chunk_step(self.chunk, is_last, self.plan)

    def _finish(self, runner) -> None:
        runner.trainer.finish_step(self.plan)
        self.step_totals.copy_(self.totals)
        runner.mode.sum_over_ranks(self.step_totals)  # in place

    def step(self, runner, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """Replay this batch's chunks and the finishing step; ``{"loss", ...}`` as eager_step's
        (the loss averages the real samples of every rank)."""
        captured = tuple(self.chunk[0].shape[1:]), tuple(self.chunk[1].shape[1:])
        if (tuple(inputs.shape[1:]), tuple(targets.shape[1:])) != captured:
            raise ValueError(
                f"the CUDA graphs were captured for samples of shape {captured[0]}, got "
                f"{tuple(inputs.shape[1:])}: one run's batches have one sequence length"
            )
        for p, grad in self.grads:  # an eager step between replays rebinds .grad
            p.grad = grad
        busiest = runner.mode.largest_batch(len(inputs), inputs.device)
        count = runner.padded_chunk_count(busiest, self.size)
        self.start_graph.replay()
        for k in range(count):
            real = chunks.fill_chunk(self.chunk, inputs, targets, k * self.size)
            last = k == count - 1  # one process: the one graph serves every chunk
            self.chunk_graphs.get(last, self.chunk_graphs[True]).replay()
            self.padding_samples += self.size - real
        self.chunk_replays += count
        if count == 0 and not runner.is_private:
            # Nothing drawn: the non-private step has no gradient, and its optimizer skips.
            runner.phases("step_done")
            return {"loss": None, "physical_step_times_ms": []}
        self.finish_graph.replay()  # after no chunk (nothing drawn): a DP trainer's noise alone
        self.replays += 1
        runner.phases("step_done")  # the chunks ran inside the graphs: no host clock
        loss_sum, real = self.step_totals.tolist()
        return {"loss": loss_sum / real if real else None, "physical_step_times_ms": []}


class Replayer:
    """A trainer's CUDA-graph state: off, waiting for its first batch to capture after,
    captured (then replaying every batch, whatever its size), or failed (every step eager, the
    error kept)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.graphs: ChunkGraphs | None = None
        self.error: str | None = None  # why the capture failed: the steps run eagerly
        self.eager_only = False  # set by eager()
        self.waited = False  # a batch came before the trainer could be captured

    def counts(self) -> dict:
        """What the replays ran so far: steps, chunks and padding samples."""
        graphs = self.graphs
        return {
            "replays": graphs.replays if graphs else 0,
            "chunk_replays": graphs.chunk_replays if graphs else 0,
            "padding_samples": graphs.padding_samples if graphs else 0,
        }

    @property
    def capture_peak_bytes(self) -> int | None:
        return self.graphs.peak_bytes if self.graphs else None

    def step(self, runner, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """One step of ``runner`` (stepping.runner.Runner): replayed once captured, else eager
        (and captured after, if it is the first that may be)."""
        if self.graphs is not None and not self.eager_only:
            return self.graphs.step(runner, inputs, targets)
        if self.captures_after(inputs, runner):
            return self.capture_after(runner, inputs, targets)
        return runner.eager_step(inputs, targets)

    def captures_after(self, inputs: torch.Tensor, runner) -> bool:
        """Is this step the eager one a capture follows? The first on CUDA with a sample on some
        rank, once the trainer's eager steps before a capture are taken."""
        waiting = self.enabled and self.graphs is None and self.error is None
        if not (waiting and not self.eager_only and inputs.is_cuda):
            return False
        if not runner.mode.largest_batch(len(inputs), inputs.device):
            return False
        self.waited = not runner.trainer.capture.ready()  # alike on every rank
        return not self.waited

    def capture_after(self, runner, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """Run this step eagerly as padded chunks on a side stream, as capture needs (autograd,
        cuBLAS and Triton set up their state and tune there, at the chunk's shape, not inside
        the capture), then capture the next ones. Returns the eager step's output."""
        current = torch.cuda.current_stream(inputs.device)
        side = torch.cuda.Stream(inputs.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            # Under DDP at least two chunks: the chunk that does not sync runs too before its
            # capture (an all-padding chunk more changes nothing).
            warm = 2 if runner.mode.is_distributed else 1
            out = runner.padded_step(inputs, targets, runner.physical_size(), min_chunks=warm)
        current.wait_stream(side)
        try:
            self.graphs = ChunkGraphs(runner, inputs, targets)
        except RuntimeError as error:  # e.g. a host sync inside a model's forward
            # torch.cuda.graph's exit raises again for an invalidated capture before it restores
            # the stream, and the first error (the cause) is then the context of the second.
            torch.cuda.set_stream(current)
            size = runner.physical_size()  # forget what the capture left
            runner.trainer.start_step(StepPlan(size, chunk_count=1, padded=True))
            torch.cuda.synchronize(inputs.device)
            cause = error.__context__ or error
            self.error = (str(cause).strip().splitlines() or ["?"])[0][:300]
        # A failed capture leaves DDP's reducer and the noise generators mid-step, and a rank
        # replaying collectives another rank does not would wait for it: under DDP, every
        # rank's config ends with an error.
        captured = self.graphs is not None
        mode = runner.mode
        if mode.is_distributed and not mode.on_every_rank(captured, inputs.device):
            raise RuntimeError(
                f"the CUDA graph capture failed on a rank ({self.error or 'another rank'}): "
                "run --distributed without --cuda_graph"
            )
        return out

    @contextlib.contextmanager
    def eager(self):
        """Steps run eagerly inside (a measurement that reads the allocator's events: a replay
        allocates nothing); the graphs are kept for the steps after."""
        saved, self.eager_only = self.eager_only, True
        try:
            yield
        finally:
            self.eager_only = saved

    def result(self) -> dict:
        """The ``cuda_graph`` result key: captured or not (and why not), the chunk size, what
        the replays ran, the capture's peak (the padded chunk's: the peak users get)."""
        graphs = self.graphs
        out = {
            "captured": graphs is not None,
            "physical_batch_size": graphs.size if graphs else None,
            **self.counts(),
            "capture_peak_mb": graphs.peak_bytes / MB if graphs else None,
            "error": self.error,
        }
        if graphs is None and self.error is None and self.waited:
            out["error"] = (
                f"standard under DDP is captured after DDP's {ddp.EAGER_ITERATIONS}th iteration "
                f"(DDP times the first ones with CUDA events): give --warmup_steps "
                f"{ddp.EAGER_ITERATIONS} or more; every step ran eagerly"
            )
        elif graphs is None and self.error is None:
            out["error"] = "no step on CUDA had a sample to capture after: every step ran eagerly"
        return out
