"""ncu command lines: where the binary is, report names, the profiling and export argv.

Trainer names are the canonical ones of core.schema.TRAINER_ORDER (no torch import here); the
aliases a user may type are mapped to them as trainers.py does.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys

from dp_cost.core import schema
from dp_cost.core.schema import TRAINER_ORDER
from dp_cost.ncu.metrics import METRICS, translate_metrics

TRAINERS = TRAINER_ORDER  # canonical names, in table order
CLOCK_CONTROLS = ("none", "base", "boost", "force-boost", "reset")
# ncu --replay-mode: ncu_command's default is kernel, run_profiling_ncu.sh's app-range
REPLAY_MODES = ("app-range", "kernel", "range")
NVTX_INCLUDE = "step/"  # the push/pop range around the measured step
REPORT_RE = re.compile(r"^report_(?P<trainer>\w+?)_bs(?P<batch>\d+)_seq(?P<seq>\d+)$")

NCU_MISSING_MESSAGE = (
    "ncu (Nsight Compute CLI) not found: install Nsight Compute (the CUDA toolkit's "
    "nsight-compute component, or https://developer.nvidia.com/nsight-compute) and put ncu on "
    "PATH, e.g. export PATH=/usr/local/cuda/bin:$PATH or "
    "PATH=/opt/nvidia/nsight-compute/<version>:$PATH (or set NCU=/path/to/ncu)"
)
_NCU_CANDIDATES = (
    "/usr/local/cuda/bin/ncu",
    "/opt/nvidia/nsight-compute/*/ncu",
    "/usr/local/cuda-*/bin/ncu",
)


def canonical_trainer_name(name: str) -> str:
    """The canonical name of a trainer name or alias (ValueError if unknown)."""
    return schema.canonical_trainer_name(name, TRAINERS)


def find_ncu() -> str | None:
    """$NCU, else ncu on PATH, else the CUDA toolkit's and Nsight Compute's usual places."""
    env = os.environ.get("NCU")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in _NCU_CANDIDATES:
        # newest version last in sort order -> try it first
        for path in sorted(glob.glob(pattern), reverse=True):
            if os.access(path, os.X_OK):
                return path
    return None


def report_name(trainer: str, batch: int, seq: int) -> str:
    """``report_<trainer>_bs<B>_seq<T>`` with the canonical trainer name."""
    return f"report_{canonical_trainer_name(trainer)}_bs{int(batch)}_seq{int(seq)}"


def parse_report_name(name: str) -> tuple[str, int, int] | None:
    """(trainer, batch, seq) of a report name or path (any extension), None if not one."""
    stem = os.path.basename(name)
    for ext in (".ncu-rep", ".csv"):
        stem = stem.removesuffix(ext)
    match = REPORT_RE.match(stem)
    if not match or match["trainer"] not in TRAINERS:
        return None
    return match["trainer"], int(match["batch"]), int(match["seq"])


def profile_args(trainer: str, batch: int, seq: int, extra=()) -> list[str]:
    """profiling_script.py arguments of one config (ncu_command adds --ncu at the end)."""
    return [
        "--mode=profile",
        f"--trainer={canonical_trainer_name(trainer)}",
        f"--batch_size={int(batch)}",
        f"--seq_len={int(seq)}",
        "--device=cuda",
        "--no_trace",  # never torch.profiler's CUDA tracing inside an ncu session
        *extra,
    ]


def ncu_command(
    report_path: str,
    python_args,
    metrics=METRICS,
    clock_control: str = "none",
    nvtx: bool = False,
    replay_mode: str = "kernel",
    *,
    ncu: str = "ncu",
    python: str | None = None,
    script: str = "profiling_script.py",
) -> list[str]:
    """argv that profiles one config's measured step into ``<report_path>.ncu-rep``.

    ``replay_mode="kernel"``: ``--profile-from-start off``, so only kernels between
    cudaProfilerStart/Stop (the worker's torch.cuda.profiler.start()/stop()) are profiled, each
    replayed per metric pass (~0.15 s of ncu overhead per kernel; per-kernel numbers).
    ``"app-range"`` / ``"range"``: ``--replay-mode <mode>``, one result for the range that
    cudaProfilerStart/Stop delimits (ncu rejects ``--profile-from-start`` there): app-range reruns
    the application once per metric pass and has no API restrictions; range captures and replays
    the range's API calls and rejects some. ``--target-processes all``: the CLI forks one worker
    per config, and ncu must follow it. ``nvtx=True`` (kernel replay only) also keeps only kernels
    inside the push/pop range ``step``; NVTX push/pop ranges are per thread, so check that
    autograd's backward kernels (launched from its own thread) are still in the report.
    """
    if clock_control not in CLOCK_CONTROLS:
        raise ValueError(f"--clock-control must be one of {', '.join(CLOCK_CONTROLS)}")
    if replay_mode not in REPLAY_MODES:
        raise ValueError(
            f"--replay-mode must be one of {', '.join(REPLAY_MODES)} (got {replay_mode!r})"
        )
    if nvtx and replay_mode != "kernel":
        raise ValueError(
            f"--nvtx (kernels inside the NVTX range {NVTX_INCLUDE!r}) needs --replay-mode kernel; "
            f"in {replay_mode} replay the cudaProfilerStart/Stop range already is the measured step"
        )
    metrics = translate_metrics(metrics)
    args = [str(a) for a in python_args]
    if "--ncu" not in args:
        args.append("--ncu")
    if replay_mode == "kernel":
        cmd = [ncu, "--profile-from-start", "off"]
    else:  # the range is cudaProfilerStart/Stop; --profile-from-start is an error here
        cmd = [ncu, "--replay-mode", replay_mode]
    cmd += ["--clock-control", clock_control, "--metrics", ",".join(metrics)]
    if nvtx:
        cmd += ["--nvtx", "--nvtx-include", NVTX_INCLUDE]
    cmd += ["--target-processes", "all", "-f", "-o", str(report_path).removesuffix(".ncu-rep")]
    return cmd + [python or sys.executable, script, *args]


def export_command(report_path: str, ncu: str = "ncu") -> list[str]:
    """argv that prints a report's per-kernel metrics as CSV (stdout).

    ``--print-units base``: plain bytes / ns, no rounding to Mbyte; ``--print-kernel-base
    demangled``: full names with template arguments, which kernels.categorize needs
    (NormTwoOps, LpNormFunctor ...); ncu's default prints the bare function name.
    """
    return [ncu, "--import", str(report_path), "--csv", "--page", "raw"] + [
        "--print-units", "base", "--print-kernel-base", "demangled",
    ]  # fmt: skip
