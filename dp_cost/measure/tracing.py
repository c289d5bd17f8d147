"""torch.profiler traces of a few extra steps, for TensorBoard, Perfetto and chrome://tracing.

The traced steps run after the timed steps, so profiler overhead never enters reported times.
Each config directory receives its own trace file(s) and is one run for
``tensorboard --logdir=./runs`` (the plugin treats any directory holding ``*.pt.trace.json[.gz]``
as a run).
"""

from __future__ import annotations

import gzip
import os
import shutil

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from dp_cost.core import files, kernel_names

# wait / warmup / active steps: the warm-up step (profiled, then dropped) re-primes caches after
# the measurements before it and lets the profiler settle; the active step is the one recorded.
# No wait step: the model is warm by then, and a step waited out would only cost time.
WAIT, WARMUP, ACTIVE = 0, 1, 1
TRACE_SUFFIXES = kernel_names.TRACE_SUFFIXES


def worker_name() -> str:
    """``rank<N>`` under torch.distributed (TensorBoard's distributed view and the reports read
    the rank from it), else ``trace``."""
    if torch.distributed.is_initialized():
        return f"rank{torch.distributed.get_rank()}"
    return "trace"


def keep_timeline(stage: files.Staging, exported: str, use_gzip: bool) -> str:
    """Move the light trace ``exported`` (a file in ``stage``: one more step's CUDA activity
    alone, kernels, copies and their launches) into the config directory as
    ``rank<N>.timeline.json[.gz]`` (one process: ``timeline.json[.gz]``); its path there. No
    Python stacks, shapes or memory events slowed its host, so its GPU timeline (what overlaps
    what) is the untraced step's. Not a *.pt.trace.json: TensorBoard's plugin would take the
    config for two runs."""
    worker = worker_name()
    rank = "" if worker == "trace" else f"{worker}."
    name = rank + kernel_names.TIMELINE_SUFFIXES[use_gzip]
    source = os.path.join(stage.path, exported)
    if use_gzip:
        with open(source, "rb") as plain, gzip.open(os.path.join(stage.path, name), "wb") as packed:
            shutil.copyfileobj(plain, packed)
    else:
        os.replace(source, os.path.join(stage.path, name))
    return stage.publish(name)


def trace_steps(step, device: torch.device, out_dir: str, use_gzip: bool) -> str | None:
    """Run ``step()`` under the profiler schedule; return the path of the trace written.
    ``out_dir``: a config directory; nothing below its run directory is written through a link."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # One trace per rank in the config directory: TensorBoard's distributed view reads them.
    worker = worker_name()
    # The handler writes into a private folder; the finished file is then moved into the config
    # directory, so an interrupted run never leaves a half-written trace there.
    with files.staging(out_dir, root=os.path.dirname(out_dir), prefix=".trace-") as staging:
        handler = tensorboard_trace_handler(staging.path, worker_name=worker, use_gzip=use_gzip)
        with profile(
            activities=activities,
            schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
            on_trace_ready=handler,
            profile_memory=True,  # the Memory view
            record_shapes=True,  # the Operator view's input shapes
            with_stack=True,  # the Module view and source lines in the Trace view
        ) as prof:
            for _ in range(WAIT + WARMUP + ACTIVE):
                with torch.profiler.record_function("train_step"):
                    step()
                # As the timed steps: the GPU drained after each, so that the recorded step's
                # window holds its own kernels alone, not the tail of the warm-up step's (its
                # optimizer's kernels, still running when the host starts the next step).
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                prof.step()
        paths = [staging.publish(name) for name in staging.names() if name.endswith(TRACE_SUFFIXES)]
    return paths[-1] if paths else None
