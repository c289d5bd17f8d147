"""trace_analysis.csv and report.html's trace section (Holistic Trace Analysis) on small traces:
a hand-made two-rank GPU trace with NCCL kernels, whose numbers are checked against a union of
intervals computed here (and by hand, in the comments); a one-GPU trace without communication;
a real CPU trace from torch.profiler (no GPU kernels: nothing to analyse); and a report without
HTA installed, which writes everything else and says what to install in one line."""

import csv
import json

import pytest
from test_report_summary import run_result

from dp_cost.report import summary as report
from dp_cost.report import trace_analysis

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
COPY = "Memcpy HtoD (Pageable -> Device)"
# (name, category, start us, duration us, stream) of each rank's GPU activity in the traced step
KERNELS = {
    0: [
        (COPY, "gpu_memcpy", 90, 5, 7),
        (GEMM, "kernel", 100, 40, 7),
        (NCCL, "kernel", 120, 50, 20),
        (ELEMENTWISE, "kernel", 150, 30, 7),
    ],
    1: [(GEMM, "kernel", 100, 60, 7), (NCCL, "kernel", 140, 60, 20)],
}


def kineto_trace(rank, kernels, world_size=2):
    """A Kineto trace as torch.profiler writes it, cut down: the profiler step on the host, a
    launch per kernel, and the kernels on their streams, linked by correlation ids."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "pid": 1, "tid": 1,
         "ts": 0, "dur": 300},
    ]  # fmt: skip
    for i, (name, category, ts, dur, stream) in enumerate(kernels):
        correlation = 100 + i
        events.append(
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
             "ts": 10 + 10 * i, "dur": 5, "args": {"correlation": correlation}}
        )  # fmt: skip
        events.append(
            {"ph": "X", "cat": category, "name": name, "pid": 0, "tid": stream, "ts": ts,
             "dur": dur, "args": {"device": 0, "stream": stream, "correlation": correlation}}
        )  # fmt: skip
    trace = {"schemaVersion": 1, "traceEvents": events}
    if world_size > 1:
        trace["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world_size}
    return trace


def union(intervals):
    """Total length of a union of (start, end) intervals, and the merged intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(e - s for s, e in merged), merged


def expected(kernels):
    """The numbers HTA's analyses should give, computed here from the kernels' intervals."""
    spans = [(ts, ts + dur) for _, _, ts, dur, _ in kernels]
    compute = [(ts, ts + d) for n, c, ts, d, _ in kernels if c == "kernel" and n != NCCL]
    comm = [(ts, ts + d) for n, _, ts, d, _ in kernels if n == NCCL]
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    idle = span - union(spans)[0]
    compute_us, compute_merged = union(compute)
    comm_us, comm_merged = union(comm)
    both = sum(
        max(0, min(e1, e2) - max(s1, s2)) for s1, e1 in compute_merged for s2, e2 in comm_merged
    )
    return {
        "gpu_span_us": span,
        "idle_us": idle,
        "compute_us": compute_us,
        "non_compute_us": span - idle - compute_us,
        "communication_us": comm_us,
        "comm_comp_overlap_pct": 100 * both / comm_us if comm_us else None,
    }


def traced_run(run_dir, kernels_by_rank, trainer="dpsgd", world_size=2):
    result = run_result(trainer, 4, 100.0, 10.0)
    config_dir = run_dir / result["config_dir"]
    config_dir.mkdir(parents=True)
    (config_dir / "result.json").write_text(json.dumps(result))
    for rank, kernels in kernels_by_rank.items():
        name = f"rank{rank}.1700000000.pt.trace.json" if world_size > 1 else "trace.1.pt.trace.json"
        (config_dir / name).write_text(json.dumps(kineto_trace(rank, kernels, world_size)))
    return result


def read_rows(run_dir):
    with open(run_dir / trace_analysis.TRACE_CSV) as f:
        return list(csv.DictReader(f))


def test_two_ranks_with_nccl_match_a_union_of_intervals(tmp_path):
    pytest.importorskip("hta")
    result = traced_run(tmp_path, KERNELS)
    text = report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    assert "Trace analysis: " in text
    rows = read_rows(tmp_path)
    assert [(r["config_dir"], r["rank"]) for r in rows] == [
        (result["config_dir"], "0"),
        (result["config_dir"], "1"),
    ]
    # By hand. Rank 0: kernels 90-95, 100-140, 120-170 (NCCL), 150-180: span 90, busy 5 + 80,
    # idle 5; compute 40 + 30 = 70; non-compute 15 (the copy and NCCL's 140-150); NCCL 50, of it
    # 120-140 and 150-170 under compute: 40 / 50 = 80%. Rank 1: 100-160 and NCCL 140-200: span
    # 100, idle 0, compute 60, NCCL 60 with 20 under compute: 33.33%.
    by_hand = {0: (90, 5, 70, 15, 50, 80.0), 1: (100, 0, 60, 40, 60, 100 / 3)}
    for row in rows:
        rank = int(row["rank"])
        want = expected(KERNELS[rank])
        assert tuple(want.values()) == pytest.approx(by_hand[rank])
        for key, value in want.items():
            assert float(row[key]) == pytest.approx(value, abs=0.01), (rank, key)
        span = want["gpu_span_us"]
        for part in ("idle", "compute", "non_compute", "communication"):
            assert float(row[f"{part}_pct"]) == pytest.approx(
                100 * want[f"{part}_us"] / span, abs=0.01
            )
        assert row["trace_file"].startswith(f"{result['config_dir']}/rank{rank}.")
    page = (tmp_path / "report.html").read_text()
    assert "Trace analysis (Holistic Trace Analysis)" in page
    assert "80.0%" in page and "33.3%" in page


def test_one_gpu_without_communication(tmp_path):
    pytest.importorskip("hta")
    kernels = [k for k in KERNELS[0] if k[0] != NCCL]
    traced_run(tmp_path, {0: kernels}, trainer="standard", world_size=1)
    report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    (row,) = read_rows(tmp_path)
    # 90-95, 100-140, 150-180: span 90, busy 75, idle 15; compute 70; the copy 5
    assert (row["rank"], row["idle_us"], row["compute_us"]) == ("0", "15.0", "70.0")
    assert row["non_compute_us"] == "5.0" and row["communication_us"] == "0.0"
    assert row["comm_comp_overlap_pct"] == "" and row["note"] == "no communication kernels"


def test_a_cpu_trace_from_torch_profiler_has_nothing_to_analyse(tmp_path):
    pytest.importorskip("hta")
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    result = run_result("standard", 2, 1.0, 1.0)
    config_dir = tmp_path / result["config_dir"]
    config_dir.mkdir()
    (config_dir / "result.json").write_text(json.dumps(result))
    model = torch.nn.Linear(8, 8)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(config_dir), worker_name="trace"),
    ) as prof:
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            prof.step()
    assert list(config_dir.glob("*.pt.trace.json"))
    text = report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    (row,) = read_rows(tmp_path)
    assert row["note"] == trace_analysis.NO_GPU_NOTE and row["idle_us"] == ""
    assert "holistictraceanalysis" not in text


def test_without_hta_the_report_says_what_to_install_once(tmp_path, monkeypatch):
    traced_run(tmp_path, KERNELS)
    monkeypatch.setattr(trace_analysis, "hta_installed", lambda: False)
    text = report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    lines = [line for line in text.splitlines() if "holistictraceanalysis" in line]
    assert lines == [trace_analysis.INSTALL_HINT]
    assert not (tmp_path / trace_analysis.TRACE_CSV).exists()
    assert (tmp_path / "summary.csv").exists() and (tmp_path / "report.html").exists()
    assert "pip install holistictraceanalysis" in (tmp_path / "report.html").read_text()


def test_a_run_without_traces_has_no_trace_section(tmp_path, monkeypatch):
    result = run_result("standard", 2, 1.0, 1.0)
    (tmp_path / result["config_dir"]).mkdir()
    (tmp_path / result["config_dir"] / "result.json").write_text(json.dumps(result))
    monkeypatch.setattr(trace_analysis, "hta_installed", lambda: False)
    text = report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    assert "holistictraceanalysis" not in text
    assert "Trace analysis" not in (tmp_path / "report.html").read_text()
    assert not (tmp_path / trace_analysis.TRACE_CSV).exists()


def test_an_unreadable_trace_is_a_note_not_a_failure(tmp_path):
    pytest.importorskip("hta")
    result = traced_run(tmp_path, {0: KERNELS[0]}, world_size=1)
    (tmp_path / result["config_dir"] / "trace.1.pt.trace.json").write_text('{"traceEv')
    report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    (row,) = read_rows(tmp_path)
    assert row["note"].startswith("not analysed: ") and row["gpu_span_us"] == ""


def test_without_hta_a_cpu_run_writes_no_trace_analysis_either(tmp_path, monkeypatch):
    """trace_analysis.csv only with HTA installed, as the docs say: a CPU run's rows would only
    say there is nothing to analyse."""
    result = run_result("standard", 2, 1.0, 1.0) | {"env": {"device": "cpu"}}
    (tmp_path / result["config_dir"]).mkdir()
    (tmp_path / result["config_dir"] / "result.json").write_text(json.dumps(result))
    (tmp_path / result["config_dir"] / "trace.1.pt.trace.json").write_text("[]")
    monkeypatch.setattr(trace_analysis, "hta_installed", lambda: False)
    text = report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    assert [line for line in text.splitlines() if "holistictraceanalysis" in line] == [
        trace_analysis.INSTALL_HINT
    ]
    assert not (tmp_path / trace_analysis.TRACE_CSV).exists()
    assert "Trace analysis:" not in text


def test_a_ranks_light_trace_is_analysed_before_its_full_trace(tmp_path):
    """Where a config kept a light trace of a rank (CUDA activity alone, its host as untraced),
    HTA reads it rather than the full trace, whose recording slows the host. The newest of a
    kind wins; a light trace older than the rank's full trace (an earlier attempt's: the
    worker writes it after the full one) does not."""
    import os

    result = traced_run(tmp_path, KERNELS)
    config_dir = tmp_path / result["config_dir"]
    for name in ("rank0.timeline.json.gz", "rank0.old.timeline.json", "rank1.timeline.json"):
        (config_dir / name).write_text("{}")
    os.utime(config_dir / "rank0.old.timeline.json", (1, 1))  # older than the .gz
    os.utime(config_dir / "rank1.timeline.json", (1, 1))  # older than rank 1's full trace
    traces = trace_analysis.config_traces(str(tmp_path), result)
    assert {rank: os.path.basename(path) for rank, path in traces.items()} == {
        0: "rank0.timeline.json.gz",
        1: "rank1.1700000000.pt.trace.json",
    }
