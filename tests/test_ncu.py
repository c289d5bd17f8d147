"""ncu.py and run_profiling_ncu.sh on CPU: command lines, metric names, CSV parsing, summaries.

tests/fixtures/ncu_raw_small.csv is hand-written to the documented shape of Nsight Compute 2025's
``ncu --csv --page raw`` output (quoted fields, a unit row, thousands separators, per-column unit
prefixes, ==PROF== lines, n/a values); ncu_raw_h100_standard.csv (kernel replay) and
ncu_raw_range_h200.csv (app-range replay: one row named ``range``) are real recordings.
"""

import csv
import io
import os
import shutil
import stat
import subprocess
import sys

import pytest
from cli_helpers import ROOT

import kernels
import ncu

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "ncu_raw_small.csv")
RANGE_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "ncu_raw_range_h200.csv")
SCRIPT = os.path.join(ROOT, "run_profiling_ncu.sh")
PY_BIN = os.path.dirname(sys.executable)
BASE_PATH = f"{PY_BIN}:/usr/bin:/bin"

GEMM = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<float>, std::array<char *, (unsigned long)3>>(int, T2, T3)"  # noqa: E501
NORM = "void at::native::reduce_kernel<(int)512, (int)1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float, (bool)0>, unsigned int, float, (int)4, (int)4>>(T3)"  # noqa: E501


def fixture_rows():
    with open(FIXTURE, encoding="utf-8") as f:
        return ncu.parse_raw_csv(f.read())


# ---------------------------------------------------------------- command lines


def test_ncu_command_exact_argv():
    args = ncu.profile_args("hooks", 8, 256, ["--hidden_dim", "1024"])
    cmd = ncu.ncu_command("ncu_reports/report_dpsgd_bs8_seq256.ncu-rep", args, python="python3")
    assert cmd == [
        "ncu",
        "--profile-from-start",
        "off",
        "--clock-control",
        "none",
        "--metrics",
        "dram__bytes_read.sum,dram__bytes_write.sum,dram__bytes_read.sum.per_second,"
        "dram__bytes_write.sum.per_second,lts__t_bytes.sum,lts__t_sectors_op_read.sum,"
        "lts__t_sectors_op_write.sum,l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum,"
        "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum,gpu__time_duration.sum",
        "--target-processes",
        "all",
        "-f",
        "-o",
        "ncu_reports/report_dpsgd_bs8_seq256",
        "python3",
        "profiling_script.py",
        "--mode=profile",
        "--trainer=dpsgd",
        "--batch_size=8",
        "--seq_len=256",
        "--device=cuda",
        "--no_trace",
        "--hidden_dim",
        "1024",
        "--ncu",
    ]


def test_ncu_command_options():
    cmd = ncu.ncu_command(
        "r", ["--ncu", "--mode=profile"], metrics="dram__bytes_read.sum", clock_control="base",
        nvtx=True, ncu="/opt/ncu",
    )  # fmt: skip
    assert cmd[:9] == [
        "/opt/ncu", "--profile-from-start", "off", "--clock-control", "base",
        "--metrics", "dram__bytes_read.sum", "--nvtx", "--nvtx-include",
    ]  # fmt: skip
    assert cmd[9] == "step/"
    assert cmd[-2:] == ["--ncu", "--mode=profile"]  # --ncu not added twice
    with pytest.raises(ValueError, match="clock-control"):
        ncu.ncu_command("r", [], clock_control="fast")
    with pytest.raises(ValueError, match="nvprof"):
        ncu.ncu_command("r", [], metrics=["gld_throughput"])


DEFAULT_METRICS = (
    "dram__bytes_read.sum,dram__bytes_write.sum,dram__bytes_read.sum.per_second,"
    "dram__bytes_write.sum.per_second,lts__t_bytes.sum,lts__t_sectors_op_read.sum,"
    "lts__t_sectors_op_write.sum,l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum,"
    "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum,gpu__time_duration.sum"
)


@pytest.mark.parametrize("mode", ["app-range", "range"])
def test_ncu_command_range_modes_exact_argv(mode):
    args = ncu.profile_args("flash", 8, 256)
    cmd = ncu.ncu_command(
        "ncu_reports/report_flash_bs8_seq256", args, python="python3", replay_mode=mode
    )
    assert cmd == [
        "ncu", "--replay-mode", mode, "--clock-control", "none", "--metrics", DEFAULT_METRICS,
        "--target-processes", "all", "-f", "-o", "ncu_reports/report_flash_bs8_seq256",
        "python3", "profiling_script.py", "--mode=profile", "--trainer=flash", "--batch_size=8",
        "--seq_len=256", "--device=cuda", "--no_trace", "--ncu",
    ]  # fmt: skip
    assert "--profile-from-start" not in cmd  # ncu rejects it in range replay


def test_ncu_command_kernel_mode_is_the_default():
    args = ncu.profile_args("flash", 8, 256)
    default = ncu.ncu_command("r", args, python="python3")
    assert ncu.ncu_command("r", args, python="python3", replay_mode="kernel") == default
    assert default[:3] == ["ncu", "--profile-from-start", "off"]
    assert "--replay-mode" not in default
    assert ncu.REPLAY_MODES == ("app-range", "kernel", "range")


def test_ncu_command_replay_mode_errors():
    with pytest.raises(ValueError, match="--nvtx .* needs --replay-mode kernel"):
        ncu.ncu_command("r", [], nvtx=True, replay_mode="app-range")
    with pytest.raises(ValueError, match="--nvtx"):
        ncu.ncu_command("r", [], nvtx=True, replay_mode="range")
    with pytest.raises(ValueError) as error:
        ncu.ncu_command("r", [], replay_mode="application")
    assert str(error.value) == (
        "--replay-mode must be one of app-range, kernel, range (got 'application')"
    )


def test_export_command():
    cmd = ncu.export_command("d/report_flash_bs8_seq256.ncu-rep")
    assert cmd[:4] == ["ncu", "--import", "d/report_flash_bs8_seq256.ncu-rep", "--csv"]
    assert cmd[4:6] == ["--page", "raw"]
    assert "--print-kernel-base" in cmd and "demangled" in cmd


def test_report_names():
    assert ncu.report_name("dpsgd_ghost", 16, 1024) == "report_ghost_bs16_seq1024"
    assert ncu.parse_report_name("x/report_flash_bs8_seq256.ncu-rep") == ("flash", 8, 256)
    assert ncu.parse_report_name("report_standard_bs16_seq1024.csv") == ("standard", 16, 1024)
    assert ncu.parse_report_name("report_vanilla_bs8_seq256") is None  # aliases are never written
    assert ncu.parse_report_name("ncu_summary.csv") is None
    with pytest.raises(ValueError, match="unknown trainer"):
        ncu.report_name("adam", 8, 256)


def test_command_cli_prints_a_shell_command():
    proc = subprocess.run(
        [sys.executable, "ncu.py", "command", "--trainer", "ghost", "--batch_size", "16",
         "--seq_len", "1024", "--report_dir", "out dir", "--python", "py",
         "--", "--dtype", "bfloat16"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "-o 'out dir/report_ghost_bs16_seq1024' py profiling_script.py" in proc.stdout
    assert proc.stdout.rstrip().endswith("--dtype bfloat16 --ncu")


def test_command_cli_replay_mode():
    base = [sys.executable, "ncu.py", "command", "--trainer", "flash", "--batch_size", "8",
            "--seq_len", "256", "--ncu", "/opt/ncu"]  # fmt: skip
    proc = subprocess.run([*base, "--replay_mode", "app-range"], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("/opt/ncu --replay-mode app-range --clock-control none ")
    assert "--profile-from-start" not in proc.stdout
    bad = subprocess.run([*base, "--replay-mode", "bogus"], cwd=ROOT, capture_output=True,
                         text=True)  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "error: --replay-mode must be one of app-range, kernel, range (got 'bogus')"
    ]


# ---------------------------------------------------------------- metric names


@pytest.mark.parametrize("name", sorted(ncu.NVPROF_TO_NCU))
def test_nvprof_names_map_to_ncu_names(name):
    replacement = ncu.NVPROF_TO_NCU[name]
    if replacement is None:
        with pytest.raises(ValueError, match="no ncu equivalent"):
            ncu.translate_metrics([name])
        return
    for metric in ncu.metrics_in_formula(replacement):
        assert metric in ncu.METRICS or ncu.NCU_METRIC_NAME.match(metric), metric
        assert metric not in ncu.NVPROF_TO_NCU
    with pytest.raises(ValueError) as error:
        ncu.translate_metrics(f"dram__bytes_read.sum,{name}")
    assert str(error.value) == f"{name!r} is an nvprof metric; in ncu use {replacement}"


def test_seed_names_are_known():
    for name in ("dram_read_throughput", "dram_write_throughput", "l2_read_throughput",
                 "l2_write_throughput", "gld_throughput", "gst_throughput", "achieved_occupancy",
                 "sm_efficiency", "dram_read_bytes", "gld_transactions",
                 "gst_transactions"):  # fmt: skip
        assert name in ncu.NVPROF_TO_NCU
    assert ncu.NVPROF_TO_NCU["dram_read_throughput"] == "dram__bytes_read.sum.per_second"
    assert ncu.NVPROF_TO_NCU["dram_write_bytes"] == "dram__bytes_write.sum"
    assert ncu.NVPROF_TO_NCU["gst_throughput"] == (
        "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum.per_second"
    )
    assert ncu.NVPROF_TO_NCU["achieved_occupancy"] == (
        "sm__warps_active.avg.pct_of_peak_sustained_active"
    )
    assert ncu.metrics_in_formula(ncu.NVPROF_TO_NCU["l2_read_throughput"]) == [
        "lts__t_sectors_op_read.sum.per_second",
        "lts__t_sectors_op_atom.sum.per_second",
        "lts__t_sectors_op_red.sum.per_second",
    ]


def test_valid_names_pass():
    assert ncu.translate_metrics(list(ncu.METRICS)) == list(ncu.METRICS)
    assert ncu.translate_metrics(" dram__bytes_read.sum , dram__bytes_read.sum,regex:lts__.*") == [
        "dram__bytes_read.sum",
        "regex:lts__.*",
    ]
    with pytest.raises(ValueError, match="not an ncu metric"):
        ncu.translate_metrics("dram_bytes")
    with pytest.raises(ValueError, match="no metric"):
        ncu.translate_metrics(" , ")


# ---------------------------------------------------------------- parsing


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
    with open(RANGE_FIXTURE, encoding="utf-8") as f:
        rows = ncu.parse_raw_csv(f.read())
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
    path = os.path.join(os.path.dirname(RANGE_FIXTURE), "ncu_raw_range_h100_ghost_full.csv")
    with open(path, encoding="utf-8") as f:
        text = f.read()
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
    rows = ncu.parse_raw_csv(raw_csv([("range", 1e9, 1e9, 1e9, 1e6), (GEMM, 1e9, 0, 1e9, 1e3)]))
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


# ---------------------------------------------------------------- summary

UNITS = ["byte", "byte", "byte", "nsecond"]
METRIC_COLS = ["dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum",
               "gpu__time_duration.sum"]  # fmt: skip


def raw_csv(kernel_rows) -> str:
    """A --page raw CSV of (name, dram read, dram write, L2 bytes, time ns) rows."""
    labels = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream"]
    quote = lambda cells: ",".join(f'"{c}"' for c in cells)
    lines = [quote(labels + METRIC_COLS), quote([""] * len(labels) + UNITS)]
    for i, (name, *values) in enumerate(kernel_rows):
        lines.append(quote([i, 1, "python3", "h", name, 1, 7] + [f"{v:,.0f}" for v in values]))
    return "\n".join(lines) + "\n"


STANDARD = [(GEMM, 1e9, 0.5e9, 3e9, 1e6), (ELEMENTWISE, 0.5e9, 0.5e9, 1e9, 0.5e6)]
# dpsgd = standard + one norm kernel: DRAM 2.5 -> 5 GB (x2), L2 4 -> 5 GB (x1.25),
# kernel time 1.5 -> 4.5 ms (x3)
DPSGD = STANDARD + [(NORM, 2.5e9, 0, 1e9, 3e6)]


def write_reports(directory):
    (directory / "report_standard_bs8_seq256.csv").write_text(raw_csv(STANDARD))
    (directory / "report_dpsgd_bs8_seq256.csv").write_text(raw_csv(DPSGD))


def test_write_ncu_summary_from_csvs(tmp_path, monkeypatch):
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)  # CSVs alone must do
    write_reports(tmp_path)
    (tmp_path / "notes.csv").write_text("not a report\n")
    text = ncu.write_ncu_summary(str(tmp_path))
    assert {"ncu_summary.csv", "ncu_summary.md", "ncu_comparison.png"} <= set(os.listdir(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    assert (tmp_path / "ncu_comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    import csv

    with open(tmp_path / "ncu_summary.csv") as f:
        rows = {r["trainer"]: r for r in csv.DictReader(f)}
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


def read_summary_csv(directory) -> dict:
    import csv

    with open(directory / "ncu_summary.csv") as f:
        return {r["trainer"]: r for r in csv.DictReader(f)}


# A range replay's export: one row named "range" (read, write, L2 bytes, time ns).
RANGE_STANDARD = [("range", 2e9, 1e9, 10e9, 50e6)]


def test_summary_mixed_replay_modes_has_no_cross_mode_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)
    write_reports(tmp_path)  # standard and dpsgd: kernel replay
    shutil.copy(RANGE_FIXTURE, tmp_path / "report_flash_bs8_seq256.csv")  # app-range
    mixed = raw_csv([("range", 1e9, 1e9, 1e9, 1e6), (GEMM, 1e9, 0, 1e9, 1e3)])
    (tmp_path / "report_ghost_bs8_seq256.csv").write_text(mixed)
    text = ncu.write_ncu_summary(str(tmp_path))
    assert (tmp_path / "ncu_comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

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
    assert ncu.CATEGORIES_NEED_KERNEL_REPLAY not in text
    assert "report_ghost_bs8_seq256: ValueError" in text


def test_summary_of_range_replays_only(tmp_path, monkeypatch):
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)
    (tmp_path / "report_standard_bs8_seq256.csv").write_text(raw_csv(RANGE_STANDARD))
    shutil.copy(RANGE_FIXTURE, tmp_path / "report_flash_bs8_seq256.csv")
    text = ncu.write_ncu_summary(str(tmp_path))
    assert (tmp_path / "ncu_comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

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


def test_load_reports_range_report_is_measured(tmp_path):
    shutil.copy(RANGE_FIXTURE, tmp_path / "report_flash_bs8_seq256.csv")
    (tmp_path / "report_standard_bs8_seq256.csv").write_text(raw_csv([]))  # header, no rows
    entries = {e["trainer"]: e for e in ncu.load_reports(str(tmp_path))}
    assert entries["flash"]["error"] is None and entries["flash"]["range_count"] == 1
    assert entries["standard"]["error"] == "no kernels in the report"


def test_summary_usage_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="existing directory"):
        ncu.write_ncu_summary(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no report_"):
        ncu.write_ncu_summary(str(tmp_path))
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)
    (tmp_path / "report_flash_bs8_seq256.ncu-rep").write_bytes(b"binary")
    with pytest.raises(ValueError, match="ncu .*not found"):
        ncu.write_ncu_summary(str(tmp_path))
    # A CSV newer than its report is used as is: no ncu needed.
    (tmp_path / "report_flash_bs8_seq256.csv").write_text(raw_csv(STANDARD))
    os.utime(tmp_path / "report_flash_bs8_seq256.ncu-rep", (1, 1))
    assert "flash" in ncu.write_ncu_summary(str(tmp_path))


def fake_ncu(directory, body: str) -> str:
    path = directory / "ncu"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_summary_exports_reports_with_ncu(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "ncu_args"
    monkeypatch.setenv("NCU", fake_ncu(bin_dir, f'echo "$@" > {log}\ncat {FIXTURE}\n'))
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "report_ghost_bs8_seq256.ncu-rep").write_bytes(b"binary")
    text = ncu.write_ncu_summary(str(reports))
    assert "--import" in log.read_text() and "--page raw" in log.read_text()
    assert (reports / "report_ghost_bs8_seq256.csv").read_text() == open(FIXTURE).read()
    assert "ghost" in text and "1.112" in text  # dram read GB of the fixture


def test_broken_report_is_listed_not_fatal(tmp_path):
    write_reports(tmp_path)
    (tmp_path / "report_ghost_bs8_seq256.csv").write_text("garbage\n")
    text = ncu.write_ncu_summary(str(tmp_path))
    assert "report_ghost_bs8_seq256: ValueError" in text
    assert "Not measured" in (tmp_path / "ncu_summary.md").read_text()


# ---------------------------------------------------------------- run_profiling_ncu.sh


def run_script(*args, path, tmp_path, **env):
    environ = {k: v for k, v in os.environ.items() if k != "NCU"}
    environ.update(PATH=path, PYTHON=sys.executable, OUTPUT_DIR=str(tmp_path / "out"), **env)
    return subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, env=environ, timeout=120
    )


def test_script_without_ncu_stops_first(tmp_path):
    if shutil.which("ncu", path=BASE_PATH):
        pytest.skip("ncu is installed in a system directory")
    proc = run_script(path=BASE_PATH, tmp_path=tmp_path)
    assert proc.returncode == 1
    assert ncu.NCU_MISSING_MESSAGE in proc.stderr
    assert "==>" not in proc.stdout
    assert not (tmp_path / "out").exists()


def test_script_rejects_nvprof_metric(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "ncu_ran"
    fake_ncu(bin_dir, f"touch {marker}\n")
    proc = run_script(
        "--metrics", "dram_read_throughput", path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 'dram_read_throughput' is an nvprof metric; in ncu use "
        "dram__bytes_read.sum.per_second"
    )
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_script_dry_run_prints_one_command_per_config(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "ncu_ran"
    fake = fake_ncu(bin_dir, f"touch {marker}\n")
    proc = run_script(
        "--dry-run", "--metrics", "dram__bytes_read.sum", "--", "--dtype", "bfloat16",
        path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path, TRAINERS="standard hooks",
        BATCH_SIZES="8", SEQ_LENS="256 1024", RUN_NAME="r",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    commands = [line[4:] for line in proc.stdout.splitlines() if line.startswith("==> ")]
    assert len(commands) == 4
    out = tmp_path / "out"
    assert commands[1].startswith(  # the suite's default: app-range replay
        f"{fake} --replay-mode app-range --clock-control none --metrics dram__bytes_read.sum "
        f"--target-processes all -f -o {out}/report_dpsgd_bs8_seq256 {sys.executable} "
        "profiling_script.py --mode=profile --trainer=dpsgd --batch_size=8 --seq_len=256"
    )
    assert commands[1].endswith(
        "--hidden_dim 1024 --num_layers 1 --num_heads 16 --vocab_size 32000 "
        f"--output_dir {out}/runs --run_name r --resume --dtype bfloat16 --ncu"
    )
    assert "--profile-from-start" not in proc.stdout
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize(
    "option", [["--replay-mode", "kernel"], ["--replay_mode", "kernel"], ["--replay-mode=kernel"]]
)
def test_script_dry_run_kernel_replay(tmp_path, option):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = fake_ncu(bin_dir, "exit 1\n")
    proc = run_script(
        "--dry-run", *option, path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path,
        TRAINERS="flash", BATCH_SIZES="8", SEQ_LENS="256",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    commands = [line[4:] for line in proc.stdout.splitlines() if line.startswith("==> ")]
    assert len(commands) == 1
    assert commands[0].startswith(f"{fake} --profile-from-start off --clock-control none ")
    assert "--replay-mode" not in commands[0]


@pytest.mark.parametrize("option", [["--replay-mode", "bogus"], ["--replay_mode=bogus"]])
def test_script_rejects_unknown_replay_mode(tmp_path, option):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "ncu_ran"
    fake_ncu(bin_dir, f"touch {marker}\n")
    proc = run_script(*option, path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --replay-mode must be app-range, kernel or range (got 'bogus')"
    ]
    assert "==>" not in proc.stdout
    assert not marker.exists() and not (tmp_path / "out").exists()
    missing = run_script("--replay-mode", path=f"{bin_dir}:{BASE_PATH}", tmp_path=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: --replay-mode needs a value"


def test_real_h100_export_parses_and_sums():
    """A real export (`ncu --import --csv --page raw --print-units base`) of the standard
    trainer's step on an H100 (first 60 kernels, columns trimmed): parsed sums equal a plain
    csv-module sum of the same columns, and every kernel gets a category."""
    import csv

    from kernels import CATEGORIES

    path = os.path.join(ROOT, "tests", "fixtures", "ncu_raw_h100_standard.csv")
    with open(path) as f:
        text = f.read()
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
    assert set(by_category) == set(CATEGORIES)
    assert sum(c["count"] for c in by_category.values()) == 60
    assert by_category["gemm"]["count"] > 0 and by_category["norm_clip"]["count"] > 0


def test_ncu_step_result_is_reported_without_numbers(tmp_path):
    """Under --ncu the worker's result is ok with null times and peaks (a replayed step is no
    measurement): the progress line and every summary file must say so, not crash on None."""
    import report
    import runner

    config = runner.ExperimentConfig("dpsgd", 8, 256, ncu=True)
    result = runner.empty_result(config, "ok")
    result["env"] = {"ncu_note": "one step ran inside cudaProfilerStart/Stop"}
    assert result["median_time_ms"] is None and result["peak_memory_mb"] is None
    assert "cudaProfilerStart" in runner.describe(result)
    run_dir = tmp_path / "run"
    (run_dir / config.config_dir).mkdir(parents=True)
    runner.write_json_atomic(str(run_dir / config.config_dir / "result.json"), result)
    report.write_summary(str(run_dir), report.load_results(str(run_dir)))
    text = (run_dir / "summary.txt").read_text()
    assert "n/a" in text and "dpsgd" in (run_dir / "summary.md").read_text()


def test_a_finished_ncu_config_is_profiled_again_on_resume(tmp_path):
    """The suite passes --resume so configs can share one run directory; an ncu config must
    still run each time ncu launches it (again in every metric pass of app-range replay), or
    ncu would overwrite a good report with an empty one. Other finished configs are skipped."""
    import runner

    def write(name, ncu_flag):
        config = runner.ExperimentConfig(trainer="standard", batch_size=1, seq_len=4, ncu=ncu_flag)
        result = runner.empty_result(config, "ok")
        path = tmp_path / name
        runner.write_json_atomic(str(path), result)
        return str(path)

    assert runner._finished(write("ncu.json", True), resume=True) is None
    assert runner._finished(write("plain.json", False), resume=True)["status"] == "ok"
