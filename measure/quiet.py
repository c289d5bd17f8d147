"""What a worker prints: known-harmless library noise is dropped, everything else shows.

The profiler's C++ side writes ``USDT ... profiler_start/stop`` and CPU-allocator warnings
straight to file descriptor 2, below Python, so the worker's fd 2 is a pipe read by a thread
that forwards every other line to the real stderr. Python warnings are filtered by their exact
message. ``--verbose`` turns all of it off.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import warnings

# Lines the C++ profiler writes on every traced or memory-measured step.
NOISE_LINES = (
    re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$"),
    re.compile(r"CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before"),
)
# Known-harmless warnings, by the start of their exact message.
HARMLESS_WARNINGS = (
    # Opacus' hooks, on every backward of a model whose inputs need no grad (token ids).
    "Full backward hook is firing when gradients are computed with respect to module outputs",
    # transformers' own LoRA/peft path calls its deprecated name.
    "`is_gradient_checkpointing` is deprecated and will be removed in v6.",
)


def is_noise(line: str) -> bool:
    return any(pattern.search(line) for pattern in NOISE_LINES)


def filter_warnings() -> None:
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message))


@contextlib.contextmanager
def quiet_stderr():
    """Inside: fd 2 goes through a filter that drops ``NOISE_LINES`` and forwards the rest."""
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    forwarder = threading.Thread(target=_forward, args=(read_end, real), daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end: the forwarder sees EOF
        forwarder.join(timeout=5)
        os.close(real)


def _forward(read_end: int, target: int) -> None:
    with os.fdopen(read_end, "rb") as pipe:
        for raw in pipe:
            if not is_noise(raw.decode(errors="replace")):
                os.write(target, raw)
