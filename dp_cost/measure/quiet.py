"""What a worker prints: known-harmless library noise is dropped, everything else shows.

The profiler's C++ side writes ``USDT ... profiler_start/stop`` and CPU-allocator warnings
straight to file descriptor 2, below Python, so the worker's fd 2 is the write end of a pipe that
a thread in the parent reads, forwarding every other line to the parent's stderr. The reader is
in the parent so that a worker that aborts or segfaults loses nothing it wrote (its fatal
message, faulthandler's traceback), and a large write in the worker never waits on a thread of
its own. Python warnings are filtered in the worker: by their exact message, and the profiler's
own by the module that raises them. ``--verbose`` turns all of it off.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings

from dp_cost.core import interrupts

# Lines the C++ profiler writes on every traced or memory-measured step; its warnings about the
# events it collects (collection.cpp, when no Python code is there to turn them into warnings);
# Kineto's, once per trace line it cannot write while the disk is full (the full disk is
# reported once, by the write of the result); torch's note that a CPU group's all-to-all (ghost
# clipping under FSDP2) falls back to an all-gather, a fact of the CPU run, not of the config.
NOISE_LINES = (
    re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$"),
    re.compile(r"CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before"),
    re.compile(r"^\[W[^\]]*\bcollection\.cpp:\d+\]"),
    re.compile(r"Failed to write to log file!\s*$"),
    # torch's gloo (and --mode=capacity's planned ranks) all-to-all, done by an all-gather
    re.compile(r"CPU process group does not support alltoall yet, falling back with allgather"),
)
# Known-harmless warnings, by the start of their exact message.
HARMLESS_WARNINGS = (
    # Opacus' hooks, on every backward of a model whose inputs need no grad (token ids).
    "Full backward hook is firing when gradients are computed with respect to module outputs",
    # transformers' own LoRA/peft path calls its deprecated name.
    "`is_gradient_checkpointing` is deprecated and will be removed in v6.",
    # FSDP2 on a model whose blocks return views (our residual adds are out of place).
    "FSDP2-wrapped module",
    # flash's reduce-scatter into FSDP2 shards: the name torch 2.11 (the GPU image) still has.
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    # flash's all-gather of per-sample gradients (DDP, one sample per rank): likewise.
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    # standard under DDP with --cuda_graph: DDP is built on a side stream, as a capture needs,
    # and its eager steps before the capture run on the current one (an extra stream wait).
    "The AccumulateGrad node's stream does not match the stream of the node that produced",
)


# The profiler's own warnings (its schedule, its event collection, a device it cannot trace):
# about the trace, a by-product, never about a measurement. Raised in these modules, or in its
# C++ event collection, which torch turns into a warning with the file it came from.
PROFILER_MODULES = r"torch\.profiler(\.|$)|torch\.autograd\.profiler(_util)?$"
PROFILER_INTERNAL = r"(?s).*\(Triggered internally at \S*\bprofiler[/\\]collection\.cpp:\d+"


def is_noise(line: str) -> bool:
    return any(pattern.search(line) for pattern in NOISE_LINES)


def filter_warnings() -> None:
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message))
    warnings.filterwarnings("ignore", module=PROFILER_MODULES)
    warnings.filterwarnings("ignore", message=PROFILER_INTERNAL)


class FilteredStderr:
    """A pipe for one worker's fd 2, drained in this (the parent) process.

    Create it before forking; the worker calls ``attach()``; the parent calls ``started()``
    after the fork and ``close()`` once the worker has exited (EOF ends the reader)."""

    def __init__(self, target_fd: int = 2):
        self.read_end, self.write_end = os.pipe()
        self.closed = False
        self.reader = threading.Thread(
            target=_forward, args=(self.read_end, target_fd), daemon=True
        )

    def attach(self) -> None:
        """In the worker: fd 2 becomes the pipe."""
        sys.stderr.flush()
        os.dup2(self.write_end, 2)
        os.close(self.write_end)
        os.close(self.read_end)

    def started(self) -> None:
        """In the parent, after the fork: keep only the read end and start reading. Run whole:
        an interrupt inside ``Thread.start`` would leave a thread that exists but has not said
        it started, which ``close()`` could neither join nor leave (it is raised after)."""
        with interrupts.held():
            write_end, self.write_end = self.write_end, None  # close() must not close it again
            os.close(write_end)
            self.reader.start()

    def close(self, timeout: float = 10.0) -> None:
        """In the parent, once the worker has exited (or never started); once only."""
        if self.closed:
            return
        self.closed = True
        if self.write_end is not None:  # the fork never happened: nobody reads the pipe
            os.close(self.write_end)
            os.close(self.read_end)
            return
        if self.reader.ident is None:  # started() failed between its close and its start
            os.close(self.read_end)
            return
        # A grandchild still holding the write end would keep the pipe open: do not wait forever.
        self.reader.join(timeout)


def _forward(read_end: int, target: int) -> None:
    gone = False  # the terminal is gone (a dropped ssh session): drained all the same, so the
    # worker never blocks on a full pipe
    with os.fdopen(read_end, "rb") as pipe:
        for raw in pipe:
            if not gone and not is_noise(raw.decode(errors="replace")):
                try:
                    os.write(target, raw)
                except OSError:
                    gone = True
