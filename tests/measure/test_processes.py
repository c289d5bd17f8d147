"""The worker processes' bookkeeping: the progress bar and what --resume keeps."""

import contextlib
import gc
import io
import multiprocessing
import os

import pytest

from dp_cost.core.files import write_json
from dp_cost.measure import processes, progress
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
    copy: a worker that hung in CI) unless the fork is made inside processes.frozen_heap."""
    context = multiprocessing.get_context("fork")
    reports, report = context.Pipe(duplex=False)
    gc.disable()  # the cycle must still be there at the fork
    try:
        _Inherited(report)
        child = context.Process(target=gc.collect)
        with processes.frozen_heap() if frozen else contextlib.nullcontext():
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

    monkeypatch.setattr(processes, "frozen_heap", recording)
    processes.probe_device()
    assert len(entered) == 1
    monkeypatch.setattr(processes, "worker_process", lambda *args, **kwargs: None)
    config = ExperimentConfig(trainer="standard", batch_size=1, seq_len=4)
    result = processes.run_in_child(
        multiprocessing.get_context("fork"), config, str(tmp_path), str(tmp_path / "result.json")
    )
    assert len(entered) == 2 and result["status"] != "ok"  # the stand-in wrote no result
