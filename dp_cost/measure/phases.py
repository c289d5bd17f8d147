"""Memory measurement: phase snapshots, the peak of a step, and what counts as "measured".

CUDA: torch's caching-allocator counters (``memory_allocated`` / ``max_memory_allocated`` after a
reset, and their ``reserved`` twins). CPU has no such counters, so there the peak of a step is
the bytes of every live tensor storage when the step starts plus the highest running total of
the allocations and frees torch.profiler reports during the step (``memory_source =
"cpu-profiler"``); CPU snapshots and reserved bytes are ``null``: nothing measures them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from dp_cost.core import kernel_names
from dp_cost.core.schema import MB


def memory_source(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu-profiler"


class PhaseRecorder:
    """Snapshots of allocated/reserved memory at the trainers' phase names.

    Each snapshot also carries the peak allocated since the previous snapshot (the peak inside
    that phase), read from the allocator's peak counter, which is reset at every snapshot. The
    counters are the host's (the caching allocator's, in the order ops are queued), so they need
    no wait for the GPU.

    When a phase ended: on CUDA, outside ``timed_step()``, the GPU is waited for and the host
    clock read; inside it, a CUDA event is queued at the phase and the step is not stopped, so it
    runs as a user's step does, its host work overlapping the GPU's (a wait at every phase would
    add each phase's launch latency to the step time, more for a trainer with more host work).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.snapshots: list[dict] = []
        self.start = time.perf_counter()
        self._timed: list[tuple[dict, torch.cuda.Event]] | None = None  # inside timed_step

    def __call__(self, name: str) -> None:
        if name.startswith("_"):  # internal markers are no snapshots
            return
        snapshot = {"name": name, "timestamp": None}
        if self._timed is not None:  # resolved when the step is over
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._timed.append((snapshot, event))
        else:
            if self.device.type == "cuda":
                # Kernels run asynchronously: the phase ends when the GPU is done with it, not
                # when the CPU has launched it (a timestamp taken before this wait lags one
                # phase behind).
                torch.cuda.synchronize(self.device)
            snapshot["timestamp"] = time.perf_counter() - self.start
        if self.device.type == "cuda":
            snapshot["allocated_mb"] = torch.cuda.memory_allocated(self.device) / MB
            snapshot["reserved_mb"] = torch.cuda.memory_reserved(self.device) / MB
            snapshot["phase_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / MB
            snapshot["phase_peak_reserved_mb"] = torch.cuda.max_memory_reserved(self.device) / MB
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            snapshot.update(
                allocated_mb=None, reserved_mb=None, phase_peak_mb=None, phase_peak_reserved_mb=None
            )
        self.snapshots.append(snapshot)

    @contextlib.contextmanager
    def timed_step(self):
        """One timed step, given the time it began (seconds on the snapshots' clock; a phase
        of it is at that or later). CUDA: the GPU idle when it begins, a CUDA event at each
        phase (no wait), and each phase's timestamp, when the GPU reached it, once the step is
        over. CPU: as outside (its ops run as they are called)."""
        if self.device.type != "cuda":
            yield time.perf_counter() - self.start
            return
        torch.cuda.synchronize(self.device)
        began = time.perf_counter() - self.start
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self._timed = []
        try:
            yield began
        finally:
            timed, self._timed = self._timed, None
            torch.cuda.synchronize(self.device)
            for snapshot, event in timed:
                snapshot["timestamp"] = began + start.elapsed_time(event) / 1e3


def live_tensor_bytes(exclude=()) -> int:
    """Bytes of every distinct CPU storage reachable from a Python tensor object (and its
    .grad), except the storages of the tensors in ``exclude``."""
    excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
    storages: dict[int, int] = {}

    def add(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            try:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a wrapper (FSDP2's DTensor): its local tensor is counted
                pass

    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        add(tensor)
        if tensor.is_leaf or tensor.retains_grad:  # others have none (reading it warns)
            add(tensor.grad)
    return sum(nbytes for address, nbytes in storages.items() if address not in excluded)


def cpu_step_peak_bytes(step, exclude=()) -> int:
    """Peak bytes during ``step()`` on CPU: the live tensor bytes when it starts (but those of
    ``exclude``, e.g. a host-side dataset: what the CUDA peak counts) plus the highest running
    total of the profiler's allocation events during the step."""
    gc.collect()
    baseline = live_tensor_bytes(exclude)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = kernel_names.memory_events(path)
    memory_events = sorted(
        (e for e in events if e["args"].get("Device Type") == 0), key=lambda e: e["ts"]
    )
    running = peak = 0
    for event in memory_events:
        running += event["args"]["Bytes"]
        peak = max(peak, running)
    return baseline + peak
