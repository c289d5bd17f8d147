"""The worker processes' bookkeeping: the progress bar and what --resume keeps."""

import contextlib
import dataclasses
import gc
import glob
import io
import multiprocessing
import os
import signal
import time

import pytest

from dp_cost.core.files import write_json
from dp_cost.core.interrupts import INTERRUPTS
from dp_cost.measure import children, processes, progress
from dp_cost.measure.config import ExperimentConfig
from dp_cost.measure.worker import result_skeleton


def test_progress_bar_counts_resumed_configs_as_done_and_estimates_from_the_rest():
    clock = iter([0.0, 0.0, 0.0, 10.0, 10.0, 10.0, 10.0, 10.0])
    stream = io.StringIO()
    bar = progress.ProgressBar(total=5, done_already=2, stream=stream)
    bar._time = lambda: next(clock)  # tqdm's clock: the first worker takes 10 s
    bar.start_t = bar.last_print_t = 0.0
    first = stream.getvalue().splitlines()[-1]
    assert "2/5 configs done, 3 left" in first and "estimate ? left" in first
    bar.update()
    line = stream.getvalue().splitlines()[-1]
    # 2 more configs at 10 s each; the 2 resumed ones took no time and do not count.
    assert "3/5 configs done, 2 left" in line and "estimate 00:20 left" in line
    assert "\r" not in stream.getvalue()  # no terminal: plain lines
    bar.close()


def test_resume_keeps_finished_results_except_ncu_configs(tmp_path):
    """An ncu config must run each time ncu launches it (again in every metric pass of
    app-range replay), or ncu would overwrite a good report with an empty one."""

    def write(name, status, ncu=False):
        config = ExperimentConfig(trainer="standard", batch_size=1, seq_len=4, ncu=ncu)
        path = str(tmp_path / config.config_dir / name)
        write_json(path, result_skeleton(config, status), root=str(tmp_path))
        return path

    def finished(path, resume=True):
        return processes.finished_result(path, str(tmp_path), resume)

    assert finished(write("ok.json", "ok"))["status"] == "ok"
    assert finished(write("oom.json", "oom"))["status"] == "oom"
    assert finished(write("error.json", "error")) is None
    assert finished(write("ok.json", "ok"), resume=False) is None
    assert finished(write("ncu.json", "ok", ncu=True)) is None
    (tmp_path / "list.json").write_text("[1, 2]")
    assert finished(str(tmp_path / "list.json")) is None


class _Inherited:
    """Half of an unreachable cycle whose destructor reports the process it ran in."""

    def __init__(self, pipe):
        self.pipe, self.cycle = pipe, self

    def __del__(self):
        self.pipe.send(os.getpid())


@pytest.mark.parametrize("frozen", [False, True])
def test_a_forked_worker_never_collects_what_it_inherited(frozen):
    """An unreachable cycle left for the parent's collector is destroyed by a forked child's
    own collection (a DDP reducer's gloo process group there waits for threads the fork did not
    copy: a worker that hung in CI) unless the fork is made inside children.frozen_heap."""
    context = multiprocessing.get_context("fork")
    reports, report = context.Pipe(duplex=False)
    gc.disable()  # the cycle must still be there at the fork
    try:
        _Inherited(report)
        child = context.Process(target=gc.collect)
        with children.frozen_heap() if frozen else contextlib.nullcontext():
            child.start()
        child.join(30)
    finally:
        gc.enable()
    gc.collect()  # the parent's own copy, here and now (none left for a later test)
    destroyed_in = []
    while reports.poll(5 if not destroyed_in else 0.5):
        destroyed_in.append(reports.recv())
    # frozen: the child's collection found nothing it inherited
    assert destroyed_in == ([os.getpid()] if frozen else [child.pid, os.getpid()])


def test_workers_fork_inside_a_frozen_heap(monkeypatch, tmp_path):
    """run_in_child (every config's worker) and the device probe fork inside frozen_heap."""
    entered = []

    @contextlib.contextmanager
    def recording():
        entered.append(gc.get_freeze_count())
        yield

    monkeypatch.setattr(children, "frozen_heap", recording)
    processes.probe_device()
    assert len(entered) == 1
    monkeypatch.setattr(children, "worker_process", lambda *args, **kwargs: None)
    config = ExperimentConfig(trainer="standard", batch_size=1, seq_len=4)
    result = processes.run_in_child(
        multiprocessing.get_context("fork"), config, str(tmp_path), str(tmp_path / "result.json")
    )
    assert len(entered) == 2 and result["status"] != "ok"  # the stand-in wrote no result


def capacity_configs(count: int) -> list:
    """``count`` --mode=capacity configs (no --validate: nothing on a GPU), each its own
    directory."""
    return [
        ExperimentConfig(trainer="standard", batch_size=1 + i, seq_len=4, capacity=True)
        for i in range(count)
    ]


def waiting_worker(others: int, seconds: float):
    """A stand-in for worker_main: its pid and start time in its config directory; then it
    waits (20 s at most) until ``others`` configs' workers of the run have started, sleeps
    ``seconds`` and writes its end time and how many it saw start; it writes no result (the
    run writes one for it)."""

    def worker(config, config_path, *args, **kwargs):
        with open(os.path.join(config_path, "began"), "w") as f:
            f.write(f"{os.getpid()} {time.monotonic()}")
        began = os.path.join(os.path.dirname(config_path), "*", "began")
        deadline = time.monotonic() + 20
        while len(glob.glob(began)) < others and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = len(glob.glob(began))
        time.sleep(seconds)
        with open(os.path.join(config_path, "ended"), "w") as f:
            f.write(f"{time.monotonic()} {seen}")

    return worker


def side_by_side_host(monkeypatch, cores: int) -> None:
    """A host of ``cores`` cores with memory for as many predicting workers."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(processes, "available_memory_bytes", lambda: cores * 2**30)
    monkeypatch.setattr(processes, "WORKER_MEMORY_BYTES", 2**30)


def test_predicting_configs_run_side_by_side_one_a_core(tmp_path, monkeypatch):
    """--mode=capacity without a GPU step: one worker a core at once (3 here), each forked as
    another ends; the results come back in the plan's order, each its own config's."""
    side_by_side_host(monkeypatch, 3)
    monkeypatch.setattr(children, "worker_main", waiting_worker(3, 0.2))
    configs = capacity_configs(4)
    assert processes.workers_at_once(configs, None) == 3
    results = processes.run_configs(configs, str(tmp_path))
    assert [r["config"]["batch_size"] for r in results] == [c.batch_size for c in configs]
    began, ended, seen = {}, {}, {}
    for config in configs:
        folder = tmp_path / config.config_dir
        began[config.batch_size] = float((folder / "began").read_text().split()[1])
        ended[config.batch_size], seen[config.batch_size] = (
            float(x) for x in (folder / "ended").read_text().split()
        )
    first_three = [c.batch_size for c in configs[:3]]
    assert all(seen[b] >= 3 for b in first_three)  # each saw the other two start: side by side
    assert began[configs[3].batch_size] >= min(ended[b] for b in first_three)  # after one ended
    monkeypatch.setattr(processes, "available_memory_bytes", lambda: 2**30)
    assert processes.workers_at_once(configs, None) == 1  # memory for one worker: one


def test_configs_that_use_a_gpu_run_one_at_a_time():
    """--validate and the searches by runs measure on the GPU, a torchrun job's ranks share
    theirs, and the measuring modes never predict: one worker at a time."""
    (config,) = capacity_configs(1)
    assert processes.workers_at_once([config] * 2, group=object()) == 1
    for flag in ("validate", "find_max_batch", "find_max_seq_len"):
        changed = dataclasses.replace(config, **{flag: True})
        assert processes.workers_at_once([config, changed], None) == 1
    measured = dataclasses.replace(config, capacity=False)
    assert processes.workers_at_once([measured, measured], None) == 1


def test_an_interrupt_stops_every_worker_running_side_by_side(tmp_path, monkeypatch):
    """Ctrl-C while two workers run: both are stopped and reaped, the interrupt names both,
    and nothing is left of their configs."""
    side_by_side_host(monkeypatch, 2)
    monkeypatch.setattr(children, "worker_main", waiting_worker(0, 60.0))
    configs = capacity_configs(2)
    folders = [tmp_path / c.config_dir for c in configs]

    def interrupt_once_both_run(signum, frame):
        if all((folder / "began").exists() for folder in folders):
            raise KeyboardInterrupt
        signal.setitimer(signal.ITIMER_REAL, 0.1)

    # the clean-up ignores further interrupts (the CLI restores its handlers; restored here)
    handlers = {s: signal.getsignal(s) for s in (*INTERRUPTS, signal.SIGALRM)}
    signal.signal(signal.SIGALRM, interrupt_once_both_run)
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    try:
        with pytest.raises(processes.Interrupted) as interrupted:
            processes.run_configs(configs, str(tmp_path))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert all(c.config_dir in str(interrupted.value) for c in configs)
    for folder in folders:
        pid = int((folder / "began").read_text().split()[0]) if folder.exists() else None
        assert not folder.exists() or not (folder / "ended").exists()
        if pid is not None:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_an_error_in_the_run_stops_every_worker_running_side_by_side(tmp_path, monkeypatch):
    """An error in the parent while workers run side by side (here: reading a result) is
    raised, and the workers still running are stopped and reaped first, not left behind."""
    side_by_side_host(monkeypatch, 2)
    short, long = capacity_configs(2)

    def worker(config, config_path, *args, **kwargs):
        with open(os.path.join(config_path, "began"), "w") as f:
            f.write(str(os.getpid()))
        if config.batch_size == long.batch_size:
            time.sleep(60)
        began = os.path.join(os.path.dirname(config_path), "*", "began")
        deadline = time.monotonic() + 20  # the short one ends once the long one runs
        while len(glob.glob(began)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)

    def failing_end(child, stopped_by=None):
        raise RuntimeError("the disk is gone")

    monkeypatch.setattr(children, "worker_main", worker)
    monkeypatch.setattr(children, "end_child", failing_end)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the disk is gone"):
        processes.run_configs([short, long], str(tmp_path))
    assert time.monotonic() - started < 30
    for config in (short, long):
        pid = int((tmp_path / config.config_dir / "began").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_every_handler_is_restored_after_a_fork_even_when_one_raises_in_between(monkeypatch):
    """A Ctrl-C that arrives just after the fork guard has put Ctrl-C's handler back, while
    it puts back the others: that handler raises there, and SIGTERM's and the hangup's
    handlers are still the program's own afterwards, not the guard's recorder."""

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    def keep(signum, frame):
        pass

    real_signal = signal.signal

    def ctrl_c_after_restoring_its_handler(signum, handler):
        previous = real_signal(signum, handler)
        if signum == signal.SIGINT and handler is stop:
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: raises Stop
        return previous

    saved = {signum: signal.getsignal(signum) for signum in INTERRUPTS}
    try:
        for signum in INTERRUPTS:
            signal.signal(signum, stop if signum == signal.SIGINT else keep)
        monkeypatch.setattr(children.signal, "signal", ctrl_c_after_restoring_its_handler)
        with pytest.raises(Stop):
            with children.interrupts_after_fork():
                pass
        monkeypatch.undo()
        assert [signal.getsignal(signum) for signum in INTERRUPTS] == [stop, keep, keep]
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
