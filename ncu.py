"""Nsight Compute (ncu): command lines, report export and parsing, per-step traffic aggregation.

    ncu --replay-mode app-range --clock-control none --metrics dram__bytes_read.sum,... \\
        --target-processes all -f -o ncu_reports/report_dpsgd_bs8_seq256 \\
        python profiling_script.py --mode=profile --trainer=dpsgd ... --ncu
    ncu --import ncu_reports/report_dpsgd_bs8_seq256.ncu-rep --csv --page raw ...  # parse_raw_csv
    python profiling_script.py --mode=ncu_report --input_dir ncu_reports   # write_ncu_summary

The worker (``--ncu``) runs its warm-up steps outside the profiled range and one step between
``torch.cuda.profiler.start()`` and ``stop()`` (cudaProfilerStart/Stop), so every kernel of that
step -- the backward ones that autograd launches from its own thread included -- is inside the
range, and nothing else is. Two ways to measure it (``REPLAY_MODES``):

- kernel replay (``--profile-from-start off``): one result per kernel. ncu replays each kernel
  once per metric pass and, by default, flushes the caches before each replay, so the DRAM bytes
  of a kernel are what it moves from a cold L2; their sum over the step is the step's traffic
  when no data survives in L2 between kernels. Per-kernel numbers give the per-category
  breakdown, at ~0.15 s of ncu overhead per kernel (a step launches 100-520).
- range replay (``--replay-mode app-range`` or ``range``): one result for the whole range, a
  row named ``range`` in the export: the real step's DRAM / L2 bytes with warm caches between
  kernels (dirty lines written back during the step count as writes) and the range's GPU time.
  app-range reruns the whole application once per metric pass and has no API restrictions;
  range captures the API calls inside the range and replays them, which supports only a subset
  of CUDA APIs (some trainers' steps are rejected).

Units: bytes, bytes/s, ns and plain counts after parsing; GB in tables is 10^9 bytes.
``python ncu.py command ...`` and ``python ncu.py metrics ...`` serve run_profiling_ncu.sh.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import kernels
import trainers
from report import atomic_write

# Every one is valid on Hopper (sm_90); check a new one with `ncu --query-metrics`.
METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__bytes_read.sum.per_second",
    "dram__bytes_write.sum.per_second",
    "lts__t_bytes.sum",
    "lts__t_sectors_op_read.sum",
    "lts__t_sectors_op_write.sum",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum",
    "gpu__time_duration.sum",
)

_L2_ATOM_RED = "lts__t_sectors_op_atom.sum + lts__t_sectors_op_red.sum"
_L2_ATOM_RED_RATE = "lts__t_sectors_op_atom.sum.per_second + lts__t_sectors_op_red.sum.per_second"
# nvprof-era names (older guides, seed 001) -> what ncu collects instead, after NVIDIA's
# "nvprof metric comparison" table. A '+' / '2 *' formula means: collect those metrics and
# combine them; None: ncu has no equivalent.
NVPROF_TO_NCU: dict[str, str | None] = {
    "dram_read_throughput": "dram__bytes_read.sum.per_second",
    "dram_write_throughput": "dram__bytes_write.sum.per_second",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "dram_read_transactions": "dram__sectors_read.sum",
    "dram_write_transactions": "dram__sectors_write.sum",
    "dram_utilization": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_read_throughput": "lts__t_sectors_op_read.sum.per_second + " + _L2_ATOM_RED_RATE,
    "l2_write_throughput": "lts__t_sectors_op_write.sum.per_second + " + _L2_ATOM_RED_RATE,
    "l2_read_transactions": "lts__t_sectors_op_read.sum + " + _L2_ATOM_RED,
    "l2_write_transactions": "lts__t_sectors_op_write.sum + " + _L2_ATOM_RED,
    "l2_utilization": "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
    "l2_tex_read_throughput": "lts__t_sectors_srcunit_tex_op_read.sum.per_second",
    "l2_tex_write_throughput": "lts__t_sectors_srcunit_tex_op_write.sum.per_second",
    "l2_tex_read_transactions": "lts__t_sectors_srcunit_tex_op_read.sum",
    "l2_tex_write_transactions": "lts__t_sectors_srcunit_tex_op_write.sum",
    "l2_tex_hit_rate": "lts__t_sector_hit_rate.pct",
    "gld_throughput": "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum.per_second",
    "gst_throughput": "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum.per_second",
    "gld_transactions": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "gst_transactions": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "gld_transactions_per_request": (
        "l1tex__average_t_sectors_per_request_pipe_lsu_mem_global_op_ld.ratio"
    ),
    "gst_transactions_per_request": (
        "l1tex__average_t_sectors_per_request_pipe_lsu_mem_global_op_st.ratio"
    ),
    "gld_efficiency": "smsp__sass_average_data_bytes_per_sector_mem_global_op_ld.pct",
    "gst_efficiency": "smsp__sass_average_data_bytes_per_sector_mem_global_op_st.pct",
    "gld_requested_throughput": None,
    "gst_requested_throughput": None,
    "local_load_throughput": "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum.per_second",
    "shared_load_transactions": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "shared_store_transactions": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
    "shared_load_throughput": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum.per_second",
    "shared_store_throughput": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum.per_second",
    "sysmem_read_throughput": "lts__t_sectors_aperture_sysmem_op_read.sum.per_second",
    "sysmem_write_throughput": "lts__t_sectors_aperture_sysmem_op_write.sum.per_second",
    "tex_cache_hit_rate": "l1tex__t_sector_hit_rate.pct",
    "achieved_occupancy": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm_efficiency": "smsp__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "warp_execution_efficiency": "smsp__thread_inst_executed_per_inst_executed.ratio",
    "eligible_warps_per_cycle": "smsp__warps_eligible.sum.per_cycle_active",
    "branch_efficiency": "smsp__sass_average_branch_targets_threads_uniform.pct",
    "ipc": "smsp__inst_executed.avg.per_cycle_active",
    "issued_ipc": "smsp__inst_issued.avg.per_cycle_active",
    "inst_executed": "smsp__inst_executed.sum",
    "issue_slot_utilization": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "flop_count_sp": (
        "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum + "
        "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum + "
        "2 * smsp__sass_thread_inst_executed_op_ffma_pred_on.sum"
    ),
    "flop_sp_efficiency": (
        "smsp__sass_thread_inst_executed_ops_fadd_fmul_ffma_pred_on.avg.pct_of_peak_sustained_elapsed"
    ),
    "stall_memory_dependency": "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
}

# unit__counter[.rollup[.submetric]]: dram__bytes_read.sum.per_second, launch__grid_size
NCU_METRIC_NAME = re.compile(r"^[a-z0-9]+__[a-z0-9_]+(\.[a-z0-9_]+)*$")
_METRIC_PREFIXES = ("regex:", "group:", "breakdown:")  # also accepted by `ncu --metrics`

TRAINERS = tuple(trainers.TRAINERS)  # the one registry: canonical names, in table order
CLOCK_CONTROLS = ("none", "base", "boost", "force-boost", "reset")
# ncu --replay-mode: ncu_command's default is kernel, run_profiling_ncu.sh's app-range
REPLAY_MODES = ("app-range", "kernel", "range")
RANGE_NAME = "range"  # the "Kernel Name" of a range replay's one result per range
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

GB = 1e9  # traffic is reported in decimal GB, as ncu and bandwidth figures use


# ---------------------------------------------------------------- metric names


def metrics_in_formula(formula: str) -> list[str]:
    """The ncu metric names of a NVPROF_TO_NCU replacement ("a + b", "2 * c")."""
    return [t for t in re.split(r"[\s+*()]+", formula) if t and not t.isdigit()]


def translate_metrics(names) -> list[str]:
    """Validated ncu metric names from a list or a comma-separated string.

    ncu names pass through (duplicates dropped); an nvprof name raises ValueError naming its ncu
    replacement, and so does anything that is not shaped like an ncu metric.
    """
    if isinstance(names, str):
        names = names.split(",")
    out: list[str] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name in NVPROF_TO_NCU:
            replacement = NVPROF_TO_NCU[name]
            if replacement is None:
                raise ValueError(f"{name!r} is an nvprof metric with no ncu equivalent")
            raise ValueError(f"{name!r} is an nvprof metric; in ncu use {replacement}")
        if not (name.startswith(_METRIC_PREFIXES) or NCU_METRIC_NAME.match(name)):
            raise ValueError(
                f"{name!r} is not an ncu metric name (they look like dram__bytes_read.sum; "
                "list them with ncu --query-metrics)"
            )
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("no metric names given")
    return out


# ---------------------------------------------------------------- command lines


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
    return f"report_{trainers.canonical_trainer_name(trainer)}_bs{int(batch)}_seq{int(seq)}"


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
        f"--trainer={trainers.canonical_trainer_name(trainer)}",
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


# ---------------------------------------------------------------- parsing

_SI = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_TIME_NS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}
_TIME_NS.update({"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9})
_COUNTED = ("byte", "sector", "request", "inst", "cycle", "warp", "thread", "wavefront", "block")


def _unit_part(part: str) -> tuple[float, bool]:
    """(factor to base units, is it time in ns) of one side of a unit: Kbyte -> (1e3, False)."""
    if part in _TIME_NS:
        return _TIME_NS[part], True
    for base in _COUNTED:
        if part.endswith(base):
            prefix = part[: -len(base)]
            factor = _BINARY.get(prefix, _SI.get(prefix))
            if factor is not None:
                return factor, False
    return 1.0, False  # %, ratio, unknown units: keep the number


def unit_factor(unit: str) -> float:
    """Multiplier that turns a value in `unit` into bytes, bytes/s, ns or a plain count.

    ncu's prefixes are decimal (1 Kbyte = 1000 bytes); Kibyte-style ones are binary.
    """
    numerator, _, denominator = unit.strip().partition("/")
    factor, _ = _unit_part(numerator)
    if denominator:
        scale, is_time = _unit_part(denominator)
        factor /= scale / 1e9 if is_time else scale  # per time unit -> per second
    return factor


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None  # n/a, empty


def is_metric_column(name: str) -> bool:
    return "__" in name  # ncu metric names are unit__counter...; the others are labels


def parse_raw_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv --page raw``: one dict per kernel launch (kernel replay) or per range
    (range replay: "Kernel Name" is ``range``).

    Label columns ("ID", "Kernel Name", "Context", "Stream", "Block Size", ...) stay strings;
    metric columns become floats in base units (bytes, bytes/s, ns, counts) or None for n/a.
    Lines ncu prints around the table ("==PROF== ...", "==WARNING== ...") are skipped.
    """
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        if lines:
            raise ValueError('not ncu --page raw CSV: no header row starting with "ID"')
        return []  # nothing but ncu messages: no kernel was profiled
    table = list(csv.reader(lines[start:]))
    header, body = table[0], table[1:]
    factors = [1.0] * len(header)
    if body and not body[0][0].strip():  # the unit row: empty under every label column
        factors = [unit_factor(u) for u in body[0]] + [1.0] * (len(header) - len(body[0]))
        body = body[1:]
    rows = []
    for cells in body:
        row = {}
        for name, cell, factor in zip(header, cells, factors):
            if is_metric_column(name):
                value = _number(cell)
                row[name] = None if value is None else value * factor
            else:
                row[name] = cell
        rows.append(row)
    return rows


# ---------------------------------------------------------------- aggregation

# aggregate key -> the metric summed over the step's kernels
TOTALS = {
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_bytes": "lts__t_bytes.sum",
    "l2_read_sectors": "lts__t_sectors_op_read.sum",
    "l2_write_sectors": "lts__t_sectors_op_write.sum",
    "global_load_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum",
    "global_store_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum",
}
_TIME = "gpu__time_duration.sum"
_CATEGORY_TOTALS = {
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_bytes": "lts__t_bytes.sum",
}


def _sum(rows: list[dict], metric: str) -> float | None:
    """Sum over rows; None when no row has the metric (not collected), n/a values skipped."""
    if not any(metric in row for row in rows):
        return None
    return math.fsum(row[metric] for row in rows if row.get(metric) is not None)


def aggregate(rows: list[dict]) -> dict:
    """Step totals of one report and, for kernel replay, per-category totals.

    ``replay`` is "kernel" (one row per kernel: ``kernel_count``, ``kernel_time_ms`` the sum of
    kernel durations, ``categories`` by kernels.categorize of "Kernel Name") or "range" (rows
    named ``range``, from ``--replay-mode app-range`` or ``range``: ``range_count``,
    ``range_time_ms``; no per-kernel numbers, so ``kernel_count``, ``kernel_time_ms`` and
    ``categories`` are None). A report that mixes both raises ValueError. Totals of a metric the
    report lacks are None; ``incomplete`` lists metrics that some rows report as n/a (their sums
    cover the other rows only).
    """
    ranges = sum(row.get("Kernel Name") == RANGE_NAME for row in rows)
    if 0 < ranges < len(rows):
        raise ValueError(
            f"the report mixes {ranges} range results with {len(rows) - ranges} kernel results; "
            "profile a config with one replay mode (kernel, or app-range / range)"
        )
    out: dict = {key: _sum(rows, metric) for key, metric in TOTALS.items()}
    time_ns = _sum(rows, _TIME)
    time_ms = None if time_ns is None else time_ns / 1e6
    out["replay"] = "range" if ranges else "kernel"
    if ranges:
        # app-range: the range's elapsed GPU time, idle gaps between kernels included (launch
        # overhead, host work), not the kernels' busy time; so is achieved_dram_gbps below.
        out.update(kernel_time_ms=None, range_time_ms=time_ms, kernel_count=None)
        out["range_count"] = ranges
    else:
        out.update(kernel_time_ms=time_ms, range_time_ms=None, kernel_count=len(rows))
        out["range_count"] = None
    dram = [out["dram_read_bytes"], out["dram_write_bytes"]]
    seconds = (time_ns or 0.0) / 1e9
    out["achieved_dram_gbps"] = (
        sum(dram) / seconds / GB if None not in dram and seconds > 0 else None
    )
    out["categories"] = None if ranges else _categories(rows, time_ns is not None)
    wanted = [*TOTALS.values(), _TIME]
    out["incomplete"] = sorted(
        m for m in wanted if any(m in row and row[m] is None for row in rows)
    )
    return out


def _categories(rows: list[dict], timed: bool) -> dict:
    """Per-category totals of a kernel replay's rows (every category, empty ones as zeros)."""
    by_category: dict[str, list[dict]] = {c: [] for c in kernels.CATEGORIES}
    for row in rows:
        by_category[kernels.categorize(row.get("Kernel Name", ""))].append(row)
    out = {}
    for category, members in by_category.items():
        entry = {}
        for key, metric in _CATEGORY_TOTALS.items():
            total = _sum(rows, metric)  # None for every category when the metric is missing
            entry[key] = None if total is None else (_sum(members, metric) or 0.0)
        time = (_sum(members, _TIME) or 0.0) if timed else None
        entry["time_ms"] = None if time is None else time / 1e6
        entry["count"] = len(members)
        out[category] = entry
    return out


def dram_bytes(entry: dict) -> float | None:
    """Read + write DRAM bytes of an aggregate or a category entry (None if not measured)."""
    read, write = entry.get("dram_read_bytes"), entry.get("dram_write_bytes")
    return None if read is None or write is None else read + write


def dram_lower_bound_bytes(
    num_params: int,
    batch: int,
    seq: int,
    hidden: int,
    num_layers: int,
    vocab: int,
    dtype_bytes: int = 4,
    activations_per_layer: int = 4,
) -> dict:
    """A lower bound of one standard (non-private) SGD step's DRAM traffic, in bytes.

    Counted once each, nothing else (so a measured step must move at least this much):
    - weights: read in forward, read again in backward (input gradients): 2·P
    - gradients: written once: P
    - plain SGD: read parameter and gradient, write parameter: 3·P
    - activations: per layer `activations_per_layer` tensors of B·T·hidden (default 4: the
      attention input after ln1, the attention output before out_proj, the MLP input after
      ln2, the block output), each written in forward and read once in backward; the MLP's
      inner activations and attention scores are not counted.
    - logits: B·T·V written by the LM head and read by the loss, and their gradient written
      by the loss and read by the LM head's backward: 4·B·T·V.
    Everything in `dtype_bytes` (4 for fp32). Adam, bf16 autocast copies and DP work are extra.
    """
    p = num_params * dtype_bytes
    tokens = batch * seq
    parts = {
        "weights_forward": p,
        "weights_backward": p,
        "gradients_write": p,
        "optimizer": 3 * p,
        "activations": 2 * activations_per_layer * num_layers * tokens * hidden * dtype_bytes,
        "logits": 4 * tokens * vocab * dtype_bytes,
    }
    parts["total"] = sum(parts.values())
    parts["assumptions"] = (
        f"{activations_per_layer} activations of B*T*hidden per layer written and read once; "
        "weights read twice, gradients written once, SGD reads param+grad and writes param; "
        f"logits and their gradient written and read once; {dtype_bytes}-byte elements"
    )
    return parts


# ---------------------------------------------------------------- summary files


def _write_atomic(path: str, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def export_report(report_path: str, ncu: str | None = None) -> str:
    """Export ``X.ncu-rep`` to ``X.csv`` next to it (atomically); return the CSV path."""
    ncu = ncu or find_ncu()
    if ncu is None:
        raise ValueError(f"{report_path} must be exported to CSV, but {NCU_MISSING_MESSAGE}")
    proc = subprocess.run(export_command(report_path, ncu), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"ncu --import {report_path} failed: {tail[0]}")
    path = report_path.removesuffix(".ncu-rep") + ".csv"
    _write_atomic(path, proc.stdout)
    return path


def load_reports(input_dir: str) -> list[dict]:
    """One entry per report_<trainer>_bs<B>_seq<T> in input_dir: trainer, batch, seq, the
    aggregate (or ``error``). A .ncu-rep is exported first when its CSV is missing or older."""
    if not os.path.isdir(input_dir):
        raise ValueError(f"--input_dir must be an existing directory, got {input_dir!r}")
    stems = {}
    for path in glob.glob(os.path.join(input_dir, "report_*")):
        parsed = parse_report_name(path) if path.endswith((".ncu-rep", ".csv")) else None
        if parsed:
            stems[os.path.splitext(path)[0]] = parsed
    if not stems:
        raise ValueError(
            f"no report_<trainer>_bs<B>_seq<T>.ncu-rep or .csv files in {input_dir} "
            "(trainers: " + ", ".join(TRAINERS) + ")"
        )
    ncu = None
    entries = []
    for stem, (trainer, batch, seq) in stems.items():
        rep, csv_path = stem + ".ncu-rep", stem + ".csv"
        entry = {"trainer": trainer, "batch": batch, "seq": seq, "report": os.path.basename(stem)}
        stale = os.path.exists(rep) and (
            not os.path.exists(csv_path) or os.path.getmtime(csv_path) < os.path.getmtime(rep)
        )
        if stale:
            ncu = ncu or find_ncu()
            if ncu is None:  # a usage problem, not one bad report: stop
                raise ValueError(f"{rep} must be exported to CSV, but {NCU_MISSING_MESSAGE}")
        try:
            if stale:
                export_report(rep, ncu)
            with open(csv_path, encoding="utf-8") as f:
                entry.update(aggregate(parse_raw_csv(f.read())))
            measured = entry["kernel_count"] or entry["range_count"]
            entry["error"] = None if measured else "no kernels in the report"
        except (OSError, RuntimeError, ValueError) as error:  # this report only
            entry["error"] = f"{type(error).__name__}: {error}"
        entries.append(entry)
    return sorted(entries, key=_order)


def _order(entry: dict) -> tuple:
    return (entry["batch"], entry["seq"], TRAINERS.index(entry["trainer"]))


def _ratio(value, base):
    return None if value is None or not base else value / base


def _step_time_ms(entry: dict) -> float | None:
    """Kernel time (sum of kernel durations) of a kernel replay, range time of a range replay."""
    key = "range_time_ms" if entry.get("replay") == "range" else "kernel_time_ms"
    return entry.get(key)


def summary_rows(entries: list[dict]) -> list[dict]:
    """One flat row per config (the ncu_summary.csv columns), with ratios against standard.

    A ratio needs the standard report at the same shape to use the same replay mode (else None):
    kernel replay sums every kernel's traffic from a flushed L2 and its kernel durations, range
    replay measures the real step with warm caches and its elapsed time, so their DRAM, L2 and
    time figures are not comparable.
    """
    base = {(e["batch"], e["seq"]): e for e in entries if e["trainer"] == "standard"}
    rows = []
    for e in entries:
        b = base.get((e["batch"], e["seq"]), {})
        if not (e.get("replay") and b.get("replay") == e.get("replay")):
            b = {}  # no standard report of the same replay mode at this shape: no ratios
        row = {k: e[k] for k in ("trainer", "batch", "seq", "report")}
        row["replay"] = e.get("replay")
        row["kernels"] = e.get("kernel_count")
        row["kernel_time_ms"] = e.get("kernel_time_ms")
        row["range_time_ms"] = e.get("range_time_ms")
        for key in TOTALS:
            row[key] = e.get(key)
        row["dram_bytes"] = dram_bytes(e)
        row["achieved_dram_gbps"] = e.get("achieved_dram_gbps")
        row["dram_vs_standard"] = _ratio(row["dram_bytes"], dram_bytes(b) if b else None)
        row["l2_vs_standard"] = _ratio(e.get("l2_bytes"), b.get("l2_bytes"))
        row["time_vs_standard"] = _ratio(_step_time_ms(e), _step_time_ms(b) if b else None)
        for category in kernels.CATEGORIES:
            c = (e.get("categories") or {}).get(category, {})
            for key in ("dram_read_bytes", "dram_write_bytes", "l2_bytes", "time_ms", "count"):
                row[f"{category}_{key}"] = c.get(key)
        row["error"] = e.get("error")
        rows.append(row)
    return rows


def _cell(value, scale: float = 1.0, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value / scale:.{digits}f}"
    return str(value)


def _table(header: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body]) + "\n"
    widths = [max(len(h), *(len(cells[i]) for cells in body)) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *body]
    return "".join(
        "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() + "\n" for cells in lines
    )


MAIN_HEADER = [
    "trainer", "batch", "seq", "replay", "kernels", "kernel_ms", "range_ms", "dram_read_GB",
    "dram_write_GB", "l2_GB", "dram_GB/s", "dram_x", "l2_x", "time_x",
]  # fmt: skip
CATEGORIES_NEED_KERNEL_REPLAY = (
    "per-category numbers need per-kernel replay: ./run_profiling_ncu.sh --replay-mode kernel"
)


def format_main_table(rows: list[dict], markdown: bool = False) -> str:
    body = [
        [
            row["trainer"],
            str(row["batch"]),
            str(row["seq"]),
            _cell(row["replay"]),
            _cell(row["kernels"]),  # "-" for a range replay: no per-kernel results
            _cell(row["kernel_time_ms"], digits=1),
            _cell(row["range_time_ms"], digits=1),
            _cell(row["dram_read_bytes"], GB, 3),
            _cell(row["dram_write_bytes"], GB, 3),
            _cell(row["l2_bytes"], GB, 3),
            _cell(row["achieved_dram_gbps"], digits=0),
            _cell(row["dram_vs_standard"]),
            _cell(row["l2_vs_standard"]),
            _cell(row["time_vs_standard"]),
        ]
        for row in rows
    ]
    return _table(MAIN_HEADER, body, markdown)


def format_category_table(rows: list[dict], markdown: bool = False) -> str:
    """DRAM GB (read + write) per category and, in brackets, the extra GB over standard.

    Kernel replay rows only (and unmeasured ones, as "-"): a range replay has no per-kernel
    numbers. With range replays and no kernel replay, one line that says how to get them.
    """
    measured = {r["replay"] for r in rows}
    rows = [r for r in rows if r["replay"] != "range"]
    if "range" in measured and "kernel" not in measured:
        return CATEGORIES_NEED_KERNEL_REPLAY + "\n"
    base = {(r["batch"], r["seq"]): r for r in rows if r["trainer"] == "standard"}

    def gb(row, category):
        read, write = row[f"{category}_dram_read_bytes"], row[f"{category}_dram_write_bytes"]
        return None if read is None or write is None else read + write

    body = []
    for row in rows:
        b = base.get((row["batch"], row["seq"]))
        cells = [row["trainer"], str(row["batch"]), str(row["seq"])]
        for category in (*kernels.CATEGORIES, "total"):
            value = row["dram_bytes"] if category == "total" else gb(row, category)
            if value is None:
                cells.append("-")
                continue
            text = f"{value / GB:.3f}"
            if b is not None and b is not row:
                ref = b["dram_bytes"] if category == "total" else gb(b, category)
                text += f" ({(value - ref) / GB:+.3f})" if ref is not None else ""
            cells.append(text)
        body.append(cells)
    return _table(["trainer", "batch", "seq", *kernels.CATEGORIES, "total"], body, markdown)


def _csv_text(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def plot_comparison(rows: list[dict], path: str) -> str | None:
    """Stacked DRAM GB per step, one bar per trainer, one panel per (batch, seq): stacked by
    kernel category when every bar is a kernel replay, else DRAM read and DRAM write stacked
    (whole-step totals of range replays; a mixed set names each bar's replay mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["dram_bytes"] is not None:
            shapes.setdefault((row["batch"], row["seq"]), []).append(row)
    if not shapes:
        return None
    plotted = [r for group in shapes.values() for r in group]
    by_category = all(r["replay"] == "kernel" for r in plotted)
    modes = {r["replay"] for r in plotted}
    fig, axes = plt.subplots(
        1,
        len(shapes),
        figsize=(max(5.0, 0.6 + 3.4 * len(shapes)), 5.0),
        squeeze=False,
        constrained_layout=True,
    )

    def gb(row, category):
        return (
            (row[f"{category}_dram_read_bytes"] or 0) + (row[f"{category}_dram_write_bytes"] or 0)
        ) / GB

    if by_category:
        colors = dict(zip(kernels.CATEGORIES, plt.get_cmap("tab10").colors))
        shown = [c for c in kernels.CATEGORIES if any(gb(r, c) for r in plotted)]
        segments = [(c, colors[c], lambda r, c=c: gb(r, c)) for c in shown]
        legend_title = "kernel category"
        title = "DRAM traffic of one training step (Nsight Compute)"
    else:
        read, write = plt.get_cmap("tab10").colors[:2]
        segments = [
            ("DRAM read", read, lambda r: r["dram_read_bytes"] / GB),
            ("DRAM write", write, lambda r: r["dram_write_bytes"] / GB),
        ]
        legend_title = "whole step"
        title = "DRAM traffic of one training step (Nsight Compute)\nwhole-step totals, " + (
            "range replay" if modes == {"range"} else "replay mode under each bar"
        )
    for ax, ((batch, seq), group) in zip(axes[0], sorted(shapes.items())):
        x = range(len(group))
        bottom = [0.0] * len(group)
        for label, color, height in segments:
            heights = [height(r) for r in group]
            ax.bar(x, heights, 0.65, bottom=bottom, color=color, label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
        top = max(bottom) or 1.0
        for i, r in enumerate(group):
            label = f"{bottom[i]:.2f}"
            if r["dram_vs_standard"] is not None and r["trainer"] != "standard":
                label += f"\n×{r['dram_vs_standard']:.2f}"
            ax.text(i, bottom[i] + 0.02 * top, label, ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, top * 1.22)
        names = [
            r["trainer"] if len(modes) == 1 else f"{r['trainer']}\n{r['replay']}" for r in group
        ]
        ax.set_xticks(list(x), names)
        ax.set_title(f"batch {batch}, seq {seq}", fontsize=10)
        ax.set_xlabel("trainer")
        if ax is axes[0][0]:
            ax.set_ylabel("DRAM read + write per step (GB = 10⁹ bytes)")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = max(1, min(len(segments), 3 * len(shapes)))
    fig.legend(
        handles, labels, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False,
        title=legend_title, title_fontsize=8,
    )  # fmt: skip
    fig.suptitle(title, fontsize=11)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path


NOTES = """
GB = 10^9 bytes. One training step per report (warm-up steps excluded). replay `kernel`
(`--replay-mode kernel`): every kernel replayed by ncu with its caches flushed first, so each
kernel's DRAM bytes are a cold-L2 figure, and kernel_ms is the sum of kernel durations
(serialised; not the step's wall time). replay `range` (`--replay-mode app-range` or `range`): one
result for the whole step with warm caches between kernels (re-reads that hit L2 are not DRAM
traffic; dirty lines written back during the step count as writes), and range_ms is the step's
elapsed GPU time, idle gaps included. Ratios (`_x`, time_x on kernel_ms or range_ms) are against
`standard` at the same batch and sequence length and the same replay mode only, since the two
modes count DRAM differently; `-` means not measured or not comparable.
"""


def write_ncu_summary(input_dir: str) -> str:
    """Write ncu_summary.csv, ncu_summary.md and ncu_comparison.png into input_dir from its
    report_*.ncu-rep / report_*.csv files; return the text tables.

    Raises ValueError (a usage problem: one line) when the directory is missing, holds no
    reports, or a report needs exporting and ncu is not installed.
    """
    entries = load_reports(input_dir)
    rows = summary_rows(entries)
    errors = "".join(f"- {r['report']}: {r['error']}\n" for r in rows if r["error"])
    text = format_main_table(rows)
    text += "\nDRAM GB per kernel category (extra over standard):\n"
    text += format_category_table(rows)
    markdown = "# Nsight Compute: memory traffic of one training step\n\n"
    markdown += format_main_table(rows, markdown=True)
    markdown += "\n## DRAM GB per kernel category (extra over standard)\n\n"
    markdown += format_category_table(rows, markdown=True) + NOTES
    if errors:
        markdown += "\nNot measured:\n" + errors
        text += "\nNot measured:\n" + errors
    _write_atomic(os.path.join(input_dir, "ncu_summary.csv"), _csv_text(rows))
    _write_atomic(os.path.join(input_dir, "ncu_summary.md"), markdown)
    plot = plot_comparison(rows, os.path.join(input_dir, "ncu_comparison.png"))
    text += f"\nWritten: {os.path.join(input_dir, 'ncu_summary.csv')}, ncu_summary.md"
    text += ", ncu_comparison.png\n" if plot else " (no DRAM data to plot)\n"
    return text


# ---------------------------------------------------------------- CLI for run_profiling_ncu.sh


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="ncu helpers for run_profiling_ncu.sh")
    sub = parser.add_subparsers(dest="what", required=True)
    cmd = sub.add_parser("command", help="print the ncu command line of one config")
    cmd.add_argument("--trainer", required=True)
    cmd.add_argument("--batch_size", type=int, required=True)
    cmd.add_argument("--seq_len", type=int, required=True)
    cmd.add_argument("--report_dir", default="ncu_reports")
    cmd.add_argument("--metrics", default=",".join(METRICS))
    cmd.add_argument("--clock_control", "--clock-control", default="none")
    cmd.add_argument("--nvtx", action="store_true")
    cmd.add_argument(
        "--replay_mode", "--replay-mode", default="kernel", help=" | ".join(REPLAY_MODES)
    )
    cmd.add_argument("--ncu", default="ncu")
    cmd.add_argument("--python", default=None)
    cmd.add_argument("extra", nargs="*", help="after --: more profiling_script.py arguments")
    met = sub.add_parser("metrics", help="check/translate a comma-separated metric list")
    met.add_argument("names")
    args = parser.parse_args(argv)
    try:
        if args.what == "metrics":
            print(",".join(translate_metrics(args.names)))
            return 0
        name = report_name(args.trainer, args.batch_size, args.seq_len)
        argv_out = ncu_command(
            os.path.join(args.report_dir, name),
            profile_args(args.trainer, args.batch_size, args.seq_len, args.extra),
            metrics=args.metrics,
            clock_control=args.clock_control,
            nvtx=args.nvtx,
            replay_mode=args.replay_mode,
            ncu=args.ncu,
            python=args.python,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(shlex.join(argv_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
