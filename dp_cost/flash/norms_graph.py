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
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

# Replay the norms where their inputs' key repeats (CUDA only). False: always eager.
REPLAY_NORMS = True
# Graphs kept, the most recently used: a replay leaves the allocator as an eager chunk does not
# (the graph's outputs live in its own pool), so the chunks after an eager one and after a
# replay may see their inputs at two sets of addresses; each gets its graph.
KEPT_GRAPHS = 3
KEYS_REMEMBERED = 8  # keys seen once, waiting for a second sighting to be captured


class Captured(NamedTuple):
    graph: Any
    outputs: Any  # what compute returned inside the capture
    state: Any  # the caller's state right after the captured compute


class NormsGraph:
    """The captured norms phases, by the key of the inputs each was captured on. A key seen a
    second time is captured (the first time runs eagerly: a shape seen once, e.g. one Poisson
    draw, costs no capture); a later chunk with a captured key replays it; any other runs
    eagerly. A capture that fails is not tried again."""

    def __init__(self):
        self.captured: OrderedDict[tuple, Captured] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()
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
        """compute()'s result for inputs of ``key``: replayed, or computed (and captured after,
        on a second sighting). ``get_state``/``set_state``: the caller's caches that compute
        fills with its outputs (after a replay: as the captured compute left them)."""
        if self._capturing():  # inside another capture: part of it
            return compute()
        if key in self.captured:
            self.captured.move_to_end(key)
            captured = self.captured[key]
            captured.graph.replay()
            set_state(captured.state)
            self.replays += 1
            return captured.outputs
        self.eager_runs += 1
        before = get_state()
        result = compute()  # on the current stream, as every eager chunk: the same allocations
        if self.error is None and key in self.seen:
            del self.seen[key]
            after = get_state()
            set_state(before)  # empty caches: the capture runs every launch
            self._capture(key, compute, get_state)
            set_state(after)
        else:
            self.seen[key] = None
            if len(self.seen) > KEYS_REMEMBERED:
                self.seen.popitem(last=False)
        return result

    def _capture(self, key, compute, get_state) -> None:
        """Capture compute on a side stream: its allocations come from the graph's own pool, so
        the allocator's other blocks are left as the eager compute left them."""
        graph = self._new_graph()
        try:
            with self._side_stream():
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    outputs = compute()
                finally:
                    graph.capture_end()
                state = get_state()
        except RuntimeError as error:  # e.g. an op that syncs with the host
            self.error = (str(error).strip().splitlines() or ["?"])[0][:300]
            return
        self.captured[key] = Captured(graph, outputs, state)
        self.captures += 1
        if len(self.captured) > KEPT_GRAPHS:
            self.captured.popitem(last=False)

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
