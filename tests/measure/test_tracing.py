"""torch.profiler traces per config, as TensorBoard's profiler plugin sees them."""

import gzip
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from cli_helpers import free_port, in_process, small_run_args

from dp_cost.core import kernel_names as kernels


def run_cli(tmp_path, *extra):
    args = small_run_args(tmp_path, "standard", "flash", seq_lens=(16,), run_name=None)
    proc = in_process(*args, *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_one_trace_per_config_and_gzip_flag(tmp_path):
    run_cli(tmp_path, "--run_name", "plain")
    run_cli(tmp_path, "--run_name", "gz", "--trace_gzip")
    run_cli(tmp_path, "--run_name", "none", "--no_trace")
    for config in ("standard_bs2_seq16", "flash_bs2_seq16"):
        plain = list((tmp_path / "plain" / config).glob("*.pt.trace.json"))
        assert len(plain) == 1
        result = json.loads((tmp_path / "plain" / config / "result.json").read_text())
        assert result["trace_file"] == plain[0].name
        events = kernels.load_trace_events(plain[0])
        steps = [e for e in events if e.get("name") == "train_step"]
        assert len(steps) == 1  # exactly the active step of the schedule
        assert any(e.get("name") == "[memory]" for e in events)  # Memory view data
        compressed = list((tmp_path / "gz" / config).glob("*.pt.trace.json.gz"))
        assert len(compressed) == 1
        with gzip.open(compressed[0]) as f:
            assert json.load(f)["traceEvents"]
        assert not list((tmp_path / "none" / config).glob("*.pt.trace*"))
    assert (tmp_path / "plain" / "visualizations" / "memory_curve.png").stat().st_size > 10_000


@pytest.mark.parametrize("use_gzip", [False, True])
def test_a_kept_light_trace_is_the_exported_one_under_its_name(tmp_path, use_gzip):
    """keep_timeline: the light trace the profiler exported into the staging folder ends in the
    config directory as timeline.json[.gz] (one process: no rank in the name), its events the
    exported ones; nothing else is published and the staging folder goes."""
    from dp_cost.core import files
    from dp_cost.measure import tracing

    events = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1, "dur": 2}]}
    with files.staging(str(tmp_path), str(tmp_path), ".trace-") as stage:
        (tmp_path / stage.name / "timeline1.json").write_text(json.dumps(events))
        (tmp_path / stage.name / "timeline0.json").write_text("{}")  # another step's: left
        kept = tracing.keep_timeline(stage, "timeline1.json", use_gzip)
    name = "timeline.json.gz" if use_gzip else "timeline.json"
    assert os.path.samefile(kept, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert name.endswith(kernels.TIMELINE_SUFFIXES) and not name.endswith(kernels.TRACE_SUFFIXES)
    opened = gzip.open(kept, "rt") if use_gzip else open(kept)
    with opened as f:
        assert json.load(f) == events


def test_tensorboard_plugin_lists_one_run_per_config(tmp_path):
    pytest.importorskip("torch_tb_profiler")
    run_cli(tmp_path, "--run_name", "r", "--trainers", "standard", "dpsgd", "flash")
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(tmp_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/runs"
    runs, deadline = None, time.time() + 90
    try:
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    data = json.load(response)
                if not data.get("loading") and len(data.get("runs", [])) >= 3:
                    runs = data["runs"]
                    break
            except OSError:
                pass
            time.sleep(0.1)  # the server starts and loads the runs in seconds: asked often
        views = None
        if runs:
            query = f"{url[:-5]}/views?run={runs[0]}"
            with urllib.request.urlopen(query, timeout=10) as response:
                views = json.load(response)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert sorted(runs or []) == [f"r/{t}_bs2_seq16" for t in ("dpsgd", "flash", "standard")]
    assert {"Overview", "Operator", "Trace", "Memory"} <= set(views)


def test_each_traced_step_on_cuda_ends_with_the_gpu_drained(tmp_path, monkeypatch):
    # The recorded step's window must hold its own kernels: without a sync, the warm-up step's
    # optimizer kernels still run when the recorded step starts and are counted as its own.
    import torch

    from dp_cost.measure import tracing

    events = []

    class Profile:  # stands in for torch.profiler.profile: CUDA activity needs a GPU
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def step(self):
            events.append("profiler step")

    class StepRange:  # the train_step range: the wait for the GPU stays outside it
        def __init__(self, name):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append("range end")
            return False

    monkeypatch.setattr(tracing, "profile", Profile)
    monkeypatch.setattr(torch.profiler, "record_function", StepRange)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    config = tmp_path / "run" / "config"
    config.mkdir(parents=True)
    tracing.trace_steps(lambda: events.append("step"), torch.device("cuda"), str(config), False)
    steps = tracing.WAIT + tracing.WARMUP + tracing.ACTIVE
    assert events == ["step", "range end", "sync", "profiler step"] * steps
    events.clear()  # on the CPU the step's work is done when it returns: no wait
    tracing.trace_steps(lambda: events.append("step"), torch.device("cpu"), str(config), False)
    assert events == ["step", "range end", "profiler step"] * steps
