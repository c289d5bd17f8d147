"""The worker processes' bookkeeping: the progress bar and what --resume keeps."""

import io

from dp_cost.core.files import write_json
from dp_cost.core.settings import ExperimentConfig
from dp_cost.measure import processes
from dp_cost.measure.worker import result_skeleton


def test_progress_bar_counts_resumed_configs_as_done_and_estimates_from_the_rest():
    clock = iter([0.0, 0.0, 0.0, 10.0, 10.0, 10.0, 10.0, 10.0])
    stream = io.StringIO()
    bar = processes.ProgressBar(total=5, done_already=2, stream=stream)
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
        write_json(str(tmp_path / name), result_skeleton(config, status))
        return str(tmp_path / name)

    assert processes.finished_result(write("ok.json", "ok"), resume=True)["status"] == "ok"
    assert processes.finished_result(write("oom.json", "oom"), resume=True)["status"] == "oom"
    assert processes.finished_result(write("error.json", "error"), resume=True) is None
    assert processes.finished_result(write("ok.json", "ok"), resume=False) is None
    assert processes.finished_result(write("ncu.json", "ok", ncu=True), resume=True) is None
    (tmp_path / "list.json").write_text("[1, 2]")
    assert processes.finished_result(str(tmp_path / "list.json"), resume=True) is None
