"""ncu.command and ncu.cli: report names, the profiling and export command lines,
``python -m dp_cost.ncu command ...``, and what importing the package costs (no torch)."""

import subprocess
import sys

import pytest
from ncu_testdata import DEFAULT_METRICS, ROOT

import trainers
from dp_cost.core.schema import TRAINER_ALIASES
from dp_cost.ncu import command as ncu


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


def test_trainer_names_match_the_registry():
    """ncu takes the canonical names and aliases from core.schema, without importing trainers
    (torch): they must be the registry's."""
    assert ncu.TRAINERS == tuple(trainers.TRAINERS)
    for alias, name in TRAINER_ALIASES.items():
        assert ncu.canonical_trainer_name(alias) == trainers.canonical_trainer_name(alias) == name


def test_command_cli_prints_a_shell_command():
    proc = subprocess.run(
        [sys.executable, "-m", "dp_cost.ncu", "command", "--trainer", "ghost", "--batch_size", "16",
         "--seq_len", "1024", "--report_dir", "out dir", "--python", "py",
         "--", "--dtype", "bfloat16"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "-o 'out dir/report_ghost_bs16_seq1024' py profiling_script.py" in proc.stdout
    assert proc.stdout.rstrip().endswith("--dtype bfloat16 --ncu")


def test_command_cli_replay_mode():
    base = [sys.executable, "-m", "dp_cost.ncu", "command", "--trainer", "flash",
            "--batch_size", "8", "--seq_len", "256", "--ncu", "/opt/ncu"]  # fmt: skip
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


def test_cli_and_summary_import_neither_torch_nor_matplotlib():
    """run_profiling_ncu.sh calls python -m dp_cost.ncu once per config and profiling_script.py
    --mode=ncu_report runs without a GPU stack: neither may pay for torch (nor matplotlib,
    until a plot is drawn)."""
    code = (
        "import sys, dp_cost.ncu.cli, dp_cost.ncu.summary\n"
        "print(sorted(m for m in ('torch', 'matplotlib', 'trainers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
