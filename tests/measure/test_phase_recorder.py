"""The phase recorder inside a timed step: no wait for the GPU between phases (the step runs as
a user's does), each phase's time the GPU's, from CUDA events, once the step is over."""

import time

import pytest
import torch

from dp_cost.measure import phases


class FakeEvent:
    """A CUDA event on a fake GPU clock: record() stamps it with the clock's time then."""

    clock_ms = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at_ms = None

    def record(self):
        self.at_ms = FakeEvent.clock_ms

    def elapsed_time(self, later):
        return later.at_ms - self.at_ms


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's clock, counters and synchronize, faked: the synchronize calls are counted."""
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    for counter in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                    "max_memory_reserved"):  # fmt: skip
        monkeypatch.setattr(torch.cuda, counter, lambda device=None: 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    FakeEvent.clock_ms = 0.0
    return waits


def test_phases_of_a_timed_step_wait_for_nothing_and_take_the_gpu_clock(fake_cuda):
    recorder = phases.PhaseRecorder(torch.device("cuda"))
    with recorder.timed_step() as step_began:
        began = len(fake_cuda)
        FakeEvent.clock_ms = 30.0  # the GPU reaches the forward's end 30 ms after the start
        recorder("forward_done")
        recorder("_clip_inputs_saved")  # an internal marker: no snapshot, no event
        FakeEvent.clock_ms = 75.0
        recorder("backward_done")
        assert len(fake_cuda) == began  # no synchronize between the phases
        assert [s["timestamp"] for s in recorder.snapshots] == [None, None]
    assert len(fake_cuda) == began + 1  # one, once the step is over
    first, second = (s["timestamp"] for s in recorder.snapshots)
    assert first == pytest.approx(step_began + 0.030)  # the step's start on the same clock
    assert second - first == pytest.approx(0.045)
    assert [s["name"] for s in recorder.snapshots] == ["forward_done", "backward_done"]
    assert recorder.snapshots[0]["phase_peak_mb"] == 1.0  # the allocator's counters, read there


def test_a_phase_outside_a_timed_step_still_waits_for_the_gpu(fake_cuda):
    recorder = phases.PhaseRecorder(torch.device("cuda"))
    recorder("optimizer_created")
    assert len(fake_cuda) == 1 and recorder.snapshots[0]["timestamp"] is not None


def test_a_failed_step_leaves_no_phase_pending(fake_cuda):
    recorder = phases.PhaseRecorder(torch.device("cuda"))
    with pytest.raises(RuntimeError), recorder.timed_step():
        FakeEvent.clock_ms = 5.0
        recorder("forward_done")
        raise RuntimeError("out of memory")
    assert recorder.snapshots[0]["timestamp"] is not None
    recorder("step_done")  # outside again: waits and stamps at once
    assert recorder.snapshots[1]["timestamp"] is not None


@pytest.mark.gpu
def test_timed_step_phase_time_is_when_the_gpu_got_there():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    recorder = phases.PhaseRecorder(device)
    torch.cuda.synchronize()
    with recorder.timed_step() as step_began:
        begun = time.perf_counter()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time at ~2 GHz, queued at once
        held = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        recorder("forward_done")
        host_s = time.perf_counter() - begun
        del held
        recorder("backward_done")
    forward, backward = recorder.snapshots
    # The host went on at once; the phase's time is the GPU's, past the sleep.
    assert host_s < 0.02
    assert forward["timestamp"] - (begun - recorder.start) > 0.04
    assert step_began <= begun - recorder.start
    assert backward["timestamp"] >= forward["timestamp"]
    assert forward["phase_peak_mb"] >= 64  # the allocator counted it without a wait


@pytest.mark.gpu
def test_a_cuda_profile_run_times_phases_by_events_and_traces_several_steps(tmp_path):
    """End to end on CUDA: every timed step's phases have GPU timestamps, in order within the
    step, and the host time is the median of the traced steps. The CLI in a process of its own
    (cli, not in_process): its workers fork, and this process has used CUDA already."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from cli_helpers import SMALL_MODEL, cli, results_in

    from dp_cost.core import kernel_names
    from dp_cost.measure.steps import TIMELINE_STEPS

    done = cli("--mode=profile", "--device", "cuda", "--trainers", "standard", "flash",
                      "--batch_sizes", "2", "--seq_lens", "8", "--steps", "3",
                      "--output_dir", str(tmp_path), "--run_name", "r", *SMALL_MODEL)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = results_in(tmp_path / "r")
    assert len(results) == 2
    for result in results.values():
        assert all(s["timestamp"] is not None for s in result["snapshots"])
        stamps = [s["timestamp"] for s in result["snapshots"]]
        assert stamps == sorted(stamps)
        traced = result["step_timeline"]["host_time_ms_of_traced_steps"]
        assert len(traced) == TIMELINE_STEPS
        assert result["host_time_ms"] == sorted(traced)[(TIMELINE_STEPS - 1) // 2]
        collections = result["step_timeline"]["python_gc_of_traced_steps"]
        assert len(collections) == TIMELINE_STEPS
        assert all(len(c["collections"]) == 3 and c["ms"] >= 0 for c in collections)
        # the light trace kept is the reported step's: CUDA activity alone, its host time that
        assert result["timeline_file"] == "timeline.json.gz"  # gzip: a GPU run's default
        kept = tmp_path / "r" / result["config_dir"] / result["timeline_file"]
        events = kernel_names.load_trace_events(kept)
        assert any(e.get("cat") == "kernel" for e in events)
        assert not any(e.get("cat") in ("cpu_op", "python_function") for e in events)
        assert kernel_names.step_timeline(events)["host_time_ms"] == result["host_time_ms"]
