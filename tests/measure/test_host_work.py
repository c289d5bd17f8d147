"""The host-work counters (measure/host_work.py) against counts known by construction: a
function called n times, an operator dispatched n times, n kernels launched; and every
trainer's step counted through the Runner."""

import contextlib
import sys
import threading

import pytest
import torch

import models
import trainers
from dp_cost.measure import host_work


def called(times: int):
    def leaf():
        return None

    def step():
        for _ in range(times):
            leaf()

    return step


def test_python_calls_count_each_function_started():
    # step itself, then leaf 9 times
    counts = host_work.count_step(called(9), torch.device("cpu"))
    assert counts["python_calls"] == 10
    assert counts["python_counter"].startswith(("sys.monitoring", "sys.setprofile"))


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring counts every thread")
def test_python_calls_on_another_thread_are_counted():
    def step():
        worker = threading.Thread(target=called(5))
        worker.start()
        worker.join()

    counts = host_work.count_step(step, torch.device("cpu"))
    assert counts["python_calls"] >= 6  # the thread's target and its 5 calls, beside threading's


def test_python_calls_are_split_at_the_phase_events():
    """Each phase's calls are those since the previous event (the observer's own call among
    them); what follows the last event is after_phases; the phases add up to the step's."""
    observers = []

    @contextlib.contextmanager
    def observing(callback):
        observers.append(callback)
        yield
        observers.pop()

    def leaf():
        return None

    def step():
        for _ in range(3):
            leaf()
        observers[-1]("forward_done")
        for _ in range(5):
            leaf()
        observers[-1]("backward_done")
        leaf()

    counts = host_work.count_step(step, torch.device("cpu"), observing)
    by_phase = counts["python_calls_by_phase"]
    # step and the observer start too: 1 + 3 + 1, then 5 + 1, then 1
    assert by_phase == {"forward_done": 5, "backward_done": 6, "after_phases": 1}
    assert sum(by_phase.values()) == counts["python_calls"]


def test_garbage_left_before_a_counted_step_is_not_counted_in_it():
    """Cyclic garbage with finalizers, left by whatever ran before: a collection inside the step
    would run them and count their calls. count_step collects first, so the count is the
    step's own."""

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            pass

    def step():
        boxes = []
        for _ in range(5000):  # enough new containers for the collector to run in the step
            boxes.append([None])

    cpu = torch.device("cpu")
    clean = host_work.count_step(step, cpu)["python_calls"]
    for _ in range(50):
        Cycle()
    assert host_work.count_step(step, cpu)["python_calls"] == clean


def test_the_counted_step_on_cuda_starts_and_ends_with_the_gpu_drained(monkeypatch):
    # Its kernels are counted from the profiler's window: a step before it still running on
    # the GPU would be counted too, and its own last kernels missed without the wait after it.
    events = []

    class Profile:  # stands in for torch.profiler.profile: CUDA activity needs a GPU
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            events.append("profile")
            return self

        def __exit__(self, *exc):
            events.append("profile end")
            return False

        def key_averages(self):
            return []

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    host_work.count_step(lambda: events.append("step"), torch.device("cuda"))
    assert events == ["sync", "profile", "step", "sync", "profile end"]


def test_operator_dispatches_count_each_aten_operator():
    a, b = torch.ones(3), torch.ones(3)

    def step():
        for _ in range(7):
            torch.add(a, b)

    assert host_work.count_step(step, torch.device("cpu"))["operator_dispatches"] == 7


def test_no_launches_are_counted_on_the_cpu():
    counts = host_work.count_step(lambda: torch.ones(2) + 1, torch.device("cpu"))
    assert counts["kernel_launches"] is None and counts["kernels"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_launches_count_each_kernel():
    device = torch.device("cuda")
    a = torch.ones(1024, device=device)

    def step():
        for _ in range(5):
            a.add_(1)

    host_work.count_step(step, device)  # the first launch loads the module
    counts = host_work.count_step(step, device)
    assert counts["kernel_launches"] == 5 and counts["kernels"] == 5
    assert counts["python_calls"] is not None or sys.version_info < (3, 12)


def test_every_trainer_step_is_counted_and_flash_counts_its_own_work():
    """Through the Runner, one eager step of each trainer: counts exist and are deterministic
    (the same step counted twice gives the same numbers)."""
    inputs = torch.randint(0, 37, (4, 8))
    seen = {}
    for name in trainers.TRAINERS:
        torch.manual_seed(0)
        model = models.build_model(
            "tiny", vocab_size=37, hidden_dim=16, num_heads=2, mlp_dim=16, num_layers=2
        )
        runner = trainers.make_trainer(name, model, lr=0.1, batch_size=4)
        runner.step(inputs, inputs)
        first, again = (
            host_work.count_step(
                lambda r=runner: r.step(inputs, inputs),
                torch.device("cpu"),
                runner.observing_phases,
            )
            for _ in range(2)
        )
        assert first == again, name
        assert first["python_calls"] > 0 and first["operator_dispatches"] > 0, name
        by_phase = first["python_calls_by_phase"]
        assert sum(by_phase.values()) == first["python_calls"], name
        assert {"forward_done", "backward_done", "step_done"} <= by_phase.keys(), name
        seen[name] = first
    # the DP trainers do more on the host than the baseline, each by its own machinery
    for name in ("dpsgd", "ghost", "flash"):
        assert seen[name]["python_calls"] > seen["standard"]["python_calls"], name
    # flash's taped forward calls torch's ops directly: no more calls than standard's forward;
    # its own work comes after it
    flash, standard = (seen[n]["python_calls_by_phase"] for n in ("flash", "standard"))
    assert flash["forward_done"] <= standard["forward_done"]
    assert flash["backward_done"] > standard["backward_done"]


def test_the_cli_counts_a_step_when_asked(tmp_path):
    """--host_work adds the result key (and one accounted step); without it the key is absent."""
    from cli_helpers import results_in, small_run_args

    import profiling_script

    argv = [*small_run_args(tmp_path, "standard", "flash", steps=1), "--host_work"]
    assert profiling_script.main(argv) == 0
    for name, result in results_in(tmp_path / "r").items():
        assert result["status"] == "ok", result["error"]
        assert result["host_work"]["python_calls"] > 0, name
        assert result["host_work"]["operator_dispatches"] > 0, name
