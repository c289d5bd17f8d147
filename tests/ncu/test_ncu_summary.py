"""ncu.summary: ncu_summary.csv / .md / ncu_comparison.png from a directory of reports, with
ratios against standard only within one replay mode."""

import csv
import os
import shutil

import pytest
from ncu_testdata import (
    FIXTURE,
    MIXED,
    RANGE_FIXTURE,
    RANGE_STANDARD,
    STANDARD,
    fake_ncu,
    raw_csv,
    read_text,
    write_reports,
)

from dp_cost.ncu import export, summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_summary_csv(directory) -> dict:
    with open(directory / "ncu_summary.csv") as f:
        return {r["trainer"]: r for r in csv.DictReader(f)}


def test_write_ncu_summary_from_csvs(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "find_ncu", lambda: None)  # CSVs alone must do
    write_reports(tmp_path)
    (tmp_path / "notes.csv").write_text("not a report\n")
    text = summary.write_ncu_summary(str(tmp_path))
    assert {"ncu_summary.csv", "ncu_summary.md", "ncu_comparison.png"} <= set(os.listdir(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    assert (tmp_path / "ncu_comparison.png").read_bytes()[:8] == PNG_MAGIC

    rows = read_summary_csv(tmp_path)
    assert list(rows) == ["standard", "dpsgd"]
    std, dp = rows["standard"], rows["dpsgd"]
    assert float(std["dram_bytes"]) == 2.5e9 and float(std["dram_vs_standard"]) == 1.0
    assert float(dp["dram_vs_standard"]) == pytest.approx(2.0)
    assert float(dp["l2_vs_standard"]) == pytest.approx(1.25)
    assert float(dp["time_vs_standard"]) == pytest.approx(3.0)
    assert float(dp["norm_clip_dram_read_bytes"]) == 2.5e9
    assert float(dp["gemm_time_ms"]) == pytest.approx(1.0)
    assert int(dp["kernels"]) == 3 and dp["batch"] == "8" and dp["seq"] == "256"

    md = (tmp_path / "ncu_summary.md").read_text()
    dp_line = next(
        line for line in md.splitlines() if line.startswith("| dpsgd | 8 | 256 | kernel | 3 |")
    )
    assert "| 2.00 | 1.25 | 3.00 |" in dp_line
    assert "2.500 (+2.500)" in md  # norm_clip: extra DRAM GB over standard
    assert "5.000 (+2.500)" in md  # total
    assert "GB = 10^9 bytes" in md
    assert "dpsgd" in text and "2.00" in text and "(+2.500)" in text


def test_summary_mixed_replay_modes_has_no_cross_mode_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "find_ncu", lambda: None)
    write_reports(tmp_path)  # standard and dpsgd: kernel replay
    shutil.copy(RANGE_FIXTURE, tmp_path / "report_flash_bs8_seq256.csv")  # app-range
    (tmp_path / "report_ghost_bs8_seq256.csv").write_text(raw_csv(MIXED))
    text = summary.write_ncu_summary(str(tmp_path))
    assert (tmp_path / "ncu_comparison.png").read_bytes()[:8] == PNG_MAGIC

    rows = read_summary_csv(tmp_path)
    std, dp, flash = rows["standard"], rows["dpsgd"], rows["flash"]
    assert std["replay"] == dp["replay"] == "kernel" and flash["replay"] == "range"
    assert float(dp["dram_vs_standard"]) == pytest.approx(2.0)  # same mode: ratios as before
    assert float(dp["time_vs_standard"]) == pytest.approx(3.0)
    assert dp["range_time_ms"] == ""
    # flash is a range replay, standard a kernel replay: no ratios across modes
    assert flash["dram_vs_standard"] == flash["l2_vs_standard"] == flash["time_vs_standard"] == ""
    assert float(flash["range_time_ms"]) == pytest.approx(117.483968)
    assert float(flash["dram_read_bytes"]) == 5961269248
    assert float(flash["dram_write_bytes"]) == 4189005312
    assert flash["kernels"] == flash["kernel_time_ms"] == flash["gemm_dram_read_bytes"] == ""
    assert flash["error"] == ""  # one range row is a measured report
    assert "mixes 1 range results with 1 kernel results" in rows["ghost"]["error"]

    md = (tmp_path / "ncu_summary.md").read_text()
    assert "| flash | 8 | 256 | range | - | - | 117.5 | 5.961 | 4.189 | 32.688 |" in md
    assert md.count("| - | - | - |") >= 1  # flash's three ratios
    categories = md.split("## DRAM GB per kernel category")[1].split("GB = 10^9")[0]
    assert "| dpsgd | 8 | 256 |" in categories and "| flash |" not in categories
    assert summary.CATEGORIES_NEED_KERNEL_REPLAY not in text
    assert "report_ghost_bs8_seq256: ValueError" in text


def test_summary_of_range_replays_only(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "find_ncu", lambda: None)
    (tmp_path / "report_standard_bs8_seq256.csv").write_text(raw_csv(RANGE_STANDARD))
    shutil.copy(RANGE_FIXTURE, tmp_path / "report_flash_bs8_seq256.csv")
    text = summary.write_ncu_summary(str(tmp_path))
    assert (tmp_path / "ncu_comparison.png").read_bytes()[:8] == PNG_MAGIC

    rows = read_summary_csv(tmp_path)
    flash = rows["flash"]
    assert rows["standard"]["replay"] == flash["replay"] == "range"
    # same replay mode at the same shape: ratios against standard (DRAM 3 GB, L2 10 GB, 50 ms)
    assert float(flash["dram_vs_standard"]) == pytest.approx((5961269248 + 4189005312) / 3e9)
    assert float(flash["l2_vs_standard"]) == pytest.approx(32688062368 / 10e9)
    assert float(flash["time_vs_standard"]) == pytest.approx(117.483968 / 50)

    line = (
        "per-category numbers need per-kernel replay: ./run_profiling_ncu.sh --replay-mode kernel"
    )
    md = (tmp_path / "ncu_summary.md").read_text()
    assert line in text and line in md
    assert "| attention |" not in md and "attention" not in text  # no category table


def test_summary_usage_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="existing directory"):
        summary.write_ncu_summary(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no report_"):
        summary.write_ncu_summary(str(tmp_path))
    monkeypatch.setattr(export, "find_ncu", lambda: None)
    (tmp_path / "report_flash_bs8_seq256.ncu-rep").write_bytes(b"binary")
    with pytest.raises(ValueError, match="ncu .*not found"):
        summary.write_ncu_summary(str(tmp_path))
    # A CSV newer than its report is used as is: no ncu needed.
    (tmp_path / "report_flash_bs8_seq256.csv").write_text(raw_csv(STANDARD))
    os.utime(tmp_path / "report_flash_bs8_seq256.ncu-rep", (1, 1))
    assert "flash" in summary.write_ncu_summary(str(tmp_path))


def test_summary_exports_reports_with_ncu(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "ncu_args"
    monkeypatch.setenv("NCU", fake_ncu(bin_dir, f'echo "$@" > {log}\ncat {FIXTURE}\n'))
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "report_ghost_bs8_seq256.ncu-rep").write_bytes(b"binary")
    text = summary.write_ncu_summary(str(reports))
    assert "--import" in log.read_text() and "--page raw" in log.read_text()
    assert (reports / "report_ghost_bs8_seq256.csv").read_text() == read_text(FIXTURE)
    assert "ghost" in text and "1.112" in text  # dram read GB of the fixture


def test_broken_report_is_listed_not_fatal(tmp_path):
    write_reports(tmp_path)
    (tmp_path / "report_ghost_bs8_seq256.csv").write_text("garbage\n")
    text = summary.write_ncu_summary(str(tmp_path))
    assert "report_ghost_bs8_seq256: ValueError" in text
    assert "Not measured" in (tmp_path / "ncu_summary.md").read_text()
