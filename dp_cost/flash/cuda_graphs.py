"""Whether a CUDA graph is being captured: flash's kernels keep their device tables alive for
the graph's replays then, and its step's last collectives land inside the graph that started
them."""

from __future__ import annotations

import torch


def capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
