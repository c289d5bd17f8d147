"""kernel_names.step_timeline on a hand-made Kineto trace: the numbers below are counted by hand."""

import json

import pytest

from dp_cost.core import kernel_names


def x(name, cat, ts, dur, tid=1, correlation=None):
    event = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def trace_events():
    return [
        # An earlier step: its launch and kernel are outside the last window.
        x("train_step", "user_annotation", 0, 500),
        x("cudaLaunchKernel", "cuda_runtime", 100, 10, correlation=1),
        x("k0", "kernel", 150, 100, tid=7, correlation=1),
        x("ProfilerStep#2", "user_annotation", 900, 2000),
        # The window: [1000, 2000] on the host.
        x("train_step", "user_annotation", 1000, 1000),
        x("train_step", "gpu_user_annotation", 1050, 2000, tid=7),  # GPU copy: not the window
        x("cudaLaunchKernel", "cuda_runtime", 1010, 10, correlation=10),
        x("k1", "kernel", 1100, 200, tid=7, correlation=10),
        # autograd's thread, driver API (Triton); overlaps k1 on another stream
        x("cuLaunchKernel", "cuda_driver", 1200, 20, tid=2, correlation=11),
        x("k2", "kernel", 1250, 150, tid=8, correlation=11),
        x("cudaMemsetAsync", "cuda_runtime", 1300, 5, correlation=12),
        x("Memset (Device)", "gpu_memset", 1500, 10, tid=7, correlation=12),
        x("cudaLaunchKernel", "cuda_runtime", 1500, 30, correlation=13),
        x("k3", "kernel", 1600, 300, tid=7, correlation=13),
        # .item(): a blocking copy, a wait and no launch
        x("cudaMemcpyAsync", "cuda_runtime", 1600, 350, correlation=14),
        x("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 1940, 5, tid=7, correlation=14),
        x("cudaStreamSynchronize", "cuda_runtime", 1960, 20, correlation=15),
        # launched last, runs past the host range's end: the wall time ends with it
        x("cudaLaunchKernel", "cuda_runtime", 1990, 5, correlation=16),
        x("k4", "kernel", 1995, 105, tid=7, correlation=16),
        # launched after the window
        x("cudaLaunchKernel", "cuda_runtime", 2500, 10, correlation=99),
        x("k5", "kernel", 2100, 100, tid=7, correlation=99),
    ]


def test_step_timeline_by_hand(tmp_path):
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": trace_events()}))
    timeline = kernel_names.step_timeline(kernel_names.load_trace_events(path))
    # Wall: 1000 to k4's end 2100. Busy: k1 u k2 = 1100..1400 (300), memset 10, k3 300,
    # memcpy 5, k4 105 = 720. Last launch (k4's) ends at 1995. Waits: memcpy 350 + sync 20.
    assert timeline["wall_time_ms"] == pytest.approx(1.1)
    assert timeline["gpu_busy_ms"] == pytest.approx(0.72)
    assert timeline["gpu_busy_fraction"] == pytest.approx(720 / 1100)
    assert timeline["host_time_ms"] == pytest.approx(0.995)
    assert timeline["host_wait_ms"] == pytest.approx(0.37)


def test_profiler_step_window_without_a_named_range():
    events = [e for e in trace_events() if e["name"] != "train_step"]
    timeline = kernel_names.step_timeline(events)
    # Window 900..2900: every launch from 1010 to 2500 (k5 too, launched at 2500 and run
    # 2100..2200). Wall ends at the window's end, 2900: busy 720 + k5 100 over 2000.
    assert timeline["wall_time_ms"] == pytest.approx(2.0)
    assert timeline["gpu_busy_fraction"] == pytest.approx(820 / 2000)
    assert timeline["host_time_ms"] == pytest.approx((2510 - 900) / 1000)


def test_cuda_only_trace_spans_its_cuda_calls():
    """A trace of CUDA activity alone has no host ranges: the window runs from the first runtime
    or driver call (1010) to the end of the last launch (1990..1995); the synchronisations after
    it (the measurement's and the profiler's own, at the end of the recorded step) are not the
    step's waits."""
    events = [
        e
        for e in trace_events()
        if e["cat"] not in ("user_annotation", "gpu_user_annotation")
        and e.get("args", {}).get("correlation") not in (1, 99)
    ]
    events += [
        x("cudaDeviceSynchronize", "cuda_runtime", 2000, 100, correlation=20),
        x("cudaDeviceSynchronize", "cuda_runtime", 2150, 5, correlation=21),
    ]
    timeline = kernel_names.step_timeline(events)
    # Window 1010..1995; wall to k4's end 2100; busy 720 as above; last launch ends at 1995.
    assert timeline["wall_time_ms"] == pytest.approx(1.09)
    assert timeline["gpu_busy_fraction"] == pytest.approx(720 / 1090)
    assert timeline["host_time_ms"] == pytest.approx(0.985)
    assert timeline["host_wait_ms"] == pytest.approx(0.37)


def test_cpu_trace_is_not_measurable():
    cpu_only = [e for e in trace_events() if e["cat"] in ("user_annotation", "cpu_op")]
    with pytest.raises(ValueError, match="no GPU activity"):
        kernel_names.step_timeline(cpu_only)
    with pytest.raises(ValueError, match="range"):
        kernel_names.step_timeline([x("aten::mm", "cpu_op", 0, 10)])
    with pytest.raises(ValueError, match="CUDA calls"):
        kernel_names.step_timeline([])
