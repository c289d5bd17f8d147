"""--mode=ncu_report survives any file: a FIFO, a device, bytes that are not UTF-8 or not a CSV
are each one "Not measured" line naming the report, the others summarised; kernel names longer
than csv's default field limit parse; non-finite numbers are blank, not -inf."""

import csv
import os
import threading

import pytest
from ncu_testdata import GEMM, STANDARD, raw_csv, write_reports

from dp_cost.ncu import export, summary


def test_bad_report_files_are_named_and_the_rest_summarised(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "find_ncu", lambda: None)
    write_reports(tmp_path)
    os.mkfifo(tmp_path / "report_flash_bs8_seq256.csv")
    os.symlink("/dev/zero", tmp_path / "report_ghost_bs8_seq256.csv")
    (tmp_path / "report_flash_bs4_seq256.csv").write_bytes(b'"ID"\xff\xfe\n')
    (tmp_path / "report_ghost_bs4_seq256.csv").write_text("a spreadsheet, not ncu\n")
    out = []
    thread = threading.Thread(target=lambda: out.append(summary.write_ncu_summary(str(tmp_path))))
    thread.daemon = True
    thread.start()
    thread.join(timeout=30)
    assert out, "a FIFO or device was read as a report"
    text = out[0]
    assert "Not measured (4 reports):" in text
    for name, why in (
        ("report_flash_bs8_seq256", "not a regular file"),
        ("report_ghost_bs8_seq256", "not a regular file"),
        ("report_flash_bs4_seq256", "not UTF-8"),
        ("report_ghost_bs4_seq256", "not ncu --page raw CSV"),
    ):
        line = next(x for x in text.splitlines() if x.startswith(f"- {name}: "))
        assert why in line, line
    with open(tmp_path / "ncu_summary.csv") as f:
        rows = {r["report"]: r for r in csv.DictReader(f)}
    assert float(rows["report_dpsgd_bs8_seq256"]["dram_vs_standard"]) == pytest.approx(2.0)


def test_kernel_names_past_the_csv_field_limit(tmp_path):
    name = "void kernel<" + "x" * 200_000 + ">()"
    rows = export.parse_raw_csv(raw_csv([(name, 1e9, 0, 1e9, 1e3), *STANDARD]))
    assert rows[0]["Kernel Name"] == name and len(rows) == 1 + len(STANDARD)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "NaN"])
def test_non_finite_numbers_are_not_measurements(tmp_path, value):
    text = raw_csv([(GEMM, 1e9, 0, 1e9, 1e3)]).replace('"1,000,000,000"', f'"{value}"', 1)
    row = export.parse_raw_csv(text)[0]
    assert row["dram__bytes_read.sum"] is None
    (tmp_path / "report_standard_bs8_seq256.csv").write_text(text)
    summary.write_ncu_summary(str(tmp_path))
    written = (tmp_path / "ncu_summary.csv").read_text() + (tmp_path / "ncu_summary.md").read_text()
    assert "inf" not in written.lower() and "nan" not in written.lower()


def test_a_details_page_export_is_named_not_summarised_as_empty(tmp_path):
    """``ncu --csv`` without ``--page raw`` has one row per metric and no metric columns: that
    report is not measured (and says how to export it), not a row of dashes."""
    details = (
        '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
        '"0","ampere_sgemm","Memory Workload Analysis","DRAM Throughput","%","12.5"\n'
    )
    (tmp_path / "report_standard_bs8_seq256.csv").write_text(details)
    (entry,) = export.load_reports(str(tmp_path))
    assert "--page raw" in entry["error"]
