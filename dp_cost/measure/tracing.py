"""torch.profiler traces of a few extra steps, for TensorBoard, Perfetto and chrome://tracing.

The traced steps run after the timed steps, so profiler overhead never enters reported times.
Each config directory receives its own trace file(s) and is one run for
``tensorboard --logdir=./runs`` (the plugin treats any directory holding ``*.pt.trace.json[.gz]``
as a run).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

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
    # The handler writes into a private folder; the finished file is then renamed into the
    # config directory, so an interrupted run never leaves a half-written trace there.
    staging = tempfile.mkdtemp(prefix=".trace-", dir=out_dir)
    # One trace per rank in the config directory: TensorBoard's distributed view reads them.
    distributed = torch.distributed.is_initialized()
    worker = f"rank{torch.distributed.get_rank()}" if distributed else "trace"
    with profile(
        activities=activities,
        schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=tensorboard_trace_handler(staging, worker_name=worker, use_gzip=use_gzip),
        profile_memory=True,  # the Memory view
        record_shapes=True,  # the Operator view's input shapes
        with_stack=True,  # the Module view and source lines in the Trace view
    ) as prof:
        for _ in range(WAIT + WARMUP + ACTIVE):
            with torch.profiler.record_function("train_step"):
                step()
            prof.step()
    written = sorted(trace_files(staging))
    paths = [os.path.join(out_dir, os.path.basename(p)) for p in written]
    for source, target in zip(written, paths):
        os.replace(source, target)
    shutil.rmtree(staging, ignore_errors=True)
    return paths[-1] if paths else None


def trace_files(directory: str) -> list[str]:
    return glob.glob(os.path.join(directory, "*.pt.trace.json")) + glob.glob(
        os.path.join(directory, "*.pt.trace.json.gz")
    )
