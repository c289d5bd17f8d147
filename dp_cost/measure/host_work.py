"""What one eager step asks of the host, counted rather than timed: Python function calls,
operator dispatches, and on CUDA kernel launches. A count does not move with the host's speed
or load, so it says whether a trainer's host work grows with the model where a time cannot.

- Python calls: every Python function started during the step, on every thread (autograd
  runs a CUDA backward's hooks on a thread of its own), counted by ``sys.monitoring``'s
  PY_START events (Python 3.12 and later). Before 3.12 only ``sys.setprofile``'s calls on this
  thread can be counted: complete on the CPU, where autograd runs the backward on the calling
  thread, and no count on CUDA (null, with the reason).
- Operator dispatches: the ``aten::`` operators torch.profiler records on the CPU side, nested
  ones included (an ``aten::linear`` and the ``aten::addmm`` it calls are two).
- Kernel launches: the CUDA runtime and driver launch calls the profiler records (Triton's
  included), and the kernels the GPU ran.
"""

from __future__ import annotations

import contextlib
import gc
import sys

import torch
from torch.profiler import ProfilerActivity

LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)
TOOL_NAME = "dp-cost host work"


class PythonCalls:
    """Counts Python function starts while inside: ``count`` (None where it cannot be counted
    on every thread that runs the step, ``why`` says so), ``counter`` names how."""

    def __init__(self, every_thread_needed: bool):
        self.count: int | None = 0
        self.why: str | None = None
        self.every_thread_needed = every_thread_needed
        monitoring = getattr(sys, "monitoring", None)
        self.counter = "sys.monitoring PY_START" if monitoring else "sys.setprofile call"
        self._tool: int | None = None

    def _started(self, *args) -> None:
        self.count += 1  # under the GIL: callbacks of several threads do not interleave here

    def _profiled(self, frame, event, arg) -> None:
        if event == "call":
            self.count += 1

    def __enter__(self) -> PythonCalls:
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            if self.every_thread_needed:
                self.count = None
                self.why = (
                    "Python before 3.12 counts calls on one thread only, and autograd runs a "
                    "CUDA backward on a thread of its own"
                )
            else:
                sys.setprofile(self._profiled)
            return self
        free = [i for i in range(6) if monitoring.get_tool(i) is None]
        if not free:
            self.count, self.why = None, "every sys.monitoring tool id is taken"
            return self
        self._tool = free[-1]
        monitoring.use_tool_id(self._tool, TOOL_NAME)
        monitoring.register_callback(self._tool, monitoring.events.PY_START, self._started)
        monitoring.set_events(self._tool, monitoring.events.PY_START)
        return self

    def __exit__(self, *exc) -> None:
        if self.count:
            self.count -= 1  # this method's own start
        monitoring = getattr(sys, "monitoring", None)
        if self._tool is not None:
            monitoring.set_events(self._tool, 0)
            monitoring.register_callback(self._tool, monitoring.events.PY_START, None)
            monitoring.free_tool_id(self._tool)
            self._tool = None
        elif monitoring is None and not self.every_thread_needed:
            sys.setprofile(None)


class CallsByPhase:
    """The Python calls of a step split at its phase events (the Runner's PhaseEvents): each
    phase's count is the calls since the previous event, summed over chunks ("forward_done":
    the forward with its hooks; "backward_done": the backward and its hooks; then the clipping,
    noise and optimizer up to "step_done"); what follows the last event is "after_phases"."""

    def __init__(self, calls: PythonCalls):
        self.calls, self.counts, self._last = calls, {}, 0

    def __call__(self, phase: str) -> None:
        if self.calls.count is not None:
            self.counts[phase] = self.counts.get(phase, 0) + self.calls.count - self._last
            self._last = self.calls.count

    def total(self) -> dict[str, int] | None:
        if self.calls.count is None:
            return None
        return {**self.counts, "after_phases": self.calls.count - self._last}


def count_step(step, device: torch.device, observing_phases=None) -> dict:
    """Run ``step()`` once, synchronised, under the counters: the result's ``host_work``.
    ``observing_phases(callback)``: a context in which the step's phase events reach
    ``callback`` (the Runner's), for the Python calls of each phase."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    calls = PythonCalls(every_thread_needed=cuda)
    by_phase = CallsByPhase(calls)
    observing = observing_phases(by_phase) if observing_phases else contextlib.nullcontext()
    # A collection runs the finalizers of what it frees (Python calls): start the step with the
    # collector's counts at zero, so the step's own allocations decide where one falls.
    gc.collect()
    if cuda:  # a step before it may still run on the GPU: its kernels are not this step's
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        with observing, calls:
            step()
        if cuda:  # the step's kernels end inside the profile; the wait's own calls not counted
            torch.cuda.synchronize(device)
    counts: dict[str, int] = {}
    for average in prof.key_averages():
        counts[average.key] = counts.get(average.key, 0) + average.count
    launches = sum(counts.get(name, 0) for name in LAUNCH_CALLS) if cuda else None
    return {
        "python_calls": calls.count,
        "python_calls_by_phase": by_phase.total(),
        "python_counter": calls.counter,
        "python_calls_note": calls.why,
        "operator_dispatches": sum(n for key, n in counts.items() if key.startswith("aten::")),
        "kernel_launches": launches,
        "kernels": _kernels(prof) if cuda else None,
    }


def _kernels(prof) -> int | None:
    """The kernels the GPU ran in the step: the profiler's device-side events, copies and
    fills left out (None where this torch keeps them elsewhere)."""
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    return sum(
        1
        for event in events
        if event.device_type() == torch.autograd.DeviceType.CUDA
        and not event.name().startswith(("Memcpy", "Memset"))
    )
