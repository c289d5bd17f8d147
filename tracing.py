"""torch.profiler traces of a few extra steps, for TensorBoard, Perfetto and chrome://tracing.

The traced steps run after the timed steps, so profiler overhead never enters reported times.
Each config directory receives its own trace file(s) and is one run for
``tensorboard --logdir=./runs`` (the plugin treats any directory holding ``*.pt.trace.json[.gz]``
as a run).
"""

from __future__ import annotations

import glob
import os

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

# wait / warmup / active steps: the first step re-primes caches after the timed loop, the
# warm-up step lets the profiler settle, the active step is the one recorded.
WAIT, WARMUP, ACTIVE = 1, 1, 1


def trace_steps(step, device: torch.device, out_dir: str, use_gzip: bool) -> str | None:
    """Run ``step()`` under the profiler schedule; return the path of the trace written."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    before = set(trace_files(out_dir))
    with profile(
        activities=activities,
        schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=tensorboard_trace_handler(out_dir, worker_name="trace", use_gzip=use_gzip),
        profile_memory=True,  # the Memory view
        record_shapes=True,  # the Operator view's input shapes
        with_stack=True,  # the Module view and source lines in the Trace view
    ) as prof:
        for _ in range(WAIT + WARMUP + ACTIVE):
            with torch.profiler.record_function("train_step"):
                step()
            prof.step()
    new = sorted(set(trace_files(out_dir)) - before)
    return new[-1] if new else None


def trace_files(directory: str) -> list[str]:
    return glob.glob(os.path.join(directory, "*.pt.trace.json")) + glob.glob(
        os.path.join(directory, "*.pt.trace.json.gz")
    )
