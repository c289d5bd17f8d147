"""A chunk's per-sample norms and clip factors replayed as one CUDA graph in the eager step,
while the tensors they read sit where they sat when it was captured.

Why: after the backward, the norms of every managed layer take a few hundred Python-level
steps (per layer: its routes, operands and kernel tables; the 1b model has 164 layers) for a few
milliseconds of GPU work, and where the host is slow the eager flash step waits for them. The
caching allocator hands out the same addresses for the same sequence of allocations, so from the
second step at one shape on, the tensors the norms read (each layer's A and G, the per-sample
gradients formed in the backward) are where they were: the graph captured then replays the same
launches on the new contents. The key of a chunk's inputs (FlashClipping.norms_inputs) says
whether they are; anything else runs eagerly, as before.

Memory: the graph's outputs (the clip factors, the norms, the small per-sample gradients'
concatenation the clipped sums read) and temporaries stay in its own pool between replays: a
few tens of MB at the 1b model, against the GB of gradients a graph of the clipped sums would
hold. Nothing is captured inside another capture (``--cuda_graph`` captures the whole step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

# Replay the norms where their inputs' key repeats (CUDA only). False: always eager.
REPLAY_NORMS = True


class NormsGraph:
    """One captured norms phase and the key of the inputs it was captured on. A key seen twice
    in a row is captured (the first time runs eagerly: a shape seen once, e.g. one Poisson
    draw, costs no capture); a later chunk with that key replays it; a new key runs eagerly.
    Keeps one graph: a capture replaces the last one. A capture that fails is not tried again."""

    def __init__(self):
        self.graph: Any = None
        self.key: tuple | None = None  # the key the graph was captured on
        self.outputs: Any = None  # what compute returned inside the capture
        self.state: Any = None  # the caller's state right after the captured compute
        self.last_key: tuple | None = None
        self.stream: torch.cuda.Stream | None = None
        self.error: str | None = None
        self.captures = self.replays = self.eager_runs = 0

    def counts(self) -> dict:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "eager": self.eager_runs,
            "error": self.error,
        }

    def run(
        self,
        key: tuple,
        compute: Callable[[], Any],
        get_state: Callable[[], Any],
        set_state: Callable[[Any], None],
    ) -> Any:
        """compute()'s result for inputs of ``key``: replayed, captured (and computed), or
        computed. ``get_state``/``set_state``: the caller's caches compute fills (set as the
        captured compute left them after a replay)."""
        if self._capturing():  # inside another capture: part of it
            return compute()
        if self.graph is not None and key == self.key:
            self.last_key = key
            self.graph.replay()
            set_state(self.state)
            self.replays += 1
            return self.outputs
        if self.error is not None or key != self.last_key:
            self.last_key = key
            self.eager_runs += 1
            return compute()
        return self._capture(key, compute, get_state, set_state)

    def _capture(self, key, compute, get_state, set_state) -> Any:
        """Compute eagerly on a side stream (this chunk's result; cuBLAS and Triton set up their
        state for that stream there, not inside the capture), then capture compute on it."""
        self.graph = self.key = self.outputs = self.state = None  # the old graph's pool goes
        before = get_state()
        with self._side_stream():
            result = compute()
            after = get_state()
            set_state(before)  # empty caches: the capture runs every launch
            graph = self._new_graph()
            try:
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    outputs = compute()
                finally:
                    graph.capture_end()
                captured_state = get_state()
            except RuntimeError as error:  # e.g. an op that syncs with the host
                self.error = (str(error).strip().splitlines() or ["?"])[0][:300]
                graph = None
        set_state(after)
        self.eager_runs += 1
        if graph is not None:
            self.graph, self.key, self.outputs, self.state = graph, key, outputs, captured_state
            self.captures += 1
        return result

    # The CUDA calls, apart (tests on the CPU replace them)

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    @contextlib.contextmanager
    def _side_stream(self):
        """Inside: this graph's own stream, after the current stream's work; the current stream
        waits for it after."""
        current = torch.cuda.current_stream()
        self.stream = self.stream or torch.cuda.Stream()
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    def _new_graph(self):
        return torch.cuda.CUDAGraph()
