"""ncu.export: units, ``--page raw`` CSV parsing, per-step and per-category aggregation, the DRAM
lower bound, and loading a directory of reports."""

import csv
import io
import shutil

import pytest
from ncu_testdata import (
    ELEMENTWISE,
    GEMM,
    H100_KERNEL_FIXTURE,
    H100_RANGE_FIXTURE,
    MIXED,
    NORM,
    RANGE_FIXTURE,
    fixture_rows,
    raw_csv,
    read_text,
)

from dp_cost.core import kernel_names as kernels
from dp_cost.core.schema import KERNEL_CATEGORIES
from dp_cost.ncu import export as ncu


def test_units():
    assert ncu.unit_factor("byte") == 1
    assert ncu.unit_factor("Kbyte") == 1e3
    assert ncu.unit_factor("Gbyte") == 1e9
    assert ncu.unit_factor("Mibyte") == 2**20
    assert ncu.unit_factor("Gbyte/second") == 1e9
    assert ncu.unit_factor("byte/usecond") == pytest.approx(1e6)
    assert ncu.unit_factor("msecond") == 1e6  # to ns
    assert ncu.unit_factor("nsecond") == 1
    assert ncu.unit_factor("Ksector") == 1e3
    assert ncu.unit_factor("%") == 1
    assert ncu.unit_factor("") == 1


def test_parse_fixture():
    rows = fixture_rows()
    assert len(rows) == 7
    first = rows[0]
    assert first["ID"] == "0" and first["Kernel Name"].startswith(GEMM)
    assert first["Stream"] == "7" and first["Block Size"] == "(384, 1, 1)"
    assert first["dram__bytes_read.sum"] == pytest.approx(12.58e6)  # Mbyte
    assert first["dram__bytes_write.sum"] == pytest.approx(4194.30e3)  # "4,194.30" Kbyte
    assert first["gpu__time_duration.sum"] == pytest.approx(85410)  # usecond -> ns
    assert first["lts__t_sectors_op_read.sum"] == 1048576  # "1,048,576" sector
    assert rows[3]["dram__bytes_write.sum"] == pytest.approx(1048576e3)  # "1,048,576.00" Kbyte
    assert rows[0]["dram__bytes_read.sum.per_second"] > 1e11  # Gbyte/second -> bytes/s
    assert rows[6]["l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum"] is None  # n/a
    assert rows[1]["Kernel Name"] == ELEMENTWISE  # quoted commas kept
    assert rows[2]["Kernel Name"] == NORM


def test_parse_edge_cases():
    assert ncu.parse_raw_csv("==PROF== Disconnected from process 1\n") == []
    with pytest.raises(ValueError, match="raw CSV"):
        ncu.parse_raw_csv("Kernel,Time\nx,1\n")
    no_units = '"ID","Kernel Name","dram__bytes_read.sum"\n"0","k","1,000"\n'
    assert ncu.parse_raw_csv(no_units) == [
        {"ID": "0", "Kernel Name": "k", "dram__bytes_read.sum": 1000.0}
    ]


def test_fixture_categories():
    names = [row["Kernel Name"] for row in fixture_rows()]
    assert [kernels.categorize(n) for n in names] == [
        "gemm", "elementwise", "norm_clip", "reduction", "optimizer", "gemm", "other",
    ]  # fmt: skip


def test_aggregate_fixture_by_hand():
    agg = ncu.aggregate(fixture_rows())
    # Column sums by hand, in the fixture's units (Mbyte, Kbyte, usecond, sector).
    assert agg["dram_read_bytes"] == pytest.approx(1112.14e6)
    assert agg["dram_write_bytes"] == pytest.approx(1077936.76e3)
    assert agg["l2_bytes"] == pytest.approx(2265.19e6)
    assert agg["l2_read_sectors"] == 37619712
    assert agg["l2_write_sectors"] == 33689616
    assert agg["global_load_bytes"] == pytest.approx(1137.23e6)  # the n/a kernel left out
    assert agg["global_store_bytes"] == pytest.approx(1077936.63e3)
    assert agg["kernel_time_ms"] == pytest.approx(1.19516)
    assert agg["kernel_count"] == 7
    assert agg["achieved_dram_gbps"] == pytest.approx((1112.14e6 + 1077936.76e3) / 1.19516e-3 / 1e9)
    assert agg["incomplete"] == [
        "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum",
        "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum",
    ]
    cats = agg["categories"]
    assert set(cats) == set(kernels.CATEGORIES)
    assert cats["gemm"]["count"] == 2
    assert cats["gemm"]["dram_read_bytes"] == pytest.approx(25.16e6)
    assert cats["gemm"]["dram_write_bytes"] == pytest.approx(8388.60e3)
    assert cats["gemm"]["l2_bytes"] == pytest.approx(81.0e6)
    assert cats["gemm"]["time_ms"] == pytest.approx(0.1704)
    assert cats["norm_clip"]["dram_read_bytes"] == pytest.approx(4.19e6)
    assert cats["reduction"]["time_ms"] == pytest.approx(0.98025)
    assert cats["optimizer"]["dram_write_bytes"] == pytest.approx(16777.22e3)
    assert cats["other"]["count"] == 1
    assert cats["attention"] == {
        "dram_read_bytes": 0.0, "dram_write_bytes": 0.0, "l2_bytes": 0.0, "time_ms": 0.0,
        "count": 0,
    }  # fmt: skip
    total = sum(c["dram_read_bytes"] for c in cats.values())
    assert total == pytest.approx(agg["dram_read_bytes"])


def test_aggregate_missing_metric_is_none():
    agg = ncu.aggregate([{"Kernel Name": "ampere_sgemm_128x64_tn", "gpu__time_duration.sum": 5e3}])
    assert agg["dram_read_bytes"] is None and agg["achieved_dram_gbps"] is None
    assert agg["categories"]["gemm"]["dram_read_bytes"] is None
    assert agg["categories"]["gemm"]["time_ms"] == pytest.approx(0.005)
    assert ncu.aggregate([])["kernel_count"] == 0


def test_aggregate_range_fixture_by_hand():
    """The real app-range export: one row named "range" with the whole step's totals."""
    rows = ncu.parse_raw_csv(read_text(RANGE_FIXTURE))
    assert len(rows) == 1 and rows[0]["Kernel Name"] == "range"
    agg = ncu.aggregate(rows)
    assert agg["replay"] == "range"
    assert agg["dram_read_bytes"] == 5961269248
    assert agg["dram_write_bytes"] == 4189005312
    assert agg["l2_bytes"] == 32688062368
    assert agg["range_time_ms"] == pytest.approx(117.483968)
    assert agg["range_count"] == 1
    assert agg["kernel_count"] is None and agg["kernel_time_ms"] is None
    assert agg["categories"] is None
    assert agg["achieved_dram_gbps"] == pytest.approx((5961269248 + 4189005312) / 0.117483968 / 1e9)
    assert agg["l2_read_sectors"] is None  # not exported in this fixture
    assert agg["incomplete"] == []


def test_full_range_export_from_an_h100():
    """A whole, unfiltered export of a real app-range report (ghost, bs 16, seq 1024, the suite's
    model; ncu 2025.3.1 on an H100): 282 columns, device attributes included. The totals must be
    the metric cells as ncu printed them (read here with the csv module), sectors as counts."""
    text = read_text(H100_RANGE_FIXTURE)
    header, units, values = csv.reader(io.StringIO(text))

    def cell(name):
        return int(values[header.index(name)].replace(",", ""))

    assert units[header.index("lts__t_sectors_op_read.sum")] == "sector"
    agg = ncu.aggregate(ncu.parse_raw_csv(text))
    assert agg["replay"] == "range" and agg["range_count"] == 1
    assert agg["dram_read_bytes"] == cell("dram__bytes_read.sum") == 115_467_052_032
    assert agg["dram_write_bytes"] == cell("dram__bytes_write.sum")
    assert agg["l2_bytes"] == cell("lts__t_bytes.sum")
    assert agg["l2_read_sectors"] == cell("lts__t_sectors_op_read.sum")
    assert agg["range_time_ms"] == pytest.approx(cell("gpu__time_duration.sum") / 1e6)
    assert agg["incomplete"] == []


def test_aggregate_kernel_replay_keys():
    agg = ncu.aggregate(fixture_rows())
    assert agg["replay"] == "kernel"
    assert agg["range_time_ms"] is None and agg["range_count"] is None
    assert agg["kernel_count"] == 7


def test_aggregate_rejects_mixed_range_and_kernel_rows():
    rows = ncu.parse_raw_csv(raw_csv(MIXED))
    with pytest.raises(ValueError, match="mixes 1 range results with 1 kernel results"):
        ncu.aggregate(rows)


def test_dram_lower_bound():
    bound = ncu.dram_lower_bound_bytes(1000, batch=2, seq=3, hidden=4, num_layers=5, vocab=7)
    assert bound["weights_forward"] == bound["weights_backward"] == bound["gradients_write"] == 4000
    assert bound["optimizer"] == 12000
    assert bound["activations"] == 2 * 4 * 5 * 2 * 3 * 4 * 4
    assert bound["logits"] == 4 * 2 * 3 * 7 * 4
    assert bound["total"] == 24000 + bound["activations"] + bound["logits"]
    assert "4 activations" in bound["assumptions"]


def test_real_h100_export_parses_and_sums():
    """A real export (`ncu --import --csv --page raw --print-units base`) of the standard
    trainer's step on an H100 (first 60 kernels, columns trimmed): parsed sums equal a plain
    csv-module sum of the same columns, and every kernel gets a category."""
    text = read_text(H100_KERNEL_FIXTURE)
    table = list(csv.reader(text.splitlines()))
    header, data = table[0], table[2:]

    def column_sum(name):
        index = header.index(name)
        return sum(float(row[index].replace(",", "")) for row in data)

    rows = ncu.parse_raw_csv(text)
    totals = ncu.aggregate(rows)
    assert totals["kernel_count"] == len(data) == 60
    assert totals["dram_read_bytes"] == pytest.approx(column_sum("dram__bytes_read.sum"))
    assert totals["dram_write_bytes"] == pytest.approx(column_sum("dram__bytes_write.sum"))
    assert totals["l2_bytes"] == pytest.approx(column_sum("lts__t_bytes.sum"))
    assert totals["kernel_time_ms"] == pytest.approx(column_sum("gpu__time_duration.sum") / 1e6)
    assert not totals["incomplete"]
    by_category = totals["categories"]
    assert set(by_category) == set(KERNEL_CATEGORIES)
    assert sum(c["count"] for c in by_category.values()) == 60
    assert by_category["gemm"]["count"] > 0 and by_category["norm_clip"]["count"] > 0


def test_load_reports_range_report_is_measured(tmp_path):
    shutil.copy(RANGE_FIXTURE, tmp_path / "report_flash_bs8_seq256.csv")
    (tmp_path / "report_standard_bs8_seq256.csv").write_text(raw_csv([]))  # header, no rows
    entries = {e["trainer"]: e for e in ncu.load_reports(str(tmp_path))}
    assert entries["flash"]["error"] is None and entries["flash"]["range_count"] == 1
    assert entries["standard"]["error"] == "no kernels in the report"
