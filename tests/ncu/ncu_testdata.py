"""Shared by the ncu tests: fixture paths, kernel names, hand-made ``--page raw`` CSVs, a fake ncu.

tests/fixtures/ncu_raw_small.csv is hand-written to the documented shape of Nsight Compute 2025's
``ncu --csv --page raw`` output (quoted fields, a unit row, thousands separators, per-column unit
prefixes, ==PROF== lines, n/a values); ncu_raw_h100_standard.csv (kernel replay),
ncu_raw_range_h200.csv (app-range replay: one row named ``range``) and
ncu_raw_range_h100_ghost_full.csv (a whole app-range export) are real recordings.
"""

import os
import stat

from dp_cost.ncu.export import parse_raw_csv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
FIXTURE = os.path.join(FIXTURES, "ncu_raw_small.csv")
RANGE_FIXTURE = os.path.join(FIXTURES, "ncu_raw_range_h200.csv")
H100_KERNEL_FIXTURE = os.path.join(FIXTURES, "ncu_raw_h100_standard.csv")
H100_RANGE_FIXTURE = os.path.join(FIXTURES, "ncu_raw_range_h100_ghost_full.csv")
SCRIPT = os.path.join(ROOT, "run_profiling_ncu.sh")

GEMM = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<float>, std::array<char *, (unsigned long)3>>(int, T2, T3)"  # noqa: E501
NORM = "void at::native::reduce_kernel<(int)512, (int)1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float, (bool)0>, unsigned int, float, (int)4, (int)4>>(T3)"  # noqa: E501

DEFAULT_METRICS = (
    "dram__bytes_read.sum,dram__bytes_write.sum,dram__bytes_read.sum.per_second,"
    "dram__bytes_write.sum.per_second,lts__t_bytes.sum,lts__t_sectors_op_read.sum,"
    "lts__t_sectors_op_write.sum,l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum,"
    "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum,gpu__time_duration.sum"
)

UNITS = ["byte", "byte", "byte", "nsecond"]
METRIC_COLS = ["dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum",
               "gpu__time_duration.sum"]  # fmt: skip

STANDARD = [(GEMM, 1e9, 0.5e9, 3e9, 1e6), (ELEMENTWISE, 0.5e9, 0.5e9, 1e9, 0.5e6)]
# dpsgd = standard + one norm kernel: DRAM 2.5 -> 5 GB (x2), L2 4 -> 5 GB (x1.25),
# kernel time 1.5 -> 4.5 ms (x3)
DPSGD = STANDARD + [(NORM, 2.5e9, 0, 1e9, 3e6)]
# A range replay's export: one row named "range" (read, write, L2 bytes, time ns).
RANGE_STANDARD = [("range", 2e9, 1e9, 10e9, 50e6)]
# A report that mixes a range result with a kernel result (rejected by aggregate).
MIXED = [("range", 1e9, 1e9, 1e9, 1e6), (GEMM, 1e9, 0, 1e9, 1e3)]


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def fixture_rows():
    return parse_raw_csv(read_text(FIXTURE))


def raw_csv(kernel_rows) -> str:
    """A --page raw CSV of (name, dram read, dram write, L2 bytes, time ns) rows."""
    labels = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream"]
    quote = lambda cells: ",".join(f'"{c}"' for c in cells)
    lines = [quote(labels + METRIC_COLS), quote([""] * len(labels) + UNITS)]
    for i, (name, *values) in enumerate(kernel_rows):
        lines.append(quote([i, 1, "python3", "h", name, 1, 7] + [f"{v:,.0f}" for v in values]))
    return "\n".join(lines) + "\n"


def write_reports(directory):
    """report_standard_bs8_seq256.csv and report_dpsgd_bs8_seq256.csv: kernel replays."""
    (directory / "report_standard_bs8_seq256.csv").write_text(raw_csv(STANDARD))
    (directory / "report_dpsgd_bs8_seq256.csv").write_text(raw_csv(DPSGD))


def fake_ncu(directory, body: str) -> str:
    """An executable ``directory/ncu``: a shell script running ``body``."""
    path = directory / "ncu"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)
