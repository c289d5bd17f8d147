"""A run's report survives any file (each bad result skipped with one warning line naming it and
counted in summary.md; the others reported) and any failing plot (tables written first, the
failure one line). The spread of the measured steps in the tables, and summary.txt's numbers."""

import json
import os

import pytest
from test_report_summary import RESULTS, run_result, write_run

import profiling_script
from dp_cost.report import figures, tables
from dp_cost.report import summary as report
from dp_cost.report.result_check import result_problem
from dp_cost.report.text import summary_text

GOOD = run_result("standard", 2, 1000.0, 10.0)


def bad_files(run_dir):
    """name -> bytes (or a callable making the path) of result.json files no report can use."""
    deep = b"[" * 5000 + b"]" * 5000
    no_status = {k: v for k, v in GOOD.items() if k != "status"}
    wrong_peak = GOOD | {"peak_memory_mb": "big"}
    wrong_batch = GOOD | {"config": GOOD["config"] | {"batch_size": "2"}}
    no_trainer = GOOD | {"config": {k: v for k, v in GOOD["config"].items() if k != "trainer"}}
    return {
        "a_list": b"[1, 2]",
        "a_number": b"3",
        "latin1": '{"status": "ok", "é": 1}'.encode("latin-1"),
        "deep": deep,
        "no_status": json.dumps(no_status).encode(),
        "wrong_peak": json.dumps(wrong_peak).encode(),
        "wrong_batch": json.dumps(wrong_batch).encode(),
        "no_trainer": json.dumps(no_trainer).encode(),
        "nan_peak": json.dumps(GOOD | {"peak_memory_mb": float("nan")}).encode(),
        "snapshots_not_list": json.dumps(GOOD | {"snapshots": {"a": 1}}).encode(),
        "fifo": lambda path: os.mkfifo(path),
        "device": lambda path: os.symlink("/dev/zero", path),
    }


def test_bad_result_files_are_skipped_with_one_warning_each(tmp_path, capsys):
    write_run(tmp_path, RESULTS)
    bad = bad_files(tmp_path)
    for name, content in bad.items():
        (tmp_path / name).mkdir()
        path = tmp_path / name / "result.json"
        content(path) if callable(content) else path.write_bytes(content)
    results = report.load_results(str(tmp_path))
    assert len(results) == len(RESULTS)
    assert {os.path.basename(os.path.dirname(p)) for p, _ in results.skipped} == set(bad)
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == len(bad)
    for name in bad:
        assert sum(f"/{name}/result.json: " in w for w in warnings) == 1
    text = report.write_summary(str(tmp_path), results)
    assert f"{len(bad)} result files skipped" in text
    markdown = (tmp_path / "summary.md").read_text()
    assert f"{len(bad)} result files skipped" in markdown and "/fifo/result.json: not a" in markdown
    assert (tmp_path / "report.html").exists()


def test_a_result_copied_into_another_configs_folder_is_left_out(tmp_path, capsys):
    """A dpsgd result copied into a flash folder would be a second dpsgd row: one warning."""
    write_run(tmp_path, RESULTS)
    copied = tmp_path / "flash_bs2_seq16"
    copied.mkdir()
    (copied / "result.json").write_bytes(
        (tmp_path / "dpsgd_bs2_seq16" / "result.json").read_bytes()
    )
    results = report.load_results(str(tmp_path))
    assert sorted(r["config_dir"] for r in results) == sorted(r["config_dir"] for r in RESULTS)
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and "/flash_bs2_seq16/result.json: " in warnings[0]
    assert "'dpsgd_bs2_seq16', not of its folder" in warnings[0]


def test_a_run_whose_only_result_is_unreadable_says_so(tmp_path, capsys):
    (tmp_path / "standard_bs2_seq16").mkdir()
    (tmp_path / "standard_bs2_seq16" / "result.json").write_text("{")
    assert profiling_script.main(["--mode=report", "--input_dir", str(tmp_path)]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning.startswith("warning: skipped ") and "not JSON" in warning
    assert error == f"error: {tmp_path} has no readable result: 1 result file skipped"


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        ({"status": "fine"}, "status"),
        ({"config": []}, "no config"),
        ({"step_times_ms": [1.0, "x"]}, "step_times_ms"),
        ({"breakdown": {"params": None}}, "breakdown"),
        ({"kernels": {"gemm": 3}}, "kernels"),
        ({"peak_memory_mb": True}, "peak_memory_mb"),
        ({"phase_costs": {"forward": {"time_ms": "1"}}}, "phase_costs"),
    ],
)
def test_result_problem_names_the_key(change, phrase):
    assert result_problem(GOOD) is None
    # a CPU sweep's phase costs: times, no memory, and a note beside the operations
    ops = {
        op: {"time_ms": 1.0, "peak_mb": None} for op in ("forward", "backward", "optimizer_step")
    }
    assert result_problem(GOOD | {"phase_costs": ops | {"memory_note": "CPU"}}) is None
    assert phrase in result_problem(GOOD | change)


def test_a_failing_plot_keeps_the_tables_and_the_other_plots(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, RESULTS)
    real = figures.save_figure

    def save_figure(fig, path, dpi=110):
        if path.endswith("performance_tradeoff.png"):
            figures.pyplot().close(fig)
            raise OSError(28, "No space left on device")
        return real(fig, path, dpi)

    monkeypatch.setattr(figures, "save_figure", save_figure)
    text = report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    failed = [line for line in text.splitlines() if "not written" in line]
    assert failed == ["plot tradeoff not written: OSError: [Errno 28] No space left on device"]
    assert "time_vs_standard" in text and (tmp_path / "summary.csv").exists()
    assert (tmp_path / "visualizations" / "memory_breakdown_comparison.png").exists()
    assert not (tmp_path / "visualizations" / "performance_tradeoff.png").exists()
    assert "No space left on device" in capsys.readouterr().err


def test_spread_of_the_measured_steps_and_the_noisy_flag():
    steady = GOOD | {"step_times_ms": [9.8, 10.0, 10.5], "median_time_ms": 10.0}
    noisy = GOOD | {"step_times_ms": [9.0, 10.0, 12.0], "median_time_ms": 10.0}
    assert tables.step_spread(steady) == pytest.approx(
        {"min_ms": 9.8, "max_ms": 10.5, "spread_pct": 7.0, "noisy": False}
    )
    assert tables.step_spread(noisy)["noisy"] is True
    assert tables.step_spread(GOOD | {"step_times_ms": []})["spread_pct"] is None
    lines = tables.format_table(tables.summary_rows([steady])).splitlines()
    assert "steps_ms" in lines[0] and "spread" in lines[0]
    assert "9.80-10.50" in lines[2] and "7.0%" in lines[2] and "NOISY" not in lines[2]
    assert "30.0% NOISY" in tables.format_table(tables.summary_rows([noisy]))


def test_summary_text_uses_the_median_and_has_no_memory_per_time_column():
    # MB divided by ms measures nothing: the old "Memory/Time" column is gone
    result = run_result("standard", 2, 1.8, 500.0) | {"avg_time_ms": 900.0}
    text = summary_text([result])
    line = next(x for x in text.splitlines() if x.startswith("Standard"))
    assert line.split()[-2:] == ["1.80", "500.00"]
    header = next(x for x in text.splitlines() if x.startswith("Method"))
    assert "Memory/Time" not in header and header.split("  ")[-1].strip() == "Median Time (ms)"
